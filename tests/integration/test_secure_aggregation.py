"""Secure aggregation as a job mode, end to end: real `edge-agent run` processes and a real
`edge-coordinator serve` on a real mosquitto run `train --secure-aggregation` (SecAgg+ over
MQTT: coordinator/secure_rounds.py, agent/secure.py). One device goes silent after sharing
its keys (the agents' test hook debug/secagg_drop), so its pairwise masks must be removed
through its reconstructed key, and mid-round serve and another agent are killed and started
again: the published version is exactly the base plus the mean of the survivors' quantised
updates, and no individual update is anywhere at the coordinator."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from edge_agent import __version__
from edge_agent.agent.jobs import JobState
from edge_agent.coordinator.records import JobStatus, RoundState
from edge_agent.updates.secagg import RoundConfig, unflat_by_name
from tests.integration.agents import SHORT_ROUND, job_id_of, jobs, logs, wait_online
from tests.integration.conftest import board_tree, device_data, register_digits, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # real agents train


def _phase(path) -> str | None:
    try:
        return json.loads(path.read_text())["round"]["phase"]
    except (OSError, ValueError, KeyError):
        return None


def _leaks(blob: bytes, needles: dict[str, bytes]) -> list[str]:
    return [name for name, needle in needles.items() if needle in blob]


def test_a_secure_job_publishes_the_survivors_exact_mean_and_the_coordinator_never_holds_an_update(
        mosquitto, agents, serve, tmp_path, digits_bundle):
    coordinator = serve(mosquitto.port).start()
    agents_ = []
    for i in range(4):  # (the simulated scenario has three devices' data: the fourth reuses the first's)
        agent = agents(tmp_path, mosquitto.port, name=f"agent{i}", sysfs_root=board_tree(tmp_path / f"board{i}"),
                       data_dir=device_data(tmp_path / f"data{i}", device=i % 3))
        (agent.state_dir / "debug" / "secagg_inputs").mkdir(parents=True)  # (hook: keep the input it masked)
        agents_.append(agent)
    victim, survivors = agents_[-1], agents_[:-1]
    (victim.state_dir / "debug" / "secagg_drop").write_text("secagg_shares")  # silent once its shares are sent
    for agent in agents_:
        agent.start()
    register_digits(coordinator, digits_bundle[1], tmp_path)
    wait_online(coordinator, agents_)

    job_id = job_id_of(coordinator.cli("train", "--model", "digits", "--devices", "all", "--deadline", "600s",
                                       "--min-devices", "3", "--secure-aggregation", "--secagg-phase", "6",
                                       *SHORT_ROUND[:-2], "--detach").stdout)
    # mid-round -- the mask phase waits for the victim's input until its deadline -- serve and a
    # survivor's agent are killed (-9) and started again: both go on from their state files
    state_path = coordinator.state_dir / "secagg" / f"{job_id}-r1.json"
    assert wait_for(lambda: _phase(state_path) == "mask", 120), logs(coordinator, agents_)
    coordinator.kill9()
    survivors[0].kill9()
    survivors[0].start()
    coordinator = serve(mosquitto.port).start()

    def finished() -> bool:
        with coordinator.registry() as reg:
            return reg.get_job(job_id).status.terminal

    assert wait_for(finished, 120), logs(coordinator, agents_)
    with coordinator.registry() as reg:
        (job,) = reg.list_jobs()
        assert job.status is JobStatus.DONE and job.params["secagg"] is True, logs(coordinator, agents_) and job.params["aggregator"] == "fedavg"
        (rnd,) = reg.list_rounds(job.id)
        assert rnd.state is RoundState.AGGREGATED, rnd.reason
        assert rnd.dropouts == {victim.id: "secagg: no masked input after sharing its keys"}
        assert reg.list_updates(job.id, 1) == []  # no update was ever stored
        base = reg.load_head(reg.get_model("digits", "1"))
        version = reg.get_model("digits", rnd.aggregated_version)
        new = reg.load_head(version)
    assert version.metrics["secagg_survivors"] == 3 and version.metrics["secagg_dropped"] == 1

    # the coordinator's round state: the victim dropped after sharing, its masks were removed
    state = json.loads((coordinator.state_dir / "secagg" / f"{job.id}-r1.json").read_text())
    assert state["round"]["phase"] == "done"
    assert state["round"]["survivors"] == sorted(a.id for a in survivors) and state["round"]["dropped"] == [victim.id]
    inputs = {a.id: np.frombuffer((a.state_dir / "debug" / "secagg_inputs" / f"{job.id}-r1.u32").read_bytes(), "<u4")
              for a in survivors}
    assert not (victim.state_dir / "debug" / "secagg_inputs" / f"{job.id}-r1.u32").exists()
    total = (sum(x.astype(np.uint64) for x in inputs.values()) % 2**32).astype(np.uint32)
    assert np.array_equal(np.frombuffer(base64.b64decode(state["sum"]), "<u4"), total)  # exact, mod 2^32

    # the published version: base + the survivors' mean, decoded from that exact sum
    config = RoundConfig.from_json(state["round"]["config"])
    mean = unflat_by_name(config.quantiser.decode_sum(total) / 3, {n: a.shape for n, a in base.items()})
    scale = float(version.metrics.get("step_scale", 1.0))  # (the gate's step, when the model has a server set)
    for name, arr in base.items():
        want = (arr.astype(np.float64) + (scale * mean[name]).astype(np.float32)).astype(np.float32)
        np.testing.assert_allclose(new[name], want, rtol=0, atol=1e-6, err_msg=name)

    # the restarted agent went on where it was: it revealed after its restart, its job is done
    after = survivors[0].log_tail(10**7).split(f"edge-agent {__version__}: device {survivors[0].id}")
    assert len(after) == 3 and "secure aggregation: shares revealed" in after[-1], after[-1][-3000:]
    assert [j.state for j in jobs(survivors[0])] == [JobState.DONE]

    # the devices: the survivors' round secrets are gone (only their reveal kept), the jobs done
    for agent in survivors:
        kept = json.loads((agent.state_dir / "secagg" / f"{job.id}-r1.json").read_text())
        assert kept["done"] is True and "device" not in kept and "delta" not in kept
        assert (agent.state_dir / "secagg" / f"{job.id}-r1.json").stat().st_mode & 0o777 == 0o600

    # no individual update at the coordinator: its state dir (registry database included) and its log
    needles = {}
    for device, x in inputs.items():
        raw = x.astype("<u4").tobytes()
        floats = (x.view(np.int32).astype(np.float64) / config.quantiser.scale).astype("<f4").tobytes()
        needles |= {f"{device} raw": raw[:64], f"{device} base64": base64.b64encode(raw)[:64],
                    f"{device} float32": floats[4:68], f"{device} float32 base64": base64.b64encode(floats)[8:72]}
    own = (survivors[0].state_dir / "debug" / "secagg_inputs" / f"{job.id}-r1.u32").read_bytes()
    assert _leaks(own, needles)  # (the scan finds an update where one is: the device's own copy)
    found = []
    for path in [*coordinator.state_dir.rglob("*"), coordinator.log_path]:
        if path.is_file():
            found += [f"{path.name}: {leak}" for leak in _leaks(path.read_bytes(), needles)]
    assert not found, found
