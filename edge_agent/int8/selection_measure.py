"""Measuring the engines on this device: the steps `select_engine` runs when neither a
cached nor a fleet-shared choice can be used.

    probe (availability, the reference's price per sample) -> predict (the budget may refuse)
    -> the oracle -> prepare and check (cheapest first, dominated ones skipped) -> thread
    variants -> time the correct ones -> decide -> record (cache, what to share)

Under a memory cap (the profile's training memory_cap_mb) no candidate is prepared whose
predicted memory (engine_memory.py) would take the process over it, and the oracle runs
fewer samples at a time when a whole chunk would not fit.

`kernels --bench` (`measure_all`, no forced engine) measures the engines one at a time:
each is prepared, checked, timed (its thread variants side by side) and closed before the
next is prepared, so the process holds one engine, never all of them: a ResNet-50 at 224
held tflite and native together, 1.7 GB at batch 32. A job's selection keeps timing the
correct engines side by side (interleaved rounds, fairer on a busy machine), the runs of an
engine's agreement check at the job's batch size counted as its first rounds.

Each step is a function over one `Ask` (the inputs, never written by a step) and a
`_Ledger` (the joules each metered phase cost); `measure` runs them in order.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic import atomic_write_json
from ..errors import EdgeAgentError
from ..heap import release_freed_memory
from . import engines as registry
from .agreement import (
    ORACLE_CHUNK,
    ROUNDING_SAMPLES,
    ROUNDING_SEEDS,
    Oracle,
    check_batch_for,
    disagreement,
    evidence_notes,
)
from .bundle import ORACLE
from .engine import ENV_FORCE_BACKEND, ENV_FORCE_WRONG, Int8Engine, Runner
from .engine_cost import (
    AGREEMENT_MAX_SAMPLES,
    RACE_MIN_ROUNDS,
    Clocks,
    EngineUnavailableError,
    Meter,
    TimedRuns,
    choice_margin_note,
    choose,
    measured,
    predict_job,
    rss_mb,
    time_rounds,
)
from .engine_memory import PrefixShape, engine_mb, oracle_chunk, over_cap, prefix_shape
from .oracle_answers import SPOT_CHECK_SAMPLES
from .selection_cache import Candidate, Selection
from .selection_worth import EXPENSIVE_PREPARE_S, dominated, unaffordable
from .shared_choice import FINGERPRINT_SAMPLES, SharedChoice, kind_of, output_fingerprint

_log = logging.getLogger(__name__)

PROBE_SAMPLES = 4  # priced after a warm-up call: one cold image cost ~200x a warm one
PROBE_REPEATS = 3  # runs of PROBE_SAMPLES images whose least CPU time prices a sample
# What the first probe phase (engine availability, the bundle's graph, one cold reference
# image) is predicted to cost before anything is measured: ~0.08 CPU-s for the demo bundle on
# a Zen 2 core and several times that on a Cortex-A72, so a budget below it is refused
# before it is spent instead of overrun by the probe
PROBE_PREDICT_CPU_S = 0.5
VARIANT_PREPARE_MAX_S = 2.0  # other thread counts are tried for engines this cheap to prepare
PREDICT_IMAGES = (100, 1000, 10000)


def _row(rows: list[Candidate], name: str) -> Candidate | None:
    return next((c for c in rows if c.name == name), None)


def load_engines(names: list[str]) -> list[tuple[str, Int8Engine | None]]:
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
    for name, engine in engines if engines is not None else load_engines(registry.candidates(preference)):
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
class Ask:
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
    def calibration(self) -> np.ndarray:
        """The bundle's calibration samples, read and decoded once per selection (~0.07 CPU-s
        each time on the camera bundle, and every step wants them); `measure` lets go of them
        before the engines are timed."""
        return self.bundle.calibration()

    @functools.cached_property
    def x(self) -> np.ndarray:
        """The check batch: the bundle's first calibration samples at the job's batch size
        (read only when something is measured: a cached choice needs none)."""
        return check_batch_for(self.bundle, self.batch_size, self.calibration)


class _Ledger:
    """The joules each metered phase cost (the meter may refuse a phase before it starts)."""

    def __init__(self, ask: Ask) -> None:
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
    notes: list[str] = field(default_factory=list)  # what the memory cap changed, for Selection.notes
    measured: set[str] = field(default_factory=set)  # engines prepared (kernels --bench closes each after)
    # each runner's agreement-check runs at the job's batch size (engine_cost.TimedRuns): its
    # first timing rounds, not run again (a digits first job's 2-thread runners: ~0.15 CPU-s)
    check_rounds: dict[tuple[str, int], list[tuple[float, float]]] = field(default_factory=dict)


def measure(ask: Ask, *, keep_runner: bool) -> tuple[Selection, Runner | None]:
    """Every step, in order (module doc)."""
    ledger = _Ledger(ask)
    rows, per_sample, graph = _probe(ask, ledger)
    shape = prefix_shape(ask.bundle, graph)
    prices, upfront = _predict(ask, rows, per_sample)
    ask.meter.before("selection", upfront)
    now = rss_mb()
    chunk = oracle_chunk(shape, None if ask.mem_cap_mb is None or now is None else ask.mem_cap_mb - now)
    with ledger.phase("agreement", prices.oracle):
        oracle = Oracle(ask.bundle, ask.x, logits=ask.logits, chunk=chunk, graph=graph, calibration=ask.calibration)
        if oracle.q is not None:  # every check reads it: paid here, not by the first engine's check
            oracle.rounding_sensitivity()
    release_freed_memory()  # the oracle's chunks: glibc kept up to 30 MB of them, which the engines' checks would sit on
    one_at_a_time = ask.measure_all and not ask.forced
    fingerprints: dict[str, str] = {}
    after = None
    if one_at_a_time:
        early_x = np.ascontiguousarray(oracle.samples[:FINGERPRINT_SAMPLES])
        n_timed = max(1, sum(r.available for r in rows))
        each = _Prices(prices.per_sample, prices.oracle, prices.prepare, prices.timing / n_timed, prices.hints)

        def after(row: Candidate, prepared: _Prepared) -> None:
            _measure_alone(ask, row, prepared, shape, each, ledger, early_x, fingerprints)
    prepared = _prepare_and_check(ask, rows, oracle, prices, ledger, shape, after=after)
    # the oracle's graphs, answers and calibration copy are done with: not held while the
    # engines are timed (14 MB of samples alone on the camera MobileNetV2); the fingerprint
    # (_record) reads the first calibration samples from what it keeps of them
    fingerprint_x = np.ascontiguousarray(oracle.samples[:FINGERPRINT_SAMPLES])
    del oracle, ask.calibration
    release_freed_memory()
    if chunk < ORACLE_CHUNK and ask.mem_cap_mb is not None:
        prepared.notes.insert(0, f"the oracle ran {chunk} samples at a time (not {ORACLE_CHUNK}) to stay under "
                                 f"the {ask.mem_cap_mb:g} MB training memory cap")
    if not one_at_a_time:
        _add_thread_variants(ask, rows, prepared, shape)
        _time(ask, rows, prepared, prices, ledger)
    selection = _decide(ask, rows, prepared)
    selection.energy_j = ledger.spent
    return _record(ask, selection, prepared, fingerprint_x, keep_runner=keep_runner,
                   fingerprints=fingerprints if one_at_a_time else None)


def _measure_alone(ask: Ask, row: Candidate, prepared: _Prepared, shape: PrefixShape, prices: _Prices,
                   ledger: _Ledger, fingerprint_x: np.ndarray, fingerprints: dict[str, str]) -> None:
    """`kernels --bench`: the engine just prepared and checked is timed (if correct) and
    closed, then each of its thread variants prepared, timed and closed in turn (while it
    fits under the cap), its output fingerprint (what _record shares) taken at each; the
    heap is trimmed after each, so the next is prepared in a process holding none."""
    runner = prepared.runners.pop((row.name, ask.threads), None)
    if runner is None:
        return
    if row.error or not row.correct:  # nothing to time: its check row says why
        runner.close()
        release_freed_memory()
        return
    seconds: dict[tuple[str, int], tuple[float, float]] = {}
    spreads: dict[tuple[str, int], float] = {}
    prints: dict[int, str] = {}
    engine = ask.by_name[row.name]
    assert engine is not None
    variants = (ask.threads > 1 and (row.prepare_cpu_s or 0) < VARIANT_PREPARE_MAX_S)
    for t in [ask.threads, *(range(ask.threads - 1, 0, -1) if variants else [])]:
        try:
            if runner is None:  # a thread variant, prepared once the one before is closed
                need = engine_mb(engine, shape, ask.batch_size, threads=t, runtime_loaded=True)
                why = over_cap(row.name, need, rss_mb(), ask.mem_cap_mb)
                if why:
                    _log.info("no %d-thread variant: %s", t, why)
                    break
                try:
                    runner = engine.prepare(ask.bundle, threads=t)
                except Exception as exc:  # keep the thread counts that worked
                    _log.warning("%s with %d threads: %s", row.name, t, exc)
                    break
            try:
                with ledger.phase("timing", prices.timing):
                    seconds.update(time_rounds({(row.name, t): runner}, ask.x, repeats=ask.repeats,
                                               clocks=ask.clocks, spread=spreads))
                prints[t] = output_fingerprint(runner, fingerprint_x)
            except EdgeAgentError:
                raise
            except Exception as exc:  # a runner that checked fine but fails when timed
                raise EngineUnavailableError(f"timing {row.name} failed: {type(exc).__name__}: {exc}") from exc
        finally:
            if runner is not None:
                runner.close()
            runner = None
            release_freed_memory()
    if seconds:
        _fill_costs(ask, [row], seconds, spreads)
        if row.threads in prints:
            fingerprints[row.name] = prints[row.threads]


def _probe(ask: Ask, ledger: _Ledger) -> tuple[list[Candidate], float, Any]:
    """Which engines can run here, and the reference's price per sample (joules), so that a
    budget too small for the selection is refused before it is spent (0.0 when the meter
    refuses nothing: no budget); and the bundle's graph as the reference parsed it (the
    oracle's, and what the memory is predicted from)."""
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
        if not ask.meter.refuses:  # no budget: no price could refuse anything, so none is paid for
            probe_runner.close()   # (13 reference images, ~0.35 CPU-s of a digits first job at depth 4)
            return rows, 0.0, getattr(probe_runner, "graph", None)
        probe_runner.run(ask.x[:1])
    n_probe = min(len(ask.x), PROBE_SAMPLES)
    # ... so the per-sample price comes from the runs after it: CPU-seconds (the least of
    # PROBE_REPEATS runs) x watts per CPU. Not the meter's joules: a power source read around a
    # few milliseconds (a sensor, or /proc/stat's 10 ms jiffies with every process's load in
    # them) predicted 0.0013-0.42 Wh for a selection that cost ~0.005 Wh. Not their median
    # either: a run of a few milliseconds on a core other processes share comes back from
    # preemption to cold caches, and a CI run under CPU hogs priced a fresh job's selection
    # 42 % above the one before it (the budget that one named was refused). The phase itself
    # is predicted at the cold image's CPU time, which buys ~200 warm ones.
    with ledger.phase("probe", ask.wpc * ph.cpu_s):
        runs = []
        for _ in range(PROBE_REPEATS):
            c0 = ask.clocks.cpu()
            probe_runner.run(ask.x[:n_probe])
            runs.append(ask.clocks.cpu() - c0)
    probe_runner.close()
    return rows, ask.wpc * max(min(runs) / n_probe, 1e-9), getattr(probe_runner, "graph", None)


