"""The selection's records (Candidate, Selection) and their cache in the state directory.

The decision and its timings are cached per (int8 backbone sha256, hardware fingerprint,
edge-agent version) -- plus batch size, threads and the candidate list, which also change
the answer (not the job size: the cached rows are re-chosen for each job's size). Not per
bundle: engines run only the backbone, so a new head version reuses the decision.
`kernels --bench` and `finetune` share the directory. A forced engine is never cached.

Separate from selection.py because reading a decision (`kernels` without --bench, the
records' JSON form) needs none of the preparing, checking and timing that making one does.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .. import __version__
from ..atomic import read_limited
from ..errors import InputError
from ..protocol.engine_choice import kind_of
from . import engines as registry
from .bundle import BACKBONE_INT8
from .engines._common import thread_count

_log = logging.getLogger(__name__)

CACHE_DIR = "int8-selection"
CACHE_FORMAT = 3  # 2: task-level agreement and costs; 3: inconclusive checks, capped tolerance
MAX_CACHE_BYTES = 256 * 1024


@dataclass
class Candidate:
    """One engine's row in the decision: availability, agreement, timing."""

    name: str
    available: bool
    reason: str  # what was found, or why not
    agreement: str = ""  # "int8" (units) | "float" (output steps) | ""
    max_diff: float | None = None  # in int8 units or in output quantisation steps
    tolerance: float | None = None
    top1_match: float | None = None  # fraction of decided samples with the reference's top-1 (None: none decided)
    top1_checked: int | None = None  # decided samples (near-ties excluded, see Oracle.decided)
    correct: bool | None = None
    basis: str = ""  # what decided `correct`: "task" (top-1 vs fp32) | "units" (the fallback)
    inconclusive: str = ""  # why the task-level check could not decide ("" when it did)
    agreement_decided: int | None = None  # calibration samples whose top-1 one output step cannot flip
    rounding_sensitivity: float | None = None  # int8 units the graph's output moves under rounding flips
    too_sensitive: bool = False  # sensitivity over the cap: units cannot judge an engine here
    latency_ms: float | None = None  # median per batch
    images_per_s: float | None = None
    chosen: bool = False
    error: str = ""  # prepare/run failure
    # task-level agreement (engine_cost.agreement_verdict): top-1 through the head vs fp32
    agreement_samples: int | None = None
    top1_fp32: float | None = None  # this engine's agreement with the fp32 model
    reference_top1_fp32: float | None = None  # the reference's (the baseline)
    mean_steps: float | None = None  # mean |engine - reference| in output steps (sanity bound)
    # cost (engine_cost): per engine at its best thread count
    threads: int | None = None
    prepare_s: float | None = None
    prepare_cpu_s: float | None = None
    prepare_j: float | None = None
    per_image_s: float | None = None
    per_image_cpu_s: float | None = None
    per_image_j: float | None = None
    per_image_spread: float | None = None  # relative half-IQR of the timed rounds' CPU (engine_cost.relative_spread)
    peak_mb: float | None = None  # peak RSS growth over prepare + runs
    # the engine class's static prepare_cpu_s_hint: what settles a tie of measured costs
    # (engine_cost.choose); None in caches made before it was recorded
    prepare_cpu_s_hint: float | None = None
    by_threads: dict[str, float] = field(default_factory=dict)  # threads -> per-image J
    predicted_j: dict[str, float] = field(default_factory=dict)  # images -> job J


@dataclass
class Selection:
    chosen: str | None
    candidates: list[Candidate]
    key: dict[str, Any]
    batch_size: int
    cached: bool = False
    forced: bool = False
    created: str = ""
    cache_file: str = ""
    notes: list[str] = field(default_factory=list)
    images: int = 0  # the job size the choice minimised the cost of
    threads: int | None = None  # the chosen engine's thread count
    energy_j: float = 0.0  # what this selection (or re-check) cost
    chosen_for: dict[str, str] = field(default_factory=dict)  # images -> engine (PREDICT_IMAGES)
    source: str = "measured"  # | "fleet": a device of this kind measured it, this one re-checked it
    share: dict[str, Any] | None = None  # the SharedChoice JSON this device reports (shared_choice.py)

    def candidate(self, name: str) -> Candidate | None:
        return next((c for c in self.candidates if c.name == name), None)

    def to_json(self) -> dict[str, Any]:
        return {"format": CACHE_FORMAT, "chosen": self.chosen, "key": self.key,
                "batch_size": self.batch_size, "created": self.created, "threads": self.threads,
                "images": self.images, "chosen_for": self.chosen_for, "source": self.source, "share": self.share,
                "candidates": [asdict(c) for c in self.candidates]}



