"""Board profiles: declarative TOML data, a schema in code, and matching to a probe report.

Each `firmware_configs/<board>.toml` overrides `base.toml` table by table. Errors are
reported as `file:line: key: message` (ESPHome's style), so a user editing a profile on a
device sees exactly where the mistake is.
"""

from __future__ import annotations

import fnmatch
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..tomlschema import (
    Field,
    Reporter,
    Schema,
    check_required,
    check_tables,
    line_of,
    merge_tables,
    number,
    read_toml,
)

KNOWN_BACKENDS = ("tflite", "edgetpu", "mxnet-onednn", "native", "reference")
KNOWN_ARCHES = ("aarch64", "armv7l", "x86_64")
KNOWN_ACCELERATORS = ("coral-usb", "coral-pcie", "hailo", "intel-ncs2", "nvidia-gpu",
                      "jetson-gpu", "rockchip-npu")
BASE_NAME = "base"


SCHEMA: Schema = {
    "profile": {
        "name": Field(str, required=True),
        "description": Field(str),
        "inherits": Field(str),
    },
    "match": {
        "model": Field(list, items=str),
        "arch": Field(list, items=str, choices=KNOWN_ARCHES),
        "requires_accelerator": Field(list, items=str, choices=KNOWN_ACCELERATORS),
        "priority": Field(int, minimum=0, maximum=1000),
    },
    "power": {
        "idle_w": number(0.05, 1000, required=True),
        "load_w": number(0.05, 1000, required=True),
        "accelerator_w": number(0, 100),
    },
    "thermal": {
        "limit_c": number(30, 125, required=True),
        "margin_c": number(1, 40),
    },
    "training": {
        "memory_cap_mb": Field(int, minimum=32, maximum=1 << 20),
        "threads": Field(int, minimum=1, maximum=256),
        "batch_size": Field(int, minimum=1, maximum=4096),
    },
    "int8": {
        "backends": Field(list, items=str, choices=KNOWN_BACKENDS, required=True),
        "threads": Field(int, minimum=1, maximum=256),
    },
    "budget": {
        "energy_wh": number(0.001, 10_000),
        "power_cap_w": number(0.05, 1000),
        "battery_floor_pct": number(0, 100),
        "battery_resume_pct": number(0, 100),
        "deadline_s": number(1, 30 * 86400),
    },
}


@dataclass
class Profile:
    name: str
    path: str
    data: dict[str, dict[str, Any]]  # merged over base

    def get(self, table: str, key: str, default: Any = None) -> Any:
        return self.data.get(table, {}).get(key, default)

    def to_dict(self) -> dict:
        return {"name": self.name, "path": self.path, **self.data}


@dataclass
class ProfileSet:
    profiles: dict[str, Profile]
    errors: list[str] = field(default_factory=list)


def profiles_dir() -> Path:
    """Where the shipped profiles are: env override, the source tree, or the installed share dir."""
    override = os.environ.get("EDGE_AGENT_PROFILES_DIR")
    if override:
        return Path(override)
    source_tree = Path(__file__).resolve().parents[2] / "firmware_configs"
    if source_tree.is_dir():
        return source_tree
    return Path(sys.prefix) / "share" / "edge-agent" / "firmware_configs"


def validate(data: dict[str, Any], *, text: str, path: str, is_base: bool) -> list[str]:
    """Check one profile file's own content against SCHEMA; returns `file:line: key: message`."""
    report = Reporter(path, text)
    check_tables(report, data, SCHEMA)
    if "name" not in data.get("profile", {}):
        report.error("profile", None, "profile.name is required")
    if not is_base and not data.get("match", {}).get("model"):
        report.error("match", "model", "a board profile needs at least one model pattern")
    return report.errors


