"""MXNet's own int8 path: the fp32 ONNX backbone quantised on the device by
mxnet.contrib.quantization.quantize_net and run by oneDNN (MKLDNN in MXNet 1.x).

The MXNet symbol is built from the project's float graph (onnx_import -> mxnet_graph), not
by mxnet.contrib.onnx: any backbone the project imports runs here too.

It calibrates its own activation ranges (min/max over the bundle's calibration samples), so
its int8 scales differ from the bundle's .tflite: agreement with the reference is checked in
float, not in int8 units (see agreement.py). MXNet is imported only in prepare(): importing
it costs ~2 CPU-s and ~200 MB, which availability() (run for every engine before selection
can price or meter them) must not spend; whether this MXNet has oneDNN is prepare()'s to say.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.metadata
import importlib.util
import io
import logging
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import InputError
from ..engine import Availability, Int8Engine, Runner
from ._common import EngineError, check_batch, thread_count

_log = logging.getLogger(__name__)
CALIB_BATCH = 32


class MxnetRunner(Runner):
    def __init__(self, block: Any, mx: Any, input_shape: tuple[int, ...]) -> None:
        self._block, self._mx, self._shape = block, mx, tuple(input_shape)

    def run(self, batch: np.ndarray) -> np.ndarray:
        x = check_batch(batch, self._shape, "mxnet-onednn")
        return self._block(self._mx.nd.array(x, dtype="float32")).asnumpy().astype(np.float32, copy=False)


class MxnetOnednnEngine(Int8Engine):
    name = "mxnet-onednn"

    # MXNet's import (~2 CPU-s) and quantize_net's calibration (~4 CPU-s for the camera
    # MobileNetV2 0.5 on an EPYC core; bench_engine_cost)
    prepare_cpu_s_hint = 6.0
    # MXNet's import with oneDNN (~170 MB: prepare's, availability only looks for the package)
    # and the calibration's float activations, CALIB_BATCH samples at a time: 176 MB on the
    # digits CNN, 331-366 MB on the camera MobileNetV2 0.5
    runtime_mb_hint, prepare_mb_hint, run_bytes_per_activation = 0.0, 170.0, 6.4

    def memory_mb_hint(self, activations: int, batch: int, *, threads: int = 1, runtime_loaded: bool = False) -> float:
        return super().memory_mb_hint(activations, max(batch, CALIB_BATCH), threads=threads,
                                      runtime_loaded=runtime_loaded)

    def availability(self, probe: dict[str, Any] | None = None) -> Availability:
        spec = importlib.util.find_spec("mxnet")
        if spec is None or not spec.origin:
            return Availability(False, "mxnet is not installed")
        if not (Path(spec.origin).parent / "libmxnet.so").is_file():
            return Availability(False, f"mxnet at {Path(spec.origin).parent} has no libmxnet.so")
        try:
            version = importlib.metadata.version("mxnet")
        except importlib.metadata.PackageNotFoundError:
            version = "(unknown version)"
        return Availability(True, f"mxnet {version} installed; its import and oneDNN are checked when prepared, "
                            "own calibration", {"version": version})

    @staticmethod
    def _import_with_onednn() -> Any:
        try:
            import mxnet as mx

            features = mx.runtime.Features()
        except Exception as exc:  # a broken libmxnet (e.g. missing shared libraries) is this engine's error
            raise EngineError(f"mxnet does not import: {type(exc).__name__}: {str(exc)[:200]}") from None
        flag = next((f for f in ("ONEDNN", "MKLDNN") if f in features), None)
        if flag is None or not features.is_enabled(flag):
            raise EngineError(f"mxnet {mx.__version__} is built without oneDNN (MKLDNN)")
        return mx

    def prepare(self, model: Any, *, threads: int | None = None) -> Runner:
        mx = self._import_with_onednn()
        from mxnet.contrib.quantization import quantize_net

        from ..graph import UnsupportedOpError
        from ..mxnet_graph import MxnetGraphError, float_graph_to_mxnet
        from ..onnx_import import import_onnx

        os.environ.setdefault("MXNET_SUBGRAPH_VERBOSE", "0")  # no "backend MKLDNN is activated" lines
        mx.base.check_call(mx.base._LIB.MXSetNumOMPThreads(ctypes.c_int(thread_count(threads))))  # noqa: SLF001
        spec = model.manifest.input
        try:  # the project's own importer, then one MXNet mapping per float-graph op kind
            sym, args = float_graph_to_mxnet(import_onnx(model.onnx_bytes(), split=model.manifest.split_tensor), mx)
        except (UnsupportedOpError, MxnetGraphError, InputError) as exc:
            raise EngineError(f"{model.path}: backbone.onnx has no MXNet form here: {exc}") from None
        with warnings.catch_warnings():  # "Cannot decide type": the input's dtype comes at run time
            warnings.simplefilter("ignore", UserWarning)
            block = mx.gluon.SymbolBlock(sym, mx.sym.var(spec.name))
        params = block.collect_params()
        for name, value in args.items():
            params[name]._load_init(value, mx.cpu())  # noqa: SLF001 - no public by-name setter
        calib = model.calibration()
        batch = min(CALIB_BATCH, len(calib))
        calib = calib[: len(calib) // batch * batch]  # whole batches: the iterator would pad
        data = mx.io.NDArrayIter(data={spec.name: calib}, batch_size=batch)
        # int8 first: "auto" (uint8 after ReLU) lost 9 points of top-1 agreement with fp32
        # on the camera MobileNetV2 (89.1 % vs int8's 98.4 %, the reference's 97.7 %; issue
        # 16), and some op mixes in imported graphs (SE multiply, concat of signed and
        # unsigned branches) fail with it at run time; "auto" stays the fallback
        errors = []
        for dtype in ("int8", "auto"):
            data.reset()
            # quantize_net logs through the root logger and warns about its own deprecation
            with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
                warnings.simplefilter("ignore")
                try:
                    qnet = quantize_net(block, quantized_dtype=dtype, quantize_mode="full",
                                        calib_mode="naive", calib_data=data,
                                        num_calib_examples=len(calib), ctx=mx.cpu())
                    qnet.hybridize(static_alloc=True, static_shape=True)
                    qnet(mx.nd.array(calib[:batch])).wait_to_read()  # type errors surface on the first run
                except Exception as exc:  # MXNetError from an op oneDNN cannot quantise
                    errors.append(f"{dtype}: {type(exc).__name__}: {_first_line(exc)}")
                    continue
            _log.debug("mxnet-onednn: quantised %s (%s) on %d samples", model.manifest.name, dtype, len(calib))
            return MxnetRunner(qnet, mx, spec.shape)
        raise EngineError(f"{model.path}: quantize_net failed: {'; '.join(errors)}")


def _first_line(exc: BaseException) -> str:
    """MXNet errors start with a C++ traceback: the line that says what failed."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    useful = [ln for ln in lines if "Check failed" in ln or ln.startswith("MXNetError")]
    return (useful or lines or [type(exc).__name__])[-1][:300]
