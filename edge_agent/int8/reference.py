"""The numpy int8 reference: runs a QGraph with TFLite's integer semantics.

It is the oracle of the int8 tests (exact against tflite-runtime's reference kernels) and
the last-resort engine on devices. The graph walker is separate from the op kernels
(`reference_ops.KERNELS`) so a native engine can pass `kernels={"CONV_2D": c_conv, ...}`
and reuse everything else.

`check_graph` validates a QGraph (known ops, options, dtypes, quantisation, shapes) before
it is written or after it is read, with errors that name the graph, the node and the op.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from . import reference_ops as ops
from .graph import ACTIVATIONS, OP_OPTIONS, PADDINGS, QGraph, QOp, QTensor, UnsupportedOpError

Kernel = ops.Kernel
KERNELS = ops.KERNELS

# Ops whose TFLite int8 kernel copies or compares raw values, so input and output must share
# scale and zero point for the result to mean what the float graph meant.
_SAME_QUANT_OPS = ("AVERAGE_POOL_2D", "MAX_POOL_2D", "RESHAPE", "PAD", "PADV2", "GATHER")


class GraphError(ValueError):
    """A QGraph that is not well-formed; the message names the graph, node and op."""


def run_graph(
    graph: QGraph,
    inputs: np.ndarray | Mapping[str, np.ndarray],
    *,
    kernels: Mapping[str, Kernel] | None = None,
) -> np.ndarray | dict[str, np.ndarray]:
    """Execute `graph` on `inputs` (one array for a single-input graph, else a dict by name).

    Returns one array for a single-output graph, else a dict by output name. The batch may
    differ from the declared one. `kernels` overrides entries of `reference_ops.KERNELS`.
    The graph is assumed valid (`check_graph`; write_tflite and read_tflite both run it),
    so it is not re-validated on every batch.
    """
    table = dict(KERNELS)
    if kernels:
        table.update(kernels)
    if isinstance(inputs, Mapping):
        feeds = dict(inputs)
    else:
        if len(graph.inputs) != 1:
            raise ValueError(f"graph {graph.name!r} has {len(graph.inputs)} inputs: pass a dict by name")
        feeds = {graph.inputs[0]: inputs}
    values: dict[str, np.ndarray] = {}
    for name in graph.inputs:
        if name not in feeds:
            raise ValueError(f"graph {graph.name!r}: missing input {name!r}")
        t = graph.tensor(name)
        arr = np.asarray(feeds[name])
        if arr.dtype != np.dtype(t.dtype):
            raise ValueError(f"graph {graph.name!r}: input {name!r} must be {t.dtype}, got {arr.dtype}")
        if tuple(arr.shape[1:]) != tuple(t.shape[1:]):
            raise ValueError(
                f"graph {graph.name!r}: input {name!r} has shape {arr.shape}, expected (N, {', '.join(map(str, t.shape[1:]))})"
            )
        values[name] = arr
    for index, op in enumerate(graph.ops):
        kernel = table.get(op.kind)
        if kernel is None:
            raise UnsupportedOpError(_node(op, index), op.kind)
        args = [None if not n else values[n] if n in values else graph.tensor(n).data for n in op.inputs]
        values[op.outputs[0]] = kernel(graph, op, args)
    outs = {name: values[name] for name in graph.outputs}
    return outs[graph.outputs[0]] if len(outs) == 1 else outs


def _node(op: QOp, index: int) -> str:
    return op.name or f"#{index}"


def infer_output_shape(graph: QGraph, op: QOp, shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, ...]:
    """The output shape TFLite computes for `op`, given its input shapes."""
    o = op.options
    x = shapes[op.inputs[0]]
    kind = op.kind
    if kind in ("CONV_2D", "DEPTHWISE_CONV_2D", "AVERAGE_POOL_2D", "MAX_POOL_2D"):
        if kind in ("CONV_2D", "DEPTHWISE_CONV_2D"):
            w = graph.tensor(op.inputs[1]).shape
            kernel, channels = (w[1], w[2]), (w[0] if kind == "CONV_2D" else w[3])
        else:
            kernel, channels = (int(o["filter_h"]), int(o["filter_w"])), x[3]
        wp = ops.window_params(op, x[1:3], kernel)
        return (x[0], wp.out_hw[0], wp.out_hw[1], channels)
    if kind == "FULLY_CONNECTED":
        w = graph.tensor(op.inputs[1]).shape
        if o.get("keep_num_dims", False):
            return (*x[:-1], w[0])
        return (int(np.prod(x)) // w[1], w[0])
    if kind in ("ADD", "MUL"):
        return tuple(np.broadcast_shapes(x, shapes[op.inputs[1]]))
    if kind == "MEAN":
        axes = ops.resolve_axes(graph.tensor(op.inputs[1]).data, len(x))
        if o.get("keep_dims", False):
            return tuple(1 if i in axes else d for i, d in enumerate(x))
        return tuple(d for i, d in enumerate(x) if i not in axes)
    if kind == "RESHAPE":
        shape = [int(d) for d in o["new_shape"]]
        total = int(np.prod(x))
        if shape.count(-1) == 1:
            known = int(np.prod([d for d in shape if d != -1]))
            shape[shape.index(-1)] = total // known if known else 0
        if int(np.prod(shape)) != total or any(d < 0 for d in shape):
            raise ValueError(f"new_shape {list(o['new_shape'])} does not fit input shape {list(x)}")
        return tuple(shape)
    if kind == "CONCATENATION":
        parts = [shapes[n] for n in op.inputs]
        axis = int(o.get("axis", -1)) % len(x)
        for p in parts:
            if len(p) != len(x) or any(a != b for i, (a, b) in enumerate(zip(p, x, strict=True)) if i != axis):
                raise ValueError(f"cannot concatenate shapes {[list(s) for s in parts]} on axis {axis}")
        return tuple(sum(p[axis] for p in parts) if i == axis else d for i, d in enumerate(x))
    if kind == "GATHER":
        axis = int(o.get("axis", 0)) % len(x)
        n = int(np.asarray(graph.tensor(op.inputs[1]).data).size)
        return tuple(n if i == axis else d for i, d in enumerate(x))
    if kind in ("PAD", "PADV2"):
        pads = np.asarray(graph.tensor(op.inputs[1]).data).reshape(-1, 2)
        if pads.shape[0] != len(x) or (pads < 0).any():
            raise ValueError(f"paddings {pads.tolist()} do not fit rank {len(x)}")
        return tuple(int(d + a + b) for d, (a, b) in zip(x, pads, strict=True))
    return tuple(x)  # QUANTIZE, DEQUANTIZE


_ARITY = {
    "CONV_2D": (2, 3), "DEPTHWISE_CONV_2D": (2, 3), "FULLY_CONNECTED": (2, 3), "ADD": (2, 2),
    "AVERAGE_POOL_2D": (1, 1), "MAX_POOL_2D": (1, 1), "MEAN": (2, 2), "RESHAPE": (1, 1),
    "CONCATENATION": (1, 1 << 16), "PAD": (2, 2), "PADV2": (3, 3), "GATHER": (2, 2), "QUANTIZE": (1, 1), "DEQUANTIZE": (1, 1),
    "MUL": (2, 2), "HARD_SWISH": (1, 1), "LOGISTIC": (1, 1),
}


def _check_quant(t: QTensor, what: str) -> None:
    if t.scale is None or t.zero_point is None:
        raise ValueError(f"{what} {t.name!r} has no quantisation parameters")
    scale, zp = np.asarray(t.scale).reshape(-1), np.asarray(t.zero_point).reshape(-1)
    if scale.size != zp.size or scale.size == 0:
        raise ValueError(f"{what} {t.name!r}: {scale.size} scales but {zp.size} zero points")
    if not np.all(np.isfinite(scale)) or np.any(scale <= 0):
        raise ValueError(f"{what} {t.name!r}: scales must be finite and > 0")


def _check_activation(t: QTensor, what: str) -> None:
    _check_quant(t, what)
    if t.per_channel:
        raise ValueError(f"{what} {t.name!r} must be quantised per tensor")
    zp = int(np.asarray(t.zero_point).reshape(-1)[0])
    if not -128 <= zp <= 127:
        raise ValueError(f"{what} {t.name!r}: zero point {zp} is outside int8")


def _check_weights(graph: QGraph, op: QOp) -> None:
    w = graph.tensor(op.inputs[1])
    rank = {"CONV_2D": 4, "DEPTHWISE_CONV_2D": 4, "FULLY_CONNECTED": 2}[op.kind]
    if w.data is None or w.dtype != "int8" or len(w.shape) != rank:
        raise ValueError(f"weights {w.name!r} must be a constant int8 tensor of rank {rank}")
    _check_quant(w, "weights")
    if np.any(np.asarray(w.zero_point) != 0):
        raise ValueError(f"weights {w.name!r} must be symmetric (zero point 0)")
    channel_dim = 3 if op.kind == "DEPTHWISE_CONV_2D" else 0
    channels = w.shape[channel_dim]
    if w.per_channel and (w.scale.size != channels or w.quantized_dim != channel_dim):
        raise ValueError(
            f"weights {w.name!r}: per-channel scales must number {channels} along dimension {channel_dim}"
        )
    x = graph.tensor(op.inputs[0]).shape
    # grouped CONV_2D: input channels = filter in-channels x groups (reference_ops_struct)
    if op.kind == "CONV_2D" and (len(x) != 4 or x[3] % w.shape[3] or w.shape[0] % (x[3] // w.shape[3])):
        raise ValueError(f"weights {w.name!r} shape {list(w.shape)} does not fit input shape {list(x)}")
    if op.kind == "DEPTHWISE_CONV_2D":
        mult = int(op.options["depth_multiplier"])
        if len(x) != 4 or w.shape[0] != 1 or mult < 1 or w.shape[3] != x[3] * mult:
            raise ValueError(
                f"weights {w.name!r} shape {list(w.shape)} does not fit input {list(x)} x depth_multiplier {mult}"
            )
    if op.kind == "FULLY_CONNECTED" and (int(np.prod(x)) % w.shape[1] or x[-1] != w.shape[1]):
        raise ValueError(f"weights {w.name!r} shape {list(w.shape)} does not fit input shape {list(x)}")
    if len(op.inputs) > 2 and op.inputs[2]:
        b = graph.tensor(op.inputs[2])
        if b.data is None or b.dtype != "int32" or tuple(b.shape) != (channels,):
            raise ValueError(f"bias {b.name!r} must be a constant int32 tensor of shape [{channels}]")
        if b.scale is not None:
            expected = np.broadcast_to(ops.bias_scales(graph, op), (channels,)).astype(np.float64)
            given = np.broadcast_to(np.asarray(b.scale, dtype=np.float64).reshape(-1), (channels,))
            if np.any(np.abs(given - expected) > 1e-3 * expected):
                raise ValueError(f"bias {b.name!r} scales must equal input scale x weight scale")


def _check_options(op: QOp, node: str) -> None:
    o = op.options
    for key in OP_OPTIONS[op.kind]:
        if key not in o and key not in ("keep_num_dims", "keep_dims", "activation", "axis"):
            raise ValueError(f"missing option {key!r}")
    if "padding" in OP_OPTIONS[op.kind] and o["padding"] not in PADDINGS:
        raise ValueError(f"padding {o['padding']!r} is not one of {PADDINGS}")
    act = o.get("activation", "NONE")
    if "activation" in OP_OPTIONS[op.kind] and act not in ACTIVATIONS:
        raise UnsupportedOpError(node, op.kind, f"fused activation {act!r} (supported: {', '.join(ACTIVATIONS)})")
    if op.kind == "CONCATENATION" and act != "NONE":
        raise UnsupportedOpError(node, op.kind, f"fused activation {act!r} (TFLite's int8 concat allows none)")
    for key in ("stride_h", "stride_w", "dilation_h", "dilation_w", "filter_h", "filter_w", "depth_multiplier"):
        if key in OP_OPTIONS[op.kind] and (not isinstance(o[key], int | np.integer) or int(o[key]) < 1):
            raise ValueError(f"option {key}={o[key]!r} must be an integer >= 1")


def _check_op(graph: QGraph, op: QOp, node: str, shapes: dict[str, tuple[int, ...]]) -> None:
    low, high = _ARITY[op.kind]
    if not low <= len(op.inputs) <= high or len(op.outputs) != 1:
        raise ValueError(f"takes {low}..{high} inputs and 1 output, got {len(op.inputs)} and {len(op.outputs)}")
    _check_options(op, node)
    for n in op.inputs:
        if n and n not in shapes:
            t = graph.tensor(n)
            if t.data is None:
                raise ValueError(f"input {n!r} is used before any op produces it")
            if tuple(np.shape(t.data)) != tuple(t.shape):
                raise ValueError(f"constant {n!r} holds shape {list(np.shape(t.data))}, declared {list(t.shape)}")
            shapes[n] = tuple(t.shape)
    x, y = graph.tensor(op.inputs[0]), graph.tensor(op.outputs[0])
    in_type = "float32" if op.kind == "QUANTIZE" and x.dtype == "float32" else "int8"
    out_type = "float32" if op.kind == "DEQUANTIZE" else "int8"
    if x.dtype != in_type or y.dtype != out_type:
        raise ValueError(f"expects {in_type} -> {out_type}, got {x.dtype} -> {y.dtype}")
    if x.dtype == "int8":
        _check_activation(x, "input")
    if y.dtype == "int8":
        _check_activation(y, "output")
        act = op.options.get("activation", "NONE")
        if act != "NONE" and abs(float(np.float32(6.0) / np.float32(ops.scale_of(y)[0]))) >= 2.0**31:
            raise ValueError(f"output scale {ops.scale_of(y)[0]:g} is too small for a fused {act} "
                             "(TFLite refuses bounds that overflow int32)")
    if op.kind in ("CONV_2D", "DEPTHWISE_CONV_2D", "FULLY_CONNECTED"):
        _check_weights(graph, op)
    if op.kind == "ADD":
        _check_activation(graph.tensor(op.inputs[1]), "input")
        twice_max = 2.0 * max(float(ops.scale_of(graph.tensor(n))[0]) for n in op.inputs)
        if twice_max / ((1 << 20) * float(ops.scale_of(y)[0])) >= 1.0:
            raise ValueError("output scale is over 2**19 times smaller than an input scale "
                             "(TFLite's int8 ADD aborts on such a rescale)")
    if op.kind in ("MUL", "HARD_SWISH", "LOGISTIC"):
        _check_elementwise(graph, op, x, y)
    if op.kind == "CONCATENATION":
        for n in op.inputs:
            _check_activation(graph.tensor(n), "input")
    if op.kind in ("MEAN", "PAD"):
        c = graph.tensor(op.inputs[1])
        if c.data is None or c.dtype != "int32":
            raise ValueError(f"{'axes' if op.kind == 'MEAN' else 'paddings'} {c.name!r} must be a constant int32 tensor")
    if op.kind in ("PADV2", "GATHER"):
        _check_struct_constants(graph, op, x)
    if op.kind in _SAME_QUANT_OPS and not ops.same_quant(x, y):
        raise ValueError("input and output must share scale and zero point (TFLite's int8 kernel copies raw values)")
    if op.kind in ("CONV_2D", "DEPTHWISE_CONV_2D", "AVERAGE_POOL_2D", "MAX_POOL_2D") and len(x.shape) != 4:
        raise ValueError(f"needs a 4-D NHWC input, got shape {list(x.shape)}")
    inferred = infer_output_shape(graph, op, shapes)
    if tuple(inferred) != tuple(y.shape) or any(d < 1 for d in inferred):
        raise ValueError(f"output {y.name!r} is declared {list(y.shape)} but the op produces {list(inferred)}")
    shapes[op.outputs[0]] = tuple(inferred)


def _check_elementwise(graph: QGraph, op: QOp, x: QTensor, y: QTensor) -> None:
    """What TFLite's Prepare refuses for MUL / HARD_SWISH / LOGISTIC (reference_ops_elementwise)."""
    if op.kind == "MUL":
        _check_activation(graph.tensor(op.inputs[1]), "input")
    elif op.kind == "LOGISTIC" and (float(ops.scale_of(y)[0]) != ops.elementwise.LOGISTIC_SCALE
                                    or ops.zp_of(y) != ops.elementwise.LOGISTIC_ZERO_POINT):
        raise ValueError("int8 LOGISTIC needs output scale 1/256 and zero point -128 (TFLite's rule)")
    elif op.kind == "HARD_SWISH" and ops.elementwise.hard_swish_params(
            float(ops.scale_of(x)[0]), float(ops.scale_of(y)[0]))[1] > 0:
        raise ValueError("output scale is over 128 times smaller than the input scale "
                         "(TFLite's int8 HARD_SWISH refuses it)")


