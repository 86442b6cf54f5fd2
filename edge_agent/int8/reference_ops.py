"""The numpy int8 kernels of the reference engine, one function per op kind.

Each kernel is `kernel(graph, op, args) -> np.ndarray`: `args` are the op's input arrays in
`op.inputs` order (constants are the tensors' data, an omitted optional input is None).
They follow tflite-runtime 2.14's *reference* kernels (BuiltinRefOpResolver) bit for bit;
the per-op docstrings give the rule, and `conv_params` / `fc_params` expose the derived
integer parameters so native kernels can reuse them instead of re-deriving them.

CONV_2D and FULLY_CONNECTED accumulate in float64 BLAS matmuls (im2col for conv): every
product is an integer of magnitude <= 255 * 128 and every partial sum stays far below 2**53,
so the float64 sum is exactly the integer sum TFLite's int32 accumulator holds (as long as
that one does not overflow, which is undefined behaviour in TFLite too); it is much faster
than numpy's integer matmul. DEPTHWISE_CONV_2D sums kh * kw taps in int32 directly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from . import quant_math as qm
from .graph import QGraph, QOp, QTensor

Kernel = Callable[[QGraph, QOp, list], np.ndarray]


def scale_of(t: QTensor) -> np.ndarray:
    """The tensor's scales as float32 (what the .tflite file stores)."""
    if t.scale is None:
        raise ValueError(f"tensor {t.name!r} has no quantisation scale")
    return np.asarray(t.scale, dtype=np.float32).reshape(-1)


def zp_of(t: QTensor) -> int:
    if t.zero_point is None:
        raise ValueError(f"tensor {t.name!r} has no zero point")
    return int(np.asarray(t.zero_point).reshape(-1)[0])


def compute_padding(size: int, kernel: int, stride: int, dilation: int, padding: str) -> tuple[int, int]:
    """TFLite's output size and leading padding for one spatial dimension.

    effective = (kernel - 1) * dilation + 1; out = ceil(size / stride) for SAME,
    (size - effective + stride) / stride for VALID; total = max(0, (out - 1) * stride +
    effective - size); leading pad = total / 2 (the odd extra pixel goes at the end).
    """
    effective = (kernel - 1) * dilation + 1
    if padding == "SAME":
        out = (size + stride - 1) // stride
    elif padding == "VALID":
        out = (size - effective + stride) // stride
    else:
        raise ValueError(f"unknown padding {padding!r} (expected SAME or VALID)")
    total = max(0, (out - 1) * stride + effective - size)
    return out, total // 2


@dataclass(frozen=True)
class WindowParams:
    """Geometry of a sliding-window op (conv, depthwise, pools) on NHWC input."""

    kernel: tuple[int, int]
    stride: tuple[int, int]
    dilation: tuple[int, int]
    pad: tuple[int, int]  # leading (top, left) padding
    out_hw: tuple[int, int]


def window_params(op: QOp, in_hw: Sequence[int], kernel: tuple[int, int]) -> WindowParams:
    o = op.options
    stride = (int(o["stride_h"]), int(o["stride_w"]))
    dilation = (int(o.get("dilation_h", 1)), int(o.get("dilation_w", 1)))
    oh, ph = compute_padding(in_hw[0], kernel[0], stride[0], dilation[0], o["padding"])
    ow, pw = compute_padding(in_hw[1], kernel[1], stride[1], dilation[1], o["padding"])
    return WindowParams(kernel, stride, dilation, (ph, pw), (oh, ow))


@dataclass(frozen=True)
class ConvParams:
    """Integer parameters of CONV_2D / DEPTHWISE_CONV_2D / FULLY_CONNECTED (per channel)."""

    input_offset: int  # -input zero point
    output_zero_point: int
    multiplier: np.ndarray  # int64 (C,), Q31
    shift: np.ndarray  # int64 (C,), positive = left
    act_min: int
    act_max: int


def _requant_params(graph: QGraph, op: QOp, real: np.ndarray) -> ConvParams:
    x, y = graph.tensor(op.inputs[0]), graph.tensor(op.outputs[0])
    m, s = qm.quantize_multiplier(real)
    act_min, act_max = qm.activation_range(op.options.get("activation", "NONE"), scale_of(y)[0], zp_of(y))
    return ConvParams(-zp_of(x), zp_of(y), m, s, act_min, act_max)


