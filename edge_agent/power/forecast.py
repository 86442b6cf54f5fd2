"""The next 24 h of solar surplus: a clear-sky model for the site, scaled by what the panel
really gave, minus the board's draw; and the earliest training window it allows.

    harvest(step) = clear-sky irradiance on the tilted panel (pvlib: Ineichen with the Linke
                    turbidity table pvlib ships, sun position, Perez/isotropic transposition)
                    x panel_w / 1000 W/m2 x efficiency x clear_sky_index
    surplus(step) = harvest(step) - load_w

The clear-sky index is learnt from the panel's measured history (measured / modelled over
daylight samples, recent days weighted more): it folds in the site's usual cloud, shading,
dust and an optimistic panel rating. There is no weather service -- the device is offline
first -- so a cloudy tomorrow after sunny days is over-forecast; the governor's battery floor
still pauses training if the battery gets there (docs/solar-deployment.md, "Reading the
forecast").

pvlib and pandas are imported only inside `forecast_surplus`: importing this module (the
daemon, the coordinator's selection) costs nothing, and the agent computes forecasts in a
short-lived child process (agent/solar.py) because pvlib+pandas add ~90 MB of RSS.

Cost: a 24-step forecast with a week of 10-minute history (1,008 samples) takes about 15 ms
on an x86 laptop core once pvlib is imported (median of 20; importing pvlib+pandas takes
~0.6 s more, paid once per child). Four sun positions per hour are averaged per step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import InputError

STEP_S = 3600.0
SUBSTEPS = 4  # sun positions averaged per hourly step
MAX_HOURS = 48
INDEX_MIN, INDEX_MAX = 0.05, 1.2
INDEX_HALF_LIFE_DAYS = 2.0  # yesterday counts ~0.7 of today, a week ago ~0.1
DAYLIGHT_FRACTION = 0.05  # history samples where the model gives < 5 % of the peak rating are ignored
MAX_HISTORY = 7 * 24 * 6 * 2  # two weeks of 10-minute samples at most
MAX_W = 100_000.0  # numbers outside +-100 kW / 1 MWh are garbage, not a field device
MAX_WH = 1_000_000.0
STATE_VERSION = 1


def _check(name: str, value: Any, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InputError(f"{name}: expected a finite number, got {str(value)[:40]!r}")
    if not low <= value <= high:
        raise InputError(f"{name}: {value!r} is outside [{low:g}, {high:g}]")
    return float(value)


@dataclass(frozen=True)
class SolarSite:
    """Where the panel is and what it can give (agent.toml [solar])."""

    latitude: float
    longitude: float
    altitude_m: float = 0.0
    panel_w: float = 20.0  # rated panel power (W at 1000 W/m2)
    tilt_deg: float = 30.0  # 0: flat, 90: vertical
    azimuth_deg: float = 180.0  # the direction it faces: 180 south, 0/360 north, 90 east
    efficiency: float = 0.75  # controller + wiring: rated watts -> watts into the battery

    def __post_init__(self) -> None:
        for name, low, high in (("latitude", -90, 90), ("longitude", -180, 180), ("altitude_m", -450, 9000),
                                ("panel_w", 0.1, 100_000), ("tilt_deg", 0, 90), ("azimuth_deg", 0, 360),
                                ("efficiency", 0.01, 1.0)):
            _check(f"solar.{name}", getattr(self, name), low, high)


@dataclass(frozen=True)
class TrainingWindow:
    start: float  # epoch s
    end: float  # epoch s: start + energy / power
    why: str

    def describe(self) -> str:
        return f"{_hhmm(self.start)}-{_hhmm(self.end)} UTC ({self.why})"


@dataclass(frozen=True)
class SurplusForecast:
    start: float  # epoch seconds of the first step
    step_s: float  # 3600.0
    panel_w: tuple[float, ...]  # expected harvest per step (clear-sky on the tilted panel x the index)
    clear_sky_w: tuple[float, ...]  # the same without the index (the model's part)
    load_w: float  # the board's expected draw (idle + application), W
    battery_wh: float
    capacity_wh: float
    floor_wh: float
    clear_sky_index: float  # measured / clear-sky over the history (1.0 with no history)
    # Beyond the core: what the device's own default job draws (extra W) and costs (Wh), and
    # its plan for it, so a coordinator can judge a round without knowing the board.
    train_w: float | None = None
    train_wh: float | None = None
    window: TrainingWindow | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        n = len(self.panel_w)
        if not 1 <= n <= MAX_HOURS or len(self.clear_sky_w) != n:
            raise InputError(f"forecast: {n} steps ({len(self.clear_sky_w)} clear-sky); 1..{MAX_HOURS}, equal")
        _check("forecast.start", self.start, 0, 1 << 40)
        _check("forecast.step_s", self.step_s, 60, 86400)
        for name in ("load_w",):
            _check(f"forecast.{name}", getattr(self, name), 0, MAX_W)
        for name in ("battery_wh", "capacity_wh", "floor_wh"):
            _check(f"forecast.{name}", getattr(self, name), 0, MAX_WH)
        if self.capacity_wh <= 0 or self.floor_wh > self.capacity_wh:
            raise InputError(f"forecast: floor {self.floor_wh:g} Wh must be within the capacity {self.capacity_wh:g} Wh")
        _check("forecast.clear_sky_index", self.clear_sky_index, 0, INDEX_MAX)
        for i, (p, c) in enumerate(zip(self.panel_w, self.clear_sky_w, strict=True)):
            _check(f"forecast.panel_w[{i}]", p, 0, MAX_W)
            _check(f"forecast.clear_sky_w[{i}]", c, 0, MAX_W)
        if self.train_w is not None:
            _check("forecast.train_w", self.train_w, 0.001, MAX_W)
        if self.train_wh is not None:
            _check("forecast.train_wh", self.train_wh, 0.0001, MAX_WH)

    @property
    def end(self) -> float:
        return self.start + self.step_s * len(self.panel_w)

    def surplus_w(self) -> tuple[float, ...]:
        """Harvest minus the board's draw, per step (negative: the battery drains)."""
        return tuple(p - self.load_w for p in self.panel_w)

    def battery_trajectory(self, extra_w: Sequence[float] = ()) -> tuple[float, ...]:
        """Projected charge (Wh) at each step's end, clipped to [0, capacity] (a full battery
        wastes the surplus; an empty one browns out). `extra_w`: added draw per step (missing
        steps: 0)."""
        hours = self.step_s / 3600.0
        charge, out = min(self.battery_wh, self.capacity_wh), []
        for i, surplus in enumerate(self.surplus_w()):
            extra = extra_w[i] if i < len(extra_w) else 0.0
            charge = min(self.capacity_wh, max(0.0, charge + (surplus - extra) * hours))
            out.append(charge)
        return tuple(out)

    def to_state(self) -> dict[str, Any]:
        """The compact form for the state message (~400 bytes for 24 steps): hourly surplus
        in W (2 decimals), the index, the battery, and the device's planned window if any."""
        body: dict[str, Any] = {
            "v": STATE_VERSION, "start": int(round(self.start)), "step_s": int(round(self.step_s)),
            "surplus_w": [round(s, 2) for s in self.surplus_w()], "load_w": round(self.load_w, 3),
            "index": round(self.clear_sky_index, 3), "battery_wh": round(self.battery_wh, 2),
            "capacity_wh": round(self.capacity_wh, 2), "floor_wh": round(self.floor_wh, 2)}
        if self.train_w is not None:
            body["train_w"] = round(self.train_w, 3)
        if self.train_wh is not None:
            body["train_wh"] = round(self.train_wh, 4)
        if self.window is not None:
            body["window"] = {"start": int(self.window.start), "end": int(math.ceil(self.window.end)),
                              "why": self.window.why[:120]}
        return body

    @classmethod
    def from_state(cls, d: Mapping[str, Any]) -> SurplusForecast:
        """Parse `to_state`'s form from an untrusted peer: InputError naming what is wrong."""
        if not isinstance(d, Mapping):
            raise InputError("forecast: not an object")
        known = {"v", "start", "step_s", "surplus_w", "load_w", "index", "battery_wh", "capacity_wh", "floor_wh",
                 "train_w", "train_wh", "window"}
        unknown = [str(k)[:32] for k in d if k not in known]
        if unknown:
            raise InputError(f"forecast: unknown field(s) {', '.join(unknown[:4])}")
        if d.get("v") != STATE_VERSION:
            raise InputError(f"forecast: version {str(d.get('v'))[:16]!r} is not {STATE_VERSION}")
        for key in ("start", "step_s", "surplus_w", "load_w", "index", "battery_wh", "capacity_wh", "floor_wh"):
            if key not in d:
                raise InputError(f"forecast: missing {key}")
        surplus = d["surplus_w"]
        if not isinstance(surplus, list | tuple) or not 1 <= len(surplus) <= MAX_HOURS:
            raise InputError(f"forecast.surplus_w: a list of 1..{MAX_HOURS} numbers")
        load = _check("forecast.load_w", d["load_w"], 0, MAX_W)
        index = _check("forecast.index", d["index"], 0, INDEX_MAX)
        panel = tuple(max(0.0, _check(f"forecast.surplus_w[{i}]", s, -MAX_W, MAX_W) + load)
                      for i, s in enumerate(surplus))
        clear = tuple(p / index if index > 0 else 0.0 for p in panel)
        window = None
        if d.get("window") is not None:
            w = d["window"]
            if not isinstance(w, Mapping) or set(w) - {"start", "end", "why"}:
                raise InputError("forecast.window: an object of start, end, why")
            why = w.get("why", "")
            if not isinstance(why, str) or len(why) > 120 or not why.isprintable():
                raise InputError("forecast.window.why: printable text of at most 120 characters")
            ws = _check("forecast.window.start", w.get("start"), 0, 1 << 40)
            we = _check("forecast.window.end", w.get("end"), ws, 1 << 40)
            window = TrainingWindow(ws, we, why)
        return cls(start=_check("forecast.start", d["start"], 0, 1 << 40),
                   step_s=_check("forecast.step_s", d["step_s"], 60, 86400), panel_w=panel, clear_sky_w=clear,
                   load_w=load, battery_wh=_check("forecast.battery_wh", d["battery_wh"], 0, MAX_WH),
                   capacity_wh=_check("forecast.capacity_wh", d["capacity_wh"], 0, MAX_WH),
                   floor_wh=_check("forecast.floor_wh", d["floor_wh"], 0, MAX_WH), clear_sky_index=index,
                   train_w=d.get("train_w"), train_wh=d.get("train_wh"), window=window)


