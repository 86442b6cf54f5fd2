"""Every aggregation rule's streaming form equals its dense reference on random fleets
(hypothesis), whatever the order updates arrive in and however they are split between
workers' partials; and each rule's own selection or weighting is pinned by a case where it,
and only it, must give a specific answer (so mutating a rule fails a test even where the
reference shares the mutated helper)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edge_agent.coordinator.partials import partial_from_bytes, partial_to_bytes
from edge_agent.coordinator.strategies import (
    STRATEGIES,
    Contribution,
    DenseUpdate,
    GaussianSum,
    NothingToAggregate,
    RoundEvidence,
    ServerEvidence,
    StrategyOptions,
    claims,
    make_strategy,
)
from edge_agent.coordinator.strategies.claims import Standing
from edge_agent.coordinator.streaming import Layout, Sparse, sparse_from_dense

CLASSES = 3
SHAPES = {"w": (3, 4), "b": (4,), "v": (5,), "out_bias": (CLASSES,)}  # out_bias: what claims.py reads


def _layout() -> Layout:
    return Layout({k: np.zeros(s, np.float32) for k, s in SHAPES.items()})


def _server(rng: np.random.Generator, size: int) -> ServerEvidence:
    return ServerEvidence(update=rng.normal(size=size), class_gradients=rng.normal(size=(CLASSES, size)),
                          root_counts=np.array([5, 3, 4]), weight=12.0)


@st.composite
def fleets(draw):
    seed = draw(st.integers(0, 2**32 - 1))
    n = draw(st.integers(1, 7))
    rng = np.random.default_rng(seed)
    layout = _layout()
    updates = []
    for i in range(n):
        vec = rng.normal(size=layout.size) * rng.choice([1e-3, 1.0, 10.0])
        vec[rng.random(layout.size) < draw(st.sampled_from([0.0, 0.3, 0.8]))] = 0.0  # top-k sparsity
        present = None
        if draw(st.booleans()) and n > 1:  # a job at one depth: some tensors absent
            present = tuple(sorted(rng.choice(len(SHAPES), size=rng.integers(1, len(SHAPES)), replace=False).tolist()))
            mask = np.zeros(layout.size, bool)
            for t in present:
                name = layout.names[t]
                mask[layout.offsets[name]:layout.offsets[name] + math.prod(layout.shapes[name])] = True
            vec = np.where(mask, vec, 0.0)
        vec = vec.astype(np.float32).astype(np.float64)  # updates travel as float32
        counts = tuple(int(c) for c in rng.integers(0, 20, CLASSES)) if draw(st.booleans()) else None
        predicted = tuple(rng.dirichlet(np.ones(CLASSES)).tolist()) if counts and draw(st.booleans()) else None
        updates.append(DenseUpdate(f"dev-{i}", vec, float(rng.integers(1, 1000)), present, counts, predicted))
    history = draw(st.one_of(st.none(), st.floats(0.01, 50.0)))
    standing = {u.device: Standing(float(rng.uniform(-3, 3)), int(rng.integers(1, 6))) for u in updates
                if draw(st.booleans())}  # earlier rounds' label consistency (claims.py)
    return layout, updates, RoundEvidence(layout, history_norm=history, server=_server(rng, layout.size),
                                          claims=standing), seed


def _sparse(u: DenseUpdate, layout: Layout) -> Sparse:
    sp = sparse_from_dense(layout.unflatten(u.vec), layout)
    return dataclasses.replace(sp, present=u.present)


def _stream(rule, updates, layout, order, split, *, via_bytes=False):
    sparse = {u.device: _sparse(u, layout) for u in updates}
    parts = [rule.start(), rule.start()]
    for k, i in enumerate(order):
        u = updates[i]
        rule.accumulate(parts[k % 2 if split else 0],
                        Contribution(u.device, sparse[u.device], u.weight, u.label_counts, u.label_predicted))
    if via_bytes:  # workers keep their partials on disk
        parts = [partial_from_bytes(partial_to_bytes(p), layout) for p in parts]
    merged = rule.merge(parts[0], parts[1])
    return rule.finalize(merged, lambda d: sparse[d])


@pytest.mark.parametrize("name", sorted(STRATEGIES))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleet=fleets(), data=st.data())
def test_the_streaming_form_equals_the_reference(name, fleet, data):
    layout, updates, evidence, seed = fleet
    options = StrategyOptions(trim_fraction=data.draw(st.sampled_from([0.0, 0.2, 0.4])))
    if name == "dp_fedavg":  # the same seeded noise both ways: they must agree exactly, noise included
        noise_seed = data.draw(st.integers(0, 2**32 - 1))
        options = dataclasses.replace(options, dp=GaussianSum(
            clip=data.draw(st.sampled_from([1e-3, 1.0, 10.0])), noise=data.draw(st.sampled_from([0.5, 1.0])),
            denominator=float(len(updates) + data.draw(st.integers(0, 3))),
            rng=lambda: np.random.default_rng(noise_seed)))
    order = data.draw(st.permutations(range(len(updates))))
    split, via_bytes = data.draw(st.booleans()), data.draw(st.booleans())
    try:
        want = make_strategy(name, options, evidence).reference(updates)
    except NothingToAggregate:
        with pytest.raises(NothingToAggregate):
            _stream(make_strategy(name, options, evidence), updates, layout, order, split)
        return
    got = _stream(make_strategy(name, options, evidence), updates, layout, order, split, via_bytes=via_bytes)
    scale = max(1e-12, max(float(np.abs(u.vec).max()) for u in updates))
    np.testing.assert_allclose(got.vec, want.vec, rtol=1e-9, atol=1e-9 * scale)
    assert got.shares.keys() == want.shares.keys()
    for d in want.shares:
        assert got.shares[d] == pytest.approx(want.shares[d], rel=1e-9, abs=1e-12)
    assert got.excluded == want.excluded
    assert got.notes == want.notes
    assert got.info.get("against_claims") == want.info.get("against_claims")


# ---------------------------------------------------------------- each rule's own decision
def _fleet(vectors, weights=None, counts=None):
    layout = Layout({"x": np.zeros(len(vectors[0]), np.float32)})
    ups = [DenseUpdate(f"d{i}", np.asarray(v, np.float64), float(weights[i] if weights else 10),
                       None, counts[i] if counts else None) for i, v in enumerate(vectors)]
    return layout, ups


def _run(name, layout, ups, *, options=None, server=None, history=None, claims=None):
    evidence = RoundEvidence(layout, history_norm=history, server=server, claims=claims)
    rule = make_strategy(name, options or StrategyOptions(), evidence)
    streamed = _stream(rule, ups, layout, range(len(ups)), False)
    return streamed, make_strategy(name, options or StrategyOptions(), evidence).reference(ups)


def test_fedavg_weights_by_samples_capped_at_twice_the_lower_median():
    layout, ups = _fleet([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0], [1.0, 1.0]], weights=[10, 30, 20, 1000])
    got, _ = _run("fedavg", layout, ups)
    # lower median 20 -> cap 40: weights 10, 30, 20, 40
    np.testing.assert_allclose(got.vec, [(10 + 40) / 100, (30 + 40) / 100])
    assert got.info["weights_capped"] == 1


def test_fedavg_clipped_clips_the_long_update_to_twice_the_median_norm():
    vecs = [[1.0, 0], [0, 1.0], [1.0, 0], [0, 1.0], [100.0, 0]]
    layout, ups = _fleet(vecs)
    got, _ = _run("fedavg_clipped", layout, ups)
    assert got.info["clip_bound"] == pytest.approx(2.0) and got.info["clipped"] == 1
    np.testing.assert_allclose(got.vec, [(1 + 1 + 2) / 5, 2 / 5])


def test_median_ignores_one_outlier_and_trimmed_mean_trims_each_end():
    vecs = [[1.0], [2.0], [3.0], [4.0], [1000.0]]
    layout, ups = _fleet(vecs)
    assert _run("median", layout, ups)[0].vec.tolist() == [3.0]
    assert _run("trimmed_mean", layout, ups, options=StrategyOptions(trim_fraction=0.2))[0].vec.tolist() == [3.0]
    assert _run("trimmed_mean", layout, ups, options=StrategyOptions(trim_fraction=0.0))[0].vec.tolist() == [202.0]


def test_multi_krum_and_only_multi_krum_excludes_the_update_far_from_the_rest():
    """Five updates near (1, 1) and one at (-3, 5), with a norm like theirs after scaling:
    Multi-Krum must exclude exactly that one (not "the first N - f")."""
    rng = np.random.default_rng(3)
    vecs = [np.array([1.0, 1.0]) + 0.05 * rng.normal(size=2) for _ in range(5)]
    vecs.insert(2, np.array([-3.0, 5.0]))  # not last: a "first n - f" choice would keep it
    layout, ups = _fleet(vecs)
    got, ref = _run("multi_krum", layout, ups, options=StrategyOptions(krum_fraction=0.2))
    assert set(got.excluded) == {"d2"} and set(ref.excluded) == {"d2"}
    assert got.shares["d2"] == 0.0
    np.testing.assert_allclose(got.vec, np.mean([v for i, v in enumerate(vecs) if i != 2], axis=0))
    for other in ("fedavg", "median", "trimmed_mean", "median_trust"):
        assert not _run(other, layout, ups)[0].excluded


def _server_towards(direction, *, classes=2):
    direction = np.asarray(direction, np.float64)
    # class 0 teaches `direction`, class 1 teaches its perpendicular: descent = -gradient
    perp = np.array([-direction[1], direction[0]])
    return ServerEvidence(update=direction.copy(), class_gradients=-np.stack([direction, perp]),
                          root_counts=np.array([10, 10]), weight=20.0)


def test_trust_zeroes_a_flipped_update_and_rescales_a_scaled_one_to_the_server_norm():
    server = _server_towards([1.0, 0.0])
    # d0 and d2 both agree with the server (cosine 0.89) but not with each other (0.6: no echo)
    layout, ups = _fleet([[1.0, 0.5], [-1.0, -0.5], [300.0, -150.0]], weights=[10, 10, 10],
                         counts=[(1, 0), (1, 0), (1, 0)])
    got, _ = _run("trust", layout, ups, server=server)
    assert got.info["trust"] == {"d0": 1.0, "d1": 0.0, "d2": 1.0}
    assert got.shares["d1"] == 0.0 and got.info["echoes"] == {}
    # d0 kept (norm 1.12 inside [0.5, 2]); d2 moved to 2 x the server norm; the server takes part
    # with its 20 root samples (d1's withheld weight goes nowhere)
    d2 = np.array([300.0, -150.0]) * 2.0 / np.linalg.norm([300.0, -150.0])
    want = (10 * np.array([1.0, 0.5]) + 10 * d2 + 20 * np.array([1.0, 0.0])) / 40
    np.testing.assert_allclose(got.vec, want)
    assert got.info["server_share"] == pytest.approx(20 / 40)
    # the second candidate, for the gate to choose: the server step also stands in for the 10
    # samples d1 did not earn (its 20 root samples already outweigh a typical device's 10)
    alt = got.alternative
    assert alt is not None and alt.info["server_stands_in"] and alt.alternative is None
    np.testing.assert_allclose(alt.vec, (10 * np.array([1.0, 0.5]) + 10 * d2 + 30 * np.array([1.0, 0.0])) / 50)
    assert alt.info["server_share"] == pytest.approx(30 / 50) and alt.shares["d1"] == 0.0
    assert alt.shares["d0"] == pytest.approx(10 / 50)


def test_trusts_second_candidate_counts_the_server_as_one_typical_device_and_in_place_of_what_trust_withheld():
    """A 2-device round whose devices hold 100 samples each, the server 20 root samples: in
    the second candidate the server's step weighs like one device (100), plus the 50 that d1's
    half trust withheld; the first keeps the root samples' 20. Streamed and reference agree."""
    server = _server_towards([1.0, 0.0])  # 20 root samples
    d1 = np.array([0.05, np.sqrt(1 - 0.05**2)])  # cosine 0.05 with the reference: half of kappa 0.1
    layout, ups = _fleet([[1.0, 0.5], d1], weights=[100, 100], counts=[(1, 0), (1, 0)])
    got, ref = _run("trust", layout, ups, server=server)
    assert got.info["trust"] == {"d0": 1.0, "d1": pytest.approx(0.5)}
    first = (100 * np.array([1.0, 0.5]) + 50 * d1 + 20 * np.array([1.0, 0.0])) / 170
    second = (100 * np.array([1.0, 0.5]) + 50 * d1 + 150 * np.array([1.0, 0.0])) / 300
    for agg in (got, ref):
        np.testing.assert_allclose(agg.vec, first, atol=1e-12)
        assert agg.alternative is not None
        np.testing.assert_allclose(agg.alternative.vec, second, atol=1e-12)
        assert agg.alternative.info["server_share"] == pytest.approx(150 / 300, abs=1e-4)


