"""End to end with the real trainer: a signed finetune command, the model fetched from the
broker and activated, MXNet training in the child, the daemon killed with -9 mid-training
and restarted, the job resumed from its checkpoint, the compressed update delivered and
acknowledged.

"Mid-training" on any machine: the child's test hook (EDGE_AGENT_TEST_HOLD, see
edge_agent/agent/child.py) holds the training at its first checkpoint from HOLD_AT on; the
test kills the daemon while it is held there."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

from edge_agent.agent.jobs import JobState, JobStore
from edge_agent.transport.models import publish_model
from edge_agent.updates import Reassembler, decode_update
from tests.integration.conftest import child_pids, device_data, online_agent, wait_for

pytestmark = pytest.mark.integration
EPOCHS = 4  # 16 batches an epoch (123 training samples, batch 8)
HOLD_AT = 20  # checkpoints every 3 steps: held at step 21, in epoch 2


def test_kill_9_mid_training_then_restart_finishes_the_job(mosquitto, fleet, agents, tmp_path, digits_bundle):
    bundle_dir, archive = digits_bundle
    coord = fleet.coordinator(mosquitto.port)
    publish_model(coord.client, coord.signer, fleet.topics, name="digits", version="1", bundle=archive,
                  chunk_bytes=16 * 1024)
    hold = tmp_path / "hold-training"
    hold.write_text(str(HOLD_AT))
    agent, watcher = online_agent(agents, fleet, coord, tmp_path, mosquitto.port, battery_pct=90,
                                  data_dir=device_data(tmp_path / "data"), env={"EDGE_AGENT_TEST_HOLD": str(hold)})

    watcher.command(agent, {"cmd_id": "job1-r1", "action": "finetune", "job": "job1", "round": 1,
                            "model": "digits", "version": "1", "sha256": hashlib.sha256(archive).hexdigest(),
                            "params": {"epochs": EPOCHS, "batch_size": 8, "checkpoint_every": 3, "patience": 10_000,
                                       "budget_wh": 1.0, "update_bytes": 2048, "seed": 0}})

    held = hold.with_name(hold.name + ".held")
    assert wait_for(held.exists, 300), agent.log_tail()  # the child checkpointed and waits
    held_at = json.loads(held.read_text())["step"]
    assert held_at >= HOLD_AT and child_pids(str(agent.state_dir))
    assert watcher.by_phase("accepted") and watcher.by_phase("model-installed")
    assert (agent.state_dir / "models" / "digits" / "current").resolve().name == "1"
    agent.kill9()
    # the training child goes with it (PR_SET_PDEATHSIG), checkpointing on the way out
    assert wait_for(lambda: not child_pids(str(agent.state_dir)), 60), child_pids(str(agent.state_dir))
    job = JobStore(agent.state_dir / "jobs").load("job1-r1")
    assert job.state is JobState.TRAINING

    hold.unlink()  # the restarted child trains on to the end
    agent.start()
    assert wait_for(lambda: watcher.by_phase("done"), 300), agent.log_tail()
    resumed = [m.body["detail"] for m in watcher.by_phase("training") if "resumed from" in m.body["detail"]]
    assert resumed, [m.body["detail"] for m in watcher.by_phase("training")][-20:]
    at = int(re.search(r"at step (\d+)", resumed[-1]).group(1))
    # continued from the checkpoint it was held at (or the one written on the way out), not from scratch
    assert held_at <= at < EPOCHS * 16

    # exactly one update arrived; it decodes to a delta for this device's head, within budget
    assert len(watcher.log.completed) == 1
    upload = watcher.log.completed[0]
    reassembler = Reassembler()
    payloads = [r for r in (reassembler.add(c) for c in upload.chunks) if r is not None]
    decoded = decode_update(payloads[0].payload)
    assert decoded.header.key == ("job1", agent.id, 1)
    assert (decoded.header.model_name, decoded.header.model_version) == ("digits", "1")
    assert sum(len(c) for c in upload.chunks) <= 2048
    assert any(abs(d).max() > 0 for d in decoded.deltas.values())
    uploading = watcher.by_phase("uploading")[-1].body["metrics"]
    assert uploading["num_samples"] > 0 and uploading["stop_reason"] == "done"

    job = JobStore(agent.state_dir / "jobs").load("job1-r1")
    assert job.state is JobState.DONE
    assert [h[1] for h in job.history].count("training") >= 2  # re-entered after the restart
    assert any("agent restarted" in h[2] for h in job.history)
    assert not (agent.state_dir / "checkpoints" / "job1-r1").exists()  # cleaned up
    assert (agent.state_dir / "residuals" / "digits.bin").exists()  # error feedback carried to the next round
    assert len(list((agent.state_dir / "outbox" / "items").iterdir())) == 0
    assert agent.alive
    maps = Path(f"/proc/{agent.proc.pid}/maps").read_text()  # the daemon itself never loaded them
    assert "numpy" not in maps and "mxnet" not in maps
