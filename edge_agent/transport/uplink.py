"""Update upload: the device's `Uploader` (outbox -> signed chunks) and the coordinator's
`UpdateReceiver` (signed chunks -> each (job, device, round) delivered once).

Flow: the agent `put`s the chunk list into the outbox and calls `Uploader.pump()` from its
loop. Each chunk goes out in a freshly signed `update_chunk` envelope (QoS 1, waiting for
the broker's PUBACK, progress persisted), then the item waits for the coordinator's signed
`ack`. No ack by the deadline (the broker restarted and lost chunks, the coordinator was
down) -> the whole item is sent again after a full-jitter delay. The receiver reassembles
by (key, upload), hands a complete upload to the application exactly once, and answers
repeats with "duplicate" (rate-limited) so the device can stop.

Unverified rejections (unknown key, bad signature...) are always answered with
`retry: true`: only a verified, application-level decision may make a device drop an update.
"""

from __future__ import annotations

import logging
import random
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..atomic import CorruptFileError
from ..errors import InputError
from ..protocol import Kind, Message, Reason, Rejection, Signer, Topics
from .backoff import full_jitter
from .mqtt import MqttClient
from .outbox import Outbox, OutboxKey

log = logging.getLogger(__name__)
# The job's facts signed onto every update chunk (protocol.schema UPDATE_CHUNK): what FedAvg
# weights by, the round's energy, the share of the delta's energy kept, the label set.
UPDATE_META = ("samples", "energy_wh", "energy_kept", "labels_sha256")
# A coordinator that verifiably refuses this device's key (revoked, or never approved: only an
# approved device is sent jobs) will not change its mind by itself: after this many attempts,
# backing off exponentially in between, the update is dropped instead of resent forever.
UNTRUSTED_REASONS = frozenset({Reason.UNKNOWN_KEY, Reason.WRONG_SIGNER})
MAX_UNTRUSTED_ATTEMPTS = 8


class Uploader:
    """Sends due outbox items; call `pump()` periodically and `handle_ack()` for verified acks."""

    def __init__(self, *, client: MqttClient, outbox: Outbox, signer: Signer, topics: Topics,
                 ack_timeout: float = 120.0, publish_timeout: float = 15.0, retry_base: float = 5.0,
                 retry_cap: float = 3600.0, chunk_ttl: float = 3600.0, clock: Callable[[], float] = time.time,
                 rng: random.Random | None = None) -> None:
        if min(ack_timeout, publish_timeout, retry_base, chunk_ttl) <= 0 or retry_cap < retry_base:
            raise ValueError("timeouts and retry_base must be positive and retry_cap >= retry_base")
        self.client, self.outbox, self.signer, self.topics = client, outbox, signer, topics
        self.ack_timeout, self.publish_timeout, self.chunk_ttl = ack_timeout, publish_timeout, chunk_ttl
        self._retry = (retry_base, retry_cap)
        self._clock, self._rng = clock, rng or random.Random()
        self.dropped: list[tuple[OutboxKey, str]] = []  # unreadable items, for the agent to report

    def _later(self, attempts: int) -> float:
        return self._clock() + full_jitter(attempts, base=self._retry[0], cap=self._retry[1], rng=self._rng)

    def pump(self, *, max_chunks: int | None = None) -> int:
        """Send what is due, oldest first; returns the chunks the broker acknowledged.

        `max_chunks` bounds the work per call so the caller's loop stays responsive.
        Returns early (nothing lost) when the connection is down or a PUBACK does not come.
        """
        sent = 0
        for item in self.outbox.due():
            if not self.client.connected or (max_chunks is not None and sent >= max_chunks):
                break
            if item.state == "awaiting_ack":  # the ack did not come: a new attempt, from chunk 0
                log.info("upload %s: no ack after attempt %d; sending again", item.key, item.attempts + 1)
                item = self.outbox.retry_later(item.key, at=self._clock(), error="no ack") or item
            topic = self.topics.device(item.key.device, "update")
            header = {"job": item.key.job, "round": item.key.round, "upload": item.upload, "count": item.count}
            # What FedAvg weights by and what the round's energy report sums, from the job.
            header.update({k: item.meta[k] for k in UPDATE_META if k in item.meta})
            for index in range(item.next_index, item.count):
                if max_chunks is not None and sent >= max_chunks:
                    return sent
                try:
                    data = self.outbox.chunk(item.key, index)
                except (CorruptFileError, OSError) as exc:
                    self.dropped.append((item.key, f"chunk {index} unreadable: {exc}"))
                    self.outbox.drop(item.key, f"chunk {index} unreadable: {exc}")
                    break
                payload = self.signer.binary(topic, Kind.UPDATE_CHUNK, {**header, "index": index}, data,
                                             ttl=self.chunk_ttl)
                if not self.client.publish_wait(topic, payload, timeout=self.publish_timeout):
                    return sent  # resume from `index` later: progress up to it is on disk
                sent += 1
                self.outbox.mark_progress(item.key, index + 1)
            else:
                self.outbox.mark_sent(item.key, ack_deadline=self._later(item.attempts) + self.ack_timeout)
        return sent

    def handle_ack(self, msg: Message) -> str:
        """Apply a verified `ack`; returns what happened ("acked", "retry", "dropped", "ignored")."""
        if msg.kind is not Kind.ACK or msg.route.device is None:
            return "ignored"
        body = msg.body
        key = OutboxKey(body["job"], msg.route.device, body["round"])
        item = self.outbox.get(key)
        if item is None:
            return "ignored"  # acked before (a repeated ack), or never ours
        if body["status"] in ("accepted", "duplicate"):
            # The coordinator holds an update for this key (maybe an earlier upload): ours is done.
            self.outbox.ack(key)
            log.info("upload %s: acknowledged (%s)", key, body["status"])
            return "acked"
        if body["upload"] != item.upload:
            return "ignored"  # a refusal of some other upload for the same key
        reason = body.get("reason", "rejected")
        detail = f"{reason}: {body.get('detail', '')}"
        try:
            default_retry = Reason(reason).retryable
        except ValueError:  # an application reason (e.g. round_closed): final unless it says retry
            default_retry = False
        if reason in UNTRUSTED_REASONS and item.attempts + 1 >= MAX_UNTRUSTED_ATTEMPTS:
            self.outbox.drop(key, f"the coordinator refused this device's key {item.attempts + 1} times ({detail}): "
                                  "revoked? Approve the device again for its next jobs")
            log.error("upload %s: dropped after %d attempts refused as %s (device revoked?)", key,
                      item.attempts + 1, reason)
            return "dropped"
        if body.get("retry", default_retry):
            self.outbox.retry_later(key, at=self._later(item.attempts), error=detail)
            log.warning("upload %s: refused (%s); will retry", key, detail)
            return "retry"
        self.outbox.drop(key, f"refused by the coordinator: {detail}")
        return "dropped"


