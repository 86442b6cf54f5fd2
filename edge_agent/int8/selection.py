"""Engine selection: which int8 engine runs this model's backbone on this device.

Candidates come from the board profile's preference list (default: every registered engine)
and are filtered by availability on the probe report. Each available one is prepared on the
actual bundle and checked; the correct ones are timed side by side at the job's batch size
and at each thread count (interleaved rounds, median). The winner is the correct engine
with the least predicted energy for the job's size (engine_cost: prepare + images x
per-image, within the profile's memory cap). The reference is prepared and timed only when
no other engine is correct (its answers are the oracle's anyway).

Correct means task-level agreement (engine_cost.agreement_verdict): top-1 through the head
agrees with the fp32 model on the bundle's calibration samples at most max(0.5 points, one
sample) less often than the bit-exact reference, with the features within a loose sanity
bound of the reference's. The int8-unit / output-step distance below is kept as a
diagnostic (`kernels --bench` prints it), and is the rule only for bundles with fewer than
AGREEMENT_MIN_SAMPLES calibration samples:
- engines that run the bundle's own .tflite (`run_int8` works): every output within 1 int8
  unit of the reference, or within the graph's measured rounding sensitivity where that is
  larger (deep nets: see ROUNDING_FLIP_RATE);
- engines with their own calibration (mxnet-onednn): float features within
  FLOAT_TOLERANCE_STEPS of the reference's output quantisation step;
- and for both, the head's top-1 equal to the reference's on every check sample that is not
  a near-tie (Oracle.decided).

FLOAT_TOLERANCE_STEPS is derived from measurements of mxnet-onednn against the reference:
two independent 8-bit calibrations of the same backbone differ by up to 4-5 output steps on
the digits CNN and 1.3-2.1 on MobileNetV2 (0.35@96, 0.5@128); 12 leaves ~2.5x headroom. It
is looser than the int8 check by nature (different scales), so an engine off by a few steps
passes it; layout, weight or scale bugs are off by tens to hundreds of steps, and the top-1
check backs it up.

The decision and its timings are cached in the state directory per (int8 backbone sha256,
hardware fingerprint, edge-agent version) -- plus batch size, threads and the candidate
list, which also change the answer (not the job size: the cached rows are re-chosen for
each job's size). Not per bundle: engines run only the backbone, so a new head version
reuses the decision. `kernels --bench` and `finetune` share the directory. `EDGE_AGENT_INT8_BACKEND=<name>` forces one engine (only
it is probed, checked and timed; never cached); a forced engine that fails the check is an
error (exit 69) unless `EDGE_AGENT_INT8_FORCE=1` (--force-engine) says to run it anyway. MXNet is imported only when an engine or a
head that is more than one dense layer needs it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .. import __version__
from ..atomic import atomic_write_json, read_limited
from ..errors import EXIT_UNAVAILABLE, ConfigError, EdgeAgentError, InputError
from . import engines as registry
from .bundle import BACKBONE_INT8
from .engine import ENV_FORCE_BACKEND, ENV_FORCE_WRONG, Int8Engine, Runner
from .engine_cost import (
    AGREEMENT_MAX_SAMPLES,
    AGREEMENT_MIN_SAMPLES,
    DEFAULT_WATTS_PER_CPU,
    SANITY_MEAN_STEPS,
    CpuMeter,
    Meter,
    agreement_verdict,
    choose,
    fp32_features,
    measured,
    predict_job,
    recheck,
    time_rounds,
    top1_agreement,
)
from .engines._common import thread_count

_log = logging.getLogger(__name__)

INT8_TOLERANCE_UNITS = 1
# Legitimate per-op rounding differences (TFLite's optimized kernels vs its reference ones:
# at most 1 unit, in well under 1 % of a conv's outputs) grow with depth. How much is
# measured on the graph itself: the reference re-run with a 1-unit flip in ROUNDING_FLIP_RATE
# of every int8 op output (ROUNDING_SEEDS patterns); the int8 tolerance is the largest
# output change seen, at least INT8_TOLERANCE_UNITS. Shallow nets stay at 1-3 units (the
# digits CNN: 2; MXNet MobileNetV2 0.35: 2); a random-init torchvision mobilenet_v2 at
# 32x32 moves by ~50 units, where tflite/XNNPACK was 31-44 units off a reference that
# TFLite's own reference kernels match bit for bit.
# mxnet-onednn's float tolerance scales the same way: FLOAT_TOLERANCE_STEPS * sensitivity / 2
# (deep random nets: mxnet-onednn 19-65 steps off where the sensitivity is 5-51 units).
ROUNDING_FLIP_RATE = 0.05
ROUNDING_SEEDS = 3
PROBE_SAMPLES = 4  # priced after a warm-up call: one cold image cost ~200x a warm one
ROUNDING_SAMPLES = 8
FLOAT_TOLERANCE_STEPS = 12.0
VARIANT_PREPARE_MAX_S = 2.0  # other thread counts are tried for engines this cheap to prepare
CACHE_DIR = "int8-selection"
CACHE_FORMAT = 2  # 2: task-level agreement and costs
PREDICT_IMAGES = (100, 1000, 10000)
MAX_CACHE_BYTES = 256 * 1024


class EngineUnavailableError(EdgeAgentError):
    """No engine (or not the forced one) can run this model here."""

    exit_code = EXIT_UNAVAILABLE


@dataclass
class Candidate:
    """One engine's row in the decision: availability, agreement, timing."""

    name: str
    available: bool
    reason: str  # what was found, or why not
    agreement: str = ""  # "int8" (units) | "float" (output steps) | ""
    max_diff: float | None = None  # in int8 units or in output quantisation steps
    tolerance: float | None = None
    top1_match: float | None = None  # fraction of decided samples with the reference's top-1
    top1_checked: int | None = None  # decided samples (near-ties excluded, see Oracle.decided)
    correct: bool | None = None
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
    peak_mb: float | None = None  # peak RSS growth over prepare + runs
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

    def candidate(self, name: str) -> Candidate | None:
        return next((c for c in self.candidates if c.name == name), None)

    def to_json(self) -> dict[str, Any]:
        return {"format": CACHE_FORMAT, "chosen": self.chosen, "key": self.key,
                "batch_size": self.batch_size, "created": self.created, "threads": self.threads,
                "images": self.images, "chosen_for": self.chosen_for,
                "candidates": [asdict(c) for c in self.candidates]}