def _hhmm(epoch: float) -> str:
    return time.strftime("%H:%M", time.gmtime(epoch))


# ---------------------------------------------------------------- the model (pvlib)
def clear_sky_harvest(site: SolarSite, times_s: Sequence[float]) -> list[float]:
    """Watts into the battery under a clear sky at each epoch second (pvlib, imported here)."""
    if not times_s:
        return []
    try:
        import pandas as pd
        from pvlib import irradiance
        from pvlib.location import Location
    except ImportError as exc:
        raise InputError(f"the solar forecast needs pvlib ({exc.name} is missing): "
                         "install the [solar] extra, e.g. pip install '/path/to/checkout[solar]'") from None
    times = pd.DatetimeIndex(pd.to_datetime(list(times_s), unit="s", utc=True))
    location = Location(site.latitude, site.longitude, tz="UTC", altitude=site.altitude_m)
    sun = location.get_solarposition(times)
    try:  # Ineichen with the Linke turbidity table pvlib ships (an HDF5 file read by h5py)
        sky = location.get_clearsky(times, model="ineichen", solar_position=sun)
    except (ImportError, OSError):  # no h5py or an unreadable table: a model that needs no data
        sky = location.get_clearsky(times, model="simplified_solis", solar_position=sun)
    poa = irradiance.get_total_irradiance(site.tilt_deg, site.azimuth_deg, sun["apparent_zenith"], sun["azimuth"],
                                          sky["dni"], sky["ghi"], sky["dhi"])["poa_global"]
    scale = site.panel_w / 1000.0 * site.efficiency
    return [max(0.0, float(v)) * scale if v == v else 0.0 for v in poa.to_numpy()]


