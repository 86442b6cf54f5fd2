"""Asynchronous buffered rounds (async_rounds.py) through the real engine and registry: a
round closes at its buffer, devices still training are carried and their updates folded in
with a staleness weight, too-stale updates are refused naming their staleness, and a restart
mid-intake loses and double-counts nothing. Real non-IID digits deltas, real payloads."""

# ruff: noqa: F811 - `fleet` and `h` are test_coordinator_rounds' fixtures, imported to be shared
from __future__ import annotations

import math

import numpy as np
import pytest

from edge_agent.coordinator.async_rounds import AsyncMode, published_since
from edge_agent.coordinator.records import JobStatus, ParticipantStatus, RoundState, UpdateStatus
from edge_agent.errors import InputError
from tests.conftest import reference_head
from tests.unit.test_coordinator_rounds import (  # noqa: F401
    N_DEV,
    Harness,
    accuracy,
    fleet,
    h,
    softmax_head,
)

ASYNC = {"mode": "async", "aggregator": "fedavg"}


def start(h: Harness, *, buffer: int, staleness: int, rounds: int = 6, min_devices: int = 1,
          deadline_s: float = 600, **kw: object) -> object:
    return h.engine.start_job(model_name="digits", model_version="1", rounds=rounds, min_devices=min_devices,
                              deadline_s=deadline_s, params={**ASYNC, "buffer": buffer, "max_staleness": staleness,
                                                             **kw})


def opened(h: Harness) -> list:
    """tick(), and every command of the rounds it opened delivered (as serve records them)."""
    plans = h.engine.tick().opened
    for plan in plans:
        h.engine.record_dispatches(plan.job_id, plan.round, dict.fromkeys(plan.devices))
    return plans


def receive(h: Harness, i: int, payload: tuple[bytes, int]) -> object:
    return h.engine.receive_update(payload[0], sender=h.fleet["ids"][i], num_samples=payload[1])


def test_a_round_closes_at_its_buffer_and_devices_still_training_are_carried(h: Harness, fleet: dict) -> None:
    h.setup(softmax_head())
    ids = fleet["ids"]
    job = start(h, buffer=2, staleness=2)
    (plan1,) = opened(h)
    assert sorted(plan1.devices) == sorted(ids)
    assert plan1.deadline_at == pytest.approx(h.clock() + 600 * 3)  # S + 1 rounds: how long its update is useful
    slow = {i: h.payload(i, plan1) for i in range(2, N_DEV)}  # trained on version 1, delivered later
    assert h.send(0, plan1) == "accepted"
    assert h.engine.tick().closed == []  # 1 of 2: the buffer is not full, the round waits
    assert h.send(1, plan1) == "accepted"
    result = h.engine.tick()
    (out1,) = result.closed
    assert out1.state is RoundState.AGGREGATED and sorted(out1.accepted) == sorted(ids[:2])
    assert out1.dropouts == {}  # still training is not dropping out
    assert h.reg.get_round(job.id, 1).in_flight == sorted(ids[2:])
    (plan2,) = result.opened  # at once, on the new version, with only the devices that are free
    assert plan2.model_version == out1.new_version.version and sorted(plan2.devices) == sorted(ids[:2])
    rnd2 = h.reg.get_round(job.id, 2)
    carried = {d: p for d, p in rnd2.participants.items() if p.origin is not None}
    assert set(carried) == set(ids[2:]) and {p.origin for p in carried.values()} == {1}
    assert all(p.status is ParticipantStatus.DISPATCHED for p in carried.values())
    assert h.engine.pending_dispatches() == [plan2]  # no second command to a device still training

    # a device trained on version 1 delivers into round 2: one version stale, weighed 1/sqrt(2)
    assert receive(h, 2, slow[2]).status == "accepted"
    assert receive(h, 2, slow[2]).status == "duplicate"  # its resend (a lost ack) counts once
    (u,) = [u for u in h.reg.list_updates(job.id, 2) if u.device_id == ids[2]]
    assert u.status is UpdateStatus.PENDING and u.metrics["staleness"] == 1
    assert u.weight == pytest.approx(slow[2][1] / math.sqrt(2))
    assert h.reg.get_round(job.id, 2).participants[ids[2]].status is ParticipantStatus.REPORTED
    sample = h.metrics.registry.get_sample_value
    assert sample("edge_coordinator_update_staleness_bucket", {"le": "0.0"}) == 2  # devices 0 and 1, fresh
    assert sample("edge_coordinator_update_staleness_bucket", {"le": "1.0"}) == 3
    assert h.send(0, plan2) == "accepted"  # a fresh one: buffer full
    result = h.engine.tick()
    (out2,) = result.closed
    assert sorted(out2.accepted) == sorted([ids[0], ids[2]])
    assert out2.new_version.parent == out1.new_version.version


