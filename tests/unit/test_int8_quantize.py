"""Post-training quantisation: calibration maths, QGraph structure, and end-to-end accuracy.

Oracles: the float graph (itself checked against MXNet in test_int8_onnx), the project's
numpy int8 reference, and tflite-runtime running the project's own .tflite writer output.
Real data: scikit-learn's digits (bundled, no download), a small CNN trained in MXNet.
"""

from __future__ import annotations

import numpy as np
import pytest

from edge_agent.errors import InputError
from edge_agent.int8.float_graph import FloatGraph, run_float
from edge_agent.int8.onnx_export import export_onnx
from edge_agent.int8.onnx_import import import_onnx
from edge_agent.int8.quantize import (
    CalibrationError,
    calibrate,
    constrain_ranges,
    dequantize_output,
    entropy_threshold,
    percentile_range,
    quantize_graph,
    quantize_input,
    validate_calibration,
)
from edge_agent.int8.reference import check_graph, run_graph
from edge_agent.int8.testing import run_tflite
from edge_agent.int8.tflite_writer import write_tflite
from edge_agent.sim import models


@pytest.fixture(scope="module")
def digits() -> dict:
    """digits_cnn trained briefly in MXNet; its backbone as a float graph."""
    x_train, y_train, x_test, y_test = models.load_digits_split(seed=0)
    net = models.digits_cnn()
    net.hybridize()
    models.fit_classifier(net, x_train, y_train, epochs=5, batch_size=128, lr=0.01, seed=0)
    fp32_top1 = float((models.predict(net, x_test).argmax(1) == y_test).mean())
    graph = import_onnx(export_onnx(net.features, (1, 1, 8, 8)))
    return {"net": net, "graph": graph, "calib": x_train[:256], "x_test": x_test,
            "y_test": y_test, "fp32": fp32_top1}


@pytest.fixture(scope="module")
def mobile() -> dict:
    net = models.initialize(models.mobilenet_v2(0.35, 10, 32), seed=0, randomize_bn=True)
    onnx_bytes = export_onnx(net, (1, 3, 32, 32))
    rng = np.random.default_rng(0)
    return {"graph": import_onnx(onnx_bytes, split="features_gap_fwd"),
            "whole": import_onnx(onnx_bytes), "calib": rng.normal(size=(32, 3, 32, 32)).astype(np.float32),
            "x": rng.normal(size=(8, 3, 32, 32)).astype(np.float32)}


def _head_top1(d: dict, features: np.ndarray) -> float:
    import mxnet as mx

    logits = d["net"].output(mx.nd.array(features)).asnumpy()
    return float((logits.argmax(1) == d["y_test"]).mean())


# ----------------------------------------------------------------- calibration data checks
@pytest.mark.parametrize(("bad", "message"), [
    (np.zeros((4, 1, 8, 9), np.float32), r"shape \(4, 1, 8, 9\) does not match the model input \(N, 1, 8, 8\)"),
    (np.zeros((4, 8, 8), np.float32), "does not match"),
    (np.zeros((0, 1, 8, 8), np.float32), "no samples"),
    (np.array([["a"]]), "not numeric"),
])
def test_bad_calibration_data_is_a_clear_error(bad: np.ndarray, message: str) -> None:
    with pytest.raises(CalibrationError, match=message):
        validate_calibration(bad, (1, 1, 8, 8))


def test_non_finite_calibration_names_the_sample(digits) -> None:
    x = np.array(digits["calib"][:10])
    x[6, 0, 3, 3] = np.nan
    x[8, 0, 0, 0] = np.inf
    with pytest.raises(CalibrationError, match=r"2 NaN/Inf values \(first in sample 6\)"):
        quantize_graph(digits["graph"], x)
    assert issubclass(CalibrationError, InputError)
    np.testing.assert_array_equal(validate_calibration(digits["calib"][:3].astype(np.float64), (1, 1, 8, 8)),
                                  digits["calib"][:3])


