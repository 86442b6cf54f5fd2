"""BudgetGovernor: decides, between training steps, whether to go on, pause or stop.

The trainer calls it at step boundaries (see the example in `edge_agent/power/__init__.py`):

    decision = gov.before_step()           # CONTINUE / PAUSE(reason, resume) / STOP(reason)
    while decision.paused:                 # the trainer checkpoints, then waits here
        decision = gov.wait_until_resumable()
    if decision.stopped: ...               # checkpoint and leave; gov.report() says why
    <one training step>
    advice = gov.after_step(step_seconds)  # sleeps the duty-cycle gap, suggests threads

Energy used is integrated from power samples taken at those boundaries (energy.py), and
a step is refused when the predicted energy of the next step would overshoot the budget,
so a job ends within one step's energy below its budget. What the budget is charged with is
the Budget's `energy_scope`: by default the job's own process tree (process_energy.py:
CPU-seconds x watts per busy core, read at the same boundaries), with the power source's
device-wide figure reported beside it; "device" charges that figure (battery-wide).

Inference: a device that serves requests while it trains (edge_agent.inference) spends
energy on them that a whole-device sensor counts into the job's. `inference_j` (the
service's running total, in J) lets the governor account it as inference: in the "device"
scope the job's energy ("job" basis) leaves it out, the device's total keeps it, and the
report says how much (the "process" scope never sees it: the service is another process).

The governor is the step lifecycle, the duty cycle and the decision; what the job has spent
is job_energy.py's JobEnergy, and what pauses it (battery, heat, window) conditions.py's.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Mapping
from datetime import tzinfo

from ..errors import ConfigError
from .budget import Budget, duty_cycle_sleep, ema, predict_step, suggest_threads, would_exceed
from .clock import Clock, SystemClock
from .conditions import Conditions
from .decisions import (
    CONTINUE,
    Action,
    Decision,
    PauseReason,
    StepAdvice,
    StopReason,
)
from .job_energy import ENERGY_KEYS, JobEnergy, checked_state
from .monitor import PowerMonitor
from .thermal import ThermalMonitor

J_PER_WH = 3600.0


class BudgetGovernor:
    """Holds a fine-tune job to its Budget. Not thread-safe except `cancel()`."""

    def __init__(
        self,
        *,
        budget: Budget,
        sources: PowerMonitor,
        thermal: ThermalMonitor | None = None,
        clock: Clock | None = None,
        idle_w: float | None = None,
        max_threads: int | None = None,
        poll_s: float = 30.0,
        stale_s: float = 300.0,
        max_sensor_failures: int = 10,
        tz: tzinfo | None = None,
        resume_from: Mapping[str, object] | None = None,
        inference_j: Callable[[], float | None] | None = None,
        watts_per_cpu: float | None = None,
        cpu_seconds: Callable[[], float] | None = None,
    ) -> None:
        """`watts_per_cpu` (the board profile's (load_w - idle_w) / cores) prices the job's
        CPU-seconds in the "process" energy scope, read from `cpu_seconds` (default: this
        process tree's; tests pass a virtual counter). Without it the scope is "device"."""
        if not isinstance(budget, Budget):
            raise ConfigError(f"budget: expected a Budget, got {type(budget).__name__}")
        for key, value in (("poll_s", poll_s), ("stale_s", stale_s)):
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ConfigError(f"{key}: must be a finite number > 0, got {value!r}")
        idle_w = idle_w if idle_w is not None else sources.idle_w
        if idle_w is not None and not (math.isfinite(idle_w) and idle_w >= 0):
            raise ConfigError(f"idle_w: must be finite and >= 0, got {idle_w!r}")
        if budget.power_cap_w is not None and idle_w is not None and budget.power_cap_w <= idle_w:
            raise ConfigError(
                f"power_cap_w: {budget.power_cap_w:g} W is at or below idle power {idle_w:g} W; no duty cycle can meet it"
            )
        self.budget = budget
        self.clock: Clock = clock if clock is not None else SystemClock()
        self.max_threads = max(
            1, int(max_threads if max_threads is not None else (os.cpu_count() or 1))
        )
        self.poll_s = float(poll_s)
        self.stale_s = float(stale_s)
        self.max_sensor_failures = max(1, int(max_sensor_failures))
        self.tz = tz
        self.energy = JobEnergy(monitor=sources, idle_w=idle_w, start_t=self.clock.monotonic(),
                                energy_scope=budget.energy_scope, watts_per_cpu=watts_per_cpu,
                                cpu_seconds=cpu_seconds, inference_j=inference_j)
        self.meter = self.energy.meter
        self.conditions = Conditions(monitor=sources, thermal=thermal, stale_s=self.stale_s, now=self._now_mono)
        self._cancel = threading.Event()
        self._cancel_detail = ""
        self._stop: Decision | None = None
        self._step_start: tuple[float, float] | None = None  # (monotonic, used J) of the open step
        self._step_from_wait = False
        self._paused: set[PauseReason] = set()
        self._pause_started = 0.0
        self._threads = self.max_threads
        self._gap_w: float | None = None  # measured power during duty-cycle gaps
        self._ema_cycle_j: float | None = None  # budget energy of one step + its gap
        self._last_cycle_j: float | None = None
        self._ema_step_s: float | None = None
        self._last_step_s: float | None = None
        self.steps = 0
        self.training_s = 0.0
        self.training_j = 0.0
        self.duty_sleep_s = 0.0
        self.pause_count = 0
        self.pause_s = 0.0
        self.pauses_by_reason: dict[str, int] = {}
        self.battery_start: float | None = None
        if resume_from is not None:
            self._restore(resume_from)
        self._t0 = self.clock.monotonic()
        self._sample()  # anchors integration and primes counter sources
        battery = self.conditions.battery()
        self.battery_start = battery.capacity_pct if battery is not None else None

    # --- the trainer's API ----------------------------------------------------------

    def before_step(self) -> Decision:
        """Call before every step. CONTINUE opens a step; PAUSE/STOP mean: do not train now.

        A trainer that ignores the power cap may skip after_step(): the open step is then
        closed here (measured, but without a duty-cycle gap).
        """
        if self._step_start is not None and not self._step_from_wait:
            self._close_step()  # the trainer skipped after_step: close the step here
        else:
            self._sample()
        self._step_start = None  # a step opened by wait_until_resumable is simply re-opened
        return self._open_if_continue(self._evaluate())

    def after_step(
        self,
        step_seconds: float | None = None,
        *,
        threads_used: int | None = None,
        sleep: bool = True,
    ) -> StepAdvice:
        """Call after every step: measures it, sleeps the gap that holds the power cap.

        step_seconds is the trainer's own timing, used only if the clock saw no time pass.
        With sleep=False the gap is returned in the advice for the caller to sleep.
        """
        if self._step_start is None:
            raise RuntimeError(
                "after_step() without a step: call before_step() and train only on CONTINUE"
            )
        if threads_used is not None:
            self._threads = max(1, min(int(threads_used), self.max_threads))
        used_before = self._step_start[1]
        step_s, step_j = self._close_step(fallback_s=step_seconds)
        step_w = step_j / step_s if step_s > 0 else None
        temp = self.conditions.temperature()
        self._threads = suggest_threads(
            current=self._threads,
            max_threads=self.max_threads,
            step_w=step_w,
            idle_w=self.meter.idle_w,
            cap_w=self.budget.power_cap_w,
            temp_c=temp.max_c if temp is not None else None,
            thermal_limit_c=self.budget.thermal_limit_c,
            thermal_margin_c=self.budget.thermal_margin_c,
        )
        gap = self._duty_gap(step_j, step_s)
        if sleep and gap > 0:
            self._sleep_gap(gap)
        cycle = self._used_j() - used_before
        self._ema_cycle_j, self._last_cycle_j = ema(self._ema_cycle_j, cycle), cycle
        return StepAdvice(
            sleep_s=gap,
            threads=self._threads,
            step_j=step_j,
            step_w=step_w,
            source=self.meter.main_source,
        )

    def wait_until_resumable(self, *, max_wait_s: float | None = None) -> Decision:
        """Poll sensors (every poll_s on the clock) until training may resume or must stop.

        Returns CONTINUE (a step is open: train it, then after_step), a STOP, or, only if
        max_wait_s elapses, the PAUSE still in force.
        """
        if self._step_start is not None and not self._step_from_wait:
            raise RuntimeError("wait_until_resumable() with a step open: call after_step() first")
        self._step_start = None
        started = self.clock.monotonic()
        napped = False
        while True:
            self._sample(hold_end=napped)  # read after a nap, it reflects the nap, not the step
            decision = self._open_if_continue(self._evaluate(), from_wait=True)  # like before_step
            if not decision.paused:
                return decision
            waited = self.clock.monotonic() - started
            if max_wait_s is not None and waited >= max_wait_s:
                return decision
            nap = self.poll_s
            now = self.clock.now()
            if decision.resume is not None and decision.resume.not_before is not None:
                nap = min(nap, decision.resume.not_before - now)
            if self.budget.deadline is not None:
                nap = min(nap, self.budget.deadline - now)
            if max_wait_s is not None:
                nap = min(nap, max_wait_s - waited)
            self.clock.sleep(max(nap, 1e-3))
            napped = True

    def charge_overhead(self) -> float:
        """Sample now, outside any step, and return the budget's energy used so far (J).

        Work done before training (int8 engine selection) is integrated like a step but
        not counted as one: no duty-cycle gap, no step statistics."""
        if self._step_start is None:
            self._sample(hold_end=True)
        return self._used_j()

    def cancel(self, detail: str = "") -> None:
        """Ask the job to stop (safe from another thread or a signal handler)."""
        self._cancel_detail = detail
        self._cancel.set()

    def finish(self, reason: StopReason | str, detail: str = "") -> Decision:
        """Record how the job ended (done, early-stopped, error...) unless already stopped."""
        reason = StopReason(reason)
        if self._step_start is not None and not self._step_from_wait:
            self._close_step()
        else:
            self._sample()
        self._step_start = None
        return self._stop or self._halt(reason, detail)

    @property
    def temp_c(self) -> float | None:
        """The latest hottest-zone temperature seen (C), or None."""
        return self.conditions.temp_c

    @property
    def battery_pct(self) -> float | None:
        """The latest battery capacity seen (%), or None."""
        return self.conditions.battery_pct

    @property
    def max_temp_c(self) -> float | None:
        return self.conditions.max_temp_c

    @property
    def stop_reason(self) -> StopReason | None:
        return self._stop.reason if self._stop is not None else None  # type: ignore[return-value]

    @property
    def energy_scope(self) -> str:
        """What the budget is charged with: "process" or "device" (see the module docstring)."""
        return self.energy.scope

    def inference_j(self) -> float:
        """Inference energy spent since this run started (J); 0 without a reader."""
        return self.energy.inference_j()

    def report(self) -> dict[str, object]:
        e = self.energy
        total_j, job_j = e.total_j(), e.job_j()
        measured = self.meter.measured_s
        budget_j = self.budget.budget_j
        return {
            "energy_wh_total": total_j / J_PER_WH,
            "energy_wh_job": job_j / J_PER_WH,
            "energy_scope": self.energy_scope,
            "energy_scope_note": e.scope_note,
            # what the power source measured for the whole board, every process on it
            "device_energy_wh_total": e.device_total_j() / J_PER_WH,
            "device_energy_wh_job": e.device_job_j() / J_PER_WH,
            "process_cpu_s": e.process.cpu_s if e.process is not None else None,
            "inference_wh": e.inference_j() / J_PER_WH,
            "budget_wh": self.budget.budget_wh,
            "budget_basis": self.budget.budget_basis,
            "budget_used_fraction": (self._used_j() / budget_j) if budget_j else None,
            "source": self.meter.main_source,
            "source_seconds": dict(self.meter.seconds_by_source),
            "idle_w": self.meter.idle_w,
            "idle_from": self.meter.idle_from,
            "peak_w": self.meter.peak_w,
            "avg_w": (self.meter.total_j / measured) if measured > 0 else None,
            "avg_w_training": (self.training_j / self.training_s) if self.training_s > 0 else None,
            "power_cap_w": self.budget.power_cap_w,
            "steps": self.steps,
            "training_s": self.training_s,
            "duty_sleep_s": self.duty_sleep_s,
            "threads": self._threads,
            "pause_count": self.pause_count,
            "pause_s": self.pause_s
            + (self._now_mono() - self._pause_started if self._paused else 0.0),
            "pauses_by_reason": dict(self.pauses_by_reason),
            "paused_for": sorted(r.value for r in self._paused),
            "stop_reason": self._stop.reason.value if self._stop and self._stop.reason else None,
            "stop_detail": self._stop.detail if self._stop else "",
            "elapsed_s": self._now_mono() - self._t0,
            "battery_pct_start": self.battery_start,
            "battery_pct_end": self.battery_pct,
            "max_temp_c": self.max_temp_c,
            "sensor_failures": self.meter.failed_reads,
            "problems": self.conditions.problems(),
        }

    def state(self) -> dict[str, float]:
        """What must survive a reboot for the budget to stay per job: store it with the checkpoint."""
        return {
            **self.energy.state(),
            "steps": float(self.steps),
            "training_s": self.training_s,
            "pause_count": float(self.pause_count),
            "pause_s": self.pause_s,
        }

    # --- internals --------------------------------------------------------------------

    def _open_if_continue(self, decision: Decision, *, from_wait: bool = False) -> Decision:
        if decision.proceed:
            self._step_start = (self._last_t(), self._used_j())
            self._step_from_wait = from_wait
        return decision

    def _now_mono(self) -> float:
        return self.clock.monotonic()

    def _last_t(self) -> float:
        return self.meter.last.t if self.meter.last is not None else self._now_mono()

    def _used_j(self) -> float:
        return self.energy.used_j(self.budget.budget_basis)

    def _sample(self, *, hold_end: bool = False) -> None:
        self.energy.sample(self._now_mono(), hold_end=hold_end)

    def _close_step(self, fallback_s: float | None = None) -> tuple[float, float]:
        """End the open step: (seconds, total joules). The closing reading reflects the step."""
        assert self._step_start is not None
        start_t, _ = self._step_start
        total_before = self.meter.total_j
        self._sample(hold_end=True)
        self._step_start = None
        step_s = self._last_t() - start_t
        if step_s <= 0 and fallback_s is not None and math.isfinite(fallback_s) and fallback_s > 0:
            step_s = fallback_s
        step_j = self.meter.total_j - total_before
        self.steps += 1
        self.training_s += max(step_s, 0.0)
        self.training_j += step_j
        self._ema_step_s, self._last_step_s = ema(self._ema_step_s, step_s), step_s
        return step_s, step_j

    def _duty_gap(self, step_j: float, step_s: float) -> float:
        cap = self.budget.power_cap_w
        if cap is None or step_s <= 0:
            return 0.0
        idle_w = self.meter.idle_w if self.meter.idle_w is not None else 0.0
        gap_w = self._gap_w if self._gap_w is not None else idle_w
        if gap_w >= cap:
            # Something else keeps the board above the cap even while we idle: the job can
            # only hold its own share, so size the gap against idle power instead.
            gap_w = idle_w
        gap = duty_cycle_sleep(step_j, step_s, cap, gap_w)
        if math.isinf(gap):  # idle power itself (a measured baseline) is above the cap
            self._halt(
                StopReason.ERROR, f"power cap {cap:g} W is at or below idle power {idle_w:.2f} W"
            )
            return 0.0
        if self.budget.deadline is not None:  # never idle past the deadline
            gap = min(gap, max(0.0, self.budget.deadline - self.clock.now()))
        return gap

    def _sleep_gap(self, gap: float) -> None:
        total_before, last_before, start = self.meter.total_j, self.meter.last, self._now_mono()
        remaining = gap
        while remaining > 0 and not self._cancel.is_set():  # in slices, so cancel() is heard
            nap = min(remaining, self.poll_s)
            self.clock.sleep(nap)
            remaining -= nap
        self._sample(hold_end=True)  # the reading after the gap reflects the gap
        slept = self._now_mono() - start
        self.duty_sleep_s += slept
        if slept > 0 and self.meter.last is not last_before:
            self._gap_w = ema(self._gap_w, (self.meter.total_j - total_before) / slept)

    def _evaluate(self) -> Decision:
        if self._stop is not None:
            return self._stop
        if self._cancel.is_set():
            return self._halt(StopReason.CANCELLED, self._cancel_detail)
        b = self.budget
        device_charged = self.energy.process is None  # the process scope needs no sensor to hold the budget
        if device_charged and b.budget_j is not None and self.meter.last is None and self.meter.failed_reads >= 3:
            # Not one reading since the start (a counter's priming read and a read at the same
            # instant do not count): the job would go unmetered. A short job used to finish
            # "within budget" at 0.0 Wh before max_sensor_failures was reached; now one step at most.
            return self._halt(StopReason.ERROR, "no power source gave a reading at the start; cannot enforce "
                              "the energy budget (edge-agent probe lists the sources and their errors)")
        if device_charged and b.budget_j is not None and self.meter.consecutive_failures >= self.max_sensor_failures:
            return self._halt(
                StopReason.ERROR,
                f"no power reading in {self.meter.consecutive_failures} consecutive samples; cannot enforce the energy budget",
            )
        now = self.clock.now()
        reasons, resume, details = self.conditions.blocking(b, now, self._paused, self.tz)
        if b.deadline is not None and now >= b.deadline:
            if PauseReason.BATTERY_LOW in reasons:
                return self._halt(
                    StopReason.BATTERY_LOW,
                    "deadline passed while waiting for the battery: " + "; ".join(details),
                )
            return self._halt(StopReason.DEADLINE, "deadline passed")
        if b.budget_j is not None:
            used, upcoming = self._used_j(), predict_step(self._ema_cycle_j, self._last_cycle_j)
            if would_exceed(used, upcoming, b.budget_j):
                return self._halt(
                    StopReason.BUDGET_EXHAUSTED,
                    f"{b.budget_basis} energy {used / J_PER_WH:.4g} Wh of {b.budget_wh:g} Wh; next step ~{upcoming / J_PER_WH:.4g} Wh",
                )
        if reasons:
            self._enter_pause(reasons)
            return Decision(Action.PAUSE, reasons[0], "; ".join(details), resume, tuple(reasons))
        if b.deadline is not None:
            next_s = predict_step(self._ema_step_s, self._last_step_s)
            if now + next_s > b.deadline:
                return self._halt(
                    StopReason.DEADLINE,
                    f"the next step (~{next_s:.1f} s) would end after the deadline",
                )
        self._leave_pause()
        return CONTINUE

    def _enter_pause(self, reasons: list[PauseReason]) -> None:
        if not self._paused:
            self.pause_count += 1
            self._pause_started = self._now_mono()
        for reason in reasons:
            if reason not in self._paused:
                self.pauses_by_reason[reason.value] = self.pauses_by_reason.get(reason.value, 0) + 1
        self._paused = set(reasons)

    def _leave_pause(self) -> None:
        if self._paused:
            self.pause_s += self._now_mono() - self._pause_started
            self._paused = set()

    def _halt(self, reason: StopReason, detail: str) -> Decision:
        self._leave_pause()
        self._stop = Decision(Action.STOP, reason, detail)
        return self._stop

    def _restore(self, state: Mapping[str, object]) -> None:
        """Carry energy and counters over from a previous run of the same job (untrusted data)."""
        values = checked_state(state, (*ENERGY_KEYS, "steps", "training_s", "pause_count", "pause_s"))
        self.energy.restore(values)
        self.steps = int(values["steps"])
        self.training_s = values["training_s"]
        self.pause_count = int(values["pause_count"])
        self.pause_s = values["pause_s"]
