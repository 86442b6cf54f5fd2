"""A throw-away PostgreSQL cluster for the registry's tests (`make test-pg`, and the
PostgreSQL-only tests in tests/unit/test_registry_pg.py).

`PgCluster.start()` runs Debian's `initdb` and `pg_ctl` (the `postgresql` package) on a
free loopback port, in a fresh temporary directory that also holds its Unix socket;
`stop()` stops it (immediate: nothing in it is worth a checkpoint) and deletes it. The
cluster trusts local connections and runs without fsync: it lives for one test session.

initdb refuses to run as root (CI runs the tests as root), so as root the server runs as
the unprivileged `nobody` through `runuser`, in a directory given to that user.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

ROOT_RUNS_AS = "nobody"


def find_bin() -> Path | None:
    """The newest installed PostgreSQL's bin directory ($EDGE_TEST_PG_BIN first)."""
    if os.environ.get("EDGE_TEST_PG_BIN"):
        return Path(os.environ["EDGE_TEST_PG_BIN"])
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parent.parent.name)
                   if p.parent.parent.name.isdigit() else 0)
    return found[-1].parent if found else None


def unavailable() -> str | None:
    """Why a cluster cannot be started here (None: it can)."""
    if find_bin() is None:
        return "no PostgreSQL server binaries (apt-get install postgresql)"
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "no psycopg (pip install 'psycopg[binary]')"
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        return "running as root without runuser (initdb refuses root)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PgCluster:
    def __init__(self) -> None:
        self.bin = find_bin()
        self.dir: Path | None = None
        self.port = 0
        self._names = itertools.count(1)

    def _run(self, *argv: str) -> subprocess.CompletedProcess[str]:
        cmd = list(argv)
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", ROOT_RUNS_AS, "--", *cmd]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)

    def start(self) -> PgCluster:
        assert self.bin is not None, unavailable()
        self.dir = Path(tempfile.mkdtemp(prefix="edge-agent-pg-"))  # not pytest's tmp: that is root-only
        if os.geteuid() == 0:
            shutil.chown(self.dir, user=ROOT_RUNS_AS)
        data = self.dir / "data"
        done = self._run(str(self.bin / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust",
                         "--no-sync", "-E", "UTF8", "--locale=C")
        if done.returncode:
            raise RuntimeError(f"initdb failed: {done.stderr.strip() or done.stdout.strip()}")
        for _ in range(5):  # a port found free can be taken before the server binds it: try another
            self.port = _free_port()
            opts = (f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off "
                    "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200")
            done = self._run(str(self.bin / "pg_ctl"), "-D", str(data), "-o", opts, "-l",
                             str(self.dir / "server.log"), "-w", "-t", "60", "start")
            if done.returncode == 0:
                return self
        log = (self.dir / "server.log").read_text(errors="replace")[-2000:] if (self.dir / "server.log").exists() else ""
        self.stop()
        raise RuntimeError(f"pg_ctl start failed: {done.stderr.strip()}\n{log}")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def _admin(self, sql: str) -> None:
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(sql)

    def create_database(self) -> str:
        """A new, empty database; returns its URL."""
        name = f"t{os.getpid()}_{next(self._names)}"
        self._admin(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def drop_database(self, url: str) -> None:
        name = url.rsplit("/", 1)[1]
        with contextlib.suppress(Exception):  # (a leftover connection is cut: FORCE)
            self._admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def stop(self) -> None:
        if self.dir is None:
            return
        if (self.dir / "data" / "postmaster.pid").exists() and self.bin is not None:
            self._run(str(self.bin / "pg_ctl"), "-D", str(self.dir / "data"), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir = None
