"""Codec properties: round trip within the stated bound, top-k, quantisation, index coding."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from edge_agent.errors import InputError
from edge_agent.updates.codec import (
    TensorSpec,
    check_table,
    compute_delta,
    decode_tensors,
    encode_delta,
    encode_tensors,
    round_trip_bound,
    select_positions,
    select_topk,
    tensor_table,
)
from edge_agent.updates.errors import (
    NonFiniteDeltaError,
    TensorTableMismatchError,
    UpdateFormatError,
)
from edge_agent.updates.indices import (
    INDEX_ALL,
    INDEX_BITMAP,
    INDEX_RICE,
    INDEX_VARINT,
    decode_indices,
    encode_indices,
    index_cost,
    varint_decode,
    varint_encode,
)
from edge_agent.updates.quantize import SUPPORTED_BITS, dequantize, error_bound, quantize
from edge_agent.updates.wire import UpdateHeader, pack_update, unpack_update

F32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
HUGE = float(np.finfo(np.float32).max)
TINY = float(np.nextafter(np.float32(0), np.float32(1)))
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def deltas(draw, max_tensors: int = 3) -> dict[str, np.ndarray]:
    """1..3 float32 tensors of any rank 0..3 (dims may be 0) with any finite values."""
    n = draw(st.integers(1, max_tensors))
    out = {}
    for i in range(n):
        shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=7))
        kind = draw(st.sampled_from(["any", "zeros", "huge", "tiny", "normal"]))
        if kind == "any":
            arr = draw(hnp.arrays(np.float32, shape, elements=F32))
        elif kind == "zeros":
            arr = np.zeros(shape, np.float32)
        else:
            mag = float(np.float32({"huge": HUGE, "tiny": TINY * 64, "normal": 1e-2}[kind]))
            elems = st.floats(-mag, mag, width=32, allow_subnormal=True)
            arr = draw(hnp.arrays(np.float32, shape, elements=elems))
        out[f"layer{i}.w"] = arr
    return out


def _round_trip(delta, density, bits, scope):
    encoded = encode_delta(delta, density=density, bits=bits, scope=scope)
    header = UpdateHeader("m", "1", "job", "dev", 3, scope)
    _, parsed = unpack_update(pack_update(header, encoded), expected_table=tensor_table(delta))
    return encoded, decode_tensors(parsed)


@FAST
@given(
    delta=deltas(),
    density=st.floats(0.01, 1.0),
    bits=st.sampled_from(SUPPORTED_BITS),
    scope=st.sampled_from(["global", "tensor"]),
)
@example(delta={"e": np.zeros((0,), np.float32)}, density=0.5, bits=8, scope="global")
@example(delta={"one": np.array([3.5], np.float32)}, density=1.0, bits=4, scope="tensor")
@example(delta={"z": np.zeros((4, 4), np.float32)}, density=1.0, bits=1, scope="global")
@example(
    delta={"big": np.array([HUGE, -HUGE, 1.0], np.float32)}, density=1.0, bits=8, scope="global"
)
@example(
    delta={"sub": np.array([TINY, -TINY, 3 * TINY], np.float32)},
    density=1.0,
    bits=4,
    scope="global",
)
def test_round_trip_within_stated_bound(delta, density, bits, scope):
    encoded, decoded = _round_trip(delta, density, bits, scope)
    for enc in encoded:
        x = delta[enc.spec.name]
        y = decoded[enc.spec.name]
        assert y.shape == x.shape and y.dtype == np.float32
        assert np.isfinite(y).all()
        err = np.abs(y.astype(np.float64) - x.astype(np.float64)).ravel()
        assert (err <= round_trip_bound(x, enc)).all()
        # Zeros are never spent bytes on, and decode to exactly 0.
        assert enc.k <= np.count_nonzero(x)
        assert (y.ravel()[x.ravel() == 0] == 0).all()


@FAST
@given(delta=deltas(), density=st.floats(0.01, 1.0), scope=st.sampled_from(["global", "tensor"]))
def test_topk_keeps_largest_magnitudes(delta, density, scope):
    pos = select_positions(delta, density, scope)
    groups = [list(delta)] if scope == "global" else [[n] for n in delta]
    for names in groups:
        kept = np.concatenate([np.abs(delta[n].ravel()[pos[n]]) for n in names])
        mask_dropped = []
        for n in names:
            m = np.ones(delta[n].size, bool)
            m[pos[n]] = False
            mask_dropped.append(np.abs(delta[n].ravel()[m]))
        dropped = np.concatenate(mask_dropped)
        total = sum(delta[n].size for n in names)
        nnz = sum(np.count_nonzero(delta[n]) for n in names)
        assert kept.size == min(nnz, max(1, int(np.ceil(density * total))) if total else 0)
        assert (kept > 0).all()
        if kept.size and dropped.size:
            assert kept.min() >= dropped.max()
    for n, p in pos.items():
        assert (np.diff(p) > 0).all() and (p.size == 0 or (p[0] >= 0 and p[-1] < delta[n].size))


@FAST
@given(
    values=hnp.arrays(np.float32, st.integers(0, 300), elements=F32),
    bits=st.sampled_from(SUPPORTED_BITS),
)
@example(values=np.array([HUGE, -HUGE], np.float32), bits=8)
@example(values=np.array([HUGE, 1.0], np.float32), bits=4)
@example(values=np.array([TINY], np.float32), bits=8)
@example(values=np.array([TINY, 2 * TINY, -TINY], np.float32), bits=1)
def test_quantise_within_bound(values, bits):
    scale, codes = quantize(values, bits)
    out = dequantize(codes, values.size, bits, scale)
    assert out.dtype == np.float32 and out.shape == values.shape and np.isfinite(out).all()
    if values.size:
        mags = np.abs(values.astype(np.float64))
        bound = error_bound(bits, scale, mags.min(), mags.max())
        assert (np.abs(out.astype(np.float64) - values) <= bound).all()


def test_quantise_sizes_and_known_values():
    v = np.array([1.0, -0.5, 0.25, -1.0], np.float32)
    scale, codes = quantize(v, 8)
    assert len(codes) == 4 and scale == pytest.approx(1 / 127, rel=1e-6)
    np.testing.assert_allclose(dequantize(codes, 4, 8, scale), v, atol=scale / 2)
    scale, codes = quantize(v, 4)
    assert len(codes) == 2
    scale, codes = quantize(v, 1)
    assert len(codes) == 1 and scale == pytest.approx(0.6875)
    np.testing.assert_array_equal(dequantize(codes, 4, 1, scale), np.sign(v) * np.float32(0.6875))
    assert len(quantize(v, 32)[1]) == 16


@pytest.mark.parametrize(
    ("codes", "k", "bits", "scale", "match"),
    [
        (b"\x80", 1, 8, 0.1, "-128"),
        (b"\x01", 2, 8, 0.1, "value bytes"),
        (b"\x08", 2, 4, 0.1, "code 0"),
        (b"\x99", 1, 4, 0.1, "padding nibble"),
        (b"\x81", 1, 1, 0.1, "padding"),
        (b"\x01", 1, 8, float("nan"), "scale"),
        (b"\x01", 1, 8, -1.0, "scale"),
        (b"\x01", 1, 8, 3e38, "overflow"),
        (np.array([np.inf], "<f4").tobytes(), 1, 32, 0.0, "NaN or Inf"),
    ],
)
def test_dequantise_refuses_bad_codes(codes, k, bits, scale, match):
    with pytest.raises(UpdateFormatError, match=match):
        dequantize(codes, k, bits, scale, where="t")


@FAST
@given(st.lists(st.integers(0, (1 << 35) - 1), max_size=200))
def test_varints_round_trip(values):
    data = varint_encode(np.array(values, dtype=np.uint64))
    assert varint_decode(data, len(values)).tolist() == values


@pytest.mark.parametrize(
    ("data", "count", "match"),
    [
        (b"\x80", 1, "truncated"),
        (b"\x01\x02", 1, "holds 2 values"),
        (b"\x80\x80\x80\x80\x80\x01", 1, "longer"),
        (b"\x81\x00", 1, "non-canonical"),
        (b"", 1, "no bytes"),
        (b"\x01", 0, "for 0 values"),
    ],
)
def test_varint_decode_refuses_bad_bytes(data, count, match):
    with pytest.raises(UpdateFormatError, match=match):
        varint_decode(data, count)


@FAST
@given(n=st.integers(0, 3000), data=st.data())
def test_indices_round_trip_and_pick_the_smaller_coding(n, data):
    k = data.draw(st.integers(0, n))
    idx = np.sort(
        np.random.default_rng(data.draw(st.integers(0, 99))).choice(n, size=k, replace=False)
    )
    kind, raw = encode_indices(idx, n)
    np.testing.assert_array_equal(decode_indices(kind, raw, k, n), idx)
    varint_len = len(varint_encode(np.diff(idx, prepend=-1) - 1))
    if k == n:
        assert kind == INDEX_ALL and raw == b""
    else:
        assert len(raw) == index_cost(idx, n)[1] <= min(varint_len, (n + 7) // 8)
        assert kind in (INDEX_VARINT, INDEX_BITMAP, INDEX_RICE)


def test_index_coding_choice_follows_density():
    n = 10_000
    sparse = np.arange(0, n, 100)  # gaps of 99: one varint byte each, Rice needs 8 bits + r
    dense = np.arange(0, n, 2)
    assert encode_indices(sparse, n) == (INDEX_VARINT, b"\x00" + bytes([99]) * 99)
    assert encode_indices(dense, n)[0] == INDEX_BITMAP
    assert len(encode_indices(dense, n)[1]) == n // 8
    # Gaps of 1000: varints take 2 bytes each (100 in all); Rice with r = 9 takes 2 unary
    # bits + 9 remainder bits each: 1 + ceil(100 / 8) + ceil(450 / 8) = 71 bytes.
    very_sparse = np.arange(50) * 1001 + 1000
    kind, raw = encode_indices(very_sparse, 50 * 1001)
    assert (kind, len(raw), raw[0]) == (INDEX_RICE, 71, 9)
    np.testing.assert_array_equal(decode_indices(kind, raw, 50, 50 * 1001), very_sparse)


@pytest.mark.parametrize(
    ("kind", "data", "k", "n", "match"),
    [
        (INDEX_BITMAP, b"\xff", 8, 16, "bitmap is 1 bytes"),
        (INDEX_BITMAP, b"\x01", 1, 4, "past element"),
        (INDEX_BITMAP, b"\xc0", 1, 8, "marks 2"),
        (INDEX_VARINT, b"\x09", 1, 8, "past the tensor"),
        (INDEX_VARINT, b"\x04\x03", 2, 8, "past the tensor"),
        (INDEX_ALL, b"", 3, 4, "k == n"),
        (INDEX_RICE, b"\x20\x00", 1, 8, "parameter 32"),
        (INDEX_RICE, b"\x00\xff", 1, 8, "ends 0 gaps"),
        (INDEX_RICE, b"\x00\x00\x00", 1, 8, "past its 1 gaps"),
        (INDEX_RICE, b"\x02\x00\x41", 1, 8, "remainder padding"),
        (INDEX_RICE, b"\x00\xfe\x80", 2, 8, "position 9 is past the tensor"),
        (INDEX_RICE, b"\x00", 1, 8, "Rice coding of 1 positions in 1 bytes"),
        (7, b"", 0, 4, "unknown index coding"),
    ],
)
def test_decode_indices_refuses_bad_input(kind, data, k, n, match):
    with pytest.raises(UpdateFormatError, match=match):
        decode_indices(kind, data, k, n)


def test_select_topk_never_keeps_zeros_and_is_sorted():
    x = np.array([0.0, -5.0, 0.0, 2.0, -1.0, 0.0], np.float32)
    assert select_topk(x, 2).tolist() == [1, 3]
    assert select_topk(x, 10).tolist() == [1, 3, 4]
    assert select_topk(x, 0).tolist() == []


def test_encoding_is_deterministic():
    rng = np.random.default_rng(5)
    delta = {
        "a": rng.standard_normal((40, 30)).astype(np.float32),
        "b": rng.standard_normal(7).astype(np.float32),
    }
    header = UpdateHeader("m", "1", "j", "d", 0)
    one = pack_update(header, encode_delta(delta, density=0.05, bits=4))
    two = pack_update(
        header, encode_delta({k: v.copy() for k, v in delta.items()}, density=0.05, bits=4)
    )
    assert one == two


def test_nan_and_inf_are_refused_naming_the_tensor():
    delta = {
        "ok": np.ones(3, np.float32),
        "fc.weight": np.array([[1.0, np.nan], [np.inf, 2.0]], np.float32),
    }
    with pytest.raises(
        NonFiniteDeltaError, match=r"'fc\.weight' has 1 NaN and 1 Inf .*index \(0, 1\)"
    ):
        encode_delta(delta, density=0.5)
    assert issubclass(NonFiniteDeltaError, InputError)


def test_compute_delta_checks_tables_and_overflow():
    base = {"w": np.zeros((2, 2), np.float32), "b": np.zeros(2, np.float32)}
    new = {"w": np.ones((2, 2), np.float32), "b": np.full(2, 0.5, np.float32)}
    delta = compute_delta(new, base)
    np.testing.assert_array_equal(delta["w"], np.ones((2, 2)))
    assert delta["b"].dtype == np.float32
    with pytest.raises(TensorTableMismatchError, match=r"'w': shape \(3,\)"):
        compute_delta({"w": np.ones(3, np.float32), "b": new["b"]}, base)
    with pytest.raises(NonFiniteDeltaError, match="'w'"):
        compute_delta(
            {"w": np.full((2, 2), 3e38), "b": new["b"]},
            {"w": np.full((2, 2), -3e38), "b": base["b"]},
        )


def test_check_table_lists_every_difference():
    model = (TensorSpec("w", (4, 3)), TensorSpec("b", (3,)), TensorSpec("h", (2,), "float16"))
    update = (TensorSpec("w", (3, 4)), TensorSpec("b", (3,)), TensorSpec("x", (1,)))
    with pytest.raises(TensorTableMismatchError) as err:
        check_table(update, model)
    msg = str(err.value)
    assert "'w': shape (3, 4) in update, model has (4, 3)" in msg
    assert "missing tensor 'h'" in msg and "unexpected tensor 'x'" in msg
    with pytest.raises(
        TensorTableMismatchError, match="dtype float32 in update, model has float16"
    ):
        check_table((TensorSpec("h", (2,)),), (TensorSpec("h", (2,), "float16"),))


def test_unsupported_dtype_and_bits_are_refused():
    with pytest.raises(UpdateFormatError, match="int32"):
        tensor_table({"i": np.zeros(3, np.int32)})
    with pytest.raises(ValueError, match="bit width 3"):
        encode_tensors({"a": np.ones(2, np.float32)}, {"a": np.arange(2)}, 3)


@FAST
@given(
    kind=st.sampled_from([INDEX_ALL, INDEX_VARINT, INDEX_BITMAP, INDEX_RICE]),
    data=st.binary(max_size=40),
    k=st.integers(0, 50),
    n=st.integers(0, 300),
)
def test_decode_indices_of_arbitrary_bytes_is_refused_or_valid(kind, data, k, n):
    # (the control that valid bytes are accepted is the test below)
    try:
        idx = decode_indices(kind, data, k, n)
    except UpdateFormatError:
        return
    assert idx.size == k and (np.diff(idx) > 0).all()
    assert k == 0 or (idx[0] >= 0 and idx[-1] < n)


@st.composite
def index_sets(draw) -> tuple[np.ndarray, int]:
    """(sorted positions, n) at densities that make encode_indices pick every coding."""
    n = draw(st.integers(1, 20_000))
    if draw(st.booleans()):  # evenly spaced: small equal gaps suit varints
        return np.arange(draw(st.integers(0, n - 1)), n, draw(st.integers(1, 200))), n
    p = draw(st.sampled_from([0.0005, 0.005, 0.05, 0.3, 0.8, 1.0]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return np.flatnonzero(rng.random(n) < p), n


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=index_sets(), damage=st.lists(st.tuples(st.integers(0), st.integers(1, 255)), max_size=3))
def test_index_codings_accept_every_valid_input_and_refuse_or_validate_damaged_ones(case, damage):
    idx, n = case
    kind, raw = encode_indices(idx, n)
    # the control group: untouched bytes of every coding decode to exactly the positions
    np.testing.assert_array_equal(decode_indices(kind, raw, idx.size, n), idx)
    if not damage or not raw:
        return
    bad = bytearray(raw)
    for pos, flip in damage:
        bad[pos % len(bad)] ^= flip  # a byte that really changed
    try:
        got = decode_indices(kind, bytes(bad), idx.size, n)
    except UpdateFormatError:
        return
    assert got.size == idx.size and (np.diff(got) > 0).all()
    assert idx.size == 0 or (got[0] >= 0 and got[-1] < n)


def test_the_index_control_group_covers_every_coding():
    rng = np.random.default_rng(0)
    kinds = set()
    cases = [(np.flatnonzero(rng.random(n) < p), n) for n, p in ((2000, 0.002), (2000, 0.3), (50, 1.0))]
    for idx, n in [*cases, (np.arange(0, 10_000, 100), 10_000), (np.arange(0, 1000, 2), 1000)]:
        kind, raw = encode_indices(idx, n)
        np.testing.assert_array_equal(decode_indices(kind, raw, idx.size, n), idx)
        kinds.add(kind)
    assert kinds == {INDEX_ALL, INDEX_VARINT, INDEX_BITMAP, INDEX_RICE}
