"""Streaming aggregation (issue 18): the rules' streaming partials and coordinate-block
machinery give the batch result (each rule's dense reference over the decoded deltas),
survive a restart mid-round, read O(1) registry rows per received update, and keep what
arrived."""

from __future__ import annotations

import base64
import shutil
import sqlite3
import tempfile
from pathlib import Path

import numpy as np
import pytest

from edge_agent.coordinator import registry_db as registry_module
from edge_agent.coordinator.aggregate import apply_delta
from edge_agent.coordinator.records import RoundState, UpdateStatus
from edge_agent.coordinator.registry import MIGRATIONS, Registry
from edge_agent.coordinator.rounds import RoundEngine, RoundPolicy
from edge_agent.coordinator.strategies import (
    DenseUpdate,
    RoundEvidence,
    StrategyOptions,
    make_strategy,
)
from edge_agent.coordinator.streaming import (
    Layout,
    SignCounts,
    block_gram,
    block_window_mean,
    sparse_from_dense,
    sparse_window_sum,
)
from edge_agent.keys import fingerprint, generate_private_key, public_key_bytes
from edge_agent.updates.wire import UpdateHeader, decode_update, encode_update

T0 = 1_700_000_000.0
SHAPES = {"w": (12, 20), "b": (12,)}
KEYS = [generate_private_key() for _ in range(40)]
IDS = [fingerprint(k) for k in KEYS]
PUBS = [base64.b64encode(public_key_bytes(k)).decode() for k in KEYS]


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    """Real files, on tmpfs when there is one (every update is fsync'ed)."""
    if not Path("/dev/shm").is_dir():
        yield tmp_path
        return
    d = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="streaming-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


class Coordinator:
    def __init__(self, state_dir: Path, n: int, **policy: object) -> None:
        self.dir, self.n, self.policy = state_dir, n, RoundPolicy(**policy)
        self.t = T0
        self.open()
        rng = np.random.default_rng(5)
        self.base = {k: (rng.normal(size=s) * 0.1).astype(np.float32) for k, s in SHAPES.items()}
        self.reg.add_model_version(name="m", version="1", head=self.base)
        for did, pub in zip(IDS[:n], PUBS[:n], strict=True):
            self.reg.enrol_device(device_id=did, public_key=pub, fleet="f", approved=True)
            self.reg.record_state(did, online=True, state={"battery_pct": 90})

    def clock(self) -> float:
        return self.t

    def open(self) -> None:
        self.reg = Registry(state_dir=self.dir, clock=self.clock)
        self.engine = RoundEngine(registry=self.reg, policy=self.policy, clock=self.clock)

    def reopen(self) -> None:
        self.reg.close()
        self.open()

    def start(self, aggregator: str, **params: object) -> object:
        self.engine.start_job(model_name="m", model_version="1", rounds=1, min_devices=1, deadline_s=100,
                              params={"aggregator": aggregator, **params}, job_id="job")
        (plan,) = self.engine.tick().opened
        return plan

    def payload(self, plan: object, i: int, delta: dict[str, np.ndarray]) -> bytes:
        header = UpdateHeader("m", "1", plan.job_id, IDS[i], plan.round)
        return encode_update(header, delta, density=0.5, bits=8)

    def receive(self, payload: bytes, i: int, samples: int) -> str:
        return self.engine.receive_update(payload, sender=IDS[i], num_samples=samples).status

    def close(self) -> object:
        (out,) = self.engine.tick().closed
        return out


def deltas(n: int, seed: int = 0, scales: list[float] | None = None) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    common = {k: rng.normal(size=s) for k, s in SHAPES.items()}
    scales = scales or [1.0] * n
    return [{k: (0.02 * sc * (v + rng.normal(size=v.shape))).astype(np.float32) for k, v in common.items()}
            for sc in scales]


def published(c: Coordinator, out: object) -> dict[str, np.ndarray]:
    return c.reg.load_head(out.new_version)


