"""TFLite's integer arithmetic in quant_math, checked against a second, scalar implementation
written with Python's unbounded ints straight from the rules in the docstrings, and against
hand-computed values at the edges (ties, saturation, carry, flush to zero)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_agent.int8 import quant_math as qm

INT32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)


def c_div(a: int, b: int) -> int:
    """C integer division (truncation toward zero) on Python ints."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b > 0) else -q


def c_round(x: float) -> int:
    """std::round on a double: ties away from zero."""
    f = math.floor(x)
    diff = x - f
    if diff > 0.5 or (diff == 0.5 and x > 0):
        return f + 1
    return f


def srdhm_scalar(a: int, b: int) -> int:
    if a == b == -(2**31):
        return 2**31 - 1
    p = a * b
    nudge = (1 << 30) if p >= 0 else 1 - (1 << 30)
    return c_div(p + nudge, 1 << 31)


def rdbpot_scalar(x: int, e: int) -> int:
    mask = (1 << e) - 1
    threshold = (mask >> 1) + (1 if x < 0 else 0)
    return (x >> e) + (1 if (x & mask) > threshold else 0)


def qm_scalar(real: float) -> tuple[int, int]:
    if real == 0:
        return 0, 0
    q, shift = math.frexp(real)
    m = c_round(q * 2**31)
    if m == 2**31:
        m, shift = m // 2, shift + 1
    if shift < -31:
        return 0, 0
    return m, shift


def mbqm_scalar(x: int, m: int, shift: int) -> int:
    left, right = max(shift, 0), max(-shift, 0)
    shifted = ((x << left) + 2**31) % 2**32 - 2**31  # int32 wrap
    return rdbpot_scalar(srdhm_scalar(shifted, m), right)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(INT32, INT32), min_size=1, max_size=20))
def test_srdhm_matches_scalar_rule(pairs):
    a = np.array([p[0] for p in pairs])
    b = np.array([p[1] for p in pairs])
    assert qm.saturating_rounding_doubling_high_mul(a, b).tolist() == [srdhm_scalar(x, y) for x, y in pairs]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(INT32, st.integers(0, 31)), min_size=1, max_size=20))
def test_rounding_divide_by_pot_matches_scalar_rule(pairs):
    x = np.array([p[0] for p in pairs])
    e = np.array([p[1] for p in pairs])
    assert qm.rounding_divide_by_pot(x, e).tolist() == [rdbpot_scalar(v, k) for v, k in pairs]


@settings(max_examples=150, deadline=None)
@given(st.floats(min_value=1e-12, max_value=1e4, allow_nan=False), st.integers(-(2**24), 2**24))
def test_quantize_multiplier_and_mbqm_match_scalar_rule(real, x):
    m, s = qm.quantize_multiplier(real)
    assert (int(m), int(s)) == qm_scalar(real)
    assert int(qm.multiply_by_quantized_multiplier(x, m, s)) == mbqm_scalar(x, int(m), int(s))
    if 1e-6 < real < 1 and abs(x) < 2**20:  # and it approximates x * real to within 1
        assert abs(int(qm.multiply_by_quantized_multiplier(x, m, s)) - x * real) <= 1


@pytest.mark.parametrize(
    ("real", "expected"),
    [
        (0.0, (0, 0)),
        (0.5, (2**30, 0)),
        (1.0, (2**30, 1)),
        (0.75, (1610612736, 0)),
        (3.0, (1610612736, 2)),
        (1 - 2**-40, (2**30, 1)),  # the mantissa rounds up to 2**31: carry into the shift
        (2**-40, (0, 0)),  # shift below -31 is flushed to zero
        (-0.5, (-(2**30), 0)),
    ],
)
def test_quantize_multiplier_known_values(real, expected):
    m, s = qm.quantize_multiplier(real)
    assert (int(m), int(s)) == expected


