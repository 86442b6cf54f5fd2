"""Issue 17 findings, reproduced against a real mosquitto and a real agent process, now handled:
a junk flood does not push out a signed command (and is logged as a few summary lines), a
full disk while recording a command yields a signed `local_fault` refusal (no traceback), a
missing replay-window file is "reject until re-synchronised" (never "empty"), a lost
coordinator `keys/seq` is recovered by the clock, and restarts keep sequence numbers near
the clock. (Broker identity and cross-fleet publishing: test_mosquitto_fleet_acl.py.)

Full disk is simulated by the daemon's test hook (EDGE_AGENT_TEST_HOOKS=1): while
<state_dir>/debug/enospc exists, ReplayWindow's writes raise OSError(ENOSPC), at the write
of the replay window, where the attack run hit it. A tmpfs needs privileges; RLIMIT_FSIZE
raises EFBIG, not ENOSPC.
"""

from __future__ import annotations

import re
import time
import uuid
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from edge_agent.atomic import read_checked
from edge_agent.protocol import Kind, SequenceCounter
from tests.integration.conftest import Watcher, board_tree, enrol, wait_for

pytestmark = pytest.mark.integration


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_restarts_keep_sequence_numbers_near_the_clock(tmp_path: Path) -> None:
    """22 restarts (the attack run's device) each signing a few messages: the counter stays
    within a lease of the clock, where the old hour-long lease left it ~20 h ahead."""
    clock, path = Clock(1_800_000_000.0), tmp_path / "seq"
    issued: list[int] = []
    for _ in range(22):
        counter = SequenceCounter(path=path, clock=clock)  # a restart: a new process reads the file
        issued += [counter.next() for _ in range(50)]
        clock.t += 3.0  # a restart takes a few seconds
    assert issued == sorted(issued) and len(set(issued)) == len(issued)
    assert issued[-1] - int(clock.t) * 10**6 <= 10**6  # at most one lease (1 s) ahead
    # Even 22 back-to-back restarts within one second move it only 22 leases ahead.
    for _ in range(22):
        issued.append(SequenceCounter(path=path, clock=clock).next())
    assert issued == sorted(issued) and issued[-1] - int(clock.t) * 10**6 <= 23 * 10**6
    # A lost counter file: numbering resumes from the clock, above everything issued a lease ago.
    path.unlink()
    clock.t += 30
    assert SequenceCounter(path=path, clock=clock).next() > issued[-1]
    # An operator's floor (recovery from counters that ran ahead): used once, then removed.
    (tmp_path / "seq.floor").write_text(str(issued[-1] + 10**12) + "\n")
    assert SequenceCounter(path=path, clock=clock).next() > issued[-1] + 10**12
    assert not (tmp_path / "seq.floor").exists()
    assert int(read_checked(path, 64).decode()) > issued[-1] + 10**12


@pytest.fixture
def agent_and_watcher(mosquitto, fleet, agents, tmp_path):  # noqa: ANN001
    data = tmp_path / "data"
    data.mkdir()
    agent = agents(tmp_path, mosquitto.port, sysfs_root=board_tree(tmp_path / "board"), data_dir=data)
    watcher = Watcher(fleet, fleet.coordinator(mosquitto.port))
    enrol(watcher, agent)
    watcher.start()
    agent.start()
    assert wait_for(lambda: watcher.states(), 60), agent.log_tail()
    return agent, watcher


def answered(watcher: Watcher, cmd_id: str) -> bool:
    return any(m.body.get("cmd_id") == cmd_id for m in watcher.by_phase("pong"))


def refusal(watcher: Watcher, cmd_id: str) -> dict | None:
    return next((m.body for m in watcher.refusals() if m.body.get("ref_cmd_id") == cmd_id), None)


