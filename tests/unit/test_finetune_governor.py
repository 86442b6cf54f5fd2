"""The budget governor driving a real fine-tune, through sensor files that change over time.

A simulated board lives under a temporary root: an INA219 on the input rail (hwmon), a
battery fuel gauge and a thermal zone, read by the project's real power sources. Time is
virtual (`BoardClock`, the project's ManualClock behind the Clock interface): the job tells
the clock after every step (`work_done`) and the clock then charges exactly STEP_S of
computing at BUSY_W; every sleep of the governor (duty-cycle gaps, polling while paused)
passes the requested seconds at IDLE_W. The INA's power file is rewritten on every move,
so the governor measures what a real board would show -- and a step costs the same energy
on any CPU, under `taskset -c 0` or beside a CPU hog. Budgets are sized in steps.

The test then drains the battery, heats the board and brings the sun back (all at chosen
steps or after chosen virtual seconds), and checks that the job pauses (with a checkpoint
first), resumes, and stops within 5 % of its energy budget.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from edge_agent.power.clock import ManualClock
from edge_agent.train.job import Progress, run_finetune

IDLE_W = 2.7  # the raspberry-pi-4 profile's idle figure
BUSY_W = 5.0
STEP_S = 0.1  # virtual seconds one training step computes
STEP_J = (BUSY_W - IDLE_W) * STEP_S  # what one step costs a budget on the "job" basis
WATTS_PER_CPU = (6.4 - IDLE_W) / 4  # the raspberry-pi-4 profile's (load_w - idle_w) / cores
POLL_S = 0.25


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(text + "\n")
    os.replace(tmp, path)  # sensors never show a half-written value


def _budget_wh(steps: int) -> float:
    """A budget worth `steps` steps and a half: the governor must stop after exactly `steps`."""
    return (steps + 0.5) * STEP_J / 3600.0


class Board:
    """Sensor files under `root`, as a Raspberry Pi with an INA219 and a fuel gauge shows them."""

    def __init__(self, root: Path) -> None:
        self.ina = root / "sys/class/hwmon/hwmon0"
        self.bat = root / "sys/class/power_supply/BAT0"
        self.zone = root / "sys/class/thermal/thermal_zone0"
        for d in (self.ina, self.bat, self.zone):
            d.mkdir(parents=True)
        _write(self.ina / "name", "ina219")
        _write(self.bat / "type", "Battery")
        _write(self.zone / "type", "cpu-thermal")
        cpus = root / "sys/devices/system/cpu"  # a Pi 4's four cores, whatever runs the test: the
        cpus.mkdir(parents=True)  # profile's watts per busy core are (load_w - idle_w) / 4 = WATTS_PER_CPU
        _write(cpus / "present", "0-3")
        self.power(BUSY_W)
        self.battery(80, "Discharging")
        self.temperature(55.0)

    def power(self, watts: float) -> None:
        _write(self.ina / "power1_input", str(int(watts * 1e6)))

    def battery(self, pct: int, status: str) -> None:
        _write(self.bat / "status", status)
        _write(self.bat / "capacity", str(pct))

    def temperature(self, celsius: float) -> None:
        _write(self.zone / "temp", str(int(celsius * 1000)))


class BoardClock(ManualClock):
    """Virtual time: a step computes STEP_S at BUSY_W, a sleep idles at IDLE_W; the INA's file
    says so right after every move, so the reading that closes a phase reflects it.
    `later(s, action)` runs `action` once `s` virtual seconds have passed (a scripted event)."""

    def __init__(self, board: Board) -> None:
        super().__init__(start_epoch=time.time())
        self.board = board
        self.work_steps = 0
        self._due: list[tuple[float, Callable[[], None]]] = []
        self.on_advance(self._moved)

    def work_done(self) -> None:  # called by the job after every step (run_finetune's clock hook)
        self.work_steps += 1
        self.advance(STEP_S)

    def later(self, seconds: float, action: Callable[[], None]) -> None:
        self._due.append((self.monotonic() + seconds, action))

    def _moved(self, _seconds: float, sleeping: bool) -> None:
        self.board.power(IDLE_W if sleeping else BUSY_W)
        for item in [d for d in self._due if d[0] <= self.monotonic()]:
            self._due.remove(item)
            item[1]()


@pytest.fixture(scope="module")
def bundle(digits_bundle: Path) -> Path:
    return digits_bundle


@pytest.fixture(scope="module")
def data(camera_device_npz: Path) -> Path:
    return camera_device_npz


@pytest.fixture(scope="module")
def cache(bundle: Path, data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Engine choice and features computed once, so the budgets below pay for training only
    (a first job on a device pays for engine selection and features too, and is charged for it)."""
    root = tmp_path_factory.mktemp("gov-cache")
    Board(root / "board")  # the same simulated board as the tests: the same hardware fingerprint
    run_finetune(model=bundle, data=data, state_dir=root / "warm", cache_dir=root, epochs=1,
                 profile="raspberry-pi-4", batch_size=8, power_root=root / "board")
    return root


