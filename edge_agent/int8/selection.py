"""Engine selection: which int8 engine runs this model's backbone on this device.

Candidates come from the board profile's preference list (default: every registered engine)
and are filtered by availability on the probe report. Each available one is prepared on the
actual bundle and checked (agreement.py says what correct means); the correct ones are timed
side by side at the job's batch size and at each thread count (interleaved rounds, median).
The winner is the correct engine with the least predicted energy for the job's size
(engine_cost: prepare + images x per-image, within the profile's memory cap). The reference
is prepared and timed only when no other engine is correct (its answers are the oracle's
anyway).

The decision and its timings are cached in the state directory (selection_cache.py).
`EDGE_AGENT_INT8_BACKEND=<name>` forces one engine (only it is probed, checked and timed;
never cached); a forced engine that fails the check is an error (exit 69) unless
`EDGE_AGENT_INT8_FORCE=1` (--force-engine) says to run it anyway. MXNet is imported only
when an engine or a head that is more than one dense layer needs it.

The records, the cache and the agreement check are re-exported here: callers import them
from this module.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic import atomic_write_json
from ..errors import EXIT_UNAVAILABLE, ConfigError, EdgeAgentError
from . import engines as registry
from . import oracle_answers
from .agreement import (
    FLOAT_TOLERANCE_STEPS,
    INT8_TOLERANCE_UNITS,
    ROUNDING_FLIP_RATE,
    ROUNDING_SAMPLES,
    ROUNDING_SEEDS,
    ROUNDING_SENSITIVITY_CAP,
    Oracle,
    check_batch_for,
    disagreement,
    evidence_notes,
)
from .bundle import ORACLE
from .engine import ENV_FORCE_BACKEND, ENV_FORCE_WRONG, Int8Engine, Runner
from .engine_cost import (
    AGREEMENT_MAX_SAMPLES,
    DEFAULT_WATTS_PER_CPU,
    RECHECK_BATCHES,
    SYSTEM_CLOCKS,
    Clocks,
    CpuMeter,
    Meter,
    SelectionStopped,
    choice_margin_note,
    choose,
    measured,
    predict_job,
    recheck,
    time_rounds,
)
from .engines._common import thread_count
from .oracle_answers import SPOT_CHECK_SAMPLES
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
from .shared_choice import FINGERPRINT_SAMPLES, SharedChoice, kind_of, matching, output_fingerprint

__all__ = [
    "CACHE_DIR", "CACHE_FORMAT", "FLOAT_TOLERANCE_STEPS", "INT8_TOLERANCE_UNITS", "MAX_CACHE_BYTES",
    "PREDICT_IMAGES", "PROBE_PREDICT_CPU_S", "PROBE_REPEATS", "PROBE_SAMPLES", "ROUNDING_FLIP_RATE", "ROUNDING_SAMPLES", "ROUNDING_SEEDS",
    "ROUNDING_SENSITIVITY_CAP",
    "VARIANT_PREPARE_MAX_S", "Candidate", "EngineUnavailableError", "Oracle", "Selection",
    "availability_report", "cache_key", "cache_path", "cached_selection", "check_batch_for",
    "default_probe", "hardware_fingerprint", "load_cached", "profile_settings", "select_engine",
]

_log = logging.getLogger(__name__)

PROBE_SAMPLES = 4  # priced after a warm-up call: one cold image cost ~200x a warm one
PROBE_REPEATS = 3  # runs of PROBE_SAMPLES images whose median CPU time prices a sample
# What the first probe phase (engine availability, the bundle's graph, one cold reference
# image) is predicted to cost before anything is measured: ~0.08 CPU-s for the demo bundle on
# a Zen 2 core and several times that on a Cortex-A72, so a budget below it is refused
# before it is spent instead of overrun by the probe
PROBE_PREDICT_CPU_S = 0.5
VARIANT_PREPARE_MAX_S = 2.0  # other thread counts are tried for engines this cheap to prepare
# An engine whose class says it costs at least this many CPU-seconds to prepare (its
# prepare_cpu_s_hint: mxnet-onednn, 6 s) is prepared last, and only when the job could pay for
# it: not when preparing it alone would cost more than the whole job on an engine already
# checked. Its prepare is taken at PREPARE_HINT_LOW x the hint (measured 2.9-3.3 CPU-s on an
# EPYC core, half its hint; a faster core may do better), the checked engine's job at the
# per-image CPU of its check runs (cold, so an over-estimate): both err towards preparing.
EXPENSIVE_PREPARE_S = 2.0
PREPARE_HINT_LOW = 0.25
PREDICT_IMAGES = (100, 1000, 10000)


class EngineUnavailableError(EdgeAgentError):
    """No engine (or not the forced one) can run this model here."""

    exit_code = EXIT_UNAVAILABLE


# ---------------------------------------------------------------- selection


def _row(rows: list[Candidate], name: str) -> Candidate | None:
    return next((c for c in rows if c.name == name), None)


def _load_engines(names: list[str]) -> list[tuple[str, Int8Engine | None]]:
    out: list[tuple[str, Int8Engine | None]] = []
    for name in names:
        try:
            out.append((name, registry.load_engine(name)))
        except KeyError:
            out.append((name, None))
    return out


def availability_report(preference: list[str] | None = None, probe: dict[str, Any] | None = None,
                        *, engines: list[tuple[str, Int8Engine | None]] | None = None) -> list[Candidate]:
    """Every candidate's availability (or why not), errors caught: nothing is prepared."""
    rows = []
    for name, engine in engines if engines is not None else _load_engines(registry.candidates(preference)):
        if engine is None:
            rows.append(Candidate(name, False, f"unknown engine (known: {', '.join(registry.engine_names())})"))
            continue
        try:
            avail = engine.availability(probe)
            rows.append(Candidate(name, bool(avail.available), avail.reason,
                                  prepare_cpu_s_hint=float(getattr(engine, "prepare_cpu_s_hint", 1.0))))
        except Exception as exc:  # a probing engine must never take the others down
            rows.append(Candidate(name, False, f"availability check failed: {type(exc).__name__}: {exc}"))
    return rows


