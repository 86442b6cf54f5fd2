"""A job's power budget (validated once, at construction) and the arithmetic behind it.

The governor is a thin class around the pure functions here: window membership, the
duty-cycle gap that holds an average power cap, thread-count advice, and the
"would the next step overshoot" test that keeps energy used within one step of the budget.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, tzinfo

from ..errors import ConfigError

BASES = ("job", "total")
# What the budget is charged with: "process" (the job's own process tree: its CPU-seconds x
# the board's watts per busy core) or "device" (everything the board's power source measures,
# every process included: battery-wide accounting). process_energy.py says why.
SCOPES = ("process", "device")
DEFAULT_RESUME_GAP_PCT = 10.0
DEFAULT_THERMAL_MARGIN_C = 5.0


@dataclass(frozen=True)
class TimeWindow:
    """Daily local-time window [start, end) in minutes after midnight; wraps midnight if end < start."""

    start_min: int
    end_min: int
    text: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        for name in ("start_min", "end_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 24 * 60:
                raise ConfigError(f"window: {name} must be minutes in [0, 1440), got {value!r}")
        if self.start_min == self.end_min:
            raise ConfigError(
                "window: start equals end (an empty window); omit the window to allow any time"
            )

    def contains_minute(self, minute: int) -> bool:
        if self.start_min < self.end_min:
            return self.start_min <= minute < self.end_min
        return minute >= self.start_min or minute < self.end_min

    def contains(self, epoch: float, tz: tzinfo | None = None) -> bool:
        local = datetime.fromtimestamp(epoch, tz)
        return self.contains_minute(local.hour * 60 + local.minute)

    def seconds_until_open(self, epoch: float, tz: tzinfo | None = None) -> float:
        """0 inside the window, else the seconds until it next opens (local time, so DST-aware)."""
        if self.contains(epoch, tz):
            return 0.0
        local = datetime.fromtimestamp(epoch, tz)
        opening = local.replace(
            hour=self.start_min // 60, minute=self.start_min % 60, second=0, microsecond=0
        )
        if opening <= local:
            opening += timedelta(days=1)
        return max(0.0, opening.timestamp() - epoch)

    def __str__(self) -> str:
        return (
            self.text
            or f"{self.start_min // 60:02d}:{self.start_min % 60:02d}-{self.end_min // 60:02d}:{self.end_min % 60:02d}"
        )


_WINDOW = re.compile(r"\s*(\d{1,2}):(\d{2})\s*-\s*(\d{1,2}):(\d{2})\s*")


def parse_window(text: str) -> TimeWindow:
    """'HH:MM-HH:MM' local time, e.g. '06:30-18:00' (solar hours) or '22:00-06:00' (wraps)."""
    match = _WINDOW.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise ConfigError(f"window: expected 'HH:MM-HH:MM', got {text!r}")
    sh, sm, eh, em = (int(g) for g in match.groups())
    if sh > 23 or eh > 23 or sm > 59 or em > 59:
        raise ConfigError(f"window: {text!r} is not a valid time of day range")
    return TimeWindow(sh * 60 + sm, eh * 60 + em, text=text.strip())


def parse_deadline(value: object) -> float:
    """Epoch seconds (int/float) or an ISO 8601 string with a timezone -> epoch seconds."""
    if isinstance(value, datetime):
        moment = value
    elif isinstance(value, str):
        try:
            moment = datetime.fromisoformat(value.strip())
        except ValueError:
            raise ConfigError(
                f"deadline: {value!r} is neither epoch seconds nor ISO 8601"
            ) from None
    else:
        return _number("deadline", value, positive=True)
    if moment.tzinfo is None:
        raise ConfigError(f"deadline: {value!s} has no timezone; add one (e.g. 'Z' or '+02:00')")
    return moment.timestamp()


def _number(
    key: str,
    value: object,
    *,
    low: float | None = None,
    high: float | None = None,
    positive: bool = False,
) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{key}: expected a number, got {type(value).__name__} {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise ConfigError(f"{key}: must be finite, got {value!r}")
    if positive and number <= 0:
        raise ConfigError(f"{key}: must be > 0, got {value!r}")
    if low is not None and number < low:
        raise ConfigError(f"{key}: must be >= {low:g}, got {value!r}")
    if high is not None and number > high:
        raise ConfigError(f"{key}: must be <= {high:g}, got {value!r}")
    return number


@dataclass(frozen=True, kw_only=True)
class Budget:
    """What a fine-tune job may spend. Every field is optional; None means "no limit".

    budget_wh applies to `budget_basis`: "job" (energy above idle, what training adds) or
    "total" (all energy drawn while the job runs, including idle and pauses), within
    `energy_scope`: "process" (default: the job's own process tree, so that other processes'
    load is not charged to it) or "device" (everything the board's power source measures:
    battery-wide accounting).
    A battery pause resumes at battery_resume_pct (default floor + 10); a thermal pause
    resumes once the hottest zone is thermal_margin_c below thermal_limit_c.
    """

    budget_wh: float | None = None
    budget_basis: str = "job"
    energy_scope: str = "process"
    power_cap_w: float | None = None
    battery_floor_pct: float | None = None
    battery_resume_pct: float | None = None
    thermal_limit_c: float | None = None
    thermal_margin_c: float = DEFAULT_THERMAL_MARGIN_C
    window: TimeWindow | str | None = None
    deadline: float | str | datetime | None = None

    def __post_init__(self) -> None:
        put = object.__setattr__  # frozen: normalise once, here
        if self.budget_wh is not None:
            put(self, "budget_wh", _number("budget_wh", self.budget_wh, positive=True))
        if self.budget_basis not in BASES:
            raise ConfigError(f"budget_basis: expected one of {BASES}, got {self.budget_basis!r}")
        if self.energy_scope not in SCOPES:
            raise ConfigError(f"energy_scope: expected one of {SCOPES}, got {self.energy_scope!r}")
        if self.power_cap_w is not None:
            put(self, "power_cap_w", _number("power_cap_w", self.power_cap_w, positive=True))
        if self.battery_floor_pct is None:
            if self.battery_resume_pct is not None:
                raise ConfigError("battery_resume_pct: needs battery_floor_pct")
        else:
            floor = _number("battery_floor_pct", self.battery_floor_pct, low=0, high=100)
            resume = self.battery_resume_pct
            resume = (
                min(100.0, floor + DEFAULT_RESUME_GAP_PCT)
                if resume is None
                else _number("battery_resume_pct", resume, low=0, high=100)
            )
            if not floor < resume:
                raise ConfigError(
                    f"battery_floor_pct: {floor:g} must be below battery_resume_pct {resume:g}"
                )
            put(self, "battery_floor_pct", floor)
            put(self, "battery_resume_pct", resume)
        margin = _number("thermal_margin_c", self.thermal_margin_c, positive=True, high=50)
        put(self, "thermal_margin_c", margin)
        if self.thermal_limit_c is not None:
            put(
                self,
                "thermal_limit_c",
                _number("thermal_limit_c", self.thermal_limit_c, positive=True, high=150),
            )
        if isinstance(self.window, str):
            put(self, "window", parse_window(self.window))
        elif self.window is not None and not isinstance(self.window, TimeWindow):
            raise ConfigError(f"window: expected 'HH:MM-HH:MM', got {self.window!r}")
        if self.deadline is not None:
            put(self, "deadline", parse_deadline(self.deadline))

    @property
    def budget_j(self) -> float | None:
        return None if self.budget_wh is None else self.budget_wh * 3600.0

    @classmethod
    def from_config(cls, config: Mapping[str, object]) -> Budget:
        """Build from a config table (TOML / command payload); unknown keys are errors."""
        if not isinstance(config, Mapping):
            raise ConfigError(f"budget: expected a table, got {type(config).__name__}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(str(k) for k in config if k not in known)
        if unknown:
            raise ConfigError(
                f"budget: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        return cls(**{str(k): v for k, v in config.items()})

    def to_config(self) -> dict[str, object]:
        out: dict[str, object] = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if value is not None:
                out[name] = str(value) if isinstance(value, TimeWindow) else value
        return out


# --- budget arithmetic (pure) ---------------------------------------------------------


def would_exceed(used_j: float, next_step_j: float, budget_j: float) -> bool:
    """True if running one more step of `next_step_j` would take usage past the budget."""
    return used_j + next_step_j > budget_j


def ema(previous: float | None, value: float, alpha: float = 0.3) -> float:
    return value if previous is None else previous + alpha * (value - previous)


def predict_step(ema_value: float | None, last: float | None) -> float:
    """A cautious guess for the next step: the larger of the running average and the last."""
    return max(v for v in (ema_value, last, 0.0) if v is not None)


def duty_cycle_sleep(step_j: float, step_s: float, cap_w: float, idle_w: float) -> float:
    """Seconds to idle after a step so that step + gap averages at most `cap_w`.

    Solves (step_j + idle_w * gap) / (step_s + gap) = cap_w. Returns inf when the cap is
    at or below idle power: no amount of idling meets it.
    """
    if step_s <= 0 or step_j <= cap_w * step_s:
        return 0.0
    if cap_w <= idle_w:
        return math.inf
    return (step_j - cap_w * step_s) / (cap_w - idle_w)


def suggest_threads(
    *,
    current: int,
    max_threads: int,
    step_w: float | None,
    idle_w: float | None,
    cap_w: float | None,
    temp_c: float | None = None,
    thermal_limit_c: float | None = None,
    thermal_margin_c: float = DEFAULT_THERMAL_MARGIN_C,
) -> int:
    """Threads for the next step: as many as fit under the cap, fewer when running hot.

    Dynamic power is taken as proportional to busy threads (measured on this step). Going
    up is limited to one thread per step so a noisy reading cannot make it oscillate.
    """
    current = max(1, min(current, max_threads))
    wanted = max_threads
    if cap_w is not None and step_w is not None and idle_w is not None:
        dynamic = step_w - idle_w
        if dynamic > 0:
            per_thread = dynamic / current
            wanted = max(1, min(max_threads, math.floor((cap_w - idle_w) / per_thread + 1e-9)))
        else:
            wanted = current
    if (
        temp_c is not None
        and thermal_limit_c is not None
        and temp_c >= thermal_limit_c - thermal_margin_c
    ):
        wanted = min(wanted, max(1, current - 1))  # in the warning band: shed heat early
    return min(wanted, current + 1)