# ----------------------------------------------------------------- range maths
def test_percentile_range_clips_both_tails() -> None:
    hist = np.zeros(100, np.int64)
    hist[50] = 1_000_000
    hist[0] = hist[99] = 1  # single outliers at each end
    lo, hi = percentile_range(hist, -10.0, 10.0, 99.99)
    assert -0.2 < lo <= 0.0 and 0.0 < hi < 0.4
    assert percentile_range(hist, -10.0, 10.0, 100.0) == (-10.0, 10.0)


def test_entropy_threshold_clips_gaussian_tails_but_not_uniform() -> None:
    rng = np.random.default_rng(0)
    x = np.abs(rng.normal(size=200_000))
    hist, _ = np.histogram(x, bins=2048, range=(0, x.max()))
    t = entropy_threshold(hist, float(x.max()))
    assert 2.5 < t < 0.95 * x.max()  # clips the sparse tail, keeps the bulk
    u = rng.uniform(0, 3, size=200_000)
    hist, _ = np.histogram(u, bins=2048, range=(0, 3))
    assert entropy_threshold(hist, 3.0) > 2.9


def test_constraints_clamp_relu6_and_tie_same_scale_ops() -> None:
    from edge_agent.int8.float_graph import FloatOp

    ops = [FloatOp("CONV_2D", "c", ["x"], "a", {"activation": "RELU6"}),
           FloatOp("MAX_POOL_2D", "p", ["a"], "b", {"activation": "NONE"}),
           FloatOp("CONV_2D", "d", ["x"], "e", {"activation": "NONE"}),
           FloatOp("CONCATENATION", "cat", ["b", "e"], "y", {"axis": 3, "activation": "NONE"})]
    g = FloatGraph("x", (1, 1, 4, 4), ops, "y", {})
    r = constrain_ranges(g, {"x": (0.5, 1.0), "a": (-1.0, 9.0), "b": (0.0, 5.0), "e": (-2.0, 3.0),
                             "y": (-2.0, 5.0)})
    assert r["x"] == (0.0, 1.0)  # ranges always include zero
    assert r["a"] == r["b"] == r["e"] == r["y"] == (-2.0, 6.0)  # relu6 clamp, then one group


# ----------------------------------------------------------------- QGraph structure
def test_quantised_graph_follows_tflite_conventions(mobile) -> None:
    q = quantize_graph(mobile["graph"], mobile["calib"])
    check_graph(q)
    assert q.tensor(q.inputs[0]).dtype == "int8" and q.tensor(q.inputs[0]).shape == (1, 32, 32, 3)
    assert q.tensor(q.outputs[0]).dtype == "int8"
    for op in q.ops:
        out = q.tensor(op.outputs[0])
        assert out.scale.shape == (1,) and -128 <= out.zero_point[0] <= 127
        if op.kind in ("CONV_2D", "DEPTHWISE_CONV_2D"):
            x, w, b = (q.tensor(n) for n in op.inputs)
            channels = w.shape[0] if op.kind == "CONV_2D" else w.shape[3]
            assert w.dtype == "int8" and w.scale.shape == (channels,) and not w.zero_point.any()
            assert w.quantized_dim == (0 if op.kind == "CONV_2D" else 3)
            assert w.data.min() >= -127 and np.abs(w.data).max() == 127
            assert b.dtype == "int32" and b.data.shape == (channels,)
            np.testing.assert_allclose(b.scale, x.scale[0] * w.scale, rtol=1e-6)
        if op.options.get("activation") == "RELU6":  # the int8 range ends at (about) 6
            assert out.zero_point[0] == -128 and out.scale[0] * 255 <= 6.0 + 1e-5
        if op.kind == "PAD":
            src = q.tensor(op.inputs[0])
            assert (src.scale, src.zero_point) == (out.scale, out.zero_point)
            assert q.tensor(op.inputs[1]).data.tolist() == [[0, 0], [1, 1], [1, 1], [0, 0]]


