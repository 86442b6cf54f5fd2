"""The fleet's int8 engine choices in the registry (issue 37): per device *kind* (the
selection cache key's digest: backbone, hardware fingerprint, edge-agent version, batch
size, threads, candidates; protocol/engine_choice.py), the latest choice an approved
device reported having measured in full, which device it was and when it said so.

Devices repeat their choices in every state message, so a report is written only when it
says something new: no row for the kind yet; another engine, thread count, batch size or
output fingerprint (the latest report wins); the same device's own re-measurement; or the
stored row is REFRESH_S old (its time is what keeps a kind among the MAX_KINDS newest). Two
devices of one kind that measured the same engine with a little timing noise do not make a
write per state. A report older than the stored one (a retained state read again after a
restart) never replaces it.

`latest()` is what every finetune command relays (newest first, at most
MAX_SHARED_CHOICES): the coordinator cannot know a device's kind, the device matches it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import InputError
from ..protocol.engine_choice import MAX_SHARED_CHOICES, SharedChoice
from .records import check_id, check_time
from .registry_db import RegistryDb

log = logging.getLogger(__name__)
MAX_KINDS = 256  # kinds kept (the oldest reported dropped): boards x backbones x agent versions
REFRESH_S = 3600.0  # an unchanged choice's time is refreshed at most this often
_FIELDS = ("engine", "threads", "batch_size", "latency_ms", "per_image_cpu_s", "fingerprint")
_SAME_CHOICE = ("engine", "threads", "batch_size", "fingerprint")  # not the timings: noise between devices


@dataclass(frozen=True)
class StoredChoice:
    choice: SharedChoice
    device_id: str  # the device that measured it
    reported_at: float  # when that device last said so (its message's time)


class EngineChoiceStore:
    """The `engine_choices` table, in the registry's database (`db`)."""

    def __init__(self, db: RegistryDb) -> None:
        self.db = db

    def record(self, device_id: str, choices: Sequence[SharedChoice], *, at: float) -> int:
        """Take a device's reported choices (already parsed: SharedChoice); returns how many
        rows were written. Reads first, and opens a write transaction only for news."""
        check_id(device_id, "device id")
        at = check_time(at, "reported at")
        if len(choices) > MAX_SHARED_CHOICES or not all(isinstance(c, SharedChoice) for c in choices):
            raise InputError(f"engine choices: at most {MAX_SHARED_CHOICES} SharedChoice records")
        if not choices:
            return 0
        marks = ", ".join("?" * len(choices))
        with self.db.read() as db:
            stored = {r["kind"]: r for r in db.execute(f"SELECT * FROM engine_choices WHERE kind IN ({marks})",
                                                       [c.kind for c in choices])}
        if not any(_news(stored.get(c.kind), c, device_id, at) for c in choices):
            return 0
        written = 0
        with self.db.tx() as db:
            for c in choices:  # again inside the writer's lock: another process may have written since
                row = db.execute("SELECT * FROM engine_choices WHERE kind = ?", (c.kind,)).fetchone()
                if not _news(row, c, device_id, at):
                    continue
                db.execute("INSERT INTO engine_choices (kind, engine, threads, batch_size, latency_ms, "
                           "per_image_cpu_s, fingerprint, device_id, reported_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) "
                           "ON CONFLICT (kind) DO UPDATE SET engine = excluded.engine, threads = excluded.threads, "
                           "batch_size = excluded.batch_size, latency_ms = excluded.latency_ms, "
                           "per_image_cpu_s = excluded.per_image_cpu_s, fingerprint = excluded.fingerprint, "
                           "device_id = excluded.device_id, reported_at = excluded.reported_at",
                           (c.kind, c.engine, c.threads, c.batch_size, c.latency_ms, c.per_image_cpu_s,
                            c.fingerprint, device_id, at))
                written += 1
            extra = int(db.execute("SELECT COUNT(*) FROM engine_choices").fetchone()[0]) - MAX_KINDS
            if extra > 0:
                db.execute("DELETE FROM engine_choices WHERE kind IN (SELECT kind FROM engine_choices "
                           "ORDER BY reported_at, kind LIMIT ?)", (extra,))
        return written

    def latest(self, *, limit: int = MAX_SHARED_CHOICES) -> list[StoredChoice]:
        """The stored choices, newest first (at most `limit`); a row that no longer parses (a
        database edited by hand) is left out with a warning."""
        with self.db.read() as db:
            rows = db.execute("SELECT * FROM engine_choices ORDER BY reported_at DESC, kind LIMIT ?",
                              (max(0, int(limit)),)).fetchall()
        out = []
        for r in rows:
            try:
                choice = SharedChoice.from_json({"kind": r["kind"], **{k: r[k] for k in _FIELDS}},
                                                where=f"{self.db.where}: engine_choices row {str(r['kind'])[:40]!r}")
            except InputError as exc:
                log.warning("%s: left out", exc)
                continue
            out.append(StoredChoice(choice, str(r["device_id"]), float(r["reported_at"])))
        return out


def _news(row: Any, c: SharedChoice, device_id: str, at: float) -> bool:
    """Is this report worth a write over the stored row (module doc)?"""
    if row is None:
        return True
    if at < row["reported_at"]:
        return False
    if any(row[k] != getattr(c, k) for k in _SAME_CHOICE):
        return True
    if row["device_id"] == device_id and (row["latency_ms"], row["per_image_cpu_s"]) != (c.latency_ms,
                                                                                          c.per_image_cpu_s):
        return True
    return at - row["reported_at"] >= REFRESH_S
