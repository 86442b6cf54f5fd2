"""Budget validation, budget arithmetic, and the governor driving a simulated device.

`World` is a Raspberry Pi-like device made of real sysfs/procfs files under tmp_path. The
test's ManualClock moves time: `clock.advance(s)` is the trainer computing (busy power),
`clock.sleep(s)` is the governor idling (idle power). After each move the world accrues
its true energy, drains or charges its battery, heats or cools, and rewrites its files;
the governor only ever sees the files.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest

from edge_agent.errors import ConfigError, InputError
from edge_agent.power import (
    Budget,
    BudgetGovernor,
    Decision,
    ManualClock,
    PauseReason,
    PowerMonitor,
    StopReason,
    ThermalMonitor,
    parse_window,
)
from edge_agent.power.battery import discover_battery
from edge_agent.power.budget import duty_cycle_sleep, predict_step, suggest_threads, would_exceed
from edge_agent.power.sources import discover_power_sources

IDLE_W = 2.7
PER_THREAD_W = 0.925  # 4 threads: 6.4 W, a Raspberry Pi 4 under full load
NCPU = 4
HZ = 100
RAPL_RANGE_UJ = 1_000_000_000


class World:
    """A simulated board whose sensor files follow its true state over (manual) time."""

    def __init__(
        self,
        root: Path,
        clock: ManualClock,
        *,
        per_thread_w: float = PER_THREAD_W,
        threads: int = NCPU,
        battery_wh: float = 20.0,
        battery_pct: float = 90.0,
        solar_w: Callable[[float], float] = lambda epoch: 0.0,
        temp_c: float = 45.0,
        ambient_c: float = 45.0,
        c_per_w: float = 8.0,
        tau_s: float = 60.0,
        rapl: bool = True,
    ) -> None:
        self.root, self.clock = root, clock
        self.per_thread_w, self.threads = per_thread_w, threads
        self.capacity_wh, self.stored_wh = battery_wh, battery_wh * battery_pct / 100
        self.solar_w = solar_w
        self.temp_c, self.ambient_c, self.c_per_w, self.tau_s = temp_c, ambient_c, c_per_w, tau_s
        self.busy = False
        self.background_w = 0.0  # another process's load, busy or not
        self.true_total_j = self.true_job_j = 0.0
        self.busy_s = self.elapsed_s = 0.0
        self.busy_jiffies = 0.0
        self.idle_jiffies = 100_000.0
        self.rapl_uj = RAPL_RANGE_UJ - 3_000_000  # wraps early in every run
        self.broken: set[str] = set()  # nodes the test has replaced with broken ones
        if not rapl:  # an ARM board: no powercap tree at all
            self.broken |= {
                f"sys/class/powercap/intel-rapl:0/{n}" for n in ("energy_uj", "max_energy_range_uj")
            }
        self.written: dict[str, str] = {}  # rewrite only what changed: file I/O dominates
        self.min_pct_while_busy = 100.0
        self.max_temp_while_busy = temp_c
        clock.on_advance(self.on_advance)
        self.write()

    @property
    def power_w(self) -> float:
        return IDLE_W + self.background_w + (self.per_thread_w * self.threads if self.busy else 0.0)

    @property
    def pct(self) -> float:
        return 100.0 * self.stored_wh / self.capacity_wh

    @property
    def charging(self) -> bool:
        return self.solar_w(self.clock.now()) > 0

    def on_advance(self, dt: float, sleeping: bool) -> None:
        self.busy = not sleeping
        power = self.power_w
        self.true_total_j += power * dt
        self.true_job_j += (power - IDLE_W) * dt
        self.elapsed_s += dt
        if self.busy:
            self.busy_s += dt
            self.min_pct_while_busy = min(self.min_pct_while_busy, self.pct)
            self.busy_jiffies += dt * HZ * self.threads
            self.idle_jiffies += dt * HZ * (NCPU - self.threads)
        else:
            self.idle_jiffies += dt * HZ * NCPU
        self.rapl_uj = (self.rapl_uj + power * dt * 1e6) % RAPL_RANGE_UJ
        net_w = self.solar_w(self.clock.now()) - power
        self.stored_wh = min(self.capacity_wh, max(0.0, self.stored_wh + net_w * dt / 3600))
        target = self.ambient_c + self.c_per_w * (power - IDLE_W)
        self.temp_c = target + (self.temp_c - target) * math.exp(-dt / self.tau_s)
        if self.busy:
            self.max_temp_while_busy = max(self.max_temp_while_busy, self.temp_c)
        self.write()

    def put(self, rel: str, value: object) -> None:
        text = f"{value}\n"
        if rel in self.broken or self.written.get(rel) == text:
            return
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        self.written[rel] = text

    def write(self) -> None:
        watts = self.power_w
        self.put("sys/class/hwmon/hwmon0/name", "ina226")
        self.put("sys/class/hwmon/hwmon0/power1_input", round(watts * 1e6))
        self.put("sys/class/hwmon/hwmon0/in1_input", 5100)
        self.put("sys/class/hwmon/hwmon0/curr1_input", round(watts / 5.1 * 1000))
        bat = "sys/class/power_supply/BAT0"
        self.put(f"{bat}/type", "Battery")
        self.put(f"{bat}/status", "Charging" if self.charging else "Discharging")
        self.put(f"{bat}/capacity", round(self.pct))
        self.put(f"{bat}/energy_now", round(self.stored_wh * 1e6))
        net = self.solar_w(self.clock.now()) - watts if self.charging else -watts
        self.put(f"{bat}/power_now", round(net * 1e6))
        self.put("sys/class/powercap/intel-rapl:0/max_energy_range_uj", RAPL_RANGE_UJ)
        self.put("sys/class/powercap/intel-rapl:0/energy_uj", int(self.rapl_uj))
        self.put("sys/class/thermal/thermal_zone0/type", "cpu-thermal")
        self.put("sys/class/thermal/thermal_zone0/temp", round(self.temp_c * 1000))
        busy, idle = int(self.busy_jiffies), int(self.idle_jiffies)
        self.put(
            "proc/stat", f"cpu  {busy} 0 0 {idle} 0 0 0 0 0 0\ncpu0 {busy} 0 0 {idle} 0 0 0 0 0 0"
        )

    def break_node(self, rel: str, how: str) -> None:
        path = self.root / rel
        path.unlink()
        self.broken.add(rel)
        if how == "dir":
            path.mkdir()
        elif how == "eio":
            os.symlink("/proc/self/mem", path)  # read() fails with EIO
        else:
            path.write_text(how)


def monitor_for(root: Path, kind: str) -> PowerMonitor:
    sources = discover_power_sources(root, idle_w=IDLE_W, load_w=IDLE_W + NCPU * PER_THREAD_W)
    if kind != "all":
        sources = [s for s in sources if s.kind == kind]
        assert sources, kind
    return PowerMonitor(sources, battery=discover_battery(root), idle_w=IDLE_W)


def make(
    tmp_path: Path,
    budget: Budget,
    *,
    kind: str = "hwmon-ina",
    start: datetime | None = None,
    max_threads: int = NCPU,
    poll_s: float = 30.0,
    broken: dict[str, str] | None = None,
    **world_kw: object,
) -> tuple[BudgetGovernor, World, ManualClock]:
    clock = ManualClock(start_epoch=(start or datetime(2024, 6, 1, 12, 0)).timestamp())
    world = World(tmp_path, clock, **world_kw)  # type: ignore[arg-type]
    for rel, how in (broken or {}).items():
        world.break_node(rel, how)
    gov = BudgetGovernor(
        budget=budget,
        sources=monitor_for(tmp_path, kind),
        thermal=ThermalMonitor(tmp_path),
        clock=clock,
        max_threads=max_threads,
        poll_s=poll_s,
    )
    return gov, world, clock


class Trainer:
    """The loop a real trainer runs, recording what the governor said."""

    def __init__(
        self,
        gov: BudgetGovernor,
        world: World,
        clock: ManualClock,
        *,
        step_s: float = 2.0,
        follow_threads: bool = False,
    ) -> None:
        self.gov, self.world, self.clock = gov, world, clock
        self.step_s, self.follow_threads = step_s, follow_threads
        self.decisions: list[Decision] = []
        self.checkpoints = 0
        self.resumed_at: list[tuple[float, float, float]] = []  # (epoch, battery %, temp C)
        self.advice = []

    def run(self, max_steps: int = 5000) -> Decision:
        for _ in range(max_steps):
            decision = self.gov.before_step()
            if decision.paused:
                self.decisions.append(decision)
                self.checkpoints += 1
                decision = self.gov.wait_until_resumable()
                if decision.proceed:
                    self.resumed_at.append((self.clock.now(), self.world.pct, self.world.temp_c))
            if decision.stopped:
                self.decisions.append(decision)
                return decision
            self.clock.advance(self.step_s)
            advice = self.gov.after_step(self.step_s, threads_used=self.world.threads)
            self.advice.append(advice)
            if self.follow_threads:
                self.world.threads = advice.threads
        raise AssertionError("the governor never stopped the job")


# --- Budget validation ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"budget_wh": -1.0}, "budget_wh: must be > 0"),
        ({"budget_wh": float("nan")}, "budget_wh: must be finite"),
        ({"budget_wh": True}, "budget_wh: expected a number"),
        ({"budget_wh": "5"}, "budget_wh: expected a number"),
        ({"power_cap_w": 0}, "power_cap_w: must be > 0"),
        ({"power_cap_w": float("inf")}, "power_cap_w: must be finite"),
        ({"battery_floor_pct": 50, "battery_resume_pct": 40}, "must be below battery_resume_pct"),
        ({"battery_floor_pct": 50, "battery_resume_pct": 50}, "must be below battery_resume_pct"),
        ({"battery_floor_pct": 100}, "must be below battery_resume_pct"),
        ({"battery_floor_pct": 101}, "battery_floor_pct: must be <= 100"),
        ({"battery_resume_pct": 40}, "needs battery_floor_pct"),
        ({"thermal_limit_c": -5}, "thermal_limit_c: must be > 0"),
        ({"thermal_limit_c": 80, "thermal_margin_c": 0}, "thermal_margin_c: must be > 0"),
        ({"budget_basis": "joules"}, "budget_basis"),
        ({"window": "25:00-06:00"}, "not a valid time"),
        ({"window": "6-18"}, "HH:MM-HH:MM"),
        ({"window": "06:00-06:00"}, "empty window"),
        ({"window": 630}, "window"),
        ({"deadline": "2024-06-01T18:00:00"}, "no timezone"),
        ({"deadline": "tomorrow"}, "neither epoch seconds nor ISO 8601"),
        ({"deadline": -3}, "deadline: must be > 0"),
    ],
)
def test_budget_rejects_bad_values_with_the_key_named(
    kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        Budget(**kwargs)  # type: ignore[arg-type]


def test_budget_is_keyword_only_and_defaults_resume_above_floor() -> None:
    with pytest.raises(TypeError):
        Budget(5.0)  # type: ignore[misc]
    assert Budget(battery_floor_pct=30).battery_resume_pct == 40.0
    assert Budget(battery_floor_pct=95).battery_resume_pct == 100.0
    assert Budget().budget_j is None and Budget(budget_wh=2).budget_j == 7200.0


def test_budget_from_config_dict() -> None:
    budget = Budget.from_config(
        {
            "budget_wh": 5,
            "power_cap_w": 4.5,
            "battery_floor_pct": 30,
            "battery_resume_pct": 45,
            "thermal_limit_c": 75,
            "thermal_margin_c": 8,
            "window": "22:00-06:00",
            "deadline": "2024-06-01T18:00:00Z",
        }
    )
    assert budget.budget_wh == 5.0 and budget.power_cap_w == 4.5
    assert budget.deadline == datetime(2024, 6, 1, 18, tzinfo=UTC).timestamp()
    assert str(budget.window) == "22:00-06:00"
    assert Budget.from_config(budget.to_config()) == budget
    assert Budget.from_config({"deadline": 1717264800}).deadline == 1717264800.0
    with pytest.raises(ConfigError, match="unknown key.*budget_kwh"):
        Budget.from_config({"budget_kwh": 1})
    with pytest.raises(ConfigError, match="expected a table"):
        Budget.from_config(["budget_wh", 5])  # type: ignore[arg-type]


def test_window_wraps_midnight_and_finds_the_next_opening() -> None:
    night = parse_window("22:00-06:00")
    assert [night.contains_minute(m) for m in (21 * 60 + 59, 22 * 60, 0, 5 * 60 + 59, 6 * 60)] == [
        False,
        True,
        True,
        True,
        False,
    ]
    solar = parse_window(" 06:30 - 18:00 ")
    at = datetime(2024, 6, 1, 5, 0)
    assert solar.seconds_until_open(at.timestamp()) == pytest.approx(90 * 60)
    assert solar.seconds_until_open(datetime(2024, 6, 1, 12, 0).timestamp()) == 0.0
    after = datetime(2024, 6, 1, 18, 0).timestamp()
    assert solar.seconds_until_open(after) == pytest.approx(12.5 * 3600)
    utc = parse_window("06:00-07:00")
    noon_utc = datetime(2024, 6, 1, 12, tzinfo=UTC).timestamp()
    assert utc.seconds_until_open(noon_utc, UTC) == pytest.approx(18 * 3600)
    assert utc.contains(noon_utc, timezone(timedelta(hours=-6)))


# --- budget arithmetic ------------------------------------------------------------------------


def test_duty_cycle_sleep_holds_the_average_at_the_cap() -> None:
    gap = duty_cycle_sleep(step_j=12.8, step_s=2.0, cap_w=4.0, idle_w=2.7)
    assert (12.8 + 2.7 * gap) / (2.0 + gap) == pytest.approx(4.0)
    assert duty_cycle_sleep(step_j=7.0, step_s=2.0, cap_w=4.0, idle_w=2.7) == 0.0
    assert math.isinf(duty_cycle_sleep(step_j=12.8, step_s=2.0, cap_w=2.5, idle_w=2.7))


def test_thread_suggestion_fits_the_cap_ramps_slowly_and_sheds_heat() -> None:
    common = {"max_threads": 4, "idle_w": 2.7, "cap_w": 4.0}
    assert suggest_threads(current=4, step_w=6.4, **common) == 1  # 0.925 W/thread, 1.3 W headroom
    assert suggest_threads(current=1, step_w=3.0, **common) == 2  # room for 4, but +1 per step
    assert suggest_threads(current=3, step_w=None, max_threads=4, idle_w=None, cap_w=None) == 4
    hot = {"temp_c": 66.0, "thermal_limit_c": 70.0, "thermal_margin_c": 5.0}
    assert suggest_threads(current=4, step_w=6.4, max_threads=4, idle_w=2.7, cap_w=None, **hot) == 3
    assert suggest_threads(current=1, step_w=6.4, max_threads=4, idle_w=2.7, cap_w=None, **hot) == 1


def test_overshoot_prediction() -> None:
    assert not would_exceed(700.0, 7.4, 720.0)
    assert would_exceed(715.0, 7.4, 720.0)
    assert predict_step(None, None) == 0.0
    assert predict_step(7.0, 9.0) == 9.0


# --- the governor on a simulated device ---------------------------------------------------------


@pytest.mark.parametrize("kind", ["hwmon-ina", "rapl", "cpu-estimate", "power-supply"])
def test_budget_exhausted_within_five_percent_for_every_source(tmp_path: Path, kind: str) -> None:
    budget = Budget(budget_wh=0.1)  # 360 J above idle; a step adds 7.4 J (2 %)
    gov, world, clock = make(tmp_path, budget, kind=kind)
    final = Trainer(gov, world, clock).run()
    assert final.reason is StopReason.BUDGET_EXHAUSTED
    report = gov.report()
    assert 0.95 * 0.1 <= report["energy_wh_job"] <= 0.1
    assert 0.95 * 360 <= world.true_job_j <= 360 * 1.001  # the device really spent it
    assert report["energy_wh_total"] == pytest.approx(world.true_total_j / 3600, rel=0.01)
    assert report["source"].startswith(
        {"hwmon-ina": "ina226", "rapl": "rapl", "cpu-estimate": "cpu", "power-supply": "battery"}[
            kind
        ]
    )
    assert report["peak_w"] == pytest.approx(6.4, rel=0.01)
    assert report["stop_reason"] == "budget-exhausted"


def test_total_basis_counts_idle_energy_too(tmp_path: Path) -> None:
    gov, world, clock = make(tmp_path, Budget(budget_wh=0.2, budget_basis="total"))
    Trainer(gov, world, clock).run()
    report = gov.report()
    assert 0.95 * 0.2 <= report["energy_wh_total"] <= 0.2
    assert world.true_total_j == pytest.approx(report["energy_wh_total"] * 3600, rel=0.01)
    assert report["energy_wh_job"] < report["energy_wh_total"]


def test_power_cap_by_duty_cycling(tmp_path: Path) -> None:
    gov, world, clock = make(
        tmp_path, Budget(budget_wh=0.1, power_cap_w=4.0), max_threads=1, per_thread_w=3.7, threads=1
    )
    trainer = Trainer(gov, world, clock)
    trainer.run()
    average = world.true_total_j / world.elapsed_s
    assert 3.9 <= average <= 4.0 * 1.01
    expected_gap = (6.4 - 4.0) * 2.0 / (4.0 - IDLE_W)
    assert trainer.advice[5].sleep_s == pytest.approx(expected_gap, rel=0.01)
    assert gov.report()["duty_sleep_s"] == pytest.approx(world.elapsed_s - world.busy_s, rel=0.01)
    assert gov.report()["avg_w"] == pytest.approx(average, rel=0.01)


def test_background_load_above_the_cap_does_not_abort_the_job(tmp_path: Path) -> None:
    budget = Budget(power_cap_w=4.0)
    gov, world, clock = make(tmp_path, budget, max_threads=1, per_thread_w=3.7, threads=1)
    for step in range(8):
        if step == 3:
            world.background_w = 2.0  # the board now idles at 4.7 W, above the cap
        assert gov.before_step().proceed
        clock.advance(2.0)
        advice = gov.after_step(2.0)
    # the gap is sized against idle power: the job holds its own share of the cap
    assert advice.sleep_s == pytest.approx((8.4 - 4.0) * 2.0 / (4.0 - IDLE_W), rel=0.01)
    assert gov.report()["stop_reason"] is None


def test_power_cap_by_thread_count(tmp_path: Path) -> None:
    gov, world, clock = make(tmp_path, Budget(budget_wh=0.03, power_cap_w=4.0))
    trainer = Trainer(gov, world, clock, follow_threads=True)
    trainer.run()
    assert trainer.advice[0].threads == 1 and trainer.advice[0].sleep_s > 0  # first step was hot
    assert all(a.threads == 1 and a.sleep_s == 0 for a in trainer.advice[1:])
    assert world.true_total_j / world.elapsed_s <= 4.0


def test_battery_drains_pauses_and_resumes_when_solar_returns(tmp_path: Path) -> None:
    start = datetime(2024, 6, 1, 5, 0)
    sunrise = (start + timedelta(minutes=30)).timestamp()
    budget = Budget(budget_wh=0.3, battery_floor_pct=30, battery_resume_pct=45)
    solar = {"solar_w": lambda t: 10.0 if t >= sunrise else 0.0}
    gov, world, clock = make(tmp_path, budget, kind="all", start=start, battery_pct=31.5, **solar)
    trainer = Trainer(gov, world, clock, step_s=4.0)
    trainer.run()
    pause = trainer.decisions[0]
    assert pause.paused and pause.reason is PauseReason.BATTERY_LOW
    assert pause.resume.battery_pct == 45 and "floor 30" in pause.detail
    assert trainer.checkpoints == 1
    resumed_epoch, resumed_pct, _ = trainer.resumed_at[0]
    assert resumed_epoch >= sunrise and resumed_pct >= 44.5
    assert world.min_pct_while_busy > 29.5  # never trained below the floor
    report = gov.report()
    assert report["pause_count"] == 1 and report["pauses_by_reason"] == {"battery-low": 1}
    assert report["pause_s"] >= sunrise - start.timestamp() - 400
    assert {"battery:BAT0", "ina226:hwmon0"} & set(report["source_seconds"])
    assert report["stop_reason"] == "budget-exhausted"
    assert 0.95 <= report["energy_wh_job"] / 0.3 <= 1.0


def test_waiting_out_a_pause_costs_the_job_nothing(tmp_path: Path) -> None:
    # The first poll after a busy step used to be integrated as a trapezoid from the step's
    # busy reading: half a poll interval of training power charged for idling (34 J per
    # pause at the default 30 s poll on this board).
    budget = Budget(budget_wh=1.0, battery_floor_pct=30, battery_resume_pct=40)
    gov, world, clock = make(tmp_path, budget, battery_pct=80.0)
    assert gov.before_step().proceed
    clock.advance(2.0)
    gov.after_step(2.0)
    used = gov.state()["energy_j_job"]
    assert used == pytest.approx(world.true_job_j, rel=0.01) and used > 1.0
    world.stored_wh = world.capacity_wh * 0.25
    world.write()
    assert gov.before_step().paused
    assert gov.wait_until_resumable(max_wait_s=300.0).paused  # ten polls of 30 s, all idle
    assert clock.monotonic() - 1000.0 == pytest.approx(302.0)
    assert gov.state()["energy_j_job"] == pytest.approx(used, abs=1e-6) == pytest.approx(world.true_job_j)


def test_battery_fuel_gauge_while_charging_falls_back_to_cpu_estimate(tmp_path: Path) -> None:
    start = datetime(2024, 6, 1, 5, 0)
    sunrise = (start + timedelta(seconds=61)).timestamp()  # charging from the step ending at 62 s
    broken = {
        "sys/class/hwmon/hwmon0/power1_input": "dir",
        "sys/class/hwmon/hwmon0/in1_input": "eio",
    }
    solar = {"solar_w": lambda t: 10.0 if t >= sunrise else 0.0}
    gov, world, clock = make(
        tmp_path,
        Budget(budget_wh=0.15),
        kind="all",
        start=start,
        broken=broken,
        rapl=False,
        **solar,
    )
    Trainer(gov, world, clock).run()
    report = gov.report()
    assert set(report["source_seconds"]) == {"battery:BAT0", "cpu-estimate"}
    assert report["source_seconds"]["battery:BAT0"] == pytest.approx(60.0)
    assert report["source_seconds"]["cpu-estimate"] > 60
    assert 0.95 * 0.15 <= report["energy_wh_job"] <= 0.15
    assert world.true_job_j / 3600 == pytest.approx(report["energy_wh_job"], rel=0.02)
    assert "ina226:hwmon0" in report["problems"]


def test_temperature_above_limit_pauses_until_cooled_by_the_margin(tmp_path: Path) -> None:
    budget = Budget(budget_wh=0.15, thermal_limit_c=70, thermal_margin_c=10)
    gov, world, clock = make(tmp_path, budget, temp_c=50.0, tau_s=30.0)
    trainer = Trainer(gov, world, clock)
    trainer.run()
    pauses = [d for d in trainer.decisions if d.paused]
    assert len(pauses) >= 2 and all(
        d.reason is PauseReason.THERMAL and d.resume.temp_c == 60 for d in pauses
    )
    assert len(trainer.resumed_at) == len(pauses)
    assert all(temp <= 60.0 for _, _, temp in trainer.resumed_at)
    assert world.max_temp_while_busy < 70.0 + 1.0  # at most one step past the limit
    report = gov.report()
    assert report["pauses_by_reason"] == {"thermal": len(pauses)} and report["max_temp_c"] >= 70
    assert report["stop_reason"] == "budget-exhausted"


def test_outside_the_solar_window_pauses_until_it_opens(tmp_path: Path) -> None:
    start = datetime(2024, 6, 1, 5, 0)
    gov, world, clock = make(
        tmp_path, Budget(budget_wh=0.01, window="06:30-18:00"), start=start, poll_s=600.0
    )
    first = gov.before_step()
    opens = datetime(2024, 6, 1, 6, 30).timestamp()
    assert first.reason is PauseReason.OUTSIDE_WINDOW and first.resume.not_before == pytest.approx(
        opens
    )
    assert gov.wait_until_resumable().proceed
    assert clock.now() == pytest.approx(opens)
    clock.advance(2.0)
    gov.after_step(2.0)
    assert gov.report()["steps"] == 1


def test_window_closing_then_deadline_overnight_stops_with_deadline(tmp_path: Path) -> None:
    start = datetime(2024, 6, 1, 17, 58)
    deadline = datetime(2024, 6, 2, 3, 0).astimezone().isoformat()
    gov, world, clock = make(
        tmp_path, Budget(window="06:30-18:00", deadline=deadline), start=start, poll_s=900.0
    )
    final = Trainer(gov, world, clock, step_s=10.0).run()
    assert trainer_pause_reasons(final, gov) == {"outside-window": 1}
    assert final.reason is StopReason.DEADLINE
    assert clock.now() == pytest.approx(datetime(2024, 6, 2, 3, 0).timestamp())
    assert world.busy_s == pytest.approx(120.0)


def trainer_pause_reasons(final: Decision, gov: BudgetGovernor) -> dict[str, int]:
    assert final.stopped
    return gov.report()["pauses_by_reason"]  # type: ignore[return-value]


def test_deadline_stops_before_a_step_would_overrun_it(tmp_path: Path) -> None:
    t0 = datetime(2024, 6, 1, 12, 0)
    gov, world, clock = make(tmp_path, Budget(deadline=t0.timestamp() + 101), start=t0)
    final = Trainer(gov, world, clock).run()
    assert final.reason is StopReason.DEADLINE and "would end after" in final.detail
    assert clock.now() <= t0.timestamp() + 101
    assert gov.report()["steps"] == 50


def test_deadline_passing_while_waiting_for_battery_is_battery_low(tmp_path: Path) -> None:
    t0 = datetime(2024, 6, 1, 20, 0)
    budget = Budget(budget_wh=1, battery_floor_pct=30, deadline=t0.timestamp() + 600)
    gov, world, clock = make(tmp_path, budget, start=t0, battery_pct=29.0)
    trainer = Trainer(gov, world, clock)
    final = trainer.run()
    assert trainer.decisions[0].reason is PauseReason.BATTERY_LOW
    assert final.reason is StopReason.BATTERY_LOW and "deadline passed" in final.detail
    assert clock.now() == pytest.approx(t0.timestamp() + 600)
    assert world.busy_s == 0.0


def test_max_wait_returns_the_pause_still_in_force(tmp_path: Path) -> None:
    gov, world, clock = make(tmp_path, Budget(battery_floor_pct=30), battery_pct=20.0)
    assert gov.before_step().paused
    still = gov.wait_until_resumable(max_wait_s=95.0)
    assert still.paused and still.reason is PauseReason.BATTERY_LOW
    assert clock.slept == [30.0, 30.0, 30.0, 5.0]


def test_cancel_stops_at_the_next_boundary_and_during_a_wait(tmp_path: Path) -> None:
    gov, world, clock = make(tmp_path, Budget())
    assert gov.before_step().proceed
    clock.advance(2.0)
    gov.after_step()
    gov.cancel("operator asked")
    stop = gov.before_step()
    assert stop.reason is StopReason.CANCELLED and stop.detail == "operator asked"
    assert gov.before_step() is stop  # stays stopped

    gov2, world2, clock2 = make(
        tmp_path / "b", Budget(thermal_limit_c=60), temp_c=65.0, ambient_c=64.0
    )
    assert gov2.before_step().reason is PauseReason.THERMAL  # never cools below 55 C
    clock2.on_advance(
        lambda dt, sleeping: gov2.cancel("shutdown") if clock2.monotonic() > 2000 else None
    )
    assert gov2.wait_until_resumable().reason is StopReason.CANCELLED
    assert gov2.report()["pause_count"] == 1 and gov2.report()["pause_s"] > 900


def test_all_power_sensors_failing_stops_with_error_not_a_crash(tmp_path: Path) -> None:
    gov, world, clock = make(tmp_path, Budget(budget_wh=0.1))
    trainer = Trainer(gov, world, clock)
    for _ in range(5):
        assert gov.before_step().proceed
        clock.advance(2.0)
        gov.after_step(2.0)
    world.break_node("sys/class/hwmon/hwmon0/power1_input", "dir")
    world.break_node("sys/class/hwmon/hwmon0/in1_input", "eio")
    world.break_node("sys/class/hwmon/hwmon0/curr1_input", "\x00\xffgarbage")
    final = trainer.run()
    assert final.reason is StopReason.ERROR and "no power reading" in final.detail
    report = gov.report()
    assert report["sensor_failures"] >= 10
    recent = " ".join(report["problems"]["ina226:hwmon0"]["recent"])
    assert "is a directory" in recent and "EIO" in recent


def test_a_budget_whose_power_sources_all_fail_from_the_start_stops_before_the_first_step(tmp_path: Path) -> None:
    broken = {"sys/class/hwmon/hwmon0/power1_input": "dir", "sys/class/hwmon/hwmon0/in1_input": "eio",
              "sys/class/hwmon/hwmon0/curr1_input": "garbage"}
    gov, _, clock = make(tmp_path, Budget(budget_wh=0.1), broken=broken)
    assert gov.before_step().proceed
    clock.advance(2.0)
    gov.after_step(2.0)
    second = gov.before_step()  # not after max_sensor_failures (10) steps: a short job stayed unmetered
    assert not second.proceed and second.reason is StopReason.ERROR and "at the start" in second.detail
    assert gov.report()["steps"] == 1
    unbudgeted, _, clock = make(tmp_path / "free", Budget(), broken=broken)
    for _ in range(3):  # nothing to enforce: an unmetered job may run
        assert unbudgeted.before_step().proceed
        clock.advance(2.0)
        unbudgeted.after_step(2.0)


def test_garbage_battery_and_thermal_nodes_never_pause_or_crash(tmp_path: Path) -> None:
    budget = Budget(budget_wh=0.05, battery_floor_pct=30, thermal_limit_c=70)
    broken = {
        "sys/class/power_supply/BAT0/capacity": "lots",
        "sys/class/thermal/thermal_zone0/temp": "eio",
    }
    gov, world, clock = make(
        tmp_path, budget, battery_pct=20.0, temp_c=90.0, ambient_c=90.0, broken=broken
    )
    final = Trainer(gov, world, clock).run()
    assert final.reason is StopReason.BUDGET_EXHAUSTED
    report = gov.report()
    assert report["pause_count"] == 0 and report["battery_pct_end"] is None
    assert "thermal" in report["problems"]


def test_a_glitching_battery_reading_keeps_the_last_good_value(tmp_path: Path) -> None:
    gov, world, clock = make(tmp_path, Budget(battery_floor_pct=30), battery_pct=25.0)
    assert gov.before_step().paused
    world.break_node("sys/class/power_supply/BAT0/capacity", "eio")
    assert gov.before_step().paused  # the last good reading (25 %) is still fresh
    assert gov.battery_pct == 25.0
    clock.sleep(301.0)
    assert gov.before_step().proceed  # stale now: no battery information, no pause


def test_api_misuse_and_finish(tmp_path: Path) -> None:
    gov, world, clock = make(tmp_path, Budget(budget_wh=1))
    with pytest.raises(RuntimeError, match="before_step"):
        gov.after_step(1.0)
    assert gov.before_step().proceed
    with pytest.raises(RuntimeError, match="after_step"):
        gov.wait_until_resumable()
    clock.advance(3.0)
    stop = gov.finish(StopReason.EARLY_STOPPED, "validation loss flat")
    assert stop.reason is StopReason.EARLY_STOPPED
    report = gov.report()
    assert report["steps"] == 1 and report["stop_reason"] == "early-stopped"
    assert report["energy_wh_job"] == pytest.approx(3.0 * 3.7 / 3600)
    assert gov.finish("done").reason is StopReason.EARLY_STOPPED  # the first stop wins


def test_cap_below_idle_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="at or below idle"):
        make(tmp_path, Budget(power_cap_w=2.0))


def test_state_carries_the_budget_across_a_restart(tmp_path: Path) -> None:
    gov, world, clock = make(tmp_path, Budget(budget_wh=0.1))
    for _ in range(30):
        assert gov.before_step().proceed
        clock.advance(2.0)
        gov.after_step(2.0)
    saved = gov.state()  # the process dies here; the state was saved with the checkpoint
    again = BudgetGovernor(
        budget=Budget(budget_wh=0.1),
        sources=monitor_for(tmp_path, "hwmon-ina"),
        clock=clock,
        resume_from=saved,
    )
    final = Trainer(again, world, clock).run()
    assert final.reason is StopReason.BUDGET_EXHAUSTED
    assert 45 <= again.report()["steps"] <= 49  # 30 before the restart, the rest after
    assert 0.95 * 360 <= world.true_job_j <= 360 * 1.001
    with pytest.raises(InputError, match="energy_j_job"):
        BudgetGovernor(
            budget=Budget(),
            sources=monitor_for(tmp_path, "hwmon-ina"),
            clock=clock,
            resume_from={"energy_j_job": float("nan")},
        )


def test_inference_energy_is_accounted_as_inference_not_charged_to_the_job(tmp_path: Path) -> None:
    """A device serving requests while it trains: the whole-device sensor counts both; the
    service's energy total (edge_agent.power.inference_energy) is left out of the job's energy."""
    from edge_agent.power.inference_energy import InferenceEnergy, read_inference_j

    energy = InferenceEnergy(watts_per_cpu=1.0, path=tmp_path / "serve" / "energy.json")
    energy.add(5.0)  # before the job: never the job's
    energy.flush()
    clock = ManualClock(start_epoch=datetime(2024, 6, 1, 12, 0).timestamp())
    world = World(tmp_path / "board", clock)
    gov = BudgetGovernor(budget=Budget(budget_wh=1.0), sources=monitor_for(tmp_path / "board", "hwmon-ina"),
                         clock=clock, max_threads=NCPU,
                         inference_j=lambda: read_inference_j(tmp_path / "serve" / "energy.json"))
    plain = BudgetGovernor(budget=Budget(budget_wh=1.0), sources=monitor_for(tmp_path / "board", "hwmon-ina"),
                           clock=clock, max_threads=NCPU)
    for _ in range(3):
        for g in (gov, plain):
            g.before_step()
        world.background_w = 1.0  # the inference service's requests, on the same sensor
        clock.advance(10.0)
        world.background_w = 0.0
        energy.add(10.0)  # 10 CPU-s at 1 W per CPU = the 10 J that 1 W for 10 s drew
        energy.flush()
        for g in (gov, plain):
            g.after_step(10.0)
    served, charged = gov.report(), plain.report()
    assert served["inference_wh"] == pytest.approx(30.0 / 3600)
    assert served["energy_wh_job"] == pytest.approx(charged["energy_wh_job"] - 30.0 / 3600, rel=1e-6)
    assert served["energy_wh_total"] == pytest.approx(charged["energy_wh_total"])  # the device's total keeps it
    assert plain.report()["inference_wh"] == 0.0