def _predict(ask: Ask, rows: list[Candidate], per_sample: float) -> tuple[_Prices, float]:
    """Each phase's predicted joules, and what is sure to be spent (+ one batch of the job):
    engines expensive to prepare are priced when they come up (and skipped when the job is too
    small for them or the budget cannot pay: selection_worth)."""
    x, bundle = ask.x, ask.bundle
    todo = [r for r in rows if r.available]
    others = [r for r in todo if r.name != "reference"]
    n_agree = min(len(ask.calibration), AGREEMENT_MAX_SAMPLES)
    stored = bundle.has(ORACLE)  # then only a spot check runs (oracle_answers.load may still refuse them)
    oracle = per_sample * (SPOT_CHECK_SAMPLES if stored else len(x) + 2 * n_agree + ROUNDING_SEEDS * ROUNDING_SAMPLES)
    hints = {r.name: float(getattr(ask.by_name[r.name], "prepare_cpu_s_hint", 1.0)) for r in todo}
    prepare = {r.name: per_sample * (len(x) + n_agree) + ask.wpc * hints[r.name] for r in todo}
    likely = [r for r in (others or todo) if ask.forced or ask.measure_all or hints[r.name] < EXPENSIVE_PREPARE_S] \
        or (others or todo)
    timing = per_sample * len(x) * (ask.repeats + 1) * len(likely) * ask.threads
    upfront = oracle + sum(prepare[r.name] for r in likely) + timing + per_sample * len(x)
    return _Prices(per_sample, oracle, prepare, timing, hints), upfront


