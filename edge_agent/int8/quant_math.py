"""TFLite's integer arithmetic as pure, vectorised numpy.

These are the exact rules of tensorflow/lite/kernels/internal/{quantization_util.cc, common.h}
and gemmlowp's fixedpoint.h as built into tflite-runtime 2.14 (the default "double rounding"
build; TFLITE_SINGLE_ROUNDING is off). The native C kernels implement the same rules, so
every function states its rule precisely. Notation: `>>` is an arithmetic (sign-propagating)
shift; `/` on integers is C division (truncates toward zero); `round()` is C's std::round
(half away from zero). All integer work is done in int64 so no intermediate overflows; where
C would overflow int32 the rule says what we do.
"""

from __future__ import annotations

import numpy as np

INT8_MIN, INT8_MAX = -128, 127
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1

ArrayLike = np.ndarray | int | float


def round_half_away(x: ArrayLike) -> np.ndarray:
    """std::round / TfLiteRound: nearest integer, ties away from zero, in x's float type.

    Computed as trunc(x) + sign(x) when |x - trunc(x)| >= 0.5 (both steps exact), not as
    floor(x + 0.5), which is wrong for 0.49999999999999994 and for negative ties.
    """
    x = np.asarray(x)
    t = np.trunc(x)
    with np.errstate(invalid="ignore"):  # inf - inf is NaN, not a tie: inf stays inf
        return np.where(np.abs(x - t) >= 0.5, t + np.sign(x), t).astype(x.dtype)


def trunc_div(a: np.ndarray, b: ArrayLike) -> np.ndarray:
    """C integer division a / b (b > 0): the quotient truncated toward zero."""
    a = np.asarray(a, dtype=np.int64)
    q = np.abs(a) // b
    return np.where(a < 0, -q, q)


def wrap_int32(x: ArrayLike) -> np.ndarray:
    """Two's-complement wrap of an int64 value into int32 range (what int32 hardware does)."""
    x = np.asarray(x, dtype=np.int64)
    return ((x + 2**31) & 0xFFFFFFFF) - 2**31


