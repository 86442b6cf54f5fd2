"""Lightweight simulated devices for load-testing a coordinator over a real broker.

Each `SimDevice` has its own Ed25519 key and paho connection, and speaks the agent's
protocol through the project's own code: `Signer` (hello, state, progress, signed update
chunks), `Verifier` (the coordinator's commands and acks), `pack_update` / `split_chunks`
(the update payload and its chunks), `upload_digest` and `UPDATE_META` (the uplink's
upload id and signed job facts). What it does not do is train: its update is a synthetic
delta of the model's shape, top-k + int8 coded once per pool entry (`UpdatePool`) and
packed per device with its own header, so 10,000 devices do not cost 10,000 encodes.

Per `finetune` command: progress `accepted` + state busy; after `train_s`, either a dropout
(progress `failed`, as an agent whose job failed says: the coordinator records a dropout)
or the update: each chunk published QoS 1 after the previous PUBACK (a slow link waits
`slow_delay_s` before each chunk), then the signed ack is awaited; no ack within
`ack_timeout_s` or a `rejected, retry` ack -> the whole upload again after a full-jitter
delay, as the agent's `Uploader` does. On an accepted/duplicate ack: progress `done`,
state idle. Differences from the agent, on purpose: no on-disk outbox or replay window
(the memory-only equivalents), no model download (the command's bundle is not fetched).
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import paho.mqtt.client as paho

from .. import keys
from ..agent.state import AGENT, render_detail
from ..config import public_key_text
from ..protocol import Kind, Message, Signer, Topics, TrustStore, Verifier
from ..transport.backoff import full_jitter
from ..transport.outbox import upload_digest
from ..transport.uplink import UPDATE_META
from ..updates.chunks import split_chunks
from ..updates.codec import encode_delta
from ..updates.wire import UpdateHeader, pack_update
from .mqtt_hub import Hub

STATE_TTL = 7 * 86400


class _MemorySequence:
    """SequenceCounter's numbering (clock-seeded, strictly increasing) without its file."""

    def __init__(self) -> None:
        self._next = 0

    def next(self) -> int:
        self._next = max(self._next + 1, int(time.time()) * 10**6)
        return self._next


@dataclass(frozen=True, kw_only=True)
class SimOptions:
    host: str = "127.0.0.1"
    port: int = 1883
    fleet: str = "sim"
    prefix: str = "edgeft/v1"
    dropout: float = 0.0  # share of devices whose job fails (a recorded dropout)
    slow_share: float = 0.0  # share of devices on a slow link
    slow_delay_s: float = 0.5  # their delay before each chunk
    train_s: tuple[float, float] = (0.0, 1.0)  # simulated training time, uniform
    chunk_size: int = 64 * 1024  # the agent's: min(64 KiB, max_message_bytes - headroom)
    ack_timeout_s: float = 120.0
    retry_base_s: float = 2.0
    retry_cap_s: float = 60.0
    keepalive: int = 60
    state_interval_s: float = 60.0  # the agent's default: serve counts a device online for 300 s after it
    samples: tuple[int, int] = (50, 500)
    seed: int = 0


