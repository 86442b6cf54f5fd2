"""A fine-tune that trains no step is a failure with a reason, not a success (issue 40).

Reproduced before: a tight budget on a loaded host chose the engine, trained 0 steps and
exited 0 with "stop_reason": "budget-exhausted" and an untrained head. Now the report says
"status": "failed" and why, and `edge-agent finetune` exits 75 with one stderr line; a job
that resumed from a checkpoint with steps in it trained, whatever stopped it this time.

Budgets are charged in the default "process" scope (the job's own CPU-seconds), and the
engine choice and features are computed once per module (`warm`), so a 1e-9 Wh budget is
spent by the cached choice's re-check before the first step on any machine, under any load:
no figure here depends on the machine's speed.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from edge_agent import cli
from edge_agent.errors import EXIT_OK, EXIT_TEMPFAIL
from edge_agent.train.checkpoints import CheckpointStore
from edge_agent.train.job import Progress, run_finetune
from edge_agent.train.job_report import ERROR, NO_STEPS, failure_record, job_status
from tests.unit.test_engine_cost import stop_the_selection_at_its_first_timed_phase

PROFILE = "raspberry-pi-4"
TINY_WH = 1e-9  # less than any step, or the re-check of a cached engine choice, costs


@pytest.fixture(scope="module")
def bundle(digits_bundle: Path) -> Path:
    return digits_bundle


@pytest.fixture(scope="module")
def data(camera_device_npz: Path) -> Path:
    return camera_device_npz


@pytest.fixture(scope="module")
def warm(bundle: Path, data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache directory holding the engine choice and every feature of `data`."""
    root = tmp_path_factory.mktemp("zero-steps-cache")
    run_finetune(model=bundle, data=data, state_dir=root / "warm", cache_dir=root, epochs=1, profile=PROFILE)
    return root