def conv_params(graph: QGraph, op: QOp) -> ConvParams:
    """CONV_2D / DEPTHWISE_CONV_2D: real[c] = double(s_in) * double(s_w[c]) / double(s_out)."""
    x, w, y = graph.tensor(op.inputs[0]), graph.tensor(op.inputs[1]), graph.tensor(op.outputs[0])
    channels = w.shape[0] if op.kind == "CONV_2D" else w.shape[3]
    ws = np.broadcast_to(scale_of(w).astype(np.float64), (channels,))
    real = np.float64(scale_of(x)[0]) * ws / np.float64(scale_of(y)[0])
    return _requant_params(graph, op, real)


def fc_params(graph: QGraph, op: QOp) -> ConvParams:
    """FULLY_CONNECTED: per channel as conv; per tensor the product s_in * s_w is float32
    (GetQuantizedConvolutionMultipler): real = double(float32(s_in * s_w)) / double(s_out)."""
    x, w, y = graph.tensor(op.inputs[0]), graph.tensor(op.inputs[1]), graph.tensor(op.outputs[0])
    s_in, s_out, ws = scale_of(x)[0], scale_of(y)[0], scale_of(w)
    if ws.size > 1:
        real = np.float64(s_in) * ws.astype(np.float64) / np.float64(s_out)
    else:
        real = np.full(w.shape[0], np.float64(np.float32(s_in * ws[0])) / np.float64(s_out))
    return _requant_params(graph, op, real)


def bias_scales(graph: QGraph, op: QOp) -> np.ndarray:
    """A bias's scales: float32(double(s_in) * double(s_w[c])), one when weights are per tensor."""
    s_in = np.float64(scale_of(graph.tensor(op.inputs[0]))[0])
    return (s_in * scale_of(graph.tensor(op.inputs[1])).astype(np.float64)).astype(np.float32)


def _padded(x: np.ndarray, wp: WindowParams, fill: int) -> np.ndarray:
    """x (N,H,W,C) padded so every tap slice of the window fits; `fill` outside the image."""
    (kh, kw), (sh, sw), (dh, dw) = wp.kernel, wp.stride, wp.dilation
    (oh, ow), (ph, pw) = wp.out_hw, wp.pad
    need_h = (oh - 1) * sh + (kh - 1) * dh + 1
    need_w = (ow - 1) * sw + (kw - 1) * dw + 1
    bottom = max(0, need_h - x.shape[1] - ph)
    right = max(0, need_w - x.shape[2] - pw)
    return np.pad(x, ((0, 0), (ph, bottom), (pw, right), (0, 0)), constant_values=fill)


def _taps(xp: np.ndarray, wp: WindowParams):
    """Yield (ky, kx, strided view (N,OH,OW,C)) for every filter tap."""
    (kh, kw), (sh, sw), (dh, dw), (oh, ow) = wp.kernel, wp.stride, wp.dilation, wp.out_hw
    for ky in range(kh):
        for kx in range(kw):
            y0, x0 = ky * dh, kx * dw
            yield ky, kx, xp[:, y0 : y0 + (oh - 1) * sh + 1 : sh, x0 : x0 + (ow - 1) * sw + 1 : sw, :]


def conv_accumulate(x: np.ndarray, w: np.ndarray, wp: WindowParams, input_offset: int) -> np.ndarray:
    """CONV_2D accumulator (N,OH,OW,O) int64 without bias: sum over in-image taps of
    (x + input_offset) * w[o]; out-of-image taps are skipped (as if x = input zero point)."""
    xp = _padded(x.astype(np.float64) + input_offset, wp, 0)
    cols = np.concatenate([tap for _, _, tap in _taps(xp, wp)], axis=-1)
    acc = cols.reshape(-1, cols.shape[-1]) @ w.reshape(w.shape[0], -1).astype(np.float64).T
    return np.rint(acc).astype(np.int64).reshape(x.shape[0], wp.out_hw[0], wp.out_hw[1], w.shape[0])


