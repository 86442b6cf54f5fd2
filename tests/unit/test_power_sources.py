"""Power sources, battery gauge, thermal zones and energy integration, on real sysfs trees."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from edge_agent.power.battery import BatteryGauge, discover_battery
from edge_agent.power.energy import EnergyMeter, above_idle_j, integrate, interval_energy_j
from edge_agent.power.monitor import PowerMonitor
from edge_agent.power.sources import (
    CpuEstimateSource,
    HwmonInaSource,
    PowerSample,
    PowerSupplySource,
    RaplSource,
    cpu_power_model,
    discover_power_sources,
    parse_proc_stat_cpu,
)
from edge_agent.power.thermal import ThermalMonitor

HW = "sys/class/hwmon"
PS = "sys/class/power_supply"
RAPL = "sys/class/powercap/intel-rapl:0"


def put(root: Path, rel: str, text: str | bytes) -> Path:
    path = root / rel.lstrip("/")
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink() or path.is_file():
        path.unlink()
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def make_eio(root: Path, rel: str) -> None:
    """A node whose read() really fails with EIO, like an INA on a glitching I2C bus."""
    path = root / rel.lstrip("/")
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        path.unlink()
    os.symlink("/proc/self/mem", path)  # reading offset 0 of one's own memory is EIO


def make_dir(root: Path, rel: str) -> None:
    path = root / rel.lstrip("/")
    if path.is_file():
        path.unlink()
    path.mkdir(parents=True, exist_ok=True)


def proc_stat(busy: int, idle: int, iowait: int = 0) -> str:
    # user nice system idle iowait irq softirq steal guest guest_nice; guest is inside user
    return f"cpu  {busy} 0 0 {idle} {iowait} 0 0 0 {busy // 2} 0\ncpu0 {busy} 0 0 {idle} {iowait} 0 0 0 0 0\nintr 1\n"


# --- hwmon INA ----------------------------------------------------------------------------


def test_ina226_power1_input_is_microwatts_and_tagged(tmp_path: Path) -> None:
    put(tmp_path, f"{HW}/hwmon2/name", "ina226\n")
    put(tmp_path, f"{HW}/hwmon2/power1_input", "5123000\n")
    put(tmp_path, f"{HW}/hwmon0/name", "cpu_thermal\n")  # not a power monitor
    sources = discover_power_sources(tmp_path)
    assert [s.kind for s in sources] == ["hwmon-ina"]
    sample = sources[0].read(10.0)
    assert sample == PowerSample(t=10.0, watts=pytest.approx(5.123), source="ina226:hwmon2")
    assert not sample.averaged


def test_ina219_without_power_node_uses_bus_mv_times_current_ma(tmp_path: Path) -> None:
    put(tmp_path, f"{HW}/hwmon1/name", "ina219")
    put(tmp_path, f"{HW}/hwmon1/in0_input", "41")  # shunt voltage: must not be used
    put(tmp_path, f"{HW}/hwmon1/in1_input", "5100")
    put(tmp_path, f"{HW}/hwmon1/curr1_input", "-980")  # shunt wired backwards
    (source,) = discover_power_sources(tmp_path)
    assert source.read(0.0).watts == pytest.approx(5.1 * 0.98)


def test_ina260_and_old_kernel_device_subdirectory(tmp_path: Path) -> None:
    put(tmp_path, f"{HW}/hwmon3/device/name", "ina260")
    put(tmp_path, f"{HW}/hwmon3/device/power1_input", "7250000")
    (source,) = discover_power_sources(tmp_path)
    assert source.path.endswith("hwmon3/device")
    assert source.read(1.0).watts == pytest.approx(7.25)


def test_ina3221_has_no_power_node_and_uses_the_input_rail_channel(tmp_path: Path) -> None:
    d = f"{HW}/hwmon4"
    put(tmp_path, f"{d}/name", "ina3221")
    for ch, (label, mv, ma) in enumerate(
        [("POM_5V_GPU", 5000, 100), ("POM_5V_IN", 5080, 900), ("POM_5V_CPU", 5000, 300)], 1
    ):
        put(tmp_path, f"{d}/in{ch}_label", label)
        put(tmp_path, f"{d}/in{ch}_input", str(mv))
        put(tmp_path, f"{d}/curr{ch}_input", str(ma))
    (source,) = discover_power_sources(tmp_path)
    assert source.channels == (2,) and "POM_5V_IN" in source.detail()
    assert source.read(0.0).watts == pytest.approx(5.08 * 0.9)
    assert source.name == "ina3221:hwmon4/ch2"
    summed = HwmonInaSource(tmp_path, f"/{d}", chip="ina3221", channels=(1, 3))
    assert summed.read(0.0).watts == pytest.approx(0.5 + 1.5)


def test_ina3221_without_labels_skips_disabled_channels(tmp_path: Path) -> None:
    d = f"{HW}/hwmon5"
    put(tmp_path, f"{d}/name", "ina3221")
    put(tmp_path, f"{d}/in1_enable", "0")
    put(tmp_path, f"{d}/in2_input", "12000")
    put(tmp_path, f"{d}/curr2_input", "250")
    (source,) = discover_power_sources(tmp_path)
    assert source.channels == (2,) and "assumed" in source.detail()
    assert source.read(0.0).watts == pytest.approx(3.0)


def test_hwmon_node_raising_eio_falls_back_to_volts_times_amps(tmp_path: Path) -> None:
    d = f"{HW}/hwmon2"
    put(tmp_path, f"{d}/name", "ina226")
    make_eio(tmp_path, f"{d}/power1_input")
    put(tmp_path, f"{d}/in1_input", "5000")
    put(tmp_path, f"{d}/curr1_input", "1200")
    (source,) = discover_power_sources(tmp_path)
    assert source.read(0.0).watts == pytest.approx(6.0)
    assert any("EIO" in p for p in source.nodes.recent_problems)


@pytest.mark.parametrize(
    "power, volts, amps",
    [
        ("dir", "dir", "1000"),  # directories where files are expected
        ("garbage\n", "\x00\xff\xfe", "12"),  # junk text and binary junk
        ("99999999999999", "eio", "eio"),  # 100 MW, then I2C errors
        ("-5000000", "", "1000"),  # negative power, empty voltage
    ],
)
def test_unreadable_or_garbage_ina_gives_none_and_records_why(
    tmp_path: Path, power: str, volts: str, amps: str
) -> None:
    d = f"{HW}/hwmon2"
    put(tmp_path, f"{d}/name", "ina226")
    for node, value in (("power1_input", power), ("in1_input", volts), ("curr1_input", amps)):
        if value == "dir":
            make_dir(tmp_path, f"{d}/{node}")
        elif value == "eio":
            make_eio(tmp_path, f"{d}/{node}")
        else:
            put(tmp_path, f"{d}/{node}", value.encode("latin-1"))
    (source,) = discover_power_sources(tmp_path)
    for _ in range(3):
        assert source.read(0.0) is None
    assert source.nodes.problem_count >= 3 and source.last_reason


def test_problem_log_stays_bounded_over_a_long_run(tmp_path: Path) -> None:
    put(tmp_path, f"{HW}/hwmon2/name", "ina226")
    put(tmp_path, f"{HW}/hwmon2/power1_input", "garbage")
    (source,) = discover_power_sources(tmp_path)
    for i in range(500):
        source.read(float(i))
    assert source.nodes.problem_count >= 500
    assert len(source.nodes.recent_problems) <= 20


# --- power_supply -------------------------------------------------------------------------


def battery(root: Path, name: str = "BAT0", **nodes: str) -> str:
    base = f"{PS}/{name}"
    put(root, f"{base}/type", "Battery")
    for key, value in nodes.items():
        put(root, f"{base}/{key}", value)
    return f"/{base}"


def test_discharging_battery_power_now_is_the_load(tmp_path: Path) -> None:
    battery(tmp_path, status="Discharging", power_now="-4200000", capacity="81")
    (source,) = discover_power_sources(tmp_path)
    assert source.kind == "power-supply"
    sample = source.read(3.0)
    assert sample.watts == pytest.approx(4.2) and sample.source == "battery:BAT0"


def test_battery_voltage_times_current_when_no_power_now(tmp_path: Path) -> None:
    path = battery(tmp_path, status="Discharging", voltage_now="3700000", current_now="-1000000")
    assert PowerSupplySource(tmp_path, path).read(0.0).watts == pytest.approx(3.7)


def test_charging_battery_reports_no_load_so_the_monitor_falls_back(tmp_path: Path) -> None:
    path = battery(tmp_path, status="Charging", power_now="9000000", capacity="50")
    put(tmp_path, "proc/stat", proc_stat(busy=100, idle=300))
    source = PowerSupplySource(tmp_path, path)
    assert source.read(0.0) is None and "Charging" in source.last_reason
    monitor = PowerMonitor.discover(tmp_path, idle_w=2.0, load_w=6.0)
    assert [s.kind for s in monitor.sources] == ["power-supply", "cpu-estimate"]
    sample = monitor.read(0.0)
    assert sample.source == "cpu-estimate" and sample.watts == pytest.approx(2.0 + 4.0 * 0.25)


def test_energy_now_differences_when_the_gauge_has_nothing_else(tmp_path: Path) -> None:
    path = battery(tmp_path, status="Discharging", energy_now="10000000")  # 10 Wh in uWh
    source = PowerSupplySource(tmp_path, path)
    assert source.read(0.0) is None  # needs a previous reading
    put(tmp_path, f"{path}/energy_now", "9990000")  # 10 mWh = 36 J later
    sample = source.read(12.0)
    assert sample.interval_j == pytest.approx(36.0) and sample.since_t == 0.0
    assert sample.watts == pytest.approx(3.0)
    put(tmp_path, f"{path}/energy_now", "9999000")  # went up: charged, not a load figure
    assert source.read(24.0) is None


def test_battery_gauge_reads_capacity_and_status_and_rejects_garbage(tmp_path: Path) -> None:
    battery(tmp_path, "hidpp_battery_0", scope="Device", capacity="90")  # a mouse
    put(tmp_path, f"{PS}/AC/type", "Mains")
    path = battery(tmp_path, "BAT1", capacity="57", status="Discharging", energy_now="5000000")
    gauge = discover_battery(tmp_path)
    assert gauge is not None and gauge.path == path
    state = gauge.read()
    assert (state.capacity_pct, state.status, state.charging) == (57.0, "Discharging", False)
    assert state.energy_j == pytest.approx(5 * 3600)
    for capacity, expected in (("103", 100.0), ("abc", None), ("250", None), ("-3", None)):
        put(tmp_path, f"{path}/capacity", capacity)
        result = gauge.read()
        assert (result.capacity_pct if result else None) == expected
    put(tmp_path, f"{path}/capacity", "40")
    put(tmp_path, f"{path}/status", "Exploding")
    assert gauge.read().status is None
    make_eio(tmp_path, f"{path}/capacity")
    assert BatteryGauge(tmp_path, path).read() is None


# --- RAPL ---------------------------------------------------------------------------------


def test_rapl_counter_differences_and_wraparound(tmp_path: Path) -> None:
    put(tmp_path, f"{RAPL}/name", "package-0")
    put(tmp_path, f"{RAPL}/max_energy_range_uj", "262143328850")
    put(tmp_path, f"{RAPL}/energy_uj", "262143000000")
    put(tmp_path, "sys/class/powercap/intel-rapl:0:0/energy_uj", "5")  # a subzone: not summed
    (source,) = discover_power_sources(tmp_path)
    assert source.kind == "rapl" and source.zones == ["/sys/class/powercap/intel-rapl:0"]
    assert source.read(100.0) is None  # primes
    put(tmp_path, f"{RAPL}/energy_uj", "171150")  # wrapped: 328850 + 171150 uJ = 0.5 J
    sample = source.read(100.5)
    assert sample.interval_j == pytest.approx(0.5) and sample.watts == pytest.approx(1.0)
    assert sample.since_t == 100.0
    put(tmp_path, f"{RAPL}/energy_uj", "20171150")
    assert source.read(101.5).watts == pytest.approx(20.0)


def test_rapl_without_range_or_with_garbage_resyncs_instead_of_crashing(tmp_path: Path) -> None:
    put(tmp_path, f"{RAPL}/energy_uj", "5000000")
    source = RaplSource(tmp_path, ["/sys/class/powercap/intel-rapl:0"])
    source.read(0.0)
    put(tmp_path, f"{RAPL}/energy_uj", "1000")  # backwards, range unknown
    assert source.read(1.0) is None
    put(tmp_path, f"{RAPL}/energy_uj", "not a number")
    assert source.read(2.0) is None
    put(tmp_path, f"{RAPL}/energy_uj", "2001000")
    assert source.read(3.0) is None  # re-primes after the garbage
    put(tmp_path, f"{RAPL}/energy_uj", "999999999999")  # a jump of ~1 MJ in a second
    assert source.read(4.0) is None and "implausible" in source.last_reason
    put(tmp_path, f"{RAPL}/energy_uj", "1000002000000")
    assert source.read(6.0).watts == pytest.approx(1.0)


# --- CPU estimate -------------------------------------------------------------------------


def test_proc_stat_parsing() -> None:
    assert parse_proc_stat_cpu(proc_stat(busy=300, idle=600, iowait=100)) == (1000, 700)
    assert parse_proc_stat_cpu("cpu0 1 2 3 4\n") is None  # no aggregate line
    assert parse_proc_stat_cpu("cpu  1 2 x 4\n") is None
    assert parse_proc_stat_cpu("cpu  1 2\n") is None
    assert cpu_power_model(0.5, 2.7, 6.4) == pytest.approx(4.55)
    assert cpu_power_model(1.7, 2.7, 6.4) == pytest.approx(6.4)


def test_cpu_estimate_from_jiffy_deltas(tmp_path: Path) -> None:
    put(tmp_path, "proc/stat", proc_stat(busy=1000, idle=9000))
    source = CpuEstimateSource(tmp_path, idle_w=2.7, load_w=6.4)
    first = source.read(50.0)
    assert first.watts == pytest.approx(2.7 + 3.7 * 0.1) and not first.averaged  # since boot
    put(tmp_path, "proc/stat", proc_stat(busy=1300, idle=9100))  # 300 busy of 400: 75 %
    sample = source.read(52.0)
    assert sample.watts == pytest.approx(2.7 + 3.7 * 0.75)
    assert sample.interval_j == pytest.approx(sample.watts * 2.0) and sample.since_t == 50.0
    put(tmp_path, "proc/stat", proc_stat(busy=10, idle=10))  # counters reset: garbage
    assert source.read(54.0) is None
    put(tmp_path, "proc/stat", b"\xff\xfe garbage")
    assert source.read(56.0) is None


@pytest.mark.parametrize(
    "idle_w, load_w", [(6.4, 2.7), (-1.0, 3.0), (float("nan"), 3.0), (2.0, float("inf"))]
)
def test_cpu_estimate_rejects_inconsistent_board_watts(
    tmp_path: Path, idle_w: float, load_w: float
) -> None:
    with pytest.raises(ValueError, match="idle_w"):
        CpuEstimateSource(tmp_path, idle_w=idle_w, load_w=load_w)


# --- discovery and the monitor ------------------------------------------------------------


def full_tree(root: Path) -> None:
    put(root, f"{HW}/hwmon1/name", "ina219")
    put(root, f"{HW}/hwmon1/power1_input", "4000000")
    battery(root, status="Discharging", power_now="4500000", capacity="70")
    put(root, f"{RAPL}/energy_uj", "1000")
    put(root, "proc/stat", proc_stat(busy=10, idle=30))


def test_discovery_order_and_descriptions(tmp_path: Path) -> None:
    full_tree(tmp_path)
    sources = discover_power_sources(tmp_path, idle_w=2.7, load_w=6.4)
    assert [s.kind for s in sources] == ["hwmon-ina", "power-supply", "rapl", "cpu-estimate"]
    assert [s.kind for s in discover_power_sources(tmp_path)] == [
        "hwmon-ina",
        "power-supply",
        "rapl",
    ]
    rows = PowerMonitor.discover(tmp_path, idle_w=2.7, load_w=6.4).describe()
    assert [r.get("rank") for r in rows] == [1, 2, 3, 4, None]
    assert rows[-1]["kind"] == "battery"
    assert all(r["detail"] for r in rows)
    assert discover_power_sources(tmp_path / "nothing-here") == []


def test_monitor_falls_back_in_order_and_tags_each_sample(tmp_path: Path) -> None:
    full_tree(tmp_path)
    monitor = PowerMonitor.discover(tmp_path, idle_w=2.7, load_w=6.4)
    assert monitor.idle_w == 2.7
    assert monitor.read(0.0).source == "ina219:hwmon1"
    make_dir(tmp_path, f"{HW}/hwmon1/power1_input")
    assert monitor.read(1.0).source == "battery:BAT0"
    put(tmp_path, f"{PS}/BAT0/status", "Charging")
    put(tmp_path, f"{RAPL}/energy_uj", "3001000")
    sample = monitor.read(2.0)
    assert sample.source == "rapl:intel-rapl:0"  # counter read at every sample, so aligned
    assert sample.interval_j == pytest.approx(3.0) and sample.since_t == 1.0
    put(tmp_path, f"{RAPL}/energy_uj", "junk")
    assert monitor.read(3.0).source == "cpu-estimate"
    assert set(monitor.problems()) == {"ina219:hwmon1", "rapl:intel-rapl:0"}


# --- thermal ------------------------------------------------------------------------------


def test_thermal_hottest_plausible_zone(tmp_path: Path) -> None:
    base = "sys/class/thermal"
    for zone, kind, temp in (
        ("thermal_zone0", "cpu-thermal", "61234"),
        ("thermal_zone1", "gpu-thermal", "58000"),
        ("thermal_zone2", "broken", "-273150"),  # sensor off
        ("thermal_zone3", "junk", "hot"),
    ):
        put(tmp_path, f"{base}/{zone}/type", kind)
        put(tmp_path, f"{base}/{zone}/temp", temp)
    put(tmp_path, f"{base}/cooling_device0/type", "fan")  # not a zone
    monitor = ThermalMonitor(tmp_path)
    assert monitor.zones == ["thermal_zone0", "thermal_zone1", "thermal_zone2", "thermal_zone3"]
    reading = monitor.read()
    assert reading.max_c == pytest.approx(61.234) and reading.zone == "thermal_zone0 (cpu-thermal)"
    assert len(reading.zones) == 2 and monitor.nodes.problem_count == 2
    make_eio(tmp_path, f"{base}/thermal_zone0/temp")
    make_dir(tmp_path, f"{base}/thermal_zone1/temp")
    assert monitor.read() is None
    assert ThermalMonitor(tmp_path / "empty").read() is None


# --- energy integration -------------------------------------------------------------------


def s(t: float, w: float, **kw: object) -> PowerSample:
    return PowerSample(t=t, watts=w, source=str(kw.pop("source", "x")), **kw)  # type: ignore[arg-type]


def test_trapezoid_hold_end_and_counter_rules() -> None:
    assert interval_energy_j(s(0, 2.0), s(10, 4.0)) == pytest.approx(30.0)
    assert interval_energy_j(s(0, 2.0), s(10, 4.0), hold_end=True) == pytest.approx(40.0)
    exact = s(10, 999.0, interval_j=12.5, since_t=0.0)
    assert interval_energy_j(s(0, 2.0), exact) == pytest.approx(12.5)  # the counter wins
    stale = s(10, 3.0, interval_j=60.0, since_t=-10.0)  # average over a longer interval
    assert interval_energy_j(s(0, 2.0), stale) == pytest.approx(30.0)
    assert interval_energy_j(s(5, 2.0), s(5, 4.0)) == 0.0
    assert above_idle_j(30.0, 10.0, 2.7) == pytest.approx(3.0)
    assert above_idle_j(20.0, 10.0, 2.7) == 0.0
    total, job = integrate([s(0, 3.0), s(2, 3.0), s(4, 5.0)], idle_w=3.0)
    assert (total, job) == (pytest.approx(14.0), pytest.approx(2.0))


def test_energy_meter_baseline_peak_and_failures() -> None:
    meter = EnergyMeter()
    meter.add(s(0, 2.5, source="a"))
    assert meter.idle_w == 2.5 and "baseline" in meter.idle_from
    meter.add(None)
    meter.add(None)
    assert meter.consecutive_failures == 2 and meter.failed_reads == 2
    meter.add(s(4, 6.5, source="b"), hold_end=True)  # the gap is integrated once a reading returns
    assert meter.total_j == pytest.approx(26.0) and meter.job_j == pytest.approx(16.0)
    assert meter.consecutive_failures == 0 and meter.peak_w == 6.5
    meter.add(s(5, 2.5, source="a"))
    assert meter.seconds_by_source == {"b": 4.0, "a": 1.0} and meter.main_source == "b"


def test_energy_meter_counts_a_counters_first_interval_only_if_primed_after_start() -> None:
    meter = EnergyMeter(idle_w=2.0, start_t=100.0)
    meter.add(s(102.0, 5.0, interval_j=10.0, since_t=100.0))  # primed when metering began
    assert meter.total_j == pytest.approx(10.0) and meter.job_j == pytest.approx(6.0)
    late = EnergyMeter(idle_w=2.0, start_t=100.0)
    late.add(s(102.0, 5.0, interval_j=500.0, since_t=0.0))  # covers time before the job
    assert late.total_j == 0.0 and late.last is not None
