"""The project's float graph (NHWC, TFLite op vocabulary, float32 weights) and `run_float`,
which executes it in numpy: calibration (quantize.py) observes its tensors, and tests
compare it with MXNet's own forward. onnx_import.py builds it from ONNX.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .float_ops import run_op


@dataclass
class FloatOp:
    kind: str  # a key of graph.OP_OPTIONS
    name: str  # the source ONNX node's name (for errors and QGraph op names)
    inputs: list[str]  # activation tensor names
    output: str
    options: dict[str, Any] = field(default_factory=dict)
    weight: np.ndarray | None = None  # CONV OHWI, DEPTHWISE 1HW(C*M), FC [out, in]
    bias: np.ndarray | None = None  # float32 (out,)
    # a BatchNorm folded into this op: its (gamma, beta), float32 (out,); what re-estimating
    # the normalisation statistics on a device's own images needs (adapt_norm.py)
    norm: tuple[np.ndarray, np.ndarray] | None = None


@dataclass
class FloatGraph:
    input: str
    input_shape: tuple[int, ...]  # NCHW, as the model takes it
    ops: list[FloatOp]  # topological order
    output: str
    shapes: dict[str, tuple[int, ...]]  # every activation, NHWC (or 2-D (N, C))
    name: str = "backbone"

    @property
    def output_shape(self) -> tuple[int, ...]:
        """The output's shape in the model's (ONNX/MXNet) layout."""
        return to_nchw_shape(self.shapes[self.output])


def to_nchw_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (shape[0], shape[3], shape[1], shape[2]) if len(shape) == 4 else shape


def _last_use(graph: FloatGraph) -> dict[str, int]:
    """Each activation's last reading op (index), the graph's output never."""
    last = {name: k for k, op in enumerate(graph.ops) for name in op.inputs}
    last.pop(graph.output, None)
    return last


def to_model_layout(y: np.ndarray) -> np.ndarray:
    """NHWC activation -> NCHW (the layout MXNet's head takes); 2-D passes through."""
    return np.ascontiguousarray(y.transpose(0, 3, 1, 2)) if y.ndim == 4 else y


def run_float(
    graph: FloatGraph,
    x: np.ndarray,
    *,
    layout: str = "model",
    on_tensor: Callable[[str, np.ndarray], None] | None = None,
) -> np.ndarray:
    """Run the float graph on `x` (NCHW float32, any batch size).

    Returns the output in the model's layout (NCHW / 2-D, as MXNet produces it) or, with
    layout="nhwc", as the graph holds it. `on_tensor(name, value)` sees the input and every
    op's output (NHWC), which is how calibration observes activations.
    """
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 4 or tuple(x.shape[1:]) != tuple(graph.input_shape[1:]):
        raise ValueError(f"input shape {x.shape} does not match the graph's {graph.input_shape}")
    values = {graph.input: np.ascontiguousarray(x.transpose(0, 2, 3, 1))}
    if on_tensor:
        on_tensor(graph.input, values[graph.input])
    last = _last_use(graph)
    for k, op in enumerate(graph.ops):
        y = run_op(op.kind, [values[i] for i in op.inputs], op.options, op.weight, op.bias)
        values[op.output] = y
        if on_tensor:
            on_tensor(op.output, y)
        for name in op.inputs:  # dropped after its last reader: a ResNet-50 at 224 kept
            if last.get(name) == k:  # 1.4 GB of every layer's output per 32 samples
                values.pop(name, None)
        del y
    out = values[graph.output]
    return to_model_layout(out) if layout == "model" else out