def _job(bundle: Path, data: Path, tmp_path: Path, clock: BoardClock, cache: Path, **kw: object) -> dict:
    # "device": the budget is charged what the simulated board's INA219 shows
    args = {"epochs": 500, "patience": 1000, "energy_scope": "device", **kw}
    return run_finetune(model=bundle, data=data, state_dir=tmp_path / "state", cache_dir=cache,
                        power_root=tmp_path / "root", profile="raspberry-pi-4", batch_size=8, poll_s=POLL_S,
                        clock=clock, **args)


def test_battery_and_heat_pause_with_a_checkpoint_resume_and_the_budget_stops_the_job(
        bundle: Path, data: Path, cache: Path, tmp_path: Path) -> None:
    board = Board(tmp_path / "root")
    clock = BoardClock(board)
    steps = 40
    budget_wh = _budget_wh(steps)
    events: list[Progress] = []
    script = {"drained": False, "heated": False, "resumed_steps": []}

    def on_event(ev: Progress) -> None:
        events.append(ev)
        if ev.phase == "train" and ev.step == 8 and not script["drained"]:
            script["drained"] = True
            board.battery(25, "Discharging")  # below the 30 % floor
        elif ev.phase == "paused" and "battery" in ev.detail:
            clock.later(1.0, lambda: board.battery(50, "Charging"))  # the sun is back
        elif ev.phase == "train" and ev.detail == "resumed":
            script["resumed_steps"].append(ev.step)
        elif ev.phase == "train" and script["resumed_steps"] and ev.step == script["resumed_steps"][0] + 8 \
                and not script["heated"]:
            script["heated"] = True
            board.temperature(74.0)  # heats past the 70 C limit
        elif ev.phase == "paused" and "thermal" in ev.detail:
            clock.later(1.0, lambda: board.temperature(60.0))  # cooled below limit - margin

    report = _job(bundle, data, tmp_path, clock, cache, budget_wh=budget_wh, battery_floor_pct=30,
                  battery_resume_pct=40, thermal_limit_c=70, progress=on_event)
    power = report["power"]
    summary = [(e.phase, e.step, e.detail[:40]) for e in events if e.phase not in ("train", "saving", "checkpoint", "features")
               or e.detail not in ("", "interval", "epoch")]
    assert report["stop_reason"] == "budget-exhausted", summary
    assert report["steps"] == clock.work_steps == steps, summary  # the budget bought exactly 40 steps
    assert power["pauses_by_reason"] == {"battery-low": 1, "thermal": 1}, (report["steps"], summary)
    assert script["resumed_steps"] == [8, 16], summary
    assert power["pause_s"] == pytest.approx(2.0), summary  # 1 s for the sun, 1 s to cool (virtual)
    # each pause was preceded by a checkpoint of the exact step it paused at
    for reason in ("battery-low", "thermal"):
        i = next(i for i, e in enumerate(events) if e.phase == "paused" and reason.split("-")[0] in e.detail)
        saved = [e for e in events[:i] if e.phase == "checkpoint"]
        assert saved and saved[-1].detail == f"pause: {reason}" and saved[-1].step == events[i].step
    used = report["energy"]["wh"]
    assert used == pytest.approx(steps * STEP_J / 3600.0)  # pauses idle: they cost the job nothing
    assert abs(used - budget_wh) / budget_wh <= 0.05, (used, budget_wh)
    assert report["energy"]["source"].startswith("ina219")
    assert power["battery_pct_end"] == 50 and power["max_temp_c"] >= 74.0
    last = [e for e in events if e.phase == "checkpoint"][-1]
    assert last.detail == "stop: budget-exhausted" and last.step == report["steps"]


def test_the_power_cap_is_held_by_duty_cycling(bundle: Path, data: Path, cache: Path, tmp_path: Path) -> None:
    board = Board(tmp_path / "root")
    clock = BoardClock(board)
    cap = 4.0
    # The governor stops when the next step would overshoot, so it ends up to one step short:
    # 60 steps make one step 1.7 % of the budget, so the 5 % bound tests the governor.
    steps = 60
    budget_wh = _budget_wh(steps)
    report = _job(bundle, data, tmp_path, clock, cache, budget_wh=budget_wh, power_cap_w=cap)
    power = report["power"]
    assert report["stop_reason"] == "budget-exhausted"
    assert report["steps"] == steps
    # step + gap averages the cap: gap = STEP_S * (BUSY_W - cap) / (cap - IDLE_W) after each step
    gap = STEP_S * (BUSY_W - cap) / (cap - IDLE_W)
    assert power["duty_sleep_s"] == pytest.approx(steps * gap, rel=0.02), power
    assert cap * 0.95 <= power["avg_w"] <= cap * 1.05, power  # uncapped it would be 5 W
    assert abs(report["energy"]["wh"] - budget_wh) / budget_wh <= 0.05, report["energy"]