# ---------------------------------------------------------------- hardware identity


def default_probe() -> dict[str, Any]:
    """This device's hardware probe report (edge_agent.hardware.probe: files only, fast)."""
    from ..hardware.probe import probe

    return probe()


def hardware_fingerprint(report: Mapping[str, Any]) -> str:
    """What makes engine timings comparable (board, CPU, int8 features, accelerators)."""
    from ..hardware.probe import hardware_fingerprint as fingerprint

    return str(fingerprint(dict(report)))


# ---------------------------------------------------------------- checking and timing


def check_batch_for(bundle: Any, batch_size: int) -> np.ndarray:
    """The bundle's first calibration samples, repeated up to `batch_size`."""
    calib = bundle.calibration()
    reps = -(-batch_size // len(calib))
    return np.ascontiguousarray(np.concatenate([calib] * reps)[:batch_size])


def time_side_by_side(runners: Mapping[str, Runner], x: np.ndarray, *, repeats: int) -> dict[str, float]:
    """Median seconds per `run(x)` for each runner, after one untimed warm-up run each.

    Rounds are interleaved (every runner once per round) so that load drifting on a shared
    machine affects all engines alike, as DESIGN.md asks of every comparison."""
    for runner in runners.values():
        runner.run(x)
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(max(1, repeats)):
        for name, runner in runners.items():
            start = time.perf_counter()
            runner.run(x)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def _row(rows: list[Candidate], name: str) -> Candidate | None:
    return next((c for c in rows if c.name == name), None)


class Oracle:
    """The reference's answers on the check batch, and the head that turns features into
    logits for the top-1 check (numpy for a dense head, else MXNet; loaded on first use)."""

    def __init__(self, bundle: Any, x: np.ndarray, *,
                 logits: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        from .engines.reference import QGraphRunner
        from .quant_math import quantize

        self.runner = QGraphRunner(bundle.qgraph())
        graph = self.runner.graph
        tin, tout = graph.tensor(graph.inputs[0]), graph.tensor(graph.outputs[0])
        self.x = x
        self.q = quantize(x.transpose(0, 2, 3, 1), float(tin.scale[0]), int(tin.zero_point[0])) \
            if self.runner.int8_io else None
        self.out_scale = float(tout.scale[0]) if tout.scale is not None else 1.0
        self.int8 = self.runner.run_int8(self.q) if self.q is not None else None
        self._int8_tolerance: float | None = None
        self.float = self.runner.run(x)
        self._logits = logits or _head_logits(bundle)
        self.ref_logits = self._logits(self.float)
        self.top1 = self.ref_logits.argmax(axis=1)
        # task level: top-1 vs the fp32 model on the bundle's calibration samples
        calib = bundle.calibration()
        self.samples = np.ascontiguousarray(calib[:AGREEMENT_MAX_SAMPLES])
        # the fp32 model runs from backbone.onnx, which needs the onnx package: 32-bit ARM has
        # no wheel for it (nor MXNet), so there the unit-level rule decides
        self.task_level = len(self.samples) >= AGREEMENT_MIN_SAMPLES and importlib.util.find_spec("onnx") is not None
        if self.task_level:
            self.fp32_top1 = self._logits(fp32_features(bundle)(self.samples)).argmax(axis=1)
            self.ref_samples = self.runner.run(self.samples)
            self.ref_agreement = top1_agreement(self._logits(self.ref_samples).argmax(axis=1), self.fp32_top1)

    def int8_tolerance(self) -> float:
        """INT8_TOLERANCE_UNITS, or this graph's measured rounding sensitivity if larger."""
        if self._int8_tolerance is None:
            from .reference import run_graph
            from .reference_ops import KERNELS

            rng = np.random.default_rng(0)

            def flipping(kernel: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
                def run(graph: Any, op: Any, args: list[Any]) -> np.ndarray:
                    y = kernel(graph, op, args)
                    if y.dtype != np.int8:
                        return y
                    flip = (rng.random(y.shape) < ROUNDING_FLIP_RATE) * rng.choice(np.array([-1, 1], np.int16), y.shape)
                    return np.clip(y.astype(np.int16) + flip, -128, 127).astype(np.int8)
                return run

            q = self.q[:ROUNDING_SAMPLES]
            clean = self.int8[:ROUNDING_SAMPLES].astype(np.int32)
            kernels = {kind: flipping(k) for kind, k in KERNELS.items()}
            worst = 0
            for _ in range(ROUNDING_SEEDS):
                out = run_graph(self.runner.graph, q, kernels=kernels)
                out = out if isinstance(out, np.ndarray) else out[self.runner.graph.outputs[0]]
                worst = max(worst, int(np.max(np.abs(out.astype(np.int32) - clean))))
            self._int8_tolerance = float(max(INT8_TOLERANCE_UNITS, worst))
        return self._int8_tolerance

    def decided(self, steps: float) -> np.ndarray:
        """Samples whose top-1 cannot flip when every feature moves by `steps` output steps.

        The head's sensitivity is measured, not assumed: the reference's features are moved
        by +-steps (four random sign patterns) and a sample is a near-tie when its top-1
        margin is under twice the largest logit change seen."""
        rng = np.random.default_rng(0)
        worst = np.zeros(len(self.float))
        for _ in range(4):
            delta = rng.choice(np.array([-1.0, 1.0], np.float32), size=self.float.shape) * (steps * self.out_scale)
            moved = self._logits((self.float + delta).astype(np.float32))
            worst = np.maximum(worst, np.abs(moved - self.ref_logits).max(axis=1))
        top2 = np.sort(self.ref_logits, axis=1)[:, -2:] if self.ref_logits.shape[1] > 1 else None
        if top2 is None:
            return np.ones(len(self.float), bool)
        return (top2[:, 1] - top2[:, 0]) > 2.0 * worst

    def check(self, runner: Runner, cand: Candidate) -> None:
        """Fill the candidate's agreement fields."""
        out_int8 = None
        if self.q is not None:
            try:
                out_int8 = runner.run_int8(self.q)
            except NotImplementedError:
                out_int8 = None
        features = runner.run(self.x)
        if features.shape != self.float.shape:
            raise EdgeAgentError(f"output shape {features.shape}, reference {self.float.shape}")
        if out_int8 is not None:
            # the rounding sensitivity costs 24 reference runs: only where it is the rule
            cand.agreement, cand.tolerance = "int8", None if self.task_level else self.int8_tolerance()
            cand.max_diff = float(np.max(np.abs(out_int8.astype(np.int32) - self.int8.astype(np.int32))))
        else:
            # FLOAT_TOLERANCE_STEPS was measured on nets whose rounding sensitivity is ~2
            # units; a graph that amplifies rounding more gets proportionally more room
            cand.agreement, cand.tolerance = "float", None
            if not self.task_level:
                sensitivity = self.int8_tolerance() if self.q is not None else 2.0
                cand.tolerance = FLOAT_TOLERANCE_STEPS * max(1.0, sensitivity / 2.0)
            cand.max_diff = float(np.max(np.abs(features - self.float)) / self.out_scale)
        mask = self.decided(max(cand.max_diff, 1.0))
        same = self._logits(features).argmax(axis=1) == self.top1
        cand.top1_checked = int(mask.sum())
        cand.top1_match = float(same[mask].mean()) if mask.any() else 1.0
        if not self.task_level:  # too few samples for a task-level figure: the unit-level rule
            cand.correct = bool(cand.max_diff <= cand.tolerance and cand.top1_match == 1.0)
            return
        out = runner.run(self.samples)
        if out.shape != self.ref_samples.shape:
            raise EdgeAgentError(f"output shape {out.shape}, reference {self.ref_samples.shape}")
        cand.mean_steps = float(np.mean(np.abs(out - self.ref_samples)) / self.out_scale)
        cand.agreement_samples = len(self.samples)
        cand.reference_top1_fp32 = self.ref_agreement
        cand.top1_fp32 = top1_agreement(self._logits(out).argmax(axis=1), self.fp32_top1)
        ok, _ = agreement_verdict(cand.top1_fp32, self.ref_agreement, len(self.samples))
        cand.correct = bool(ok and np.isfinite(out).all() and cand.mean_steps <= SANITY_MEAN_STEPS)


def _head_logits(bundle: Any) -> Callable[[np.ndarray], np.ndarray]:
    """The bundle head's logits: numpy for a one-dense-layer head, else its MXNet block."""
    head = None

    def logits(features: np.ndarray) -> np.ndarray:
        nonlocal head
        if head is None:
            from ..train.dense_head import dense_head_logits

            head = dense_head_logits(bundle) or _mxnet_head(bundle)
        return head(features).reshape(len(features), -1)

    return logits


def _mxnet_head(bundle: Any) -> Callable[[np.ndarray], np.ndarray]:
    from ..train.mxnet_import import mxnet

    mx = mxnet()  # MXNetUnavailableError (one line, exit 69) where it cannot load: 32-bit ARM

    block = bundle.head_block()
    return lambda features: block(mx.nd.array(features)).asnumpy()


# ---------------------------------------------------------------- selection


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
            rows.append(Candidate(name, bool(avail.available), avail.reason))
        except Exception as exc:  # a probing engine must never take the others down
            rows.append(Candidate(name, False, f"availability check failed: {type(exc).__name__}: {exc}"))
    return rows


def cache_key(bundle: Any, fingerprint: str, *, batch_size: int, threads: int | None,
              preference: list[str]) -> dict[str, Any]:
    # keyed on the int8 backbone, not the whole bundle: every engine runs only the backbone,
    # so a new head version (each federated round) reuses the decision instead of spending
    # a re-selection (tens of CPU-seconds, every candidate prepared) on every device
    return {"backbone_sha256": bundle.manifest.files[BACKBONE_INT8].sha256, "hardware": fingerprint, "edge_agent": __version__,
            "batch_size": batch_size, "threads": threads, "candidates": list(preference)}


def _cache_path(state_dir: str | os.PathLike[str], key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return Path(state_dir) / CACHE_DIR / f"{digest}.json"


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
                         images=int(obj.get("images", 0)), chosen_for=dict(obj.get("chosen_for", {})))
    except FileNotFoundError:
        return None
    except (OSError, InputError, ValueError, TypeError, KeyError, AttributeError) as exc:
        _log.warning("ignoring unreadable int8 selection cache %s: %s", path, exc)
        return None


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
) -> tuple[Selection, Runner | None]:
    """Choose the engine for `bundle` here; returns the decision and (with `keep_runner`)
    the chosen engine's prepared runner. Raises EngineUnavailableError if nothing is correct,
    ConfigError for an unknown forced engine. `engines` replaces the registry (tests).

    The choice minimises the predicted energy of a job of `images` images (engine_cost).
    `meter` charges each phase (the job's budget governor; it may refuse one), else CPU
    seconds x `watts_per_cpu`. `recheck_cached` re-times a cached choice on a few batches
    and falls back to one thread when it got RECHECK_FACTOR slower (see _use_cached)."""
    env = os.environ if env is None else env
    threads = thread_count(threads)  # None and "all cores" are the same decision
    if batch_size < 1:
        raise ConfigError(f"batch size must be >= 1, got {batch_size}")
    wpc = float(watts_per_cpu) if watts_per_cpu else DEFAULT_WATTS_PER_CPU
    meter = meter if meter is not None else CpuMeter(wpc)
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
    path = _cache_path(state_dir, key) if state_dir is not None else None
    by_name = dict(loaded)
    if not forced and use_cache and path is not None:
        cached = load_cached(path, key)
        if cached is not None:
            hit = _use_cached(cached, bundle, by_name, probe, images=images, mem_cap_mb=mem_cap_mb,
                              keep_runner=keep_runner, recheck_cached=recheck_cached)
            if hit is not None:
                return hit
    # a forced engine is the only one tried: the others are not even probed (probing
    # mxnet-onednn imports MXNet, ~130 MB and ~2 CPU-s, in a job that will not use it)
    rows = availability_report(probe=probe, engines=[(n, e) for n, e in loaded if not forced or n == forced])
    if forced:
        rows += [Candidate(n, False, f"not tried: {ENV_FORCE_BACKEND}={forced}") for n, _ in loaded if n != forced]
    x = check_batch_for(bundle, batch_size)
    spent = 0.0
    # the probe: one reference image prices the rest, so that a budget too small for the
    # selection is refused before it is spent (meter.before("selection", ...))
    from .engines.reference import QGraphRunner

    with measured(meter, "probe") as ph:  # the first call pays one-off costs (graph, buffers) ...
        probe_runner = QGraphRunner(bundle.qgraph())
        probe_runner.run(x[:1])
    spent += ph.joules
    n_probe = min(len(x), PROBE_SAMPLES)
    with measured(meter, "probe") as ph:  # ... so the per-sample price comes from the second
        probe_runner.run(x[:n_probe])
    spent += ph.joules
    per_sample = max(ph.joules / n_probe, 1e-9)
    n_agree = min(len(bundle.calibration()), AGREEMENT_MAX_SAMPLES)
    todo = [r for r in rows if r.available]
    others = [r for r in todo if r.name != "reference"]
    pred_oracle = per_sample * (len(x) + 2 * n_agree + ROUNDING_SEEDS * ROUNDING_SAMPLES)
    pred_prepare = {r.name: per_sample * (len(x) + n_agree) + wpc * float(getattr(by_name[r.name], "prepare_cpu_s_hint", 1.0))
                    for r in todo}
    pred_timing = per_sample * len(x) * (repeats + 1) * max(1, len(others or todo)) * threads
    predicted = pred_oracle + sum(pred_prepare[r.name] for r in (others or todo)) + pred_timing
    meter.before("selection", predicted + per_sample * batch_size)  # + one batch of the job
    with measured(meter, "agreement", pred_oracle) as ph:
        oracle = Oracle(bundle, x, logits=logits)
    spent += ph.joules
    runners: dict[tuple[str, int], Runner] = {}

    def prepare_and_check(row: Candidate) -> None:
        nonlocal spent
        engine = by_name[row.name]
        assert engine is not None
        with measured(meter, f"prepare:{row.name}", pred_prepare[row.name]) as ph:
            try:
                c0, w0 = time.process_time(), time.perf_counter()
                runner = engine.prepare(bundle, threads=threads)
                row.prepare_cpu_s, row.prepare_s = time.process_time() - c0, time.perf_counter() - w0
                row.prepare_j = row.prepare_cpu_s * wpc
                runners[(row.name, threads)] = runner
                oracle.check(runner, row)
            except Exception as exc:  # one failing engine is a row in the table, not a crash
                row.error = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
                row.correct = False
        spent += ph.joules
        row.peak_mb = round(ph.peak_mb, 1) if np.isfinite(ph.peak_mb) else None
        row.threads = threads

    # the reference (~25x slower, never the winner) is prepared and timed only when nothing
    # else is correct: its agreement is already the oracle's
    for row in others if not forced else todo:
        prepare_and_check(row)
    ref = _row(todo, "reference")
    if not forced and ref is not None and others:
        if any(r.correct for r in others):
            ref.reason += "; not timed: another engine is correct"
        else:
            prepare_and_check(ref)
    elif not forced and ref is not None:
        prepare_and_check(ref)
    # other thread counts of cheaply prepared engines (XNNPACK's pool: 1 thread can beat 2
    # on a busy machine, and always costs less CPU)
    for row in rows:
        if row.correct and (row.name, threads) in runners and threads > 1 and (row.prepare_cpu_s or 0) < VARIANT_PREPARE_MAX_S:
            engine = by_name[row.name]
            assert engine is not None
            for t in range(1, threads):
                try:
                    runners[(row.name, t)] = engine.prepare(bundle, threads=t)
                except Exception as exc:  # keep the thread count that worked
                    _log.warning("%s with %d threads: %s", row.name, t, exc)
    timed = {k: r for k, r in runners.items() if (c := _row(rows, k[0])) is not None and not c.error
             and (c.correct or forced)}
    try:
        with measured(meter, "timing", pred_timing) as ph:
            seconds = time_rounds(timed, x, repeats=repeats)
        spent += ph.joules
    except EdgeAgentError:
        raise
    except Exception as exc:  # a runner that checked fine but fails when timed
        raise EngineUnavailableError(f"timing the int8 engines failed: {type(exc).__name__}: {exc}") from exc
    for row in rows:
        mine = {t: v for (n, t), v in seconds.items() if n == row.name}
        if not mine:
            continue
        row.by_threads = {str(t): round(cpu / batch_size * wpc, 9) for t, (_, cpu) in sorted(mine.items())}
        best = min(mine, key=lambda t: (round(mine[t][1] / batch_size * wpc, 6), mine[t][0]))
        wall, cpu = mine[best]
        row.threads = best
        row.latency_ms, row.images_per_s = wall * 1000.0, batch_size / wall
        row.per_image_s, row.per_image_cpu_s = wall / batch_size, cpu / batch_size
        row.per_image_j = row.per_image_cpu_s * wpc
        row.predicted_j = {str(n): round(predict_job(row, n)[0], 3) for n in PREDICT_IMAGES}
    selection = Selection(None, rows, key, batch_size, forced=bool(forced), images=images,
                          created=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    if forced:
        row = selection.candidate(forced)
        if row is None or (forced, threads) not in runners or row.error:
            why = (row.error or row.reason) if row else "not loaded"
            raise EngineUnavailableError(f"{ENV_FORCE_BACKEND}={forced}: engine cannot run this model: {why}")
        if not row.correct:
            what = _disagreement(row)
            if env.get(ENV_FORCE_WRONG, "").strip() not in ("1", "true", "yes"):
                raise EngineUnavailableError(
                    f"{ENV_FORCE_BACKEND}={forced}: the engine disagrees with the reference on this model "
                    f"({what}), so it is not run; --force-engine ({ENV_FORCE_WRONG}=1) runs it anyway")
            note = f"forced engine {forced} disagrees with the reference ({what}); used anyway ({ENV_FORCE_WRONG}=1)"
            _log.warning("%s", note)
            selection.notes.append(note)
        selection.chosen = forced
    else:
        best_row = choose(rows, images, mem_cap_mb) or choose(rows, images)
        if best_row is None:
            raise EngineUnavailableError("no int8 engine is both available and correct here: " + "; ".join(
                f"{c.name}: {c.error or c.reason}" + (f" ({_disagreement(c)})" if c.correct is False and not c.error else "")
                for c in rows))
        if mem_cap_mb is not None and choose(rows, images, mem_cap_mb) is None:
            selection.notes.append(f"no correct engine fits the {mem_cap_mb:g} MB memory cap; cheapest used")
        selection.chosen = best_row.name
        selection.chosen_for = {str(n): (choose(rows, n, mem_cap_mb) or best_row).name for n in PREDICT_IMAGES}
    chosen_row = selection.candidate(selection.chosen)
    selection.threads = chosen_row.threads if chosen_row is not None and chosen_row.threads else threads
    selection.energy_j = spent
    for row in rows:
        row.chosen = row.name == selection.chosen
    if not forced and path is not None:
        atomic_write_json(path, selection.to_json())
        selection.cache_file = str(path)
    keep = runners.pop((selection.chosen, selection.threads), None) if keep_runner and selection.chosen else None
    for runner in runners.values():
        runner.close()
    return selection, keep


def _disagreement(row: Candidate) -> str:
    if row.top1_fp32 is not None and row.reference_top1_fp32 is not None:
        return (f"top-1 agreement with fp32 {row.top1_fp32:.1%} vs the reference's {row.reference_top1_fp32:.1%} "
                f"on {row.agreement_samples} samples, mean {row.mean_steps:.3g} steps off")
    if row.max_diff is not None:
        return f"{row.agreement} max {row.max_diff:.3g}/{row.tolerance:g}, top-1 {row.top1_match}"
    return "no agreement figures"


def _use_cached(cached: Selection, bundle: Any, by_name: Mapping[str, Int8Engine | None], probe: dict[str, Any], *,
                images: int, mem_cap_mb: float | None, keep_runner: bool,
                recheck_cached: bool) -> tuple[Selection, Runner | None] | None:
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
        good, now = recheck(runner, x, best.latency_ms / 1000.0)
        if not good and t > 1:  # contention: a spinning pool on shared cores; try one thread
            one = engine.prepare(bundle, threads=1)
            good1, now1 = recheck(one, x, best.latency_ms / 1000.0 * t)
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


def cached_selection(bundle: Any, *, probe: dict[str, Any], preference: list[str] | None = None,
                     batch_size: int = 32, threads: int | None = None,
                     state_dir: str | os.PathLike[str]) -> Selection | None:
    """The cached decision for this bundle and device, without preparing anything."""
    names = registry.candidates(preference)
    key = cache_key(bundle, hardware_fingerprint(probe), batch_size=batch_size, threads=thread_count(threads),
                    preference=names)
    return load_cached(_cache_path(state_dir, key), key)
