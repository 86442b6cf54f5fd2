"""What int8 engine selection and a prepared engine add to a job's memory, predicted before
anything is prepared. The depth planner (train/depth_plan.py) counts it in a job's peak
RSS; selection (selection_measure.py) skips a candidate whose prepare would take the process
over the profile's training memory cap, and runs its oracle in chunks that fit under it.

One figure of the bundle view carries most of it: its int8 prefix's activations, the
elements per sample of every activation tensor, input included (`prefix_shape`). The
reference and the fp32 runner keep each layer's output of a chunk until the chunk is done.

    selection = before + max(oracle, engines)      (the oracle's garbage is trimmed before the engines)
    before    = SELECTION_FIXED_MB + CALIBRATION_COPIES x calibration MB
                + PROBE_SAMPLES x prefix activations x PROBE_BYTES   (the probe's reference run)
    oracle    = ORACLE_FIXED_MB + max(chunk, ROUNDING_SAMPLES)
                                  x max(prefix activations x ORACLE_BYTES, tail activations x TAIL_BYTES)
                (with the answers in the bundle: ORACLE_FIXED_MB + max(SPOT_CHECK_SAMPLES x prefix
                 activations x ORACLE_BYTES, chunk x tail activations x TAIL_BYTES))
    engines   = the candidates selection prepares, in its order, at the job's threads, and the
                cheap ones again at each fewer thread count (its thread variants)
    engine    = [its runtime_mb_hint] + its prepare_mb_hint
                + batch x prefix activations x its run_bytes_per_activation [x threads]
    cached    = CACHED_CALIBRATION_COPIES x calibration MB + the cached engine's, runtime included

A selection's probe checks every candidate's availability, which loads the runtimes (they
are in SELECTION_FIXED_MB). A candidate whose memory (MEMORY_MARGIN more) would take the
process over the cap is not prepared (nor counted). The oracle's chunk is ORACLE_CHUNK
samples, fewer when that many would not fit (its rounding-sensitivity run holds
ROUNDING_SAMPLES whatever the chunk).

Fitted on a 2-core x86 VM (AVX-512, glibc 2.36; peak RSS from PeakWatch, jobs at 2 threads):
a fresh selection added 23-26 MB (digits CNN, depth 0; 31 at depth 2) and 187-197 MB (camera
MobileNetV2 0.5 at 96x96, 4-depth bundle, depths 0-4: 0.93-0.97 M activations per sample, 128
calibration samples of 108 KB), 450 MB with mxnet-onednn prepared; its oracle 37 and 135 MB
above its start at chunks of 8 and 32 MobileNetV2 samples; a cached choice 4.5 and 48 MB. A
device learns its own scale of these figures (train/job_depth.py).
"""

from __future__ import annotations

import io
import math
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .agreement import ORACLE_CHUNK, ROUNDING_SAMPLES
from .oracle_answers import SPOT_CHECK_SAMPLES

# what the probe leaves besides its samples (the engines' availability checks load their
# runtimes; the bundle's graph): 7.6 MB on the digits CNN (native and tflite), whose samples
# and activations are tiny
SELECTION_FIXED_MB = 8.0
# the calibration set is read by the check batch and the predictor before the oracle, each a copy
CALIBRATION_COPIES = 2
CACHED_CALIBRATION_COPIES = 2  # the re-check's batch and the engine's fingerprint
PROBE_BYTES = 4.1  # the reference's, per activation element (engines/reference.py)
ORACLE_FIXED_MB = 10.0  # onnx and the fp32 graph: 15 MB for the digits CNN, whose activations are tiny
# fp32 activations (4 B) kept per element, and the op in hand's temporaries: 4.1 MB per
# MobileNetV2 sample (0.97 M activations) from chunks of 8 to 32
ORACLE_BYTES = 4.4
# a tail of convolutions in numpy (the oracle's head): im2col for a 3x3 kernel holds 9x its
# input; 143 KB per sample for the digits CNN's 8,298 tail activations at depth 2
TAIL_BYTES = 16.0
# what a first job still holds once selection is over and the heap trimmed (the engines'
# runtimes, onnx): 24-25 MB on both bundles
SELECTION_RESIDUAL_MB = 25.0
MXNET_ENGINE = "mxnet-onednn"  # imports MXNet, which stays for the rest of the job
# Under a cap, what is prepared or run must fit with this much to spare: the engines' figures
# are a few MB off either way (timing's first runs of the thread variants allocate more than
# their prepares show). Under a 200 MB cap the camera MobileNetV2's first job (predicted 198
# MB) peaked at 211-221 MB without it; with it (the oracle in 8s, predicted 186) at 208.
MEMORY_MARGIN = 1.25


