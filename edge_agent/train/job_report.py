"""The fine-tune job's results: the trained parameters written crash-safely, the JSON
report and job.json -- also for a job the budget stopped while its engine was being
chosen. A mixin of job._Job.

The report's "status" says what came of the job: "trained" (at least one step, counting
those of the checkpoint it resumed from: the head is written, "stop_reason" says whether
it finished), "cancelled" (by the user or the daemon: resumable), or "failed", with
"failure" saying why. A job that ends having trained no step is failed (issue 40): an
untrained head reported as a success let `finetune && deploy` go on and let the agent send
an empty update."""

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
NO_STEPS, ERROR = "no-steps", "error"  # failure kinds: nothing trained; the governor's error stop

# what kept a job from its first training step, by stop reason
_NO_STEP_WHY = {
    "budget-exhausted": "the energy budget ran out",
    "deadline": "the deadline passed",
    "battery-low": "the deadline passed with the battery below its floor",
}
_WHERE = {
    "selection": "while the int8 engine was being chosen",
    "features": "while the backbone's features were being computed",
    "training": "before the first training step",
}


class JobReport:
    """_Job's report side (uses its state, args, budget, gov, trainer, plan, store, pos)."""

    state: Path
    args: dict[str, Any]
    budget: Any
    bundle: Any
    gov: Any
    trainer: Any
    plan: Any
    adaptation: Any  # job_adapt.Adaptation
    label_claims: Any  # protocol.label_claims.LabelClaims | None: set by _Job._run
    store: Any
    pos: dict[str, Any]
    cpu: dict[str, float]
    started: float
    root_sha256: str
    base_params: dict[str, np.ndarray]

    emit: Any  # _Job.emit
    checkpoint: Any  # _Job.checkpoint

    def _stopped_in_selection(self, bundle: Any, dataset: Any, prof: dict[str, Any], detail: str, *,
                              store: Any, resumed: tuple[Any, Any] | None = None) -> dict[str, Any]:
        """The report of a job whose budget ran out while the engine was being chosen:
        stop reason budget-exhausted, the energy spent reported; a later job with a budget
        reuses the probes already cached. A fresh job trained nothing: it failed (no head, no
        update). `resumed` (trainer, checkpoint): a resumed job that trained steps before keeps
        them -- its head is written and reported, and a checkpoint keeps the energy spent."""
        from ..power import StopReason

        self.gov.finish(StopReason.BUDGET_EXHAUSTED, detail)
        steps, epochs, elapsed, head, before, trainer = 0, 0, 0.0, None, None, None
        if resumed is not None:
            trainer, ckpt = resumed
            position = ckpt.meta["position"]
            self.trainer, self.store = trainer, store
            self.pos = {k: position[k] for k in ("epoch", "batch", "step", "elapsed_s")}
            self.before = tuple(ckpt.meta["before"]) if ckpt.meta.get("before") is not None else (math.nan, math.nan)
            self.checkpoint("stop: budget-exhausted")
            steps, epochs, elapsed = int(self.pos["step"]), int(self.pos["epoch"]), float(position["elapsed_s"])
            head, before = self._head_record(), _rounded(self.before[1])
        gov = self.gov.report()
        energy = _energy_record(gov, self.budget)
        stop = StopReason.BUDGET_EXHAUSTED.value
        failure = failure_record(stop, steps, detail, energy["wh"], stopped_in="selection",
                                 pauses=gov.get("pauses_by_reason"))
        duration = time.monotonic() - self.started
        report = {
            "schema": REPORT_SCHEMA, "status": job_status(stop, failure), "failure": failure,
            "model": {"name": bundle.manifest.name, "version": bundle.manifest.version, "sha256": self.root_sha256},
            "data": dataset.report.to_json(), "engine": {"name": None, "notes": [detail]},
            "trainer": trainer.backend if trainer is not None else None,
            "depth": {**self.plan.to_json(), "tail": self.args["tail"], "bn": self.args["bn"],
                      "distill": self.args["distill"]},
            "adaptation": self.adaptation.to_json(),
            "accuracy": {"before": before, "after": None, "validation_samples": dataset.report.validation},
            "energy": energy,
            "power": gov, "profile": prof, "steps": steps, "epochs_done": epochs,
            "stop_reason": stop, "stop_detail": detail,
            "duration_s": round(duration, 3),
            "duration_s_all_runs": round(elapsed + duration, 3), "resumed": bool(self.args["resume"]),
            "peak_rss_mb": round(process_peak_rss_mb(), 1), "head": head,
        }
        atomic_write_json(self.state / REPORT_FILE, report)
        atomic_write_json(self.state / JOB_FILE, _job_record(self, report))
        self.emit("done", step=steps, detail=f"budget-exhausted: {detail}")
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

    def _head_record(self) -> dict[str, Any]:
        """head.params written, and the report's "head": its file, hash and the trained tail."""
        head_path, head_sha = self._write_head()
        params = self.trainer.params()  # the trained tail (head.params holds every tensor)
        inline = sum(v.size for v in params.values()) <= INLINE_PARAM_LIMIT
        return {"file": str(head_path), "sha256": head_sha,
                "params": {n: {"shape": list(v.shape), **({"values": v.reshape(-1).tolist()} if inline else {})}
                           for n, v in params.items()}}

    def _finish(self, bundle: Any, dataset: Any, selection: Any, cache_stats: Any, before: tuple[float, float],
                after: tuple[float, float], stop_reason: str | None, prof: dict[str, Any], *,
                stopped_in: str = "training") -> dict[str, Any]:
        gov = self.gov.report()
        energy = _energy_record(gov, self.budget)
        failure = failure_record(stop_reason, int(self.pos["step"]), str(gov.get("stop_detail") or ""), energy["wh"],
                                 stopped_in=stopped_in, pauses=gov.get("pauses_by_reason"))
        # nothing trained, nothing to deploy: no head (as when the selection took the budget)
        head = None if failure is not None and failure["kind"] == NO_STEPS else self._head_record()
        duration = time.monotonic() - self.started
        report = {
            "schema": REPORT_SCHEMA,
            "status": job_status(stop_reason, failure),
            "failure": failure,
            "model": {"name": bundle.manifest.name, "version": bundle.manifest.version, "sha256": self.root_sha256},
            "depth": {**self.plan.to_json(), "tail": self.args["tail"], "bn": self.args["bn"],
                      "distill": self.args["distill"],
                      "actual_wh": gov["energy_wh_job"],
                      "actual_peak_rss_mb": round(process_peak_rss_mb(), 1),
                      "memory": getattr(self, "memory", None),
                      "cpu_s": {k: round(v, 3) for k, v in self.cpu.items()}},
            "adaptation": self.adaptation.to_json(),
            "data": dataset.report.to_json(),
            # per class over the training split: samples, and the base's mean probability on them
            "label_claims": None if self.label_claims is None else self.label_claims.to_json(),
            "engine": {"name": selection.chosen, "cached_decision": bool(selection.cached), "source": selection.source,
                       "threads": selection.threads, "images": selection.images,
                       "selection_wh": round(getattr(self, "selection_j", 0.0) / 3600.0, 9),
                       "agreement": _agreement_record(selection),
                       "notes": list(selection.notes)},
            "trainer": self.trainer.backend,
            "feature_cache": cache_stats.to_json() if cache_stats is not None else None,
            "accuracy": {"before": _rounded(before[1]), "after": _rounded(after[1]), "validation_samples": dataset.report.validation},
            "loss": {"before": _rounded(before[0]), "after": _rounded(after[0])},
            "energy": energy,
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
            "head": head,
        }
        atomic_write_json(self.state / REPORT_FILE, report)
        atomic_write_json(self.state / JOB_FILE, _job_record(self, report))
        self.emit("done", step=int(self.pos["step"]), detail=str(stop_reason))
        return report


