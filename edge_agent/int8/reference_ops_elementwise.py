"""int8 reference kernels of the elementwise ops MobileNetV3 / EfficientNet need: MUL,
HARD_SWISH and LOGISTIC, bit-exact with tflite-runtime 2.14 (reference and default resolvers).

Registered into `reference_ops.KERNELS`. Every output depends only on the int8 input
value(s), so each op is evaluated once for all of them (HARD_SWISH and LOGISTIC: 256
values, MUL: 256 x 256 pairs; a table cached per quantisation) and then gathered by the
inputs' bytes: exact and about as fast as a native kernel would be, which is why the native
engine uses these kernels as its documented fallback.

This module must not import reference_ops (which imports it): the two helpers below repeat
`scale_of` / `zp_of`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable
from functools import lru_cache

import numpy as np

from . import quant_math as qm
from .graph import QGraph, QOp, QTensor

INT16_MIN, INT16_MAX = -(2**15), 2**15 - 1
LOGISTIC_SCALE = 1.0 / 256.0  # TFLite's int8 LOGISTIC refuses any other output scale...
LOGISTIC_ZERO_POINT = -128  # ...and zero point


def _scale(t: QTensor) -> float:
    return float(np.asarray(t.scale, dtype=np.float32).reshape(-1)[0])


def _zp(t: QTensor) -> int:
    return int(np.asarray(t.zero_point).reshape(-1)[0])


# ------------------------------------------------------------------------------- MUL
def mul_params(graph: QGraph, op: QOp) -> tuple[int, int]:
    """MUL's Prepare: real = double(s1) * double(s2) / double(s_out); QuantizeMultiplier."""
    t1, t2, y = (graph.tensor(n) for n in (op.inputs[0], op.inputs[1], op.outputs[0]))
    real = np.float64(_scale(t1)) * np.float64(_scale(t2)) / np.float64(_scale(y))
    m, s = qm.quantize_multiplier(real)
    return int(m), int(s)


_BYTE_VALUES = np.arange(256, dtype=np.uint8).view(np.int8)  # the int8 value of each byte


def _by_byte(table: np.ndarray) -> np.ndarray:
    """A table indexed by x + 128 -> indexed by x's byte (x.view(uint8)), no int64 pass."""
    return np.ascontiguousarray(table[_BYTE_VALUES.astype(np.int64) + 128])


@lru_cache(maxsize=512)
def mul_table(zp1: int, zp2: int, m: int, s: int, zp_out: int, lo: int, hi: int) -> np.ndarray:
    """MUL's output for every pair of input bytes, (256, 256) int8."""
    v = _BYTE_VALUES.astype(np.int64)
    prod = (v[:, None] - zp1) * (v[None, :] - zp2)
    out = qm.multiply_by_quantized_multiplier(prod, m, s) + zp_out
    return np.clip(out, lo, hi).astype(np.int8)


def mul(graph: QGraph, op: QOp, args: list) -> np.ndarray:
    """MUL, int8 (reference_integer_ops::Mul / BroadcastMul): inputs broadcast numpy-style;
    out = clamp(MBQM((x1 - zp1) * (x2 - zp2), m, s) + zp_out, act_min, act_max)."""
    t1, t2, y = (graph.tensor(n) for n in (op.inputs[0], op.inputs[1], op.outputs[0]))
    m, s = mul_params(graph, op)
    lo, hi = qm.activation_range(op.options.get("activation", "NONE"), _scale(y), _zp(y))
    table = mul_table(_zp(t1), _zp(t2), m, s, _zp(y), lo, hi)
    a, b = (np.asarray(v, dtype=np.int8).view(np.uint8) for v in args[:2])
    return table.reshape(-1)[(a.astype(np.intp) << 8) | b]  # one flat gather, broadcasting


# ------------------------------------------------------------------------ HARD_SWISH
def _srdhm16(a: np.ndarray, b: int) -> np.ndarray:
    """gemmlowp SaturatingRoundingDoublingHighMul on int16: round(a * b / 2**15), ties up,
    by (a * b + nudge) / 2**15 with C truncation; -32768 * -32768 saturates."""
    ab = a.astype(np.int64) * b
    nudge = np.where(ab >= 0, 1 << 14, 1 - (1 << 14))
    r = qm.trunc_div(ab + nudge, 1 << 15)
    return np.where((a == INT16_MIN) & (b == INT16_MIN), INT16_MAX, r)


