"""Bias correction (bias_correction.py): the int8 prefix's mean error per channel, measured on
the calibration samples, taken out of the biases.

Real models: torchvision's trained ResNet-18 and SqueezeNet exports (tests/fixtures/models,
digits at 32x32), judged on held-out digits through the project's int8 reference engine.
"""

from __future__ import annotations

import numpy as np
import pytest

from edge_agent.int8.bias_correction import MIN_POSITIONS, bias_corrections, with_corrected_biases
from edge_agent.int8.float_graph import run_float
from edge_agent.int8.onnx_import import import_onnx
from edge_agent.int8.quant_math import quantize_bias
from edge_agent.int8.quantize import (
    calibrate,
    constrain_ranges,
    dequantize_output,
    quantize_graph,
    quantize_input,
)
from edge_agent.int8.reference import run_graph
from tests.fixtures.models import zoo


def _fixture(arch_id: str):
    arch = next(a for a in zoo.torch_archs() if a.id == arch_id)
    x_train, _, x_test, _ = zoo.digits(arch.size)
    return import_onnx(zoo.HERE / arch.name, split=arch.split), x_train[:64], x_test[:128]


def _errors(graph, calib, x, **options) -> tuple[float, float]:
    """(mean |per-channel mean error|, signal-to-quantisation-noise dB) of the int8 features."""
    q = quantize_graph(graph, calib, **options)
    want = run_float(graph, x)
    err = dequantize_output(run_graph(q, quantize_input(x, q)), q) - want
    axes = tuple(i for i in range(err.ndim) if i != 1)
    return float(np.abs(err.mean(axis=axes)).mean()), float(10 * np.log10((want ** 2).sum() / (err ** 2).sum()))


@pytest.mark.parametrize("arch_id", ["torch-resnet18-legacy", "torch-squeezenet1_1-legacy"])
def test_corrected_prefix_is_closer_to_float_on_held_out_digits(arch_id: str) -> None:
    graph, calib, x = _fixture(arch_id)
    bias_before, sqnr_before = _errors(graph, calib, x, bias_correction=False)
    bias_after, sqnr_after = _errors(graph, calib, x, bias_correction=True)
    print(f"{arch_id}: mean channel error {bias_before:.5f} -> {bias_after:.5f}, "
          f"SQNR {sqnr_before:.2f} -> {sqnr_after:.2f} dB")
    assert bias_after < 0.85 * bias_before  # measured: 0.69 (resnet18), 0.75 (squeezenet)
    assert sqnr_after > sqnr_before + 0.3  # measured: +0.8 dB each


def test_corrections_change_only_biases_and_a_prefix_takes_the_whole_graphs() -> None:
    graph, calib, _ = _fixture("torch-resnet18-legacy")
    ranges = calibrate(graph, calib)
    corrections = bias_corrections(graph, calib, constrain_ranges(graph, ranges))
    assert corrections and any(np.abs(c).max() > 0 for c in corrections.values())
    plain = quantize_graph(graph, calib, ranges=ranges, bias_correction=False)
    corrected = quantize_graph(graph, calib, ranges=ranges, corrections=corrections)
    moved = [name for name, t in plain.tensors.items()
             if t.data is not None and not np.array_equal(t.data, corrected.tensors[name].data)]
    assert moved and all(name.endswith("/bias") for name in moved)
    for op in graph.ops:  # uncorrected biases are the float ones, as before
        if op.name in corrections:
            w_scale = plain.tensor(f"{op.name}/weight").scale
            in_scale = float(plain.tensor(op.inputs[0]).scale[0])
            np.testing.assert_array_equal(plain.tensor(f"{op.name}/bias").data,
                                          quantize_bias(op.bias, in_scale, w_scale)[0])
    # an op's correction depends only on the ops before it: a prefix measures the same
    prefix = import_onnx(zoo.HERE / "resnet18.legacy.onnx", split=graph.ops[len(graph.ops) // 2].name)
    own = bias_corrections(prefix, calib, constrain_ranges(prefix, calibrate(prefix, calib)))
    assert own and own.keys() <= corrections.keys()
    for name, c in own.items():
        np.testing.assert_allclose(c, corrections[name], atol=1e-6)


def test_nothing_to_correct_on_without_samples() -> None:
    graph, calib, _ = _fixture("torch-resnet18-legacy")
    ranges = constrain_ranges(graph, calibrate(graph, calib))
    assert bias_corrections(graph, calib[:0], ranges) == {}
    assert with_corrected_biases(graph, {}).ops == graph.ops
    # too few output positions per channel (the classifier-side ops on one sample) are noise
    few = bias_corrections(graph, calib[:1], ranges)
    last = graph.ops[-1]
    spatial = int(np.prod(graph.shapes[last.output][1:-1])) if len(graph.shapes[last.output]) == 4 else 1
    assert (last.name in few) == (spatial >= MIN_POSITIONS)