def depthwise_accumulate(
    x: np.ndarray, w: np.ndarray, wp: WindowParams, input_offset: int, depth_multiplier: int
) -> np.ndarray:
    """DEPTHWISE_CONV_2D accumulator (N,OH,OW,C*M) int64 without bias: output channel
    oc = ic * depth_multiplier + m sees only input channel ic."""
    xp = _padded(x.astype(np.int32) + input_offset, wp, 0)
    w32 = w.astype(np.int32)
    acc = np.zeros((x.shape[0], wp.out_hw[0], wp.out_hw[1], w.shape[3]), dtype=np.int32)
    for ky, kx, tap in _taps(xp, wp):
        acc += (np.repeat(tap, depth_multiplier, axis=-1) if depth_multiplier > 1 else tap) * w32[0, ky, kx]
    return acc.astype(np.int64)


def fc_accumulate(x: np.ndarray, w: np.ndarray, input_offset: int) -> np.ndarray:
    """FULLY_CONNECTED accumulator (numel / in, out) int64 without bias."""
    rows = x.reshape(-1, w.shape[1]).astype(np.float64) + input_offset
    return np.rint(rows @ w.astype(np.float64).T).astype(np.int64)


def _epilogue(acc: np.ndarray, bias: np.ndarray | None, p: ConvParams) -> np.ndarray:
    if bias is not None:
        acc = acc + bias.astype(np.int64)
    return qm.requantize(acc, p.multiplier, p.shift, p.output_zero_point, p.act_min, p.act_max)


def conv_2d(graph: QGraph, op: QOp, args: list) -> np.ndarray:
    """CONV_2D (reference_integer_ops::ConvPerChannel): acc = conv_accumulate + bias[c];
    out = clamp(MBQM(acc, m[c], s[c]) + zp_out, act_min, act_max)."""
    x, w, bias = args[0], args[1], args[2] if len(args) > 2 else None
    p = conv_params(graph, op)
    wp = window_params(op, x.shape[1:3], (w.shape[1], w.shape[2]))
    if x.shape[3] != w.shape[3]:  # grouped convolution (reference_ops_struct)
        return _epilogue(struct.grouped_accumulate(x, w, wp, p.input_offset), bias, p)
    return _epilogue(conv_accumulate(x, w, wp, p.input_offset), bias, p)


def depthwise_conv_2d(graph: QGraph, op: QOp, args: list) -> np.ndarray:
    """DEPTHWISE_CONV_2D (reference_integer_ops::DepthwiseConvPerChannel), as conv_2d."""
    x, w, bias = args[0], args[1], args[2] if len(args) > 2 else None
    p = conv_params(graph, op)
    wp = window_params(op, x.shape[1:3], (w.shape[1], w.shape[2]))
    acc = depthwise_accumulate(x, w, wp, p.input_offset, int(op.options.get("depth_multiplier", 1)))
    return _epilogue(acc, bias, p)


def fully_connected(graph: QGraph, op: QOp, args: list) -> np.ndarray:
    """FULLY_CONNECTED (reference_integer_ops::FullyConnected[PerChannel]): the input is
    flattened to (numel / in, in); acc = (x + input_offset) @ w.T + bias, then requantised."""
    x, w, bias = args[0], args[1], args[2] if len(args) > 2 else None
    p = fc_params(graph, op)
    out = _epilogue(fc_accumulate(x, w, p.input_offset), bias, p)
    if op.options.get("keep_num_dims", False):
        return out.reshape(*x.shape[:-1], w.shape[0])
    return out


def add(graph: QGraph, op: QOp, args: list) -> np.ndarray:
    """ADD, int8 (reference_integer_ops::Add), with left_shift = 20:
    twice_max = 2 * max(s1, s2); real_i = s_i / twice_max; real_out = twice_max / (2**20 * s_out)
    (all double); v_i = MBQMSmallerThanOneExp((x_i - zp_i) * 2**20, m_i, e_i);
    out = clamp(MBQMSmallerThanOneExp(v_1 + v_2, m_out, e_out) + zp_out, act_min, act_max).
    Inputs broadcast numpy-style."""
    t1, t2, y = (graph.tensor(n) for n in (op.inputs[0], op.inputs[1], op.outputs[0]))
    s1, s2, so = (np.float64(scale_of(t)[0]) for t in (t1, t2, y))
    twice_max = 2.0 * max(s1, s2)
    m1, e1 = qm.quantize_multiplier(s1 / twice_max)
    m2, e2 = qm.quantize_multiplier(s2 / twice_max)
    mo, eo = qm.quantize_multiplier(twice_max / ((1 << 20) * so))
    v1 = qm.multiply_by_quantized_multiplier_smaller_than_one_exp(
        (args[0].astype(np.int64) - zp_of(t1)) << 20, m1, e1)
    v2 = qm.multiply_by_quantized_multiplier_smaller_than_one_exp(
        (args[1].astype(np.int64) - zp_of(t2)) << 20, m2, e2)
    out = qm.multiply_by_quantized_multiplier_smaller_than_one_exp(v1 + v2, mo, eo) + zp_of(y)
    lo, hi = qm.activation_range(op.options.get("activation", "NONE"), scale_of(y)[0], zp_of(y))
    return np.clip(out, lo, hi).astype(np.int8)


