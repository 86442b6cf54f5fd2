"""[solar] on the agent and the coordinator: the config table, the panel history over a temp
sysfs tree, the job driver waiting for its surplus window or refusing, the forecast in the
state message, and round selection by a reported forecast. Real pvlib (in-process: the
planner's `compute` is the child's own function), real files."""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from edge_agent.agent.jobs import JobState, JobStore
from edge_agent.agent.lifecycle import DriverSettings, JobDriver
from edge_agent.agent.models import ModelStore
from edge_agent.agent.policy import DeviceLimits
from edge_agent.agent.solar import SolarPlanner, SolarSettings, compute_request, run_child
from edge_agent.agent.state import DeviceState, Readings
from edge_agent.atomic import read_checked
from edge_agent.config import load_config
from edge_agent.coordinator.records import Device
from edge_agent.coordinator.selection import forecast_state, select_devices
from edge_agent.errors import ConfigError, InputError
from edge_agent.power import BatteryState
from edge_agent.power.forecast import SolarSite, forecast_surplus
from edge_agent.power.panel_history import MAX_FILE_BYTES, PanelHistory, PanelMeter
from edge_agent.protocol import Kind, Topics
from edge_agent.protocol.schema import check_body
from edge_agent.transport import Outbox

from .test_config import _rendered, _write

MIDNIGHT = datetime(2024, 6, 10, tzinfo=UTC).timestamp()
H = 3600.0
SITE = SolarSite(latitude=52.0, longitude=5.0, panel_w=20.0)


# ---------------------------------------------------------------- config
def test_solar_table_is_optional_and_validated(tmp_path: Path) -> None:
    assert SolarSettings.from_config(load_config(_write(tmp_path, _rendered(tmp_path)))) is None
    text = _rendered(tmp_path) + "\n[solar]\nlatitude = 52.0\nlongitude = 5.0\nbattery_wh = 60\npanel_w = 30\n"
    settings = SolarSettings.from_config(load_config(_write(tmp_path, text)))
    assert settings is not None and settings.site.panel_w == 30.0 and settings.capacity_wh == 60.0
    assert settings.load_w == 2.7  # the Pi 4 profile's idle draw
    assert settings.floor_wh == pytest.approx(60.0 * settings.floor_pct / 100)
    bad = _rendered(tmp_path) + "\n[solar]\nlongitude = 500\nefficiency = 2\npanel_sensor = \"i2c:0x40\"\n"
    with pytest.raises(ConfigError) as caught:
        load_config(_write(tmp_path, bad))
    message = str(caught.value)
    assert "solar.longitude: 500 is above the maximum 180" in message
    assert "solar.efficiency: 2 is above the maximum 1" in message
    assert ":" in message.split("solar.longitude")[0]  # file:line: in front
    bad = _rendered(tmp_path) + "\n[solar]\nlongitude = 5\npanel_sensor = \"i2c:0x40\"\n"
    with pytest.raises(ConfigError) as caught:
        load_config(_write(tmp_path, bad))
    assert "solar.latitude is required" in str(caught.value) and "solar.battery_wh is required" in str(caught.value)
    assert "hwmon:<entry>" in str(caught.value)


# ---------------------------------------------------------------- panel history
def _sysfs(tmp_path: Path, *, status: str = "Charging", power_uw: int = 4_000_000) -> Path:
    root = tmp_path / "sys-root"
    bat = root / "sys/class/power_supply/battery"
    bat.mkdir(parents=True)
    for name, value in (("type", "Battery"), ("status", status), ("capacity", "50"), ("power_now", str(power_uw))):
        (bat / name).write_text(value + "\n")
    ina = root / "sys/class/hwmon/hwmon3"
    ina.mkdir(parents=True)
    for name, value in (("name", "ina219"), ("power1_input", "6500000")):
        (ina / name).write_text(value + "\n")
    return root


def test_panel_meter_reads_an_ina_or_the_battery_charge(tmp_path: Path) -> None:
    root = _sysfs(tmp_path)
    assert PanelMeter(root, "hwmon:hwmon3", load_w=2.0).read() == pytest.approx(6.5)
    battery = PanelMeter(root, "auto", load_w=2.0)
    assert battery.kind == "battery" and battery.read() == pytest.approx(4.0 + 2.0)  # charge + the board's draw
    (root / "sys/class/power_supply/battery/status").write_text("Discharging\n")
    (root / "sys/class/power_supply/battery/power_now").write_text("1500000\n")
    assert battery.read() == pytest.approx(0.5)  # the panel paid 0.5 of the board's 2 W
    (root / "sys/class/power_supply/battery/status").write_text("Full\n")
    assert battery.read() is None  # curtailed by the charger: not evidence of cloud
    with pytest.raises(ConfigError, match="hwmon9"):
        PanelMeter(root, "hwmon:hwmon9", load_w=2.0)


