"""Fleet-shared engine choices end to end (issue 37), with real `edge-agent run` processes and
a real `edge-coordinator serve` on a real mosquitto: the first device of a kind measures its
int8 engine in full and its state reports the choice; the coordinator keeps it and relays it
in the next finetune command; a second device of the same kind (a copy of the same board)
re-checks that choice instead of measuring, and trains on the same engine."""

from __future__ import annotations

import json

import pytest

from edge_agent.coordinator.records import JobStatus
from edge_agent.int8.selection_cache import CACHE_DIR
from edge_agent.int8.shared_choice import shared_choices
from edge_agent.protocol.engine_choice import SharedChoice
from tests.integration.agents import SHORT_ROUND, jobs, logs, start_agents, wait_online
from tests.integration.conftest import register_digits, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # real agents train


def test_a_device_of_a_kind_starts_from_the_choice_another_measured(mosquitto, agents, serve, tmp_path,
                                                                     digits_bundle):
    coordinator = serve(mosquitto.port).start()
    first, second = start_agents(agents, tmp_path, mosquitto.port, 2)  # copies of one board: one kind
    register_digits(coordinator, digits_bundle[1], tmp_path)
    wait_online(coordinator, [first, second])
    for agent, tag in ((first, "first"), (second, "second")):
        coordinator.cli("tag", agent.id, tag)

    def train(tag: str) -> None:
        done = coordinator.cli("train", "--model", "digits", "--devices", f"tag:{tag}", "--min-devices", "1",
                               "--rounds", "1", "--deadline", "600s", *SHORT_ROUND, check=False, timeout=900)
        assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{logs(coordinator, [first, second])}"

    # 1. the first device measures in full; its state, after the job, reports what it chose
    train("first")
    measured = shared_choices(first.state_dir / "cache")
    assert len(measured) == 1, logs(coordinator, [first, second])
    choice = SharedChoice.from_json(measured[0].to_json())  # as it travels (to_json rounds the timings)

    def stored() -> list:
        with coordinator.registry() as reg:
            return reg.engine_choices()

    assert wait_for(lambda: [s.choice for s in stored()] == [choice], 120), logs(coordinator, [first, second])
    assert stored()[0].device_id == first.id

    # 2. the second device's command carries it; its selection re-checks it instead of measuring
    train("second")
    (job,) = jobs(second)
    assert job.params["engine_choices"] == [choice.to_json()]
    entry = json.loads((second.state_dir / "cache" / CACHE_DIR / f"{choice.kind}.json").read_text())
    assert entry.get("source", "measured") != "measured", entry  # adopted from the fleet, not measured here
    assert shared_choices(second.state_dir / "cache") == []  # so it passes nothing on as its own
    assert job.result["engine"] == choice.engine
    with coordinator.registry() as reg:
        assert all(j.status is JobStatus.DONE for j in reg.list_jobs())
        assert [(s.choice, s.device_id) for s in reg.engine_choices()] == [(choice, first.id)]
    out = coordinator.cli("devices").stdout
    assert f"kind {choice.kind[:8]}: {choice.engine}, {choice.threads} thread(s)" in out and first.id in out
    assert all(a.alive for a in (first, second)) and coordinator.alive
