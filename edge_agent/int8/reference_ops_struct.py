"""Reference int8 kernels for the structural ops real models need (PADV2, GATHER, grouped
CONV_2D), following tflite-runtime 2.14's reference kernels bit for bit like reference_ops.

- PADV2 (reference_ops::Pad with a constant value input): the importer lowers a MaxPool with
  explicit pads to PADV2 filled with -128 (the int8 minimum, below every real value) and a
  VALID MAX_POOL_2D, which is exact.
- GATHER on a constant index vector copies raw values: the importer lowers ShuffleNet's
  channel shuffle (Reshape -> Transpose -> Reshape) to a GATHER on the NHWC channel axis.
- grouped CONV_2D (input channels = filter in-channels x groups): tflite-runtime 2.14's
  CONV_2D accepts it on the reference, optimized and XNNPACK paths (measured: all three agree
  with this kernel, tests/unit/test_int8_ops_struct.py), so it is emitted as one op rather
  than SPLIT + per-group convs + CONCATENATION. Output channel o belongs to group
  o // (out_channels / groups) and sees input channels [g * cin_g, (g + 1) * cin_g).
"""

from __future__ import annotations

import numpy as np

from .graph import QGraph, QOp


def conv_groups(x_channels: int, w: np.ndarray) -> int:
    """How many groups a CONV_2D with OHWI weights `w` has on `x_channels` input channels."""
    return max(1, x_channels // int(w.shape[3]))


def grouped_accumulate(x: np.ndarray, w: np.ndarray, wp, input_offset: int) -> np.ndarray:
    """Grouped CONV_2D accumulator (N,OH,OW,O) int64: one ordinary conv per group."""
    from .reference_ops import conv_accumulate

    groups = conv_groups(x.shape[3], w)
    cin, per = w.shape[3], w.shape[0] // groups
    parts = [conv_accumulate(x[..., g * cin:(g + 1) * cin], w[g * per:(g + 1) * per], wp, input_offset)
             for g in range(groups)]
    return np.concatenate(parts, axis=-1)


def padv2(graph: QGraph, op: QOp, args: list) -> np.ndarray:
    """PADV2, int8: pads with the raw value of the int8 constant input (input 2)."""
    x, paddings = args[0], np.asarray(args[1]).reshape(-1, 2)
    fill = int(np.asarray(args[2]).reshape(-1)[0])
    return np.pad(x, [tuple(int(v) for v in row) for row in paddings], constant_values=fill)


def gather(graph: QGraph, op: QOp, args: list) -> np.ndarray:
    """GATHER (reference_ops::Gather, batch_dims 0): raw values taken along `axis`."""
    x, idx = args[0], np.asarray(args[1]).astype(np.int64)
    axis = int(op.options.get("axis", 0)) % x.ndim
    if idx.size and (idx.min() < 0 or idx.max() >= x.shape[axis]):
        raise ValueError(f"GATHER indices out of range for axis size {x.shape[axis]}")
    return np.take(x, idx, axis=axis)


STRUCT_KERNELS = {"PADV2": padv2, "GATHER": gather}
