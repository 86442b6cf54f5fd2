"""DP-FedAvg (McMahan et al. 2018, "Learning Differentially Private Recurrent Language
Models"): user-level differential privacy by clipping each device's update and adding
Gaussian noise to the sum.

    dp_fedavg   (sum_i s_i d_i + N(0, (sigma C)^2 I)) / D,   s_i = min(1, C / ||d_i||)

C is the job's `dp_clip`, sigma its `dp_noise` (the noise multiplier) and D a fixed
denominator: the number of devices the round selected (dispatched to), known before any
update arrives -- the paper's "fixed-denominator estimator" with D = qN, the expected count.
Not the number of updates that arrived (that would make the denominator, and so the
sensitivity, depend on who took part). Every update weighs the same: a sample count is not
bounded, so weighting by it would break the sensitivity bound C. A device that trained only
some tensors counts as zero on the others (the denominator is the same for every tensor).

The clip and the noise are one reusable object, `GaussianSum`: any rule whose aggregate is a
clipped sum can take it. It also says how the same noise is spread across devices
(`device_std`): with n devices each adding N(0, (sigma C)^2 / n), the sum carries exactly
N(0, (sigma C)^2) -- the distributed form that sits under secure aggregation, where no party
sees an un-noised sum (coordinator/secagg.py: `release_noised` takes such a sum; the engine's
dp_fedavg rule still adds the noise itself, central DP).

Clipping is enforced here whatever the device did: an update longer than C is scaled to C,
and one longer than C x (1 + tolerance) -- more than the codec's quantisation can explain --
gets a verdict note saying it was clipped at the coordinator.

Streaming: an update's coefficient s_i is known at arrival, so nothing is read at close; the
noise is drawn once, at `finalize`, from the rng the option carries (a CSPRNG-seeded
generator in production: coordinator/privacy.py; a seeded one in tests).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .base import Aggregate, Contribution, DenseUpdate, Load, Member, Partial, Strategy

CLIP_TOLERANCE = 0.05  # what int8 quantisation of a device-clipped update may add to its norm


@dataclass(frozen=True)
class GaussianSum:
    """The Gaussian mechanism on a sum of clipped vectors (module doc)."""

    clip: float  # C
    noise: float  # sigma, the noise multiplier
    denominator: float  # D
    rng: Callable[[], np.random.Generator]  # a generator per draw
    tolerance: float = CLIP_TOLERANCE

    def __post_init__(self) -> None:
        if not (self.clip > 0 and self.noise > 0 and self.denominator > 0):
            raise ValueError("clip, noise and denominator must be positive")

    def coef(self, norm: float) -> float:
        return 1.0 if norm <= self.clip or norm == 0 else self.clip / norm

    def over(self, norm: float) -> bool:
        """Longer than the device should have sent (it did not clip, or clipped at another C)."""
        return norm > self.clip * (1.0 + self.tolerance)

    @property
    def std(self) -> float:
        """The noise's standard deviation on the sum, per coordinate: sigma C."""
        return self.noise * self.clip

    def device_std(self, devices: int) -> float:
        """Each of `devices` devices' share of the noise (distributed DP): their sum's std is `std`."""
        return self.std / math.sqrt(devices)

    def draw(self, size: int) -> np.ndarray:
        return self.rng().normal(0.0, self.std, size)

    def release(self, clipped_sum: np.ndarray) -> np.ndarray:
        """The noised mean: (sum + N(0, (sigma C)^2)) / D."""
        return (clipped_sum + self.draw(clipped_sum.size)) / self.denominator

    def release_noised(self, noised_sum: np.ndarray) -> np.ndarray:
        """The mean of a sum that already carries the noise (each device added N(0, device_std^2)
        under secure aggregation): no noise added here, the same fixed denominator."""
        return np.asarray(noised_sum, np.float64) / self.denominator


class DpFedAvg(Strategy):
    name = "dp_fedavg"
    summary = "user-level DP: each update clipped to --dp-clip, Gaussian noise on the sum (McMahan et al. 2018)"
    reads_at_close = "outliers"  # none: coefficients are known at arrival

    def __init__(self, options, evidence) -> None:  # type: ignore[no-untyped-def]
        super().__init__(options, evidence)
        if options.dp is None:
            raise ValueError("dp_fedavg needs a private job (--dp-clip and --dp-noise)")
        self.dp: GaussianSum = options.dp

    def member(self, c: Contribution) -> Member:
        coef = self.dp.coef(c.update.norm)
        return Member(weight=c.weight, norm=c.update.norm, kept=c.update.kept, present=c.update.present,
                      label_counts=c.label_counts, coef=coef, mean_weight=1.0)

    def finalize(self, partial: Partial, load: Load) -> Aggregate:
        if not partial.members:
            raise ValueError("no updates to aggregate")
        norms = {d: m.norm for d, m in partial.members.items()}
        return Aggregate(self.dp.release(partial.vec), self._shares(norms), info=self._info(norms),
                         notes=self._notes(norms))

    def reference(self, updates: Sequence[DenseUpdate]) -> Aggregate:
        total = np.zeros(self.evidence.layout.size, dtype=np.float64)
        norms = {}
        for u in updates:
            norms[u.device] = float(np.linalg.norm(u.vec))
            total += self.dp.coef(norms[u.device]) * np.asarray(u.vec, np.float64)
        return Aggregate(self.dp.release(total), self._shares(norms), info=self._info(norms),
                         notes=self._notes(norms))

    @staticmethod
    def _shares(norms: dict[str, float]) -> dict[str, float]:
        return {d: 1.0 / len(norms) for d in norms}

    def _info(self, norms: dict[str, float]) -> dict[str, object]:
        return {"dp_denominator": self.dp.denominator, "dp_noise_std": self.dp.std / self.dp.denominator,
                "dp_clipped": sum(n > self.dp.clip for n in norms.values()),
                "dp_clipped_at_coordinator": sum(self.dp.over(n) for n in norms.values())}

    def _notes(self, norms: dict[str, float]) -> dict[str, str]:
        return {d: f"clipped at the coordinator: norm {n:.4g} > dp_clip {self.dp.clip:g} (the device did not clip)"
                for d, n in norms.items() if self.dp.over(n)}
