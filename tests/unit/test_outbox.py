"""The persistent outbox: durable, bounded, restart-safe; the backoff it retries with; and
what acks do to its items (no broker: the Uploader's ack path and the coordinator's receiver)."""

from __future__ import annotations

import os
import random

import pytest

from edge_agent.atomic import CorruptFileError
from edge_agent.errors import InputError, TransientError
from edge_agent.protocol import (
    Kind,
    Topics,
)
from edge_agent.transport import MqttClient, UpdateReceiver, Uploader, ack_message
from edge_agent.transport.backoff import full_jitter
from edge_agent.transport.outbox import Outbox, OutboxFullError, OutboxKey, upload_digest
from tests.unit.signed_wire import signed_wire

KEY = OutboxKey("job-1", "dev1", 3)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def chunks(n: int = 3, size: int = 1000, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(size) for _ in range(n)]


def test_put_then_read_back_after_a_restart(tmp_path):
    data = chunks(4)
    box = Outbox(directory=tmp_path, clock=Clock())
    item = box.put(KEY, data, meta={"model": "digits", "bytes": 4000})
    assert (item.count, item.nbytes, item.state, item.upload) == (4, 4000, "pending", upload_digest(data))
    reopened = Outbox(directory=tmp_path)
    again = reopened.get(KEY)
    assert again == item
    assert [reopened.chunk(KEY, i) for i in range(4)] == data
    assert reopened.used_bytes == 4000 and len(reopened) == 1


def test_state_changes_are_durable(tmp_path):
    clock = Clock()
    box = Outbox(directory=tmp_path, clock=clock)
    box.put(KEY, chunks())
    box.mark_progress(KEY, 2)
    assert Outbox(directory=tmp_path).get(KEY).next_index == 2
    box.mark_sent(KEY, ack_deadline=1060.0)
    item = Outbox(directory=tmp_path).get(KEY)
    assert (item.state, item.next_index, item.due_at) == ("awaiting_ack", 3, 1060.0)
    box.retry_later(KEY, at=1100.0, error="no ack")
    item = Outbox(directory=tmp_path).get(KEY)
    assert (item.state, item.next_index, item.attempts, item.last_error) == ("pending", 0, 1, "no ack")


def test_due_orders_oldest_first_and_respects_times(tmp_path):
    clock = Clock()
    box = Outbox(directory=tmp_path, clock=clock)
    keys = [OutboxKey("j", "d", r) for r in (5, 1, 9)]
    for k in keys:
        box.put(k, chunks(1))
    assert [i.key for i in box.due()] == keys
    box.mark_sent(keys[0], ack_deadline=1050.0)
    box.retry_later(keys[1], at=1010.0)
    assert [i.key for i in box.due()] == [keys[2]]
    clock.t = 1050.0
    assert [i.key for i in box.due()] == keys  # ack of keys[0] timed out: due again


def test_put_is_idempotent_per_key_and_keeps_the_first_upload(tmp_path):
    box = Outbox(directory=tmp_path)
    first = box.put(KEY, chunks(seed=1))
    second = box.put(KEY, chunks(seed=2))  # re-encoded after a crash: the queued one stays
    assert second == first
    assert box.chunk(KEY, 0) == chunks(seed=1)[0]


def test_full_outbox_refuses_with_a_transient_error_and_keeps_what_it_has(tmp_path):
    box = Outbox(directory=tmp_path, max_bytes=5000, max_items=2)
    box.put(OutboxKey("j", "d", 1), chunks(3))
    with pytest.raises(OutboxFullError, match="would exceed 5000") as exc:
        box.put(OutboxKey("j", "d", 2), chunks(3))
    assert isinstance(exc.value, TransientError)
    box.put(OutboxKey("j", "d", 3), chunks(2))
    with pytest.raises(OutboxFullError, match="limit is 2"):
        box.put(OutboxKey("j", "d", 4), chunks(1, size=10))
    reopened = Outbox(directory=tmp_path, max_bytes=5000, max_items=2)
    assert [i.key.round for i in reopened.items()] == [1, 3]
    assert not list((tmp_path / "tmp").iterdir())
    reopened.ack(OutboxKey("j", "d", 1))
    reopened.put(OutboxKey("j", "d", 4), chunks(2))  # room again once acked


def test_ack_and_drop_remove_the_files(tmp_path):
    box = Outbox(directory=tmp_path)
    box.put(KEY, chunks())
    other = OutboxKey("j", "d", 7)
    box.put(other, chunks())
    assert box.ack(KEY) and not box.ack(KEY)
    assert box.drop(other, "refused") and box.get(other) is None
    assert not list((tmp_path / "items").iterdir())
    assert len(Outbox(directory=tmp_path)) == 0
    assert box.mark_progress(KEY, 1) is None  # a late state change for an acked item is a no-op


