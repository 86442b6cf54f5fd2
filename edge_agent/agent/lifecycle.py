"""The job driver: takes each job through jobs.TRANSITIONS, one persisted step at a time.

    accepted -> waiting-for-power -> preparing -> training <-> paused -> uploading -> done
                                                                    \\-> failed / cancelled

* accepted / waiting-for-power: start when the battery (or charging) and temperature allow,
  with hysteresis (wait below the floor, resume at the resume level); fail at the deadline.
  With [solar] (solar.py), a job is accepted into its planned surplus window (params
  `not_before`, `plan`) and waits for it before the battery check; a job with no window
  before its deadline is refused (no_solar_window).
* preparing: fetch and activate the model version if it is not installed (models.py).
* training / paused: a `train` child (runner.py) runs the fine-tune, resumable from its
  checkpoints; its governor's pauses show as `paused`. A child that dies is respawned with
  backoff, each respawn a re-entry of `training` — the re-entry limit in jobs.py ends a
  brown-out loop. After a daemon restart a training job is `paused` until its child is back.
* finishing: the child leaves result.json + update.chunks + residual.pending; the driver
  queues the chunks in the outbox (durable, idempotent per (job, device, round)), then
  adopts the residual with one rename, then records `uploading`. A crash between any two
  steps repeats only idempotent work. A child that trained no step (the budget, deadline or
  battery stopped it first) leaves a "failed" result and no update: the job fails with its
  reason, which the coordinator records as this device's dropout (issue 40).
* uploading: the Uploader sends the chunks until the coordinator's ack; then `done`.

Governor pause/resume cycles are not restarts: resuming does not count as a re-entry.

Fleet-shared engine choices (issue 37): a command's `engine_choices` go with the job to the
training child, which starts engine selection from the one of its kind; the child's result
lists the choices this device measured in full (int8.shared_choice.shared_choices), kept
here for the state message. They are reported only once a command carried the field: that
coordinator reads them (an older one's strict schema would refuse the whole state).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..atomic import fsync_dir, read_checked
from ..errors import InputError, TransientError
from ..heap import release_freed_memory
from ..power.forecast import TrainingWindow
from ..protocol.engine_choice import parse_choices
from ..protocol.finetune import FLEET_DISTILL_DEFAULT, TRAIN_KEYS, BadParams, parse_finetune
from ..transport.outbox import Outbox, OutboxKey
from .jobs import Job, JobState, JobStore
from .models import ModelStore
from .policy import (
    DAY_S,
    Allowance,
    Conditions,
    DeviceLimits,
    Verdict,
    check_finetune,
    counted_jobs,
    daily_allowance,
    effective_budget,
    unmetered,
)
from .runner import (
    EXIT_BUSY,
    EXIT_STOPPED,
    EXIT_TRAINED,
    FAIL_CODES,
    MAX_UPDATE_FILE,
    RESIDUAL_FILE,
    RESULT_FILE,
    SECAGG_DELTA,
    ChildProcess,
    describe_exit,
    read_result,
    read_update,
)
from .secure import SecureJobs
from .solar import SolarPlanner
from .state import Readings

log = logging.getLogger(__name__)
S = JobState
TRANSIENT_RETRY_S = 10.0
Publish = Callable[..., None]  # publish(phase, *, job, round, cmd_id, pct, detail, metrics)


@dataclass(frozen=True, kw_only=True)
class DriverSettings:
    device_id: str
    state_dir: Path
    limits: DeviceLimits
    sysfs_root: str = "/"
    profile: str | None = None
    battery_floor_pct: float | None = None
    battery_resume_pct: float | None = None
    thermal_limit_c: float | None = None
    thermal_margin_c: float = 8.0
    cache_mb: int = 256
    label_map: str | None = None  # agent.toml [data] label_map (a --label-map spec)
    skip_unknown: bool = False  # agent.toml [data] skip_unknown
    chunk_size: int = 64 * 1024
    poll_s: float = 30.0
    respawn_base_s: float = 2.0
    progress_interval_s: float = 30.0  # training progress on a cellular link: not every step
    python: tuple[str, ...] | None = None  # the child's interpreter line (tests); default: this one
    # with the local inference service running: the training child yields to requests
    # (inference/personal.lower_priority: "idle" = SCHED_IDLE) and its governor leaves the
    # service's energy (this file) out of the job's
    child_priority: str = "normal"
    inference_energy: str | None = None


class JobDriver:
    def __init__(self, *, settings: DriverSettings, store: JobStore, models: ModelStore, outbox: Outbox,
                 readings: Callable[..., Readings], publish: Publish, clock: Callable[[], float] = time.time,
                 planner: SolarPlanner | None = None) -> None:
        self.s, self.store, self.models, self.outbox = settings, store, models, outbox
        self.planner = planner  # [solar]: jobs go into surplus windows (solar.py)
        self._readings, self._publish, self._clock = readings, publish, clock
        self.jobs_dir = settings.state_dir / "checkpoints"
        self.residuals = settings.state_dir / "residuals"
        self.children: dict[str, ChildProcess] = {}
        self._next_spawn: dict[str, float] = {}
        self._last_progress: dict[str, tuple[str, float]] = {}
        self._fetching: set[str] = set()  # jobs whose model fetch this process started or joined
        self._jobs: dict[str, Job] | None = None
        self._retry_at: dict[str, float] = {}
        self.stopping = False
        self.engine: str | None = None
        self.measured: list[dict[str, Any]] = []  # the engine choices this device measured (JSON form)
        self.coordinator_reads_choices = False  # a command carried `engine_choices`
        self.changed = True  # something worth a state message happened
        self._counted: dict[str, float] | None = None  # jobs counted against the daily limit (policy)
        self.secure: SecureJobs | None = None  # secure jobs' rounds (secure.py), set by the daemon

    # ---- queries ----
    def active(self) -> list[Job]:
        """Unfinished jobs, oldest first: kept in memory (asked every loop iteration); the
        store on disk is written before every change."""
        if self._jobs is None:
            self._jobs = {job.job_id: job for job in self.store.active()}
        return sorted(self._jobs.values(), key=lambda j: j.created)

    def _track(self, job: Job) -> None:
        self.active()
        assert self._jobs is not None
        if job.state.terminal:
            self._jobs.pop(job.job_id, None)
        else:
            self._jobs[job.job_id] = job

    def job_dir(self, job: Job) -> Path:
        return self.jobs_dir / job.job_id

    def key(self, job: Job) -> OutboxKey:
        return OutboxKey(job.params["job"], self.s.device_id, job.round)

    def protected_models(self) -> set[tuple[str, str]]:
        return {tuple(j.model.split("@", 1)) for j in self.active()}  # type: ignore[misc]

    def shared_choices(self) -> list[dict[str, Any]]:
        """The engine choices for the state message: none until a coordinator showed it reads them."""
        return list(self.measured) if self.coordinator_reads_choices else []

    def _take_choices(self, result: dict[str, Any], where: str) -> None:
        """A child's result lists the choices this device measured in full (checked: it is a file)."""
        if "engine_choices" not in result:
            return
        try:
            choices = [c.to_json() for c in parse_choices(result["engine_choices"], where=f"{where}: engine_choices")]
        except InputError as exc:
            log.warning("%s; not reported", exc)
            return
        if choices != self.measured:
            self.measured, self.changed = choices, True

    def allowance(self) -> Allowance:
        """Today's job allowance for the state message (store read once, then kept here)."""
        now = self._clock()
        if self._counted is None:
            self._counted = counted_jobs([*self.store.entries(), *self.store.pruned_today(now=now)], now)
        self._counted = {k: t for k, t in self._counted.items() if t >= now - DAY_S}
        return daily_allowance(self.s.limits, self._counted.values(), now)

    def conditions(self) -> Conditions:
        r = self._readings(fresh=True)  # a decision on a command: read the sensors now
        return Conditions(battery_pct=r.battery_pct, charging=r.charging, temp_c=r.temp_c,
                          power_reading=r.power_w is not None)

    # ---- commands ----
    def submit(self, body: dict[str, Any], cmd_id: str) -> tuple[Verdict, Job | None]:
        """A verified finetune command: refuse, acknowledge a repeat, or create the job."""
        now = self._clock()
        try:
            req = parse_finetune(body, deadline_s=self.s.limits.deadline_s, now=now)
        except BadParams as exc:
            return Verdict.refuse("bad_params", str(exc)), None
        if req.relays_choices and not self.coordinator_reads_choices:
            self.coordinator_reads_choices = self.changed = True  # (the next state reports ours)
        with contextlib.suppress(FileNotFoundError, InputError):
            existing = self.store.load(req.local_id)
            return Verdict(True, "duplicate", f"job {req.local_id} is already {existing.state.value}"), existing
        jobs = self.store.entries()  # the store's index: no record is read per command
        active = [j.job_id for j in jobs if not j.state.terminal]
        # cancelled jobs do not count (policy.counts_against_limit); nor are pruned ones forgotten
        self._counted = counted_jobs([*jobs, *self.store.pruned_today(now=now)], now)
        conditions = self.conditions()
        verdict = check_finetune(req, self.s.limits, conditions, active=active,
                                 accepted_last_day=len(self._counted), now=now, battery_planned=self.planner is not None)
        if not verdict.accept:
            return verdict, None
        budget = effective_budget(req, self.s.limits)
        planned: dict[str, Any] = {}
        if self.planner is not None:
            verdict, planned = self._plan(req, budget, conditions, now)
            if not verdict.accept:
                return verdict, None
        self._counted[req.local_id] = now
        params = {**req.to_params(), **budget, "cmd_id": cmd_id, **planned}
        job = Job(job_id=req.local_id, round=req.round, model=f"{req.model}@{req.version}", params=params,
                  created=now)
        self.store.save(job)  # durable before the acceptance is announced
        self._track(job)
        self._announce(job, "accepted")
        return verdict, job

    def _plan(self, req: Any, budget: dict[str, float | None], conditions: Conditions,
              now: float) -> tuple[Verdict, dict[str, Any]]:
        """[solar]: the job's surplus window (job params `not_before`, `plan`), or a refusal
        naming the forecast. Without a forecast (the child failed) the battery rule decides."""
        assert self.planner is not None
        outcome = self.planner.plan(now=now, energy_wh=budget["budget_wh"],
                                    power_cap_w=budget["power_cap_w"], deadline=req.deadline_at)
        if outcome.forecast is None:
            log.warning("job %s: %s", req.local_id, outcome.detail)
            return check_finetune(req, self.s.limits, conditions, active=[], accepted_last_day=0, now=now), {}
        if outcome.window is None:
            return Verdict.refuse("no_solar_window", outcome.detail), {}
        return Verdict(True, "", outcome.detail), {"not_before": outcome.window.start, "plan_end": outcome.window.end,
                                                   "plan": outcome.detail[:200]}

    def planned_window(self) -> TrainingWindow | None:
        """The window a job is waiting for ([solar]), for the state's forecast."""
        now = self._clock()
        for job in self.active():
            start, end = job.params.get("not_before"), job.params.get("plan_end")
            if job.state in (S.ACCEPTED, S.WAITING_FOR_POWER) and isinstance(start, int | float) and now < start:
                return TrainingWindow(float(start), float(end if isinstance(end, int | float) else start),
                                      f"job {job.params.get('job')}"[:120])
        return None

    def cancel(self, body: dict[str, Any]) -> Verdict:
        job_id, rnd = body.get("job"), body.get("round")
        matches = [j for j in self.active() if j.params.get("job") == job_id and rnd in (None, j.round)]
        if not job_id or not matches:
            return Verdict.refuse("unknown_job", f"no active job {job_id!r}" + (f" round {rnd}" if rnd is not None else ""))
        for job in matches:
            job.params["cancel"] = True
            self.store.save(job)  # a restart finishes the cancellation
            self._cancel(job)
        return Verdict(True)

    def _cancel(self, job: Job) -> None:
        child = self.children.get(job.job_id)
        if child is not None:
            child.signal_stop()  # it checkpoints, exits with "cancelled", then step() finishes
            return
        if job.state is S.UPLOADING:
            self.outbox.drop(self.key(job), "cancelled by the coordinator", expected=True)
        self._advance(job, S.CANCELLED, "cancelled by the coordinator")

    # ---- lifecycle ----
    def recover(self) -> None:
        """After a (re)start: jobs whose step was cut short go back a step, counted."""
        for job in self.active():
            if job.params.get("cancel"):
                self._cancel(job)
            elif job.state is S.TRAINING and not self._trained(job):
                self._advance(job, S.PAUSED, "agent restarted; resuming from the last checkpoint")
            elif job.state is S.PREPARING:
                self._advance(job, S.WAITING_FOR_POWER, "agent restarted")
        for job in sorted(self.store.all(), key=lambda j: j.created):
            if job.result.get("engine"):
                self.engine = str(job.result["engine"])
            self._take_choices(job.result, f"job {job.job_id}")
            if "engine_choices" in job.params:  # (kept 30 days: the next command says it again)
                self.coordinator_reads_choices = True

    def step(self) -> None:
        for job in self.active():
            if time.monotonic() < self._retry_at.get(job.job_id, 0.0):
                continue
            try:
                self._step(job)
            except (TransientError, OSError) as exc:  # outbox or disk full, ...: the same step, later
                log.warning("job %s: %s; retrying in %.0f s", job.job_id, exc, TRANSIENT_RETRY_S)
                self._retry_at[job.job_id] = time.monotonic() + TRANSIENT_RETRY_S
            except Exception as exc:  # one bad job must not stop the others or the daemon
                log.exception("job %s: step failed", job.job_id)
                with contextlib.suppress(Exception):
                    self._advance(job, S.FAILED, f"internal error: {type(exc).__name__}: {exc}"[:500])

    def _step(self, job: Job) -> None:
        now = self._clock()
        waiting = job.state is S.WAITING_FOR_POWER
        if job.state in (S.ACCEPTED, S.WAITING_FOR_POWER, S.PREPARING) and now > job.params["deadline_at"]:
            self._advance(job, S.FAILED, f"deadline passed while {job.state.value}")
            return
        if job.state in (S.ACCEPTED, S.WAITING_FOR_POWER):
            start = job.params.get("not_before")
            if isinstance(start, int | float) and now < start:  # [solar]: its planned window has not opened
                if job.state is S.ACCEPTED:
                    self._advance(job, S.WAITING_FOR_POWER, f"planned start {time.strftime('%H:%M', time.gmtime(start))} "
                                                            f"UTC: {job.params.get('plan', '')}"[:300])
                return
            unmetered_why = self._unmetered(job)
            if unmetered_why:  # (the sensor failed since the job was accepted, or before a restart)
                self._advance(job, S.FAILED, unmetered_why)
                return
            ok, why = self._power_ok(waiting=waiting)
            if ok:
                self._advance(job, S.PREPARING, "power ok")
            elif not waiting:
                self._advance(job, S.WAITING_FOR_POWER, why)
        elif job.state is S.PREPARING:
            self._prepare(job)
        elif job.state in (S.TRAINING, S.PAUSED):
            self._train(job)
        elif job.state is S.UPLOADING and not job.params.get("secagg") and self.outbox.get(self.key(job)) is None:
            self._advance(job, S.DONE, "acknowledged by the coordinator")  # acked before a restart

    def _unmetered(self, job: Job) -> str:
        """policy.unmetered for an accepted job: checked before any training work starts."""
        budget = job.params.get("budget_wh")
        if budget is None or self._readings().power_w is not None:
            return ""
        return unmetered(budget, self._readings(fresh=True).power_w is not None)  # (a counter primed just now)

    def _power_ok(self, *, waiting: bool) -> tuple[bool, str]:
        r = self._readings()
        floor = self.s.battery_resume_pct if waiting else self.s.battery_floor_pct
        if r.battery_pct is not None and not r.charging and floor is not None and r.battery_pct < floor:
            return False, f"battery {r.battery_pct:.0f} % < {floor:g} %"
        limit = self.s.thermal_limit_c
        if limit is not None and r.temp_c is not None:
            cool = limit - self.s.thermal_margin_c if waiting else limit
            if r.temp_c >= cool:
                return False, f"temperature {r.temp_c:.1f} C >= {cool:g} C"
        return True, ""

    def _prepare(self, job: Job) -> None:
        name, version = job.model.split("@", 1)
        status, detail = self.models.status(name, version)
        if status == "installed":
            ok, why = self._power_ok(waiting=False)
            if not ok:
                self._advance(job, S.WAITING_FOR_POWER, why)
                return
            self._advance(job, S.TRAINING, "starting the fine-tune")
            self._spawn(job)
        elif status == "failed" and job.job_id in self._fetching:
            self._advance(job, S.FAILED, f"model {name}/{version}: {detail}")
        elif status in ("absent", "failed"):  # (a fetch that failed for someone else is tried again)
            self._fetching.add(job.job_id)
            self.models.fetch(name, version, job.params.get("sha256"), head_sha256=job.params.get("head_sha256"))
            self._progress(job, "downloading", f"fetching model {name}/{version}", throttle=False)
        else:
            self._fetching.add(job.job_id)

    def _trained(self, job: Job) -> bool:
        result = read_result(self.job_dir(job))
        return bool(result and result.get("status") == "trained")

    def _spawn(self, job: Job) -> None:
        folder = self.job_dir(job)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / RESULT_FILE).unlink(missing_ok=True)  # a "stopped" result from an earlier run
        child = ChildProcess(command="train", spec=self._spec(job), job_dir=folder, name=f"job {job.job_id}",
                             python=self.s.python)
        child.start()
        if self.s.child_priority != "normal" and child.pid is not None:
            from ..inference.personal import lower_priority

            lower_priority(child.pid, self.s.child_priority)
        self.children[job.job_id] = child

    def _spec(self, job: Job) -> dict[str, Any]:
        p, (name, version) = job.params, job.model.split("@", 1)
        spec = {"job_dir": str(self.job_dir(job)), "job": p["job"], "round": job.round, "device_id": self.s.device_id,
                "model_name": name, "version": version, "model_dir": str(self.models.path(name, version)),
                "data": self.s.limits.data_dir, "cache_dir": str(self.s.state_dir / "cache"),
                "cache_max_mb": self.s.cache_mb, "residual_file": str(self.residuals / f"{name}.bin"),
                "sysfs_root": self.s.sysfs_root, "profile": self.s.profile, "budget_wh": p.get("budget_wh"),
                "power_cap_w": p.get("power_cap_w"), "battery_floor_pct": self.s.battery_floor_pct,
                "battery_resume_pct": self.s.battery_resume_pct, "thermal_limit_c": self.s.thermal_limit_c,
                "deadline_at": p["deadline_at"], "poll_s": self.s.poll_s, "chunk_size": self.s.chunk_size,
                "label_map": self.s.label_map, "skip_unknown": self.s.skip_unknown,
                "inference_energy": self.s.inference_energy}
        for key in TRAIN_KEYS:
            if p.get(key) is not None:
                spec[key] = p[key]
        spec.setdefault("distill", FLEET_DISTILL_DEFAULT)
        if p.get("engine_choices"):
            spec["engine_choices"] = p["engine_choices"]
        if p.get("secagg"):  # a secure job: the child leaves the dense delta, not an update (secure.py)
            spec["secagg"] = True
        return spec

    def _train(self, job: Job) -> None:
        child = self.children.get(job.job_id)
        if child is None:
            if self._trained(job):
                self._finish(job)
            elif time.monotonic() >= self._next_spawn.get(job.job_id, 0.0) and not self.stopping:
                if job.state is S.PAUSED:
                    self._advance(job, S.TRAINING, "resuming the fine-tune")
                if job.state is S.TRAINING:  # (not if the re-entry limit just failed it)
                    self._spawn(job)
            return
        for event in child.events():
            self._on_event(job, event)
        code = child.poll()
        if code is None or self.stopping:
            return
        del self.children[job.job_id]
        self._on_exit(job, child, code)

    def _on_event(self, job: Job, event: dict[str, Any]) -> None:
        phase = event["phase"]
        if phase == "paused" and job.state is S.TRAINING:
            self._advance(job, S.PAUSED, str(event.get("detail", ""))[:300] or "paused by the governor")
        elif phase in ("train", "features", "checkpoint") and job.state is S.PAUSED:
            # A governor pause/resume is not a restart: keep the re-entry count for restarts.
            self._advance(job, S.TRAINING, "resumed by the governor", restart=False)
        if phase in ("train", "features", "paused", "checkpoint", "encoding", "data"):
            total, step = event.get("total_steps") or 0, event.get("step") or 0
            pct = min(100.0, 100.0 * step / total) if isinstance(total, int) and isinstance(step, int) and total > 0 else None
            metrics = {k: event[k] for k in ("step", "epoch", "loss", "energy_wh", "watts", "temp_c", "val_accuracy")
                       if isinstance(event.get(k), int | float) and not isinstance(event.get(k), bool)}
            detail = str(event.get("detail") or phase)
            if phase == "data":  # what the data set gave and what was skipped, why: in the journal too
                log.info("job %s: data: %s", job.job_id, detail[:300])
            self._progress(job, "paused" if phase == "paused" else "training", detail, pct=pct, metrics=metrics,
                           # pauses, resumptions and the data summary always get through; the rest is sampled
                           throttle=not (phase in ("paused", "encoding", "data")
                                         or (phase == "train" and event.get("detail"))))

    def _on_exit(self, job: Job, child: ChildProcess, code: int) -> None:
        result = read_result(self.job_dir(job)) or {}
        if "engine_choices" in result:  # (a stopped job may have measured them: kept in its record)
            self._take_choices(result, f"job {job.job_id}")
            job.result["engine_choices"] = result["engine_choices"]
        why = f"{describe_exit(code)}: {child.last_error or result.get('stop_reason') or 'no detail'}"
        if job.params.get("cancel"):
            self._advance(job, S.CANCELLED, "cancelled by the coordinator")
        elif code == EXIT_TRAINED and result.get("status") == "trained":
            self._finish(job)
        elif code == EXIT_STOPPED and result.get("stop_reason") not in (None, "cancelled"):
            detail = str(result.get("stop_detail") or "")[:300]
            # a job that trained no step says why ("trained 0 steps: the energy budget ran
            # out ..."): the coordinator records it as this device's dropout, with that reason
            failure = str(result.get("failure") or "")[:500]
            self._advance(job, S.FAILED, failure or f"training stopped: {result.get('stop_reason')}"
                          + (f" ({detail})" if detail else ""))
        elif code in FAIL_CODES:
            self._advance(job, S.FAILED, why)
        else:  # a crash, an outside SIGTERM, or the job's lock still held by a dying child
            delay = 1.0 if code == EXIT_BUSY else self.s.respawn_base_s * (1 + job.entries.get("training", 0))
            self._next_spawn[job.job_id] = time.monotonic() + delay
            if code != EXIT_BUSY and job.state is S.TRAINING:
                self._advance(job, S.PAUSED, f"training child ended ({why}); restarting in {delay:.0f} s")
            log.warning("job %s: child ended (%s); retrying in %.1f s", job.job_id, why, delay)

    def _finish(self, job: Job) -> None:
        """Queue the update (durable), adopt the residual, then record `uploading`."""
        folder = self.job_dir(job)
        result = read_result(folder) or {}
        if job.params.get("secagg") and self.secure is not None:
            self._finish_secure(job, folder, result)
            return
        try:
            chunks = read_update(folder)
        except (InputError, OSError) as exc:  # damaged on disk: train (encode) again
            log.error("job %s: update file unusable (%s); running the child again", job.job_id, exc)
            (folder / RESULT_FILE).unlink(missing_ok=True)
            return
        meta = {k: result[k] for k in ("num_samples", "energy_wh", "steps", "engine") if result.get(k) is not None}
        if isinstance(result.get("num_samples"), int) and result["num_samples"] >= 1:
            meta["samples"] = result["num_samples"]  # the Uploader signs it onto every chunk: FedAvg weights by it
        update = result.get("update") if isinstance(result.get("update"), dict) else {}
        # signed onto every chunk too: the label set trained on (the coordinator refuses another
        # model's) and the share of the delta's energy the update kept (shown by `status`)
        meta.update({k: update[k] for k in ("energy_kept", "labels_sha256") if update.get(k) is not None})
        self.outbox.put(self.key(job), chunks, meta=meta)  # OutboxFullError: retried next step
        pending = folder / RESIDUAL_FILE
        if pending.exists():
            self.residuals.mkdir(parents=True, exist_ok=True)
            os.replace(pending, self.residuals / f"{job.model.split('@', 1)[0]}.bin")
            fsync_dir(self.residuals)
        job.result = {k: v for k, v in result.items() if k != "status"}
        if result.get("engine"):
            self.engine = str(result["engine"])
        self._take_choices(result, f"job {job.job_id}")
        if job.state is S.PAUSED:
            self._advance(job, S.TRAINING, "finished before the restart")
        self._advance(job, S.UPLOADING, f"{len(chunks)} chunk(s), {sum(map(len, chunks))} bytes queued")

    def _finish_secure(self, job: Job, folder: Path, result: dict[str, Any]) -> None:
        """A secure job: its dense delta goes to secure aggregation (secure.py), which ends the
        job through `secure_finished`; nothing is queued in the outbox."""
        assert self.secure is not None
        try:
            delta = read_checked(folder / SECAGG_DELTA, MAX_UPDATE_FILE)
        except (InputError, OSError) as exc:  # damaged on disk: train (encode) again
            log.error("job %s: secure delta unusable (%s); running the child again", job.job_id, exc)
            (folder / RESULT_FILE).unlink(missing_ok=True)
            return
        self.secure.begin(job, delta)
        job.result = {k: v for k, v in result.items() if k != "status"}
        self._take_choices(result, f"job {job.job_id}")
        if job.state is S.PAUSED:
            self._advance(job, S.TRAINING, "finished before the restart")
        self._advance(job, S.UPLOADING, "secure aggregation: keys advertised")

    def secure_finished(self, job_id: str, ok: bool, reason: str) -> None:
        """secure.py's verdict on a secure job's round."""
        for job in self.active():
            if job.job_id == job_id and job.state is S.UPLOADING:
                self._advance(job, S.DONE if ok else S.FAILED, reason[:500])

    def on_upload(self, key: OutboxKey, outcome: str, detail: str = "") -> None:
        """The Uploader's verdict on an update: "acked" or "dropped"."""
        for job in self.active():
            if job.state is S.UPLOADING and self.key(job) == key:
                if outcome == "acked":
                    self._advance(job, S.DONE, "acknowledged by the coordinator")
                else:
                    self._advance(job, S.FAILED, f"update refused: {detail}"[:500])

    # ---- reporting ----
    def _advance(self, job: Job, new: JobState, reason: str, *, restart: bool = True) -> None:
        self.store.advance(job, new, reason, restart=restart)
        if new is S.CANCELLED and self._counted is not None:
            self._counted.pop(job.job_id, None)  # gives its daily allowance back
        self._track(job)
        self.changed = True
        log.info("job %s: %s (%s)", job.job_id, job.state.value, job.reason)
        if job.state in (S.FAILED, S.CANCELLED) and self.secure is not None and job.params.get("secagg"):
            self.secure.discard(job.job_id)  # its round secrets: gone with it
        if job.state.terminal:
            child = self.children.pop(job.job_id, None)
            if child is not None and child.poll() is None:
                child.stop(timeout=30.0)  # (a failure while it ran: never leave it training alone)
            shutil.rmtree(self.job_dir(job), ignore_errors=True)  # checkpoints: the record keeps the outcome
        self._announce(job, job.state.value)
        if job.state.terminal:  # nothing more happens to it: its per-job memory goes (a flat RSS)
            for per_job in (self._next_spawn, self._last_progress, self._retry_at):
                per_job.pop(job.job_id, None)
            self._fetching.discard(job.job_id)
            release_freed_memory()  # fragmentation, not leaks, is what creeps over a year

    def _announce(self, job: Job, phase: str) -> None:
        metrics: dict[str, Any] = {}
        if phase in ("uploading", "done"):
            metrics = {k: v for k, v in job.result.items() if isinstance(v, int | float | str | bool) and v is not None}
            metrics.update({f"update_{k}": v for k, v in (job.result.get("update") or {}).items()
                            if k != "sha256" and isinstance(v, int | float)})
        self._progress(job, phase, job.reason or phase, metrics=metrics, throttle=False)

    def _progress(self, job: Job, phase: str, detail: str, *, pct: float | None = None,
                  metrics: dict[str, Any] | None = None, throttle: bool = True) -> None:
        last = self._last_progress.get(job.job_id)
        now = time.monotonic()
        if throttle and last is not None and last[0] == phase and now - last[1] < self.s.progress_interval_s:
            return
        self._last_progress[job.job_id] = (phase, now)
        self._publish(phase, job=job.params.get("job"), round=job.round, cmd_id=job.params.get("cmd_id"),
                      pct=pct, detail=detail, metrics=metrics or {})

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop every child cleanly (they checkpoint); jobs stay where they are for next start."""
        self.stopping = True
        for job_id, child in list(self.children.items()):
            log.info("job %s: stopping the training child (it checkpoints)", job_id)
            child.stop(timeout)
        self.children.clear()
