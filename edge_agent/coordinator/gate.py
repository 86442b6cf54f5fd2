"""The validation gate: no version is published that the server set shows to be worse.

Every candidate is scored on the server set's gate split against the version it would
replace, sample by sample. Two versions' accuracies on the same samples differ only where
they disagree, so the test is on the disagreements (McNemar's): b samples the candidate gets
right and the current one wrong, c the reverse. The candidate is worse when

    c - b > z x sqrt(b + c)     (z = 1.64: one-sided 5 %)   and   (c - b) / N > min_drop

-- significantly and by more than min_drop (0.5 point) -- so an honest round that moves
accuracy by noise is never stopped, and a poisoned one that costs points is. A worse
candidate is retried at a half and a quarter of its step (the round's direction may be
right and its length wrong: a late, noisy round); if even the quarter step is worse, the
round publishes nothing and says why. The gate's score is the version's accuracy everywhere
(status, dashboard, plateau rule, rollback).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

STEP_SCALES = (1.0, 0.5, 0.25)


@dataclass(frozen=True)
class GateVerdict:
    ok: bool
    accuracy: float  # the candidate's accuracy on the gate split
    current: float  # the current version's
    better: int  # b: samples only the candidate gets right
    worse: int  # c: samples only the current version gets right
    samples: int

    def describe(self) -> str:
        return (f"server set: {100 * self.accuracy:.2f} % vs {100 * self.current:.2f} % now "
                f"({self.samples} samples; {self.better} newly right, {self.worse} newly wrong)")


@dataclass(frozen=True, kw_only=True)
class ValidationGate:
    z: float = 1.64
    min_drop: float = 0.005

    def __post_init__(self) -> None:
        if not (math.isfinite(self.z) and self.z >= 0) or not 0 <= self.min_drop < 1:
            raise ValueError(f"gate needs z >= 0 and 0 <= min_drop < 1, got {self.z}, {self.min_drop}")

    def judge(self, candidate: np.ndarray, current: np.ndarray) -> GateVerdict:
        """Compare per-sample correctness (bool arrays over the same gate samples)."""
        candidate, current = np.asarray(candidate, bool), np.asarray(current, bool)
        if candidate.shape != current.shape or not candidate.size:
            raise ValueError("the gate compares correctness over the same, non-empty set of samples")
        b = int((candidate & ~current).sum())
        c = int((~candidate & current).sum())
        n = int(candidate.size)
        worse = c - b > self.z * math.sqrt(max(b + c, 1)) and (c - b) / n > self.min_drop
        return GateVerdict(not worse, float(candidate.mean()), float(current.mean()), b, c, n)
