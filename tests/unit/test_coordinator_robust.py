"""Robust aggregation through the real RoundEngine, registry files and update codec: every
attack a stolen device key allows, against the robust rules, in rounds of 2, 3 and 10
devices, with and without an earlier round; per-device strikes, quarantine and release; and
the server set's trust rule and validation gate end to end (issue 34)."""

from __future__ import annotations

import base64
import logging
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

from edge_agent.coordinator.cli import main as coordinator_main
from edge_agent.coordinator.records import RoundState, UpdateStatus
from edge_agent.coordinator.registry import Registry
from edge_agent.coordinator.round_intake import arrival_weight
from edge_agent.coordinator.rounds import RoundEngine, RoundPolicy
from edge_agent.coordinator.strategies.base import lower_median
from edge_agent.keys import fingerprint, generate_private_key, public_key_bytes
from edge_agent.updates.codec import encode_tensors
from edge_agent.updates.wire import UpdateHeader, encode_update, pack_update

T0 = 1_700_000_000.0
SHM = Path("/dev/shm")
SHAPES = {"w": (10, 16), "b": (10,)}
KEYS = [generate_private_key() for _ in range(10)]
IDS = [fingerprint(k) for k in KEYS]
PUBS = [base64.b64encode(public_key_bytes(k)).decode() for k in KEYS]
ATTACKS = ("sign_flip", "scale100", "inflated_samples", "tiny_norm", "nan", "inf", "huge")
ROBUST = ("median_trust", "fedavg_clipped", "median", "trimmed_mean", "multi_krum")


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    """Real files, on tmpfs when there is one: these tests store hundreds of updates and
    each one is fsync'ed twice (the payload, the registry row)."""
    if not SHM.is_dir():
        yield tmp_path
        return
    d = Path(tempfile.mkdtemp(dir=SHM, prefix="robust-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


class Clock:
    t = T0

    def __call__(self) -> float:
        return self.t


class Fleet:
    """A registry + engine with n enrolled devices and a small head; honest deltas are a
    shared direction plus device noise (norms within ~20 %, cosines ~0.8)."""

    def __init__(self, state_dir: Path, n: int, **policy: object) -> None:
        self.clock = Clock()
        self.reg = Registry(state_dir=state_dir, clock=self.clock)
        self.engine = RoundEngine(registry=self.reg, policy=RoundPolicy(**policy), clock=self.clock)
        rng = np.random.default_rng(0)
        self.base = {k: (rng.normal(size=s) * 0.1).astype(np.float32) for k, s in SHAPES.items()}
        self.reg.add_model_version(name="m", version="1", head=self.base)
        self.ids = IDS[:n]
        for did, pub in zip(self.ids, PUBS[:n], strict=True):
            self.reg.enrol_device(device_id=did, public_key=pub, fleet="f", approved=True)
            self.reg.record_state(did, online=True, state={"battery_pct": 90})
        self.direction = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
        self.rng = rng
        self.opened: list = []

    def honest(self) -> dict[str, np.ndarray]:
        return {k: (0.05 * (v + 0.5 * self.rng.normal(size=v.shape))).astype(np.float32)
                for k, v in self.direction.items()}

    def start(self, rounds: int, aggregator: str, min_devices: int = 1) -> str:
        job = self.engine.start_job(model_name="m", model_version="1", rounds=rounds, min_devices=min_devices,
                                    deadline_s=100, params={"aggregator": aggregator})
        return job.id

    def send(self, plan: object, i: int, delta: dict[str, np.ndarray], samples: int = 100, *,
             raw: bytes | None = None, bits: int = 8) -> str:
        header = UpdateHeader("m", plan.model_version, plan.job_id, self.ids[i], plan.round)
        payload = raw if raw is not None else encode_update(header, delta, density=1.0, bits=bits)
        return self.engine.receive_update(payload, sender=self.ids[i], num_samples=samples).status

    def attack(self, plan: object, i: int, kind: str, honest: dict[str, np.ndarray]) -> str:
        header = UpdateHeader("m", plan.model_version, plan.job_id, self.ids[i], plan.round)
        if kind == "sign_flip":
            return self.send(plan, i, {k: -v for k, v in honest.items()})
        if kind == "scale100":
            return self.send(plan, i, {k: 100 * v for k, v in honest.items()})
        if kind == "inflated_samples":  # the liar's own direction, weighted as if it had all the data
            return self.send(plan, i, {k: -v for k, v in honest.items()}, samples=1_000_000_000)
        if kind == "tiny_norm":
            return self.send(plan, i, {k: 1e-6 * v for k, v in honest.items()})
        value = {"nan": np.nan, "inf": np.inf, "huge": 3e38}[kind]
        bad = {k: np.full(v.shape, value, np.float32) for k, v in honest.items()}
        positions = {k: np.arange(v.size) for k, v in honest.items()}
        return self.send(plan, i, {}, raw=pack_update(header, encode_tensors(bad, positions, 32)))

    def run_round(self, attack: str | None, attackers: int) -> tuple[object, dict[str, np.ndarray], float]:
        """One round: honest devices send honest deltas, the first `attackers` attack.
        Returns (outcome, the honest devices' mean delta, their largest norm)."""
        plan = self.next_plan()
        honest = [self.honest() for _ in self.ids]
        for i in range(len(self.ids)):
            if attack is not None and i < attackers:
                self.attack(plan, i, attack, honest[i])
            else:
                assert self.send(plan, i, honest[i]) == "accepted"
        sent = honest[attackers:] if attack else honest
        mean = {k: np.mean([h[k] for h in sent], axis=0) for k in SHAPES}
        result = self.engine.tick()
        (out,) = result.closed
        self.opened = result.opened
        return out, mean, max(flat_norm(h) for h in sent)

    def next_plan(self) -> object:
        opened, self.opened = self.opened or self.engine.tick().opened, []
        (plan,) = opened
        return plan

    def published_delta(self, out: object) -> dict[str, np.ndarray]:
        head = self.reg.load_head(out.new_version)
        parent = self.reg.load_head(self.reg.get_model("m", out.new_version.parent))
        return {k: head[k].astype(np.float64) - parent[k] for k in SHAPES}


def flat(d: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(d[k], np.float64).ravel() for k in SHAPES])


def flat_norm(d: dict[str, np.ndarray]) -> float:
    return float(np.linalg.norm(flat(d)))


def assert_not_poisoned(fleet: Fleet, out: object, mean: dict, max_norm: float, attackers: int,
                        min_cos: float = 0.5) -> None:
    """Either nothing is published (and the round says why), or what is published points
    with the honest mean and is no larger than an honest update; no hostile update is used
    (a tiny one may be: it is harmless)."""
    if out.new_version is None:
        assert out.state is RoundState.FAILED and out.reason
        return
    got = flat(fleet.published_delta(out))
    assert np.isfinite(got).all()
    cos = float(got @ flat(mean) / (np.linalg.norm(got) * np.linalg.norm(flat(mean))))
    assert cos > min_cos, (cos, out)
    assert np.linalg.norm(got) <= 1.5 * max_norm, (np.linalg.norm(got), max_norm)


def shares(fleet: Fleet, out: object) -> dict[str, str]:
    """device -> its verdict reason, for the accepted updates of the round."""
    return {u.device_id: u.reason for u in fleet.reg.list_updates(out.job_id, out.round) if u.device_id in out.accepted}


@pytest.mark.parametrize(("aggregator", "n"), [(a, n) for a in ROBUST for n in (3, 10)
                                                if n == 10 or a not in ("trimmed_mean", "multi_krum")])
def test_every_attack_after_an_honest_round(state_dir: Path, aggregator: str, n: int) -> None:
    """Round 1 is honest; rounds 2.. each carry one attack by 1 device (n = 3) or 2 (n = 10).
    Every round publishes, nothing poisoned is published, no honest update is ever rejected,
    and non-finite or out-of-bounds updates are refused at arrival. (With 3 updates the
    trimmed mean trims nothing and Multi-Krum has no neighbours to compare: strategies/ says
    so; they are robust rules for larger rounds.)"""
    fleet = Fleet(state_dir, n, quarantine_after=1000)
    attackers = 2 if n == 10 else 1
    fleet.start(1 + len(ATTACKS), aggregator)
    out, _, _ = fleet.run_round(None, 0)
    krum = sum(why.startswith("krum_excluded") for why in out.rejected.values())  # Multi-Krum leaves f out
    assert out.state is RoundState.AGGREGATED and len(out.accepted) + krum == n
    for attack in ATTACKS:
        fleet.clock.t += 1
        out, mean, max_norm = fleet.run_round(attack, attackers)
        assert out.state is RoundState.AGGREGATED, (attack, out.reason)
        assert_not_poisoned(fleet, out, mean, max_norm, attackers)
        liars = set(fleet.ids[:attackers])
        screened = {d: why for d, why in out.rejected.items() if d not in liars}
        assert all(why.startswith("krum_excluded") for why in screened.values()), (attack, screened)
        if attack in ("nan", "inf", "huge"):
            assert all(out.rejected[d].startswith(("malformed", "out_of_bounds", "non_finite")) for d in liars)


@pytest.mark.parametrize("n", [2, 3])
def test_a_first_round_with_one_attacker_publishes_or_says_why(state_dir: Path, n: int) -> None:
    """No history at all (a new job each time, first round), no server set, the default rule:
    every round either publishes something not poisoned, or fails naming why; a flipped
    update among honest ones counts for nothing (it is not rejected: it only disagrees).
    With 2 devices nothing tells a liar from an honest one: what is published may be weak,
    but never points against the honest update nor reaches further than it."""
    fleet = Fleet(state_dir, n, quarantine_after=1000)
    for attack in ATTACKS:
        job = fleet.engine.start_job(model_name="m", model_version="1", rounds=1, min_devices=1, deadline_s=100)
        assert fleet.reg.get_job(job.id).params["aggregator"] == "median_trust"
        out, mean, max_norm = fleet.run_round(attack, 1)
        assert_not_poisoned(fleet, out, mean, max_norm, 1, min_cos=0.5 if n == 3 else 0.0)
        assert out.new_version is not None or out.reason, attack
        if n == 3 and attack in ("sign_flip", "inflated_samples"):
            assert shares(fleet, out)[fleet.ids[0]].startswith("counted for nothing"), (attack, out)
        fleet.clock.t += 1


def test_repeat_offender_is_quarantined_logged_listed_and_released(state_dir: Path, caplog, capsys) -> None:
    fleet = Fleet(state_dir, 4, quarantine_after=2)
    liar = fleet.ids[0]
    fleet.start(4, "median_trust")
    with caplog.at_level(logging.WARNING, logger="edge_agent.coordinator.rounds"):
        for _ in range(2):
            out, _, _ = fleet.run_round("huge", 1)
            assert out.rejected[liar].startswith("out_of_bounds")
            fleet.clock.t += 1
    dev = fleet.reg.get_device(liar)
    assert dev.quarantined and dev.strikes == 2 and "out_of_bounds" in dev.quarantine_reason
    assert [r.getMessage() for r in caplog.records if liar in r.getMessage()][0].startswith(f"device {liar} quarantined")
    assert all(not fleet.reg.get_device(d).quarantined and fleet.reg.get_device(d).strikes == 0 for d in fleet.ids[1:])
    plan = fleet.next_plan()  # round 3: selection skips the quarantined device
    assert liar not in plan.devices and len(plan.devices) == 3
    for i in range(1, 4):
        fleet.send(plan, i, fleet.honest())
    fleet.engine.tick()
    code = coordinator_main(["devices", "--state-dir", str(state_dir), "--json"])
    listed = {d["id"]: d for d in __import__("json").loads(capsys.readouterr().out)}
    assert code == 0 and listed[liar]["quarantined"] and "out_of_bounds" in listed[liar]["quarantine_reason"]
    assert coordinator_main(["devices", "--state-dir", str(state_dir), "--release", liar[:8]]) == 0
    assert f"released {liar}" in capsys.readouterr().out
    dev = fleet.reg.get_device(liar)  # the CLI wrote through its own connection (WAL: visible here)
    assert not dev.quarantined and dev.strikes == 0


def test_disagreement_is_never_a_strike(state_dir: Path) -> None:
    """Sign flips among 10, round after round: they count for nothing, but a disagreeing
    update is no proof of hostility (honest non-IID devices disagree too), so no strike and
    no quarantine -- only what no honest device sends (non-finite, out of bounds) strikes."""
    fleet = Fleet(state_dir, 10, quarantine_after=1)
    fleet.start(4, "median_trust")
    for _ in range(3):
        out, mean, max_norm = fleet.run_round("sign_flip", 2)
        fleet.clock.t += 1
        assert_not_poisoned(fleet, out, mean, max_norm, 2)
        assert out.state is RoundState.AGGREGATED and not out.rejected
        assert all(shares(fleet, out)[d].startswith("counted for nothing") for d in fleet.ids[:2])
        # honest updates count in full, or share a vote with alike ones and say so
        assert all(shares(fleet, out)[d] == "" or shares(fleet, out)[d].startswith("shares one vote")
                   for d in fleet.ids[2:])
    assert not any(fleet.reg.get_device(d).quarantined or fleet.reg.get_device(d).strikes for d in fleet.ids)


def test_an_accepted_update_takes_a_strike_off(state_dir: Path) -> None:
    fleet = Fleet(state_dir, 4, quarantine_after=3)
    fleet.start(3, "median_trust")
    fleet.run_round("huge", 1)
    fleet.clock.t += 1
    assert fleet.reg.get_device(fleet.ids[0]).strikes == 1 and fleet.reg.get_device(fleet.ids[1]).strikes == 0
    out, _, _ = fleet.run_round(None, 0)
    assert fleet.ids[0] in out.accepted and fleet.reg.get_device(fleet.ids[0]).strikes == 0


def test_sample_counts_are_capped_by_the_round_and_the_device_history(state_dir: Path) -> None:
    fleet = Fleet(state_dir, 3)
    fleet.start(2, "fedavg")
    plan = fleet.next_plan()
    deltas = [fleet.honest() for _ in range(3)]
    for i, samples in enumerate((100, 120, 1_000_000_000)):
        fleet.send(plan, i, deltas[i], samples=samples, bits=32)  # exact values: the weights are what is checked
    result = fleet.engine.tick()
    (out,) = result.closed
    fleet.opened = result.opened
    assert out.new_version.metrics["weights_capped"] == 1
    got = flat(fleet.published_delta(out))
    want = (100 * flat(deltas[0]) + 120 * flat(deltas[1]) + 120 * flat(deltas[2])) / 340  # small round: 1 x lower median
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # round 2: on arrival, a device's count is capped at 2 x the most it reported in its
    # accepted updates: device 0 reported 100, so its 1e6 now weighs 200
    plan = fleet.next_plan()
    fleet.send(plan, 0, fleet.honest(), samples=1_000_000)
    (rec,) = [u for u in fleet.reg.list_updates(out.job_id, 2) if u.device_id == fleet.ids[0]]
    assert (rec.num_samples, rec.weight) == (1_000_000, 200.0)


def test_weights_and_medians() -> None:
    assert lower_median([5, 1]) == 1 and lower_median([3, 1, 2]) == 2 and lower_median([4, 1, 3, 2]) == 2
    assert arrival_weight(1_000_000_000, 300.0, None) == 300 and arrival_weight(50, 300.0, 40) == 40
    assert arrival_weight(50, None, None) == 50


def test_rejected_updates_keep_no_file_and_accepted_ones_keep_the_payload(state_dir: Path) -> None:
    fleet = Fleet(state_dir, 3)
    job = fleet.start(1, "fedavg_clipped")
    plan = fleet.next_plan()
    header = UpdateHeader("m", "1", job, fleet.ids[0], 1)
    payload = encode_update(header, fleet.honest(), density=1.0, bits=8)
    assert fleet.engine.receive_update(payload, sender=fleet.ids[0], num_samples=10).status == "accepted"
    fleet.attack(plan, 1, "huge", fleet.honest())
    recs = {u.device_id: u for u in fleet.reg.list_updates(job, 1)}
    assert fleet.reg.load_payload(recs[fleet.ids[0]]) == payload  # what arrived, byte for byte
    assert recs[fleet.ids[0]].delta_path.endswith(".eaup") and recs[fleet.ids[1]].delta_path is None
    assert recs[fleet.ids[1]].status is UpdateStatus.REJECTED and recs[fleet.ids[1]].reason.startswith("out_of_bounds")
    assert not list(state_dir.rglob("updates/**/*.npz"))


# ---------------------------------------------------------------- with a server set
def test_the_trust_rule_and_the_gate_decide_with_the_server_set() -> None:
    """Three digits devices, one flipping its updates, the default rule with a server set
    (trust): the flip counts for nothing, every round publishes, each version's accuracy is
    the server set's, and the fleet learns (held-out accuracy rises)."""
    from edge_agent.sim.poisoning import digits_fleet, simulate

    data = digits_fleet(3, seed=1)
    run = simulate(data, attack="sign_flip", attackers=1, rounds=4, server_set=True, seed=1)
    assert run.aggregator == "trust" and run.failed == 0 and run.rejected_honest == 0
    assert run.accuracy[-1] > run.accuracy[0] + 0.1


def test_the_gate_refuses_what_the_server_set_shows_worse() -> None:
    """Plain FedAvg (no defence) with a x100 attacker: after its first round (which happens
    to help: the attacker's own direction, against a random start), each aggregate would
    wreck the model. The gate scores every candidate on the server set against the best
    version so far, tries a half and a quarter step, and publishes nothing worse: the rounds
    say why, and accuracy holds where the unguarded fleet's collapses."""
    from edge_agent.sim.poisoning import digits_fleet, simulate

    data = digits_fleet(3, seed=2)
    hit = simulate(data, attack="scale100", attackers=1, rounds=4, server_set=True, aggregator="fedavg", seed=2)
    unguarded = simulate(data, attack="scale100", attackers=1, rounds=4, server_set=False, aggregator="fedavg",
                         seed=2)
    assert hit.failed >= 2 and all(r.startswith("gate: every step") for r in hit.reasons), hit.reasons
    assert "on the server set" in hit.reasons[0] and "newly wrong" in hit.reasons[0]
    assert min(hit.accuracy[1:]) >= hit.accuracy[0] - 0.02
    assert unguarded.accuracy[-1] < hit.accuracy[-1] - 0.1


# ---------------------------------------------------------------- without a server set: the devices' claims
def test_a_flipped_device_counts_for_nothing_by_its_own_label_counts_without_a_server_set() -> None:
    """Five textures devices, one sending its honest update negated, no server set (the
    default median_trust): its output bias pushes down the classes its label counts say it
    holds (strategies/claims.py), so it counts for nothing in every round, takes no part in the
    median, and the fleet learns as if it were silent. Before, its flips got trust whenever
    its direction happened to agree with the median: 5.9 points lost after 30 rounds."""
    from edge_agent.sim.poisoning import simulate, texture_fleet

    data = texture_fleet(5, seed=0)
    flipped = simulate(data, attack="sign_flip", attackers=1, rounds=10, server_set=False, seed=0)
    silent = simulate(data, attack="silent", attackers=1, rounds=10, server_set=False, seed=0)
    assert flipped.aggregator == "median_trust" and flipped.failed == 0 and flipped.rejected_honest == 0
    assert flipped.uncounted_hostile == 10, flipped
    assert flipped.uncounted_honest <= 3, flipped
    assert flipped.accuracy[-1] >= silent.accuracy[-1] - 0.02, (flipped.accuracy, silent.accuracy)


def test_the_devices_claim_record_survives_a_restart_and_a_round_closed_twice(state_dir: Path, caplog) -> None:
    """The label-consistency standing lives beside the round evidence (claims.json): a new
    coordinator reads it; a round closed again after a crash replaces its own value instead
    of counting twice; a round's own value is not part of its evidence; a damaged record is
    judged afresh, with a warning."""
    from types import SimpleNamespace

    from edge_agent.coordinator.aggregation import NoEvidence, RoundAggregation
    from edge_agent.coordinator.heads import HeadCache
    from edge_agent.coordinator.strategies import Aggregate
    from edge_agent.coordinator.strategies.claims import Standing

    def aggregation() -> RoundAggregation:
        reg = Registry(state_dir=state_dir)
        return RoundAggregation(registry=reg, heads=HeadCache(reg, max_update_bytes=1 << 20), policy=RoundPolicy(),
                                evidence=NoEvidence())

    job = SimpleNamespace(id="job-1")
    first = aggregation()
    for number, claims in ((1, {"a": -0.8, "b": 0.5}), (2, {"a": -0.6, "b": 0.3}), (2, {"a": -0.4, "b": 0.3})):
        first.remember(job, SimpleNamespace(number=number), Aggregate(np.zeros(1), {}, info={"claims": claims}))
    again = aggregation()  # a restarted coordinator
    assert again._standings("job-1", 3) == {"a": Standing(pytest.approx(-1.2), 2), "b": Standing(pytest.approx(0.8), 2)}
    assert again._standings("job-1", 2) == {"a": Standing(pytest.approx(-0.8), 1), "b": Standing(pytest.approx(0.5), 1)}
    assert again._standings("job-2", 3) == {}
    path = state_dir / "evidence" / "job-1" / "claims.json"
    path.write_bytes(path.read_bytes()[:-3])
    with caplog.at_level(logging.WARNING):
        assert again._standings("job-1", 3) == {}
    assert "label consistency record is unreadable" in caplog.text
