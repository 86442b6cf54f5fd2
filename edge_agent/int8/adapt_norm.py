"""The prefix adapted to the device's own camera: normalisation statistics re-estimated on
its images (AdaBN, Li et al. 2016), then the int8 prefix re-quantised on the device.

A camera shifts the low-level statistics of what the network sees (blur, gamma, tint,
noise); a trainable tail cannot undo that, because only the frozen int8 prefix sees the
pixels. BatchNorm's running mean and variance are the network's record of those
statistics: estimating them again on the device's images re-centres every layer on the
device's data, with no backward pass and no label.

The import folds every BatchNorm (gamma, beta, running mean mu, std sigma) into its
producer, which then outputs z = gamma (c - mu) / sigma + beta for the raw output c (its
(gamma, beta) kept in FloatOp.norm). New statistics (mu', sigma') of c on the device's
images give gamma (c - mu') / sigma' + beta, which in terms of z is, per channel,

    z' = |gamma| (z - m) / s + beta        m, s: the device's mean and std of z

an affine map that folds into the same weights and bias; on the data the statistics came
from it is the identity. The first ADAPT_LAYERS normalised layers are adapted, in
topological order, each on the outputs of the adapted layers before it; the layers after
them keep the bundle's statistics (their inputs are the adapted ones). The adapted float
prefix is quantised again with the device's images as calibration (quantize.py, the
coordinator's code for the same step) and served as a bundle view whose int8 prefix is the
adapted one (`adapted_view`).

Why only the first layers: a camera (blur, gamma, tint, noise) moves the low-level
statistics, where measure_shift reads it; deeper statistics describe what the images show,
and re-estimated on one device's share -- a few classes, 40-140 images -- they move with the
classes it holds. Held-out accuracy after a depth-4 fine-tune on bench_depth's eight
devices (camera digits and textures, each with a strongly shifted camera; 4 seeds, mean):
every layer adapted 0.751 / 0.617 (digits / textures), the first 4 0.775 / 0.616, the first
8 0.762 / 0.619, none 0.744 / 0.591. Every layer did best only on the strongly
shifted digits camera (0.735 against 0.706 for the first 4) and cost the three digits field
cameras 2-7 points against the first 4.

`measure_shift` is the cheap half: the same statistics at the first few normalised layers
on a few images, as a distance from the statistics the bundle was built with (0 on the
data it came from). The planner reads it to decide whether adapting pays.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .float_graph import FloatGraph, FloatOp
from .float_ops import apply_activation, run_op

ADAPT_MAX_IMAGES = 64  # camera digits: 64 adapt as well as 256 (32 do not), at a quarter of the memory
CALIBRATION_MAX_IMAGES = 128
SHIFT_LAYERS = 4  # where a camera's shift shows: the first normalised layers
ADAPT_LAYERS = SHIFT_LAYERS  # and the layers adapted to it (module doc)
SHIFT_IMAGES = 32
RUN_CHUNK = 8  # images per op call in the statistics pass
STATS_ROWS = 1 << 14
VAR_FLOOR = 1e-6  # a channel (nearly) constant on the device's images keeps its statistics
_OUT_AXIS = {"CONV_2D": 0, "DEPTHWISE_CONV_2D": 3, "FULLY_CONNECTED": 0}


@dataclass(frozen=True)
class LayerShift:
    op: str
    mean_shift: float  # mean over channels of |m - beta| / |gamma|
    scale_shift: float  # mean over channels of |log(s / |gamma|)|

    @property
    def distance(self) -> float:
        return self.mean_shift + self.scale_shift


@dataclass(frozen=True)
class ShiftReport:
    layers: tuple[LayerShift, ...]
    images: int

    @property
    def distance(self) -> float:
        """The mean over the layers measured: 0 where the device's data looks like the
        data the statistics came from; a strong camera shift is above 1."""
        return float(np.mean([layer.distance for layer in self.layers])) if self.layers else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"distance": round(self.distance, 4), "images": self.images,
                "layers": [{"op": s.op, "mean_shift": round(s.mean_shift, 4), "scale_shift": round(s.scale_shift, 4)}
                           for s in self.layers]}


ADAPT_FIXED_MB = 20.0  # onnx, the fp32 graph and its adapted copy
LIVE_ACTIVATIONS = 2.5  # the largest activation's copies alive at once in the pass (input, output, a residual)


def adapt_mb(view: Any, images: int) -> float:
    """The adapting pass's predicted peak above its start for bundle view `view` on `images`
    images: measured on MobileNetV2 w0.5 96x96 (64 images) +81 MB, predicted 91. The largest
    activation comes from the manifest where recorded (the planner asks at every depth)."""
    from .engine_memory import prefix_figures

    largest = prefix_figures(view)["prefix_largest_activation"]
    return ADAPT_FIXED_MB + images * largest * 4 * LIVE_ACTIVATIONS / 2**20


def normalised_layers(graph: FloatGraph) -> int:
    return sum(op.norm is not None for op in graph.ops)


def _last_uses(graph: FloatGraph) -> dict[str, int]:
    last = {graph.input: -1}
    for i, op in enumerate(graph.ops):
        for name in op.inputs:
            last[name] = i
    last[graph.output] = len(graph.ops)
    return last


def _channel_stats(z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and variance of `z` (.., C), in float64 over blocks of rows: a
    float64 copy of a whole camera-sized activation would double the pass's memory."""
    flat = z.reshape(-1, z.shape[-1])
    total, squares = np.zeros(flat.shape[1]), np.zeros(flat.shape[1])
    for i in range(0, len(flat), STATS_ROWS):
        block = flat[i:i + STATS_ROWS].astype(np.float64)
        total += block.sum(axis=0)
        squares += np.einsum("ij,ij->j", block, block)
    mean = total / max(len(flat), 1)
    return mean, np.maximum(squares / max(len(flat), 1) - mean * mean, 0.0)