@dataclass
class _Ask:
    """What one selection is asked: the inputs every step reads (never writes)."""

    bundle: Any
    by_name: dict[str, Int8Engine | None]
    rows_from: list[tuple[str, Int8Engine | None]]  # the candidates, in preference order
    probe: dict[str, Any]
    key: dict[str, Any]
    path: Path | None
    batch_size: int
    threads: int
    images: int
    repeats: int
    mem_cap_mb: float | None
    forced: str | None
    env: Mapping[str, str]
    measure_all: bool
    wpc: float
    meter: Meter
    clocks: Clocks
    logits: Callable[[np.ndarray], np.ndarray] | None

    @functools.cached_property
    def x(self) -> np.ndarray:
        """The check batch: the bundle's first calibration samples at the job's batch size
        (read only when something is measured: a cached choice needs none)."""
        return check_batch_for(self.bundle, self.batch_size)


class _Ledger:
    """The joules each metered phase cost (the meter may refuse a phase before it starts)."""

    def __init__(self, ask: _Ask) -> None:
        self.ask, self.spent = ask, 0.0

    @contextlib.contextmanager
    def phase(self, name: str, predicted_j: float = 0.0) -> Iterator[Any]:
        with measured(self.ask.meter, name, predicted_j, clocks=self.ask.clocks) as ph:
            yield ph
        self.spent += ph.joules


@dataclass
class _Prices:
    """Predicted joules of the phases to come, from the probe's per-sample price."""

    per_sample: float
    oracle: float
    prepare: dict[str, float]
    timing: float
    hints: dict[str, float]  # the engines' prepare_cpu_s_hint