def test_per_tensor_and_float_io_options(digits) -> None:
    q = quantize_graph(digits["graph"], digits["calib"], per_channel=False, float_io=True)
    check_graph(q)
    assert [q.ops[0].kind, q.ops[-1].kind] == ["QUANTIZE", "DEQUANTIZE"]
    assert q.tensor(q.inputs[0]).dtype == q.tensor(q.outputs[0]).dtype == "float32"
    for op in q.ops:
        if op.kind == "CONV_2D":
            assert q.tensor(op.inputs[1]).scale.shape == (1,) == q.tensor(op.inputs[2]).scale.shape
    pool = next(op for op in q.ops if op.kind == "MAX_POOL_2D")
    assert q.tensor(pool.inputs[0]).scale == q.tensor(pool.outputs[0]).scale
    x = digits["x_test"][:50]
    y_float = run_graph(q, np.ascontiguousarray(x.transpose(0, 2, 3, 1)))
    assert y_float.dtype == np.float32
    err = np.abs(y_float.transpose(0, 3, 1, 2) - run_float(digits["graph"], x)).max()
    assert err < 0.05 * np.abs(run_float(digits["graph"], x)).max()


def test_unknown_method_is_rejected(digits) -> None:
    with pytest.raises(ValueError, match="unknown calibration method 'median'"):
        calibrate(digits["graph"], digits["calib"], method="median")


# ----------------------------------------------------------------- end to end
@pytest.mark.parametrize("method", ["minmax", "percentile", "entropy"])
def test_digits_int8_top1_within_one_point_on_every_engine(digits, method: str) -> None:
    q = quantize_graph(digits["graph"], digits["calib"], method=method)
    xq = quantize_input(digits["x_test"], q)
    ref = run_graph(q, xq)
    model = write_tflite(q)
    # the project's writer, run by tflite-runtime's reference kernels, is bit-exact
    np.testing.assert_array_equal(run_tflite(model, xq, reference_kernels=True), ref)
    engines = {"reference": ref, "tflite-xnnpack": run_tflite(model, xq, reference_kernels=False)}
    fp32 = digits["fp32"]
    assert fp32 > 0.95
    for name, y in engines.items():
        top1 = _head_top1(digits, dequantize_output(y, q))
        print(f"digits {method} {name}: fp32 top-1 {fp32:.4f}, int8 top-1 {top1:.4f}")
        assert abs(top1 - fp32) <= 0.01, (name, top1, fp32)


def test_mobilenet_v2_quantises_and_runs_end_to_end(mobile) -> None:
    g, x = mobile["graph"], mobile["x"]
    q = quantize_graph(g, mobile["calib"])
    xq = quantize_input(x, q)
    ref = run_graph(q, xq)
    model = write_tflite(q)
    np.testing.assert_array_equal(run_tflite(model, xq, reference_kernels=True), ref)
    features = dequantize_output(ref, q)
    expected = run_float(g, x)
    assert features.shape == expected.shape == (8, 1280, 1, 1)
    rel_rms = float(np.sqrt(np.mean((features - expected) ** 2)) / np.std(expected))
    cosine = float(np.sum(features * expected) / np.linalg.norm(features) / np.linalg.norm(expected))
    print(f"mobilenet_v2 int8 vs float: rms error / std {rel_rms:.4f}, cosine {cosine:.5f}")
    assert rel_rms < 0.05 and cosine > 0.998
    np.testing.assert_array_equal(run_graph(quantize_graph(g, mobile["calib"]), xq), ref)  # deterministic


def test_whole_mobilenet_with_classifier_quantises(mobile) -> None:
    g, x = mobile["whole"], mobile["x"]
    assert [op.kind for op in g.ops[-3:]] == ["MEAN", "RESHAPE", "FULLY_CONNECTED"]
    q = quantize_graph(g, mobile["calib"], method="percentile")
    xq = quantize_input(x, q)
    ref = run_graph(q, xq)
    np.testing.assert_array_equal(run_tflite(write_tflite(q), xq, reference_kernels=True), ref)
    logits, expected = dequantize_output(ref, q), run_float(g, x)
    assert logits.shape == expected.shape == (8, 10)
    assert np.abs(logits - expected).max() < 0.05 * np.abs(expected).max()
