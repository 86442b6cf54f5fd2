"""Coordinate-wise rules: the median, and the trimmed mean (Yin et al. 2018). Unweighted (a
sample count is exactly what a liar inflates); a tensor an update does not carry counts as
zero there.

    median        per coordinate, the mean of the middle one or two values
    trimmed_mean  per coordinate, drop floor(trim_fraction x N) values at each end, mean the rest
                  (trims nothing while N < 1 / trim_fraction: then it is the plain mean)

Streaming: arrival only counts each coordinate's signs (8 bytes per coordinate). At close
the "hot" coordinates -- those whose sorted window can hold a non-zero -- are known from the
counts, and only their entries are read back from the stored updates (streaming.py
`block_window_mean`): every stored update is read once or a few times.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ..streaming import block_window_mean
from .base import Aggregate, DenseUpdate, Load, Partial, Strategy, present_mask


class _Window(Strategy):
    reads_at_close = "all"
    keeps_signs = True

    def window(self, n: int) -> tuple[int, int]:
        raise NotImplementedError

    def member(self, c):  # type: ignore[no-untyped-def]
        m = super().member(c)
        m.coef = 0.0  # nothing folded: the window is taken at close
        m.mean_weight = 1.0
        return m

    def finalize(self, partial: Partial, load: Load) -> Aggregate:
        devices = list(partial.members)
        if not devices:
            raise ValueError("no updates to aggregate")
        lo, hi = self.window(len(devices))
        kept = sum(m.kept for m in partial.members.values())
        vec = block_window_mean([lambda d=d: load(d) for d in devices], kept, partial.layout.size, lo, hi,
                                signs=partial.signs)
        return Aggregate(vec, {d: 1.0 / len(devices) for d in devices}, info={"trimmed_each_end": lo})

    def reference(self, updates: Sequence[DenseUpdate]) -> Aggregate:
        layout = self.evidence.layout
        stack = np.stack([np.where(present_mask(u.present, layout), u.vec, 0.0) for u in updates])
        lo, hi = self.window(len(updates))
        vec = np.sort(stack, axis=0)[lo:hi].mean(axis=0)
        return Aggregate(vec, {u.device: 1.0 / len(updates) for u in updates}, info={"trimmed_each_end": lo})


class Median(_Window):
    name = "median"
    summary = "coordinate-wise median, unweighted; tolerates floor((N-1)/2) liars among N >= 3"

    def window(self, n: int) -> tuple[int, int]:
        return (n - 1) // 2, n // 2 + 1


class TrimmedMean(_Window):
    name = "trimmed_mean"
    summary = "coordinate-wise mean after dropping trim_fraction (0.2) at each end (Yin et al. 2018)"

    def window(self, n: int) -> tuple[int, int]:
        cut = int(math.floor(self.options.trim_fraction * n))
        return cut, n - cut
