"""Restarts in the middle of a round: the coordinator killed with -9 (real agents), the
broker restarted while an update is half uploaded, a device killed with -9. Nothing
received is lost, nothing is counted twice, and a round does not wait for a dead device
until its deadline.

The moment of each restart is fixed by the test, not by the machine's speed: two agents
are held at their last checkpoint (the child's EDGE_AGENT_TEST_HOLD hook) until the
coordinator is down; the half-uploaded device sends exactly half its chunks first."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from edge_agent import keys
from edge_agent.agent.jobs import JobState, JobStore
from edge_agent.coordinator.records import JobStatus, RoundState, UpdateStatus
from edge_agent.protocol import Kind
from edge_agent.protocol.label_claims import decode_predicted
from edge_agent.transport import Outbox, OutboxKey
from tests.integration.agents import job_id_of
from tests.integration.conftest import (
    DeviceLoop,
    announce,
    board_tree,
    device_data,
    fake_update,
    online_devices,
    register_digits,
    wait_for,
)

pytestmark = pytest.mark.integration


def _three_agents_two_held(mosquitto, agents, serve, tmp_path, digits_bundle):
    """serve with the digits model, and three agents online; agents 1 and 2 stop at their first
    checkpoint until the returned hold file is removed."""
    _, archive = digits_bundle
    coordinator = serve(mosquitto.port).start()
    register_digits(coordinator, archive, tmp_path)
    hold = tmp_path / "hold-training"
    hold.write_text("1")
    agents_ = [agents(tmp_path, mosquitto.port, name=f"agent{i}", data_dir=device_data(tmp_path / f"data{i}", device=i),
                      sysfs_root=board_tree(tmp_path / f"board{i}", battery_pct=90),
                      env={"EDGE_AGENT_TEST_HOLD": str(hold)} if i else None).start() for i in range(3)]
    assert wait_for(lambda: len(online_devices(coordinator)) == 3, 180), coordinator.log_tail()
    return coordinator, agents_, hold


def _local_state(agent, local: str):
    try:
        return JobStore(agent.state_dir / "jobs").load(local).state
    except FileNotFoundError:
        return None


def _kill_serve_while_two_finish(coordinator, agents_, hold, job_id: str) -> float:
    """Once agent0's update is stored and the others are held in training: kill -9 serve, let
    them finish and send while it is down (the broker keeps their messages for its session),
    start it again. Returns when it was killed."""
    def stored() -> int:
        with coordinator.registry() as reg:
            return len(reg.list_updates(job_id))

    assert wait_for(lambda: stored() == 1, 600), coordinator.log_tail()
    assert wait_for(hold.with_name(hold.name + ".held").exists, 600), [a.log_tail(1500) for a in agents_]
    coordinator.kill9()
    killed_at = time.time()
    assert stored() == 1
    hold.unlink()
    assert wait_for(lambda: all(_local_state(a, f"{job_id}-r1") in (JobState.UPLOADING, JobState.DONE)
                                for a in agents_[1:]), 600), [a.log_tail(1500) for a in agents_]
    coordinator.start()
    return killed_at


@pytest.mark.slow  # three real agents train
def test_coordinator_killed_mid_round_resumes_and_counts_each_update_once(
        mosquitto, fleet, agents, serve, tmp_path, digits_bundle):
    coordinator, agents_, hold = _three_agents_two_held(mosquitto, agents, serve, tmp_path, digits_bundle)
    out = coordinator.cli("train", "--model", "digits", "--devices", "all", "--rounds", "1", "--min-devices", "3",
                          "--deadline", "60m", "--epochs", "1", "--batch-size", "16", "--distill", "3",
                          "--detach").stdout  # distilled updates: the label-claim check must not flag them
    job_id = job_id_of(out)
    killed_at = _kill_serve_while_two_finish(coordinator, agents_, hold, job_id)
    with coordinator.registry() as reg:
        assert wait_for(lambda: reg.get_job(job_id).status.terminal, 300), coordinator.log_tail()
        job = reg.get_job(job_id)
        assert job.status is JobStatus.DONE, (job, coordinator.log_tail())
        (rnd,) = reg.list_rounds(job_id)
        assert rnd.state is RoundState.AGGREGATED and rnd.dropouts == {}
        updates = reg.list_updates(job_id)
        assert sorted(u.device_id for u in updates) == sorted(a.id for a in agents_)  # one row per device
        assert all(u.status is UpdateStatus.ACCEPTED for u in updates)
        # every update counts: each device's label claims reached the close, and the one whose
        # samples the base already predicted well is judged by them (claims.py), not flagged
        assert reg.get_model("digits", rnd.aggregated_version).metrics["updates"] == 3
        assert all(decode_predicted(u.metrics.get("label_predicted"), 10) for u in updates), [u.metrics for u in updates]
        late = sorted(u.device_id for u in updates if u.received_at > killed_at)  # in flight, then delivered
        assert late == sorted(a.id for a in agents_[1:])
    # every agent got its ack: jobs done, outboxes empty
    assert wait_for(lambda: all(_local_state(a, f"{job_id}-r1") is JobState.DONE for a in agents_), 120)
    assert all(not any((a.state_dir / "outbox" / "items").iterdir()) for a in agents_)
    assert coordinator.alive and all(a.alive for a in agents_)


def test_broker_restarted_mid_upload_the_update_arrives_once_intact(mosquitto, fleet, serve, tmp_path, digits_bundle):
    _, archive = digits_bundle
    coordinator = serve(mosquitto.port).start()
    register_digits(coordinator, archive, tmp_path)
    side = fleet.device(mosquitto.port, name="dev")
    announce(fleet, side)
    outbox = Outbox(directory=tmp_path / "outbox")
    device = DeviceLoop(fleet, side, outbox, max_chunks=1, chunk_budget=0, ack_timeout=3.0).start()
    assert wait_for(lambda: online_devices(coordinator) == [side.id], 60), coordinator.log_tail()
    coordinator.cli("train", "--model", "digits", "--devices", "all", "--rounds", "1", "--deadline", "60m",
                    "--detach")
    assert wait_for(lambda: device.commands, 60), coordinator.log_tail()
    cmd = device.commands[0]
    with coordinator.registry() as reg:
        chunks = fake_update(reg, side, cmd, chunk_size=128)
    assert len(chunks) >= 15
    key = OutboxKey(cmd.body["job"], side.id, cmd.body["round"])
    outbox.put(key, chunks, meta={"samples": 40, "energy_wh": 0.01})
    half = len(chunks) // 2
    device.release(half)
    assert wait_for(lambda: outbox.get(key).next_index == half, 60)  # exactly half on the broker
    assert outbox.get(key).state != "awaiting_ack"

    mosquitto.restart(down_for=0.5)  # the chunks sent so far die with the broker's memory
    assert wait_for(lambda: side.client.stats["connects"] == 2, 60) and side.client.wait_connected(60)
    device.release()
    # both sides reconnect; the device, never acked, sends the rest and, if need be, all again
    assert wait_for(lambda: outbox.get(key) is None, 120), coordinator.log_tail()
    with coordinator.registry() as reg:
        assert wait_for(lambda: reg.get_job(cmd.body["job"]).status.terminal, 120)
    assert device.ack_results.count("acked") == 1
    # Whatever the device sent before this sentinel (a resend racing the ack) has been handled.
    coordinator_sentinel(fleet, side, device, key)
    with coordinator.registry() as reg:
        (update,) = reg.list_updates(cmd.body["job"])
        payload_sha = hashlib.sha256(b"".join(_payload(chunks))).hexdigest()
        assert update.sha256 == payload_sha and update.status is UpdateStatus.ACCEPTED and update.num_samples == 40
        assert reg.get_job(cmd.body["job"]).status is JobStatus.DONE
    assert coordinator.alive


def coordinator_sentinel(fleet, side, device, key: OutboxKey) -> None:
    """An update chunk with a broken signature from `side`, naming an upload of its own: the
    coordinator answers it with a `rejected, retry` ack, after everything `side` sent before."""
    topic = fleet.topics.device(side.id, "update")
    upload = hashlib.sha256(uuid.uuid4().bytes).hexdigest()  # an upload id nobody else uses
    header = {"job": key.job, "round": key.round, "upload": upload, "count": 1, "index": 0}
    payload = side.signer.binary(topic, Kind.UPDATE_CHUNK, header, b"sentinel", ttl=3600)
    assert side.client.publish_wait(topic, payload[:-1] + b"!", timeout=60)  # the data no longer matches the signature
    assert wait_for(lambda: any(a.body.get("upload") == upload for a in list(device.acks)), 60)


def _payload(chunks):
    from edge_agent.updates import Reassembler

    r = Reassembler()
    done = [x for x in (r.add(c) for c in chunks) if x is not None]
    return [done[0].payload]


DEVICE_SCRIPT = textwrap.dedent("""
    import sys, time
    from edge_agent import keys
    from edge_agent.config import public_key_text
    from edge_agent.protocol import Kind, SequenceCounter, Signer, Topics
    from edge_agent.transport import MqttClient, Will
    key_path, seq_path, prefix, port = sys.argv[1:5]
    key = keys.load_private_key(key_path)
    topics = Topics(fleet="farm", prefix=prefix)
    signer = Signer(key=key, topics=topics, sequence=SequenceCounter(path=seq_path))
    dev = keys.fingerprint(key)
    state, hello = topics.device(dev, "state"), topics.device(dev, "hello")
    def will():
        return Will(state, signer.control(state, Kind.STATE, {"status": "offline"}, ttl=86400))
    c = MqttClient(host="127.0.0.1", port=int(port), client_id="doomed", will=will, keepalive=5)
    c.start()
    assert c.wait_connected(60)
    info = {"name": "doomed", "board": "Test Board", "profile": "raspberry-pi-4"}
    for topic, kind, body in ((hello, Kind.HELLO, {"public_key": public_key_text(key), "agent": "test", "info": info}),
                              (state, Kind.STATE, {"status": "idle", "agent": "test", "detail":
                                                   "status=idle battery_pct=90 on_power=false energy_wh=5"})):
        assert c.publish_wait(topic, signer.control(topic, kind, body, ttl=86400), retain=True, timeout=60)
    print("READY", flush=True)
    time.sleep(600)
