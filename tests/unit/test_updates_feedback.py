"""Error feedback, the residual store, the encoder's commit protocol and the warm-up schedule."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from edge_agent.atomic import CorruptFileError, write_checked
from edge_agent.updates import (
    CompressionPolicy,
    NonFiniteDeltaError,
    Reassembler,
    ResidualStore,
    TensorSpec,
    TensorTableMismatchError,
    UpdateEncoder,
    decode_update,
    tensor_table,
)

SHAPES = {"w": (6, 5), "b": (5,), "s": ()}


def _deltas(rounds: int, seed: int, scale: float = 1.0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        {n: (rng.standard_normal(shape) * scale).astype(np.float32) for n, shape in SHAPES.items()}
        for _ in range(rounds)
    ]


TINY = float(np.float32(1e-30))
ELEM = st.floats(-1e4, 1e4, width=32) | st.floats(-TINY, TINY, width=32)


@st.composite
def delta_sequences(draw):
    shapes = {
        "w": draw(hnp.array_shapes(min_dims=1, max_dims=2, max_side=6)),
        "b": (draw(st.integers(0, 4)),),
    }
    rounds = draw(st.integers(1, 5))
    return [
        {n: draw(hnp.arrays(np.float32, shape, elements=ELEM)) for n, shape in shapes.items()}
        for _ in range(rounds)
    ]


POLICIES = st.one_of(
    st.builds(
        CompressionPolicy,
        density=st.floats(0.05, 1.0),
        bits=st.sampled_from([1, 4, 8, 32]),
        scope=st.sampled_from(["global", "tensor"]),
        warmup_rounds=st.integers(0, 3),
    ),
    st.builds(CompressionPolicy, budget_bytes=st.integers(200, 600)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seq=delta_sequences(), policy=POLICIES)
def test_sent_plus_residual_equals_sum_of_true_deltas(seq, policy):
    enc = UpdateEncoder(model_name="m", device_id="d", policy=policy)
    total_true = {n: np.zeros(a.shape) for n, a in seq[0].items()}
    total_sent = {n: np.zeros(a.shape) for n, a in seq[0].items()}
    scale = 0.0
    table = tensor_table(seq[0])
    for rnd, delta in enumerate(seq):
        update = enc.encode(delta, job_id="j", round=rnd, model_version="1")
        # What was sent is exactly what the coordinator decodes from the wire.
        received = decode_update(update.payload, expected_table=table).deltas
        for n in delta:
            np.testing.assert_array_equal(received[n], update.sent[n])
            total_true[n] += delta[n]
            total_sent[n] += received[n]
        scale += max((float(np.abs(a).max()) if a.size else 0.0) for a in delta.values())
        enc.commit(update)
    residual = enc.residual
    for n in total_true:
        # float32 arithmetic in each round's `delta + residual` and `corrected - sent`.
        tol = 2.0**-21 * len(seq) * scale + 1e-37
        np.testing.assert_allclose(total_sent[n] + residual[n], total_true[n], rtol=0, atol=tol)


def test_error_feedback_sends_what_an_earlier_round_dropped():
    enc = UpdateEncoder(
        model_name="m", device_id="d", policy=CompressionPolicy(density=0.25, bits=32)
    )
    first = {"v": np.array([4.0, 3.0, 2.0, 1.0], np.float32)}
    u1 = enc.encode(first, job_id="j", round=0, model_version="1")
    np.testing.assert_array_equal(u1.sent["v"], [4, 0, 0, 0])
    enc.commit(u1)
    u2 = enc.encode({"v": np.zeros(4, np.float32)}, job_id="j", round=1, model_version="1")
    np.testing.assert_array_equal(u2.sent["v"], [0, 3, 0, 0])  # the residual's largest
    np.testing.assert_array_equal(u2.residual["v"], [0, 0, 2, 1])
    without = UpdateEncoder(
        model_name="m",
        device_id="d",
        policy=CompressionPolicy(density=0.25, bits=32, error_feedback=False),
    )
    w1 = without.encode(first, job_id="j", round=0, model_version="1")
    without.commit(w1)
    assert w1.residual is None and without.residual is None
    w2 = without.encode({"v": np.zeros(4, np.float32)}, job_id="j", round=1, model_version="1")
    assert not w2.sent["v"].any()


def test_encode_does_not_change_state_until_commit():
    enc = UpdateEncoder(model_name="m", device_id="d", policy=CompressionPolicy(density=0.2))
    d = _deltas(1, 0)[0]
    a = enc.encode(d, job_id="j", round=0, model_version="1")
    b = enc.encode(d, job_id="j", round=0, model_version="1")
    assert a.payload == b.payload and enc.residual is None
    enc.commit(a)
    c = enc.encode(d, job_id="j", round=0, model_version="1")
    assert c.payload != a.payload  # the residual now contributes


def test_nan_delta_is_refused_and_nothing_is_sent_or_changed(tmp_path):
    store = ResidualStore(tmp_path / "residual.bin")
    enc = UpdateEncoder(
        model_name="m", device_id="d", policy=CompressionPolicy(density=0.2), store=store
    )
    d = _deltas(2, 1)
    enc.commit(enc.encode(d[0], job_id="j", round=0, model_version="1"))
    before = store.path.read_bytes()
    bad = {**d[1], "w": d[1]["w"].copy()}
    bad["w"][2, 3] = np.nan
    with pytest.raises(
        NonFiniteDeltaError, match=r"'w' has 1 NaN and 0 Inf values \(first at index \(2, 3\)\)"
    ):
        enc.encode(bad, job_id="j", round=1, model_version="1")
    bad["w"][2, 3] = np.inf
    with pytest.raises(NonFiniteDeltaError, match="refusing to encode"):
        enc.encode(bad, job_id="j", round=1, model_version="1")
    assert store.path.read_bytes() == before and enc.last_round == 0


def test_residual_overflow_is_refused():
    enc = UpdateEncoder(
        model_name="m", device_id="d", policy=CompressionPolicy(density=0.01, bits=32)
    )
    big = {"v": np.array([3e38, 3e38], np.float32)}
    enc.commit(enc.encode(big, job_id="j", round=0, model_version="1"))
    with pytest.raises(NonFiniteDeltaError, match="delta \\+ residual"):
        enc.encode(big, job_id="j", round=1, model_version="1")


def test_residual_survives_a_reboot_and_encoding_resumes_identically(tmp_path):
    policy = CompressionPolicy(budget_bytes=400, warmup_rounds=2)
    seq = _deltas(5, 2)
    steady = UpdateEncoder(model_name="head", device_id="d", policy=policy)
    payloads = []
    for rnd, d in enumerate(seq):
        u = steady.encode(d, job_id="j", round=rnd, model_version="1")
        steady.commit(u)
        payloads.append(u.payload)
    path = tmp_path / "state" / "residual.bin"
    for rnd, d in enumerate(seq):
        # A fresh encoder per round: as after a reboot, all state comes from the file.
        enc = UpdateEncoder(
            model_name="head", device_id="d", policy=policy, store=ResidualStore(path)
        )
        assert enc.last_round == (rnd - 1 if rnd else None)
        u = enc.encode(d, job_id="j", round=rnd, model_version="1")
        assert u.payload == payloads[rnd]
        enc.commit(u)
    stored = ResidualStore(path).load(expected_table=tensor_table(seq[0]))
    assert stored.round == 4 and stored.model_name == "head"
    for n, arr in steady.residual.items():
        np.testing.assert_array_equal(stored.residual[n], arr)


def test_residual_store_refuses_damaged_files(tmp_path):
    path = tmp_path / "residual.bin"
    store = ResidualStore(path)
    assert store.load() is None
    residual = {"w": np.ones((2, 3), np.float32), "b": np.zeros(3, np.float32)}
    store.save(residual, model_name="m", round=3)
    good = path.read_bytes()
    path.write_bytes(good[:-5])  # truncated
    with pytest.raises(CorruptFileError, match="payload is"):
        store.load()
    path.write_bytes(bytes(len(good)))  # zero-filled, as SD cards leave after power loss
    with pytest.raises(CorruptFileError, match="zero-filled"):
        store.load()
    flipped = bytearray(good)
    flipped[-3] ^= 0x10
    path.write_bytes(bytes(flipped))
    with pytest.raises(CorruptFileError, match="sha256 mismatch"):
        store.load()
    write_checked(path, b"NOPE" + good[48:])  # framing intact, wrong magic
    with pytest.raises(CorruptFileError, match="not a residual file"):
        store.load()
    # Well-framed but holding a NaN (written by a buggy version): refused, not propagated.
    store.save(
        {"w": np.full((2, 3), np.nan, np.float32), "b": np.zeros(3, np.float32)},
        model_name="m",
        round=3,
    )
    with pytest.raises(CorruptFileError, match="'w' holds NaN"):
        store.load()
    store.save(residual, model_name="m", round=3)
    with pytest.raises(TensorTableMismatchError, match=r"'w': shape \(2, 3\) in residual"):
        store.load(expected_table=[TensorSpec("w", (3, 2)), TensorSpec("b", (3,))])
    # A float16 model's residual is still float32: names and shapes must match, not dtype.
    loaded = store.load(
        expected_table=[TensorSpec("w", (2, 3), "float16"), TensorSpec("b", (3,), "float16")]
    )
    np.testing.assert_array_equal(loaded.residual["w"], residual["w"])
    store.clear()
    assert not path.exists()


def test_encoder_with_a_corrupt_store_raises_and_reset_recovers(tmp_path):
    path = tmp_path / "r.bin"
    path.write_bytes(b"\x00" * 100)
    with pytest.raises(CorruptFileError):
        UpdateEncoder(model_name="m", device_id="d", store=ResidualStore(path))
    ResidualStore(path).clear()
    enc = UpdateEncoder(model_name="m", device_id="d", store=ResidualStore(path))
    assert enc.residual is None


def test_residual_for_another_table_is_refused_until_reset(tmp_path):
    store = ResidualStore(tmp_path / "r.bin")
    enc = UpdateEncoder(
        model_name="m", device_id="d", policy=CompressionPolicy(density=0.2), store=store
    )
    enc.commit(enc.encode(_deltas(1, 3)[0], job_id="j", round=0, model_version="1"))
    other = {
        "w": np.ones((7, 5), np.float32),
        "b": np.ones(5, np.float32),
        "s": np.ones((), np.float32),
    }
    with pytest.raises(TensorTableMismatchError, match=r"stored residual .*'w': shape \(6, 5\)"):
        enc.encode(other, job_id="j", round=1, model_version="2")
    enc.reset()
    assert not store.path.exists()
    enc.encode(other, job_id="j", round=1, model_version="2")


def test_chunks_carry_the_signature_and_the_ratio_is_counted_on_the_wire():
    policy = CompressionPolicy(budget_bytes=3000, signature_bytes=64)
    enc = UpdateEncoder(model_name="m", device_id="d", policy=policy, chunk_size=1024)
    d = {"w": np.random.default_rng(0).standard_normal((100, 100)).astype(np.float32)}
    u = enc.encode(d, job_id="j", round=0, model_version="1")
    chunks = u.chunks(signature=b"\x01" * 64)
    assert sum(len(c) for c in chunks) == u.wire_bytes <= 3000
    assert u.ratio == pytest.approx(40_000 / u.wire_bytes)
    r = Reassembler()
    out = [x for c in chunks if (x := r.add(c))][0]
    assert out.digest == u.digest and out.signature == b"\x01" * 64


def test_warmup_schedule_decays_geometrically_to_the_target():
    p = CompressionPolicy(budget_bytes=1000, warmup_rounds=4, warmup_factor=16.0)
    assert [p.settings(r).budget_bytes for r in range(6)] == [16000, 8000, 4000, 2000, 1000, 1000]
    q = CompressionPolicy(density=0.01, bits=4, warmup_rounds=2, warmup_factor=4.0)
    assert [round(q.settings(r).density, 6) for r in range(3)] == [0.04, 0.02, 0.01]
    assert (
        CompressionPolicy(density=0.5, warmup_rounds=3, warmup_factor=10).settings(0).density == 1.0
    )
    assert CompressionPolicy(density=0.1).settings(0).density == 0.1


def test_warmup_sends_more_in_early_rounds():
    policy = CompressionPolicy(budget_bytes=400, warmup_rounds=3, warmup_factor=8.0)
    enc = UpdateEncoder(model_name="m", device_id="d", policy=policy)
    sizes = []
    for rnd, d in enumerate(_deltas(5, 4, scale=1.0)):
        d = {"w": np.tile(d["w"], (40, 40))}
        u = enc.encode(d, job_id="j", round=rnd, model_version="1")
        enc.commit(u)
        sizes.append(u.wire_bytes)
    assert sizes[0] > sizes[1] > sizes[2] > sizes[3] and max(sizes[3:]) <= 400


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"density": 0.0}, "density"),
        ({"bits": 2}, "bits"),
        ({"budget_bytes": 0}, "budget_bytes"),
        ({"budget_bytes": 100, "scope": "tensor"}, "globally"),
        ({"warmup_factor": 0.5}, "warmup"),
        ({"bits_choices": (3,)}, "bits_choices"),
        ({"scope": "layer"}, "scope"),
    ],
)
def test_policy_validates_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CompressionPolicy(**kwargs)


def test_encoder_declares_the_models_dtypes_and_checks_deltas_against_its_table():
    model = {"w": np.zeros((4, 3), np.float16), "b": np.zeros(3, np.float16)}
    table = tensor_table(model)
    delta = {"w": np.ones((4, 3), np.float32), "b": np.ones(3, np.float32)}
    enc = UpdateEncoder(
        model_name="m", device_id="d", policy=CompressionPolicy(density=0.5), table=table
    )
    update = enc.encode(delta, job_id="j", round=0, model_version="1")
    decoded = decode_update(update.payload, expected_table=table)
    assert decoded.table == table and decoded.deltas["w"].dtype == np.float32
    plain = UpdateEncoder(model_name="m", device_id="d", policy=CompressionPolicy(density=0.5))
    with pytest.raises(
        TensorTableMismatchError, match="dtype float32 in update, model has float16"
    ):
        decode_update(
            plain.encode(delta, job_id="j", round=0, model_version="1").payload,
            expected_table=table,
        )
    with pytest.raises(
        TensorTableMismatchError, match=r"delta does not match the model: tensor 'b': shape \(4,\)"
    ):
        enc.encode(
            {"w": delta["w"], "b": np.ones(4, np.float32)}, job_id="j", round=1, model_version="1"
        )
