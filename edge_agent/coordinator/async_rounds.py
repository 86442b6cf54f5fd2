"""Asynchronous buffered rounds (issue 38; FedBuff, Nguyen et al., AISTATS 2022).

A solar device has energy when its sun shines, not when the coordinator dispatches. An
asynchronous job (params `mode: "async"`, `buffer: K`, `max_staleness: S`) keeps the round
engine's machinery -- selection, the strategy, its screening, the validation gate, one
version per closed round -- and changes three things:

- **A round is one buffer.** It closes as soon as K updates are accepted (or its deadline
  passes), and the next opens at once on the new version with every eligible device that is
  not already training.
- **Devices stay in flight.** A device still training when its round closes is not a
  dropout: it is carried into the next round (a participant row naming its `origin`, the
  round it was dispatched in) and gets no new command. Its update, whose header names the
  origin round and that round's version, is folded into whichever round is open when it
  arrives.
- **Concurrency** (optional `max_concurrency: C`, FedBuff's): a round dispatches at most
  C minus the devices still in flight, so no more than C train at once -- the energy knob.
- **Staleness weighs and bounds.** s = the versions published since the update's base. The
  update's weight is multiplied by 1/sqrt(1 + s) (FedBuff's polynomial staleness function
  with a = 1/2), and an update with s > S is refused as "stale", naming s. A device whose
  version has gone more than S versions stale is released (not carried): it may be selected
  again on the current version.

The device's command carries a deadline of S + 1 rounds' deadlines: the longest its update
can stay useful if every round ran to its deadline. A round whose devices have all passed
that deadline closes (it would otherwise wait for good on devices that died silently), and
a device past it is not carried on.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import InputError
from .records import IN_FLIGHT, RoundRecord, RoundState

MAX_BUFFER = 100_000
MAX_STALENESS = 1_000


@dataclass(frozen=True)
class AsyncMode:
    buffer: int  # K: a round closes once this many updates are accepted
    max_staleness: int  # S: updates more versions behind are refused
    max_concurrency: int | None = None  # C: devices training at once (in flight + new), FedBuff's concurrency

    @classmethod
    def of(cls, params: Mapping[str, Any]) -> AsyncMode | None:
        """The job's asynchronous mode, None for a synchronous job; InputError for bad values."""
        mode = params.get("mode", "sync")
        if mode not in ("sync", "async"):
            raise InputError(f"mode must be 'sync' or 'async', got {str(mode)[:40]!r}")
        if mode == "sync":
            for key in ("buffer", "max_staleness", "max_concurrency"):
                if key in params:
                    raise InputError(f"{key} is a parameter of asynchronous jobs (mode 'async')")
            return None
        values = []
        for key, lo, hi, default in (("buffer", 1, MAX_BUFFER, None), ("max_staleness", 0, MAX_STALENESS, 4)):
            v = params.get(key, default)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise InputError(f"{key} must be an integer in {lo}..{hi} for an asynchronous job, got {v!r}")
            values.append(v)
        c = params.get("max_concurrency")
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or not values[0] <= c <= MAX_BUFFER * 100):
            raise InputError(f"max_concurrency must be an integer >= buffer ({values[0]}), got {c!r}: fewer devices "
                             "training at once than a buffer holds would never fill it")
        return cls(*values, c)

    def new_dispatches(self, per_round: int | None, in_flight: int) -> int | None:
        """How many devices a round may newly dispatch: `per_round` (devices_per_round), and
        at most what keeps the devices training at once within max_concurrency."""
        if self.max_concurrency is None:
            return per_round
        room = max(0, self.max_concurrency - in_flight)
        return room if per_round is None else min(per_round, room)

    def weight(self, staleness: int) -> float:
        """The factor on an update's arrival weight: 1/sqrt(1 + s)."""
        return 1.0 / math.sqrt(1.0 + max(0, staleness))

    def device_deadline(self, started_at: float, deadline_s: float) -> float:
        return started_at + deadline_s * (self.max_staleness + 1)

    def stale_reason(self, staleness: int, base: str) -> str:
        return (f"trained on version {base}, {staleness} version(s) behind the newest; this job takes updates "
                f"at most {self.max_staleness} version(s) old (max_staleness)")


def published_since(rounds: Sequence[RoundRecord], origin: int, current: int) -> int:
    """Versions published by rounds origin..current-1: how stale an update trained on
    round `origin`'s version is when round `current` takes it."""
    return sum(1 for r in rounds if origin <= r.number < current and r.state is RoundState.AGGREGATED)


def carry_over(prev: RoundRecord, rounds: Sequence[RoundRecord], number: int, mode: AsyncMode, *,
               now: float, deadline_s: float) -> tuple[dict[str, int], dict[str, str]]:
    """Who of the closed round `prev` is still training, for round `number`: ({device:
    origin} to carry, {device: why} released -- too stale to be worth waiting for, or past
    the deadline its command carried, by which the device itself gives up)."""
    started = {r.number: r.started_at for r in rounds}
    carried: dict[str, int] = {}
    released: dict[str, str] = {}
    for device in prev.in_flight:
        part = prev.participants[device]
        origin = part.origin or prev.number
        s = published_since(rounds, origin, number)
        if s > mode.max_staleness:
            released[part.device_id] = f"{s} versions stale"
        elif now >= mode.device_deadline(started.get(origin, prev.started_at), deadline_s):
            released[part.device_id] = "past its command's deadline"
        else:
            carried[part.device_id] = origin
    return carried, released


__all__ = ["IN_FLIGHT", "AsyncMode", "carry_over", "published_since"]