def test_a_distrusted_claim_of_more_data_hands_the_server_only_a_typical_devices_weight():
    """Four honest updates of 10 samples and a flipped one claiming 1e9 (the round caps it at
    2 x 10): the second candidate's server step weighs its 20 root samples plus 10, not plus 20."""
    e = np.eye(6)
    server = ServerEvidence(update=e[0], class_gradients=-np.stack([e[0], e[1]]), root_counts=np.array([10, 10]),
                            weight=20.0)
    honest = [0.5 * e[0] + e[i] for i in range(1, 5)]  # cosine 0.45 with the server, 0.2 with each other
    layout, ups = _fleet([*honest, -e[0]], weights=[10, 10, 10, 10, 1e9], counts=[(1, 0)] * 5)
    got, ref = _run("trust", layout, ups, server=server)
    assert got.info["trust"] == {"d0": 1.0, "d1": 1.0, "d2": 1.0, "d3": 1.0, "d4": 0.0}
    for agg in (got, ref):
        assert agg.alternative is not None
        np.testing.assert_allclose(agg.alternative.vec, (10 * sum(honest) + 30 * e[0]) / 70, atol=1e-12)
        assert agg.alternative.info["server_share"] == round(30 / 70, 4)


def test_trust_offers_no_second_candidate_when_it_would_weigh_the_server_step_the_same():
    """Every update fully trusted and the root samples outweigh a typical device: nothing
    was withheld, so there is nothing for the server step to stand in for."""
    server = _server_towards([1.0, 0.0])  # 20 root samples
    layout, ups = _fleet([[1.0, 0.5], [1.0, -0.5]], weights=[10, 10], counts=[(1, 0), (1, 0)])
    got, ref = _run("trust", layout, ups, server=server)
    assert got.info["trust"] == {"d0": 1.0, "d1": 1.0}
    assert got.alternative is None and ref.alternative is None


