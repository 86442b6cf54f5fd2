"""Junk on every topic at the running daemon: logged and dropped, the daemon stays up,
answers commands after the storm, and the update it had queued still gets delivered."""

from __future__ import annotations

import random
import time
import uuid

import pytest

from edge_agent.agent.jobs import Job, JobState, JobStore, transition
from edge_agent.protocol import Kind
from edge_agent.transport import MqttClient, Outbox, OutboxKey
from tests.integration.conftest import FAST, Watcher, board_tree, enrol, wait_for
from tests.integration.test_transport_fuzz import junk_payloads

pytestmark = pytest.mark.integration


def queued_upload(agent) -> list[bytes]:
    """What a daemon leaves behind when it was stopped while uploading: a job and its update."""
    job = Job(job_id="jz-r4", round=4, model="digits@1", params={"job": "jz", "cmd_id": "jz-r4",
                                                                  "deadline_at": time.time() + 3600})
    for step in (JobState.PREPARING, JobState.TRAINING, JobState.UPLOADING):
        transition(job, step)
    JobStore(agent.state_dir / "jobs").save(job)
    chunks = [random.Random(3).randbytes(20_000) for _ in range(3)]
    Outbox(directory=agent.state_dir / "outbox").put(OutboxKey("jz", agent.id, 4), chunks)
    return chunks


def test_junk_on_every_topic_is_dropped_and_the_queued_update_survives(mosquitto, fleet, agents, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    agent = agents(tmp_path, mosquitto.port, sysfs_root=board_tree(tmp_path / "board"), data_dir=data)
    chunks = queued_upload(agent)

    coord = fleet.coordinator(mosquitto.port)
    coord.client.subscribe(fleet.topics.root + "/#")
    watcher = Watcher(fleet, coord)
    enrol(watcher, agent)
    agent.start()
    # (the coordinator's loop starts after the storm: until then the update waits for its ack)
    seen = []

    def heard(predicate) -> bool:
        msg = coord.channel.receive(timeout=0.05)
        if msg is not None:
            seen.append(msg)
        return any(predicate(m) for m in seen if not hasattr(m, "reason"))

    assert wait_for(lambda: heard(lambda m: m.kind is Kind.STATE), 30, interval=0), agent.log_tail()
    # a fetch that never completes keeps the daemon subscribed to a model's topics too
    fetch = coord.signer.control(agent.topic("cmd"), Kind.CMD, {"cmd_id": "f1", "action": "fetch_model",
                                                                  "model": "m", "version": "v1"}, ttl=60)
    assert coord.client.publish_wait(agent.topic("cmd"), fetch)
    assert wait_for(lambda: heard(lambda m: m.kind is Kind.PROGRESS and m.body.get("cmd_id") == "f1"), 30,
                    interval=0), agent.log_tail()

    attacker = MqttClient(host="127.0.0.1", port=mosquitto.port, client_id=f"attacker-{uuid.uuid4().hex[:6]}", **FAST)
    fleet.clients.append(attacker)
    attacker.start()
    assert attacker.wait_connected(10)
    valid = coord.signer.control(agent.topic("cmd"), Kind.CMD, {"cmd_id": "ok", "action": "ping"}, ttl=60)
    t = fleet.topics
    topics = [agent.topic(ch) for ch in ("hello", "state", "cmd", "ack", "progress", "update")]
    topics += [t.manifest("m", "v1"), t.model_chunk("m", "v1", 0), t.model_chunk("m", "v1", 7),
               t.root + "/devices/x/unknown", t.root + "/random/topic"]
    rng = random.Random(1)
    for topic in topics:
        for payload in junk_payloads(valid, rng):
            assert attacker.publish_wait(topic, payload)
    assert attacker.publish_wait(agent.topic("cmd"), valid)  # a genuine command inside the storm

    watcher.start()
    assert wait_for(lambda: any(m.body.get("cmd_id") == "ok" for m in watcher.by_phase("pong")), 60), agent.log_tail()
    assert wait_for(lambda: watcher.by_phase("done"), 60), agent.log_tail()
    assert len(watcher.log.completed) == 1 and watcher.log.completed[0].chunks == chunks  # nothing lost
    assert JobStore(agent.state_dir / "jobs").load("jz-r4").state is JobState.DONE
    assert agent.alive
    # refused commands are answered (rate-limited); junk on other topics never is
    refusals = [m for m in watcher.refusals() if m.sender == agent.id]
    assert 1 <= len(refusals) <= 12
    assert {m.body["reason"] for m in refusals} <= {"malformed", "oversized", "bad_schema", "unsupported_version",
                                                    "wrong_kind", "unknown_key", "bad_signature"}
    log = agent.log_tail(200_000)
    assert "dropped:" in log and "Traceback" not in log
    assert agent.terminate() == 0


def test_broker_outage_then_reconnect_delivers_the_queued_update(mosquitto, fleet, agents, tmp_path):
    agent = agents(tmp_path, mosquitto.port, sysfs_root=board_tree(tmp_path / "board"))
    chunks = queued_upload(agent)
    mosquitto.stop()
    agent.start()  # no broker: it keeps retrying with jittered backoff and keeps the update
    assert wait_for(lambda: "cannot connect" in agent.log_tail(), 20), agent.log_tail()
    mosquitto.start()  # same port
    watcher = Watcher(fleet, fleet.coordinator(mosquitto.port))
    enrol(watcher, agent)
    watcher.start()
    assert wait_for(lambda: watcher.by_phase("done"), 60), agent.log_tail()
    assert [u.chunks for u in watcher.log.completed] == [chunks]
    assert agent.alive
