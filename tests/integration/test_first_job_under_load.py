"""A first `edge-agent finetune` under background load (issue 37, "Done when"): the real CLI
in a subprocess pinned with `taskset -c` to one CPU, beside two CPU hogs pinned to the same
CPU, with a fresh state directory, feature cache and engine-choice cache, so that the job
chooses its int8 engine (measuring every engine) and pays for that out of its budget.

The budget is charged in the default energy scope, "process": the job's own CPU-seconds x
the board profile's watts per busy core. The power root is an empty board -- no power
sensor, no battery, no thermal zone -- whose `cpu/present` says four cores (both profiles
used here are four-core boards), so watts per core are (load_w - idle_w) / 4 on any
machine. The hogs triple the job's wall time (it gets a third of the CPU); its CPU-seconds
do not grow with them, so the budget stops it at the same place on an idle or a loaded
machine.

1. A budget that runs out during training (selection costs ~0.3 of its 3.6 CPU-seconds on
   a 2-core AMD EPYC CI machine): the job ends budget-exhausted within 5 % of it, selection included.
2. A budget that covers the job's predicted cost is not refused: a first job with a tiny
   budget is refused (exit 64) with the cost it predicts ("needs ~X Wh (predicted ...), and
   Y Wh is spent already; give --budget-wh Z or more"); a fresh first job given Z runs. The refusals
   are followed as a user would: the first, before anything is measured, quotes only the
   cost of pricing the selection (selection.PROBE_PREDICT_CPU_S, and says so); a budget
   covering that may be refused again, once the probe is measured, with the selection's
   predicted cost plus one batch.

The first test uses raspberry-pi-zero-2w's engines (tflite, native, reference), the second
the Pi 4's (mxnet-onednn too: an engine that expensive to prepare is left out of the
selection's up-front prediction, and is not prepared for a job this small).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from edge_agent.errors import EXIT_USAGE
from tests.integration.conftest import device_data

PROFILES = {  # (load_w - idle_w) / 4 cores, from firmware_configs
    "raspberry-pi-zero-2w": (3.0 - 0.6) / 4,
    "raspberry-pi-4": (6.4 - 2.7) / 4,
}
HOGS = 2
TOLERANCE = 0.05  # the issue's: energy used within 5 % of the budget, either side
# 3.6 CPU-seconds at the Pi Zero 2 W's 0.6 W per core: the selection's gate (0.00044-0.00046
# Wh, ~2.8 CPU-s, predicted and spent, under the hogs) passes with room, and the selection
# itself (~0.3 CPU-s) leaves ~3.3 CPU-s of training (7,000-10,000 steps, 10-15 s of wall time
# under the hogs)
BUDGET_WH = 0.0006
# Item 2: the budget a refusal names (Z) is what a user types next; it is predicted + spent
# with headroom (job_support.REFUSAL_HEADROOM), because the next job measures its probe again:
# "spent already" repeats within a few per cent, and the selection's prediction moves with the
# probe's per-sample CPU time (+-0.8 % over six runs on one machine, but 1.559e-4 then 1.679e-4
# Wh, +7.7 %, in a CI run that followed "predicted + spent + 5 %" and was refused a third time).
MAX_REFUSALS = 2  # the probe's gate, then the selection's
REFUSED = re.compile(r"--budget-wh \S+ is too small for this job: .* needs ~(?P<need>[0-9.eE+-]+) Wh \(predicted[^)]*\), "
                     r"and (?P<spent>[0-9.eE+-]+) Wh is spent already; give --budget-wh (?P<enough>[0-9.eE+-]+) or more")


def _cpu() -> str:
    """The CPU the job and the hogs share: the first this test may run on (0 unless the
    whole run is pinned elsewhere)."""
    return str(min(os.sched_getaffinity(0)))


def _taskset() -> str:
    found = shutil.which("taskset")  # util-linux: Essential on Debian, so never skipped
    assert found is not None, "taskset (util-linux) is needed to pin the job and the CPU hogs to one CPU"
    return found


@contextlib.contextmanager
def _cpu_hogs(taskset: str, n: int = HOGS) -> Iterator[list[subprocess.Popen]]:
    hogs: list[subprocess.Popen] = []
    try:
        for _ in range(n):
            hogs.append(subprocess.Popen([taskset, "-c", _cpu(), sys.executable, "-c", "while True: pass"],
                                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL))
        yield hogs
    finally:
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.wait(30)


@pytest.fixture
def loaded_cpu() -> Iterator[str]:
    """taskset's path, with HOGS processes spinning on the CPU the job will be pinned to."""
    taskset = _taskset()
    with _cpu_hogs(taskset) as hogs:
        assert all(h.poll() is None for h in hogs)
        yield taskset
        assert all(h.poll() is None for h in hogs), "a CPU hog ended before the job did"


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return device_data(tmp_path_factory.mktemp("first-job-data"))


@pytest.fixture
def board(tmp_path: Path) -> Path:
    """A power root with no power sensor, battery or thermal zone, and four cores."""
    root = tmp_path / "board"
    (root / "sys/devices/system/cpu").mkdir(parents=True)
    (root / "sys/devices/system/cpu/present").write_text("0-3\n")
    return root


def _edge_agent() -> list[str]:
    script = Path(sys.executable).with_name("edge-agent")  # the console script of this venv
    return [str(script)] if script.is_file() else [sys.executable, "-m", "edge_agent.cli"]


