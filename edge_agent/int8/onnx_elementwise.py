"""ONNX -> float graph handlers for the elementwise ops of MobileNetV3 and EfficientNet: a
mixin of onnx_import._Converter, plus the HardSwish pattern pass run before conversion.

Lowerings (TFLite op vocabulary), each exact in float:
- HardSwish (opset 14) -> HARD_SWISH; so are the decompositions older exporters emit
  (`fuse_hard_swish`): x * HardSigmoid(x) with alpha 1/6, beta 1/2, and
  x * Clip(x + 3, 0, 6) / 6 in any association (Mul/Div by 6 or Mul by 1/6, either order);
- Sigmoid -> LOGISTIC (output quantisation fixed at 1/256, -128 as TFLite requires); SiLU /
  Swish x * Sigmoid(x) is LOGISTIC then MUL (TFLite has no SiLU op);
- HardSigmoid(alpha, beta) = clip(alpha * x + beta, 0, 1): folded into the producing conv /
  depthwise / fully connected (weights * alpha, bias * alpha + beta) or, when there is none,
  a 1x1 DEPTHWISE_CONV_2D with weight alpha and bias beta; either with a fused RELU and the
  output range pinned to exactly [0, 1] ("clip_max", quantize.py), so the int8 saturation
  at 127 == 1.0 is the upper clamp. Why not ADD(+3) RELU6 then MUL(1/6): two ops, two
  roundings and only alpha = 1/6; this is one op, any alpha > 0, and it runs on the native
  conv kernels;
- Sub of a constant -> Add of its negation;
- Mul of two activations -> MUL with broadcasting ((N,1,1,C) over (N,H,W,C): the SE scale);
  Mul / Div by a constant: folded into the producing conv / depthwise / FC when per-channel
  or scalar (exact), a positive scalar also after a RELU / RELU6 (the clamp becomes a
  clip_max), else MUL with an int8 constant operand; Add of a constant that cannot
  fold into a bias, or of two broadcasting activations -> ADD.
"""

from __future__ import annotations

from collections import ChainMap
from typing import TYPE_CHECKING

import numpy as np

from .float_graph import FloatOp, to_nchw_shape
from .graph import UnsupportedOpError

if TYPE_CHECKING:  # pragma: no cover - typing only
    import onnx

LINEAR = ("CONV_2D", "DEPTHWISE_CONV_2D", "FULLY_CONNECTED")
_SIXTH_TOL = 1e-6  # torch writes alpha = 1/6 as float32 0.16666667


def _node_name(node: onnx.NodeProto) -> str:
    """onnx_import.node_name (repeated: importing onnx_import here would be circular)."""
    return node.name or (node.output[0] if node.output else node.op_type)


def _attrs(node: onnx.NodeProto) -> dict:
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


