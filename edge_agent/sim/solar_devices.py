"""A simulated solar fleet's devices and data (issue 38): what stays the same in every run.

Devices (`make_devices`): a location (solar_weather.Sites: clusters of 5 within ~5 km, over
35-60 N, -10..25 E), a panel (60-100 W), a battery (240-480 Wh: 12 V, 20-40 Ah), the Raspberry
Pi 4 profile's power (firmware_configs/raspberry-pi-4.toml: idle 2.7 W is the board's load
all day, 6.4 W while training), a local job of 20 min at full load on the median device (x a
per-device speed factor, lognormal sd 0.35: slower boards, more data; 1.23 Wh above idle) and
an upload latency over a cellular link (lognormal, median 2 min, a heavy tail). Battery
floor 35 %, resume 45 % (the real `power.Budget`'s default resume gap), the owner's policy
`min_battery_pct` 40 % (the real `agent.policy.DeviceLimits` default).

Data: the digits cameras and textures of sim/poisoning.py, but each device draws `PER_DEVICE`
(60) samples with its own Dirichlet(1.0) label shares from the training pool -- with 1,000
devices the 1,048 training digits cannot be partitioned, so devices' draws overlap; each
device sees them through its own camera. Test and server sets are poisoning's.

A `SolarFleet` is devices + weather (solar_weather.py, the truth) + data + seed: the same
fleet is given to every mode, so "same data, same total energy available" holds by
construction (same panels, batteries and weather).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ..agent.policy import DeviceLimits
from ..power.budget import Budget
from .digits import apply_camera, camera_params, device_seed, load_digits_images
from .poisoning import (
    SERVER_SAMPLES,
    FleetData,
    _split_server,
    _through_cameras,
    seeded_device_keys,
    texture_fleet,
)
from .solar_weather import STEP_S, Sites, Weather, make_sites, make_weather

PER_DEVICE = 60
# Sized as an off-grid Pi 4 is (65 Wh a day at idle): a battery for ~2.5 days of autonomy
# between the floor and full, a panel that refills it in a clear April day. The bench checks
# the sizing (`idle_minimum_pct`): with idle load alone every device of its fleets stays 7+
# points above its floor for the 14 days (lowest 42.4 %), so a device below its floor in a
# run is there because of training. The first sizing (30-60 W, 80-180 Wh) took 20 of 100 and
# 180 of 1,000 devices below it at night with no training at all; 50-100 W panels left one
# device of 100 (seed 2) 0.27 points above it at idle, and below it after any training.
PANEL_W = (60.0, 100.0)
BATTERY_WH = (240.0, 480.0)
START = 1_711_929_600.0  # 2024-04-01 00:00 UTC
HOUR = 3600.0


# ---------------------------------------------------------------- the devices' hardware
@functools.cache
def pi4_power() -> tuple[float, float]:
    """(idle_w, load_w) of the raspberry-pi-4 profile."""
    from ..hardware.profiles import load_profiles, profiles_dir

    prof = load_profiles([profiles_dir() / "raspberry-pi-4.toml"]).profiles["raspberry-pi-4"]
    return float(prof.get("power", "idle_w")), float(prof.get("power", "load_w"))


@dataclass(frozen=True)
class Devices:
    sites: Sites
    lat: np.ndarray
    lon: np.ndarray
    panel_w: np.ndarray
    battery_wh: np.ndarray  # capacity
    start_pct: np.ndarray
    load_w: float
    train_w: float
    job_s: np.ndarray  # a local job's duration at full load
    budget: Budget  # floor / resume
    limits: DeviceLimits  # the owner's policy (min_battery_pct)

    @property
    def n(self) -> int:
        return int(len(self.panel_w))

    @property
    def floor_wh(self) -> np.ndarray:
        return self.battery_wh * float(self.budget.battery_floor_pct) / 100  # type: ignore[arg-type]

    @property
    def resume_wh(self) -> np.ndarray:
        return self.battery_wh * float(self.budget.battery_resume_pct) / 100  # type: ignore[arg-type]

    def job_extra_wh(self) -> np.ndarray:
        return (self.train_w - self.load_w) * self.job_s / HOUR


def make_devices(n: int, *, seed: int = 0, job_min: float = 20.0) -> Devices:
    rng = np.random.default_rng([seed, 0xDE71])
    sites = make_sites(n, seed=seed)
    lat, lon = sites.device_latlon(seed)
    idle, load = pi4_power()
    return Devices(sites, lat, lon, rng.uniform(*PANEL_W, n), rng.uniform(*BATTERY_WH, n), rng.uniform(50, 90, n),
                   idle, load, job_min * 60 * np.exp(rng.normal(0, 0.35, n)),
                   Budget(battery_floor_pct=35.0), DeviceLimits(min_battery_pct=40.0, data_dir="/"))


def latency_s(rng: np.random.Generator) -> float:
    """Upload over a cellular link: lognormal, median 2 min; 5 % wait for a lost link (~40 min)."""
    base = 120.0 * float(np.exp(rng.normal(0, 0.8)))
    return base + (float(rng.exponential(2400.0)) if rng.random() < 0.05 else 0.0)


def idle_minimum_pct(devices: Devices, weather: Weather) -> np.ndarray:
    """Each device's lowest battery (% of capacity) over the weather's days with only its
    idle load: what the sizing alone leaves above the floor."""
    battery = devices.battery_wh * devices.start_pct / 100
    lowest = battery / devices.battery_wh
    for step in range(weather.steps):
        harvest = weather.panel_w(devices.panel_w, devices.sites.cluster, step)
        battery = np.clip(battery + (harvest - devices.load_w) * STEP_S / HOUR, 0.0, devices.battery_wh)
        lowest = np.minimum(lowest, battery / devices.battery_wh)
    return 100 * lowest


# ---------------------------------------------------------------- the data
def digits_overlapping(n: int, *, seed: int = 0, per_device: int = PER_DEVICE, alpha: float = 1.0) -> FleetData:
    """Digits for any number of devices: held-out test (449) and server (SERVER_SAMPLES) as
    poisoning.digits_fleet, each device `per_device` draws from the remaining pool with its
    own Dirichlet label shares (without replacement within a device; devices overlap)."""
    images, labels = load_digits_images()
    perm = np.random.default_rng([seed, 0x7E57]).permutation(len(labels))
    test_idx, srv_idx, pool = perm[:449], perm[449:449 + SERVER_SAMPLES], perm[449 + SERVER_SAMPLES:]
    by_class = [pool[labels[pool] == c] for c in range(10)]
    rng = np.random.default_rng([seed, 0xD161])
    cams = [camera_params(device_seed(seed, d)) for d in range(n)]
    xs, ys = [], []
    for d in range(n):
        share = rng.dirichlet([alpha] * 10)
        counts = rng.multinomial(per_device, share)
        idx = np.concatenate([rng.choice(by_class[c], size=min(k, len(by_class[c])), replace=False)
                              for c, k in enumerate(counts) if k])
        xs.append(apply_camera(images[idx], cams[d]).reshape(len(idx), -1))
        ys.append(labels[idx])
    flat = lambda idx: _through_cameras(images[idx], cams, apply_camera).reshape(len(idx), -1)  # noqa: E731
    return FleetData("digits", [str(i) for i in range(10)], xs, ys, flat(test_idx), labels[test_idx],
                     _split_server(flat(srv_idx), labels[srv_idx], 10))


def fleet_data(name: str, n: int, *, seed: int = 0) -> FleetData:
    if name == "digits":
        return digits_overlapping(n, seed=seed)
    return texture_fleet(n, seed=seed, per_device=PER_DEVICE)


# ---------------------------------------------------------------- keys
@functools.lru_cache(maxsize=4)
def device_keys(n: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """The devices' ids and public keys, derived from the seed: the coordinator orders and
    samples devices by id, so fresh random keys made two runs of one cell select different
    devices (a synchronous cell reached its final accuracy at 183 h in one run, 199 h in
    another). Simulation keys only: a real device generates its key."""
    return seeded_device_keys(f"solar-sim/{seed}", n)


# ---------------------------------------------------------------- a fleet
@dataclass(frozen=True)
class SolarFleet:
    devices: Devices
    weather: Weather
    data: FleetData
    seed: int

    @property
    def n(self) -> int:
        return self.devices.n


def make_fleet(n: int, *, days: int = 14, data: str = "digits", seed: int = 0, start: float = START) -> SolarFleet:
    devices = make_devices(n, seed=seed)
    return SolarFleet(devices, make_weather(devices.sites, start, days, seed=seed), fleet_data(data, n, seed=seed), seed)
