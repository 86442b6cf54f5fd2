"""Helpers shared by the engines: layout and (de)quantisation at the model's edges.

Runners take NCHW float32 (the bundle's input layout) and return features in the model's
layout (NCHW, or 2-D), like MXNet. The int8 model is NHWC inside, as TFLite is.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os
from typing import Any

import numpy as np

from ...errors import EdgeAgentError
from ..quant_math import dequantize, quantize

__all__ = ["EngineError", "check_batch", "dequantize", "interpreter_module", "nchw_to_nhwc",
           "nhwc_to_nchw", "quantize", "quantize_to_nhwc", "thread_count", "usable_cpus"]


class EngineError(EdgeAgentError):
    """An engine could not prepare or run a model (the reason is in the message)."""


def nchw_to_nhwc(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.transpose(0, 2, 3, 1)) if x.ndim == 4 else x


def nhwc_to_nchw(y: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(y.transpose(0, 3, 1, 2)) if y.ndim == 4 else y


@functools.cache
def _native_kernels() -> Any:
    """The native kernels for quantize_to_nhwc, or None where the library does not load."""
    from ..native import NativeKernels, NativeUnavailableError

    try:
        return NativeKernels()
    except NativeUnavailableError:
        return None


def quantize_to_nhwc(x: np.ndarray, scale: float, zero_point: int) -> np.ndarray:
    """float32 NCHW (or 2-D) -> int8 NHWC: quant_math.quantize after nchw_to_nhwc, in one C pass
    where the native kernels load (bit-exact with it, test_kernels_native), else in numpy. The
    numpy form costs ~15 ms per batch of 32 RGB 96x96 images, a third of XNNPACK's whole run of
    a MobileNetV2 0.35 there; engines other than the reference share the fast one."""
    kernels = _native_kernels()
    if kernels is not None and x.ndim in (2, 4):
        return kernels.quantize_nchw(x, scale, zero_point)
    return quantize(nchw_to_nhwc(x), scale, zero_point)


def check_batch(batch: np.ndarray, shape: tuple[int, ...], what: str) -> np.ndarray:
    """The runner's input contract: float32 (N, *shape) with N >= 1."""
    batch = np.asarray(batch)
    if batch.ndim != len(shape) + 1 or tuple(batch.shape[1:]) != tuple(shape) or batch.shape[0] < 1:
        raise ValueError(f"{what}: batch shape {batch.shape}, expected (N, {', '.join(map(str, shape))})")
    return np.ascontiguousarray(batch, dtype=np.float32)


def usable_cpus() -> int:
    """CPUs this process may run on (affinity, not the machine's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def thread_count(requested: int | None) -> int:
    """Requested threads capped at the usable CPUs: oversubscribing spin-waiting thread pools
    (XNNPACK's, OpenMP's) is catastrophic (4 XNNPACK threads on 2 cores: 100x slower)."""
    cpus = usable_cpus()
    return cpus if not requested or requested < 1 else min(int(requested), cpus)


def interpreter_module() -> tuple[Any, str]:
    """The TFLite Interpreter module: tflite-runtime, or ai-edge-litert (its successor)."""
    errors = []
    for module, dist in (("tflite_runtime.interpreter", "tflite-runtime"),
                         ("ai_edge_litert.interpreter", "ai-edge-litert")):
        try:
            mod = importlib.import_module(module)
        except Exception as exc:  # ImportError, or a broken native library
            errors.append(f"{module}: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            version = "unknown version"
        return mod, f"{dist} {version}"
    raise EngineError("no TFLite interpreter (pip install tflite-runtime or ai-edge-litert): " + "; ".join(errors))
