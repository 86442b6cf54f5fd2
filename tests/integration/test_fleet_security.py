"""Untrusted input against `edge-coordinator serve`: a device whose key is not approved,
a forger, and junk on every topic while a real upload is in flight."""

from __future__ import annotations

import hashlib
import json
import random
import time
import uuid

import pytest

from edge_agent import keys
from edge_agent.coordinator.records import JobStatus, UpdateStatus
from edge_agent.coordinator.service_files import read_serve_file
from edge_agent.protocol import Kind, canonical_json
from edge_agent.protocol.envelope import _signing_input
from edge_agent.transport import MqttClient, Outbox, OutboxKey
from tests.integration.conftest import (
    FAST,
    DeviceLoop,
    announce,
    fake_update,
    online_devices,
    register_digits,
    wait_for,
)

pytestmark = pytest.mark.integration


def test_an_unapproved_key_is_refused_until_approved_and_a_forger_never(mosquitto, fleet, serve, tmp_path,
                                                                        digits_bundle):
    coordinator = serve(mosquitto.port, auto_approve=False).start()
    register_digits(coordinator, digits_bundle[1], tmp_path)
    stranger = fleet.device(mosquitto.port, name="stranger")
    announce(fleet, stranger)
    outbox = Outbox(directory=tmp_path / "outbox")
    device = DeviceLoop(fleet, stranger, outbox, ack_timeout=30.0).start()
    assert wait_for(lambda: "PENDING" in coordinator.cli("devices").stdout, 90), coordinator.log_tail()

    # its update is refused (retry: approval may come), and nothing is stored
    key = OutboxKey("job-made-up", stranger.id, 1)
    outbox.put(key, [random.Random(1).randbytes(3000)], meta={"samples": 10})
    assert wait_for(lambda: "retry" in device.ack_results, 90), coordinator.log_tail()
    assert outbox.get(key) is not None  # kept for later: never silently dropped
    assert "pending approval" in coordinator.log_tail() and "unknown_key" not in coordinator.log_tail()
    with coordinator.registry() as reg:
        assert reg.totals()["updates"] == 0
        assert not reg.get_device(stranger.id).approved  # shown (online, named), but nothing it says is taken
        assert "battery_pct" not in reg.get_device(stranger.id).state

    # the operator approves it by its enrolment code: its state is taken from then on
    code = keys.enrolment_code(stranger.key)
    assert "approved" in coordinator.cli("approve", code).stdout
    assert wait_for(lambda: online_devices(coordinator) == [stranger.id], 90), coordinator.log_tail()

    # a forger signing (validly, with its own key) for the approved device's topic is refused
    forger = keys.generate_private_key()
    topic = fleet.topics.device(stranger.id, "update")
    now = int(time.time())
    header = canonical_json({"v": 1, "kind": "update_chunk", "from": keys.fingerprint(forger), "seq": now * 10**6,
                             "iat": now, "exp": now + 600, "body": {"job": "j", "round": 1, "upload": "0" * 64,
                                                                   "index": 0, "count": 1, "size": 4}})
    sig = forger.sign(_signing_input(fleet.topics.parse(topic).address, b"B", header + hashlib.sha256(b"data").digest()))
    forged = b"EFB1" + len(header).to_bytes(2, "big") + header + sig + b"data"
    assert stranger.client.publish_wait(topic, forged, timeout=60)
    assert wait_for(lambda: "wrong_signer" in coordinator.log_tail(10**7), 90), coordinator.log_tail()
    with coordinator.registry() as reg:
        assert reg.totals()["updates"] == 0
    assert coordinator.alive and not device.errors


