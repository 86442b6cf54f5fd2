"""The oracle's answers travel with the bundle (`oracle.npz`), computed where it is made.

Judging an engine (agreement.py) needs the bit-exact reference's output and the fp32
model's features on the bundle's calibration samples: on the camera MobileNetV2 bundle that
was ~4.5 of a fresh device's ~7 CPU-seconds of engine selection, the same numbers on every
device -- the reference is integer arithmetic, and the fp32 features only feed a top-1. So
`create_bundle` computes them once and stores them; a device checks they belong to this
bundle (the int8 backbone's and the calibration file's sha256 are inside, and the manifest
pins the file's own hash), re-runs the reference on SPOT_CHECK_SAMPLES samples to confirm
they are this reference's answers, and uses them. Anything that does not hold -- another
backbone, a malformed file -- means the device computes them itself, as before. The file
holds the reference's int8 output, not its float features as well: those are exactly the int8
output dequantised, and were 27 % of each depth's file (the demo's first round sent every
device 1.5 MB of answers).

A multi-depth bundle carries answers for each depth's prefix (`depth<k>-oracle.npz`; the
first job at a depth paid ~4.8 of its ~8 CPU-s of selection for them on the camera
MobileNetV2). Each is bound to its own int8 prefix: a federated version that changes a
weight inside a prefix re-quantises that prefix (requantize.refresh_prefixes, which drops
its answers), and one that changes weights only in a depth's tail leaves the prefix's int8
and fp32 answers as they were.
"""

from __future__ import annotations

import io
import logging
import zipfile
from dataclasses import dataclass
from typing import Any

import numpy as np

from .bundle import BACKBONE_INT8, BACKBONE_ONNX, CALIBRATION, MAX_FILE_BYTES, ORACLE, depth_file

_log = logging.getLogger(__name__)

SPOT_CHECK_SAMPLES = 2
# Each depth's fp32 answers patch and import the whole fp32 backbone once more while `model
# create` runs: on a 31 MB all-weights net with 3 depths that took create from imports + 85 MB
# to imports + 139 MB, over test_zoo_memory's bound; larger backbones' devices compute them
MULTI_DEPTH_MAX_BYTES = 16 << 20
_KEYS = {"ref_int8", "fp32", "sensitivity", "backbone_sha256", "calibration_sha256"}
# bundles made before 2026-12-07 also hold the reference's float features, `ref`: exactly its
# int8 output dequantised (QGraphRunner.float_output), 27 % of a depth's file; read and ignored
_LEGACY_KEYS = _KEYS | {"ref"}


@dataclass(frozen=True)
class OracleAnswers:
    ref_int8: np.ndarray  # the reference's int8 output (NHWC) on calibration[:n]
    fp32: np.ndarray  # the fp32 backbone's features on the same samples
    sensitivity: float  # agreement.rounding_sensitivity of the int8 graph


def compute_all(bundle: Any) -> dict[str, bytes]:
    """The answers files of a written bundle: oracle.npz, and one per depth of a multi-depth
    bundle whose fp32 backbone is at most MULTI_DEPTH_MAX_BYTES (none where they do not
    apply: float I/O)."""
    if bundle.manifest.depths and bundle.manifest.files[BACKBONE_ONNX].size > MULTI_DEPTH_MAX_BYTES:
        _log.info("%s: no oracle answers for a multi-depth bundle of a %d-byte backbone (over %d): its devices "
                  "compute them", bundle.path, bundle.manifest.files[BACKBONE_ONNX].size, MULTI_DEPTH_MAX_BYTES)
        return {}
    views = [bundle.at_depth(k) for k in range(len(bundle.manifest.depths))] if bundle.manifest.depths else [bundle]
    out = {}
    for k, view in enumerate(views):
        answers = compute(view)
        if answers is not None:
            out[depth_file(k, ORACLE)] = answers
    return out


def compute(bundle: Any) -> bytes | None:
    """oracle.npz for a written bundle or one of its depth views (None for float I/O)."""
    from .agreement import AGREEMENT_MAX_SAMPLES, in_chunks, quantized_input, rounding_sensitivity
    from .engine_cost import fp32_features
    from .engines.reference import QGraphRunner

    runner = QGraphRunner(bundle.qgraph())
    if not runner.int8_io:
        return None
    samples = np.ascontiguousarray(bundle.calibration()[:AGREEMENT_MAX_SAMPLES])
    q = quantized_input(runner, samples)
    ref_int8 = in_chunks(runner.run_int8, q)
    arrays = {
        "ref_int8": ref_int8,
        "fp32": in_chunks(fp32_features(bundle), samples).astype(np.float32),
        "sensitivity": np.float64(rounding_sensitivity(runner.graph, q, ref_int8)),
        "backbone_sha256": np.str_(bundle.manifest.files[BACKBONE_INT8].sha256),
        "calibration_sha256": np.str_(bundle.manifest.files[CALIBRATION].sha256),
    }
    out = io.BytesIO()
    np.savez_compressed(out, **arrays)
    return out.getvalue()


def load(bundle: Any, n_samples: int) -> OracleAnswers | None:
    """The stored answers for this bundle's first `n_samples` calibration samples, or None
    (absent, not for this view, or unusable: a warning says why)."""
    if not bundle.has(ORACLE):
        return None
    try:
        return _parse(bundle, bundle.read(ORACLE), n_samples)
    except (ValueError, OSError, EOFError, KeyError, zipfile.BadZipFile) as exc:
        _log.warning("%s: %s not used (%s); the device computes the reference's answers itself",
                     bundle.path, ORACLE, str(exc)[:200])
        return None


def _parse(bundle: Any, data: bytes, n: int) -> OracleAnswers:
    with zipfile.ZipFile(io.BytesIO(data)) as zf:  # declared sizes bound what will inflate
        total = sum(i.file_size for i in zf.infolist())
        if total > MAX_FILE_BYTES:
            raise ValueError(f"{total} bytes uncompressed")
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        if set(npz.files) not in (_KEYS, _LEGACY_KEYS):
            raise ValueError(f"arrays {sorted(npz.files)[:8]}, expected {sorted(_KEYS)}")
        arrays = {k: npz[k] for k in _KEYS}
    files = bundle.manifest.files
    if str(arrays["backbone_sha256"]) != files[BACKBONE_INT8].sha256 or \
            str(arrays["calibration_sha256"]) != files[CALIBRATION].sha256:
        raise ValueError("made for another backbone or calibration set")
    ref_int8, fp32 = arrays["ref_int8"], arrays["fp32"]
    if fp32.dtype != np.float32 or ref_int8.dtype != np.int8:
        raise ValueError(f"dtypes {ref_int8.dtype}, {fp32.dtype}")
    if not n <= len(ref_int8) == len(fp32) or ref_int8.ndim < 2 or fp32.ndim < 2:
        raise ValueError(f"shapes {ref_int8.shape}, {fp32.shape} for {n} samples")
    ref_int8, fp32 = ref_int8[:n], fp32[:n]  # the same samples (the calibration's sha256)
    sensitivity = float(arrays["sensitivity"])
    if not (np.isfinite(fp32).all() and np.isfinite(sensitivity) and sensitivity >= 0):
        raise ValueError("non-finite values")
    return OracleAnswers(ref_int8, fp32, sensitivity)
