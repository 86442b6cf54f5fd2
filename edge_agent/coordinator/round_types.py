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
from .strategies import AGGREGATORS

__all__ = ["Receipt", "RoundOutcome", "RoundPlan", "RoundPolicy", "TickResult", "check_options"]


@dataclass(frozen=True, kw_only=True)
class RoundPolicy:
    """Fleet-wide defaults; a job's params may override aggregator, trim_fraction,
    min_battery_pct, devices_per_round, max_samples, clip_mult and krum_fraction. The rules
    are in strategies/ (their table and the defaults in strategies/__init__.py)."""

    online_within_s: float = 300.0  # "online" = online flag and heard from within this
    offline_grace_s: float = 30.0  # a device gone offline mid-round this long (not back): a dropout
    min_battery_pct: float = 30.0  # unless on external power
    allow_unknown_power: bool = True  # devices reporting no battery at all (mains-powered)
    aggregator: str | None = None  # None: chosen per job by fleet size and server set (default_strategy)
    trim_fraction: float = 0.2
    max_wait_s: float | None = None  # wait for enough eligible devices; None: the job's deadline
    max_update_bytes: int = 64 << 20
    clip_mult: float = 2.0  # fedavg_clipped: clip each delta to this x the round's reference norm
    samples_mult: float = 2.0  # weights capped at this x the round's lower-median weight
    samples_growth: float = 2.0  # ... and at this x the device's largest recent accepted count
    krum_fraction: float = 0.2  # Multi-Krum's assumed share of hostile updates
    trust_kappa: float = 0.1  # trust: the cosine with the server's reference at which an update earns full trust
    median_kappa: float = 0.3  # median_trust: the same against the round's median (strategies/trust.py)
    gate_z: float = 2.33  # the validation gate's one-sided significance (gate.py)
    gate_min_drop: float = 0.005  # ... and the smallest accuracy drop that stops a version
    max_abs_delta: float = 1e6  # any |value| above this: refused at arrival (a strike)
    quarantine_after: int = 3  # strikes (refused updates, net of accepted ones)

    def __post_init__(self) -> None:
        check_options(self.aggregator, self.trim_fraction, self.min_battery_pct)
        if not (math.isfinite(self.online_within_s) and self.online_within_s > 0):
            raise ValueError(f"online_within_s must be > 0, got {self.online_within_s}")
        if not (math.isfinite(self.offline_grace_s) and self.offline_grace_s >= 0):
            raise ValueError(f"offline_grace_s must be >= 0, got {self.offline_grace_s}")
        if not 0 < self.max_update_bytes <= 1 << 30:
            raise ValueError("max_update_bytes must be in (0, 1 GiB]")
        for name in ("clip_mult", "samples_mult", "samples_growth", "max_abs_delta"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 1):
                raise ValueError(f"{name} must be a finite number >= 1, got {value}")
        if self.quarantine_after < 1 or not 0 <= self.krum_fraction < 0.5 or not 0 < self.trust_kappa <= 1 \
                or not 0 < self.median_kappa <= 1:
            raise ValueError("need quarantine_after >= 1, 0 <= krum_fraction < 0.5, 0 < trust_kappa <= 1, "
                             "0 < median_kappa <= 1")
        if not (math.isfinite(self.gate_z) and self.gate_z >= 0) or not 0 <= self.gate_min_drop < 1:
            raise ValueError("need gate_z >= 0 and 0 <= gate_min_drop < 1")
        if self.max_wait_s is not None and not (math.isfinite(self.max_wait_s) and self.max_wait_s >= 0):
            raise ValueError(f"max_wait_s must be >= 0, got {self.max_wait_s}")


def check_options(aggregator: Any, trim_fraction: Any, min_battery_pct: Any) -> None:
    if aggregator is not None and aggregator not in AGGREGATORS:
        raise InputError(f"aggregator must be one of {', '.join(AGGREGATORS)}, got {str(aggregator)[:40]!r}")
    for name, value, lo, hi in (("trim_fraction", trim_fraction, 0.0, 0.49),
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
    gone: list[tuple[str, str, int]] = field(default_factory=list)  # (device, job, round) dropouts: offline
    secagg: list[tuple[str, Any, dict[str, Any]]] = field(default_factory=list)  # (device, kind, body): secure rounds' requests
