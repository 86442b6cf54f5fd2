"""The daemon's own lifecycle as a real `edge-agent run` process: SIGTERM while its child
trains (the child stops with a checkpoint, the job is kept, exit 0, and a restart resumes
it), and exit 1 after a run of failing main-loop iterations (for systemd to restart it)."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import time

import pytest

from edge_agent.agent.jobs import JobState, JobStore
from edge_agent.protocol.facts import facts_from_state
from edge_agent.train.checkpoints import CheckpointStore
from edge_agent.transport.models import publish_model
from tests.integration.conftest import (
    REPO,
    Watcher,
    board_tree,
    child_pids,
    device_data,
    enrol,
    online_agent,
    wait_for,
)

pytestmark = pytest.mark.integration


def _alive(pid: int) -> bool:
    try:
        return ") Z " not in open(f"/proc/{pid}/stat").read()  # a zombie is gone, only not yet reaped
    except OSError:
        return False


def _steps(watcher: Watcher) -> int:
    return max((m.body.get("metrics", {}).get("step", 0) for m in watcher.by_phase("training")), default=0)


def test_sigterm_while_the_child_trains_stops_it_keeps_the_job_and_a_restart_resumes(
        mosquitto, fleet, agents, tmp_path, digits_bundle):
    _, archive = digits_bundle
    coord = fleet.coordinator(mosquitto.port)
    publish_model(coord.client, coord.signer, fleet.topics, name="digits", version="1", bundle=archive,
                  chunk_bytes=16 * 1024)
    agent, watcher = online_agent(agents, fleet, coord, tmp_path, mosquitto.port, battery_pct=90,
                                  data_dir=device_data(tmp_path / "data"))
    # 10 000 epochs: the job is still training whenever the test acts, however fast the machine
    watcher.command(agent, {"cmd_id": "job1-r1", "action": "finetune", "job": "job1", "round": 1,
                            "model": "digits", "version": "1", "sha256": hashlib.sha256(archive).hexdigest(),
                            "params": {"epochs": 10_000, "batch_size": 8, "checkpoint_every": 2, "patience": 10_000,
                                       "budget_wh": 1.0, "seed": 0}})
    assert wait_for(lambda: _steps(watcher) >= 4 and child_pids(str(agent.state_dir)), 180), agent.log_tail()
    children = child_pids(str(agent.state_dir))
    before = _steps(watcher)

    started = time.monotonic()
    assert agent.terminate(timeout=120) == 0, agent.log_tail()  # the bound only catches a hang
    # the daemon waited for its child: none is left behind, not even for a moment
    assert not [pid for pid in children if _alive(pid)] and not child_pids(str(agent.state_dir))
    text = agent.log_tail(10**7)
    assert "job job1-r1: stopping the training child (it checkpoints)" in text
    assert "did not stop within" not in text and "Traceback" not in text, text  # stopped cleanly, not killed
    assert time.monotonic() - started < 120
    job = JobStore(agent.state_dir / "jobs").load("job1-r1")
    assert job.state is JobState.TRAINING  # kept where it was, for the next start
    # file names carry a sequence number; the step is inside (and load_latest verifies it)
    stores = [CheckpointStore(d) for d in {p.parent for p in (agent.state_dir / "checkpoints" / "job1-r1")
                                           .rglob("ckpt-*.ckpt")}]
    saved = [ck.step for ck in (s.load_latest() for s in stores) if ck is not None]
    assert saved and max(saved) >= before, (saved, before)  # the child checkpointed on its way out
    assert wait_for(lambda: watcher.states()[-1].body["status"] == "offline", 60)

    # restarted: the job is reported as resuming and training goes on from its checkpoint
    seen_states = len(watcher.states())
    agent.start()

    def resumed() -> list[str]:
        return [m.body["detail"] for m in watcher.by_phase("training") if "resumed from" in m.body["detail"]]

    assert wait_for(resumed, 180), agent.log_tail()
    at = int(re.search(r"at step (\d+)", resumed()[-1]).group(1))
    assert at >= before, (at, before)  # the stop checkpoint is at least as new as the progress seen
    assert wait_for(lambda: facts_from_state(watcher.states()[-1].body).get("job_state") == "training", 60)
    assert all(facts_from_state(m.body).get("job") == "job1" for m in watcher.states()[seen_states:]
               if m.body["status"] != "offline")  # reported busy with that job from its first state on
    history = JobStore(agent.state_dir / "jobs").load("job1-r1").history
    assert [h[1:] for h in history][-2:] == [("paused", "agent restarted; resuming from the last checkpoint"),
                                             ("training", "resuming the fine-tune")]

    # and it can still be ended: a cancel stops the resumed child
    watcher.command(agent, {"cmd_id": "job1-cancel", "action": "cancel", "job": "job1"})
    assert wait_for(lambda: JobStore(agent.state_dir / "jobs").load("job1-r1").state is JobState.CANCELLED, 60)
    assert wait_for(lambda: not child_pids(str(agent.state_dir)), 60)
    assert agent.terminate() == 0


# `edge-agent run` with the failure limit lowered from 100 (whose back-off adds up to minutes):
# everything else is the real command, exit code included.
RUN_WITH_LIMIT = ("import sys, edge_agent.agent.daemon as d; d.MAX_FAILING_ITERATIONS = int(sys.argv[1]); "
                  "from edge_agent.agent.cli import main; sys.exit(main(sys.argv[2:]))")
LIMIT = 5


def test_a_run_of_failing_iterations_ends_the_daemon_with_exit_1(mosquitto, fleet, agents, tmp_path):
    agent = agents(tmp_path, mosquitto.port, sysfs_root=board_tree(tmp_path / "board"))
    watcher = Watcher(fleet, fleet.coordinator(mosquitto.port))
    enrol(watcher, agent)
    watcher.start()
    with open(agent.log_path, "ab") as log:
        agent.proc = subprocess.Popen([sys.executable, "-c", RUN_WITH_LIMIT, str(LIMIT), "run", "--config",
                                       str(agent.config)], stdout=log, stderr=subprocess.STDOUT, env=agent.env,
                                      cwd=REPO)
    assert wait_for(lambda: watcher.states(), 60), agent.log_tail()
    assert watcher.states()[-1].body["status"] == "idle" and agent.alive

    # a local fault that every iteration hits (the test hook: EDGE_AGENT_TEST_HOOKS=1)
    fault = agent.state_dir / "debug" / "fail"
    fault.parent.mkdir(parents=True, exist_ok=True)
    fault.touch()
    assert agent.proc.wait(120) == 1, agent.log_tail()  # the bound only catches a hang
    text = agent.log_tail(10**7)
    counts = [int(n) for n in re.findall(r"main loop iteration failed \((\d+) in a row\)", text)]
    assert counts == list(range(1, LIMIT + 1)), counts  # it kept going until the limit, then stopped
    assert "stopping: checkpointing the training child, publishing offline" in text
    assert wait_for(lambda: watcher.states()[-1].body["status"] == "offline", 60)
    assert os.path.exists(fault)
