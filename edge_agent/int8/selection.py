"""Engine selection: which int8 engine runs this model's backbone on this device.

Candidates come from the board profile's preference list (default: every registered engine)
and are filtered by availability on the probe report. Each available one is prepared on the
actual bundle and checked (agreement.py says what correct means); the correct ones are timed
side by side at the job's batch size and at each thread count (interleaved rounds, median; the
runs of an engine's check at that batch size are its first rounds, engine_cost.TimedRuns).
The winner is the correct engine with the least predicted energy for the job's size
(engine_cost: prepare + images x per-image, within the profile's memory cap). The reference
is prepared and timed only when no other engine is correct (its answers are the oracle's
anyway).

The decision and its timings are cached in the state directory (selection_cache.py).
`EDGE_AGENT_INT8_BACKEND=<name>` forces one engine (only it is probed, checked and timed;
never cached); a forced engine that fails the check is an error (exit 69) unless
`EDGE_AGENT_INT8_FORCE=1` (--force-engine) says to run it anyway. MXNet is imported only
when an engine or a head that is more than one dense layer needs it.

Here: the entry point, resolving what is asked. The measurement's steps are in
selection_measure.py, reusing a cached or a fleet-shared choice in selection_reuse.py. The
records, the cache and the agreement check are re-exported here: callers import them from
this module.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import ConfigError
from . import engines as registry
from .agreement import (
    FLOAT_TOLERANCE_STEPS,
    INT8_TOLERANCE_UNITS,
    ROUNDING_FLIP_RATE,
    ROUNDING_SAMPLES,
    ROUNDING_SEEDS,
    ROUNDING_SENSITIVITY_CAP,
    Oracle,
    check_batch_for,
)
from .engine import ENV_FORCE_BACKEND, Int8Engine, Runner
from .engine_cost import (
    DEFAULT_WATTS_PER_CPU,
    SYSTEM_CLOCKS,
    Clocks,
    CpuMeter,
    EngineUnavailableError,
    Meter,
)
from .engines._common import thread_count
from .selection_cache import (
    CACHE_DIR,
    CACHE_FORMAT,
    MAX_CACHE_BYTES,
    Candidate,
    Selection,
    cache_key,
    cache_path,
    cached_selection,
    default_probe,
    hardware_fingerprint,
    load_cached,
)
from .selection_measure import (
    PREDICT_IMAGES,
    PROBE_PREDICT_CPU_S,
    PROBE_REPEATS,
    PROBE_SAMPLES,
    VARIANT_PREPARE_MAX_S,
    Ask,
    availability_report,
    load_engines,
    measure,
)
from .selection_reuse import adopt_shared, use_cached
from .selection_worth import EXPENSIVE_PREPARE_S
from .shared_choice import SharedChoice, kind_of, matching

__all__ = [
    "CACHE_DIR", "CACHE_FORMAT", "EXPENSIVE_PREPARE_S", "FLOAT_TOLERANCE_STEPS", "INT8_TOLERANCE_UNITS",
    "MAX_CACHE_BYTES", "PREDICT_IMAGES", "PROBE_PREDICT_CPU_S", "PROBE_REPEATS", "PROBE_SAMPLES",
    "ROUNDING_FLIP_RATE", "ROUNDING_SAMPLES", "ROUNDING_SEEDS", "ROUNDING_SENSITIVITY_CAP",
    "VARIANT_PREPARE_MAX_S", "Candidate", "EngineUnavailableError", "Oracle", "Selection",
    "availability_report", "cache_key", "cache_path", "cached_selection", "check_batch_for",
    "default_probe", "hardware_fingerprint", "load_cached", "profile_settings", "select_engine",
]

_log = logging.getLogger(__name__)


def select_engine(
    bundle: Any,
    *,
    probe: dict[str, Any] | None = None,
    preference: list[str] | None = None,
    batch_size: int = 32,
    threads: int | None = None,
    state_dir: str | os.PathLike[str] | None = None,
    repeats: int = 5,
    use_cache: bool = True,
    env: Mapping[str, str] | None = None,
    logits: Callable[[np.ndarray], np.ndarray] | None = None,
    engines: list[tuple[str, Int8Engine | None]] | None = None,
    keep_runner: bool = False,
    images: int = 1000,
    meter: Meter | None = None,
    watts_per_cpu: float | None = None,
    mem_cap_mb: float | None = None,
    recheck_cached: bool = False,
    clocks: Clocks = SYSTEM_CLOCKS,
    shared: Sequence[SharedChoice] = (),
    measure_all: bool = False,
) -> tuple[Selection, Runner | None]:
    """Choose the engine for `bundle` here; returns the decision and (with `keep_runner`)
    the chosen engine's prepared runner. Raises EngineUnavailableError if nothing is correct,
    ConfigError for an unknown forced engine. `engines` replaces the registry (tests).

    The choice minimises the predicted energy of a job of `images` images (engine_cost).
    `meter` charges each phase (the job's budget governor; it may refuse one), else CPU
    seconds x `watts_per_cpu`. `recheck_cached` re-times a cached choice on a few batches
    and falls back to one thread when it got RECHECK_FACTOR slower (see selection_reuse.use_cached).
    `clocks`: where wall and CPU seconds are read (tests: virtual clocks). `shared`: choices
    other devices measured (shared_choice.py); one made on a device of this kind is re-checked
    (same outputs, about the same speed) instead of measuring every engine. `measure_all`
    (`kernels --bench`): every available engine is prepared and timed, whatever the job.

    The steps: the cache, else the fleet's choice, else a measurement -- probe (availability,
    the reference's price per sample) -> predict (the budget may refuse here) -> the oracle ->
    prepare and check the candidates (cheapest first, dominated ones skipped) -> time the
    correct ones -> decide -> record (cache, what to share)."""
    if batch_size < 1:
        raise ConfigError(f"batch size must be >= 1, got {batch_size}")
    ask = _ask(bundle, probe=probe, preference=preference, batch_size=batch_size, threads=threads,
               state_dir=state_dir, repeats=repeats, env=env, logits=logits, engines=engines, images=images,
               meter=meter, watts_per_cpu=watts_per_cpu, mem_cap_mb=mem_cap_mb, clocks=clocks, measure_all=measure_all)
    if not ask.forced and use_cache and ask.path is not None:
        cached = load_cached(ask.path, ask.key)
        hit = None if cached is None else use_cached(cached, ask, keep_runner=keep_runner,
                                                     recheck_cached=recheck_cached)
        if hit is not None:
            return hit
    kind = kind_of(ask.key)
    fleet = matching(shared, kind) if not ask.forced else None
    passed_over = ""
    if fleet is not None:
        adopted = adopt_shared(fleet, ask, keep_runner=keep_runner)
        if isinstance(adopted, tuple):
            return adopted
        passed_over = f"the fleet's int8 choice {fleet.engine} for this kind of device not taken ({adopted})"
    elif shared and not ask.forced:
        passed_over = (f"none of the fleet's {len(shared)} int8 choice(s) was made on a device of this kind "
                       f"({kind[:8]})")
    if passed_over:
        _log.info("%s: measuring every engine", passed_over)
    selection, runner = measure(ask, keep_runner=keep_runner)
    if passed_over:  # the job's report says why it paid for a full measurement
        selection.notes.append(f"{passed_over}: every engine measured")
    return selection, runner


def _ask(bundle: Any, *, probe: dict[str, Any] | None, preference: list[str] | None, batch_size: int,
         threads: int | None, state_dir: str | os.PathLike[str] | None, repeats: int, env: Mapping[str, str] | None,
         logits: Callable[[np.ndarray], np.ndarray] | None, engines: list[tuple[str, Int8Engine | None]] | None,
         images: int, meter: Meter | None, watts_per_cpu: float | None, mem_cap_mb: float | None, clocks: Clocks,
         measure_all: bool) -> Ask:
    """The inputs resolved: the candidates (a forced engine outside them added), the cache key."""
    env = os.environ if env is None else env
    threads = thread_count(threads)  # None and "all cores" are the same decision
    wpc = float(watts_per_cpu) if watts_per_cpu else DEFAULT_WATTS_PER_CPU
    probe = default_probe() if probe is None else probe
    names = [n for n, _ in engines] if engines is not None else registry.candidates(preference)
    loaded = engines if engines is not None else load_engines(names)
    forced = env.get(ENV_FORCE_BACKEND, "").strip() or None
    if forced and forced not in {n for n, e in loaded if e is not None}:
        known = [n for n, e in loaded if e is not None] if engines is not None else registry.engine_names()
        if forced not in known:
            raise ConfigError(f"{ENV_FORCE_BACKEND}={forced}: unknown engine; known: {', '.join(known)}")
        loaded = [*loaded, (forced, registry.load_engine(forced))]  # forced but outside the profile
    key = cache_key(bundle, hardware_fingerprint(probe), batch_size=batch_size, threads=threads,
                    preference=[n for n, _ in loaded])
    return Ask(bundle, dict(loaded), loaded, probe, key, cache_path(state_dir, key) if state_dir is not None else None,
                batch_size, threads, images, repeats, mem_cap_mb, forced, env, measure_all,
                wpc, meter if meter is not None else CpuMeter(wpc), clocks, logits)


def profile_settings(report: Mapping[str, Any]) -> dict[str, Any]:
    """The matched board profile's int8 backends, int8 threads and training batch size
    (empty when no profile matched or the profiles cannot be loaded)."""
    name = (report.get("profile") or {}).get("name")
    if not name:
        return {}
    try:
        from ..hardware.profiles import load_profiles

        profile = load_profiles().profiles.get(name)
    except Exception as exc:  # a broken profile directory must not stop selection
        _log.warning("cannot load board profiles: %s", exc)
        return {}
    if profile is None:
        return {}
    found = {"profile": name, "backends": profile.get("int8", "backends"),
             "threads": profile.get("int8", "threads"), "batch_size": profile.get("training", "batch_size"),
             "memory_cap_mb": profile.get("training", "memory_cap_mb")}
    idle, load = profile.get("power", "idle_w"), profile.get("power", "load_w")
    if idle is not None and load is not None and load > idle:  # what one busy core adds
        cores = max(1, int((report.get("cpu") or {}).get("count") or os.cpu_count() or 1))
        found["watts_per_cpu"] = (float(load) - float(idle)) / cores
    return {k: v for k, v in found.items() if v is not None}