def test_a_junk_flood_does_not_push_out_a_signed_command(agent_and_watcher, mosquitto, tmp_path) -> None:  # noqa: ANN001
    agent, watcher = agent_and_watcher
    (agent.state_dir / "debug").mkdir(exist_ok=True)
    hang = agent.state_dir / "debug" / "hang"
    hang.touch()  # the main loop stops reading: the inbox fills, as under a flood faster than it
    flooder = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"flood-{uuid.uuid4().hex[:6]}")
    flooder.connect("127.0.0.1", mosquitto.port)
    flooder.loop_start()
    try:
        topic = agent.topic("cmd")
        for i in range(5000):
            flooder.publish(topic, b"junk %d " % i + b"x" * 64, qos=0)
        watcher.command(agent, {"cmd_id": "flood-ping", "action": "ping"})
        for i in range(2000):  # more than the 1000-message inbox after it: a FIFO would lose it
            flooder.publish(topic, b"late junk %d" % i, qos=0)
        info = flooder.publish(topic, b"last junk", qos=1)
        info.wait_for_publish(60)
        assert info.is_published()
        assert wait_for(lambda: "oldest unverified message dropped" in agent.log_tail(200_000), 60), agent.log_tail()
    finally:
        flooder.disconnect()
        flooder.loop_stop()
        hang.unlink()
    assert wait_for(lambda: answered(watcher, "flood-ping"), 60), agent.log_tail()
    watcher.command(agent, {"cmd_id": "after-flood", "action": "ping"})
    assert wait_for(lambda: answered(watcher, "after-flood"), 60), agent.log_tail()
    text = agent.log_path.read_text(errors="replace")
    drop_lines = [ln for ln in text.splitlines() if "dropped" in ln]
    assert 1 <= len(drop_lines) <= 30, drop_lines[:40]  # 7000 junk messages: summaries, not 7000 lines
    assert "Traceback" not in text


def test_a_full_disk_while_recording_a_command_is_a_signed_refusal(agent_and_watcher) -> None:  # noqa: ANN001
    agent, watcher = agent_and_watcher
    (agent.state_dir / "debug").mkdir(exist_ok=True)
    enospc = agent.state_dir / "debug" / "enospc"
    enospc.touch()
    watcher.command(agent, {"cmd_id": "full-disk", "action": "ping"})
    assert wait_for(lambda: refusal(watcher, "full-disk"), 60), agent.log_tail()
    body = refusal(watcher, "full-disk")
    assert body["reason"] == "local_fault" and "No space left on device" in body["detail"], body
    assert not answered(watcher, "full-disk")
    enospc.unlink()  # space again: the coordinator's resend (a new command) is taken
    watcher.command(agent, {"cmd_id": "disk-ok", "action": "ping"})
    assert wait_for(lambda: answered(watcher, "disk-ok"), 60), agent.log_tail()
    assert "Traceback" not in agent.log_path.read_text(errors="replace")


def test_lost_replay_window_and_lost_coordinator_counter(agent_and_watcher, tmp_path) -> None:  # noqa: ANN001
    agent, watcher = agent_and_watcher
    coord = watcher.side
    topic = agent.topic("cmd")
    old = coord.signer.control(topic, Kind.CMD, {"cmd_id": "old-ping", "action": "ping"}, ttl=600)
    assert coord.client.publish_wait(topic, old, timeout=60)
    assert wait_for(lambda: answered(watcher, "old-ping"), 60), agent.log_tail()

    # The agent's replay-window file is lost while it is down: the captured command replayed
    # after the restart is refused (never treated as an empty window), a new one is taken.
    assert agent.terminate() == 0
    window = agent.state_dir / "replay" / f"{coord.signer.key_id}.replay"
    assert window.exists()
    window.unlink()
    states = len(watcher.states())
    agent.start()
    assert wait_for(lambda: len(watcher.states()) > states, 60), agent.log_tail()
    assert coord.client.publish_wait(topic, old, timeout=60)
    assert wait_for(lambda: refusal(watcher, "old-ping"), 60), agent.log_tail()
    body = refusal(watcher, "old-ping")
    assert body["reason"] == "replayed" and "window was reset" in body["detail"], body
    assert len([m for m in watcher.by_phase("pong") if m.body.get("cmd_id") == "old-ping"]) == 1
    # commands issued after the restart's second go through (iat has 1 s resolution: one
    # captured earlier in that second must not pass as new, so the window starts after it)
    reset_at = int(re.search(r"reset at (\d+)", body["detail"]).group(1))
    assert wait_for(lambda: time.time() >= reset_at, 10)
    watcher.command(agent, {"cmd_id": "resync", "action": "ping"})
    assert wait_for(lambda: answered(watcher, "resync"), 60), agent.log_tail()
    seq = int(read_checked(agent.state_dir / "keys" / "seq", 64).decode())
    assert seq - time.time() * 10**6 < 5 * 10**6  # the agent's restart did not leap ahead

    # The coordinator's keys/seq is lost: numbering restarts from the clock, which is above
    # every number issued a lease (1 s) ago; once the clock has passed them, commands go through.
    last = coord.signer.sequence.next()
    coord.signer.sequence = SequenceCounter(path=tmp_path / "restored-seq")
    assert wait_for(lambda: int(time.time()) * 10**6 > last + 10**6, 10)
    watcher.command(agent, {"cmd_id": "after-loss", "action": "ping"})
    assert wait_for(lambda: answered(watcher, "after-loss"), 60), agent.log_tail()
    assert refusal(watcher, "after-loss") is None


