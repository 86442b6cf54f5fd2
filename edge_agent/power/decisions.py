"""What the governor tells the trainer: decisions, stop/pause reasons, step advice."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Action(enum.Enum):
    CONTINUE = "continue"
    PAUSE = "pause"
    STOP = "stop"


class StopReason(enum.StrEnum):
    DONE = "done"
    EARLY_STOPPED = "early-stopped"
    BUDGET_EXHAUSTED = "budget-exhausted"
    DEADLINE = "deadline"
    CANCELLED = "cancelled"
    BATTERY_LOW = "battery-low"  # the deadline passed while waiting for the battery
    ERROR = "error"


class PauseReason(enum.StrEnum):
    BATTERY_LOW = "battery-low"
    THERMAL = "thermal"
    OUTSIDE_WINDOW = "outside-window"


@dataclass(frozen=True)
class ResumeCondition:
    """All set fields must hold to resume."""

    battery_pct: float | None = None  # capacity at least this
    temp_c: float | None = None  # hottest zone at most this
    not_before: float | None = None  # wall clock (epoch s) at least this: the window opens

    def describe(self) -> str:
        parts = []
        if self.battery_pct is not None:
            parts.append(f"battery >= {self.battery_pct:g} %")
        if self.temp_c is not None:
            parts.append(f"temperature <= {self.temp_c:g} C")
        if self.not_before is not None:
            parts.append(f"time >= {self.not_before:.0f} (window opens)")
        return " and ".join(parts) or "now"


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: StopReason | PauseReason | None = None
    detail: str = ""
    resume: ResumeCondition | None = None
    reasons: tuple[PauseReason, ...] = ()  # every reason blocking, for a PAUSE

    @property
    def proceed(self) -> bool:
        return self.action is Action.CONTINUE

    @property
    def paused(self) -> bool:
        return self.action is Action.PAUSE

    @property
    def stopped(self) -> bool:
        return self.action is Action.STOP

    def __str__(self) -> str:
        text = self.action.value + (f"({self.reason.value})" if self.reason is not None else "")
        if self.resume is not None:
            text += f" until {self.resume.describe()}"
        return text + (f": {self.detail}" if self.detail else "")


CONTINUE = Decision(Action.CONTINUE)


@dataclass(frozen=True)
class StepAdvice:
    sleep_s: float  # the duty-cycle gap slept after the step to hold the power cap
    threads: int  # suggested thread count for the next step
    step_j: float  # energy of the step (total)
    step_w: float | None  # its average power
    source: str | None  # the power source that measured it
