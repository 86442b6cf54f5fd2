"""A rate limit for log lines a hostile device could otherwise multiply."""

from __future__ import annotations

import time
from collections.abc import Callable


class LineBudget:
    """At most `per_minute` log lines a minute; `take()` says whether to log this one and how
    many were not logged since the last that was (to count them into it)."""

    def __init__(self, *, per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_minute, self._clock = per_minute, clock
        self._start, self._lines, self._hidden = -1e18, 0, 0

    def take(self) -> tuple[bool, int]:
        now = self._clock()
        if now - self._start >= 60.0:
            self._start, self._lines = now, 0
        if self._lines >= self.per_minute:
            self._hidden += 1
            return False, 0
        hidden, self._hidden = self._hidden, 0
        self._lines += 1
        return True, hidden