def learn_index(history: Sequence[tuple[float, float]], modelled: Sequence[float], *, now: float,
                peak_w: float) -> float:
    """The clear-sky index: sum(measured) / sum(modelled) over daylight samples, each weighted
    by exp(-age ln2 / half-life), clipped to [0.05, 1.2]; 1.0 without daylight samples."""
    measured_sum = modelled_sum = 0.0
    decay = math.log(2) / (INDEX_HALF_LIFE_DAYS * 86400.0)
    for (t, watts), model in zip(history, modelled, strict=True):
        if model < DAYLIGHT_FRACTION * peak_w:
            continue
        weight = math.exp(-max(0.0, now - t) * decay)
        measured_sum += weight * watts
        modelled_sum += weight * model
    if modelled_sum <= 0:
        return 1.0
    return min(INDEX_MAX, max(INDEX_MIN, measured_sum / modelled_sum))


def _clean_history(history: Sequence[tuple[float, float]], now: float) -> list[tuple[float, float]]:
    out = []
    for item in list(history)[-MAX_HISTORY:]:
        try:
            t, w = float(item[0]), float(item[1])
        except (TypeError, ValueError, IndexError):
            continue
        if math.isfinite(t) and math.isfinite(w) and now - 30 * 86400 <= t <= now and 0 <= w <= MAX_W:
            out.append((t, w))
    return out


