"""Closing a round, as a list of named steps over one context (`Close`):

    collect    the round's stored (pending) updates; a legacy row or one that no longer
               decodes is rejected as unreadable
    aggregate  the job's rule (strategies/) over its streaming partial: merged from serve
               workers' partials and completed from payloads (aggregation.py); too few
               updates, or a rule with nothing it can publish, fails the round with why
    choose     a rule that offers a second candidate (trust: its server step standing in for
               the data distrust withheld) has both scored on the server set's gate split;
               the second goes on when it gets at least as many samples right and its mean
               loss is lower (else the first)
    learn      the server optimiser's step and the plateau rule (server_opt.py, plateau.py),
               judged by the server set's accuracy of the base version when there is one
    gate       the candidate scored on the server set against the version it replaces
               (gate.py): a worse one is retried at a half and a quarter of its step, and if
               still worse the round publishes nothing and says why
    secure     (a secure job, instead of collect and aggregate) the round's unmasked sum
               (secure_rounds.py) decoded and divided: the survivors' mean, or dp_fedavg's
               fixed denominator for a private job -- no update is ever seen
    commit     the new head written, then ONE registry transaction: every update's verdict,
               the version (its accuracy from the server set, or marked device-reported),
               the round's state and the job's next status; strikes; forget the round

Every step reads only the context and its explicit collaborators; a coordinator killed at any
point re-runs the close from the registry (the round stays CLOSING until commit).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..atomic import CorruptFileError
from ..errors import InputError
from ..updates.secagg import unflat_by_name
from .aggregate import apply_delta
from .aggregation import RoundAggregation
from .gate import STEP_SCALES, GateVerdict, ValidationGate
from .heads import HeadCache
from .plateau import LearnStep, learn, published
from .privacy import DpParams, PrivacyLedger, version_metrics
from .records import (
    Job,
    JobStatus,
    ModelVersion,
    RoundRecord,
    RoundState,
    UpdateRecord,
    UpdateStatus,
)
from .round_types import RoundPolicy
from .secure_rounds import SecureRounds, is_secure
from .server_opt import LearningStore
from .strategies import Aggregate, NothingToAggregate
from .streaming import Layout, Sparse
from .strikes import Strikes

log = logging.getLogger("edge_agent.coordinator.rounds")


@dataclass
class Close:
    job: Job
    rnd: RoundRecord
    now: float
    base: ModelVersion
    base_head: dict[str, np.ndarray]
    layout: Layout
    recs: dict[str, UpdateRecord] = field(default_factory=dict)
    verdicts: dict[str, tuple[UpdateStatus, str]] = field(default_factory=dict)
    strikes: dict[str, str | None] = field(default_factory=dict)
    aggregate: Aggregate | None = None
    rule: str = ""
    learned: LearnStep | None = None
    new_head: dict[str, np.ndarray] | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    reason: str = ""

    @property
    def failed(self) -> bool:
        return bool(self.reason)


class RoundCloser:
    def __init__(self, *, registry: Any, policy: RoundPolicy, clock: Callable[[], float], heads: HeadCache,
                 aggregation: RoundAggregation, strikes: Strikes, gate: ValidationGate,
                 secure: SecureRounds | None = None) -> None:
        self.registry, self.policy, self.clock = registry, policy, clock
        self.heads, self.aggregation, self.strikes, self.gate = heads, aggregation, strikes, gate
        self.secure = secure

    def close(self, job: Job, rnd: RoundRecord, job_end: Callable[..., tuple[JobStatus | None, str]]) -> None:
        """Run every step and commit (module doc). `job_end(job, number, aggregated=, stop=)`
        gives the job's status once this round ends."""
        base, head = self.heads.head(job.model_name, rnd.base_version)
        c = Close(job, rnd, self.clock(), base, head, self.heads.layout(job.model_name, rnd.base_version))
        first = (self.secure_sum,) if is_secure(job.params) else (self.collect, self.aggregate)
        for step in (*first, self.choose, self.learn, self.judge):
            step(c)
            if c.failed:
                break
        self.commit(c, job_end)
        if self.secure is not None:
            self.secure.forget(job.id, rnd.number)

    # ---- steps
    def collect(self, c: Close) -> None:
        for rec in self.registry.list_updates(c.job.id, c.rnd.number, UpdateStatus.PENDING):
            if rec.norm is None:  # a legacy row: measure it now
                try:
                    sp = self.heads.sparse(rec, c.layout)
                    if not math.isfinite(sp.norm) or sp.max_abs > self.policy.max_abs_delta:
                        raise InputError(f"non-finite or out-of-bounds values (max |value| {sp.max_abs:.3g})")
                    rec = dataclasses.replace(rec, norm=sp.norm, weight=float(rec.num_samples), kept=sp.kept)
                except (CorruptFileError, InputError) as exc:
                    c.verdicts[rec.device_id] = (UpdateStatus.REJECTED, f"unreadable: {str(exc)[:400]}")
                    continue
            c.recs[rec.device_id] = rec

    def aggregate(self, c: Close) -> None:
        cache: dict[str, Sparse] = {}

        def load(device: str) -> Sparse:
            if device not in cache:
                if len(cache) > 64:
                    cache.clear()
                cache[device] = self.heads.sparse(c.recs[device], c.layout)
            return cache[device]

        rule, partial, unreadable, read = self.aggregation.at_close(c.job, c.rnd, c.recs, load)
        c.rule = rule.name
        c.metrics["folded_at_close"] = read  # stored payloads no in-memory or worker partial covered
        for device, why in unreadable.items():
            c.verdicts[device] = (UpdateStatus.REJECTED, f"unreadable: {why}")
            c.recs.pop(device)
            partial.members.pop(device, None)
        if len(partial.members) < c.job.min_devices:
            c.reason = (f"{len(partial.members)} accepted update(s), need {c.job.min_devices}; "
                        f"{len(c.rnd.dropouts)} dropout(s), {len(c.verdicts)} rejected")
            return
        try:
            c.aggregate = rule.finalize(partial, load)
        except NothingToAggregate as exc:
            c.reason = f"{rule.name}: {exc}"
            for d in partial.members:
                c.verdicts.setdefault(d, (UpdateStatus.ACCEPTED, f"counted for nothing: {exc}"[:512]))
            return
        self.aggregation.remember(c.job, c.rnd, c.aggregate)
        for d, why in c.aggregate.excluded.items():
            c.verdicts[d] = (UpdateStatus.REJECTED, why[:512])
        dp = DpParams.of(c.job.params)
        if dp is not None:  # epsilon spent up to this round (privacy.py), for the version's metrics
            c.metrics |= version_metrics(self.registry, PrivacyLedger(self.registry.state_dir), dp, c.job,
                                         c.rnd.number, c.rnd.base_version)
        trust = c.aggregate.info.get("trust", {})
        for d, share in c.aggregate.shares.items():
            if d not in c.verdicts:
                note = c.aggregate.notes.get(d, "") if share > 0 else \
                    f"counted for nothing (trust {trust.get(d, 0):.2f}: its direction disagreed with the reference)"
                c.verdicts[d] = (UpdateStatus.ACCEPTED, note)
                c.strikes.setdefault(d, None)

    def secure_sum(self, c: Close) -> None:
        """A secure round's aggregate from its unmasked sum (module doc)."""
        st = self.secure.load(c.job.id, c.rnd.number) if self.secure is not None else None
        if st is None:
            c.reason = "secure aggregation: the round never started (no device trained in time)"
            return
        r = st.round
        if st.total is None:
            c.reason = f"secure aggregation: {r.reason or f'unfinished in phase {r.phase}'}"[:1024]
            return
        n = len(r.survivors)
        if n < c.job.min_devices or r.config.length != c.layout.size:
            c.reason = (f"secure aggregation: {n} masked input(s) in the sum, need {c.job.min_devices}"
                        if n < c.job.min_devices else "secure aggregation: the head's size changed")
            return
        plain = r.config.quantiser.decode_sum(st.total)
        dp = DpParams.of(c.job.params)
        if dp is not None:  # each device added its share of the noise: the selected devices' fixed denominator
            vec, c.rule = plain / float(len(r.config.devices)), "dp_fedavg"
            c.metrics |= version_metrics(self.registry, PrivacyLedger(self.registry.state_dir), dp, c.job,
                                         c.rnd.number, c.rnd.base_version)
        else:
            vec, c.rule = plain / n, "fedavg"
        by_name = unflat_by_name(vec, c.layout.shapes)  # devices mask in name order (updates/secagg.py)
        vec = np.concatenate([by_name[name].ravel() for name in c.layout.names])
        c.aggregate = Aggregate(vec=vec, shares=dict.fromkeys(r.survivors, 1.0 / n), info={
            "secagg": True, "secagg_advertised": len(r.adverts), "secagg_survivors": n,
            "secagg_dropped": len(r.config.devices) - n, "secagg_threshold": r.config.threshold,
            "secagg_degree": r.config.degree})

    def choose(self, c: Close) -> None:
        """The step between the rule and the server optimiser (module doc). Two candidates
        judged on the same samples that will judge the version: the kept one's score is biased
        up by at most the better of two draws, not a search."""
        assert c.aggregate is not None
        alt = c.aggregate.alternative
        if alt is None:
            return
        c.aggregate.alternative = None
        tail = self.aggregation.tail(c.job, c.rnd.base_version)
        if tail is None or not tail.data.can_gate:
            return
        try:
            scored = [tail.scored(apply_delta(c.base_head, c.layout.unflatten(a.vec))) for a in (c.aggregate, alt)]
        except InputError as exc:  # an unusable candidate: the first goes on, and learn says why if it is too
            log.warning("job %s round %d: the second candidate is unusable: %s", c.job.id, c.rnd.number, exc)
            return
        right, loss = [int(ok.sum()) for ok, _ in scored], [lo for _, lo in scored]
        c.metrics["candidates_correct"], c.metrics["candidates_loss"] = right, [round(lo, 5) for lo in loss]
        if right[1] >= right[0] and loss[1] < loss[0]:
            c.aggregate = dataclasses.replace(c.aggregate, vec=alt.vec, shares=alt.shares,
                                              info=c.aggregate.info | alt.info)

    def learn(self, c: Close) -> None:
        assert c.aggregate is not None
        tail = self.aggregation.tail(c.job, c.rnd.base_version)
        measured = None
        if tail is not None and tail.data.can_gate:
            base_ok = tail.correct(c.base_head, key=c.base.version)
            measured = (float(base_ok.mean()), int(base_ok.size))
        used = [d for d, s in c.aggregate.shares.items() if s > 0]
        try:
            c.learned = learn(LearningStore(self.registry.state_dir), c.job.id, c.job.params, c.rnd.number,
                              c.rnd.base_version, c.layout.unflatten(c.aggregate.vec),
                              [(c.recs[d].metrics, c.recs[d].num_samples) for d in used if d in c.recs], measured)
        except InputError as exc:
            c.reason = f"aggregate unusable: {exc}"[:1024]
            return
        c.metrics |= c.learned.metrics

    def judge(self, c: Close) -> None:
        """The gate (module doc); without a server set the candidate is published as it is."""
        assert c.learned is not None
        if c.learned.restore:
            c.new_head = self.heads.head(c.job.model_name, c.learned.restore)[1]
            return
        tail = self.aggregation.tail(c.job, c.rnd.base_version)
        try:
            if tail is None or not tail.data.can_gate:
                c.new_head = apply_delta(c.base_head, c.learned.step)
                c.metrics["accuracy_source"] = "device-reported"
                return
            base_ok = tail.correct(c.base_head, key=c.base.version)
            verdict: GateVerdict | None = None
            for scale in STEP_SCALES:
                step = c.learned.step if scale == 1.0 else {k: (v * scale).astype(v.dtype)
                                                            for k, v in c.learned.step.items()}
                head = apply_delta(c.base_head, step)
                verdict = self.gate.judge(tail.correct(head), base_ok)
                if verdict.ok:
                    c.new_head = head
                    c.metrics |= {"accuracy": round(verdict.accuracy, 6), "accuracy_samples": verdict.samples,
                                  "accuracy_source": "server set", "step_scale": scale,
                                  "gate": f"vs {c.base.version}: {verdict.describe()}"}
                    self._plateau(c, verdict)
                    return
            assert verdict is not None
            c.reason = (f"gate: every step (x{', x'.join(f'{s:g}' for s in STEP_SCALES)}) scores worse than "
                        f"{c.base.version} on the server set; at x{STEP_SCALES[-1]:g} {verdict.describe()}")
        except InputError as exc:
            c.reason = f"aggregate unusable: {exc}"[:1024]

    def _plateau(self, c: Close, verdict: GateVerdict) -> None:
        """The plateau rule on the version the gate passed (plateau.published): a job that
        stops publishes its best version's head instead."""
        stop, restore, metrics = published(LearningStore(self.registry.state_dir), c.job.id, c.job.params,
                                           c.rnd.number, f"{c.job.id}-r{c.rnd.number}", verdict.accuracy,
                                           verdict.samples)
        c.metrics |= metrics
        if restore is not None:
            assert c.learned is not None
            c.learned = dataclasses.replace(c.learned, stop=stop, restore=restore)
            c.new_head = self.heads.head(c.job.model_name, restore)[1] if restore != f"{c.job.id}-r{c.rnd.number}" \
                else c.new_head

    def commit(self, c: Close, job_end: Callable[..., tuple[JobStatus | None, str]]) -> None:
        new_version = None
        if not c.failed and c.new_head is not None and c.aggregate is not None:
            version = f"{c.job.id}-r{c.rnd.number}"
            rel, sha = self.registry.write_head(c.job.model_name, version, c.new_head)
            used = [d for d, s in c.aggregate.shares.items() if s > 0]
            norms = [c.recs[d].norm for d in used if d in c.recs]  # (a secure round sees no update: none)
            info = {k: v for k, v in c.aggregate.info.items() if k not in ("trust", "median_cosines")}
            new_version = ModelVersion(
                name=c.job.model_name, version=version, parent=c.rnd.base_version, created_at=self.clock(),
                bundle_path=c.base.bundle_path, head_path=rel, head_sha256=sha, head_only=True,
                metrics={"updates": len(used), "samples": sum(c.recs[d].num_samples for d in used if d in c.recs),
                         "aggregator": c.rule, "dropouts": len(c.rnd.dropouts),
                         "rejected": sum(v[0] is UpdateStatus.REJECTED for v in c.verdicts.values()),
                         "mean_update_norm": float(np.mean(norms)) if norms else 0.0,
                         **info, **c.metrics},
                job_id=c.job.id, round=c.rnd.number)
        for d in c.recs:
            if d not in c.verdicts:  # a failed round: nothing wrong with the update, nothing published
                c.verdicts[d] = (UpdateStatus.ACCEPTED, f"round published nothing: {c.reason}"[:512])
                c.strikes.setdefault(d, None)
        state = RoundState.AGGREGATED if new_version else RoundState.FAILED
        status, job_reason = job_end(c.job, c.rnd.number, aggregated=new_version is not None,
                                     stop=c.learned.stop if c.learned is not None else "")
        self.registry.finish_round(c.job.id, c.rnd.number, state=state, reason=c.reason, verdicts=c.verdicts,
                                   new_version=new_version, job_status=status, job_reason=job_reason,
                                   now=self.clock())
        self.aggregation.forget(c.job.id, c.rnd.number)
        self.strikes.apply(c.strikes)