def quantize_multiplier(real: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """QuantizeMultiplier: a double `real` -> (int32 multiplier, int shift), per element.

    Rule: if real == 0: (0, 0). Else (q, shift) = frexp(real) with 0.5 <= |q| < 1;
    m = round(q * 2**31) as int64; if m == 2**31: m = 2**30, shift += 1;
    if shift < -31: m = 0, shift = 0 (flush tiny multipliers to zero).
    Then real ~= m * 2**(shift - 31). `real` must be computed in double (float64) exactly as
    the op's Prepare does (see reference_ops: conv/FC/ADD/MEAN each state their formula).
    """
    real = np.asarray(real, dtype=np.float64)
    q, shift = np.frexp(real)
    m = round_half_away(q * float(1 << 31)).astype(np.int64)
    shift = shift.astype(np.int64)
    carry = m == (1 << 31)
    m = np.where(carry, m // 2, m)
    shift = np.where(carry, shift + 1, shift)
    tiny = shift < -31
    m = np.where(tiny | (real == 0), 0, m)
    shift = np.where(tiny | (real == 0), 0, shift)
    return m.astype(np.int64), shift.astype(np.int64)


def saturating_rounding_doubling_high_mul(a: ArrayLike, b: ArrayLike) -> np.ndarray:
    """gemmlowp SaturatingRoundingDoublingHighMul(int32 a, int32 b) -> int32.

    Rule: if a == b == INT32_MIN: INT32_MAX. Else p = int64(a) * int64(b);
    nudge = 2**30 if p >= 0 else 1 - 2**30; result = (p + nudge) / 2**31 with C division
    (truncation toward zero, NOT an arithmetic shift). Net effect: round(a * b / 2**31) with
    ties toward +infinity (1.5 -> 2, -1.5 -> -1).
    """
    a = np.asarray(a, dtype=np.int64)
    b = np.asarray(b, dtype=np.int64)
    # The C rule folds into one floor: for p < 0, (p + 1 - 2**30) / 2**31 truncated is
    # (p + 1 - 2**30 + 2**31 - 1) >> 31 = (p + 2**30) >> 31, the same as for p >= 0. Two
    # passes over the activations instead of seven: most of the reference's requantisation.
    r = a * b
    r += 1 << 30
    r >>= 31
    if np.any(b == INT32_MIN):
        r = np.where((a == INT32_MIN) & (b == INT32_MIN), INT32_MAX, r)
    return r


def rounding_divide_by_pot(x: ArrayLike, exponent: ArrayLike) -> np.ndarray:
    """gemmlowp RoundingDivideByPOT(int32 x, int exponent), 0 <= exponent <= 31.

    Rule: mask = 2**exponent - 1; remainder = x & mask; threshold = (mask >> 1) + (x < 0);
    result = (x >> exponent) + (remainder > threshold). That is round-half-away-from-zero
    of x / 2**exponent.
    """
    x = np.asarray(x, dtype=np.int64)
    e = np.asarray(exponent, dtype=np.int64)
    # The same rule as one floor: (x + 2**(e-1) - [x < 0]) >> e for e > 0 (a negative tie
    # moves away from zero), x for e == 0. Four passes over the activations instead of six.
    r = x + ((np.int64(1) << e) >> 1)
    r += (x >> 63) if np.all(e > 0) else (x >> 63) * (e > 0)  # x >> 63: -1 for negatives, else 0
    r >>= e
    return r


def multiply_by_quantized_multiplier(x: ArrayLike, multiplier: ArrayLike, shift: ArrayLike) -> np.ndarray:
    """MultiplyByQuantizedMultiplier(int32 x, int32 m, int shift) -> int32, double rounding.

    Rule: left = max(shift, 0), right = max(-shift, 0);
    result = RoundingDivideByPOT(SaturatingRoundingDoublingHighMul(x * 2**left, m), right).
    x * 2**left is an int32 multiply in C (undefined on overflow); here it wraps like int32
    hardware. `multiplier`/`shift` broadcast against x, so per-channel requantisation is
    `multiply_by_quantized_multiplier(acc, m[c], s[c])` with acc's last axis = channel.
    """
    shift = np.asarray(shift, dtype=np.int64)
    left = np.maximum(shift, 0)
    right = np.maximum(-shift, 0)
    shifted = np.asarray(x, dtype=np.int64)
    if np.any(left > 0):
        shifted = wrap_int32(shifted << left)
    return rounding_divide_by_pot(saturating_rounding_doubling_high_mul(shifted, multiplier), right)


def multiply_by_quantized_multiplier_smaller_than_one_exp(
    x: ArrayLike, multiplier: ArrayLike, left_shift: ArrayLike
) -> np.ndarray:
    """MultiplyByQuantizedMultiplierSmallerThanOneExp (used by ADD): left_shift <= 0.

    Rule: RoundingDivideByPOT(SaturatingRoundingDoublingHighMul(x, m), -left_shift);
    identical to multiply_by_quantized_multiplier for non-positive shifts.
    """
    return rounding_divide_by_pot(saturating_rounding_doubling_high_mul(x, multiplier), -np.asarray(left_shift))


def requantize(
    acc: ArrayLike, multiplier: ArrayLike, shift: ArrayLike, output_zero_point: int, act_min: int, act_max: int
) -> np.ndarray:
    """The common conv/FC epilogue: MultiplyByQuantizedMultiplier, + output zp, clamp, int8."""
    out = multiply_by_quantized_multiplier(acc, multiplier, shift) + int(output_zero_point)
    return np.clip(out, act_min, act_max).astype(np.int8)


def quantize(x: ArrayLike, scale: float, zero_point: int) -> np.ndarray:
    """Reference QUANTIZE float32 -> int8 (reference_ops::AffineQuantize).

    Rule: q = int32(round(float32(x) / float32(scale))) + zero_point, clamped to [-128, 127].
    The division is a float32 division; round() is half away from zero. NaN gives -128 (in
    TFLite the int cast of NaN is undefined: INT32_MIN on x86, 0 on ARM; here it is defined,
    as in the native kernels).
    """
    x = np.asarray(x, dtype=np.float32)
    scaled = round_half_away(x / np.float32(scale))
    nan = np.isnan(scaled)
    # Values far outside int8 only need to saturate; clip before the int cast (C would be UB).
    q = np.clip(np.where(nan, 0.0, scaled), -(2.0**24), 2.0**24).astype(np.int64) + int(zero_point)
    return np.where(nan, INT8_MIN, np.clip(q, INT8_MIN, INT8_MAX)).astype(np.int8)


def dequantize(q: ArrayLike, scale: float, zero_point: int) -> np.ndarray:
    """Reference DEQUANTIZE int8 -> float32: float32(double(scale) * (q - zero_point)).

    The product is in double (scale is held as a double) and then rounded to float32.
    """
    diff = np.asarray(q, dtype=np.int64) - int(zero_point)
    return (np.float64(np.float32(scale)) * diff).astype(np.float32)


def quantize_scalar_float32(f: float, scale: float, zero_point: int) -> int:
    """zero_point + int(round(float32(f) / float32(scale))): used for activation bounds."""
    return int(zero_point) + int(round_half_away(np.float32(f) / np.float32(scale)))


def activation_range(activation: str, scale: float, zero_point: int) -> tuple[int, int]:
    """CalculateActivationRangeQuantized for int8 outputs: the clamp [act_min, act_max].

    Rule (qmin=-128, qmax=127, quantize(f) = zp + round(float32(f) / float32(scale))):
    NONE: [qmin, qmax]; RELU: [max(qmin, quantize(0)), qmax];
    RELU6: [max(qmin, quantize(0)), min(qmax, quantize(6))].
    """
    if activation == "NONE":
        return INT8_MIN, INT8_MAX
    low = max(INT8_MIN, quantize_scalar_float32(0.0, scale, zero_point))
    if activation == "RELU":
        return low, INT8_MAX
    if activation == "RELU6":
        return low, min(INT8_MAX, quantize_scalar_float32(6.0, scale, zero_point))
    raise ValueError(f"unknown fused activation {activation!r} (expected NONE, RELU or RELU6)")


def quantize_bias(bias: ArrayLike, input_scale: float, weight_scales: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """Float bias -> (int32 bias, float32 bias scales) with scale = input_scale * weight_scale[c].

    The bias scale is what the writer stores; the kernels never read it (TFLite only checks it
    against input_scale * weight_scale), so the product is taken in float64 then rounded once.
    """
    scales = (np.float64(input_scale) * np.asarray(weight_scales, dtype=np.float64)).astype(np.float32)
    q = round_half_away(np.asarray(bias, dtype=np.float64) / scales.astype(np.float64))
    return np.clip(q, INT32_MIN, INT32_MAX).astype(np.int32), scales


def symmetric_per_channel(weights: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """Float weights -> (int8 weights in [-127, 127], float32 scales), symmetric per `axis`."""
    w = np.asarray(weights, dtype=np.float64)
    other = tuple(i for i in range(w.ndim) if i != axis % w.ndim)
    absmax = np.max(np.abs(w), axis=other) if other else np.abs(w)
    scales = np.where(absmax > 0, absmax / 127.0, 1.0).astype(np.float32)
    shape = [1] * w.ndim
    shape[axis] = -1
    q = round_half_away(w / scales.astype(np.float64).reshape(shape))
    return np.clip(q, -127, 127).astype(np.int8), scales


MIN_RANGE = 1e-6


def asymmetric_params(lo: float, hi: float) -> tuple[float, int]:
    """Per-tensor int8 (scale, zero_point) covering [min(lo, 0), max(hi, 0)].

    An empty range gives (1.0, 0); a range narrower than MIN_RANGE is widened to it, since
    TFLite refuses a fused RELU6 whose round(6 / scale) overflows int32."""
    lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
    if hi - lo <= 0:
        return 1.0, 0
    if hi - lo < MIN_RANGE:
        hi, lo = (lo + MIN_RANGE, lo) if hi > 0 else (hi, hi - MIN_RANGE)
    scale = float(np.float32((hi - lo) / 255.0))
    zero_point = int(np.clip(round_half_away(INT8_MIN - lo / scale), INT8_MIN, INT8_MAX))
    return scale, zero_point
