"""The fleet end to end with the project's own daemon: real `edge-agent run` processes and a
real `edge-coordinator serve` on a real mosquitto. Two rounds where round 2 reaches the
agents as a head patch, a cancel of a running round, a protocol refusal that is not a
dropout, and a round over mutual TLS with the shipped broker config and make-certs."""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest

from edge_agent.agent.jobs import JobState
from edge_agent.coordinator.artefacts import ModelArtefacts
from edge_agent.coordinator.records import JobStatus, ParticipantStatus, RoundState, UpdateStatus
from edge_agent.int8.bundle import load_bundle, unpack_bundle
from edge_agent.transport import MqttClient
from tests.integration.agents import (
    LONG_TRAINING,
    SHORT_ROUND,
    job_id_of,
    jobs,
    log_lines,
    logs,
    phases,
    start_agents,
    wait_online,
)
from tests.integration.conftest import (
    FAST,
    REPO,
    board_tree,
    child_pids,
    device_data,
    register_digits,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # real agents train


def train(coordinator, *args: str):
    """`edge-coordinator train ...` followed to its end; the deadline only bounds a hang (a
    round closes as soon as every selected device has reported)."""
    return coordinator.cli("train", "--model", "digits", "--devices", "all", "--deadline", "600s", *args,
                           check=False, timeout=900)


def test_two_rounds_and_round_two_reaches_the_agents_as_a_head_patch(mosquitto, agents, serve, tmp_path,
                                                                     digits_bundle):
    coordinator = serve(mosquitto.port).start()
    agents_ = start_agents(agents, tmp_path, mosquitto.port, 2)
    register_digits(coordinator, digits_bundle[1], tmp_path)
    wait_online(coordinator, agents_)

    done = train(coordinator, "--rounds", "2", "--min-devices", "2", *SHORT_ROUND)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{logs(coordinator, agents_)}"
    with coordinator.registry() as reg:
        (job,) = reg.list_jobs()
        assert job.status is JobStatus.DONE
        first, second = reg.list_rounds(job.id)
        assert first.state is second.state is RoundState.AGGREGATED and first.dropouts == second.dropouts == {}
        assert (first.base_version, second.base_version) == ("1", first.aggregated_version)
        for rnd in (first, second):
            updates = reg.list_updates(job.id, rnd.number)
            assert sorted(u.device_id for u in updates) == sorted(a.id for a in agents_)
            assert all(u.status is UpdateStatus.ACCEPTED for u in updates)
        version = first.aggregated_version
        # what the coordinator's commands pinned as that version (the full archive: built on demand)
        archive = ModelArtefacts(reg).archive_for(reg.get_model("digits", version)).path
    published = unpack_bundle(archive, tmp_path / "published")
    for agent in agents_:
        text = agent.log_tail(10**7)
        assert "model digits/1: fetching the bundle" in text, text  # round 1: nothing to patch yet
        assert f"model digits/{version}: fetching the head patch onto 1" in text, text
        assert f"model digits/{version}: fetching the bundle" not in text and "head patch unusable" not in text
        installed = load_bundle(agent.state_dir / "models" / "digits" / version)
        assert installed.sha256 == published.sha256 and installed.manifest.parent_version == "1"
        assert sorted((j.round, j.state) for j in jobs(agent)) == [(1, JobState.DONE), (2, JobState.DONE)]
        assert not log_lines(agent, "ERROR"), log_lines(agent, "ERROR")
    assert all(a.alive for a in agents_) and coordinator.alive


def test_a_round_trains_with_mxnet_when_the_job_asks_for_it(mosquitto, agents, serve, tmp_path, digits_bundle):
    """Issue 35 #24: `--param trainer=mxnet` reaches the training child. The digits head is
    one dense layer, which the agent trains in numpy unless the job says otherwise; the
    device's result (carried to the coordinator's update record) names the trainer that ran."""
    coordinator = serve(mosquitto.port).start()
    agents_ = start_agents(agents, tmp_path, mosquitto.port, 1)
    register_digits(coordinator, digits_bundle[1], tmp_path)
    wait_online(coordinator, agents_)

    done = train(coordinator, "--rounds", "1", "--min-devices", "1", "--param", "trainer=mxnet", *SHORT_ROUND)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{logs(coordinator, agents_)}"
    with coordinator.registry() as reg:
        (job,) = reg.list_jobs()
        assert job.status is JobStatus.DONE and job.params["trainer"] == "mxnet"
        (update,) = reg.list_updates(job.id, 1)
        assert update.status is UpdateStatus.ACCEPTED
        assert update.metrics["trainer"] == "mxnet", update.metrics


def test_cancel_stops_the_agents_and_nothing_is_aggregated(mosquitto, agents, serve, tmp_path, digits_bundle):
    coordinator = serve(mosquitto.port).start()
    agents_ = start_agents(agents, tmp_path, mosquitto.port, 2)
    register_digits(coordinator, digits_bundle[1], tmp_path)
    wait_online(coordinator, agents_)
    job_id = job_id_of(coordinator.cli("train", "--model", "digits", "--devices", "all", "--min-devices", "2",
                                       "--deadline", "600s", *LONG_TRAINING, "--detach").stdout)

    def training() -> bool:  # each agent's training child runs and has said so
        return phases(coordinator, agents_) == ["training"] * 2 and all(child_pids(str(a.state_dir)) for a in agents_)

    assert wait_for(training, 240), logs(coordinator, agents_)
    coordinator.cli("cancel", job_id, "--reason", "wrong data")

    def cancelled(agent) -> bool:
        return [j.state for j in jobs(agent)] == [JobState.CANCELLED] and not child_pids(str(agent.state_dir))

    assert wait_for(lambda: all(cancelled(a) for a in agents_), 120), logs(coordinator, agents_)
    with coordinator.registry() as reg:
        job = reg.get_job(job_id)
        assert job.status is JobStatus.CANCELLED and job.reason == "wrong data"
        (rnd,) = reg.list_rounds(job_id)
        assert rnd.state is RoundState.CANCELLED and rnd.aggregated_version is None
        assert all(u.status is not UpdateStatus.ACCEPTED for u in reg.list_updates(job_id))
        assert [m.version for m in reg.list_models("digits")] == ["1"]
    for agent in agents_:
        (job,) = jobs(agent)
        assert job.reason == "cancelled by the coordinator"
        assert not (agent.state_dir / "checkpoints" / job.job_id).exists()
        assert any(f"job {job.job_id}: cancelled" in line for line in log_lines(agent, "INFO"))
        # a cancel is the operator's decision, not a fault: nothing about it at ERROR
        assert not log_lines(agent, "ERROR") and "Traceback" not in agent.log_tail(10**7), agent.log_tail()
        assert agent.alive
    assert " ERROR " not in coordinator.log_tail(10**7), coordinator.log_tail()
    assert "cancelled" in coordinator.cli("status", job_id).stdout


def test_a_cancelled_round_aggregates_nothing_not_even_an_update_already_received(mosquitto, agents, serve, tmp_path,
                                                                                  digits_bundle):
    """One agent trains and uploads; the other accepted the job but waits for its battery
    (45 %, its floor 50 %), so the round stays open with one update received. A cancel then
    turns that update away and stops the waiting job: no version comes of it."""
    coordinator = serve(mosquitto.port).start()
    (fast,) = start_agents(agents, tmp_path, mosquitto.port, 1)
    waiting = agents(tmp_path, mosquitto.port, name="agent1", sysfs_root=board_tree(tmp_path / "board1", battery_pct=45),
                     data_dir=device_data(tmp_path / "data1", device=1),
                     extra_toml="\n[budget]\nbattery_floor_pct = 50\nbattery_resume_pct = 60\n").start()
    register_digits(coordinator, digits_bundle[1], tmp_path)
    wait_online(coordinator, [fast, waiting])
    job_id = job_id_of(coordinator.cli("train", "--model", "digits", "--devices", "all", "--min-devices", "1",
                                       "--deadline", "600s", *SHORT_ROUND[:-2], "--detach").stdout)

    def received() -> list[UpdateStatus]:
        with coordinator.registry() as reg:
            return [u.status for u in reg.list_updates(job_id)]

    assert wait_for(lambda: received() == [UpdateStatus.PENDING], 300), logs(coordinator, [fast, waiting])
    assert wait_for(lambda: [j.state for j in jobs(waiting)] == [JobState.WAITING_FOR_POWER], 300), \
        logs(None, [waiting])
    coordinator.cli("cancel", job_id)

    assert wait_for(lambda: [j.state for j in jobs(waiting)] == [JobState.CANCELLED], 120), logs(None, [waiting])
    with coordinator.registry() as reg:
        (rnd,) = reg.list_rounds(job_id)
        assert rnd.state is RoundState.CANCELLED and rnd.aggregated_version is None
        (update,) = reg.list_updates(job_id)
        assert (update.device_id, update.status, update.reason) == (fast.id, UpdateStatus.REJECTED, "job_cancelled")
        assert [m.version for m in reg.list_models("digits")] == ["1"]
    assert not log_lines(waiting, "ERROR") and not log_lines(fast, "ERROR"), logs(None, [fast, waiting])
    assert fast.alive and waiting.alive and coordinator.alive


def test_a_protocol_refusal_is_not_a_dropout(mosquitto, fleet, agents, serve, tmp_path, digits_bundle):
    """A replayed or tampered copy of the round's command is refused by the agent (it says
    so, naming the command), but the agent still trains: the coordinator must not count
    that refusal as the device dropping out, or its update would be turned away."""
    coordinator = serve(mosquitto.port).start()
    (agent,) = start_agents(agents, tmp_path, mosquitto.port, 1)
    register_digits(coordinator, digits_bundle[1], tmp_path)
    wait_online(coordinator, [agent])
    spy = MqttClient(host="127.0.0.1", port=mosquitto.port, client_id=f"spy-{uuid.uuid4().hex[:6]}",
                     subscriptions=[agent.topic("cmd")], **FAST)
    fleet.clients.append(spy)
    spy.start()
    assert spy.wait_connected(60)

    job_id = job_id_of(coordinator.cli("train", "--model", "digits", "--devices", "all", "--deadline", "600s",
                                       *SHORT_ROUND[:-2], "--detach").stdout)
    got = spy.get(120)
    while got is not None and b'"action":"ping"' in got.payload:  # the answer to its hello may come late
        got = spy.get(120)
    assert got is not None and b'"action":"finetune"' in got.payload, logs(coordinator, [agent])
    cmd_id = f"{job_id}-r1"
    assert f'"cmd_id":"{cmd_id}"'.encode() in got.payload
    tampered = got.payload.replace(b'"batch_size":16', b'"batch_size":17')
    assert tampered != got.payload
    # The agent has to fetch and activate the model (a child process) before it can train:
    # both copies are answered long before its update can exist.
    for payload in (got.payload, tampered):  # a replay, and a copy whose signature fails
        assert spy.publish_wait(got.topic, payload, timeout=60)

    with coordinator.registry() as reg:
        assert wait_for(lambda: reg.get_job(job_id).status.terminal, 300), logs(coordinator, [agent])
        job, (rnd,) = reg.get_job(job_id), reg.list_rounds(job_id)
        assert job.status is JobStatus.DONE and rnd.state is RoundState.AGGREGATED, (job, rnd)
        assert rnd.dropouts == {} and rnd.participants[agent.id].status is not ParticipantStatus.DROPPED
        (update,) = reg.list_updates(job_id)
        assert update.device_id == agent.id and update.status is UpdateStatus.ACCEPTED
    closed = f"job {job_id} round 1 aggregated"  # logged just after the registry says so
    assert wait_for(lambda: closed in coordinator.log_tail(10**7), 60), coordinator.log_tail()
    text = coordinator.log_tail(10**7)
    refusals = [f"device {agent.id} refused {cmd_id}: {why}" for why in ("replayed", "bad_signature")]
    assert all(r in text for r in refusals), text  # the coordinator heard both refusals...
    aggregated = text.index(closed)
    assert all(text.index(r) < aggregated for r in refusals)  # ... while the round was still open
    (job_rec,) = jobs(agent)
    assert job_rec.state is JobState.DONE  # the agent ran the command once, and only once


@pytest.mark.parametrize("topic_prefix", ["edgeft/v1"])  # the prefix the shipped ACL grants
def test_a_round_over_mutual_tls_with_the_shipped_broker_config(topic_prefix, fleet, agents, serve, tmp_path,
                                                                digits_bundle):
    """Certificates from packaging/mosquitto/make-certs, mosquitto running the shipped fleet
    config and ACL (paths moved into the test), the agent and the coordinator connecting
    with their own client certificates: a whole round gets through."""
    from tests.integration.test_mosquitto_fleet_acl import FleetBroker, make_certs

    certs = tmp_path / "fleet-certs"
    agent = agents(tmp_path, 0, name="agent0", sysfs_root=board_tree(tmp_path / "board0", battery_pct=90),
                   data_dir=device_data(tmp_path / "data0", device=0))
    for args in (["init"], ["server", "127.0.0.1"], ["coordinator"], ["device", agent.id],
                 ["acl", "--fleet", fleet.topics.fleet, "--prefix", fleet.topics.prefix]):  # the ACL pinned to the fleet
        made = make_certs(*args, "--dir", certs)
        assert made.returncode == 0, made.stderr
    broker = FleetBroker(workdir=tmp_path / "mosquitto", cert_dir=certs)
    broker.start()
    try:
        # the agent's config: the broker's TLS port and this device's certificate (its CN is the device id)
        text = agent.config.read_text().replace("port = 0", f"port = {broker.port}", 1)
        text = text.replace("tls = false", f'tls = true\nca_file = "{certs}/ca.pem"\n'
                                           f'cert_file = "{certs}/{agent.id}.pem"\nkey_file = "{certs}/{agent.id}.key"')
        agent.config.write_text(text)
        check = subprocess.run([sys.executable, "-m", "edge_agent.agent.cli", "run", "--config", str(agent.config),
                                "--check"], capture_output=True, text=True, timeout=120, cwd=REPO, check=False)
        assert check.returncode == 0, check.stderr
        coordinator = serve(broker.port, extra=("--tls", "--ca-file", str(certs / "ca.pem"), "--cert-file",
                                                str(certs / "coordinator.pem"), "--key-file",
                                                str(certs / "coordinator.key"))).start()
        agent.start()
        register_digits(coordinator, digits_bundle[1], tmp_path)
        wait_online(coordinator, [agent])
        done = train(coordinator, "--rounds", "1", *SHORT_ROUND)
        assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{logs(coordinator, [agent])}"
        with coordinator.registry() as reg:
            (job,) = reg.list_jobs()
            (rnd,) = reg.list_rounds(job.id)
            assert job.status is JobStatus.DONE and rnd.state is RoundState.AGGREGATED
            (update,) = reg.list_updates(job.id)
            assert update.device_id == agent.id and update.status is UpdateStatus.ACCEPTED
        # each connected as the identity its certificate names, which is what the ACL confines
        seen = broker.log_tail(10**6)
        assert f"u'{agent.id}'" in seen and "u'coordinator'" in seen, seen
        assert agent.alive and coordinator.alive
        agent.stop()
        coordinator.stop()
    finally:
        broker.stop()