def test_trust_compares_each_update_with_what_its_own_classes_teach():
    """An update along class 1's direction is honest for a device holding class 1 only, and
    earns no trust from a device claiming class 0 only: the version is then the server's own
    step alone."""
    server = _server_towards([1.0, 0.0])
    layout, ups = _fleet([[0.0, 1.0]], counts=[(0, 5)])
    assert _run("trust", layout, ups, server=server)[0].info["trust"] == {"d0": 1.0}
    layout, ups = _fleet([[0.0, 1.0]], counts=[(5, 0)])
    got, want = _run("trust", layout, ups, server=server)
    assert got.info["trust"] == {"d0": 0.0} and got.shares == {"d0": 0.0} and got.info["server_share"] == 1.0
    np.testing.assert_allclose(got.vec, [1.0, 0.0])
    np.testing.assert_allclose(want.vec, [1.0, 0.0])


def test_median_trust_counts_a_disagreeing_update_for_nothing_without_rejecting_it():
    layout, ups = _fleet([[1.0, 0.1], [0.9, 0.0], [1.1, -0.1], [-1.0, 0.0]])
    got, _ = _run("median_trust", layout, ups)
    assert got.info["trust"]["d3"] == 0.0 and got.shares["d3"] == 0.0 and not got.excluded
    assert all(got.info["trust"][d] == 1.0 for d in ("d0", "d1", "d2"))
    np.testing.assert_allclose(got.vec, [1.0, 0.0], atol=1e-12)


