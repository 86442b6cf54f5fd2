"""The simulated truth of a solar fleet: where its devices are and what their panels harvest.

Sites: devices stand at farms ("clusters", a few devices each) spread over latitudes
35-60 N and longitudes -10..25 E; each device is within ~5 km of its cluster's centre, so
the clear-sky irradiance is computed once per cluster (pvlib: `Location.get_clearsky`,
Ineichen with the Linke turbidity climatology, then `irradiance.get_total_irradiance` on the
panel's plane, 30 deg tilt facing south) on the simulated clock's grid (10-minute steps, UTC).

Clouds: a clear-sky index multiplies that irradiance. Each cluster's day is clear, partly
cloudy or overcast, a Markov chain over days (`DAY_TRANSITIONS`); the chains of nearby
clusters move together -- each day's draw is a Gaussian copula with correlation
exp(-distance / 400 km) between clusters -- so a front covers a region for days. Within a
day an hourly AR(1) noise (also regional) moves the index around its day type's mean,
interpolated to the step grid. Everything is seeded: the same seed gives the same weather.

A device's panel power (W) at a step: panel_w x POA / 1000 W/m^2 x clear-sky index x
harvest efficiency (0.75: the controller, wiring and temperature losses).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

STEP_S = 600.0  # the simulated clock's step
DAY_S = 86400.0
STEPS_PER_DAY = int(DAY_S // STEP_S)
EFFICIENCY = 0.75
TILT_DEG, AZIMUTH_DEG = 30.0, 180.0
DAY_TYPES = ("clear", "partly", "overcast")
DAY_MEAN = np.array([0.92, 0.6, 0.25])  # clear-sky index around which each day type moves
DAY_SD = np.array([0.05, 0.22, 0.08])  # its hourly noise
# P(tomorrow | today): rows today clear / partly / overcast. Stationary ~ 0.33 / 0.40 / 0.27.
DAY_TRANSITIONS = np.array([[0.6, 0.3, 0.1], [0.25, 0.5, 0.25], [0.15, 0.35, 0.5]])
CORRELATION_KM = 400.0


@dataclass(frozen=True)
class Sites:
    """Where the fleet's devices are: cluster centres and each device's cluster."""

    lat: np.ndarray  # per cluster, degrees N
    lon: np.ndarray  # per cluster, degrees E
    alt: np.ndarray  # per cluster, metres
    cluster: np.ndarray  # per device: its cluster's index

    @property
    def n_devices(self) -> int:
        return int(len(self.cluster))

    def device_latlon(self, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """Each device's own position: its cluster's centre plus up to ~5 km (0.05 deg)."""
        jitter = np.random.default_rng([seed, 0x51735]).uniform(-0.05, 0.05, (self.n_devices, 2))
        return self.lat[self.cluster] + jitter[:, 0], self.lon[self.cluster] + jitter[:, 1]


def make_sites(n_devices: int, *, per_cluster: int = 5, seed: int = 0) -> Sites:
    n_clusters = max(1, -(-n_devices // per_cluster))
    rng = np.random.default_rng([seed, 0x517E])
    lat = rng.uniform(35.0, 60.0, n_clusters)
    lon = rng.uniform(-10.0, 25.0, n_clusters)
    alt = rng.uniform(0.0, 800.0, n_clusters)
    return Sites(lat, lon, alt, np.arange(n_devices) % n_clusters)


def grid(start: float, days: int) -> np.ndarray:
    """The simulated clock's step starts (epoch s)."""
    return start + STEP_S * np.arange(days * STEPS_PER_DAY)


@functools.lru_cache(maxsize=4096)
def _poa(lat: float, lon: float, alt: float, start: float, steps: int) -> np.ndarray:
    """Clear-sky plane-of-array irradiance (W/m^2) at the middle of each step (pvlib)."""
    import pandas as pd
    from pvlib import irradiance
    from pvlib.location import Location

    times = pd.to_datetime(start + STEP_S * (np.arange(steps) + 0.5), unit="s", utc=True)
    loc = Location(lat, lon, tz="UTC", altitude=alt)
    sky = loc.get_clearsky(times)
    sun = loc.get_solarposition(times)
    poa = irradiance.get_total_irradiance(TILT_DEG, AZIMUTH_DEG, sun["apparent_zenith"], sun["azimuth"],
                                          sky["dni"], sky["ghi"], sky["dhi"])["poa_global"]
    out = np.nan_to_num(poa.to_numpy(np.float64), nan=0.0)
    out[sun["apparent_zenith"].to_numpy() >= 90.0] = 0.0  # the sun is down
    return np.maximum(out, 0.0)


