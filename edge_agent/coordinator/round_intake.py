"""The receive path: one complete update payload from a device is checked (size, wire format,
sender, round membership and deadline, model and label set, sample count, tensor table,
finiteness and bounds), stored in the registry, and folded into its round's aggregation.

The one path that handles untrusted bytes, so it is its own object with explicit inputs: the
registry, the round policy, the clock, the head cache, the rounds' aggregation, the strikes
and (optionally) metrics. The engine serialises calls with its lock.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..errors import InputError
from ..updates.errors import NonFiniteDeltaError, TensorTableMismatchError, UpdateError
from ..updates.wire import unpack_update
from .aggregate import check_tensor_table
from .aggregation import RoundAggregation
from .async_rounds import AsyncMode
from .heads import HeadCache
from .records import MAX_SAMPLES, NotFound, ParticipantStatus, RoundState, UpdateStatus, check_id
from .round_types import Receipt, RoundPolicy
from .streaming import Sparse, decode_sparse
from .strikes import Strikes

if TYPE_CHECKING:  # prometheus-client is optional: metrics are passed in, never imported here
    from .metrics import CoordinatorMetrics


def arrival_weight(samples: int, device_cap: float | None, job_cap: float | None) -> float:
    """The weight an update may carry as it arrives: its count, capped by what the
    coordinator knows of the device and by the job (the round cap comes at close)."""
    w = float(samples)
    for cap in (device_cap, job_cap):
        if cap is not None and cap > 0:
            w = min(w, float(cap))
    return w


class UpdateIntake:
    def __init__(self, *, registry: Any, policy: RoundPolicy, clock: Callable[[], float], heads: HeadCache,
                 aggregation: RoundAggregation, strikes: Strikes, metrics: CoordinatorMetrics | None = None) -> None:
        self.registry, self.policy, self.clock = registry, policy, clock
        self.heads, self.aggregation, self.strikes, self.metrics = heads, aggregation, strikes, metrics

    def receive(self, payload: bytes, *, sender: str, num_samples: int, wire_bytes: int | None = None,
                energy_wh: float | None = None, metrics: Mapping[str, Any] | None = None,
                energy_kept: float | None = None, labels_sha256: str | None = None) -> Receipt:
        """Verify, de-duplicate, store and fold one complete update payload from `sender` (the
        verified signer). `energy_kept` (the share of the delta's energy the update kept) is
        recorded in the update's metrics; an update whose `labels_sha256` is not the round's
        model's label set is refused ("wrong_labels")."""
        if energy_kept is not None and not (isinstance(energy_kept, int | float) and 0 <= energy_kept <= 1):
            energy_kept = None  # a bogus figure must not cost the update
        if energy_kept is not None:
            metrics = {**(metrics or {}), "energy_kept": round(float(energy_kept), 6)}
        try:
            return self._receive(bytes(payload), sender, num_samples, wire_bytes, energy_wh, metrics, labels_sha256)
        except NotFound as exc:
            return Receipt("rejected", "unknown_round", str(exc)[:512])
        except InputError as exc:  # an id in the header that the registry refuses
            return Receipt("rejected", "invalid", str(exc)[:512])

    def _receive(self, payload: bytes, sender: str, num_samples: Any, wire_bytes: int | None,
                 energy_wh: float | None, metrics: Mapping[str, Any] | None, labels_sha256: str | None) -> Receipt:
        now = self.clock()
        if len(payload) > self.policy.max_update_bytes:
            return Receipt("rejected", "oversized", f"{len(payload)} bytes > {self.policy.max_update_bytes}")
        try:
            header, encoded = unpack_update(payload, max_bytes=self.policy.max_update_bytes)
        except UpdateError as exc:
            return Receipt("rejected", "malformed", str(exc)[:512])
        if header.device_id != sender:
            return Receipt("rejected", "wrong_device", f"update names device {header.device_id}, sent by {sender}")
        job_id, number = header.job_id, header.round
        check_id(job_id, "job id")
        if self.registry.has_update(job_id, sender, number):
            return Receipt("duplicate")
        job, rnd = self.registry.get_job(job_id), self.registry.get_round_for(job_id, number, sender)
        part = rnd.participants.get(sender)
        if part is None:
            return Receipt("rejected", "not_selected", f"{sender} is not in job {job_id} round {number}")
        base_version, staleness = rnd.base_version, 0
        mode = AsyncMode.of(job.params)
        if mode is not None and rnd.state is not RoundState.OPEN:  # in flight: into the round open now
            moved = self._in_flight(job, rnd, sender, mode)
            if isinstance(moved, Receipt):
                if moved.reason == "stale" and self.metrics is not None:
                    self.metrics.observe_staleness(None)
                return moved
            if moved is not None:
                rnd, staleness = moved
                number, part = rnd.number, rnd.participants[sender]
        if rnd.state is not RoundState.OPEN:
            return Receipt("rejected", "round_closed", f"round {number} is {rnd.state}")
        if part.status is ParticipantStatus.DROPPED:
            return Receipt("rejected", "dropped_out", f"{sender} dropped out: {part.reason}")
        if now > rnd.deadline_at and mode is None:  # an asynchronous round past its deadline still waits
            self.registry.set_participant(job_id, number, sender, ParticipantStatus.DROPPED, "late_update", now=now)
            return Receipt("rejected", "late", f"round {number} deadline passed {now - rnd.deadline_at:.0f} s ago")
        wire = len(payload) if wire_bytes is None else wire_bytes
        fp32 = 4 * sum(e.spec.numel for e in encoded)
        mv, head = self.heads.head(job.model_name, base_version)
        samples_ok = not isinstance(num_samples, bool) and isinstance(num_samples, int) and 1 <= num_samples <= MAX_SAMPLES
        if energy_wh is not None and not (isinstance(energy_wh, int | float) and 0 <= energy_wh < 1e6):
            energy_wh = None  # a bogus energy report must not cost the update
        code, detail, sp = self._judge(job, base_version, header, encoded, head, mv, samples_ok, num_samples,
                                       labels_sha256)
        weight = None
        if not code and sp is not None:
            cap = job.params.get("max_samples")
            weight = arrival_weight(num_samples, self._device_cap(sender), cap if isinstance(cap, int) else None)
            if mode is not None:
                weight *= mode.weight(staleness)
                metrics = {**(metrics or {}), "staleness": staleness}
        stored = self.registry.add_update(
            job_id=job_id, device_id=sender, round=number, num_samples=num_samples if samples_ok else 0,
            wire_bytes=wire, fp32_bytes=fp32, sha256=hashlib.sha256(payload).hexdigest(),
            payload=None if code else payload, status=UpdateStatus.REJECTED if code else UpdateStatus.PENDING,
            reason=code and f"{code}: {detail}", energy_wh=energy_wh, metrics=metrics, now=now,
            norm=None if code or sp is None else sp.norm, weight=weight, kept=None if sp is None else sp.kept)
        if stored == "duplicate":
            return Receipt("duplicate")
        if stored != "inserted":
            return Receipt("rejected", stored, f"job {job_id} round {number}")
        if code in ("non_finite", "out_of_bounds"):  # what no honest device sends: a strike
            self.strikes.apply({sender: f"{code}: {detail}"[:300]})
        elif sp is not None and weight is not None:
            self.aggregation.fold(job, rnd, sender, sp, weight, metrics or {})
        if self.metrics is not None:
            self.metrics.observe_update(wire_bytes=wire, fp32_bytes=fp32, energy_wh=energy_wh,
                                        status="rejected" if code else "accepted")
            if mode is not None and not code:
                self.metrics.observe_staleness(staleness)
        return Receipt("rejected", code, detail) if code else Receipt("accepted")

    def _in_flight(self, job: Any, rnd: Any, sender: str, mode: AsyncMode) -> tuple[Any, int] | Receipt | None:
        """An asynchronous job's update whose round (its origin) has closed: (the open round
        that carries the sender, its staleness); a "stale" or "duplicate" receipt; None when
        no open round carries it (the caller refuses it as its round being closed)."""
        # reads counts and keys, not the job's rounds: this runs on every late arrival
        open_now = [n for j, n in self.registry.active_round_keys() if j == job.id]
        head = open_now[0] if open_now else None
        staleness = self.registry.published_between(job.id, rnd.number, head if head is not None else 1 << 40)
        if staleness > mode.max_staleness:
            return Receipt("rejected", "stale", mode.stale_reason(staleness, rnd.base_version))
        if head is None:
            return None
        current = self.registry.get_round_for(job.id, head, sender)
        if current.state is not RoundState.OPEN:
            return None
        if self.registry.has_update(job.id, sender, current.number):
            return Receipt("duplicate")
        part = current.participants.get(sender)
        return (current, staleness) if part is not None and part.origin == rnd.number else None

    def _judge(self, job: Any, base_version: str, header: Any, encoded: Any, head: Mapping[str, Any], mv: Any,
               samples_ok: bool, num_samples: Any, labels_sha256: str | None) -> tuple[str, str, Sparse | None]:
        """(refusal code or "", detail, the decoded update when it decodes); `base_version`:
        the version the update's round dispatched (an asynchronous one's origin round's)."""
        if (header.model_name, header.model_version) != (job.model_name, base_version):
            return "wrong_model", (f"update is for {header.model_name} {header.model_version}, round "
                                   f"{header.round} trains {job.model_name} {base_version}"), None
        expected = self.heads.labels_digest(mv) if labels_sha256 is not None else None
        if expected is not None and labels_sha256 != expected:
            return "wrong_labels", (f"update was trained on another label set (sha256 {str(labels_sha256)[:12]}), "
                                    f"not {job.model_name} {base_version}'s ({expected[:12]})"), None
        if not samples_ok:
            return "bad_samples", f"num_samples {str(num_samples)[:40]!r} not in 1..{MAX_SAMPLES}", None
        try:
            check_tensor_table({e.spec.name: e.spec.shape for e in encoded}, head, subset=True)  # before decoding
            sp = decode_sparse(encoded, self.heads.layout(job.model_name, base_version))
        except UpdateError as exc:
            code = ("bad_table" if isinstance(exc, TensorTableMismatchError) else
                    "non_finite" if isinstance(exc, NonFiniteDeltaError) else "malformed")
            return code, str(exc)[:512], None
        if not math.isfinite(sp.norm):
            return "non_finite", f"the update's norm overflows float64 (max |value| {sp.max_abs:.3g})", sp
        if sp.max_abs > self.policy.max_abs_delta:
            return "out_of_bounds", f"a value of magnitude {sp.max_abs:.3g} (> {self.policy.max_abs_delta:g}) in the delta", sp
        return "", "", sp

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
