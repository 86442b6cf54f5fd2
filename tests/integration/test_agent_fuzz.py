"""Junk on every topic at the running daemon: logged and dropped, the daemon stays up,
answers commands after the storm, and the update it had queued still gets delivered.

Judged message by message: after each junk message (or each topic's batch) the test pings
the daemon and waits for the pong, so whatever the daemon said about that junk has arrived
(one publisher's messages stay in order), on a fast machine or a slow one."""

from __future__ import annotations

import hashlib
import random
import time
import uuid
from collections.abc import Callable

import pytest

from edge_agent.agent.jobs import Job, JobState, JobStore, transition
from edge_agent.protocol import Kind, Message
from edge_agent.transport import MqttClient, Outbox, OutboxKey
from tests.integration.conftest import (
    FAST,
    AgentProcess,
    Side,
    Watcher,
    board_tree,
    enrol,
    wait_for,
)
from tests.integration.test_transport_fuzz import Junk, junk_payloads

pytestmark = pytest.mark.integration


def queued_upload(agent) -> list[bytes]:
    """What a daemon leaves behind when it was stopped while uploading: a job and its update,
    and the replay window its first start made (without it, a device with a job and a queued
    update has lost its replay/ directory: only commands issued after this start are taken)."""
    from edge_agent.config import load_config
    from edge_agent.keys import fingerprint
    from edge_agent.protocol import ReplayWindow

    coordinator = fingerprint(load_config(agent.config).coordinator_public_key)
    ReplayWindow(directory=agent.state_dir / "replay", strict_missing=True, known_senders=(coordinator,))
    job = Job(job_id="jz-r4", round=4, model="digits@1", params={"job": "jz", "cmd_id": "jz-r4",
                                                                  "deadline_at": time.time() + 3600})
    for step in (JobState.PREPARING, JobState.TRAINING, JobState.UPLOADING):
        transition(job, step)
    JobStore(agent.state_dir / "jobs").save(job)
    chunks = [random.Random(3).randbytes(20_000) for _ in range(3)]
    Outbox(directory=agent.state_dir / "outbox").put(OutboxKey("jz", agent.id, 4), chunks)
    return chunks


class Listener:
    """The coordinator's side before its loop starts: keeps every verified message, and
    `ping()` is a barrier (a pong comes back only after what was published before it)."""

    def __init__(self, coord: Side, agent: AgentProcess) -> None:
        self.coord, self.agent = coord, agent
        self.seen: list[Message] = []
        self.pings = 0

    def until(self, predicate: Callable[[Message], bool], timeout: float = 60) -> bool:
        def heard() -> bool:
            msg = self.coord.channel.receive(timeout=0.05)
            if isinstance(msg, Message):
                self.seen.append(msg)
            return any(predicate(m) for m in self.seen)

        return wait_for(heard, timeout, interval=0)

    def command(self, body: dict, publisher: MqttClient | None = None) -> None:
        topic = self.agent.topic("cmd")  # signed right before it is sent: no lifetime to outlive
        payload = self.coord.signer.control(topic, Kind.CMD, body, ttl=600)
        assert (publisher or self.coord.client).publish_wait(topic, payload, timeout=60)

    def ping(self, publisher: MqttClient | None = None) -> list[Message]:
        """Ping the agent, wait for the pong; the refusals it sent since the last ping."""
        self.pings += 1
        cmd_id, mark = f"barrier-{self.pings}", len(self.seen)
        self.command({"cmd_id": cmd_id, "action": "ping"}, publisher)
        assert self.until(lambda m: m.kind is Kind.PROGRESS and m.body.get("cmd_id") == cmd_id), \
            self.agent.log_tail()
        return [m for m in self.seen[mark:] if m.kind is Kind.REFUSAL]