def junk_payloads(rng: random.Random, valid: list[bytes]) -> list[bytes]:
    out = [b"", b"\x00", b"{", b"null", b"[]", b'{"v":1}', b"EFB1", b"EFB1\xff\xff" + bytes(100),
           json.dumps({"v": 1, "kind": "state", "from": "x" * 24, "seq": 1, "iat": 0, "exp": 1,
                       "body": {"status": "idle"}, "sig": "AAAA"}).encode(),
           json.dumps({"v": 1, "kind": "hello", "from": "y" * 24, "seq": 1, "iat": 0, "exp": 9e18,
                       "body": {"public_key": "A" * 44}, "sig": "B" * 88}).encode(),
           b'{"a":' * 5000, "é".encode("latin-1") * 50, bytes(200 * 1024), bytes(130 * 1024),
           rng.randbytes(300 * 1024)]
    out += [rng.randbytes(rng.randrange(1, 4000)) for _ in range(20)]
    for msg in valid:  # real messages with one bit flipped, or cut short
        flipped = bytearray(msg)
        flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
        out += [bytes(flipped), msg[: len(msg) // 2]]
    return out


def test_junk_on_every_topic_is_logged_and_dropped_and_loses_nothing_queued(mosquitto, fleet, serve, tmp_path,
                                                                            digits_bundle):
    coordinator = serve(mosquitto.port).start()
    register_digits(coordinator, digits_bundle[1], tmp_path)
    side = fleet.device(mosquitto.port, name="dev")
    announce(fleet, side)
    outbox = Outbox(directory=tmp_path / "outbox")
    device = DeviceLoop(fleet, side, outbox, max_chunks=1, pause=0.05, ack_timeout=5.0).start()
    assert wait_for(lambda: online_devices(coordinator) == [side.id], 90), coordinator.log_tail()
    coordinator.cli("train", "--model", "digits", "--devices", "all", "--rounds", "1", "--deadline", "120s",
                    "--detach")
    assert wait_for(lambda: device.commands, 90), coordinator.log_tail()
    cmd = device.commands[0]
    with coordinator.registry() as reg:
        chunks = fake_update(reg, side, cmd, chunk_size=200)
    key = OutboxKey(cmd.body["job"], side.id, cmd.body["round"])
    outbox.put(key, chunks, meta={"samples": 25})

    rng = random.Random(7)
    topics = fleet.topics
    valid = [side.signer.binary(topics.device(side.id, "update"), Kind.UPDATE_CHUNK,
                                {"job": key.job, "round": key.round, "upload": "1" * 64, "index": 0, "count": 2},
                                b"x" * 50, ttl=60),
             side.signer.control(topics.device(side.id, "progress"), Kind.PROGRESS, {"phase": "training"}, ttl=60)]
    ids = [side.id, "z" * 24, "not-a-device", uuid.uuid4().hex[:24]]
    targets = [topics.device(i, ch) for i in ids for ch in ("hello", "state", "progress", "update", "cmd", "ack")]
    targets += [topics.manifest("digits", "1"), topics.model_chunk("digits", "1", 0), f"{topics.root}/devices/x",
                f"{topics.root}/devices/{side.id}/update/extra", f"{topics.prefix}/other-fleet/devices/a/state",
                "random/topic", f"{topics.root}/" + "deep/" * 40]
    fuzzer = MqttClient(host="127.0.0.1", port=mosquitto.port, client_id=f"fuzz-{uuid.uuid4().hex[:6]}", **FAST)
    fuzzer.start()
    assert fuzzer.wait_connected(10)
    sent = 0
    for payload in junk_payloads(rng, valid):
        for topic in rng.sample(targets, 6):
            if topic.endswith("/cmd") or topic.endswith("/ack"):
                continue  # devices' topics: the coordinator does not listen there
            sent += fuzzer.publish_wait(topic, payload, retain=rng.random() < 0.2, timeout=10)
    fuzzer.stop()
    assert sent > 100

    # the upload that was in flight arrives once, whole, and the round completes
    assert wait_for(lambda: outbox.get(key) is None, 60), coordinator.log_tail()
    with coordinator.registry() as reg:
        assert wait_for(lambda: reg.get_job(key.job).status.terminal, 90)
        assert reg.get_job(key.job).status is JobStatus.DONE
        (update,) = reg.list_updates(key.job)
        assert update.status is UpdateStatus.ACCEPTED and update.num_samples == 25
        assert [d.id for d in reg.list_devices()] == [side.id]  # no junk enrolled
    log = coordinator.log_tail(200_000)
    assert "dropped:" in log and "Traceback" not in log
    info = read_serve_file(coordinator.state_dir)
    assert coordinator.alive and info["errors"] == 0 and time.time() - info["heartbeat_at"] < 60