def test_median_trust_gives_full_trust_only_above_its_own_pull_on_the_median():
    """Full trust from cosine 0.3 with the median (median_kappa), not 0.1: among 5 updates a
    random direction's own pull on the median gave it 0.15-0.18 on the bench. d4 here sits at
    cosine ~0.2 with the median: two-thirds of a vote, not a whole one."""
    honest = [[1.0, 0.2, 0.0], [1.0, -0.2, 0.0], [0.9, 0.0, 0.1], [1.1, 0.0, -0.1]]
    layout, ups = _fleet([*honest, [0.2, 0.0, 0.98]])
    got, want = _run("median_trust", layout, ups)
    cos = got.info["median_cosines"]["d4"]
    assert 0.1 < cos < 0.3
    assert got.info["trust"]["d4"] == pytest.approx(cos / 0.3, abs=1e-3) == want.info["trust"]["d4"]
    assert all(got.info["trust"][f"d{i}"] == 1.0 for i in range(4))
    options = StrategyOptions(median_kappa=0.1)  # the trust rule's kappa would trust it fully
    assert _run("median_trust", layout, ups, options=options)[0].info["trust"]["d4"] == 1.0


def test_median_trust_takes_the_median_again_without_the_updates_against_it():
    """IPM (-1 x the honest mean) drags the coordinate-wise median of five off d1's way: d1's
    cosine falls to 0.06 and it would earn a fifth of its trust (full from median_kappa 0.3).
    The second median, of the updates that agree with the first, gives most of it back (cosine
    0.283); the attacker still counts for nothing."""
    honest = [[-1.0, 4.0, -1.0], [3.0, -1.0, 2.0], [1.0, 4.0, 1.0], [4.0, 4.0, 3.0]]
    vecs = honest + [(-np.mean(honest, axis=0)).tolist()]
    layout, ups = _fleet(vecs)
    got, want = _run("median_trust", layout, ups)
    assert got.info["median_left_out"] == ["d4"] == want.info["median_left_out"]
    first = np.median(np.array(vecs), axis=0)  # the one median a single pass would judge by
    assert np.dot(vecs[1], first) / (np.linalg.norm(vecs[1]) * np.linalg.norm(first)) < 0.1
    assert got.info["median_cosines"]["d1"] == pytest.approx(0.283, abs=1e-3)
    t1 = got.info["median_cosines"]["d1"] / 0.3
    assert got.info["trust"]["d1"] == pytest.approx(t1, abs=1e-3) and got.info["trust"]["d4"] == 0.0
    assert all(got.info["trust"][d] == 1.0 for d in ("d0", "d2", "d3"))
    # d1 echoes no one; d0, d2 and d3 partly echo each other (cosines 0.78, 0.85) and share votes
    votes = {d: got.info["trust"][d] / got.info["echoes"].get(d, 1.0) for d in ("d0", "d1", "d2", "d3")}
    assert set(got.info["echoes"]) == {"d0", "d2", "d3"}
    assert got.shares["d4"] == 0.0 and got.shares["d1"] == pytest.approx(votes["d1"] / sum(votes.values()), abs=1e-3)
    np.testing.assert_allclose(got.vec, want.vec)
    # in a round without a majority (3 updates) the median is taken once
    layout, ups = _fleet(vecs[2:])
    assert _run("median_trust", layout, ups)[0].info["median_left_out"] == []


