"""ONNX -> the project's float graph (NHWC, TFLite op vocabulary), cut at a split node.

The float graph is the input of post-training quantisation (quantize.py): it already has
the QGraph's shape (same op kinds and option keys as graph.OP_OPTIONS, NHWC, weights in
TFLite layout), with float32 weights. Fusions done here, once, so every later stage sees
the same graph:
- BatchNormalization folded into the preceding conv / depthwise conv / fully connected;
- Relu and Clip(0, 6) fused as the preceding op's activation (RELU / RELU6);
- Identity and Dropout removed; a constant Add after a conv or MatMul folded into its bias;
- explicit conv pads that TFLite's SAME/VALID cannot express become a PAD op.
The structural ops of real models (explicit-pad pools, standalone BatchNorm, Gemm/MatMul,
Identity, Reshape/Flatten/Transpose, channel shuffle, Split, channel Slice) are onnx_struct.py's mixin;
the elementwise ones (HardSwish and its decompositions, HardSigmoid, Sigmoid, Mul/Div,
broadcasting Add) are onnx_elementwise.py's.

Before any of that, Shape subgraphs that are constant at the fixed input size are folded
into Constant nodes (onnx_fold.py), so ShuffleNet v2's Shape -> Gather -> ... -> Slice /
Reshape reach these handlers with constant arguments. Every refusal names the node and its
op (UnsupportedOpError, or "node 'N' (op O): ..." for a malformed node).

The float graph itself and `run_float`, which executes it in numpy, live in float_graph.py;
reading untrusted ONNX (size limit, parse, checker, IR and opset) in onnx_load.py.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import InputError
from .float_graph import FloatGraph, FloatOp
from .float_ops import out_size, same_pads
from .graph import UnsupportedOpError
from .onnx_elementwise import ElementwiseOps, fuse_hard_swish
from .onnx_fold import fold_shapes
from .onnx_load import MAX_ONNX_BYTES, OnnxImportError, load_onnx
from .onnx_struct import StructOps

if TYPE_CHECKING:  # pragma: no cover - typing only
    import onnx

FUSABLE = ("CONV_2D", "DEPTHWISE_CONV_2D", "FULLY_CONNECTED", "ADD", "AVERAGE_POOL_2D",
           "MAX_POOL_2D", "CONCATENATION")
_NCHW_TO_NHWC_AXIS = {0: 0, 1: 3, 2: 1, 3: 2}


def node_name(node: onnx.NodeProto) -> str:
    """A node's name; MXNet leaves some empty, so fall back to its first output."""
    return node.name or (node.output[0] if node.output else node.op_type)


def node_names(model: onnx.ModelProto) -> list[str]:
    """Every name accepted as a split node, in graph order."""
    return [node_name(n) for n in model.graph.node]


def supported_ops() -> list[str]:
    """The ONNX op types the importer has a handler for."""
    return sorted({"Constant"} | {m[4:] for m in dir(_Converter) if m.startswith("_op_")})


def split_hint(model: onnx.ModelProto) -> str:
    """A few useful split points for an error message (not every node name)."""
    from .cut_points import candidate_cuts, describe

    try:
        cuts = candidate_cuts(model)
    except Exception:  # the hint must never hide the error it decorates
        cuts = []
    return (f"block boundaries near the head: {describe(cuts)} "
            "(all of them: edge-coordinator model nodes FILE)")


# ------------------------------------------------------------------------- conversion
def import_onnx(
    source: bytes | str | os.PathLike[str] | onnx.ModelProto,
    *,
    split: str | None = None,
    max_bytes: int = MAX_ONNX_BYTES,
    name: str = "backbone",
    weights: Mapping[str, Any] | None = None,
) -> FloatGraph:
    """ONNX model -> FloatGraph of everything up to and including `split`'s output.

    `split` names a node (or the tensor it produces); None keeps the whole graph.
    `weights`: initialiser protos by name that stand for the model's own (a sub-model
    extracted without its weights' data, onnx_lean.LeanExtractor.extract_skeleton).
    """
    import onnx

    model = fold_shapes(source) if isinstance(source, onnx.ModelProto) else load_onnx(source, max_bytes=max_bytes)
    return _Converter(model, name, weights).convert(split)


