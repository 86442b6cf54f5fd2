"""`edge-agent probe`: what this device is and can do, as a stable JSON report.

The probe reads only /proc, /sys, /dev and /etc under a root (default `/`), so fixture
trees captured from real boards drive it in tests. It never imports MXNet or tflite: it
runs in the idle daemon and at install time, and must stay fast and small.

JSON report (schema "edge-agent.probe/1"; keys are only ever added, never renamed):
  schema, root, live           report version; the probed root; whether it is the live `/`
  board     {model, model_source, compatible[], vendor, jetson_release, ram_mb, swap_mb}
  cpu       {arch, count, model, parts[], flags[], int8_features{name: bool}, soc{},
             kernel_check{variants{name: runnable}, confirmed[], denied[],
                          disagree{feature: {cpuinfo, kernels}}}   (live only; kernels win)
  accelerators [{kind, description, evidence[], runtime_library, runtime_loads, runtime_detail}]
  power     {hwmon[{hwmon, name, path, channels[{channel, voltage_v, current_a, power_w, label}]}],
             power_supply[{name, type, status, capacity_pct, power_w, energy_wh, voltage_v, ...}],
             rapl[{domain, name, energy_j, readable}]}
  thermal   [{zone, type, temp_c}]
  cpufreq   {governor, min_mhz, max_mhz, cur_mhz}
  profile   {name, path, reason, candidates[]}   (name null when nothing matched)
  fingerprint                                   stable hash of what decides int8 engine choice
  problems  ["<path>: <what could not be read and why>"]
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from .accelerators import find_accelerators
from .board import read_board
from .cpu import read_cpu
from .profiles import load_profiles, match_profile
from .sensors import read_cpufreq, read_hwmon_power, read_power_supplies, read_rapl, read_thermal
from .sysfs import Problems, SysRoot

SCHEMA = "edge-agent.probe/1"


def _is_live(root: Path) -> bool:
    try:
        return root.resolve() == Path("/")
    except OSError:
        return False


_CPUFREQ = "/sys/devices/system/cpu/cpu0/cpufreq"


def _cpufreq(sysroot: SysRoot) -> dict[str, Any]:
    """cpufreq, with the hardware limits (cpuinfo_min/max/cur_freq) where the scaling_* nodes
    are missing: some drivers and containers expose only those."""
    freq = read_cpufreq(sysroot)
    if not freq:
        return freq
    for key, node in (("min_mhz", "cpuinfo_min_freq"), ("max_mhz", "cpuinfo_max_freq"),
                      ("cur_mhz", "cpuinfo_cur_freq")):
        if freq.get(key) is None:
            khz = sysroot.read_int(f"{_CPUFREQ}/{node}")
            freq[key] = khz / 1000 if khz is not None and khz > 0 else None
    return freq


def probe(root: str | os.PathLike[str] = "/", *, profiles_directory: Path | None = None) -> dict[str, Any]:
    """Probe the device under `root` and return the JSON-ready report. A `root` that is not a
    directory is an InputError (a typo must not report an empty board and succeed)."""
    if not Path(root).is_dir():
        from ..errors import InputError

        raise InputError(f"{root}: no such directory to probe (a filesystem root: / or a captured board tree)")
    problems = Problems()
    sysroot = SysRoot(root, problems=problems)
    live = _is_live(Path(root))
    cpu = read_cpu(sysroot, machine=os.uname().machine if live else None)
    board = read_board(sysroot, cpuinfo_model=cpu.soc.get("Model", ""))
    accelerators = find_accelerators(sysroot, compatible=board.compatible, live=live)
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "root": str(root),
        "live": live,
        "board": board.to_dict(),
        "cpu": cpu.to_dict(),
        "accelerators": [a.to_dict() for a in accelerators],
        "power": {
            "hwmon": read_hwmon_power(sysroot),
            "power_supply": read_power_supplies(sysroot),
            "rapl": read_rapl(sysroot),
        },
        "thermal": read_thermal(sysroot),
        "cpufreq": _cpufreq(sysroot),
    }
    profile_set = load_profiles(directory=profiles_directory)
    for error in profile_set.errors:
        problems.add("profiles", error)
    match = match_profile(report, profile_set.profiles)
    report["profile"] = {
        "name": match.profile.name if match.profile else None,
        "path": match.profile.path if match.profile else None,
        "reason": match.reason,
        "candidates": match.candidates,
    }
    report["fingerprint"] = hardware_fingerprint(report)
    report["problems"] = problems.items
    return report


def hardware_fingerprint(report: dict[str, Any]) -> str:
    """A short stable hash of what decides int8 engine choice (not readings that drift)."""
    cpu = report.get("cpu", {})
    key = {
        "model": report.get("board", {}).get("model", ""),
        "arch": cpu.get("arch", ""),
        "count": cpu.get("count", 0),
        "parts": cpu.get("parts", []),
        "features": sorted(k for k, v in cpu.get("int8_features", {}).items() if v),
        "accelerators": sorted(
            (a.get("kind", ""), bool(a.get("runtime_loads"))) for a in report.get("accelerators", [])
        ),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _fmt(value: Any, unit: str, digits: int = 2) -> str:
    return "?" if value is None else f"{value:.{digits}f} {unit}"


def render(report: dict[str, Any]) -> str:
    """A short human-readable report."""
    board, cpu = report["board"], report["cpu"]
    lines = [f"Board:        {board['model'] or 'unknown'}"
             + (f"  (from {board['model_source']})" if board["model_source"] else "")]
    if board.get("jetson_release"):
        lines.append(f"Jetson:       {board['jetson_release']}")
    ram = f"{board['ram_mb']} MB RAM" if board["ram_mb"] is not None else "RAM unknown"
    swap = f", {board['swap_mb']} MB swap" if board["swap_mb"] is not None else ""
    lines.append(f"CPU:          {cpu['arch']}, {cpu['count']} cores, {cpu['model'] or 'unknown model'}; {ram}{swap}")
    feats = cpu["int8_features"]
    if feats:
        lines.append("int8 features: " + "  ".join(f"{k}:{'yes' if v else 'no'}" for k, v in feats.items()))
    check = cpu.get("kernel_check") or {}
    if check:
        runs = [name for name, ok in check.get("variants", {}).items() if ok]
        lines.append(f"Kernels check: runs {', '.join(runs) or 'nothing'} (cpuid/auxv)")
        for name, says in check.get("disagree", {}).items():
            lines.append(f"  {name}: /proc/cpuinfo says {'yes' if says['cpuinfo'] else 'no'}, "
                         f"the kernels' check says {'yes' if says['kernels'] else 'no'} (used)")
    if report["accelerators"]:
        for acc in report["accelerators"]:
            state = "runtime loads" if acc["runtime_loads"] else (acc["runtime_detail"] or "no runtime")
            lines.append(f"Accelerator:  {acc['description']} [{acc['kind']}]; {state}")
            for ev in acc["evidence"]:
                lines.append(f"                seen: {ev}")
    else:
        lines.append("Accelerator:  none found")
    power = report["power"]
    for sensor in power["hwmon"]:
        chans = ", ".join(
            f"ch{c['channel']}{'(' + c['label'] + ')' if c.get('label') else ''} "
            f"{_fmt(c.get('voltage_v'), 'V')} {_fmt(c.get('power_w'), 'W')}"
            for c in sensor["channels"])
        lines.append(f"Power sensor: {sensor['name']} ({sensor['hwmon']}): {chans}")
    for supply in power["power_supply"]:
        cap = f" {supply['capacity_pct']}%" if "capacity_pct" in supply else ""
        lines.append(f"Power supply: {supply['name']} {supply.get('type', '')} {supply.get('status', '')}{cap}"
                     + (f" {_fmt(supply['power_w'], 'W')}" if "power_w" in supply else ""))
    for domain in power["rapl"]:
        lines.append(f"RAPL:         {domain['domain']} {domain['name']} "
                     + ("readable" if domain["readable"] else "not readable (needs root?)"))
    if not (power["hwmon"] or power["power_supply"] or power["rapl"]):
        lines.append("Power:        no sensor; energy will be estimated from CPU load and the profile")
    for zone in report["thermal"]:
        lines.append(f"Thermal:      {zone['zone']} {zone['type']} {_fmt(zone['temp_c'], '°C', 1)}")
    freq = report["cpufreq"]
    if freq:
        span = (f"{_fmt(freq.get('min_mhz'), 'MHz', 0)} .. {_fmt(freq.get('max_mhz'), 'MHz', 0)}"
                if freq.get("min_mhz") is not None or freq.get("max_mhz") is not None else "range unknown")
        now = f" (now {_fmt(freq.get('cur_mhz'), 'MHz', 0)})" if freq.get("cur_mhz") is not None else ""
        lines.append(f"cpufreq:      {freq.get('governor') or 'governor unknown'} {span}{now}")
    prof = report["profile"]
    lines.append(f"Profile:      {prof['name'] or 'none'} ({prof['reason']})")
    lines.append(f"Fingerprint:  {report['fingerprint']}")
    if report["problems"]:
        lines.append(f"Could not read ({len(report['problems'])}):")
        lines += [f"  - {p}" for p in report["problems"][:20]]
    return "\n".join(lines)