def _claiming_fleet(flip: float = -1.0):
    """Three devices of a 3-class head whose output bias moves towards the classes each reports
    holding (what training on them does), and d3 holding d0's classes but pushing them down
    (`flip` x d0's update); every update points the median's way in the hidden layer, each
    with a direction of its own there too (so no two echo: cosines <= 0.61)."""
    layout = Layout({"hidden": np.zeros(5, np.float32), "out_bias": np.zeros(3, np.float32)})
    counts = [(30, 5, 5), (5, 30, 5), (5, 5, 30), (30, 5, 5)]
    biases = [[0.6, -0.3, -0.3], [-0.3, 0.6, -0.3], [-0.3, -0.3, 0.6]]
    biases.append([flip * b for b in biases[0]])
    ups = [DenseUpdate(f"d{i}", np.concatenate([np.eye(5)[0] + np.eye(5)[i + 1], b]), 10.0, None, c)
           for i, (b, c) in enumerate(zip(biases, counts, strict=True))]
    return layout, ups


def test_median_trust_counts_for_nothing_an_update_that_pushes_down_its_own_classes():
    """claims.py: d3's direction agrees with the median (cosine > kappa: the median alone
    would trust it fully) but its output bias pushes down the classes it reports holding."""
    layout, ups = _claiming_fleet()
    got, want = _run("median_trust", layout, ups)
    assert got.info["median_cosines"]["d3"] > 0.5
    assert got.info["claims"]["d3"] < -0.5 and all(got.info["claims"][d] > 0.5 for d in ("d0", "d1", "d2"))
    assert got.info["against_claims"] == ["d3"] == want.info["against_claims"]
    assert got.info["trust"]["d3"] == 0.0 and got.shares["d3"] == 0.0 and not got.excluded
    assert all(got.info["trust"][d] == 1.0 for d in ("d0", "d1", "d2"))
    # the same round with d3's updates consistent (no flip): it counts like the others
    layout, honest = _claiming_fleet(flip=1.0)
    got, _ = _run("median_trust", layout, honest)
    assert got.info["against_claims"] == [] and got.shares["d3"] > 0.2


