"""Junk on every topic: each message judged with the right reason, both sides stay up and
lose nothing queued.

Per message, not per second: every junk message's verdict is looked up by (topic, sha256)
at each receiver. "Nothing more arrives" is proved with a sentinel: MQTT keeps one
publisher's messages in order and a broker routes a QoS 1 message before it acknowledges
it, so a message published after the storm was acknowledged arrives after all of it.
"""

from __future__ import annotations

import hashlib
import json
import random
import uuid
from dataclasses import dataclass, field

import pytest

from edge_agent.protocol import BINARY_KINDS, Kind, Message, Reason, Rejection, Topics
from edge_agent.transport import Channel, MqttClient, Outbox, OutboxKey
from tests.integration.conftest import FAST, CoordinatorLoop, DeviceLoop, wait_for

pytestmark = pytest.mark.integration


@dataclass(frozen=True)
class Junk:
    """A junk payload and the verdict it must get on each kind of topic of this fleet."""

    what: str
    payload: bytes
    control: Reason  # on a control topic (cmd, ack, state, manifest, ...)
    binary: Reason  # on a binary topic (update chunks, model chunks)
    on: dict[str, Reason] = field(default_factory=dict)  # where a channel differs ("ack": ...)

    def reason(self, topics: Topics, topic: str) -> Reason:
        route = topics.parse(topic)
        if route is None:
            return Reason.UNKNOWN_TOPIC
        if route.channel in self.on:
            return self.on[route.channel]
        return self.binary if route.kinds[0] in BINARY_KINDS else self.control


