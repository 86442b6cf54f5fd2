"""Engine choices shared across a fleet: one device measures, the others of its kind re-check.

A device's full selection (every candidate prepared, checked against the reference and the
fp32 model, timed) is what a fresh device pays most for before its first training step, and
every device of the same board, CPU features and backbone would pay it again for the same
answer. So a device that measured in full reports its choice as a `SharedChoice`; the
coordinator relays the choices it has heard for a model in each fine-tune command; a device
of the same *kind* (the selection cache key: backbone, hardware fingerprint, edge-agent
version, batch size, threads, candidates) starts from it and re-checks it cheaply:

- the same answers: the engine's output on the bundle's first FINGERPRINT_SAMPLES calibration
  samples hashes to the fingerprint the measuring device reported. Engines are deterministic
  on one kind of hardware (the native engine is bit-exact everywhere), so equal outputs are
  the outputs that passed the measuring device's agreement check;
- about the same speed: a few batches within RECHECK_FACTOR of the reported batch time, or,
  slower by the clock only, within RECHECK_FACTOR of the reported CPU time per image (a busy
  CPU, whose other processes inflate wall time, not the work the engine does).

A choice that fails either check is measured locally in full (and that device's own result
is then shared). Everything here arrives over the network: parsed strictly, bounded.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InputError
from ..protocol.engine_choice import (
    MAX_SHARED_CHOICES,
    SharedChoice,
    kind_of,
    matching,
    parse_choices,
)

__all__ = ["FINGERPRINT_SAMPLES", "MAX_SHARED_CHOICES", "SharedChoice", "kind_of", "matching", "output_fingerprint",
           "parse_choices", "shared_choices"]

FINGERPRINT_SAMPLES = 8


def output_fingerprint(runner: Any, calibration: np.ndarray) -> str:
    """sha256 of the runner's features on the first FINGERPRINT_SAMPLES calibration samples,
    rounded to 1e-4 (int8 engines give exact multiples of the output scale; a float engine
    that differs in the last bits costs a full measurement, never a wrong answer)."""
    x = np.ascontiguousarray(calibration[:FINGERPRINT_SAMPLES])
    out = runner.run(x)
    data = np.round(np.asarray(out, np.float64), 4).astype(np.float32)
    return hashlib.sha256(np.ascontiguousarray(data).tobytes()).hexdigest()


def shared_choices(state_dir: str | Path, *, limit: int = MAX_SHARED_CHOICES) -> list[SharedChoice]:
    """The choices this device measured in full (its selection cache), newest first, one per
    kind: what it reports for the rest of the fleet. Fleet-adopted and unreadable entries are
    left out (a device passes on only what it measured itself)."""
    from ..atomic import read_limited
    from .selection_cache import CACHE_DIR, MAX_CACHE_BYTES

    found: list[tuple[float, SharedChoice]] = []
    directory = Path(state_dir) / CACHE_DIR
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        try:
            obj = json.loads(read_limited(path, MAX_CACHE_BYTES))
            share = obj.get("share")
            if obj.get("source", "measured") == "measured" and isinstance(share, dict):
                found.append((path.stat().st_mtime, SharedChoice.from_json(share, where=str(path))))
        except (OSError, ValueError, InputError):
            continue
    found.sort(key=lambda t: -t[0])
    return _one_per_kind(c for _, c in found)[:limit]


def _one_per_kind(choices: Iterable[SharedChoice]) -> list[SharedChoice]:
    seen: set[str] = set()
    out = []
    for c in choices:
        if c.kind not in seen:
            seen.add(c.kind)
            out.append(c)
    return out
