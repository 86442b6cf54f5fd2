"""A simulated device's training planner: the agent's own forecast and window planner
(`edge_agent.power.forecast`: `forecast_surplus`, `plan_training`), fed with the device's
measured panel history taken from the simulated truth.

What a device does (agent/solar.py, `SolarPlanner.plan`): a fresh forecast from its battery
now and its panel history (one sample per 10 minutes, the last 7 days: power/panel_history.py),
then the earliest window whose projected battery stays above the floor to the horizon.

The sim's history is what a meter on the panel's rail reads: the panel's available power
(the simulated truth, solar_weather.Weather.panel_w). The devices' site is their cluster's
centre, where the truth is computed (each is within ~5 km of it).

Cost, and why forecasts are made per cluster every 3 h: `forecast_surplus` costs 10-18 ms
(pvlib's sun positions and Linke turbidity for 96 sub-steps and up to 1,008 history samples).
All the devices of a cluster see the same sky, and a panel's forecast scales with its
rating: the clear-sky harvest is `panel_w x ...` and the learnt index is measured /
modelled, which does not depend on `panel_w`. So the sim calls `forecast_surplus` once per
cluster per refresh for a 1 W panel (history in W per rated W) and gives each device that
forecast scaled by its panel, with its own battery now, capacity, floor and load
(test_solar_fleet checks it against a direct call for the device's own panel). Refreshes
are every `REFRESH_S` (3 h: the agent's `[solar] forecast_interval_s = 10800`; its default
is 1 h, which costs 3x the pvlib time and nothing else here); a device plans on the hour
from its latest refresh, the hours already past dropped. The refreshes depend only on the
weather, not on the mode, so one table (`unit_forecasts`) serves every run of a fleet.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from ..power.forecast import (
    SolarSite,
    SurplusForecast,
    TrainingWindow,
    forecast_surplus,
    plan_training,
)
from ..power.panel_history import INTERVAL_S, KEEP_S
from .solar_devices import Devices
from .solar_weather import EFFICIENCY, STEP_S, Weather

HOUR_S = 3600.0
HISTORY_STEPS = int(KEEP_S // STEP_S)  # the agent keeps 7 days of 10-minute samples
REFRESH_S = 3 * HOUR_S
REFRESH_STEPS = int(REFRESH_S // STEP_S)
HORIZON_H = 24 + int(REFRESH_S // HOUR_S) - 1  # so a plan from a refresh still sees 24 h ahead
assert INTERVAL_S == STEP_S, "the sim's clock step is the panel history's sampling interval"


@dataclass
class ForecastErrors:
    """The forecast against the simulated truth, per plan: the next 24 h's harvest (Wh) and
    the planned window's surplus (Wh), each as (forecast, truth); plus the day type (0 clear,
    1 partly, 2 overcast) of the cluster on the forecast's day, for a breakdown."""

    harvest: list[tuple[float, float, int]] = field(default_factory=list)
    window: list[tuple[float, float]] = field(default_factory=list)


def unit_forecast(weather: Weather, site: SolarSite, unit_w: np.ndarray, step: int) -> SurplusForecast:
    """`forecast_surplus` at the start of `step` for a 1 W panel at `site` whose measured
    history is `unit_w` (W per rated W at each step) over the agent's 7 days."""
    lo = max(0, step - HISTORY_STEPS)
    hist = [(weather.start + (s + 0.5) * STEP_S, float(w)) for s, w in zip(range(lo, step), unit_w[lo:step], strict=True)]
    return forecast_surplus(site, now=weather.start + step * STEP_S, battery_wh=0.0, capacity_wh=1.0, floor_wh=0.0,
                            load_w=0.0, history=hist, hours=HORIZON_H)


def unit_forecasts(devices: Devices, weather: Weather, clusters: Sequence[int]) -> dict[tuple[int, int], SurplusForecast]:
    """Every refresh of the given clusters over the weather's days: the table a Planner
    takes as its `cache` (compute it once per fleet, in parallel by clusters if need be)."""
    unit_w = weather.clear_poa * weather.index / 1000.0 * EFFICIENCY
    sites = devices.sites
    return {(c, ref): unit_forecast(weather, SolarSite(float(sites.lat[c]), float(sites.lon[c]), float(sites.alt[c]),
                                                       panel_w=1.0), unit_w[c], ref)
            for c in clusters for ref in range(0, weather.steps, REFRESH_STEPS)}