def test_panel_history_is_bounded_crash_safe_and_survives_a_corrupt_file(tmp_path: Path) -> None:
    path = tmp_path / "solar" / "panel-history.bin"
    history = PanelHistory(path, keep_s=6 * H)  # (the default keeps 7 days: 1,008 samples)
    t = MIDNIGHT
    assert history.record(t, 3.0) and not history.record(t + 60, 4.0)  # one per 10 minutes
    for i in range(1, 2 * 36):  # twelve hours of samples: the first six fall out
        history.record(t + i * 600, float(i % 7))
    assert len(history.samples) == 36 and history.samples[0][0] > t + 6 * H - 600
    reloaded = PanelHistory(path, keep_s=6 * H)
    assert reloaded.samples == [(float(int(a)), round(b, 3)) for a, b in history.samples]
    assert len(read_checked(path, MAX_FILE_BYTES)) < 36 * 25
    assert not any(p.name.endswith(".tmp") for p in path.parent.iterdir())  # atomic: no temp left
    path.write_bytes(b"\0" * 4096)  # what an SD card leaves after power loss
    assert PanelHistory(path).samples == []


# ---------------------------------------------------------------- the job driver
class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _driver(tmp_path: Path, *, battery_pct: float, clock: Clock, panel_w: float = 20.0,
            ) -> tuple[JobDriver, list[dict[str, Any]], SolarPlanner]:
    data = tmp_path / "data"
    data.mkdir(parents=True, exist_ok=True)
    state = tmp_path / "state"
    settings = SolarSettings(site=SolarSite(52.0, 5.0, panel_w=panel_w), capacity_wh=60.0, floor_pct=30.0,
                             load_w=1.0, train_w=3.0, train_wh=6.0, panel_sensor="none")
    battery = BatteryState(capacity_pct=battery_pct, status="Discharging", energy_j=None, source="test")
    planner = SolarPlanner(settings=settings, state_dir=state, sysfs_root=str(tmp_path), battery=lambda: battery,
                           compute=compute_request)
    published: list[dict[str, Any]] = []
    models = ModelStore(root=state / "models", topics=Topics(fleet="f"),
                        subscribe=lambda f: None, unsubscribe=lambda f: None)
    driver = JobDriver(
        settings=DriverSettings(device_id="dev0", state_dir=state, battery_floor_pct=30.0, battery_resume_pct=35.0,
                                limits=DeviceLimits(min_battery_pct=40.0, energy_wh=6.0, data_dir=str(data)),
                                python=(sys.executable, "-c", "raise SystemExit(1)")),
        store=JobStore(state / "jobs"), models=models, outbox=Outbox(directory=state / "outbox"),
        readings=lambda fresh=False: Readings(battery_pct=battery_pct, charging=False, power_w=1.0),
        publish=lambda phase, **kw: published.append({"phase": phase, **kw}), clock=clock, planner=planner)
    return driver, published, planner


def _cmd(deadline: float) -> dict[str, Any]:
    return {"cmd_id": "j-r1", "action": "finetune", "job": "j", "round": 1, "model": "digits", "version": "1",
            "params": {"deadline": deadline}}


def test_a_low_battery_at_night_waits_for_the_morning_window(tmp_path: Path) -> None:
    clock = Clock(MIDNIGHT + 1 * H)  # 01:00 UTC, battery 35 %: below min_battery_pct 40, above the 30 % floor
    driver, published, planner = _driver(tmp_path, battery_pct=35.0, clock=clock)
    verdict, job = driver.submit(_cmd(MIDNIGHT + 14 * H), "j-r1")
    assert verdict.accept and job is not None, verdict  # the battery rule alone would refuse (35 < 40)
    start = job.params["not_before"]
    assert MIDNIGHT + 4 * H <= start <= MIDNIGHT + 12 * H and job.params["plan_end"] == start + 2 * H
    driver.step()
    job = driver.store.load("j-r1")
    assert job.state is JobState.WAITING_FOR_POWER and job.reason.startswith("planned start ")
    assert datetime.fromtimestamp(start, UTC).strftime("%H:%M") in job.reason
    driver.step()
    assert driver.store.load("j-r1").state is JobState.WAITING_FOR_POWER  # still before the window
    # the state carries the forecast with the waiting job's window, and the protocol takes it
    state = planner.state(driver.planned_window())
    assert state is not None and state["window"]["start"] == int(start) and len(state["surplus_w"]) == 24
    body = DeviceState(sysfs_root=str(tmp_path), probe_report={}).state_body({"status": "busy"}, forecast=state)
    check_body(Kind.STATE, body)
    assert len(json.dumps(body["forecast"])) < 700
    # the window opens: the battery check (35 % >= the resume level) lets it go on to preparing
    clock.now = start + 1
    driver.step()
    assert driver.store.load("j-r1").state in (JobState.PREPARING, JobState.FAILED)
    assert "preparing" in [h[1] for h in driver.store.load("j-r1").history]
    assert [p["phase"] for p in published][:2] == ["accepted", "waiting-for-power"]


