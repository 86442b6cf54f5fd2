"""Whether the device takes on a command: pure functions over the command and the device.

The protocol layer (Verifier) has already refused anything unsigned, expired, replayed or
malformed at the envelope level; this is the device's own say, by its owner's policy:

    bad_params          the body lacks a field the action needs, or a parameter is out of range
    finetune_disabled   [policy] accept_finetune = false
    no_data             no local data set ([data] dir) to train on
    busy                another job is active (one job at a time)
    daily_limit         [policy] max_jobs_per_day reached (jobs accepted in the last 24 h,
                        not counting cancelled ones: `counted_jobs`)
    battery_low         battery below [policy] min_battery_pct and not charging (without [solar];
                        with it, the solar plan decides instead: no_solar_window)
    no_solar_window     [solar]: the forecast has no training window that ends by the job's deadline
                        with the projected battery above the floor (agent/solar.py)
    too_hot             the hottest thermal zone is at or above the thermal limit
    budget_exceeded     the command asks for more energy than the device's [budget] energy_wh
    no_power_reading    the job has an energy budget but no power source gives a reading now, so
                        it could not be metered (the training child would stop it with an error
                        only after its engine selection and features)
    power_cap_exceeded  ... a higher average power than [budget] power_cap_w
    deadline_passed     its training deadline is already over
    unknown_job         `cancel` names no job this device has
    internal_error      the device failed while taking the command on (disk full, ...)

Every refusal is a `Verdict` with one of these codes (an id: it goes into a signed
`refusal` body) and a sentence for humans. Unknown command parameters are ignored, not
refused: the coordinator passes its job parameters (aggregator, ...) through unchanged.

`Allowance` is what the device tells the coordinator in every state message (entries of
its `info`, protocol.schema.ALLOWANCE_CHECKS): jobs left today, when the next one frees up, and a standing refusal
(finetune disabled, no data, daily limit) -- so round selection skips a device that would
refuse instead of selecting it round after round.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..protocol.finetune import (
    FinetuneRequest,
)

DAY_S = 86400.0
# Two jobs an hour: an hourly schedule plus re-dispatches and short jobs fit, with headroom
# (24 -- exactly one an hour -- left a device at its limit for most of every day).
DEFAULT_MAX_JOBS_PER_DAY = 48
REASONS = ("bad_params", "finetune_disabled", "no_data", "busy", "daily_limit", "battery_low", "too_hot",
           "budget_exceeded", "power_cap_exceeded", "no_power_reading", "deadline_passed", "unknown_job",
           "internal_error", "local_fault", "no_solar_window")


@dataclass(frozen=True)
class Verdict:
    accept: bool
    reason: str = ""  # one of REASONS when refused
    detail: str = ""

    @classmethod
    def refuse(cls, reason: str, detail: str) -> Verdict:
        assert reason in REASONS, reason
        return cls(False, reason, detail)


OK = Verdict(True)


@dataclass(frozen=True, kw_only=True)
class DeviceLimits:
    """The owner's policy and the device's own budget (agent.toml over the board profile)."""

    accept_finetune: bool = True
    min_battery_pct: float = 40.0
    max_jobs_per_day: int = DEFAULT_MAX_JOBS_PER_DAY
    energy_wh: float | None = None
    power_cap_w: float | None = None
    deadline_s: float | None = None
    thermal_limit_c: float | None = None
    data_dir: str | None = None

    @classmethod
    def from_config(cls, config: Any) -> DeviceLimits:
        g = config.get
        return cls(accept_finetune=g("policy", "accept_finetune", True),
                   min_battery_pct=float(g("policy", "min_battery_pct", 40.0)),
                   max_jobs_per_day=int(g("policy", "max_jobs_per_day", DEFAULT_MAX_JOBS_PER_DAY)),
                   energy_wh=g("budget", "energy_wh"), power_cap_w=g("budget", "power_cap_w"),
                   deadline_s=g("budget", "deadline_s"), thermal_limit_c=g("thermal", "limit_c"),
                   data_dir=g("data", "dir"))


@dataclass(frozen=True)
class Conditions:
    """What the device measures now (None: unknown, e.g. no battery)."""

    battery_pct: float | None = None
    charging: bool | None = None
    temp_c: float | None = None
    power_reading: bool = True  # a power source gives a reading (False: none does, the job cannot be metered)


def check_finetune(req: FinetuneRequest, limits: DeviceLimits, conditions: Conditions, *, active: list[str],
                   accepted_last_day: int, now: float | None = None, battery_planned: bool = False) -> Verdict:
    """Accept or refuse a parsed finetune request. `active` lists the local ids of jobs not
    yet finished; `accepted_last_day` counts jobs accepted in the last 24 hours.
    `battery_planned`: the solar planner judges the battery (a low battery now may be full by
    the window), so the battery_low rule is left to it."""
    now = time.time() if now is None else now
    if not limits.accept_finetune:
        return Verdict.refuse("finetune_disabled", "this device's policy refuses fine-tune jobs (accept_finetune = false)")
    if not limits.data_dir or not Path(limits.data_dir).exists():
        where = limits.data_dir or "[data] dir is not set"
        return Verdict.refuse("no_data", f"no local training data ({where})")
    if active:
        return Verdict.refuse("busy", f"already running job {active[0]}; one job at a time")
    if accepted_last_day >= limits.max_jobs_per_day:
        return Verdict.refuse("daily_limit", f"{accepted_last_day} job(s) accepted in the last 24 h (cancelled ones "
                                             f"not counted); the limit is {limits.max_jobs_per_day}")
    b = conditions.battery_pct
    if b is not None and not conditions.charging and b < limits.min_battery_pct and not battery_planned:
        return Verdict.refuse("battery_low", f"battery {b:.0f} % is below {limits.min_battery_pct:.0f} % "
                                             "and not charging")
    t = conditions.temp_c
    if t is not None and limits.thermal_limit_c is not None and t >= limits.thermal_limit_c:
        return Verdict.refuse("too_hot", f"{t:.1f} C is at or above the thermal limit {limits.thermal_limit_c:g} C")
    if req.budget_wh is not None and limits.energy_wh is not None and req.budget_wh > limits.energy_wh:
        return Verdict.refuse("budget_exceeded", f"asks for {req.budget_wh:g} Wh; this device allows "
                                                 f"{limits.energy_wh:g} Wh per job")
    if req.power_cap_w is not None and limits.power_cap_w is not None and req.power_cap_w > limits.power_cap_w:
        return Verdict.refuse("power_cap_exceeded", f"asks for {req.power_cap_w:g} W; this device allows "
                                                    f"{limits.power_cap_w:g} W")
    why = unmetered(effective_budget(req, limits)["budget_wh"], conditions.power_reading)
    if why:
        return Verdict.refuse("no_power_reading", why)
    if req.deadline_at <= now:
        return Verdict.refuse("deadline_passed", f"the deadline passed {now - req.deadline_at:.0f} s ago")
    return OK


def unmetered(budget_wh: float | None, power_reading: bool) -> str:
    """Why a job with this energy budget cannot run now ("" when it can): no power source
    gives a reading, so nothing would meter it against the budget."""
    if budget_wh is None or power_reading:
        return ""
    return (f"no power source gives a reading, so the {budget_wh:g} Wh energy budget cannot be enforced "
            "(`edge-agent probe` lists the power sources and their errors)")


def effective_budget(req: FinetuneRequest, limits: DeviceLimits) -> dict[str, float | None]:
    """The budget the job runs under: the command's where given (never above the device's
    limits, which check_finetune enforced), else the device's own."""
    return {"budget_wh": req.budget_wh if req.budget_wh is not None else limits.energy_wh,
            "power_cap_w": req.power_cap_w if req.power_cap_w is not None else limits.power_cap_w}