def test_median_trust_judges_a_device_by_its_whole_jobs_record():
    """A device whose earlier rounds were consistent keeps its trust through one round that
    is not (honest updates swing round to round), and one whose earlier rounds pushed its
    classes down stays counted for nothing through a round that looks consistent."""
    layout, ups = _claiming_fleet()
    good = {"d3": Standing(total=4 * 0.8, rounds=4)}  # (3.2 - 0.8) / (5 + 1) > CLAIM_FLOOR
    got, want = _run("median_trust", layout, ups, claims=good)
    assert got.info["against_claims"] == [] == want.info["against_claims"] and got.shares["d3"] > 0.2
    neutral = claims.NEUTRAL_ROUNDS
    assert got.info["claims_standing"]["d3"] == pytest.approx((3.2 + got.info["claims"]["d3"]) / (5 + neutral),
                                                             abs=1e-4)
    layout, honest = _claiming_fleet(flip=1.0)
    bad = {"d3": Standing(total=-5 * 0.8, rounds=5)}
    got, want = _run("median_trust", layout, honest, claims=bad)
    assert got.info["against_claims"] == ["d3"] == want.info["against_claims"] and got.shares["d3"] == 0.0


def test_claims_find_the_output_bias_and_need_two_devices_that_differ():
    layout = Layout({"fc1_weight": np.zeros((4, 3)), "fc1_bias": np.zeros(4), "fc2_weight": np.zeros((3, 4)),
                     "fc2_bias": np.zeros(3)})
    assert claims.output_classes(layout) == 3 and claims.output_bias(layout, 3) == slice(28, 31)
    assert claims.output_bias(layout, 5) is None
    assert claims.output_classes(Layout({"w": np.zeros((3, 3))})) is None
    b = {"a": np.array([1.0, -1.0]), "b": np.array([-1.0, 1.0])}
    assert claims.consistencies(b, {"a": (9, 1)}) == {}  # one device: nothing to compare with
    assert claims.consistencies(b, {"a": (5, 5), "b": (5, 5)}) == {}  # the same proportions: no direction
    got = claims.consistencies(b, {"a": (9, 1), "b": (1, 9)})
    assert got == pytest.approx({"a": 1.0, "b": 1.0})
    assert claims.consistencies(b, {"a": (1, 9), "b": (9, 1)}) == pytest.approx({"a": -1.0, "b": -1.0})
    assert claims.standings({"a": -0.5}, {"a": Standing(1.0, 3)}) == {"a": pytest.approx(0.5 / (4 + claims.NEUTRAL_ROUNDS))}
    floor = claims.CLAIM_FLOOR
    assert claims.against_claims({"a": floor - 0.01, "b": floor, "c": 0.5}, "abc") == {"a"}
    # never every device of the round: the best of them stays (a device without counts counts)
    assert claims.against_claims({"a": -0.7, "b": -0.2}, "ab") == {"a"}
    assert claims.against_claims({"a": -0.7, "b": -0.2}, "abc") == {"a", "b"}
    assert claims.against_claims({}, "ab") == set()


