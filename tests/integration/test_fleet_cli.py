"""The operator's commands against a running `serve` with real agents: a device's policy
refusal is a dropout with its reason, `train` follows the job to its end, a second `serve`
on the same state directory is refused, and a pending device is shown and approved."""

from __future__ import annotations

import subprocess

import pytest

from edge_agent.coordinator.records import JobStatus
from tests.integration.agents import logs
from tests.integration.conftest import (
    REPO,
    board_tree,
    device_data,
    online_devices,
    register_digits,
    wait_for,
)

pytestmark = pytest.mark.integration


def test_a_policy_refusal_is_a_dropout_and_a_second_serve_is_refused(mosquitto, fleet, agents, serve, tmp_path,
                                                                      digits_bundle):
    """A real agent whose battery (35 %) passes the coordinator's selection (30 %) but not
    its own policy (40 %) refuses the round's command: a dropout with its reason, which
    `train` follows to the job's end and prints. (Cancel: test_fleet_agents.py.)"""
    coordinator = serve(mosquitto.port).start()
    register_digits(coordinator, digits_bundle[1], tmp_path)
    agent = agents(tmp_path, mosquitto.port, sysfs_root=board_tree(tmp_path / "board", battery_pct=35),
                   data_dir=device_data(tmp_path / "data")).start()
    assert wait_for(lambda: online_devices(coordinator) == [agent.id], 60), coordinator.log_tail() + agent.log_tail()

    done = coordinator.cli("train", "--model", "digits", "--deadline", "10m", "--poll", "0.2", check=False,
                           timeout=600)
    assert done.returncode == 1, done.stdout  # the job failed: its only round had no update
    assert f"dropout {agent.id}: refused:battery_low" in done.stdout and "failed" in done.stdout, done.stdout
    with coordinator.registry() as reg:
        (job,) = reg.list_jobs()
        assert job.status is JobStatus.FAILED
        assert reg.list_rounds(job.id)[0].dropouts == {agent.id: "refused:battery_low"}
    assert "refused finetune" in agent.log_tail() and "battery 35 %" in agent.log_tail(), agent.log_tail()
    assert not (agent.state_dir / "jobs").exists() or not any((agent.state_dir / "jobs").iterdir())

    # one serve per state directory: a second one is refused with a clear message
    second = subprocess.run(coordinator.argv, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert second.returncode == 69 and "another edge-coordinator serve" in second.stderr, second.stderr
    assert coordinator.alive and agent.alive


def test_a_pending_agent_is_shown_logged_once_and_approved_by_name(mosquitto, fleet, serve, agents, tmp_path):
    """A real `edge-agent run` before approval: `devices` shows the name it announced, that
    it is online, when it was last heard from and the enrolment code the agent logged; the
    coordinator logs it once as pending approval (no unknown-key drops per message) and
    takes none of its state; `approve NAME` lets its state in; `tag NAME` tags it."""
    import json

    from edge_agent import keys
    from tests.integration.conftest import board_tree

    coordinator = serve(mosquitto.port, auto_approve=False).start()
    agent = agents(tmp_path, mosquitto.port, sysfs_root=board_tree(tmp_path / "board", battery_pct=64),
                   name="barn-pi-7").start()
    code = keys.enrolment_code(agent.key)

    def row() -> dict:
        rows = {d["id"]: d for d in json.loads(coordinator.cli("devices", "--json").stdout)}
        return rows.get(agent.id) or {}

    assert wait_for(lambda: row().get("online") and row().get("name") == "barn-pi-7", 90), logs(coordinator, [agent])
    first = row()
    assert (first["code"], first["approved"], first["battery_pct"]) == (code, False, None), first
    # more of its states arrive ("last seen" moves, at most every HEARD_EVERY_S): one log line, no drops
    for _ in range(2):
        seen = row()["last_seen"]
        assert wait_for(lambda seen=seen: row()["last_seen"] > seen, 180), logs(coordinator, [agent])
    text = coordinator.log_path.read_text(errors="replace")
    pending = [line for line in text.splitlines() if "pending approval" in line]
    assert len(pending) == 1 and agent.id in pending[0] and code in pending[0], pending
    assert "unknown_key" not in text and "dropped:" not in text, text[-3000:]
    assert f"enrolment code {code}" in agent.log_tail()  # the device shows the same code
    table = coordinator.cli("devices").stdout
    line = next(ln for ln in table.splitlines() if ln.startswith(agent.id))
    assert line.split()[1:5] == [code, "barn-pi-7", "PENDING", "yes"] and line.endswith("s ago"), table
    assert row()["battery_pct"] is None  # nothing it said was taken as fact

    assert f"approved {agent.id}" in coordinator.cli("approve", "barn-pi-7").stdout
    assert wait_for(lambda: row().get("approved") and row().get("battery_pct") == 64, 60), logs(coordinator, [agent])
    assert coordinator.cli("tag", "barn-pi-7", "north").stdout.startswith(f"{agent.id}: tags north")
    assert coordinator.alive and agent.alive
