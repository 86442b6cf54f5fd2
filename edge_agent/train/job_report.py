"""The fine-tune job's results: the trained parameters written crash-safely, the JSON
report and job.json -- also for a job the budget stopped while its engine was being
chosen. A mixin of job._Job."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic import atomic_write_bytes, atomic_write_json, sha256_file
from ..int8.engine_cost import process_peak_rss_mb

JOB_FILE = "job.json"
REPORT_FILE = "report.json"
HEAD_FILE = "head.params"
INLINE_PARAM_LIMIT = 50_000  # head parameters listed in the JSON report up to this many values
REPORT_SCHEMA = "edge-agent.finetune/1"


class JobReport:
    """_Job's report side (uses its state, args, budget, gov, trainer, plan, store, pos)."""

    state: Path
    args: dict[str, Any]
    budget: Any
    bundle: Any
    gov: Any
    trainer: Any
    plan: Any
    store: Any
    pos: dict[str, Any]
    cpu: dict[str, float]
    started: float
    root_sha256: str
    base_params: dict[str, np.ndarray]

    emit: Any  # _Job.emit
    def _stopped_in_selection(self, bundle: Any, dataset: Any, prof: dict[str, Any], detail: str) -> dict[str, Any]:
        """The report of a job whose budget ran out while the engine was being chosen:
        stop reason budget-exhausted, nothing trained (steps 0: no update is sent), the
        energy spent reported; a later job with a budget reuses the probes already cached."""
        from ..power import StopReason

        self.gov.finish(StopReason.BUDGET_EXHAUSTED, detail)
        gov = self.gov.report()
        report = {
            "schema": REPORT_SCHEMA,
            "model": {"name": bundle.manifest.name, "version": bundle.manifest.version, "sha256": self.root_sha256},
            "data": dataset.report.to_json(), "engine": {"name": None, "notes": [detail]}, "trainer": None,
            "depth": {**self.plan.to_json(), "tail": self.args["tail"], "bn": self.args["bn"]},
            "accuracy": {"before": None, "after": None, "validation_samples": dataset.report.validation},
            "energy": _energy_record(gov, self.budget),
            "power": gov, "profile": prof, "steps": 0, "epochs_done": 0,
            "stop_reason": StopReason.BUDGET_EXHAUSTED.value, "stop_detail": detail,
            "duration_s": round(time.monotonic() - self.started, 3),
            "duration_s_all_runs": round(time.monotonic() - self.started, 3), "resumed": bool(self.args["resume"]),
            "peak_rss_mb": round(process_peak_rss_mb(), 1), "head": None,
        }
        atomic_write_json(self.state / REPORT_FILE, report)
        atomic_write_json(self.state / JOB_FILE, {"status": "done", "stop_reason": report["stop_reason"],
                                                  "model_sha256": self.root_sha256, "data": self.args["data"],
                                                  "report": str(self.state / REPORT_FILE)})
        self.emit("done", step=0, detail=f"budget-exhausted: {detail}")
        return report

    def _write_head(self) -> tuple[Path, str]:
        # MXNet's own file layout (arg:/aux: names), written with numpy: crash-safe in one step
        from ..int8.bundle import bundle_params
        from ..mxparams import dump_params

        # every tensor of the bundle's head.params: the tail's trained, the rest as they were
        # (a deeper bundle's params serve every depth; an update's delta is zero for the rest)
        _, prefixes = bundle_params(self.bundle)
        params = {**self.base_params, **self.trainer.params()}
        aux = self.trainer.aux_names() | {n for n, p in prefixes.items() if p == "aux"}
        blob = dump_params({f"{'aux' if n in aux else 'arg'}:{n}": np.asarray(v, np.float32) for n, v in params.items()})
        target = self.state / HEAD_FILE
        atomic_write_bytes(target, blob)
        return target, sha256_file(target)

    def _finish(self, bundle: Any, dataset: Any, selection: Any, cache_stats: Any, before: tuple[float, float],
                after: tuple[float, float], stop_reason: str | None, prof: dict[str, Any]) -> dict[str, Any]:
        head_path, head_sha = self._write_head()
        params = self.trainer.params()  # the trained tail (head.params holds every tensor)
        inline = sum(v.size for v in params.values()) <= INLINE_PARAM_LIMIT

        def num(value: float) -> float | None:
            return None if value is None or not math.isfinite(value) else round(float(value), 6)

        gov = self.gov.report()
        duration = time.monotonic() - self.started
        report = {
            "schema": REPORT_SCHEMA,
            "model": {"name": bundle.manifest.name, "version": bundle.manifest.version, "sha256": self.root_sha256},
            "depth": {**self.plan.to_json(), "tail": self.args["tail"], "bn": self.args["bn"],
                      "actual_wh": gov["energy_wh_job"],
                      "actual_peak_rss_mb": round(process_peak_rss_mb(), 1),
                      "memory": getattr(self, "memory", None),
                      "cpu_s": {k: round(v, 3) for k, v in self.cpu.items()}},
            "data": dataset.report.to_json(),
            "engine": {"name": selection.chosen, "cached_decision": bool(selection.cached),
                       "threads": selection.threads, "images": selection.images,
                       "selection_wh": round(getattr(self, "selection_j", 0.0) / 3600.0, 9),
                       "agreement": _agreement_record(selection),
                       "notes": list(selection.notes)},
            "trainer": self.trainer.backend,
            "feature_cache": cache_stats.to_json() if cache_stats is not None else None,
            "accuracy": {"before": num(before[1]), "after": num(after[1]), "validation_samples": dataset.report.validation},
            "loss": {"before": num(before[0]), "after": num(after[0])},
            "energy": _energy_record(gov, self.budget),
            "power": gov,
            "profile": prof,
            "duration_s": round(duration, 3),
            "duration_s_all_runs": round(self.pos["elapsed_s"] + duration, 3),
            "peak_rss_mb": round(process_peak_rss_mb(), 1),
            "steps": int(self.pos["step"]),
            "epochs_done": int(self.pos["epoch"]),
            "stop_reason": stop_reason,
            "resumed": bool(self.args["resume"]),
            "checkpoint": str(self.store.paths()[0]) if self.store.paths() else None,
            "checkpoint_problems": list(self.store.problems),
            "config": {**self.trainer.config.to_json(), "budget": self.budget.to_config()},
            "head": {"file": str(head_path), "sha256": head_sha,
                     "params": {n: {"shape": list(v.shape), **({"values": v.reshape(-1).tolist()} if inline else {})}
                                for n, v in params.items()}},
        }
        atomic_write_json(self.state / REPORT_FILE, report)
        finished = stop_reason in ("done", "early-stopped", "budget-exhausted", "deadline")
        atomic_write_json(self.state / JOB_FILE, {"status": "done" if finished else "stopped",
                                                  "stop_reason": stop_reason, "model_sha256": self.root_sha256,
                                                  "data": self.args["data"], "report": str(self.state / REPORT_FILE)})
        self.emit("done", step=int(self.pos["step"]), detail=str(stop_reason))
        return report


