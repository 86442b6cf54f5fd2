"""The solar surplus forecast (power/forecast.py): real pvlib clear-sky, the learnt index,
the training planner's floor guarantee, and the untrusted state form."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from datetime import UTC, datetime

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edge_agent.errors import InputError
from edge_agent.power.forecast import (
    SolarSite,
    SurplusForecast,
    TrainingWindow,
    forecast_surplus,
    plan_training,
)

SITE = SolarSite(latitude=52.0, longitude=5.0, panel_w=20.0)  # the Netherlands, facing south
MIDNIGHT = datetime(2024, 6, 10, tzinfo=UTC).timestamp()  # a June day, UTC midnight
H = 3600.0


def _fc(**kw: object) -> SurplusForecast:
    args: dict[str, object] = dict(now=MIDNIGHT, battery_wh=30.0, capacity_wh=60.0, floor_wh=15.0, load_w=1.0)
    args.update(kw)
    return forecast_surplus(SITE, **args)  # type: ignore[arg-type]


def test_clear_sky_harvest_is_zero_at_night_and_peaks_near_solar_noon() -> None:
    fc = _fc()
    assert len(fc.panel_w) == 24 and fc.step_s == H and fc.start == MIDNIGHT
    assert fc.clear_sky_index == 1.0 and fc.panel_w == fc.clear_sky_w  # no history: the model alone
    assert fc.panel_w[0] == 0.0 and fc.panel_w[23] == 0.0  # 00-01 and 23-24 UTC: night in June
    # solar noon at 5 E is 12:00 - 5 * 4 min = 11:40 UTC (+ the equation of time, ~1 min in June)
    peak = max(range(24), key=lambda i: fc.panel_w[i])
    assert peak in (11, 12) or (peak == 10 and fc.panel_w[11] > 0.99 * fc.panel_w[10])
    # a 20 W panel x 0.75 on a June noon: between half and all of its rated 15 W
    assert 7.5 < fc.panel_w[peak] <= 15.5
    # the same site 90 degrees east: noon six hours earlier
    east = forecast_surplus(SolarSite(52.0, 95.0, panel_w=20.0), now=MIDNIGHT, battery_wh=30, capacity_wh=60,
                            floor_wh=15, load_w=1.0)
    assert abs(max(range(24), key=lambda i: east.panel_w[i]) - peak) in (5, 6, 7)


def test_surplus_and_trajectory_follow_the_load_and_clip_at_empty_and_full() -> None:
    fc = _fc(load_w=2.0, battery_wh=5.0, capacity_wh=20.0, floor_wh=2.0)
    assert fc.surplus_w()[0] == pytest.approx(-2.0)
    trajectory = fc.battery_trajectory()
    assert trajectory[0] == pytest.approx(3.0) and trajectory[1] == pytest.approx(1.0)
    assert min(trajectory) == 0.0  # the night drains it: clipped at empty, not negative
    assert max(trajectory) == 20.0  # the day fills it: clipped at capacity
    assert fc.battery_trajectory([1.0])[0] == pytest.approx(2.0)  # extra draw in step 0 only


def test_a_cloudy_history_lowers_the_index_and_the_forecast() -> None:
    sunny = _fc()
    # a week of 10-minute samples at 40 % of the clear-sky model: what a cloudy site measured
    times = [MIDNIGHT - d * 86400 + i * 600 for d in range(7, 0, -1) for i in range(144)]
    modelled = forecast_surplus(SITE, now=MIDNIGHT - 7 * 86400, battery_wh=0, capacity_wh=1, floor_wh=0,
                                load_w=0, hours=24)
    history = [(t, 0.4 * modelled.clear_sky_w[int((t - (MIDNIGHT - 7 * 86400)) % 86400 // H)]) for t in times]
    cloudy = _fc(history=history)
    assert 0.3 < cloudy.clear_sky_index < 0.5
    assert cloudy.clear_sky_w == sunny.clear_sky_w  # the model's part is unchanged
    assert sum(cloudy.panel_w) == pytest.approx(cloudy.clear_sky_index * sum(sunny.panel_w))
    # recent days weigh more: a sunny yesterday after a cloudy week pulls the index up
    yesterday = [(t, w / 0.4) for t, w in history if t >= MIDNIGHT - 86400]
    mixed = _fc(history=[*(h for h in history if h[0] < MIDNIGHT - 86400), *yesterday])
    assert mixed.clear_sky_index > 0.4 + (1.0 - 0.4) / 7  # more than the plain average
    # garbage and future samples are skipped, not trusted
    assert _fc(history=[(MIDNIGHT + 3600, 0.0), (float("nan"), 1.0), (MIDNIGHT - 50, -3.0)]).clear_sky_index == 1.0


def test_a_window_is_found_in_the_morning_when_the_battery_is_low_at_night() -> None:
    fc = _fc(battery_wh=16.0, floor_wh=12.0, capacity_wh=60.0, load_w=1.0)
    assert plan_training(fc, energy_wh=3.0, power_w=3.0, not_before=MIDNIGHT) is not None
    window = plan_training(fc, energy_wh=6.0, power_w=3.0)  # 2 h at 3 W: the night cannot pay for it
    assert window is not None
    hour = (window.start - MIDNIGHT) / H
    assert 4 <= hour <= 12 and window.end == window.start + 2 * H
    assert window.why == "surplus covers the draw" or "floor" in window.why
    trajectory = fc.battery_trajectory([3.0 if window.start <= MIDNIGHT + i * H < window.end else 0.0
                                        for i in range(24)])
    assert min(trajectory[int(hour):]) >= fc.floor_wh
    # a deadline before the window: none
    assert plan_training(fc, energy_wh=6.0, power_w=3.0, deadline=window.start + H) is None


def test_no_window_when_the_panel_is_too_small() -> None:
    tiny = forecast_surplus(SolarSite(52.0, 5.0, panel_w=1.0), now=MIDNIGHT, battery_wh=20.0, capacity_wh=60.0,
                            floor_wh=15.0, load_w=1.0)
    assert max(tiny.surplus_w()) < 0  # never a surplus: the night and the day both drain it
    assert plan_training(tiny, energy_wh=2.0, power_w=2.0) is None


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(battery=st.floats(0, 100), capacity=st.floats(10, 100), floor_frac=st.floats(0, 0.9),
       load=st.floats(0, 6), energy=st.floats(0.01, 30), power=st.floats(0.1, 15),
       index=st.floats(0.05, 1.2), offset=st.floats(0, 86400))
def test_plan_training_never_lets_the_projected_battery_go_below_the_floor(
        battery: float, capacity: float, floor_frac: float, load: float, energy: float, power: float,
        index: float, offset: float) -> None:
    clear = BASE.clear_sky_w
    shift = int(offset // H)
    clear = clear[shift:] + clear[:shift]
    fc = SurplusForecast(start=MIDNIGHT + shift * H, step_s=H, panel_w=tuple(c * index for c in clear),
                         clear_sky_w=clear, load_w=load, battery_wh=min(battery, capacity), capacity_wh=capacity,
                         floor_wh=floor_frac * capacity, clear_sky_index=index)
    window = plan_training(fc, energy_wh=energy, power_w=power)
    if window is None:
        return
    assert window.end == pytest.approx(window.start + energy / power * H)
    assert fc.start <= window.start and window.end <= fc.end + 1e-6
    k = int((window.start - fc.start) // H)
    extra = [power * max(0.0, min(window.end, fc.start + (i + 1) * H) - max(window.start, fc.start + i * H)) / H
             for i in range(24)]
    assert all(c >= fc.floor_wh - 1e-9 for c in fc.battery_trajectory(extra)[k:])
    assert (fc.battery_wh if k == 0 else fc.battery_trajectory()[k - 1]) >= fc.floor_wh


BASE = forecast_surplus(SITE, now=MIDNIGHT, battery_wh=0, capacity_wh=1, floor_wh=0, load_w=0)


def test_state_round_trip_is_compact_and_keeps_the_plan() -> None:
    fc = _fc(train_w=2.5, train_wh=3.0)
    window = plan_training(fc, energy_wh=3.0, power_w=2.5)
    assert window is not None
    body = SurplusForecast.from_state(json.loads(json.dumps(
        SurplusForecast(**{**fc.__dict__, "window": window}).to_state()))).to_state()
    assert len(json.dumps(body)) < 700 and len(body["surplus_w"]) == 24
    back = SurplusForecast.from_state(body)
    assert back.surplus_w() == pytest.approx(fc.surplus_w(), abs=0.01)
    assert back.train_w == 2.5 and back.window is not None and back.window.start == int(window.start)
    assert plan_training(back, energy_wh=3.0, power_w=2.5) == TrainingWindow(
        window.start, window.end, window.why)


@pytest.mark.parametrize("change, words", [
    ({"surplus_w": [1.0] * 49}, "surplus_w"),
    ({"surplus_w": "1,2"}, "surplus_w"),
    ({"surplus_w": [float("inf")]}, "surplus_w[0]"),
    ({"index": 7}, "index"),
    ({"index": True}, "index"),
    ({"v": 2}, "version"),
    ({"extra": 1}, "unknown"),
    ({"floor_wh": 100.0}, "floor"),
    ({"battery_wh": -1}, "battery_wh"),
    ({"step_s": 1}, "step_s"),
    ({"window": {"start": 10, "end": 5, "why": "x"}}, "window.end"),
    ({"window": {"start": 10, "end": 20, "why": "\x1b[2J"}}, "window.why"),
    ({"window": [1, 2]}, "window"),
])
def test_from_state_rejects_bad_input(change: dict, words: str) -> None:
    body = {**_fc().to_state(), **change}
    with pytest.raises(InputError, match=words.replace("[", r"\[").replace("]", r"\]")):
        SurplusForecast.from_state(body)
    with pytest.raises(InputError, match="missing"):
        SurplusForecast.from_state({k: v for k, v in _fc().to_state().items() if k != "load_w"})
    with pytest.raises(InputError):
        SurplusForecast.from_state([1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize("kw, words", [
    ({"latitude": 91}, "solar.latitude"), ({"longitude": "5"}, "solar.longitude"),
    ({"panel_w": 0}, "solar.panel_w"), ({"tilt_deg": -1}, "solar.tilt_deg"),
    ({"azimuth_deg": float("nan")}, "solar.azimuth_deg"), ({"efficiency": 1.5}, "solar.efficiency"),
])
def test_site_errors_name_the_field(kw: dict, words: str) -> None:
    args = {"latitude": 52.0, "longitude": 5.0, **kw}
    with pytest.raises(InputError, match=words):
        SolarSite(**args)


def test_planner_arguments_are_checked() -> None:
    fc = _fc()
    with pytest.raises(InputError, match="power_w"):
        plan_training(fc, energy_wh=1.0, power_w=0.0)
    with pytest.raises(InputError, match="hours"):
        _fc(hours=0)
    assert math.isfinite(plan_training(fc, energy_wh=1.0, power_w=1.0, not_before=MIDNIGHT + 12 * H).start)


def test_importing_the_module_loads_neither_pvlib_nor_pandas() -> None:
    code = ("import sys, edge_agent.power.forecast, edge_agent.coordinator.selection; "
            "print(sorted(m for m in ('pandas', 'pvlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