def _check_struct_constants(graph: QGraph, op: QOp, x: QTensor) -> None:
    """PADV2's paddings and fill value, GATHER's indices: constants of the right type."""
    c = graph.tensor(op.inputs[1])
    if c.data is None or c.dtype != "int32":
        raise ValueError(f"{'paddings' if op.kind == 'PADV2' else 'indices'} {c.name!r} must be a constant int32 tensor")
    if op.kind == "GATHER":
        axis = int(op.options.get("axis", 0))
        if not -len(x.shape) <= axis < len(x.shape):
            raise ValueError(f"axis {axis} is out of range for rank {len(x.shape)}")
        if c.data.ndim != 1 or c.data.size == 0 or c.data.min() < 0 or c.data.max() >= x.shape[axis]:
            raise ValueError(f"indices {c.name!r} must be a 1-D vector within [0, {x.shape[axis]})")
        return
    fill = graph.tensor(op.inputs[2])
    if fill.data is None or fill.dtype != "int8" or fill.data.size != 1:
        raise ValueError(f"fill value {fill.name!r} must be a constant int8 scalar")
    _check_quant(fill, "fill value")
    if not ops.same_quant(fill, x):
        raise ValueError("the fill value must share the input's scale and zero point (TFLite's PADV2)")


def check_graph(graph: QGraph) -> None:
    """Validate `graph`; raises UnsupportedOpError or GraphError naming graph, node and op."""
    shapes: dict[str, tuple[int, ...]] = {}
    for name in graph.inputs:
        t = _lookup(graph, name, "graph input")
        if t.data is not None or t.dtype not in ("int8", "float32"):
            raise GraphError(f"graph {graph.name!r}: input {name!r} must be an int8 or float32 activation")
        shapes[name] = tuple(t.shape)
    for index, op in enumerate(graph.ops):
        if op.kind not in OP_OPTIONS:
            raise UnsupportedOpError(_node(op, index), op.kind)
        for n in [*op.inputs, *op.outputs]:
            if n:
                _lookup(graph, n, f"node {_node(op, index)!r} ({op.kind}) tensor")
        if op.outputs and op.outputs[0] in shapes:
            raise GraphError(f"graph {graph.name!r}: node {_node(op, index)!r} ({op.kind}) overwrites {op.outputs[0]!r}")
        try:
            _check_op(graph, op, _node(op, index), shapes)
        except UnsupportedOpError:
            raise
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            detail = exc.args[0] if exc.args else repr(exc)
            raise GraphError(f"graph {graph.name!r}: node {_node(op, index)!r} ({op.kind}): {detail}") from None
    for name in graph.outputs:
        if name not in shapes or name in graph.inputs:
            raise GraphError(f"graph {graph.name!r}: output {name!r} is not produced by any op")


def _lookup(graph: QGraph, name: str, what: str) -> QTensor:
    if name not in graph.tensors:
        raise GraphError(f"graph {graph.name!r}: {what} {name!r} does not exist")
    return graph.tensors[name]

