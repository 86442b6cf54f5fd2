"""Issue 35, item 3, end to end: a real mosquitto, a real `edge-coordinator serve` and a real
`edge-agent run`. `key rotate` moves the fleet to a new coordinator key (serve publishes it
signed by the old one; the agent follows, and still does after a restart); a deleted key is
refused at start (exit 78) instead of silently made anew; and a key the devices do not know
shows in `status` as a fleet-wide unknown_key problem once serve sends them a job."""

from __future__ import annotations

import pytest

from edge_agent import keys
from edge_agent.protocol import Kind
from tests.integration.agents import SHORT_ROUND, logs, wait_online
from tests.integration.conftest import (
    Watcher,
    board_tree,
    device_data,
    register_digits,
    wait_for,
)

pytestmark = pytest.mark.integration


def pongs(watcher: Watcher, cmd_id: str) -> bool:
    return any(m.body.get("cmd_id") == cmd_id for m in watcher.by_phase("pong"))


def refused(watcher: Watcher, cmd_id: str) -> str | None:
    return next((m.body["reason"] for m in watcher.refusals() if m.body.get("ref_cmd_id") == cmd_id), None)


def ping_until_pong(watcher: Watcher, agent, prefix: str, attempts: int = 6) -> None:  # noqa: ANN001
    """Ping `agent` until one is answered: serve signs with the same key from its own sequence
    counter, so a ping of the watcher's numbered below serve's last is refused as a replay."""
    for attempt in range(attempts):
        watcher.command(agent, {"cmd_id": f"{prefix}-{attempt}", "action": "ping"})
        if wait_for(lambda a=attempt: pongs(watcher, f"{prefix}-{a}"), 15):
            return
    raise AssertionError(agent.log_tail())


def test_key_rotation_and_a_lost_key_through_serve_and_a_real_agent(mosquitto, fleet, serve, agents, tmp_path,
                                                                    digits_bundle) -> None:  # noqa: ANN001
    coordinator = serve(mosquitto.port).start()
    agent = agents(tmp_path, mosquitto.port, sysfs_root=board_tree(tmp_path / "board", battery_pct=90),
                   data_dir=device_data(tmp_path / "data"))
    agent.start()
    wait_online(coordinator, [agent])
    old_id = fleet.coord_id

    # ---- rotate (serve stopped: it holds the key), start again: the agent follows by itself
    assert coordinator.stop() == 0
    done = coordinator.cli("key", "rotate")
    new_key = keys.load_private_key(coordinator.state_dir / "keys" / "coordinator.key")
    new_id = keys.fingerprint(new_key)
    assert f"rotated: coordinator key {old_id} -> {new_id}" in done.stdout
    coordinator.start()
    assert wait_for(lambda: f"now trusting {new_id}" in agent.log_tail(100_000), 90), logs(coordinator, [agent])
    assert "published the rotation of 1 retired coordinator key(s)" in coordinator.log_tail(100_000)

    # a command signed by the new key is taken, one signed by the old key no longer
    side = fleet._side("coord-new", new_key, "coordinator", mosquitto.port, fleet.topics.coordinator_subscriptions(),
                       None)
    side.client.start()
    assert side.client.wait_connected(60)
    side.trust.add(agent.key.public_key(), role="device")
    watcher = Watcher(fleet, side).start()
    # serve signs with the new key too, from its own sequence counter: a ping of ours numbered
    # below serve's last is a replay to the agent (CI under load: the first one was), so ask again
    ping_until_pong(watcher, agent, "new-key-ping")
    old = fleet.coordinator(mosquitto.port)
    topic = agent.topic("cmd")
    assert old.client.publish_wait(topic, old.signer.control(topic, Kind.CMD, {"cmd_id": "old-key-ping",
                                                                            "action": "ping"}, ttl=600), timeout=60)
    assert wait_for(lambda: refused(watcher, "old-key-ping") == "unknown_key", 60), agent.log_tail()
    assert not pongs(watcher, "old-key-ping")

    # the agent restarts: it still trusts the new key (the rotation was persisted)
    heard = agent.log_tail(100_000).count("the coordinator heard this device's hello")
    assert agent.terminate() == 0
    agent.start()  # a command sent before it subscribes again would be lost: wait for its hello's answer
    assert wait_for(lambda: agent.log_tail(100_000).count("the coordinator heard this device's hello") > heard, 90), \
        agent.log_tail()
    # serve signs with this key too (its hello answers): ask again until a ping is numbered above its last
    ping_until_pong(watcher, agent, "after-restart")
    assert "now trusting" not in agent.log_tail(100_000).rsplit("enrolment code", 1)[-1]  # trusted from disk

    # ---- the key is deleted: serve refuses to start (78) and names the ways back
    assert coordinator.stop() == 0
    (coordinator.state_dir / "keys" / "coordinator.key").unlink()
    coordinator.start(wait=False)
    assert coordinator.proc.wait(120) == 78, coordinator.log_tail()
    assert "Restore the file from a backup" in coordinator.log_tail() and "key rotate" in coordinator.log_tail()
    assert not (coordinator.state_dir / "keys" / "coordinator.key").exists()

    # made anew on purpose, not signed by the lost key: the device cannot follow, and once serve
    # sends it a job `status` says so, fleet-wide, with the fix
    coordinator.cli("key", "rotate", "--without-old-key")
    coordinator.start()
    register_digits(coordinator, digits_bundle[1], tmp_path)
    wait_online(coordinator, [agent])
    coordinator.cli("train", "--model", "digits", "--devices", "all", "--rounds", "1", "--deadline", "600s",
                    *SHORT_ROUND[:-2], "--detach")
    assert wait_for(lambda: "PROBLEM: unknown_key" in coordinator.cli("status").stdout, 120), \
        logs(coordinator, [agent])
    status = coordinator.cli("status").stdout
    assert "1 device(s) refuse this coordinator's commands as signed by a key they do not know" in status, status
