"""The update's metadata end to end: real `edge-agent run` processes train, sign the share of
the delta's energy their update kept and their model's label set onto every chunk, and the
coordinator records the first and checks the second; `status` shows the kept share."""

from __future__ import annotations

import re

import pytest

from edge_agent.coordinator.records import UpdateStatus
from tests.integration.agents import start_agents
from tests.integration.test_fleet_round import run_round

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # real agents train: ~30 s each


def test_agents_send_the_kept_energy_and_status_shows_it(mosquitto, agents, serve, tmp_path, digits_bundle):
    _, archive = digits_bundle
    coordinator = serve(mosquitto.port).start()
    agents_ = start_agents(agents, tmp_path, mosquitto.port, 3)
    run_round(coordinator, agents_, tmp_path, archive)  # --update-bytes 1024 on a 330-value head
    with coordinator.registry() as reg:
        (job,) = reg.list_jobs()
        updates = reg.list_updates(job.id, 1)
    assert len(updates) == 3 and all(u.status is UpdateStatus.ACCEPTED for u in updates)
    # 1024 bytes hold the whole head as int8: nearly all of the energy, fewer bytes than fp32
    assert all(0.99 <= u.metrics["energy_kept"] <= 1.0 for u in updates), [u.metrics for u in updates]
    assert all(u.wire_bytes < u.fp32_bytes for u in updates), [(u.wire_bytes, u.fp32_bytes) for u in updates]
    status = coordinator.cli("status", job.id).stdout
    assert re.search(r"kept (99\.\d|100\.0) % of the delta energy", status), status
