"""A fleet-shared int8 engine choice as it travels: reported by the device that measured it,
relayed by the coordinator in fine-tune commands (edge_agent.int8.shared_choice says how a
device uses one). Untrusted on arrival: parsed strictly, bounded."""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import InputError

MAX_SHARED_CHOICES = 16  # per command: one per kind of device in the fleet is plenty
_KIND_RE = re.compile(r"^[0-9a-f]{32}\Z")
_SHA_RE = re.compile(r"^[0-9a-f]{64}\Z")
_ENGINE_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,31}\Z")
_FIELDS = {"kind", "engine", "threads", "batch_size", "latency_ms", "per_image_cpu_s", "fingerprint"}


def kind_of(key: dict[str, Any]) -> str:
    """The kind of a selection cache key (the digest its cache file is named by)."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class SharedChoice:
    kind: str  # kind_of(the selection's cache key)
    engine: str
    threads: int
    batch_size: int
    latency_ms: float  # median batch time when measured
    per_image_cpu_s: float
    fingerprint: str  # output_fingerprint of the engine's output

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "engine": self.engine, "threads": self.threads, "batch_size": self.batch_size,
                "latency_ms": round(self.latency_ms, 6), "per_image_cpu_s": round(self.per_image_cpu_s, 9),
                "fingerprint": self.fingerprint}

    @classmethod
    def from_json(cls, obj: Any, *, where: str = "engine choice") -> SharedChoice:
        """Parse one choice from untrusted JSON; InputError says what is wrong."""
        if not isinstance(obj, dict):
            raise InputError(f"{where}: not an object")
        unknown = set(obj) - _FIELDS
        if unknown or _FIELDS - set(obj):
            raise InputError(f"{where}: fields {sorted(obj)[:10]}, expected {sorted(_FIELDS)}")
        for name, pattern in (("kind", _KIND_RE), ("engine", _ENGINE_RE), ("fingerprint", _SHA_RE)):
            if not isinstance(obj[name], str) or not pattern.match(obj[name]):
                raise InputError(f"{where}: bad {name} {str(obj[name])[:70]!r}")
        for name, hi in (("threads", 256), ("batch_size", 4096)):
            if type(obj[name]) is not int or not 1 <= obj[name] <= hi:
                raise InputError(f"{where}: {name} must be an integer in 1..{hi}")
        for name in ("latency_ms", "per_image_cpu_s"):
            value = obj[name]
            # (the range first: math.isfinite(10**400) raises OverflowError, and JSON can carry it)
            if type(value) not in (int, float) or not 0 < value < 1e6 or not math.isfinite(value):
                raise InputError(f"{where}: {name} must be a positive number")
        return cls(obj["kind"], obj["engine"], obj["threads"], obj["batch_size"], float(obj["latency_ms"]),
                   float(obj["per_image_cpu_s"]), obj["fingerprint"])


def parse_choices(value: Any, *, where: str = "engine_choices") -> list[SharedChoice]:
    """A list of choices from untrusted JSON (at most MAX_SHARED_CHOICES, one per kind)."""
    if not isinstance(value, list):
        raise InputError(f"{where}: not a list")
    if len(value) > MAX_SHARED_CHOICES:
        raise InputError(f"{where}: {len(value)} choices, at most {MAX_SHARED_CHOICES}")
    out = [SharedChoice.from_json(v, where=f"{where}[{i}]") for i, v in enumerate(value)]
    if len({c.kind for c in out}) != len(out):
        raise InputError(f"{where}: a kind appears twice")
    return out


def matching(choices: Sequence[SharedChoice], kind: str) -> SharedChoice | None:
    """The choice made on a device of this kind, if any."""
    return next((c for c in choices if c.kind == kind), None)
