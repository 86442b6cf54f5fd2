"""A simulated device's training planner: the agent's surplus forecast and window planner
(`edge_agent.power.forecast`: `forecast_surplus`, `plan_training`) behind a small adapter.

STAND-IN: until edge_agent/power/forecast.py is on main, `_standin_forecast_surplus` and
`_standin_plan_training` below implement its published API (hourly clear-sky panel watts
from pvlib, times a clear-sky index estimated from the last hours' measured panel power,
relaxing towards the climatology; the earliest hour whose surplus pays for the training and
whose battery trajectory stays above the floor). They are deleted when the real module lands.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

HOUR_S = 3600.0


@dataclass(frozen=True)
class SolarSite:
    latitude: float
    longitude: float
    altitude_m: float = 0.0
    panel_w: float = 20.0
    tilt_deg: float = 30.0
    azimuth_deg: float = 180.0
    efficiency: float = 0.75


@dataclass(frozen=True)
class TrainingWindow:
    start: float
    end: float
    why: str = ""


@dataclass(frozen=True)
class SurplusForecast:
    start: float
    step_s: float
    panel_w: tuple[float, ...]
    clear_sky_w: tuple[float, ...]
    load_w: float
    battery_wh: float
    capacity_wh: float
    floor_wh: float
    clear_sky_index: float
    extra: dict[str, float] = field(default_factory=dict, compare=False)

    def surplus_w(self) -> tuple[float, ...]:
        return tuple(p - self.load_w for p in self.panel_w)

    def battery_trajectory(self, extra_w: Sequence[float] = ()) -> tuple[float, ...]:
        out, b = [], self.battery_wh
        for i, s in enumerate(self.surplus_w()):
            b = min(self.capacity_wh, max(0.0, b + (s - (extra_w[i] if i < len(extra_w) else 0.0))
                                          * self.step_s / HOUR_S))
            out.append(b)
        return tuple(out)


@functools.lru_cache(maxsize=8192)
def _hourly_clear_w(lat: float, lon: float, alt: float, tilt: float, az: float, day: float) -> np.ndarray:
    """Clear-sky POA (W/m^2) for the 48 hours from `day` (epoch s, midnight UTC), hour centres."""
    import pandas as pd
    from pvlib import irradiance
    from pvlib.location import Location

    times = pd.to_datetime(day + HOUR_S * (np.arange(48) + 0.5), unit="s", utc=True)
    loc = Location(lat, lon, tz="UTC", altitude=alt)
    sky, sun = loc.get_clearsky(times), loc.get_solarposition(times)
    poa = irradiance.get_total_irradiance(tilt, az, sun["apparent_zenith"], sun["azimuth"],
                                          sky["dni"], sky["ghi"], sky["dhi"])["poa_global"].to_numpy(np.float64)
    poa = np.nan_to_num(poa)
    poa[sun["apparent_zenith"].to_numpy() >= 90] = 0.0
    return np.maximum(poa, 0.0)


CLIMATOLOGY_CSI = 0.6


def _standin_forecast_surplus(site: SolarSite, *, now: float, battery_wh: float, capacity_wh: float,
                              floor_wh: float, load_w: float, history: Sequence[tuple[float, float]] = (),
                              hours: int = 24) -> SurplusForecast:
    start = math.floor(now / HOUR_S) * HOUR_S
    day = math.floor(start / 86400.0) * 86400.0
    off = int((start - day) // HOUR_S)
    poa = _hourly_clear_w(round(site.latitude, 2), round(site.longitude, 2), round(site.altitude_m, -1),
                          site.tilt_deg, site.azimuth_deg, day)[off:off + hours]
    clear = site.panel_w * poa / 1000.0 * site.efficiency
    ratios = []
    for t, w in history:
        h = int((math.floor(t / HOUR_S) * HOUR_S - day) // HOUR_S)
        if 0 <= h < 48:
            cw = site.panel_w * _hourly_clear_w(round(site.latitude, 2), round(site.longitude, 2),
                                                round(site.altitude_m, -1), site.tilt_deg, site.azimuth_deg,
                                                day)[h] / 1000.0 * site.efficiency
            if cw > 0.1 * site.panel_w * site.efficiency:
                ratios.append(w / cw)
    k = float(np.clip(np.mean(ratios), 0.05, 1.1)) if ratios else CLIMATOLOGY_CSI
    weights = 0.85 ** np.arange(len(clear))
    csi = CLIMATOLOGY_CSI + (k - CLIMATOLOGY_CSI) * weights
    return SurplusForecast(start, HOUR_S, tuple(float(x) for x in clear * csi), tuple(float(x) for x in clear),
                           load_w, battery_wh, capacity_wh, floor_wh, k)


def _standin_plan_training(forecast: SurplusForecast, *, energy_wh: float, power_w: float,
                           not_before: float | None = None, deadline: float | None = None) -> TrainingWindow | None:
    surplus = forecast.surplus_w()
    need_h = max(1, math.ceil(energy_wh / max(power_w, 1e-9)))
    for i in range(len(surplus) - need_h + 1):
        t0 = forecast.start + i * forecast.step_s
        if not_before is not None and t0 + forecast.step_s <= not_before:
            continue
        if deadline is not None and t0 + need_h * forecast.step_s > deadline:
            return None
        if min(surplus[i:i + need_h]) < power_w:
            continue
        extra = [0.0] * i + [energy_wh / need_h] * need_h
        if min(forecast.battery_trajectory(extra)) < forecast.floor_wh:
            continue
        start = max(t0, not_before or t0)
        return TrainingWindow(start, t0 + need_h * forecast.step_s, "surplus pays for the training")
    return None


forecast_surplus = _standin_forecast_surplus
plan_training = _standin_plan_training
FORECAST_IS_STANDIN = True