def _shift(op: FloatOp, mean: np.ndarray, var: np.ndarray) -> LayerShift:
    gamma, beta = (np.abs(op.norm[0]).astype(np.float64), op.norm[1].astype(np.float64))
    live = (gamma > 1e-6) & (var > VAR_FLOOR)
    if not live.any():
        return LayerShift(op.name, 0.0, 0.0)
    g = gamma[live]
    return LayerShift(op.name, float(np.mean(np.abs(mean[live] - beta[live]) / g)),
                      float(np.mean(np.abs(np.log(np.sqrt(var[live]) / g)))))


def _adapted(op: FloatOp, mean: np.ndarray, var: np.ndarray) -> tuple[FloatOp, np.ndarray, np.ndarray]:
    """`op` with the device's statistics folded in; returns it and the per-channel (a, c) of
    z' = a z + c (identity for the channels left alone)."""
    gamma, beta = np.abs(op.norm[0]).astype(np.float64), op.norm[1].astype(np.float64)
    keep = (gamma <= 1e-6) | (var <= VAR_FLOOR)
    a = np.where(keep, 1.0, gamma / np.sqrt(np.maximum(var, VAR_FLOOR)))
    c = np.where(keep, 0.0, beta - a * mean)
    shape = [1] * op.weight.ndim
    shape[_OUT_AXIS[op.kind]] = -1
    weight = (op.weight * a.reshape(shape)).astype(np.float32)
    bias = (op.bias * a + c).astype(np.float32)
    return dataclasses.replace(op, weight=weight, bias=bias), a.astype(np.float32), c.astype(np.float32)


def _activate_in_place(z: np.ndarray, act: str) -> np.ndarray:
    if act == "RELU":
        np.maximum(z, 0.0, out=z)
    elif act == "RELU6":
        np.clip(z, 0.0, 6.0, out=z)
    elif act != "NONE":
        return apply_activation(z, act)
    return z


def _run(op: FloatOp, inputs: list[np.ndarray], options: dict[str, Any]) -> np.ndarray:
    """One op on every image, RUN_CHUNK images at a time into one output array: a
    convolution's taps over a whole batch of camera-sized images would take several times
    the activations' memory."""
    n = len(inputs[0])
    first = run_op(op.kind, [v[:RUN_CHUNK] for v in inputs], options, op.weight, op.bias)
    if n <= RUN_CHUNK:
        return first
    out = np.empty((n, *first.shape[1:]), first.dtype)
    out[:RUN_CHUNK] = first
    del first
    for i in range(RUN_CHUNK, n, RUN_CHUNK):
        out[i:i + RUN_CHUNK] = run_op(op.kind, [v[i:i + RUN_CHUNK] for v in inputs], options, op.weight, op.bias)
    return out


