"""Energy from power samples: integration rules (pure) and a running meter.

Rules, per interval between two consecutive samples:
- a counter or modelled source whose reading covers exactly that interval gives its own
  energy (RAPL energy_uj / energy_now differences / CPU jiffies: no sampling error);
- a sample that is an average over its own interval is held over the interval;
- an instantaneous reading that closes a homogeneous phase (a training step, a duty-cycle
  gap) is held backwards: read right after the phase, it reflects that phase, while the
  opening reading reflects the one before (a trapezoid would halve a step's excess power);
- otherwise the trapezoid rule.
Energy attributable to the job is what lies above idle power, interval by interval.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .sources import PowerSample


def interval_energy_j(prev: PowerSample, cur: PowerSample, *, hold_end: bool = False) -> float:
    """Joules between two samples (see the module docstring for the rules)."""
    dt = cur.t - prev.t
    if dt <= 0:
        return 0.0
    if cur.interval_j is not None and cur.since_t == prev.t:
        return cur.interval_j
    if cur.averaged or hold_end:
        return cur.watts * dt
    return 0.5 * (prev.watts + cur.watts) * dt


def above_idle_j(energy_j: float, seconds: float, idle_w: float) -> float:
    """The part of an interval's energy above idle draw (never negative)."""
    return max(0.0, energy_j - idle_w * seconds)


def integrate(samples: list[PowerSample], idle_w: float = 0.0) -> tuple[float, float]:
    """(total J, above-idle J) over a list of samples with the trapezoid/counter rules."""
    total = job = 0.0
    for prev, cur in zip(samples, samples[1:], strict=False):
        joules = interval_energy_j(prev, cur)
        total += joules
        job += above_idle_j(joules, cur.t - prev.t, idle_w)
    return total, job


@dataclass
class EnergyMeter:
    """Accumulates total and above-idle energy from a stream of samples.

    If idle power is not known up front (no board profile), the first sample, taken
    before training starts, serves as the baseline. `start_t` is when metering began: a
    counter's first usable reading covers time since its priming read, and counts if that
    priming happened at or after `start_t`.
    """

    idle_w: float | None = None
    start_t: float | None = None
    idle_from: str = "given"
    total_j: float = 0.0
    job_j: float = 0.0
    peak_w: float = 0.0
    measured_s: float = 0.0
    last: PowerSample | None = None
    seconds_by_source: dict[str, float] = field(default_factory=dict)
    failed_reads: int = 0
    consecutive_failures: int = 0

    def add(self, sample: PowerSample | None, *, hold_end: bool = False) -> float:
        """Fold in one sample (None = every source failed); returns the interval's joules."""
        if sample is None:
            self.failed_reads += 1
            self.consecutive_failures += 1
            return 0.0  # the gap is integrated when a reading returns
        self.consecutive_failures = 0
        if self.idle_w is None:
            self.idle_w, self.idle_from = sample.watts, f"baseline from {sample.source}"
        self.peak_w = max(self.peak_w, sample.watts)
        prev, self.last = self.last, sample
        if prev is None:
            covered = sample.interval_j is not None and sample.since_t is not None
            if not (covered and self.start_t is not None and sample.since_t >= self.start_t):  # type: ignore[operator]
                return 0.0
            prev = PowerSample(t=sample.since_t, watts=sample.watts, source=sample.source)  # type: ignore[arg-type]
        seconds = sample.t - prev.t
        if seconds <= 0:
            return 0.0
        joules = interval_energy_j(prev, sample, hold_end=hold_end)
        self.total_j += joules
        self.job_j += above_idle_j(joules, seconds, self.idle_w)
        self.measured_s += seconds
        self.seconds_by_source[sample.source] = (
            self.seconds_by_source.get(sample.source, 0.0) + seconds
        )
        return joules

    def used_j(self, basis: str) -> float:
        return self.job_j if basis == "job" else self.total_j

    @property
    def main_source(self) -> str | None:
        if not self.seconds_by_source:
            return self.last.source if self.last is not None else None
        return max(self.seconds_by_source, key=lambda k: self.seconds_by_source[k])
