"""The operator's commands against a running `serve`: cancel reaches the devices, a
device's refusal is a dropout with its reason, `train` follows the job to its end, and a
second `serve` on the same state directory is refused."""

from __future__ import annotations

import subprocess

import pytest

from edge_agent.coordinator.records import JobStatus, RoundState
from edge_agent.protocol import Kind
from edge_agent.transport import Outbox
from tests.integration.conftest import (
    REPO,
    DeviceLoop,
    announce,
    online_devices,
    register_digits,
    wait_for,
)

pytestmark = pytest.mark.integration


def test_cancel_refusal_and_a_second_serve(mosquitto, fleet, serve, tmp_path, digits_bundle):
    coordinator = serve(mosquitto.port).start()
    register_digits(coordinator, digits_bundle[1], tmp_path)
    side = fleet.device(mosquitto.port, name="dev")
    announce(fleet, side)
    device = DeviceLoop(fleet, side, Outbox(directory=tmp_path / "outbox")).start()
    assert wait_for(lambda: online_devices(coordinator) == [side.id], 30), coordinator.log_tail()

    # cancel: the running serve ends the round and tells the device to stop
    out = coordinator.cli("train", "--model", "digits", "--deadline", "10m", "--detach").stdout
    job_id = out.split()[1].rstrip(":")
    assert wait_for(lambda: any(c.body["action"] == "finetune" for c in device.commands), 30)
    coordinator.cli("cancel", job_id, "--reason", "wrong data")
    assert wait_for(lambda: any(c.body["action"] == "cancel" and c.body["job"] == job_id for c in device.commands), 30)
    with coordinator.registry() as reg:
        assert reg.get_job(job_id).status is JobStatus.CANCELLED
        assert reg.list_rounds(job_id)[0].state is RoundState.CANCELLED

    # a refusal is a dropout, with the device's reason; `train` follows the job and says so
    proc = subprocess.Popen([*coordinator.cli_argv, "train", "--model", "digits", "--deadline", "10m", "--poll", "0.2",
                             "--state-dir", str(coordinator.state_dir)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert wait_for(lambda: sum(c.body["action"] == "finetune" for c in device.commands) == 2, 30)
    cmd = [c for c in device.commands if c.body["action"] == "finetune"][-1]
    assert cmd.body["params"]["deadline"] > 0 and len(cmd.body["sha256"]) == 64
    refusal = {"reason": "battery_low", "detail": "battery 12 % is below 40 %", "ref_cmd_id": cmd.body["cmd_id"],
               "ref_kind": "cmd"}
    assert side.channel.send(fleet.topics.device(side.id, "progress"), Kind.REFUSAL, refusal, ttl=600)
    stdout, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, stdout  # the job failed: its only round had no update
    assert f"dropout {side.id}: refused:battery_low" in stdout and "failed" in stdout, stdout
    with coordinator.registry() as reg:
        job = reg.get_job(cmd.body["job"])
        assert job.status is JobStatus.FAILED and reg.list_rounds(job.id)[0].dropouts == {
            side.id: "refused:battery_low"}

    # one serve per state directory: a second one is refused with a clear message
    second = subprocess.run(coordinator.argv, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert second.returncode == 69 and "another edge-coordinator serve" in second.stderr, second.stderr
    assert coordinator.alive and not device.errors


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

    def logs() -> str:
        return coordinator.log_tail() + "\n--- agent\n" + agent.log_tail()

    assert wait_for(lambda: row().get("online") and row().get("name") == "barn-pi-7", 90), logs()
    first = row()
    assert (first["code"], first["approved"], first["battery_pct"]) == (code, False, None), first
    # several more of its states arrive (each moves "last seen"): still one log line, no drops
    for _ in range(2):
        seen = row()["last_seen"]
        assert wait_for(lambda seen=seen: row()["last_seen"] > seen, 60), logs()
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
    assert wait_for(lambda: row().get("approved") and row().get("battery_pct") == 64, 60), logs()
    assert coordinator.cli("tag", "barn-pi-7", "north").stdout.startswith(f"{agent.id}: tags north")
    assert coordinator.alive and agent.alive
