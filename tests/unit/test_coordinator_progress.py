"""Device progress messages at the coordinator (service_messages.DeviceMessages) over a real
registry: a device's result metrics are untrusted, partial input."""

from __future__ import annotations

import base64
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from edge_agent.coordinator.command_refusals import CommandRefusals
from edge_agent.coordinator.registry import Registry
from edge_agent.coordinator.service_messages import DeviceMessages
from edge_agent.coordinator.update_inbox import UpdateInbox
from edge_agent.keys import fingerprint, generate_private_key, public_key_bytes


def _messages(reg: Registry, engine: Any, tmp_path: Path) -> DeviceMessages:
    """The coordinator's message handler over `reg` and `engine`, with no broker: progress
    reports publish nothing."""
    inbox = UpdateInbox(registry=reg, engine=engine, signer=None, topics=None, client=None,  # type: ignore[arg-type]
                        ack_interval=1.0)
    refusals = CommandRefusals(signer=None, state_dir=tmp_path, approved=lambda: 1, problems=[])  # type: ignore[arg-type]
    return DeviceMessages(registry=reg, engine=engine, topics=None, signer=None, client=None,  # type: ignore[arg-type]
                          channel=None, pending=None, device_trust=None, inbox=inbox,  # type: ignore[arg-type]
                          refusals=refusals, auto_approve=False, full_wanted=lambda ref: None)


def test_a_progress_report_with_only_some_result_metrics_keeps_those_and_raises_nothing(tmp_path: Path) -> None:
    """Before: a metrics dict without one of RESULT_METRICS raised KeyError in the serving
    loop (a missing key reads as None, which counts as a scalar), and each error backed the
    loop off further -- one device could slow the whole coordinator."""
    key = generate_private_key()
    device = fingerprint(key)
    with Registry(state_dir=tmp_path) as reg:
        reg.enrol_device(device_id=device, public_key=base64.b64encode(public_key_bytes(key)).decode(), fleet="f")
        dropouts: list[tuple] = []
        h = _messages(reg, SimpleNamespace(record_dropout=lambda *a: dropouts.append(a) or True), tmp_path)
        body = {"phase": "uploading", "job": "job-1", "round": 2,
                "metrics": {"num_samples": 40, "energy_wh": 0.01, "engine": "x" * 300, "not_a_metric": 1}}
        h._progress(SimpleNamespace(body=body), device)  # type: ignore[arg-type]
        assert h.inbox.results[("job-1", device, 2)] == {"num_samples": 40, "energy_wh": 0.01}  # too long: dropped
        h._progress(SimpleNamespace(body={"phase": "failed", "job": "job-1", "round": 3,  # type: ignore[arg-type]
                                          "detail": "battery low"}), device)
        assert dropouts == [("job-1", 3, device, "failed: battery low")]
        assert reg.get_device(device).state.get("job_phase") == "failed"


def test_a_device_whose_job_trained_no_step_is_a_dropout_the_round_does_not_wait_for(tmp_path: Path) -> None:
    """Issue 40: the agent fails a job that trained no step and says why in its "failed"
    progress (agent/lifecycle.py); no update comes. The coordinator's existing failed-job
    path records the device as dropped out with that reason, and the round closes with the
    others' updates instead of waiting for the deadline."""
    from edge_agent.coordinator.records import ParticipantStatus, RoundState
    from edge_agent.coordinator.rounds import RoundEngine
    from edge_agent.train.job_report import failure_record

    keys = [generate_private_key() for _ in range(2)]
    devices = [fingerprint(k) for k in keys]
    now = [1_700_000_000.0]
    with Registry(state_dir=tmp_path, clock=lambda: now[0]) as reg:
        reg.add_model_version(name="digits", version="1", head={"w": np.zeros(4, np.float32)})
        for device, key in zip(devices, keys, strict=True):
            reg.enrol_device(device_id=device, public_key=base64.b64encode(public_key_bytes(key)).decode(),
                             fleet="f", approved=True)
            reg.record_state(device, online=True, state={"battery_pct": 90.0, "on_power": True})
        engine = RoundEngine(registry=reg, clock=lambda: now[0])
        job = engine.start_job(model_name="digits", model_version="1", min_devices=1, deadline_s=600)
        (plan,) = engine.tick().opened
        for device in devices:
            engine.record_dispatch(job.id, 1, device)
        h = _messages(reg, engine, tmp_path)
        why = failure_record("budget-exhausted", 0, "", 0.0021, stopped_in="features")["message"]
        h._progress(SimpleNamespace(body={"phase": "failed", "job": job.id, "round": 1,  # type: ignore[arg-type]
                                          "detail": why}), devices[0])
        rnd = reg.get_round(job.id, 1)
        assert rnd.participants[devices[0]].status is ParticipantStatus.DROPPED
        assert rnd.participants[devices[0]].reason == f"failed: {why}" and "trained 0 steps" in why
        assert engine.tick().closed == []  # the other device may still deliver
        h._progress(SimpleNamespace(body={"phase": "failed", "job": job.id, "round": 1,  # type: ignore[arg-type]
                                          "detail": why}), devices[1])
        (closed,) = engine.tick().closed  # nobody left to wait for: closed now, not at the deadline
        assert closed.state is RoundState.FAILED and set(closed.dropouts) == set(devices), closed