# ---------------------------------------------------------------- the daily allowance
def counts_against_limit(job: Any) -> bool:
    """Whether an accepted job uses up the daily allowance. A job the coordinator cancelled
    does not: the limit bounds how often the owner's device is put to work, and a cancel is
    the coordinator's decision (a job cancelled or re-planned, a round closed early) -- counting
    it let a coordinator that cancels lock a device out for the rest of the day, which is
    what the year-long soak saw. The work a cancelled job did is bounded anyway by the
    per-job checks every job still passes (energy budget, power cap, battery, temperature)
    and by one job at a time."""
    state = getattr(job, "state", None)
    return getattr(state, "value", state) != "cancelled"


def counted_jobs(jobs: Iterable[Any], now: float) -> dict[str, float]:
    """job id -> created time of the jobs that count against today's limit (the last 24 h)."""
    return {j.job_id: float(j.created) for j in jobs if j.created >= now - DAY_S and counts_against_limit(j)}


@dataclass(frozen=True)
class Allowance:
    """How many more jobs the device takes today, and why it would refuse one now."""

    limit: int
    used: int
    resets_at: float | None = None  # when the oldest counted job leaves the 24-h window
    refuse: str = ""  # a standing refusal (one of REASONS) or ""
    detail: str = ""

    @property
    def jobs_left(self) -> int:
        return max(0, self.limit - self.used)

    def to_facts(self) -> dict[str, Any]:
        """State facts for the state message's `info` (protocol.schema.ALLOWANCE_CHECKS)."""
        body: dict[str, Any] = {"jobs_left": min(self.jobs_left, 100_000), "jobs_limit": min(self.limit, 100_000)}
        if self.resets_at is not None:
            body["jobs_reset_at"] = int(math.ceil(self.resets_at))
        if self.refuse:
            body["refuse"], body["refuse_detail"] = self.refuse, self.detail[:200]
        return body


def daily_allowance(limits: DeviceLimits, counted: Iterable[float], now: float) -> Allowance:
    """The allowance from the created times of the counted jobs (`counted_jobs`)."""
    times = sorted(t for t in counted if t >= now - DAY_S)
    resets_at = times[0] + DAY_S if times else None
    if not limits.accept_finetune:
        return Allowance(limits.max_jobs_per_day, len(times), resets_at, "finetune_disabled",
                         "accept_finetune = false")
    if not limits.data_dir or not Path(limits.data_dir).exists():
        return Allowance(limits.max_jobs_per_day, len(times), resets_at, "no_data",
                         f"no local training data ({limits.data_dir or '[data] dir is not set'})")
    if len(times) >= limits.max_jobs_per_day:
        # the next job is taken once enough of the oldest ones leave the window
        frees = times[len(times) - limits.max_jobs_per_day] + DAY_S if limits.max_jobs_per_day else None
        when = time.strftime("%H:%M UTC", time.gmtime(frees)) if frees is not None else "never (limit 0)"
        return Allowance(limits.max_jobs_per_day, len(times), frees, "daily_limit",
                         f"daily limit {len(times)}/{limits.max_jobs_per_day}, resets {when}")
    return Allowance(limits.max_jobs_per_day, len(times), resets_at)
