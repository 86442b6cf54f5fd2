"""Multi-Krum (Blanchard et al. 2017): score each update by the summed squared distances to
its N - f - 2 nearest others (f = floor(krum_fraction x N)), average the N - f best,
unweighted; the others are rejected ("krum_excluded"). Guarantees need N > 2f + 2; with
N <= 2 it averages everything.

Cost: the Gram matrix G_ij = <d_i, d_j> of every pair, built at close by dense coordinate
blocks of N rows (streaming.py `block_gram`): O(N^2 P) arithmetic and every stored update
read once or twice. Meant for rounds of up to a few hundred updates.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ..streaming import block_gram
from .base import Aggregate, DenseUpdate, Load, Partial, Strategy, present_mask


def krum_select(gram: np.ndarray, fraction: float) -> list[int]:
    """Indices of the N - f updates with the smallest sums of squared distances to their
    N - f - 2 nearest others, from the Gram matrix."""
    n = gram.shape[0]
    if n <= 2:
        return list(range(n))
    f = int(math.floor(fraction * n))
    sq = np.diag(gram)
    dist = np.maximum(sq[:, None] + sq[None, :] - 2 * gram, 0.0)
    np.fill_diagonal(dist, np.inf)
    nb = max(1, n - f - 2)
    scores = np.sort(dist, axis=1)[:, :nb].sum(axis=1)
    keep = max(1, n - f)
    return sorted(int(i) for i in np.argsort(scores, kind="stable")[:keep])


class MultiKrum(Strategy):
    name = "multi_krum"
    summary = "mean of the N - f updates closest to their neighbours (Blanchard et al. 2017); O(N^2) at close"
    reads_at_close = "all"

    def member(self, c):  # type: ignore[no-untyped-def]
        m = super().member(c)
        m.coef, m.mean_weight = 0.0, 1.0  # the chosen ones are summed at close
        return m

    def _result(self, devices: list[str], chosen: list[int], vec: np.ndarray) -> Aggregate:
        picked = {devices[i] for i in chosen}
        return Aggregate(vec, {d: (1.0 / len(chosen) if d in picked else 0.0) for d in devices},
                         excluded={d: "krum_excluded: not among the Multi-Krum selection"
                                   for d in devices if d not in picked})

    def finalize(self, partial: Partial, load: Load) -> Aggregate:
        devices = list(partial.members)
        if not devices:
            raise ValueError("no updates to aggregate")
        kept = sum(m.kept for m in partial.members.values())
        gram = block_gram([lambda d=d: load(d) for d in devices], kept, partial.layout.size)
        chosen = krum_select(gram, self.options.krum_fraction)
        vec = np.zeros(partial.layout.size, dtype=np.float64)
        for i in chosen:
            sp = load(devices[i])
            vec[sp.idx] += sp.vals.astype(np.float64)
        return self._result(devices, chosen, vec / len(chosen))

    def reference(self, updates: Sequence[DenseUpdate]) -> Aggregate:
        layout = self.evidence.layout
        stack = np.stack([np.where(present_mask(u.present, layout), u.vec, 0.0) for u in updates])
        chosen = krum_select(stack @ stack.T, self.options.krum_fraction)
        return self._result([u.device for u in updates], chosen, stack[chosen].mean(axis=0))
