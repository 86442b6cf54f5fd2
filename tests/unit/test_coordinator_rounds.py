"""Round orchestration without a broker: real registry files, real update payloads (the
codec's wire format), real non-IID digits deltas from a numpy softmax-regression head."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest

from edge_agent.coordinator.metrics import CoordinatorMetrics
from edge_agent.coordinator.records import (
    Device,
    JobStatus,
    ParticipantStatus,
    RoundState,
    UpdateStatus,
)
from edge_agent.coordinator.registry import Registry
from edge_agent.coordinator.rounds import RoundEngine, RoundPolicy
from edge_agent.coordinator.selection import sample_devices, select_devices
from edge_agent.errors import InputError
from edge_agent.keys import fingerprint, generate_private_key, public_key_bytes
from edge_agent.sim.digits import make_fleet
from edge_agent.updates.codec import compute_delta, encode_tensors
from edge_agent.updates.wire import UpdateHeader, encode_update, pack_update
from tests.conftest import reference_head

N_DEV = 6
T0 = 1_700_000_000.0


class Clock:
    def __init__(self) -> None:
        self.t = T0

    def __call__(self) -> float:
        return self.t


# ---------------------------------------------------------------- the simulated fleet
def softmax_head(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"dense0_weight": (rng.normal(size=(10, 64)) * 0.01).astype(np.float32),
            "dense0_bias": np.zeros(10, np.float32)}


def train_locally(head: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray, steps: int = 200,
                  lr: float = 2.0) -> dict[str, np.ndarray]:
    w, b = head["dense0_weight"].astype(np.float64), head["dense0_bias"].astype(np.float64)
    onehot = np.eye(10)[y]
    for _ in range(steps):
        z = x @ w.T + b
        p = np.exp(z - z.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        g = (p - onehot) / len(x)
        w -= lr * g.T @ x
        b -= lr * g.sum(axis=0)
    return {"dense0_weight": w.astype(np.float32), "dense0_bias": b.astype(np.float32)}


def accuracy(head: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
    return float(((x @ head["dense0_weight"].T + head["dense0_bias"]).argmax(axis=1) == y).mean())


@pytest.fixture(scope="module")
def fleet() -> dict:
    f = make_fleet(n_devices=N_DEV, alpha=0.5, seed=3)
    keys = [generate_private_key() for _ in range(N_DEV)]
    return {
        "ids": [fingerprint(k) for k in keys],
        "pubs": [base64.b64encode(public_key_bytes(k)).decode() for k in keys],
        "x": [d.images.reshape(len(d.images), -1).astype(np.float64) for d in f.devices],
        "y": [d.labels for d in f.devices],
        "test": (f.test_images.reshape(len(f.test_images), -1).astype(np.float64), f.test_labels),
    }


class Harness:
    """A registry + engine on a state dir, with the fleet enrolled, approved and online."""

    def __init__(self, state_dir: Path, fleet: dict, clock: Clock, **policy: object) -> None:
        self.dir, self.fleet, self.clock = state_dir, fleet, clock
        self.metrics = CoordinatorMetrics()
        self.policy = RoundPolicy(**policy)
        self.sent: dict[tuple[int, int], tuple[bytes, int]] = {}  # (device index, round) -> (payload, samples)
        self.open()

    def open(self) -> None:
        self.reg = Registry(state_dir=self.dir, clock=self.clock)
        self.engine = RoundEngine(registry=self.reg, policy=self.policy, clock=self.clock, metrics=self.metrics)

    def reopen(self) -> None:  # a coordinator restart: new objects on the same files
        self.reg.close()
        self.open()

    def setup(self, base: dict[str, np.ndarray], *, battery: float = 80.0) -> None:
        self.reg.add_model_version(name="digits", version="1", head=base, bundle_path="/srv/bundles/digits-1")
        for i, (did, pub) in enumerate(zip(self.fleet["ids"], self.fleet["pubs"], strict=True)):
            self.reg.enrol_device(device_id=did, public_key=pub, fleet="farm", board="rpi4", engine="tflite",
                                  tags=["north"] if i % 2 == 0 else ["south"], approved=True)
            self.reg.record_state(did, online=True, state={"battery_pct": battery, "on_power": False})

    def payload(self, i: int, plan: object, *, scale: float = 1.0, density: float = 0.5) -> tuple[bytes, int]:
        mv = self.reg.get_model(plan.model_name, plan.model_version)
        base = self.reg.load_head(mv)
        new = train_locally(base, self.fleet["x"][i], self.fleet["y"][i])
        delta = {k: v * scale for k, v in compute_delta(new, base).items()}
        header = UpdateHeader("digits", plan.model_version, plan.job_id, self.fleet["ids"][i], plan.round)
        return encode_update(header, delta, density=density, bits=8), len(self.fleet["y"][i])

    def send(self, i: int, plan: object, **kw: object) -> str:
        payload, n = self.payload(i, plan, **kw)
        self.sent[(i, plan.round)] = (payload, n)
        return self.engine.receive_update(payload, sender=self.fleet["ids"][i], num_samples=n, energy_wh=0.2).status


@pytest.fixture
def h(tmp_path: Path, fleet: dict) -> Harness:
    harness = Harness(tmp_path, fleet, Clock())
    yield harness
    harness.reg.close()


def dev(i: int, **kw: object) -> Device:
    fields = {"id": f"d{i}", "fleet": "f", "public_key": "", "enrolled_at": 0.0, "approved": True,
              "tags": ("north",), "board": "rpi4", "profile": "rpi4-solar", "engine": "tflite",
              "state": {"battery_pct": 90}, "last_seen": T0 - 10, "online": True}
    return Device(**(fields | kw))


# ---------------------------------------------------------------- selection (pure)
def test_select_devices_explains_every_exclusion() -> None:
    devices = [dev(0), dev(1, approved=False), dev(2, online=False), dev(3, last_seen=T0 - 3600),
               dev(4, state={"battery_pct": 12}), dev(5, state={"battery_pct": 12, "on_power": True}),
               dev(6, state={}), dev(7, state={"on_power": False}), dev(8, state={"battery_pct": 90, "energy_wh": 0.5}),
               dev(9, tags=("south",)), dev(10, board="jetson"), dev(11), dev(12, state={"status": "busy"}),
               dev(13, state={"status": "busy", "job": "job-a"})]
    sel = select_devices(devices, "tag:north", now=T0, online_within_s=300, min_battery_pct=30, budget_wh=2.0,
                         busy=frozenset({"d11"}), job_id="job-a")
    # d5 is on power; d6 reports no battery (mains); d13 is busy with this very job (its last round)
    assert sel.eligible == ["d0", "d10", "d13", "d5", "d6"]
    why = sel.ineligible
    assert "d9" not in why  # not matching the selector: not listed at all
    assert why["d1"] == "not approved" and why["d2"].startswith("offline") and "3600 s ago" in why["d3"]
    assert why["d4"] == "battery 12% < 30%" and why["d7"] == "battery level unknown"
    assert why["d8"] == "energy 0.50 Wh < budget 2.00 Wh"
    assert why["d11"] == why["d12"] == "busy with another job"
    strict = select_devices([dev(6, state={})], "all", now=T0, online_within_s=300, min_battery_pct=30,
                            allow_unknown_power=False)
    assert strict.ineligible == {"d6": "battery level unknown"}
    assert select_devices(devices, "board:jetson", now=T0, online_within_s=300, min_battery_pct=30).eligible == ["d10"]
    assert select_devices([dev(0)], "board:rpi4-solar", now=T0, online_within_s=300, min_battery_pct=30).eligible == [
        "d0"]  # a board profile name matches too
    with pytest.raises(InputError):
        select_devices(devices, "tag:../x", now=T0, online_within_s=1, min_battery_pct=0)


def test_sampling_is_deterministic_and_bounded() -> None:
    ids = [f"d{i}" for i in range(10)]
    a = sample_devices(ids, 4, seed="job/1")
    assert a == sample_devices(ids, 4, seed="job/1") and len(set(a)) == 4 and set(a) <= set(ids)
    assert sample_devices(ids, None, seed="x") == ids and sample_devices(ids, 20, seed="x") == ids


def test_a_rounds_dispatch_is_recorded_in_one_batch_and_skips_who_already_reported(h: Harness, fleet: dict) -> None:
    h.setup(softmax_head())
    job = h.engine.start_job(model_name="digits", model_version="1", selector="all", rounds=1, min_devices=2,
                             deadline_s=600)
    (plan,) = h.engine.tick().opened
    ids = fleet["ids"]
    assert h.send(0, plan) == "accepted"  # an update may beat the dispatch ack: it stays reported
    assert h.engine.record_dispatch(job.id, 1, ids[1], ok=False, reason="too big")
    moved = h.engine.record_dispatches(job.id, 1, {ids[0]: None, ids[1]: None, ids[2]: None, ids[3]: "schema: x"})
    assert moved == [ids[2], ids[3]]  # ids[0] reported and ids[1] dropped before: left as they were
    parts = h.reg.get_round(job.id, 1).participants
    assert parts[ids[0]].status is ParticipantStatus.REPORTED
    assert parts[ids[1]].status is ParticipantStatus.DROPPED and "too big" in parts[ids[1]].reason
    assert parts[ids[2]].status is ParticipantStatus.DISPATCHED
    assert parts[ids[3]].status is ParticipantStatus.DROPPED and parts[ids[3]].reason == "dispatch_failed: schema: x"
    assert [p.devices for p in h.engine.pending_dispatches()] == [tuple(sorted(ids[4:]))]
    h.engine.cancel_job(job.id)
    assert h.engine.record_dispatches(job.id, 1, {ids[4]: None}) == []  # the round is no longer open


# ---------------------------------------------------------------- a whole job
def test_two_round_job_on_non_iid_digits(h: Harness, fleet: dict) -> None:
    base = softmax_head()
    h.setup(base)
    x_test, y_test = fleet["test"]
    job = h.engine.start_job(model_name="digits", model_version="1", selector="all", rounds=2, min_devices=3,
                             deadline_s=600, budget_wh=1.0, params={"epochs": 2, "aggregator": "fedavg_clipped"})
    assert job.status is JobStatus.PENDING
    (plan,) = h.engine.tick().opened
    assert (plan.round, plan.model_version, plan.params) == (1, "1", {"epochs": 2, "budget_wh": 1.0,
                                                                      "aggregator": "fedavg_clipped"})
    assert sorted(plan.devices) == sorted(fleet["ids"]) and plan.cmd_id == f"{job.id}-r1"
    assert h.engine.pending_dispatches() == [plan]
    ids = fleet["ids"]
    for d in ids[:5]:
        assert h.engine.record_dispatch(job.id, 1, d)
    assert h.engine.record_dispatch(job.id, 1, ids[5], ok=False, reason="publish timed out")
    assert h.engine.pending_dispatches() == []
    assert [h.send(i, plan) for i in range(4)] == ["accepted"] * 4
    assert h.send(0, plan) == "duplicate"  # a resend (the ack was lost)
    assert h.send(4, plan, scale=1000.0) == "accepted"  # stored; clipped at close
    assert h.send(5, plan) == "rejected"  # dispatch failed: it dropped out
    result = h.engine.tick()  # everyone reported or dropped: closes without waiting for the deadline
    (out,) = result.closed
    assert out.state is RoundState.AGGREGATED and out.job_status is JobStatus.RUNNING
    assert sorted(out.accepted) == sorted(ids[:5]) and not out.rejected  # the x1000 one is clipped, not ejected
    assert out.dropouts == {ids[5]: "dispatch_failed: publish timed out"}
    v1 = out.new_version
    assert (v1.version, v1.parent, v1.head_only, v1.bundle_path) == (f"{job.id}-r1", "1", True, "/srv/bundles/digits-1")
    assert v1.metrics["updates"] == 5 and v1.metrics["samples"] == sum(len(fleet["y"][i]) for i in range(5))
    assert v1.metrics["clipped"] == 1 and v1.metrics["accuracy_source"] == "device-reported"
    head1 = h.reg.load_head(v1)
    # the new head is exactly base + the clipped FedAvg of what the five devices sent
    want = reference_head(h.reg, job.id, 1)
    for k in base:
        np.testing.assert_allclose(head1[k], want[k], rtol=1e-6, atol=1e-6)
    assert accuracy(head1, x_test, y_test) > accuracy(base, x_test, y_test) + 0.4

    (plan2,) = result.opened  # the next round starts from the new version, in the same tick
    assert (plan2.round, plan2.model_version) == (2, v1.version)
    for i in range(N_DEV):
        h.engine.record_dispatch(job.id, 2, ids[i])
        assert h.send(i, plan2) == "accepted"
    (out2,) = h.engine.tick().closed
    assert out2.state is RoundState.AGGREGATED and out2.job_status is JobStatus.DONE
    assert out2.new_version.parent == v1.version and out2.rejected == {} and out2.dropouts == {}
    assert accuracy(h.reg.load_head(out2.new_version), x_test, y_test) >= accuracy(head1, x_test, y_test) - 0.02
    assert h.engine.tick().opened == []  # done: nothing more
    with pytest.raises(InputError, match="cannot go from done to cancelled"):
        h.engine.cancel_job(job.id)
    assert [m.version for m in h.reg.list_models("digits")] == ["1", v1.version, out2.new_version.version]
    sample = h.metrics.registry.get_sample_value
    assert sample("edge_coordinator_rounds_total", {"status": "aggregated"}) == 2
    assert sample("edge_coordinator_devices_online") == N_DEV
    assert sample("edge_coordinator_update_bytes_received_total") == h.reg.totals(job.id)["wire_bytes"] > 0
    assert sample("edge_coordinator_energy_wh_total") == pytest.approx(0.2 * 11)
    assert sample("edge_coordinator_update_compression_ratio_count") == 11


def test_deadline_dropouts_and_too_few_updates_fail_the_round(h: Harness, fleet: dict) -> None:
    h.setup(softmax_head())
    job = h.engine.start_job(model_name="digits", model_version="1", selector="tag:north", rounds=1, min_devices=3,
                             deadline_s=100)
    (plan,) = h.engine.tick().opened
    north = [fleet["ids"][i] for i in (0, 2, 4)]
    assert sorted(plan.devices) == sorted(north)
    for d in north:
        h.engine.record_dispatch(job.id, 1, d)
    assert h.send(0, plan) == "accepted"
    assert h.engine.record_dropout(job.id, 1, north[1], "refused:battery_low")
    h.clock.t += 50
    assert h.engine.tick().closed == []  # device 4 may still report
    h.clock.t += 51
    late = h.engine.receive_update(h.payload(4, plan)[0], sender=north[2], num_samples=5)
    assert (late.status, late.reason) == ("rejected", "late")
    (out,) = h.engine.tick().closed
    assert out.state is RoundState.FAILED and "1 accepted update(s), need 3" in out.reason
    assert out.dropouts == {north[1]: "refused:battery_low", north[2]: "late_update"}
    assert out.job_status is JobStatus.FAILED
    assert h.reg.get_job(job.id).reason == "none of the 1 round(s) produced a model"
    assert h.reg.list_updates(job.id)[0].status is UpdateStatus.ACCEPTED  # screened fine, just too few
    assert h.metrics.registry.get_sample_value("edge_coordinator_rounds_total", {"status": "failed"}) == 1


def test_untrusted_updates_are_rejected_with_a_reason(h: Harness, fleet: dict) -> None:
    h.setup(softmax_head())
    ids = fleet["ids"]
    job = h.engine.start_job(model_name="digits", model_version="1", selector="tag:north", rounds=1, min_devices=1,
                             deadline_s=100)
    (plan,) = h.engine.tick().opened
    good, n = h.payload(0, plan)
    recv = h.engine.receive_update

    def reason(payload: bytes, sender: str = ids[0], samples: int = n) -> tuple[str, str]:
        r = recv(payload, sender=sender, num_samples=samples)
        return r.status, r.reason

    assert reason(good, sender=ids[2]) == ("rejected", "wrong_device")  # signer is not the update's device
    assert reason(b"EAUP\x01\x00garbage") == ("rejected", "malformed")
    assert reason(b"x" * (65 << 20)) == ("rejected", "oversized")
    other = h.payload(1, plan)[0]  # device 1 (south) is not in this round
    assert reason(other, sender=ids[1]) == ("rejected", "not_selected")
    hdr = UpdateHeader("digits", "1", "no-such-job", ids[0], 1)
    assert reason(encode_update(hdr, {"w": np.ones(2, np.float32)}, density=1.0)) == ("rejected", "unknown_round")
    # decisions about a participant's update are stored (as data) and make it REPORTED
    wrong_table = encode_update(UpdateHeader("digits", "1", job.id, ids[2], 1),
                                {"dense0_weight": np.ones((10, 32), np.float32)}, density=1.0)
    assert reason(wrong_table, sender=ids[2]) == ("rejected", "bad_table")
    nan = {"dense0_weight": np.full((10, 64), np.nan, np.float32), "dense0_bias": np.zeros(10, np.float32)}
    positions = {"dense0_weight": np.arange(640), "dense0_bias": np.arange(10)}
    nan_payload = pack_update(UpdateHeader("digits", "1", job.id, ids[4], 1), encode_tensors(nan, positions, 32))
    r = recv(nan_payload, sender=ids[4], num_samples=n)  # the codec refuses NaN values while decoding
    assert (r.status, r.reason) == ("rejected", "malformed") and "NaN" in r.detail
    assert reason(nan_payload, sender=ids[4]) == ("duplicate", "")  # a resend of a rejected one: stop sending
    assert reason(good, samples=0) == ("rejected", "bad_samples")
    stored = {u.device_id: (u.status, u.reason.split(":")[0], u.delta_path) for u in h.reg.list_updates(job.id)}
    assert stored == {ids[0]: (UpdateStatus.REJECTED, "bad_samples", None),
                      ids[2]: (UpdateStatus.REJECTED, "bad_table", None),
                      ids[4]: (UpdateStatus.REJECTED, "malformed", None)}
    (out,) = h.engine.tick().closed  # all three reported: nothing left to wait for
    assert out.state is RoundState.FAILED and out.accepted == () and set(out.rejected) == {ids[0], ids[2], ids[4]}
    assert h.metrics.registry.get_sample_value("edge_coordinator_updates_total", {"status": "rejected"}) == 3


def test_wrong_base_version_is_rejected(h: Harness, fleet: dict) -> None:
    h.setup(softmax_head())
    h.reg.add_model_version(name="digits", version="0", head=softmax_head(1))
    h.engine.start_job(model_name="digits", model_version="1", selector="tag:north", rounds=1, min_devices=1,
                       deadline_s=100)
    (plan,) = h.engine.tick().opened
    stale = type(plan)(plan.job_id, plan.round, plan.model_name, "0", plan.deadline_at, plan.devices)
    payload, n = h.payload(0, stale)
    r = h.engine.receive_update(payload, sender=fleet["ids"][0], num_samples=n)
    assert (r.status, r.reason) == ("rejected", "wrong_model")


def test_restart_mid_round_and_mid_closing_loses_no_update(h: Harness, fleet: dict) -> None:
    h.setup(softmax_head())
    ids = fleet["ids"]
    job = h.engine.start_job(model_name="digits", model_version="1", rounds=2, min_devices=4, deadline_s=300,
                             params={"aggregator": "trimmed_mean", "trim_fraction": 0.2})
    (plan,) = h.engine.tick().opened
    payloads = [h.payload(i, plan) for i in range(N_DEV)]
    for i in range(3):
        assert h.engine.receive_update(payloads[i][0], sender=ids[i], num_samples=payloads[i][1]).status == "accepted"
    h.reopen()  # crash after three updates
    assert h.engine.receive_update(payloads[0][0], sender=ids[0], num_samples=1).status == "duplicate"
    assert [p.devices for p in h.engine.pending_dispatches()] == [tuple(sorted(ids[3:]))]  # not confirmed yet
    for i in range(3, N_DEV):
        assert h.engine.receive_update(payloads[i][0], sender=ids[i], num_samples=payloads[i][1]).status == "accepted"
    h.reg.begin_closing(job.id, 1)  # crash right after the round stopped collecting
    h.reopen()
    result = h.engine.tick()
    (out,) = result.closed
    assert out.state is RoundState.AGGREGATED and sorted(out.accepted) == sorted(ids)
    assert out.new_version.metrics["aggregator"] == "trimmed_mean"
    assert result.opened[0].round == 2
    # closing is idempotent: asking again returns the same outcome and changes nothing
    again = h.engine.close_round(job.id, 1)
    assert again.new_version == out.new_version and again.accepted == out.accepted


def test_cancel_stops_the_round_and_tells_the_devices(h: Harness, fleet: dict) -> None:
    h.setup(softmax_head())
    ids = fleet["ids"]
    job = h.engine.start_job(model_name="digits", model_version="1", rounds=3, min_devices=2, deadline_s=300)
    (plan,) = h.engine.tick().opened
    for d in ids[:2]:
        h.engine.record_dispatch(job.id, 1, d)
    assert h.send(0, plan) == "accepted"
    (stop,) = h.engine.cancel_job(job.id, "operator changed their mind")
    assert stop.devices == tuple(sorted(ids[1:]))  # all that may be working on it; device 0 already reported
    rnd = h.reg.get_round(job.id, 1)
    assert rnd.state is RoundState.CANCELLED and rnd.reason == "operator changed their mind"
    assert rnd.participants[ids[2]].status is ParticipantStatus.DROPPED
    assert h.reg.list_updates(job.id)[0].reason == "job_cancelled"
    assert h.send(1, plan) == "rejected"
    assert h.engine.tick().opened == [] and h.reg.get_job(job.id).status is JobStatus.CANCELLED
    assert h.engine.cancel_job(job.id) == []  # cancelling twice is harmless: nothing left to stop


def test_cancel_from_another_process_is_picked_up_by_tick(h: Harness, fleet: dict) -> None:
    h.setup(softmax_head())
    job = h.engine.start_job(model_name="digits", model_version="1", rounds=1, min_devices=1, deadline_s=300)
    (plan,) = h.engine.tick().opened
    with Registry(state_dir=h.dir) as cli:  # `edge-coordinator cancel` in another process
        cli.set_job_status(job.id, JobStatus.CANCELLED, "cancelled from the CLI")
    (stopped,) = h.engine.tick().cancelled
    assert stopped.job_id == job.id and h.reg.get_round(job.id, 1).state is RoundState.CANCELLED


def test_waits_for_eligible_devices_then_records_the_failed_round(h: Harness, fleet: dict) -> None:
    h.setup(softmax_head(), battery=10.0)  # everyone too low to train
    h.reg.record_state(fleet["ids"][0], online=True, state={"on_power": True})
    job = h.engine.start_job(model_name="digits", model_version="1", rounds=1, min_devices=2, deadline_s=60)
    assert h.engine.tick().opened == []
    waiting = h.reg.get_job(job.id)
    assert waiting.status is JobStatus.RUNNING and waiting.reason.startswith("waiting: 1 eligible device(s), need 2")
    assert "battery 10% < 30%" in waiting.reason
    h.clock.t += 30
    assert h.engine.tick().closed == []  # still within the wait
    h.reg.record_state(fleet["ids"][1], online=True, state={"battery_pct": 95})
    (plan,) = h.engine.tick().opened  # a second device charged: the round starts
    assert sorted(plan.devices) == sorted(fleet["ids"][:2])
    assert (h.reg.get_job(job.id).waiting_since, h.reg.get_job(job.id).reason) == (None, "")


def test_gives_up_waiting_after_max_wait(h: Harness, fleet: dict) -> None:
    h.setup(softmax_head(), battery=10.0)
    job = h.engine.start_job(model_name="digits", model_version="1", rounds=1, min_devices=1, deadline_s=60)
    h.engine.tick()
    h.clock.t += 61
    (out,) = h.engine.tick().closed
    assert out.state is RoundState.FAILED and out.reason.startswith("not started: 0 eligible device(s), need 1")
    assert h.reg.get_job(job.id).status is JobStatus.FAILED


@pytest.mark.parametrize("kwargs", [{"params": {"aggregator": "mean"}}, {"params": {"trim_fraction": 0.7}},
                                    {"params": {"max_samples": 0}}, {"params": {"clip_mult": 0.5}},
                                    {"budget_wh": -1.0}, {"params": {"devices_per_round": 0}},
                                    {"selector": "everyone"}, {"job_id": "bad id"}, {"model_version": "9"}])
def test_bad_jobs_are_refused_at_start(h: Harness, kwargs: dict) -> None:
    h.setup(softmax_head())
    args = {"model_name": "digits", "model_version": "1", "rounds": 1, "min_devices": 1} | kwargs
    with pytest.raises(InputError):
        h.engine.start_job(**args)
    assert h.reg.list_jobs() == []


def test_policy_is_validated_at_construction() -> None:
    for bad in ({"aggregator": "mean"}, {"online_within_s": 0}, {"trust_kappa": 0}, {"median_kappa": 1.5},
                {"max_wait_s": -5}, {"min_battery_pct": 101}, {"gate_min_drop": 1.0}):
        with pytest.raises((ValueError, InputError)):
            RoundPolicy(**bad)
    with pytest.raises(TypeError):
        RoundPolicy("fedavg")  # keyword-only


def test_a_broken_job_fails_alone(h: Harness, fleet: dict) -> None:
    h.setup(softmax_head())
    h.reg.add_model_version(name="other", version="1", head=softmax_head(1))
    broken = h.engine.start_job(model_name="digits", model_version="1", selector="tag:north", rounds=1,
                                min_devices=1, deadline_s=100)
    fine = h.engine.start_job(model_name="other", model_version="1", selector="tag:south", rounds=1,
                              min_devices=1, deadline_s=100)
    h.engine.tick()
    head_file = h.reg.state_dir / h.reg.get_model("digits", "1").head_path
    head_file.write_bytes(b"\0" * 64)  # the SD card lost the base head
    h.clock.t += 101
    result = h.engine.tick()
    assert list(result.failed) == [broken.id] and "zero-filled" in result.failed[broken.id]
    assert h.reg.get_job(broken.id).status is JobStatus.FAILED
    assert h.reg.get_round(broken.id, 1).state is RoundState.CANCELLED
    (out,) = result.closed  # the other job's round still closed normally (no updates: failed, as data)
    assert (out.job_id, out.state) == (fine.id, RoundState.FAILED)


def test_bogus_energy_report_does_not_cost_the_update(h: Harness, fleet: dict) -> None:
    h.setup(softmax_head())
    job = h.engine.start_job(model_name="digits", model_version="1", selector="tag:north", rounds=1,
                             min_devices=1, deadline_s=100)
    (plan,) = h.engine.tick().opened
    payload, n = h.payload(0, plan)
    r = h.engine.receive_update(payload, sender=fleet["ids"][0], num_samples=n, energy_wh=float("nan"))
    assert r.status == "accepted"
    assert h.reg.list_updates(job.id)[0].energy_wh is None


def test_a_device_that_stays_offline_is_a_dropout_and_the_round_closes(h: Harness, fleet: dict) -> None:
    """Its broker will (an offline state) while the round waits for its update: if it is not
    heard again within the grace it is a dropout, so the round closes as soon as the others
    are in, not at its deadline. One that comes back within the grace (a broker restart, a
    link flap) stays in; one that already sent its update is not touched."""
    h.setup(softmax_head())
    job = h.engine.start_job(model_name="digits", model_version="1", rounds=1, min_devices=2, deadline_s=600,
                             params={"aggregator": "fedavg"})
    (plan,) = h.engine.tick().opened
    ids = fleet["ids"]
    for i in range(N_DEV - 2):
        assert h.send(i, plan) == "accepted"
    h.reg.record_state(ids[0], online=False)  # already reported
    h.reg.record_state(ids[-1], online=False)  # the will of one still training...
    h.reg.record_state(ids[-2], online=False)
    h.clock.t += h.policy.offline_grace_s / 2
    h.reg.record_state(ids[-2], online=True)  # ... and of one that reconnects
    tick = h.engine.tick()
    assert tick.closed == [] and tick.gone == []  # within the grace
    h.clock.t += h.policy.offline_grace_s / 2
    tick = h.engine.tick()
    assert tick.gone == [(ids[-1], job.id, 1)] and tick.closed == []  # the other one is still due
    assert h.engine.tick().gone == []  # once
    assert h.send(N_DEV - 2, plan) == "accepted"
    (out,) = h.engine.tick().closed  # closed because everyone settled, long before the deadline
    assert out.state is RoundState.AGGREGATED and list(out.dropouts) == [ids[-1]]
    assert "did not come back within 30 s" in out.dropouts[ids[-1]]
    assert h.clock() < plan.deadline_at
