"""Agreement: is an int8 engine's output correct on this model (selection.py asks it).

Correct means task-level agreement (engine_cost.agreement_verdict): top-1 through the head
agrees with the fp32 model on the bundle's calibration samples at most max(0.5 points, one
sample) less often than the bit-exact reference, with the features within a loose sanity
bound of the reference's. That check needs evidence: at least AGREEMENT_MIN_SAMPLES
calibration samples whose top-1 is *decided* -- not a near-tie that moving every feature of
the reference by one output step could flip (Oracle.decided). With fewer (a small bundle; a
net whose features carry nothing, as random weights give, where every sample is a tie) or
without the onnx package (no fp32 model: 32-bit ARM) the task-level check is
*inconclusive*, never "ok": the candidate records why (`inconclusive`) and the int8-unit /
output-step distance below decides instead (`basis` "units"). Otherwise that distance is
a diagnostic (`kernels --bench` prints it):
- engines that run the bundle's own .tflite (`run_int8` works): every output within 1 int8
  unit of the reference, or within the graph's measured rounding sensitivity where that is
  larger (deep nets: see ROUNDING_FLIP_RATE), capped at ROUNDING_SENSITIVITY_CAP units;
- engines with their own calibration (mxnet-onednn): float features within
  FLOAT_TOLERANCE_STEPS of the reference's output quantisation step (scaled with the capped
  sensitivity);
- and for both, the head's top-1 equal to the reference's on every check sample that is not
  a near-tie (Oracle.decided); with no decided check sample the units decide alone.

The cap: a graph that amplifies rounding (a 1-unit flip in 5 % of every op's outputs moves a
random-init efficientnet's output by ~94 units) would otherwise make its own tolerance so
loose that an engine 35 units off passed on units alone. Past the cap the graph is
`too_sensitive`: units cannot tell an engine's legitimate rounding from a bug there, so an
engine further off than the cap needs a conclusive task-level check.

FLOAT_TOLERANCE_STEPS is derived from measurements of mxnet-onednn against the reference:
two independent 8-bit calibrations of the same backbone differ by up to 4-5 output steps on
the digits CNN and 1.3-2.1 on MobileNetV2 (0.35@96, 0.5@128); 12 leaves ~2.5x headroom. It
is looser than the int8 check by nature (different scales), so an engine off by a few steps
passes it; layout, weight or scale bugs are off by tens to hundreds of steps, and the top-1
check backs it up.

Separate from selection.py because it is the one place that decides correctness (the
reference's answers, the head, the tolerances); selection only prices and times the engines
this module calls correct.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import EdgeAgentError
from .engine import Runner
from .engine_cost import (
    AGREEMENT_MAX_SAMPLES,
    AGREEMENT_MIN_SAMPLES,
    SANITY_MEAN_STEPS,
    agreement_verdict,
    fp32_features,
    top1_agreement,
)
from .oracle_answers import SPOT_CHECK_SAMPLES, OracleAnswers
from .oracle_answers import load as load_answers

_log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from .selection_cache import Candidate

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
ROUNDING_SAMPLES = 8
FLOAT_TOLERANCE_STEPS = 12.0
# The most rounding sensitivity a unit-level tolerance follows (int8: 8 units; float:
# 12 x 8 / 2 = 48 steps). Shallow nets measure 1-3 (the digits CNN 2); the deep test graph of
# test_int8_import_ux 7 (12 blocks) to 18 (40 blocks); the trained zoo nets torchvision
# squeezenet1_1 8, mobilenet_v2 14, efficientnet_b0 18 -- above the cap, where their 63-64
# decided calibration samples let the task level decide alone -- and random-init ones 50-94.
ROUNDING_SENSITIVITY_CAP = 8.0


def check_batch_for(bundle: Any, batch_size: int, calibration: np.ndarray | None = None) -> np.ndarray:
    """The bundle's first calibration samples (`calibration`, if already read), repeated up
    to `batch_size`."""
    calib = bundle.calibration() if calibration is None else calibration
    reps = -(-batch_size // len(calib))
    return np.ascontiguousarray(np.concatenate([calib] * reps)[:batch_size])


# The reference and the fp32 runner hold every layer's activations for the whole batch (int32
# and float64 intermediates): 128 camera samples at once peaked ~100 MB above 32 at a time.
ORACLE_CHUNK = 32


def in_chunks(run: Callable[[np.ndarray], np.ndarray], x: np.ndarray, chunk: int = ORACLE_CHUNK) -> np.ndarray:
    """`run` over `x` in chunks of `chunk` samples, concatenated (bounded peak memory)."""
    if len(x) <= chunk:
        return run(x)
    return np.concatenate([run(x[i:i + chunk]) for i in range(0, len(x), chunk)])


def quantized_input(runner: Any, x: np.ndarray) -> np.ndarray:
    """The int8 NHWC input the reference's graph takes for the float NCHW batch `x`."""
    from .quant_math import quantize

    tin = runner.graph.tensor(runner.graph.inputs[0])
    return quantize(x.transpose(0, 2, 3, 1), float(tin.scale[0]), int(tin.zero_point[0]))


