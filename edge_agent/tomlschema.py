"""A small schema for TOML files, with `file:line: key: message` errors.

Board profiles and the agent's config are declarative data checked by a schema in code
(ESPHome's approach): a user editing a file on a device sees exactly where a mistake is.
tomllib keeps no line numbers, so they are recovered from the source text.
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_TOML_BYTES = 64 * 1024


@dataclass(frozen=True)
class Field:
    kind: type | tuple[type, ...]
    required: bool = False
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] = ()  # for strings, or for each item of a list
    items: type | None = None  # for lists
    max_length: int = 512  # for strings


def number(minimum: float | None = None, maximum: float | None = None, *, required: bool = False) -> Field:
    return Field((int, float), required=required, minimum=minimum, maximum=maximum)


Schema = dict[str, dict[str, Field]]


def line_of(text: str, table: str | None, key: str | None) -> int:
    """Best-effort line number of `[table]` / `key =` in TOML source."""
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


def type_name(kind: type | tuple[type, ...]) -> str:
    if isinstance(kind, tuple):
        return "number"
    return {str: "string", int: "integer", list: "list", float: "number", bool: "boolean"}.get(
        kind, kind.__name__)


class Reporter:
    """Collects `file:line: table.key: message` errors for one file."""

    def __init__(self, path: str | Path, text: str) -> None:
        self.path = str(path)
        self.text = text
        self.errors: list[str] = []

    def error(self, table: str | None, key: str | None, message: str) -> None:
        where = f"{table}.{key}" if table and key else (table or key or "")
        self.errors.append(f"{self.path}:{line_of(self.text, table, key)}: {where}: {message}")


def check_value(report: Reporter, table: str, key: str, item: Any, spec: Field) -> None:
    is_bool_field = spec.kind is bool
    if (isinstance(item, bool) and not is_bool_field) or not isinstance(item, spec.kind):
        name = type_name(spec.kind)
        report.error(table, key, f"must be {'an' if name[0] in 'aeiou' else 'a'} {name}, got {type(item).__name__}")
        return
    if isinstance(item, float) and not math.isfinite(item):
        report.error(table, key, "must be finite")
        return
    if isinstance(item, int | float) and not isinstance(item, bool):
        if spec.minimum is not None and item < spec.minimum:
            report.error(table, key, f"{item} is below the minimum {spec.minimum}")
        if spec.maximum is not None and item > spec.maximum:
            report.error(table, key, f"{item} is above the maximum {spec.maximum}")
    if isinstance(item, str):
        if len(item) > spec.max_length:
            report.error(table, key, f"longer than {spec.max_length} characters")
        elif spec.choices and item not in spec.choices:
            report.error(table, key, f"unknown value {item!r} (known: {', '.join(spec.choices)})")
    if isinstance(item, list):
        for element in item:
            if spec.items and (not isinstance(element, spec.items) or isinstance(element, bool)):
                report.error(table, key, f"items must be {type_name(spec.items)}s, got {element!r}")
            elif spec.choices and element not in spec.choices:
                report.error(table, key, f"unknown value {element!r} (known: {', '.join(spec.choices)})")


def check_tables(report: Reporter, data: dict[str, Any], schema: Schema) -> None:
    """Unknown tables/keys, types, ranges and choices. Required keys are the caller's call
    (they may be satisfied by a file merged underneath)."""
    for table, value in data.items():
        if table not in schema:
            report.error(None, table, f"unknown table (known: {', '.join(schema)})")
            continue
        if not isinstance(value, dict):
            report.error(None, table, "must be a table")
            continue
        for key, item in value.items():
            spec = schema[table].get(key)
            if spec is None:
                report.error(table, key, f"unknown key (known: {', '.join(schema[table])})")
                continue
            check_value(report, table, key, item, spec)


def check_required(report: Reporter, merged: dict[str, Any], schema: Schema, *, skip: tuple[str, ...] = ()) -> None:
    for table, fields in schema.items():
        if table in skip:
            continue
        for key, spec in fields.items():
            if spec.required and key not in merged.get(table, {}):
                report.error(table, None, f"{table}.{key} is required")


def read_toml(path: Path, *, max_bytes: int = MAX_TOML_BYTES) -> tuple[dict[str, Any] | None, str, list[str]]:
    """Parse a TOML file: (data or None, source text, errors as file:line: message)."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        return None, "", [f"{path}:1: cannot read: {exc.strerror or exc}"]
    if len(raw) > max_bytes:
        return None, "", [f"{path}:1: file is {len(raw)} bytes, over the {max_bytes}-byte limit"]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, "", [f"{path}:1: not UTF-8 (byte {exc.start})"]
    try:
        return tomllib.loads(text), text, []
    except tomllib.TOMLDecodeError as exc:
        match = re.search(r"line (\d+)", str(exc))
        return None, text, [f"{path}:{match.group(1) if match else '1'}: TOML syntax: {exc}"]


def merge_tables(base: dict[str, Any], over: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """`over` overrides `base` key by key within each table."""
    merged = {table: dict(values) for table, values in base.items() if isinstance(values, dict)}
    for table, values in over.items():
        if isinstance(values, dict):
            merged.setdefault(table, {}).update(values)
    return merged