@pytest.fixture(autouse=True)
def _process_scope(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EDGE_AGENT_ENERGY_SCOPE", raising=False)  # the default: the job's own CPU-seconds


def _finetune(bundle: Path, data: Path, state: Path, cache: Path, *extra: str) -> int:
    return cli.main(["finetune", "--model", str(bundle), "--data", str(data), "--state-dir", str(state),
                     "--cache-dir", str(cache), "--profile", PROFILE, "-q", *extra])


def _sigterm_at_step(n: int) -> Callable[[Progress], None]:  # systemd's stop: the job checkpoints and stops
    def progress(ev: Progress) -> None:
        if ev.phase == "train" and ev.step == n:
            os.kill(os.getpid(), signal.SIGTERM)
    return progress


def test_a_job_whose_budget_cannot_pay_for_one_step_fails_with_exit_75_saying_why(
        bundle: Path, data: Path, warm: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report_file = tmp_path / "report.json"
    code = _finetune(bundle, data, tmp_path / "s", warm, "--budget-wh", repr(TINY_WH), "--report", str(report_file))
    err = capsys.readouterr().err
    assert code == EXIT_TEMPFAIL, err
    report = json.loads(report_file.read_text())
    failure = report["failure"]
    assert report["status"] == "failed" and report["steps"] == 0 and report["stop_reason"] == "budget-exhausted"
    assert failure["kind"] == NO_STEPS and failure["stop_reason"] == "budget-exhausted", failure
    assert failure["stopped_in"] == "training" and failure["energy_wh"] == report["energy"]["wh"] > 0, failure
    assert failure["message"].startswith("trained 0 steps: the energy budget ran out before the first training step")
    assert f"{report['energy']['wh']:.4g} Wh spent" in failure["message"]
    assert report["head"] is None  # nothing trained: nothing to deploy
    # one line on stderr, naming why
    assert err.count("\n") == 1 and err == f"failed: {failure['message']}; report: {report_file}\n", err
    assert json.loads((tmp_path / "s" / "job.json").read_text())["failure"] == failure["message"]
    # failed for want of budget, not unfinished: the state directory takes the next job as it is
    assert _finetune(bundle, data, tmp_path / "s", warm, "--epochs", "1", "--report", str(report_file)) == EXIT_OK
    again = json.loads(report_file.read_text())
    assert again["status"] == "trained" and again["failure"] is None and again["steps"] > 0


def test_a_resumed_job_that_trained_steps_before_is_not_a_zero_step_job(
        bundle: Path, data: Path, warm: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "s"
    stopped = run_finetune(model=bundle, data=data, state_dir=state, cache_dir=warm, profile=PROFILE, epochs=3,
                           checkpoint_every=1, progress=_sigterm_at_step(3))
    assert stopped["stop_reason"] == "cancelled" and stopped["steps"] == 3
    assert stopped["status"] == "cancelled" and stopped["failure"] is None  # a cancel is resumable, not a failure
    capsys.readouterr()
    # resumed with a budget its first run already spent: it stops before any new step ...
    report_file = tmp_path / "report.json"
    code = _finetune(bundle, data, state, warm, "--resume", "--epochs", "3", "--checkpoint-every", "1",
                     "--budget-wh", repr(TINY_WH), "--report", str(report_file))
    err = capsys.readouterr().err
    report = json.loads(report_file.read_text())
    # ... and is a job that trained 3 steps, stopped by its budget: its head is the result
    assert code == EXIT_OK, err
    assert report["resumed"] and report["steps"] == 3 and report["stop_reason"] == "budget-exhausted", report["failure"]
    assert report["status"] == "trained" and report["failure"] is None and report["head"] is not None
    assert "failed" not in err and "stop: budget-exhausted" in err


def test_a_resumed_job_the_engine_selection_stopped_keeps_its_earlier_steps(
        bundle: Path, data: Path, warm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The budget running out while the engine is chosen (a fresh cache: every engine is
    measured) is a zero-step failure for a new job; a resumed one reports the steps and the
    head of its checkpoint, and checkpoints the energy the selection spent."""
    state = tmp_path / "s"
    common = dict(model=bundle, data=data, state_dir=state, profile=PROFILE, epochs=3, checkpoint_every=1)
    stopped = run_finetune(cache_dir=warm, progress=_sigterm_at_step(3), **common)
    stop_the_selection_at_its_first_timed_phase(monkeypatch)
    resumed = run_finetune(cache_dir=tmp_path / "fresh-cache", resume=True, budget_wh=1.0, **common)
    assert resumed["stop_reason"] == "budget-exhausted" and resumed["steps"] == 3, resumed["failure"]
    assert resumed["status"] == "trained" and resumed["failure"] is None
    assert resumed["head"] is not None and Path(resumed["head"]["file"]).is_file()
    assert resumed["accuracy"]["before"] is not None and resumed["epochs_done"] == 0
    latest = CheckpointStore(state / "checkpoints").load_latest()
    assert latest is not None and latest.step == 3 and latest.meta["why"] == "stop: budget-exhausted"
    assert latest.meta["energy_wh"] == pytest.approx(resumed["energy"]["wh_job"])  # what the selection spent is kept
    assert resumed["energy"]["wh_job"] > stopped["energy"]["wh_job"]
    fresh = run_finetune(cache_dir=tmp_path / "fresh-cache-2", budget_wh=1.0,
                         **{**common, "state_dir": tmp_path / "new"})
    assert fresh["status"] == "failed" and fresh["steps"] == 0 and fresh["head"] is None
    assert fresh["failure"]["stopped_in"] == "selection" and fresh["failure"]["kind"] == NO_STEPS
    assert "while the int8 engine was being chosen" in fresh["failure"]["message"]


@pytest.mark.parametrize(("stop", "steps", "status", "kind"), [
    ("done", 12, "trained", None), ("early-stopped", 12, "trained", None),
    ("budget-exhausted", 1, "trained", None), ("battery-low", 5, "trained", None),
    ("budget-exhausted", 0, "failed", NO_STEPS), ("deadline", 0, "failed", NO_STEPS),
    ("battery-low", 0, "failed", NO_STEPS), ("error", 0, "failed", ERROR), ("error", 7, "failed", ERROR),
    ("cancelled", 0, "cancelled", None), ("cancelled", 4, "cancelled", None),
])
def test_the_status_of_every_ending(stop: str, steps: int, status: str, kind: str | None) -> None:
    failure = failure_record(stop, steps, "why", 0.001, stopped_in="training")
    assert job_status(stop, failure) == status
    assert (failure or {}).get("kind") == kind


def test_a_deadline_that_passed_while_paused_names_the_pause() -> None:
    """Window closed, board too hot: the deadline stops a job that waited; the failure says what it waited for."""
    failure = failure_record("deadline", 0, "deadline passed", 0.00042, stopped_in="training",
                             pauses={"outside-window": 1, "thermal": 2})
    assert failure is not None and failure["message"] == (
        "trained 0 steps: the deadline passed before the first training step, after pausing for outside-window, "
        "thermal; 0.00042 Wh spent")


def test_the_agents_training_child_fails_a_zero_step_job_and_sends_nothing(
        bundle: Path, data: Path, warm: Path, tmp_path: Path) -> None:
    """The daemon's child (agent/child.py) on the same job: its result says "failed" with the
    report's reason, it writes no update, and it exits EXIT_STOPPED -- the daemon then fails
    the job with that reason (test_agent_lifecycle) and the coordinator records the device as
    a dropout (test_coordinator_progress)."""
    from edge_agent.agent.child import Events, train
    from edge_agent.agent.runner import EXIT_STOPPED, RESULT_FILE, UPDATE_FILE, read_result

    job_dir = tmp_path / "job"
    job_dir.mkdir()
    spec = {"job_dir": str(job_dir), "job": "j", "round": 1, "device_id": "dev", "model_name": "digits",
            "version": "1", "model_dir": str(bundle), "data": str(data), "cache_dir": str(warm),
            "residual_file": str(tmp_path / "residual.bin"), "profile": PROFILE, "budget_wh": TINY_WH,
            "chunk_size": 65536, "epochs": 1}
    r, w = os.pipe()
    os.set_blocking(w, False)  # a full pipe drops events (Events.send), never hangs the test
    try:
        code = train(spec, Events(w))
    finally:
        os.close(w)
        with os.fdopen(r, "rb") as pipe:
            events = [json.loads(line) for line in pipe.read().splitlines()]
    result = read_result(job_dir)
    assert code == EXIT_STOPPED and result is not None, events[-3:]
    assert result["status"] == "failed" and result["steps"] == 0 and result["stop_reason"] == "budget-exhausted"
    report = json.loads((job_dir / "report.json").read_text())
    assert result["failure"] == report["failure"]["message"] and result["failure"].startswith("trained 0 steps: ")
    assert not (job_dir / UPDATE_FILE).exists() and (job_dir / RESULT_FILE).exists()
    assert not any(e["phase"] == "encoding" for e in events)


def test_a_local_fine_tune_that_trained_no_step_installs_no_personal_model(
        bundle: Path, data: Path, tmp_path: Path) -> None:
    """The inference service's local fine-tune (inference/personal.py) runs `edge-agent
    finetune` as a child: a zero-step run installed the untrained head as a personal model;
    now it is a failed run that says why."""
    import time

    from edge_agent.inference.personal import LocalFineTune

    state = tmp_path / "state"
    # the service's cache as a job before this one left it (engine choice, features): same board, same profile
    run_finetune(model=bundle, data=data, state_dir=tmp_path / "before", cache_dir=state / "cache", epochs=1)
    local = LocalFineTune(state_dir=state, personal_root=state / "personal", data_dir=data, priority="normal",
                          budget_wh=TINY_WH)
    local.start(name="digits", version="1", bundle_dir=bundle, samples=10)
    deadline = time.monotonic() + 120
    while local.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert local.poll() is None, "a personal model was installed"
    assert local.last["status"] == "failed" and local.last["exit"] == EXIT_TEMPFAIL, local.last
    assert local.last["detail"].startswith("trained 0 steps: the energy budget ran out"), local.last
    assert not (state / "personal").exists()
