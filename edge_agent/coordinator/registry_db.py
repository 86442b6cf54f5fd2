"""The registry's database: one connection (SQLite file, WAL, foreign keys on,
synchronous=FULL; or PostgreSQL through db.py's dialect layer), one lock, its transactions and
migrations, its clock, and the state directory its array files live in. The registry's parts
(registry.py: devices, jobs, rounds; registry_models.py, registry_updates.py,
registry_reports.py) are each given this object: none reaches into another's state.

Every write is one `BEGIN IMMEDIATE` transaction (PostgreSQL: one advisory lock, the same
effect: writers one at a time), so a restarted coordinator (or the CLI in another process)
reads exactly what was committed.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .db import PgConnection, redact, resolve
from .records import check_time
from .schema import MIGRATIONS

DB_NAME = "registry.sqlite3"


class RegistryDb:
    """The connection, its lock and transactions (module doc). Thread-safe."""

    def __init__(self, *, state_dir: str | Path, clock: Callable[[], float] = time.time,
                 busy_timeout_s: float = 10.0, read_only: bool = False, db: str | None = None) -> None:
        """`read_only`: a `mode=ro` connection for viewers (the dashboard) that never write,
        never migrate and never create the database; every write method then fails.
        `db`: a postgresql:// URL for a registry shared by several workers (array files stay
        in `state_dir`, which they must share too), "sqlite" for the file in `state_dir`, or
        None: $EDGE_COORDINATOR_DB if set, else that file (db.resolve)."""
        if not 0 < busy_timeout_s <= 600:
            raise ValueError(f"busy_timeout_s must be in (0, 600], got {busy_timeout_s}")
        self.state_dir = Path(state_dir).resolve()
        self.path = self.state_dir / DB_NAME
        self.clock = clock
        self.lock = threading.RLock()
        url = resolve(db)
        self.dialect = "sqlite" if url is None else "postgresql"
        self.where = str(self.path) if url is None else redact(url)  # what messages name: never a password
        if url is not None:
            self._open_postgres(url, busy_timeout_s, read_only)
            return
        if read_only:
            self._open_read_only(busy_timeout_s)
            return
        self.state_dir.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: no implicit transactions; every write is an explicit BEGIN IMMEDIATE.
        self.conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False,
                                   timeout=busy_timeout_s)
        self.conn.row_factory = sqlite3.Row
        try:
            for pragma in ("journal_mode=WAL", "foreign_keys=ON", "synchronous=FULL"):
                self.conn.execute(f"PRAGMA {pragma}")
            self.migrate()
        except sqlite3.DatabaseError as exc:  # not a database, or corrupt beyond SQLite's recovery
            self.conn.close()
            raise ConfigError(f"{self.path}: not a usable registry database ({exc})") from None
        except BaseException:
            self.conn.close()
            raise

    def _open_postgres(self, url: str, timeout_s: float, read_only: bool) -> None:
        import psycopg  # (PgConnection reports a missing psycopg as one line first)

        self.conn = PgConnection(url, read_only=read_only, connect_timeout_s=timeout_s)  # type: ignore[assignment]
        try:
            if read_only:
                version = self.schema_version
                if version != len(MIGRATIONS):
                    raise ConfigError(f"{self.where}: schema version {version}, this viewer reads {len(MIGRATIONS)}")
            else:
                if not self.state_dir.is_dir():
                    self.state_dir.mkdir(parents=True, exist_ok=True)
                self.migrate()
        except psycopg.Error as exc:
            self.conn.close()
            raise ConfigError(f"{self.where}: not a usable registry database ({str(exc).strip().splitlines()[0]})") from None
        except BaseException:
            self.conn.close()
            raise

    def _open_read_only(self, busy_timeout_s: float) -> None:
        if not self.path.is_file():
            raise ConfigError(f"{self.path}: no registry here (start `edge-coordinator serve` first)")
        uri = f"{self.path.as_uri()}?mode=ro"
        self.conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False,
                                   timeout=busy_timeout_s)
        self.conn.row_factory = sqlite3.Row
        try:
            version = self.schema_version
        except sqlite3.DatabaseError as exc:
            self.conn.close()
            raise ConfigError(f"{self.path}: not a usable registry database ({exc})") from None
        if version != len(MIGRATIONS):
            self.conn.close()
            raise ConfigError(f"{self.path}: schema version {version}, this viewer reads {len(MIGRATIONS)}")

    def close(self) -> None:
        with self.lock:
            self.conn.close()

    @contextmanager
    def tx(self, mode: str = "IMMEDIATE") -> Iterator[sqlite3.Connection]:
        """One transaction: IMMEDIATE (a writer; writers run one at a time) or DEFERRED (a
        reader's snapshot). On PostgreSQL the same through PgConnection.begin."""
        with self.lock:
            pg = isinstance(self.conn, PgConnection)
            if pg:
                self.conn.begin(write=mode != "DEFERRED")
            else:
                self.conn.execute(f"BEGIN {mode}")
            try:
                yield self.conn
            except BaseException:
                try:
                    self.conn.rollback() if pg else self.conn.execute("ROLLBACK")
                except Exception:  # a lost connection: the server rolls back; keep the first error
                    pass
                raise
            self.conn.commit() if pg else self.conn.execute("COMMIT")

    def read(self) -> Any:
        return self.tx("DEFERRED")  # a consistent snapshot across several SELECTs

    def now(self, now: float | None = None) -> float:
        return check_time(self.clock() if now is None else now, "now")

    @property
    def schema_version(self) -> int:
        with self.read() as db:
            return int(db.execute("SELECT version FROM schema_version").fetchone()[0])

    def migrate(self) -> None:
        with self.tx() as db:
            db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            row = db.execute("SELECT version FROM schema_version").fetchone()
            if row is None:
                db.execute("INSERT INTO schema_version (version) VALUES (0)")
            version = 0 if row is None else int(row[0])
            if version > len(MIGRATIONS):
                raise ConfigError(f"{self.where}: schema version {version} is newer than this coordinator "
                                  f"understands ({len(MIGRATIONS)}); upgrade edge-agent")
            for statements in MIGRATIONS[version:]:
                for sql in statements:
                    db.execute(sql)
            db.execute("UPDATE schema_version SET version = ?", (len(MIGRATIONS),))

    def rel(self, path: Path) -> str:
        return path.relative_to(self.state_dir).as_posix()

    def abs(self, rel: str) -> Path:
        path = (self.state_dir / rel).resolve()
        if not path.is_relative_to(self.state_dir):  # a tampered row must not reach outside
            raise ConfigError(f"{self.where}: stored path {rel!r} leaves the state directory")
        return path