@dataclass
class _Prepared:
    runners: dict[tuple[str, int], Runner] = field(default_factory=dict)
    check_rate: dict[str, float] = field(default_factory=dict)  # CPU-s per image of each engine's check runs


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
    and falls back to one thread when it got RECHECK_FACTOR slower (see _use_cached).
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
        hit = None if cached is None else _use_cached(
            cached, bundle, ask.by_name, ask.probe, images=images, mem_cap_mb=mem_cap_mb, keep_runner=keep_runner,
            recheck_cached=recheck_cached, clocks=clocks)
        if hit is not None:
            return hit
    fleet = matching(shared, kind_of(ask.key)) if not ask.forced else None
    if fleet is not None:
        adopted = _adopt_shared(fleet, bundle, ask.by_name, ask.probe, ask.key, ask.x, ask.path, images=images,
                                meter=ask.meter, wpc=ask.wpc, keep_runner=keep_runner, clocks=clocks)
        if isinstance(adopted, tuple):
            return adopted
        _log.info("fleet-shared int8 choice %s not taken (%s): measuring every engine", fleet.engine, adopted)
    ledger = _Ledger(ask)
    rows, per_sample = _probe(ask, ledger)
    prices, upfront = _predict(ask, rows, per_sample)
    ask.meter.before("selection", upfront)
    with ledger.phase("agreement", prices.oracle):
        oracle = Oracle(bundle, ask.x, logits=logits)
        if oracle.q is not None:  # every check reads it: paid here, not by the first engine's check
            oracle.rounding_sensitivity()
    prepared = _prepare_and_check(ask, rows, oracle, prices, ledger)
    _add_thread_variants(ask, rows, prepared)
    _time(ask, rows, prepared, prices, ledger)
    selection = _decide(ask, rows, prepared)
    selection.energy_j = ledger.spent
    return _record(ask, selection, prepared, keep_runner=keep_runner)


def _ask(bundle: Any, *, probe: dict[str, Any] | None, preference: list[str] | None, batch_size: int,
         threads: int | None, state_dir: str | os.PathLike[str] | None, repeats: int, env: Mapping[str, str] | None,
         logits: Callable[[np.ndarray], np.ndarray] | None, engines: list[tuple[str, Int8Engine | None]] | None,
         images: int, meter: Meter | None, watts_per_cpu: float | None, mem_cap_mb: float | None, clocks: Clocks,
         measure_all: bool) -> _Ask:
    """The inputs resolved: the candidates (a forced engine outside them added), the cache key."""
    env = os.environ if env is None else env
    threads = thread_count(threads)  # None and "all cores" are the same decision
    wpc = float(watts_per_cpu) if watts_per_cpu else DEFAULT_WATTS_PER_CPU
    probe = default_probe() if probe is None else probe
    names = [n for n, _ in engines] if engines is not None else registry.candidates(preference)
    loaded = engines if engines is not None else _load_engines(names)
    forced = env.get(ENV_FORCE_BACKEND, "").strip() or None
    if forced and forced not in {n for n, e in loaded if e is not None}:
        known = [n for n, e in loaded if e is not None] if engines is not None else registry.engine_names()
        if forced not in known:
            raise ConfigError(f"{ENV_FORCE_BACKEND}={forced}: unknown engine; known: {', '.join(known)}")
        loaded = [*loaded, (forced, registry.load_engine(forced))]  # forced but outside the profile
    key = cache_key(bundle, hardware_fingerprint(probe), batch_size=batch_size, threads=threads,
                    preference=[n for n, _ in loaded])
    return _Ask(bundle, dict(loaded), loaded, probe, key, cache_path(state_dir, key) if state_dir is not None else None,
                batch_size, threads, images, repeats, mem_cap_mb, forced, env, measure_all,
                wpc, meter if meter is not None else CpuMeter(wpc), clocks, logits)


