"""Board profiles: declarative TOML data, a schema in code, and matching to a probe report.

Each `firmware_configs/<board>.toml` overrides `base.toml` table by table. Errors are
reported as `file:line: key: message` (ESPHome's style), so a user editing a profile on a
device sees exactly where the mistake is.
"""

from __future__ import annotations

import fnmatch
import math
import os
import re
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KNOWN_BACKENDS = ("tflite", "edgetpu", "mxnet-onednn", "native", "reference")
KNOWN_ARCHES = ("aarch64", "armv7l", "x86_64")
KNOWN_ACCELERATORS = ("coral-usb", "coral-pcie", "hailo", "intel-ncs2", "nvidia-gpu",
                      "jetson-gpu", "rockchip-npu")
BASE_NAME = "base"
MAX_PROFILE_BYTES = 64 * 1024


@dataclass(frozen=True)
class Field:
    kind: type | tuple[type, ...]
    required: bool = False
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] = ()  # for strings, or for each item of a list
    items: type | None = None  # for lists


def _num(minimum: float | None = None, maximum: float | None = None, *, required: bool = False) -> Field:
    return Field((int, float), required=required, minimum=minimum, maximum=maximum)


SCHEMA: dict[str, dict[str, Field]] = {
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
        "idle_w": _num(0.05, 1000, required=True),
        "load_w": _num(0.05, 1000, required=True),
        "accelerator_w": _num(0, 100),
    },
    "thermal": {
        "limit_c": _num(30, 125, required=True),
        "margin_c": _num(1, 40),
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
        "energy_wh": _num(0.001, 10_000),
        "power_cap_w": _num(0.05, 1000),
        "battery_floor_pct": _num(0, 100),
        "battery_resume_pct": _num(0, 100),
        "deadline_s": _num(1, 30 * 86400),
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


def _line_of(text: str, table: str | None, key: str | None) -> int:
    """Best-effort line number of `[table]` / `key =` in TOML source (tomllib keeps none)."""
    lines = text.splitlines()
    start = 0
    if table:
        header = re.compile(rf"^\s*\[\s*{re.escape(table)}\s*\]")
        for i, line in enumerate(lines):
            if header.match(line):
                start = i
                break
        else:
            return 1
    if key:
        pattern = re.compile(rf"^\s*{re.escape(key)}\s*=")
        for i in range(start, len(lines)):
            if i > start and table and lines[i].lstrip().startswith("["):
                break
            if pattern.match(lines[i]):
                return i + 1
    return start + 1


def _type_name(kind: type | tuple[type, ...]) -> str:
    if isinstance(kind, tuple):
        return "number"
    return {str: "string", int: "integer", list: "list", float: "number"}.get(kind, kind.__name__)


def validate(data: dict[str, Any], *, text: str, path: str, is_base: bool) -> list[str]:
    """Check one profile file's own content against SCHEMA; returns `file:line: key: message`."""
    errors: list[str] = []

    def err(table: str | None, key: str | None, message: str) -> None:
        where = f"{table}.{key}" if table and key else (table or key or "")
        errors.append(f"{path}:{_line_of(text, table, key)}: {where}: {message}")

    for table, value in data.items():
        if table not in SCHEMA:
            err(None, table, f"unknown table (known: {', '.join(SCHEMA)})")
            continue
        if not isinstance(value, dict):
            err(None, table, "must be a table")
            continue
        for key, item in value.items():
            spec = SCHEMA[table].get(key)
            if spec is None:
                err(table, key, f"unknown key (known: {', '.join(SCHEMA[table])})")
                continue
            if isinstance(item, bool) or not isinstance(item, spec.kind):
                err(table, key, f"must be a {_type_name(spec.kind)}, got {type(item).__name__}")
                continue
            if isinstance(item, float) and not math.isfinite(item):
                err(table, key, "must be finite")
                continue
            if spec.minimum is not None and isinstance(item, int | float) and item < spec.minimum:
                err(table, key, f"{item} is below the minimum {spec.minimum}")
            if spec.maximum is not None and isinstance(item, int | float) and item > spec.maximum:
                err(table, key, f"{item} is above the maximum {spec.maximum}")
            if isinstance(item, list):
                for element in item:
                    if spec.items and not isinstance(element, spec.items):
                        err(table, key, f"items must be {_type_name(spec.items)}s, got {element!r}")
                    elif spec.choices and element not in spec.choices:
                        err(table, key, f"unknown value {element!r} (known: {', '.join(spec.choices)})")
    if "name" not in data.get("profile", {}):
        err("profile", None, "profile.name is required")
    if not is_base and not data.get("match", {}).get("model"):
        err("match", "model", "a board profile needs at least one model pattern")
    return errors


def _merged_checks(merged: dict[str, dict[str, Any]], *, text: str, path: str) -> list[str]:
    """Cross-field rules and required keys, checked after merging over base."""
    errors = []
    for table, fields in SCHEMA.items():
        for key, spec in fields.items():
            if spec.required and table != "profile" and key not in merged.get(table, {}):
                errors.append(f"{path}:{_line_of(text, table, None)}: {table}.{key}: required (not set here or in base)")
    power = merged.get("power", {})
    if {"idle_w", "load_w"} <= power.keys() and power["load_w"] <= power["idle_w"]:
        errors.append(f"{path}:{_line_of(text, 'power', 'load_w')}: power.load_w: must exceed idle_w ({power['idle_w']})")
    budget = merged.get("budget", {})
    if {"battery_floor_pct", "battery_resume_pct"} <= budget.keys() and \
            budget["battery_resume_pct"] <= budget["battery_floor_pct"]:
        errors.append(f"{path}:{_line_of(text, 'budget', 'battery_resume_pct')}: budget.battery_resume_pct: "
                      f"must exceed battery_floor_pct ({budget['battery_floor_pct']})")
    return errors


def _read(path: Path) -> tuple[dict[str, Any] | None, str, list[str]]:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        return None, "", [f"{path}:1: cannot read: {exc.strerror or exc}"]
    if len(raw) > MAX_PROFILE_BYTES:
        return None, "", [f"{path}:1: file is {len(raw)} bytes, over the {MAX_PROFILE_BYTES}-byte limit"]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, "", [f"{path}:1: not UTF-8 (byte {exc.start})"]
    try:
        return tomllib.loads(text), text, []
    except tomllib.TOMLDecodeError as exc:
        match = re.search(r"line (\d+)", str(exc))
        line = match.group(1) if match else "1"
        return None, text, [f"{path}:{line}: TOML syntax: {exc}"]


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, dict[str, Any]]:
    merged = {table: dict(values) for table, values in base.items() if isinstance(values, dict)}
    for table, values in over.items():
        if isinstance(values, dict):
            merged.setdefault(table, {}).update(values)
    return merged