def test_an_update_more_than_max_staleness_versions_old_is_refused_naming_its_staleness(h: Harness, fleet: dict
                                                                                        ) -> None:
    h.setup(softmax_head())
    ids = fleet["ids"]
    job = start(h, buffer=1, staleness=1)
    (plan1,) = opened(h)
    late = h.payload(5, plan1)
    assert h.send(0, plan1) == "accepted"
    (plan2,) = opened(h)  # version 2 published; device 5 carried (1 behind)
    assert ids[5] in h.reg.get_round(job.id, 2).participants
    assert h.send(0, plan2) == "accepted"
    result = h.engine.tick()  # version 3: device 5 is now 2 behind, more than S = 1
    (plan3,) = result.opened
    assert ids[5] not in {d for d, p in h.reg.get_round(job.id, 3).participants.items() if p.origin}
    assert ids[5] in plan3.devices  # released: it may take the current version instead
    receipt = receive(h, 5, late)
    assert (receipt.status, receipt.reason) == ("rejected", "stale")
    assert "2 version(s) behind" in receipt.detail and "at most 1" in receipt.detail
    assert h.metrics.registry.get_sample_value("edge_coordinator_updates_stale_total") == 1
    assert h.reg.list_updates(job.id, 3) == [] and h.reg.list_updates(job.id, 1, UpdateStatus.PENDING) == []


def test_a_restart_mid_async_intake_loses_and_double_counts_nothing(h: Harness, fleet: dict) -> None:
    base = softmax_head()
    h.setup(base)
    ids = fleet["ids"]
    job = start(h, buffer=3, staleness=4, rounds=3)
    (plan1,) = opened(h)
    slow = {i: h.payload(i, plan1) for i in range(3, N_DEV)}
    for i in range(3):
        assert h.send(i, plan1) == "accepted"
    (plan2,) = opened(h)
    assert receive(h, 3, slow[3]).status == "accepted"
    h.reopen()  # the coordinator is killed after an in-flight update was stored
    assert receive(h, 3, slow[3]).status == "duplicate"
    assert receive(h, 4, slow[4]).status == "accepted"
    h.reg.begin_closing(job.id, 2, dropout_reason="in_flight: carried")  # killed right after closing began
    h.reopen()
    (out2,) = h.engine.tick().closed
    assert sorted(out2.accepted) == sorted(ids[3:5])
    stored = h.reg.list_updates(job.id)
    assert len(stored) == len({(u.device_id, u.round) for u in stored}) == 5  # each update once
    # the published head is the rule's dense reference over exactly those two stored updates,
    # each weighed by its staleness (both were trained on version 1: one version behind)
    assert {u.device_id: u.weight for u in stored if u.round == 2} == pytest.approx(
        {ids[i]: slow[i][1] / math.sqrt(2) for i in (3, 4)})
    v2, want = h.reg.load_head(out2.new_version), reference_head(h.reg, job.id, 2)
    for k in v2:
        np.testing.assert_allclose(v2[k], want[k], rtol=1e-5, atol=1e-6)
    x_test, y_test = fleet["test"]
    assert accuracy(v2, x_test, y_test) > accuracy(base, x_test, y_test) + 0.3


def test_an_async_job_ends_after_its_versions_and_cancel_reaches_devices_in_flight(h: Harness, fleet: dict) -> None:
    h.setup(softmax_head())
    ids = fleet["ids"]
    job = start(h, buffer=2, staleness=3, rounds=2)
    (plan1,) = opened(h)
    h.send(0, plan1), h.send(1, plan1)
    (plan2,) = opened(h)
    cancelled = h.engine.cancel_job(job.id)
    told = {d for p in cancelled for d in p.devices}
    assert set(ids[2:]) <= told  # the devices still training version 1 are told to stop too
    assert h.reg.get_job(job.id).status is JobStatus.CANCELLED
    assert h.send(2, plan1) == "rejected"


