"""The job's own energy: CPU-seconds of its process tree x the board's watts per busy core.

Why not the power source's figure: a sensor on the input rail (or the CPU model over
/proc/stat) measures the whole board, every process on it. On a shared or busy device that
charged other processes' work to the job -- under background load a 0.1 Wh budget was
refused twice and a 0.05 Wh job ended at 116 % with nothing trained. The job's own CPU time
(this process, all its threads, and the child processes it has waited for) is counted by the
kernel in nanoseconds and does not move with anyone else's load, so "process" is the
default scope (Budget.energy_scope) and what the board's source measures is reported beside
it. "device" charges that figure instead: battery-wide accounting, for a battery that must
also carry whatever else runs.

watts per busy core = (the board profile's load_w - idle_w) / cores: what one busy core adds
above idle. Energy above idle ("job" basis) = CPU-seconds x that; the "total" basis adds the
idle power over the time the job ran.
"""

from __future__ import annotations

import math
import resource
import time
from collections.abc import Callable

from ..errors import ConfigError


def process_cpu_seconds() -> float:
    """CPU-seconds of this process (all threads) and of the children it has waited for, to
    the nanosecond / microsecond (os.times counts 10 ms clock ticks: too coarse for a
    selection probe of a few milliseconds)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


class ProcessEnergy:
    """Accumulates the job's CPU-seconds between samples and prices them.

    `cpu_seconds` is the counter (tests pass a virtual one); `sample(t)` is called at the
    governor's sampling instants, `t` on the governor's clock."""

    def __init__(self, *, watts_per_cpu: float, cpu_seconds: Callable[[], float] = process_cpu_seconds) -> None:
        if not (isinstance(watts_per_cpu, int | float) and math.isfinite(watts_per_cpu) and watts_per_cpu > 0):
            raise ConfigError(f"watts_per_cpu: must be a finite number > 0, got {watts_per_cpu!r}")
        self.watts_per_cpu = float(watts_per_cpu)
        self._cpu = cpu_seconds
        self._prev: tuple[float, float] | None = None  # (t, CPU-seconds) at the last sample
        self.cpu_s = 0.0
        self.elapsed_s = 0.0

    def sample(self, t: float) -> None:
        cpu = float(self._cpu())
        if self._prev is not None:
            self.elapsed_s += max(0.0, t - self._prev[0])
            self.cpu_s += max(0.0, cpu - self._prev[1])  # a counter never runs backwards
        self._prev = (t, cpu)

    @property
    def job_j(self) -> float:
        """Energy above idle: CPU-seconds x watts per busy core."""
        return self.cpu_s * self.watts_per_cpu

    def total_j(self, idle_w: float | None) -> float:
        """Above idle, plus the idle power over the time the job ran."""
        return self.job_j + (idle_w or 0.0) * self.elapsed_s