def rounding_sensitivity(graph: Any, q: np.ndarray, clean_int8: np.ndarray) -> float:
    """The largest output change (int8 units) seen when ROUNDING_FLIP_RATE of every int8 op
    output is moved by one unit, on the first ROUNDING_SAMPLES samples (`q`, whose reference
    output is `clean_int8`): how much legitimate rounding differences can grow."""
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

    q = q[:ROUNDING_SAMPLES]
    clean = clean_int8[:ROUNDING_SAMPLES].astype(np.int32)
    kernels = {kind: flipping(k) for kind, k in KERNELS.items()}
    worst = 0
    for _ in range(ROUNDING_SEEDS):
        out = run_graph(graph, q, kernels=kernels)
        out = out if isinstance(out, np.ndarray) else out[graph.outputs[0]]
        worst = max(worst, int(np.max(np.abs(out.astype(np.int32) - clean))))
    return float(worst)


class Oracle:
    """The reference's answers on the check batch, and the head that turns features into
    logits for the top-1 check (numpy for a dense head, else MXNet; loaded on first use)."""

    def __init__(self, bundle: Any, x: np.ndarray, *,
                 logits: Callable[[np.ndarray], np.ndarray] | None = None, chunk: int = ORACLE_CHUNK,
                 graph: Any = None, calibration: np.ndarray | None = None) -> None:
        from .engines.reference import QGraphRunner

        self.chunk = max(1, chunk)  # samples per run of the reference and the fp32 model (their peak memory)
        self.runner = QGraphRunner(bundle.qgraph() if graph is None else graph)
        graph = self.runner.graph
        tout = graph.tensor(graph.outputs[0])
        self.x = x
        self.q = quantized_input(self.runner, x) if self.runner.int8_io else None
        self.out_scale = float(tout.scale[0]) if tout.scale is not None else 1.0
        # task level: top-1 vs the fp32 model on the bundle's calibration samples
        calib = bundle.calibration() if calibration is None else calibration  # `calibration`: already read
        self.samples = np.ascontiguousarray(calib[:AGREEMENT_MAX_SAMPLES])
        self.ref_samples: np.ndarray | None = None
        self._fp32: np.ndarray | None = None
        self._sensitivity: float | None = None
        prefix = len(x) <= len(self.samples) and np.array_equal(x, self.samples[:len(x)])
        answers = self._stored_answers(bundle) if prefix and len(self.samples) >= AGREEMENT_MIN_SAMPLES else None
        self.answers_stored = answers is not None
        if answers is not None:  # computed where the bundle was made (oracle_answers.py)
            self.int8, self._fp32 = answers.ref_int8[:len(x)], answers.fp32
            self.ref_samples = self.runner.float_output(answers.ref_int8)
            self._sensitivity = answers.sensitivity
            self.float = self.ref_samples[:len(x)]
        else:
            self.int8 = in_chunks(self.runner.run_int8, self.q, self.chunk) if self.q is not None else None
            task_level_runs = len(self.samples) >= AGREEMENT_MIN_SAMPLES and importlib.util.find_spec("onnx") is not None
            if task_level_runs and prefix:
                # the check batch is the first calibration samples (check_batch_for): one reference
                # run answers both (the reference is ~75x the native engine's cost per image)
                self.ref_samples = in_chunks(self.runner.run, self.samples, self.chunk)
                self.float = self.ref_samples[:len(x)]
            else:
                self.float = in_chunks(self.runner.run, x, self.chunk)
        head = logits or _head_logits(bundle)
        # in chunks too: a tail of convolutions over all AGREEMENT_MAX_SAMPLES at once held
        # ~36 MB (digits, depth 2) where its prefix's own runs held a few
        self._logits: Callable[[np.ndarray], np.ndarray] = lambda features: in_chunks(head, features, self.chunk)
        # the check batch is the calibration samples' first (`prefix`): their logits, and which
        # of them are decided at one step, are the first of the task level's, computed once
        # (with the step memo below: both engines' checks in a digits first job at depth 4 went
        # from 0.71-0.85 to 0.49-0.63 CPU-s)
        self._samples_logits = self._logits(self.ref_samples) if prefix and self.ref_samples is not None else None
        self.ref_logits = (self._samples_logits[:len(x)] if self._samples_logits is not None
                           else self._logits(self.float))
        self._decided_at: dict[float, np.ndarray] = {}  # steps -> the check batch's decided samples
        self.top1 = self.ref_logits.argmax(axis=1)
        self.decided_samples: int | None = None
        self.inconclusive = self._task_level_evidence(bundle)  # "" when the task level decides
        self.task_level = not self.inconclusive

    def _stored_answers(self, bundle: Any) -> OracleAnswers | None:
        """The bundle's stored answers, if they are this reference's: SPOT_CHECK_SAMPLES of
        them are recomputed here and must be equal, bit for bit."""
        answers = load_answers(bundle, len(self.samples))
        if answers is None or self.q is None:
            return None
        spot = self.runner.run_int8(self.q[:SPOT_CHECK_SAMPLES])
        if spot.shape == answers.ref_int8[:SPOT_CHECK_SAMPLES].shape and \
                np.array_equal(spot, answers.ref_int8[:SPOT_CHECK_SAMPLES]):
            return answers
        _log.warning("%s: the stored reference answers differ from this reference's on the first %d samples; "
                     "computing them here", bundle.path, SPOT_CHECK_SAMPLES)
        return None

    def _task_level_evidence(self, bundle: Any) -> str:
        """Run the task-level baseline; return why it cannot decide ("" when it can)."""
        n, need = len(self.samples), AGREEMENT_MIN_SAMPLES
        if n < need:
            return f"{n} calibration samples, the task-level check needs {need} with a decided top-1"
        # the fp32 model runs from backbone.onnx, which needs the onnx package: 32-bit ARM has
        # no wheel for it (nor MXNet)
        if self._fp32 is None and importlib.util.find_spec("onnx") is None:
            return "no onnx package here, so no fp32 model to agree with"
        if self.ref_samples is None:
            self.ref_samples = in_chunks(self.runner.run, self.samples, self.chunk)
        ref_logits = self._samples_logits if self._samples_logits is not None else self._logits(self.ref_samples)
        decided = self._decided(self.ref_samples, ref_logits, 1.0)
        self.decided_samples = int(decided.sum())
        if self._samples_logits is not None:
            self._decided_at[1.0] = decided[:len(self.x)]
        if self.decided_samples < need:
            # e.g. random weights: features ~1e-10, every sample a tie, and any engine "agrees"
            return (f"{self.decided_samples} of {n} calibration samples have a top-1 that one output step "
                    f"cannot flip; the task-level check needs {need}")
        fp32 = self._fp32 if self._fp32 is not None else in_chunks(fp32_features(bundle), self.samples, self.chunk)
        self.fp32_top1 = self._logits(fp32).argmax(axis=1)
        self.ref_agreement = top1_agreement(ref_logits.argmax(axis=1), self.fp32_top1)
        return ""

    def rounding_sensitivity(self) -> float:
        """The largest output change (int8 units) seen when ROUNDING_FLIP_RATE of every int8
        op output is moved by one unit: how much legitimate rounding differences can grow."""
        if self._sensitivity is None:
            self._sensitivity = rounding_sensitivity(self.runner.graph, self.q, self.int8)
        return self._sensitivity

    def int8_tolerance(self) -> float:
        """INT8_TOLERANCE_UNITS, or this graph's rounding sensitivity if larger, at most
        ROUNDING_SENSITIVITY_CAP."""
        return float(max(INT8_TOLERANCE_UNITS, min(self.rounding_sensitivity(), ROUNDING_SENSITIVITY_CAP)))

    def float_tolerance(self) -> float:
        """FLOAT_TOLERANCE_STEPS, scaled with the (capped) sensitivity above ~2 units: it was
        measured on nets whose rounding sensitivity is ~2."""
        sensitivity = self.int8_tolerance() if self.q is not None else 2.0
        return FLOAT_TOLERANCE_STEPS * max(1.0, sensitivity / 2.0)

    def decided(self, steps: float) -> np.ndarray:
        """Check-batch samples whose top-1 cannot flip when every feature moves by `steps`
        output steps (see _decided); once per `steps`: every engine as exact as the reference's
        own rounding (max_diff <= 1) is judged on the same samples."""
        key = float(steps)
        if key not in self._decided_at:
            self._decided_at[key] = self._decided(self.float, self.ref_logits, steps)
        return self._decided_at[key]

    def _decided(self, features: np.ndarray, ref_logits: np.ndarray, steps: float) -> np.ndarray:
        """The head's sensitivity is measured, not assumed: the reference's features are moved
        by +-steps (four random sign patterns) and a sample is a near-tie when its top-1
        margin is under twice the largest logit change seen."""
        if ref_logits.shape[1] < 2:
            return np.ones(len(features), bool)
        rng = np.random.default_rng(0)
        worst = np.zeros(len(features))
        for _ in range(4):
            delta = rng.choice(np.array([-1.0, 1.0], np.float32), size=features.shape) * (steps * self.out_scale)
            moved = self._logits((features + delta).astype(np.float32))
            worst = np.maximum(worst, np.abs(moved - ref_logits).max(axis=1))
        top2 = np.sort(ref_logits, axis=1)[:, -2:]
        return (top2[:, 1] - top2[:, 0]) > 2.0 * worst

    def images_per_check(self) -> int:
        """How many images `check` runs through an engine (its per-image cost is priced by it)."""
        if self._reuses_samples():
            return (len(self.x) if self.q is not None else 0) + len(self.samples)
        return len(self.x) * (2 if self.q is not None else 1) + (len(self.samples) if self.task_level else 0)

    def _reuses_samples(self) -> bool:
        """Whether an engine's check batch output is the first of its task-level samples' (the
        check batch is the first calibration samples, and the task level decides)."""
        return self.task_level and self._samples_logits is not None

    def _engine_samples(self, runner: Runner) -> np.ndarray:
        out = in_chunks(runner.run, self.samples, self.chunk)  # the engine's buffers sized for a chunk, not 128 samples
        if out.shape != self.ref_samples.shape:
            raise EdgeAgentError(f"output shape {out.shape}, reference {self.ref_samples.shape}")
        return out

    def check(self, runner: Runner, cand: Candidate) -> None:
        """Fill the candidate's agreement fields."""
        out_int8 = None
        if self.q is not None:
            try:
                out_int8 = runner.run_int8(self.q)
            except NotImplementedError:
                out_int8 = None
        out = None
        if self._reuses_samples():  # the check batch is the samples' first: run once, not twice
            out = self._engine_samples(runner)
            features, logits = out[:len(self.x)], self._logits(out)
        else:
            features = runner.run(self.x)
            logits = self._logits(features)
        if features.shape != self.float.shape:
            raise EdgeAgentError(f"output shape {features.shape}, reference {self.float.shape}")
        cand.inconclusive, cand.agreement_decided = self.inconclusive, self.decided_samples
        cand.basis = "task" if self.task_level else "units"
        if self.q is not None:  # priced by selection (ROUNDING_SEEDS x ROUNDING_SAMPLES runs)
            cand.rounding_sensitivity = self.rounding_sensitivity()
            cand.too_sensitive = cand.rounding_sensitivity > ROUNDING_SENSITIVITY_CAP
        if out_int8 is not None:
            cand.agreement, cand.tolerance = "int8", self.int8_tolerance()
            cand.max_diff = float(np.max(np.abs(out_int8.astype(np.int32) - self.int8.astype(np.int32))))
        else:
            cand.agreement, cand.tolerance = "float", self.float_tolerance()
            cand.max_diff = float(np.max(np.abs(features - self.float)) / self.out_scale)
        mask = self.decided(max(cand.max_diff, 1.0))
        same = logits[:len(self.x)].argmax(axis=1) == self.top1
        cand.top1_checked = int(mask.sum())
        cand.top1_match = float(same[mask].mean()) if mask.any() else None  # nothing decided: no evidence
        if not self.task_level:  # inconclusive at the task level: the unit-level rule decides
            cand.correct = bool(cand.max_diff <= cand.tolerance and cand.top1_match in (None, 1.0))
            return
        if out is None:
            out = self._engine_samples(runner)
            logits = self._logits(out)
        cand.mean_steps = float(np.mean(np.abs(out - self.ref_samples)) / self.out_scale)
        cand.agreement_samples = len(self.samples)
        cand.reference_top1_fp32 = self.ref_agreement
        cand.top1_fp32 = top1_agreement(logits.argmax(axis=1), self.fp32_top1)
        ok, _ = agreement_verdict(cand.top1_fp32, self.ref_agreement, len(self.samples))
        cand.correct = bool(ok and np.isfinite(out).all() and cand.mean_steps <= SANITY_MEAN_STEPS)


