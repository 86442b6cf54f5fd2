"""Device limits known to the coordinator (issue 20): the agent reports its daily job
allowance (and a standing refusal) in its signed state; cancelled jobs do not count; round
selection skips a device at its limit and `status` / `devices` say why."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest

from edge_agent.agent.jobs import Job, JobState
from edge_agent.agent.policy import (
    DAY_S,
    DEFAULT_MAX_JOBS_PER_DAY,
    DeviceLimits,
    counted_jobs,
    daily_allowance,
)
from edge_agent.coordinator.fleet_views import device_rows, refusal_lines
from edge_agent.coordinator.rounds import RoundPolicy
from edge_agent.coordinator.selection import allowance_state, refusal, select_devices
from edge_agent.protocol.schema import Kind, check_body
from tests.unit.test_agent_lifecycle import Rig
from tests.unit.test_coordinator_rounds import T0, Clock, Harness, dev, softmax_head
from tests.unit.test_coordinator_rounds import fleet as fleet  # the module-scoped fixture


def test_default_limit_leaves_headroom_over_an_hourly_schedule() -> None:
    assert DeviceLimits().max_jobs_per_day == DEFAULT_MAX_JOBS_PER_DAY >= 2 * 24
    from edge_agent.config import DEFAULTS

    assert DEFAULTS["policy"]["max_jobs_per_day"] == DEFAULT_MAX_JOBS_PER_DAY


def test_cancelled_jobs_do_not_count_and_the_allowance_says_when_it_frees(tmp_path: Path) -> None:
    now = 1_800_000_000.0
    jobs = [Job(job_id=f"j{i}-r1", round=1, model="m@1", created=now - 3600 * (i + 1),
                state=JobState.CANCELLED if i == 1 else JobState.DONE) for i in range(4)]
    jobs.append(Job(job_id="old-r1", round=1, model="m@1", created=now - DAY_S - 1, state=JobState.DONE))
    counted = counted_jobs(jobs, now)
    assert sorted(counted) == ["j0-r1", "j2-r1", "j3-r1"]  # not the cancelled one, not the day-old one
    lim = DeviceLimits(max_jobs_per_day=3, data_dir=str(tmp_path))
    a = daily_allowance(lim, counted.values(), now)
    assert (a.jobs_left, a.refuse) == (0, "daily_limit")
    assert a.resets_at == now - 4 * 3600 + DAY_S  # the oldest counted job leaves the window
    assert "daily limit 3/3, resets" in a.detail and a.detail.endswith("UTC")
    facts = a.to_facts()
    check_body(Kind.STATE, {"status": "idle", "info": {"name": "pi", **facts}})
    assert facts["refuse"] == "daily_limit" and facts["jobs_left"] == 0 and facts["jobs_limit"] == 3
    roomy = daily_allowance(dataclasses.replace(lim, max_jobs_per_day=5), counted.values(), now)
    assert (roomy.jobs_left, roomy.refuse) == (2, "") and "refuse" not in roomy.to_facts()
    off = daily_allowance(DeviceLimits(accept_finetune=False, data_dir=str(tmp_path)), [], now)
    assert off.refuse == "finetune_disabled" and off.jobs_left == DEFAULT_MAX_JOBS_PER_DAY


@pytest.mark.parametrize(("allowance", "words"), [
    ({"jobs_left": -1, "jobs_limit": 3}, "entry jobs_left must be an integer"),
    ({"jobs_left": 1.5}, "entry jobs_left must be an integer"),
    ({"jobs_left": 1, "jobs_reset_at": "03:00"}, "entry jobs_reset_at must be an integer"),
    ({"jobs_left": 1, "jobs_limit": 3, "refuse": "no such!"}, "entry refuse must be"),
    ({"jobs_left": 1, "jobs_limit": 3, "refuse_detail": "x" * 201}, "at most 200"),
])
def test_the_state_allowance_is_validated(allowance: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        check_body(Kind.STATE, {"status": "idle", "info": allowance})
    check_body(Kind.STATE, {"status": "idle", "info": {"name": "pi"}})  # an agent that sends none is valid
    # and an older coordinator (whose schema only knew a flat `info`) takes a newer agent's state
    from edge_agent.protocol.schema import _flat

    _flat({"jobs_left": 0, "jobs_limit": 48, "jobs_reset_at": 1_800_000_000, "refuse": "daily_limit",
           "refuse_detail": "daily limit 48/48, resets 03:00 UTC"})


def test_a_driver_counts_accepted_jobs_but_gives_a_cancelled_one_back(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.settings = dataclasses.replace(rig.settings, limits=dataclasses.replace(rig.settings.limits,
                                                                                max_jobs_per_day=1))
    rig.driver = rig.new_driver()
    assert rig.driver.allowance().jobs_left == 1
    rig.submit("a")
    assert rig.driver.allowance().to_facts()["refuse"] == "daily_limit"
    assert rig.driver.cancel({"job": "a"}).accept
    assert rig.job("a-r1").state is JobState.CANCELLED
    assert rig.driver.allowance().jobs_left == 1  # the cancel gave it back
    rig.submit("b")  # accepted: the cancelled job did not count
    rig.store.advance(rig.job("b-r1"), JobState.CANCELLED, "x")  # (a finished job would count)
    rig.driver._track(rig.job("b-r1"))
    verdict, _ = rig.driver.submit({"cmd_id": "c-r1", "action": "finetune", "job": "c", "round": 1,
                                    "model": "digits", "version": "1"}, "c-r1")
    assert verdict.accept  # counted from the store: b is cancelled too
    rig.store.advance(rig.job("c-r1"), JobState.FAILED, "x")
    rig.driver._track(rig.job("c-r1"))
    verdict, _ = rig.driver.submit({"cmd_id": "d-r1", "action": "finetune", "job": "d", "round": 1,
                                    "model": "digits", "version": "1"}, "d-r1")
    assert not verdict.accept and verdict.reason == "daily_limit"
    fresh = rig.new_driver()  # a restarted daemon reads the store once
    assert fresh.allowance().refuse == "daily_limit"


def test_selection_skips_a_device_at_its_limit_until_the_reset_passes() -> None:
    full = allowance_state({"jobs_left": 0, "jobs_limit": 48, "jobs_reset_at": int(T0) + 600, "refuse": "daily_limit",
                            "refuse_detail": "daily limit 48/48, resets 03:00 UTC", "battery_pct": 50})
    assert set(full) == {"jobs_left", "jobs_limit", "jobs_reset_at", "refuse", "refuse_detail"}
    at_limit = dev(1, state={"battery_pct": 90, **full})
    roomy = dev(2, state={"battery_pct": 90, **allowance_state({"jobs_left": 7, "jobs_limit": 48})})
    old = dev(3, state={"battery_pct": 90, **allowance_state({"battery_pct": 90})})  # an agent that does not say
    sel = select_devices([at_limit, roomy, old], "all", now=T0, online_within_s=300, min_battery_pct=30)
    assert sel.eligible == ["d2", "d3"]
    assert sel.ineligible == {"d1": "refuses jobs: daily limit 48/48, resets 03:00 UTC"}
    later = select_devices([dataclasses.replace(at_limit, last_seen=T0 + 600)], "all", now=T0 + 601,
                           online_within_s=300, min_battery_pct=30)
    assert later.eligible == ["d1"]  # its oldest job left the window since it said so
    no_data = dev(4, state={"battery_pct": 90, **allowance_state({"jobs_left": 3, "jobs_limit": 48,
                                                                   "refuse": "no_data"})})
    assert refusal(no_data.state, T0 + 10**6) == "refuses jobs: no_data"
    assert refusal_lines([at_limit, roomy], T0) == [
        "  d1 (-): refuses jobs: daily limit 48/48, resets 03:00 UTC -- not selected for rounds"]
    rows = device_rows([at_limit, roomy, old], RoundPolicy(), T0)
    assert rows[0][9] == "JOBS LEFT" and [r[9] for r in rows[1:]] == ["0/48 (refuses)", "7/48", "-"]


def test_the_round_engine_does_not_select_a_device_at_its_limit(tmp_path: Path, fleet: dict) -> None:
    h = Harness(tmp_path, fleet, Clock())
    try:
        h.setup(softmax_head())
        full = fleet["ids"][0]
        h.reg.record_state(full, online=True, state=allowance_state(
            {"jobs_left": 0, "jobs_limit": 2, "jobs_reset_at": int(T0) + 3600, "refuse": "daily_limit",
             "refuse_detail": "daily limit 2/2, resets 01:00 UTC"}))
        h.engine.start_job(model_name="digits", model_version="1", rounds=1, min_devices=1, deadline_s=60)
        (plan,) = h.engine.tick().opened
        assert full not in plan.devices and sorted(plan.devices) == sorted(fleet["ids"][1:])
        h.engine.start_job(model_name="digits", model_version="1", rounds=1, min_devices=len(fleet["ids"]),
                           deadline_s=60, selector="all")
        h.engine.tick()
        waiting = [j for j in h.reg.list_jobs() if j.reason.startswith("waiting")]
        assert waiting and f"{full}: refuses jobs: daily limit 2/2" in waiting[0].reason
    finally:
        h.reg.close()


def test_time_is_not_read_from_the_wall_clock_in_selection() -> None:
    # the reset check uses the engine's clock (`now`), so a test clock controls it
    state = allowance_state({"jobs_left": 0, "jobs_limit": 1, "jobs_reset_at": 10, "refuse": "daily_limit"})
    assert refusal(state, 9.0) and not refusal(state, 10.0) and time.time() > 10