def test_interrupted_put_leaves_nothing_and_is_cleaned_at_open(tmp_path):
    box = Outbox(directory=tmp_path)
    box.put(KEY, chunks())
    crashed = tmp_path / "tmp" / "abc123"  # a put that lost power half-way
    crashed.mkdir()
    (crashed / "00000.chunk").write_bytes(b"partial")
    reopened = Outbox(directory=tmp_path)
    assert [i.key for i in reopened.items()] == [KEY]
    assert not crashed.exists()


def test_zero_filled_meta_is_dropped_and_reported_others_survive(tmp_path):
    box = Outbox(directory=tmp_path)
    other = OutboxKey("j", "d", 8)
    box.put(KEY, chunks())
    box.put(other, chunks())
    meta = tmp_path / "items" / KEY.slug / "meta"
    meta.write_bytes(b"\0" * meta.stat().st_size)
    reopened = Outbox(directory=tmp_path)
    assert [i.key for i in reopened.items()] == [other]
    assert len(reopened.dropped_corrupt) == 1 and "zero-filled" in reopened.dropped_corrupt[0]


def test_a_corrupt_chunk_is_detected_on_read(tmp_path):
    box = Outbox(directory=tmp_path)
    box.put(KEY, chunks())
    path = tmp_path / "items" / KEY.slug / "00001.chunk"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert box.chunk(KEY, 0) == chunks()[0]
    with pytest.raises(CorruptFileError, match="sha256 mismatch"):
        box.chunk(KEY, 1)
    with pytest.raises(IndexError):
        box.chunk(KEY, 3)


@pytest.mark.parametrize("bad", [[], [b""], [b"x" * 200_000]])
def test_bad_chunk_lists_are_refused(tmp_path, bad):
    with pytest.raises(InputError):
        Outbox(directory=tmp_path).put(KEY, bad)


@pytest.mark.parametrize("job,device,rnd", [("a/b", "d", 1), ("j", "+", 1), ("j", "d", -1), ("j", "d", 2**32),
                                            ("j", "d", True), ("", "d", 1)])
def test_keys_are_validated(job, device, rnd):
    with pytest.raises(InputError):
        OutboxKey(job, device, rnd)


def test_files_are_checksummed_not_plain(tmp_path):
    box = Outbox(directory=tmp_path)
    box.put(KEY, [b"hello world"])
    raw = (tmp_path / "items" / KEY.slug / "00000.chunk").read_bytes()
    assert raw.endswith(b"hello world") and raw.startswith(b"EAC1")
    assert os.path.exists(tmp_path / "items" / KEY.slug / "meta")


def test_full_jitter_stays_within_its_growing_ceiling():
    rng = random.Random(7)
    for attempt, ceiling in [(0, 0.5), (1, 1.0), (3, 4.0), (10, 30.0), (1000, 30.0)]:
        draws = [full_jitter(attempt, base=0.5, cap=30.0, rng=rng) for _ in range(200)]
        assert all(0 <= d <= ceiling for d in draws)
        assert max(draws) > ceiling * 0.8  # spread over the whole range, not a fixed delay
        assert min(draws) < ceiling * 0.2
    with pytest.raises(ValueError):
        full_jitter(1, base=0, cap=1)


# ---- what acks do to outbox items, and the coordinator's de-duplication (no broker) ----
@pytest.fixture
def wire(tmp_path):
    topics = Topics(fleet="farm")
    w = signed_wire(tmp_path, topics)
    dev, coord, device, verifier = w.dev, w.coord, w.device, w.verifier
    box = Outbox(directory=tmp_path / "outbox")
    client = MqttClient(host="127.0.0.1", port=1, client_id="never-started")  # pump is not used here
    return dev, topics, coord, device, verifier, box, client


