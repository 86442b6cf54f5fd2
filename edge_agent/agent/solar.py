"""The agent's solar planning step: the panel history, the hourly forecast, and the plan for
a fine-tune (agent.toml [solar]; absent: none of this runs, behaviour unchanged).

    SolarSettings.from_config(config)   the site, battery, draws and sensor, validated
    SolarPlanner.tick(now)              daemon loop: a panel sample every 10 min, a forecast
                                        every forecast_interval_s (default 1 h)
    SolarPlanner.plan(...)              a job's window: the earliest start that keeps the
                                        projected battery above the floor (power.forecast)

The forecast is computed in a short-lived child (`python -m edge_agent.agent.solar`, request
on stdin, `SurplusForecast.to_state()` on stdout): pvlib and pandas add ~90 MB of RSS that
the idle daemon (target <= 60 MB) must not carry. A child costs ~1 s of CPU on a Pi 4
(mostly imports); it runs hourly and when a fine-tune is asked. Its failure (pvlib missing,
timeout) is logged and the job falls back to today's battery rule.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..errors import ConfigError, InputError
from ..power import BatteryState
from ..power.forecast import SolarSite, SurplusForecast, TrainingWindow, plan_training
from ..power.panel_history import PanelHistory, PanelMeter

log = logging.getLogger(__name__)
HISTORY_FILE = "solar/panel-history.bin"
CHILD_TIMEOUT_S = 45.0  # under systemd's WatchdogSec=60: the loop waits for the child
FRESH_S = 900.0  # a forecast this recent plans a job without computing a new one
MAX_CHILD_OUTPUT = 16 * 1024
MAX_REQUEST = 256 * 1024
PVLIB_HINT = ("the [solar] forecast needs pvlib: install the package's [solar] extra, e.g. "
              "pip install '/path/to/checkout[solar]' or 'the-wheel.whl[solar]' (pvlib==0.11.2, pandas<2.3, h5py<3.12)")


def pvlib_missing() -> str:
    """"" when pvlib and pandas import, else what to install (checked without importing them)."""
    missing = [m for m in ("pvlib", "pandas") if importlib.util.find_spec(m) is None]
    return f"{PVLIB_HINT}; missing: {', '.join(missing)}" if missing else ""


@dataclass(frozen=True, kw_only=True)
class SolarSettings:
    site: SolarSite
    capacity_wh: float
    floor_pct: float  # the governor's battery floor ([budget] battery_floor_pct, else [policy] min_battery_pct)
    load_w: float  # the board's usual draw
    train_w: float  # the extra draw while training
    train_wh: float  # the device's own default job's energy ([budget] energy_wh, else 1 h at train_w)
    panel_sensor: str = "auto"
    interval_s: float = 3600.0

    @classmethod
    def from_config(cls, config: Any) -> SolarSettings | None:
        """None without a [solar] table; ConfigError (naming the file) for a bad one."""
        solar = config.data.get("solar")
        if not solar:
            return None
        g = config.get
        idle, load = g("power", "idle_w"), g("power", "load_w")
        try:
            site = SolarSite(**{k: float(solar[k]) for k in ("latitude", "longitude", "altitude_m", "panel_w",
                                                             "tilt_deg", "azimuth_deg", "efficiency") if k in solar})
        except (InputError, KeyError) as exc:
            raise ConfigError(f"{config.path}: {exc}") from None
        board_w = float(solar.get("load_w", idle if idle is not None else 1.0))
        train_w = float(solar.get("train_w", max(0.1, (load or 0.0) - (idle or 0.0)) if load else 1.0))
        floor = g("budget", "battery_floor_pct")
        return cls(site=site, capacity_wh=float(solar["battery_wh"]),
                   floor_pct=float(floor if floor is not None else g("policy", "min_battery_pct", 40.0)),
                   load_w=board_w, train_w=train_w, train_wh=float(g("budget", "energy_wh") or train_w),
                   panel_sensor=str(solar.get("panel_sensor", "auto")),
                   interval_s=float(solar.get("forecast_interval_s", 3600.0)))

    @property
    def floor_wh(self) -> float:
        return self.capacity_wh * self.floor_pct / 100.0

    def battery_wh(self, battery: BatteryState | None) -> float | None:
        """The charge now: the gauge's energy_now if it has one, else capacity x its percentage."""
        if battery is None:
            return None
        if battery.energy_j is not None:
            return min(self.capacity_wh, battery.energy_j / 3600.0)
        return self.capacity_wh * battery.capacity_pct / 100.0


@dataclass(frozen=True)
class PlanOutcome:
    window: TrainingWindow | None
    detail: str  # the plan in words, or why there is none
    forecast: SurplusForecast | None = None  # None: no forecast (the child failed): today's rule applies


Compute = Callable[[dict[str, Any]], SurplusForecast]


