"""Time as the governor sees it: a small interface, the real clock, and a manual one.

The governor only ever asks a `Clock` for time and for sleeps, so a test (or a benchmark
that replays a power model) can drive hours of battery drain and solar charging in
milliseconds with `ManualClock`, while the daemon uses `SystemClock`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Protocol, runtime_checkable


@runtime_checkable
class Clock(Protocol):
    """What the governor needs from time."""

    def monotonic(self) -> float:
        """Seconds on a clock that never jumps (for durations and energy integration)."""
        ...

    def now(self) -> float:
        """Wall-clock time, epoch seconds (for deadlines and solar windows)."""
        ...

    def sleep(self, seconds: float) -> None:
        """Block for `seconds` (duty-cycle gaps, polling while paused)."""
        ...


class SystemClock:
    """The real clock: time.monotonic / time.time / time.sleep."""

    def monotonic(self) -> float:
        return time.monotonic()

    def now(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


AdvanceListener = Callable[[float, bool], None]


class ManualClock:
    """A clock that moves only when told to; listeners see every move.

    `advance(s)` models the caller being busy for `s` seconds (e.g. a training step);
    `sleep(s)` is what the governor calls when it idles. Listeners receive
    `(seconds, sleeping)` after time has moved, so a simulated device can accrue energy
    at its busy or idle power and rewrite its sensor files.
    """

    def __init__(
        self, *, start_epoch: float = 1_700_000_000.0, start_monotonic: float = 1000.0
    ) -> None:
        self._mono = float(start_monotonic)
        self._epoch = float(start_epoch)
        self._listeners: list[AdvanceListener] = []
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self._mono

    def now(self) -> float:
        return self._epoch

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self._move(seconds, sleeping=True)

    def advance(self, seconds: float) -> None:
        self._move(seconds, sleeping=False)

    def on_advance(self, listener: AdvanceListener) -> None:
        self._listeners.append(listener)

    def _move(self, seconds: float, *, sleeping: bool) -> None:
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"cannot move a clock by {seconds!r} seconds")
        self._mono += seconds
        self._epoch += seconds
        for listener in list(self._listeners):
            listener(seconds, sleeping)
