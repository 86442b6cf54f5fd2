"""The registry's schema as an append-only list of migrations, in SQLite's spelling that
db.translate also makes PostgreSQL's (INTEGER PRIMARY KEY -> BIGINT identity, INTEGER ->
BIGINT, REAL -> DOUBLE PRECISION): write new entries in the SQL both engines take (no
SQLite-only table options, no PRAGMA), and test them on both (`make test-pg`).

`MIGRATIONS[i]` brings a database from schema version i to i + 1; `Registry` applies the
missing ones in ONE transaction at open and records the version in `schema_version`. Never
edit a released entry: append a new one (ALTER TABLE ..., CREATE INDEX ...).

Tables: devices, model_versions, jobs, rounds, participants (one row per device selected
for a round: its dispatch / report / dropout and why), updates (UNIQUE (job, device,
round): the de-duplication key), device_history, server_sets, engine_choices (one row per
device kind: the fleet's int8 engine choice). JSON columns hold small flat objects (tags, state,
params, metrics). Times are UNIX seconds (REAL).
"""

from __future__ import annotations

# Schema migrations: entry i brings the schema from version i to i + 1. Append only.
MIGRATIONS: list[tuple[str, ...]] = [
    (
        """CREATE TABLE devices (
            id TEXT PRIMARY KEY, fleet TEXT NOT NULL, public_key TEXT NOT NULL UNIQUE,
            enrolled_at REAL NOT NULL, approved INTEGER NOT NULL DEFAULT 0 CHECK (approved IN (0, 1)),
            tags TEXT NOT NULL DEFAULT '[]', board TEXT NOT NULL DEFAULT '',
            profile TEXT NOT NULL DEFAULT '', engine TEXT NOT NULL DEFAULT '',
            state TEXT NOT NULL DEFAULT '{}', last_seen REAL,
            online INTEGER NOT NULL DEFAULT 0 CHECK (online IN (0, 1)))""",
        """CREATE TABLE model_versions (
            name TEXT NOT NULL, version TEXT NOT NULL, parent TEXT, created_at REAL NOT NULL,
            bundle_path TEXT, head_path TEXT NOT NULL, head_sha256 TEXT NOT NULL,
            head_only INTEGER NOT NULL CHECK (head_only IN (0, 1)), metrics TEXT NOT NULL DEFAULT '{}',
            job_id TEXT, round INTEGER,
            PRIMARY KEY (name, version),
            FOREIGN KEY (name, parent) REFERENCES model_versions (name, version))""",
        """CREATE TABLE jobs (
            id TEXT PRIMARY KEY, model_name TEXT NOT NULL, model_version TEXT NOT NULL,
            selector TEXT NOT NULL, params TEXT NOT NULL, rounds INTEGER NOT NULL CHECK (rounds >= 1),
            min_devices INTEGER NOT NULL CHECK (min_devices >= 1),
            deadline_s REAL NOT NULL CHECK (deadline_s > 0), status TEXT NOT NULL,
            reason TEXT NOT NULL DEFAULT '', created_at REAL NOT NULL, updated_at REAL NOT NULL,
            waiting_since REAL,
            FOREIGN KEY (model_name, model_version) REFERENCES model_versions (name, version))""",
        """CREATE TABLE rounds (
            job_id TEXT NOT NULL REFERENCES jobs (id), number INTEGER NOT NULL CHECK (number >= 1),
            state TEXT NOT NULL, base_version TEXT NOT NULL, started_at REAL NOT NULL,
            deadline_at REAL NOT NULL, ended_at REAL, aggregated_version TEXT,
            reason TEXT NOT NULL DEFAULT '', PRIMARY KEY (job_id, number))""",
        """CREATE TABLE participants (
            job_id TEXT NOT NULL, round INTEGER NOT NULL, device_id TEXT NOT NULL REFERENCES devices (id),
            status TEXT NOT NULL, reason TEXT NOT NULL DEFAULT '', dispatched_at REAL,
            PRIMARY KEY (job_id, round, device_id),
            FOREIGN KEY (job_id, round) REFERENCES rounds (job_id, number))""",
        """CREATE TABLE updates (
            id INTEGER PRIMARY KEY, job_id TEXT NOT NULL, device_id TEXT NOT NULL REFERENCES devices (id),
            round INTEGER NOT NULL, num_samples INTEGER NOT NULL CHECK (num_samples >= 0),
            wire_bytes INTEGER NOT NULL CHECK (wire_bytes >= 0),
            fp32_bytes INTEGER NOT NULL CHECK (fp32_bytes >= 0), sha256 TEXT NOT NULL,
            received_at REAL NOT NULL, status TEXT NOT NULL, reason TEXT NOT NULL DEFAULT '',
            delta_path TEXT, energy_wh REAL, metrics TEXT NOT NULL DEFAULT '{}',
            UNIQUE (job_id, device_id, round),
            FOREIGN KEY (job_id, round) REFERENCES rounds (job_id, number))""",
        "CREATE INDEX jobs_by_status ON jobs (status)",
        "CREATE INDEX rounds_by_state ON rounds (state)",
    ),
    (  # 1 -> 2: each device's battery / power over time (sampled, bounded), for the dashboard
        """CREATE TABLE device_history (
            device_id TEXT NOT NULL REFERENCES devices (id), at REAL NOT NULL,
            battery_pct REAL, power_w REAL, energy_wh REAL, on_power INTEGER,
            PRIMARY KEY (device_id, at))""",
    ),
    (  # 2 -> 3: the per-device and per-time reads of status and the dashboard, indexed
        "CREATE INDEX participants_by_device ON participants (device_id)",
        "CREATE INDEX updates_by_received ON updates (received_at)",
    ),
    (  # 3 -> 4: streaming, robust aggregation (issues 17, 18). An update row names its stored
        # payload (delta_path: the .eaup wire bytes), its norm, its arrival weight (samples
        # after the device / job caps), its kept entries and its cosine with the job's last
        # published step (direction); devices carry their screening
        # strikes and quarantine; the round's and the device's update reads are indexed.
        "ALTER TABLE updates ADD COLUMN norm REAL",
        "ALTER TABLE updates ADD COLUMN weight REAL",
        "ALTER TABLE updates ADD COLUMN kept INTEGER",
        "ALTER TABLE updates ADD COLUMN direction REAL",
        "ALTER TABLE devices ADD COLUMN strikes INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE devices ADD COLUMN quarantined_at REAL",
        "ALTER TABLE devices ADD COLUMN quarantine_reason TEXT NOT NULL DEFAULT ''",
        "CREATE INDEX updates_by_round ON updates (job_id, round, status)",
        "CREATE INDEX updates_by_device ON updates (device_id, status, round)",
    ),
    (  # 4 -> 5: the coordinator's own evidence (issue 34): a model's labelled server set, stored
        # content-addressed as <state_dir>/server_sets/<sha256[:16]>.npz (a job may name another)
        """CREATE TABLE server_sets (
            model_name TEXT PRIMARY KEY, sha256 TEXT NOT NULL, samples INTEGER NOT NULL,
            created_at REAL NOT NULL)""",
    ),
    (  # 5 -> 6: fleet-shared int8 engine choices (issue 37): the latest per device kind, which
        # device measured it and when it was reported (registry_choices.py; at most MAX_KINDS rows)
        """CREATE TABLE engine_choices (
            kind TEXT PRIMARY KEY, engine TEXT NOT NULL, threads INTEGER NOT NULL,
            batch_size INTEGER NOT NULL, latency_ms REAL NOT NULL, per_image_cpu_s REAL NOT NULL,
            fingerprint TEXT NOT NULL, device_id TEXT NOT NULL REFERENCES devices (id),
            reported_at REAL NOT NULL)""",
        "CREATE INDEX engine_choices_by_time ON engine_choices (reported_at)",
    ),
    (  # 6 -> 7: asynchronous buffered rounds (issue 38, async_rounds.py): a participant carried
        # into a later round while it still trains names the round it was dispatched in (origin;
        # NULL: this one), which its update's header names and its staleness is counted from
        "ALTER TABLE participants ADD COLUMN origin INTEGER",
    ),
]