@pytest.mark.parametrize("params, match", [
    ({"mode": "async"}, "buffer must be an integer"),
    ({"mode": "async", "buffer": 0}, "buffer must be an integer in 1"),
    ({"mode": "async", "buffer": 2, "max_staleness": -1}, "max_staleness must be"),
    ({"mode": "async", "buffer": True}, "buffer must be"),
    ({"mode": "fast"}, "mode must be 'sync' or 'async'"),
    ({"buffer": 4}, "buffer is a parameter of asynchronous jobs"),
])
def test_bad_async_params_are_refused_at_start(h: Harness, params: dict, match: str) -> None:
    h.setup(softmax_head())
    with pytest.raises(InputError, match=match):
        h.engine.start_job(model_name="digits", model_version="1", params=params)


def test_staleness_counts_published_versions_only() -> None:
    from edge_agent.coordinator.records import RoundRecord

    def rnd(n: int, state: RoundState) -> RoundRecord:
        return RoundRecord("j", n, state, "1", 0.0, 1.0, 1.0, f"j-r{n}" if state is RoundState.AGGREGATED else None, "")

    rounds = [rnd(1, RoundState.AGGREGATED), rnd(2, RoundState.FAILED), rnd(3, RoundState.AGGREGATED),
              rnd(4, RoundState.OPEN)]
    assert published_since(rounds, 1, 4) == 2 and published_since(rounds, 2, 4) == 1
    assert published_since(rounds, 4, 4) == 0
    mode = AsyncMode(buffer=3, max_staleness=2)
    assert mode.weight(0) == 1.0 and mode.weight(3) == pytest.approx(0.5)


