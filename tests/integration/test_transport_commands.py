"""Signed commands over a real broker: good ones run, bad ones are refused with the reason."""

from __future__ import annotations

import json
import time

import pytest

from edge_agent import keys
from edge_agent.protocol import Kind, Message, SequenceCounter, Signer
from edge_agent.transport import Outbox
from tests.integration.conftest import CoordinatorLoop, DeviceLoop, wait_for

pytestmark = pytest.mark.integration


def refusals(server: CoordinatorLoop) -> list[dict]:
    return [m.body for m in server.log.messages if m.kind is Kind.REFUSAL]


def test_bad_expired_and_replayed_commands_are_refused_with_the_reason(mosquitto, fleet, tmp_path):
    coord = fleet.coordinator(mosquitto.port)
    dev = fleet.device(mosquitto.port, enrol=coord)
    server = CoordinatorLoop(fleet, coord).start()
    agent = DeviceLoop(fleet, dev, Outbox(directory=tmp_path / "outbox")).start()
    topic = fleet.topics.device(dev.id, "cmd")

    good = coord.signer.control(topic, Kind.CMD, {"cmd_id": "run-1", "action": "finetune", "job": "j1", "round": 0},
                                ttl=3600)
    assert coord.client.publish_wait(topic, good, timeout=60)
    assert wait_for(lambda: len(agent.commands) == 1, 60)
    assert agent.commands[0].body["action"] == "finetune" and agent.commands[0].sender == fleet.coord_id

    forged = json.loads(coord.signer.control(topic, Kind.CMD, {"cmd_id": "run-2", "action": "ping"}, ttl=3600))
    forged["body"]["action"] = "cancel"  # changed after signing
    assert coord.client.publish_wait(topic, json.dumps(forged).encode(), timeout=60)

    stale_signer = Signer(key=fleet.coord_key, topics=fleet.topics, sequence=coord.signer.sequence,
                          clock=lambda: time.time() - 3600)
    assert coord.client.publish_wait(topic, stale_signer.control(topic, Kind.CMD, {"cmd_id": "run-3", "action": "ping"},
                                                                 ttl=600), timeout=60)
    assert coord.client.publish_wait(topic, good, timeout=60)  # a replay of the accepted command

    assert wait_for(lambda: len(refusals(server)) == 3, 60), refusals(server)
    by_cmd = {r["ref_cmd_id"]: r for r in refusals(server)}
    assert by_cmd["run-2"]["reason"] == "bad_signature"
    assert by_cmd["run-3"]["reason"] == "expired" and "expired" in by_cmd["run-3"]["detail"]
    assert by_cmd["run-1"]["reason"] == "replayed"
    assert all(r["ref_topic"] == topic for r in refusals(server))
    assert len(agent.commands) == 1  # none of them ran
    assert [r.reason for r in agent.rejections] == ["bad_signature", "expired", "replayed"]


def test_commands_from_a_device_key_or_an_unknown_key_are_refused(mosquitto, fleet, tmp_path):
    coord = fleet.coordinator(mosquitto.port)
    dev = fleet.device(mosquitto.port, enrol=coord)
    other = fleet.device(mosquitto.port, name="other", enrol=coord)
    server = CoordinatorLoop(fleet, coord).start()
    agent = DeviceLoop(fleet, dev, Outbox(directory=tmp_path / "outbox")).start()
    topic = fleet.topics.device(dev.id, "cmd")
    # A key this device knows, but as a device's key, signing a command for it.
    dev.trust.add(other.key.public_key(), role="device")
    assert other.client.publish_wait(topic, other.signer.control(topic, Kind.CMD, {"cmd_id": "evil", "action": "ping"},
                                                                  ttl=600), timeout=60)
    rogue = Signer(key=keys.generate_private_key(), topics=fleet.topics,
                   sequence=SequenceCounter(path=tmp_path / "rogue.seq"))
    assert other.client.publish_wait(topic, rogue.control(topic, Kind.CMD, {"cmd_id": "rogue", "action": "ping"},
                                                          ttl=600), timeout=60)
    assert wait_for(lambda: len(refusals(server)) == 2, 60)
    assert {r["ref_cmd_id"]: r["reason"] for r in refusals(server)} == {"evil": "wrong_signer", "rogue": "unknown_key"}
    assert agent.commands == []
    # The refusals themselves are signed by the device and verified by the coordinator.
    assert all(isinstance(m, Message) and m.sender == dev.id for m in server.log.messages if m.kind is Kind.REFUSAL)