def _probe(ask: _Ask, ledger: _Ledger) -> tuple[list[Candidate], float]:
    """Which engines can run here, and the reference's price per sample (joules), so that a
    budget too small for the selection is refused before it is spent."""
    from .engines.reference import ReferenceEngine

    forced = ask.forced
    ask.meter.before("selection-probe", ask.wpc * PROBE_PREDICT_CPU_S)  # nothing measured yet: a budget below the probe stops here
    with ledger.phase("probe") as ph:  # (just checked above) the first call pays one-off costs ...
        # which engines can run here: cheap by contract (Int8Engine.availability), and metered
        # with the probe all the same; a forced engine is the only one asked
        rows = availability_report(probe=ask.probe, engines=[(n, e) for n, e in ask.rows_from if not forced or n == forced])
        if forced:
            rows += [Candidate(n, False, f"not tried: {ENV_FORCE_BACKEND}={forced}") for n, _ in ask.rows_from if n != forced]
        probe_runner = (ask.by_name.get("reference") or ReferenceEngine()).prepare(ask.bundle)
        probe_runner.run(ask.x[:1])
    n_probe = min(len(ask.x), PROBE_SAMPLES)
    # ... so the per-sample price comes from the runs after it: CPU-seconds (the median of
    # PROBE_REPEATS runs) x watts per CPU. Not the meter's joules: a power source read around a
    # few milliseconds (a sensor, or /proc/stat's 10 ms jiffies with every process's load in
    # them) predicted 0.0013-0.42 Wh for a selection that cost ~0.005 Wh. The phase itself is
    # predicted at the cold image's CPU time, which buys ~200 warm ones.
    with ledger.phase("probe", ask.wpc * ph.cpu_s):
        runs = []
        for _ in range(PROBE_REPEATS):
            c0 = ask.clocks.cpu()
            probe_runner.run(ask.x[:n_probe])
            runs.append(ask.clocks.cpu() - c0)
    probe_runner.close()
    return rows, ask.wpc * max(float(np.median(runs)) / n_probe, 1e-9)


def _predict(ask: _Ask, rows: list[Candidate], per_sample: float) -> tuple[_Prices, float]:
    """Each phase's predicted joules, and what is sure to be spent (+ one batch of the job):
    engines expensive to prepare are priced when they come up (and skipped when the job is too
    small for them or the budget cannot pay: _dominated, _unaffordable)."""
    x, bundle = ask.x, ask.bundle
    todo = [r for r in rows if r.available]
    others = [r for r in todo if r.name != "reference"]
    n_agree = min(len(bundle.calibration()), AGREEMENT_MAX_SAMPLES)
    stored = oracle_answers.applies(bundle) and bundle.has(ORACLE)  # then only a spot check runs
    oracle = per_sample * (SPOT_CHECK_SAMPLES if stored else len(x) + 2 * n_agree + ROUNDING_SEEDS * ROUNDING_SAMPLES)
    hints = {r.name: float(getattr(ask.by_name[r.name], "prepare_cpu_s_hint", 1.0)) for r in todo}
    prepare = {r.name: per_sample * (len(x) + n_agree) + ask.wpc * hints[r.name] for r in todo}
    likely = [r for r in (others or todo) if ask.forced or ask.measure_all or hints[r.name] < EXPENSIVE_PREPARE_S] \
        or (others or todo)
    timing = per_sample * len(x) * (ask.repeats + 1) * len(likely) * ask.threads
    upfront = oracle + sum(prepare[r.name] for r in likely) + timing + per_sample * len(x)
    return _Prices(per_sample, oracle, prepare, timing, hints), upfront