class UpdatePool:
    """A few synthetic coded deltas of the model's shape; `non_iid` gives each cluster of
    devices its own mean direction (their updates disagree, as non-IID data makes them)."""

    def __init__(self, head: dict[str, np.ndarray], *, distinct: int = 16, density: float = 0.02, bits: int = 8,
                 clusters: int = 1, scale: float = 1e-3, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        means = [{k: rng.normal(size=v.shape).astype(np.float32) for k, v in head.items()}
                 for _ in range(max(1, clusters))]
        self.clusters = len(means)
        self.encoded = []
        for i in range(distinct):
            mean = means[i % self.clusters]
            delta = {k: scale * (m + rng.normal(size=m.shape).astype(np.float32)) for k, m in mean.items()}
            self.encoded.append(encode_delta(delta, density=density, bits=bits))

    def payload(self, index: int, header: UpdateHeader) -> bytes:
        return pack_update(header, self.encoded[index % len(self.encoded)])


@dataclass
class DeviceStats:
    connected_at: float | None = None
    cmd_at: float | None = None
    uploaded_at: float | None = None  # last chunk PUBACKed
    acked_at: float | None = None
    ack_status: str = ""
    dropped_out: bool = False
    uploads: int = 0  # attempts
    wire_bytes: int = 0
    disconnects: int = 0


class SimDevice:
    """One simulated device; every method runs on its hub's thread."""

    def __init__(self, *, index: int, hub: Hub, options: SimOptions, topics: Topics, verifier: Verifier,
                 pool: UpdatePool, labels_sha256: str | None = None) -> None:
        self.index, self.hub, self.o, self.topics, self.verifier, self.pool = index, hub, options, topics, verifier, pool
        self.key = keys.generate_private_key()
        self.id = keys.fingerprint(self.key)
        self.name = f"sim-{index:05d}"
        self.signer = Signer(key=self.key, topics=topics, sequence=_MemorySequence())  # type: ignore[arg-type]
        self.rng = random.Random(f"{options.seed}-{index}")
        self.slow = self.rng.random() < options.slow_share
        self.drops = self.rng.random() < options.dropout
        self.labels_sha256 = labels_sha256
        self.stats = DeviceStats()
        self.jobs: dict[tuple[str, int], dict[str, Any]] = {}  # (job, round) -> upload state
        self._inflight: dict[int, Any] = {}  # mid -> callback on PUBACK
        self._ticking = False  # the periodic state is scheduled
        state = topics.device(self.id, "state")
        will = self.signer.control(state, Kind.STATE, {"status": "offline", "agent": AGENT}, ttl=STATE_TTL)
        self.client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=f"edge-agent-{self.id}",
                                  clean_session=False, protocol=paho.MQTTv311)
        self.client.will_set(state, will, qos=1, retain=True)
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = self._on_disconnect
        self.client.on_message = self._on_message
        self.client.on_publish = self._on_publish
        self.client.max_inflight_messages_set(20)
        hub.attach(self.client)

    # ---- connection ----
    def connect(self) -> None:
        try:
            self.client.connect(self.o.host, self.o.port, keepalive=self.o.keepalive)
        except OSError:
            self.hub.call_later(1.0 + self.rng.random(), self.connect)

    def _on_disconnect(self, client: Any, userdata: Any, flags: Any, reason: Any, properties: Any) -> None:
        self.stats.disconnects += 1
        self.hub.call_later(1.0 + 2 * self.rng.random(), self._reconnect)

    def _reconnect(self) -> None:
        try:
            self.client.reconnect()
        except OSError:
            self.hub.call_later(2.0 + 2 * self.rng.random(), self._reconnect)

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason: Any, properties: Any) -> None:
        if reason.is_failure:
            return
        if self.stats.connected_at is None:
            self.stats.connected_at = time.monotonic()
        client.subscribe([(t, 1) for t in self.topics.device_subscriptions(self.id)])
        hello = {"public_key": public_key_text(self.key), "agent": AGENT,
                 "info": {"name": self.name, "board": "simulated", "profile": "sim", "mxnet": False,
                          "trainers": "numpy"}}
        self._send(self.topics.device(self.id, "hello"), Kind.HELLO, hello, ttl=365 * 86400, retain=True)
        if self.stats.connected_at is not None and not self._ticking:
            self._ticking = True
            self.hub.call_later(self.rng.uniform(0.5, 1.0) * self.o.state_interval_s, self._state_tick)
        self.publish_state(busy=None)
        for job in self.jobs.values():  # a reconnect mid-upload: the rest goes out again
            if job["phase"] == "uploading" and job["next"] < len(job["chunks"]):
                self._next_chunk(job)

    def _state_tick(self) -> None:
        if self.client.is_connected():
            busy = next((j["job"] for j in self.jobs.values() if j["phase"] in ("training", "uploading")), None)
            self.publish_state(busy=busy)
        self.hub.call_later(self.o.state_interval_s, self._state_tick)

    # ---- publishing ----
    def _send(self, topic: str, kind: Kind, body: dict[str, Any], *, ttl: float, retain: bool = False) -> None:
        self.client.publish(topic, self.signer.control(topic, kind, body, ttl=ttl), qos=1, retain=retain)

    def publish_state(self, *, busy: str | None) -> None:
        facts = {"status": "busy" if busy else "idle", "name": self.name, "profile": "sim", "battery_pct": 90,
                 "on_power": True, "charging": False, "energy_wh": 50.0, "engine": "sim"}
        if busy:
            facts["job"] = busy
        body: dict[str, Any] = {"status": facts["status"], "agent": AGENT, "detail": render_detail(facts),
                                "info": facts}
        if busy:
            body["job"] = busy
        self._send(self.topics.device(self.id, "state"), Kind.STATE, body, ttl=STATE_TTL, retain=True)

    def _progress(self, phase: str, job: dict[str, Any], detail: str = "", **metrics: Any) -> None:
        body: dict[str, Any] = {"phase": phase, "job": job["job"], "round": job["round"], "cmd_id": job["cmd_id"],
                                "detail": detail}
        if metrics:
            body["metrics"] = metrics
        self._send(self.topics.device(self.id, "progress"), Kind.PROGRESS, body, ttl=3600)

    def _on_publish(self, client: Any, userdata: Any, mid: int, reason: Any, properties: Any) -> None:
        then = self._inflight.pop(mid, None)
        if then is not None:
            then()

    # ---- commands and acks ----
    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        got = self.verifier.open(msg.topic, msg.payload)
        if not isinstance(got, Message):
            return
        if got.kind is Kind.CMD and got.body["action"] == "finetune":
            self._finetune(got)
        elif got.kind is Kind.ACK:
            self._ack(got)

    def _finetune(self, msg: Message) -> None:
        b = msg.body
        slot = (b["job"], b["round"])
        if slot in self.jobs:
            return  # a repeated command (QoS 1 may deliver twice)
        self.stats.cmd_at = time.monotonic()
        job = {"job": b["job"], "round": b["round"], "cmd_id": b["cmd_id"], "model": b["model"],
               "version": b["version"], "phase": "training", "attempts": 0}
        self.jobs[slot] = job
        self._progress("accepted", job)
        self.publish_state(busy=b["job"])
        self.hub.call_later(self.rng.uniform(*self.o.train_s), lambda: self._trained(job))

    def _trained(self, job: dict[str, Any]) -> None:
        if self.drops:
            job["phase"] = "failed"
            self.stats.dropped_out = True
            self._progress("failed", job, "training stopped: simulated dropout")
            self.publish_state(busy=None)
            return
        header = UpdateHeader(job["model"], job["version"], job["job"], self.id, job["round"])
        payload = self.pool.payload(self.index, header)
        job["chunks"] = split_chunks(payload, chunk_size=self.o.chunk_size)
        job["upload"] = upload_digest(job["chunks"])
        job["samples"] = self.rng.randint(*self.o.samples)
        job["phase"] = "uploading"
        # no metrics: serve's _progress raises KeyError on a metrics map without every
        # RESULT_METRICS key (and then backs off its loop); the samples ride on the chunks
        self._progress("uploading", job)
        self._start_upload(job)

    def _start_upload(self, job: dict[str, Any]) -> None:
        if job["phase"] != "uploading":
            return
        job["attempts"] += 1
        job["next"] = 0
        job["try"] = job["attempts"]
        self.stats.uploads += 1
        self._next_chunk(job)

    def _next_chunk(self, job: dict[str, Any]) -> None:
        if self.slow:
            attempt = job["try"]
            self.hub.call_later(self.o.slow_delay_s, lambda: self._publish_chunk(job, attempt))
        else:
            self._publish_chunk(job, job["try"])

    def _publish_chunk(self, job: dict[str, Any], attempt: int) -> None:
        if job["phase"] != "uploading" or attempt != job["try"] or not self.client.is_connected():
            return  # superseded, acked, or offline (resumed on reconnect)
        index, chunks = job["next"], job["chunks"]
        topic = self.topics.device(self.id, "update")
        body = {"job": job["job"], "round": job["round"], "upload": job["upload"], "count": len(chunks),
                "index": index, "samples": job["samples"], "energy_wh": 0.01, "energy_kept": 1.0}
        if self.labels_sha256:
            body["labels_sha256"] = self.labels_sha256
        assert set(body) - {"job", "round", "upload", "count", "index"} <= set(UPDATE_META)
        payload = self.signer.binary(topic, Kind.UPDATE_CHUNK, body, chunks[index], ttl=3600)
        info = self.client.publish(topic, payload, qos=1)
        self.stats.wire_bytes += len(chunks[index])

        def puback() -> None:
            if attempt != job["try"] or job["phase"] != "uploading":
                return
            job["next"] = index + 1
            if job["next"] < len(chunks):
                self._next_chunk(job)
            else:
                self.stats.uploaded_at = time.monotonic()
                self.hub.call_later(self.o.ack_timeout_s, lambda: self._no_ack(job, attempt))

        self._inflight[info.mid] = puback

    def _no_ack(self, job: dict[str, Any], attempt: int) -> None:
        if job["phase"] == "uploading" and attempt == job["try"]:
            self._retry(job)

    def _retry(self, job: dict[str, Any]) -> None:
        job["try"] = -1  # nothing of the old attempt goes on
        delay = full_jitter(job["attempts"] - 1, base=self.o.retry_base_s, cap=self.o.retry_cap_s, rng=self.rng)
        self.hub.call_later(delay, lambda: self._start_upload(job))

    def _ack(self, msg: Message) -> None:
        b = msg.body
        job = self.jobs.get((b["job"], b["round"]))
        if job is None or job["phase"] != "uploading":
            return
        if b["status"] in ("accepted", "duplicate"):
            job["phase"] = "done"
            job.pop("chunks", None)
            self.stats.acked_at, self.stats.ack_status = time.monotonic(), b["status"]
            self._progress("done", job, "acknowledged by the coordinator")
            self.publish_state(busy=None)
        elif b["upload"] == job["upload"]:
            if b.get("retry", True):
                self._retry(job)
            else:
                job["phase"] = "refused"
                self.stats.ack_status = f"rejected:{b.get('reason', '')}"