def test_a_revoked_device_backs_off_and_stops_resending(mosquitto, fleet, tmp_path) -> None:  # noqa: ANN001
    from edge_agent.transport import Outbox, OutboxKey
    from edge_agent.transport.uplink import MAX_UNTRUSTED_ATTEMPTS
    from tests.integration.conftest import CoordinatorLoop, DeviceLoop, update_sentinel

    coord = fleet.coordinator(mosquitto.port)
    dev = fleet.device(mosquitto.port, enrol=coord)
    coord.trust.remove(dev.id)  # revoked after the job was sent
    server = CoordinatorLoop(fleet, coord).start()
    outbox = Outbox(directory=tmp_path / "outbox")
    key = OutboxKey("job-rev", dev.id, 1)
    outbox.put(key, [b"a" * 1000, b"b" * 1000], meta={"model": "digits", "samples": 10})
    device = DeviceLoop(fleet, dev, outbox).start()
    assert wait_for(lambda: "dropped" in device.ack_results, 120), (device.ack_results, outbox.get(key))
    assert outbox.get(key) is None
    refused = [r for r in server.log.rejections if str(r.reason) == "unknown_key"]
    assert refused and MAX_UNTRUSTED_ATTEMPTS > 1  # refused (answers are rate-limited; silence is an attempt too)
    update_sentinel(fleet, dev, server)  # all it sent so far has been judged ...
    seen = server.chunks_seen + len(server.log.rejections)
    for _ in range(3):  # ... and nothing more comes: it stopped (several pump cycles later)
        update_sentinel(fleet, dev, server)
    assert server.chunks_seen + len(server.log.rejections) == seen + 3  # only the 3 sentinels


def test_fetching_a_bundle_signed_by_another_key_times_out(mosquitto, fleet, agents, tmp_path) -> None:  # noqa: ANN001
    from edge_agent import keys
    from edge_agent.protocol import Signer
    from edge_agent.transport.models import publish_model

    data = tmp_path / "data"
    data.mkdir()
    agent = agents(tmp_path, mosquitto.port, sysfs_root=board_tree(tmp_path / "board"), data_dir=data,
                   extra_toml="model_fetch_timeout_s = 2\n")
    watcher = Watcher(fleet, fleet.coordinator(mosquitto.port))
    enrol(watcher, agent)
    watcher.start()
    agent.start()
    assert wait_for(lambda: watcher.states(), 60), agent.log_tail()
    rogue = Signer(key=keys.generate_private_key(), topics=fleet.topics,
                   sequence=SequenceCounter(path=tmp_path / "rogue-seq"))
    publish_model(watcher.side.client, rogue, fleet.topics, name="digits", version="9", bundle=b"x" * 5000,
                  chunk_bytes=1000)  # retained, on the right topics, signed by a key the agent does not trust
    watcher.command(agent, {"cmd_id": "fetch-rogue", "action": "fetch_model", "model": "digits", "version": "9"})
    assert wait_for(lambda: watcher.by_phase("model-failed"), 60), agent.log_tail()
    detail = watcher.by_phase("model-failed")[0].body["detail"]
    assert "digits/9" in detail and "timed out" in detail, detail
    assert "unknown_key" in agent.log_tail(200_000)  # the rogue chunks were refused, not installed
    assert not (agent.state_dir / "models" / "digits" / "9").exists()


