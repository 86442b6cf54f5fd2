"""Trust-scored rules: each update counts in proportion to how far its direction agrees with a
reference the round's attackers cannot steer, at a norm the coordinator sets.

    trust         (with a server set; in the spirit of FLTrust, Cao et al. NDSS 2021)
    median_trust  (without one)

For update d_i with weight w_i (its bounded sample count) and reference r_i:

    t_i = clip(cos(d_i, r_i) / kappa, 0, 1)          trust: full from cosine kappa up (0.1; 0.3
                                                     under median_trust, below)
    s_i = clip(||d_i||, lo x R, hi x R) / ||d_i||     norm moved into [0.5, 2] x the reference norm R
    e_i = the update's echo count: 1 + how many others point (nearly) its way (echoes.py)
    aggregate = (sum_i w_i t_i s_i d_i / e_i + w_0 g_0) / (sum_i w_i t_i / e_i + w_0)

`trust`: r_i is the descent direction the coordinator measures itself on its labelled
server set's root split, at the round's base, mixed in the device's reported label
proportions (`ServerEvidence.reference`): a device that holds three classes is compared with
what those three classes teach, not with the whole set's direction -- measured on the bench's
non-IID digits, honest cosines against the whole set's direction fell to -0.34 and against
the class-mixed one stayed above 0.04 at 10 devices, while sign flips sat below -0.47.
R = ||g_0||, the server's own update (the base trained on the root split with as many steps
as a typical device takes), and the server update takes part with weight w_0 = its root
samples: so magnitude attacks (x100, x1e-6) are neutralised, a direction against the
evidence counts for nothing, and a fleet that lost an attacker's data still learns what the
server set teaches. The rule also offers a second candidate, the server's step standing in
for the data distrust withheld (w_0 = max(root samples, m) + sum_i min(w_i, m) (1 - t_i), m
the round's lower-median weight), and the round's close keeps the stand-in when the gate
split gets as many samples right with it at a lower mean loss (round_close.py: the loss
resolves what 300 right-or-wrong answers cannot; by counts alone the bench's 2-device digits
fleets ended 2.1 points under clean after 10 rounds, by loss alone an honest round failed the
gate, which counts): always taking the stand-in lifted bench_poisoning's 2-device
fleets from 2.6-3.7 to 1.7-2.6 points under clean but cost `make demo` 6 points after 3
rounds (its devices adapt their int8 prefixes to their cameras, so honest updates earn
partial trust against a step computed on the bundle's own features, and the stand-in took
their weight) -- which of the two helps is a question for the evidence, not a constant. A
device that lies about its label counts only changes which honest direction it is compared
with. Colluders that each earn trust on their own share one vote (e_i): measured in the
solar fleet (async, 20 % IPM attackers), attackers' cosines with their references had a
median of 0.11 and earned trust 59 % of the way, while their updates were
near-twins of each other (median cosine 0.93).

`median_trust`: r_i is the round's coordinate-wise median (a minority cannot steer it; in a
round with a majority, taken again without the updates that point against it first), full
trust from cosine 0.3: the median includes the update itself, and among 5 values one above
the middle moves it up, so a random direction at an honest norm had a cosine of 0.15-0.18
with it (honest updates 0.4-0.7) and earned full trust from 0.1 -- 2.4 points after 10
rounds among 5 digits devices, 1.2 from 0.3, and honest fleets still failed no round and
lost no update (bench_poisoning, 4 seeds); comparing each update with the
median of the others instead counted 15-30 % of the honest non-IID updates for nothing. And
R the round's lower-median norm, held within [0.5, 2] x the model lineage's recent median
when there is one (so a few tiny or huge updates cannot move it), with no update moved past
1 x R in a round of <= 3 (no majority); weights capped at the round's lower-median weight
(no evidence backs a claim of more data); no server update; updates that echo each other
share one vote (e_i, as above). Nothing is ejected for disagreeing
with a single other update: a disagreeing update only counts less. And an update whose device
has, over the job, pushed down the classes it reports holding counts for nothing (claims.py:
its label counts are the evidence; measured on the bench, without it a sign flip at 5 and
10 devices cost 5-6 points on textures after 30 rounds, the median's cosine letting it in).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ..streaming import block_window_mean
from . import claims, echoes
from .base import (
    Aggregate,
    Contribution,
    DenseUpdate,
    Load,
    Member,
    NothingToAggregate,
    Partial,
    Strategy,
    dense_mean,
    lower_median,
    present_mask,
    shares,
)


def trust_of(cos: float, kappa: float) -> float:
    return float(min(1.0, max(0.0, cos / kappa))) if np.isfinite(cos) else 0.0


def band_scale(norm: float, reference: float, band: tuple[float, float]) -> float:
    """The factor that moves a norm into [lo, hi] x reference (1 inside; 0 for a zero update)."""
    if norm <= 0 or not np.isfinite(norm):
        return 0.0
    if reference <= 0:
        return 1.0
    return float(min(max(norm, band[0] * reference), band[1] * reference) / norm)


def _cos(dot: float, a: float, b: float) -> float:
    return dot / (a * b) if a > 0 and b > 0 else 0.0


def _echoed(agg: Aggregate, echo: dict[str, float], sketches: Mapping[str, np.ndarray | None],
            coefs: Mapping[str, float]) -> Aggregate:
    """Record the echo counts above 1, say so in those updates' verdicts, and keep the trusted
    updates' sketches (coefficient > 0) for the next round's echoes."""
    agg.info["echoes"] = echo
    agg.notes |= {d: f"shares one vote with the {e - 1:.1f} update(s) its direction echoes (cosine >= "
                     f"{echoes.ECHO_FROM})" for d, e in echo.items()}
    agg.sketches = {d: sk for d, sk in sketches.items() if sk is not None and coefs.get(d, 0.0) > 0}
    return agg


def _echo_counts(trusted: Mapping[str, np.ndarray | None], earlier: Mapping[str, np.ndarray] | None
                 ) -> tuple[dict[str, float], dict[str, float]]:
    """(each trusted update's echo count, the counts above 1 rounded for the record)."""
    echo = echoes.echo_counts({d: sk for d, sk in trusted.items() if sk is not None}, earlier)
    return echo, {d: round(e, 3) for d, e in echo.items() if e > 1.0005}


def _sketches(members: Mapping[str, Member]) -> dict[str, np.ndarray | None]:
    return {d: m.sketch for d, m in members.items()}


def _coefs_of(members: Mapping[str, Member]) -> dict[str, float]:
    return {d: m.coef for d, m in members.items()}


def _no_trust(trust: dict[str, float]) -> NothingToAggregate:
    return NothingToAggregate(f"no update earned trust ({len(trust)} update(s); trust "
                              + ", ".join(f"{t:.2f}" for t in list(trust.values())[:20]) + ")")


class TrustScored(Strategy):
    name = "trust"
    summary = "each update weighted by its agreement with the server set's own update, rescaled to it (FLTrust)"
    reads_at_close = "outliers"
    needs_server_set = True

    def __init__(self, options, evidence) -> None:  # type: ignore[no-untyped-def]
        super().__init__(options, evidence)
        if evidence.server is None:
            raise ValueError("the trust rule needs a server set (model create --validation / train --validation)")
        self.server = evidence.server
        self._refs: dict[tuple[Any, Any], tuple[np.ndarray, float]] = {}

    def _reference(self, label_counts: tuple[int, ...] | None, present: tuple[int, ...] | None
                   ) -> tuple[np.ndarray, float]:
        """The reference for these label counts over the tensors an update carries (a device
        that trained only the head is compared with the head's part of the direction)."""
        key = (label_counts, present)
        if key not in self._refs:
            if len(self._refs) > 256:
                self._refs.clear()
            ref = self.server.reference(label_counts)
            if present is not None:
                ref = np.where(present_mask(present, self.evidence.layout), ref, 0.0)
            self._refs[key] = (ref, float(np.linalg.norm(ref)))
        return self._refs[key]

    def score(self, dot_ref: float, norm: float, ref_norm: float, weight: float) -> tuple[float, float, float]:
        """(coef, mean weight, trust) of an update with <d, r> = dot_ref."""
        t = trust_of(_cos(dot_ref, norm, ref_norm), self.options.trust_kappa)
        s = band_scale(norm, self.server.norm, self.options.band)
        return weight * t * s, weight * t, t

    def member(self, c: Contribution) -> Member:
        ref, ref_norm = self._reference(c.label_counts, c.update.present)
        coef, mean, t = self.score(c.update.dot_dense(ref), c.update.norm, ref_norm, c.weight)
        return Member(weight=c.weight, norm=c.update.norm, kept=c.update.kept, present=c.update.present,
                      label_counts=c.label_counts, coef=coef, mean_weight=mean, trust=t,
                      sketch=echoes.sketch(c.update.idx, c.update.vals, self.evidence.layout.size))

    def _adjusted(self, members: dict[str, Member]) -> tuple[dict[str, tuple[float, float]], dict[str, float]]:
        """(new (coef, mean weight) of the members whose weight moves at close, and the echo
        counts above 1): the round's weight cap, then the trusted updates' echoes."""
        cap = self.round_cap([m.weight for m in members.values()])
        echo, recorded = _echo_counts({d: m.sketch for d, m in members.items() if m.coef > 0},
                                      self.evidence.earlier_sketches)
        out = {}
        for d, m in members.items():
            factor = min(1.0, cap / m.weight) / echo.get(d, 1.0)
            if factor < 1.0:
                out[d] = (m.coef * factor, m.mean_weight * factor)
        return out, recorded

    def stand_in_weight(self, members: Mapping[str, Member]) -> float:
        """The server step's weight in the second candidate: one typical device (its root
        samples, or the round's lower-median weight when that is more) plus the weight the
        round's updates did not earn by trust, each at most a typical device's (a claim of
        more data is no evidence)."""
        typical = lower_median([m.weight for m in members.values()])
        lost = sum(min(m.weight, typical) * (1.0 - (m.trust or 0.0)) for m in members.values())
        return max(self.server.weight, typical) + lost

    def _aggregate(self, mean: Callable[[float], np.ndarray], members: Mapping[str, Member]) -> Aggregate:
        """The aggregate with the server step at its root samples' weight, and the stand-in
        candidate when it weighs more (`mean(w_0)`: the mean with the server step at w_0).
        With no update trusted the version is the server's own step (the gate still judges
        it): measured on the bench, 2-device fleets otherwise failed a third of their rounds,
        an honest device disagreeing with its classes' reference as often as a flipped one."""
        means = {d: m.mean_weight for d, m in members.items()}
        trust = {d: m.trust or 0.0 for d, m in members.items()}
        info = {"trust": {d: round(t, 4) for d, t in trust.items()}, "zero_trust": sum(t == 0 for t in trust.values()),
                "reference_norm": self.server.norm}
        w0, stand_in = self.server.weight, self.stand_in_weight(members)
        agg = Aggregate(mean(w0), shares(means, w0), info=info | {"server_share": round(w0 / (sum(means.values()) + w0), 4)})
        if stand_in > w0 * (1 + 1e-9):
            agg.alternative = Aggregate(mean(stand_in), shares(means, stand_in), info=info | {
                "server_share": round(stand_in / (sum(means.values()) + stand_in), 4), "server_stands_in": True})
        return agg

    def finalize(self, partial: Partial, load: Load) -> Aggregate:
        if not partial.members:
            raise ValueError("no updates to aggregate")
        changes, echo = self._adjusted(partial.members)
        decoded = partial.readjust(changes, load)
        agg = self._aggregate(lambda w0: partial.mean((self.server.update, w0)), partial.members)
        agg.info["decoded_at_close"] = decoded
        return _echoed(agg, echo, _sketches(partial.members), _coefs_of(partial.members))

    def reference(self, updates: Sequence[DenseUpdate]) -> Aggregate:
        members = {}
        for u in updates:
            ref, ref_norm = self._reference(u.label_counts, u.present)
            vec = np.asarray(u.vec, np.float64)
            coef, mean, t = self.score(float(vec @ ref), float(np.linalg.norm(vec)), ref_norm, u.weight)
            members[u.device] = Member(weight=u.weight, norm=0.0, kept=0, present=u.present, coef=coef,
                                       mean_weight=mean, trust=t, sketch=echoes.sketch_dense(vec))
        changes, echo = self._adjusted(members)
        for d, (coef, mean) in changes.items():
            members[d].coef, members[d].mean_weight = coef, mean
        agg = self._aggregate(lambda w0: dense_mean(updates, [members[u.device].coef for u in updates],
                                                    [members[u.device].mean_weight for u in updates],
                                                    self.evidence.layout, (self.server.update, w0)), members)
        return _echoed(agg, echo, _sketches(members), _coefs_of(members))


class MedianTrust(Strategy):
    name = "median_trust"
    summary = "each update weighted by its agreement with the round's coordinate-wise median, norms banded"
    reads_at_close = "all"
    keeps_signs = True

    def member(self, c: Contribution) -> Member:
        m = super().member(c)
        m.coef = m.mean_weight = 0.0  # the median is only known at close
        m.sketch = echoes.sketch(c.update.idx, c.update.vals, self.evidence.layout.size)
        return m

    def _shared_votes(self, coefs: dict[str, tuple[float, float]], trust: dict[str, float],
                      sketches: Mapping[str, np.ndarray | None]) -> tuple[dict[str, tuple[float, float]], dict[str, float]]:
        """Trusted updates that echo each other share one vote, as in the trust rule (echoes.py):
        measured on the bench (digits, 10 devices, 2 colluders sending one random direction, 6
        seeds), the colluders cost 2.1 points after 10 rounds, 1.2 with shared votes. (Giving
        echoes one entry in the median too gained 0.2 more there, but hands a lone attacker half
        the median whenever the honest updates agree closely: left out.)"""
        echo, recorded = _echo_counts({d: sk for d, sk in sketches.items() if trust.get(d, 0.0) > 0},
                                      self.evidence.earlier_sketches)
        return {d: (c / echo.get(d, 1.0), m / echo.get(d, 1.0)) for d, (c, m) in coefs.items()}, recorded

    def round_cap(self, weights: Sequence[float]) -> float:
        """No update weighs more than the round's lower-median weight: without a server set a
        sample count is only a claim (measured on the bench: a sign flip claiming 1e9 samples
        cost 6 points at 5 devices under a 2x cap, no more than the plain flip under 1x)."""
        return lower_median(weights)

    def reference_norm(self, norms: Sequence[float]) -> float:
        """The round's lower-median norm (with two updates the smaller: a huge one cannot raise
        it), held within the band around the lineage's history when there is one (so a tiny
        one cannot lower it for long)."""
        center = lower_median(norms)
        hist = self.evidence.history_norm
        if hist is not None and hist > 0:
            center = min(max(center, self.options.band[0] * hist), self.options.band[1] * hist)
        return center

    def band(self, n: int) -> tuple[float, float]:
        """No update reaches further than the reference in a round without a majority."""
        lo, hi = self.options.band
        return (lo, 1.0) if n <= self.options.small_round else (lo, hi)

    def _claims(self, bias_deltas: dict[str, np.ndarray], counts: dict[str, tuple[int, ...]],
                predicted: dict[str, tuple[float, ...]]) -> tuple[dict[str, float], dict[str, float]]:
        """(this round's label consistency of each update, each device's standing over the job)."""
        now = claims.consistencies(bias_deltas, counts, predicted)
        return now, claims.standings(now, self.evidence.claims)

    def _output_bias(self, counts: dict[str, tuple[int, ...]]) -> slice | None:
        sizes = {len(c) for c in counts.values()}
        return claims.output_bias(self.evidence.layout, sizes.pop()) if len(sizes) == 1 else None

    def _coefs(self, weights: dict[str, float], norms: dict[str, float], cosines: dict[str, float],
               against: set[str]) -> tuple[dict[str, tuple[float, float]], dict[str, float]]:
        """Each update's (coefficient, mean weight) and trust; the round's weight cap and
        reference norm come from the updates not against their claims (a known liar's claim
        of data or norm moves nothing)."""
        judged = [d for d in weights if d not in against] or list(weights)
        cap = self.round_cap([weights[d] for d in judged])
        center = self.reference_norm([norms[d] for d in judged])
        band = self.band(len(judged))
        out, trust = {}, {}
        for d, w in weights.items():
            t = 0.0 if d in against else trust_of(cosines[d], self.options.median_kappa)
            w = min(w, cap)
            out[d] = (w * t * band_scale(norms[d], center, band), w * t)
            trust[d] = t
        return out, trust

    def _aggregate(self, vec: np.ndarray, coefs: dict[str, tuple[float, float]], trust: dict[str, float],
                   cosines: dict[str, float], now: dict[str, float], standing: dict[str, float],
                   against: set[str], left_out: list[str]) -> Aggregate:
        means = {d: c[1] for d, c in coefs.items()}
        if not any(means.values()):
            raise _no_trust(trust)
        info = {"trust": {d: round(t, 4) for d, t in trust.items()}, "zero_trust": sum(t == 0 for t in trust.values()),
                "median_cosines": {d: round(c, 4) for d, c in cosines.items()}, "median_left_out": left_out}
        if now:  # kept by the coordinator for the job's later rounds (aggregation.remember)
            info |= {"claims": {d: round(c, 4) for d, c in now.items()},
                     "claims_standing": {d: round(c, 4) for d, c in standing.items()},
                     "against_claims": sorted(against)}
        return Aggregate(vec, shares(means), info=info)

    def _median_cosines(self, devices: list[str], median: Callable[[list[str]], np.ndarray],
                        cosines_with: Callable[[np.ndarray], dict[str, float]]) -> tuple[dict[str, float], list[str]]:
        """(each update's cosine with the round's median, the updates left out of it). In a
        round with a majority the median is taken twice: the second time without the updates
        that point against the first (they earn no trust anyway), so one such update cannot
        drag the median off the honest ones' way (measured on the bench: IPM at 1 of 5
        textures devices lowered honest cosines until some lost their trust: -2.7 points after
        30 rounds, -1.1 with the second median; honest fleets failed no round either way)."""
        cosines = cosines_with(median(devices))
        if len(devices) > self.options.small_round:
            agree = [d for d in devices if cosines[d] > 0]
            if agree and len(agree) < len(devices):
                return cosines_with(median(agree)), sorted(set(devices) - set(agree))
        return cosines, []

    def finalize(self, partial: Partial, load: Load) -> Aggregate:
        if not partial.members:
            raise ValueError("no updates to aggregate")
        counts = {d: m.label_counts for d, m in partial.members.items() if m.label_counts}
        predicted = {d: m.label_predicted for d, m in partial.members.items() if m.label_predicted}
        where = self._output_bias(counts)
        now, standing = self._claims({d: claims.sparse_slice(load(d), where) for d in counts} if where else {}, counts,
                                     predicted)
        against = claims.against_claims(standing, partial.members)

        def median(devices: list[str]) -> np.ndarray:
            n = len(devices)
            if not n:
                return np.zeros(partial.layout.size)
            every = n == len(partial.members)  # the round's sign counts hold only for all of them
            return block_window_mean([lambda d=d: load(d) for d in devices],
                                     sum(partial.members[d].kept for d in devices), partial.layout.size,
                                     (n - 1) // 2, n // 2 + 1, signs=partial.signs if every else None)

        def cosines_with(med: np.ndarray) -> dict[str, float]:
            med_norm = float(np.linalg.norm(med))
            return {d: _cos(load(d).dot_dense(med), partial.members[d].norm, med_norm) for d in partial.members}

        cosines, left_out = self._median_cosines([d for d in partial.members if d not in against], median,
                                                 cosines_with)
        coefs, trust = self._coefs({d: m.weight for d, m in partial.members.items()},
                                   {d: m.norm for d, m in partial.members.items()}, cosines, against)
        sketches = _sketches(partial.members)
        coefs, echo = self._shared_votes(coefs, trust, sketches)
        for d, t in trust.items():
            partial.members[d].trust = t
        decoded = partial.readjust(coefs, load)
        agg = self._aggregate(partial.mean(), coefs, trust, cosines, now, standing, against, left_out)
        agg.info["decoded_at_close"] = decoded
        return _echoed(agg, echo, sketches, {d: c[0] for d, c in coefs.items()})

    def reference(self, updates: Sequence[DenseUpdate]) -> Aggregate:
        layout = self.evidence.layout
        stack = {u.device: np.where(present_mask(u.present, layout), u.vec, 0.0) for u in updates}
        counts = {u.device: u.label_counts for u in updates if u.label_counts}
        predicted = {u.device: u.label_predicted for u in updates if u.label_predicted}
        where = self._output_bias(counts)
        now, standing = self._claims({d: np.asarray(stack[d][where], np.float64) for d in counts} if where else {},
                                     counts, predicted)
        against = claims.against_claims(standing, stack)
        norms = {d: float(np.linalg.norm(v)) for d, v in stack.items()}

        def median(devices: list[str]) -> np.ndarray:
            return np.median(np.stack([stack[d] for d in devices]), axis=0) if devices else np.zeros(layout.size)

        def cosines_with(med: np.ndarray) -> dict[str, float]:
            med_norm = float(np.linalg.norm(med))
            return {d: _cos(float(v @ med), norms[d], med_norm) for d, v in stack.items()}

        cosines, left_out = self._median_cosines([u.device for u in updates if u.device not in against], median,
                                                 cosines_with)
        coefs, trust = self._coefs({u.device: u.weight for u in updates}, norms, cosines, against)
        sketches: dict[str, np.ndarray | None] = {d: echoes.sketch_dense(v) for d, v in stack.items()}
        coefs, echo = self._shared_votes(coefs, trust, sketches)
        vec = dense_mean(updates, [coefs[u.device][0] for u in updates], [coefs[u.device][1] for u in updates], layout)
        agg = self._aggregate(vec, coefs, trust, cosines, now, standing, against, left_out)
        return _echoed(agg, echo, sketches, {d: c[0] for d, c in coefs.items()})