def _agreement_record(selection: Any) -> dict[str, Any] | None:
    """How the chosen engine was judged correct: "task" (top-1 vs fp32) or "units" (the
    fallback), and why the task-level check was inconclusive when it was."""
    row = selection.candidate(selection.chosen) if selection.chosen else None
    if row is None:
        return None
    return {"basis": row.basis or None, "inconclusive": row.inconclusive or None,
            "decided_samples": row.agreement_decided, "too_sensitive_for_units": bool(row.too_sensitive)}


def _energy_record(gov: dict[str, Any], budget: Any) -> dict[str, Any]:
    """What the budget was charged (its basis, in its scope) and, beside it, what the power
    source measured for the whole board (every process on it)."""
    basis = budget.budget_basis
    return {"wh": gov["energy_wh_job"] if basis == "job" else gov["energy_wh_total"], "basis": basis,
            "scope": gov.get("energy_scope"), "scope_note": gov.get("energy_scope_note") or None,
            "source": gov["source"], "budget_wh": budget.budget_wh,
            "wh_total": gov["energy_wh_total"], "wh_job": gov["energy_wh_job"],
            "device_wh": gov["device_energy_wh_job"] if basis == "job" else gov["device_energy_wh_total"],
            "cpu_s": gov.get("process_cpu_s")}
