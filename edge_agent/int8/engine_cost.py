"""What an int8 engine costs a job and whether it answers the task as well as the reference.

Selection (selection.py) chooses the engine that minimises a job's predicted energy:

    job J = prepare J + images x per-image J        (per engine and thread count)

measured on this device: prepare = CPU-seconds of `engine.prepare` (imports included: a
first MXNet import is most of mxnet-onednn's), per image = CPU-seconds of a batch at the
job's batch size / batch size (median of interleaved rounds), peak memory = the growth of
the process's peak RSS over prepare and runs. Energy is CPU-seconds x `watts_per_cpu`
(the board profile's (load_w - idle_w) / cores: what one busy core adds above idle), or
the governor's metered joules inside a job. CPU-seconds, not wall seconds: a spinning
thread pool burns energy without shortening the batch.

Correct means task-level agreement (see `agreement_verdict`): the engine's top-1 through
the bundle's head agrees with the fp32 model on the bundle's calibration samples no less
than the bit-exact reference does, minus AGREEMENT_SLACK. Unit-level distance to the
reference stays a diagnostic; a loose sanity bound (SANITY_MEAN_STEPS) still refuses
features off by tens of steps on average (layout, scale or weight bugs).
"""

from __future__ import annotations

import contextlib
import math
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np

from ..errors import EXIT_UNAVAILABLE, EdgeAgentError, UsageError
from .engine import Runner

# An engine may agree with fp32 on this many fewer samples, as a fraction, than the
# reference (0.5 points, the figure), but always on one sample fewer: with the
# 32-256 samples a bundle carries, one sample is 0.4-3 points. Measured (bench_engine_cost,
# camera MobileNetV2 0.5@96, 128 samples; the reference agrees with fp32 on 97.7 %):
# tflite/XNNPACK 98.4 % (14 int8 units off the reference at most), native 97.7 %
# (bit-exact) -- accepted; mxnet-onednn 89.1 % (naive calibration; 84.4 % with entropy) --
# refused: 11 more samples flip, a real loss, not rounding.
AGREEMENT_SLACK = 0.005
AGREEMENT_MIN_SAMPLES = 32
AGREEMENT_MAX_SAMPLES = 256
# Mean |engine - reference| over all features, in output quantisation steps: a gross-bug
# bound only (a transposed layout or a wrong scale is tens of steps and more). Measured on
# the camera bundle: tflite 1.4, native 0, mxnet-onednn (its own calibration) 6.3.
SANITY_MEAN_STEPS = 10.0
# Two candidates whose predicted job energies are closer than this (relative to the dearer)
# are a tie: the evidence does not separate them, and a static order decides (see `choose`).
# The half-IQR of one engine's 3 timed rounds (`relative_spread`) was 0.1-16 % at one thread
# on this 2-core VM under CI load (tflite <= 14 %, native <= 16 %; 2-thread rows, whose pool
# threads share the vCPUs, up to 43 %): 12 % covers a typical round's noise, and a row's own
# larger spread widens it (`noise_margin`). It stays below the differences that matter: on
# the camera MobileNetV2 (bench_engine_cost) native costs 7.7 mJ/image, tflite 11.8 (35 %
# more), mxnet-onednn 17.2, and those stay decided.
NOISE_FLOOR = 0.12
# ... and jobs whose CPU-seconds differ by less than this are a tie whatever the ratio: a
# prepare is timed once, and between selections of the demo bundle (digits CNN, 1,000
# images, 12-38 ms of CPU per engine) tflite's prepare took 2.6-18 ms of CPU and native's
# per image 11-33 us, so the two jobs differed by up to 25 ms either way (60 selections on
# this 2-core VM with CI load; the old rule chose tflite in 9 of 40, native in the rest, and
# tflite in 40 of 40 under `taskset -c 0`). CPU-seconds, not joules: the noise is CPU time,
# whatever the profile's watts; 50 ms of one core is 0.1 J at 2 W, 1.3e-4 Wh at the x86
# profile's 9.5 W: nothing a device should choose an engine by.
NOISE_FLOOR_CPU_S = 0.05
# Rounds every timed runner gets before the race may leave it out (time_rounds): three give
# relative_spread its quartiles, and the median a round's hiccup cannot move alone.
RACE_MIN_ROUNDS = 3
# Memory is compared in buckets: RSS growth moves by a few MB between runs (allocator, imports).
MEMORY_BUCKET_MB = 16.0
# The interface's default prepare hint (Int8Engine.prepare_cpu_s_hint), for a name no
# registered engine has (a test's fake engine).
DEFAULT_PREPARE_HINT = 1.0
DEFAULT_WATTS_PER_CPU = 2.0  # no profile: a typical small-board core above idle
RECHECK_BATCHES = 3
# A cached choice is re-timed at job start; slower than this factor x its cached batch time
# (contention: another process on the cores XNNPACK's pool spins on) means fall back.
RECHECK_FACTOR = 2.0


