"""The fleet load generator end to end: 60 simulated devices (own keys, real MQTT connections)
against a real mosquitto and a real `edge-coordinator serve` complete a round; the new
version exists, every accepted update is counted once, dropouts are recorded as dropouts."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from edge_agent.sim.fleet_load import LoadConfig, run_load

pytestmark = pytest.mark.timeout(300)


def test_simulated_fleet_completes_a_round(tmp_path: Path, digits_bundle: tuple[Path, bytes]) -> None:
    bundle, _ = digits_bundle
    cfg = LoadConfig(devices=60, params="100k", aggregator="fedavg_clipped", dropout=0.1, slow_share=0.1,
                     slow_delay_s=0.2, train_s=1.0, tick_s=0.3, timeout_s=240.0)
    res = run_load(cfg, tmp_path / "load", bundle)

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
    db = sqlite3.connect(f"file:{tmp_path / 'load' / 'coordinator' / 'registry.sqlite3'}?mode=ro", uri=True)
    try:
        (version,) = db.execute("SELECT version FROM model_versions WHERE job_id = ?", (res["job"],)).fetchone()
        reasons = [r for (r,) in db.execute("SELECT reason FROM participants WHERE job_id = ? AND status = 'dropped'",
                                            (res["job"],))]
    finally:
        db.close()
    assert version == res["new_version"]
    assert all("simulated dropout" in r for r in reasons), reasons
    assert sim["errors"] == 0