def reference(c: Coordinator, aggregator: str, sent: list[tuple[dict[str, np.ndarray], int]],
              **options: float) -> dict[str, np.ndarray]:
    """The rule's dense reference over the decoded deltas, applied to the base: what the
    engine's streaming close must publish."""
    layout = Layout(c.base)
    ups = []
    for i, (d, n) in enumerate(sent):
        present = None if set(d) == set(layout.names) else tuple(t for t, k in enumerate(layout.names) if k in d)
        vec = np.concatenate([np.asarray(d[k], np.float64).ravel() if k in d else np.zeros(int(np.prod(SHAPES[k])))
                              for k in layout.names])
        ups.append(DenseUpdate(IDS[i], vec, float(n), present))
    agg = make_strategy(aggregator, StrategyOptions(**options), RoundEvidence(layout)).reference(ups)
    return apply_delta(c.base, layout.unflatten(agg.vec))


# ---------------------------------------------------------------- the coordinate-block maths
def test_sparse_window_sum_equals_sorting_the_dense_columns() -> None:
    rng = np.random.default_rng(0)
    for trial in range(60):
        n, size = int(rng.integers(1, 9)), int(rng.integers(1, 30))
        dense = rng.normal(size=(n, size)).round(1)  # ties
        dense[rng.random((n, size)) < 0.5] = 0.0  # missing entries and explicit zeros
        rows, cols = np.nonzero(np.ones_like(dense) if trial % 2 else dense)
        for lo in range(n):
            for hi in range(lo + 1, n + 1):
                want = np.sort(dense, axis=0)[lo:hi].sum(axis=0)
                got = sparse_window_sum(cols, dense[rows, cols], n, lo, hi, size)
                np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_the_one_key_sort_orders_float32_values_as_lexsort_does() -> None:
    from edge_agent.coordinator.streaming import _by_coord_then_value

    rng = np.random.default_rng(1)
    for _ in range(100):
        n = int(rng.integers(1, 400))
        c = rng.integers(0, 40, n)
        v = rng.normal(size=n).astype(np.float32).astype(np.float64)
        v[rng.random(n) < 0.1] = float(np.float32(1e-40))  # subnormals of both signs, ties
        v[rng.random(n) < 0.05] = -float(np.float32(1e-40))
        v[rng.random(n) < 0.1] = -3.0
        for vals in (v, v + 1e-12):  # float32 values (one key) and float64 ones (lexsort)
            o, want = _by_coord_then_value(c, vals), np.lexsort((vals, c))
            assert np.array_equal(c[o], c[want]) and np.array_equal(vals[o], vals[want])


def _sparse_updates(n: int, size: int, density: float, seed: int) -> list:
    rng = np.random.default_rng(seed)
    layout = Layout({"x": np.zeros(size, np.float32)})
    out = []
    for _ in range(n):
        v = np.where(rng.random(size) < density, rng.normal(size=size), 0).astype(np.float32)
        out.append(sparse_from_dense({"x": v}, layout))
    return out


def test_blocks_give_the_same_result_in_any_block_size_cached_or_not() -> None:
    sps = _sparse_updates(7, 1000, 0.3, 1)
    loads = [lambda s=s: s for s in sps]
    kept = sum(s.kept for s in sps)
    dense = np.zeros((7, 1000))
    for i, s in enumerate(sps):
        dense[i, s.idx] = s.vals
    want = np.sort(dense, axis=0)[1:6].mean(axis=0)
    for block_bytes, cache_bytes in ((1 << 26, 1 << 28), (4096, 0), (100, 1 << 28)):
        got = block_window_mean(loads, kept, 1000, 1, 6, block_bytes=block_bytes, cache_bytes=cache_bytes)
        np.testing.assert_array_equal(got, want)
        gram = block_gram(loads, kept, 1000, block_bytes=block_bytes, cache_bytes=cache_bytes)
        np.testing.assert_allclose(gram, dense @ dense.T, rtol=1e-12)


