"""Junk on every topic: logged and dropped; both sides stay up and lose nothing queued."""

from __future__ import annotations

import json
import random
import uuid

import pytest

from edge_agent.protocol import Kind, Reason, Rejection
from edge_agent.transport import MqttClient, Outbox, OutboxKey
from tests.integration.conftest import FAST, CoordinatorLoop, DeviceLoop, wait_for

pytestmark = pytest.mark.integration


def junk_payloads(valid: bytes, rng: random.Random) -> list[bytes]:
    return [
        b"",
        rng.randbytes(64),
        rng.randbytes(5000),
        b"\xff" * 100,
        b"{" * 10_000,
        b"[" * 15_000 + b"]" * 15_000,  # oversized for a control topic, and deep
        b"EFB1" + b"\xff\xff" + rng.randbytes(100),  # binary magic, absurd header length
        json.dumps({"v": 1, "kind": "cmd", "body": "x" * 100}).encode(),
        json.dumps({"v": 1, "kind": "ack", "from": "x", "seq": 1, "iat": 0, "exp": 1, "body": {}, "sig": "AA=="}).encode(),
        valid[: len(valid) // 2],
        valid.replace(b'"v":1', b'"v":99'),
        rng.randbytes(200 * 1024),  # over every protocol limit, under the client's
        rng.randbytes(300 * 1024),  # over the client's max_payload: dropped before the inbox
    ]


def test_junk_on_every_topic_is_dropped_and_the_queued_update_still_arrives(mosquitto, fleet, tmp_path):
    coord = fleet.coordinator(mosquitto.port)
    dev = fleet.device(mosquitto.port, enrol=coord)
    coord.client.subscribe(fleet.topics.root + "/#")  # the coordinator sees every topic, models included
    outbox = Outbox(directory=tmp_path / "outbox")
    key = OutboxKey("job-f", dev.id, 5)
    chunks = [random.Random(9).randbytes(30_000) for _ in range(3)]
    outbox.put(key, chunks)

    attacker = MqttClient(host="127.0.0.1", port=mosquitto.port, client_id=f"attacker-{uuid.uuid4().hex[:6]}", **FAST)
    fleet.clients.append(attacker)
    attacker.start()
    assert attacker.wait_connected(10)
    valid = coord.signer.control(fleet.topics.device(dev.id, "cmd"), Kind.CMD, {"cmd_id": "ok", "action": "ping"},
                                 ttl=60)
    t = fleet.topics
    topics = [t.device(dev.id, ch) for ch in ("hello", "state", "cmd", "ack", "progress", "update")]
    topics += [t.device("someone-else", "update"), t.manifest("m", "v1"), t.model_chunk("m", "v1", 0),
               t.root + "/devices/x/unknown", t.root + "/random/topic"]
    rng = random.Random(1)
    sent = 0
    for topic in topics:
        for payload in junk_payloads(valid, rng):
            assert attacker.publish_wait(topic, payload)
            sent += 1

    server = CoordinatorLoop(fleet, coord).start()
    agent = DeviceLoop(fleet, dev, outbox).start()
    # Everything is drained, every message judged; both processes are up and connected.
    assert wait_for(lambda: dev.client.stats["received"] + dev.client.stats["dropped_oversize"] >= 2 * 13, 60)
    assert wait_for(lambda: outbox.get(key) is None, 60), "the queued update was lost or stuck"
    assert len(server.log.completed) == 1 and server.log.completed[0].chunks == chunks
    assert not agent.errors and not server.errors
    assert dev.client.connected and coord.client.connected
    assert dev.client.stats["dropped_oversize"] == 2  # the 300 KiB ones on its cmd and ack topics
    assert all(isinstance(r, Rejection) for r in agent.rejections)
    reasons = {r.reason for r in agent.rejections} | {r.reason for r in server.log.rejections}
    assert {Reason.MALFORMED, Reason.OVERSIZED, Reason.BAD_SCHEMA, Reason.UNSUPPORTED_VERSION,
            Reason.UNKNOWN_TOPIC} <= reasons
    assert len(server.log.rejections) >= 10 * 12  # eleven topics, twelve payloads each reach the verifier

    # Still serving: a good command goes through after the storm. Signed now: the storm
    # can outlast the first one's 60 s lifetime on a loaded machine, and expiry is correct.
    assert not any(c.body["cmd_id"] == "ok" for c in agent.commands)  # no junk got through
    fresh = coord.signer.control(t.device(dev.id, "cmd"), Kind.CMD, {"cmd_id": "ok", "action": "ping"}, ttl=600)
    assert coord.client.publish_wait(t.device(dev.id, "cmd"), fresh)
    assert wait_for(lambda: any(c.body["cmd_id"] == "ok" for c in agent.commands), 30)
    # Refusals are rate-limited, and junk on non-command topics is never answered.
    device_refusals = [m for m in server.log.messages if m.kind is Kind.REFUSAL]
    assert 1 <= len(device_refusals) <= 6