def _prepare_and_check(ask: _Ask, rows: list[Candidate], oracle: Oracle, prices: _Prices,
                       ledger: _Ledger) -> _Prepared:
    """Prepare each candidate and check it against the oracle, cheapest to prepare first; an
    engine expensive to prepare is skipped when dominated or unaffordable. The reference (~25x
    slower, never the winner) is prepared and timed only when nothing else is correct: its
    agreement is already the oracle's."""
    out = _Prepared()
    todo = [r for r in rows if r.available]
    others = [r for r in todo if r.name != "reference"]

    def prepare_and_check(row: Candidate) -> None:
        engine = ask.by_name[row.name]
        assert engine is not None
        with ledger.phase(f"prepare:{row.name}", prices.prepare[row.name]) as ph:
            try:
                c0, w0 = ask.clocks.cpu(), ask.clocks.wall()
                runner = engine.prepare(ask.bundle, threads=ask.threads)
                row.prepare_cpu_s, row.prepare_s = ask.clocks.cpu() - c0, ask.clocks.wall() - w0
                row.prepare_j = row.prepare_cpu_s * ask.wpc
                out.runners[(row.name, ask.threads)] = runner
                c1 = ask.clocks.cpu()
                oracle.check(runner, row)
                out.check_rate[row.name] = (ask.clocks.cpu() - c1) / oracle.images_per_check()
            except Exception as exc:  # one failing engine is a row in the table, not a crash
                row.error = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
                row.correct = False
        row.peak_mb = round(ph.peak_mb, 1) if np.isfinite(ph.peak_mb) else None
        row.threads = ask.threads

    if ask.forced:
        for row in todo:
            prepare_and_check(row)
        return out
    for row in sorted(others, key=lambda r: prices.hints[r.name]):
        hint = prices.hints[row.name]
        why = None if ask.measure_all else (_dominated(row, hint, rows, out.check_rate, ask.images)
                                            or _unaffordable(ask.meter, row.name, hint, prices.prepare[row.name]))
        if why:
            row.reason += f"; not prepared: {why}"
            continue
        prepare_and_check(row)
    ref = _row(todo, "reference")
    if ref is not None and others and any(r.correct for r in others):
        ref.reason += "; not timed: another engine is correct"
    elif ref is not None:
        prepare_and_check(ref)
    return out


def _add_thread_variants(ask: _Ask, rows: list[Candidate], prepared: _Prepared) -> None:
    """Other thread counts of cheaply prepared correct engines (XNNPACK's pool: 1 thread can
    beat 2 on a busy machine, and always costs less CPU)."""
    for row in rows:
        if not (row.correct and (row.name, ask.threads) in prepared.runners and ask.threads > 1
                and (row.prepare_cpu_s or 0) < VARIANT_PREPARE_MAX_S):
            continue
        engine = ask.by_name[row.name]
        assert engine is not None
        for t in range(1, ask.threads):
            try:
                prepared.runners[(row.name, t)] = engine.prepare(ask.bundle, threads=t)
            except Exception as exc:  # keep the thread count that worked
                _log.warning("%s with %d threads: %s", row.name, t, exc)


def _time(ask: _Ask, rows: list[Candidate], prepared: _Prepared, prices: _Prices, ledger: _Ledger) -> None:
    """Time the correct engines (a forced one whatever its verdict) side by side, and fill
    each row's costs at its cheapest thread count."""
    timed = {k: r for k, r in prepared.runners.items() if (c := _row(rows, k[0])) is not None and not c.error
             and (c.correct or ask.forced)}
    spreads: dict[tuple[str, int], float] = {}
    try:
        with ledger.phase("timing", prices.timing):
            seconds = time_rounds(timed, ask.x, repeats=ask.repeats, clocks=ask.clocks, spread=spreads)
    except EdgeAgentError:
        raise
    except Exception as exc:  # a runner that checked fine but fails when timed
        raise EngineUnavailableError(f"timing the int8 engines failed: {type(exc).__name__}: {exc}") from exc
    batch, wpc = ask.batch_size, ask.wpc
    for row in rows:
        mine = {t: v for (n, t), v in seconds.items() if n == row.name}
        if not mine:
            continue
        row.by_threads = {str(t): round(cpu / batch * wpc, 9) for t, (_, cpu) in sorted(mine.items())}
        best = min(mine, key=lambda t: (round(mine[t][1] / batch * wpc, 6), mine[t][0]))
        wall, cpu = mine[best]
        row.threads = best
        row.per_image_spread = spreads.get((row.name, best))
        row.latency_ms, row.images_per_s = wall * 1000.0, batch / wall
        row.per_image_s, row.per_image_cpu_s = wall / batch, cpu / batch
        row.per_image_j = row.per_image_cpu_s * wpc
        row.predicted_j = {str(n): round(predict_job(row, n)[0], 3) for n in PREDICT_IMAGES}