def test_devices_refusing_every_command_as_replayed_show_in_status_with_the_fix(
        mosquitto, fleet, serve, agents, tmp_path, digits_bundle) -> None:  # noqa: ANN001
    import json

    from edge_agent.atomic import write_checked
    from tests.integration.agents import SHORT_ROUND
    from tests.integration.conftest import device_data, online_devices, register_digits

    coordinator = serve(mosquitto.port).start()
    register_digits(coordinator, digits_bundle[1], tmp_path)
    agent = agents(tmp_path, mosquitto.port, sysfs_root=board_tree(tmp_path / "board", battery_pct=90),
                   data_dir=device_data(tmp_path / "data"))
    # The device's window for the coordinator is 20 h ahead of the coordinator's counter (what
    # 22 restarts with the old hour-long lease did): it refuses every command as replayed.
    ahead = (int(time.time()) + 20 * 3600) * 10**6
    write_checked(agent.state_dir / "replay" / f"{fleet.coord_id}.replay",
                  json.dumps({"high": ahead, "mask": "1", "floor": 0}).encode(), mode=0o600)
    agent.start()
    assert wait_for(lambda: online_devices(coordinator) == [agent.id], 90), coordinator.log_tail()
    coordinator.cli("train", "--model", "digits", "--devices", "all", "--rounds", "1", "--deadline", "600s",
                    *SHORT_ROUND, "--detach")
    assert wait_for(lambda: "PROBLEM: replayed" in coordinator.cli("status").stdout, 90), \
        coordinator.log_tail() + agent.log_tail()
    status = coordinator.cli("status").stdout
    assert "1 device(s) refuse this coordinator's commands as replayed" in status, status
    assert f"echo {ahead + 1} > {coordinator.state_dir.resolve() / 'keys' / 'seq.floor'}" in status, status
    assert "replayed" in coordinator.log_tail(10**6) and "Lost sequence counter" in coordinator.log_tail(10**6)

    # A stolen key (the approved device's) sending an update that is not one: the coordinator
    # says so at WARNING, naming the device and the reason.
    from edge_agent.transport import Outbox, OutboxKey
    from tests.integration.conftest import DeviceLoop

    stolen = fleet.device(mosquitto.port, name="stolen", key=agent.key)
    outbox = Outbox(directory=tmp_path / "stolen-outbox")
    outbox.put(OutboxKey("job-x", agent.id, 1), [b"not an update" * 50], meta={"samples": 10})
    DeviceLoop(fleet, stolen, outbox).start()
    assert wait_for(lambda: f"rejected update job-x round 1 from device {agent.id}: malformed"
                    in coordinator.log_tail(10**6), 90), coordinator.log_tail()
    assert "WARNING" in next(ln for ln in coordinator.log_tail(10**6).splitlines() if "rejected update job-x" in ln)


def test_a_missing_window_is_lost_only_after_the_first_start(tmp_path: Path) -> None:
    """Files, no broker: the first start makes the coordinator's window (so commands queued
    for a device that never had one are taken); after that a missing window means lost."""
    from edge_agent import keys
    from edge_agent.protocol import ReplayWindow

    coord = keys.fingerprint(keys.generate_private_key())
    clock = Clock(1_800_000_000.0)
    ReplayWindow(directory=tmp_path, strict_missing=True, known_senders=(coord,), clock=clock)  # first start
    assert (tmp_path / f"{coord}.replay").exists() and (tmp_path / ".initialised").exists()
    clock.t += 100
    restarted = ReplayWindow(directory=tmp_path, strict_missing=True, known_senders=(coord,), clock=clock)
    assert restarted.check_and_record(coord, 5 * 10**15, int(clock.t) - 50) is None  # queued while it was down
    (tmp_path / f"{coord}.replay").unlink()  # lost
    clock.t += 100
    again = ReplayWindow(directory=tmp_path, strict_missing=True, known_senders=(coord,), clock=clock)
    assert "window was reset" in again.check_and_record(coord, 6 * 10**15, int(clock.t) - 50)
    assert again.check_and_record(coord, 6 * 10**15 + 1, int(clock.t) + 1) is None  # issued after the restart second: taken


def test_one_flooding_device_is_cut_to_its_budget_and_others_still_get_through(mosquitto, fleet, caplog) -> None:  # noqa: ANN001
    """The coordinator's per-device ingress bucket, in its MQTT network thread (here 5 at once
    and a negligible refill, so the count does not depend on the machine's speed)."""
    import logging

    from edge_agent.protocol import TrustStore, Verifier
    from edge_agent.transport import Admission

    admission = Admission(Verifier(topics=fleet.topics, trust=TrustStore(), replay=None),
                          priority_channels=("progress", "state"), per_device=(0.001, 5))
    coord = fleet.coordinator(mosquitto.port, admit=admission)
    flooder, honest = fleet.device(mosquitto.port, name="flooder"), fleet.device(mosquitto.port, name="honest")
    with caplog.at_level(logging.WARNING, logger="edge_agent.transport.mqtt"):
        for i in range(300):
            assert flooder.client.publish(fleet.topics.device(flooder.id, "update"), b"chunk %d" % i) is not None
        assert flooder.client.publish_wait(fleet.topics.device(flooder.id, "update"), b"last", timeout=60)
        assert honest.client.publish_wait(fleet.topics.device(honest.id, "update"), b"honest", timeout=60)
        got = []
        while not any(r.payload == b"honest" for r in got):
            r = coord.client.get(60)
            assert r is not None, f"the honest device's message never came ({len(got)} others)"
            got.append(r)
        assert wait_for(lambda: coord.client.stats["dropped_admit"] == 301 - 5, 60), coord.client.stats
    assert len([r for r in got if flooder.id in r.topic]) == 5
    assert admission.dropped[flooder.id] == 296 and admission.dropped[honest.id] == 0
    lines = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert lines and f"over the ingress budget of device {flooder.id}" in lines[0] and len(lines) <= 3