def forecast_surplus(site: SolarSite, *, now: float, battery_wh: float, capacity_wh: float, floor_wh: float,
                     load_w: float, history: Sequence[tuple[float, float]] = (), hours: int = 24,
                     train_w: float | None = None, train_wh: float | None = None) -> SurplusForecast:
    """The surplus for `hours` hourly steps from `now`. `history`: (epoch s, measured panel W)
    samples of past days (bad or future samples are skipped); the index is learnt from them."""
    _check("now", now, 0, 1 << 40)
    if isinstance(hours, bool) or not isinstance(hours, int) or not 1 <= hours <= MAX_HOURS:
        raise InputError(f"hours: an integer in 1..{MAX_HOURS}, got {hours!r}")
    capacity = _check("capacity_wh", capacity_wh, 0.001, MAX_WH)
    past = _clean_history(history, now)
    # one pvlib call for the forecast's sub-steps and the history (the Linke table is read once)
    grid = [now + (i + (j + 0.5) / SUBSTEPS) * STEP_S for i in range(hours) for j in range(SUBSTEPS)]
    modelled = clear_sky_harvest(site, grid + [t for t, _ in past])
    ahead, behind = modelled[:len(grid)], modelled[len(grid):]
    index = learn_index(past, behind, now=now, peak_w=site.panel_w * site.efficiency)
    clear = tuple(sum(ahead[i * SUBSTEPS:(i + 1) * SUBSTEPS]) / SUBSTEPS for i in range(hours))
    return SurplusForecast(
        start=float(now), step_s=STEP_S, panel_w=tuple(c * index for c in clear), clear_sky_w=clear,
        load_w=_check("load_w", load_w, 0, MAX_W), battery_wh=min(capacity, _check("battery_wh", battery_wh, 0, MAX_WH)),
        capacity_wh=capacity, floor_wh=_check("floor_wh", floor_wh, 0, capacity), clear_sky_index=index,
        train_w=train_w, train_wh=train_wh)


# ---------------------------------------------------------------- planning
def _extra_draw(forecast: SurplusForecast, start: float, end: float, power_w: float) -> list[float]:
    """`power_w` drawn over [start, end) as an average per step."""
    out = []
    for i in range(len(forecast.panel_w)):
        s0 = forecast.start + i * forecast.step_s
        overlap = max(0.0, min(end, s0 + forecast.step_s) - max(start, s0))
        out.append(power_w * overlap / forecast.step_s)
    return out


def plan_training(forecast: SurplusForecast, *, energy_wh: float, power_w: float, not_before: float | None = None,
                  deadline: float | None = None) -> TrainingWindow | None:
    """The earliest start -- `not_before` (default: the forecast's start) or a later step
    boundary -- such that drawing `power_w` extra for `energy_wh / power_w` hours keeps the
    projected battery at or above the floor at the start and at the end of every step from
    the start to the horizon. The run must end by `deadline` and within the horizon. None if
    there is no such window. Since the whole horizon must stay above the floor, a night run
    that would leave the battery short before dawn is refused: surplus is preferred by
    construction."""
    energy = _check("energy_wh", energy_wh, 0.0001, MAX_WH)
    power = _check("power_w", power_w, 0.001, MAX_W)
    duration = energy / power * 3600.0
    earliest = forecast.start if not_before is None else max(forecast.start, float(not_before))
    last_end = forecast.end if deadline is None else min(forecast.end, float(deadline))
    baseline = forecast.battery_trajectory()
    first = int((earliest - forecast.start) // forecast.step_s)
    candidates = [earliest] + [forecast.start + k * forecast.step_s for k in range(first + 1, len(forecast.panel_w))]
    surplus = forecast.surplus_w()
    for begin in candidates:
        end = begin + duration
        if end > last_end + 1e-6:
            break
        k = int((begin - forecast.start) // forecast.step_s)
        before = forecast.battery_wh if k == 0 else baseline[k - 1]
        if begin > forecast.start + k * forecast.step_s:  # mid-step (not_before): the lower end
            before = min(before, baseline[k])
        if before < forecast.floor_wh:
            continue
        trajectory = forecast.battery_trajectory(_extra_draw(forecast, begin, end, power))
        if all(c >= forecast.floor_wh for c in trajectory[k:]):
            last = min(len(surplus), int(math.ceil((end - forecast.start) / forecast.step_s)))
            covered = all(s >= power for s in surplus[k:last])
            why = ("surplus covers the draw" if covered
                   else f"battery stays >= {forecast.floor_wh:.1f} Wh floor to the horizon")
            return TrainingWindow(begin, end, why)
    return None
