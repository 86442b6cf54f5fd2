"""The round engine's streaming state and robust screening (issues 17, 18): the part of
`RoundEngine` between receiving an update and aggregating a round, as a mixin over the
engine's registry, policy and head cache. The maths is in streaming.py and robust.py.

Per open round the engine holds a `RunningSum` (rebuilt from the stored payloads on first
touch after a restart), the job's accepted-norm history, and per (job, version) the unit
step that produced the version (for the optional direction rule).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from ..atomic import CorruptFileError
from ..errors import InputError
from ..updates.errors import UpdateError
from ..updates.wire import unpack_update
from .aggregate import check_tensor_table
from .records import Job, UpdateRecord, UpdateStatus, load_arrays
from .streaming import (
    HotCache,
    Layout,
    RunningSum,
    Sparse,
    aggregate_updates,
    decode_sparse,
    direction_check,
    norm2,
    sparse_from_dense,
)

if TYPE_CHECKING:
    from .registry import Registry
    from .round_types import RoundPolicy

log = logging.getLogger("edge_agent.coordinator.rounds")  # the engine's log: one place to watch


class RobustRounds:
    """Mixin of RoundEngine (which sets every attribute below in its __init__)."""

    registry: Registry
    policy: RoundPolicy
    clock: Callable[[], float]
    _layouts: dict[tuple[str, str], Layout]
    _sums: dict[tuple[str, int], RunningSum]
    _unreadable: dict[tuple[str, int], dict[str, str]]
    _history: dict[tuple[str, int], float | None]
    _steps: dict[tuple[str, str, str], np.ndarray | None]
    _cosines: dict[tuple[str, str], list[float]]

    def _head(self, name: str, version: str) -> tuple[Any, dict[str, np.ndarray]]:
        raise NotImplementedError

    def _layout(self, name: str, version: str) -> Layout:
        if (name, version) not in self._layouts:
            if len(self._layouts) > 16:
                self._layouts.clear()
            self._layouts[(name, version)] = Layout(self._head(name, version)[1])
        return self._layouts[(name, version)]

    def _sparse(self, rec: UpdateRecord, layout: Layout) -> Sparse:
        """A stored update, decoded (CorruptFileError / InputError if it cannot be)."""
        data = self.registry.load_payload(rec)
        try:
            if rec.delta_path is not None and rec.delta_path.endswith(".npz"):  # a pre-streaming row
                delta = load_arrays(data, where=rec.delta_path)
                check_tensor_table(delta, layout.shapes)
                return sparse_from_dense(delta, layout)
            _, encoded = unpack_update(data, max_bytes=self.policy.max_update_bytes)
            check_tensor_table({e.spec.name: e.spec.shape for e in encoded}, layout.shapes, subset=True)
            return decode_sparse(encoded, layout)
        except UpdateError as exc:
            raise CorruptFileError(f"{rec.delta_path}: stored update does not decode ({exc})") from None

    def _past_norm(self, job_id: str, number: int) -> float | None:
        """Median accepted norm of the job's previous rounds (None: no history yet)."""
        key = (job_id, number)
        if key not in self._history:
            norms = self.registry.job_norm_history(job_id, number)
            self._history[key] = float(np.median(norms)) if norms else None
        return self._history[key]

    def _foldable(self, job_id: str, number: int, norm: float) -> bool:
        """Not folded: an update screening will reject on history alone (keeps the sum clean)."""
        past = self._past_norm(job_id, number)
        return past is None or norm <= self.policy.history_k * past

    def _running(self, job_id: str, number: int, layout: Layout) -> RunningSum:
        """The round's running sum; rebuilt from the stored payloads when this process has
        none (after a restart): O(N) once, then O(1) per update."""
        key = (job_id, number)
        if key not in self._sums:
            acc, bad = RunningSum(layout.size), {}
            for rec in self.registry.list_updates(job_id, number, UpdateStatus.PENDING):
                if rec.norm is None or not self._foldable(job_id, number, rec.norm):
                    continue  # legacy rows and history outliers are handled at close
                try:
                    acc.fold(rec.device_id, self._sparse(rec, layout),
                             rec.weight if rec.weight is not None else float(rec.num_samples))
                except (CorruptFileError, InputError) as exc:
                    bad[rec.device_id] = str(exc)
            self._sums[key], self._unreadable[key] = acc, bad
        return self._sums[key]

    def _fold(self, job: Job, base_version: str, number: int, device: str, sp: Sparse, weight: float) -> None:
        acc = self._running(job.id, number, self._layout(job.model_name, base_version))
        if self._foldable(job.id, number, sp.norm):
            acc.fold(device, sp, weight)

    def _forget(self, job_id: str, number: int) -> None:
        for cache in (self._sums, self._unreadable, self._history):
            cache.pop((job_id, number), None)

    def _step(self, job_id: str, model: str, version: str) -> np.ndarray | None:
        """The unit vector of the step that produced `version` (version - its parent), when
        this job published it; None otherwise (a job's first round)."""
        key = (job_id, model, version)
        if key not in self._steps:
            if len(self._steps) >= 4:  # a head-sized float64 each (8 MB at 1M parameters): the oldest goes
                self._steps.pop(next(iter(self._steps)))
            mv, step = self.registry.get_model(model, version), None
            if mv.job_id == job_id and mv.parent is not None:
                layout = self._layout(model, version)
                new, old = self._head(model, version)[1], self._head(model, mv.parent)[1]
                vec = np.concatenate([np.asarray(new[n], np.float64).ravel() - np.asarray(old[n], np.float64).ravel()
                                      for n in layout.names])
                size = norm2(vec)
                step = vec / size if size > 0 and math.isfinite(size) else None
            self._steps[key] = step
        return self._steps[key]

    def _against_progress(self, good: list[str], job_id: str, number: int, recs: Mapping[str, UpdateRecord],
                          verdicts: dict[str, tuple[UpdateStatus, str]], strikes: dict[str, str | None]) -> list[str]:
        """Reject updates that keep pointing against the job's last published step: the mean
        cosine of the device's last `direction_rounds` updates of this job (this one included)
        below `min_direction`. One round's cosine is noisy on non-IID data (honest ones dip
        to about -0.2); a sign-flipping device's mean stays below. A strike each time."""
        pol, out = self.policy, []
        for d in good:
            raw = recs[d].direction
            if raw is None:
                out.append(d)
                continue
            seen = [raw, *self.registry.device_directions(job_id, d, number, limit=pol.direction_rounds - 1)]
            mean = sum(seen) / len(seen)
            if mean < pol.min_direction:
                why = (f"direction_outlier: against the job's last published step (cosine {raw:.3f}; mean of the "
                       f"device's last {len(seen)}: {mean:.3f} < {pol.min_direction:g})")
                verdicts[d], strikes[d] = (UpdateStatus.REJECTED, why), why
            else:
                out.append(d)
        return out

    def _device_cap(self, device_id: str) -> float | None:
        """The most samples this device may claim: `samples_growth` x the largest count of
        its recent accepted updates, or of the data size its state reports (None: unknown)."""
        caps = []
        past = self.registry.device_samples_history(device_id)
        if past:
            caps.append(self.policy.samples_growth * past)
        size = self.registry.get_device(device_id).state.get("data_samples")
        if isinstance(size, int) and not isinstance(size, bool) and size >= 1:
            caps.append(self.policy.samples_growth * size)
        return min(caps) if caps else None

    def _strike(self, strikes: Mapping[str, str | None]) -> None:
        """Count screened-out updates per device; quarantine the repeat offenders, loudly."""
        if not strikes:
            return
        for dev in self.registry.apply_strikes(strikes, quarantine_after=self.policy.quarantine_after,
                                               now=self.clock()):
            log.warning("device %s quarantined: %s; it is not selected for rounds until "
                        "`edge-coordinator devices --release %s`", dev.id, dev.quarantine_reason, dev.id)

    def _direction(self, good: list[str], job_id: str, recs: Mapping[str, UpdateRecord], load: Callable[[str], Sparse],
                   layout: Layout, verdicts: dict[str, tuple[UpdateStatus, str]],
                   strikes: dict[str, str | None], quorum: int = 1, acc: RunningSum | None = None,
                   hot_cache: HotCache | None = None) -> tuple[list[str], str]:
        """Step 5 of robust.py: cosine with the round's coordinate-wise median. Small rounds
        (<= direction_max_n): below min_cosine rejected, no strike. Larger ones: below
        min_median_cosine rejected, and a strike when the mean of the device's last
        `direction_rounds` cosines (kept in memory: a restart only delays a quarantine) is
        below strike_median_cosine; one low round is not enough, honest non-IID updates dip.
        Near zero is no signal, not hostility: once a job has converged, honest updates are
        mostly noise (cosines of +-0.01 in the year-long soak), so when the rejections would
        leave fewer than the job's `quorum` updates, those at or above strike_median_cosine
        are taken back, the best first, until the quorum is met (sign flips sit lower:
        robust.py's measured distributions); if half or more of the round would still be
        rejected, the best of the rest too, until the rejected are a minority or the quorum
        is met. The weight cap and clipping still bound whatever is taken back."""
        pol = self.policy
        small = len(good) <= pol.direction_max_n
        floor = pol.min_cosine if small else pol.min_median_cosine
        kept, rejected, undecidable, cosines = direction_check(
            good, load, {d: recs[d].norm for d in good}, layout.size,
            sum(recs[d].kept or layout.size for d in good), floor, acc, hot_cache)
        if len(kept) < quorum and rejected and not undecidable:
            weak = sorted((d for d in rejected if cosines.get(d, -1.0) >= pol.strike_median_cosine),
                          key=lambda d: -cosines[d])
            back = weak[:quorum - len(kept)]
            minority = (len(good) - 1) // 2
            if len(good) >= 3 and len(rejected) - len(back) > minority:
                # Half or more of the round against its own median is a split fleet, not
                # outliers: the median has no majority behind it. Unanswered, the next round
                # (same base, same data) repeats the verdict for ever (the soak's 2 vs 2
                # honest devices at -0.11, 788 rounds). Take back the best until the rejected
                # are a minority; a lone sign flip among honest updates stays out.
                rest = sorted((d for d in rejected if d not in back), key=lambda d: -cosines.get(d, -1.0))
                back += rest[:min(len(rest) - minority, quorum - len(kept) - len(back))]
            if back:
                log.info("job %s: %d low-cosine update(s) kept to meet the round's quorum of %d (%s)", job_id,
                         len(back), quorum, ", ".join(f"{cosines[d]:.3f}" for d in back))
                kept = [d for d in good if d in kept or d in back]
                rejected = {d: why for d, why in rejected.items() if d not in back}
        for d, why in rejected.items():
            verdicts[d] = (UpdateStatus.REJECTED, why[:512])
        if small:
            return kept, undecidable
        if len(self._cosines) > 100_000:
            self._cosines.clear()
        for d, c in cosines.items():
            seen = self._cosines.setdefault((job_id, d), [])
            seen[:] = [*seen, c][-pol.direction_rounds:]
            mean = sum(seen) / len(seen)
            if d in rejected and len(seen) >= pol.direction_rounds and mean < pol.strike_median_cosine:
                strikes[d] = (f"direction_outlier: mean cosine with the round's coordinate-wise median over the "
                              f"device's last {len(seen)} updates {mean:.3f} < {pol.strike_median_cosine:g}")
        return kept, undecidable

    def _aggregate(self, aggregator: str, good: list[str], recs: Mapping[str, UpdateRecord],
                   load: Callable[[str], Sparse], acc: RunningSum, layout: Layout, *, center: float,
                   clip_mult: float, trim: float, krum_fraction: float,
                   hot_cache: HotCache | None = None) -> tuple[np.ndarray, dict[str, Any]]:
        # A small round has no majority to outvote a liar: no update may weigh more than the
        # lower-median one or be longer than the reference norm, so one liar among 3 moves the
        # aggregate less than the two honest ones (a 1e9-sample sign flip among 3 did not).
        small = len(good) <= 3
        return aggregate_updates(
            aggregator, good, weights={d: recs[d].weight if recs[d].weight is not None else float(recs[d].num_samples)
                                       for d in recs},
            norms={d: recs[d].norm for d in recs}, kept={d: recs[d].kept or layout.size for d in recs}, load=load,
            acc=acc, size=layout.size, center=center, clip_mult=1.0 if small else clip_mult,
            samples_mult=1.0 if small else self.policy.samples_mult,
            trim_fraction=trim, krum_fraction=krum_fraction, layout=layout, hot_cache=hot_cache)