def junk_payloads(valid: bytes, rng: random.Random) -> list[Junk]:
    """Junk derived from `valid`, a genuine signed command for a device (cmd_id "ok")."""
    M, B = Reason.MALFORMED, Reason.BAD_SCHEMA
    return [
        Junk("empty", b"", M, M),
        Junk("random 64 B", rng.randbytes(64), M, M),
        Junk("random 5 kB", rng.randbytes(5000), M, M),
        Junk("0xff", b"\xff" * 100, M, M),
        Junk("open braces", b"{" * 10_000, M, M),
        Junk("deep and oversized for control", b"[" * 15_000 + b"]" * 15_000, Reason.OVERSIZED, M),
        Junk("binary magic, absurd header", b"EFB1" + b"\xff\xff" + rng.randbytes(100), M, M),
        Junk("missing fields", json.dumps({"v": 1, "kind": "cmd", "body": "x" * 100}).encode(), B, M),
        Junk("ack envelope, no body", json.dumps({"v": 1, "kind": "ack", "from": "x", "seq": 1, "iat": 0, "exp": 1,
                                                  "body": {}, "sig": "AA=="}).encode(),
             Reason.WRONG_KIND, M, on={"ack": B}),
        Junk("truncated command", valid[: len(valid) // 2], M, M),
        Junk("protocol v99", valid.replace(b'"v":1', b'"v":99'), Reason.UNSUPPORTED_VERSION, M),
        Junk("command altered after signing", valid.replace(b'"cmd_id":"ok"', b'"cmd_id":"no"'), Reason.WRONG_KIND,
             M, on={"cmd": Reason.BAD_SIGNATURE}),
        Junk("200 KiB", rng.randbytes(200 * 1024), Reason.OVERSIZED, Reason.OVERSIZED),  # under the client's limit
        Junk("300 KiB", rng.randbytes(300 * 1024), Reason.OVERSIZED, Reason.OVERSIZED),  # over it: never judged
    ]


def sha(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()


def verdicts(rejections: list[Rejection]) -> dict[tuple[str, str], list[str]]:
    found: dict[tuple[str, str], list[str]] = {}
    for r in list(rejections):
        found.setdefault((r.topic, r.sha256), []).append(str(r.reason))
    return found


def test_junk_on_every_topic_is_judged_message_by_message_and_the_queued_update_still_arrives(
        mosquitto, fleet, tmp_path):
    t = fleet.topics
    coord = fleet.coordinator(mosquitto.port)
    dev = fleet.device(mosquitto.port, enrol=coord)
    # The coordinator also reads model and unknown topics (filters that do not overlap its
    # own, so each message reaches it once); the device reads its cmd and ack topics.
    for extra in (f"{t.root}/devices/+/unknown", f"{t.root}/models/#", f"{t.root}/random/#"):
        coord.client.subscribe(extra)
    # The device's refusals are rate-limited by a token bucket; with its clock stopped the
    # bucket never refills, so exactly its burst (5) is answered whatever the machine's speed.
    dev.channel = Channel(client=dev.client, signer=dev.signer, verifier=dev.verifier, role="device",
                          clock=lambda: 0.0)
    outbox = Outbox(directory=tmp_path / "outbox")
    key = OutboxKey("job-f", dev.id, 5)
    chunks = [random.Random(9).randbytes(30_000) for _ in range(3)]
    outbox.put(key, chunks)

    attacker = MqttClient(host="127.0.0.1", port=mosquitto.port, client_id=f"attacker-{uuid.uuid4().hex[:6]}", **FAST)
    fleet.clients.append(attacker)
    attacker.start()
    assert attacker.wait_connected(60)
    cmd_topic = t.device(dev.id, "cmd")
    valid = coord.signer.control(cmd_topic, Kind.CMD, {"cmd_id": "ok", "action": "ping"}, ttl=600)
    topics = [t.device(dev.id, ch) for ch in ("hello", "state", "cmd", "ack", "progress", "update")]
    topics += [t.device("someone-else", "update"), t.manifest("m", "v1"), t.model_chunk("m", "v1", 0),
               t.root + "/devices/x/unknown", t.root + "/random/topic"]
    rng = random.Random(1)
    storm = [(topic, junk) for topic in topics for junk in junk_payloads(valid, rng)]
    assert len({(topic, sha(j.payload)) for topic, j in storm}) == len(storm)  # each one identifiable
    for topic, junk in storm:
        assert attacker.publish_wait(topic, junk.payload, timeout=60), junk.what

    server = CoordinatorLoop(fleet, coord).start()
    agent = DeviceLoop(fleet, dev, outbox).start()
    # Published after the storm was acknowledged: the device judges the whole storm first.
    fresh = coord.signer.control(cmd_topic, Kind.CMD, {"cmd_id": "ok", "action": "ping"}, ttl=600)
    assert coord.client.publish_wait(cmd_topic, fresh, timeout=60)
    assert wait_for(lambda: [c.body["cmd_id"] for c in agent.commands] == ["ok"], 60), agent.commands
    # The device's last word, after its refusals: once the coordinator has it, it has every
    # refusal the device sent, and (queued behind the storm) it has judged the storm too.
    progress = t.device(dev.id, "progress")
    assert dev.channel.send(progress, Kind.PROGRESS, {"phase": "sentinel"}, ttl=600)
    assert wait_for(lambda: any(m.kind is Kind.PROGRESS and m.body["phase"] == "sentinel"
                                for m in list(server.log.messages)), 60)

    # Every junk message, at every receiver subscribed to its topic: refused once, for the
    # right reason; the ones over a client's max_payload never reach its verifier.
    at_device, at_coord = verdicts(agent.rejections), verdicts(server.log.rejections)
    device_topics = set(t.device_subscriptions(dev.id))  # the coordinator reads every other one
    for topic, junk in storm:
        expected = [str(junk.reason(t, topic))]
        got_coord = at_coord.get((topic, sha(junk.payload)), [])
        reaches_coord = topic not in device_topics and len(junk.payload) <= coord.client.max_payload
        assert got_coord == (expected if reaches_coord else []), (topic, junk.what)
        got_dev = at_device.get((topic, sha(junk.payload)), [])
        reaches_device = topic in device_topics and len(junk.payload) <= dev.client.max_payload
        assert got_dev == (expected if reaches_device else []), (topic, junk.what)
    assert dev.client.stats["dropped_oversize"] == 2  # the 300 KiB ones on its cmd and ack topics
    assert coord.client.stats["dropped_oversize"] == len(topics) - 2
    assert dev.client.stats["dropped_inbox_full"] == coord.client.stats["dropped_inbox_full"] == 0

    # Refused commands are answered, message by message, until the bucket is empty; junk on
    # the ack topic (and anywhere else) never is.
    cmd_junk = [j for topic, j in storm if topic == cmd_topic and len(j.payload) <= dev.client.max_payload]
    answered = [(m.body["ref_sha256"], m.body["reason"], m.body["ref_topic"])
                for m in list(server.log.messages) if m.kind is Kind.REFUSAL]
    assert answered == [(sha(j.payload), str(j.reason(t, cmd_topic)), cmd_topic) for j in cmd_junk[:5]]
    assert all(isinstance(m, Message) and m.sender == dev.id for m in server.log.messages if m.kind is Kind.REFUSAL)

    # The update queued before the storm still arrives, once and intact; both sides are up.
    assert wait_for(lambda: outbox.get(key) is None, 60), "the queued update was lost or stuck"
    assert len(server.log.completed) == 1 and server.log.completed[0].chunks == chunks
    assert dev.client.connected and coord.client.connected
