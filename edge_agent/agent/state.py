"""What the device says about itself: `hello` (who, what board) and `state` (how it is now).

Readings (battery, power, temperature) come from edge_agent.power's sysfs readers under the
configured root and are cached for a couple of seconds: the policy, the job driver and the
periodic state message all ask, and a sysfs read is cheap but not free on a Pi Zero.

State facts are a flat map (numbers, booleans, short strings), the shape the coordinator's
registry merges (battery_pct, on_power, energy_wh, status, ...):

    status idle|busy, name, profile, battery_pct, charging, on_power, energy_wh, power_w,
    power_source, temp_c, engine, models ("name@version,..."), job, job_state, outbox

They travel in the retained `state` message's `info` field, and as a human-readable
summary of `k=v` pairs in its `detail` text (at most 256 characters, what `mosquitto_sub`
shows), which `facts_from_state` can also read back. Nothing here imports numpy.

Beside `info`, a state may carry `forecast`: the solar surplus forecast with agent.toml
[solar] (power.forecast.SurplusForecast.to_state, refreshed hourly by agent/solar.py; a
coordinator older than this field refuses the state, so upgrade the coordinator first).

Beside `info`, a state may carry `engine_choices`: the int8 engine choices this device
measured in full, for the rest of its fleet (sent only to a coordinator whose commands
carry them, i.e. one that reads them: an older one's strict schema would refuse the state).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .. import __version__
from ..power import PowerMonitor, ThermalMonitor
from ..protocol.facts import MAX_DETAIL
from ..protocol.schema import clean_flat

AGENT = f"edge-agent/{__version__}"


@dataclass(frozen=True)
class Readings:
    battery_pct: float | None = None
    charging: bool | None = None
    energy_wh: float | None = None
    power_w: float | None = None
    power_source: str | None = None
    temp_c: float | None = None

    @property
    def on_power(self) -> bool | None:
        """Mains or charging: no battery gauge at all means mains for a field device."""
        if self.battery_pct is None:
            return True
        return bool(self.charging)


class DeviceState:
    def __init__(self, *, sysfs_root: str, probe_report: Mapping[str, Any], idle_w: float | None = None,
                 load_w: float | None = None, max_age_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.root, self.max_age_s, self._clock = sysfs_root, max_age_s, clock
        self.monitor = PowerMonitor.discover(sysfs_root, idle_w=idle_w, load_w=load_w)
        self.thermal = ThermalMonitor(sysfs_root)
        self.set_probe(probe_report)
        self._cached: Readings | None = None
        self._at = -1e18

    def set_probe(self, report: Mapping[str, Any]) -> None:
        board, cpu, prof = report.get("board", {}), report.get("cpu", {}), report.get("profile", {}) or {}
        self.board = str(board.get("model") or "unknown")[:128]
        self.arch = str(cpu.get("arch") or "")[:32]
        self.profile = str(prof.get("name") or "none")[:64]
        self.fingerprint = str(report.get("fingerprint") or "")[:64]
        self.accelerators = ",".join(sorted(str(a.get("kind")) for a in report.get("accelerators", [])))[:128]

    def readings(self, *, fresh: bool = False) -> Readings:
        now = self._clock()
        if not fresh and self._cached is not None and now - self._at < self.max_age_s:
            return self._cached
        battery = self.monitor.battery()
        sample = self.monitor.read(now)
        thermal = self.thermal.read()
        self._cached = Readings(
            battery_pct=battery.capacity_pct if battery else None,
            charging=battery.charging if battery else None,
            energy_wh=round(battery.energy_j / 3600.0, 3) if battery and battery.energy_j is not None else None,
            power_w=round(sample.watts, 3) if sample else None,
            power_source=sample.source if sample else None,
            temp_c=round(thermal.max_c, 1) if thermal else None)
        self._at = now
        return self._cached

    def hello_info(self, name: str) -> dict[str, Any]:
        # Capabilities (mxnet, trainers, native): round selection skips a device that cannot
        # run a job, e.g. a 32-bit Pi (no MXNet wheel) for a head that trains with MXNet.
        # engine_choices: this agent reads the fleet's int8 engine choices in a finetune command.
        # secagg: it runs secure aggregation (agent/secure.py): only such devices get secure jobs.
        from ..doctor import capabilities

        return _flat({"name": name, "board": self.board, "arch": self.arch, "profile": self.profile,
                      "hw_fingerprint": self.fingerprint, "accelerators": self.accelerators,
                      **capabilities(), "engine_choices": True, "secagg": True})

    def facts(self, *, name: str, busy: bool, job: str | None, job_state: str | None, models: Mapping[str, str],
              engine: str | None, outbox: int) -> dict[str, Any]:
        r = self.readings()
        return _flat({
            "status": "busy" if busy else "idle", "name": name, "profile": self.profile,
            "battery_pct": r.battery_pct, "charging": r.charging, "on_power": r.on_power,
            "energy_wh": r.energy_wh, "power_w": r.power_w, "power_source": r.power_source, "temp_c": r.temp_c,
            "engine": engine, "models": ",".join(f"{n}@{v}" for n, v in sorted(models.items())) or None,
            "job": job, "job_state": job_state, "outbox": outbox})

    def state_body(self, facts: Mapping[str, Any], allowance: Mapping[str, Any] | None = None, *,
                   engine_choices: Sequence[Mapping[str, Any]] = (),
                   forecast: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """`engine_choices`: the int8 engine choices this device measured in full (their JSON
        form), for a coordinator known to read them (lifecycle.JobDriver.shared_choices)."""
        body: dict[str, Any] = {"status": facts["status"], "agent": AGENT, "detail": render_detail(facts)}
        if facts.get("job"):
            body["job"] = facts["job"]
        body["info"] = dict(facts)
        if allowance is not None:  # policy.Allowance.to_facts: round selection skips a device that would refuse
            body["info"].update(allowance)
        if engine_choices:
            body["engine_choices"] = [dict(c) for c in engine_choices]
        if forecast is not None:
            body["forecast"] = dict(forecast)
        return body


def _flat(values: Mapping[str, Any]) -> dict[str, Any]:
    """Drop unknowns, cap strings, and drop a reading outside the protocol's range for it
    (protocol.schema.FLAT_ENTRIES: a broken sensor loses that fact, not the whole state)."""
    return clean_flat({key: value[:256] if isinstance(value, str) else value
                       for key, value in values.items() if value is not None and value != ""})


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value).replace(" ", "_")


# Most useful first: the detail is cut at 256 characters.
_DETAIL_ORDER = ("status", "battery_pct", "on_power", "charging", "power_w", "temp_c", "energy_wh", "job",
                 "job_state", "engine", "models", "outbox", "profile", "power_source", "name")


def render_detail(facts: Mapping[str, Any]) -> str:
    parts: list[str] = []
    size = 0
    for key in _DETAIL_ORDER:
        if key not in facts:
            continue
        part = f"{key}={_text(facts[key])}"
        if size + len(part) + 1 > MAX_DETAIL:
            break
        parts.append(part)
        size += len(part) + 1
    return " ".join(parts)