def _prepare_and_check(ask: Ask, rows: list[Candidate], oracle: Oracle, prices: _Prices,
                       ledger: _Ledger, shape: PrefixShape,
                       after: Callable[[Candidate, _Prepared], None] | None = None) -> _Prepared:
    """Prepare each candidate and check it against the oracle, cheapest to prepare first; an
    engine whose predicted memory would take the process over the cap is skipped, and one
    expensive to prepare when dominated or unaffordable. The reference (~25x slower, never the
    winner) is prepared and timed only when nothing else is correct: its agreement is already
    the oracle's. `after(row, prepared)`, if given, runs after each engine's check (kernels
    --bench: time it and close it, _measure_alone)."""
    out = _Prepared()
    todo = [r for r in rows if r.available]
    others = [r for r in todo if r.name != "reference"]
    refused: dict[str, tuple[Candidate, str]] = {}  # over the memory cap

    def need(row: Candidate) -> float:  # the probe checked its availability: the runtime is loaded
        return engine_mb(ask.by_name[row.name], shape, max(ask.batch_size, oracle.chunk), threads=ask.threads,
                         runtime_loaded=True)

    def too_big(row: Candidate) -> bool:
        why = over_cap(row.name, need(row), rss_mb(), ask.mem_cap_mb)
        if why:
            refused[row.name] = (row, why)
        return why is not None

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
                out.measured.add(row.name)
                c1 = ask.clocks.cpu()
                timed = TimedRuns(runner, len(ask.x), ask.clocks)
                oracle.check(timed, row)
                out.check_rate[row.name] = (ask.clocks.cpu() - c1) / oracle.images_per_check()
                if len(timed.rounds()) >= RACE_MIN_ROUNDS:
                    out.check_rounds[(row.name, ask.threads)] = timed.rounds()
            except Exception as exc:  # one failing engine is a row in the table, not a crash
                row.error = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
                row.correct = False
        row.peak_mb = round(ph.peak_mb, 1) if np.isfinite(ph.peak_mb) else None
        row.threads = ask.threads
        if after is not None:
            after(row, out)

    if ask.forced:
        for row in todo:
            if not too_big(row):
                prepare_and_check(row)
        return _over_the_cap(ask, out, refused, need, prepare_and_check)
    for row in sorted(others, key=lambda r: prices.hints[r.name]):
        if too_big(row):
            continue
        hint = prices.hints[row.name]
        why = None if ask.measure_all else (dominated(row, hint, rows, out.check_rate, ask.images)
                                            or unaffordable(ask.meter, row.name, hint, prices.prepare[row.name]))
        if why:
            row.reason += f"; not prepared: {why}"
            continue
        prepare_and_check(row)
    ref = _row(todo, "reference")
    if ref is not None and others and any(r.correct for r in others):
        ref.reason += "; not timed: another engine is correct"
    elif ref is not None and not too_big(ref):
        prepare_and_check(ref)
    return _over_the_cap(ask, out, refused, need, prepare_and_check)