@dataclass(frozen=True)
class PrefixShape:
    """What the memory of a bundle view's int8 prefix scales with."""

    activations: int  # elements per sample of the int8 prefix's activation tensors, input included
    tail_activations: int  # the trainable tail's (the manifest's depth costs)
    calibration_mb: float  # the stored calibration samples, as loaded (float32)
    answers_stored: bool = False  # the bundle carries the oracle's answers for this prefix (oracle_answers.py)


@dataclass
class SelectionMemory:
    """A fresh selection's predicted peak above the process at its start, and why."""

    peak_mb: float
    oracle_mb: float
    oracle_chunk: int
    prepared: list[str] = field(default_factory=list)  # the engines counted, in selection's order
    refused: dict[str, str] = field(default_factory=dict)  # engine -> why it would not be prepared

    @property
    def imports_mxnet(self) -> bool:
        return MXNET_ENGINE in self.prepared


def prefix_shape(bundle: Any, graph: Any = None) -> PrefixShape:
    """The bundle view's figures (`graph`: its QGraph when already parsed). The prefix's
    activation count comes from the manifest where `model create` recorded it: parsing every
    depth's prefix to plan a job was ~0.5 of its ~4 CPU-s (camera MobileNetV2, 5 depths)."""
    from .bundle import CALIBRATION, ORACLE

    depths = bundle.manifest.depths
    activations = prefix_figures(bundle, graph)["prefix_activations"]
    tail = int(depths[bundle.depth].costs.get("tail_activations", 0)) if depths else 0
    try:  # the array's size from the zip's directory: nothing decompressed
        with zipfile.ZipFile(io.BytesIO(bundle.read(CALIBRATION))) as zf:
            calibration = sum(i.file_size for i in zf.infolist()) / 2**20
    except (OSError, zipfile.BadZipFile):  # a broken file fails later, where it is loaded
        calibration = 0.0
    return PrefixShape(int(activations), tail, calibration, bundle.has(ORACLE))


PREFIX_FIGURES = ("prefix_activations", "prefix_largest_activation")


def count_activations(graph: Any) -> dict[str, int]:
    """An int8 QGraph's activation elements per sample, in all and in its largest tensor."""
    sizes = [math.prod(t.shape[1:]) for t in graph.tensors.values() if not t.is_constant]
    return {"prefix_activations": int(sum(sizes)), "prefix_largest_activation": int(max(sizes, default=0))}


def prefix_figures(bundle: Any, graph: Any = None) -> dict[str, int]:
    """count_activations of the bundle view's prefix: from the manifest where `model create`
    recorded them, else (an older bundle, or `graph` given) from its parsed graph."""
    depths = bundle.manifest.depths
    stored = depths[bundle.depth].costs if depths and graph is None else {}
    if all(stored.get(k) for k in PREFIX_FIGURES):
        return {k: int(stored[k]) for k in PREFIX_FIGURES}
    return count_activations(bundle.qgraph() if graph is None else graph)


def _per_sample_mb(shape: PrefixShape) -> float:
    return max(shape.activations * ORACLE_BYTES, shape.tail_activations * TAIL_BYTES) / 2**20


def oracle_mb(shape: PrefixShape, chunk: int) -> float:
    """The oracle's peak above its start: the reference's and the fp32 runner's chunk of
    samples (and the head's logits over one), onnx. With the answers stored, only the
    reference's spot check and the head's chunks run (measured on the camera MobileNetV2's
    first job at depth 4: 210 MB where 304 MB had been predicted for computing them)."""
    if shape.answers_stored:
        return ORACLE_FIXED_MB + max(SPOT_CHECK_SAMPLES * shape.activations * ORACLE_BYTES,
                                     chunk * shape.tail_activations * TAIL_BYTES) / 2**20
    return ORACLE_FIXED_MB + max(chunk, ROUNDING_SAMPLES) * _per_sample_mb(shape)


