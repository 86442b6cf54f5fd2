"""Sensor-node reading for long-running monitors, on top of SysRoot.

SysRoot appends every failure to a list; a governor polling a flaky INA every step for
days would grow that list without bound. `NodeReader` drains it into a short ring of
recent problems plus a counter, which is what a report needs.
"""

from __future__ import annotations

import math
import os
from collections import deque

from ..hardware.sysfs import MAX_PROC_BYTES, SysRoot

RECENT_PROBLEMS = 20


class NodeReader:
    """Reads sysfs/procfs nodes under a root; never raises on bad nodes."""

    def __init__(self, root: str | os.PathLike[str] | SysRoot = "/") -> None:
        # A private SysRoot: draining must never clear problems a caller collected.
        self.sys = SysRoot(root.root if isinstance(root, SysRoot) else root)
        self.recent_problems: deque[str] = deque(maxlen=RECENT_PROBLEMS)
        self.problem_count = 0

    def note(self, where: str, reason: str) -> None:
        self.problem_count += 1
        self.recent_problems.append(f"{where}: {reason}")

    def _drain(self) -> None:
        items = self.sys.problems.items
        if items:
            self.problem_count += len(items)
            self.recent_problems.extend(items)
            items.clear()

    def int(self, rel: str) -> int | None:
        value = self.sys.read_int(rel)
        self._drain()
        return value

    def text(self, rel: str, *, limit: int | None = None) -> str | None:
        value = self.sys.read_text(rel) if limit is None else self.sys.read_text(rel, limit=limit)
        self._drain()
        return value

    def proc_text(self, rel: str) -> str | None:
        return self.text(rel, limit=MAX_PROC_BYTES)

    def exists(self, rel: str) -> bool:
        return self.sys.exists(rel)

    def listdir(self, rel: str) -> list[str]:
        entries = self.sys.listdir(rel)
        self._drain()
        return entries


def plausible(value: float | None, low: float, high: float) -> bool:
    """A finite number within [low, high]; sensors return junk often enough to check."""
    return value is not None and math.isfinite(value) and low <= value <= high
