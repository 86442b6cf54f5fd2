"""TFLite engine: tflite-runtime's Interpreter (or ai-edge-litert's) with XNNPACK for int8.

The pip tflite-runtime 2.14 applies its default XNNPACK delegate to float ops only: the int8
(QS8) flag is off in that build, so int8 models fall back to TFLite's builtin kernels, whose
per-channel depthwise convolution is generic C on x86 (MobileNetV2-0.35 at 96x96 runs ~7x
slower than with XNNPACK). The wheel exports XNNPACK's C API, so this engine creates the
delegate itself with TFLITE_XNNPACK_DELEGATE_FLAG_QS8 through ctypes. When that API is not
there (another wheel), it falls back to the default resolver and says so.
"""

from __future__ import annotations

import ctypes
import glob
import os
from typing import Any

import numpy as np

from ..engine import Availability, Int8Engine, Runner
from ._common import (
    EngineError,
    check_batch,
    dequantize,
    interpreter_module,
    nchw_to_nhwc,
    nhwc_to_nchw,
    quantize_to_nhwc,
    thread_count,
)

XNNPACK_FLAG_QS8 = 0x1  # TFLITE_XNNPACK_DELEGATE_FLAG_QS8 (xnnpack_delegate.h)


class _XnnpackOptions(ctypes.Structure):
    # The leading fields of TfLiteXNNPackDelegateOptions (stable since TF 2.5). The struct is
    # filled by TfLiteXNNPackDelegateOptionsDefault (returned through a hidden pointer, as any
    # struct over 16 bytes is on x86-64 and AArch64), so the padding keeps whatever fields a
    # newer runtime appends, and only num_threads and flags are changed.
    _fields_ = [("num_threads", ctypes.c_int32), ("flags", ctypes.c_uint32),
                ("weights_cache", ctypes.c_void_p), ("handle_variable_ops", ctypes.c_bool),
                ("_rest", ctypes.c_uint8 * 256)]


def _xnnpack_library(module: Any) -> Any:
    """The interpreter wrapper's shared library, if it exports XNNPACK's C API."""
    directory = os.path.dirname(getattr(module, "__file__", "") or "")
    for path in sorted(glob.glob(os.path.join(directory, "_pywrap_tensorflow_interpreter_wrapper*.so"))):
        try:
            lib = ctypes.CDLL(path)  # already loaded by the import: this only finds its handle
            lib.TfLiteXNNPackDelegateOptionsDefault.restype = _XnnpackOptions
            lib.TfLiteXNNPackDelegateCreate.argtypes = [ctypes.POINTER(_XnnpackOptions)]
            lib.TfLiteXNNPackDelegateCreate.restype = ctypes.c_void_p
            lib.TfLiteXNNPackDelegateDelete.argtypes = [ctypes.c_void_p]
            return lib
        except (OSError, AttributeError):
            continue
    return None


class XnnpackDelegate:
    """An XNNPACK delegate with int8 enabled, in the shape Interpreter(experimental_delegates=)
    expects. The Interpreter keeps a reference until its native interpreter is freed, so the
    delegate outlives every graph it was applied to."""

    def __init__(self, lib: Any, threads: int) -> None:
        options = lib.TfLiteXNNPackDelegateOptionsDefault()
        options.num_threads = threads if threads > 1 else 0  # 0: no thread pool
        options.flags |= XNNPACK_FLAG_QS8
        self._lib, self._ptr = lib, lib.TfLiteXNNPackDelegateCreate(ctypes.byref(options))
        if not self._ptr:
            raise EngineError("TfLiteXNNPackDelegateCreate returned NULL")

    def _get_native_delegate_pointer(self) -> int:
        return self._ptr

    def __del__(self) -> None:
        if getattr(self, "_ptr", None):
            self._lib.TfLiteXNNPackDelegateDelete(self._ptr)
            self._ptr = None