def test_without_a_cap_the_same_budget_runs_at_full_power(
        bundle: Path, data: Path, cache: Path, tmp_path: Path) -> None:
    # the control for the test above: the duty cycle, not the board, holds the average down
    board = Board(tmp_path / "root")
    clock = BoardClock(board)
    report = _job(bundle, data, tmp_path, clock, cache, budget_wh=_budget_wh(60))
    assert report["stop_reason"] == "budget-exhausted" and report["steps"] == 60
    assert report["power"]["duty_sleep_s"] == 0 and report["power"]["avg_w"] == pytest.approx(BUSY_W)


def test_a_battery_that_never_recovers_stops_at_the_deadline_and_resume_continues(
        bundle: Path, data: Path, cache: Path, tmp_path: Path) -> None:
    board = Board(tmp_path / "root")
    board.battery(10, "Discharging")
    clock = BoardClock(board)
    first = _job(bundle, data, tmp_path, clock, cache, battery_floor_pct=30, deadline=clock.now() + 2.0, epochs=2)
    assert first["stop_reason"] == "battery-low" and first["steps"] == 0
    assert first["status"] == "failed" and "battery below its floor" in first["failure"]["message"]
    assert clock.monotonic() - 1000.0 == pytest.approx(2.0)  # it waited (virtually) for the deadline
    board.battery(90, "Charging")
    second = _job(bundle, data, tmp_path, BoardClock(board), cache, battery_floor_pct=30, epochs=2, resume=True)
    assert second["stop_reason"] == "done" and second["steps"] > 0 and second["resumed"]
    assert second["status"] == "trained" and second["failure"] is None


class LoadedBoardClock(BoardClock):
    """The same board with another process keeping it busy: the INA reads HOG_W more than the
    job alone would, even while the job sleeps. The job's own CPU time is virtual too: STEP_S
    per step (`cpu_seconds`, the job's CPU-time counter hook)."""

    HOG_W = 4.0

    def cpu_seconds(self) -> float:
        return self.work_steps * STEP_S

    def _moved(self, seconds: float, sleeping: bool) -> None:
        super()._moved(seconds, sleeping)
        self.board.power((IDLE_W if sleeping else BUSY_W) + self.HOG_W)


def test_another_processes_load_is_reported_beside_the_job_never_charged_to_it(
        bundle: Path, data: Path, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Charged with the board's whole draw (every process's), a 0.05 Wh first job ended at
    116 % with nothing trained. By default the budget is charged the job's own CPU-seconds x
    the profile's watts per busy core; the sensor's whole-board figure is reported beside it."""
    monkeypatch.delenv("EDGE_AGENT_ENERGY_SCOPE", raising=False)
    clock = LoadedBoardClock(Board(tmp_path / "root"))
    steps, step_j = 40, STEP_S * WATTS_PER_CPU
    budget_wh = (steps + 0.5) * step_j / 3600.0
    report = _job(bundle, data, tmp_path, clock, cache, budget_wh=budget_wh, energy_scope=None)  # the default
    energy = report["energy"]
    assert report["stop_reason"] == "budget-exhausted" and report["steps"] == clock.work_steps == steps
    assert energy["scope"] == "process" and energy["cpu_s"] == pytest.approx(steps * STEP_S)
    assert energy["wh"] == pytest.approx(steps * step_j / 3600.0)
    # what the INA saw, the other process's 4 W included: 6.8x the job's share, reported only
    board_wh = steps * (BUSY_W + LoadedBoardClock.HOG_W - IDLE_W) * STEP_S / 3600.0
    assert energy["device_wh"] == pytest.approx(board_wh) and energy["source"].startswith("ina219")


def test_battery_wide_accounting_charges_the_whole_board(
        bundle: Path, data: Path, cache: Path, tmp_path: Path) -> None:
    """--energy-scope device: the same budget buys the steps the whole board's draw allows."""
    clock = LoadedBoardClock(Board(tmp_path / "root"))
    board_step_j = (BUSY_W + LoadedBoardClock.HOG_W - IDLE_W) * STEP_S
    report = _job(bundle, data, tmp_path, clock, cache, budget_wh=10.5 * board_step_j / 3600.0)
    assert report["energy"]["scope"] == "device" and report["steps"] == 10
    assert report["energy"]["wh"] == pytest.approx(report["energy"]["device_wh"])
