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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ..errors import EdgeAgentError, UsageError

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
DEFAULT_WATTS_PER_CPU = 2.0  # no profile: a typical small-board core above idle
RECHECK_BATCHES = 3
# A cached choice is re-timed at job start; slower than this factor x its cached batch time
# (contention: another process on the cores XNNPACK's pool spins on) means fall back.
RECHECK_FACTOR = 2.0


class BudgetTooSmallError(EdgeAgentError):
    """The energy budget cannot pay for engine selection plus one training step."""

    exit_code = UsageError.exit_code


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
    returns the phase's joules. The job's meter is the budget governor."""

    def before(self, phase: str, predicted_j: float) -> None: ...

    def after(self, phase: str, cpu_s: float) -> float: ...


class CpuMeter:
    """Joules = CPU-seconds x watts_per_cpu; never refuses (`kernels --bench`)."""

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


def reset_peak_rss() -> float | None:
    """Reset the kernel's peak-RSS mark (Linux >= 4.0) and return the current RSS in MB."""
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")
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


def time_rounds(runners: dict[Any, Any], x: np.ndarray, *, repeats: int,
                clocks: Clocks = SYSTEM_CLOCKS) -> dict[Any, tuple[float, float]]:
    """Median (wall s, CPU s) per `run(x)` for each runner, rounds interleaved (every runner
    once per round) so that load drifting on a shared machine hits all alike."""
    for runner in runners.values():
        runner.run(x)
    wall: dict[Any, list[float]] = {k: [] for k in runners}
    cpu: dict[Any, list[float]] = {k: [] for k in runners}
    for _ in range(max(1, repeats)):
        for key, runner in runners.items():
            c0, w0 = clocks.cpu(), clocks.wall()
            runner.run(x)
            wall[key].append(clocks.wall() - w0)
            cpu[key].append(clocks.cpu() - c0)
    return {k: (float(np.median(wall[k])), float(np.median(cpu[k]))) for k in runners}


def predict_job(row: Any, images: int) -> tuple[float, float]:
    """(joules, seconds) of a job of `images` images on this candidate (prepare included)."""
    j = (row.prepare_j or 0.0) + images * (row.per_image_j or 0.0)
    s = (row.prepare_s or 0.0) + images * (row.per_image_s or 0.0)
    return j, s


def choose(rows: list[Any], images: int, mem_cap_mb: float | None = None) -> Any | None:
    """The correct candidate with the least predicted job energy (then time) whose peak
    memory fits the cap; None when none qualifies."""
    ok = [r for r in rows if r.correct and r.per_image_j is not None
          and (mem_cap_mb is None or r.peak_mb is None or not math.isfinite(r.peak_mb) or r.peak_mb <= mem_cap_mb)]
    if not ok:
        return None
    return min(ok, key=lambda r: predict_job(r, images))


def top1_agreement(top1: np.ndarray, fp32_top1: np.ndarray) -> float:
    return float(np.mean(top1 == fp32_top1)) if len(top1) else math.nan


def agreement_verdict(engine: float, reference: float, samples: int) -> tuple[bool, float]:
    """(accepted, the lowest accepted agreement): the reference's own agreement with fp32
    minus max(AGREEMENT_SLACK, one sample)."""
    floor = reference - max(AGREEMENT_SLACK, 1.0 / max(samples, 1)) - 1e-9
    return bool(engine >= floor), max(0.0, floor)


def recheck(runner: Any, x: np.ndarray, cached_wall_s: float, *, batches: int = RECHECK_BATCHES,
            factor: float = RECHECK_FACTOR, clocks: Clocks = SYSTEM_CLOCKS) -> tuple[bool, float]:
    """Time a few batches of a cached choice: (still good, median wall s per batch)."""
    runner.run(x)  # warm-up, as when it was measured
    times = []
    for _ in range(max(1, batches)):
        t0 = clocks.wall()
        runner.run(x)
        times.append(clocks.wall() - t0)
    now = float(np.median(times))
    return now <= factor * cached_wall_s, now


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
