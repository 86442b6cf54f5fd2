"""Updates travel device -> coordinator exactly once, intact, across broker and agent restarts."""

from __future__ import annotations

import random

import pytest

from edge_agent.transport import Outbox, OutboxKey
from edge_agent.transport.broker import MosquittoBroker, free_port
from tests.integration.conftest import CoordinatorLoop, DeviceLoop, wait_for

pytestmark = pytest.mark.integration


def update_chunks(n: int, size: int = 60_000, seed: int = 1) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(size) for _ in range(n)]


def test_update_arrives_once_and_intact_although_the_broker_dies_mid_upload(mosquitto, fleet, tmp_path):
    coord = fleet.coordinator(mosquitto.port)
    dev = fleet.device(mosquitto.port, enrol=coord)
    server = CoordinatorLoop(fleet, coord).start()
    outbox = Outbox(directory=tmp_path / "outbox")
    key = OutboxKey("job-7", dev.id, 2)
    chunks = update_chunks(12)
    outbox.put(key, chunks, meta={"model": "digits", "samples": 137, "energy_wh": 0.42})
    agent = DeviceLoop(fleet, dev, outbox, max_chunks=1, pause=0.04).start()

    assert wait_for(lambda: server.chunks_seen >= 3, 10), "upload never started"
    assert outbox.get(key).next_index < len(chunks)  # really mid-upload
    mosquitto.restart(kill=True, down_for=0.5)  # a crash: whatever the broker held in memory is gone
    assert wait_for(lambda: outbox.get(key) is None, 30), f"never acknowledged: {outbox.get(key)}"

    assert not server.errors and not agent.errors
    assert len(server.log.completed) == 1
    done = server.log.completed[0]
    assert done.key == key and done.chunks == chunks
    assert (done.samples, done.energy_wh) == (137, 0.42)  # signed with every chunk, for FedAvg
    assert dev.client.stats["connects"] >= 2 and coord.client.stats["connects"] >= 2
    assert "acked" in agent.ack_results
    # Repeats after the ack (the device resending, QoS 1 redelivery) never deliver it twice.
    assert wait_for(lambda: len(server.log.completed) == 1, 0.5)


def test_chunks_the_broker_accepted_but_nobody_received_are_sent_again(mosquitto, fleet, tmp_path):
    # The coordinator is offline with a clean session: the broker PUBACKs every chunk and
    # drops it. Only the missing coordinator ack can tell the device to send it all again.
    coord = fleet.coordinator(mosquitto.port, start=False)
    dev = fleet.device(mosquitto.port, enrol=coord)
    outbox = Outbox(directory=tmp_path / "outbox")
    key = OutboxKey("job-11", dev.id, 4)
    chunks = update_chunks(3, size=20_000, seed=4)
    outbox.put(key, chunks)
    agent = DeviceLoop(fleet, dev, outbox, ack_timeout=1.5).start()
    assert wait_for(lambda: outbox.get(key).state == "awaiting_ack", 10)
    assert outbox.get(key).attempts == 0

    coord.client.start()
    assert coord.client.wait_connected(10)
    server = CoordinatorLoop(fleet, coord).start()
    assert wait_for(lambda: outbox.get(key) is None, 20)
    assert len(server.log.completed) == 1 and server.log.completed[0].chunks == chunks
    assert "acked" in agent.ack_results  # only possible if it was sent again after the first attempt


def test_a_restarted_agent_resumes_from_its_outbox(mosquitto, fleet, tmp_path):
    coord = fleet.coordinator(mosquitto.port)
    dev = fleet.device(mosquitto.port, enrol=coord)
    server = CoordinatorLoop(fleet, coord).start()
    outbox = Outbox(directory=tmp_path / "outbox")
    key = OutboxKey("job-8", dev.id, 0)
    chunks = update_chunks(10, seed=2)
    outbox.put(key, chunks)
    agent = DeviceLoop(fleet, dev, outbox, max_chunks=1, pause=0.05).start()
    assert wait_for(lambda: server.chunks_seen >= 3, 10)
    agent.stop()  # the agent process dies; its memory with it
    dev.client.stop()
    sent_before = Outbox(directory=tmp_path / "outbox").get(key).next_index
    assert 3 <= sent_before < 10

    # A new process: same key, same outbox directory, fresh client and state.
    reborn = fleet.device(mosquitto.port, name="dev-again", key=dev.key)
    reopened = Outbox(directory=tmp_path / "outbox")
    assert reopened.get(key).next_index == sent_before
    DeviceLoop(fleet, reborn, reopened).start()
    assert wait_for(lambda: reopened.get(key) is None, 20)
    assert len(server.log.completed) == 1 and server.log.completed[0].chunks == chunks
    # It resumed where it stopped rather than starting over: no chunk arrived twice.
    assert server.chunks_seen == 10


def test_an_update_from_an_unknown_key_is_rejected_kept_and_accepted_after_enrolment(mosquitto, fleet, tmp_path):
    coord = fleet.coordinator(mosquitto.port)
    dev = fleet.device(mosquitto.port)  # not enrolled with the coordinator
    server = CoordinatorLoop(fleet, coord).start()
    outbox = Outbox(directory=tmp_path / "outbox")
    key = OutboxKey("job-9", dev.id, 1)
    chunks = update_chunks(2, size=5000, seed=3)
    outbox.put(key, chunks)
    agent = DeviceLoop(fleet, dev, outbox).start()

    assert wait_for(lambda: any(r.reason == "unknown_key" for r in server.log.rejections), 10)
    assert wait_for(lambda: "retry" in agent.ack_results, 10), agent.ack_results
    assert server.log.completed == []
    item = outbox.get(key)
    assert item is not None and "unknown_key" in item.last_error  # kept, with the reason

    coord.trust.add(dev.key.public_key(), role="device")  # the operator enrols it
    assert wait_for(lambda: outbox.get(key) is None, 20)
    assert len(server.log.completed) == 1 and server.log.completed[0].chunks == chunks


def test_uploads_wait_while_the_broker_is_down(fleet, tmp_path):
    port = free_port()
    dev = fleet.device(port, start=False)
    dev.client.start()
    outbox = Outbox(directory=tmp_path / "outbox")
    key = OutboxKey("job-10", dev.id, 0)
    outbox.put(key, update_chunks(2, size=1000))
    agent = DeviceLoop(fleet, dev, outbox).start()
    assert wait_for(lambda: dev.client.stats["connect_failures"] >= 3, 10)
    assert outbox.get(key).next_index == 0 and not agent.errors  # nothing lost, nothing claimed sent

    broker = MosquittoBroker(workdir=tmp_path / "late-broker", port=port)
    broker.start()
    try:
        coord = fleet.coordinator(port)
        coord.trust.add(dev.key.public_key(), role="device")
        CoordinatorLoop(fleet, coord).start()
        assert wait_for(lambda: outbox.get(key) is None, 20)
    finally:
        fleet.close()
        broker.stop()
