"""The conditions that pause a job: battery below its floor, a zone too hot, outside the
training window -- each with what must hold to resume (hysteresis: a paused job waits for the
resume level, not just above the floor).

Battery and temperature readings are held for `stale_s` over a failed read, so one glitch
never flips a pause decision.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import tzinfo

from .battery import BatteryState
from .budget import Budget
from .decisions import PauseReason, ResumeCondition
from .monitor import PowerMonitor
from .thermal import ThermalMonitor, ThermalReading


class Conditions:
    def __init__(self, *, monitor: PowerMonitor, thermal: ThermalMonitor | None, stale_s: float,
                 now: Callable[[], float]) -> None:
        self.monitor, self.thermal, self.stale_s, self._now = monitor, thermal, stale_s, now
        self._battery: tuple[BatteryState, float] | None = None
        self._temp: tuple[ThermalReading, float] | None = None
        self.max_temp_c: float | None = None

    @property
    def temp_c(self) -> float | None:
        """The latest hottest-zone temperature seen (C), or None."""
        return self._temp[0].max_c if self._temp is not None else None

    @property
    def battery_pct(self) -> float | None:
        """The latest battery capacity seen (%), or None."""
        return self._battery[0].capacity_pct if self._battery is not None else None

    def battery(self) -> BatteryState | None:
        state = self.monitor.battery()
        now = self._now()
        if state is not None:
            self._battery = (state, now)
            return state
        if self._battery is not None and now - self._battery[1] <= self.stale_s:
            return self._battery[0]  # one glitch must not flip a pause decision
        return None

    def temperature(self) -> ThermalReading | None:
        if self.thermal is None:
            return None
        try:
            reading = self.thermal.read()
        except Exception:  # noqa: BLE001 - a bug in a sensor path must not stop training
            reading = None
        now = self._now()
        if reading is not None:
            self._temp = (reading, now)
            self.max_temp_c = reading.max_c if self.max_temp_c is None else max(self.max_temp_c, reading.max_c)
            return reading
        if self._temp is not None and now - self._temp[1] <= self.stale_s:
            return self._temp[0]
        return None

    def blocking(self, budget: Budget, now: float, paused: set[PauseReason], tz: tzinfo | None
                 ) -> tuple[list[PauseReason], ResumeCondition, list[str]]:
        """(what blocks training now, what must hold to resume, why in words); `paused` = the
        reasons already in force (they hold until their resume level), `now` wall-clock."""
        b = budget
        reasons: list[PauseReason] = []
        details: list[str] = []
        resume_pct = resume_temp = not_before = None
        battery = self.battery()
        if b.battery_floor_pct is not None and battery is not None:
            pct = battery.capacity_pct
            held = PauseReason.BATTERY_LOW in paused and pct < b.battery_resume_pct  # type: ignore[operator]
            if pct <= b.battery_floor_pct or held:
                reasons.append(PauseReason.BATTERY_LOW)
                details.append(f"battery {pct:g} % ({battery.status or 'status unknown'}), floor {b.battery_floor_pct:g} %")
                resume_pct = b.battery_resume_pct
        temp = self.temperature()
        if b.thermal_limit_c is not None and temp is not None:
            cool = b.thermal_limit_c - b.thermal_margin_c
            if temp.max_c >= b.thermal_limit_c or (PauseReason.THERMAL in paused and temp.max_c > cool):
                reasons.append(PauseReason.THERMAL)
                details.append(f"{temp.zone} at {temp.max_c:.1f} C, limit {b.thermal_limit_c:g} C")
                resume_temp = cool
        if b.window is not None and not b.window.contains(now, tz):  # type: ignore[union-attr]
            reasons.append(PauseReason.OUTSIDE_WINDOW)
            details.append(f"outside window {b.window}")
            not_before = now + b.window.seconds_until_open(now, tz)  # type: ignore[union-attr]
        return reasons, ResumeCondition(resume_pct, resume_temp, not_before), details

    def problems(self) -> dict[str, object]:
        problems = dict(self.monitor.problems())
        if self.thermal is not None and self.thermal.nodes.problem_count:
            problems["thermal"] = {"count": self.thermal.nodes.problem_count,
                                   "recent": list(self.thermal.nodes.recent_problems)}
        return problems