def _walk(graph: FloatGraph, x: np.ndarray, *, adapt: int = 0, measure: int | None = None,
          ranges: dict[str, tuple[float, float]] | None = None) -> tuple[list[FloatOp], list[LayerShift]]:
    """Run the graph on `x` (NCHW float32): op by op over every image up to its `measure`-th
    normalised op (default: `adapt`), each of those measured (its shift) and the first
    `adapt` given the device's statistics; then, only when `ranges` is given, the ops after
    it (the graph's own) RUN_CHUNK images at a time through all of them. `ranges` receives
    every tensor's (min, max) as the walk computed it (the adapted graph's). Returns the ops
    walked (the adapted ones in place) and the shifts measured."""
    if x.ndim != 4 or tuple(x.shape[1:]) != tuple(graph.input_shape[1:]):
        raise ValueError(f"images of shape {x.shape[1:]}; the prefix takes {tuple(graph.input_shape[1:])}")
    measure = adapt if measure is None else measure
    last = _last_uses(graph)
    values = {graph.input: np.ascontiguousarray(np.asarray(x, np.float32).transpose(0, 2, 3, 1))}
    if ranges is not None:
        ranges[graph.input] = (float(values[graph.input].min()), float(values[graph.input].max()))
    ops: list[FloatOp] = []
    shifts: list[LayerShift] = []
    for i, op in enumerate(graph.ops):
        if len(shifts) >= measure:  # nothing left to measure or adapt
            break
        inputs = [values[n] for n in op.inputs]
        if op.norm is None or op.kind not in _OUT_AXIS:
            y = _run(op, inputs, op.options)
        else:
            z = _run(op, inputs, {**op.options, "activation": "NONE"})
            mean, var = _channel_stats(z)
            shifts.append(_shift(op, mean, var))
            if len(shifts) <= adapt:
                op, a, c = _adapted(op, mean, var)
                z *= a  # in place: z is this op's own fresh output
                z += c
            y = _activate_in_place(z, op.options.get("activation", "NONE"))
        ops.append(op)
        values[op.output] = y
        if ranges is not None:
            ranges[op.output] = (float(y.min()), float(y.max()))
        for name in op.inputs:
            if last.get(name, -1) <= i:
                values.pop(name, None)
    if ranges is not None and len(ops) < len(graph.ops):
        _ranges_in_chunks(graph, len(ops), values, last, ranges)
    return ops, shifts


def _ranges_in_chunks(graph: FloatGraph, start: int, values: dict[str, np.ndarray], last: dict[str, int],
                      ranges: dict[str, tuple[float, float]]) -> None:
    """The (min, max) of every tensor from op `start` on, into `ranges`: the ops run
    RUN_CHUNK images at a time through all of them from `values` (the tensors alive before
    op `start`), so no later activation is ever held for every image (op by op, the camera
    digits' 64 images paid ~0.1 CPU-s of fresh pages for them, a fifth of the pass)."""
    n = len(next(iter(values.values())))
    for lo in range(0, n, RUN_CHUNK):
        live = {name: v[lo:lo + RUN_CHUNK] for name, v in values.items()}
        for i in range(start, len(graph.ops)):
            op = graph.ops[i]
            y = run_op(op.kind, [live[name] for name in op.inputs], op.options, op.weight, op.bias)
            live[op.output] = y
            low, high = float(y.min()), float(y.max())
            seen = ranges.get(op.output) if lo else None
            ranges[op.output] = (low, high) if seen is None else (min(seen[0], low), max(seen[1], high))
            for name in op.inputs:
                if last.get(name, -1) <= i:
                    live.pop(name, None)


def measure_shift(graph: FloatGraph, x: np.ndarray, *, layers: int = SHIFT_LAYERS,
                  images: int = SHIFT_IMAGES) -> ShiftReport:
    """How far the device's images `x` are from the statistics the prefix was built with,
    at its first `layers` normalised layers, on `images` of them spread over `x`."""
    take = np.linspace(0, len(x) - 1, min(images, len(x))).astype(np.int64) if len(x) else np.empty(0, np.int64)
    if not len(take):
        return ShiftReport((), 0)
    _, shifts = _walk(graph, np.asarray(x)[take], measure=layers)
    return ShiftReport(tuple(shifts), len(take))


def adapt_graph(graph: FloatGraph, x: np.ndarray, *, max_images: int | None = None, layers: int = ADAPT_LAYERS,
                ranges: dict[str, tuple[float, float]] | None = None) -> tuple[FloatGraph, ShiftReport]:
    """The float prefix with its first `layers` normalised layers' statistics re-estimated
    on `x` (the device's images, NCHW float32 as the model takes them), and the shift it met
    at each normalised layer it ran (after the layers before it were adapted). With `ranges`
    the whole prefix runs and they receive every tensor's (min, max) on those images through
    the adapted graph; without, the pass ends at the last adapted layer (the ops after it
    are the graph's own)."""
    take = np.linspace(0, len(x) - 1, min(max_images or ADAPT_MAX_IMAGES, len(x))).astype(np.int64)
    if len(take) < 2:
        raise ValueError("re-estimating normalisation statistics needs at least 2 images")
    layers = max(0, layers)
    ops, shifts = _walk(graph, np.asarray(x)[take], adapt=layers, ranges=ranges)
    return dataclasses.replace(graph, ops=[*ops, *graph.ops[len(ops):]]), ShiftReport(tuple(shifts), len(take))