def _merged_checks(merged: dict[str, dict[str, Any]], *, text: str, path: str) -> list[str]:
    """Cross-field rules and required keys, checked after merging over base."""
    report = Reporter(path, text)
    check_required(report, merged, SCHEMA, skip=("profile",))
    power = merged.get("power", {})
    if {"idle_w", "load_w"} <= power.keys() and power["load_w"] <= power["idle_w"]:
        report.error("power", "load_w", f"must exceed idle_w ({power['idle_w']})")
    budget = merged.get("budget", {})
    if {"battery_floor_pct", "battery_resume_pct"} <= budget.keys() and \
            budget["battery_resume_pct"] <= budget["battery_floor_pct"]:
        report.error("budget", "battery_resume_pct",
                     f"must exceed battery_floor_pct ({budget['battery_floor_pct']})")
    return report.errors


def load_profiles(paths: list[Path] | None = None, *, directory: Path | None = None) -> ProfileSet:
    """Load and validate profiles. With `paths`, only those (plus the directory's base)."""
    directory = directory or profiles_dir()
    base_path = directory / f"{BASE_NAME}.toml"
    files = list(paths) if paths else sorted(directory.glob("*.toml"))
    result = ProfileSet(profiles={})
    base_data: dict[str, Any] = {}
    base_candidates = [p for p in files if p.stem == BASE_NAME] or ([base_path] if base_path.exists() else [])
    for bp in base_candidates[:1]:
        data, text, errors = read_toml(bp)
        result.errors += errors
        if data is not None:
            errs = validate(data, text=text, path=str(bp), is_base=True)
            result.errors += errs
            if not errs:
                base_data = data
    for path in files:
        if path.stem == BASE_NAME:
            continue
        data, text, errors = read_toml(path)
        result.errors += errors
        if data is None:
            continue
        errs = validate(data, text=text, path=str(path), is_base=False)
        inherits = data.get("profile", {}).get("inherits", BASE_NAME)
        if inherits != BASE_NAME:
            errs.append(f"{path}:{line_of(text, 'profile', 'inherits')}: profile.inherits: "
                        f"only {BASE_NAME!r} is supported, got {inherits!r}")
        merged = merge_tables(base_data, data)
        if not errs:  # cross-field rules assume every value already has the right type
            errs += _merged_checks(merged, text=text, path=str(path))
        result.errors += errs
        if errs:
            continue
        name = merged["profile"]["name"]
        if name in result.profiles:
            result.errors.append(f"{path}:{line_of(text, 'profile', 'name')}: profile.name: "
                                 f"{name!r} is also defined in {result.profiles[name].path}")
            continue
        result.profiles[name] = Profile(name=name, path=str(path), data=merged)
    return result


@dataclass
class Match:
    profile: Profile | None
    reason: str
    candidates: list[str] = field(default_factory=list)


def match_profile(report: dict[str, Any], profiles: dict[str, Profile]) -> Match:
    """The most specific profile whose rules all hold for a probe report, and why."""
    model = report.get("board", {}).get("model", "")
    arch = report.get("cpu", {}).get("arch", "")
    kinds = {a.get("kind") for a in report.get("accelerators", [])}
    hits: list[tuple[tuple[int, int, int], Profile, str]] = []
    for profile in profiles.values():
        rules = profile.data.get("match", {})
        arches = rules.get("arch", [])
        if arches and arch not in arches:
            continue
        pattern = next((p for p in rules.get("model", []) if fnmatch.fnmatch(model.lower(), p.lower())), None)
        if pattern is None:
            continue
        required = rules.get("requires_accelerator", [])
        if not set(required) <= kinds:
            continue
        why = f"model {model!r} matches {pattern!r}"
        if arches:
            why += f", arch {arch} in {arches}"
        if required:
            why += f", accelerator {', '.join(required)} present"
        # More required accelerators, then explicit priority, then a longer literal pattern.
        specificity = (len(required), int(rules.get("priority", 0)), len(pattern.replace("*", "")))
        hits.append((specificity, profile, why))
    if not hits:
        return Match(None, f"no profile matches model {model!r} arch {arch!r}")
    hits.sort(key=lambda h: h[0], reverse=True)
    best = hits[0]
    return Match(best[1], best[2], [h[1].name for h in hits])