class _Initialisers(dict):  # type: ignore[type-arg]
    """Initialisers as arrays, converted when read and not kept: a cut converts only what its
    nodes use (resnet50's depth prefixes would each convert the tail's ~60 MB too), and a
    weight an op transforms (BatchNorm folded into its conv) is not held in both forms until
    the import ends. Constants the import makes are set, and kept, as in any dict."""

    def __init__(self, protos: Mapping[str, Any]) -> None:
        super().__init__()
        self._protos = protos

    def __missing__(self, name: str) -> np.ndarray:
        from onnx import numpy_helper

        proto = self._protos.get(name)
        if proto is None:
            raise KeyError(name)
        try:
            value = numpy_helper.to_array(proto)
        except Exception as exc:  # data length vs dims mismatch in a corrupt file
            raise OnnxImportError(f"initializer {name!r}: unreadable ({exc})") from None
        return value

    def __contains__(self, name: object) -> bool:
        return dict.__contains__(self, name) or name in self._protos

    def get(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
        return self[name] if name in self else default  # noqa: SIM401 (dict.get would not convert)


class _Converter(StructOps, ElementwiseOps):
    def __init__(self, model: onnx.ModelProto, name: str, weights: Mapping[str, Any] | None = None) -> None:
        self.model, self.name = model, name
        g = model.graph
        protos = {i.name: i for i in g.initializer}
        if weights is not None:
            protos |= {n: weights[n] for n in protos if n in weights}
        self.consts: dict[str, np.ndarray] = _Initialisers(protos)
        inputs = [i for i in g.input if i.name not in self.consts]
        if len(inputs) != 1:
            raise OnnxImportError(f"model must have exactly one data input, found {[i.name for i in inputs]}")
        dims = inputs[0].type.tensor_type.shape.dim
        dynamic = [d.dim_param or "?" for d in list(dims)[1:] if not d.HasField("dim_value")]
        if dynamic:  # only the batch may be dynamic: a made-up H or W would import a different net
            raise OnnxImportError(f"input {inputs[0].name!r}: dimensions {', '.join(dynamic)} are dynamic; "
                                  "export the model with a fixed C, H and W")
        shape = tuple(d.dim_value if d.HasField("dim_value") else 1 for d in dims)
        if len(shape) != 4 or min(shape[1:], default=0) <= 0:
            raise OnnxImportError(f"input {inputs[0].name!r}: need a fixed NCHW shape, got {shape}")
        self.input, self.input_shape = inputs[0].name, shape
        self.shapes: dict[str, tuple[int, ...]] = {self.input: (shape[0], shape[2], shape[3], shape[1])}
        self.alias: dict[str, str] = {}
        self.ops: list[FloatOp] = []
        self.producer: dict[str, FloatOp] = {}
        self.uses: dict[str, int] = {}
        self.flat_nchw: dict[str, tuple[int, int, int]] = {}  # NHWC-flattened spatial maps
        self.pending: dict[str, dict[str, Any]] = {}  # channel-shuffle views (onnx_struct)

    # -- cutting
    def _select(self, split: str | None) -> tuple[list[onnx.NodeProto], str]:
        nodes = list(self.model.graph.node)
        if split is None:
            outs = [o.name for o in self.model.graph.output]
            if len(outs) != 1:
                raise OnnxImportError(f"model has {len(outs)} outputs; name a split node")
            target = outs[0]
        else:
            by_name = {node_name(n): n for n in nodes}
            produced = {o for n in nodes for o in n.output}
            if split in by_name:
                target = by_name[split].output[0]
            elif split in produced:
                target = split
            else:
                raise OnnxImportError(f"unknown split node {split!r}; {split_hint(self.model)}")
        producer = {o: n for n in nodes for o in n.output}
        keep: set[int] = set()
        stack = [target]
        while stack:
            t = stack.pop()
            n = producer.get(t)
            if n is None or id(n) in keep:
                continue
            keep.add(id(n))
            stack.extend(i for i in n.input if i)
        selected = [n for n in nodes if id(n) in keep]
        for n in selected:
            for i in n.input:
                if i:
                    self.uses[i] = self.uses.get(i, 0) + 1
        self.uses[target] = self.uses.get(target, 0) + 1  # the graph output is a use
        return selected, target

    def convert(self, split: str | None) -> FloatGraph:
        nodes, target = self._select(split)
        nodes = fuse_hard_swish(nodes, self.consts, self.uses)
        for node in nodes:
            if node.op_type == "Constant":
                self._constant(node)
                continue
            handler = getattr(self, f"_op_{node.op_type}", None)
            if handler is None or node.domain not in ("", "ai.onnx"):
                raise UnsupportedOpError(node_name(node), f"{node.domain + '.' if node.domain else ''}{node.op_type}",
                                         f"supported ops: {', '.join(supported_ops())}")
            try:
                handler(node)
            except OnnxImportError as exc:  # every refusal names the node and its op
                raise OnnxImportError(_naming(str(exc), node_name(node), node.op_type)) from None
            except (UnsupportedOpError, InputError):
                raise
            except Exception as exc:  # a malformed node (missing input/attribute, odd shape): no traceback
                raise UnsupportedOpError(node_name(node), node.op_type,
                                         f"malformed node ({type(exc).__name__}: {str(exc)[:160]})") from None
        out = self._act(target, "graph output")
        if out == self.input:
            raise OnnxImportError(f"split {split!r} leaves no operations in the backbone")
        if out in self.flat_nchw:
            raise UnsupportedOpError(self.producer[out].name, "Flatten",
                                     "flattening an HxW>1 map as the output changes element order")
        for op in self.ops:
            for what, arr in (("weights", op.weight), ("bias", op.bias)):
                if arr is not None and not np.all(np.isfinite(arr)):
                    raise OnnxImportError(f"node {op.name!r}: {what} contain NaN/Inf (corrupt model?)")
        return FloatGraph(self.input, self.input_shape, self.ops, out, dict(self.shapes), self.name)

    # -- helpers
    def _act(self, tensor: str, what: str) -> str:
        t = self.alias.get(tensor, tensor)
        if t in self.pending:  # a 5-D channel split used other than by the shuffle's Transpose
            raise OnnxImportError(f"{what}: tensor {tensor!r} is a 5-D channel split; supported only as "
                                  "ShuffleNet's channel shuffle (Reshape -> Transpose(0,2,1,3,4) -> Reshape)")
        if t not in self.shapes:
            raise OnnxImportError(f"{what}: tensor {tensor!r} is not an activation computed here")
        return t

    def _const(self, node: onnx.NodeProto, index: int) -> np.ndarray | None:
        if index >= len(node.input) or not node.input[index]:
            return None
        name = node.input[index]
        if name not in self.consts:
            raise UnsupportedOpError(node_name(node), node.op_type, f"input {name!r} must be a constant")
        return self.consts[name]

    def _constant(self, node: onnx.NodeProto) -> None:
        from onnx import helper, numpy_helper

        attr = {a.name: a for a in node.attribute}
        if "value" not in attr:
            raise UnsupportedOpError(node_name(node), "Constant", "only the 'value' attribute")
        try:
            self.consts[node.output[0]] = numpy_helper.to_array(helper.get_attribute_value(attr["value"]))
        except Exception as exc:  # corrupt tensor data
            raise OnnxImportError(f"node {node_name(node)!r}: unreadable constant ({exc})") from None

    def _emit(self, node: onnx.NodeProto, op: FloatOp, shape: tuple[int, ...]) -> None:
        for i in op.inputs:
            if i in self.flat_nchw and op.kind != "FULLY_CONNECTED":
                raise UnsupportedOpError(op.name, node.op_type,
                                         "input is a flattened HxW>1 map (NHWC order differs)")
        self.ops.append(op)
        self.shapes[op.output] = shape
        self.producer[op.output] = op

    def _fusable(self, src: str, node: onnx.NodeProto, kinds: tuple[str, ...]) -> FloatOp:
        """The op producing `src`, if `node` may be fused into it."""
        t = self._act(src, f"node {node_name(node)!r}")
        op = self.producer.get(t)
        # every name of the tensor counts (Identity aliases): fusing changes its value
        uses = self.uses.get(t, 0) + sum(self.uses.get(a, 0) for a, c in self.alias.items() if c == t)
        if op is None or op.kind not in kinds or uses != 1:
            why = "its input is not produced by a fusable op used only here"
            raise UnsupportedOpError(node_name(node), node.op_type, why)
        return op

    def _rename(self, op: FloatOp, new: str) -> None:
        old = op.output
        op.output = new
        self.shapes[new] = self.shapes.pop(old)
        self.producer[new] = self.producer.pop(old)
        if old in self.flat_nchw:
            self.flat_nchw[new] = self.flat_nchw.pop(old)

    # -- elementwise fusions
    def _fuse_activation(self, node: onnx.NodeProto, act: str) -> None:
        op = self._fusable(node.input[0], node, FUSABLE)
        if op.options.get("activation", "NONE") not in ("NONE", act):
            raise UnsupportedOpError(node_name(node), node.op_type, "a second activation")
        op.options["activation"] = act
        self._rename(op, node.output[0])

    def _op_Relu(self, node: onnx.NodeProto) -> None:  # noqa: N802 - ONNX op names
        self._fuse_activation(node, "RELU")

    def _op_Clip(self, node: onnx.NodeProto) -> None:  # noqa: N802
        attrs = _attrs(node)
        lo = self._const(node, 1) if len(node.input) > 1 else attrs.get("min")
        hi = self._const(node, 2) if len(node.input) > 2 else attrs.get("max")
        lo = None if lo is None else float(np.asarray(lo).reshape(-1)[0])
        hi = None if hi is None else float(np.asarray(hi).reshape(-1)[0])
        if lo == 0.0 and hi == 6.0:
            self._fuse_activation(node, "RELU6")
        elif lo == 0.0 and (hi is None or np.isinf(hi)):
            self._fuse_activation(node, "RELU")
        else:
            raise UnsupportedOpError(node_name(node), "Clip", f"only Clip(0, 6) or Clip(0, inf), got ({lo}, {hi})")

    def _op_Dropout(self, node: onnx.NodeProto) -> None:  # noqa: N802
        if len(node.output) > 1 and self.uses.get(node.output[1]):
            raise UnsupportedOpError(node_name(node), "Dropout", "its mask output is used")
        self._op_Identity(node)

    # -- compute ops
    def _op_Conv(self, node: onnx.NodeProto) -> None:  # noqa: N802
        nm, a = node_name(node), _attrs(node)
        x = self._act(node.input[0], f"node {nm!r}")
        w = self._const(node, 1).astype(np.float32)
        b = self._const(node, 2)
        if w.ndim != 4:
            raise UnsupportedOpError(nm, "Conv", f"only 2-D convolution, weight shape {w.shape}")
        n, h, wd, c = self.shapes[x]
        o, i_per_group, kh, kw = w.shape
        group = int(a.get("group", 1))
        sh, sw = a.get("strides", [1, 1])
        dh, dw = a.get("dilations", [1, 1])
        pads = _explicit_pads(nm, "Conv", a, (h, wd), (kh, kw), (sh, sw), (dh, dw))
        if b is not None and b.shape != (o,):
            raise OnnxImportError(f"node {nm!r}: bias shape {b.shape} for {o} output channels")
        bias = np.zeros(o, np.float32) if b is None else b.astype(np.float32)
        if group == 1 and i_per_group != c:
            raise OnnxImportError(f"node {nm!r}: weight expects {i_per_group} input channels, got {c}")
        if group == 1:
            kind, weight, extra = "CONV_2D", w.transpose(0, 2, 3, 1), {}
        elif group == c and i_per_group == 1 and o % c == 0:
            kind, weight = "DEPTHWISE_CONV_2D", w.reshape(o, kh, kw)[None].transpose(0, 2, 3, 1)
            extra = {"depth_multiplier": o // c}
        elif i_per_group * group == c and o % group == 0:  # grouped: one CONV_2D (onnx_struct doc)
            kind, weight, extra = "CONV_2D", w.transpose(0, 2, 3, 1), {}
        else:
            raise UnsupportedOpError(nm, "Conv", f"grouped convolution (group={group}, channels={c})")
        x, padding = self._padding(node, x, pads, (h, wd), (kh, kw), (sh, sw), (dh, dw))
        oh, ow = (out_size(s, k, st, d, padding) for s, k, st, d in
                  zip(self.shapes[x][1:3], (kh, kw), (sh, sw), (dh, dw), strict=True))
        opts = {"stride_h": sh, "stride_w": sw, "padding": padding, "dilation_h": dh,
                "dilation_w": dw, **extra, "activation": "NONE"}
        self._emit(node, FloatOp(kind, nm, [x], node.output[0], opts,
                                 np.ascontiguousarray(weight), bias), (n, oh, ow, o))

    def _padding(self, node: onnx.NodeProto, x: str, pads: tuple[int, int, int, int],
                 hw: tuple[int, int], k: tuple[int, int], s: tuple[int, int],
                 d: tuple[int, int]) -> tuple[str, str]:
        """SAME / VALID when they match the ONNX pads, else an explicit PAD op + VALID."""
        if not any(pads):
            return x, "VALID"
        same = tuple(p for dim in zip(*(same_pads(*args) for args in zip(hw, k, s, d, strict=True)),
                                       strict=True) for p in dim)  # (top, left, bottom, right)
        if pads == same:
            return x, "SAME"
        t, left, b, r = pads
        n, h, w, c = self.shapes[x]
        out = f"{node_name(node)}_pad"
        self._emit(node, FloatOp("PAD", f"{node_name(node)}/pad", [x], out,
                                 {"paddings": ((0, 0), (t, b), (left, r), (0, 0))}),
                   (n, h + t + b, w + left + r, c))
        return out, "VALID"

    def _op_GlobalMaxPool(self, node: onnx.NodeProto) -> None:  # noqa: N802
        nm = node_name(node)
        x = self._act(node.input[0], f"node {nm!r}")
        n, h, w, c = self.shapes[x]
        opts = {"stride_h": 1, "stride_w": 1, "filter_h": h, "filter_w": w,
                "padding": "VALID", "activation": "NONE"}
        self._emit(node, FloatOp("MAX_POOL_2D", nm, [x], node.output[0], opts), (n, 1, 1, c))

    def _mean(self, node: onnx.NodeProto, axes: list[int], keep: bool) -> None:
        nm = node_name(node)
        x = self._act(node.input[0], f"node {nm!r}")
        shape = self.shapes[x]
        if len(shape) != 4 or sorted(a % 4 for a in axes) != [2, 3]:
            raise UnsupportedOpError(nm, node.op_type, f"only a mean over H and W, axes {axes}")
        n, _, _, c = shape
        self._emit(node, FloatOp("MEAN", nm, [x], node.output[0], {"keep_dims": keep, "axes": (1, 2)}),
                   (n, 1, 1, c) if keep else (n, c))

    def _op_GlobalAveragePool(self, node: onnx.NodeProto) -> None:  # noqa: N802
        self._mean(node, [2, 3], True)

    def _op_ReduceMean(self, node: onnx.NodeProto) -> None:  # noqa: N802
        a = _attrs(node)
        axes = a.get("axes")
        if axes is None and len(node.input) > 1:  # opset 18 moved axes to an input
            axes = self._const(node, 1).tolist()
        self._mean(node, list(axes or []), bool(a.get("keepdims", 1)))

    def _fc(self, node: onnx.NodeProto, x: str, weight: np.ndarray, bias: np.ndarray) -> None:
        nm = node_name(node)
        shape = self.shapes[x]
        if len(shape) != 2 or weight.shape[1] != shape[1]:
            raise UnsupportedOpError(nm, node.op_type, f"input {shape} vs weight {weight.shape}")
        if x in self.flat_nchw:  # columns are in NCHW flatten order: permute to NHWC's
            h, w, c = self.flat_nchw[x]
            weight = weight.reshape(-1, c, h, w).transpose(0, 2, 3, 1).reshape(weight.shape[0], -1)
        self._emit(node, FloatOp("FULLY_CONNECTED", nm, [x], node.output[0],
                                 {"activation": "NONE", "keep_num_dims": False},
                                 np.ascontiguousarray(weight, np.float32),
                                 np.broadcast_to(bias, (weight.shape[0],)).astype(np.float32)),
                   (shape[0], weight.shape[0]))

    def _op_Add(self, node: onnx.NodeProto) -> None:  # noqa: N802
        nm = node_name(node)
        const = [i for i in node.input if i in self.consts]
        if not const:
            a, b = (self._act(i, f"node {nm!r}") for i in node.input)
            if self.shapes[a] == self.shapes[b]:
                self._emit(node, FloatOp("ADD", nm, [a, b], node.output[0], {"activation": "NONE"}),
                           self.shapes[a])
                return
        self._add_general(node)  # broadcasting, or a constant: bias fold or ADD (onnx_elementwise)

    def _op_Concat(self, node: onnx.NodeProto) -> None:  # noqa: N802
        nm = node_name(node)
        xs = [self._act(i, f"node {nm!r}") for i in node.input]
        rank = len(self.shapes[xs[0]])
        axis = int(_attrs(node)["axis"]) % rank
        axis = _NCHW_TO_NHWC_AXIS[axis] if rank == 4 else axis
        shapes = [self.shapes[x] for x in xs]
        if any(len(s) != rank or s[:axis] + s[axis + 1:] != shapes[0][:axis] + shapes[0][axis + 1:]
               for s in shapes):
            raise UnsupportedOpError(nm, "Concat", f"mismatched shapes {shapes}")
        out = list(shapes[0])
        out[axis] = sum(s[axis] for s in shapes)
        self._emit(node, FloatOp("CONCATENATION", nm, xs, node.output[0],
                                 {"axis": axis, "activation": "NONE"}), tuple(out))

    def _op_Pad(self, node: onnx.NodeProto) -> None:  # noqa: N802
        nm, a = node_name(node), _attrs(node)
        x = self._act(node.input[0], f"node {nm!r}")
        if a.get("mode", b"constant") not in (b"constant", "constant"):
            raise UnsupportedOpError(nm, "Pad", f"mode {a['mode']!r}")
        pads = a.get("pads")
        if pads is None:
            pads = self._const(node, 1).tolist()
        value = self._const(node, 2) if len(node.input) > 2 else a.get("value", 0.0)
        if (value is not None and float(np.asarray(value).reshape(-1)[0]) != 0.0) or len(node.input) > 3:
            raise UnsupportedOpError(nm, "Pad", "only zero padding of all axes")
        shape = self.shapes[x]
        rank = len(shape)
        if len(pads) != 2 * rank or min(pads) < 0:
            raise UnsupportedOpError(nm, "Pad", f"pads {pads}")
        pairs = [(int(pads[i]), int(pads[i + rank])) for i in range(rank)]  # in NCHW axis order
        if rank == 4:
            pairs = [pairs[0], pairs[2], pairs[3], pairs[1]]
        out = tuple(s + p + q for s, (p, q) in zip(shape, pairs, strict=True))
        self._emit(node, FloatOp("PAD", nm, [x], node.output[0], {"paddings": tuple(pairs)}), out)


def _naming(message: str, name: str, op: str) -> str:
    """`message` as "node 'N' (op O): ..." (handlers write "node 'N': ..." or a bare what)."""
    for prefix in (f"node {name!r}: ", f"node {name!r} (op {op}): "):
        if message.startswith(prefix):
            message = message[len(prefix):]
    return f"node {name!r} (op {op}): {message}"


def _attrs(node: onnx.NodeProto) -> dict[str, Any]:
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _explicit_pads(nm: str, op: str, a: dict[str, Any], hw: tuple[int, int], k: tuple[int, int],
                   s: tuple[int, int], d: tuple[int, int]) -> tuple[int, int, int, int]:
    """ONNX pads (or auto_pad) as (top, left, bottom, right)."""
    auto = a.get("auto_pad", b"NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        (t, b), (left, r) = (same_pads(*args) for args in zip(hw, k, s, d, strict=True))
        return (b, r, t, left) if auto == "SAME_LOWER" else (t, left, b, r)
    if auto == "VALID":
        return (0, 0, 0, 0)
    pads = tuple(int(p) for p in a.get("pads", [0, 0, 0, 0]))
    if len(pads) != 4 or min(pads) < 0:
        raise UnsupportedOpError(nm, op, f"pads {pads}")
    return pads  # type: ignore[return-value]
