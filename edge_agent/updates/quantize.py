"""Quantisation of the values kept by top-k: pure functions on 1-D float32 arrays.

Bit widths (one per tensor, with one float32 scale per tensor):
  32  raw float32, no scale (exact for float32 input)
   8  int8 codes in [-127, 127], value = code * scale, scale = max|v| / 127
   4  4-bit codes in [-7, 7], two per byte (high nibble first), scale = max|v| / 7
   1  sign bit per value (1 = negative), value = ±scale, scale = mean|v| (the scale that
      minimises the squared error of a sign code)
Rounding is deterministic (round to nearest): the same input always gives the same bytes,
so an update re-encoded after a reboot is byte-identical. Whatever rounding loses is not
lost for good: error feedback carries it into the next round.

The stated bound (`error_bound`): per kept value, |decoded - original| is at most
  32: 2**-24 * max|v|          8, 4: scale / 2 + slack       1: max(max|v| - s, s - min|v|) + slack
where slack = 2**-22 * max|v| + 2**-149 covers float32 rounding of the product and subnormals.
"""

from __future__ import annotations

import numpy as np

from .errors import UpdateFormatError

SUPPORTED_BITS = (1, 4, 8, 32)
_LEVELS = {8: 127, 4: 7}
_F32_MAX = float(np.finfo(np.float32).max)
_F32_TINY = float(np.nextafter(np.float32(0), np.float32(1)))  # smallest subnormal


def value_bytes(k: int, bits: int) -> int:
    """Bytes taken by the codes of k values at `bits` (the scale is counted separately)."""
    if bits == 32:
        return 4 * k
    if bits == 8:
        return k
    if bits == 4:
        return (k + 1) // 2
    if bits == 1:
        return (k + 7) // 8
    raise ValueError(f"unsupported bit width {bits}; choose one of {SUPPORTED_BITS}")


def _linear_scale(vmax: float, levels: int) -> float:
    """Smallest float32 scale with levels * scale >= vmax, kept finite when multiplied back."""
    s = np.float32(vmax / levels)
    if float(s) * levels < vmax:
        s = np.nextafter(s, np.float32(np.inf))
    s = max(float(s), _F32_TINY)
    if s * levels > _F32_MAX:  # vmax near float32 max: clip the top code instead of overflowing
        s = float(np.nextafter(np.float32(_F32_MAX / levels), np.float32(0)))
    return s


def quantize(values: np.ndarray, bits: int) -> tuple[float, bytes]:
    """Quantise finite 1-D values to (scale, code bytes). scale is 0.0 for bits=32 or no values."""
    v = np.asarray(values, dtype=np.float32).ravel()
    if bits == 32:
        return 0.0, v.astype("<f4").tobytes()
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"unsupported bit width {bits}; choose one of {SUPPORTED_BITS}")
    if v.size == 0:
        return 0.0, b""
    mags = np.abs(v.astype(np.float64))
    if bits == 1:
        scale = max(float(np.float32(mags.mean())), _F32_TINY)
        return scale, np.packbits(v < 0).tobytes()
    levels = _LEVELS[bits]
    scale = _linear_scale(float(mags.max()), levels)
    codes = np.clip(np.rint(v.astype(np.float64) / scale), -levels, levels).astype(np.int8)
    if bits == 8:
        return scale, codes.tobytes()
    nib = (codes + 8).astype(np.uint8)  # 1..15; nibble 0 never occurs, so padding is detectable
    if nib.size % 2:
        nib = np.append(nib, np.uint8(0))
    return scale, ((nib[0::2] << 4) | nib[1::2]).astype(np.uint8).tobytes()


def dequantize(
    codes: bytes, k: int, bits: int, scale: float, *, where: str = "values"
) -> np.ndarray:
    """Inverse of `quantize`: k float32 values. Validates lengths, codes and the scale."""
    if len(codes) != (expected := value_bytes(k, bits)):
        raise UpdateFormatError(
            f"{where}: {len(codes)} value bytes, {k} values at {bits} bits need {expected}"
        )
    if bits == 32:
        out = np.frombuffer(codes, dtype="<f4").astype(np.float32)
        if not np.isfinite(out).all():
            raise UpdateFormatError(f"{where}: raw float32 values include NaN or Inf")
        return out
    if k == 0:
        return np.empty(0, dtype=np.float32)
    if not (np.isfinite(scale) and scale > 0):
        raise UpdateFormatError(f"{where}: scale {scale!r} is not a positive finite number")
    if scale * _LEVELS.get(bits, 1) > _F32_MAX:
        raise UpdateFormatError(f"{where}: scale {scale!r} would overflow float32")
    raw = np.frombuffer(codes, dtype=np.uint8)
    if bits == 1:
        signs = np.unpackbits(raw)
        if signs[k:].any():
            raise UpdateFormatError(f"{where}: sign bits set in the padding")
        q = 1.0 - 2.0 * signs[:k].astype(np.float64)
    elif bits == 8:
        q = raw.view(np.int8).astype(np.float64)
        if (q == -128).any():
            raise UpdateFormatError(f"{where}: int8 code -128 is outside [-127, 127]")
    else:
        nib = np.empty(raw.size * 2, dtype=np.uint8)
        nib[0::2], nib[1::2] = raw >> 4, raw & 0x0F
        if nib[k:].any():
            raise UpdateFormatError(f"{where}: 4-bit padding nibble is not zero")
        if (nib[:k] == 0).any():
            raise UpdateFormatError(f"{where}: 4-bit code 0 (-8) is outside [-7, 7]")
        q = nib[:k].astype(np.float64) - 8.0
    return (q * scale).astype(np.float32)


def error_bound(bits: int, scale: float, vmin: float, vmax: float) -> float:
    """The stated bound on |decoded - original| for kept values with magnitudes in [vmin, vmax]."""
    slack = 2.0**-22 * vmax + 2.0**-149
    if bits == 32:
        return 2.0**-24 * vmax + 2.0**-149
    if bits == 1:
        return max(vmax - scale, scale - vmin, 0.0) + slack
    return scale / 2.0 + slack
