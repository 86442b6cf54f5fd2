"""Each open round's aggregation: its rule (strategies/, from the job's params), the
coordinator's evidence for it, and the rule's streaming partial, fed as updates arrive.

    evidence   the model lineage's recent accepted norm (any job on the model) and, with a
               server set, the server's own update and class gradients at the round's base --
               computed once per round and written to <state_dir>/evidence/<job>/r<N>.npz, so a
               restarted coordinator and every serve worker use the same numbers
    partial    folded in memory as updates are stored (O(1) work per update); after a restart,
               rebuilt from the stored payloads on first touch. A serve worker of a group saves
               its partial to the shared state dir (partials.py) at most every `save_every_s`,
               and the leader's close merges the workers' partials and folds from its payload
               only what no partial covers (an update stored after its worker last saved)

The stored payloads stay the source of truth: a partial is only trusted for members whose
updates are still pending in the registry.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np

from ..atomic import CorruptFileError, read_checked, write_checked
from ..errors import InputError
from ..protocol.label_claims import decode_counts, decode_predicted
from .evidence import TailEvidence
from .heads import HeadCache
from .partials import PartialStore
from .privacy import DpParams, NoiseSource, PrivacyLedger, csprng_noise
from .records import Job, RoundRecord, UpdateRecord, UpdateStatus
from .strategies import (
    Aggregate,
    Contribution,
    GaussianSum,
    Partial,
    RoundEvidence,
    ServerEvidence,
    Strategy,
    StrategyOptions,
    make_strategy,
)
from .strategies.claims import Standing, output_classes
from .streaming import Sparse

log = logging.getLogger("edge_agent.coordinator.rounds")
MAX_EVIDENCE_BYTES = 1 << 30
MAX_CLAIMS_BYTES = 64 << 20  # ~60 bytes a device: a million devices' standings


class EvidenceSource(Protocol):
    """Where the coordinator's labelled evidence for a model version comes from (server_set.py
    for stored server sets and bundles; the fleet simulation gives its own)."""

    def tail(self, job: Job, version: Any, head: Mapping[str, np.ndarray]) -> TailEvidence | None: ...

    def has_server_set(self, model_name: str, params: Mapping[str, Any]) -> bool: ...


class NoEvidence:
    def tail(self, job: Job, version: Any, head: Mapping[str, np.ndarray]) -> TailEvidence | None:
        return None

    def has_server_set(self, model_name: str, params: Mapping[str, Any]) -> bool:
        return False


def strategy_options(policy: Any, params: Mapping[str, Any]) -> StrategyOptions:
    return StrategyOptions(samples_mult=policy.samples_mult, clip_mult=float(params.get("clip_mult", policy.clip_mult)),
                           trim_fraction=float(params.get("trim_fraction", policy.trim_fraction)),
                           krum_fraction=float(params.get("krum_fraction", policy.krum_fraction)),
                           trust_kappa=policy.trust_kappa, median_kappa=policy.median_kappa)


class RoundAggregation:
    def __init__(self, *, registry: Any, heads: HeadCache, policy: Any, evidence: EvidenceSource,
                 clock: Callable[[], float] = time.time, worker: str | None = None,
                 partials: PartialStore | None = None, save_every_s: float = 1.0,
                 noise: NoiseSource | None = None) -> None:
        self.registry, self.heads, self.policy, self.source = registry, heads, policy, evidence
        self.clock, self.worker, self.partials, self.save_every_s = clock, worker, partials, save_every_s
        self._evidence: dict[tuple[str, int], RoundEvidence] = {}
        self._strategies: dict[tuple[str, int], Strategy] = {}
        self._partials: dict[tuple[str, int], Partial] = {}
        self._saved_at: dict[tuple[str, int], float] = {}
        self._tails: dict[tuple[str, str, str], TailEvidence | None] = {}
        self.noise = noise or csprng_noise
        self.privacy = PrivacyLedger(registry.state_dir)

    # ---- evidence
    def tail(self, job: Job, version: str) -> TailEvidence | None:
        """The server set's evidence for heads of `version` of the job's model (None: no set)."""
        key = (job.id, job.model_name, version)
        if key not in self._tails:
            if len(self._tails) > 16:
                self._tails.clear()
            mv, head = self.heads.head(job.model_name, version)
            try:
                self._tails[key] = self.source.tail(job, mv, head)
            except InputError as exc:
                log.warning("job %s: the server set cannot judge %s %s: %s", job.id, job.model_name, version, exc)
                self._tails[key] = None
        return self._tails[key]

    def _evidence_path(self, job_id: str, number: int) -> Any:
        return self.registry.state_dir / "evidence" / job_id / f"r{number}.npz"

    def evidence(self, job: Job, rnd: RoundRecord) -> RoundEvidence:
        key = (job.id, rnd.number)
        if key not in self._evidence:
            layout = self.heads.layout(job.model_name, rnd.base_version)
            norms = self.registry.lineage_norm_history(job.model_name, before=key)
            history = float(np.median(norms)) if norms else None
            self._evidence[key] = RoundEvidence(layout, history_norm=history, server=self._server(job, rnd),
                                                earlier_sketches=self._earlier_sketches(job.id, rnd.number),
                                                claims=self._standings(job.id, rnd.number))
        return self._evidence[key]

    def _echo_path(self, job_id: str, number: int) -> Any:
        return self.registry.state_dir / "evidence" / job_id / f"r{number}.echo.npz"

    def _claims_path(self, job_id: str) -> Any:
        return self.registry.state_dir / "evidence" / job_id / "claims.json"

    def _claims_table(self, job_id: str) -> dict[str, list[float]]:
        """device -> [sum of its label consistencies, rounds, last round, last value] over the
        job's closed rounds (strategies/claims.py); {} when none or unreadable."""
        path = self._claims_path(job_id)
        if not path.exists():
            return {}
        try:
            table = json.loads(read_checked(path, MAX_CLAIMS_BYTES))
            if not isinstance(table, dict) or not all(
                    isinstance(v, list) and len(v) == 4 and all(isinstance(x, int | float) for x in v)
                    for v in table.values()):
                raise ValueError("not a table of [sum, rounds, last round, last value]")
            return {str(d): [float(x) for x in v] for d, v in table.items()}
        except (CorruptFileError, OSError, ValueError) as exc:
            log.warning("job %s: the devices' label consistency record is unreadable (%s): judged afresh",
                        job_id, exc)
            return {}

    def _standings(self, job_id: str, number: int) -> dict[str, Standing]:
        """Each device's consistency in the job's rounds before `number` (a round closed again
        after a restart does not count twice)."""
        out = {}
        for d, (total, rounds, last, value) in self._claims_table(job_id).items():
            if last >= number:
                total, rounds = total - value, rounds - 1
            if rounds > 0:
                out[d] = Standing(total, int(rounds))
        return out

    def _remember_claims(self, job: Job, rnd: RoundRecord, now: Mapping[str, float]) -> None:
        table = self._claims_table(job.id)
        for d, c in now.items():
            total, rounds, last, value = table.get(d, [0.0, 0, -1, 0.0])
            if last == rnd.number:  # this round again (closed after a restart): replace its value
                total, rounds = total - value, rounds - 1
            elif last > rnd.number:
                continue
            table[d] = [total + float(c), rounds + 1, rnd.number, float(c)]
        write_checked(self._claims_path(job.id), json.dumps(table, sort_keys=True).encode())

    def remember(self, job: Job, rnd: RoundRecord, aggregate: Aggregate) -> None:
        """Keep what the job's next rounds judge with: the devices' label consistency
        (strategies/claims.py) and the round's trusted updates' sketches for the next round's
        echoes (strategies/echoes.py): ~4 KiB per update, beside the round's server evidence."""
        now = aggregate.info.get("claims")
        if isinstance(now, dict) and now:
            self._remember_claims(job, rnd, now)
        if not aggregate.sketches:
            return
        devices = sorted(aggregate.sketches)
        buf = io.BytesIO()
        np.savez(buf, devices=np.array(devices), sketches=np.stack([aggregate.sketches[d] for d in devices]))
        path = self._echo_path(job.id, rnd.number)
        write_checked(path, buf.getvalue())
        for old in path.parent.glob("r*.echo.npz"):  # only the round before the next one is read
            number = old.name[1:-len(".echo.npz")]
            if number.isdigit() and int(number) < rnd.number:
                old.unlink(missing_ok=True)

    def _earlier_sketches(self, job_id: str, number: int) -> dict[str, np.ndarray] | None:
        path = self._echo_path(job_id, number - 1)
        if number < 2 or not path.exists():
            return None
        try:
            with np.load(io.BytesIO(read_checked(path, MAX_EVIDENCE_BYTES)), allow_pickle=False) as z:
                devices, sketches = [str(d) for d in z["devices"]], z["sketches"].astype(np.float32)
            if sketches.ndim != 2 or len(devices) != len(sketches):
                raise ValueError("devices and sketches do not match")
            return dict(zip(devices, sketches, strict=True))
        except (CorruptFileError, OSError, KeyError, ValueError) as exc:
            log.warning("job %s round %d: the previous round's sketches are unreadable (%s): no echoes of it",
                        job_id, number, exc)
            return None

    def _server(self, job: Job, rnd: RoundRecord) -> ServerEvidence | None:
        name = str(job.params.get("aggregator") or "")
        if name != "trust":
            return None
        path = self._evidence_path(job.id, rnd.number)
        if path.exists():
            try:
                with np.load(io.BytesIO(read_checked(path, MAX_EVIDENCE_BYTES)), allow_pickle=False) as z:
                    return ServerEvidence(update=z["update"], class_gradients=z["class_gradients"],
                                          root_counts=z["root_counts"], weight=float(z["weight"]))
            except (CorruptFileError, OSError, KeyError, ValueError) as exc:
                log.warning("job %s round %d: evidence file unreadable (%s): computed again", job.id, rnd.number, exc)
        tail = self.tail(job, rnd.base_version)
        if tail is None:
            return None
        _, head = self.heads.head(job.model_name, rnd.base_version)
        try:
            server = tail.server_evidence(head, device_samples=self._typical_samples(rnd))
        except InputError as exc:
            log.warning("job %s round %d: no server update (%s)", job.id, rnd.number, exc)
            return None
        if server is not None:
            buf = io.BytesIO()
            np.savez(buf, update=server.update, class_gradients=server.class_gradients,
                     root_counts=server.root_counts, weight=np.float64(server.weight))
            write_checked(path, buf.getvalue())
        return server

    def _typical_samples(self, rnd: RoundRecord) -> float | None:
        """The median data size the round's devices report (their last state): the server
        trains as many steps as such a device."""
        sizes = []
        for device in rnd.participants:
            size = self.registry.get_device(device).state.get("data_samples")
            if isinstance(size, int) and not isinstance(size, bool) and size > 0:
                sizes.append(size)
        return float(np.median(sizes)) if sizes else None

    # ---- the rule
    def strategy(self, job: Job, rnd: RoundRecord) -> Strategy:
        key = (job.id, rnd.number)
        if key not in self._strategies:
            evidence = self.evidence(job, rnd)
            name = str(job.params.get("aggregator") or self.policy.aggregator or "median_trust")
            if name == "trust" and evidence.server is None:
                log.warning("job %s round %d: the trust rule has no server evidence; median_trust instead",
                            job.id, rnd.number)
                name = "median_trust"
            options = strategy_options(self.policy, job.params)
            dp = DpParams.of(job.params)
            if dp is not None:  # DP-FedAvg's fixed denominator: the devices the round selected
                selected = self.privacy.selected(job.id, rnd.number) or len(rnd.participants) or 1
                options = dataclasses.replace(options, dp=GaussianSum(dp.clip, dp.noise, float(selected), self.noise))
            self._strategies[key] = make_strategy(name, options, evidence)
        return self._strategies[key]

    def contribution(self, job: Job, device: str, sp: Sparse, weight: float, metrics: Mapping[str, Any],
                     rule: Strategy) -> Contribution:
        """An update as its rule sees it; its label counts are read when the server set or the
        head's output layer says how many classes there are (strategies/claims.py)."""
        classes = self.tail_classes(job) or output_classes(rule.evidence.layout)
        if not classes:
            return Contribution(device, sp, weight)
        return Contribution(device, sp, weight, decode_counts(metrics.get("label_counts"), classes),
                            decode_predicted(metrics.get("label_predicted"), classes))

    def tail_classes(self, job: Job) -> int | None:
        server = next((e.server for (j, _), e in self._evidence.items() if j == job.id and e.server is not None), None)
        return None if server is None else int(server.class_gradients.shape[0])

    # ---- folding
    def fold(self, job: Job, rnd: RoundRecord, device: str, sp: Sparse, weight: float,
             metrics: Mapping[str, Any]) -> None:
        key = (job.id, rnd.number)
        rule = self.strategy(job, rnd)
        partial = self._partials.get(key)
        if partial is None:
            if self.worker is None:  # single serve: after a restart, rebuild what was stored before
                partial = self._rebuilt(job, rnd, rule, exclude={device})
            else:
                partial = rule.start()
            self._partials[key] = partial
        rule.accumulate(partial, self.contribution(job, device, sp, weight, metrics, rule))
        if self.worker is not None and self.partials is not None:
            now = self.clock()
            if now - self._saved_at.get(key, -math.inf) >= self.save_every_s:
                self.save(job.id, rnd.number)

    def save(self, job_id: str, number: int) -> None:
        """A worker's partial to the shared state dir (partials.py)."""
        key = (job_id, number)
        if self.worker is not None and self.partials is not None and key in self._partials:
            self.partials.save(job_id, number, self.worker, self._partials[key])
            self._saved_at[key] = self.clock()

    def _rebuilt(self, job: Job, rnd: RoundRecord, rule: Strategy, *, exclude: set[str]) -> Partial:
        partial = rule.start()
        layout = self.evidence(job, rnd).layout
        for rec in self.registry.list_updates(job.id, rnd.number, status=UpdateStatus.PENDING):
            if rec.device_id in exclude or rec.norm is None:
                continue
            try:
                sp = self.heads.sparse(rec, layout)
            except (CorruptFileError, InputError):
                continue  # judged at close
            rule.accumulate(partial, self.contribution(job, rec.device_id, sp, _weight(rec), rec.metrics, rule))
        return partial

    def at_close(self, job: Job, rnd: RoundRecord, recs: Mapping[str, UpdateRecord],
                 load: Callable[[str], Sparse]) -> tuple[Strategy, Partial, dict[str, str], int]:
        """(the rule, its partial over exactly `recs`, device -> why unreadable, payloads read
        to complete it). Merges the workers' saved partials when this is a worker group's leader."""
        rule = self.strategy(job, rnd)
        key = (job.id, rnd.number)
        candidates = [self._partials[key]] if key in self._partials else []
        if self.partials is not None:
            saved, bad = self.partials.load_all(job.id, rnd.number, rule.evidence.layout)
            for worker, why in bad.items():
                log.warning("job %s round %d: worker %s's partial is unreadable (%s): its updates are read again",
                            job.id, rnd.number, worker, why)
            candidates += [p for w, p in saved.items() if w != self.worker]
        partial = rule.start()
        for p in candidates:
            if set(p.members) <= set(recs) and not set(p.members) & set(partial.members):
                partial = rule.merge(partial, p)
        unreadable: dict[str, str] = {}
        read = 0
        for device, rec in recs.items():
            if device in partial.members:
                continue
            try:
                sp = load(device)
            except (CorruptFileError, InputError) as exc:
                unreadable[device] = str(exc)[:400]
                continue
            read += 1
            rule.accumulate(partial, self.contribution(job, device, sp, _weight(rec), rec.metrics, rule))
        return rule, partial, unreadable, read

    def forget(self, job_id: str, number: int) -> None:
        key = (job_id, number)
        for cache in (self._evidence, self._strategies, self._partials, self._saved_at):
            cache.pop(key, None)
        if self.partials is not None:
            self.partials.forget(job_id, number)


def _weight(rec: UpdateRecord) -> float:
    return rec.weight if rec.weight is not None else float(rec.num_samples)