""")


def test_a_device_killed_mid_round_is_a_dropout_after_the_grace_not_at_the_deadline(
        mosquitto, fleet, serve, tmp_path, digits_bundle):
    """Power cut on a selected device: the broker publishes its will; once it has stayed away
    for --offline-grace the round stops waiting for it and closes with the update it has."""
    _, archive = digits_bundle
    coordinator = serve(mosquitto.port, extra=("--offline-grace", "2")).start()
    register_digits(coordinator, archive, tmp_path)
    doomed_key = keys.generate_private_key()
    keys.save_private_key(tmp_path / "doomed.key", doomed_key)
    doomed = subprocess.Popen([sys.executable, "-c", DEVICE_SCRIPT, str(tmp_path / "doomed.key"),
                               str(tmp_path / "doomed.seq"), fleet.topics.prefix, str(mosquitto.port)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert doomed.stdout.readline().strip() == "READY"
        side = fleet.device(mosquitto.port, name="dev")
        announce(fleet, side)
        outbox = Outbox(directory=tmp_path / "outbox")
        device = DeviceLoop(fleet, side, outbox).start()
        assert wait_for(lambda: len(online_devices(coordinator)) == 2, 60), coordinator.log_tail()
        coordinator.cli("train", "--model", "digits", "--devices", "all", "--rounds", "1", "--deadline", "60m",
                        "--detach")
        assert wait_for(lambda: device.commands, 60), coordinator.log_tail()
        cmd = device.commands[0]
        with coordinator.registry() as reg:
            assert len(reg.get_round(cmd.body["job"], 1).participants) == 2
        doomed.kill()  # no DISCONNECT: the broker publishes its will
        doomed.wait(10)
    finally:
        if doomed.poll() is None:
            doomed.kill()
    with coordinator.registry() as reg:
        chunks = fake_update(reg, side, cmd)
        outbox.put(OutboxKey(cmd.body["job"], side.id, cmd.body["round"]), chunks, meta={"samples": 40})
        assert wait_for(lambda: reg.get_job(cmd.body["job"]).status.terminal, 60), coordinator.log_tail()
        assert reg.get_job(cmd.body["job"]).status is JobStatus.DONE
        (rnd,) = reg.list_rounds(cmd.body["job"])
        dead = keys.fingerprint(doomed_key)
        assert rnd.state is RoundState.AGGREGATED and list(rnd.dropouts) == [dead]
        assert "did not come back within 2 s" in rnd.dropouts[dead]
    assert "stayed offline: a dropout" in coordinator.log_tail()


@pytest.mark.slow  # three real agents train, some twice
def test_coordinator_killed_mid_async_intake_loses_and_double_counts_nothing(
        mosquitto, fleet, agents, serve, tmp_path, digits_bundle):
    """An asynchronous job (buffer 2): agent0 delivers, agents 1 and 2 are held in training,
    the coordinator is killed; they deliver while it is down. After the restart every update
    is stored once -- in round 1, or carried into round 2 with its staleness -- and each
    published version counts exactly the updates its round accepted."""
    coordinator, agents_, hold = _three_agents_two_held(mosquitto, agents, serve, tmp_path, digits_bundle)
    out = coordinator.cli("train", "--model", "digits", "--devices", "all", "--rounds", "2", "--min-devices", "1",
                          "--async", "--buffer", "2", "--max-staleness", "3", "--deadline", "60m", "--epochs", "1",
                          "--batch-size", "16", "--detach").stdout
    job_id = job_id_of(out)
    _kill_serve_while_two_finish(coordinator, agents_, hold, job_id)
    with coordinator.registry() as reg:
        assert wait_for(lambda: reg.get_job(job_id).status.terminal, 600), coordinator.log_tail()
        job = reg.get_job(job_id)
        assert job.status is JobStatus.DONE, (job, coordinator.log_tail())
        rounds = reg.list_rounds(job_id)
        assert [r.state for r in rounds] == [RoundState.AGGREGATED] * 2
        updates = reg.list_updates(job_id)
        assert len({(u.device_id, u.round) for u in updates}) == len(updates)  # nothing stored twice
        # each agent's version-1 update: stored exactly once, in round 1 or carried into round 2
        first = [u for u in updates if u.round == 1 or u.metrics.get("staleness") == 1]
        assert sorted(u.device_id for u in first) == sorted(a.id for a in agents_), updates
        assert all(u.status is UpdateStatus.ACCEPTED for u in updates), updates
        for r in rounds:  # each version counts exactly what its round accepted
            accepted = [u for u in updates if u.round == r.number]
            assert reg.get_model("digits", r.aggregated_version).metrics["updates"] == len(accepted) >= 2
    assert wait_for(lambda: all(_local_state(a, f"{job_id}-r1") is JobState.DONE for a in agents_), 120)
    assert coordinator.alive and all(a.alive for a in agents_)
