"""The coordinator's registry: devices, jobs, rounds, received updates, model versions.

One SQLite file (`<state_dir>/registry.sqlite3`, WAL, foreign keys on, synchronous=FULL)
or, with `db="postgresql://..."` (or $EDGE_COORDINATOR_DB), one PostgreSQL database that
several processes share (db.py: the dialect layer); schema and migrations in schema.py,
record types and validators in records.py; crash-safe array files in `state_dir` either way. This module holds the connection, transactions and
migrations, devices, jobs, rounds and participants; parts it is composed of hold the rest, each
given the database explicitly: model versions
(registry_models.py), received updates, screening history and strikes
(registry_updates.py), read models for the CLI and dashboard (registry_reports.py), the
fleet's int8 engine choices (registry_choices.py).

    <state_dir>/updates/<job>/r<round>/<device>.<sha256[:16]>.eaup  the update payload as received
                                                                    (legacy rows: .npz dense deltas)
    <state_dir>/models/<name>/<version>/head.<sha256[:16]>.npz      head parameters

Array files are written with `atomic.write_checked` (temp + fsync + rename, framed with
their sha256) *before* the row that names them is committed, so a committed row always
points at a complete file; a crash in between leaves at most an orphan file.

Every write is one `BEGIN IMMEDIATE` transaction (PostgreSQL: one advisory lock, the same
effect: writers one at a time), so a restarted coordinator (or the CLI in another process)
reads exactly what was committed. WAL lets `edge-coordinator status` read
while `serve` writes. The state machines live in ONE place each: `JOB_TRANSITIONS`,
`ROUND_TRANSITIONS`, `PARTICIPANT_TRANSITIONS`, checked inside the writing transaction.

API for the transport side (all thread-safe; one Registry per process):
    enrol_device / set_approved / set_tags / record_state / approved_keys   (hello, state)
    has_update(job, device, round)            -> UpdateReceiver(is_known=...)
    add_update(...) -> "inserted" | "duplicate" | "round_not_open" | "not_participant"
The round logic (rounds.RoundEngine) drives jobs, rounds and participants; the CLI reads
list_devices / list_jobs / list_rounds / list_updates / list_models.

Every string from a device or a user is validated (`ID_RE` for ids and tags, printable
and bounded for board/engine text, flat bounded JSON for state) before it reaches SQL, and
every statement is parameterised.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .records import (
    JOB_TRANSITIONS,
    PARTICIPANT_TRANSITIONS,
    ROUND_TRANSITIONS,
    Device,
    IllegalTransition,
    Job,
    JobStatus,
    ModelVersion,
    NotFound,
    Participant,
    ParticipantStatus,
    RoundRecord,
    RoundState,
    UpdateStatus,
    check_flat,
    check_id,
    check_public_key,
    check_tags,
    check_text,
    check_time,
)
from .registry_choices import EngineChoiceStore
from .registry_db import DB_NAME, RegistryDb
from .registry_models import MAX_ARRAY_FILE_BYTES, ModelStore
from .registry_reports import HISTORY_KEYS, FleetReports
from .registry_updates import UpdateStore
from .schema import MIGRATIONS

__all__ = ["DB_NAME", "MAX_ARRAY_FILE_BYTES", "MIGRATIONS", "Registry"]


class Registry:
    """The registry under `state_dir`: devices, jobs, rounds and participants here, composed with its
    parts (module doc). Thread-safe (one lock around one connection: registry_db.py)."""

    def __init__(self, *, state_dir: str | Path, clock: Callable[[], float] = time.time,
                 busy_timeout_s: float = 10.0, read_only: bool = False, db: str | None = None) -> None:
        """The arguments are RegistryDb's (registry_db.py: read-only viewers, PostgreSQL)."""
        if not callable(clock):
            raise TypeError("clock must be a callable returning seconds")
        self.db = RegistryDb(state_dir=state_dir, clock=clock, busy_timeout_s=busy_timeout_s, read_only=read_only,
                             db=db)
        self.state_dir, self.path, self.dialect, self.where = self.db.state_dir, self.db.path, self.db.dialect, \
            self.db.where
        # the parts, each given the database and what else it reads explicitly
        self.models = ModelStore(self.db)
        self.updates = UpdateStore(self.db, round_row=self._round, device_row=self._device,
                                   move_participant=self._move_participant)
        self.reports = FleetReports(self.db)
        self.choices = EngineChoiceStore(self.db)
        # their methods are the registry's API: callers need not know which part holds what
        m, u, r = self.models, self.updates, self.reports
        (self.write_head, self.add_model_version, self.get_model, self.list_models, self.load_head,
         self.server_set_path, self.store_server_set, self.load_server_set, self.set_model_server_set,
         self.model_server_set) = (m.write_head, m.add_model_version, m.get_model, m.list_models, m.load_head,
                                   m.server_set_path, m.store_server_set, m.load_server_set,
                                   m.set_model_server_set, m.model_server_set)
        (self.add_update, self.has_update, self.list_updates, self.count_updates, self.load_payload,
         self.load_delta, self.job_norm_history, self.lineage_norm_history, self.device_directions,
         self.device_samples_history, self.apply_strikes, self.release_device) = (
            u.add_update, u.has_update, u.list_updates, u.count_updates, u.load_payload, u.load_delta,
            u.job_norm_history, u.lineage_norm_history, u.device_directions, u.device_samples_history,
            u.apply_strikes, u.release_device)
        (self.device_history, self.totals, self.energy_by_device, self.newest_job_of_devices,
         self.participations) = (r.device_history, r.totals, r.energy_by_device, r.newest_job_of_devices,
                                 r.participations)
        self.record_engine_choices, self.engine_choices = self.choices.record, self.choices.latest

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def schema_version(self) -> int:
        return self.db.schema_version

    # the database's own, as the methods below use them
    def _tx(self, mode: str = "IMMEDIATE") -> Any:
        return self.db.tx(mode)

    def _read(self) -> Any:
        return self.db.read()

    def _now(self, now: float | None) -> float:
        return self.db.now(now)

    def _abs(self, rel: str) -> Path:
        return self.db.abs(rel)

    # ------------------------------------------------------------------ devices
    def enrol_device(self, *, device_id: str, public_key: str, fleet: str, board: str = "",
                     profile: str = "", engine: str = "", tags: Sequence[str] | None = None,
                     approved: bool = False, now: float | None = None) -> Device:
        """Register a device from its (self-signed) hello, or refresh its board/engine info.
        The id must be the key's fingerprint. Re-enrolling keeps approval and tags."""
        check_public_key(device_id, public_key)
        check_id(fleet, "fleet")
        board, profile, engine = (check_text(v, w) for v, w in ((board, "board"), (profile, "profile"),
                                                                 (engine, "engine")))
        tag_json = None if tags is None else json.dumps(check_tags(tags))
        when = self._now(now)
        with self._tx() as db:
            if db.execute("SELECT 1 FROM devices WHERE id = ?", (device_id,)).fetchone():
                db.execute("UPDATE devices SET fleet = ?, board = ?, profile = ?, engine = ?, "
                           "tags = COALESCE(?, tags) WHERE id = ?",
                           (fleet, board, profile, engine, tag_json, device_id))
            else:
                db.execute("INSERT INTO devices (id, fleet, public_key, enrolled_at, approved, tags, board, "
                           "profile, engine) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                           (device_id, fleet, public_key, when, int(bool(approved)), tag_json or "[]",
                            board, profile, engine))
            return self._device(db, device_id)

    def set_approved(self, device_id: str, approved: bool = True) -> Device:
        with self._tx() as db:
            self._device(db, device_id)
            db.execute("UPDATE devices SET approved = ? WHERE id = ?", (int(bool(approved)), device_id))
            return self._device(db, device_id)

    def set_tags(self, device_id: str, tags: Sequence[str]) -> Device:
        tag_json = json.dumps(check_tags(tags))
        with self._tx() as db:
            self._device(db, device_id)
            db.execute("UPDATE devices SET tags = ? WHERE id = ?", (tag_json, device_id))
            return self._device(db, device_id)

    def record_state(self, device_id: str, *, online: bool, state: Mapping[str, Any] | None = None,
                     now: float | None = None) -> Device:
        """A device was heard from (or its last will said offline). `state` keys are merged
        into the stored state (battery_pct, on_power, energy_wh, status, ...)."""
        new = check_flat(dict(state or {}), "device state")
        when = self._now(now)
        with self._tx() as db:
            merged = check_flat({**self._device(db, device_id).state, **new}, "device state")
            db.execute("UPDATE devices SET online = ?, state = ?, last_seen = ? WHERE id = ?",
                       (int(bool(online)), json.dumps(merged, sort_keys=True), when, device_id))
            if any(k in new for k in HISTORY_KEYS):
                FleetReports.sample_history(db, device_id, merged, when)
            return self._device(db, device_id)

    def record_heard(self, device_id: str, *, at: float, online: bool = True,
                     state: Mapping[str, Any] | None = None) -> Device:
        """A verified message issued at `at` (its own timestamp) that may be older than what
        is stored (a retained hello re-delivered after a restart): `state` keys are merged,
        `last_seen` never moves back, and "online" is taken only from the newest news, while
        "offline" always is (a last will is signed at connect time, so it is older than the
        states before it; the broker delivers it only once nothing newer is retained)."""
        new = check_flat(dict(state or {}), "device state")
        with self._tx() as db:
            dev = self._device(db, device_id)
            merged = check_flat({**dev.state, **new}, "device state")
            newest = dev.last_seen is None or at >= dev.last_seen
            db.execute("UPDATE devices SET online = ?, state = ?, last_seen = ? WHERE id = ?",
                       (int(bool(online)) if newest or not online else int(dev.online), json.dumps(merged, sort_keys=True),
                        at if newest else dev.last_seen, device_id))
            return self._device(db, device_id)

    def get_device(self, device_id: str) -> Device:
        with self._read() as db:
            return self._device(db, device_id)

    def list_devices(self, *, fleet: str | None = None) -> list[Device]:
        with self._read() as db:
            rows = db.execute("SELECT * FROM devices WHERE fleet = COALESCE(?, fleet) ORDER BY id", (fleet,))
            return [Device.from_row(r) for r in rows]

    def states_of(self, device_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """The stored state of each of these devices (unknown ids left out): one query per
        500 ids, for a dispatch that reads what each device said it can do."""
        ids = [check_id(d, "device id") for d in device_ids]
        out: dict[str, dict[str, Any]] = {}
        with self._read() as db:
            for start in range(0, len(ids), 500):
                part = ids[start:start + 500]
                rows = db.execute(f"SELECT id, state FROM devices WHERE id IN ({', '.join('?' * len(part))})", part)
                out.update({r["id"]: json.loads(r["state"]) for r in rows})
        return out

    def approved_keys(self) -> dict[str, str]:
        """device id -> base64 public key of every approved device (for the TrustStore)."""
        with self._read() as db:
            return {r["id"]: r["public_key"] for r in db.execute("SELECT id, public_key FROM devices WHERE approved = 1")}

    def approved_count(self) -> int:
        """How many devices are approved: a tick's cheap test of whether approvals changed."""
        with self._read() as db:
            return int(db.execute("SELECT COUNT(*) FROM devices WHERE approved = 1").fetchone()[0])

    def _device(self, db: sqlite3.Connection, device_id: str) -> Device:
        check_id(device_id, "device id")
        row = db.execute("SELECT * FROM devices WHERE id = ?", (device_id,)).fetchone()
        if row is None:
            raise NotFound(f"device {device_id!r} is not enrolled")
        return Device.from_row(row)

    # ------------------------------------------------------------------ jobs
    def create_job(self, *, job_id: str, model_name: str, model_version: str, selector: str, rounds: int,
                   min_devices: int, deadline_s: float, params: Mapping[str, Any] | None = None,
                   now: float | None = None) -> Job:
        job = Job(id=job_id, model_name=model_name, model_version=model_version, selector=selector,
                  params=dict(params or {}), rounds=rounds, min_devices=min_devices, deadline_s=deadline_s,
                  status=JobStatus.PENDING, reason="", created_at=self._now(now), updated_at=self._now(now))
        job.validate()
        with self._tx() as db:
            self.models.row(db, model_name, model_version)
            if db.execute("SELECT 1 FROM jobs WHERE id = ?", (job_id,)).fetchone():
                raise IllegalTransition(f"job {job_id!r} already exists")
            db.execute("INSERT INTO jobs (id, model_name, model_version, selector, params, rounds, min_devices, "
                       "deadline_s, status, reason, created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                       (job.id, job.model_name, job.model_version, job.selector, json.dumps(job.params, sort_keys=True),
                        job.rounds, job.min_devices, job.deadline_s, job.status.value, "", job.created_at,
                        job.updated_at))
        return job

    def get_job(self, job_id: str) -> Job:
        with self._read() as db:
            return self._job(db, job_id)

    def _job(self, db: sqlite3.Connection, job_id: str) -> Job:
        check_id(job_id, "job id")
        row = db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise NotFound(f"job {job_id!r} does not exist")
        return Job.from_row(row)

    def list_jobs(self, *, status: Sequence[JobStatus] | None = None) -> list[Job]:
        wanted = [JobStatus(s).value for s in status] if status is not None else []
        where = f"WHERE status IN ({', '.join('?' * len(wanted))})" if status is not None else ""
        with self._read() as db:
            return [Job.from_row(r) for r in db.execute(f"SELECT * FROM jobs {where} ORDER BY created_at, id", wanted)]

    def set_job_status(self, job_id: str, status: JobStatus, reason: str = "", *,
                       now: float | None = None) -> Job:
        when = self._now(now)
        with self._tx() as db:
            self._set_job(db, job_id, status, reason, when)
            return self._job(db, job_id)

    def _set_job(self, db: sqlite3.Connection, job_id: str, status: JobStatus, reason: str, now: float) -> None:
        job = self._job(db, job_id)
        if status != job.status and status not in JOB_TRANSITIONS[job.status]:
            raise IllegalTransition(f"job {job_id}: cannot go from {job.status} to {status}")
        db.execute("UPDATE jobs SET status = ?, reason = ?, updated_at = ? WHERE id = ?",
                   (status.value, check_text(reason, "reason", limit=1024), now, job_id))

    def set_job_waiting(self, job_id: str, *, since: float | None, reason: str = "") -> Job:
        """Record that the job waits for eligible devices since `since` (None: not waiting)."""
        with self._tx() as db:
            self._job(db, job_id)
            db.execute("UPDATE jobs SET waiting_since = ?, reason = ? WHERE id = ?",
                       (since, check_text(reason, "reason", limit=1024), job_id))
            return self._job(db, job_id)

    # ------------------------------------------------------------------ rounds and participants
    def open_round(self, *, job_id: str, number: int, base_version: str, devices: Sequence[str],
                   deadline_at: float, now: float | None = None,
                   carried: Mapping[str, int] | None = None) -> RoundRecord:
        """Record a new round and its selected devices (status SELECTED) in one transaction;
        `carried` (asynchronous jobs): devices still training the version of their origin
        round, added as DISPATCHED (they get no new command) with that origin."""
        when = self._now(now)
        check_time(deadline_at, "deadline")
        with self._tx() as db:
            job = self._job(db, job_id)
            self.models.row(db, job.model_name, base_version)
            if db.execute("SELECT 1 FROM rounds WHERE job_id = ? AND number = ?", (job_id, number)).fetchone():
                raise IllegalTransition(f"job {job_id}: round {number} already exists")
            db.execute("INSERT INTO rounds (job_id, number, state, base_version, started_at, deadline_at) "
                       "VALUES (?, ?, ?, ?, ?, ?)", (job_id, number, RoundState.OPEN.value, base_version, when,
                                                     deadline_at))
            for device_id in dict.fromkeys(devices):
                self._device(db, device_id)
                db.execute("INSERT INTO participants (job_id, round, device_id, status) VALUES (?, ?, ?, ?)",
                           (job_id, number, device_id, ParticipantStatus.SELECTED.value))
            for device_id, origin in (carried or {}).items():
                self._device(db, device_id)
                db.execute("INSERT INTO participants (job_id, round, device_id, status, reason, dispatched_at, origin) "
                           "VALUES (?, ?, ?, ?, ?, ?, ?)",
                           (job_id, number, device_id, ParticipantStatus.DISPATCHED.value,
                            f"in flight since round {int(origin)}", when, int(origin)))
            db.execute("UPDATE jobs SET waiting_since = NULL, reason = '', updated_at = ? WHERE id = ?", (when, job_id))
            return self._round(db, job_id, number)

    def get_round(self, job_id: str, number: int) -> RoundRecord:
        with self._read() as db:
            return self._round(db, job_id, number)

    def _round(self, db: sqlite3.Connection, job_id: str, number: int, *, only: str | None = None) -> RoundRecord:
        """The round with all its participants, or (`only`) with at most that one (O(1))."""
        row = db.execute("SELECT * FROM rounds WHERE job_id = ? AND number = ?", (job_id, number)).fetchone()
        if row is None:
            raise NotFound(f"job {job_id!r} has no round {number}")
        if only is not None:
            parts = db.execute("SELECT * FROM participants WHERE job_id = ? AND round = ? AND device_id = ?",
                               (job_id, number, only))
        else:
            parts = db.execute("SELECT * FROM participants WHERE job_id = ? AND round = ? ORDER BY device_id",
                               (job_id, number))
        return RoundRecord.from_row(row, [Participant.from_row(p) for p in parts])

    def get_round_for(self, job_id: str, number: int, device_id: str) -> RoundRecord:
        """The round with only `device_id` among its participants (if it is one): O(1)."""
        with self._read() as db:
            return self._round(db, job_id, number, only=device_id)

    def list_rounds(self, job_id: str, *, participants: bool = True) -> list[RoundRecord]:
        """The job's rounds in order; `participants=False` leaves them out (a tick reads the
        rounds every few seconds: 25 rounds x 10,000 participants is not for that)."""
        with self._read() as db:
            if not participants:
                return [RoundRecord.from_row(r, []) for r in db.execute(
                    "SELECT * FROM rounds WHERE job_id = ? ORDER BY number", (job_id,))]
            numbers = [r[0] for r in db.execute("SELECT number FROM rounds WHERE job_id = ? ORDER BY number",
                                                (job_id,))]
            return [self._round(db, job_id, n) for n in numbers]

    def participant_counts(self, job_id: str, number: int) -> dict[ParticipantStatus, int]:
        """How many of a round's participants are in each status (one indexed GROUP BY)."""
        with self._read() as db:
            return {ParticipantStatus(r[0]): int(r[1]) for r in db.execute(
                "SELECT status, COUNT(*) FROM participants WHERE job_id = ? AND round = ? GROUP BY status",
                (job_id, number))}

    def rounds_to_dispatch(self) -> list[tuple[RoundRecord, list[str]]]:
        """Open rounds with participants still to be sent their command: the round (without
        its participants) and those devices, in order. Reads only the selected rows."""
        with self._read() as db:
            todo: dict[tuple[str, int], list[str]] = {}
            for r in db.execute("SELECT p.job_id, p.round, p.device_id FROM participants p JOIN rounds r ON "
                                "r.job_id = p.job_id AND r.number = p.round WHERE r.state = ? AND p.status = ? "
                                "ORDER BY r.started_at, p.job_id, p.round, p.device_id",
                                (RoundState.OPEN.value, ParticipantStatus.SELECTED.value)):
                todo.setdefault((r[0], int(r[1])), []).append(r[2])
            return [(RoundRecord.from_row(db.execute("SELECT * FROM rounds WHERE job_id = ? AND number = ?",
                                                     key).fetchone(), []), devices) for key, devices in todo.items()]

    def offline_participants(self, *, before: float) -> list[tuple[str, int, str]]:
        """(job, round, device) of the participants an open round still waits for whose
        device went offline (its will) no later than `before` and was not heard since."""
        live = (ParticipantStatus.SELECTED.value, ParticipantStatus.DISPATCHED.value)
        with self._read() as db:
            return [(r[0], int(r[1]), r[2]) for r in db.execute(
                "SELECT p.job_id, p.round, p.device_id FROM participants p "
                "JOIN rounds r ON r.job_id = p.job_id AND r.number = p.round "
                "JOIN devices d ON d.id = p.device_id "
                "WHERE r.state = ? AND p.status IN (?, ?) AND d.online = 0 AND d.last_seen <= ? "
                "ORDER BY p.job_id, p.round, p.device_id", (RoundState.OPEN.value, *live, before))]

    def published_between(self, job_id: str, first: int, before: int) -> int:
        """How many of the job's rounds first..before-1 published a version (an indexed count:
        an asynchronous update's staleness, read on every arrival)."""
        with self._read() as db:
            return int(db.execute("SELECT COUNT(*) FROM rounds WHERE job_id = ? AND number >= ? AND number < ? "
                                  "AND state = ?", (job_id, first, before, RoundState.AGGREGATED.value)).fetchone()[0])

    def active_round_keys(self) -> list[tuple[str, int]]:
        """(job, round) of the rounds in OPEN or CLOSING state, oldest first, without reading them."""
        with self._read() as db:
            return [(r[0], int(r[1])) for r in db.execute(
                "SELECT job_id, number FROM rounds WHERE state IN (?, ?) ORDER BY started_at",
                (RoundState.OPEN.value, RoundState.CLOSING.value))]

    def active_rounds(self) -> list[RoundRecord]:
        """Rounds in OPEN or CLOSING state, over all jobs (what a restarted coordinator resumes)."""
        with self._read() as db:
            keys = db.execute("SELECT job_id, number FROM rounds WHERE state IN (?, ?) ORDER BY started_at",
                              (RoundState.OPEN.value, RoundState.CLOSING.value)).fetchall()
            return [self._round(db, k[0], k[1]) for k in keys]

    def set_participant(self, job_id: str, number: int, device_id: str, status: ParticipantStatus,
                        reason: str = "", *, now: float | None = None) -> Participant:
        """Move one participant along PARTICIPANT_TRANSITIONS (dispatched, dropped...)."""
        when = self._now(now)
        with self._tx() as db:
            rnd = self._round(db, job_id, number, only=device_id)
            if rnd.state is not RoundState.OPEN:
                raise IllegalTransition(f"job {job_id} round {number} is {rnd.state}, not open")
            self._move_participant(db, rnd, device_id, status, reason, when)
            return self._round(db, job_id, number, only=device_id).participants[device_id]

    def set_participants(self, job_id: str, number: int, moves: list[tuple[str, ParticipantStatus, str]], *,
                         only_from: frozenset[ParticipantStatus], now: float | None = None) -> list[str]:
        """Move many participants in one transaction (a round's dispatch: one commit, not one
        per device). A move whose participant is not in `only_from` any more (it reported or
        dropped out meanwhile) is skipped; returns the devices moved. The round must be open."""
        when, moved = self._now(now), []
        with self._tx() as db:
            for device_id, status, reason in moves:
                rnd = self._round(db, job_id, number, only=device_id)
                if rnd.state is not RoundState.OPEN:
                    break
                part = rnd.participants.get(device_id)
                if part is not None and part.status in only_from and part.status is not status:
                    self._move_participant(db, rnd, device_id, status, reason, when)
                    moved.append(device_id)
        return moved

    def _move_participant(self, db: sqlite3.Connection, rnd: RoundRecord, device_id: str,
                          status: ParticipantStatus, reason: str, now: float) -> None:
        part = rnd.participants.get(device_id)
        if part is None:
            raise NotFound(f"device {device_id!r} is not in job {rnd.job_id} round {rnd.number}")
        if status not in PARTICIPANT_TRANSITIONS[part.status]:
            raise IllegalTransition(f"device {device_id} in round {rnd.number}: cannot go from {part.status} "
                                    f"to {status}")
        db.execute("UPDATE participants SET status = ?, reason = ?, dispatched_at = CASE WHEN ? THEN ? ELSE "
                   "dispatched_at END WHERE job_id = ? AND round = ? AND device_id = ?",
                   (status.value, check_text(reason, "reason", limit=512), status is ParticipantStatus.DISPATCHED,
                    now, rnd.job_id, rnd.number, device_id))

    def _set_round(self, db: sqlite3.Connection, rnd: RoundRecord, state: RoundState, *, reason: str = "",
                   ended_at: float | None = None, version: str | None = None) -> None:
        if state not in ROUND_TRANSITIONS[rnd.state]:
            raise IllegalTransition(f"job {rnd.job_id} round {rnd.number}: cannot go from {rnd.state} to {state}")
        db.execute("UPDATE rounds SET state = ?, reason = ?, ended_at = ?, aggregated_version = ? "
                   "WHERE job_id = ? AND number = ?", (state.value, check_text(reason, "reason", limit=1024),
                                                       ended_at, version, rnd.job_id, rnd.number))

    def begin_closing(self, job_id: str, number: int, *, dropout_reason: str = "no_update",
                      now: float | None = None) -> RoundRecord:
        """OPEN -> CLOSING: from here no update is accepted; every participant that has not
        reported becomes a dropout (DROPPED with `dropout_reason`)."""
        when = self._now(now)
        with self._tx() as db:
            rnd = self._round(db, job_id, number)
            for part in rnd.participants.values():
                if part.status in (ParticipantStatus.SELECTED, ParticipantStatus.DISPATCHED):
                    why = dropout_reason if part.status is ParticipantStatus.DISPATCHED else "not_dispatched"
                    self._move_participant(db, rnd, part.device_id, ParticipantStatus.DROPPED, why, when)
            self._set_round(db, rnd, RoundState.CLOSING)
            return self._round(db, job_id, number)

    def finish_round(self, job_id: str, number: int, *, state: RoundState, reason: str = "",
                     verdicts: Mapping[str, tuple[UpdateStatus, str]] | None = None,
                     new_version: ModelVersion | None = None, job_status: JobStatus | None = None,
                     job_reason: str = "", now: float | None = None) -> RoundRecord:
        """End a round in ONE transaction: the screening verdicts of its updates (device ->
        (status, reason)), the new model version (its head already written by `write_head`),
        the round's final state, and optionally the job's next status."""
        when = self._now(now)
        with self._tx() as db:
            rnd = self._round(db, job_id, number)
            rows = [(UpdateStatus(status).value, check_text(why, "reason", limit=512), job_id, number, device_id)
                    for device_id, (status, why) in (verdicts or {}).items()]
            cur = db.executemany("UPDATE updates SET status = ?, reason = ? WHERE job_id = ? AND round = ? AND "
                                 "device_id = ?", rows)
            if rows and cur.rowcount != len(rows):
                missing = [r[4] for r in rows if not UpdateStore.has_row(db, job_id, r[4], number)]
                raise NotFound(f"no update from {', '.join(map(repr, missing[:5]))} in job {job_id} round {number}")
            if new_version is not None:
                self.models.insert(db, new_version)
            self._set_round(db, rnd, state, reason=reason, ended_at=when,
                            version=new_version.version if new_version else None)
            if job_status is not None:
                self._set_job(db, job_id, job_status, job_reason, when)
            return self._round(db, job_id, number)