def _sdhm16(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """TFLite's SaturatingDoublingHighMul on int16 (SQDMULH): a * b / 2**15, truncated."""
    r = qm.trunc_div(a.astype(np.int64) * b, 1 << 15)
    return np.where((a == INT16_MIN) & (b == INT16_MIN), INT16_MAX, r)


def _rdbp16(x: np.ndarray, exponent: int) -> np.ndarray:
    """gemmlowp RoundingDivideByPOT on int16: the mask 2**e - 1 is cast to int16 (so for
    e >= 16 it is all ones), threshold = (mask >> 1) + (x < 0)."""
    mask = (1 << exponent) - 1
    mask = ((mask + 2**15) & 0xFFFF) - 2**15
    threshold = (mask >> 1) + (x < 0)
    return (x >> exponent) + ((x & mask) > threshold)


def _saturating_left_shift16(x: np.ndarray, amount: int) -> np.ndarray:
    return np.clip(x * (1 << amount), INT16_MIN, INT16_MAX)


def _downscale_to_int16(m32: int) -> int:
    """DownScaleInt32ToInt16Multiplier: (m + 2**15) >> 16, saturating near INT32_MAX."""
    if m32 >= qm.INT32_MAX - (1 << 15):
        return INT16_MAX
    return (m32 + (1 << 15)) >> 16


def hard_swish_params(s_in: float, s_out: float) -> tuple[int, int, int, int]:
    """HardSwishPrepare (float32 arithmetic, then QuantizeMultiplier in double):
    hires = float32(1/128) * s_in; out_mult = hires / s_out; reluish_mult = hires / (3/32768);
    each -> (int16 multiplier by DownScaleInt32ToInt16Multiplier, exponent).
    Returns (out_m16, out_exp, reluish_m16, reluish_exp); TFLite requires out_exp <= 0."""
    f32 = np.float32
    hires = f32(1.0 / 128.0) * f32(s_in)
    out_mult = hires / f32(s_out)
    reluish = hires / (f32(3.0) / f32(32768.0))
    (om, oe), (rm, re) = (qm.quantize_multiplier(np.float64(v)) for v in (out_mult, reluish))
    return _downscale_to_int16(int(om)), int(oe), _downscale_to_int16(int(rm)), int(re)


@lru_cache(maxsize=256)
def hard_swish_table(s_in: float, zp_in: int, s_out: float, zp_out: int) -> np.ndarray:
    """reference_ops::HardSwish (quantized) for every int8 input; indexed by x + 128."""
    out_m, out_e, rel_m, rel_e = hard_swish_params(s_in, s_out)
    if out_e > 0:
        raise ValueError(f"HARD_SWISH output scale {s_out:g} is too small for input scale {s_in:g} "
                         "(TFLite requires output_multiplier_exponent <= 0)")
    x = np.arange(-128, 128, dtype=np.int64) - zp_in
    hires = x * 128  # input_value_on_hires_input_scale, fits int16 (|x| <= 255)
    preshift = _srdhm16(hires, out_m)
    reluish = hires
    if rel_e > 0:
        reluish = _saturating_left_shift16(reluish, rel_e - 1)
    reluish = _srdhm16(reluish, rel_m)
    if rel_e > 0:
        reluish = _saturating_left_shift16(reluish, 1)
    if rel_e < 0:
        reluish = _rdbp16(reluish, -rel_e)
    reluish = (reluish + (1 << 15)) >> 1
    out = _rdbp16(_sdhm16(reluish, preshift), -out_e) + zp_out
    return np.clip(out, qm.INT8_MIN, qm.INT8_MAX).astype(np.int8)


def hard_swish(graph: QGraph, op: QOp, args: list) -> np.ndarray:
    """HARD_SWISH, int8: x * relu6(x + 3) / 6 in int16 fixed point (see hard_swish_table)."""
    x, y = graph.tensor(op.inputs[0]), graph.tensor(op.outputs[0])
    table = _byte_table(hard_swish_table, _scale(x), _zp(x), _scale(y), _zp(y))
    return table[np.asarray(args[0], dtype=np.int8).view(np.uint8)]


# -------------------------------------------------------------------------- LOGISTIC
def _libm_expf() -> Callable[[float], float] | None:
    """The C library's expf, the function TFLite's std::exp(float) calls: numpy's float32
    exp may differ from it in the last bit, which can move a table entry by one."""
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
        fn = lib.expf
    except (OSError, AttributeError):  # pragma: no cover - no C math library found
        return None
    fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float]
    return fn


_EXPF = _libm_expf()