def _over_the_cap(ask: Ask, out: _Prepared, refused: dict[str, tuple[Candidate, str]],
                  need: Callable[[Candidate], float], prepare_and_check: Callable[[Candidate], None]) -> _Prepared:
    """The candidates left out for the memory cap, said in their rows and the notes; when that
    left nothing prepared, the lightest is prepared all the same (the job needs an engine; the
    depth planner had already found that no depth fits), and the notes say so."""
    lightest = min((row for row, _ in refused.values()), key=need) if refused and not out.measured else None
    for row, why in refused.values():
        if row is not lightest:
            row.reason += f"; not prepared: {why}"
            out.notes.append(f"not prepared: {why}")
    if lightest is not None:
        note = (f"{lightest.name} prepared over the {ask.mem_cap_mb:g} MB training memory cap (~{need(lightest):.0f} MB "
                "predicted): no candidate fits under it, and it is the lightest")
        lightest.reason += f"; {note}"
        out.notes.append(note)
        prepare_and_check(lightest)
    return out


def _add_thread_variants(ask: Ask, rows: list[Candidate], prepared: _Prepared, shape: PrefixShape) -> None:
    """Other thread counts of cheaply prepared correct engines (XNNPACK's pool: 1 thread can
    beat 2 on a busy machine, and always costs less CPU), while they fit under the memory cap."""
    pending = 0.0  # what the variants prepared so far will take when timing first runs them
    for row in rows:
        if not (row.correct and (row.name, ask.threads) in prepared.runners and ask.threads > 1
                and (row.prepare_cpu_s or 0) < VARIANT_PREPARE_MAX_S):
            continue
        engine = ask.by_name[row.name]
        assert engine is not None
        for t in range(1, ask.threads):
            need = engine_mb(engine, shape, ask.batch_size, threads=t, runtime_loaded=True)
            now = rss_mb()
            why = over_cap(row.name, need, None if now is None else now + pending, ask.mem_cap_mb)
            if why:  # an option, not a candidate: the thread count already prepared is timed
                _log.info("no %d-thread variant: %s", t, why)
                break
            try:
                prepared.runners[(row.name, t)] = engine.prepare(ask.bundle, threads=t)
                pending += need
            except Exception as exc:  # keep the thread count that worked
                _log.warning("%s with %d threads: %s", row.name, t, exc)


