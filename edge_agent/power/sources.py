"""Power sources: where the watts come from, in the order the agent trusts them.

1. hwmon INA219/220/226/230/231/234/238/260/3221 shunt monitors (the real input rail);
2. a discharging battery's fuel gauge (/sys/class/power_supply: power_now, V x I, or
   energy_now differences);
3. RAPL package energy counters (x86 only; CPU package, not the whole board);
4. an estimate from CPU utilisation (/proc/stat) and the board profile's idle/load watts.

Every sample says which source produced it. A source never raises: a missing, unreadable
or nonsensical node gives `None` (recorded in the source's problem log) so the monitor
falls back to the next source.

Kernel units (Documentation/hwmon/sysfs-interface, ina2xx.rst, ina3221.rst,
ABI/testing/sysfs-class-power, powercap): in*_input mV, curr*_input mA, power*_input uW;
power_now uW, voltage_now uV, current_now uA, energy_now uWh; energy_uj uJ wrapping at
max_energy_range_uj; /proc/stat in jiffies.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ..hardware.sysfs import SysRoot
from ._nodes import NodeReader, plausible

MAX_PLAUSIBLE_W = 1000.0  # a field device drawing more than 1 kW is a garbage reading
UWH_TO_J = 3.6e-3

HWMON = "/sys/class/hwmon"
POWER_SUPPLY = "/sys/class/power_supply"
POWERCAP = "/sys/class/powercap"

# hwmon `name` values of TI shunt monitors whose drivers expose in/curr(/power) inputs.
INA2XX_CHIPS = frozenset(
    {
        "ina209",
        "ina219",
        "ina220",
        "ina226",
        "ina230",
        "ina231",
        "ina234",
        "ina237",
        "ina238",
        "ina260",
        "sy24655",
    }
)
INA3221 = "ina3221"
_INPUT_RAIL = re.compile(r"(?:^|_)IN$", re.IGNORECASE)  # Jetson: POM_5V_IN, VDD_IN


@dataclass(frozen=True)
class PowerSample:
    """One power reading.

    `watts` is instantaneous unless `since_t` is set, in which case it is the average since
    the source's previous reading at monotonic time `since_t`, and `interval_j` is the
    energy over that interval (exact for counters, modelled for the CPU estimate).
    """

    t: float
    watts: float
    source: str
    interval_j: float | None = None
    since_t: float | None = None

    @property
    def averaged(self) -> bool:
        return self.since_t is not None


class PowerSource:
    """Base class: `read(t)` returns a PowerSample or None, never raises."""

    kind = "abstract"

    def __init__(
        self, root: str | os.PathLike[str] | SysRoot, *, name: str, path: str, max_w: float
    ) -> None:
        self.nodes = NodeReader(root)
        self.name = name
        self.path = path
        self.max_w = max_w
        self.last_reason = ""  # why the last read gave None, for probe/report

    def read(self, t: float) -> PowerSample | None:
        raise NotImplementedError

    def detail(self) -> str:
        return ""

    def describe(self) -> dict[str, object]:
        return {"kind": self.kind, "name": self.name, "path": self.path, "detail": self.detail()}

    def _fail(self, reason: str) -> None:
        self.last_reason = reason

    def _watts_ok(self, watts: float | None, what: str) -> bool:
        if plausible(watts, 0.0, self.max_w):
            return True
        self.nodes.note(f"{self.path}/{what}", f"implausible power {watts!r} W")
        self._fail(f"implausible {what}")
        return False


class HwmonInaSource(PowerSource):
    """An INA2xx / INA3221 hwmon node: power{ch}_input, else in{ch}_input x curr{ch}_input."""

    kind = "hwmon-ina"

    def __init__(
        self,
        root: str | os.PathLike[str] | SysRoot,
        hwmon: str,
        *,
        chip: str,
        channels: tuple[int, ...] = (1,),
        max_w: float = MAX_PLAUSIBLE_W,
        channel_note: str = "",
    ) -> None:
        if not channels or any(c not in (1, 2, 3) for c in channels):
            raise ValueError(f"INA channels must be among 1, 2, 3; got {channels!r}")
        suffix = "" if chip != INA3221 else "/ch" + "+".join(map(str, channels))
        super().__init__(
            root, name=f"{chip}:{os.path.basename(hwmon)}{suffix}", path=hwmon, max_w=max_w
        )
        self.chip = chip
        self.channels = channels
        self.channel_note = channel_note

    def detail(self) -> str:
        how = (
            "in x curr (mV x mA)" if self.chip == INA3221 else "power1_input (uW), else in1 x curr1"
        )
        note = f"; {self.channel_note}" if self.channel_note else ""
        return f"{self.chip} channel(s) {','.join(map(str, self.channels))}: {how}{note}"

    def _channel_watts(self, ch: int) -> float | None:
        if self.chip != INA3221:  # INA3221 has no power attribute
            uw = self.nodes.int(f"{self.path}/power{ch}_input")
            if uw is not None:
                if plausible(uw / 1e6, 0.0, self.max_w):
                    return uw / 1e6
                self.nodes.note(
                    f"{self.path}/power{ch}_input", f"implausible {uw} uW; trying in x curr"
                )
        mv = self.nodes.int(f"{self.path}/in{ch}_input")
        ma = self.nodes.int(f"{self.path}/curr{ch}_input")
        if mv is None or ma is None:
            return None
        return abs(mv * ma) / 1e6  # a shunt wired backwards reads negative current

    def read(self, t: float) -> PowerSample | None:
        total = 0.0
        for ch in self.channels:
            watts = self._channel_watts(ch)
            if watts is None:
                self._fail(f"channel {ch} unreadable")
                return None
            total += watts
        if not self._watts_ok(total, "input"):
            return None
        return PowerSample(t=t, watts=total, source=self.name)


class PowerSupplySource(PowerSource):
    """A battery fuel gauge: system draw while the battery is discharging.

    While charging (solar back) or full on mains, power_now measures the charge rate, not
    the board's load, so the source reports nothing and the monitor falls back.
    """

    kind = "power-supply"

    def __init__(
        self, root: str | os.PathLike[str] | SysRoot, supply: str, *, max_w: float = MAX_PLAUSIBLE_W
    ) -> None:
        super().__init__(root, name=f"battery:{os.path.basename(supply)}", path=supply, max_w=max_w)
        self._prev_energy: tuple[float, int] | None = None  # (t, energy_now uWh)

    def detail(self) -> str:
        return "power_now (uW), else voltage_now x current_now, else energy_now differences; only while Discharging"

    def read(self, t: float) -> PowerSample | None:
        status = self.nodes.text(f"{self.path}/status")
        energy = self.nodes.int(f"{self.path}/energy_now")
        prev, self._prev_energy = self._prev_energy, ((t, energy) if energy is not None else None)
        if status is not None and status != "Discharging":
            self._fail(f"status {status!r}: power_now is not the load")
            return None
        uw = self.nodes.int(f"{self.path}/power_now")
        if uw is not None:  # some gauges report discharge power as negative
            watts = abs(uw) / 1e6
            return (
                PowerSample(t=t, watts=watts, source=self.name)
                if self._watts_ok(watts, "power_now")
                else None
            )
        uv = self.nodes.int(f"{self.path}/voltage_now")
        ua = self.nodes.int(f"{self.path}/current_now")
        if uv is not None and ua is not None:
            watts = abs(uv * ua) / 1e12
            return (
                PowerSample(t=t, watts=watts, source=self.name)
                if self._watts_ok(watts, "voltage_now*current_now")
                else None
            )
        if energy is not None and prev is not None and t > prev[0] and energy <= prev[1]:
            joules = (prev[1] - energy) * UWH_TO_J
            watts = joules / (t - prev[0])
            if self._watts_ok(watts, "energy_now"):
                return PowerSample(
                    t=t, watts=watts, source=self.name, interval_j=joules, since_t=prev[0]
                )
            return None
        self._fail("no power_now, voltage_now x current_now, or energy_now history")
        return None


class RaplSource(PowerSource):
    """RAPL package counters (sum of top-level zones), unwrapped at max_energy_range_uj."""

    kind = "rapl"

    def __init__(
        self,
        root: str | os.PathLike[str] | SysRoot,
        zones: list[str],
        *,
        max_w: float = MAX_PLAUSIBLE_W,
    ) -> None:
        if not zones:
            raise ValueError("RaplSource needs at least one powercap zone")
        names = "+".join(os.path.basename(z) for z in zones)
        super().__init__(root, name=f"rapl:{names}", path=zones[0], max_w=max_w)
        self.zones = list(zones)
        self._ranges: dict[str, int | None] = {
            z: self.nodes.int(f"{z}/max_energy_range_uj") for z in zones
        }
        self._prev: tuple[float, dict[str, int]] | None = None  # the first read only primes

    def detail(self) -> str:
        return (
            f"energy_uj counters of {', '.join(self.zones)} (CPU package only, not the whole board)"
        )

    def _raw(self) -> dict[str, int] | None:
        raw: dict[str, int] = {}
        for zone in self.zones:
            value = self.nodes.int(f"{zone}/energy_uj")
            if value is None or value < 0:
                return None
            raw[zone] = value
        return raw

    def read(self, t: float) -> PowerSample | None:
        raw = self._raw()
        prev, self._prev = self._prev, ((t, raw) if raw is not None else None)
        if raw is None:
            self._fail("energy_uj unreadable")
            return None
        if prev is None or t <= prev[0]:
            self._fail("counter primed; no interval yet")
            return None
        total_uj = 0
        for zone, value in raw.items():
            delta = value - prev[1][zone]
            if delta < 0:
                span = self._ranges.get(zone)
                if span is None or span <= 0:
                    self._fail(f"{zone} went backwards and max_energy_range_uj is unknown")
                    return None
                delta += span
            total_uj += delta
        joules = total_uj / 1e6
        watts = joules / (t - prev[0])
        if not self._watts_ok(watts, "energy_uj"):
            return None
        return PowerSample(t=t, watts=watts, source=self.name, interval_j=joules, since_t=prev[0])


def parse_proc_stat_cpu(text: str) -> tuple[int, int] | None:
    """(busy+idle jiffies, idle jiffies) from /proc/stat's aggregate `cpu` line, or None.

    guest/guest_nice are already counted in user/nice, so only the first 8 fields count.
    """
    for line in text.splitlines():
        if line.startswith("cpu "):
            fields = line.split()[1:9]
            if len(fields) < 4:
                return None
            try:
                values = [int(f) for f in fields]
            except ValueError:
                return None
            if any(v < 0 for v in values):
                return None
            idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
            return sum(values), idle
    return None


def cpu_power_model(util: float, idle_w: float, load_w: float) -> float:
    """Linear board power model: idle at 0 % utilisation, load_w with every core busy."""
    return idle_w + (load_w - idle_w) * min(1.0, max(0.0, util))


class CpuEstimateSource(PowerSource):
    """Board power estimated from CPU utilisation and the profile's idle/full-load watts."""

    kind = "cpu-estimate"

    def __init__(
        self,
        root: str | os.PathLike[str] | SysRoot,
        *,
        idle_w: float,
        load_w: float,
        max_w: float = MAX_PLAUSIBLE_W,
    ) -> None:
        if not (
            plausible(idle_w, 0.0, max_w) and plausible(load_w, 0.0, max_w) and idle_w < load_w
        ):
            raise ValueError(
                f"need 0 <= idle_w < load_w (finite), got idle_w={idle_w!r}, load_w={load_w!r}"
            )
        super().__init__(root, name="cpu-estimate", path="/proc/stat", max_w=max_w)
        self.idle_w = float(idle_w)
        self.load_w = float(load_w)
        self._prev: tuple[float, tuple[int, int]] | None = None

    def detail(self) -> str:
        return f"/proc/stat utilisation x board model (idle {self.idle_w:g} W, full load {self.load_w:g} W)"

    def _jiffies(self) -> tuple[int, int] | None:
        text = self.nodes.proc_text("/proc/stat")
        parsed = parse_proc_stat_cpu(text) if text is not None else None
        if text is not None and parsed is None:
            self.nodes.note("/proc/stat", "no parsable aggregate cpu line")
        return parsed

    def read(self, t: float) -> PowerSample | None:
        jiffies = self._jiffies()
        prev, self._prev = self._prev, ((t, jiffies) if jiffies is not None else None)
        if jiffies is None:
            self._fail("/proc/stat unreadable")
            return None
        total, idle = jiffies
        if prev is not None and t > prev[0]:
            d_total, d_idle = total - prev[1][0], idle - prev[1][1]
            if d_total < 0 or d_idle < 0 or d_idle > d_total:
                self._fail("jiffies went backwards")
                return None
            util = 1.0 - d_idle / d_total if d_total > 0 else 0.0
            watts = cpu_power_model(util, self.idle_w, self.load_w)
            return PowerSample(
                t=t,
                watts=watts,
                source=self.name,
                interval_j=watts * (t - prev[0]),
                since_t=prev[0],
            )
        util = 1.0 - idle / total if total > 0 else 0.0  # no interval yet: average since boot
        return PowerSample(
            t=t, watts=cpu_power_model(util, self.idle_w, self.load_w), source=self.name
        )