class BudgetTooSmallError(EdgeAgentError):
    """The energy budget cannot pay for engine selection plus one training step."""

    exit_code = UsageError.exit_code


class EngineUnavailableError(EdgeAgentError):
    """No engine (or not the forced one) can run this model here."""

    exit_code = EXIT_UNAVAILABLE


class SelectionStopped(EdgeAgentError):
    """The governor stopped the job while the engine was being selected."""


@dataclass(frozen=True)
class Clocks:
    """Where selection reads time: wall seconds (latency, the re-check's contention test) and
    this process's CPU seconds (energy). Tests pass virtual ones, so that no verdict of theirs
    depends on how busy the machine is."""

    wall: Callable[[], float] = time.perf_counter
    cpu: Callable[[], float] = time.process_time


SYSTEM_CLOCKS = Clocks()


@dataclass
class Phase:
    cpu_s: float
    wall_s: float
    joules: float
    peak_mb: float


class Meter(Protocol):
    """Selection's energy meter: `before(phase, predicted_j)` may refuse (raise), `after`
    returns the phase's joules. The job's meter is the budget governor. `refuses`: whether
    `before` can refuse at all (a budget is set); selection prices its phases only then."""

    @property
    def refuses(self) -> bool: ...

    def before(self, phase: str, predicted_j: float) -> None: ...

    def after(self, phase: str, cpu_s: float) -> float: ...


class CpuMeter:
    """Joules = CPU-seconds x watts_per_cpu; never refuses (`kernels --bench`)."""

    refuses = False

    def __init__(self, watts_per_cpu: float = DEFAULT_WATTS_PER_CPU) -> None:
        self.watts_per_cpu = watts_per_cpu
        self.total_j = 0.0

    def before(self, phase: str, predicted_j: float) -> None:
        return None

    def after(self, phase: str, cpu_s: float) -> float:
        joules = cpu_s * self.watts_per_cpu
        self.total_j += joules
        return joules