class ElementwiseOps:
    """`_op_<OnnxOp>` handlers; they use the converter's _act / _emit / shapes / consts."""

    consts: dict[str, np.ndarray]
    shapes: dict[str, tuple[int, ...]]
    producer: dict[str, FloatOp]
    uses: dict[str, int]
    alias: dict[str, str]

    # -- helpers
    def _sole_linear_producer(self, x: str, *, activated: bool = False) -> FloatOp | None:
        """The conv / depthwise / FC producing x, when x is used only once (every alias
        counts), i.e. when folding a map into it changes nothing else; with no activation,
        or (activated=True) only with one (RELU, RELU6 or a clip_max)."""
        op = self.producer.get(x)
        uses = self.uses.get(x, 0) + sum(self.uses.get(a, 0) for a, c in self.alias.items() if c == x)
        if op is None or op.kind not in LINEAR or uses != 1:
            return None
        has_activation = op.options.get("activation", "NONE") != "NONE" or "clip_max" in op.options
        return op if has_activation == activated else None

    def _scale_activated(self, node: onnx.NodeProto, x: str, c: np.ndarray) -> bool:
        """x * c for a positive scalar c after a conv / FC with RELU / RELU6: c commutes with
        the clamp, so fold it (relu6(z) * c = min(relu(c z), 6 c): RELU and clip_max 6c;
        torch's decomposed hardsigmoid relu6(x + 3) / 6 ends up as one op this way)."""
        op = self._sole_linear_producer(x, activated=True)
        if op is None or c.size != 1 or not float(c.reshape(-1)[0]) > 0:
            return False
        v = float(c.reshape(-1)[0])
        top = 6.0 if op.options.get("activation") == "RELU6" else op.options.get("clip_max")
        op.weight = (op.weight * np.float64(v)).astype(np.float32)
        op.bias = (op.bias * np.float64(v)).astype(np.float32)
        op.options["activation"] = "RELU"
        if top is not None:
            op.options["clip_max"] = float(top) * v
        self._rename(op, node.output[0])
        return True

    def _to_nhwc_constant(self, node: onnx.NodeProto, x: str, value: np.ndarray) -> np.ndarray:
        """An ONNX constant broadcast against activation x (model layout) -> NHWC layout,
        refused when it would enlarge x (the output must keep x's shape)."""
        nm, model_shape = _node_name(node), to_nchw_shape(self.shapes[x])
        try:
            c = np.asarray(value, np.float32)
        except (TypeError, ValueError):
            raise UnsupportedOpError(nm, node.op_type, f"a constant of type {np.asarray(value).dtype}") from None
        if c.ndim > len(model_shape):
            raise UnsupportedOpError(nm, node.op_type, f"constant of rank {c.ndim} on a rank-{len(model_shape)} input")
        c = c.reshape((1,) * (len(model_shape) - c.ndim) + c.shape)
        try:
            fits = np.broadcast_shapes(c.shape, model_shape) == tuple(model_shape)
        except ValueError:
            fits = False
        if not fits:
            raise UnsupportedOpError(nm, node.op_type, f"constant of shape {value.shape} does not broadcast "
                                                       f"onto the input {model_shape}")
        return np.ascontiguousarray(c.transpose(0, 2, 3, 1) if c.ndim == 4 else c)

    def _binary(self, node: onnx.NodeProto, kind: str, a: str, b: str) -> None:
        """ADD / MUL of two activations, broadcasting like ONNX (same rank only)."""
        nm, sa, sb = _node_name(node), self.shapes[a], self.shapes[b]
        try:
            shape = tuple(np.broadcast_shapes(sa, sb)) if len(sa) == len(sb) else None
        except ValueError:
            shape = None
        if shape is None:
            raise UnsupportedOpError(nm, node.op_type, f"inputs {to_nchw_shape(sa)} and {to_nchw_shape(sb)} "
                                                       "do not broadcast (same rank, ONNX rules)")
        self._emit(node, FloatOp(kind, nm, [a, b], node.output[0], {"activation": "NONE"}), shape)

    def _with_constant(self, node: onnx.NodeProto, kind: str, x: str, value: np.ndarray) -> None:
        """x + c or x * c: folded into x's conv / depthwise / FC when c is a scalar or per
        channel (exact), else an ADD / MUL with a constant operand."""
        c = self._to_nhwc_constant(node, x, value)
        op = self._sole_linear_producer(x)
        per_channel = c.size == 1 or (c.shape[-1] == c.size and op is not None and c.size == op.bias.shape[0])
        if op is not None and per_channel:
            v = np.broadcast_to(c.reshape(-1).astype(np.float64), op.bias.shape)
            if kind == "ADD":
                op.bias = (op.bias + v).astype(np.float32)
            else:
                axis = 3 if op.kind == "DEPTHWISE_CONV_2D" else 0
                shape = [1] * op.weight.ndim
                shape[axis] = -1
                op.weight = (op.weight * v.reshape(shape)).astype(np.float32)
                op.bias = (op.bias * v).astype(np.float32)
            self._rename(op, node.output[0])
            return
        if kind == "MUL" and self._scale_activated(node, x, c):
            return
        nm = _node_name(node)
        self._emit(node, FloatOp(kind, nm, [x], node.output[0], {"activation": "NONE"}, c), self.shapes[x])

    def _split_constant(self, node: onnx.NodeProto) -> tuple[str | None, np.ndarray | None, list[str]]:
        """(activation input, constant, activations) of a binary node; refuses two constants."""
        consts = [i for i in node.input if i in self.consts]
        if len(consts) == 2:
            raise UnsupportedOpError(_node_name(node), node.op_type, "both inputs are constants")
        acts = [self._act(i, f"node {_node_name(node)!r}") for i in node.input if i not in self.consts]
        if consts:
            return acts[0], self.consts[consts[0]], acts
        return None, None, acts

    def _add_general(self, node: onnx.NodeProto) -> None:
        """Add with broadcasting, or of a constant that is not a producer's bias."""
        x, c, acts = self._split_constant(node)
        if c is None:
            self._binary(node, "ADD", *acts)
        else:
            self._with_constant(node, "ADD", x, c)

    # -- ops
    def _op_Mul(self, node: onnx.NodeProto) -> None:  # noqa: N802 - ONNX op names
        x, c, acts = self._split_constant(node)
        if c is None:
            self._binary(node, "MUL", *acts)
        else:
            self._with_constant(node, "MUL", x, c)

    def _op_Div(self, node: onnx.NodeProto) -> None:  # noqa: N802
        nm = _node_name(node)
        if node.input[0] in self.consts or node.input[1] not in self.consts:
            raise UnsupportedOpError(nm, "Div", "only an activation divided by a constant")
        try:
            c = np.asarray(self.consts[node.input[1]], np.float64)
        except (TypeError, ValueError):
            raise UnsupportedOpError(nm, "Div", "a non-numeric divisor") from None
        if np.any(c == 0) or not np.all(np.isfinite(c)):
            raise UnsupportedOpError(nm, "Div", "a divisor that is zero or not finite")
        self._with_constant(node, "MUL", self._act(node.input[0], f"node {nm!r}"), 1.0 / c)

    def _op_Sub(self, node: onnx.NodeProto) -> None:  # noqa: N802 - input normalisation (x - mean)
        nm = _node_name(node)
        if node.input[0] in self.consts or node.input[1] not in self.consts:
            raise UnsupportedOpError(nm, "Sub", "only an activation minus a constant")
        try:
            c = -np.asarray(self.consts[node.input[1]], np.float64)
        except (TypeError, ValueError):
            raise UnsupportedOpError(nm, "Sub", "a non-numeric constant") from None
        self._with_constant(node, "ADD", self._act(node.input[0], f"node {nm!r}"), c)

    def _elementwise(self, node: onnx.NodeProto, kind: str) -> None:
        nm = _node_name(node)
        x = self._act(node.input[0], f"node {nm!r}")
        self._emit(node, FloatOp(kind, nm, [x], node.output[0], {}), self.shapes[x])

    def _op_HardSwish(self, node: onnx.NodeProto) -> None:  # noqa: N802
        self._elementwise(node, "HARD_SWISH")

    def _op_Sigmoid(self, node: onnx.NodeProto) -> None:  # noqa: N802
        self._elementwise(node, "LOGISTIC")

    def _op_HardSigmoid(self, node: onnx.NodeProto) -> None:  # noqa: N802
        nm, a = _node_name(node), _attrs(node)
        alpha, beta = float(a.get("alpha", 0.2)), float(a.get("beta", 0.5))
        if not (np.isfinite(alpha) and np.isfinite(beta) and alpha > 0):
            raise UnsupportedOpError(nm, "HardSigmoid", f"alpha={alpha}, beta={beta} (supported: alpha > 0)")
        x = self._act(node.input[0], f"node {nm!r}")
        op = self._sole_linear_producer(x)
        if op is not None:  # clip(alpha * (W x + b) + beta, 0, 1)
            op.weight = (op.weight * np.float64(alpha)).astype(np.float32)
            op.bias = (op.bias * np.float64(alpha) + beta).astype(np.float32)
            op.options.update(activation="RELU", clip_max=1.0)
            self._rename(op, node.output[0])
            return
        shape = self.shapes[x]
        if len(shape) != 4:
            raise UnsupportedOpError(nm, "HardSigmoid", "on a 2-D tensor not produced by a Gemm/MatMul used only here")
        c = shape[3]
        opts = {"stride_h": 1, "stride_w": 1, "padding": "VALID", "dilation_h": 1, "dilation_w": 1,
                "depth_multiplier": 1, "activation": "RELU", "clip_max": 1.0}
        self._emit(node, FloatOp("DEPTHWISE_CONV_2D", nm, [x], node.output[0], opts,
                                 np.full((1, 1, 1, c), alpha, np.float32), np.full(c, beta, np.float32)), shape)