@dataclass(frozen=True)
class CompletedUpload:
    key: OutboxKey
    upload: str
    chunks: list[bytes] = field(repr=False)
    samples: int | None = None  # the device's local training sample count, if it sent it
    energy_wh: float | None = None
    energy_kept: float | None = None  # share of the delta's energy the update kept
    labels_sha256: str | None = None  # edge_agent.labels.label_set_digest of the labels trained on


@dataclass(frozen=True)
class ReceiveResult:
    """What one chunk did: status "complete" (once per key), "duplicate" or "partial"."""

    status: str
    key: OutboxKey
    upload: str
    ack_due: bool  # send an ack now (complete, or a rate-limited answer to a repeat)
    update: CompletedUpload | None = None


@dataclass
class _Partial:
    count: int
    parts: dict[int, bytes] = field(default_factory=dict)
    nbytes: int = 0


def expire(entries: OrderedDict[Any, Any], now: float, keep_s: float, at: Callable[[Any], float]) -> None:
    """Drop the oldest entries of a last-touched-last OrderedDict until the first is younger
    than `keep_s` (`at(value)` is when an entry was last touched)."""
    while entries and at(next(iter(entries.values()))) < now - keep_s:
        entries.popitem(last=False)


class UpdateReceiver:
    """Coordinator side. Memory-bounded in count and in time: which uploads completed is
    remembered for `remember_s` (a fast path: `is_known(key)` consults the coordinator's
    registry, so repeats after that, or after a restart, are still recognised as duplicates;
    an upload the registry never stored -- one refused on arrival -- is reassembled and
    judged again, with the same verdict), when each upload was last acked for
    `ack_interval`, the only time it is used. A fleet's steady state costs a few minutes of
    uploads, not the last `remember` whatever their age."""

    def __init__(self, *, max_pending: int = 256, max_pending_bytes: int = 256 << 20,
                 is_known: Callable[[OutboxKey], bool] | None = None, ack_interval: float = 30.0,
                 remember: int = 10000, remember_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_pending < 1 or max_pending_bytes < 1 or remember < 1 or ack_interval < 0 or remember_s < 0:
            raise ValueError("limits must be positive")
        self.max_pending, self.max_pending_bytes, self.ack_interval = max_pending, max_pending_bytes, ack_interval
        self._is_known, self._clock, self._remember, self._remember_s = is_known, clock, remember, remember_s
        self._pending: OrderedDict[tuple[OutboxKey, str], _Partial] = OrderedDict()
        self._done: OrderedDict[OutboxKey, float] = OrderedDict()
        self._last_ack: OrderedDict[tuple[str, str], float] = OrderedDict()
        self.evicted = 0

    @property
    def remembered(self) -> int:
        """Entries held for completed uploads and their acks (what the time bound keeps small)."""
        return len(self._done) + len(self._last_ack)

    def ack_due(self, device: str, upload: str) -> bool:
        """At most one ack per (device, upload) per `ack_interval` (repeats come in bursts)."""
        now, slot = self._clock(), (device, upload)
        last = self._last_ack.get(slot)
        if last is not None and now - last < self.ack_interval:
            return False
        self._touch_ack(slot, now)
        return True

    def _touch_ack(self, slot: tuple[str, str], now: float) -> None:
        self._last_ack[slot] = now
        self._last_ack.move_to_end(slot)
        expire(self._last_ack, now, self.ack_interval, float)
        while len(self._last_ack) > self._remember:
            self._last_ack.popitem(last=False)

    def add(self, msg: Message) -> ReceiveResult:
        """Take one verified `update_chunk` message."""
        if msg.kind is not Kind.UPDATE_CHUNK or msg.route.device is None:
            raise ValueError(f"not an update chunk: {msg.kind}")
        b = msg.body
        key, upload = OutboxKey(b["job"], msg.route.device, b["round"]), b["upload"]
        if key in self._done or (self._is_known is not None and self._is_known(key)):
            self._remember_done(key)
            return ReceiveResult("duplicate", key, upload, self.ack_due(key.device, upload))
        slot = (key, upload)
        part = self._pending.get(slot)
        if part is None or part.count != b["count"]:  # a changed count is a new upload attempt
            part = self._pending[slot] = _Partial(b["count"])
        if b["index"] not in part.parts:
            part.parts[b["index"]] = msg.data
            part.nbytes += len(msg.data)
        self._pending.move_to_end(slot)
        if len(part.parts) < part.count:
            self._evict(slot)
            return ReceiveResult("partial", key, upload, False)
        for other in [s for s in self._pending if s[0] == key]:
            del self._pending[other]
        self._remember_done(key)
        self._touch_ack((key.device, upload), self._clock())
        chunks = [part.parts[i] for i in range(part.count)]
        done = CompletedUpload(key, upload, chunks, **{k: b.get(k) for k in UPDATE_META})
        return ReceiveResult("complete", key, upload, True, done)

    def _remember_done(self, key: OutboxKey) -> None:
        now = self._clock()
        self._done[key] = now
        self._done.move_to_end(key)
        expire(self._done, now, self._remember_s, float)
        while len(self._done) > self._remember:
            self._done.popitem(last=False)

    def _evict(self, keep: tuple[OutboxKey, str]) -> None:
        while len(self._pending) > 1 and (len(self._pending) > self.max_pending or
                                          sum(p.nbytes for p in self._pending.values()) > self.max_pending_bytes):
            oldest = next(iter(self._pending))
            if oldest == keep:
                break
            del self._pending[oldest]
            self.evicted += 1  # the device resends it after its ack timeout


def ack_message(signer: Signer, topics: Topics, key: OutboxKey, upload: str, status: str, *,
                reason: str | None = None, detail: str | None = None, retry: bool | None = None,
                ttl: float = 3600.0) -> tuple[str, bytes]:
    """(topic, payload) of a signed ack for one upload."""
    body: dict[str, Any] = {"job": key.job, "round": key.round, "upload": upload, "status": status}
    for name, value in (("reason", reason), ("detail", detail[:512] if detail else None), ("retry", retry)):
        if value is not None:
            body[name] = value
    topic = topics.device(key.device, "ack")
    return topic, signer.control(topic, Kind.ACK, body, ttl=ttl)


def rejection_ack(signer: Signer, topics: Topics, rejection: Rejection, *, ttl: float = 3600.0) -> tuple[str, bytes] | None:
    """A `rejected, retry` ack for a refused update chunk, if it names an upload; else None."""
    route, b = rejection.route, rejection.body or {}
    if route is None or route.channel != "update" or route.device is None:
        return None
    try:  # the claimed fields are unverified: any of them may be junk
        key = OutboxKey(b.get("job"), route.device, b.get("round"))  # type: ignore[arg-type]
        return ack_message(signer, topics, key, b.get("upload"), "rejected", reason=str(rejection.reason),  # type: ignore[arg-type]
                           detail=rejection.detail, retry=True, ttl=ttl)
    except (InputError, ValueError, TypeError):
        return None
