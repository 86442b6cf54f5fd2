"""The round engine's receive path: one complete update payload from a device is checked
(size, wire format, sender, round membership and deadline, model and label set, sample count,
tensor table, finiteness and bounds), stored in the registry, and folded into the round's
running sum -- as a mixin of `RoundEngine`, over its registry, policy, lock and head cache.

Separate from rounds.py because it is the one path that handles untrusted bytes; the
screening of the stored updates at close is in robust_rounds.py, which this builds on.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import InputError
from ..updates.errors import NonFiniteDeltaError, TensorTableMismatchError, UpdateError
from ..updates.wire import unpack_update
from .aggregate import check_tensor_table
from .records import (
    MAX_SAMPLES,
    ModelVersion,
    NotFound,
    ParticipantStatus,
    RoundState,
    UpdateStatus,
    check_id,
)
from .robust import arrival_weight
from .robust_rounds import RobustRounds
from .round_types import Receipt
from .streaming import Sparse, decode_sparse

if TYPE_CHECKING:  # prometheus-client is optional: metrics are passed in, never imported here
    from .metrics import CoordinatorMetrics


class UpdateIntake(RobustRounds):
    """Mixin of RoundEngine (which sets every attribute below in its __init__)."""

    clock: Callable[[], float]
    metrics: CoordinatorMetrics | None
    _lock: threading.RLock
    _heads: dict[tuple[str, str], dict[str, np.ndarray]]
    _label_digests: dict[str, str | None]  # bundle path -> label_set_digest

    def _robust_params(self, params: Mapping[str, Any]) -> tuple[int | None, float, float]:
        raise NotImplementedError

    def _head(self, name: str, version: str) -> tuple[ModelVersion, dict[str, np.ndarray]]:
        mv = self.registry.get_model(name, version)
        if (name, version) not in self._heads:
            if len(self._heads) > 8:
                self._heads.clear()
            self._heads[(name, version)] = self.registry.load_head(mv)
        return mv, self._heads[(name, version)]

    def _labels_digest(self, mv: ModelVersion) -> str | None:
        """edge_agent.labels.label_set_digest of a version's bundle labels (None: no bundle, or
        unreadable: then updates are not checked against it). Read once per bundle."""
        if mv.bundle_path is None:
            return None
        if mv.bundle_path not in self._label_digests:
            import json
            import tarfile

            from ..int8.bundle import MANIFEST, MAX_MANIFEST_BYTES
            from ..labels import label_set_digest

            digest = None
            try:
                with tarfile.open(self.registry.state_dir / mv.bundle_path, mode="r:*") as tar:
                    member = tar.getmember(MANIFEST)
                    handle = tar.extractfile(member) if member.size <= MAX_MANIFEST_BYTES else None
                    labels = json.loads(handle.read()).get("labels") if handle is not None else None
                if isinstance(labels, list) and all(isinstance(x, str) for x in labels):
                    digest = label_set_digest(labels)
            except (OSError, KeyError, ValueError, tarfile.TarError):
                digest = None
            self._label_digests[mv.bundle_path] = digest
        return self._label_digests[mv.bundle_path]

    def receive_update(self, payload: bytes, *, sender: str, num_samples: int, wire_bytes: int | None = None,
                       energy_wh: float | None = None, metrics: Mapping[str, Any] | None = None,
                       energy_kept: float | None = None, labels_sha256: str | None = None) -> Receipt:
        """Verify, de-duplicate and store one complete update payload from `sender` (the
        verified signer). Stored updates are screened when the round closes.
        `energy_kept` (the share of the delta's energy the update kept) is recorded in the
        update's metrics; an update whose `labels_sha256` is not the round's model's label
        set is refused ("wrong_labels")."""
        if energy_kept is not None and not (isinstance(energy_kept, int | float) and 0 <= energy_kept <= 1):
            energy_kept = None  # a bogus figure must not cost the update
        if energy_kept is not None:
            metrics = {**(metrics or {}), "energy_kept": round(float(energy_kept), 6)}
        with self._lock:
            try:
                return self._receive(bytes(payload), sender, num_samples, wire_bytes, energy_wh, metrics,
                                     labels_sha256)
            except NotFound as exc:
                return Receipt("rejected", "unknown_round", str(exc)[:512])
            except InputError as exc:  # an id in the header that the registry refuses
                return Receipt("rejected", "invalid", str(exc)[:512])

    def _receive(self, payload: bytes, sender: str, num_samples: Any, wire_bytes: int | None,
                 energy_wh: float | None, metrics: Mapping[str, Any] | None,
                 labels_sha256: str | None = None) -> Receipt:
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
        if rnd.state is not RoundState.OPEN:
            return Receipt("rejected", "round_closed", f"round {number} is {rnd.state}")
        if part.status is ParticipantStatus.DROPPED:
            return Receipt("rejected", "dropped_out", f"{sender} dropped out: {part.reason}")
        if now > rnd.deadline_at:
            self.registry.set_participant(job_id, number, sender, ParticipantStatus.DROPPED, "late_update", now=now)
            return Receipt("rejected", "late", f"round {number} deadline passed {now - rnd.deadline_at:.0f} s ago")
        wire = len(payload) if wire_bytes is None else wire_bytes
        fp32 = 4 * sum(e.spec.numel for e in encoded)
        sp: Sparse | None = None
        code, detail = "", ""
        mv, head = self._head(job.model_name, rnd.base_version)
        expected_labels = self._labels_digest(mv) if labels_sha256 is not None else None
        samples_ok = not isinstance(num_samples, bool) and isinstance(num_samples, int) and 1 <= num_samples <= MAX_SAMPLES
        if energy_wh is not None and not (isinstance(energy_wh, int | float) and 0 <= energy_wh < 1e6):
            energy_wh = None  # a bogus energy report must not cost the update
        if (header.model_name, header.model_version) != (job.model_name, rnd.base_version):
            code, detail = "wrong_model", (f"update is for {header.model_name} {header.model_version}, round {number} "
                                           f"trains {job.model_name} {rnd.base_version}")
        elif expected_labels is not None and labels_sha256 != expected_labels:
            code, detail = "wrong_labels", (f"update was trained on another label set (sha256 {str(labels_sha256)[:12]}), "
                                            f"not {job.model_name} {rnd.base_version}'s ({expected_labels[:12]})")
        elif not samples_ok:
            code, detail = "bad_samples", f"num_samples {str(num_samples)[:40]!r} not in 1..{MAX_SAMPLES}"
        else:
            try:
                check_tensor_table({e.spec.name: e.spec.shape for e in encoded}, head, subset=True)  # before decoding
                sp = decode_sparse(encoded, self._layout(job.model_name, rnd.base_version))
                if not math.isfinite(sp.norm):
                    code, detail = "non_finite", f"the update's norm overflows float64 (max |value| {sp.max_abs:.3g})"
                elif sp.max_abs > self.policy.max_abs_delta:
                    code, detail = "out_of_bounds", (f"a value of magnitude {sp.max_abs:.3g} "
                                                     f"(> {self.policy.max_abs_delta:g}) in the delta")
            except UpdateError as exc:
                code = ("bad_table" if isinstance(exc, TensorTableMismatchError) else
                        "non_finite" if isinstance(exc, NonFiniteDeltaError) else "malformed")
                detail = str(exc)[:512]
        status = UpdateStatus.REJECTED if code else UpdateStatus.PENDING
        step = self._step(job.id, job.model_name, rnd.base_version) if not code and sp is not None else None
        direction = sp.dot_dense(step) / sp.norm if step is not None and sp is not None and sp.norm > 0 else None
        weight = None
        if not code and sp is not None:
            cap, _, _ = self._robust_params(job.params)
            weight = arrival_weight(num_samples, self._device_cap(sender), cap)
        stored = self.registry.add_update(
            job_id=job_id, device_id=sender, round=number, num_samples=num_samples if samples_ok else 0, wire_bytes=wire, fp32_bytes=fp32,
            sha256=hashlib.sha256(payload).hexdigest(), payload=None if code else payload, status=status,
            reason=code and f"{code}: {detail}", energy_wh=energy_wh, metrics=metrics, now=now,
            norm=None if code or sp is None else sp.norm, weight=weight, kept=None if sp is None else sp.kept,
            direction=direction)
        if stored == "duplicate":
            return Receipt("duplicate")
        if stored != "inserted":
            return Receipt("rejected", stored, f"job {job_id} round {number}")
        if code in ("non_finite", "out_of_bounds"):
            self._strike({sender: f"{code}: {detail}"[:300]})
        elif sp is not None and weight is not None:
            self._fold(job, rnd.base_version, number, sender, sp, weight)
        if self.metrics is not None:
            self.metrics.observe_update(wire_bytes=wire, fp32_bytes=fp32, energy_wh=energy_wh,
                                        status=status.value if code else "accepted")
        return Receipt("rejected", code, detail) if code else Receipt("accepted")