class SolarPlanner:
    def __init__(self, *, settings: SolarSettings, state_dir: Path, sysfs_root: str,
                 battery: Callable[[], BatteryState | None], compute: Compute | None = None) -> None:
        self.s, self._battery = settings, battery
        self.meter = PanelMeter(sysfs_root, settings.panel_sensor, load_w=settings.load_w)
        self.history = PanelHistory(state_dir / HISTORY_FILE)
        self._compute = compute or run_child
        self.forecast: SurplusForecast | None = None
        self._made_at = float("-inf")  # when self.forecast was computed
        self._next_forecast = 0.0

    def tick(self, now: float) -> bool:
        """Sample the panel when due; refresh the forecast when due. True if the forecast changed."""
        if self.history.due(now):
            battery = self._battery()
            if not (battery is not None and battery.status == "Full"):  # full: curtailed, not cloud
                self.history.record(now, self.meter.read(now))
        if now < self._next_forecast:
            return False
        self._next_forecast = now + self.s.interval_s
        return self.refresh(now) is not None

    def refresh(self, now: float) -> SurplusForecast | None:
        """A new forecast from the battery now (None, logged, if it cannot be made)."""
        charge = self.s.battery_wh(self._battery())
        if charge is None:
            log.warning("solar forecast: no battery reading; not forecasting")
            return None
        request = {"site": self.s.site.__dict__, "now": now, "battery_wh": charge, "capacity_wh": self.s.capacity_wh,
                   "floor_wh": self.s.floor_wh, "load_w": self.s.load_w, "train_w": self.s.train_w,
                   "train_wh": self.s.train_wh, "history": [list(h) for h in self.history.samples]}
        try:
            fc = self._compute(request)
        except (InputError, OSError, subprocess.SubprocessError) as exc:
            log.warning("solar forecast failed: %s", str(exc)[:300])
            return None
        # the device's own default job's window: what a coordinator reads from the state
        self.forecast = replace(fc, window=plan_training(fc, energy_wh=self.s.train_wh, power_w=self.s.train_w))
        self._made_at = now
        return self.forecast

    def plan(self, *, now: float, energy_wh: float | None, power_cap_w: float | None,
             deadline: float) -> PlanOutcome:
        """The window for a job of `energy_wh` (None: the device's default) drawing at most
        `power_cap_w` extra, ending by `deadline`, from a forecast at most FRESH_S old (a
        command arriving minutes after the hourly refresh does not pay for pvlib's start-up
        in a child again, in the daemon's loop; the battery moves little in that time and the
        governor's floor stays the safety net)."""
        fresh = self.forecast is not None and 0 <= now - self._made_at <= FRESH_S
        fc = self.forecast if fresh else self.refresh(now)
        if fc is None:
            return PlanOutcome(None, "no solar forecast (see the log); the battery rule applies")
        power = min(self.s.train_w, power_cap_w) if power_cap_w else self.s.train_w
        energy = energy_wh if energy_wh is not None else self.s.train_wh
        window = plan_training(fc, energy_wh=energy, power_w=power, not_before=now, deadline=deadline)
        if window is not None:
            return PlanOutcome(window, f"solar window {window.describe()}", fc)
        later = plan_training(fc, energy_wh=energy, power_w=power, not_before=now)
        nxt = f"next at {_hhmm(later.start)} UTC" if later else "none in the next 24 h"
        return PlanOutcome(None, f"forecast: no surplus window before the deadline ({nxt}; {energy:g} Wh at "
                                 f"{power:g} W, floor {fc.floor_wh:.1f} Wh)", fc)

    def state(self, waiting: TrainingWindow | None = None) -> dict[str, Any] | None:
        """The forecast for the state message, with a waiting job's window (`waiting`) if any."""
        if self.forecast is None:
            return None
        return replace(self.forecast, window=waiting or self.forecast.window).to_state()


def _hhmm(epoch: float) -> str:
    return time.strftime("%H:%M", time.gmtime(epoch))


def run_child(request: dict[str, Any], *, python: Sequence[str] | None = None,
              timeout: float = CHILD_TIMEOUT_S) -> SurplusForecast:
    """Compute a forecast in a child process (keeps pvlib out of the daemon's memory)."""
    command = [*(python or (sys.executable,)), "-m", "edge_agent.agent.solar"]
    done = subprocess.run(command, input=json.dumps(request).encode(), capture_output=True, timeout=timeout,
                          check=False)
    if done.returncode != 0:
        raise InputError(f"forecast child exited {done.returncode}: "
                         f"{done.stderr.decode(errors='replace').strip().splitlines()[-1:] or ['no detail']}")
    if len(done.stdout) > MAX_CHILD_OUTPUT:
        raise InputError(f"forecast child wrote {len(done.stdout)} bytes (limit {MAX_CHILD_OUTPUT})")
    try:
        return SurplusForecast.from_state(json.loads(done.stdout))
    except ValueError as exc:
        raise InputError(f"forecast child output is not JSON ({str(exc)[:100]})") from None


def compute_request(request: dict[str, Any]) -> SurplusForecast:
    """The child's work (in-process too: `edge-agent forecast`, tests)."""
    from ..power.forecast import forecast_surplus

    site = SolarSite(**request["site"])
    history = [(float(t), float(w)) for t, w in request.get("history", [])]
    return forecast_surplus(site, now=float(request["now"]), battery_wh=float(request["battery_wh"]),
                            capacity_wh=float(request["capacity_wh"]), floor_wh=float(request["floor_wh"]),
                            load_w=float(request["load_w"]), history=history, train_w=request.get("train_w"),
                            train_wh=request.get("train_wh"))


def main() -> int:
    raw = sys.stdin.buffer.read(MAX_REQUEST + 1)
    if len(raw) > MAX_REQUEST:
        print(f"forecast request over {MAX_REQUEST} bytes", file=sys.stderr)
        return 65
    try:
        fc = compute_request(json.loads(raw))
    except (InputError, ValueError, KeyError, TypeError) as exc:
        print(f"forecast: {str(exc)[:300]}", file=sys.stderr)
        return 65
    sys.stdout.write(json.dumps(fc.to_state(), separators=(",", ":")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
