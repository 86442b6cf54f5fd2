"""Several `edge-coordinator serve` workers on one PostgreSQL registry (issue 18):
`serve --db postgresql://... --workers-group NAME`.

Every worker subscribes to the devices' topics through the MQTT shared subscription
`$share/<group>/...`, so the broker hands each message to ONE of the group's connected
workers, and every worker ingests (verifies, reassembles, stores, acks). What a single
`serve` keeps in its own memory or files is kept here, in PostgreSQL, instead:

    leadership      a session advisory lock (`pg_try_advisory_lock`) on this module's own
                    connection: only its holder runs RoundEngine.tick (opening, closing,
                    cancelling rounds), dispatch, retention and model publishing. A worker
                    killed with -9 loses its socket, PostgreSQL releases the lock, and the
                    next worker to tick (every --tick s) takes over; closing a round is
                    resumable (a CLOSING round is re-aggregated from the stored updates).
    worker_seq      the coordinator signer's sequence (one row): every worker signs acks
                    with the same key, and a device's replay window refuses a number twice,
                    so numbers come from one UPDATE ... RETURNING, not a file per process
                    (the same clock-seeded numbering as protocol.SequenceCounter).
    replay_seen     the devices' windowed messages (progress, refusals) accepted, one row
                    per (device, seq): the primary key makes "accepted once" hold across
                    workers. A window of REPLAY_SPAN in sequence units (~600 s of the
                    device's clock-seeded numbers) instead of 1024 numbers, because shared
                    subscriptions reorder one device's messages across workers.
    upload_chunks   chunks of multi-chunk uploads (the broker spreads one upload's chunks
                    over the workers); the worker whose insert completes the set reassembles
                    it; rows are deleted once the update is stored (or after CHUNK_KEEP_S).
    worker_results  a device's result metrics (its progress report) until its update
                    arrives, perhaps at another worker.

    partials        each worker folds the updates it stores into its round's streaming partial
                    and keeps it in the shared state dir (partials.py, saved at most once a
                    second); the leader's close merges the workers' partials and decodes only
                    the payloads no partial covers yet (stored after their worker last saved, or
                    by a worker killed with -9), instead of re-reading every stored payload.
Duplicates cannot be counted twice: `Registry.add_update` checks and inserts under the
registry's write lock, and (job, device, round) is unique.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError, TransientError
from ..protocol.schema import validate_id
from ..transport.uplink import (
    UPDATE_META,
    CompletedUpload,
    OutboxKey,
    ReceiveResult,
    UpdateReceiver,
)
from .db import WRITE_LOCK_KEY

log = logging.getLogger("edge_agent.coordinator.service")
GROUP_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
REPLAY_SPAN = 600 * 10**6  # sequence units (clock-seeded: ~10**6 per second of the sender's clock)
CHUNK_KEEP_S = 3600.0  # partial uploads older than this are dropped (the device resends)
RESULT_KEEP_S = 86400.0
_LEADER_NS = 0x6557_4B52  # "eWKR": the first key of the two-int advisory lock; the group's hash is the second

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS worker_seq (id TEXT PRIMARY KEY, next BIGINT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS replay_seen (sender TEXT NOT NULL, seq BIGINT NOT NULL, PRIMARY KEY (sender, seq))",
    "CREATE TABLE IF NOT EXISTS upload_chunks (job_id TEXT NOT NULL, device_id TEXT NOT NULL, round BIGINT NOT NULL, "
    "upload TEXT NOT NULL, count BIGINT NOT NULL, idx BIGINT NOT NULL, meta TEXT NOT NULL, data BYTEA NOT NULL, "
    "received_at DOUBLE PRECISION NOT NULL, PRIMARY KEY (job_id, device_id, round, upload, count, idx))",
    "CREATE TABLE IF NOT EXISTS worker_results (job_id TEXT NOT NULL, device_id TEXT NOT NULL, round BIGINT NOT NULL, "
    "metrics TEXT NOT NULL, at DOUBLE PRECISION NOT NULL, PRIMARY KEY (job_id, device_id, round))",
    "CREATE TABLE IF NOT EXISTS workers (grp TEXT NOT NULL, id TEXT NOT NULL, pid BIGINT NOT NULL, "
    "heartbeat_at DOUBLE PRECISION NOT NULL, leader BOOLEAN NOT NULL, PRIMARY KEY (grp, id))",
)


def check_group(name: str) -> str:
    """A workers group is an MQTT topic level ($share/<group>/...): letters, digits, _ and -."""
    if not isinstance(name, str) or not GROUP_RE.fullmatch(name):
        raise ConfigError(f"--workers-group {str(name)[:80]!r}: 1-64 letters, digits, '_' or '-' (a topic level)")
    return name


def shared_filters(group: str, filters: list[str]) -> list[str]:
    """The coordinator's subscriptions as the group's shared subscriptions."""
    return [f"$share/{check_group(group)}/{f}" for f in filters]


class WorkerStore:
    """The workers' shared state: one psycopg connection (autocommit) holding the leader
    lock, and the tables above. Thread-safe (one lock): the serve loop, and the MQTT thread
    only through the signer."""

    def __init__(self, url: str, *, group: str, worker_id: str) -> None:
        try:
            import psycopg
        except ImportError:
            raise ConfigError("--workers-group needs psycopg: pip install 'psycopg[binary]==3.2.3'") from None
        self._psycopg, self._url = psycopg, url
        self.group, self.worker_id = check_group(group), worker_id
        self._lock = threading.RLock()
        self._conn: Any = None
        self.leader = False
        self._pruned_at = 0.0
        self._key = int.from_bytes(hashlib.sha256(f"leader/{group}".encode()).digest()[:4], "big", signed=True)
        self._connect()
        with self._lock, self._conn.transaction():  # workers starting together: one creates the tables
            self._conn.execute("SELECT pg_advisory_xact_lock(%s)", (WRITE_LOCK_KEY,))
            for sql in SCHEMA:
                self._conn.execute(sql)

    def _connect(self) -> None:
        from .db import redact

        try:
            self._conn = self._psycopg.connect(self._url, autocommit=True, connect_timeout=10,
                                               application_name=f"edge-coordinator worker {self.worker_id}"[:63])
        except self._psycopg.Error as exc:
            raise TransientError(f"{redact(self._url)}: workers' connection failed: "
                                 f"{str(exc).strip().splitlines()[0] if str(exc).strip() else exc}") from None

    def execute(self, sql: str, params: tuple[Any, ...] = ()) -> Any:
        """One statement on the shared connection; a lost connection is reopened on the
        next call (and leadership, which lived on it, is gone: `elect` says so)."""
        with self._lock:
            if self._conn is None or self._conn.closed:
                self.leader = False
                self._connect()
            try:
                return self._conn.execute(sql, params, prepare=False)
            except self._psycopg.OperationalError as exc:
                self.leader = False
                try:
                    self._conn.close()
                finally:
                    self._conn = None
                raise TransientError(f"workers' database connection lost: {exc}") from None

    # ---- leadership
    def elect(self) -> bool:
        """True while this worker holds the group's leader lock (tried when it does not).
        A holder only checks its connection: a session lock is re-entrant and would stack."""
        was = self.leader
        try:
            if self.leader:
                self.execute("SELECT 1")
            else:
                row = self.execute("SELECT pg_try_advisory_lock(%s, %s)", (_LEADER_NS, self._key)).fetchone()
                with self._lock:
                    self.leader = bool(row[0])
        except TransientError as exc:
            log.warning("worker %s: %s", self.worker_id, exc)
            self.leader = False
        if self.leader != was:
            log.info("worker %s %s group %s", self.worker_id, "now leads" if self.leader else "no longer leads",
                     self.group)
        return self.leader

    def resign(self) -> None:
        """Give the leader lock up (its holder lost the broker): another worker takes it."""
        try:
            self.execute("SELECT pg_advisory_unlock(%s, %s)", (_LEADER_NS, self._key))
        except TransientError:
            pass  # the connection is gone: so is the lock
        if self.leader:
            log.warning("worker %s resigns as leader of group %s", self.worker_id, self.group)
        self.leader = False

    def beat(self, pid: int) -> None:
        self.execute("INSERT INTO workers (grp, id, pid, heartbeat_at, leader) VALUES (%s, %s, %s, %s, %s) "
                     "ON CONFLICT (grp, id) DO UPDATE SET pid = EXCLUDED.pid, heartbeat_at = EXCLUDED.heartbeat_at, "
                     "leader = EXCLUDED.leader", (self.group, self.worker_id, pid, time.time(), self.leader))

    def workers(self, within_s: float = 15.0) -> list[dict[str, Any]]:
        rows = self.execute("SELECT id, pid, heartbeat_at, leader FROM workers WHERE grp = %s AND heartbeat_at > %s "
                            "ORDER BY id", (self.group, time.time() - within_s)).fetchall()
        return [{"id": r[0], "pid": r[1], "heartbeat_at": r[2], "leader": r[3]} for r in rows]

    def prune(self, now: float | None = None) -> None:
        """The leader's housekeeping: abandoned partial uploads and unclaimed results."""
        now = time.time() if now is None else now
        if now - self._pruned_at < 60.0:
            return
        self._pruned_at = now
        self.execute("DELETE FROM upload_chunks WHERE received_at < %s", (now - CHUNK_KEEP_S,))
        self.execute("DELETE FROM worker_results WHERE at < %s", (now - RESULT_KEEP_S,))
        self.execute("DELETE FROM workers WHERE grp = %s AND heartbeat_at < %s", (self.group, now - 86400))

    def close(self) -> None:
        with self._lock:
            if self._conn is not None and not self._conn.closed:
                self._conn.close()  # releases the leader lock
            self._conn, self.leader = None, False

    # ---- result metrics reported before the update
    def put_result(self, job: str, device: str, rnd: int, metrics: dict[str, Any]) -> None:
        self.execute("INSERT INTO worker_results (job_id, device_id, round, metrics, at) VALUES (%s, %s, %s, %s, %s) "
                     "ON CONFLICT (job_id, device_id, round) DO UPDATE SET metrics = EXCLUDED.metrics, at = EXCLUDED.at",
                     (job, device, rnd, json.dumps(metrics, sort_keys=True), time.time()))

    def take_result(self, job: str, device: str, rnd: int) -> dict[str, Any]:
        row = self.execute("DELETE FROM worker_results WHERE job_id = %s AND device_id = %s AND round = %s "
                           "RETURNING metrics", (job, device, rnd)).fetchone()
        return json.loads(row[0]) if row else {}


