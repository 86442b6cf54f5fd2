"""Updates that echo each other share one vote (coordinator/strategies/echoes.py): the echo
counts, the sketch they are measured on, and the trust rule's use of them -- colluders that
each earn trust count as one, honest updates without a near-twin keep their weight, and the
streaming form (sketches carried through serve workers' partial files) equals the dense one."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_agent.coordinator.partials import partial_from_bytes, partial_to_bytes
from edge_agent.coordinator.strategies import (
    Contribution,
    DenseUpdate,
    RoundEvidence,
    ServerEvidence,
    StrategyOptions,
    make_strategy,
)
from edge_agent.coordinator.strategies.echoes import (
    ECHO_FROM,
    SKETCH_DIM,
    echo_counts,
    sketch,
    sketch_dense,
)
from edge_agent.coordinator.streaming import Layout, sparse_from_dense


def _unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


def test_k_copies_of_one_direction_count_as_one_and_unrelated_ones_as_themselves() -> None:
    rng = np.random.default_rng(0)
    same = rng.normal(size=50)
    sketches = {f"c{i}": (1.0 + i) * same for i in range(3)}  # the norm does not matter, the direction does
    sketches |= {f"h{i}": rng.normal(size=50) for i in range(4)}
    e = echo_counts(sketches)
    assert all(abs(e[f"c{i}"] - 3.0) < 1e-9 for i in range(3))
    assert all(e[f"h{i}"] < 1.2 for i in range(4))  # random 50-d directions: cosines ~ +-0.14


def test_the_ramp_is_continuous_between_its_ends() -> None:
    def pair(cos: float) -> float:
        a = np.array([1.0, 0.0])
        b = np.array([cos, np.sqrt(1 - cos * cos)])
        return echo_counts({"a": a, "b": b})["a"]

    assert pair(ECHO_FROM - 0.01) == 1.0 and pair(0.999) == 2.0
    mids = [pair(c) for c in np.linspace(ECHO_FROM, 0.95, 6)]
    assert mids == sorted(mids) and 1.0 <= mids[0] < mids[-1] <= 2.0


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(2, 6))
def test_echo_counts_do_not_depend_on_order_or_norms(seed: int, n: int) -> None:
    rng = np.random.default_rng(seed)
    base = rng.normal(size=8)
    vecs = {f"d{i}": base + rng.normal(size=8) * rng.choice([0.05, 1.0]) for i in range(n)}
    e = echo_counts(vecs)
    perm = list(vecs)[::-1]
    e2 = echo_counts({d: vecs[d] * rng.uniform(0.1, 10.0) for d in perm})
    assert all(abs(e[d] - e2[d]) < 1e-9 and 1.0 <= e[d] <= n for d in vecs)


def test_the_count_sketch_estimates_cosines_of_large_heads() -> None:
    rng = np.random.default_rng(1)
    size = 200_000
    a = rng.normal(size=size)
    for target in (0.0, 0.5, 0.9):
        b = target * a + np.sqrt(1 - target**2) * rng.normal(size=size)
        true = float(_unit(a) @ _unit(b))
        sa, sb = sketch_dense(a), sketch_dense(b)
        assert sa.shape == (SKETCH_DIM,)
        assert abs(float(_unit(sa) @ _unit(sb)) - true) < 0.12
    # a sparse update (top-k) gives the sketch of its dense form
    idx = np.sort(rng.choice(size, 5000, replace=False))
    dense = np.zeros(size)
    dense[idx] = a[idx]
    np.testing.assert_allclose(sketch(idx, a[idx].astype(np.float32), size), sketch_dense(dense), rtol=1e-5, atol=1e-5)


def _trust_round(vecs: dict[str, np.ndarray], size: int, *, via_bytes: bool):
    layout = Layout({"w": np.zeros(size, np.float32)})
    server_dir = np.zeros(size)
    server_dir[0] = 1.0
    server = ServerEvidence(update=server_dir, class_gradients=-np.stack([server_dir, server_dir]),
                            root_counts=np.array([5, 5]), weight=10.0)
    rule = make_strategy("trust", StrategyOptions(), RoundEvidence(layout, server=server))
    part = rule.start()
    for d, v in vecs.items():
        v = v.astype(np.float32).astype(np.float64)
        rule.accumulate(part, Contribution(d, sparse_from_dense({"w": v}, layout), 10.0, None))
    if via_bytes:
        part = partial_from_bytes(partial_to_bytes(part), layout)
    stored = {d: sparse_from_dense({"w": v.astype(np.float32).astype(np.float64)}, layout) for d, v in vecs.items()}
    got = rule.finalize(part, stored.__getitem__)
    ref = rule.reference([DenseUpdate(d, v.astype(np.float32).astype(np.float64), 10.0) for d, v in vecs.items()])
    return got, ref


def test_colluders_that_each_earn_trust_share_one_vote_through_workers_partials() -> None:
    rng = np.random.default_rng(2)
    size = 3000  # past SKETCH_DIM: the count sketch, carried through a partial file
    push = np.zeros(size)
    push[0] = 0.3  # enough agreement with the server's direction to earn full trust (cosine > 0.1)
    attack = push + _unit(rng.normal(size=size))
    vecs = {f"bad{i}": attack * (1 + 0.01 * i) for i in range(3)}
    vecs |= {f"good{i}": push + _unit(rng.normal(size=size)) for i in range(3)}
    got, ref = _trust_round(vecs, size, via_bytes=True)
    assert all(t == 1.0 for t in got.info["trust"].values())  # trust alone cannot tell them apart
    for i in range(3):
        assert abs(got.info["echoes"][f"bad{i}"] - 3.0) < 0.1 and f"good{i}" not in got.info["echoes"]
        assert abs(got.shares[f"bad{i}"] * 3 - got.shares["good0"]) < 0.02 * got.shares["good0"]
    np.testing.assert_allclose(got.vec, ref.vec, rtol=1e-6, atol=1e-9)
    assert ref.info["echoes"].keys() == got.info["echoes"].keys()


def test_a_colluder_alone_in_its_round_echoes_the_round_before_but_not_its_own_past() -> None:
    rng = np.random.default_rng(3)
    attack, honest = rng.normal(size=64), rng.normal(size=64)
    earlier = {"bad-1": attack * 1.02, "good": honest, "bad-2": attack}  # the previous round's trusted updates
    e = echo_counts({"bad-2": attack, "good": honest + 0.01 * rng.normal(size=64)}, earlier)
    assert abs(e["bad-2"] - 2.0) < 1e-3  # bad-1's twin; its own earlier update does not count
    assert e["good"] < 1.01  # a device repeating its own direction is not an echo
    assert echo_counts({"x": attack}, {"y": np.zeros(32)})["x"] == 1.0  # another layout's sketches are ignored


def test_the_previous_rounds_sketches_are_kept_crash_safe_and_a_bad_file_only_costs_the_echoes(tmp_path, caplog) -> None:
    from types import SimpleNamespace

    from edge_agent.coordinator.aggregation import RoundAggregation
    from edge_agent.coordinator.strategies import Aggregate

    agg = RoundAggregation(registry=SimpleNamespace(state_dir=tmp_path), heads=None, policy=None, evidence=None)
    job, rnd = SimpleNamespace(id="job-1"), SimpleNamespace(number=4)
    sk = {"a": np.arange(8, dtype=np.float32), "b": np.ones(8, np.float32)}
    agg.remember(job, rnd, Aggregate(np.zeros(8), {"a": 0.5, "b": 0.5}, sketches=sk))
    got = agg._earlier_sketches("job-1", 5)
    assert set(got) == {"a", "b"} and np.array_equal(got["a"], sk["a"])
    assert agg._earlier_sketches("job-1", 4) is None  # no round 3 was kept
    agg.remember(job, SimpleNamespace(number=5), Aggregate(np.zeros(8), {"a": 1.0}, sketches={"a": sk["a"]}))
    assert sorted(p.name for p in (tmp_path / "evidence" / "job-1").iterdir()) == ["r5.echo.npz"]  # r4 is no longer read
    assert set(agg._earlier_sketches("job-1", 6)) == {"a"}
    path = tmp_path / "evidence" / "job-1" / "r5.echo.npz"
    path.write_bytes(path.read_bytes()[:40])
    assert agg._earlier_sketches("job-1", 6) is None and "unreadable" in caplog.text