def default_probe() -> dict[str, Any]:
    """This device's hardware probe report (edge_agent.hardware.probe: files only, fast)."""
    from ..hardware.probe import probe

    return probe()


def hardware_fingerprint(report: Mapping[str, Any]) -> str:
    """What makes engine timings comparable (board, CPU, int8 features, accelerators)."""
    from ..hardware.probe import hardware_fingerprint as fingerprint

    return str(fingerprint(dict(report)))


def cache_key(bundle: Any, fingerprint: str, *, batch_size: int, threads: int | None,
              preference: list[str]) -> dict[str, Any]:
    # keyed on the int8 backbone, not the whole bundle: every engine runs only the backbone,
    # so a new head version (each federated round) reuses the decision instead of spending
    # a re-selection (tens of CPU-seconds, every candidate prepared) on every device
    return {"backbone_sha256": bundle.manifest.files[BACKBONE_INT8].sha256, "hardware": fingerprint, "edge_agent": __version__,
            "batch_size": batch_size, "threads": threads, "candidates": list(preference)}


def cache_path(state_dir: str | os.PathLike[str], key: dict[str, Any]) -> Path:
    """Named by the key's kind: the devices that share a choice share this name."""
    return Path(state_dir) / CACHE_DIR / f"{kind_of(key)}.json"


def load_cached(path: Path, key: dict[str, Any]) -> Selection | None:
    """A cached decision for exactly this key, or None (absent, corrupt or stale)."""
    try:
        obj = json.loads(read_limited(path, MAX_CACHE_BYTES))
        if obj.get("format") != CACHE_FORMAT or obj.get("key") != key:
            return None
        cands = [Candidate(**c) for c in obj["candidates"]]
        chosen = obj["chosen"]
        if chosen not in {c.name for c in cands if c.correct}:
            return None
        threads = obj.get("threads")
        return Selection(chosen, cands, key, int(obj["batch_size"]), cached=True,
                         created=str(obj.get("created", "")), cache_file=str(path),
                         threads=int(threads) if isinstance(threads, int) else None,
                         images=int(obj.get("images", 0)), chosen_for=dict(obj.get("chosen_for", {})),
                         source="fleet" if obj.get("source") == "fleet" else "measured",
                         share=obj["share"] if isinstance(obj.get("share"), dict) else None)
    except FileNotFoundError:
        return None
    except (OSError, InputError, ValueError, TypeError, KeyError, AttributeError) as exc:
        _log.warning("ignoring unreadable int8 selection cache %s: %s", path, exc)
        return None


def _plain_key(bundle: Any, probe: dict[str, Any], preference: list[str] | None, batch_size: int,
               threads: int | None) -> dict[str, Any]:
    """The cache key a selection without a forced engine uses (selection._ask's)."""
    return cache_key(bundle, hardware_fingerprint(probe), batch_size=batch_size, threads=thread_count(threads),
                     preference=registry.candidates(preference))


def cached_selection(bundle: Any, *, probe: dict[str, Any], preference: list[str] | None = None,
                     batch_size: int = 32, threads: int | None = None,
                     state_dir: str | os.PathLike[str]) -> Selection | None:
    """The cached decision for this bundle and device, without preparing anything."""
    key = _plain_key(bundle, probe, preference, batch_size, threads)
    return load_cached(cache_path(state_dir, key), key)


def selection_kind(bundle: Any, *, probe: dict[str, Any], preference: list[str] | None = None,
                   batch_size: int = 32, threads: int | None = None) -> str:
    """The kind of device and prefix a fleet's engine choice must match to be re-checked here
    instead of measured (shared_choice.matching)."""
    return kind_of(_plain_key(bundle, probe, preference, batch_size, threads))
