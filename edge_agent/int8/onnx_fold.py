"""Constant-shape folding: the shape arithmetic of an ONNX graph evaluated at its fixed input
size, before the importer sees it.

Exporters write shape-dependent code as subgraphs over `Shape`: torch's legacy exporter
turns ShuffleNet v2's `x.chunk(2, dim=1)` into Shape -> Gather -> Add -> Div -> Mul -> Slice,
and view(...) calls into Shape -> Gather -> Unsqueeze -> Concat -> Reshape. The bundle's
input size is fixed (the importer refuses a dynamic C, H or W), so every such value is a
constant; folding it turns those Slices and Reshapes into the constant-argument forms the
importer's handlers already map to TFLite ops (GATHER of channels, the channel shuffle).

`fold_shapes(model)` returns a copy in which every foldable node is a `Constant` node with
the same name and output (node names, and so split points, do not change); the model
passed in is not modified. A node folds when it is in FOLD (one numpy function per op) and
all its inputs are constants, and either one of them derives from a Shape / Size or all of
them are small integer tensors (shape arithmetic, never float weights). Shape and Size fold
when their input's shape is fully static after ONNX shape inference; a symbolic batch
dimension is not made up (those subgraphs stay, and the importer refuses them by name).
Shape inference runs again after each round of folding, since a Reshape whose target just
became constant gives its output a static shape (at most MAX_ROUNDS rounds).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # pragma: no cover - typing only
    import onnx

MAX_ROUNDS = 8
MAX_SHAPE_ELEMENTS = 64  # an integer constant larger than this is data, not a shape


def _int_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """ONNX Div: integers truncate toward zero (C semantics), floats divide."""
    if np.issubdtype(a.dtype, np.integer) and np.issubdtype(b.dtype, np.integer):
        q = np.abs(a) // np.maximum(np.abs(b), 1)
        return (np.sign(a) * np.sign(b) * q).astype(np.result_type(a, b))
    return np.asarray(a / b)


def _axes(node: onnx.NodeProto, inputs: list[np.ndarray | None], attrs: dict[str, Any]) -> list[int] | None:
    if "axes" in attrs:
        return [int(a) for a in attrs["axes"]]
    if len(inputs) > 1 and inputs[1] is not None:
        return [int(a) for a in np.asarray(inputs[1]).reshape(-1)]
    return None


def _squeeze(node: onnx.NodeProto, x: list[np.ndarray | None], a: dict[str, Any]) -> np.ndarray:
    axes = _axes(node, x, a)
    data = np.asarray(x[0])
    return data.squeeze() if axes is None else data.squeeze(tuple(ax % data.ndim for ax in axes))


def _unsqueeze(node: onnx.NodeProto, x: list[np.ndarray | None], a: dict[str, Any]) -> np.ndarray:
    data = np.asarray(x[0])
    axes = _axes(node, x, a) or []
    rank = data.ndim + len(axes)
    for ax in sorted(ax % rank for ax in axes):
        data = np.expand_dims(data, ax)
    return data


def _slice(node: onnx.NodeProto, x: list[np.ndarray | None], a: dict[str, Any]) -> np.ndarray:
    data = np.asarray(x[0])
    starts, ends = (np.asarray(v).reshape(-1) for v in (x[1], x[2]))
    axes = np.asarray(x[3]).reshape(-1) if len(x) > 3 and x[3] is not None else np.arange(len(starts))
    steps = np.asarray(x[4]).reshape(-1) if len(x) > 4 and x[4] is not None else np.ones(len(starts), np.int64)
    index = [slice(None)] * data.ndim
    for s, e, ax, st in zip(starts, ends, axes, steps, strict=True):
        index[int(ax) % data.ndim] = slice(int(s), int(e), int(st))  # numpy clamps as ONNX does
    return data[tuple(index)]


def _cast(node: onnx.NodeProto, x: list[np.ndarray | None], a: dict[str, Any]) -> np.ndarray:
    from onnx import helper

    return np.asarray(x[0]).astype(helper.tensor_dtype_to_np_dtype(int(a["to"])))


def _binary(fn: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Callable[..., np.ndarray]:
    def run(node: onnx.NodeProto, x: list[np.ndarray | None], a: dict[str, Any]) -> np.ndarray:
        return np.asarray(fn(np.asarray(x[0]), np.asarray(x[1])))
    return run


def _unary(fn: Callable[[np.ndarray], np.ndarray]) -> Callable[..., np.ndarray]:
    def run(node: onnx.NodeProto, x: list[np.ndarray | None], a: dict[str, Any]) -> np.ndarray:
        return np.asarray(fn(np.asarray(x[0])))
    return run


# op type -> numpy evaluation of (node, inputs, attributes); Shape and Size are special
# (they read the input's static shape, not its value)
FOLD: dict[str, Callable[..., np.ndarray]] = {
    "Gather": lambda n, x, a: np.take(np.asarray(x[0]), np.asarray(x[1]), axis=int(a.get("axis", 0))),
    "Unsqueeze": _unsqueeze,
    "Squeeze": _squeeze,
    "Concat": lambda n, x, a: np.concatenate([np.asarray(v) for v in x], axis=int(a["axis"])),
    "Slice": _slice,
    "Cast": _cast,
    "Identity": _unary(lambda v: v),
    "Add": _binary(np.add),
    "Sub": _binary(np.subtract),
    "Mul": _binary(np.multiply),
    "Div": _binary(_int_div),
    "Max": _binary(np.maximum),
    "Min": _binary(np.minimum),
    "Neg": _unary(np.negative),
    "Abs": _unary(np.abs),
    "Floor": _unary(np.floor),
    "Ceil": _unary(np.ceil),
    "Reshape": lambda n, x, a: np.asarray(x[0]).reshape([int(v) for v in np.asarray(x[1]).reshape(-1)]),
}
SHAPE_OPS = ("Shape", "Size")


def _static_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    """Tensor name -> fully static shape, after ONNX shape inference (non-strict)."""
    import onnx

    try:
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception:  # an odd model: fold what needs no shapes
        inferred = model
    g = inferred.graph
    out: dict[str, tuple[int, ...]] = {}
    for vi in [*g.input, *g.value_info, *g.output]:
        t = vi.type.tensor_type
        if t.HasField("shape") and all(d.HasField("dim_value") for d in t.shape.dim):
            out[vi.name] = tuple(int(d.dim_value) for d in t.shape.dim)
    for init in g.initializer:
        out[init.name] = tuple(int(d) for d in init.dims)
    return out


def _shape_value(node: onnx.NodeProto, shape: tuple[int, ...], attrs: dict[str, Any]) -> np.ndarray:
    if node.op_type == "Size":
        return np.array(int(np.prod(shape)), np.int64)
    rank = len(shape)
    start, end = int(attrs.get("start", 0)), int(attrs.get("end", rank))  # opset 15's slice of the shape
    start, end = (max(0, min(rank, v + rank if v < 0 else v)) for v in (start, end))
    return np.array(shape[start:end], np.int64)


def _is_shape_data(v: np.ndarray) -> bool:
    return np.issubdtype(v.dtype, np.integer) and v.size <= MAX_SHAPE_ELEMENTS


def foldable_nodes(model: onnx.ModelProto) -> bool:
    """Cheap test: does the graph hold anything fold_shapes could fold?"""
    return any(n.op_type in SHAPE_OPS for n in model.graph.node)


def fold_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` with its constant shape subgraphs folded into Constant nodes (see
    the module doc); `model` itself when there is nothing to fold."""
    import onnx
    from onnx import helper, numpy_helper

    if not foldable_nodes(model):
        return model
    model = onnx.ModelProto.FromString(model.SerializeToString())
    g = model.graph
    consts: dict[str, np.ndarray] = {}
    for init in g.initializer:
        if init.data_type in (onnx.TensorProto.INT64, onnx.TensorProto.INT32) and \
                int(np.prod(init.dims)) <= MAX_SHAPE_ELEMENTS:
            consts[init.name] = numpy_helper.to_array(init)
    derived: set[str] = set()  # outputs computed from a Shape / Size
    for _ in range(MAX_ROUNDS):
        shapes, changed = _static_shapes(model), False
        for k, node in enumerate(g.node):
            if node.op_type == "Constant":
                if node.output[0] not in consts:
                    value = _constant_value(node)
                    if value is not None:
                        consts[node.output[0]] = value
                continue
            if len(node.output) != 1 or node.domain not in ("", "ai.onnx"):
                continue
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            value = None
            if node.op_type in SHAPE_OPS and node.input and node.input[0] in shapes:
                value = _shape_value(node, shapes[node.input[0]], attrs)
            elif node.op_type in FOLD:
                inputs = [consts.get(i) if i else None for i in node.input]
                given = [v for i, v in zip(node.input, inputs, strict=True) if i]
                from_shape = any(i in derived for i in node.input)
                if given and all(v is not None for v in given) and \
                        (from_shape or all(_is_shape_data(v) for v in given)):
                    try:
                        value = FOLD[node.op_type](node, inputs, attrs)
                    except Exception:  # malformed: left for the importer to refuse by name
                        value = None
            if value is None:
                continue
            value = np.asarray(value)
            out = node.output[0]
            consts[out] = value
            derived.add(out)
            g.node[k].CopyFrom(helper.make_node("Constant", [], [out], name=node.name,
                                                value=numpy_helper.from_array(value, out)))
            changed = True
        if not changed or not foldable_nodes(model):
            break
    return model


def _constant_value(node: onnx.NodeProto) -> np.ndarray | None:
    """A Constant node's value when it is small integer data (shape arithmetic)."""
    from onnx import helper, numpy_helper

    for a in node.attribute:
        if a.name == "value":
            try:
                v = numpy_helper.to_array(helper.get_attribute_value(a))
            except Exception:  # corrupt: the importer says so
                return None
            return v if _is_shape_data(v) else None
        if a.name in ("value_int", "value_ints"):
            return np.asarray(helper.get_attribute_value(a), np.int64)
    return None