def test_fixed_point_edges():
    assert qm.saturating_rounding_doubling_high_mul(-(2**31), -(2**31)) == 2**31 - 1
    # (-2**30 + 1 - 2**30) / 2**31 truncates to 0, where a floor (shift) would give -1
    assert qm.saturating_rounding_doubling_high_mul(-1, 2**30) == 0
    assert qm.rounding_divide_by_pot([5, -5, 4, 6, -6, -7, 7], 1).tolist() == [3, -3, 2, 3, -3, -4, 4]
    assert qm.rounding_divide_by_pot([6, -6, -7, 5], 2).tolist() == [2, -2, -2, 1]
    assert qm.multiply_by_quantized_multiplier(100, *qm.quantize_multiplier(3.0)) == 300
    assert qm.multiply_by_quantized_multiplier(1000, *qm.quantize_multiplier(0.25)) == 250
    # A tie inside the doubling high mul rounds toward +inf (-1.5 -> -1, 1.5 -> 2); ties in
    # the power-of-two division round away from zero (-6 * 0.25 = SRDHM -3, then -3 / 2 -> -2).
    assert qm.multiply_by_quantized_multiplier([-3, 3], *qm.quantize_multiplier(0.5)).tolist() == [-1, 2]
    assert qm.multiply_by_quantized_multiplier([-6, 6], *qm.quantize_multiplier(0.25)).tolist() == [-2, 2]


def test_round_half_away_from_zero_in_both_float_types():
    values = [0.5, 1.5, 2.5, -0.5, -2.5, 0.49999999999999994, -0.49999999999999994, 3.0]
    assert qm.round_half_away(np.array(values)).tolist() == [1, 2, 3, -1, -3, 0, 0, 3]
    f32 = qm.round_half_away(np.array([2.5, -2.5, 0.4999999701976776], dtype=np.float32))
    assert f32.dtype == np.float32 and f32.tolist() == [3, -3, 0]


def test_multiplier_broadcasts_per_channel():
    rng = np.random.default_rng(0)
    acc = rng.integers(-(2**20), 2**20, size=(4, 3, 5))
    m, s = qm.quantize_multiplier(rng.uniform(1e-4, 2.0, size=5))
    got = qm.multiply_by_quantized_multiplier(acc, m, s)
    want = [[[mbqm_scalar(int(v), int(m[c]), int(s[c])) for c, v in enumerate(row)] for row in plane] for plane in acc]
    assert got.tolist() == want


@pytest.mark.parametrize(
    ("activation", "scale", "zp", "expected"),
    [
        ("NONE", 0.1, 5, (-128, 127)),
        ("RELU", 0.1, -10, (-10, 127)),
        ("RELU", 0.1, -128, (-128, 127)),
        ("RELU6", 0.1, 0, (0, 60)),
        ("RELU6", 6 / 255, -128, (-128, 127)),
        ("RELU6", 0.05, -100, (-100, 20)),
        ("RELU6", 0.01, 0, (0, 127)),  # 6.0 is beyond the int8 range: clamp to 127
    ],
)
def test_activation_range(activation, scale, zp, expected):
    assert qm.activation_range(activation, scale, zp) == expected


def test_activation_range_rejects_unknown():
    with pytest.raises(ValueError, match="TANH"):
        qm.activation_range("TANH", 0.1, 0)


def test_quantize_dequantize_rules():
    q = qm.quantize(np.array([0.5, -0.5, 1.5, 1e30, -1e30, 0.0]), 1.0, 0)
    assert q.dtype == np.int8 and q.tolist() == [1, -1, 2, 127, -128, 0]
    assert qm.quantize(np.array([0.25]), 0.1, -3).tolist() == [0]  # round(2.5) = 3, -3 + 3
    d = qm.dequantize(np.array([-128, 0, 127], dtype=np.int8), 0.5, -28)
    assert d.dtype == np.float32 and d.tolist() == [-50.0, 14.0, 77.5]


def test_weight_and_bias_helpers():
    rng = np.random.default_rng(1)
    w = rng.normal(size=(6, 3, 3, 4))
    q, scales = qm.symmetric_per_channel(w, 0)
    assert q.dtype == np.int8 and q.min() >= -127 and scales.shape == (6,)
    assert np.abs(q).reshape(6, -1).max(axis=1).tolist() == [127] * 6
    assert np.abs(q * scales[:, None, None, None] - w).max() <= scales.max() / 2 + 1e-6
    qb, bscale = qm.quantize_bias(np.array([0.3, -0.2, 0.0, 1.0, 2.0, -5.0]), 0.02, scales)
    assert qb.dtype == np.int32 and np.allclose(qb * bscale, [0.3, -0.2, 0.0, 1.0, 2.0, -5.0], atol=bscale.max())
    scale, zp = qm.asymmetric_params(-1.0, 3.0)
    assert qm.quantize(np.array([0.0]), scale, zp).tolist() == [zp]  # zero is exact
    assert qm.quantize(np.array([-1.0, 3.0]), scale, zp).tolist() == [-128, 127]
    assert qm.asymmetric_params(0.0, 0.0) == (1.0, 0)
