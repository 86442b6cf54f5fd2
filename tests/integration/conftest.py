"""Integration fixtures: a real mosquitto per test (free loopback port, generated config in
tmp_path), a unique topic prefix per test, and a small fleet (coordinator + devices) wired
the way the agent daemon and the coordinator will wire the transport."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from edge_agent import keys
from edge_agent.protocol import (
    Kind,
    Message,
    Rejection,
    ReplayWindow,
    SequenceCounter,
    Signer,
    Topics,
    TrustStore,
    Verifier,
)
from edge_agent.transport import (
    Channel,
    MqttClient,
    Outbox,
    UpdateReceiver,
    Uploader,
    Will,
    ack_message,
)
from edge_agent.transport.broker import MosquittoBroker

FAST = {"keepalive": 5, "backoff_base": 0.05, "backoff_cap": 0.5, "connect_timeout": 2.0}


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02) -> bool:
    """Poll `predicate` until true or `timeout` (no fixed sleeps in tests)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


@pytest.fixture
def mosquitto(tmp_path: Path):
    broker = MosquittoBroker(workdir=tmp_path / "mosquitto")
    broker.start()
    yield broker
    broker.stop()


@pytest.fixture
def topic_prefix() -> str:
    return f"t-{uuid.uuid4().hex[:12]}/edgeft/v1"


@dataclass
class Side:
    name: str
    key: keys.Ed25519PrivateKey
    id: str
    signer: Signer
    trust: TrustStore
    verifier: Verifier
    client: MqttClient
    channel: Channel
    home: Path


class Fleet:
    """Builds a coordinator and devices on one broker; stops every client it made."""

    def __init__(self, tmp_path: Path, prefix: str) -> None:
        self.tmp, self.topics = tmp_path, Topics(fleet="farm", prefix=prefix)
        self.coord_key = keys.generate_private_key()
        self.coord_id = keys.fingerprint(self.coord_key)
        self.clients: list[MqttClient] = []
        self.threads: list[_Loop] = []

    def _side(self, name: str, key: keys.Ed25519PrivateKey, role: str, port: int, subs: list[str],
              will: Callable[[Signer], Will] | None, **client_kw: Any) -> Side:
        home = self.tmp / name
        signer = Signer(key=key, topics=self.topics, sequence=SequenceCounter(path=home / "seq"))
        trust = TrustStore()
        verifier = Verifier(topics=self.topics, trust=trust, replay=ReplayWindow(directory=home / "replay"))
        client = MqttClient(host="127.0.0.1", port=port, client_id=f"{name}-{uuid.uuid4().hex[:6]}",
                            subscriptions=subs, will=(lambda: will(signer)) if will else None,
                            **{**FAST, **client_kw})
        self.clients.append(client)
        channel = Channel(client=client, signer=signer, verifier=verifier, role=role)
        return Side(name, key, keys.fingerprint(key), signer, trust, verifier, client, channel, home)

    def coordinator(self, port: int, *, start: bool = True, **client_kw: Any) -> Side:
        side = self._side("coord", self.coord_key, "coordinator", port, self.topics.coordinator_subscriptions(),
                          None, **client_kw)
        if start:
            side.client.start()
            assert side.client.wait_connected(10)
        return side

    def device(self, port: int, *, name: str = "dev", key: keys.Ed25519PrivateKey | None = None, enrol: Side | None = None,
               start: bool = True, **client_kw: Any) -> Side:
        key = key or keys.generate_private_key()
        dev_id = keys.fingerprint(key)

        def will(signer: Signer) -> Will:
            topic = self.topics.device(dev_id, "state")
            return Will(topic, signer.control(topic, Kind.STATE, {"status": "offline"}, ttl=86400))

        side = self._side(name, key, "device", port, self.topics.device_subscriptions(dev_id), will, **client_kw)
        side.trust.add(self.coord_key.public_key(), role="coordinator")
        if enrol is not None:
            enrol.trust.add(key.public_key(), role="device")
        if start:
            side.client.start()
            assert side.client.wait_connected(10)
        return side

    def close(self) -> None:
        for loop in self.threads:
            loop.stop()
        for client in self.clients:
            client.stop()


@pytest.fixture
def fleet(tmp_path: Path, topic_prefix: str):
    f = Fleet(tmp_path, topic_prefix)
    yield f
    f.close()


class _Loop:
    def __init__(self, fleet: Fleet, name: str) -> None:
        self._stop = threading.Event()
        self.errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        fleet.threads.append(self)

    def start(self) -> _Loop:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except BaseException as exc:  # surfaced by the test's assertions
                self.errors.append(exc)
                return

    def step(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


class DeviceLoop(_Loop):
    """What the agent daemon will do: apply acks, refuse bad commands, pump the outbox."""

    def __init__(self, fleet: Fleet, side: Side, outbox: Outbox, *, max_chunks: int | None = None,
                 pause: float = 0.0, **uploader_kw: Any) -> None:
        super().__init__(fleet, f"device-{side.id}")
        self.side, self.outbox, self.max_chunks, self.pause = side, outbox, max_chunks, pause
        kw = {"ack_timeout": 1.0, "publish_timeout": 2.0, "retry_base": 0.2, "retry_cap": 1.0, **uploader_kw}
        self.uploader = Uploader(client=side.client, outbox=outbox, signer=side.signer, topics=fleet.topics, **kw)
        self.commands: list[Message] = []
        self.rejections: list[Rejection] = []
        self.ack_results: list[str] = []

    def step(self) -> None:
        result = self.side.channel.receive(timeout=0.02)
        if isinstance(result, Rejection):
            self.rejections.append(result)
            self.side.channel.reply_to(result)
        elif isinstance(result, Message):
            if result.kind is Kind.ACK:
                self.ack_results.append(self.uploader.handle_ack(result))
            elif result.kind is Kind.CMD:
                self.commands.append(result)
        self.uploader.pump(max_chunks=self.max_chunks)
        if self.pause:
            time.sleep(self.pause)


@dataclass
class CoordinatorLog:
    completed: list[Any] = field(default_factory=list)
    duplicates: int = 0
    rejections: list[Rejection] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)


class CoordinatorLoop(_Loop):
    """What the coordinator will do: reassemble updates once, ack them, answer bad chunks."""

    def __init__(self, fleet: Fleet, side: Side, **receiver_kw: Any) -> None:
        super().__init__(fleet, "coordinator")
        self.side, self.topics = side, fleet.topics
        self.receiver = UpdateReceiver(ack_interval=0.2, **receiver_kw)
        self.log = CoordinatorLog()
        self.chunks_seen = 0

    def step(self) -> None:
        result = self.side.channel.receive(timeout=0.05)
        if isinstance(result, Rejection):
            self.log.rejections.append(result)
            self.side.channel.reply_to(result)
        elif isinstance(result, Message):
            if result.kind is not Kind.UPDATE_CHUNK:
                self.log.messages.append(result)
                return
            self.chunks_seen += 1
            got = self.receiver.add(result)
            if got.status == "complete":
                self.log.completed.append(got.update)
            elif got.status == "duplicate":
                self.log.duplicates += 1
            if got.ack_due:
                status = "accepted" if got.status == "complete" else "duplicate"
                topic, payload = ack_message(self.side.signer, self.topics, got.key, got.upload, status)
                self.side.client.publish_wait(topic, payload, timeout=2.0)
