"""The registry's received updates and what is learnt from them about each device: the
`updates` rows with their payload files

    <state_dir>/updates/<job>/r<round>/<device>.<sha256[:16]>.eaup  the update payload as received
                                                                    (legacy rows: .npz dense deltas)

(the file written with `atomic.write_checked` before its row is committed), the screening
history the robust rules read (norms, directions, sample counts of earlier updates), and
the strikes that quarantine a device. A part of `Registry` (`registry.updates`), separate
because it is the transport's hot path (`has_update`, `add_update`) and the reputation state,
not the job/round state machines; it moves a participant to REPORTED through the registry's
`_move_participant` (given to it) inside the same transaction as the insert.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..atomic import CorruptFileError, read_checked, write_checked
from .records import (
    Device,
    NotFound,
    ParticipantStatus,
    RoundRecord,
    RoundState,
    UpdateRecord,
    UpdateStatus,
    check_flat,
    check_id,
    check_text,
    check_time,
    dump_arrays,
    load_arrays,
)
from .registry_db import RegistryDb
from .registry_models import MAX_ARRAY_FILE_BYTES


class UpdateStore:
    """Received updates, screening history, strikes and quarantine, in the registry's
    database. It reads rounds and devices and moves participants with the registry's own
    row functions, given explicitly (they are the registry's tables)."""

    def __init__(self, db: RegistryDb, *, round_row: Callable[..., RoundRecord],
                 device_row: Callable[[sqlite3.Connection, str], Device],
                 move_participant: Callable[..., None]) -> None:
        self.db, self._round, self._device, self._move_participant = db, round_row, device_row, move_participant

    def add_update(self, *, job_id: str, device_id: str, round: int, num_samples: int, wire_bytes: int,
                   fp32_bytes: int, sha256: str, deltas: Mapping[str, np.ndarray] | None = None,
                   payload: bytes | None = None, norm: float | None = None, weight: float | None = None,
                   kept: int | None = None, direction: float | None = None, status: UpdateStatus = UpdateStatus.PENDING, reason: str = "",
                   energy_wh: float | None = None, metrics: Mapping[str, Any] | None = None,
                   now: float | None = None) -> str:
        """Store one received update: its `payload` as received (or, legacy, dense `deltas`)
        and what the engine measured of it (norm, arrival weight, kept entries). Returns
        "inserted"; "duplicate" if (job, device, round) is already stored (the first one is
        kept untouched); "round_not_open" / "not_participant" if a PENDING update arrives for
        a round or device that cannot take it (nothing is stored then). The participant
        becomes REPORTED. O(1) in the round's size: only this participant's row is read."""
        rec = UpdateRecord(job_id=job_id, device_id=device_id, round=round, num_samples=num_samples,
                           wire_bytes=wire_bytes, fp32_bytes=fp32_bytes, sha256=sha256,
                           received_at=self.db.now(now), status=UpdateStatus(status),
                           reason=check_text(reason, "reason", limit=512), delta_path=None, energy_wh=energy_wh,
                           metrics=check_flat(dict(metrics or {}), "metrics"))
        rec.validate()
        for value, what in ((norm, "norm"), (weight, "weight")):
            if value is not None:
                check_time(value, what)  # finite and >= 0
        with self.db.tx() as db:
            if self.has_row(db, job_id, device_id, round):
                return "duplicate"
            rnd = self._round(db, job_id, round, only=device_id)
            part = rnd.participants.get(device_id)
            if rec.status is UpdateStatus.PENDING:
                if rnd.state is not RoundState.OPEN:
                    return "round_not_open"
                if part is None or part.status not in (ParticipantStatus.SELECTED, ParticipantStatus.DISPATCHED):
                    return "not_participant"
            path = None
            if payload is not None or deltas is not None:  # the file first: a committed row names a complete file
                where = self.db.state_dir / "updates" / job_id / f"r{round}"
                path = where / f"{device_id}.{sha256[:16]}.{'eaup' if payload is not None else 'npz'}"
                write_checked(path, bytes(payload) if payload is not None else dump_arrays(deltas or {}))
            try:
                db.execute("INSERT INTO updates (job_id, device_id, round, num_samples, wire_bytes, fp32_bytes, "
                           "sha256, received_at, status, reason, delta_path, energy_wh, metrics, norm, weight, kept, "
                           "direction) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                           (job_id, device_id, round, num_samples, wire_bytes, fp32_bytes, sha256, rec.received_at,
                            rec.status.value, rec.reason, path and self.db.rel(path), energy_wh,
                            json.dumps(rec.metrics, sort_keys=True), norm, weight, kept,
                            None if direction is None or not -1.01 <= direction <= 1.01 else float(direction)))
                if part is not None and part.status in (ParticipantStatus.SELECTED, ParticipantStatus.DISPATCHED):
                    self._move_participant(db, rnd, device_id, ParticipantStatus.REPORTED, rec.status.value,
                                           rec.received_at)
            except BaseException:
                if path is not None:
                    path.unlink(missing_ok=True)
                raise
            return "inserted"

    def has_update(self, job_id: str, device_id: str, round: int) -> bool:
        with self.db.read() as db:
            return self.has_row(db, job_id, device_id, round)

    @staticmethod
    def has_row(db: sqlite3.Connection, job_id: str, device_id: str, round: int) -> bool:
        return db.execute("SELECT 1 FROM updates WHERE job_id = ? AND device_id = ? AND round = ?",
                          (job_id, device_id, round)).fetchone() is not None

    def list_updates(self, job_id: str, round: int | None = None,
                     status: UpdateStatus | None = None) -> list[UpdateRecord]:
        with self.db.read() as db:
            rows = db.execute("SELECT * FROM updates WHERE job_id = ? AND round = COALESCE(?, round) AND "
                              "status = COALESCE(?, status) ORDER BY round, device_id",
                              (job_id, round, status and status.value))
            return [UpdateRecord.from_row(r) for r in rows]

    def count_updates(self, job_id: str, round: int, status: UpdateStatus) -> int:
        """How many of a round's updates have `status` (an indexed count, no rows read)."""
        with self.db.read() as db:
            return int(db.execute("SELECT COUNT(*) FROM updates WHERE job_id = ? AND round = ? AND status = ?",
                                  (job_id, round, status.value)).fetchone()[0])

    def load_payload(self, rec: UpdateRecord) -> bytes:
        """The stored file of an update: the payload as received (.eaup) or, for a legacy row,
        the dense .npz (integrity-checked; CorruptFileError if not, or if it is gone)."""
        if rec.delta_path is None:
            raise NotFound(f"update from {rec.device_id} in job {rec.job_id} round {rec.round} has no stored delta")
        try:
            return read_checked(self.db.abs(rec.delta_path), MAX_ARRAY_FILE_BYTES)
        except FileNotFoundError:
            raise CorruptFileError(f"{rec.delta_path}: the stored update is missing") from None

    def load_delta(self, rec: UpdateRecord) -> dict[str, np.ndarray]:
        """The stored update as a dense delta (decoded from its payload; CorruptFileError if
        the file is damaged or does not decode)."""
        data = self.load_payload(rec)
        if rec.delta_path is not None and rec.delta_path.endswith(".npz"):
            return load_arrays(data, where=rec.delta_path)
        from ..updates.errors import UpdateError
        from ..updates.wire import decode_update
        try:
            return decode_update(data).deltas
        except UpdateError as exc:
            raise CorruptFileError(f"{rec.delta_path}: stored payload does not decode ({exc})") from None

    # ------------------------------------------------------------------ screening history, reputation
    def job_norm_history(self, job_id: str, before_round: int, *, rounds: int = 3) -> list[float]:
        """Norms of the accepted updates of the job's last `rounds` rounds before `before_round`."""
        with self.db.read() as db:
            rows = db.execute("SELECT norm FROM updates WHERE job_id = ? AND status = ? AND round < ? AND round >= ? "
                              "AND norm IS NOT NULL", (job_id, UpdateStatus.ACCEPTED.value, before_round,
                                                       before_round - rounds))
            return [float(r[0]) for r in rows]

    def lineage_norm_history(self, model_name: str, *, before: tuple[str, int], limit: int = 200) -> list[float]:
        """Norms of the most recent accepted updates of any job on `model_name` (the model's
        lineage), leaving out job `before[0]`'s rounds from `before[1]` on."""
        job_id, number = before
        with self.db.read() as db:
            rows = db.execute("SELECT u.norm FROM updates u JOIN jobs j ON j.id = u.job_id WHERE j.model_name = ? "
                              "AND u.status = ? AND u.norm IS NOT NULL AND NOT (u.job_id = ? AND u.round >= ?) "
                              "ORDER BY u.received_at DESC LIMIT ?",
                              (model_name, UpdateStatus.ACCEPTED.value, job_id, number, limit))
            return [float(r[0]) for r in rows]

    def device_directions(self, job_id: str, device_id: str, before_round: int, *, limit: int = 2) -> list[float]:
        """The device's `direction` (cosine with the job's previous step) in its last `limit`
        updates of this job before `before_round` (the (job, device, round) key's index)."""
        with self.db.read() as db:
            rows = db.execute("SELECT direction FROM updates WHERE job_id = ? AND device_id = ? AND round < ? AND "
                              "direction IS NOT NULL ORDER BY round DESC LIMIT ?",
                              (job_id, device_id, before_round, limit))
            return [float(r[0]) for r in rows]

    def device_samples_history(self, device_id: str, *, limit: int = 10) -> int | None:
        """The most samples the device reported in its last `limit` accepted updates."""
        with self.db.read() as db:
            rows = db.execute("SELECT num_samples FROM updates WHERE device_id = ? AND status = ? "
                              "ORDER BY round DESC LIMIT ?", (device_id, UpdateStatus.ACCEPTED.value, limit))
            counts = [int(r[0]) for r in rows]
            return max(counts) if counts else None

    def apply_strikes(self, strikes: Mapping[str, str | None], *, quarantine_after: int,
                      now: float | None = None) -> list[Device]:
        """device -> why it was screened out (a strike) or None (accepted: one strike off).
        Returns the devices this quarantined (strikes reached `quarantine_after`)."""
        when = self.db.now(now)
        out = []
        with self.db.tx() as db:  # an accepted update costs one cheap statement (most devices have no strike)
            db.executemany("UPDATE devices SET strikes = strikes - 1 WHERE id = ? AND strikes > 0",
                           [(check_id(d, "device id"),) for d, why in strikes.items() if not why])
            for device_id, why in strikes.items():
                if not why:
                    continue
                dev = self._device(db, device_id)
                n = dev.strikes + 1 if why else max(0, dev.strikes - 1)
                db.execute("UPDATE devices SET strikes = ? WHERE id = ?", (n, device_id))
                if why and n >= quarantine_after and not dev.quarantined:
                    db.execute("UPDATE devices SET quarantined_at = ?, quarantine_reason = ? WHERE id = ?",
                               (when, check_text(f"{n} updates screened out; last: {why}"[:512], "reason",
                                                 limit=512), device_id))
                    out.append(self._device(db, device_id))
        return out

    def release_device(self, device_id: str) -> Device:
        """Lift a quarantine (and clear the strikes): the device is selectable again."""
        with self.db.tx() as db:
            self._device(db, device_id)
            db.execute("UPDATE devices SET quarantined_at = NULL, quarantine_reason = '', strikes = 0 WHERE id = ?",
                       (device_id,))
            return self._device(db, device_id)
