"""What the round engine takes and gives back: the fleet-wide `RoundPolicy` (with
`check_options`, the per-job overrides' validation) and the plain values its calls return
(`RoundPlan`, `RoundOutcome`, `Receipt`, `TickResult`).

Separate from rounds.py so the engine reads as the state machine only; the CLI, dashboard
and MQTT service import these names from rounds.py, which re-exports them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..errors import InputError
from .records import JobStatus, ModelVersion, RoundState
from .robust import AGGREGATORS

__all__ = ["Receipt", "RoundOutcome", "RoundPlan", "RoundPolicy", "TickResult", "check_options"]


@dataclass(frozen=True, kw_only=True)
class RoundPolicy:
    """Fleet-wide defaults; a job's params may override aggregator, trim_fraction, norm_k,
    min_battery_pct, devices_per_round, max_samples, clip_mult and krum_fraction. The
    robust-aggregation knobs are explained in robust.py."""

    online_within_s: float = 300.0  # "online" = online flag and heard from within this
    min_battery_pct: float = 30.0  # unless on external power
    allow_unknown_power: bool = True  # devices reporting no battery at all (mains-powered)
    aggregator: str = "fedavg_clipped"
    trim_fraction: float = 0.2
    norm_k: float = 3.5
    norm_min_updates: int = 3
    max_wait_s: float | None = None  # wait for enough eligible devices; None: the job's deadline
    max_update_bytes: int = 64 << 20
    clip_mult: float = 2.0  # clip each delta to this x the round's reference norm
    samples_mult: float = 2.0  # weights capped at this x the round's lower-median weight
    samples_growth: float = 2.0  # ... and at this x the device's largest recent accepted count
    history_k: float = 10.0  # norm > this x the job's past accepted median: rejected
    small_ratio: float = 3.0  # two updates, no history: norms must agree within this ratio
    # Off by default (-1): the mean cosine of a device's last `direction_rounds` updates with the
    # job's last published step, below this: rejected, a strike. It separates sign flips only while
    # that step is clean; on federated digits a poisoned first round made honest devices look hostile.
    min_direction: float = -1.0
    direction_rounds: int = 3
    min_cosine: float = 0.0  # small rounds: cosine with the round's coordinate-wise median
    direction_max_n: int = 5  # ... in rounds of at most this many updates (non-IID: a weak signal)
    min_median_cosine: float = 0.05  # larger rounds: below it rejected (no strike) ...
    strike_median_cosine: float = -0.1  # ... a strike when the mean of the device's last
    # `direction_rounds` cosines is below this (robust.py step 5 has the measured distributions)
    krum_fraction: float = 0.2  # Multi-Krum's assumed share of hostile updates
    max_abs_delta: float = 1e6  # any |value| above this: refused at arrival
    quarantine_after: int = 3  # strikes (screened-out updates, net of accepted ones)

    def __post_init__(self) -> None:
        check_options(self.aggregator, self.trim_fraction, self.norm_k, self.min_battery_pct)
        if not (math.isfinite(self.online_within_s) and self.online_within_s > 0):
            raise ValueError(f"online_within_s must be > 0, got {self.online_within_s}")
        if self.norm_min_updates < 1 or not 0 < self.max_update_bytes <= 1 << 30:
            raise ValueError("norm_min_updates must be >= 1 and max_update_bytes in (0, 1 GiB]")
        for name in ("clip_mult", "samples_mult", "samples_growth", "history_k", "small_ratio", "max_abs_delta"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 1):
                raise ValueError(f"{name} must be a finite number >= 1, got {value}")
        if not -1 <= self.min_direction <= 1 or self.direction_rounds < 1:
            raise ValueError("need -1 <= min_direction <= 1 and direction_rounds >= 1")
        if not -1 <= self.min_cosine <= 1 or not -1 <= self.min_median_cosine <= 1 \
                or not -1 <= self.strike_median_cosine <= 1 or self.direction_max_n < 0 or self.quarantine_after < 1 \
                or not 0 <= self.krum_fraction < 0.5:
            raise ValueError("need -1 <= min_cosine <= 1, direction_max_n >= 0, quarantine_after >= 1, "
                             "0 <= krum_fraction < 0.5")
        if self.max_wait_s is not None and not (math.isfinite(self.max_wait_s) and self.max_wait_s >= 0):
            raise ValueError(f"max_wait_s must be >= 0, got {self.max_wait_s}")


def check_options(aggregator: Any, trim_fraction: Any, norm_k: Any, min_battery_pct: Any) -> None:
    if aggregator not in AGGREGATORS:
        raise InputError(f"aggregator must be one of {AGGREGATORS}, got {aggregator!r}")
    for name, value, lo, hi in (("trim_fraction", trim_fraction, 0.0, 0.49), ("norm_k", norm_k, 0.1, 1e6),
                                ("min_battery_pct", min_battery_pct, 0.0, 100.0)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
            raise InputError(f"{name} must be a number in [{lo}, {hi}], got {value!r}")


# ---------------------------------------------------------------- results
@dataclass(frozen=True)
class RoundPlan:
    """A round's dispatch: send a signed `finetune` command to each of `devices`."""

    job_id: str
    round: int
    model_name: str
    model_version: str  # the version devices train from (fetch it first if they lack it)
    deadline_at: float
    devices: tuple[str, ...]
    params: dict[str, Any] = field(default_factory=dict)  # job params (budget_wh, epochs...)

    @property
    def cmd_id(self) -> str:
        return f"{self.job_id}-r{self.round}"


@dataclass(frozen=True)
class RoundOutcome:
    job_id: str
    round: int
    state: RoundState
    reason: str
    new_version: ModelVersion | None
    accepted: tuple[str, ...]
    rejected: dict[str, str]  # device -> reason (at receipt or at screening)
    dropouts: dict[str, str]  # device -> reason: failures are data
    job_status: JobStatus


@dataclass(frozen=True)
class Receipt:
    """What to ack: status "accepted" (stored; screened at close), "duplicate" or "rejected"
    with an id-like `reason` (ack schema) and a human `detail`."""

    status: str
    reason: str = ""
    detail: str = ""


@dataclass
class TickResult:
    opened: list[RoundPlan] = field(default_factory=list)
    closed: list[RoundOutcome] = field(default_factory=list)
    cancelled: list[RoundPlan] = field(default_factory=list)  # tell these devices to stop
    failed: dict[str, str] = field(default_factory=dict)  # job id -> why it failed in this tick