# ----------------------------------------------------------- HardSwish decompositions
def _scalar(consts: dict[str, np.ndarray], name: str) -> float | None:
    v = consts.get(name)
    if v is None or np.asarray(v).size != 1:
        return None
    try:
        return float(np.asarray(v).reshape(-1)[0])
    except (TypeError, ValueError):  # a string or other non-numeric constant: no pattern
        return None


def fuse_hard_swish(nodes: list[onnx.NodeProto], consts: dict[str, np.ndarray],
                    uses: dict[str, int]) -> list[onnx.NodeProto]:
    """Replace each exact HardSwish decomposition by one HardSwish node (named after the
    decomposition's last node, so split names keep working); `uses` is updated.

    Every intermediate tensor must be used only inside the pattern. Constants may come from
    initializers or Constant nodes (read here: conversion has not run yet)."""
    from onnx import helper, numpy_helper

    known = ChainMap({}, consts)  # not dict(consts): the importer converts initialisers as read
    for n in nodes:
        if n.op_type == "Constant" and n.output:
            for attr in n.attribute:
                if attr.name == "value":
                    try:
                        known[n.output[0]] = numpy_helper.to_array(helper.get_attribute_value(attr))
                    except Exception:  # corrupt: the converter reports it
                        pass
    producer = {o: n for n in nodes for o in n.output}

    def sole(t: str) -> onnx.NodeProto | None:  # the producer of t, if t is used only once
        return producer.get(t) if uses.get(t, 0) == 1 else None

    def other(n: onnx.NodeProto, value: float) -> str | None:  # the input beside constant `value`
        if len(n.input) != 2:
            return None
        for i, j in ((0, 1), (1, 0)):
            v = _scalar(known, n.input[j])
            if v is not None and abs(v - value) <= _SIXTH_TOL * max(1.0, abs(value)) and n.input[i] not in known:
                return n.input[i]
        return None

    def sixth(n: onnx.NodeProto | None) -> str | None:  # v / 6 or v * (1/6) -> v
        if n is None:
            return None
        if n.op_type == "Div" and len(n.input) == 2 and _scalar(known, n.input[1]) == 6.0:
            return n.input[0]
        return other(n, 1.0 / 6.0) if n.op_type == "Mul" else None

    def relu6_plus3(t: str) -> tuple[str, list[onnx.NodeProto]] | None:  # Clip(x + 3, 0, 6) -> x
        clip = sole(t)
        if clip is None or clip.op_type != "Clip":
            return None
        a = {at.name: helper.get_attribute_value(at) for at in clip.attribute}
        lo = _scalar(known, clip.input[1]) if len(clip.input) > 1 and clip.input[1] else a.get("min")
        hi = _scalar(known, clip.input[2]) if len(clip.input) > 2 and clip.input[2] else a.get("max")
        add = sole(clip.input[0])
        if lo != 0.0 or hi != 6.0 or add is None or add.op_type != "Add":
            return None
        x = other(add, 3.0)
        return (x, [add, clip]) if x is not None else None

    def hard_sigmoid_of(t: str) -> tuple[str, list[onnx.NodeProto]] | None:  # HardSigmoid(x) -> x
        hs = sole(t)
        if hs is not None and hs.op_type == "HardSigmoid":
            a = {at.name: helper.get_attribute_value(at) for at in hs.attribute}
            if abs(float(a.get("alpha", 0.2)) - 1 / 6) <= _SIXTH_TOL and float(a.get("beta", 0.5)) == 0.5:
                return hs.input[0], [hs]
        return None

    def match(last: onnx.NodeProto) -> tuple[str, list[onnx.NodeProto]] | None:
        if last.op_type == "Mul" and len(last.input) == 2:  # x * HardSigmoid(x), x * (relu6(x+3)/6)
            for i, j in ((0, 1), (1, 0)):
                x, gate = last.input[i], last.input[j]
                found = hard_sigmoid_of(gate)
                if found is None and (div := sole(gate)) is not None and (v := sixth(div)) is not None:
                    inner = relu6_plus3(v)
                    found = (inner[0], [*inner[1], div]) if inner else None
                if found is not None and found[0] == x:
                    return x, found[1]
        v = sixth(last)  # (x * relu6(x + 3)) / 6
        inner_mul = sole(v) if v is not None else None
        if inner_mul is not None and inner_mul.op_type == "Mul" and len(inner_mul.input) == 2:
            for i, j in ((0, 1), (1, 0)):
                found = relu6_plus3(inner_mul.input[j])
                if found is not None and found[0] == inner_mul.input[i]:
                    return found[0], [*found[1], inner_mul]
        return None

    removed: set[int] = set()
    replacement: dict[int, onnx.NodeProto] = {}
    for n in nodes:
        if id(n) in removed or n.op_type not in ("Mul", "Div"):
            continue
        found = match(n)
        if found is None or any(id(m) in removed for m in found[1]):
            continue
        x, inner = found
        for m in [*inner, n]:
            for i in m.input:
                if i:
                    uses[i] = uses.get(i, 0) - 1
            removed.add(id(m))
        uses[x] = uses.get(x, 0) + 1
        replacement[id(n)] = helper.make_node("HardSwish", [x], [n.output[0]], name=_node_name(n))
    return [replacement.get(id(n), n) for n in nodes if id(n) not in removed or id(n) in replacement]



def decompose_hard_swish(model: onnx.ModelProto) -> onnx.ModelProto:
    """Rewrite every HardSwish node as x * HardSigmoid(x; 1/6, 1/2), in place: MXNet's ONNX
    importer (the head's path, bundle_create) knows HardSigmoid and Mul but not HardSwish."""
    from onnx import helper

    nodes = []
    for n in model.graph.node:
        if n.op_type != "HardSwish":
            nodes.append(n)
            continue
        gate = f"{n.output[0]}__hardsigmoid"
        nodes += [helper.make_node("HardSigmoid", [n.input[0]], [gate], name=f"{_node_name(n)}/gate",
                                   alpha=1.0 / 6.0, beta=0.5),
                  helper.make_node("Mul", [n.input[0], gate], [n.output[0]], name=_node_name(n))]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model