def _decide(ask: _Ask, rows: list[Candidate], prepared: _Prepared) -> Selection:
    """The forced engine (if it may run), else the correct one with the least predicted job
    energy (ties within noise settled by engine_cost.choose); with the notes saying how."""
    images, cap = ask.images, ask.mem_cap_mb
    selection = Selection(None, rows, ask.key, ask.batch_size, forced=bool(ask.forced), images=images,
                          created=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    if ask.forced:
        selection.chosen = _forced_choice(ask, selection, prepared)
    else:
        best_row = choose(rows, images, cap) or choose(rows, images)
        if best_row is None:
            raise EngineUnavailableError("no int8 engine is both available and correct here: " + "; ".join(
                f"{c.name}: {c.error or c.reason}" + (f" ({disagreement(c)})" if c.correct is False and not c.error else "")
                for c in rows))
        if cap is not None and choose(rows, images, cap) is None:
            selection.notes.append(f"no correct engine fits the {cap:g} MB memory cap; cheapest used")
        selection.chosen = best_row.name
        note = choice_margin_note(rows, images, best_row.name, cap) or choice_margin_note(rows, images, best_row.name)
        if note:
            selection.notes.append(note)
        selection.chosen_for = {str(n): (choose(rows, n, cap) or best_row).name for n in PREDICT_IMAGES}
    chosen_row = selection.candidate(selection.chosen)
    if chosen_row is not None:  # how the chosen engine was judged, in the job's report too
        selection.notes.extend(evidence_notes(chosen_row))
    selection.threads = chosen_row.threads if chosen_row is not None and chosen_row.threads else ask.threads
    for row in rows:
        row.chosen = row.name == selection.chosen
    return selection


def _forced_choice(ask: _Ask, selection: Selection, prepared: _Prepared) -> str:
    """The forced engine, if it runs and agrees (or --force-engine says to run it anyway)."""
    forced = ask.forced
    assert forced is not None
    row = selection.candidate(forced)
    if row is None or (forced, ask.threads) not in prepared.runners or row.error:
        why = (row.error or row.reason) if row else "not loaded"
        raise EngineUnavailableError(f"{ENV_FORCE_BACKEND}={forced}: engine cannot run this model: {why}")
    if not row.correct:
        what = disagreement(row)
        if ask.env.get(ENV_FORCE_WRONG, "").strip() not in ("1", "true", "yes"):
            raise EngineUnavailableError(
                f"{ENV_FORCE_BACKEND}={forced}: the engine disagrees with the reference on this model "
                f"({what}), so it is not run; --force-engine ({ENV_FORCE_WRONG}=1) runs it anyway")
        note = f"forced engine {forced} disagrees with the reference ({what}); used anyway ({ENV_FORCE_WRONG}=1)"
        _log.warning("%s", note)
        selection.notes.append(note)
    return forced


def _record(ask: _Ask, selection: Selection, prepared: _Prepared, *, keep_runner: bool
            ) -> tuple[Selection, Runner | None]:
    """What this device would share (a measured, unforced choice), the cache, and the chosen
    runner kept (with `keep_runner`); every other runner closed."""
    chosen_row = selection.candidate(selection.chosen) if selection.chosen else None
    chosen_runner = prepared.runners.get((selection.chosen, selection.threads)) if selection.chosen else None
    if not ask.forced and chosen_runner is not None and chosen_row is not None and chosen_row.latency_ms:
        selection.share = SharedChoice(kind_of(ask.key), chosen_row.name, selection.threads, ask.batch_size,
                                       chosen_row.latency_ms, chosen_row.per_image_cpu_s or 1e-9,
                                       output_fingerprint(chosen_runner, ask.bundle.calibration())).to_json()
    if not ask.forced and ask.path is not None:
        atomic_write_json(ask.path, selection.to_json())
        selection.cache_file = str(ask.path)
    keep = prepared.runners.pop((selection.chosen, selection.threads), None) if keep_runner and selection.chosen else None
    for runner in prepared.runners.values():
        runner.close()
    return selection, keep


def _dominated(row: Candidate, hint_s: float, rows: list[Candidate], check_rate: Mapping[str, float],
               images: int) -> str | None:
    """Why an engine expensive to prepare need not be prepared for a job of `images` images
    (see EXPENSIVE_PREPARE_S), or None. CPU-seconds on both sides: the same watts multiply them."""
    if hint_s < EXPENSIVE_PREPARE_S:
        return None
    jobs = [((r.prepare_cpu_s or 0.0) + images * check_rate[r.name], r.name)
            for r in rows if r.correct and r.name in check_rate]
    if not jobs:
        return None
    best_s, best = min(jobs)
    low = hint_s * PREPARE_HINT_LOW
    if low <= best_s:
        return None
    return (f"its prepare alone (~{low:.2g} CPU-s or more) costs more than a {images:,}-image job on {best} "
            f"(~{best_s:.2g} CPU-s)")


def _unaffordable(meter: Meter, name: str, hint_s: float, predicted_j: float) -> str | None:
    """Why an engine expensive to prepare is skipped because the job's budget cannot pay for
    it (the meter refuses its prepare), or None: a cheaper engine was checked already."""
    if hint_s < EXPENSIVE_PREPARE_S:
        return None
    try:
        meter.before(f"prepare:{name}", predicted_j)
    except SelectionStopped:
        return f"the job's energy budget cannot pay for its prepare (~{predicted_j:.3g} J predicted)"
    return None


def _adopt_shared(choice: SharedChoice, bundle: Any, by_name: Mapping[str, Int8Engine | None], probe: dict[str, Any],
                  key: dict[str, Any], x: np.ndarray, path: Path | None, *, images: int, meter: Meter, wpc: float,
                  keep_runner: bool, clocks: Clocks) -> tuple[Selection, Runner | None] | str:
    """A device of this kind measured `choice`: take it if this device's engine gives the same
    outputs (the fingerprint) at about the same speed (recheck). Returns the selection, or why
    not (then every engine is measured)."""
    engine = by_name.get(choice.engine)
    if engine is None:
        return f"{choice.engine} is not a candidate here"
    if not _still_available(engine, probe):
        return f"{choice.engine} is not available here"
    runs = FINGERPRINT_SAMPLES + (RECHECK_BATCHES + 1) * len(x)
    predicted = wpc * (choice.per_image_cpu_s * runs + float(getattr(engine, "prepare_cpu_s_hint", 1.0)))
    runner: Runner | None = None
    why = ""
    with measured(meter, "shared-recheck", predicted, clocks=clocks) as ph:
        try:
            c0 = clocks.cpu()
            runner = engine.prepare(bundle, threads=choice.threads)
            prepare_cpu_s = clocks.cpu() - c0
            if output_fingerprint(runner, bundle.calibration()) != choice.fingerprint:
                why = "its outputs here differ from the measuring device's"
            else:
                good, now = recheck(runner, x, choice.latency_ms / 1000.0, clocks=clocks)
                if not good:
                    why = f"{now * 1e3:.1f} ms per batch here, {choice.latency_ms:.1f} where it was measured"
        except Exception as exc:  # a shared choice that fails here is measured, not fatal
            why = f"{type(exc).__name__}: {str(exc).strip()[:200]}"
    if why:
        if runner is not None:
            runner.close()
        return why
    assert runner is not None
    row = Candidate(choice.engine, True, f"the fleet's choice for this kind of device, re-checked here: same outputs, "
                    f"{now * 1e3:.1f} ms per batch ({choice.latency_ms:.1f} where measured)", correct=True,
                    basis="fleet", threads=choice.threads, latency_ms=now * 1e3, images_per_s=len(x) / now,
                    per_image_s=now / len(x), per_image_cpu_s=choice.per_image_cpu_s,
                    per_image_j=choice.per_image_cpu_s * wpc, prepare_cpu_s=prepare_cpu_s,
                    prepare_j=prepare_cpu_s * wpc, chosen=True)
    row.predicted_j = {str(n): round(predict_job(row, n)[0], 3) for n in PREDICT_IMAGES}
    selection = Selection(choice.engine, [row], key, len(x), images=images, threads=choice.threads,
                          created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), energy_j=ph.joules, source="fleet",
                          share=choice.to_json(), chosen_for={str(n): choice.engine for n in PREDICT_IMAGES})
    selection.notes.append(f"int8 engine {choice.engine} ({choice.threads} thread(s)) as measured by a device of this "
                           f"kind; re-checked here in {ph.cpu_s:.2f} CPU-s instead of measuring every engine")
    if path is not None:
        atomic_write_json(path, selection.to_json())
        selection.cache_file = str(path)
    if keep_runner:
        return selection, runner
    runner.close()
    return selection, None