def job_status(stop_reason: str | None, failure: dict[str, Any] | None) -> str:
    """The report's "status" (module doc): "failed", "cancelled" or "trained"."""
    if failure is not None:
        return "failed"
    return "cancelled" if stop_reason == "cancelled" else "trained"


def failure_record(stop_reason: str | None, steps: int, detail: str, energy_wh: float, *, stopped_in: str,
                   pauses: dict[str, int] | None = None) -> dict[str, Any] | None:
    """Why a job failed, None if it did not: it trained a step or more (counting a resumed
    checkpoint's) and was not halted by the governor's error, or it was cancelled -- a
    user's or the daemon's stop, which keeps its checkpoint to resume, is no failure.
    `stopped_in`: "selection", "features" or "training" (where the stop came); `pauses`:
    the governor's pauses_by_reason (a deadline that passed while it waited names them)."""
    if stop_reason == "cancelled" or (steps > 0 and stop_reason != "error"):
        return None
    wh = f"{energy_wh:.4g} Wh spent"
    if stop_reason == "error":
        kind, message = ERROR, f"the governor stopped the job after {steps} step(s) ({detail}); {wh}"
    else:
        why = _NO_STEP_WHY.get(str(stop_reason), f"it stopped ({stop_reason})")
        waited = sorted(set(pauses or ()) - {stop_reason})  # (battery-low says its own pause)
        paused = f", after pausing for {', '.join(waited)}" if waited else ""
        said = f" ({detail})" if detail and detail.lower() not in why else ""  # ("deadline passed" says nothing new)
        kind = NO_STEPS
        message = f"trained 0 steps: {why} {_WHERE.get(stopped_in, _WHERE['training'])}{paused}{said}; {wh}"
    return {"kind": kind, "stop_reason": stop_reason, "stopped_in": stopped_in, "steps": steps,
            "energy_wh": energy_wh, "message": message}


def _job_record(job: JobReport, report: dict[str, Any]) -> dict[str, Any]:
    """job.json once the job ended. Its "status" says whether the state directory holds an
    unfinished job (anything but "done" wants --resume or another directory): a job that
    trained nothing for want of budget or time is failed, but done -- the next run starts
    afresh with what it was given."""
    stop = report["stop_reason"]
    finished = stop in ("done", "early-stopped", "budget-exhausted", "deadline")
    record = {"status": "done" if finished else "stopped", "stop_reason": stop, "model_sha256": job.root_sha256,
              "data": job.args["data"], "report": str(job.state / REPORT_FILE)}
    if report["failure"] is not None:
        record["failure"] = report["failure"]["message"]
    return record


def _rounded(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else round(float(value), 6)


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