def _time(ask: Ask, rows: list[Candidate], prepared: _Prepared, prices: _Prices, ledger: _Ledger) -> None:
    """Time the correct engines (a forced one whatever its verdict) side by side, and fill
    each row's costs at its cheapest thread count."""
    timed = {k: r for k, r in prepared.runners.items() if (c := _row(rows, k[0])) is not None and not c.error
             and (c.correct or ask.forced)}
    spreads: dict[tuple[str, int], float] = {}
    try:
        with ledger.phase("timing", prices.timing):
            seconds = time_rounds(timed, ask.x, repeats=ask.repeats, clocks=ask.clocks, spread=spreads,
                                  earlier={k: prepared.check_rounds[k] for k in timed if k in prepared.check_rounds})
    except EdgeAgentError:
        raise
    except Exception as exc:  # a runner that checked fine but fails when timed
        raise EngineUnavailableError(f"timing the int8 engines failed: {type(exc).__name__}: {exc}") from exc
    _fill_costs(ask, rows, seconds, spreads)


def _fill_costs(ask: Ask, rows: list[Candidate], seconds: Mapping[tuple[str, int], tuple[float, float]],
                spreads: Mapping[tuple[str, int], float]) -> None:
    """Each timed row's costs at its cheapest thread count."""
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


def _decide(ask: Ask, rows: list[Candidate], prepared: _Prepared) -> Selection:
    """The forced engine (if it may run), else the correct one with the least predicted job
    energy (ties within noise settled by engine_cost.choose); with the notes saying how."""
    images, cap = ask.images, ask.mem_cap_mb
    selection = Selection(None, rows, ask.key, ask.batch_size, forced=bool(ask.forced), images=images,
                          created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), notes=list(prepared.notes))
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


def _forced_choice(ask: Ask, selection: Selection, prepared: _Prepared) -> str:
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


def _record(ask: Ask, selection: Selection, prepared: _Prepared, calibration: np.ndarray, *, keep_runner: bool,
            fingerprints: Mapping[str, str] | None = None) -> tuple[Selection, Runner | None]:
    """What this device would share (a measured, unforced choice; `calibration`: at least the
    bundle's first FINGERPRINT_SAMPLES calibration samples), the cache, and the chosen runner
    kept (with `keep_runner`); every other runner closed. `fingerprints`: the engines were
    measured one at a time and closed (_measure_alone), each correct one's fingerprint taken
    then; a kept runner is prepared again."""
    chosen_row = selection.candidate(selection.chosen) if selection.chosen else None
    chosen_runner = prepared.runners.get((selection.chosen, selection.threads)) if selection.chosen else None
    fingerprint = (fingerprints.get(selection.chosen or "") if fingerprints is not None else
                   output_fingerprint(chosen_runner, calibration) if chosen_runner is not None else None)
    if not ask.forced and fingerprint and chosen_row is not None and chosen_row.latency_ms:
        selection.share = SharedChoice(kind_of(ask.key), chosen_row.name, selection.threads, ask.batch_size,
                                       chosen_row.latency_ms, chosen_row.per_image_cpu_s or 1e-9,
                                       fingerprint).to_json()
    if not ask.forced and ask.path is not None:
        atomic_write_json(ask.path, selection.to_json())
        selection.cache_file = str(ask.path)
    keep = prepared.runners.pop((selection.chosen, selection.threads), None) if keep_runner and selection.chosen else None
    if keep is None and keep_runner and selection.chosen and fingerprints is not None:
        engine = ask.by_name.get(selection.chosen)
        keep = engine.prepare(ask.bundle, threads=selection.threads) if engine is not None else None
    for runner in prepared.runners.values():
        runner.close()
    return selection, keep