def _use_cached(cached: Selection, bundle: Any, by_name: Mapping[str, Int8Engine | None], probe: dict[str, Any], *,
                images: int, mem_cap_mb: float | None, keep_runner: bool,
                recheck_cached: bool, clocks: Clocks) -> tuple[Selection, Runner | None] | None:
    """The cached rows, re-chosen for this job's size; with `recheck_cached` the choice is
    re-timed on a few batches first: RECHECK_FACTOR slower on several threads falls back to
    one thread; on one thread the choice is kept (load slows every engine alike, and the
    cached features belong to this engine). None: select again."""
    best = choose(cached.candidates, images, mem_cap_mb) or choose(cached.candidates, images)
    if best is None:
        return None
    engine = by_name.get(best.name)
    if engine is None or not _still_available(engine, probe):
        return None
    t = best.threads or cached.key.get("threads") or 1
    cached.images, cached.chosen, cached.threads = images, best.name, t
    cached.notes.extend(evidence_notes(best))
    note = choice_margin_note(cached.candidates, images, best.name, mem_cap_mb) or \
        choice_margin_note(cached.candidates, images, best.name)
    if note:
        cached.notes.append(note)
    for row in cached.candidates:
        row.chosen = row.name == best.name
    if not keep_runner and not recheck_cached:
        return cached, None
    try:
        runner = engine.prepare(bundle, threads=t)
    except Exception as exc:  # it worked when cached; re-select rather than fail
        _log.warning("cached int8 engine %s failed to prepare (%s); selecting again", best.name, exc)
        return None
    if recheck_cached and best.latency_ms:
        x = check_batch_for(bundle, cached.batch_size)
        good, now = recheck(runner, x, best.latency_ms / 1000.0, clocks=clocks)
        if not good and t > 1:  # contention: a spinning pool on shared cores; try one thread
            one = engine.prepare(bundle, threads=1)
            good1, now1 = recheck(one, x, best.latency_ms / 1000.0 * t, clocks=clocks)
            if good1 or now1 < now:
                runner.close()
                runner, now, good = one, now1, True
                cached.threads = 1
                cached.notes.append(f"{best.name}: slower than measured with {t} threads (contention?): using 1 "
                                    f"thread ({now1 * 1e3:.1f} ms/batch)")
            else:
                one.close()
        if not good:
            # one thread and still slow: the whole machine is busy, which slows every engine
            # alike; another selection would cost energy and change the features' engine
            cached.notes.append(f"{best.name}: {now * 1e3:.1f} ms/batch now, {best.latency_ms:.1f} when measured "
                                "(a busy machine); kept")
    if not keep_runner:
        runner.close()
        return cached, None
    return cached, runner


def _still_available(engine: Int8Engine, probe: dict[str, Any]) -> bool:
    try:
        return bool(engine.availability(probe).available)
    except Exception:  # treat a failing probe as "gone": re-select
        return False


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