@lru_cache(maxsize=256)
def logistic_table(s_in: float, zp_in: int, s_out: float, zp_out: int) -> np.ndarray:
    """LOGISTIC int8 (activations.cc PopulateLookupTable, used by both the reference and the
    optimized kernel in 2.14), all in float32: v = s_in * (x - zp_in);
    t = 1 / (1 + expf(-v)); q = clamp(int(round(t * (1 / s_out)) + zp_out), -128, 127)."""
    f32 = np.float32
    v = f32(s_in) * (np.arange(-128, 128) - zp_in).astype(f32)
    e = np.array([_EXPF(float(-a)) for a in v], dtype=f32) if _EXPF is not None else np.exp(-v)
    t = f32(1.0) / (f32(1.0) + e)
    rescaled = qm.round_half_away(t * (f32(1.0) / f32(s_out)))
    q = (rescaled + f32(zp_out)).astype(np.int64)
    return np.clip(q, qm.INT8_MIN, qm.INT8_MAX).astype(np.int8)


def logistic(graph: QGraph, op: QOp, args: list) -> np.ndarray:
    """LOGISTIC, int8: a 256-entry table (see logistic_table); output scale 1/256, zp -128."""
    x, y = graph.tensor(op.inputs[0]), graph.tensor(op.outputs[0])
    table = _byte_table(logistic_table, _scale(x), _zp(x), _scale(y), _zp(y))
    return table[np.asarray(args[0], dtype=np.int8).view(np.uint8)]


@lru_cache(maxsize=512)
def _byte_table(make: Callable[..., np.ndarray], *key: float) -> np.ndarray:
    return _by_byte(make(*key))


# ----------------------------------------------------------- SiLU for the native engine
LOOKUP = "LOOKUP_TABLE"  # an engine-internal op (never written to .tflite): out = table[byte]


def fuse_silu(graph: QGraph) -> QGraph:
    """A copy of `graph` where each LOGISTIC whose output feeds only a MUL with the LOGISTIC's
    own input (SiLU / Swish, x * sigmoid(x): EfficientNet's activation) is folded with that
    MUL into one LOOKUP_TABLE op: both are functions of x's byte alone, so the composite
    256-entry table is exact and costs one gather instead of two ops and a temporary."""
    consumers: dict[str, list[int]] = {}
    for i, op in enumerate(graph.ops):
        for n in op.inputs:
            consumers.setdefault(n, []).append(i)
    drop: set[int] = set()
    fused: dict[int, QOp] = {}
    for i, op in enumerate(graph.ops):
        users = consumers.get(op.outputs[0], [])
        if op.kind != "LOGISTIC" or op.outputs[0] in graph.outputs or len(users) != 1:
            continue
        mul_op = graph.ops[users[0]]
        x, sig = op.inputs[0], op.outputs[0]
        if mul_op.kind != "MUL" or sorted(mul_op.inputs) != sorted([x, sig]) or users[0] in fused:
            continue
        tx, ts, y = graph.tensor(x), graph.tensor(sig), graph.tensor(mul_op.outputs[0])
        if tuple(tx.shape) != tuple(y.shape):
            continue
        sig_bytes = _byte_table(logistic_table, _scale(tx), _zp(tx), _scale(ts), _zp(ts)).view(np.uint8)
        m, s = mul_params(graph, mul_op)
        lo, hi = qm.activation_range(mul_op.options.get("activation", "NONE"), _scale(y), _zp(y))
        both = mul_table(_zp(graph.tensor(mul_op.inputs[0])), _zp(graph.tensor(mul_op.inputs[1])), m, s, _zp(y), lo, hi)
        byte = np.arange(256)
        table = both[byte, sig_bytes] if mul_op.inputs[0] == x else both[sig_bytes, byte]
        drop.add(i)
        fused[users[0]] = QOp(LOOKUP, [x], list(mul_op.outputs), {"table": np.ascontiguousarray(table)},
                              name=mul_op.name)
    ops = [fused.get(j, op) for j, op in enumerate(graph.ops) if j not in drop]
    return QGraph(dict(graph.tensors), ops, list(graph.inputs), list(graph.outputs), graph.name)


def lookup_table(graph: QGraph, op: QOp, args: list) -> np.ndarray:
    return op.options["table"][np.asarray(args[0], dtype=np.int8).view(np.uint8)]


NATIVE_KERNELS = {LOOKUP: lookup_table}  # for engines that run fuse_silu's graphs


KERNELS = {"MUL": mul, "HARD_SWISH": hard_swish, "LOGISTIC": logistic}