def quantised_prefix(graph: FloatGraph, x: np.ndarray, *, method: str = "minmax", layers: int = ADAPT_LAYERS) -> bytes:
    """The float prefix `graph` adapted to the images `x` (NCHW float32 as the model takes
    them; its first `layers` normalised layers) and quantised on them: the int8 prefix's
    .tflite bytes. With min/max calibration (the default) the ranges come from the adapting
    pass itself: no second forward pass."""
    from .quantize import quantize_graph
    from .tflite_reader import read_tflite
    from .tflite_writer import write_tflite

    # min/max: the ranges from the adapting pass over the whole prefix; the histogram methods
    # run their own passes, so the adapting one ends at the last adapted layer
    ranges: dict[str, tuple[float, float]] | None = {} if method == "minmax" else None
    adapted, _ = adapt_graph(graph, x, layers=layers, ranges=ranges)
    # no bias correction here: its two passes (float and int8) over the images would cost a
    # device's adapting job more than the statistics pass itself
    if ranges is not None:
        qgraph = quantize_graph(adapted, np.empty((0, *graph.input_shape[1:]), np.float32), ranges=ranges,
                                bias_correction=False)
    else:  # histogram methods observe a larger sample in their own passes
        take = np.linspace(0, len(x) - 1, min(CALIBRATION_MAX_IMAGES, len(x))).astype(np.int64)
        qgraph = quantize_graph(adapted, np.asarray(x, np.float32)[take], method=method, batch_size=RUN_CHUNK,
                                bias_correction=False)
    tflite = write_tflite(qgraph)
    read_tflite(tflite)  # what a reader refuses must not be served
    return tflite


def adapted_view(view: Any, tflite_path: Path) -> Any:
    """`view` (a Bundle, at any depth) with the adapted int8 prefix at `tflite_path` in place
    of its own: every reader of the prefix (engines, the feature cache's key, the predictor)
    sees the adapted one. Its identity (sha256) names both."""
    from .bundle import BACKBONE_INT8, Bundle, FileEntry

    data = tflite_path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    files = dict(view.manifest.files)
    files[BACKBONE_INT8] = FileEntry(digest, len(data))
    manifest = dataclasses.replace(view.manifest, files=files)
    aliases = {**view.aliases, BACKBONE_INT8: str(tflite_path.resolve())}
    sha = hashlib.sha256(f"{view.sha256}:adapted:{digest}".encode()).hexdigest()
    return Bundle(view.path, manifest, sha, depth=view.depth, aliases=aliases)


SPOT_SAMPLES = 2
SPOT_MIN_STEPS = 3.0  # output steps: engines differ by a few (rounding of requantisation)


def prepare_adapted(adapted: Any, selection: Any, images: np.ndarray, threads: int) -> tuple[Any, str]:
    """The selected engine prepared on the adapted prefix, if it agrees there with the
    reference on SPOT_SAMPLES images (within SPOT_MIN_STEPS or twice what it differed by on
    the bundle's own prefix); else None and why. The choice was made on the bundle's prefix:
    same ops and shapes, other weights and scales, so it is re-checked, not re-measured."""
    from .engines import load_engine

    name = selection.chosen or "reference"
    runner = load_engine(name).prepare(adapted, threads=threads)
    if name == "reference":
        return runner, ""
    take = np.asarray(images[np.linspace(0, len(images) - 1, min(SPOT_SAMPLES, len(images))).astype(np.int64)])
    reference = load_engine("reference").prepare(adapted, threads=1)
    try:
        got, want = np.asarray(runner.run(take), np.float64), np.asarray(reference.run(take), np.float64)
    finally:
        reference.close()
    graph = adapted.qgraph()
    scale = float(np.asarray(graph.tensor(graph.outputs[0]).scale).reshape(-1)[0])
    row = selection.candidate(name)
    allowed = max(SPOT_MIN_STEPS, 2.0 * float(row.max_diff or 0.0) if row is not None else 0.0)
    steps = float(np.max(np.abs(got - want))) / scale if got.size else 0.0
    if steps > allowed:
        runner.close()
        return None, f"engine {name} differs from the reference by {steps:.1f} output steps on the adapted prefix"
    return runner, ""
