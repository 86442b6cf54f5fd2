"""The job driver over real files (JobStore, Outbox, model directories) with a scripted child
at the child contract's interface (runner.py): power waits, governor pauses, crashes and the
re-entry limit, cancellation, restart recovery, and the hand-off to the outbox."""

from __future__ import annotations

import dataclasses
import inspect
import json
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from edge_agent.agent.child import FINETUNE_KEYS
from edge_agent.agent.jobs import MAX_REENTRIES, Job, JobState, JobStore, transition
from edge_agent.agent.lifecycle import DriverSettings, JobDriver
from edge_agent.agent.models import ModelStore
from edge_agent.agent.policy import DeviceLimits
from edge_agent.agent.runner import SPEC_FILE
from edge_agent.agent.state import Readings
from edge_agent.protocol import Topics
from edge_agent.protocol.finetune import DISTILL_DEFAULT, FLEET_DISTILL_DEFAULT, TRAIN_KEYS
from edge_agent.train.job import run_finetune
from edge_agent.transport import Outbox, OutboxKey

S = JobState
DEVICE = "dev0"
# Follows the child contract: events on --events-fd, results in the job dir, exit codes.
SCRIPTED = textwrap.dedent(r'''
    import json, os, signal, struct, sys, time
    from edge_agent.atomic import atomic_write_json, write_checked
    from edge_agent.agent.runner import pack_chunks
    args = sys.argv[1:]
    fd = int(args[args.index("--events-fd") + 1])
    spec = json.load(open(args[args.index("--spec") + 1]))
    job_dir = spec["job_dir"]
    mode = json.load(open(os.path.join(spec["data"], "mode.json")))["mode"]
    def send(**ev):
        os.write(fd, (json.dumps(ev) + "\n").encode())
    if mode == "crash":
        sys.exit(1)
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    send(phase="train", step=1, total_steps=4, detail="")
    if mode == "pause":
        send(phase="paused", step=1, detail="pause(battery-low) until battery >= 50 %")
        send(phase="train", step=1, detail="resumed")
    if mode == "wait":
        while not stop:
            time.sleep(0.02)
        atomic_write_json(os.path.join(job_dir, "result.json"), {"status": "stopped", "stop_reason": "cancelled"})
        sys.exit(3)
    if mode == "zero-steps":  # the budget ran out before the first step: failed, nothing to send (issue 40)
        atomic_write_json(os.path.join(job_dir, "result.json"), {"status": "failed", "stop_reason": "budget-exhausted",
                          "stop_detail": "job energy 0.002 Wh of 0.002 Wh; next step ~0.0001 Wh", "steps": 0,
                          "failure": "trained 0 steps: the energy budget ran out while the backbone's features were "
                                     "being computed (job energy 0.002 Wh of 0.002 Wh); 0.002 Wh spent"})
        sys.exit(3)
    if mode == "sensor-error":  # the governor halted: the result says why
        atomic_write_json(os.path.join(job_dir, "result.json"), {"status": "stopped", "stop_reason": "error",
                          "stop_detail": "no power reading in 5 consecutive samples", "steps": 1})
        sys.exit(3)
    send(phase="train", step=4, total_steps=4, detail="")
    write_checked(os.path.join(job_dir, "update.chunks"), pack_chunks([b"chunk-0" * 10, b"chunk-1"]))
    open(os.path.join(job_dir, "residual.pending"), "wb").write(b"residual of " + spec["job"].encode())
    atomic_write_json(os.path.join(job_dir, "result.json"), {"status": "trained", "stop_reason": "done",
                      "num_samples": 42, "energy_wh": 0.01, "engine": "native", "steps": 4})
    sys.exit(0)
''')


