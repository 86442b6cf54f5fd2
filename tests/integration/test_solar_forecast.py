"""A real agent with `[solar]` (pvlib in its forecast child) reports its surplus forecast in
its state over a real mosquitto; the real coordinator keeps it and selects by it: a round
whose deadline ends before the device's surplus window does not take the device (naming
the forecast) while its battery alone would have let it in."""

from __future__ import annotations

import pytest

from edge_agent.coordinator.selection import parse_flat_forecast
from tests.integration.conftest import (
    board_tree,
    device_data,
    online_devices,
    register_digits,
    wait_for,
)

pytestmark = pytest.mark.integration

SOLAR = """
[solar]
latitude = 52.09
longitude = 5.12
panel_w = 2
battery_wh = 40
"""


def test_an_agents_forecast_reaches_the_coordinator_and_decides_its_selection(
        mosquitto, fleet, agents, serve, tmp_path, digits_bundle):
    _, archive = digits_bundle
    coordinator = serve(mosquitto.port).start()
    register_digits(coordinator, archive, tmp_path)
    agent = agents(tmp_path, mosquitto.port, name="solar", sysfs_root=board_tree(tmp_path / "board", battery_pct=45),
                   data_dir=device_data(tmp_path / "data", device=0), extra_toml=SOLAR).start()
    assert wait_for(lambda: len(online_devices(coordinator)) == 1, 180), coordinator.log_tail()

    def stored():
        with coordinator.registry() as reg:
            return reg.get_device(agent.id).state.get("forecast")

    assert wait_for(lambda: isinstance(stored(), str), 180), agent.log_tail()
    forecast = parse_flat_forecast(stored())
    assert len(forecast.panel_w) == 24 and forecast.capacity_wh == 40 and forecast.train_w
    # a 2 W panel cannot carry a Pi 4's load: no window in the next day, whatever the battery says now
    out = coordinator.cli("train", "--model", "digits", "--devices", "all", "--min-devices", "1", "--deadline", "1h",
                          "--wait-for-devices", "--detach").stdout
    assert "forecast: no surplus window" not in out  # train's own check knows no deadline: it queues
    job_id = next(line for line in out.splitlines() if line.startswith("job ")).split()[1].rstrip(":")
    with coordinator.registry() as reg:
        assert wait_for(lambda: "forecast: no surplus window before the deadline" in reg.get_job(job_id).reason,
                        120), (reg.get_job(job_id).status, reg.get_job(job_id).reason, [r.state for r in reg.list_rounds(job_id)])
        assert reg.list_rounds(job_id) == []
    assert agent.alive and coordinator.alive