@dataclass
class SimFleet:
    """N simulated devices spread over `threads` hubs, connecting at `connect_rate` per s."""

    options: SimOptions
    count: int
    pool: UpdatePool
    coordinator_key: Any  # Ed25519PublicKey
    threads: int = 1
    labels: Sequence[str] | None = None
    hubs: list[Hub] = field(default_factory=list)
    devices: list[SimDevice] = field(default_factory=list)

    def build(self) -> None:
        from ..labels import label_set_digest

        topics = Topics(fleet=self.options.fleet, prefix=self.options.prefix)
        trust = TrustStore()
        trust.add(self.coordinator_key, role="coordinator")
        # One verifier for all (the coordinator's key is the only one it trusts); no replay
        # window: the agent's is a file per device, which 10,000 of would measure the disk.
        verifier = Verifier(topics=topics, trust=trust, replay=None)
        digest = label_set_digest(list(self.labels)) if self.labels else None
        self.hubs = [Hub(name=f"mqtt-hub-{i}") for i in range(max(1, self.threads))]
        self.devices = [SimDevice(index=i, hub=self.hubs[i % len(self.hubs)], options=self.options, topics=topics,
                                  verifier=verifier, pool=self.pool, labels_sha256=digest) for i in range(self.count)]

    def start(self, connect_rate: float = 500.0) -> None:
        self.start_hubs()
        for i, dev in enumerate(self.devices):
            dev.hub.call_soon(dev.connect)
            if connect_rate > 0 and i % 50 == 49:
                time.sleep(50.0 / connect_rate)

    def start_hubs(self) -> None:
        for hub in self.hubs:
            hub.start()

    def connect(self, indices: Iterable[int]) -> None:
        """Start these devices' connections (hubs started)."""
        for i in indices:
            dev = self.devices[i]
            dev.hub.call_soon(dev.connect)

    def stop(self) -> None:
        for dev in self.devices:
            dev.hub.call_soon(dev.client.disconnect)
        time.sleep(0.5)
        for hub in self.hubs:
            hub.stop()

    def summary(self) -> dict[str, Any]:
        s = [d.stats for d in self.devices]
        connected = [x.connected_at for x in s if x.connected_at is not None]
        return {"devices": len(s), "connected": len(connected), "commanded": sum(x.cmd_at is not None for x in s),
                "dropped_out": sum(x.dropped_out for x in s), "acked": sum(x.acked_at is not None for x in s),
                "uploads": sum(x.uploads for x in s), "wire_bytes_sent": sum(x.wire_bytes for x in s),
                "disconnects": sum(x.disconnects for x in s), "slow": sum(d.slow for d in self.devices),
                "errors": sum(h.errors for h in self.hubs)}