class Rig:
    def __init__(self, tmp: Path, *, battery: float = 90.0, mode: str = "finish") -> None:
        self.tmp, self.battery, self.charging = tmp, battery, False
        self.power_w: float | None = 2.5  # what the power monitor reads (None: no source gives a reading)
        self.data = tmp / "data"
        self.data.mkdir()
        self.set_mode(mode)
        script = tmp / "child.py"
        script.write_text(SCRIPTED)
        self.store = JobStore(tmp / "state" / "jobs")
        self.outbox = Outbox(directory=tmp / "state" / "outbox")
        self.models = ModelStore(root=tmp / "state" / "models", topics=Topics(fleet="f"), subscribe=lambda f: None,
                                 unsubscribe=lambda f: None)
        (tmp / "state" / "models" / "digits" / "1").mkdir(parents=True)
        (tmp / "state" / "models" / "digits" / "1" / "manifest.json").write_text("{}")
        self.published: list[dict[str, Any]] = []
        self.settings = DriverSettings(
            device_id=DEVICE, state_dir=tmp / "state", battery_floor_pct=40.0, battery_resume_pct=50.0,
            limits=DeviceLimits(min_battery_pct=30.0, energy_wh=2.0, deadline_s=3600, data_dir=str(self.data)),
            respawn_base_s=0.01, python=(sys.executable, str(script)))
        self.driver = self.new_driver()

    def new_driver(self) -> JobDriver:
        """A fresh driver over the same files: what a restarted daemon builds."""
        return JobDriver(settings=self.settings, store=self.store, models=self.models, outbox=self.outbox,
                         readings=lambda fresh=False: Readings(battery_pct=self.battery, charging=self.charging,
                                                               power_w=self.power_w),
                         publish=lambda phase, **kw: self.published.append({"phase": phase, **kw}))

    def set_mode(self, mode: str) -> None:
        (self.data / "mode.json").write_text(json.dumps({"mode": mode}))

    def submit(self, job: str = "j", rnd: int = 1) -> Job:
        verdict, created = self.driver.submit({"cmd_id": f"{job}-r{rnd}", "action": "finetune", "job": job,
                                               "round": rnd, "model": "digits", "version": "1"}, f"{job}-r{rnd}")
        assert verdict.accept and created is not None, verdict
        return created

    def job(self, job_id: str = "j-r1") -> Job:
        return self.store.load(job_id)

    def run_until(self, done: Callable[[], bool], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.driver.step()
            if done():
                return
            time.sleep(0.01)
        raise AssertionError(f"timed out; job {self.job().state} {self.job().history}")


@pytest.fixture
def rig(tmp_path: Path) -> Rig:
    return Rig(tmp_path)


def test_a_job_the_governor_stopped_fails_with_the_governors_reason(rig: Rig) -> None:
    rig.set_mode("sensor-error")
    rig.submit()
    rig.run_until(lambda: rig.job().state is S.FAILED)
    assert rig.job().reason == "training stopped: error (no power reading in 5 consecutive samples)"
    assert rig.outbox.items() == []  # nothing trained: nothing sent


def test_a_job_that_trained_no_step_fails_with_its_reason_and_sends_nothing(rig: Rig) -> None:
    rig.set_mode("zero-steps")
    rig.submit()
    rig.run_until(lambda: rig.job().state.terminal)
    job = rig.job()
    assert job.state is S.FAILED and job.reason.startswith("trained 0 steps: the energy budget ran out"), job.history
    assert [h[1] for h in job.history][-2:] == ["training", "failed"]  # not respawned: a verdict, not a crash
    assert rig.outbox.items() == []  # no (empty) update
    failed = [p for p in rig.published if p["phase"] == "failed"]
    # what the coordinator records as this device's dropout (service_messages._progress)
    assert len(failed) == 1 and failed[0]["detail"] == job.reason and failed[0]["job"] == "j" and failed[0]["round"] == 1
    assert not any(p["phase"] in ("uploading", "done") for p in rig.published)


def test_happy_path_with_a_governor_pause_then_the_outbox(rig: Rig) -> None:
    rig.set_mode("pause")
    rig.submit()
    rig.run_until(lambda: rig.job().state is S.UPLOADING)
    job = rig.job()
    assert [h[1] for h in job.history] == ["preparing", "training", "paused", "training", "uploading"]
    assert job.entries["training"] == 1  # a governor pause/resume is not a restart
    key = OutboxKey("j", DEVICE, 1)
    item = rig.outbox.get(key)
    assert item is not None and item.meta["num_samples"] == 42
    assert [rig.outbox.chunk(key, i) for i in range(item.count)] == [b"chunk-0" * 10, b"chunk-1"]
    residual = rig.tmp / "state" / "residuals" / "digits.bin"
    assert residual.read_bytes() == b"residual of j"  # adopted only once the update was queued
    rig.driver.on_upload(key, "acked")
    assert rig.job().state is S.DONE
    assert not (rig.tmp / "state" / "checkpoints" / "j-r1").exists()
    phases = [p["phase"] for p in rig.published]
    assert phases[0] == "accepted" and "paused" in phases and phases[-2:] == ["uploading", "done"]
    uploading = next(p for p in rig.published if p["phase"] == "uploading")
    assert uploading["metrics"]["num_samples"] == 42 and uploading["job"] == "j" and uploading["round"] == 1
    # a repeated command for the same (job, round) is acknowledged, not run again
    verdict, again = rig.driver.submit({"job": "j", "round": 1, "model": "digits", "version": "1"}, "x")
    assert verdict.accept and verdict.reason == "duplicate" and again is not None and again.state is S.DONE


def test_the_data_label_settings_reach_the_training_child(rig: Rig) -> None:
    """agent.toml [data] label_map / skip_unknown: a fleet job reads data as the operator said."""
    rig.settings = dataclasses.replace(rig.settings, label_map="0=sky,1=tree", skip_unknown=True)
    rig.driver = rig.new_driver()
    job = rig.submit()
    rig.run_until(lambda: rig.job().state is S.UPLOADING)
    spec = json.loads((rig.driver.job_dir(job) / SPEC_FILE).read_text())
    assert spec["label_map"] == "0=sky,1=tree" and spec["skip_unknown"] is True


def test_every_training_parameter_of_the_command_reaches_the_training_child(rig: Rig) -> None:
    """Issue 35 #24: `trainer` was accepted by the coordinator but dropped by the agent."""
    params = {"epochs": 3, "batch_size": 8, "lr": 0.01, "patience": 2, "checkpoint_every": 5, "seed": 7,
              "update_bytes": 4096, "augment": 1, "depth": 1, "bn": "update", "tail": "bias", "trainer": "mxnet",
              "dp_clip": 0.5, "distill": 1.5}
    assert set(params) == set(TRAIN_KEYS)  # (a new key gets a value here too)
    verdict, job = rig.driver.submit({"cmd_id": "j-r1", "action": "finetune", "job": "j", "round": 1,
                                      "model": "digits", "version": "1", "params": params}, "j-r1")
    assert verdict.accept and job is not None, verdict
    rig.run_until(lambda: rig.job().state is S.UPLOADING)
    spec = json.loads((rig.driver.job_dir(job) / SPEC_FILE).read_text())
    assert {k: spec.get(k) for k in params} == params
    assert set(FINETUNE_KEYS) <= set(inspect.signature(run_finetune).parameters)  # what the child passes on


def test_a_fleet_job_that_sets_no_distillation_trains_without_it(rig: Rig) -> None:
    """protocol/finetune.FLEET_DISTILL_DEFAULT: off in a coordinator's job, whatever the local
    `edge-agent finetune` default is (simulated fleets lost accuracy with the pull)."""
    job = rig.submit()
    rig.run_until(lambda: rig.job().state is S.UPLOADING)
    spec = json.loads((rig.driver.job_dir(job) / SPEC_FILE).read_text())
    assert spec["distill"] == FLEET_DISTILL_DEFAULT == 0.0 != DISTILL_DEFAULT


def test_a_job_no_power_source_can_meter_is_refused_or_failed_before_any_work(rig: Rig) -> None:
    """Issue 35 #26: with no power reading the daemon said "power ok" and the child stopped
    with an error only after engine selection and features (minutes on a Pi)."""
    rig.power_w = None
    verdict, created = rig.driver.submit({"cmd_id": "j-r1", "action": "finetune", "job": "j", "round": 1,
                                         "model": "digits", "version": "1"}, "j-r1")
    assert not verdict.accept and created is None and verdict.reason == "no_power_reading", verdict
    assert "2 Wh energy budget cannot be enforced" in verdict.detail and "edge-agent probe" in verdict.detail
    # accepted while the sensor read, failed before the next step: the job fails, untrained, saying why
    rig.power_w = 2.5
    rig.submit()
    rig.power_w = None
    rig.run_until(lambda: rig.job().state.terminal)
    job = rig.job()
    assert job.state is S.FAILED and "no power source gives a reading" in job.reason, job.history
    assert [h[1] for h in job.history] == ["failed"] and not (rig.driver.job_dir(job) / SPEC_FILE).exists()
    # without an energy budget there is nothing to meter against: accepted
    rig.settings = dataclasses.replace(rig.settings, limits=dataclasses.replace(rig.settings.limits, energy_wh=None))
    rig.driver = rig.new_driver()
    rig.submit("k")
    rig.run_until(lambda: rig.job("k-r1").state is S.UPLOADING)


def test_waits_for_power_with_hysteresis_then_cancel_stops_the_child(rig: Rig) -> None:
    rig.battery = 35.0  # above the policy's 30 % (accepted), below the 40 % floor (waits)
    rig.set_mode("wait")
    rig.submit()
    rig.run_until(lambda: rig.job().state is S.WAITING_FOR_POWER)
    rig.battery = 45.0  # above the floor but below the 50 % resume level: keeps waiting
    for _ in range(5):
        rig.driver.step()
    assert rig.job().state is S.WAITING_FOR_POWER
    rig.battery = 55.0
    rig.run_until(lambda: rig.job().state is S.TRAINING and "j-r1" in rig.driver.children)
    assert rig.driver.cancel({"job": "j"}).accept
    assert rig.job().params["cancel"] is True  # persisted: a restart would finish the cancellation
    rig.run_until(lambda: rig.job().state is S.CANCELLED)
    assert "j-r1" not in rig.driver.children
    assert rig.driver.cancel({"job": "j"}).reason == "unknown_job"


def test_a_crashing_child_is_respawned_until_the_reentry_limit(rig: Rig) -> None:
    rig.set_mode("crash")
    rig.submit()
    rig.run_until(lambda: rig.job().state is S.FAILED, timeout=60)
    job = rig.job()
    assert "reboot loop" in job.reason
    assert job.entries["training"] == MAX_REENTRIES + 1
    assert any("training child ended (exit code 1" in h[2] for h in job.history)


def test_restart_recovery(rig: Rig) -> None:
    training = Job(job_id="a-r1", round=1, model="digits@1", params={"job": "a", "deadline_at": time.time() + 99})
    cancelling = Job(job_id="b-r1", round=1, model="digits@1",
                     params={"job": "b", "deadline_at": time.time() + 99, "cancel": True})
    uploaded = Job(job_id="c-r1", round=1, model="digits@1", params={"job": "c", "deadline_at": time.time() + 99})
    for job, path in ((training, (S.PREPARING, S.TRAINING)), (cancelling, (S.PREPARING, S.TRAINING)),
                      (uploaded, (S.PREPARING, S.TRAINING, S.UPLOADING))):
        for step in path:
            transition(job, step)
        rig.store.save(job)
    driver = rig.driver = rig.new_driver()
    driver.recover()
    assert rig.job("a-r1").state is S.PAUSED and rig.job("a-r1").reason.startswith("agent restarted")
    assert rig.job("b-r1").state is S.CANCELLED
    rig.run_until(lambda: rig.job("c-r1").state is S.DONE)  # its update left the outbox before the crash
    rig.run_until(lambda: rig.job("a-r1").state is S.UPLOADING)
    assert rig.job("a-r1").entries["training"] == 2
