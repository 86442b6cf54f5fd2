"""The numpy reference engine: TFLite's integer semantics, int32 accumulation, no native code.

It is the oracle every other engine is checked against and the engine of last resort (it
runs anywhere numpy does, slowly).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..engine import Availability, Int8Engine, Runner
from ._common import check_batch, dequantize, nchw_to_nhwc, nhwc_to_nchw, quantize


class QGraphRunner(Runner):
    """Runs a QGraph through `reference.run_graph`, optionally with some kernels replaced
    (the native engine passes its C kernels here and reuses the rest)."""

    def __init__(self, graph: Any, *, kernels: dict[str, Any] | None = None) -> None:
        from ..reference import run_graph

        self.graph, self._kernels, self._run_graph = graph, kernels, run_graph
        (self._src,), (self._dst,) = graph.inputs, graph.outputs
        tin, tout = graph.tensor(self._src), graph.tensor(self._dst)
        self.int8_io = tin.dtype == "int8" and tout.dtype == "int8"
        self._in_q = (float(tin.scale[0]), int(tin.zero_point[0])) if tin.dtype == "int8" else None
        self._out_q = (float(tout.scale[0]), int(tout.zero_point[0])) if tout.dtype == "int8" else None
        self._in_shape = (tin.shape[3], tin.shape[1], tin.shape[2]) if len(tin.shape) == 4 else tuple(tin.shape[1:])

    def _invoke(self, x: np.ndarray) -> np.ndarray:
        out = self._run_graph(self.graph, x, kernels=self._kernels)
        return out if isinstance(out, np.ndarray) else out[self._dst]

    def run(self, batch: np.ndarray) -> np.ndarray:
        x = nchw_to_nhwc(check_batch(batch, self._in_shape, "reference"))
        if self._in_q is not None:
            x = quantize(x, *self._in_q)
        return self.float_output(self._invoke(x))

    def float_output(self, y: np.ndarray) -> np.ndarray:
        """The graph's raw output (int8 NHWC for an int8 graph) as `run` returns it: float32 NCHW."""
        if self._out_q is not None:
            y = dequantize(y, *self._out_q)
        return nhwc_to_nchw(np.asarray(y, np.float32))

    def run_int8(self, batch_nhwc: np.ndarray) -> np.ndarray:
        if not self.int8_io:
            raise NotImplementedError("this graph has float32 input/output edges")
        if batch_nhwc.dtype != np.int8:
            raise ValueError(f"run_int8 takes int8, got {batch_nhwc.dtype}")
        return self._invoke(batch_nhwc)


class ReferenceEngine(Int8Engine):
    name = "reference"
    # numpy keeps every layer's int8 output of the batch, and int32 / float64 temporaries of
    # the op in hand: 131 MB for 32 camera MobileNetV2 samples (30 M activation elements)
    runtime_mb_hint, prepare_mb_hint, run_bytes_per_activation = 0.0, 5.0, 4.1

    def availability(self, probe: dict[str, Any] | None = None) -> Availability:
        return Availability(True, f"numpy {np.__version__} (int32 accumulation, TFLite rounding)")

    def prepare(self, model: Any, *, threads: int | None = None) -> Runner:
        return QGraphRunner(model.qgraph())
