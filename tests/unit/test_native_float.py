"""The numpy tail's depthwise convolution in C (kernels/float_depthwise.c via train/native_float.py)
against the numpy path it replaces when the library is built: hypothesis draws the geometry
(kernel, stride, padding, map and channel sizes, which gradients are needed), and both give
the same forward bits (taps added in the same order; allclose where a compiler contracts
into FMA) and the same gradients to float32 rounding (other summation orders). Without the
library the numpy path runs, and a whole tail trains to the same parameters either way.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from edge_agent.int8 import native_float
from edge_agent.train import numpy_tail
from edge_agent.train.dense_head import NumpyTailTrainer
from edge_agent.train.trainer import TrainConfig

LIB = native_float.native_library()
needs_lib = pytest.mark.skipif(LIB is None, reason="the native library is not built here (no C compiler at install)")


def _node(k: tuple[int, int], s: tuple[int, int], p: tuple[int, int], c: int) -> numpy_tail._Node:
    return numpy_tail._Node("Convolution", "dw", {"kernel": k, "stride": s, "pad": p, "groups": c})


def _numpy_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native_float, "native_library", lambda: None)


@st.composite
def geometries(draw: st.DrawFn) -> tuple:
    kh, kw = draw(st.sampled_from([1, 3, 5])), draw(st.sampled_from([1, 3]))
    ph, pw = draw(st.integers(0, kh - 1)), draw(st.integers(0, kw - 1))
    sh, sw = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    h, w = draw(st.integers(max(1, kh - 2 * ph), 7)), draw(st.integers(max(1, kw - 2 * pw), 7))
    return draw(st.integers(1, 3)), h, w, draw(st.integers(1, 19)), (kh, kw), (sh, sw), (ph, pw), draw(st.booleans())


@needs_lib
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(geometries(), st.sampled_from([(True, True), (True, False), (False, True)]))
def test_c_and_numpy_depthwise_agree(monkeypatch: pytest.MonkeyPatch, geometry: tuple, need: tuple) -> None:
    n, h, w, c, k, s, p, bias = geometry
    assume(not (c == 1 and k == (1, 1) and p == (0, 0)))  # a plain 1x1 convolution: one matrix product
    rng = np.random.default_rng([n, h, w, c, *k, *s, *p])
    x = rng.normal(size=(n, h, w, c)).astype(np.float32)
    ins = [x, rng.normal(size=(c, 1, *k)).astype(np.float32)] + ([rng.normal(size=c).astype(np.float32)] if bias else [])
    node = _node(k, s, p, c)
    out_c, cache_c = numpy_tail._conv_fwd(node, ins, True)
    assert cache_c[0] == "native"
    g = rng.normal(size=out_c.shape).astype(np.float32)
    flags = [*need, True][:len(ins)]
    grads_c = numpy_tail._conv_bwd(node, ins, out_c, cache_c, g, flags)
    with monkeypatch.context() as m:
        _numpy_path(m)
        out_n, cache_n = numpy_tail._conv_fwd(node, ins, True)
        assert cache_n[0] == "numpy"
        grads_n = numpy_tail._conv_bwd(node, ins, out_n, cache_n, g, flags)
    assert out_c.shape == out_n.shape and out_c.dtype == np.float32
    np.testing.assert_allclose(out_c, out_n, rtol=1e-6, atol=1e-6)
    for got, want, needed in zip(grads_c, grads_n, flags, strict=True):
        assert (got is None) == (want is None) == (not needed)
        if got is not None:
            assert got.shape == want.shape and got.dtype == np.float32
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@needs_lib
def test_the_library_refuses_what_it_does_not_compute() -> None:
    x = np.zeros((1, 3, 3, 4), np.float32)
    taps = np.zeros((9, 4), np.float32)
    out = np.zeros((1, 3, 3, 4), np.float32)
    ok = dict(batch=1, in_h=3, in_w=3, in_c=4, out_h=3, out_w=3, out_c=4, k_h=3, k_w=3, stride_h=1, stride_w=1,
              dilation_h=1, dilation_w=1, pad_top=1, pad_left=1, depth_multiplier=1)
    fwd = LIB.ea_f32_depthwise_fwd
    assert fwd(ctypes.byref(native_float.ConvParams(**ok)), x.ctypes.data, taps.ctypes.data, out.ctypes.data) == 0
    for bad in ({"dilation_h": 0}, {"out_c": 8}, {"depth_multiplier": 2}, {"stride_w": 0}, {"out_h": 9},
                {"pad_left": -1}):
        p = native_float.ConvParams(**{**ok, **bad})
        assert fwd(ctypes.byref(p), x.ctypes.data, taps.ctypes.data, out.ctypes.data) == -1, bad
    assert LIB.ea_f32_depthwise_bwd(ctypes.byref(native_float.ConvParams(**ok)), x.ctypes.data, taps.ctypes.data,
                                    out.ctypes.data, None, None) == -1  # no gradient asked for


def _tiny_tail() -> str:
    """conv 3x3 depthwise (pad 1) -> BatchNorm -> relu -> global average pool -> FC: MXNet symbol JSON."""
    import json

    nodes = [{"op": "null", "name": "data", "inputs": []},
             {"op": "null", "name": "dw_weight", "inputs": []},
             {"op": "Convolution", "name": "dw", "attrs": {"kernel": "(3, 3)", "pad": "(1, 1)", "num_group": "6",
                                                          "num_filter": "6", "no_bias": "True"},
              "inputs": [[0, 0, 0], [1, 0, 0]]},
             *({"op": "null", "name": f"bn_{v}", "inputs": []} for v in ("gamma", "beta", "moving_mean", "moving_var")),
             {"op": "BatchNorm", "name": "bn", "attrs": {"fix_gamma": "False"},
              "inputs": [[2, 0, 0], [3, 0, 0], [4, 0, 0], [5, 0, 1], [6, 0, 1]]},
             {"op": "Activation", "name": "relu", "attrs": {"act_type": "relu"}, "inputs": [[7, 0, 0]]},
             {"op": "Pooling", "name": "pool", "attrs": {"global_pool": "True", "pool_type": "avg", "kernel": "(1, 1)"},
              "inputs": [[8, 0, 0]]},
             {"op": "null", "name": "fc_weight", "inputs": []}, {"op": "null", "name": "fc_bias", "inputs": []},
             {"op": "FullyConnected", "name": "fc", "attrs": {"num_hidden": "3"},
              "inputs": [[9, 0, 0], [10, 0, 0], [11, 0, 0]]}]
    return json.dumps({"nodes": nodes, "heads": [[12, 0, 0]], "arg_nodes": [0, 1, 3, 4, 5, 6, 10, 11]})


@needs_lib
def test_a_tail_trains_to_the_same_parameters_with_or_without_the_library(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(0)
    params = {"dw_weight": rng.normal(0, 0.5, (6, 1, 3, 3)), "bn_gamma": np.ones(6), "bn_beta": np.zeros(6),
              "bn_moving_mean": np.zeros(6), "bn_moving_var": np.ones(6), "fc_weight": rng.normal(0, 0.5, (3, 6)),
              "fc_bias": np.zeros(3)}
    params = {k: np.asarray(v, np.float32) for k, v in params.items()}
    x = rng.normal(size=(48, 6, 4, 4)).astype(np.float32)
    y = (x[:, :3].mean(axis=(2, 3)).argmax(axis=1)).astype(np.int64)

    def train() -> dict[str, np.ndarray]:
        t = NumpyTailTrainer(symbol_json=_tiny_tail(), params=params, input_name="data", num_classes=3,
                             config=TrainConfig(lr=0.05, batch_size=16))
        for _ in range(3):
            for i in range(0, len(x), 16):
                t.step(x[i:i + 16], y[i:i + 16])
        return {k: np.array(v) for k, v in t.params().items()}

    native = train()
    with monkeypatch.context() as m:
        _numpy_path(m)
        fallback = train()
    assert native.keys() == fallback.keys()
    assert not np.allclose(native["dw_weight"], params["dw_weight"])  # it trained
    for k in native:
        np.testing.assert_allclose(native[k], fallback[k], rtol=1e-4, atol=1e-5, err_msg=k)


@needs_lib
def test_a_real_float_prefix_runs_to_numpys_bits(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """MobileNetV2's float prefix (SAME padding, stride 2, 3x3 depthwise at every block) on
    images: the C depthwise gives exactly numpy's outputs at every tensor, so calibration
    ranges, statistics and bundles do not depend on whether the library was built."""
    from edge_agent.int8.bundle import load_bundle
    from edge_agent.int8.bundle_create import create_bundle
    from edge_agent.int8.float_graph import run_float
    from edge_agent.int8.onnx_import import import_onnx
    from edge_agent.sim import models

    shape = (3, 32, 32)
    net = models.initialize(models.mobilenet_v2(0.35, 4, shape[-1]), seed=0, randomize_bn=True)
    calib = np.random.default_rng(0).normal(0, 1, (8, *shape)).astype(np.float32)
    create_bundle(net, tmp_path / "b", calibration=calib, labels=list("abcd"), name="b", version="1", input_shape=shape)
    bundle = load_bundle(tmp_path / "b")
    graph = import_onnx(bundle.onnx_bytes(), split=bundle.manifest.split_tensor)
    assert sum(op.kind == "DEPTHWISE_CONV_2D" for op in graph.ops) >= 5
    x = np.random.default_rng(1).normal(0, 1, (5, *shape)).astype(np.float32)

    calls = []
    forward = native_float.depthwise_forward
    monkeypatch.setattr(native_float, "depthwise_forward", lambda *a: calls.append(1) or forward(*a))

    def tensors() -> dict[str, np.ndarray]:
        seen: dict[str, np.ndarray] = {}
        run_float(graph, x, on_tensor=lambda name, v: seen.__setitem__(name, v.copy()))
        return seen

    native = tensors()
    ran_in_c = len(calls)
    with monkeypatch.context() as m:
        _numpy_path(m)
        fallback = tensors()
    assert ran_in_c == sum(op.kind == "DEPTHWISE_CONV_2D" for op in graph.ops) and len(calls) == ran_in_c
    assert native.keys() == fallback.keys()
    for name in native:
        assert np.array_equal(native[name], fallback[name]), name


@needs_lib
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(["SAME", "VALID"]), st.integers(1, 2), st.integers(1, 2), st.sampled_from([1, 3, 5]),
       st.integers(5, 9), st.integers(1, 13))
def test_float_ops_depthwise_gives_numpys_bits(monkeypatch: pytest.MonkeyPatch, padding: str, stride: int,
                                               dilation: int, k: int, size: int, c: int) -> None:
    """The float prefix's DEPTHWISE_CONV_2D (TFLite layout, SAME's extra cell after, strides,
    dilation) in C and in numpy: the same bits."""
    from edge_agent.int8.float_ops import run_op

    assume(padding == "SAME" or (k - 1) * dilation + 1 <= size)  # else no output: the importer refuses it
    rng = np.random.default_rng([k, size, c, stride, dilation])
    x = rng.normal(size=(2, size, size + 1, c)).astype(np.float32)
    w, b = rng.normal(size=(1, k, k, c)).astype(np.float32), rng.normal(size=c).astype(np.float32)
    options = {"stride_h": stride, "stride_w": stride, "dilation_h": dilation, "dilation_w": dilation,
               "padding": padding, "depth_multiplier": 1, "activation": "NONE"}
    native = run_op("DEPTHWISE_CONV_2D", [x], options, w, b)
    with monkeypatch.context() as m:
        _numpy_path(m)
        fallback = run_op("DEPTHWISE_CONV_2D", [x], options, w, b)
    assert native.shape == fallback.shape and native.dtype == fallback.dtype == np.float32
    assert np.array_equal(native, fallback)
