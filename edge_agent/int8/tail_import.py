"""A bundle's trainable fp32 tail (the head at depth 0, every deeper tail) as an MXNet
symbol + parameters, through the project's own ONNX importer (issue 41).

The tail used to come from mxnet.contrib.onnx, which does not know what newer exporters
write (opset 18's ReduceMean axes input, BatchNorm's training_mode...), so a torch dynamo
export got no training depth at all. Now the part of the model from the cut tensor to the
output is imported like the prefix (onnx_import.py -> FloatGraph), so any network whose
prefix imports gets its tails too, and mxnet_graph.py's per-op mapping builds the symbol.

Parameters are the ONNX initialisers themselves, by name and in ONNX layout (OIHW convs,
[out, in] dense weights), not the float graph's folded copies: the coordinator writes a
trained tail back into backbone.onnx by initialiser name to re-quantise the shallower
prefixes (requantize.py), every tail of a bundle then shares its parameters where tails
overlap, and training keeps its BatchNorm semantics. So a linear op of the float graph is
traced back to its ONNX node (its name) and the nodes fused into it (BatchNorm, Relu, Clip,
HardSigmoid, a bias Add, scalar Mul/Div...: the chain of single consumers up to the float
op's output), and that chain is replayed in MXNet on the initialisers. BatchNorm thus stays
a real BatchNorm (gamma/beta trained, running mean/var as aux states) rather than the float
graph's fold: `TrainConfig.bn` ("update" / "frozen"), `tail="bias"` (BN scale/shift) and
numpy_tail.py's BatchNorm all rely on it. An op whose weights cannot be traced (a fold this
module does not replay) gets float-graph weights named `<node>.<weight|bias|const>`;
`TailImport.unmapped` lists them, and a deeper tail holding such a parameter inside an int8
prefix is refused (bundle_create.py), because nothing could re-quantise that prefix.

Ops are emitted in the forms numpy_tail.py trains without MXNet where one exists (global
average pool as Pooling, flatten as Flatten, a dense layer as FullyConnected: head_form.py's
fast path). Every tail is checked against `run_float` of its float graph before use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .float_graph import FloatGraph, FloatOp, run_float
from .graph import UnsupportedOpError
from .mxnet_graph import MxnetGraphError, _Builder

LINEAR = ("CONV_2D", "DEPTHWISE_CONV_2D", "FULLY_CONNECTED")
_PASS = ("Identity", "Dropout")
_MAX_CHAIN = 8


@dataclass
class TailImport:
    """A tail as MXNet symbol + params (NDArrays by ONNX name; aux: BatchNorm statistics)."""

    symbol: Any
    args: dict[str, Any]
    aux: dict[str, Any]
    unmapped: dict[str, str] = field(default_factory=dict)  # parameter -> "node (op kind)" it belongs to


def tail_model(extractor: Any, model: Any, tensor: str) -> Any:
    """The ONNX model of `tensor` -> the outputs. A 2-D cut (N, C) becomes a (N, C, 1, 1)
    input flattened first (the importer takes NCHW maps; MXNet's Flatten of the (N, C)
    features a device feeds is the identity). A Softmax or LogSoftmax that produces the
    model's output is left out: the tail gives logits, as every head the trainer makes does.
    Its large initialisers have no data: the extractor's `wmap` (the model's own) has it."""
    from onnx import helper

    tail = extractor.extract_skeleton([tensor], [o.name for o in model.graph.output])  # data: extractor.wmap
    out = tail.graph.output
    last = next((n for n in tail.graph.node if len(out) == 1 and out[0].name in n.output), None)
    if last is not None and last.op_type in ("Softmax", "LogSoftmax"):
        # a trailing softmax only squashes the logits: training wants them, top-k is the same
        out[0].name = last.input[0]
        tail.graph.node.remove(last)
    inits = {i.name for i in tail.graph.initializer}
    inp = next(i for i in tail.graph.input if i.name not in inits)
    dims = inp.type.tensor_type.shape.dim
    if len(dims) == 2:
        flat = f"{tensor}__features"
        for node in tail.graph.node:
            for k, name in enumerate(node.input):
                if name == tensor:
                    node.input[k] = flat
        dims.add().dim_value = 1
        dims.add().dim_value = 1
        tail.graph.node.insert(0, helper.make_node("Flatten", [tensor], [flat], name=flat, axis=1))
    return tail


def import_tail(extractor: Any, model: Any, tensor: str, mx: Any, shared: dict[str, Any] | None = None) -> TailImport:
    """The tail after `tensor` (see the module doc). UnsupportedOpError / OnnxImportError
    name the node an op fails on; MxnetGraphError when the symbol is not the float graph.
    `shared`: NDArrays by initialiser name (a deeper tail's, of the same model) used instead
    of new copies of the same weights."""
    from ..heap import release_freed_memory
    from .onnx_import import import_onnx

    tail = tail_model(extractor, model, tensor)
    graph = import_onnx(tail, name="tail", weights=extractor.wmap)
    builder = _TailBuilder(graph, tail, mx, extractor.wmap, shared or {})
    result = TailImport(builder.build(), builder.params, builder.aux, builder.unmapped)
    x = np.abs(np.random.default_rng(0).normal(0.0, 1.0, (2, *graph.input_shape[1:]))).astype(np.float32)
    want = run_float(graph, x)
    # the float graph's weights go before MXNet runs the tail: oneDNN keeps a reordered copy of
    # every conv weight it runs at inference (resnet50's deepest tail: ~60 MB each)
    del builder, graph
    release_freed_memory()  # and given back: oneDNN's buffers are not taken from malloc's free lists
    _check(result, tensor, mx, x, want)
    return result


def _check(tail: TailImport, tensor: str, mx: Any, x: np.ndarray, want: np.ndarray) -> None:
    """The symbol computes on `x` what run_float computed on the tail's float graph: `want`."""
    args = {tensor: mx.nd.array(x), **tail.args}
    try:
        exe = tail.symbol.bind(mx.cpu(), args=args, aux_states=dict(tail.aux), grad_req="null")
        got = exe.forward(is_train=False)[0].asnumpy().reshape(want.shape)
    except Exception as exc:  # MXNetError: shapes the mapping got wrong
        raise MxnetGraphError(f"the tail's MXNet symbol does not run: {str(exc).strip().splitlines()[0][:200]}") \
            from None
    scale = float(np.abs(want).max()) or 1.0
    err = float(np.abs(got - want).max())
    if not err <= 1e-3 * scale:
        raise MxnetGraphError(f"the tail's MXNet symbol differs from the float graph by {err:.3g} "
                              f"(outputs up to {scale:.3g})")


class _TailBuilder(_Builder):
    def __init__(self, graph: FloatGraph, model: Any, mx: Any, weights: dict[str, Any], shared: dict[str, Any]) -> None:
        super().__init__(graph, mx)
        self.shared = shared
        from .onnx_import import node_name

        g = model.graph
        self.inits = {i.name: weights.get(i.name, i) for i in g.initializer}  # with their data
        self.nodes = {node_name(n): n for n in g.node}
        self.producer = {o: n for n in g.node for o in n.output}
        self.consumers: dict[str, list[Any]] = {}
        for n in g.node:
            for i in n.input:
                self.consumers.setdefault(i, []).append(n)
        self.outputs = {o.name for o in g.output}
        self.vars: dict[str, Any] = {}
        self.aux: dict[str, Any] = {}
        self.unmapped: dict[str, str] = {}
        self.current: FloatOp | None = None

    def build(self) -> Any:
        for index, op in enumerate(self.g.ops):
            self.current = op
            try:
                y = self._traced(op) if op.kind in LINEAR else None
                if y is None:
                    y = self.activation(self.op(index, self._fallback_op(op)), op.options)
            except (MxnetGraphError, UnsupportedOpError):
                raise
            except Exception as exc:  # an MXNet attribute error for odd options: name the op
                raise MxnetGraphError(f"op {op.name!r} ({op.kind}): {type(exc).__name__}: {exc}") from None
            self.t[op.output] = y
        return self.t[self.g.output]

    # -- parameters
    def value(self, name: str) -> np.ndarray:
        from onnx import numpy_helper

        return numpy_helper.to_array(self.inits[name])

    def var(self, name: str, aux: bool = False) -> Any:
        """The initialiser `name` as a parameter (one variable however often it is used)."""
        if name not in self.vars:
            value = self.shared.get(name)
            if value is None:
                value = self.mx.nd.array(np.ascontiguousarray(self.value(name), np.float32))
            (self.aux if aux else self.params)[name] = value
            self.vars[name] = self.sym.var(name, shape=value.shape)
        return self.vars[name]

    def const(self, name: str, value: np.ndarray) -> Any:
        """A float-graph weight no initialiser gives: named after its op, listed as unmapped."""
        op = self.current
        stem = f"{op.name}.{name.split('_', 1)[1]}" if op is not None and "_" in name else name
        while stem in self.inits or stem in self.vars:
            stem += "_"
        self.unmapped[stem] = f"{op.name} ({op.kind})" if op is not None else stem
        self.params[stem] = self.mx.nd.array(np.ascontiguousarray(value, np.float32))
        self.vars[stem] = self.sym.var(stem, shape=value.shape)
        return self.vars[stem]

    def _param(self, tensor: str) -> tuple[str, bool] | None:
        """(initialiser, transposed) behind a weight input: the initialiser itself, or through
        Identity (the legacy exporter's shared weights) and 2-D Transpose (dynamo's Linear)."""
        from onnx import helper

        transposed = False
        for _ in range(_MAX_CHAIN):
            if tensor in self.inits:
                return tensor, transposed
            n = self.producer.get(tensor)
            if n is None or not n.input:
                return None
            if n.op_type == "Transpose":
                perm = [helper.get_attribute_value(a) for a in n.attribute if a.name == "perm"]
                if perm and list(perm[0]) != [1, 0]:
                    return None
                transposed = not transposed
            elif n.op_type != "Identity":
                return None
            tensor = n.input[0]
        return None

    def _scalar(self, tensor: str) -> float | None:
        """A one-element constant input's value (initialiser or Constant node)."""
        from onnx import helper, numpy_helper

        if tensor in self.inits:
            v = self.value(tensor)
        else:
            n = self.producer.get(tensor)
            if n is None or n.op_type != "Constant":
                return None
            attr = {a.name: a for a in n.attribute}
            if "value" not in attr:
                return None
            v = numpy_helper.to_array(helper.get_attribute_value(attr["value"]))
        return float(v.reshape(-1)[0]) if v.size == 1 else None

    # -- tracing a linear float op back to its ONNX nodes
    def _chain(self, start: Any, target: str) -> list[Any] | None:
        """The nodes fused into `start`'s float op: single consumers up to `target`."""
        chain, cur = [], start.output[0]
        while cur != target:
            users = self.consumers.get(cur, [])
            if len(users) != 1 or cur in self.outputs or len(chain) >= _MAX_CHAIN:
                return None
            chain.append(users[0])
            cur = users[0].output[0]
        return chain

    def _traced(self, op: FloatOp) -> Any:
        """The op and what was fused into it, replayed on the initialisers; None if it
        cannot be traced (then the float graph's own weights stand in)."""
        node = self.nodes.get(op.name)
        if node is None:
            return None
        x = self.t[op.inputs[0]]
        if node.op_type == "BatchNormalization" and op.kind == "DEPTHWISE_CONV_2D":  # standalone BN
            chain = [] if op.output == f"{op.name}_map" else self._chain(node, op.output)
            if chain is None or not self._replayable(node) or not all(self._replayable(n) for n in chain):
                return None
            y = self._replay(node, x)
        elif node.op_type == "Conv" and op.kind != "FULLY_CONNECTED":
            chain = self._chain(node, op.output)
            if chain is None or not all(self._replayable(n) for n in chain):
                return None
            y = self._conv(op, node, x)
        elif node.op_type in ("Gemm", "MatMul") and op.kind == "FULLY_CONNECTED":
            chain = self._chain(node, op.output)
            if chain is None or not all(self._replayable(n) for n in chain):
                return None
            y, chain = self._dense(node, x, chain)
        else:
            return None
        if y is None:
            return None
        for n in chain:
            y = self._replay(n, y)
        return y

    def _conv(self, op: FloatOp, node: Any, x: Any) -> Any:
        w = self._param(node.input[1])
        b = self._param(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        if w is None or w[1] or (len(node.input) > 2 and node.input[2] and (b is None or b[1])):
            return None
        weight = self.value(w[0])
        if weight.ndim != 4:
            return None
        o = op.options
        k, s, d = tuple(weight.shape[2:]), (o["stride_h"], o["stride_w"]), (o["dilation_h"], o["dilation_w"])
        groups = self.g.shapes[op.inputs[0]][3] // weight.shape[1]
        x, pad = self._padded(x, self._pads(op.inputs[0], k, s, d, o["padding"]))
        extra = {"bias": self.var(b[0])} if b is not None else {"no_bias": True}
        return self.sym.Convolution(x, weight=self.var(w[0]), kernel=k, stride=s, dilate=d, pad=pad,
                                    num_filter=weight.shape[0], num_group=groups, name=op.name, **extra)

    def _dense(self, node: Any, x: Any, chain: list[Any]) -> tuple[Any, list[Any]]:
        """Gemm / MatMul (+ the Add of a bias vector after it) as FullyConnected where the
        weight is [out, in] (head_form's dense form), else _linalg_gemm2."""
        from onnx import helper

        a = {t.name: helper.get_attribute_value(t) for t in node.attribute}
        w = self._param(node.input[1])
        if w is None or a.get("transA", 0):
            return None, chain
        direct = bool(a.get("transB", 0)) != w[1]  # the initialiser is [out, in]
        units = self.value(w[0]).shape[0 if direct else 1]
        alpha, beta = float(a.get("alpha", 1.0)), float(a.get("beta", 1.0))
        bias = None
        if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2]:
            bias = self._param(node.input[2])
            if bias is None or bias[1]:
                return None, chain
            bias = bias[0]
        elif chain and chain[0].op_type == "Add":  # dynamo's Linear: MatMul then Add(bias)
            other = [i for i in chain[0].input if i != node.output[0]]
            if len(other) == 1 and other[0] in self.inits and self.value(other[0]).shape == (units,):
                bias, chain = other[0], chain[1:]
        x = self.sym.Flatten(x)
        if bias is not None and direct and alpha == 1.0 and beta == 1.0 and self.value(bias).shape == (units,):
            return self.sym.FullyConnected(x, weight=self.var(w[0]), bias=self.var(bias), num_hidden=units,
                                           flatten=True, name=node.name or None), chain
        y = self.sym.linalg.gemm2(x, self.var(w[0]), transpose_b=direct, alpha=alpha)
        if bias is not None:
            b = self.var(bias)
            y = self.sym.broadcast_add(y, b if beta == 1.0 else b * beta)
        return y, chain

    def _replayable(self, n: Any) -> bool:
        if n.op_type in (*_PASS, "Relu", "HardSigmoid", "Clip"):
            return all(not i or self._scalar(i) is not None for i in n.input[1:])
        if n.op_type == "BatchNormalization":
            return all(self._param(i) == (i, False) for i in n.input[1:5]) and \
                not any(o for o in n.output[1:] if self.consumers.get(o))
        if n.op_type in ("Add", "Sub", "Mul", "Div"):
            consts = [i for i in n.input if i in self.inits or self._scalar(i) is not None]
            return len(consts) == 1 and (self._scalar(consts[0]) is not None or
                                         (n.op_type in ("Add", "Mul") and consts[0] in self.inits))
        return False

    def _replay(self, n: Any, y: Any) -> Any:
        from onnx import helper

        sym, t = self.sym, n.op_type
        a = {x.name: helper.get_attribute_value(x) for x in n.attribute}
        if t in _PASS:
            return y
        if t == "Relu":
            return sym.relu(y)
        if t == "Clip":
            lo = self._scalar(n.input[1]) if len(n.input) > 1 and n.input[1] else a.get("min")
            hi = self._scalar(n.input[2]) if len(n.input) > 2 and n.input[2] else a.get("max")
            if lo is not None and lo == 0.0 and (hi is None or np.isinf(hi)):
                return sym.relu(y)
            return sym.clip(y, -3.4e38 if lo is None else float(lo), 3.4e38 if hi is None else float(hi))
        if t == "HardSigmoid":
            return sym.clip(y * float(a.get("alpha", 0.2)) + float(a.get("beta", 0.5)), 0.0, 1.0)
        if t == "BatchNormalization":
            gamma, beta, mean, var = n.input[1:5]
            return sym.BatchNorm(y, gamma=self.var(gamma), beta=self.var(beta), moving_mean=self.var(mean, aux=True),
                                 moving_var=self.var(var, aux=True), eps=float(a.get("epsilon", 1e-5)),
                                 momentum=float(a.get("momentum", 0.9)), fix_gamma=False, name=n.name or None)
        const = next(i for i in n.input if i in self.inits or self._scalar(i) is not None)
        first = n.input[0] == const
        s = self._scalar(const)
        if s is not None:
            if t == "Add":
                return y + s
            if t == "Mul":
                return y * s
            if t == "Sub":
                return s - y if first else y - s
            return s / y if first else y / s
        c = self.var(const)
        shape = self.value(const).shape
        rank = len(self.g.shapes[self.current.output])  # the activation's rank (NCHW in MXNet)
        if len(shape) < rank:
            c = sym.reshape(c, shape=(1,) * (rank - len(shape)) + tuple(shape))
        return sym.broadcast_add(y, c) if t == "Add" else sym.broadcast_mul(y, c)

    # -- the float graph's own mapping, in numpy_tail's forms where one exists
    def _fallback_op(self, op: FloatOp) -> FloatOp:
        """A fully connected op after a flattened HxW>1 map has its columns in NHWC order
        (onnx_import permutes them); this builder flattens NCHW (Flatten), so undo that."""
        if op.kind != "FULLY_CONNECTED":
            return op
        src = next((p for p in self.g.ops if p.output == op.inputs[0]), None)
        if src is None or src.kind != "RESHAPE" or len(self.g.shapes[src.inputs[0]]) != 4:
            return op
        _, h, w, c = self.g.shapes[src.inputs[0]]
        weight = op.weight.reshape(-1, h, w, c).transpose(0, 3, 1, 2).reshape(op.weight.shape[0], -1)
        return FloatOp(op.kind, op.name, op.inputs, op.output, op.options, weight, op.bias, op.norm)

    def op(self, i: int, op: FloatOp) -> Any:
        sym, o, kind = self.sym, op.options, op.kind
        x = self.t[op.inputs[0]]
        if kind == "MEAN":  # over H and W (the importer's only mean): a global average pool
            y = sym.Pooling(x, kernel=(1, 1), global_pool=True, pool_type="avg")
            return y if o["keep_dims"] else sym.Flatten(y)
        if kind == "RESHAPE" and self.rank4(op.inputs[0]) and not self.rank4(op.output):
            return sym.Flatten(x)  # NCHW order: _fallback_op / the ONNX weights expect it
        if kind == "FULLY_CONNECTED":
            return sym.FullyConnected(sym.Flatten(x), weight=self.const(f"op{i}_weight", op.weight),
                                      bias=self.const(f"op{i}_bias", op.bias), num_hidden=op.weight.shape[0],
                                      flatten=True)
        if kind in ("MAX_POOL_2D", "AVERAGE_POOL_2D") and o["padding"] == "VALID":
            return sym.Pooling(x, kernel=(o["filter_h"], o["filter_w"]), stride=(o["stride_h"], o["stride_w"]),
                               pool_type="max" if kind == "MAX_POOL_2D" else "avg", pooling_convention="valid")
        if kind == "GATHER":
            return self._gather(op, x)
        return super().op(i, op)

    def _gather(self, op: FloatOp, x: Any) -> Any:
        """Channel parts (Split) and channel shuffles without an index variable (which an
        optimiser would train)."""
        idx = np.asarray(op.options["indices"]).reshape(-1)
        if not self.rank4(op.inputs[0]) or op.options["axis"] % 4 != 3:
            raise UnsupportedOpError(op.name, "GATHER", "only a gather of channels in a tail")
        c = self.g.shapes[op.inputs[0]][3]
        if len(idx) and np.array_equal(idx, np.arange(idx[0], idx[0] + len(idx))):
            return self.sym.slice_axis(x, axis=1, begin=int(idx[0]), end=int(idx[0]) + len(idx))
        for g in range(2, c):
            if c % g == 0 and len(idx) == c and np.array_equal(idx, np.arange(c).reshape(g, c // g).T.reshape(-1)):
                y = self.sym.reshape(x, shape=(0, -4, g, c // g, -2))  # (N, g, C/g, H, W)
                return self.sym.reshape(self.sym.transpose(y, axes=(0, 2, 1, 3, 4)), shape=(0, -3, -2))
        raise UnsupportedOpError(op.name, "GATHER", "a channel gather that is neither a slice nor a shuffle")