class Planner:
    """The fleet's planners: one forecast per (cluster, hour), scaled per device."""

    def __init__(self, devices: Devices, weather: Weather, steps: int,
                 cache: Mapping[tuple[int, int], SurplusForecast] | None = None) -> None:
        self.dev, self.weather, self.steps = devices, weather, steps
        sites = devices.sites
        self.sites = [SolarSite(float(a), float(o), float(h), panel_w=1.0)
                      for a, o, h in zip(sites.lat, sites.lon, sites.alt, strict=True)]
        # truth per rated W, (clusters, steps): what a 1 W panel gives at each step
        self.unit_w = weather.clear_poa * weather.index / 1000.0 * EFFICIENCY
        self._cache: dict[tuple[int, int], SurplusForecast] = dict(cache or {})
        self.errors = ForecastErrors()
        self.forecasts = 0  # forecast_surplus calls

    def unit_forecast(self, cluster: int, step: int) -> SurplusForecast:
        """The cluster's forecast for a 1 W panel at the start of `step` (on the hour): its
        latest refresh's, the hours already past dropped; the 24 h from `step`."""
        ref = step - step % REFRESH_STEPS
        fc = self._cache.get((cluster, ref))
        if fc is None:
            fc = self._cache[(cluster, ref)] = unit_forecast(self.weather, self.sites[cluster], self.unit_w[cluster], ref)
            self.forecasts += 1
        k = (step - ref) // int(HOUR_S // STEP_S)
        return replace(fc, start=fc.start + k * fc.step_s, panel_w=fc.panel_w[k:k + 24],
                       clear_sky_w=fc.clear_sky_w[k:k + 24])

    def forecast(self, i: int, step: int, battery_wh: float, floor_wh: float) -> SurplusForecast:
        """Device `i`'s forecast at the start of `step`: its cluster's, scaled to its panel."""
        dev = self.dev
        unit = self.unit_forecast(int(dev.sites.cluster[i]), step)
        pw = float(dev.panel_w[i])
        cap = float(dev.battery_wh[i])
        return replace(unit, panel_w=tuple(p * pw for p in unit.panel_w),
                       clear_sky_w=tuple(c * pw for c in unit.clear_sky_w), load_w=dev.load_w,
                       battery_wh=min(cap, battery_wh), capacity_wh=cap, floor_wh=floor_wh)

    def plan(self, i: int, step: int, battery_wh: float, floor_wh: float) -> TrainingWindow | None:
        """Device `i`'s next window for its local job from `step` (None: none in 24 h), and
        the forecast's error against the truth recorded."""
        dev = self.dev
        fc = self.forecast(i, step, battery_wh, floor_wh)
        win = plan_training(fc, energy_wh=float(dev.job_extra_wh()[i]), power_w=dev.train_w - dev.load_w,
                            not_before=fc.start)
        self._record(i, step, fc, win)
        return win

    def _record(self, i: int, step: int, fc: SurplusForecast, win: TrainingWindow | None) -> None:
        per_day = int(86400 // STEP_S)
        if step + per_day > self.steps:
            return  # no 24 h of truth ahead
        c = int(self.dev.sites.cluster[i])
        pw = float(self.dev.panel_w[i])
        truth = float(self.unit_w[c, step:step + per_day].sum()) * pw * STEP_S / HOUR_S
        day = min(self.weather.days - 1, step // per_day)
        self.errors.harvest.append((sum(fc.panel_w) * fc.step_s / HOUR_S, truth, int(self.weather.day_types[c, day])))
        if win is None:
            return
        a = int((win.start - self.weather.start) // STEP_S)
        b = int(math.ceil((win.end - self.weather.start) / STEP_S))
        if b > self.steps:
            return
        # the surplus over the window's own span, forecast (hourly steps, pro rata) and true
        pred = 0.0
        for k, s in enumerate(fc.surplus_w()):
            s0 = fc.start + k * fc.step_s
            pred += s * max(0.0, min(win.end, s0 + fc.step_s) - max(win.start, s0)) / HOUR_S
        spans = np.clip(np.minimum(win.end, self.weather.start + (np.arange(a, b) + 1) * STEP_S)
                        - np.maximum(win.start, self.weather.start + np.arange(a, b) * STEP_S), 0, None)
        true = float(((self.unit_w[c, a:b] * pw - self.dev.load_w) * spans).sum()) / HOUR_S
        self.errors.window.append((pred, true))


def summarise(errors: ForecastErrors) -> dict[str, float]:
    """MAE, bias and relative MAE of the 24-h harvest forecast (overall and by the day
    type of the forecast's start), and of the planned windows' surplus."""
    out: dict[str, float] = {}
    if errors.harvest:
        f, t, d = (np.asarray(x, np.float64) for x in zip(*errors.harvest, strict=True))
        out.update(n=float(len(f)), mae=float(np.mean(np.abs(f - t))), bias=float(np.mean(f - t)),
                   mean_truth=float(np.mean(t)), rel_mae=float(np.mean(np.abs(f - t)) / max(1e-9, np.mean(t))))
        for k, name in enumerate(("clear", "partly", "overcast")):
            sel = d == k
            if sel.any():
                out[f"bias_{name}"] = float(np.mean(f[sel] - t[sel]))
                out[f"rel_bias_{name}"] = float(np.mean(f[sel] - t[sel]) / max(1e-9, np.mean(t[sel])))
    if errors.window:
        wf, wt = np.asarray(errors.window, np.float64).T
        out.update(windows=float(len(wf)), window_mae=float(np.mean(np.abs(wf - wt))),
                   window_forecast=float(np.mean(wf)), window_truth=float(np.mean(wt)),
                   window_short=float(np.mean(wt < 0)))
    return out