def _status_mb(field: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        return None
    return None


class PeakWatch:
    """The process's peak RSS (MB) since the watch started, across `reset_peak_rss`: each reset
    first folds the kernel's mark into every open watch. Without it a phase's reset would hide
    an earlier, higher peak (the oracle's) from the job's figure and from VmHWM itself."""

    def __init__(self, *, reset: bool = True) -> None:
        self.folded = 0.0
        if reset:  # start from now: the peak before is folded into the other watches only
            _clear_peak_mark()
        _WATCHES.add(self)

    @property
    def peak_mb(self) -> float | None:
        now = _status_mb("VmHWM")
        return None if now is None else max(self.folded, now)

    def close(self) -> None:
        _WATCHES.discard(self)

    def __enter__(self) -> PeakWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def process_peak_rss_mb() -> float:
    """This process's peak RSS so far (MB), resets included; ru_maxrss where /proc has none."""
    import resource

    return PROCESS_PEAK.peak_mb or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


_WATCHES: weakref.WeakSet[PeakWatch] = weakref.WeakSet()


def _clear_peak_mark() -> None:
    hwm = _status_mb("VmHWM")
    if hwm is not None:
        for watch in list(_WATCHES):
            watch.folded = max(watch.folded, hwm)
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")


# the whole process's, from before the first reset (VmHWM counts from the process's start)
PROCESS_PEAK = PeakWatch(reset=False)


def reset_peak_rss() -> float | None:
    """Reset the kernel's peak-RSS mark (Linux >= 4.0) and return the current RSS in MB; the
    mark so far is kept by the open PeakWatches (PROCESS_PEAK: the process's whole run)."""
    _clear_peak_mark()
    return _status_mb("VmRSS")


def rss_mb() -> float | None:
    """This process's resident memory now (MB)."""
    return _status_mb("VmRSS")


def peak_rss_growth(start_mb: float | None) -> float:
    peak = _status_mb("VmHWM")
    return max(0.0, peak - start_mb) if peak is not None and start_mb is not None else math.nan


@contextlib.contextmanager
def measured(meter: Meter, phase: str, predicted_j: float = 0.0, *, clocks: Clocks = SYSTEM_CLOCKS) -> Iterator[Phase]:
    """Meter one phase: refuse it first if the meter says so, then CPU, wall, J and peak MB."""
    meter.before(phase, predicted_j)
    out = Phase(0.0, 0.0, 0.0, 0.0)
    rss0 = reset_peak_rss()
    cpu0, wall0 = clocks.cpu(), clocks.wall()
    try:
        yield out
    finally:
        out.cpu_s, out.wall_s = clocks.cpu() - cpu0, clocks.wall() - wall0
        out.peak_mb = peak_rss_growth(rss0)
        out.joules = meter.after(phase, out.cpu_s)


class TimedRuns(Runner):
    """A runner whose `run` calls on batches of `batch` images are timed as they happen (wall
    s, CPU s): an engine's agreement check runs it over the calibration samples at the job's
    batch size, and those runs are timing rounds `time_rounds` need not repeat (`rounds`:
    the first, which warms the engine up, left out)."""

    def __init__(self, runner: Runner, batch: int, clocks: Clocks = SYSTEM_CLOCKS) -> None:
        self.runner, self.batch, self.clocks = runner, batch, clocks
        self.samples: list[tuple[float, float]] = []

    def run(self, x: np.ndarray) -> np.ndarray:
        c0, w0 = self.clocks.cpu(), self.clocks.wall()
        out = self.runner.run(x)
        if len(x) == self.batch:
            self.samples.append((self.clocks.wall() - w0, self.clocks.cpu() - c0))
        return out

    def run_int8(self, x: np.ndarray) -> np.ndarray:
        return self.runner.run_int8(x)

    def rounds(self) -> list[tuple[float, float]]:
        return self.samples[1:]


def time_rounds(runners: dict[Any, Any], x: np.ndarray, *, repeats: int,
                clocks: Clocks = SYSTEM_CLOCKS,
                spread: dict[Any, float] | None = None,
                earlier: Mapping[Any, list[tuple[float, float]]] | None = None) -> dict[Any, tuple[float, float]]:
    """Median (wall s, CPU s) per `run(x)` for each runner, rounds interleaved (every runner
    once per round) so that load drifting on a shared machine hits all alike. `spread`, when
    given, is filled with each runner's relative spread of its CPU times (`relative_spread`):
    the noise `choose` allows that runner. `earlier`: (wall, CPU) rounds a runner already ran
    on batches of this size (its agreement check's, TimedRuns), counted as its first rounds:
    it is not warmed up again and runs only the rounds after them.

    A race, not a fixed schedule: from RACE_MIN_ROUNDS rounds on, a runner whose cheapest
    round cost more CPU than the dearest round of the current leader (the least median) is
    out -- their rounds do not overlap, so more of them would not reorder the two unless the
    load changed -- and is not run again; the others run up to `repeats` rounds. A job's
    selection timed every engine and thread variant for all its rounds (0.5-0.7 CPU-s of a
    digits first job, more than the job's own feature extraction)."""
    earlier = earlier or {}
    wall: dict[Any, list[float]] = {k: [w for w, _ in earlier.get(k, [])] for k in runners}
    cpu: dict[Any, list[float]] = {k: [c for _, c in earlier.get(k, [])] for k in runners}
    for key, runner in runners.items():
        if not cpu[key]:
            runner.run(x)
    racing = dict(runners)
    for done in range(max(1, repeats)):
        for key, runner in racing.items():
            if len(cpu[key]) > done:  # this round came with it
                continue
            c0, w0 = clocks.cpu(), clocks.wall()
            runner.run(x)
            wall[key].append(clocks.wall() - w0)
            cpu[key].append(clocks.cpu() - c0)
        if done + 1 >= RACE_MIN_ROUNDS and len(racing) > 1:
            leader = min(racing, key=lambda k: float(np.median(cpu[k])))
            racing = {k: r for k, r in racing.items() if k == leader or min(cpu[k]) <= max(cpu[leader])}
    if spread is not None:
        spread.update({k: relative_spread(cpu[k]) for k in runners})
    return {k: (float(np.median(wall[k])), float(np.median(cpu[k]))) for k in runners}


def relative_spread(samples: list[float]) -> float:
    """Half the inter-quartile range over the median (numpy's linear quartiles): robust to
    the one hiccup a few rounds on a shared machine carry, and for 3-5 rounds about the
    standard error of their median (half an IQR is 0.67 sigma; the median of n rounds is off
    by ~1.25 sigma / sqrt(n)). 0.0 for fewer than two samples (nothing to tell), inf for a
    median of zero with a spread (nothing can be said relative to it)."""
    if len(samples) < 2:
        return 0.0
    q25, med, q75 = (float(v) for v in np.percentile(samples, [25, 50, 75]))
    half_iqr = (q75 - q25) / 2.0
    if med <= 0.0:
        return 0.0 if half_iqr <= 0.0 else math.inf
    return half_iqr / med


def predict_job(row: Any, images: int) -> tuple[float, float]:
    """(joules, seconds) of a job of `images` images on this candidate (prepare included)."""
    j = (row.prepare_j or 0.0) + images * (row.per_image_j or 0.0)
    s = (row.prepare_s or 0.0) + images * (row.per_image_s or 0.0)
    return j, s


def _fits(row: Any, mem_cap_mb: float | None) -> bool:
    peak = row.peak_mb
    return mem_cap_mb is None or peak is None or not math.isfinite(peak) or peak <= mem_cap_mb


def _eligible(rows: list[Any], mem_cap_mb: float | None) -> list[Any]:
    return [r for r in rows if r.correct and r.per_image_j is not None and _fits(r, mem_cap_mb)]


def noise_margin(a: Any, b: Any) -> float:
    """The relative noise two candidates' predictions are compared within: NOISE_FLOOR, or
    the larger measured spread of their per-image CPU times (`per_image_spread`) when the
    rows carry one."""
    spreads = [s for r in (a, b) if (s := getattr(r, "per_image_spread", None)) is not None and not math.isnan(s)]
    return max([NOISE_FLOOR, *spreads])


def _job_cpu_s(row: Any, images: int) -> float:
    """A job's predicted CPU-seconds: the row's own CPU figures, else its joules at
    DEFAULT_WATTS_PER_CPU (rows that carry joules only)."""
    prep, per = getattr(row, "prepare_cpu_s", None), getattr(row, "per_image_cpu_s", None)
    if per is not None:
        return (prep or 0.0) + images * per
    return predict_job(row, images)[0] / DEFAULT_WATTS_PER_CPU


@dataclass(frozen=True)
class _Gap:
    rel: float  # |Ja - Jb| over the dearer
    margin: float  # noise_margin(a, b)
    cpu_s: float  # |CPU-s a - CPU-s b| of the whole job
    relative: bool  # within the relative margin
    absolute: bool  # within NOISE_FLOOR_CPU_S

    @property
    def tied(self) -> bool:
        return self.relative or self.absolute


def _gap(a: Any, b: Any, images: int) -> _Gap:
    ja, jb = predict_job(a, images)[0], predict_job(b, images)[0]
    dearer, gap = max(ja, jb), abs(ja - jb)
    margin = noise_margin(a, b)
    cpu_s = abs(_job_cpu_s(a, images) - _job_cpu_s(b, images))
    return _Gap(gap / dearer if dearer > 0 else 0.0, margin, cpu_s, gap <= margin * dearer,
                cpu_s <= NOISE_FLOOR_CPU_S)


def prepare_hint(name: str, hints: Mapping[str, float] | None = None, row: Any = None) -> float:
    """The static CPU-seconds an engine's prepare is expected to cost (its class's
    `prepare_cpu_s_hint`): `hints` first, then the row's own (`Candidate.prepare_cpu_s_hint`,
    set when the row was made), then the registered engine class, then the interface's
    default."""
    if hints is not None and name in hints:
        return float(hints[name])
    own = getattr(row, "prepare_cpu_s_hint", None) if row is not None else None
    if own is not None:
        return float(own)
    try:
        from . import engines as registry

        engine = registry.load_engine(name)
        if not isinstance(engine, registry.BrokenEngine):
            return float(engine.prepare_cpu_s_hint)
    except Exception:  # an unknown name (a test's fake engine), an engine that fails to load
        pass
    return DEFAULT_PREPARE_HINT


def _memory_bucket(row: Any) -> float:
    peak = row.peak_mb
    if peak is None or not math.isfinite(peak):
        return math.inf  # unknown: last
    return float(math.floor(max(peak, 0.0) / MEMORY_BUCKET_MB))


def _static_key(row: Any, hints: Mapping[str, float] | None) -> tuple[float, float, str]:
    """The order among candidates the evidence does not separate: cheaper to prepare by the
    engine's static hint, then lighter in memory (MEMORY_BUCKET_MB buckets, unknown last),
    then by name. None of it is measured in this selection, so it cannot flip between runs."""
    return prepare_hint(row.name, hints, row), _memory_bucket(row), row.name


def _ranked(rows: list[Any], images: int, mem_cap_mb: float | None,
            hints: Mapping[str, float] | None) -> tuple[Any, list[Any]] | None:
    """(the chosen row, the rows tied with the cheapest), or None when none qualifies."""
    ok = _eligible(rows, mem_cap_mb)
    if not ok:
        return None
    # the anchor: the cheapest by energy, then time, then name (no dependence on row order)
    cheapest = min(ok, key=lambda r: (*predict_job(r, images), r.name))
    tied = [r for r in ok if r is cheapest or _gap(r, cheapest, images).tied]
    return min(tied, key=lambda r: _static_key(r, hints)), tied


def choose(rows: list[Any], images: int, mem_cap_mb: float | None = None, *,
           hints: Mapping[str, float] | None = None) -> Any | None:
    """The correct candidate with the least predicted job energy whose peak memory fits the
    cap; None when none qualifies. Candidates within the measurement noise of the cheapest
    (`noise_margin` of its energy, or NOISE_FLOOR_CPU_S of its CPU time) are a tie, settled
    by a static order: the lower prepare hint (`hints` name -> CPU-s, else see
    `prepare_hint`), the lighter memory bucket, the name. The tie set is taken around the
    single cheapest row, so a chain (a ~ b ~ c, a !~ c) cannot make the answer depend on the
    rows' order."""
    ranked = _ranked(rows, images, mem_cap_mb, hints)
    return ranked[0] if ranked else None


def choice_margin_note(rows: list[Any], images: int, chosen: str | None, mem_cap_mb: float | None = None, *,
                       hints: Mapping[str, float] | None = None) -> str | None:
    """One line on how far the chosen engine stood from its closest competitor (the cheapest
    other qualifying one) for a job of `images` images, for `Selection.notes`; None when
    there was no competitor (or `chosen` does not qualify)."""
    ok = _eligible(rows, mem_cap_mb)
    mine = next((r for r in ok if r.name == chosen), None)
    others = [r for r in ok if r.name != chosen]
    if mine is None or not others:
        return None
    other = min(others, key=lambda r: (*predict_job(r, images), r.name))
    gap = _gap(mine, other, images)
    j_mine, j_other = predict_job(mine, images)[0], predict_job(other, images)[0]
    head = (f"{mine.name} chosen over {other.name} for {images} images: {gap.rel * 100:.0f} % "
            f"{'apart' if gap.tied else 'cheaper' if j_mine < j_other else 'dearer'} ({j_mine:.3g} J vs {j_other:.3g} J)")
    noise = f"the {gap.margin * 100:.0f} % measurement noise"
    if not gap.tied:
        return f"{head}, beyond {noise}"
    h_mine, h_other = prepare_hint(mine.name, hints, mine), prepare_hint(other.name, hints, other)
    if _static_key(mine, hints) > _static_key(other, hints):  # not this rule's pick (a forced engine)
        why = f"{other.name} comes first in the static order"
    elif h_mine != h_other:
        why = f"the one cheaper to prepare ({h_mine:g} vs {h_other:g} CPU-s hint)"
    elif _memory_bucket(mine) != _memory_bucket(other):
        why = f"the one lighter in memory ({MEMORY_BUCKET_MB:g} MB buckets)"
    else:
        why = "first by name (same prepare hint and memory)"
    if gap.relative:
        return f"{head}, within {noise}; {why}"
    return (f"{head}, beyond {noise} but {gap.cpu_s * 1e3:.0f} ms of CPU, within its "
            f"{NOISE_FLOOR_CPU_S * 1e3:.0f} ms floor; {why}")


def top1_agreement(top1: np.ndarray, fp32_top1: np.ndarray) -> float:
    return float(np.mean(top1 == fp32_top1)) if len(top1) else math.nan


def agreement_verdict(engine: float, reference: float, samples: int) -> tuple[bool, float]:
    """(accepted, the lowest accepted agreement): the reference's own agreement with fp32
    minus max(AGREEMENT_SLACK, one sample)."""
    floor = reference - max(AGREEMENT_SLACK, 1.0 / max(samples, 1)) - 1e-9
    return bool(engine >= floor), max(0.0, floor)


class Recheck(NamedTuple):
    """A re-timed choice: still within `factor` of its measured batch time by the clock, and
    the median wall and CPU seconds per batch (the warm-up left out, as when it was measured:
    its first-touch faults, and under qemu its code translation, are not the engine's work)."""

    good: bool
    wall_s: float
    cpu_s: float


def recheck(runner: Any, x: np.ndarray, cached_wall_s: float, *, batches: int = RECHECK_BATCHES,
            factor: float = RECHECK_FACTOR, clocks: Clocks = SYSTEM_CLOCKS) -> Recheck:
    """Time a few batches of a cached choice (see Recheck)."""
    runner.run(x)  # warm-up, as when it was measured
    walls, cpus = [], []
    for _ in range(max(1, batches)):
        c0, t0 = clocks.cpu(), clocks.wall()
        runner.run(x)
        walls.append(clocks.wall() - t0)
        cpus.append(clocks.cpu() - c0)
    now = float(np.median(walls))
    return Recheck(now <= factor * cached_wall_s, now, float(np.median(cpus)))


def fp32_features(bundle: Any) -> Callable[[np.ndarray], np.ndarray]:
    """The bundle's fp32 backbone (its backbone.onnx in the numpy float runner)."""
    from .float_graph import run_float
    from .onnx_import import import_onnx

    graph = None

    def run(x: np.ndarray) -> np.ndarray:
        nonlocal graph
        if graph is None:
            try:
                graph = import_onnx(bundle.onnx_bytes(), split=bundle.manifest.split_tensor)
            except Exception:  # the stored backbone ends at the split already
                graph = import_onnx(bundle.onnx_bytes())
        return run_float(graph, x)

    return run