def test_no_window_before_the_deadline_is_refused_naming_the_forecast(tmp_path: Path) -> None:
    clock = Clock(MIDNIGHT + 1 * H)
    driver, _, _ = _driver(tmp_path, battery_pct=35.0, clock=clock)
    verdict, job = driver.submit(_cmd(MIDNIGHT + 3 * H), "j-r1")  # the deadline is before dawn
    assert not verdict.accept and job is None
    assert verdict.reason == "no_solar_window"
    assert verdict.detail.startswith("forecast: no surplus window before the deadline (next at ")
    # a panel too small for the board: no window at all
    small, _, _ = _driver(tmp_path / "small", battery_pct=35.0, clock=clock, panel_w=1.0)
    verdict, _ = small.submit(_cmd(MIDNIGHT + 20 * H), "j-r1")
    assert verdict.reason == "no_solar_window" and "none in the next 24 h" in verdict.detail


def test_the_forecast_child_computes_what_the_function_does(tmp_path: Path) -> None:
    request = {"site": SITE.__dict__, "now": MIDNIGHT, "battery_wh": 30.0, "capacity_wh": 60.0, "floor_wh": 15.0,
               "load_w": 1.0, "train_w": 3.0, "train_wh": 6.0, "history": []}
    child = run_child(request)
    direct = compute_request(request)
    assert child.surplus_w() == pytest.approx(direct.surplus_w(), abs=0.01) and child.train_w == 3.0
    with pytest.raises(InputError, match="forecast child exited 65"):
        run_child({**request, "site": {"latitude": 100, "longitude": 0}})


# ---------------------------------------------------------------- coordinator selection
def _device(dev_id: str, *, battery: float, forecast: dict[str, Any] | None) -> Device:
    state = {"status": "idle", "battery_pct": battery, "on_power": False, **forecast_state({"forecast": forecast})}
    return Device(dev_id, "f", "k", 0.0, True, (), "pi", "raspberry-pi-4", "native", state, MIDNIGHT, True)


def test_selection_uses_a_reported_forecast(tmp_path: Path) -> None:
    now = MIDNIGHT + 1 * H
    fc = forecast_surplus(SITE, now=now, battery_wh=20.0, capacity_wh=60.0, floor_wh=15.0, load_w=1.0,
                          train_w=3.0, train_wh=6.0).to_state()
    devices = [_device("low-with-sun", battery=25.0, forecast=fc),
               _device("low-no-forecast", battery=25.0, forecast=None),
               _device("bad-forecast", battery=80.0, forecast={**fc, "surplus_w": "lots"}),
               _device("full-no-forecast", battery=80.0, forecast=None)]
    kw: dict[str, Any] = dict(now=now, online_within_s=1e9, min_battery_pct=30.0)
    # a round ending at 14:00: the morning sun gives the forecasting device its window
    chosen = select_devices(devices, "all", deadline_at=MIDNIGHT + 14 * H, **kw)
    assert sorted(chosen.eligible) == ["bad-forecast", "full-no-forecast", "low-with-sun"]
    assert chosen.ineligible == {"low-no-forecast": "battery 25% < 30%"}
    # a round ending at 03:00: no surplus window before it
    early = select_devices(devices, "all", deadline_at=MIDNIGHT + 3 * H, **kw)
    why = early.ineligible["low-with-sun"]
    assert why.startswith("forecast: no surplus window before the deadline (next at ") and why.endswith(" UTC)")
    assert "bad-forecast" in early.eligible  # an invalid forecast is ignored: the battery rule applies
    # without a deadline (existing callers), today's rule
    assert select_devices(devices, "all", **kw).ineligible["low-with-sun"] == "battery 25% < 30%"