def _pool_geometry(graph: QGraph, op: QOp, x: np.ndarray) -> tuple[WindowParams, int, int]:
    kernel = (int(op.options["filter_h"]), int(op.options["filter_w"]))
    y = graph.tensor(op.outputs[0])
    lo, hi = qm.activation_range(op.options.get("activation", "NONE"), scale_of(y)[0], zp_of(y))
    return window_params(op, x.shape[1:3], kernel), lo, hi


def average_pool_2d(graph: QGraph, op: QOp, args: list) -> np.ndarray:
    """AVERAGE_POOL_2D (reference_integer_ops::AveragePool): sum the raw int8 values of the
    in-image taps (count = how many), avg = (sum + count/2) / count if sum > 0 else
    (sum - count/2) / count with C division; clamp to the activation range. Scales are
    ignored: input and output must share them."""
    x = args[0]
    wp, lo, hi = _pool_geometry(graph, op, x)
    xp = _padded(x.astype(np.int32), wp, 0)
    ones = _padded(np.ones((1, *x.shape[1:3], 1), dtype=np.int32), wp, 0)
    total = sum(tap for _, _, tap in _taps(xp, wp))
    count = sum(tap for _, _, tap in _taps(ones, wp))
    half = count // 2
    avg = np.where(total > 0, qm.trunc_div(total + half, count), -((half - total) // count))
    return np.clip(avg, lo, hi).astype(np.int8)


def max_pool_2d(graph: QGraph, op: QOp, args: list) -> np.ndarray:
    """MAX_POOL_2D (reference_integer_ops::MaxPool): max of the in-image taps, then clamp."""
    x = args[0]
    wp, lo, hi = _pool_geometry(graph, op, x)
    xp = _padded(x.astype(np.int32), wp, -1 << 20)
    out = np.maximum.reduce([tap for _, _, tap in _taps(xp, wp)])
    return np.clip(out, lo, hi).astype(np.int8)


def resolve_axes(axes: np.ndarray, rank: int) -> tuple[int, ...]:
    resolved: list[int] = []
    for a in np.asarray(axes).reshape(-1).tolist():
        a = a + rank if a < 0 else a
        if not 0 <= a < rank:
            raise ValueError(f"MEAN axis {a} is out of range for rank {rank}")
        if a not in resolved:
            resolved.append(a)
    return tuple(resolved)


def mean(graph: QGraph, op: QOp, args: list) -> np.ndarray:
    """MEAN, int8 (reference_ops::QuantizedMeanOrSum, used for every axis set in 2.14):
    (m, s) = QuantizeMultiplier(double(s_in) / double(s_out)); n = elements reduced;
    k = min(floor(log2(n)), 32, 31 + s); m' = (int64(m) << k) / n (C division); s' = s - k;
    out = clamp(MBQM(sum(raw x) - zp_in * n, m', s') + zp_out, -128, 127)."""
    x, axes_data = args[0], args[1]
    tx, ty = graph.tensor(op.inputs[0]), graph.tensor(op.outputs[0])
    keep = bool(op.options.get("keep_dims", False))
    axes = resolve_axes(axes_data, x.ndim)
    if not axes:  # TFLite copies the input unchanged
        return x.copy()
    n = int(np.prod([x.shape[a] for a in axes]))
    m, s = qm.quantize_multiplier(np.float64(scale_of(tx)[0]) / np.float64(scale_of(ty)[0]))
    m, s = int(m), int(s)
    k = min(n.bit_length() - 1, 32, 31 + s)
    m, s = (m << k) // n, s - k
    total = x.astype(np.int64).sum(axis=axes, keepdims=keep) - zp_of(tx) * n
    out = qm.multiply_by_quantized_multiplier(total, m, s) + zp_of(ty)
    return np.clip(out, qm.INT8_MIN, qm.INT8_MAX).astype(np.int8)


def reshape(graph: QGraph, op: QOp, args: list) -> np.ndarray:
    """RESHAPE: a copy. `new_shape` may hold one -1; a batch other than the declared one is
    carried through when new_shape[0] equals the declared input batch."""
    x = args[0]
    shape = [int(d) for d in op.options["new_shape"]]
    declared = graph.tensor(op.inputs[0]).shape
    if shape and declared and x.shape[0] != declared[0] and shape[0] == declared[0]:
        shape[0] = x.shape[0]
    return x.reshape(shape)


def requantize_tensor(x: np.ndarray, src: QTensor, dst: QTensor) -> np.ndarray:
    """QUANTIZE int8 -> int8 (reference_ops::Requantize): real = double(s_in) / double(s_out);
    out = clamp(MBQM(x - zp_in, m, s) + zp_out, -128, 127)."""
    m, s = qm.quantize_multiplier(np.float64(scale_of(src)[0]) / np.float64(scale_of(dst)[0]))
    out = qm.multiply_by_quantized_multiplier(x.astype(np.int64) - zp_of(src), m, s) + zp_of(dst)
    return np.clip(out, qm.INT8_MIN, qm.INT8_MAX).astype(np.int8)


def same_quant(a: QTensor, b: QTensor) -> bool:
    return bool(scale_of(a)[0] == scale_of(b)[0] and zp_of(a) == zp_of(b))


def concatenation(graph: QGraph, op: QOp, args: list) -> np.ndarray:
    """CONCATENATION: TFLite's int8 kernel requires every input to share the output's scale
    and zero point, so the writer puts a QUANTIZE (requantise) in front of any input that does
    not; here such an input is requantised by the same rule. Then concat and clamp."""
    y = graph.tensor(op.outputs[0])
    parts = []
    for name, arr in zip(op.inputs, args, strict=True):
        t = graph.tensor(name)
        parts.append(arr if same_quant(t, y) else requantize_tensor(arr, t, y))
    axis = int(op.options.get("axis", -1))
    out = np.concatenate(parts, axis=axis)
    lo, hi = qm.activation_range(op.options.get("activation", "NONE"), scale_of(y)[0], zp_of(y))
    return np.clip(out, lo, hi).astype(np.int8)


def pad(graph: QGraph, op: QOp, args: list) -> np.ndarray:
    """PAD, int8: pads with the output zero point; paddings is an int32 [rank, 2] constant."""
    x, paddings = args[0], np.asarray(args[1]).reshape(-1, 2)
    return np.pad(x, [tuple(int(v) for v in row) for row in paddings], constant_values=zp_of(graph.tensor(op.outputs[0])))


def quantize(graph: QGraph, op: QOp, args: list) -> np.ndarray:
    """QUANTIZE: float32 -> int8 by quant_math.quantize, or int8 -> int8 requantisation."""
    src, dst = graph.tensor(op.inputs[0]), graph.tensor(op.outputs[0])
    if src.dtype == "int8":
        return requantize_tensor(args[0], src, dst)
    return qm.quantize(args[0], scale_of(dst)[0], zp_of(dst))


def dequantize(graph: QGraph, op: QOp, args: list) -> np.ndarray:
    """DEQUANTIZE: int8 -> float32 by quant_math.dequantize."""
    src = graph.tensor(op.inputs[0])
    return qm.dequantize(args[0], scale_of(src)[0], zp_of(src))


KERNELS: dict[str, Kernel] = {
    "CONV_2D": conv_2d,
    "DEPTHWISE_CONV_2D": depthwise_conv_2d,
    "FULLY_CONNECTED": fully_connected,
    "ADD": add,
    "AVERAGE_POOL_2D": average_pool_2d,
    "MAX_POOL_2D": max_pool_2d,
    "MEAN": mean,
    "RESHAPE": reshape,
    "CONCATENATION": concatenation,
    "PAD": pad,
    "QUANTIZE": quantize,
    "DEQUANTIZE": dequantize,
}

from . import reference_ops_struct as struct  # noqa: E402 - it imports this module's helpers

KERNELS.update(struct.STRUCT_KERNELS)

from . import reference_ops_elementwise as elementwise  # noqa: E402 - MUL, HARD_SWISH, LOGISTIC

KERNELS.update(elementwise.KERNELS)
