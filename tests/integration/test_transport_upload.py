"""Updates travel device -> coordinator exactly once, intact, across broker and agent restarts."""

from __future__ import annotations

import random

import pytest

from edge_agent.transport import Outbox, OutboxKey
from edge_agent.transport.broker import MosquittoBroker, free_port
from tests.integration.conftest import CoordinatorLoop, DeviceLoop, update_sentinel, wait_for

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
    agent = DeviceLoop(fleet, dev, outbox, max_chunks=1, chunk_budget=3).start()

    # exactly 3 of 12 chunks out, seen by the coordinator: the crash lands mid-upload
    assert wait_for(lambda: server.chunks_seen == 3 and outbox.get(key).next_index == 3, 60), "upload never started"
    mosquitto.restart(kill=True, down_for=0.5)  # a crash: whatever the broker held in memory is gone
    assert wait_for(lambda: dev.client.stats["connects"] == 2 and coord.client.stats["connects"] == 2, 60)
    assert dev.client.wait_connected(60) and coord.client.wait_connected(60)
    assert outbox.get(key).next_index == 3 and outbox.get(key).state != "awaiting_ack"  # nothing sent meanwhile
    agent.release()
    assert wait_for(lambda: outbox.get(key) is None, 60), f"never acknowledged: {outbox.get(key)}"

    assert len(server.log.completed) == 1
    done = server.log.completed[0]
    assert done.key == key and done.chunks == chunks
    assert (done.samples, done.energy_wh) == (137, 0.42)  # signed with every chunk, for FedAvg
    assert "acked" in agent.ack_results
    # Repeats after the ack (the device resending, QoS 1 redelivery) never deliver it twice:
    # everything the device sent before the sentinel has been judged.
    update_sentinel(fleet, dev, server)
    assert len(server.log.completed) == 1


def test_chunks_the_broker_accepted_but_nobody_received_are_sent_again(mosquitto, fleet, tmp_path):
    # The coordinator is offline with a clean session: the broker PUBACKs every chunk and
    # drops it. Only the missing coordinator ack can tell the device to send it all again.
    # The device's clock is the test's: the ack deadline passes when the test says so.
    now = [1_000_000.0]
    coord = fleet.coordinator(mosquitto.port, start=False)
    dev = fleet.device(mosquitto.port, enrol=coord)
    outbox = Outbox(directory=tmp_path / "outbox", clock=lambda: now[0])
    key = OutboxKey("job-11", dev.id, 4)
    chunks = update_chunks(3, size=20_000, seed=4)
    outbox.put(key, chunks)
    agent = DeviceLoop(fleet, dev, outbox, ack_timeout=60, clock=lambda: now[0]).start()
    assert wait_for(lambda: outbox.get(key).state == "awaiting_ack", 60)
    assert outbox.get(key).attempts == 0

    coord.client.start()
    assert coord.client.wait_connected(60)  # subscribed: what is sent from now on reaches it
    server = CoordinatorLoop(fleet, coord).start()
    assert server.chunks_seen == 0 and outbox.get(key).state == "awaiting_ack"  # still waiting
    now[0] += 3600  # past the ack deadline (60 s + a retry delay of at most 1 s)
    assert wait_for(lambda: outbox.get(key) is None, 60)
    assert len(server.log.completed) == 1 and server.log.completed[0].chunks == chunks
    assert agent.ack_results == ["acked"]  # only possible because it was sent again


def test_a_restarted_agent_resumes_from_its_outbox(mosquitto, fleet, tmp_path):
    coord = fleet.coordinator(mosquitto.port)
    dev = fleet.device(mosquitto.port, enrol=coord)
    server = CoordinatorLoop(fleet, coord).start()
    outbox = Outbox(directory=tmp_path / "outbox")
    key = OutboxKey("job-8", dev.id, 0)
    chunks = update_chunks(10, seed=2)
    outbox.put(key, chunks)
    agent = DeviceLoop(fleet, dev, outbox, max_chunks=1, chunk_budget=3).start()
    assert wait_for(lambda: server.chunks_seen == 3, 60)
    agent.stop()  # the agent process dies; its memory with it
    dev.client.stop()
    assert Outbox(directory=tmp_path / "outbox").get(key).next_index == 3

    # A new process: same key, same outbox directory, fresh client and state.
    reborn = fleet.device(mosquitto.port, name="dev-again", key=dev.key)
    reopened = Outbox(directory=tmp_path / "outbox")
    assert reopened.get(key).next_index == 3
    DeviceLoop(fleet, reborn, reopened, ack_timeout=60).start()
    assert wait_for(lambda: reopened.get(key) is None, 60)
    assert len(server.log.completed) == 1 and server.log.completed[0].chunks == chunks
    # It resumed where it stopped rather than starting over: no chunk arrived twice.
    update_sentinel(fleet, reborn, server)
    assert server.chunks_seen == 10


def test_an_update_from_an_unknown_key_is_rejected_kept_and_accepted_after_enrolment(mosquitto, fleet, tmp_path):
    now = [1_000_000.0]  # the device's clock: its retry comes when the test says so
    coord = fleet.coordinator(mosquitto.port)
    dev = fleet.device(mosquitto.port)  # not enrolled with the coordinator
    server = CoordinatorLoop(fleet, coord).start()
    outbox = Outbox(directory=tmp_path / "outbox", clock=lambda: now[0])
    key = OutboxKey("job-9", dev.id, 1)
    chunks = update_chunks(2, size=5000, seed=3)
    outbox.put(key, chunks)
    agent = DeviceLoop(fleet, dev, outbox, ack_timeout=60, clock=lambda: now[0]).start()

    assert wait_for(lambda: any(r.reason == "unknown_key" for r in server.log.rejections), 60)
    # one "rejected, retry" ack per refused chunk (the coordinator's reply burst covers both)
    assert wait_for(lambda: agent.ack_results == ["retry", "retry"], 60), agent.ack_results
    assert server.log.completed == []
    item = outbox.get(key)
    assert item is not None and "unknown_key" in item.last_error  # kept, with the reason

    coord.trust.add(dev.key.public_key(), role="device")  # the operator enrols it
    now[0] += 3600  # the retry is due
    assert wait_for(lambda: outbox.get(key) is None, 60), outbox.get(key)
    assert len(server.log.completed) == 1 and server.log.completed[0].chunks == chunks


def test_uploads_wait_while_the_broker_is_down(fleet, tmp_path):
    port = free_port()
    dev = fleet.device(port, start=False)
    dev.client.start()
    outbox = Outbox(directory=tmp_path / "outbox")
    key = OutboxKey("job-10", dev.id, 0)
    outbox.put(key, update_chunks(2, size=1000))
    agent = DeviceLoop(fleet, dev, outbox).start()
    assert wait_for(lambda: dev.client.stats["connect_failures"] >= 3, 60)
    assert outbox.get(key).next_index == 0 and not agent.errors  # nothing lost, nothing claimed sent

    broker = MosquittoBroker(workdir=tmp_path / "late-broker", port=port)
    broker.start()
    try:
        coord = fleet.coordinator(port)
        coord.trust.add(dev.key.public_key(), role="device")
        CoordinatorLoop(fleet, coord).start()
        assert wait_for(lambda: outbox.get(key) is None, 60)
    finally:
        fleet.close()
        broker.stop()
