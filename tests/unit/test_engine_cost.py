"""Engine choice by a job's cost and task-level accuracy (issue 16): the agreement verdict,
the choice by job size and memory cap, the re-check of a cached choice under contention,
and selection inside the job's energy budget (virtual clock and simulated board of
test_finetune_governor: each metered phase of the selection costs one STEP_J there)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from edge_agent.errors import EXIT_USAGE
from edge_agent.int8 import agreement
from edge_agent.int8 import engine_cost as ec
from edge_agent.int8 import selection as sel
from edge_agent.int8.bundle import load_bundle
from edge_agent.int8.engine import Availability, Int8Engine, Runner
from edge_agent.int8.engines.reference import QGraphRunner
from edge_agent.sim import scenario as demo
from edge_agent.train.job import run_finetune
from tests.unit.test_finetune_governor import STEP_J, Board, BoardClock

PROBE = {"cpu": {"arch": "x86_64", "count": 2, "int8_features": {"avx2": True}}, "accelerators": [],
         "board": {"model": "test board"}}


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo.ensure_bundle(tmp_path_factory.getbasetemp() / "digits-bundle")  # test_finetune_governor's


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dev = demo.scenario().devices[2]
    return demo.write_data(tmp_path_factory.mktemp("cost-data"), dev.images, dev.labels, "npz")


def test_agreement_verdict_is_relative_to_the_reference() -> None:
    # the bench bundle: tflite 95.0 %, mxnet-onednn 94.5 %, reference 95.1 % on 2,694 images
    assert ec.agreement_verdict(0.950, 0.951, 2694)[0] and not ec.agreement_verdict(0.945, 0.951, 2694)[0]
    # with few samples one sample is the slack; two fewer is refused
    assert ec.agreement_verdict(63 / 64, 1.0, 64)[0] and not ec.agreement_verdict(62 / 64, 1.0, 64)[0]
    assert ec.agreement_verdict(1.0, 0.9, 64)[0]  # better than the reference is fine


def _row(name: str, prepare_j: float, per_image_j: float, peak_mb: float = 10.0, correct: bool = True) -> SimpleNamespace:
    return SimpleNamespace(name=name, correct=correct, prepare_j=prepare_j, per_image_j=per_image_j,
                           prepare_s=prepare_j, per_image_s=per_image_j, peak_mb=peak_mb)


def test_the_choice_minimises_the_predicted_job_energy() -> None:
    # mxnet-onednn-like: costly to prepare, cheap per image; tflite-like the other way round
    rows = [_row("light", 1.0, 0.010), _row("heavy", 60.0, 0.004, peak_mb=420.0), _row("wrong", 0.0, 0.0, correct=False)]
    assert ec.choose(rows, 100).name == "light" and ec.choose(rows, 1000).name == "light"
    assert ec.choose(rows, 100_000).name == "heavy"  # breaks even at 9,833 images
    assert ec.choose(rows, 100_000, mem_cap_mb=256).name == "light"  # over the profile's memory cap
    assert ec.predict_job(rows[1], 10_000) == pytest.approx((100.0, 100.0))
    assert ec.choose([rows[2]], 10) is None


class Burner(QGraphRunner):
    """The reference's output after burning `cost / threads` CPU-seconds and waiting WAIT_S
    per batch (so that its wall time hardly depends on the machine's load); `contended`:
    the wait grows 10x on more than one thread ("threads": well past RECHECK_FACTOR even when
    the first measurement's burn was slowed by a loaded machine), or 5x on two and 10x on
    one thread ("always": the whole machine is busy)."""

    WAIT_S = 0.06

    def __init__(self, graph, engine: CostlyEngine, threads: int) -> None:
        super().__init__(graph)
        self.engine, self.threads = engine, threads

    def _invoke(self, x):
        end = time.process_time() + self.engine.cost / self.threads
        while time.process_time() < end:
            pass
        wait = self.WAIT_S
        if self.engine.contended == "threads" and self.threads > 1:
            wait *= 10
        elif self.engine.contended == "always":
            wait *= 5 if self.threads > 1 else 10
        time.sleep(wait)
        return super()._invoke(x)


class CostlyEngine(Int8Engine):
    def __init__(self, cost: float) -> None:
        self.name, self.cost, self.contended, self.prepared = "costly", cost, "", []

    def availability(self, probe=None) -> Availability:
        return Availability(True, "fake")

    def prepare(self, model, *, threads=None) -> Runner:
        self.prepared.append(threads)
        return Burner(model.qgraph(), self, threads or 1)


def test_a_cached_choice_is_rechecked_and_falls_back_under_contention(bundle_dir: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sel, "thread_count", lambda _t: 2)  # two threads whatever this machine has
    monkeypatch.setattr(sel, "AGREEMENT_MAX_SAMPLES", 32)  # the verdict is not under test here
    monkeypatch.setattr(agreement, "AGREEMENT_MAX_SAMPLES", 32)  # (the Oracle's samples; sel's prices them)
    bundle = load_bundle(bundle_dir)
    engine = CostlyEngine(0.04)
    kw = dict(engines=[("costly", engine)], state_dir=tmp_path, repeats=2, batch_size=2, probe=PROBE, env={})
    first, _ = sel.select_engine(bundle, **kw)
    assert first.threads == 2 and engine.prepared == [2, 1]  # both thread counts measured
    assert set(first.candidate("costly").by_threads) == {"1", "2"}
    again, runner = sel.select_engine(bundle, keep_runner=True, recheck_cached=True, **kw)
    assert again.cached and again.threads == 2 and runner.threads == 2 and not again.notes
    engine.contended = "threads"  # another process on the second core: the pool spins
    engine.prepared.clear()
    fallback, runner = sel.select_engine(bundle, keep_runner=True, recheck_cached=True, **kw)
    assert fallback.cached and fallback.threads == 1 and runner.threads == 1 and engine.prepared == [2, 1]
    assert "(contention?): using 1 thread" in fallback.notes[0]
    engine.contended = "always"  # slower on any thread count: a busy machine slows every engine alike
    engine.prepared.clear()
    busy, _ = sel.select_engine(bundle, recheck_cached=True, **kw)
    assert busy.cached and busy.chosen == "costly" and engine.prepared == [2, 1] and "busy machine" in busy.notes[-1]


def _job(bundle_dir: Path, data: Path, tmp_path: Path, clock: BoardClock, budget_wh: float) -> dict:
    return run_finetune(model=bundle_dir, data=data, state_dir=tmp_path / "state", cache_dir=tmp_path / "cache",
                        power_root=tmp_path / "root", profile="raspberry-pi-4", batch_size=8, poll_s=0.25,
                        clock=clock, budget_wh=budget_wh, epochs=500, patience=1000, engine="tflite")


def test_a_budget_smaller_than_selection_stops_before_starting(bundle_dir: Path, data: Path, tmp_path: Path) -> None:
    clock = BoardClock(Board(tmp_path / "root"))
    budget_wh = 40 * STEP_J / 3600.0
    with pytest.raises(ec.BudgetTooSmallError, match="too small for this job.*kernels --model") as err:
        _job(bundle_dir, data, tmp_path, clock, budget_wh)
    assert err.value.exit_code == EXIT_USAGE
    assert clock.work_steps == 2  # only the probe (a warm-up image, then 4 priced) was spent: 5 % of the budget
    assert clock.work_steps * STEP_J <= 0.05 * budget_wh * 3600.0 + 1e-12


def test_a_first_job_pays_for_selection_within_its_budget(bundle_dir: Path, data: Path, tmp_path: Path) -> None:
    clock = BoardClock(Board(tmp_path / "root"))
    budget_wh = 1000 * STEP_J / 3600.0  # the probe-based prediction is conservative (~600 steps here)
    report = _job(bundle_dir, data, tmp_path, clock, budget_wh)
    assert report["stop_reason"] == "budget-exhausted" and not report["engine"]["cached_decision"]
    assert report["engine"]["name"] == "tflite" and report["engine"]["selection_wh"] >= 4 * STEP_J / 3600.0
    used = report["energy"]["wh"]
    assert used == pytest.approx(clock.work_steps * STEP_J / 3600.0)  # selection, features and steps
    assert used <= budget_wh * 1.05 and used >= budget_wh * 0.95, (used, budget_wh)
    assert report["steps"] < clock.work_steps - 4  # selection phases and feature batches came first
    assert np.isfinite(report["accuracy"]["after"])


def test_a_budget_that_runs_out_during_selection_ends_the_job_cleanly(bundle_dir: Path, data: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The governor's meter stops the selection at its first timed phase (as when the probe
    under-predicted): the job ends budget-exhausted with a report, not a traceback, and
    nothing trained; the state directory takes the next job."""
    import json

    from edge_agent.train import job as job_module

    real = job_module._GovernorMeter.before  # noqa: SLF001 - the project's own meter interface

    def before(self: object, phase: str, predicted_j: float) -> None:
        real(self, phase, predicted_j)
        if phase != "selection":
            raise ec.SelectionStopped(f"the energy budget ran out while choosing the int8 engine ({phase})")

    monkeypatch.setattr(job_module._GovernorMeter, "before", before)  # noqa: SLF001
    clock = BoardClock(Board(tmp_path / "root"))
    report = _job(bundle_dir, data, tmp_path, clock, 1000 * STEP_J / 3600.0)
    assert report["stop_reason"] == "budget-exhausted" and report["steps"] == 0 and report["head"] is None
    assert "while choosing the int8 engine" in report["stop_detail"]
    assert report["energy"]["wh"] == pytest.approx(clock.work_steps * STEP_J / 3600.0)  # the probe was charged
    saved = json.loads((tmp_path / "state" / "report.json").read_text())
    assert saved["stop_reason"] == "budget-exhausted"
    assert json.loads((tmp_path / "state" / "job.json").read_text())["status"] == "done"
    monkeypatch.undo()
    again = _job(bundle_dir, data, tmp_path, clock, 1000 * STEP_J / 3600.0)
    assert again["steps"] > 0  # the next job in the same state directory runs


def test_mxnet_onednn_availability_does_not_import_mxnet() -> None:
    """Availability runs for every engine before selection can price or meter anything:
    importing MXNet there (~2 CPU-s, ~200 MB) overran small budgets 24-fold."""
    code = ("import sys\n"
            "from edge_agent.int8.engines.mxnet_onednn import MxnetOnednnEngine\n"
            "a = MxnetOnednnEngine().availability()\n"
            "print(a.available, 'mxnet' in sys.modules, a.reason)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    available, imported, reason = done.stdout.split(" ", 2)
    assert (available, imported) == ("True", "False") and "checked when prepared" in reason


def test_a_budget_smaller_than_the_probe_stops_before_anything_is_spent(bundle_dir: Path, data: Path,
                                                                        tmp_path: Path) -> None:
    """Before the probe nothing is measured: its cost is predicted (PROBE_PREDICT_CPU_S at the
    profile's watts per CPU), and a budget below that exits 64 with no phase run."""
    clock = BoardClock(Board(tmp_path / "root"))
    with pytest.raises(ec.BudgetTooSmallError, match="too small for this job") as err:
        _job(bundle_dir, data, tmp_path, clock, 1 * STEP_J / 3600.0)
    assert err.value.exit_code == EXIT_USAGE and clock.work_steps == 0