def clear_sky_poa(sites: Sites, start: float, steps: int) -> np.ndarray:
    """(clusters, steps) clear-sky POA irradiance, W/m^2."""
    return np.stack([_poa(float(a), float(o), float(h), float(start), int(steps))
                     for a, o, h in zip(sites.lat, sites.lon, sites.alt, strict=True)])


def _distance_km(lat: np.ndarray, lon: np.ndarray) -> np.ndarray:
    la, lo = np.radians(lat), np.radians(lon)
    dlat, dlon = la[:, None] - la[None, :], lo[:, None] - lo[None, :]
    h = np.sin(dlat / 2) ** 2 + np.cos(la[:, None]) * np.cos(la[None, :]) * np.sin(dlon / 2) ** 2
    return 2 * 6371.0 * np.arcsin(np.sqrt(np.clip(h, 0, 1)))


def cloud_index(sites: Sites, days: int, *, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(clusters, days x steps-per-day) clear-sky index, and (clusters, days) day types
    (indices into DAY_TYPES)."""
    from scipy.stats import norm

    n = len(sites.lat)
    corr = np.exp(-_distance_km(sites.lat, sites.lon) / CORRELATION_KM)
    chol = np.linalg.cholesky(corr + 1e-9 * np.eye(n))
    rng = np.random.default_rng([seed, 0xC10D])
    types = np.empty((n, days), np.int64)
    cum = np.cumsum(DAY_TRANSITIONS, axis=1)
    state = np.minimum(np.searchsorted(np.cumsum([0.33, 0.40, 0.27]), norm.cdf(chol @ rng.standard_normal(n))), 2)
    for d in range(days):
        if d:
            u = norm.cdf(chol @ rng.standard_normal(n))
            state = np.minimum((u[:, None] > cum[state]).sum(axis=1), 2)
        types[:, d] = state
    hours = days * 24
    noise = np.empty((n, hours))
    prev = chol @ rng.standard_normal(n)
    for h in range(hours):  # AR(1), hourly, correlated like the day types
        prev = 0.7 * prev + np.sqrt(1 - 0.49) * (chol @ rng.standard_normal(n))
        noise[:, h] = prev
    day_of_hour = np.repeat(types, 24, axis=1)
    hourly = np.clip(DAY_MEAN[day_of_hour] + DAY_SD[day_of_hour] * noise, 0.05, 1.05)
    per_hour = STEPS_PER_DAY // 24
    t = (np.arange(days * STEPS_PER_DAY) + 0.5) / per_hour - 0.5  # step centres in hours
    idx = np.clip(t, 0, hours - 1)
    lo = np.floor(idx).astype(np.int64)
    hi = np.minimum(lo + 1, hours - 1)
    frac = idx - lo
    return hourly[:, lo] * (1 - frac) + hourly[:, hi] * frac, types


@dataclass(frozen=True)
class Weather:
    """The truth: clear-sky POA and clear-sky index per cluster, on the step grid."""

    start: float
    days: int
    clear_poa: np.ndarray  # (clusters, steps) W/m^2
    index: np.ndarray  # (clusters, steps)
    day_types: np.ndarray  # (clusters, days)

    @property
    def steps(self) -> int:
        return int(self.clear_poa.shape[1])

    def panel_w(self, panel_w: np.ndarray, cluster: np.ndarray, step: int) -> np.ndarray:
        """Each device's panel power (W) during `step`."""
        return panel_w * (self.clear_poa[cluster, step] * self.index[cluster, step] / 1000.0) * EFFICIENCY


def make_weather(sites: Sites, start: float, days: int, *, seed: int = 0) -> Weather:
    steps = days * STEPS_PER_DAY
    index, types = cloud_index(sites, days, seed=seed)
    return Weather(start, days, clear_sky_poa(sites, start, steps), index, types)
