"""What the solar panel really gave: a meter over sysfs and a small crash-safe history.

The forecast's clear-sky index is learnt from this history (power/forecast.py). Where the
panel's power is measured (agent.toml [solar] panel_sensor):

    hwmon:<entry>[:<channel>]  an INA2xx/INA3221 under /sys/class/hwmon/<entry> wired on the
                               panel's (charger's input) rail: watts as measured
    battery                    the battery fuel gauge (power_now, else voltage_now x current_now):
                               while Charging, harvest = charge power + the board's expected
                               draw (the panel feeds both); while Discharging, harvest =
                               max(0, expected draw - discharge power); while Full nothing is
                               recorded (the charger curtails the panel: it would read as cloud)
    none                       no history: the index stays 1.0 (clear sky)
    auto (default)             battery if the gauge has power_now or current_now, else none

The history keeps one sample per `interval_s` (10 min) for `keep_s` (7 days): at most 1,008
samples, ~20 KB, rewritten atomically with a checksum (atomic.write_checked) after each
sample, so a brown-out loses at most the sample being written and a zero-filled file after
power loss reads as an empty history, never as a crash.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from pathlib import Path

from ..atomic import CorruptFileError, read_checked, write_checked
from ..errors import ConfigError, InputError
from ..hardware.sysfs import SysRoot
from ._nodes import NodeReader, plausible
from .sources import HWMON, INA3221, POWER_SUPPLY, HwmonInaSource

log = logging.getLogger(__name__)
INTERVAL_S = 600.0
KEEP_S = 7 * 86400.0
MAX_SAMPLES = 2016  # two weeks at 10 minutes: the bound whatever the settings
MAX_FILE_BYTES = 128 * 1024
MAX_PANEL_W = 10_000.0
_SENSOR = re.compile(r"^(auto|battery|none|hwmon:(?P<entry>[A-Za-z0-9_.-]{1,64})(?::(?P<ch>[123]))?)$")


def check_sensor(spec: str) -> str:
    """A [solar] panel_sensor value, or ConfigError saying the accepted forms."""
    if not isinstance(spec, str) or not _SENSOR.match(spec):
        raise ConfigError(f"panel_sensor: {str(spec)[:80]!r} is not auto, battery, none or hwmon:<entry>[:<1-3>] "
                          "(e.g. hwmon:hwmon2, an INA on the panel rail)")
    return spec


class PanelMeter:
    """Reads the panel's harvest in W now, or None (night readings are 0.0, not None)."""

    def __init__(self, root: str | os.PathLike[str] | SysRoot, spec: str, *, load_w: float) -> None:
        self.spec, self.load_w = check_sensor(spec), load_w
        self.nodes = NodeReader(root)
        self.ina: HwmonInaSource | None = None
        self.supply: str | None = None
        match = _SENSOR.match(spec)
        assert match is not None
        if match.group("entry"):
            directory = f"{HWMON}/{match.group('entry')}"
            chip = (self.nodes.text(f"{directory}/name") or "").strip().lower()
            if not chip:
                raise ConfigError(f"panel_sensor: {spec}: {directory}/name is not readable (no such hwmon device)")
            channel = int(match.group("ch") or 1)
            self.ina = HwmonInaSource(self.nodes.sys, directory, chip=chip, channels=(channel,), max_w=MAX_PANEL_W)
        elif spec in ("auto", "battery"):
            self.supply = self._battery()
            if self.supply is None and spec == "battery":
                raise ConfigError("panel_sensor: battery: no battery under power_supply with power_now or current_now")
        self.kind = "hwmon" if self.ina else ("battery" if self.supply else "none")

    def _battery(self) -> str | None:
        for entry in self.nodes.listdir(POWER_SUPPLY):
            supply = f"{POWER_SUPPLY}/{entry}"
            if self.nodes.text(f"{supply}/type") != "Battery" or self.nodes.text(f"{supply}/scope") == "Device":
                continue
            if self.nodes.exists(f"{supply}/power_now") or self.nodes.exists(f"{supply}/current_now"):
                return supply
        return None

    def describe(self) -> str:
        if self.ina is not None:
            return f"{self.ina.name} ({'INA3221 channel' if self.ina.chip == INA3221 else 'INA'} on the panel rail)"
        if self.supply is not None:
            return f"battery:{os.path.basename(self.supply)} charge power + the board's {self.load_w:g} W"
        return "none (no panel measurement: clear-sky index 1.0)"

    def read(self, t: float = 0.0) -> float | None:
        if self.ina is not None:
            sample = self.ina.read(t)
            return sample.watts if sample is not None else None
        if self.supply is None:
            return None
        status = self.nodes.text(f"{self.supply}/status")
        if status not in ("Charging", "Discharging"):
            return None  # Full: curtailed, not cloudy; Unknown/Not charging: nothing to learn
        uw = self.nodes.int(f"{self.supply}/power_now")
        if uw is None:
            uv, ua = self.nodes.int(f"{self.supply}/voltage_now"), self.nodes.int(f"{self.supply}/current_now")
            uw = None if uv is None or ua is None else uv * ua // 1_000_000
        if uw is None or not plausible(abs(uw) / 1e6, 0.0, MAX_PANEL_W):
            return None
        battery_w = abs(uw) / 1e6  # (gauges disagree on the sign; the status says the direction)
        return battery_w + self.load_w if status == "Charging" else max(0.0, self.load_w - battery_w)


class PanelHistory:
    """(epoch s, W) samples, one per `interval_s`, the last `keep_s`, in one checked file."""

    def __init__(self, path: str | os.PathLike[str], *, interval_s: float = INTERVAL_S, keep_s: float = KEEP_S) -> None:
        self.path, self.interval_s, self.keep_s = Path(path), interval_s, keep_s
        self.samples: list[tuple[float, float]] = self._load()

    def _load(self) -> list[tuple[float, float]]:
        try:
            data = json.loads(read_checked(self.path, MAX_FILE_BYTES))
            rows = data["samples"] if isinstance(data, dict) else None
            if not isinstance(rows, list):
                raise InputError("no samples list")
        except FileNotFoundError:
            return []
        except (InputError, CorruptFileError, OSError, ValueError, KeyError) as exc:
            log.warning("%s: panel history unusable (%s); starting a new one", self.path, str(exc)[:200])
            return []
        out: list[tuple[float, float]] = []
        for row in rows[-MAX_SAMPLES:]:
            if (isinstance(row, list) and len(row) == 2 and all(isinstance(v, int | float) and not isinstance(v, bool)
                                                                 for v in row)
                    and math.isfinite(row[0]) and plausible(row[1], 0.0, MAX_PANEL_W)
                    and (not out or row[0] > out[-1][0])):
                out.append((float(row[0]), float(row[1])))
        return out

    def due(self, now: float) -> bool:
        return not self.samples or now - self.samples[-1][0] >= self.interval_s or now < self.samples[-1][0]

    def record(self, now: float, watts: float | None) -> bool:
        """Keep a sample if one is due (a clock stepped back starts the series again); True if written."""
        if watts is None or not plausible(watts, 0.0, MAX_PANEL_W) or not self.due(now):
            return False
        kept = [s for s in self.samples if now - self.keep_s < s[0] < now]
        self.samples = [*kept, (float(now), float(watts))][-MAX_SAMPLES:]
        body = {"v": 1, "samples": [[int(t), round(w, 3)] for t, w in self.samples]}
        write_checked(self.path, json.dumps(body, separators=(",", ":")).encode())
        return True
