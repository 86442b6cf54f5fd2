"""The fleet load generator end to end: 60 simulated devices (own keys, real MQTT connections)
against a real mosquitto and a real `edge-coordinator serve` complete a round; the new
version exists, every accepted update is counted once, dropouts are recorded as dropouts.
The registry is read through `Registry`: SQLite, or PostgreSQL under `pytest --pg`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from edge_agent.coordinator.records import ParticipantStatus
from edge_agent.coordinator.registry import Registry
from edge_agent.sim.fleet_load import LoadConfig, run_load

pytestmark = pytest.mark.timeout(300)


def test_simulated_fleet_completes_a_round(tmp_path: Path, digits_bundle: tuple[Path, bytes]) -> None:
    bundle, _ = digits_bundle
    cfg = LoadConfig(devices=60, params="100k", aggregator="fedavg_clipped", dropout=0.1, slow_share=0.1,
                     slow_delay_s=0.2, train_s=1.0, tick_s=0.3, timeout_s=240.0)
    res = run_load(cfg, tmp_path / "load", bundle)
    # the run was on the registry this session asked for ($EDGE_COORDINATOR_DB under --pg)
    assert res["registry"] == ("postgresql" if os.environ.get("EDGE_COORDINATOR_DB") else "sqlite")

    assert res["round_state"] == "aggregated", res
    assert res["new_version"], res
    sim = res["sim"]
    assert sim["connected"] == sim["commanded"] == 60, sim
    dropped = sim["dropped_out"]
    assert dropped >= 1  # seeded: 10 % of 60 devices
    # every update the devices saw acknowledged is one accepted row; no device twice
    assert res["accepted"] == sim["acked"] == 60 - dropped, res
    assert res["duplicate_rows"] == 0
    assert res["participants"].get("dropped") == dropped, res["participants"]
    assert res["participants"].get("reported") == 60 - dropped
    with Registry(state_dir=tmp_path / "load" / "coordinator", read_only=True) as reg:
        versions = [m.version for m in reg.list_models("simhead") if m.job_id == res["job"]]
        reasons = [p.reason for p in reg.get_round(res["job"], 1).participants.values()
                   if p.status is ParticipantStatus.DROPPED]
    assert versions == [res["new_version"]]
    assert len(reasons) == dropped
    assert all("simulated dropout" in r for r in reasons), reasons
    assert sim["errors"] == 0
    # the close is measured to its end: the commit, then the version's manifest on the broker
    assert 0 <= res["last_update_to_version_s"] <= res["last_update_to_broker_s"] < 120, res