def _finetune(taskset: str, bundle: Path, data: Path, board: Path, work: Path, profile: str, budget_wh: float,
              *extra: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    """A first job: fresh state, feature cache and engine-choice directories under `work`.
    Returns the finished process and its report (None when it wrote none)."""
    work.mkdir(parents=True)
    report = work / "report.json"
    env = {k: v for k, v in os.environ.items()
           if k not in ("EDGE_AGENT_ENERGY_SCOPE", "EDGE_AGENT_INT8_BACKEND", "EDGE_AGENT_INT8_FORCE")}
    env["EDGE_AGENT_STATE_DIR"] = str(work / "machine-state")  # nothing cached elsewhere is read
    argv = [taskset, "-c", _cpu(), *_edge_agent(), "finetune", "--model", str(bundle), "--data", str(data),
            "--state-dir", str(work / "state"), "--cache-dir", str(work / "cache"), "--power-root", str(board),
            "--profile", profile, "--budget-wh", repr(budget_wh), "--report", str(report), "-q", *extra]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    return done, (json.loads(report.read_text()) if report.exists() else None)


def test_a_first_job_under_load_ends_within_5_percent_of_its_budget_selection_included(
        loaded_cpu: str, digits_bundle: tuple[Path, bytes], data: Path, board: Path, tmp_path: Path) -> None:
    profile = "raspberry-pi-zero-2w"
    wpc = PROFILES[profile]
    done, report = _finetune(loaded_cpu, digits_bundle[0], data, board, tmp_path / "job", profile, BUDGET_WH,
                             "--epochs", "100000", "--patience", "100000")  # only the budget stops it
    assert done.returncode == 0 and report is not None, (done.returncode, done.stderr[-3000:])
    energy, engine, power, cpu = report["energy"], report["engine"], report["power"], report["depth"]["cpu_s"]
    summary = {"energy": energy, "engine": engine, "steps": report["steps"], "cpu_s": cpu,
               "elapsed_s": power["elapsed_s"], "stop": report["stop_reason"], "detail": power["stop_detail"]}
    # charged the job's CPU-seconds at the profile's watts per core: no sensor, nothing else
    assert (energy["scope"], energy["basis"], energy["source"]) == ("process", "job", None), summary
    assert energy["wh"] == pytest.approx(energy["cpu_s"] * wpc / 3600.0, rel=1e-6), summary
    # it ran under load: with the hogs it has a third of its CPU, so its wall time grew (its CPU time did not)
    assert energy["cpu_s"] < 0.6 * power["elapsed_s"], summary
    # a first job: the engine was chosen by measuring the engines, and paid for from the budget ...
    assert not engine["cached_decision"] and engine["name"], summary
    assert engine["selection_wh"] == pytest.approx(cpu["selection_s"] * wpc / 3600.0, rel=0.02, abs=0.005 * wpc / 3600), summary
    # ... and the budget ran out in training, after every feature was computed and steps were taken
    assert report["stop_reason"] == "budget-exhausted", summary
    assert cpu["feature_images"] == report["data"]["loaded"] > 0 and report["steps"] >= 100, summary
    assert 0 < engine["selection_wh"] < 0.5 * BUDGET_WH, summary
    # all of it charged (train_s ends after the stop's checkpoint, which comes after the last charge)
    assert energy["cpu_s"] >= cpu["selection_s"] + cpu["features_s"] + cpu["train_s"] - 0.02, summary
    used = energy["wh"]
    assert energy["budget_wh"] == BUDGET_WH
    assert BUDGET_WH * (1 - TOLERANCE) <= used <= BUDGET_WH * (1 + TOLERANCE), summary


def test_a_budget_that_covers_the_first_jobs_predicted_cost_is_not_refused(
        loaded_cpu: str, digits_bundle: tuple[Path, bytes], data: Path, board: Path, tmp_path: Path) -> None:
    profile = "raspberry-pi-4"
    budget = 1e-7  # far below anything: refused before anything is measured
    refusals: list[tuple[float, float, float]] = []  # (budget, predicted, spent already)
    for attempt in range(MAX_REFUSALS + 1):
        done, report = _finetune(loaded_cpu, digits_bundle[0], data, board, tmp_path / f"job{attempt}", profile,
                                 budget, "--epochs", "2")
        if done.returncode != EXIT_USAGE:
            break
        found = REFUSED.search(done.stderr)
        assert found is not None and report is None and "Traceback" not in done.stderr, done.stderr[-3000:]
        need, spent, enough = float(found["need"]), float(found["spent"]), float(found["enough"])
        assert need + spent > budget, (budget, done.stderr)  # the refusal was owed ...
        assert enough >= (need + spent) * 1.2, (need, spent, enough)  # ... and names a budget with headroom
        # a budget that covered the last prediction is refused only at a later gate, which predicts more
        assert not refusals or need > refusals[-1][1], (refusals, budget, need, spent)
        refusals.append((budget, need, spent))
        budget = enough
    else:
        pytest.fail(f"a budget covering the predicted cost was refused: {refusals}")
    assert refusals, "the tiny budget was not refused"
    # the budget covering the last refusal's predicted cost: taken, and the job trained
    assert done.returncode == 0 and report is not None, (refusals, done.returncode, done.stderr[-3000:])
    summary = {"refusals": refusals, "energy": report["energy"], "engine": report["engine"],
               "steps": report["steps"], "stop": report["stop_reason"]}
    assert report["energy"]["budget_wh"] == pytest.approx(budget) and report["energy"]["scope"] == "process", summary
    assert not report["engine"]["cached_decision"] and report["engine"]["name"], summary
    assert report["steps"] >= 1 and report["stop_reason"] in ("done", "early-stopped", "budget-exhausted"), summary
    assert report["energy"]["wh"] <= budget * (1 + TOLERANCE), summary