def _hwmon_dir(nodes: NodeReader, entry: str) -> tuple[str, str] | None:
    """(attribute directory, chip name); old kernels keep attributes under device/."""
    base = f"{HWMON}/{entry}"
    for directory in (base, f"{base}/device"):
        name = nodes.text(f"{directory}/name")
        if name:
            return directory, name.strip().lower()
    return None


def _ina3221_channels(nodes: NodeReader, directory: str) -> tuple[tuple[int, ...], str]:
    enabled = [ch for ch in (1, 2, 3) if nodes.text(f"{directory}/in{ch}_enable") != "0"]
    if not enabled:
        return (1,), "all channels report disabled; using channel 1"
    for ch in enabled:
        label = nodes.text(f"{directory}/in{ch}_label") or ""
        if _INPUT_RAIL.search(label):
            return (ch,), f"input rail {label!r}"
    return (
        enabled[0],
    ), "no input-rail label; channel assumed to be the input (override with channels=)"


def discover_power_sources(
    root: str | os.PathLike[str] = "/",
    *,
    idle_w: float | None = None,
    load_w: float | None = None,
    max_w: float = MAX_PLAUSIBLE_W,
) -> list[PowerSource]:
    """Power sources present under `root`, best first (INA hwmon, battery, RAPL, CPU estimate).

    Presence is structural (the nodes exist); a source that fails at read time makes the
    monitor fall back to the next one. The CPU estimate needs the board profile's idle and
    full-load watts and is left out without them.
    """
    nodes = NodeReader(root)
    found: list[PowerSource] = []
    for entry in nodes.listdir(HWMON):
        located = _hwmon_dir(nodes, entry)
        if located is None:
            continue
        directory, chip = located
        if chip in INA2XX_CHIPS:
            found.append(HwmonInaSource(nodes.sys, directory, chip=chip, max_w=max_w))
        elif chip == INA3221:
            channels, note = _ina3221_channels(nodes, directory)
            found.append(
                HwmonInaSource(
                    nodes.sys,
                    directory,
                    chip=chip,
                    channels=channels,
                    max_w=max_w,
                    channel_note=note,
                )
            )
    for entry in nodes.listdir(POWER_SUPPLY):
        supply = f"{POWER_SUPPLY}/{entry}"
        if nodes.text(f"{supply}/type") != "Battery" or nodes.text(f"{supply}/scope") == "Device":
            continue  # mains adapters, and peripheral batteries (a mouse) are not the board
        if any(
            nodes.exists(f"{supply}/{attr}") for attr in ("power_now", "current_now", "energy_now")
        ):
            found.append(PowerSupplySource(nodes.sys, supply, max_w=max_w))
    zones = [
        f"{POWERCAP}/{z}" for z in nodes.listdir(POWERCAP) if re.fullmatch(r"intel-rapl:\d+", z)
    ]
    zones = [z for z in zones if nodes.exists(f"{z}/energy_uj")]
    if zones:
        found.append(RaplSource(nodes.sys, zones, max_w=max_w))
    if idle_w is not None and load_w is not None and nodes.exists("/proc/stat"):
        found.append(CpuEstimateSource(nodes.sys, idle_w=idle_w, load_w=load_w, max_w=max_w))
    return found