def _head_logits(bundle: Any) -> Callable[[np.ndarray], np.ndarray]:
    """The bundle head's logits: numpy for a one-dense-layer head, else its MXNet block."""
    head = None

    def logits(features: np.ndarray) -> np.ndarray:
        nonlocal head
        if head is None:
            from .head_form import dense_head_logits

            head = dense_head_logits(bundle) or _mxnet_head(bundle)
        return head(features).reshape(len(features), -1)

    return logits


def _mxnet_head(bundle: Any) -> Callable[[np.ndarray], np.ndarray]:
    from .mxnet_import import mxnet

    mx = mxnet()  # MXNetUnavailableError (one line, exit 69) where it cannot load: 32-bit ARM

    block = bundle.head_block()
    return lambda features: block(mx.nd.array(features)).asnumpy()


def disagreement(row: Candidate) -> str:
    """Why a candidate was found incorrect, in one line (for selection's errors and notes)."""
    if row.top1_fp32 is not None and row.reference_top1_fp32 is not None:
        return (f"top-1 agreement with fp32 {row.top1_fp32:.1%} vs the reference's {row.reference_top1_fp32:.1%} "
                f"on {row.agreement_samples} samples, mean {row.mean_steps:.3g} steps off")
    if row.max_diff is not None:
        top1 = f"top-1 {row.top1_match}" if row.top1_match is not None else "top-1 inconclusive (no decided sample)"
        why = f"; task level inconclusive: {row.inconclusive}" if row.inconclusive else ""
        return f"{row.agreement} max {row.max_diff:.3g}/{row.tolerance:g}, {top1}{why}"
    return "no agreement figures"


def evidence_notes(row: Candidate) -> list[str]:
    """What a reader must know about how `row` was judged: an inconclusive task-level check
    (judged by units instead), a graph too sensitive for units to judge. Empty when the
    task-level check decided on a graph units can also judge."""
    notes = []
    if row.inconclusive:
        notes.append(f"{row.name}: task-level agreement inconclusive ({row.inconclusive}); "
                     f"judged by the unit-level comparison instead")
    if row.too_sensitive and row.rounding_sensitivity is not None:
        then = ("task-level agreement decides alone" if row.basis == "task" else
                f"an engine more than {ROUNDING_SENSITIVITY_CAP:g} units off cannot be accepted without a "
                "conclusive task-level check")
        notes.append(f"{row.name}: this graph is too sensitive to judge an engine by units (a one-unit rounding "
                     f"flip in {ROUNDING_FLIP_RATE:.0%} of every op's outputs moves it by "
                     f"{row.rounding_sensitivity:g} units, cap {ROUNDING_SENSITIVITY_CAP:g}); {then}")
    return notes
