"""The registry's read models for people watching the fleet (the CLI's `status`, the
dashboard): per-device battery/power history, energy and byte totals, and each device's
rounds. Given the registry's database; `Registry.record_state` writes the history samples
through `sample_history` inside its own write transaction.
"""

from __future__ import annotations

import json
import math
import sqlite3
from collections.abc import Mapping
from typing import Any

from ..protocol.schema import MAX_FLAT_NUMBER
from .records import check_time
from .registry_db import RegistryDb

HISTORY_EVERY_S = 60.0  # at most one battery/power sample per device per minute
HISTORY_KEEP_S = 7 * 86400.0  # and a week of them
HISTORY_KEYS = ("battery_pct", "power_w", "energy_wh")


def _sample(value: Any) -> float | int | None:
    """A number a history column can hold (the protocol bounds them; a registry written by an
    older coordinator may not): a 64-bit SQLite INTEGER overflowed on battery_pct = 2**64."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return value if abs(value) <= MAX_FLAT_NUMBER and math.isfinite(value) else None


class FleetReports:
    """Read-only queries over the registry's tables, in its database (`db`)."""

    def __init__(self, db: RegistryDb) -> None:
        self.db = db

    @staticmethod
    def sample_history(db: sqlite3.Connection, device_id: str, state: Mapping[str, Any], when: float) -> None:
        """Append a battery/power sample unless one was taken within HISTORY_EVERY_S; drop
        the device's samples older than HISTORY_KEEP_S (so the table stays bounded)."""
        last = db.execute("SELECT MAX(at) FROM device_history WHERE device_id = ?", (device_id,)).fetchone()[0]
        if last is not None and when - last < HISTORY_EVERY_S:
            return
        values = [_sample(state.get(k)) for k in HISTORY_KEYS]
        on_power = state.get("on_power")
        db.execute("INSERT OR IGNORE INTO device_history (device_id, at, battery_pct, power_w, energy_wh, on_power) "
                   "VALUES (?, ?, ?, ?, ?, ?)",
                   (device_id, when, *values, int(on_power) if isinstance(on_power, bool) else None))
        db.execute("DELETE FROM device_history WHERE device_id = ? AND at < ?", (device_id, when - HISTORY_KEEP_S))

    def device_history(self, device_id: str, *, since: float) -> list[dict[str, Any]]:
        """The device's battery/power samples since `since`, oldest first."""
        with self.db.read() as db:
            rows = db.execute("SELECT at, battery_pct, power_w, energy_wh, on_power FROM device_history "
                              "WHERE device_id = ? AND at >= ? ORDER BY at", (device_id, check_time(since, "since")))
            return [dict(r) for r in rows]

    def totals(self, job_id: str | None = None) -> dict[str, float]:
        """Bytes on the wire, fp32 bytes, energy and counts of stored updates (one job or all)."""
        with self.db.read() as db:
            row = db.execute("SELECT COUNT(*), COALESCE(SUM(wire_bytes), 0), COALESCE(SUM(fp32_bytes), 0), "
                             "COALESCE(SUM(energy_wh), 0), COALESCE(SUM(CASE WHEN status = 'accepted' THEN 1 ELSE 0 END), 0) "
                             "FROM updates WHERE job_id = COALESCE(?, job_id)", (job_id,)).fetchone()
        return {"updates": row[0], "wire_bytes": row[1], "fp32_bytes": row[2], "energy_wh": float(row[3]),
                "accepted": row[4]}

    def energy_by_device(self, *, since: float) -> dict[str, float]:
        """Energy (Wh) each device reported spending on updates received since `since`."""
        with self.db.read() as db:
            rows = db.execute("SELECT device_id, SUM(energy_wh) FROM updates WHERE received_at >= ? AND "
                              "energy_wh IS NOT NULL GROUP BY device_id", (check_time(since, "since"),))
            return {r[0]: float(r[1]) for r in rows}

    def newest_job_of_devices(self) -> dict[str, str]:
        """For each device ever selected for a round: the newest job (by creation) it was selected for."""
        with self.db.read() as db:
            # the newest by a window, not SQLite's bare column beside MAX() (PostgreSQL has none)
            rows = db.execute("SELECT device_id, job_id FROM (SELECT p.device_id, p.job_id, ROW_NUMBER() OVER "
                              "(PARTITION BY p.device_id ORDER BY j.created_at DESC, j.id DESC) AS n "
                              "FROM participants p JOIN jobs j ON j.id = p.job_id) AS newest WHERE n = 1")
            return {r[0]: r[1] for r in rows}

    def participations(self, device_id: str) -> list[dict[str, Any]]:
        """Every round the device was selected for, newest first: its participant status and
        reason, and its update (bytes, energy, status, metrics) if one arrived."""
        with self.db.read() as db:
            rows = db.execute(
                "SELECT p.job_id, p.round, p.status, p.reason, p.dispatched_at, r.started_at, r.state, "
                "u.wire_bytes, u.fp32_bytes, u.energy_wh, u.status AS update_status, u.reason AS update_reason, "
                "u.metrics, u.received_at FROM participants p JOIN rounds r ON r.job_id = p.job_id AND "
                "r.number = p.round LEFT JOIN updates u ON u.job_id = p.job_id AND u.round = p.round AND "
                "u.device_id = p.device_id WHERE p.device_id = ? ORDER BY r.started_at DESC, p.round DESC",
                (device_id,)).fetchall()
        return [{**dict(r), "metrics": json.loads(r["metrics"]) if r["metrics"] else {}} for r in rows]
