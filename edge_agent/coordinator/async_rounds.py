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
- **Staleness weighs and bounds.** s = the versions published since the update's base. The
  update's weight is multiplied by 1/sqrt(1 + s) (FedBuff's polynomial staleness function
  with a = 1/2), and an update with s > S is refused as "stale", naming s. A device whose
  version has gone more than S versions stale is released (not carried): it may be selected
  again on the current version.

The device's command carries a deadline of S + 1 rounds' deadlines: the longest its update
can stay useful if every round ran to its deadline.
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

    @classmethod
    def of(cls, params: Mapping[str, Any]) -> AsyncMode | None:
        """The job's asynchronous mode, None for a synchronous job; InputError for bad values."""
        mode = params.get("mode", "sync")
        if mode not in ("sync", "async"):
            raise InputError(f"mode must be 'sync' or 'async', got {str(mode)[:40]!r}")
        if mode == "sync":
            for key in ("buffer", "max_staleness"):
                if key in params:
                    raise InputError(f"{key} is a parameter of asynchronous jobs (mode 'async')")
            return None
        values = []
        for key, lo, hi, default in (("buffer", 1, MAX_BUFFER, None), ("max_staleness", 0, MAX_STALENESS, 4)):
            v = params.get(key, default)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise InputError(f"{key} must be an integer in {lo}..{hi} for an asynchronous job, got {v!r}")
            values.append(v)
        return cls(*values)

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


def carry_over(prev: RoundRecord, rounds: Sequence[RoundRecord], number: int,
               mode: AsyncMode) -> tuple[dict[str, int], dict[str, int]]:
    """Who of the closed round `prev` is still training, for round `number`: ({device:
    origin} to carry, {device: staleness} released as too stale to be worth waiting for)."""
    carried: dict[str, int] = {}
    released: dict[str, int] = {}
    for device in prev.in_flight:
        part = prev.participants[device]
        origin = part.origin or prev.number
        s = published_since(rounds, origin, number)
        if s > mode.max_staleness:
            released[part.device_id] = s
        else:
            carried[part.device_id] = origin
    return carried, released


__all__ = ["IN_FLIGHT", "AsyncMode", "carry_over", "published_since"]