def oracle_chunk(shape: PrefixShape, headroom_mb: float | None) -> int:
    """ORACLE_CHUNK samples at a time, or fewer when that many would not fit in `headroom_mb`
    (with MEMORY_MARGIN to spare)."""
    if headroom_mb is None or oracle_mb(shape, ORACLE_CHUNK) * MEMORY_MARGIN <= headroom_mb:
        return ORACLE_CHUNK
    per_sample = _per_sample_mb(shape)
    fits = (headroom_mb / MEMORY_MARGIN - ORACLE_FIXED_MB) // per_sample if per_sample > 0 else ORACLE_CHUNK
    return int(max(1, min(ORACLE_CHUNK, fits)))


def engine_mb(engine: Any, shape: PrefixShape, batch: int, *, threads: int = 1, runtime_loaded: bool = False) -> float:
    """What `engine` adds prepared with `threads` and running batches of `batch` samples (its
    class's hints; the interface's for an object without them); `runtime_loaded`: its
    availability was checked in this process, which loaded its runtime."""
    from .engine import Int8Engine

    hint = getattr(engine, "memory_mb_hint", None)
    if hint is None:  # an object without the interface's hints
        runtime = 0.0 if runtime_loaded else Int8Engine.runtime_mb_hint
        per_run = batch * shape.activations * Int8Engine.run_bytes_per_activation / 2**20
        return runtime + Int8Engine.prepare_mb_hint + per_run
    return float(hint(shape.activations, batch, threads=threads, runtime_loaded=runtime_loaded))


def over_cap(name: str, need_mb: float, now_mb: float | None, cap_mb: float | None) -> str | None:
    """Why an engine needing `need_mb` (MEMORY_MARGIN more, to be safe) is not prepared in a
    process holding `now_mb` under the cap, or None."""
    if cap_mb is None or now_mb is None or now_mb + need_mb * MEMORY_MARGIN <= cap_mb:
        return None
    return (f"{name} would need ~{need_mb:.0f} MB (predicted) beside the ~{now_mb:.0f} MB the process holds: "
            f"over the {cap_mb:g} MB training memory cap")


def selection_mb(shape: PrefixShape, engines: Sequence[tuple[str, Any]], *, batch: int, threads: int = 1,
                 start_mb: float | None = None, cap_mb: float | None = None) -> SelectionMemory:
    """A fresh selection's peak above the process at its start (`start_mb`), preparing
    `engines` in order (cheapest to prepare first, as selection does; the caller leaves out
    those it will not prepare: the reference when another engine runs, one too dear for the
    job) at `threads` and the cheap ones at fewer, skipping each that would go over `cap_mb`."""
    from .selection_measure import PROBE_SAMPLES, VARIANT_PREPARE_MAX_S

    before = (SELECTION_FIXED_MB + CALIBRATION_COPIES * shape.calibration_mb
              + PROBE_SAMPLES * shape.activations * PROBE_BYTES / 2**20)
    headroom = None if cap_mb is None or start_mb is None else cap_mb - start_mb - before
    chunk = oracle_chunk(shape, headroom)
    out = SelectionMemory(0.0, oracle_mb(shape, chunk), chunk)
    held = 0.0
    for name, engine in engines:
        cheap = float(getattr(engine, "prepare_cpu_s_hint", 1.0)) < VARIANT_PREPARE_MAX_S
        for t in range(threads, 0 if cheap else threads - 1, -1):  # the job's threads, then the variants
            need = engine_mb(engine, shape, max(batch, chunk), threads=t, runtime_loaded=True)
            why = over_cap(name, need, None if start_mb is None else start_mb + before + held, cap_mb)
            if why:
                if t == threads:
                    out.refused[name] = why
                break
            if t == threads:
                out.prepared.append(name)
            held += need
    if engines and not out.prepared:  # selection prepares the lightest all the same (selection_measure._over_the_cap)
        name, engine = min(engines, key=lambda ne: engine_mb(ne[1], shape, max(batch, chunk), threads=threads,
                                                             runtime_loaded=True))
        out.refused.pop(name, None)
        out.prepared.append(name)
        held = engine_mb(engine, shape, max(batch, chunk), threads=threads, runtime_loaded=True)
    out.peak_mb = before + max(out.oracle_mb, held)
    return out


def cached_mb(shape: PrefixShape, engine: Any, batch: int, threads: int = 1) -> float:
    """A cached choice's re-check and the features through it: its engine at the job's batch
    and its threads."""
    return CACHED_CALIBRATION_COPIES * shape.calibration_mb + engine_mb(engine, shape, batch, threads=threads)