class TfliteRunner(Runner):
    """One Interpreter on an int8 .tflite; re-allocated when the batch size changes."""

    def __init__(self, model_bytes: bytes, *, threads: int | None = None,
                 delegates: list[Any] | None = None, where: str = "model", check: bool = True) -> None:
        if check:
            # tflite-runtime's Python wrapper does not verify the flatbuffer: a truncated file
            # can segfault the process. The project's reader bounds every offset first.
            from ..tflite_reader import read_tflite

            read_tflite(model_bytes, where=where)
        module, _ = interpreter_module()
        self._where = where
        threads = thread_count(threads)
        resolver = module.OpResolverType.AUTO
        self.xnnpack_int8 = False
        if delegates is None and (lib := _xnnpack_library(module)) is not None:
            delegates = [XnnpackDelegate(lib, threads)]
            resolver = module.OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES  # not a second XNNPACK
            self.xnnpack_int8 = True
        try:
            self._interp = module.Interpreter(model_content=model_bytes, num_threads=threads,
                                              experimental_delegates=delegates,
                                              experimental_op_resolver_type=resolver)
            self._interp.allocate_tensors()
        except (ValueError, RuntimeError) as exc:  # bad flatbuffer, unsupported op, delegate failure
            raise EngineError(f"{where}: TFLite cannot load it: {str(exc).strip()[:300]}") from None
        inp, out = self._interp.get_input_details(), self._interp.get_output_details()
        if len(inp) != 1 or len(out) != 1:
            raise EngineError(f"{where}: expected one input and one output, found {len(inp)} and {len(out)}")
        self._in, self._out = inp[0], out[0]
        self.int8_io = self._in["dtype"] == np.int8 and self._out["dtype"] == np.int8
        shape = tuple(int(v) for v in self._in["shape"])
        self._in_shape_nhwc = shape[1:]
        self._in_shape = (shape[3], shape[1], shape[2]) if len(shape) == 4 else shape[1:]
        self._batch = shape[0]

    @staticmethod
    def _qparams(detail: dict[str, Any]) -> tuple[float, int] | None:
        if detail["dtype"] != np.int8:
            return None
        scale, zp = detail["quantization"]
        return float(scale), int(zp)

    def _invoke(self, x: np.ndarray) -> np.ndarray:
        if x.shape[0] != self._batch:  # resize keeps XNNPACK's packed weights; it re-plans memory
            self._interp.resize_tensor_input(self._in["index"], [x.shape[0], *self._in_shape_nhwc])
            self._interp.allocate_tensors()
            self._batch = x.shape[0]
        self._interp.set_tensor(self._in["index"], x)
        self._interp.invoke()
        return self._interp.get_tensor(self._out["index"]).copy()

    def run(self, batch: np.ndarray) -> np.ndarray:
        x = check_batch(batch, self._in_shape, self._where)
        in_q, out_q = self._qparams(self._in), self._qparams(self._out)
        y = self._invoke(quantize_to_nhwc(x, *in_q) if in_q else nchw_to_nhwc(x))
        return nhwc_to_nchw(dequantize(y, *out_q) if out_q else y.astype(np.float32))

    def run_int8(self, batch_nhwc: np.ndarray) -> np.ndarray:
        if not self.int8_io:
            raise NotImplementedError(f"{self._where}: model input/output are not int8")
        if batch_nhwc.dtype != np.int8 or tuple(batch_nhwc.shape[1:]) != self._in_shape_nhwc:
            raise ValueError(f"run_int8 takes int8 (N, {self._in_shape_nhwc}), got {batch_nhwc.dtype} {batch_nhwc.shape}")
        return self._invoke(np.ascontiguousarray(batch_nhwc))

    def close(self) -> None:
        self._interp = None  # type: ignore[assignment]


class TfliteEngine(Int8Engine):
    name = "tflite"
    # tflite_runtime's import and the interpreter with XNNPACK (0.03-0.09 CPU-s on an EPYC core; a Pi core is 3-5x slower)
    prepare_cpu_s_hint = 0.2
    # tflite-runtime's import (availability), then the interpreter and XNNPACK's packed
    # weights; its arena reuses one small plan: 11 MB in all with 32 camera MobileNetV2
    # samples, 3-7 MB per interpreter once the runtime is imported
    runtime_mb_hint, prepare_mb_hint, run_bytes_per_activation = 8.0, 3.0, 0.1

    def availability(self, probe: dict[str, Any] | None = None) -> Availability:
        try:
            module, what = interpreter_module()
        except EngineError as exc:
            return Availability(False, str(exc))
        if _xnnpack_library(module) is not None:
            return Availability(True, f"{what}, XNNPACK with int8", {"package": what, "xnnpack_int8": True})
        return Availability(True, f"{what}, builtin int8 kernels (XNNPACK C API not exported)",
                            {"package": what, "xnnpack_int8": False})

    def prepare(self, model: Any, *, threads: int | None = None) -> Runner:
        from ..bundle import BACKBONE_INT8

        return TfliteRunner(model.read(BACKBONE_INT8), threads=threads, where=str(model.path / BACKBONE_INT8))
