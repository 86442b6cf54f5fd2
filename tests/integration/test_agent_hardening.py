"""Issue 35 against a real mosquitto and a real agent process: a deleted `state/replay/`
directory does not reopen replays (item 4)."""

from __future__ import annotations

import re
import shutil
import time

import pytest

from edge_agent.protocol import Kind
from tests.integration.conftest import Watcher, online_agent, wait_for

pytestmark = pytest.mark.integration


def pongs(watcher: Watcher, cmd_id: str) -> int:
    return len([m for m in watcher.by_phase("pong") if m.body.get("cmd_id") == cmd_id])


def refusal(watcher: Watcher, cmd_id: str) -> dict | None:
    return next((m.body for m in watcher.refusals() if m.body.get("ref_cmd_id") == cmd_id), None)


def test_a_deleted_replay_directory_refuses_a_captured_command(mosquitto, fleet, agents, tmp_path) -> None:  # noqa: ANN001
    """Before: with no marker and no window files the agent took its restart for a first start
    (empty windows) and accepted the captured, unexpired command a second time."""
    agent, watcher = online_agent(agents, fleet, fleet.coordinator(mosquitto.port), tmp_path, mosquitto.port)
    coord, topic = watcher.side, agent.topic("cmd")
    captured = coord.signer.control(topic, Kind.CMD, {"cmd_id": "captured", "action": "ping"}, ttl=3600)
    assert coord.client.publish_wait(topic, captured, timeout=60)
    assert wait_for(lambda: pongs(watcher, "captured") == 1, 60), agent.log_tail()

    assert agent.terminate() == 0
    shutil.rmtree(agent.state_dir / "replay")  # the whole directory: no marker, no window file
    states = len(watcher.states())
    agent.start()
    assert wait_for(lambda: len(watcher.states()) > states, 60), agent.log_tail()
    assert coord.client.publish_wait(topic, captured, timeout=60)  # the replay
    assert wait_for(lambda: refusal(watcher, "captured"), 60), agent.log_tail()
    body = refusal(watcher, "captured")
    assert body["reason"] == "replayed" and "window was reset" in body["detail"], body
    assert pongs(watcher, "captured") == 1
    assert "replay windows in" in agent.log_tail(100_000) and "enrolled before" in agent.log_tail(100_000)

    # what the coordinator issues after the restart is taken (after the restart's second), and
    # another restart keeps that floor (it was written down), so nothing sent meanwhile is lost
    reset_at = int(re.search(r"reset at (\d+)", body["detail"]).group(1))
    assert wait_for(lambda: time.time() >= reset_at, 10)
    queued = coord.signer.control(topic, Kind.CMD, {"cmd_id": "queued", "action": "ping"}, ttl=3600)
    assert agent.terminate() == 0
    assert coord.client.publish_wait(topic, queued, timeout=60)  # queued by the broker while it is down
    agent.start()
    assert wait_for(lambda: pongs(watcher, "queued") == 1, 60), agent.log_tail()
    assert refusal(watcher, "queued") is None


def test_a_lost_replay_directory_of_an_enrolled_device_persists_its_floor(tmp_path) -> None:  # noqa: ANN001
    """Files, no broker: `enrolled` turns "no marker, no window" from a first start into a lost
    directory; the floor is written, so a second restart does not move it (nor reopen it)."""
    from edge_agent import keys
    from edge_agent.agent.daemon import ever_enrolled
    from edge_agent.protocol import ReplayWindow

    class Clock:
        t = 1_800_000_000.0

        def __call__(self) -> float:
            return self.t

    coord, clock = keys.fingerprint(keys.generate_private_key()), Clock()
    lost = ReplayWindow(directory=tmp_path / "replay", strict_missing=True, known_senders=(coord,), enrolled=True,
                        clock=clock)
    assert "window was reset" in lost.check_and_record(coord, 5 * 10**15, int(clock.t) - 50)  # captured
    clock.t += 100
    again = ReplayWindow(directory=tmp_path / "replay", strict_missing=True, known_senders=(coord,), enrolled=True,
                         clock=clock)
    assert again.check_and_record(coord, 6 * 10**15, int(clock.t) - 50) is None  # sent after the first restart
    assert "window was reset" in again.check_and_record(coord, 4 * 10**15, 1_800_000_000 - 1)

    state = tmp_path / "state"
    for sub in ("jobs", "outbox", "keys"):
        (state / sub).mkdir(parents=True)
    (state / "keys" / "device.key").write_text("a key made by init")
    assert not ever_enrolled(state)  # init made the key: nothing was ever sent to it
    (state / "keys" / "seq").write_text("1")
    assert ever_enrolled(state)  # it signed its hello
    (state / "keys" / "seq").unlink()
    (state / "outbox" / "job-1").mkdir()
    assert ever_enrolled(state)