def test_median_trust_gives_colluders_that_send_one_direction_one_vote():
    """Four honest updates (each its own direction beside the common one) and two colluders
    sending the same direction, close enough to the median to earn full trust: the two share
    one vote, each counting half an honest device."""
    e = np.eye(8)
    honest = [e[0] + e[i + 1] for i in range(4)]
    colluder = e[0] + 0.8 * e[7]
    layout, ups = _fleet([*honest, colluder, colluder.copy()])
    got, want = _run("median_trust", layout, ups)
    for agg in (got, want):
        assert all(t == 1.0 for t in agg.info["trust"].values())
        assert agg.info["echoes"] == {"d4": 2.0, "d5": 2.0}
        assert agg.shares["d4"] == pytest.approx(0.5 * agg.shares["d0"]) and agg.shares["d0"] == pytest.approx(0.2)
    np.testing.assert_allclose(got.vec, want.vec)
    assert set(got.sketches) == {f"d{i}" for i in range(6)}  # kept for the next round's echoes


def test_median_trust_weighs_no_update_above_the_lower_median_weight():
    """Five agreeing updates, one claiming 1e9 samples: without a server set it counts like
    the lower-median device (30), not like 2x it as under fedavg."""
    vecs = [np.eye(6)[0] + np.eye(6)[i + 1] for i in range(5)]  # alike (cosine 0.5) but no echoes
    layout, ups = _fleet(vecs, weights=[10, 20, 30, 40, 1e9])
    got, _ = _run("median_trust", layout, ups)
    assert all(got.info["trust"][d] == 1.0 for d in got.shares)
    assert got.shares["d4"] == pytest.approx(30 / (10 + 20 + 30 + 30 + 30))
    assert got.shares["d3"] == pytest.approx(30 / 120)  # the honest 40 is held to 30 too


def test_median_trust_holds_its_reference_norm_to_the_lineage_history():
    """Two tiny updates cannot shrink the honest one below half the lineage's recent norm:
    the reference norm stays within [0.5, 2] x the history (here 0.5, not 1e-6), and in a
    round of 3 every update is moved into [0.5, 1] x that reference."""
    layout, ups = _fleet([[1e-6, 0.0], [1e-6, 0.0], [1.0, 0.0]])
    got, _ = _run("median_trust", layout, ups, history=1.0)
    np.testing.assert_allclose(got.vec, [(0.25 + 0.25 + 0.5) / 3, 0.0])
    got, _ = _run("median_trust", layout, ups)  # no history: the tiny median rules, the big one shrinks
    assert got.vec[0] < 1e-5


