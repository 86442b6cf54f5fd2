"""Inventory of power sensors, thermal zones and cpufreq, for the probe report.

This lists what exists and its current reading, in SI units (W, V, A, Wh, °C, MHz).
Sampling over time for the budget governor lives in edge_agent.power.
"""

from __future__ import annotations

import re

from .sysfs import SysRoot

POWER_HWMON_NAMES = ("ina219", "ina226", "ina230", "ina231", "ina260", "ina3221", "ina238")
_SUPPLY_FIELDS = ("type", "status", "capacity", "power_now", "energy_now", "energy_full",
                  "voltage_now", "current_now", "online")
_CHANNEL_RE = re.compile(r"^(in|curr|power)(\d+)_input$")
_UNIT_SCALE = {"in": ("voltage_v", 1e-3), "curr": ("current_a", 1e-3), "power": ("power_w", 1e-6)}


def read_hwmon_power(sysroot: SysRoot) -> list[dict]:
    """INA2xx-style hwmon devices with their channels (voltage V, current A, power W)."""
    sensors = []
    for dev in sysroot.listdir("/sys/class/hwmon"):
        base = f"/sys/class/hwmon/{dev}"
        name = sysroot.read_text(f"{base}/name") or ""
        if name not in POWER_HWMON_NAMES:
            continue
        channels: dict[int, dict] = {}
        for entry in sysroot.listdir(base):
            match = _CHANNEL_RE.match(entry)
            if not match:
                continue
            kind, index = match.group(1), int(match.group(2))
            if kind == "in" and index == 0 and name != "ina3221":
                continue  # ina2xx in0 is the shunt voltage, not a supply channel
            value = sysroot.read_int(f"{base}/{entry}")
            channel = channels.setdefault(index, {"channel": index})
            if value is not None:
                key, scale = _UNIT_SCALE[kind]
                channel[key] = round(value * scale, 6)
            label = sysroot.read_text(f"{base}/{'in' if kind == 'in' else kind}{index}_label")
            if label:
                channel["label"] = label[:40]
        for channel in channels.values():
            if "power_w" not in channel and "voltage_v" in channel and "current_a" in channel:
                channel["power_w"] = round(channel["voltage_v"] * channel["current_a"], 6)
                channel["power_derived"] = True
        sensors.append({"hwmon": dev, "name": name, "path": base,
                        "channels": [channels[i] for i in sorted(channels)]})
    return sensors


def read_power_supplies(sysroot: SysRoot) -> list[dict]:
    supplies = []
    for name in sysroot.listdir("/sys/class/power_supply"):
        base = f"/sys/class/power_supply/{name}"
        entry: dict = {"name": name, "path": base}
        for field in _SUPPLY_FIELDS:
            if field in ("type", "status"):
                text = sysroot.read_text(f"{base}/{field}")
                if text:
                    entry[field] = text[:32]
                continue
            value = sysroot.read_int(f"{base}/{field}")
            if value is None:
                continue
            if field == "power_now":
                entry["power_w"] = value / 1e6
            elif field in ("energy_now", "energy_full"):
                entry[field.replace("_now", "_wh").replace("_full", "_full_wh")] = value / 1e6
            elif field == "voltage_now":
                entry["voltage_v"] = value / 1e6
            elif field == "current_now":
                entry["current_a"] = value / 1e6
            elif field == "capacity":
                if 0 <= value <= 100:
                    entry["capacity_pct"] = value
                else:
                    sysroot.problems.add(f"{base}/capacity", f"out of range: {value}")
            else:
                entry[field] = value
        supplies.append(entry)
    return supplies


def read_rapl(sysroot: SysRoot) -> list[dict]:
    domains = []
    for name in sysroot.listdir("/sys/class/powercap"):
        if not name.startswith("intel-rapl:"):
            continue
        base = f"/sys/class/powercap/{name}"
        energy = sysroot.read_int(f"{base}/energy_uj")
        domains.append({
            "domain": name,
            "name": (sysroot.read_text(f"{base}/name") or "")[:32],
            "energy_j": energy / 1e6 if energy is not None else None,
            "readable": energy is not None,
        })
    return domains


def read_thermal(sysroot: SysRoot) -> list[dict]:
    zones = []
    for name in sysroot.listdir("/sys/class/thermal"):
        if not name.startswith("thermal_zone"):
            continue
        base = f"/sys/class/thermal/{name}"
        milli = sysroot.read_int(f"{base}/temp")
        temp = milli / 1000 if milli is not None and -50_000 < milli < 200_000 else None
        if milli is not None and temp is None:
            sysroot.problems.add(f"{base}/temp", f"implausible temperature {milli} m°C")
        zones.append({"zone": name, "type": (sysroot.read_text(f"{base}/type") or "")[:32],
                      "temp_c": temp})
    return zones


def read_cpufreq(sysroot: SysRoot) -> dict:
    base = "/sys/devices/system/cpu/cpu0/cpufreq"
    if not sysroot.exists(base):
        return {}

    def mhz(node: str) -> float | None:
        khz = sysroot.read_int(f"{base}/{node}")
        return khz / 1000 if khz is not None else None

    return {
        "governor": (sysroot.read_text(f"{base}/scaling_governor") or "")[:32],
        "min_mhz": mhz("scaling_min_freq"),
        "max_mhz": mhz("scaling_max_freq"),
        "cur_mhz": mhz("scaling_cur_freq"),
    }
