"""Byte budget: the chosen update fits, is the largest that fits, and is the most accurate."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edge_agent.updates.budget import (
    AWS_IOT_CORE_MAX_MESSAGE,
    _Sizer,
    choose_for_budget,
    per_update_budget,
)
from edge_agent.updates.chunks import split_chunks, wire_size
from edge_agent.updates.codec import decode_tensors, encode_tensors
from edge_agent.updates.errors import BudgetError, NonFiniteDeltaError
from edge_agent.updates.indices import decode_indices
from edge_agent.updates.wire import UpdateHeader, pack_update

HEADER = UpdateHeader("digits-head", "v1", "job-1", "dev-01", 5)


def _delta(seed: int, hidden: int = 40) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    # Heavy-tailed, like real training deltas: a few large values, many small ones.
    return {
        "fc1.weight": (rng.standard_t(2, (64, hidden)) * 1e-3).astype(np.float32),
        "fc1.bias": (rng.standard_t(2, hidden) * 1e-3).astype(np.float32),
        "fc2.weight": (rng.standard_t(2, (hidden, 10)) * 1e-2).astype(np.float32),
        "fc2.bias": np.zeros(10, np.float32),
    }


def _wire_bytes(encoded, chunk_size=65536, signature=0) -> int:
    return wire_size(len(pack_update(HEADER, encoded)), chunk_size, signature)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10**6),
    budget=st.integers(260, 12_000),
    chunk=st.sampled_from([300, 1024, 65536]),
)
def test_choice_fits_and_no_larger_k_would(seed, budget, chunk):
    delta = _delta(seed)
    choice = choose_for_budget(delta, HEADER, budget, chunk_size=chunk, signature_bytes=64)
    actual = _wire_bytes(choice.encoded, chunk, 64)
    assert actual == choice.wire_bytes <= budget
    sizer = _Sizer(delta, HEADER, chunk, 64, k_cap=10**9)
    assert choice.k == sum(e.k for e in choice.encoded)
    if choice.k < sizer.nonzero:
        assert sizer.size(choice.k + 1, choice.bits) > budget  # maximal for its bit width
    # Its error is the smallest among all bit widths at their own largest k.
    for bits in (1, 4, 8, 32):
        k = sizer.largest_k(bits, budget)
        if k is not None:
            assert choice.sq_error <= sizer.sq_error(k, bits) * (1 + 1e-9) + 1e-30
    # The reported error is the real one.
    decoded = decode_tensors(choice.encoded)
    real = sum(float(np.sum((delta[n].astype(np.float64) - decoded[n]) ** 2)) for n in delta)
    assert choice.sq_error == pytest.approx(real, rel=1e-6, abs=1e-30)


def test_largest_k_agrees_with_a_linear_scan():
    delta = _delta(7, hidden=4)
    sizer = _Sizer(delta, HEADER, 65536, 0, k_cap=10**9)
    for bits in (1, 4, 8, 32):
        sizes = [sizer.size(k, bits) for k in range(sizer.nonzero + 1)]
        for budget in range(sizes[0], sizes[-1] + 2, 23):
            k = sizer.largest_k(bits, budget)
            # Fits, the next k does not, and nothing fits beyond a small tolerance: size is
            # monotone except where a tensor becomes fully kept (its index coding vanishes).
            assert sizes[k] <= budget and (k == sizer.nonzero or sizes[k + 1] > budget)
            best = max(j for j, s in enumerate(sizes) if s <= budget)
            assert sizes[best] - sizes[k] <= 16


def test_error_shrinks_as_the_budget_grows_and_reaches_lossless():
    delta = _delta(3)
    dense = 4 * sum(a.size for a in delta.values())
    errors = [choose_for_budget(delta, HEADER, b).sq_error for b in (300, 1000, 3000, 10_000)]
    assert errors == sorted(errors, reverse=True) and errors[-1] < errors[0] / 10
    lossless = choose_for_budget(delta, HEADER, dense + 1000)
    assert lossless.sq_error == 0.0 and lossless.bits == 32


def test_budget_below_the_fixed_overhead_is_a_clear_error():
    with pytest.raises(
        BudgetError, match=r"budget of 100 bytes is below .* overhead of \d+ bytes .*4-tensor table"
    ):
        choose_for_budget(_delta(0), HEADER, 100)


def test_budget_refuses_nan_and_per_tensor_scope():
    delta = _delta(0)
    delta["fc1.bias"][3] = np.inf
    with pytest.raises(NonFiniteDeltaError, match="fc1.bias"):
        choose_for_budget(delta, HEADER, 5000)
    with pytest.raises(ValueError, match="globally"):
        choose_for_budget(_delta(0), UpdateHeader("m", "1", "j", "d", 0, "tensor"), 5000)


def test_all_zero_delta_costs_only_the_header():
    zeros = {n: np.zeros_like(a) for n, a in _delta(0).items()}
    choice = choose_for_budget(zeros, HEADER, 5000)
    assert choice.k == 0 and choice.sq_error == 0.0 and choice.wire_bytes < 200


def test_large_update_fits_a_budget_over_many_chunks():
    rng = np.random.default_rng(1)
    delta = {"w": rng.standard_normal((512, 512)).astype(np.float32)}
    choice = choose_for_budget(delta, HEADER, 300_000)
    chunks = split_chunks(pack_update(HEADER, choice.encoded))
    assert len(chunks) == 5 and sum(len(c) for c in chunks) == choice.wire_bytes <= 300_000
    assert all(len(c) <= AWS_IOT_CORE_MAX_MESSAGE // 2 for c in chunks)


def test_encoding_the_chosen_positions_reproduces_the_choice():
    delta = _delta(11)
    choice = choose_for_budget(delta, HEADER, 2000)
    positions = {
        e.spec.name: decode_indices(e.index_kind, e.index_bytes, e.k, e.spec.numel)
        for e in choice.encoded
    }
    again = encode_tensors(delta, positions, choice.bits)
    assert pack_update(HEADER, again) == pack_update(HEADER, choice.encoded)


def test_per_update_budget_from_a_daily_allowance():
    # 1 MB/day, 24 updates a day, 10 % kept back for retries and protocol.
    assert per_update_budget(1_000_000, 24) == 37_500
    assert per_update_budget(1_000_000, 24, reserve=0.0) == 41_666
    with pytest.raises(ValueError):
        per_update_budget(0, 24)
    with pytest.raises(ValueError):
        per_update_budget(1000, 1, reserve=1.0)


def test_search_widens_its_candidate_set_when_a_budget_allows_many_values():
    # 4,000 values at 1 bit with implied positions take ~500 bytes: far more values than the
    # first candidate set (sized for ~1-byte indices) holds.
    delta = {"w": np.random.default_rng(2).standard_normal(4000).astype(np.float32)}
    choice = choose_for_budget(delta, HEADER, 2000, bits_choices=(1,))
    assert choice.k == 4000 and choice.wire_bytes < 700


def test_size_arithmetic_matches_real_encodings():
    delta = _delta(5, hidden=30)
    delta["tiny"] = np.array([0.5, 0.0, -0.25], np.float32)  # fully kept: 'all' coding
    header = HEADER
    sizer = _Sizer(delta, header, 700, 64, k_cap=10**9)
    for k in (0, 1, 2, 17, 300, 1500, sizer.nonzero - 1, sizer.nonzero):
        positions = dict(zip(delta, sizer.positions(k), strict=True))
        for bits in (1, 4, 8, 32):
            encoded = encode_tensors(delta, positions, bits)
            assert sizer.size(k, bits) == wire_size(len(pack_update(header, encoded)), 700, 64), (
                k,
                bits,
            )