def test_partials_of_two_workers_cannot_count_one_update_twice():
    layout, ups = _fleet([[1.0, 0.0]])
    rule = make_strategy("fedavg", StrategyOptions(), RoundEvidence(layout))
    a, b = rule.start(), rule.start()
    c = Contribution("d0", _sparse(ups[0], layout), 10.0)
    rule.accumulate(a, c)
    rule.accumulate(b, c)
    with pytest.raises(ValueError, match="counted twice"):
        rule.merge(a, b)


def test_trust_refuses_to_start_without_a_server_set():
    with pytest.raises(ValueError, match="server set"):
        make_strategy("trust", StrategyOptions(), RoundEvidence(_layout()))


def test_claims_compare_with_what_the_base_predicted_when_a_device_reports_it():
    """Measured in test_fleet_restart with distillation: an honest device whose samples the base
    already predicted close to their labels moved its bias against p - mean (c = -0.43, and
    counted for nothing) but along p - q (c = +0.51): the reference is the cross-entropy's own
    bias direction, not the fleet's average."""
    b = {"a": np.array([0.01, -0.02, 0.01]), "b": np.array([-0.03, 0.06, -0.03])}
    counts = {"a": (60, 20, 20), "b": (20, 60, 20)}
    # against the round's mean, a looks like it pushes its own class 0 down ...
    without = claims.consistencies({"a": np.array([-0.01, 0.02, -0.01]), "b": b["b"]}, counts)
    assert without["a"] < -0.5
    # ... but its base already predicted class 0 above its share: its honest delta follows p - q
    predicted = {"a": (0.65, 0.20, 0.15), "b": (0.34, 0.33, 0.33)}
    got = claims.consistencies({"a": np.array([-0.01, 0.0, 0.01]), "b": b["b"]}, counts, predicted)
    assert got["a"] == pytest.approx(1.0) and got["b"] > 0.9
    # one device alone is judged against its own predictions; with none, there is no reference
    lone = {"a": np.array([0.02, -0.01, -0.01])}
    assert claims.consistencies(lone, {"a": (60, 20, 20)}, {"a": (0.2, 0.4, 0.4)})["a"] == pytest.approx(1.0)
    assert claims.consistencies(lone, {"a": (60, 20, 20)}) == {}
    # a base that predicts exactly what the device holds gives no direction: no judgement
    assert claims.consistencies(b, counts, {"a": (0.6, 0.2, 0.2), "b": (0.34, 0.33, 0.33)}).keys() == {"b"}
    # a report of the wrong length is ignored: that device falls back to the round's mean
    mixed = claims.consistencies(b, counts, {"a": (0.5, 0.5), "b": (0.34, 0.33, 0.33)})
    assert mixed["a"] == pytest.approx(claims.consistencies(b, counts)["a"])


def test_median_trust_keeps_an_honest_device_the_round_mean_would_have_flagged():
    """The fleet of _claiming_fleet, with d3 honest but already fitted to classes the base
    over-predicts: its bias moves against p - mean. With no prediction reported it counts for
    nothing; with its base's predictions it counts, in the streaming close as in the reference."""
    layout, ups = _claiming_fleet(flip=-0.2)
    got, want = _run("median_trust", layout, ups)
    assert got.info["against_claims"] == ["d3"] == want.info["against_claims"]
    over = (0.8, 0.1, 0.1)  # its base already gives class 0 more than the 0.75 it holds
    ups = [dataclasses.replace(u, label_predicted=over if u.device == "d3" else (0.34, 0.33, 0.33)) for u in ups]
    got, want = _run("median_trust", layout, ups)
    assert got.info["claims"]["d3"] > 0.5
    assert got.info["against_claims"] == [] == want.info["against_claims"] and got.shares["d3"] > 0.1
