"""Empirical bias correction (Nagel et al. 2019, "Data-Free Quantization"; as AIMET does it
with data): the int8 prefix's systematic error, taken back out of its biases.

Rounding a layer's weights to int8, and its input to its int8 grid, shifts the layer's
mean output per channel; the shift reaches every layer after it and adds up through a
deep stack of depthwise blocks (their 9-tap kernels have the fewest weights to average
the rounding over). For every CONV_2D / DEPTHWISE_CONV_2D / FULLY_CONNECTED op this
measures, on the calibration samples, the mean of

    pre-activation output through the simulated int8 path - the float path's

per output channel, and subtracts it from the op's bias. Layers are corrected in
topological order, each on the outputs of the corrected layers before it (so the errors
a layer inherits are corrected once, where they arise and as they arrive).

The int8 path is simulated in float: weights rounded as quantize.py writes them
(symmetric, per output channel or per tensor), every activation rounded to its tensor's
int8 grid. The calibration data streams in batches (a batch's live tensors twice, float
and int8, never the whole set): each batch's int8 pass uses the running mean of the
corrections over the batches so far, itself included; the mean after the last batch is
what the graph keeps.

Off by default (`model create --bias-correction` turns it on; the manifest records it, and
a coordinator re-quantising a prefix does as the root did). What it gains, measured:
- the features' signal-to-quantisation-noise on held-out digits, through the int8 reference
  engine, on the committed torchvision fixtures at 32x32: resnet18 32.4 -> 33.2 dB,
  squeezenet1_1 34.6 -> 35.3, shufflenet_v2 21.2 -> 21.9, mobilenet_v3_small 23.7 -> 24.1,
  mobilenet_v2 and efficientnet_b0 (w0.25) within 0.05 dB; in a numpy simulation of
  mnasnet1_0 at 64x64, 23.8 -> 25.1 dB;
- top-1 agreement with fp32 on 719 held-out digits, bench_model_zoo_full's matrix at 64x64
  (the same fixtures and code, with and without; `ZOO_BIAS_CORRECTION=1 python -m
  bench.bench_model_zoo_full build/zoo-full torch-mnasnet torch-efficientnet`): mnasnet1_0
  legacy / dynamo 98.9 / 98.7 % -> 99.2 / 99.3 % through the fitted probe, 99.4 / 99.3 % ->
  99.6 / 99.7 % through its own classifier; but efficientnet_b0 99.7 / 99.7 % -> 98.9 /
  99.7 % and 99.7 / 99.6 % -> 99.6 / 99.4 %. A few digits of 719 either way: it lifts the
  net that was below the 99 % bar over it and takes one that was above it below.
So it is a tool to try on a net whose int8 prefix loses accuracy, judged by that net's own
numbers, not a default.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from .float_graph import FloatGraph
from .float_ops import apply_activation, run_op
from .quant_math import asymmetric_params, dequantize, quantize, symmetric_per_channel

WEIGHT_AXIS = {"CONV_2D": 0, "DEPTHWISE_CONV_2D": 3, "FULLY_CONNECTED": 0}
# fewer output positions per channel than this and the measured mean is mostly sampling
# noise (a FULLY_CONNECTED op on 16 samples): such an op keeps its bias
MIN_POSITIONS = 64
# standard errors a channel's mean error must stand out by to be corrected (_significant):
# without it the committed mobilenet_v3_small / shufflenet fixtures' held-out per-channel
# mean error grew by a third (0.0050 -> 0.0066 / 0.0069); with it 0.0053 / 0.0047
SIGNIFICANCE = 3.0


def dequantised_weight(op: Any, per_channel: bool = True) -> np.ndarray:
    """`op`'s weights as quantize.py writes them (int8, symmetric), back in float."""
    if op.kind not in WEIGHT_AXIS:
        return op.weight
    if not per_channel:
        q, scale = symmetric_per_channel(op.weight.reshape(1, -1), 0)
        return (q.astype(np.float32) * scale[0]).reshape(op.weight.shape)
    axis = WEIGHT_AXIS[op.kind]
    q, scales = symmetric_per_channel(op.weight, axis)
    shape = [1] * op.weight.ndim
    shape[axis] = -1
    return (q.astype(np.float32) * scales.reshape(shape)).astype(np.float32)


