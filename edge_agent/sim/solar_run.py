"""What one simulated solar run measured (solar_fleet.simulate): the accuracy after every
published version, the energy spent, the battery floors, the refusals and the forecast's
error; and the figures the bench compares (time and energy to a target accuracy)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class SolarRun:
    mode: str
    params: dict[str, Any]
    times: list[float] = field(default_factory=list)  # hours since start, at each published version
    accuracy: list[float] = field(default_factory=list)  # held-out accuracy of that version
    energy_wh: list[float] = field(default_factory=list)  # fleet's training energy (above idle) so far
    base_accuracy: float = 0.0
    published: int = 0
    failed_rounds: int = 0
    updates_sent: int = 0
    accepted: int = 0
    rejected: dict[str, int] = field(default_factory=dict)  # reason -> count
    refused_battery: int = 0
    jobs_abandoned: int = 0  # stopped at a deadline or lost in a brown-out
    below_floor_training: int = 0  # devices that went below their floor because of training
    below_floor_load: int = 0  # devices below their floor from the board's load alone
    floor_pauses: int = 0  # training paused at the floor (the governor's rule)
    brownouts: int = 0  # devices whose battery reached 0 (load alone)
    lowest_pct: list[float] = field(default_factory=list)  # per device, its lowest charge over the run (%)
    lowest_at_h: list[float] = field(default_factory=list)  # and when (hours since start)
    train_energy_wh: float = 0.0
    harvest_wh: float = 0.0  # what the fleet's panels could give over the run (the same in every mode)
    forecast: dict[str, float] = field(default_factory=dict)  # solar_plan.summarise
    forecasts: int = 0  # forecast_surplus calls
    wall_s: float = 0.0
    state_reports: int = 0
    profile: dict[str, float] = field(default_factory=dict)  # wall s per part of the loop

    def smoothed(self, k: int = 5) -> np.ndarray:
        """A running mean of the last `k` versions' accuracy."""
        acc = np.asarray(self.accuracy, np.float64)
        if not len(acc):
            return acc
        c = np.cumsum(np.insert(acc, 0, 0.0))
        idx = np.arange(1, len(acc) + 1)
        lo = np.maximum(0, idx - k)
        return (c[idx] - c[lo]) / (idx - lo)

    def final(self, hours: float = 24.0) -> float:
        """Mean accuracy of the versions published in the last `hours` (the last one if none)."""
        if not self.times:
            return self.base_accuracy
        t = np.asarray(self.times)
        sel = t >= t[-1] - hours
        return float(np.mean(np.asarray(self.accuracy)[sel]))

    def time_to(self, target: float, k: int = 5) -> float | None:
        """Hours until the smoothed accuracy first reaches `target` (k=1: any one version)."""
        hit = np.nonzero(self.smoothed(k) >= target - 1e-9)[0]
        return float(self.times[hit[0]]) if len(hit) else None

    def energy_to(self, target: float, k: int = 5) -> float | None:
        hit = np.nonzero(self.smoothed(k) >= target - 1e-9)[0]
        return float(self.energy_wh[hit[0]]) if len(hit) else None