def load_profiles(paths: list[Path] | None = None, *, directory: Path | None = None) -> ProfileSet:
    """Load and validate profiles. With `paths`, only those (plus the directory's base)."""
    directory = directory or profiles_dir()
    base_path = directory / f"{BASE_NAME}.toml"
    files = list(paths) if paths else sorted(directory.glob("*.toml"))
    result = ProfileSet(profiles={})
    base_data: dict[str, Any] = {}
    base_candidates = [p for p in files if p.stem == BASE_NAME] or ([base_path] if base_path.exists() else [])
    for bp in base_candidates[:1]:
        data, text, errors = _read(bp)
        result.errors += errors
        if data is not None:
            errs = validate(data, text=text, path=str(bp), is_base=True)
            result.errors += errs
            if not errs:
                base_data = data
    for path in files:
        if path.stem == BASE_NAME:
            continue
        data, text, errors = _read(path)
        result.errors += errors
        if data is None:
            continue
        errs = validate(data, text=text, path=str(path), is_base=False)
        inherits = data.get("profile", {}).get("inherits", BASE_NAME)
        if inherits != BASE_NAME:
            errs.append(f"{path}:{_line_of(text, 'profile', 'inherits')}: profile.inherits: "
                        f"only {BASE_NAME!r} is supported, got {inherits!r}")
        merged = _merge(base_data, data)
        if not errs:  # cross-field rules assume every value already has the right type
            errs += _merged_checks(merged, text=text, path=str(path))
        result.errors += errs
        if errs:
            continue
        name = merged["profile"]["name"]
        if name in result.profiles:
            result.errors.append(f"{path}:{_line_of(text, 'profile', 'name')}: profile.name: "
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
