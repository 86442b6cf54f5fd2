"""Round orchestration as a transport-free state machine over the registry.

`RoundEngine` decides; the MQTT layer only carries messages. Everything it decides is
committed to the registry before it returns, so a coordinator killed at any point resumes
from the registry with `tick()` (a CLOSING round is re-aggregated from the stored deltas).

How the transport side drives it (one thread or several: the engine serialises calls):

    engine = RoundEngine(registry=Registry(state_dir=d), policy=RoundPolicy(), metrics=m)
    job = engine.start_job(model_name="digits", model_version="1", selector="tag:farm",
                           rounds=5, min_devices=3, deadline_s=900, budget_wh=2.0)
    every few seconds:
        result = engine.tick()                # closes due rounds, opens next ones
        for plan in engine.pending_dispatches():      # also after a restart
            for device in plan.devices:               # send a signed `finetune` cmd
                ok = publish(cmd(plan, device))
                engine.record_dispatch(plan.job_id, plan.round, device, ok=ok)
        for plan in result.cancelled: send `cancel` to plan.devices
        for outcome in result.closed: publish outcome.new_version (head only) if any
        result.failed: {job: why} for jobs that cannot go on (logged; the others continue)
    on a hello:           registry.enrol_device(device_id=..., public_key=..., fleet=..., board=...)
    on a state/progress:  registry.record_state(device, online=status != "offline",
                              state={"status", "job", "battery_pct", "on_power", "energy_wh"})
    on a device refusal:  engine.record_dropout(job, round, device, "refused:battery_low")
    on a complete upload: receipt = engine.receive_update(payload, sender=device,
                                                          num_samples=n, energy_wh=e)
                          ack(receipt.status, receipt.reason, receipt.detail)
    UpdateReceiver(is_known=lambda k: registry.has_update(k.job, k.device, k.round))

Selection (`select_devices`) and aggregation (`aggregate.py`) are pure functions; the
engine is the thin class around them. Time comes from the injectable `clock`. The engine's
parts: round_types.py (the policy and the values returned), round_intake.py (the receive
path), robust_rounds.py (the running sums and the screening at close); this module holds
jobs, the tick that opens and closes rounds, dispatch bookkeeping and closing a round.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..errors import EdgeAgentError, InputError
from .aggregation import EvidenceSource, NoEvidence, RoundAggregation
from .async_rounds import IN_FLIGHT, AsyncMode, carry_over
from .gate import ValidationGate
from .heads import HeadCache
from .partials import PartialStore
from .plateau import check_learning_params
from .privacy import DpParams, NoiseSource, PrivacyLedger, budget_refusal, predict, sampling_rate
from .records import (
    MAX_ROUNDS,
    MAX_SAMPLES,
    IllegalTransition,
    Job,
    JobStatus,
    ModelVersion,
    NotFound,
    ParticipantStatus,
    RoundRecord,
    RoundState,
    UpdateStatus,
    check_text,
)
from .registry import Registry
from .round_close import RoundCloser
from .round_intake import UpdateIntake
from .round_types import Receipt, RoundOutcome, RoundPlan, RoundPolicy, TickResult, check_options
from .secure_rounds import SecureRounds, check_secure_params, is_secure
from .selection import head_needs_mxnet, job_needs, sample_devices, select_devices
from .strategies import AGGREGATORS, default_strategy
from .strikes import Strikes

if TYPE_CHECKING:  # prometheus-client is optional: metrics are passed in, never imported here
    from .metrics import CoordinatorMetrics

_LIVE = (ParticipantStatus.SELECTED, ParticipantStatus.DISPATCHED)
FLEET_METRICS_S = 5.0  # the devices-online gauges read every device: refreshed this often, not every tick
log = logging.getLogger(__name__)
__all__ = ["AGGREGATORS", "Receipt", "RoundEngine", "RoundOutcome", "RoundPlan", "RoundPolicy", "TickResult",
           "check_options"]  # the values are defined in round_types.py


# ---------------------------------------------------------------- the engine
class RoundEngine:
    """The round state machine, composed of explicit parts: `intake` (the receive path),
    `aggregation` (each open round's rule, evidence and streaming partial), `closer` (the
    close's steps), `strikes`, and the head cache they share. `evidence`: where the
    coordinator's server sets come from (server_set.py; None: no server sets). `worker`:
    this process's id in a serve workers group, whose partials go to the shared state dir.
    `noise`: where private jobs' Gaussian noise comes from (privacy.csprng_noise; tests seed it)."""

    def __init__(self, *, registry: Registry, policy: RoundPolicy | None = None,
                 clock: Callable[[], float] = time.time, metrics: CoordinatorMetrics | None = None,
                 evidence: EvidenceSource | None = None, worker: str | None = None,
                 noise: NoiseSource | None = None) -> None:
        if not isinstance(registry, Registry):
            raise TypeError("registry must be a Registry")
        if not callable(clock):
            raise TypeError("clock must be a callable returning seconds")
        self.registry, self.policy = registry, policy or RoundPolicy()
        self.clock, self.metrics = clock, metrics
        self.evidence = evidence or NoEvidence()
        self._lock = threading.RLock()
        self.heads = HeadCache(registry, max_update_bytes=self.policy.max_update_bytes)
        self.strikes = Strikes(registry=registry, quarantine_after=self.policy.quarantine_after, clock=clock)
        self.aggregation = RoundAggregation(registry=registry, heads=self.heads, policy=self.policy,
                                            evidence=self.evidence, clock=clock, worker=worker,
                                            partials=PartialStore(registry.state_dir) if worker else None,
                                            noise=noise)
        self.privacy = PrivacyLedger(registry.state_dir)
        self.secure = SecureRounds(state_dir=registry.state_dir, clock=clock)  # secure jobs' rounds (secagg)
        self.intake = UpdateIntake(registry=registry, policy=self.policy, clock=clock, heads=self.heads,
                                   aggregation=self.aggregation, strikes=self.strikes, metrics=metrics)
        self.closer = RoundCloser(registry=registry, policy=self.policy, clock=clock, heads=self.heads,
                                  aggregation=self.aggregation, strikes=self.strikes, secure=self.secure,
                                  gate=ValidationGate(z=self.policy.gate_z, min_drop=self.policy.gate_min_drop))
        # (model, version) and bundle path -> train.depth_plan.numpy_depths, for job_needs
        self._numpy_depths: dict[tuple[str, str] | str, tuple[bool, ...]] = {}
        self._metrics_at = float("-inf")  # when the fleet gauges are next refreshed (FLEET_METRICS_S)

    # ---- jobs
    def start_job(self, *, model_name: str, model_version: str, selector: str = "all", rounds: int = 1,
                  min_devices: int = 1, deadline_s: float = 600.0, budget_wh: float | None = None,
                  params: Mapping[str, Any] | None = None, job_id: str | None = None) -> Job:
        """Create a PENDING job (the next `tick()` opens its first round). A job that names no
        aggregator gets the default for its fleet (strategies.default_strategy), recorded in
        its params with why (`aggregator_default`), so `train` and `status` can show it."""
        p = dict(params or {})
        if budget_wh is not None:
            p["budget_wh"] = budget_wh
        self._options(p)  # refuse a bad aggregator now, not at the end of round 1
        if "devices_per_round" in p and (isinstance(p["devices_per_round"], bool)
                                          or not isinstance(p["devices_per_round"], int) or p["devices_per_round"] < 1):
            raise InputError(f"devices_per_round must be a positive integer, got {p['devices_per_round']!r}")
        if "budget_wh" in p and (not isinstance(p["budget_wh"], int | float) or not 0 < p["budget_wh"] < 1e6):
            raise InputError(f"budget_wh must be a positive number of Wh, got {p['budget_wh']!r}")
        self._robust_params(p)
        mode = AsyncMode.of(p)  # a bad buffer / staleness bound: refused now
        if mode is not None and mode.buffer < min_devices:
            raise InputError(f"buffer {mode.buffer} < min_devices {min_devices}: every full buffer would close "
                             "with too few updates to publish (a buffer must hold at least --min-devices)")
        check_learning_params(p)  # server optimiser and plateau rule (server_opt.py, plateau.py)
        self._check_privacy(p, selector, mode)
        secure = is_secure(p)
        check_secure_params(p, min_devices=min_devices, asynchronous=mode is not None,
                            length=self._head_length(model_name, model_version) if secure else None,
                            fleet=self._fleet_size(selector) if secure else None)
        if not p.get("aggregator"):
            if self.policy.aggregator:
                p["aggregator"], p["aggregator_default"] = self.policy.aggregator, "the coordinator's --aggregator"
            else:
                fleet = p.get("devices_per_round") or self._fleet_size(selector)
                p["aggregator"], p["aggregator_default"] = default_strategy(
                    int(fleet), self.evidence.has_server_set(model_name, p))
        return self.registry.create_job(job_id=job_id or f"job-{secrets.token_hex(6)}", model_name=model_name,
                                        model_version=model_version, selector=selector, rounds=rounds,
                                        min_devices=min_devices, deadline_s=deadline_s, params=p, now=self.clock())

    def _check_privacy(self, p: dict[str, Any], selector: str, mode: AsyncMode | None) -> None:
        """A private job aggregates with dp_fedavg (set here when it names no rule), is not
        asynchronous, and its first round alone fits its epsilon budget (privacy.py)."""
        dp = DpParams.of(p)
        if dp is None:
            if p.get("aggregator") == "dp_fedavg" or (not p.get("aggregator") and self.policy.aggregator == "dp_fedavg"):
                raise InputError("the dp_fedavg aggregator needs a private job: give --dp-clip and --dp-noise")
            return
        if p.get("aggregator") not in (None, "", "dp_fedavg"):
            raise InputError(f"a private job aggregates with dp_fedavg (its sensitivity bound is the clip), "
                             f"not {p['aggregator']!r}: leave --aggregator out")
        if mode is not None:
            raise InputError("a private job cannot be asynchronous yet (its rounds' sampling would be unaccounted)")
        p["aggregator"] = "dp_fedavg"
        fleet = self._fleet_size(selector)
        per_round = p.get("devices_per_round") or fleet
        q = sampling_rate(int(per_round), fleet)
        if dp.epsilon is not None and predict(dp, q, 1) > dp.epsilon:
            raise InputError(f"dp_epsilon {dp.epsilon:g} is spent by the first round alone: one round at q {q:.3g} "
                             f"with dp_noise {dp.noise:g} costs epsilon {predict(dp, q, 1):.3g} (delta {dp.delta:g}); "
                             "raise --dp-noise, lower --devices-per-round or raise the budget")

    def _head_length(self, name: str, version: str) -> int | None:
        """Parameters of a version's head (None: unreadable now; its round fails later, saying why)."""
        try:
            return self.heads.layout(name, version).size
        except (EdgeAgentError, OSError):
            return None

    def _fleet_size(self, selector: str) -> int:
        """Approved, unquarantined devices the selector matches (online or not)."""
        sel = select_devices([d for d in self.registry.list_devices() if not d.quarantined], selector,
                             now=self.clock(), online_within_s=float("inf"), min_battery_pct=0.0, budget_wh=None,
                             allow_unknown_power=True, busy=frozenset(), job_id="", needs=frozenset())
        return len(sel.eligible) + len(sel.ineligible)

    def _options(self, params: Mapping[str, Any]) -> tuple[str | None, float, float]:
        pol = self.policy
        opts = (params.get("aggregator", pol.aggregator), params.get("trim_fraction", pol.trim_fraction),
                params.get("min_battery_pct", pol.min_battery_pct))
        check_options(*opts)
        return opts

    def _robust_params(self, params: Mapping[str, Any]) -> tuple[int | None, float, float]:
        """(max_samples, clip_mult, krum_fraction) of a job: its params over the policy."""
        cap = params.get("max_samples")
        clip = params.get("clip_mult", self.policy.clip_mult)
        krum = params.get("krum_fraction", self.policy.krum_fraction)
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or not 1 <= cap <= MAX_SAMPLES):
            raise InputError(f"max_samples must be an integer in 1..{MAX_SAMPLES}, got {cap!r}")
        for name, value, lo, hi in (("clip_mult", clip, 1.0, 1e6), ("krum_fraction", krum, 0.0, 0.49)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
                raise InputError(f"{name} must be a number in [{lo}, {hi}], got {value!r}")
        return cap, float(clip), float(krum)

    def cancel_job(self, job_id: str, reason: str = "cancelled by operator") -> list[RoundPlan]:
        """Cancel a job and its active round; returns whom to send a `cancel` command."""
        with self._lock:
            if self.registry.get_job(job_id).status is JobStatus.CANCELLED:
                return []  # cancelling twice is harmless (and keeps the first reason)
            self.registry.set_job_status(job_id, JobStatus.CANCELLED, reason, now=self.clock())
            return self._cancel_active(job_id, reason)

    def _cancel_active(self, job_id: str, reason: str) -> list[RoundPlan]:
        plans = []
        job = self.registry.get_job(job_id)
        for rnd in self.registry.list_rounds(job_id):
            if rnd.state not in (RoundState.OPEN, RoundState.CLOSING):
                continue
            live = rnd.with_status(*_LIVE)  # SELECTED too: a crash may have hidden a sent command
            if rnd.state is RoundState.OPEN:
                rnd = self.registry.begin_closing(job_id, rnd.number, dropout_reason="cancelled", now=self.clock())
            pending = self.registry.list_updates(job_id, rnd.number, UpdateStatus.PENDING)
            self.registry.finish_round(job_id, rnd.number, state=RoundState.CANCELLED, reason=reason,
                                       verdicts={u.device_id: (UpdateStatus.REJECTED, "job_cancelled") for u in pending},
                                       now=self.clock())
            self.aggregation.forget(job_id, rnd.number)
            self.secure.forget(job_id, rnd.number)  # (a secure round's partial masked inputs)
            self._count_round(RoundState.CANCELLED)
            plans.append(self._plan(job, rnd, tuple(live)))
        return plans

    # ---- the periodic step
    def tick(self) -> TickResult:
        """Advance every job: close due rounds (deadline passed, everyone settled, or left
        CLOSING by a crash), open the next round when enough devices are eligible."""
        result = TickResult()
        with self._lock:
            for job in self.registry.list_jobs(status=(JobStatus.PENDING, JobStatus.RUNNING)):
                try:
                    if job.status is JobStatus.PENDING:
                        job = self.registry.set_job_status(job.id, JobStatus.RUNNING, now=self.clock())
                    self._advance(job, result)
                except IllegalTransition:  # another process (the CLI) changed the job meanwhile
                    continue
                except InputError as exc:  # e.g. a corrupt base head: this job cannot go on, others can
                    why = f"{type(exc).__name__}: {exc}"[:1024]
                    self.registry.set_job_status(job.id, JobStatus.FAILED, why, now=self.clock())
                    result.cancelled += self._cancel_active(job.id, why)
                    result.failed[job.id] = why
            for job_id in dict.fromkeys(j for j, _ in self.registry.active_round_keys()):
                job = self.registry.get_job(job_id)  # cancelled by the CLI (another process)?
                if job.status.terminal:
                    result.cancelled += self._cancel_active(job.id, job.reason or f"job {job.status}")
            result.gone = self._drop_offline()
            if self.metrics is not None and self.clock() >= self._metrics_at:  # every device: not every tick
                now = self._metrics_at = self.clock()
                self._metrics_at += FLEET_METRICS_S
                devices = self.registry.list_devices()
                self.metrics.set_devices_online(sum(d.is_online(now, self.policy.online_within_s) for d in devices))
                self.metrics.set_fleet(devices=len(devices), rounds_open=len(self.registry.active_round_keys()))
        return result

    def _advance(self, job: Job, result: TickResult) -> None:
        rounds = self.registry.list_rounds(job.id, participants=False)  # a tick's read: counts, not rows
        active = [r for r in rounds if r.state in (RoundState.OPEN, RoundState.CLOSING)]
        mode = AsyncMode.of(job.params)
        if active:
            rnd = active[0]
            if rnd.state is RoundState.OPEN and is_secure(job.params):
                due = self._secure_step(job, rnd, result)
            else:
                due = rnd.state is not RoundState.OPEN or self._due(job, rnd, mode)
            if not due:
                return
            result.closed.append(self.close_round(job.id, rnd.number))
            rounds = self.registry.list_rounds(job.id, participants=False)
            job = self.registry.get_job(job.id)
        # an asynchronous job's --rounds counts versions: a buffer that fails does not use one up
        done = len(rounds) if mode is None else sum(r.state is RoundState.AGGREGATED for r in rounds)
        if job.status is JobStatus.RUNNING and done < job.rounds and len(rounds) < MAX_ROUNDS:
            opened = self._open_next(job, rounds, result)
            if opened is not None:
                result.opened.append(opened)

    def _secure_step(self, job: Job, rnd: RoundRecord, result: TickResult) -> bool:
        """A secure round's phases (secure_rounds.py): its requests go out with the tick's
        result; due once the sum is unmasked or the round failed."""
        full = self.registry.get_round(job.id, rnd.number)
        length = self.heads.layout(job.model_name, rnd.base_version).size
        due, out = self.secure.step(job, full, full.with_status(*_LIVE), length)
        result.secagg += out
        if due:  # who is in the sum reported; who advertised and then went silent dropped out, saying when
            moves = self.secure.participants(job.id, rnd.number)
            self.registry.set_participants(job.id, rnd.number, moves, only_from=frozenset(_LIVE), now=self.clock())
        return due

    def _due(self, job: Job, rnd: RoundRecord, mode: AsyncMode | None) -> bool:
        """An open round closes at its deadline or once everyone settled (reported or dropped
        out). An asynchronous one closes when its buffer is full; at its deadline only with
        --min-devices updates to publish (else it waits on for its devices in flight, who may
        deliver hours later); when everyone settled; and, at the latest, once the deadline its
        own commands carried has passed (carried devices' commands are older still)."""
        counts = self.registry.participant_counts(job.id, rnd.number)
        if bool(counts) and not any(counts.get(s) for s in _LIVE):
            return True
        if mode is None:
            return self.clock() >= rnd.deadline_at
        accepted = self.registry.count_updates(job.id, rnd.number, UpdateStatus.PENDING)
        if accepted >= mode.buffer or (self.clock() >= rnd.deadline_at and accepted >= job.min_devices):
            return True
        # every command this round waits on is past its deadline: its devices have given up
        return self.clock() >= mode.device_deadline(rnd.started_at, job.deadline_s)

    def _needs(self, job: Job, version: str) -> frozenset[str]:
        """What a device must run for this job at its depth (selection.job_needs), and
        secure aggregation for a secure job (its hello says `secagg`)."""
        needs = self._depth_needs(job, version)
        return needs | {"secagg"} if is_secure(job.params) else needs

    def _depth_needs(self, job: Job, version: str) -> frozenset[str]:
        if job.params.get("trainer") == "mxnet":
            return job_needs(job.params, None)  # no need to read the model
        key = (job.model_name, version)
        if key not in self._numpy_depths:  # read once, not on every tick a job waits
            try:
                mv = self.registry.get_model(*key)
            except EdgeAgentError:
                return job_needs(job.params, None)  # an unknown version fails the round elsewhere
            depths = self._numpy_depths.get(mv.bundle_path) if mv.bundle_path else None
            depths = depths or self._read_numpy_depths(mv)
            if depths is None:
                return job_needs(job.params, None)  # an unreadable model fails the round elsewhere
            if len(self._numpy_depths) > 64:
                self._numpy_depths.clear()
            self._numpy_depths[key] = depths
            if mv.bundle_path:
                self._numpy_depths[mv.bundle_path] = depths
        return job_needs(job.params, self._numpy_depths[key])

    def _read_numpy_depths(self, mv: ModelVersion) -> tuple[bool, ...] | None:
        """Which depths train without MXNet, from the version's bundle (a round's version
        names its root's); registered without a readable bundle, its tensors are one head."""
        from ..train.depth_plan import archive_numpy_depths

        try:
            if mv.bundle_path:
                return archive_numpy_depths(self.registry.state_dir / mv.bundle_path)
        except (EdgeAgentError, OSError) as exc:
            log.warning("model %s %s: bundle unreadable for the depths' trainers (%s)", mv.name, mv.version, exc)
        try:
            return (not head_needs_mxnet(self.registry.load_head(mv)),)
        except (EdgeAgentError, OSError):
            return None

    def _open_next(self, job: Job, rounds: list[RoundRecord], result: TickResult) -> RoundPlan | None:
        now, number = self.clock(), len(rounds) + 1
        base = next((r.aggregated_version for r in reversed(rounds) if r.aggregated_version), job.model_version)
        _, _, min_battery = self._options(job.params)
        busy = frozenset(d for r in self.registry.active_rounds() for d in r.with_status(*_LIVE))
        mode = AsyncMode.of(job.params)
        carried = self._carried_over(job, rounds, number, mode, now)
        busy |= frozenset(carried)
        devices = self.registry.list_devices()
        quarantined = [d.id for d in devices if d.quarantined]
        # a device reporting a solar forecast is judged by whether its surplus window ends by
        # the deadline of the command it would get
        deadline = now + job.deadline_s if mode is None else mode.device_deadline(now, job.deadline_s)
        cap = job.params.get("power_cap_w")
        sel = select_devices([d for d in devices if not d.quarantined], job.selector, now=now,
                             online_within_s=self.policy.online_within_s, min_battery_pct=min_battery,
                             budget_wh=job.budget_wh, allow_unknown_power=self.policy.allow_unknown_power, busy=busy,
                             job_id=job.id, needs=self._needs(job, base), deadline_at=deadline,
                             power_cap_w=float(cap) if isinstance(cap, int | float) and not isinstance(cap, bool) else None)
        per_round = job.params.get("devices_per_round")
        if mode is not None:  # asynchronous: the devices already training count against max_concurrency
            per_round = mode.new_dispatches(per_round, len(carried))
        chosen = sample_devices(sel.eligible, per_round, seed=f"{job.id}/{number}")
        # an asynchronous round opens with whoever can contribute (its buffer decides when it closes)
        if len(chosen) >= job.min_devices or (mode is not None and chosen + list(carried)):
            if not self._charge_privacy(job, number, len(chosen), len(sel.eligible), now):
                return None
            rnd = self.registry.open_round(job_id=job.id, number=number, base_version=base, devices=chosen,
                                           deadline_at=now + job.deadline_s, now=now, carried=carried)
            return self._plan(job, rnd, tuple(chosen))
        why = f"{len(chosen)} eligible device(s), need {job.min_devices}"
        if sel.ineligible:
            why += "; " + ", ".join(f"{d}: {r}" for d, r in list(sel.ineligible.items())[:20])
        if quarantined:
            why += f"; {len(quarantined)} quarantined: " + ", ".join(quarantined[:10])
        since = job.waiting_since if job.waiting_since is not None else now
        max_wait = self.policy.max_wait_s if self.policy.max_wait_s is not None else job.deadline_s
        if now - since < max_wait:
            self.registry.set_job_waiting(job.id, since=since, reason=f"waiting: {why}"[:1024])
            return None
        # Waited long enough: the round is recorded as failed (with who was ineligible and why).
        self.registry.open_round(job_id=job.id, number=number, base_version=base, devices=[], deadline_at=now, now=now)
        status, job_reason = self._job_end(job, number, aggregated=False)
        rec = self.registry.finish_round(job.id, number, state=RoundState.FAILED, reason=f"not started: {why}"[:1024],
                                         job_status=status, job_reason=job_reason, now=now)
        self._count_round(RoundState.FAILED)
        result.closed.append(RoundOutcome(job.id, number, RoundState.FAILED, rec.reason, None, (), {}, {},
                                          status or JobStatus.RUNNING))
        return None

    def _carried_over(self, job: Job, rounds: list[RoundRecord], number: int, mode: AsyncMode | None,
                      now: float) -> dict[str, int]:
        """An asynchronous job's devices of its last round still training their version, to
        carry into round `number` ({device: origin}; async_rounds.carry_over)."""
        if mode is None or not rounds:
            return {}
        carried, released = carry_over(self.registry.get_round(job.id, rounds[-1].number), rounds, number, mode,
                                       now=now, deadline_s=job.deadline_s)
        if released:
            log.info("job %s round %d: %d device(s) in flight released: %s", job.id, number, len(released),
                     ", ".join(f"{d} ({why})" for d, why in list(released.items())[:10]))
        return carried

    def _charge_privacy(self, job: Job, number: int, selected: int, eligible: int, now: float) -> bool:
        """A private job's round is charged to its ledger before it opens; False (and the job
        DONE, saying so) when it would overspend the job's epsilon budget."""
        dp = DpParams.of(job.params)
        if dp is None:
            return True
        q = sampling_rate(selected, eligible)
        why = budget_refusal(dp, self.privacy.rates(job.id, upto=number - 1), q)
        if why:
            self.registry.set_job_status(job.id, JobStatus.DONE, why[:1024], now=now)
            log.info("job %s: %s", job.id, why)
            return False
        self.privacy.charge(job.id, number, selected=selected, eligible=eligible)
        return True

    def _job_end(self, job: Job, number: int, *, aggregated: bool, stop: str = "") -> tuple[JobStatus | None, str]:
        """The job's status once round `number` ends (None: more rounds to go); `stop`: the
        plateau rule ended it (plateau.py)."""
        if stop and aggregated:
            return JobStatus.DONE, stop
        if AsyncMode.of(job.params) is not None:  # --rounds counts versions, not buffers
            versions = sum(r.state is RoundState.AGGREGATED for r in self.registry.list_rounds(job.id, participants=False)
                           if r.number != number) + int(aggregated)
            if versions < job.rounds and number < MAX_ROUNDS:
                return None, ""
            return (JobStatus.DONE, "") if versions else (
                JobStatus.FAILED, f"none of the job's {number} buffer(s) produced a model")
        if number < job.rounds:
            return None, ""
        if aggregated or any(r.state is RoundState.AGGREGATED for r in self.registry.list_rounds(job.id, participants=False)):
            return JobStatus.DONE, ""
        return JobStatus.FAILED, f"none of the {job.rounds} round(s) produced a model"

    def _plan(self, job: Job, rnd: RoundRecord, devices: tuple[str, ...]) -> RoundPlan:
        mode = AsyncMode.of(job.params)  # an asynchronous device may deliver while S more versions publish
        deadline = rnd.deadline_at if mode is None else mode.device_deadline(rnd.started_at, job.deadline_s)
        return RoundPlan(job.id, rnd.number, job.model_name, rnd.base_version, deadline, devices, dict(job.params))

    def pending_dispatches(self) -> list[RoundPlan]:
        """Open rounds' devices not yet dispatched (also those a crash interrupted)."""
        with self._lock:
            return [self._plan(self.registry.get_job(rnd.job_id), rnd, tuple(todo))
                    for rnd, todo in self.registry.rounds_to_dispatch()]

    def record_dispatch(self, job_id: str, round: int, device_id: str, *, ok: bool = True, reason: str = "") -> bool:
        """The finetune command was delivered (ok) or could not be (the device drops out).
        Returns False (and changes nothing) when it no longer matters: the round is closed
        or the device already reported or dropped out."""
        status = ParticipantStatus.DISPATCHED if ok else ParticipantStatus.DROPPED
        return self._move(job_id, round, device_id, status, "" if ok else f"dispatch_failed: {reason}")

    def record_dispatches(self, job_id: str, round: int, results: Mapping[str, str | None]) -> list[str]:
        """`record_dispatch` for many devices in one registry transaction: `results` maps a
        device to None (delivered) or the reason it could not be. Returns the devices moved."""
        moves = [(d, ParticipantStatus.DISPATCHED if why is None else ParticipantStatus.DROPPED,
                  "" if why is None else check_text(f"dispatch_failed: {why}"[:512], "reason", limit=512))
                 for d, why in results.items()]
        with self._lock:
            return self.registry.set_participants(job_id, round, moves, only_from=frozenset(_LIVE), now=self.clock())

    def _drop_offline(self) -> list[tuple[str, str, int]]:
        """Live participants whose device has been offline (its broker will, or its goodbye)
        for `policy.offline_grace_s` and not heard since. A will also comes when the broker
        restarts or the link flaps, and the agent then reconnects and finishes its round,
        so only a device that stays away is a dropout -- never in an asynchronous job, whose
        devices sleep through nights and deliver later. Read from the registry, so it holds
        across a restart and whichever worker of a group took the will."""
        out, modes = [], {}
        for job, number, device in self.registry.offline_participants(before=self.clock() - self.policy.offline_grace_s):
            if job not in modes:
                modes[job] = AsyncMode.of(self.registry.get_job(job).params)
            if modes[job] is not None:  # asynchronous: a device asleep for the night delivers in the morning;
                continue                # its staleness bound and its command's deadline let go of it
            if self._move(job, number, device, ParticipantStatus.DROPPED,
                          "offline: the broker reported the device gone (its will) and it did not come back "
                          f"within {self.policy.offline_grace_s:g} s while the round waited for its update"):
                out.append((device, job, number))
        return out

    def record_dropout(self, job_id: str, round: int, device_id: str, reason: str) -> bool:
        """A device said it will not deliver (refused: battery low, thermal, cancelled...)."""
        return self._move(job_id, round, device_id, ParticipantStatus.DROPPED, reason)

    def _move(self, job_id: str, round: int, device_id: str, status: ParticipantStatus, reason: str) -> bool:
        reason = check_text(reason[:512], "reason", limit=512)
        with self._lock:
            rnd = self.registry.get_round_for(job_id, round, device_id)  # O(1), not the whole round
            part = rnd.participants.get(device_id)
            if part is None:
                raise NotFound(f"device {device_id!r} is not in job {job_id} round {round}")
            if rnd.state is not RoundState.OPEN and part.reason.startswith(IN_FLIGHT):
                # an asynchronous job's device gave up (brown-out, refusal) after its round closed:
                # it speaks of the round it was dispatched in, it is carried in the open one
                carried = self._carried_in(job_id, round, device_id)
                if carried is None:
                    return False
                rnd, part = carried, carried.participants[device_id]
                round = rnd.number
            if rnd.state is not RoundState.OPEN or part.status not in _LIVE or part.status is status:
                return False
            self.registry.set_participant(job_id, round, device_id, status, reason, now=self.clock())
            return True

    def _carried_in(self, job_id: str, origin: int, device_id: str) -> RoundRecord | None:
        """The open round of the job that carries `device_id` from round `origin` (async_rounds.py)."""
        for job, number in self.registry.active_round_keys():
            if job == job_id:
                rnd = self.registry.get_round_for(job_id, number, device_id)
                part = rnd.participants.get(device_id)
                if part is not None and part.origin == origin:
                    return rnd
        return None

    # ---- receiving and closing
    def receive_update(self, payload: bytes, *, sender: str, num_samples: int, wire_bytes: int | None = None,
                       energy_wh: float | None = None, metrics: Mapping[str, Any] | None = None,
                       energy_kept: float | None = None, labels_sha256: str | None = None) -> Receipt:
        """UpdateIntake.receive (round_intake.py) under the engine's lock."""
        with self._lock:
            return self.intake.receive(payload, sender=sender, num_samples=num_samples, wire_bytes=wire_bytes,
                                       energy_wh=energy_wh, metrics=metrics, energy_kept=energy_kept,
                                       labels_sha256=labels_sha256)

    def receive_secagg(self, job_id: str, number: int, sender: str, kind: Any, body: dict[str, Any]) -> bool:
        """A device's secure aggregation message into its open round (secure_rounds.py).
        InputError when the round is not a secure one open."""
        with self._lock:
            rnd, job = self.registry.get_round_for(job_id, number, sender), self.registry.get_job(job_id)
            if not is_secure(job.params) or rnd.state is not RoundState.OPEN or sender not in rnd.participants:
                raise InputError(f"{kind} for {job_id} round {number}: not an open secure round of this device")
            if self.secure.load(job_id, number) is None:  # (before the tick after its opening: opened now)
                full = self.registry.get_round(job_id, number)
                self.secure.open(job, full, self.heads.layout(job.model_name, full.base_version).size)
            return self.secure.receive(job_id, number, sender, kind, body)

    def close_round(self, job_id: str, number: int) -> RoundOutcome:
        """Stop collecting, aggregate with the job's rule, gate on the server set, and register
        the new (head-only) version -- or fail the round with the reason (round_close.py)."""
        with self._lock:
            rnd, job = self.registry.get_round(job_id, number), self.registry.get_job(job_id)
            if rnd.state is RoundState.OPEN:
                # an asynchronous job's devices still training are carried into the next round
                why = (f"{IN_FLIGHT}: still training when the buffer closed; its update goes to the next round"
                       if AsyncMode.of(job.params) is not None else "no_update")
                rnd = self.registry.begin_closing(job_id, number, dropout_reason=why, now=self.clock())
            if rnd.state is RoundState.CLOSING and job.status.terminal:  # cancelled meanwhile
                self._cancel_active(job_id, job.reason or f"job {job.status}")
            rnd = self.registry.get_round(job_id, number)
            if rnd.state is not RoundState.CLOSING:  # finished: idempotent
                return self._outcome(job_id, number)
            self.closer.close(job, rnd, self._job_end)
            outcome = self._outcome(job_id, number)
            self._count_round(outcome.state)
            return outcome

    def _outcome(self, job_id: str, number: int) -> RoundOutcome:
        rnd, job = self.registry.get_round(job_id, number), self.registry.get_job(job_id)
        updates = self.registry.list_updates(job_id, number)
        version = (self.registry.get_model(job.model_name, rnd.aggregated_version)
                   if rnd.aggregated_version else None)
        return RoundOutcome(job_id, number, rnd.state, rnd.reason, version,
                            tuple(u.device_id for u in updates if u.status is UpdateStatus.ACCEPTED),
                            {u.device_id: u.reason for u in updates if u.status is UpdateStatus.REJECTED},
                            rnd.dropouts, job.status)

    def _count_round(self, state: RoundState) -> None:
        if self.metrics is not None:
            self.metrics.round_finished(state.value)