def test_junk_on_every_topic_is_dropped_message_by_message_and_the_queued_update_survives(
        mosquitto, fleet, agents, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    agent = agents(tmp_path, mosquitto.port, sysfs_root=board_tree(tmp_path / "board"), data_dir=data)
    chunks = queued_upload(agent)

    coord = fleet.coordinator(mosquitto.port)
    watcher = Watcher(fleet, coord)
    enrol(watcher, agent)
    agent.start()
    # (the coordinator's loop starts after the storm: until then the update waits for its ack)
    listener = Listener(coord, agent)
    assert listener.until(lambda m: m.kind is Kind.STATE), agent.log_tail()
    # a fetch that never completes keeps the daemon subscribed to a model's topics too
    listener.command({"cmd_id": "f1", "action": "fetch_model", "model": "m", "version": "v1"})
    assert listener.until(lambda m: m.kind is Kind.PROGRESS and m.body.get("cmd_id") == "f1"), agent.log_tail()

    attacker = MqttClient(host="127.0.0.1", port=mosquitto.port, client_id=f"attacker-{uuid.uuid4().hex[:6]}", **FAST)
    fleet.clients.append(attacker)
    attacker.start()
    assert attacker.wait_connected(60)
    cmd_topic = agent.topic("cmd")
    valid = coord.signer.control(cmd_topic, Kind.CMD, {"cmd_id": "ok", "action": "ping"}, ttl=600)
    t = fleet.topics
    topics = [agent.topic(ch) for ch in ("hello", "state", "cmd", "ack", "progress", "update")]
    topics += [t.manifest("m", "v1"), t.model_chunk("m", "v1", 0), t.model_chunk("m", "v1", 7),
               t.root + "/devices/x/unknown", t.root + "/random/topic"]
    max_payload = 128 * 1024  # the daemon's broker.max_message_bytes: bigger ones never reach its verifier
    rng = random.Random(1)
    answered: list[tuple[Junk, Message | None]] = []
    for topic in topics:
        batch = junk_payloads(valid, rng)
        if topic != cmd_topic:
            for junk in batch:
                assert attacker.publish_wait(topic, junk.payload, timeout=60)
            assert listener.ping(attacker) == [], topic  # junk on other topics is never answered
            continue
        for junk in batch:  # each refused command: answered with its reason, or rate-limited
            assert attacker.publish_wait(topic, junk.payload, timeout=60)
            refusals = listener.ping(attacker)
            assert len(refusals) <= 1, (junk.what, [m.body for m in refusals])
            if len(junk.payload) > max_payload:
                assert refusals == [], junk.what
            else:
                answered.append((junk, refusals[0] if refusals else None))
    for junk, refusal in answered:
        if refusal is not None:
            assert refusal.sender == agent.id
            assert (refusal.body["reason"], refusal.body["ref_sha256"], refusal.body["ref_topic"]) == \
                (str(junk.reason(t, cmd_topic)), hashlib.sha256(junk.payload).hexdigest(), cmd_topic), junk.what
    # the reply bucket starts full (a burst of 5) and nothing else drew on it
    assert all(refusal is not None for _, refusal in answered[:5]), [(j.what, r) for j, r in answered]
    assert len(answered) == 12

    listener.command({"cmd_id": "genuine", "action": "ping"}, attacker)  # genuine, whoever relays it: it runs
    assert listener.until(lambda m: m.kind is Kind.PROGRESS and m.body.get("cmd_id") == "genuine"), agent.log_tail()
    assert not any(m.body.get("cmd_id") in ("ok", "no") for m in listener.seen if m.kind is Kind.PROGRESS)

    watcher.start()
    assert wait_for(lambda: watcher.by_phase("done"), 60), agent.log_tail()
    assert len(watcher.log.completed) == 1 and watcher.log.completed[0].chunks == chunks  # nothing lost
    assert JobStore(agent.state_dir / "jobs").load("jz-r4").state is JobState.DONE
    assert agent.alive
    log = agent.log_tail(200_000)
    assert "dropped:" in log and "Traceback" not in log
    assert agent.terminate() == 0


def test_broker_outage_then_reconnect_delivers_the_queued_update(mosquitto, fleet, agents, tmp_path):
    agent = agents(tmp_path, mosquitto.port, sysfs_root=board_tree(tmp_path / "board"))
    chunks = queued_upload(agent)
    mosquitto.stop()
    agent.start()  # no broker: it keeps retrying with jittered backoff and keeps the update
    assert wait_for(lambda: "cannot connect" in agent.log_tail(), 60), agent.log_tail()
    mosquitto.start()  # same port
    watcher = Watcher(fleet, fleet.coordinator(mosquitto.port))
    enrol(watcher, agent)
    watcher.start()
    assert wait_for(lambda: watcher.by_phase("done"), 60), agent.log_tail()
    assert [u.chunks for u in watcher.log.completed] == [chunks]
    assert agent.alive