def test_acks_decide_the_fate_of_an_item(wire):
    dev, topics, coord, _, verifier, box, client = wire
    up = Uploader(client=client, outbox=box, signer=coord, topics=topics, retry_base=1.0, retry_cap=2.0)

    def ack(key, status, upload=None, **kw):
        topic, raw = ack_message(coord, topics, key, upload or box.get(key).upload, status, **kw)
        return up.handle_ack(verifier.open(topic, raw))

    keys_ = [OutboxKey("j", dev, r) for r in range(6)]
    for k in keys_:
        box.put(k, chunks(1, seed=k.round))
    assert ack(keys_[0], "accepted") == "acked" and box.get(keys_[0]) is None
    assert ack(keys_[1], "duplicate", upload="cd" * 32) == "acked"  # it has another upload of that key
    assert ack(keys_[2], "rejected", reason="unknown_key") == "retry"  # protocol reason: retryable
    item = box.get(keys_[2])
    assert item.attempts == 1 and "unknown_key" in item.last_error and item.due_at > 0
    assert ack(keys_[3], "rejected", reason="round_closed", retry=False) == "dropped" and box.get(keys_[3]) is None
    assert ack(keys_[4], "rejected", reason="round_closed") == "dropped"  # application reason: final by default
    assert ack(keys_[5], "rejected", upload="cd" * 32, reason="bad_schema") == "ignored"  # someone else's upload
    assert box.get(keys_[5]) is not None
    assert ack(keys_[0], "accepted", upload="ab" * 32) == "ignored"  # already gone


def test_the_receiver_delivers_each_key_once(wire):
    dev, topics, _, device, verifier, _, _ = wire
    now = [0.0]
    known = {OutboxKey("old", dev, 1)}
    rx = UpdateReceiver(ack_interval=10.0, max_pending=2, is_known=known.__contains__, clock=lambda: now[0])
    topic = topics.device(dev, "update")

    def chunk(job, rnd, index, count, data, upload="ab" * 32):
        body = {"job": job, "round": rnd, "upload": upload, "index": index, "count": count}
        return verifier.open(topic, device.binary(topic, Kind.UPDATE_CHUNK, body, data, ttl=60))

    assert rx.add(chunk("j", 0, 1, 2, b"second")).status == "partial"
    assert rx.add(chunk("j", 0, 1, 2, b"second")).status == "partial"  # QoS 1 redelivery
    done = rx.add(chunk("j", 0, 0, 2, b"first"))
    assert done.status == "complete" and done.ack_due and done.update.chunks == [b"first", b"second"]
    assert not rx.add(chunk("j", 0, 0, 2, b"first")).ack_due  # a late repeat: acked a moment ago
    again = rx.add(chunk("j", 0, 0, 2, b"first", upload="cd" * 32))  # another upload of the same key
    assert again.status == "duplicate" and again.ack_due  # its sender has not been told yet
    assert not rx.add(chunk("j", 0, 1, 2, b"x", upload="cd" * 32)).ack_due  # one ack per burst
    now[0] = 11.0
    assert rx.add(chunk("j", 0, 1, 2, b"x", upload="cd" * 32)).ack_due
    assert rx.add(chunk("old", 1, 0, 3, b"x")).status == "duplicate"  # known from the registry
    for r in range(1, 5):  # memory bound: only the newest partial uploads are kept
        rx.add(chunk("j", r, 0, 2, b"x"))
    assert rx.evicted == 2


def test_the_receiver_forgets_completed_uploads_after_a_while_and_judges_late_repeats_again(wire):
    """Steady-state memory: what completed is remembered for `remember_s`, acks for
    `ack_interval`; a repeat after that is a duplicate if the registry has it, else it is
    reassembled (an upload refused on arrival gets the same verdict again, not silence)."""
    dev, topics, _, device, verifier, _, _ = wire
    now = [0.0]
    stored: set[OutboxKey] = set()
    rx = UpdateReceiver(ack_interval=10.0, remember_s=60.0, is_known=stored.__contains__, clock=lambda: now[0])
    topic = topics.device(dev, "update")

    def chunk(job, rnd):
        body = {"job": job, "round": rnd, "upload": f"{rnd:064x}", "index": 0, "count": 1}
        return verifier.open(topic, device.binary(topic, Kind.UPDATE_CHUNK, body, b"x", ttl=60))

    for r in range(1, 201):  # 200 uploads, one a second
        now[0] = float(r)
        assert rx.add(chunk("j", r)).status == "complete"
        if r % 2:
            stored.add(OutboxKey("j", dev, r))  # the odd ones were stored; the even ones refused
        assert rx.remembered <= 2 * 61  # a minute of uploads, whatever ran before
    assert rx.add(chunk("j", 200)).status == "duplicate"  # recent: remembered
    now[0] = 1000.0
    assert rx.add(chunk("j", 199)).status == "duplicate"  # long ago, and stored: the registry says so
    again = rx.add(chunk("j", 198))  # long ago, never stored: judged again
    assert again.status == "complete" and again.ack_due
    assert rx.remembered == 2 + 2  # the two just seen (done + ack each)
