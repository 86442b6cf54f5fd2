"""The quantised graph: the one in-memory form of an int8 backbone.

It mirrors TFLite's model closely (NHWC activations, per-tensor activation quantisation,
per-output-channel weight quantisation) so that the TFLite writer and reader, the numpy
reference, and the native kernels all speak the same structure:

    float graph --quantize--> QGraph --write_tflite--> .tflite --read_tflite--> QGraph
                                 \\--> reference.run_graph / native engine

Conventions (identical to TFLite's):
- activations: NHWC, int8, asymmetric per tensor (scale, zero_point);
- CONV_2D weights OHWI int8, symmetric per output channel (zero_point 0, quantized_dim 0);
- DEPTHWISE_CONV_2D weights 1HW(C*M) int8, symmetric per channel (quantized_dim 3);
- FULLY_CONNECTED weights [out, in] int8, per channel (quantized_dim 0) or per tensor;
- biases int32 with scale = input_scale * weight_scale[c], zero_point 0;
- QUANTIZE / DEQUANTIZE edges are the only ops that touch float32 tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Ops the writer, reader and reference must support, with the option keys each uses.
OP_OPTIONS: dict[str, tuple[str, ...]] = {
    "CONV_2D": ("stride_h", "stride_w", "padding", "dilation_h", "dilation_w", "activation"),
    "DEPTHWISE_CONV_2D": (
        "stride_h", "stride_w", "padding", "dilation_h", "dilation_w", "depth_multiplier",
        "activation",
    ),
    "FULLY_CONNECTED": ("activation", "keep_num_dims"),
    "ADD": ("activation",),
    "AVERAGE_POOL_2D": ("stride_h", "stride_w", "filter_h", "filter_w", "padding", "activation"),
    "MAX_POOL_2D": ("stride_h", "stride_w", "filter_h", "filter_w", "padding", "activation"),
    "MEAN": ("keep_dims",),  # second input: int32 axes constant
    "RESHAPE": ("new_shape",),
    "CONCATENATION": ("axis", "activation"),
    "PAD": (),  # second input: int32 [rank, 2] paddings constant
    "PADV2": (),  # inputs: x, int32 [rank, 2] paddings, int8 [1] fill value (same quant as x)
    "GATHER": ("axis",),  # second input: int32 [k] indices constant (a channel permutation)
    "MUL": ("activation",),  # inputs broadcast (SE scaling); the second may be an int8 constant
    "HARD_SWISH": (),
    "LOGISTIC": (),  # output quantisation fixed at scale 1/256, zero point -128
    "QUANTIZE": (),
    "DEQUANTIZE": (),
}
PADDINGS = ("SAME", "VALID")
ACTIVATIONS = ("NONE", "RELU", "RELU6")


@dataclass
class QTensor:
    """One tensor: an activation (data is None) or a constant (weights, bias, axes)."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # "int8" | "int32" | "float32"
    scale: np.ndarray | None = None  # float32, shape (1,) per tensor or (C,) per channel
    zero_point: np.ndarray | None = None  # int64, same shape as scale
    quantized_dim: int = 0
    data: np.ndarray | None = None

    @property
    def is_constant(self) -> bool:
        return self.data is not None

    @property
    def per_channel(self) -> bool:
        return self.scale is not None and self.scale.size > 1


@dataclass
class QOp:
    kind: str  # a key of OP_OPTIONS
    inputs: list[str]  # tensor names; "" for an omitted optional input (e.g. no bias)
    outputs: list[str]
    options: dict[str, Any] = field(default_factory=dict)
    name: str = ""  # the source node's name, for error messages


@dataclass
class QGraph:
    tensors: dict[str, QTensor]
    ops: list[QOp]  # in execution (topological) order
    inputs: list[str]
    outputs: list[str]
    name: str = "backbone"

    def tensor(self, name: str) -> QTensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"graph {self.name!r} has no tensor {name!r}") from None


class UnsupportedOpError(ValueError):
    """A node the int8 path cannot express; the message names the node and the op."""

    def __init__(self, node: str, op: str, why: str = "") -> None:
        detail = f": {why}" if why else ""
        super().__init__(f"node {node!r}: op {op!r} is not supported by the int8 path{detail}")
        self.node = node
        self.op = op