class SharedSequence:
    """protocol.SequenceCounter's numbering (max(last + 1, clock seconds x 10**6)) from one
    row every worker advances, with the database's clock (workers' clocks may differ).
    `floor`: where a local counter (keys/seq, keys/seq.floor) had got to, so moving a
    single serve to a group never makes the sequence go backwards."""

    def __init__(self, store: WorkerStore, *, floor: int = 0) -> None:
        self.store, self.problem = store, None
        store.execute("INSERT INTO worker_seq (id, next) VALUES ('coordinator', %s) ON CONFLICT (id) DO UPDATE "
                      "SET next = GREATEST(worker_seq.next, EXCLUDED.next)", (int(floor),))

    def next(self) -> int:
        row = self.store.execute(
            "UPDATE worker_seq SET next = GREATEST(next + 1, FLOOR(EXTRACT(EPOCH FROM clock_timestamp()))::BIGINT "
            "* 1000000) WHERE id = 'coordinator' RETURNING next").fetchone()
        return int(row[0])


class SharedReplay:
    """The Verifier's replay window for device messages, shared by the workers (module doc).
    Duck-types protocol.ReplayWindow.check_and_record; a database fault is an OSError, which
    the Verifier turns into a `local_fault` refusal (the device sends again)."""

    def __init__(self, store: WorkerStore, *, span: int = REPLAY_SPAN) -> None:
        self.store, self.span = store, span

    def check_and_record(self, sender: str, seq: int, issued_at: int) -> str | None:
        validate_id(sender, "sender")
        try:
            (high,) = self.store.execute("SELECT MAX(seq) FROM replay_seen WHERE sender = %s", (sender,)).fetchone()
            if high is not None and seq <= high - self.span:
                return f"sequence {seq} is older than the window ({self.span} below {high})"
            cur = self.store.execute("INSERT INTO replay_seen (sender, seq) VALUES (%s, %s) ON CONFLICT DO NOTHING",
                                     (sender, seq))
            if cur.rowcount == 0:
                return f"sequence {seq} from {sender} was already accepted"
            if high is None or seq > high:  # the window moved: forget what fell out of it
                self.store.execute("DELETE FROM replay_seen WHERE sender = %s AND seq <= %s", (sender, seq - self.span))
        except TransientError as exc:
            raise OSError(str(exc)) from None
        return None