def test_hot_passes_and_sign_counts_give_the_same_window_mean() -> None:
    """Gathering only the hot coordinates' entries, in passes of a few entries, with the signs
    given or counted: the same values as sorting the dense columns, for every window."""
    rng = np.random.default_rng(3)
    for n, density in ((9, 0.05), (9, 0.6), (25, 0.1)):
        sps = _sparse_updates(n, 500, density, int(rng.integers(1 << 30)))
        kept = sum(s.kept for s in sps)
        dense = np.zeros((n, 500))
        for i, s in enumerate(sps):
            dense[i, s.idx] = s.vals
        signs = SignCounts.of([lambda s=s: s for s in sps], 500)
        for lo, hi in ((n // 2, n // 2 + 1), (1, n - 1), (n // 4, n - n // 4)):
            want = np.sort(dense, axis=0)[lo:hi].mean(axis=0)
            for sg in (None, signs):
                for block_bytes, cache_bytes in ((1 << 26, 1 << 28), (200, 64), (48, 8)):
                    got = block_window_mean([lambda s=s: s for s in sps], kept, 500, lo, hi, signs=sg,
                                            block_bytes=block_bytes, cache_bytes=cache_bytes)
                    np.testing.assert_array_equal(got, want)


def test_a_window_of_zeros_reads_no_update() -> None:
    """Many sparse updates whose coordinates rarely overlap: every trimmed window is zeros, and
    with the signs known the mean is found without decoding one update (10,000 devices x 1M
    parameters at 2 % re-decoded every update once per coordinate block before)."""
    sps = _sparse_updates(40, 2000, 0.02, 5)
    signs = SignCounts.of([lambda s=s: s for s in sps], 2000)  # counted as the updates arrived
    reads = []
    loads = [lambda i=i: reads.append(i) or sps[i] for i in range(40)]
    got = block_window_mean(loads, sum(s.kept for s in sps), 2000, 8, 32, signs=signs, cache_bytes=0)
    assert reads == [] and not got.any()
    dense = np.zeros((40, 2000))
    for i, s in enumerate(sps):
        dense[i, s.idx] = s.vals
    # the two lowest per coordinate: every negative is hot, and they fit one pass (not cached)
    kept = sum(s.kept for s in sps)
    med = block_window_mean(loads, kept, 2000, 0, 2, signs=signs, cache_bytes=8 * kept - 8)
    np.testing.assert_array_equal(med, np.sort(dense, axis=0)[0:2].mean(axis=0))
    assert sorted(reads) == list(range(40))  # one pass: each update read once


# ---------------------------------------------------------------- the engine, end to end
@pytest.mark.parametrize("aggregator", ["fedavg", "fedavg_clipped", "trimmed_mean", "median", "multi_krum",
                                        "median_trust"])
def test_streaming_close_equals_the_batch_aggregate(state_dir: Path, aggregator: str) -> None:
    c = Coordinator(state_dir, 6)
    plan = c.start(aggregator, trim_fraction=0.2)
    scales = [1.0, 1.5, 2.0, 2.5, 3.0, 5.0]  # diverse norms: the largest is clipped (> 2 x median), not rejected
    sent = []
    for i, d in enumerate(deltas(6, 1, scales)):
        payload, samples = c.payload(plan, i, d), 100 + 10 * i
        assert c.receive(payload, i, samples) == "accepted"
        sent.append((decode_update(payload).deltas, samples))
    out = c.close()
    assert out.state is RoundState.AGGREGATED and len(out.accepted) == (6 if aggregator != "multi_krum" else 5)
    if aggregator == "fedavg_clipped":
        assert out.new_version.metrics["clipped"] >= 1 and out.new_version.metrics["decoded_at_close"] >= 1
    expected = reference(c, aggregator, sent, trim_fraction=0.2)
    got = published(c, out)
    for k in SHAPES:
        np.testing.assert_allclose(got[k], expected[k], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("restart", [False, True])
def test_a_tensor_only_some_updates_carry_is_averaged_over_those(state_dir: Path, restart: bool) -> None:
    """A round at mixed depths: devices 0-2 trained `w` and `b`, devices 3-5 only `b` (their
    updates leave `w` out). `w` is the weighted mean of the three that trained it -- not that
    mean diluted by three absent (zero) deltas -- and `b` the mean of all six; the same after
    a restart rebuilds the running sum from the stored payloads."""
    c = Coordinator(state_dir, 6)
    plan = c.start("fedavg")
    sent = []
    for i, d in enumerate(deltas(6, 4)):
        part = d if i < 3 else {"b": d["b"]}
        header = UpdateHeader("m", "1", plan.job_id, IDS[i], plan.round)
        payload, samples = encode_update(header, part, density=1.0, bits=8), 100 + 20 * i
        assert c.receive(payload, i, samples) == "accepted"
        sent.append((decode_update(payload).deltas, samples))
        if restart and i == 3:
            c.reopen()
    out = c.close()
    assert out.state is RoundState.AGGREGATED and len(out.accepted) == 6
    carriers = [(d, n) for d, n in sent if "w" in d]
    want_w = sum(n * d["w"].astype(np.float64) for d, n in carriers) / sum(n for _, n in carriers)
    want_b = sum(n * d["b"].astype(np.float64) for d, n in sent) / sum(n for _, n in sent)
    np.testing.assert_allclose(reference(c, "fedavg", sent)["w"], c.base["w"] + want_w, rtol=1e-6, atol=1e-7)
    got = published(c, out)
    np.testing.assert_allclose(got["w"], c.base["w"] + want_w, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(got["b"], c.base["b"] + want_b, rtol=1e-6, atol=1e-7)
    diluted = c.base["w"] + want_w * sum(n for _, n in sent[:3]) / sum(n for _, n in sent)
    assert np.abs(got["w"] - diluted).max() > 1e-3  # the old rule would have given this


def _send_flat(c: Coordinator, plan, vecs: list[np.ndarray]) -> None:
    """Each flat vector (0.02 x, cut into SHAPES) as device i's accepted update."""
    for i, v in enumerate(vecs):
        d, off = {}, 0
        for k, shape in SHAPES.items():
            d[k] = (0.02 * v[off:off + int(np.prod(shape))]).reshape(shape).astype(np.float32)
            off += int(np.prod(shape))
        header = UpdateHeader("m", "1", plan.job_id, IDS[i], plan.round)
        assert c.receive(encode_update(header, d, density=1.0, bits=8), i, 100) == "accepted"


def test_a_clean_fedavg_close_reads_no_stored_update(state_dir: Path) -> None:
    c = Coordinator(state_dir, 8)
    plan = c.start("fedavg_clipped")
    for i, d in enumerate(deltas(8, 2)):
        c.receive(c.payload(plan, i, d), i, 100)
    out = c.close()
    assert out.new_version.metrics["decoded_at_close"] == 0 and out.new_version.metrics["clipped"] == 0


def test_an_outlier_in_a_fedavg_close_is_clipped_and_the_only_update_read_again(state_dir: Path) -> None:
    """(Its own test: with --pg a test's registries share one database.)"""
    c = Coordinator(state_dir, 8)
    plan = c.start("fedavg_clipped")
    for i, d in enumerate(deltas(8, 2)):
        c.receive(c.payload(plan, i, d if i else {k: 40 * v for k, v in d.items()}), i, 100)
    out = c.close()
    assert not out.rejected and out.new_version.metrics["clipped"] == 1  # a long update is clipped, not ejected
    assert out.new_version.metrics["decoded_at_close"] == 1  # clipping the outlier; nothing else re-read


def test_restart_mid_round_keeps_the_running_sum(state_dir: Path, tmp_path: Path, new_registry_db) -> None:
    sent = deltas(6, 3, [1.0, 1.1, 1.2, 0.9, 1.0, 1.3])
    heads = []
    for restart, where in ((True, state_dir / "a"), (False, state_dir / "b")):
        new_registry_db()  # two registries (on PostgreSQL: two databases)
        c = Coordinator(where, 6)
        plan = c.start("fedavg_clipped")
        payloads = [c.payload(plan, i, d) for i, d in enumerate(sent)]
        for i in range(3):
            assert c.receive(payloads[i], i, 100 + i) == "accepted"
        if restart:
            c.reopen()  # a crash: the in-memory sum is gone; the stored payloads are not
            assert c.receive(payloads[0], 0, 100) == "duplicate"
        for i in range(3, 6):
            assert c.receive(payloads[i], i, 100 + i) == "accepted"
        assert len(c.engine.aggregation._partials[("job", 1)].members) == 6  # rebuilt on first touch, then folded
        out = c.close()
        assert out.state is RoundState.AGGREGATED and len(out.accepted) == 6
        heads.append(published(c, out))
        c.reg.close()
    for k in SHAPES:
        np.testing.assert_allclose(heads[0][k], heads[1][k], rtol=1e-6, atol=1e-7)


def test_restart_while_closing_rebuilds_from_the_payloads(state_dir: Path) -> None:
    c = Coordinator(state_dir, 4)
    plan = c.start("fedavg")
    sent = []
    for i, d in enumerate(deltas(4, 4)):
        payload = c.payload(plan, i, d)
        c.receive(payload, i, 50)
        sent.append((decode_update(payload).deltas, 50))
    c.reg.begin_closing("job", 1)
    c.reopen()
    out = c.close()
    got = published(c, out)
    want = reference(c, "fedavg", sent)
    for k in SHAPES:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7)


@pytest.mark.sqlite_only("counts statements and reads query plans through sqlite3's trace callback")
def test_receiving_an_update_reads_the_same_rows_whatever_the_round_size(state_dir: Path) -> None:
    counts = []
    for n in (4, 40):
        c = Coordinator(state_dir / str(n), n)
        plan = c.start("fedavg_clipped")
        d = deltas(2, 5)
        c.receive(c.payload(plan, 0, d[0]), 0, 10)  # the first one builds the (empty) running sum
        statements: list[str] = []
        c.reg.db.conn.set_trace_callback(statements.append)
        assert c.receive(c.payload(plan, 1, d[1]), 1, 10) == "accepted"
        c.reg.db.conn.set_trace_callback(None)
        counts.append(len(statements))
        plans = [s for s in statements if s.lstrip().upper().startswith("SELECT")]
        for sql in plans:  # every lookup uses an index (no full scan of a table)
            q = c.reg.db.conn.execute("EXPLAIN QUERY PLAN " + sql).fetchall()
            assert not any(str(r[3]).startswith("SCAN") and "USING" not in str(r[3]) for r in q), (sql, q)
        c.reg.close()
    assert counts[0] == counts[1], counts


def test_a_legacy_dense_row_from_before_the_upgrade_is_still_aggregated(state_dir: Path) -> None:
    c = Coordinator(state_dir, 3)
    plan = c.start("fedavg")
    sent = deltas(3, 6)
    for i in range(2):
        c.receive(c.payload(plan, i, sent[i]), i, 10)
    # what a schema-3 coordinator left: a dense .npz delta, no norm / weight
    c.reg.add_update(job_id="job", device_id=IDS[2], round=1, num_samples=10, wire_bytes=1, fp32_bytes=4,
                     sha256="ab" * 32, deltas=sent[2])
    c.reopen()
    out = c.close()
    assert sorted(out.accepted) == sorted(IDS[:3])
    decoded = [decode_update(c.payload(plan, i, sent[i])).deltas for i in range(2)] + [sent[2]]
    want = reference(c, "fedavg", [(d, 10) for d in decoded])
    got = published(c, out)
    for k in SHAPES:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7)


@pytest.mark.sqlite_only("reads sqlite_master (test_registry_pg.py: the same on PostgreSQL)")
def test_schema_3_registry_migrates_with_its_rows(state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry_module, "MIGRATIONS", MIGRATIONS[:3])
    with Registry(state_dir=state_dir) as old:
        old.enrol_device(device_id=IDS[0], public_key=PUBS[0], fleet="f", approved=True)
        assert old.schema_version == 3
    monkeypatch.setattr(registry_module, "MIGRATIONS", MIGRATIONS)
    with Registry(state_dir=state_dir) as reg:
        assert reg.schema_version == len(MIGRATIONS) >= 4
        dev = reg.get_device(IDS[0])
        assert (dev.approved, dev.strikes, dev.quarantined) == (True, 0, False)
    db = sqlite3.connect(state_dir / registry_module.DB_NAME)
    indexes = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    db.close()
    assert {"updates_by_round", "updates_by_device"} <= indexes


def test_a_corrupt_stored_payload_is_rejected_at_close_after_a_restart(state_dir: Path) -> None:
    c = Coordinator(state_dir, 3)
    plan = c.start("fedavg")
    for i, d in enumerate(deltas(3, 7)):
        c.receive(c.payload(plan, i, d), i, 10)
    rec = next(u for u in c.reg.list_updates("job", 1) if u.device_id == IDS[1])
    (state_dir / rec.delta_path).write_bytes(b"\0" * 64)  # the disk lost it
    c.reopen()
    out = c.close()
    assert out.state is RoundState.AGGREGATED and sorted(out.accepted) == sorted([IDS[0], IDS[2]])
    assert out.rejected[IDS[1]].startswith("unreadable")
    assert c.reg.list_updates("job", 1, UpdateStatus.REJECTED)[0].device_id == IDS[1]
