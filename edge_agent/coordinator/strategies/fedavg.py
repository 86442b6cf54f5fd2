"""FedAvg (McMahan et al. 2017) with bounded weights, and its clipped form.

    fedavg          sum_i w_i d_i / sum_i w_i
    fedavg_clipped  sum_i w_i s_i d_i / sum_i w_i,  s_i = min(1, C / ||d_i||)

w_i is the update's sample count after the device's and the job's caps (at arrival) and the
round's cap (`Strategy.round_cap`, at close). C = clip_mult x the round's reference norm:
the median of the round's norms, or the model lineage's recent median when that is larger
(1x in rounds of <= small_round updates, where no majority outvotes a long update).

Streaming: each update is folded with its arrival weight as it arrives; at close only the
members whose weight exceeds the round cap, or whose norm exceeds C, are read again.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .base import Aggregate, DenseUpdate, Load, Partial, Strategy, dense_mean, shares


class FedAvg(Strategy):
    name = "fedavg"
    summary = "sample-weighted mean, weights capped at 2x the round's lower median (McMahan et al. 2017)"
    reads_at_close = "outliers"

    def coefficients(self, weights: dict[str, float], norms: dict[str, float]) -> dict[str, tuple[float, float]]:
        """device -> (coef, mean weight) for the round, from arrival weights and norms."""
        cap = self.round_cap(list(weights.values()))
        return {d: (min(w, cap), min(w, cap)) for d, w in weights.items()}

    def finalize(self, partial: Partial, load: Load) -> Aggregate:
        if not partial.members:
            raise ValueError("no updates to aggregate")
        coefs = self.coefficients({d: m.weight for d, m in partial.members.items()},
                                  {d: m.norm for d, m in partial.members.items()})
        decoded = partial.readjust(coefs, load)
        info = {"decoded_at_close": decoded,
                "weights_capped": sum(coefs[d][1] < m.weight for d, m in partial.members.items())}
        return Aggregate(partial.mean(), shares({d: c[1] for d, c in coefs.items()}), info=info | self._info(coefs))

    def _info(self, coefs: dict[str, tuple[float, float]]) -> dict[str, object]:
        return {}

    def reference(self, updates: Sequence[DenseUpdate]) -> Aggregate:
        coefs = self.coefficients({u.device: u.weight for u in updates},
                                  {u.device: float(np.linalg.norm(u.vec)) for u in updates})
        vec = dense_mean(updates, [coefs[u.device][0] for u in updates], [coefs[u.device][1] for u in updates],
                         self.evidence.layout)
        return Aggregate(vec, shares({d: c[1] for d, c in coefs.items()}))


class ClippedFedAvg(FedAvg):
    name = "fedavg_clipped"
    summary = "FedAvg with each update's norm clipped at 2x the round's median norm (1x in rounds of <= 3)"

    def bound(self, norms: Sequence[float]) -> float:
        center = float(np.median(norms))
        hist = self.evidence.history_norm
        if hist is not None and hist > center:
            center = hist
        mult = 1.0 if len(norms) <= self.options.small_round else self.options.clip_mult
        return mult * center

    def coefficients(self, weights: dict[str, float], norms: dict[str, float]) -> dict[str, tuple[float, float]]:
        capped = super().coefficients(weights, norms)
        bound = self.bound(list(norms.values()))
        self._bound = bound
        return {d: (w * (1.0 if norms[d] <= bound or norms[d] == 0 else bound / norms[d]), m)
                for d, (w, m) in capped.items()}

    def _info(self, coefs: dict[str, tuple[float, float]]) -> dict[str, object]:
        return {"clip_bound": float(self._bound), "clipped": sum(c < m for c, m in coefs.values())}