def test_a_schema_6_registry_with_an_open_round_migrates_its_participants(h: Harness, fleet: dict,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from edge_agent.coordinator import registry as registry_module
    from edge_agent.coordinator.schema import MIGRATIONS

    h.reg.close()
    monkeypatch.setattr(registry_module, "MIGRATIONS", MIGRATIONS[:6])
    h.open()
    h.setup(softmax_head())
    job = h.engine.start_job(model_name="digits", model_version="1", min_devices=1, deadline_s=600)
    (plan,) = opened(h)
    monkeypatch.setattr(registry_module, "MIGRATIONS", MIGRATIONS)
    h.reopen()  # the upgraded coordinator resumes the round it left open
    assert h.reg.schema_version == len(MIGRATIONS)
    parts = h.reg.get_round(job.id, 1).participants
    assert len(parts) == N_DEV and all(p.origin is None for p in parts.values())
    assert h.send(0, plan) == "accepted"


def test_retention_keeps_the_versions_devices_in_flight_still_train(h: Harness, fleet: dict) -> None:
    from edge_agent.coordinator.retention import current

    h.setup(softmax_head())
    ids = fleet["ids"]
    job = start(h, buffer=1, staleness=4)
    (plan1,) = opened(h)
    assert h.send(5, plan1) == "accepted"
    (plan2,) = opened(h)  # version r1; devices 0-4 carried, 5 dispatched again on r1
    late = h.payload(5, plan2)  # device 5 trains r1 and is slow to deliver
    assert receive(h, 0, h.payload(0, plan1)).status == "accepted"  # a carried one fills round 2
    (plan3,) = opened(h)  # version r2; device 5 carried with origin 2
    assert h.send(0, plan3) == "accepted"
    opened(h)  # version r3: round 4 is open on it, device 5 still trains r1
    rnd4 = h.reg.get_round(job.id, 4)
    assert rnd4.base_version == f"{job.id}-r3" and rnd4.participants[ids[5]].origin == 2
    kept = {v for name, v in current(h.reg) if name == "digits"}
    assert f"{job.id}-r1" in kept  # device 5's base: its update decodes against it
    assert receive(h, 5, late).status == "accepted"
    assert f"{job.id}-r1" not in {v for _, v in current(h.reg)}  # delivered: nobody trains r1 any more


def test_a_device_asleep_offline_stays_in_flight_and_delivers_later(h: Harness, fleet: dict) -> None:
    h.setup(softmax_head())
    ids = fleet["ids"]
    job = start(h, buffer=2, staleness=3, deadline_s=3 * 3600)  # a device's command: 4 x 3 h, through the night
    (plan1,) = opened(h)
    late = h.payload(4, plan1)
    h.reg.record_state(ids[4], online=False)  # its will: the battery ran down at dusk
    h.clock.t += 10 * h.policy.offline_grace_s
    assert h.engine.tick().gone == []  # not a dropout: asynchronous devices come back
    assert h.send(0, plan1) == "accepted" and h.send(1, plan1) == "accepted"
    opened(h)
    assert ids[4] in h.reg.get_round(job.id, 2).carried_in
    for _ in range(8):  # the night: round 2 passes its deadline with nothing to publish, and waits
        h.clock.t += 3600
        assert h.engine.tick().closed == []
    h.reg.record_state(ids[4], online=True)  # the morning
    assert receive(h, 4, late).status == "accepted"
    (out,) = h.engine.tick().closed  # past its deadline with an update to publish: it closes
    assert out.state is RoundState.AGGREGATED and out.accepted == (ids[4],)
    assert [r.state for r in h.reg.list_rounds(job.id)][:2] == [RoundState.AGGREGATED] * 2


def test_a_device_in_flight_that_gives_up_is_a_dropout_of_the_round_carrying_it(h: Harness, fleet: dict) -> None:
    h.setup(softmax_head())
    ids = fleet["ids"]
    job = start(h, buffer=1, staleness=4)
    (plan1,) = opened(h)
    assert h.send(0, plan1) == "accepted"
    opened(h)  # round 2 carries devices 1-5
    # device 3 browns out: its refusal names the round it was dispatched in
    assert h.engine.record_dropout(job.id, 1, ids[3], "failed: brown-out") is True
    assert h.engine.record_dropout(job.id, 1, ids[3], "failed: brown-out") is False  # once
    assert h.reg.get_round(job.id, 2).dropouts == {ids[3]: "failed: brown-out"}
    assert h.send(1, plan1) == "accepted"  # a carried one fills round 2's buffer
    opened(h)
    assert ids[3] not in h.reg.get_round(job.id, 3).carried_in  # not in flight any more: free again
    with pytest.raises(InputError, match="buffer 1 < min_devices 2"):
        h.engine.start_job(model_name="digits", model_version="1", min_devices=2,
                           params={"mode": "async", "buffer": 1})


def test_devices_that_go_silent_for_good_do_not_stall_the_job(h: Harness, fleet: dict) -> None:
    """One update, fewer than --min-devices, and every other device dead without a word: the
    round closes once its commands' deadline (S + 1 rounds) has passed, and the next round
    does not carry devices past their deadline (they were released, and may be chosen again)."""
    h.setup(softmax_head())
    job = start(h, buffer=3, staleness=2, min_devices=2)
    (plan,) = opened(h)
    assert h.send(0, plan) == "accepted"
    for _ in range(2):  # two round deadlines: still waiting for its devices in flight
        h.clock.t += 600
        assert h.engine.tick().closed == []
    h.clock.t += 600  # 3 x 600 s = the commands' deadline
    for i in range(N_DEV):  # (the fleet is heard again: selection takes only devices online now)
        h.reg.record_state(fleet["ids"][i], online=True, state={"battery_pct": 80.0, "on_power": False})
    result = h.engine.tick()
    (out,) = result.closed
    assert out.state is RoundState.FAILED and "1 accepted update(s), need 2" in out.reason
    rnd2 = h.reg.get_round(job.id, 2)
    assert rnd2.carried_in == [] and len(rnd2.participants) == N_DEV  # released and chosen again


def test_max_concurrency_caps_the_devices_training_at_once(h: Harness, fleet: dict) -> None:
    h.setup(softmax_head())
    ids = fleet["ids"]
    job = start(h, buffer=1, staleness=4, max_concurrency=3)
    (plan1,) = opened(h)
    assert len(plan1.devices) == 3  # 6 eligible, 3 at once
    assert h.send(plan1_i := ids.index(plan1.devices[0]), plan1) == "accepted"
    (plan2,) = opened(h)
    carried = h.reg.get_round(job.id, 2).carried_in
    assert len(carried) == 2 and len(plan2.devices) == 1  # 2 still training + 1 new = 3
    assert ids[plan1_i] not in carried
    with pytest.raises(InputError, match="max_concurrency must be an integer >= buffer"):
        start(h, buffer=4, staleness=1, max_concurrency=2)
    with pytest.raises(InputError, match="max_concurrency is a parameter of asynchronous jobs"):
        h.engine.start_job(model_name="digits", model_version="1", params={"max_concurrency": 3})