class SharedChunks:
    """Reassembly of multi-chunk uploads across workers (module doc). Single-chunk uploads
    never come here: they complete in the worker that got them."""

    def __init__(self, store: WorkerStore, *, is_known: Callable[[OutboxKey], bool]) -> None:
        self.store, self._is_known = store, is_known

    def add(self, msg: Any, receiver: UpdateReceiver) -> ReceiveResult:
        """UpdateReceiver.add for a chunk of a multi-chunk upload (`receiver`: its ack pacing)."""
        b = msg.body
        key, upload = OutboxKey(b["job"], msg.route.device, b["round"]), b["upload"]
        if self._is_known(key):  # stored already: a repeat
            return ReceiveResult("duplicate", key, upload, receiver.ack_due(key.device, upload))
        where = (key.job, key.device, key.round, upload, b["count"])
        meta = json.dumps({k: b.get(k) for k in UPDATE_META}, sort_keys=True)
        with self.store._lock:  # one transaction: the insert that completes the set sees it complete
            self.store.execute("BEGIN")
            try:
                self.store.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))",
                                   (_LEADER_NS + 1, f"{key.job}/{key.device}/{key.round}/{upload}"))
                self.store.execute("INSERT INTO upload_chunks (job_id, device_id, round, upload, count, idx, meta, "
                                   "data, received_at) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT DO "
                                   "NOTHING", (*where, b["index"], meta, bytes(msg.data), time.time()))
                rows = self.store.execute(
                    "SELECT idx, data, meta FROM upload_chunks WHERE job_id = %s AND device_id = %s AND round = %s "
                    "AND upload = %s AND count = %s ORDER BY idx", where).fetchall() \
                    if self._complete(where) else None
                self.store.execute("COMMIT")
            except BaseException:
                try:
                    self.store.execute("ROLLBACK")
                except TransientError:
                    pass
                raise
        if rows is None or [r[0] for r in rows] != list(range(b["count"])):
            return ReceiveResult("partial", key, upload, False)
        receiver.ack_due(key.device, upload)  # starts its ack pacing, as a local completion does
        done = CompletedUpload(key, upload, [bytes(r[1]) for r in rows], **json.loads(rows[-1][2]))
        return ReceiveResult("complete", key, upload, True, done)

    def _complete(self, where: tuple[Any, ...]) -> bool:
        (n,) = self.store.execute("SELECT COUNT(*) FROM upload_chunks WHERE job_id = %s AND device_id = %s AND "
                                  "round = %s AND upload = %s AND count = %s", where).fetchone()
        return int(n) == int(where[4])

    def done(self, key: OutboxKey) -> None:
        """The update is stored (or judged): its chunks are not needed any more."""
        self.store.execute("DELETE FROM upload_chunks WHERE job_id = %s AND device_id = %s AND round = %s",
                           (key.job, key.device, key.round))