def test_edge_agent_forecast_prints_the_table_and_the_state_form(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from edge_agent.cli import main

    root = _sysfs(tmp_path, status="Discharging", power_uw=1_800_000)
    text = _rendered(tmp_path, sysfs_root=str(root), profile="raspberry-pi-4") + \
        "\n[solar]\nlatitude = 52.09\nlongitude = 5.12\nbattery_wh = 60\npanel_w = 30\n"
    config = _write(tmp_path, text)
    assert main(["forecast", "--config", str(config), "--at", str(MIDNIGHT + 6 * H)]) == 0
    out = capsys.readouterr().out
    assert "index    1.00" in out and "battery  30.0 of 60 Wh" in out and out.count("06-1") == 24
    assert "window   06:00-" in out  # the default job fits the morning sun
    assert main(["forecast", "--config", str(config), "--at", str(MIDNIGHT), "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert len(body["surplus_w"]) == 24 and body["battery_wh"] == 30.0
    plain = _write(tmp_path, _rendered(tmp_path))
    assert main(["forecast", "--config", str(plain)]) == 78  # no [solar]: a configuration error
    assert "no [solar] table" in capsys.readouterr().err


def test_the_coordinator_keeps_a_reported_forecast_as_a_line_and_its_rounds_select_by_it(tmp_path: Path) -> None:
    import base64

    from edge_agent import keys
    from edge_agent.coordinator.registry import Registry
    from edge_agent.coordinator.rounds import RoundEngine, RoundPolicy
    from edge_agent.coordinator.selection import FLAT_LIMIT, parse_flat_forecast

    now = [MIDNIGHT + 1 * H]
    fc = forecast_surplus(SITE, now=now[0], battery_wh=20.0, capacity_wh=60.0, floor_wh=15.0, load_w=1.0,
                          train_w=3.0, train_wh=6.0)
    line = forecast_state({"forecast": fc.to_state()})["forecast"]
    assert isinstance(line, str) and len(line) <= FLAT_LIMIT  # the registry keeps a device's state flat
    back = parse_flat_forecast(line)
    assert back.surplus_w() == pytest.approx(fc.surplus_w(), abs=0.051) and back.train_wh == fc.train_wh
    for bad in ("f1 1 2", "f2" + line[2:], line.replace(",", ";"), "x" * 300):
        with pytest.raises(InputError):
            parse_flat_forecast(bad)
    key = keys.generate_private_key()
    with Registry(state_dir=tmp_path, clock=lambda: now[0]) as reg:
        reg.add_model_version(name="m", version="1", head={"w": __import__("numpy").zeros((2, 2), "float32")})
        dev = reg.enrol_device(device_id=keys.fingerprint(key), public_key=base64.b64encode(
            keys.public_key_bytes(key)).decode(), fleet="f", approved=True)
        reg.record_state(dev.id, online=True, state={"battery_pct": 25.0, "on_power": False,
                                                     **forecast_state({"forecast": fc.to_state()})})
        engine = RoundEngine(registry=reg, policy=RoundPolicy(min_battery_pct=30.0, max_wait_s=1e6),
                             clock=lambda: now[0])
        late = engine.start_job(model_name="m", model_version="1", deadline_s=2 * H)  # ends 03:00: no sun
        assert engine.tick().opened == []
        assert "forecast: no surplus window before the deadline" in reg.get_job(late.id).reason
        engine.cancel_job(late.id)
        engine.start_job(model_name="m", model_version="1", deadline_s=13 * H)  # ends 14:00: its morning window
        (plan,) = engine.tick().opened  # below min_battery_pct now, but the forecast has its window
        assert plan.devices == (dev.id,)


def test_a_job_plans_on_a_fresh_forecast_and_a_stale_one_is_computed_again(tmp_path: Path) -> None:
    from edge_agent.agent.solar import FRESH_S, SolarPlanner, SolarSettings

    calls: list[float] = []

    def counting(request: dict[str, Any]) -> Any:
        calls.append(request["now"])
        return compute_request(request)

    settings = SolarSettings(site=SolarSite(52.0, 5.0, panel_w=20.0), capacity_wh=60.0, floor_pct=30.0,
                             load_w=1.0, train_w=3.0, train_wh=6.0, panel_sensor="none")
    battery = BatteryState(capacity_pct=50.0, status="Discharging", energy_j=None, source="test")
    planner = SolarPlanner(settings=settings, state_dir=tmp_path, sysfs_root=str(tmp_path), battery=lambda: battery,
                           compute=counting)
    assert planner.tick(MIDNIGHT) and calls == [MIDNIGHT]  # the hourly refresh
    first = planner.plan(now=MIDNIGHT + 600, energy_wh=None, power_cap_w=None, deadline=MIDNIGHT + 20 * H)
    assert first.window is not None and calls == [MIDNIGHT]  # ten minutes on: the same forecast plans it
    later = planner.plan(now=MIDNIGHT + FRESH_S + 60, energy_wh=None, power_cap_w=None, deadline=MIDNIGHT + 20 * H)
    assert later.window is not None and calls == [MIDNIGHT, MIDNIGHT + FRESH_S + 60]  # stale: computed again