def int8_rounded(v: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """`v` through int8 QUANTIZE / DEQUANTIZE on the range (lo, hi)."""
    scale, zero_point = asymmetric_params(lo, hi)
    return dequantize(quantize(v, scale, zero_point), scale, zero_point)


def int8_constant(c: np.ndarray | None) -> np.ndarray | None:
    """An ADD / MUL constant operand as quantize.py writes it (int8 per tensor, asymmetric)."""
    if c is None:
        return None
    c = np.asarray(c, np.float32)
    return int8_rounded(c, float(min(c.min(), 0.0)), float(max(c.max(), 0.0)))


def bias_corrections(graph: FloatGraph, calibration: np.ndarray, ranges: Mapping[str, tuple[float, float]], *,
                     per_channel: bool = True, batch_size: int = 32) -> dict[str, np.ndarray]:
    """Each weighted op's mean int8 error per output channel (op name -> float32 vector),
    measured on `calibration` (NCHW float32 samples as the model takes them) with `ranges`
    (every tensor's int8 range as quantize.py uses it, after `constrain_ranges`). An op's
    correction depends only on the ops before it, so a prefix of the graph can take the
    whole graph's. Empty with no samples.
    """
    x = np.asarray(calibration, np.float32)
    sums = {op.name: np.zeros(op.bias.shape, np.float64)
            for op in graph.ops if op.kind in WEIGHT_AXIS and op.bias is not None}
    if not len(x) or not sums:
        return {}
    squares = {name: np.zeros_like(v) for name, v in sums.items()}
    counts = dict.fromkeys(sums, 0)
    last = {name: k for k, op in enumerate(graph.ops) for name in op.inputs}
    for start in range(0, len(x), batch_size):
        batch = np.ascontiguousarray(x[start:start + batch_size].transpose(0, 2, 3, 1))
        exact = {graph.input: batch}
        rounded = {graph.input: int8_rounded(batch, *ranges[graph.input])}
        for k, op in enumerate(graph.ops):
            f_in = [exact[n] for n in op.inputs]
            q_in = [rounded[n] for n in op.inputs]
            if op.name in sums:
                act = op.options.get("activation", "NONE")
                linear = {**op.options, "activation": "NONE"}
                f_pre = run_op(op.kind, f_in, linear, op.weight, op.bias)
                # int8 weights made as used: a second copy of all a ResNet-50's would break
                # model create's memory bound
                q_pre = run_op(op.kind, q_in, linear, dequantised_weight(op, per_channel), op.bias)
                error = np.subtract(q_pre, f_pre).reshape(-1, q_pre.shape[-1])
                sums[op.name] += error.sum(axis=0, dtype=np.float64)
                squares[op.name] += np.einsum("ij,ij->j", error, error)
                counts[op.name] += len(error)
                del error
                exact[op.output] = apply_activation(f_pre, act)
                q_pre -= (sums[op.name] / counts[op.name]).astype(np.float32)
                q_out = apply_activation(q_pre, act)
                del f_pre, q_pre
            else:
                exact[op.output] = run_op(op.kind, f_in, op.options, op.weight, op.bias)
                weight = int8_constant(op.weight) if op.kind in ("ADD", "MUL") else op.weight
                q_out = run_op(op.kind, q_in, op.options, weight, op.bias)
            rounded[op.output] = int8_rounded(q_out, *ranges[op.output])
            del f_in, q_in, q_out
            for name in op.inputs:  # a batch's tensors live until their last reader
                if last.get(name) == k and name != graph.output:
                    exact.pop(name, None)
                    rounded.pop(name, None)
    return {name: _significant(sums[name], squares[name], counts[name])
            for name in sums if counts[name] >= MIN_POSITIONS}


def _significant(total: np.ndarray, squares: np.ndarray, n: int) -> np.ndarray:
    """The mean error per channel, where it stands out from its own sampling noise (more
    than SIGNIFICANCE standard errors from 0); elsewhere 0: a correction fitted to the
    calibration samples' noise is an error of its own on every other image."""
    mean = total / n
    stderr = np.sqrt(np.maximum(squares / n - mean ** 2, 0.0) / max(n - 1, 1))
    return np.where(np.abs(mean) > SIGNIFICANCE * stderr, mean, 0.0).astype(np.float32)


def with_corrected_biases(graph: FloatGraph, corrections: Mapping[str, np.ndarray]) -> FloatGraph:
    """A copy of `graph` (weights shared) whose ops named in `corrections` have their
    correction taken out of their bias. The float function moves by exactly the int8
    error it removes."""
    ops = [dataclasses.replace(op, bias=(op.bias - corrections[op.name]).astype(np.float32))
           if op.name in corrections else op for op in graph.ops]
    return dataclasses.replace(graph, ops=ops)
