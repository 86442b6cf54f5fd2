"""Labels are names: the `--label-map` spec a user gives to tie their data's label names
(folder names, CSV cells, NPZ values) to a model's labels, and the digest of a model's
label list that an update carries so the coordinator can refuse one trained on another.

Free of numpy: the coordinator and the agent daemon's children import it cheaply.
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .atomic import read_limited
from .errors import InputError

MAX_LABEL_MAP_BYTES = 1 << 20
MAX_LABEL_MAP_ENTRIES = 10_000
INDICES = "indices"  # the label-map spec saying "integer label values are indices"


def label_set_digest(labels: Sequence[str]) -> str:
    """sha256 hex of a model's ordered label list: what an update says it was trained on."""
    return hashlib.sha256(json.dumps(list(labels), ensure_ascii=False).encode()).hexdigest()


def _map_entry(key: Any, value: Any, where: str) -> tuple[str, str]:
    k, v = str(key).strip(), value.strip() if isinstance(value, str) else None
    if not k or v is None or not v or len(k) > 256 or len(v) > 256:
        raise InputError(f"{where}: label map entry {str(key)[:40]!r} -> {str(value)[:40]!r}: "
                         "both sides must be non-empty text of at most 256 characters")
    return k, v


def _pairs_from_text(text: str, where: str) -> list[tuple[str, str]]:
    """DATA=MODEL pairs separated by commas or newlines ('#' starts a comment)."""
    pairs = []
    for line in text.splitlines():
        for item in line.split("#", 1)[0].split(","):
            if not item.strip():
                continue
            if "=" not in item:
                raise InputError(f"{where}: label map entry {item.strip()[:40]!r} is not DATA_LABEL=MODEL_LABEL")
            key, value = item.split("=", 1)
            pairs.append(_map_entry(key, value, where))
    return pairs


def parse_label_map(spec: str) -> dict[str, str] | str:
    """A `--label-map` value -> {data label: model label}, or `INDICES` (see LABEL_MAP_HELP).

    A spec naming an existing file is read as that file (JSON object, TOML pairs or a
    `[labels]` table, or DATA=MODEL lines); otherwise it must be inline `K=V,K=V` pairs.
    Which model labels the targets must be is checked by `load_dataset`."""
    text = str(spec).strip()
    if text == INDICES:
        return INDICES
    path = Path(text).expanduser()
    if path.is_file():
        where = str(path)
        raw = read_limited(path, MAX_LABEL_MAP_BYTES)
        try:
            body = raw.decode("utf-8-sig")
        except UnicodeDecodeError:
            raise InputError(f"{where}: the label map is not UTF-8 text") from None
        if path.suffix.lower() == ".json":
            try:
                obj = json.loads(body)
            except json.JSONDecodeError as exc:
                raise InputError(f"{where}: not valid JSON ({exc})") from None
        elif path.suffix.lower() == ".toml":
            try:
                obj = tomllib.loads(body)
            except tomllib.TOMLDecodeError as exc:
                raise InputError(f"{where}: not valid TOML ({exc})") from None
            if set(obj) == {"labels"} and isinstance(obj["labels"], dict):
                obj = obj["labels"]
        else:
            obj = None
        if obj is None:
            pairs = _pairs_from_text(body, where)
        elif isinstance(obj, dict):
            pairs = [_map_entry(k, v, where) for k, v in obj.items()]
        else:
            raise InputError(f"{where}: a label map must be an object of DATA_LABEL: MODEL_LABEL")
    elif "=" in text:
        where = "--label-map"
        pairs = _pairs_from_text(text, where)
    else:
        raise InputError(f"--label-map {text[:80]!r}: no such file, and not DATA_LABEL=MODEL_LABEL pairs "
                         f"(e.g. 0=brick,1=grass) or {INDICES!r}")
    if not pairs:
        raise InputError(f"{where}: the label map is empty")
    if len(pairs) > MAX_LABEL_MAP_ENTRIES:
        raise InputError(f"{where}: more than {MAX_LABEL_MAP_ENTRIES} label map entries")
    mapping: dict[str, str] = {}
    for key, value in pairs:
        if mapping.get(key, value) != value:
            raise InputError(f"{where}: data label {key!r} is mapped twice ({mapping[key]!r} and {value!r})")
        mapping[key] = value
    return mapping
