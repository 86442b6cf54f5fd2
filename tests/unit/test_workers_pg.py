"""The workers' shared state on PostgreSQL (coordinator/workers.py): leader election and
failover, the shared signer sequence, the shared replay window, multi-chunk uploads spread
over workers, and the serve locks of a shared state directory. Needs a throw-away cluster
(tests/pg_cluster.py): skipped without PostgreSQL."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from edge_agent.coordinator.service_files import AlreadyServing, lock_state_dir
from edge_agent.coordinator.workers import (
    REPLAY_SPAN,
    SharedChunks,
    SharedReplay,
    SharedSequence,
    WorkerStore,
    check_group,
    shared_filters,
)
from edge_agent.errors import ConfigError
from edge_agent.transport import UpdateReceiver

DEVICE = "a" * 16


def test_group_names_are_topic_levels() -> None:
    assert shared_filters("g1", ["p/f/devices/+/update"]) == ["$share/g1/p/f/devices/+/update"]
    for bad in ("", "a/b", "+", "#", "x" * 65, "a b"):
        with pytest.raises(ConfigError):
            check_group(bad)


def test_one_leader_and_failover_when_its_connection_dies(pg_url: str) -> None:
    a = WorkerStore(pg_url, group="g", worker_id="a")
    b = WorkerStore(pg_url, group="g", worker_id="b")
    other = WorkerStore(pg_url, group="other", worker_id="c")
    try:
        assert a.elect() and not b.elect()
        assert a.elect() and not b.elect()  # a holder keeps it; the lock does not stack
        assert other.elect()  # each group its own leader
        a.close()  # what a kill -9 does to its socket: PostgreSQL releases the lock
        t0 = time.monotonic()
        while not b.elect():  # once a's backend has gone (a few ms: the close is asynchronous)
            assert time.monotonic() - t0 < 2.0, "the closed connection's lock was not released"
            time.sleep(0.01)
        a2 = WorkerStore(pg_url, group="g", worker_id="a")
        try:
            assert not a2.elect()  # a restarted worker does not take it back
        finally:
            a2.close()
    finally:
        for s in (a, b, other):
            s.close()


def test_a_killed_leader_process_releases_the_lock(pg_url: str) -> None:
    code = ("import sys, time; from edge_agent.coordinator.workers import WorkerStore; "
            "s = WorkerStore(sys.argv[1], group='g', worker_id='victim'); assert s.elect(); "
            "print('leader', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code, pg_url], stdout=subprocess.PIPE, text=True)
    b = WorkerStore(pg_url, group="g", worker_id="b")
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "leader"
        assert not b.elect()
        proc.kill()  # SIGKILL
        proc.wait(10)
        t0 = time.monotonic()
        while not b.elect():
            assert time.monotonic() - t0 < 10, "the killed leader's lock was not released"
            time.sleep(0.05)
    finally:
        proc.kill()
        b.close()


def test_the_shared_sequence_increases_across_workers_and_resumes_above_a_floor(pg_url: str) -> None:
    a = WorkerStore(pg_url, group="g", worker_id="a")
    b = WorkerStore(pg_url, group="g", worker_id="b")
    try:
        floor = int(time.time() + 3600) * 10**6  # a local keys/seq ahead of the clock
        sa, sb = SharedSequence(a, floor=floor), SharedSequence(b, floor=0)
        seen = [s.next() for _ in range(50) for s in (sa, sb)]
        assert seen == sorted(seen) and len(set(seen)) == len(seen)
        assert seen[0] > floor
        assert SharedSequence(a, floor=0).next() > seen[-1]  # a lower floor never moves it back
    finally:
        a.close()
        b.close()


def test_the_shared_replay_window_accepts_each_message_once_in_any_worker_and_order(pg_url: str) -> None:
    a = WorkerStore(pg_url, group="g", worker_id="a")
    b = WorkerStore(pg_url, group="g", worker_id="b")
    try:
        ra, rb = SharedReplay(a), SharedReplay(b)
        base = int(time.time()) * 10**6
        assert ra.check_and_record(DEVICE, base + 10**6, 0) is None  # the next second's message first
        assert rb.check_and_record(DEVICE, base + 5, 0) is None  # then an earlier one, at another worker
        assert "already accepted" in (ra.check_and_record(DEVICE, base + 5, 0) or "")
        assert "already accepted" in (rb.check_and_record(DEVICE, base + 10**6, 0) or "")
        assert ra.check_and_record(DEVICE, base + 3 * REPLAY_SPAN, 0) is None
        assert "older than the window" in (rb.check_and_record(DEVICE, base + 6, 0) or "")
        (rows,) = a.execute("SELECT COUNT(*) FROM replay_seen WHERE sender = %s", (DEVICE,)).fetchone()
        assert rows == 1  # what fell out of the window is forgotten
    finally:
        a.close()
        b.close()


def _chunk(index: int, count: int, data: bytes, upload: str = "u1") -> SimpleNamespace:
    body = {"job": "job-1", "round": 1, "upload": upload, "count": count, "index": index, "samples": 7}
    return SimpleNamespace(body=body, route=SimpleNamespace(device=DEVICE), data=data)


def test_a_multi_chunk_upload_spread_over_workers_completes_once(pg_url: str) -> None:
    a = WorkerStore(pg_url, group="g", worker_id="a")
    b = WorkerStore(pg_url, group="g", worker_id="b")
    stored: set[object] = set()
    try:
        ca, cb = (SharedChunks(s, is_known=lambda k: k in stored) for s in (a, b))
        rx = UpdateReceiver()
        parts = [b"one-", b"two-", b"three"]
        assert ca.add(_chunk(0, 3, parts[0]), rx).status == "partial"
        assert cb.add(_chunk(2, 3, parts[2]), rx).status == "partial"
        assert cb.add(_chunk(2, 3, parts[2]), rx).status == "partial"  # a repeat changes nothing
        got = ca.add(_chunk(1, 3, parts[1]), rx)
        assert got.status == "complete" and got.update is not None
        assert b"".join(got.update.chunks) == b"".join(parts) and got.update.samples == 7
        stored.add(got.key)
        ca.done(got.key)
        assert cb.add(_chunk(0, 3, parts[0]), rx).status == "duplicate"  # the device's resend
        (rows,) = a.execute("SELECT COUNT(*) FROM upload_chunks").fetchone()
        assert rows == 0
    finally:
        a.close()
        b.close()


def test_results_reported_at_one_worker_are_taken_at_another(pg_url: str) -> None:
    a = WorkerStore(pg_url, group="g", worker_id="a")
    b = WorkerStore(pg_url, group="g", worker_id="b")
    try:
        a.put_result("job-1", DEVICE, 2, {"accuracy_after": 0.9})
        assert b.take_result("job-1", DEVICE, 2) == {"accuracy_after": 0.9}
        assert a.take_result("job-1", DEVICE, 2) == {}  # read once
    finally:
        a.close()
        b.close()


def test_workers_share_a_state_dir_and_a_lone_serve_is_kept_off_it(tmp_path: Path) -> None:
    w1 = lock_state_dir(tmp_path, worker="w1")
    w2 = lock_state_dir(tmp_path, worker="w2")
    try:
        with pytest.raises(AlreadyServing, match="worker w1"):
            lock_state_dir(tmp_path, worker="w1")
        with pytest.raises(AlreadyServing):
            lock_state_dir(tmp_path)
    finally:
        for fd in (*w1, *w2):
            os.close(fd)
    lone = lock_state_dir(tmp_path)
    try:
        with pytest.raises(AlreadyServing, match="outside a workers group"):
            lock_state_dir(tmp_path, worker="w1")
    finally:
        for fd in lone:
            os.close(fd)


def test_serve_refuses_a_workers_group_on_sqlite(tmp_path: Path) -> None:
    from edge_agent.coordinator.service import Coordinator, ServeOptions

    with pytest.raises(ConfigError, match="needs a PostgreSQL registry"):
        Coordinator(ServeOptions(state_dir=tmp_path, db="sqlite", workers_group="g"))
    for fd in lock_state_dir(tmp_path):  # nothing was left locked
        os.close(fd)


def test_a_leader_that_resigns_lets_another_lead(pg_url: str) -> None:
    a = WorkerStore(pg_url, group="g", worker_id="a")
    b = WorkerStore(pg_url, group="g", worker_id="b")
    try:
        assert a.elect() and not b.elect()
        a.resign()  # what a leader cut off from the broker does (synchronous: no wait)
        assert not a.leader and b.elect()
        assert not a.elect()
    finally:
        a.close()
        b.close()


def test_a_worker_hands_the_group_sequence_back_to_keys_seq(tmp_path: Path, pg_url: str) -> None:
    """A lone serve started on the directory after the group resumes above the group's numbers
    (which come from the database's clock, not this host's)."""
    from edge_agent.coordinator.service import Coordinator, ServeOptions
    from edge_agent.protocol import SequenceCounter

    c = Coordinator(ServeOptions(state_dir=tmp_path, db=pg_url, workers_group="g", worker_id="a"))
    try:
        assert c.worker_id == "a" and c.client.client_id.endswith("-a")
        assert isinstance(c.signer.sequence, SharedSequence)
        ahead = int(time.time() + 7200) * 10**6  # the database's clock two hours ahead of this host's
        c.shared.execute("UPDATE worker_seq SET next = %s", (ahead,))  # type: ignore[union-attr]
    finally:
        c.close()
    assert SequenceCounter(path=tmp_path / "keys" / "seq").next() > ahead


def test_a_leader_on_another_host_is_serving_while_its_heartbeat_is_fresh() -> None:
    import socket

    from edge_agent.coordinator.service_files import serving

    other = {"pid": 2**22 + 12345, "host": socket.gethostname() + "-elsewhere", "heartbeat_at": time.time()}
    assert serving(other)  # its pid means nothing on this host
    assert not serving({**other, "heartbeat_at": time.time() - 60})
    assert not serving({**other, "host": socket.gethostname()})  # here: no such process
