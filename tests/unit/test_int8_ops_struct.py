"""Structural ops of real models (issue 14): hand-built ONNX graphs (onnx.helper), each
imported, checked against onnx's own ReferenceEvaluator in float, quantised, written as
.tflite and run by tflite-runtime 2.14 (the oracle): the numpy reference must equal TFLite's
reference kernels exactly, the optimized/XNNPACK path within OPTIMIZED_MODEL_BOUND units,
and the native engine must equal the reference. Gluon's resnet18_v1 / v2 go the whole way
through the project's MXNet -> ONNX export. Unsupported attribute combinations raise an
error naming the node, the op and what is supported.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from edge_agent.int8.engines.native import NativeRunner
from edge_agent.int8.float_graph import run_float
from edge_agent.int8.graph import UnsupportedOpError
from edge_agent.int8.onnx_import import OnnxImportError, import_onnx
from edge_agent.int8.quantize import quantize_graph, quantize_input
from edge_agent.int8.reference import run_graph
from edge_agent.int8.testing import run_tflite
from edge_agent.int8.tflite_reader import read_tflite
from edge_agent.int8.tflite_writer import write_tflite

OPTIMIZED_MODEL_BOUND = 2  # test_int8_reference's bound for whole models (optimized kernels)


def _w(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed + sum(shape)).normal(0, 0.5, shape).astype(np.float32)


def _model(nodes: list, in_shape: tuple[int, ...], inits: dict[str, np.ndarray], opset: int = 14):
    # opset 14: onnx 1.15's ReferenceEvaluator runs an opset 9-13 BatchNormalization with
    # batch statistics (its momentum default), not the inference formula
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(in_shape))],
        [helper.make_tensor_value_info(nodes[-1].output[0], TensorProto.FLOAT, None)],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _conv(name: str, x: str, y: str, w: str, **kw) -> helper.NodeProto:
    return helper.make_node("Conv", [x, w], [y], name=name, **kw)


def end_to_end(model, *, batch: int = 3, seed: int = 0, kinds: set[str] | None = None) -> np.ndarray:
    """Float graph == ONNX's reference; int8 reference == TFLite exactly; optimized within the
    bound; native engine == reference; the .tflite reads back. Returns the int8 output."""
    g = import_onnx(model)
    if kinds is not None:
        assert kinds <= {op.kind for op in g.ops}, [op.kind for op in g.ops]
    shape = g.input_shape
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1, (batch, *shape[1:])).astype(np.float32)
    expected = ReferenceEvaluator(model).run(None, {"x": x})[0]
    np.testing.assert_allclose(run_float(g, x), expected, rtol=1e-4, atol=1e-4)
    # the checked samples are among the calibration ones: no clipping in the float comparison
    q = quantize_graph(g, np.concatenate([x, rng.normal(0, 1, (13, *shape[1:])).astype(np.float32)]))
    tfl = write_tflite(q)
    assert [op.kind for op in read_tflite(tfl).ops] == [op.kind for op in q.ops]
    xi = quantize_input(x, q)
    ours = run_graph(q, xi)
    np.testing.assert_array_equal(ours, run_tflite(tfl, xi, reference_kernels=True))
    optimized = run_tflite(tfl, xi, reference_kernels=False)
    assert np.abs(optimized.astype(np.int32) - ours).max() <= OPTIMIZED_MODEL_BOUND
    np.testing.assert_array_equal(NativeRunner(q).run_int8(xi), ours)
    # and the int8 result means the float one: within a few output steps
    out = q.tensors[q.outputs[0]]
    deq = (ours.astype(np.float32) - out.zero_point[0]) * out.scale[0]
    deq = deq.transpose(0, 3, 1, 2) if deq.ndim == 4 else deq
    assert np.abs(deq - expected).max() <= 0.1 * (np.abs(expected).max() + 1e-6) + 3 * out.scale[0]
    return ours


# ------------------------------------------------------------------------ pools
@pytest.mark.parametrize(("hw", "attrs", "kinds"), [
    # ResNet v1 stem (k3 s2 pads 1): on an even map TFLite's SAME would pad (0, 1), not (1, 1)
    (8, {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}, ["PADV2", "MAX_POOL_2D"]),
    (9, {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}, ["MAX_POOL_2D"]),  # = SAME
    (8, {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}, ["PADV2", "MAX_POOL_2D"]),  # SqueezeNet
    (7, {"kernel_shape": [2, 3], "strides": [1, 2], "pads": [0, 1, 1, 0]}, ["PADV2", "MAX_POOL_2D"]),
])
def test_max_pool_with_explicit_pads_is_padv2_then_valid(hw: int, attrs: dict, kinds: list[str]) -> None:
    nodes = [_conv("c0", "x", "c", "w", pads=[1, 1, 1, 1]),
             helper.make_node("MaxPool", ["c"], ["y"], name="pool", **attrs)]
    model = _model(nodes, (1, 3, hw, hw), {"w": _w(6, 3, 3, 3)})
    assert [op.kind for op in import_onnx(model).ops] == ["CONV_2D", *kinds]
    end_to_end(model)


def test_average_pool_with_pads() -> None:
    # count_include_pad=1: zero PAD then VALID (exact); count_include_pad=0 with SAME's pads: SAME
    nodes = [_conv("c0", "x", "c", "w"),
             helper.make_node("AveragePool", ["c"], ["a"], name="avg_incl", kernel_shape=[3, 3], strides=[2, 2],
                              pads=[1, 1, 1, 1], count_include_pad=1),
             helper.make_node("AveragePool", ["a"], ["y"], name="avg_same", kernel_shape=[3, 3], pads=[1, 1, 1, 1])]
    end_to_end(_model(nodes, (1, 3, 9, 9), {"w": _w(4, 3, 1, 1)}), kinds={"PAD", "AVERAGE_POOL_2D"})
    bad = [_conv("c0", "x", "c", "w"),
           helper.make_node("AveragePool", ["c"], ["y"], name="avg_odd", kernel_shape=[3, 3], pads=[0, 0, 2, 2])]
    with pytest.raises(UnsupportedOpError, match=r"node 'avg_odd': op 'AveragePool'.*supported: no pads"):
        import_onnx(_model(bad, (1, 3, 9, 9), {"w": _w(4, 3, 1, 1)}))


# ------------------------------------------------------------------------ batch norm
def _bn(name: str, x: str, y: str, c: int, seed: int) -> tuple[helper.NodeProto, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    p = {f"{name}_g": rng.uniform(-1.5, 1.5, c), f"{name}_b": rng.normal(0, 0.3, c),
         f"{name}_m": rng.normal(0, 0.3, c), f"{name}_v": rng.uniform(0.3, 2.0, c)}
    node = helper.make_node("BatchNormalization", [x, *p], [y], name=name, epsilon=1e-3)
    return node, {k: v.astype(np.float32) for k, v in p.items()}


def test_standalone_batch_norm_is_a_per_channel_depthwise() -> None:
    # ResNet v2: BN on the raw input, BN after a Relu and on a tensor also used by the shortcut
    bn0, p0 = _bn("bn_in", "x", "b0", 3, 0)
    bn1, p1 = _bn("bn_pre", "r", "b1", 6, 1)
    nodes = [bn0, _conv("c0", "b0", "c", "w0", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"], name="relu0"), bn1,
             helper.make_node("Relu", ["b1"], ["rb"], name="relu1"),
             _conv("c1", "rb", "c1", "w1"), helper.make_node("Add", ["c1", "r"], ["y"], name="sum")]
    model = _model(nodes, (1, 3, 6, 6), {"w0": _w(6, 3, 3, 3), "w1": _w(6, 6, 1, 1), **p0, **p1})
    g = import_onnx(model)
    dw = [op for op in g.ops if op.kind == "DEPTHWISE_CONV_2D"]
    assert [op.name for op in dw] == ["bn_in", "bn_pre"] and dw[1].options["activation"] == "RELU"
    end_to_end(model)


def test_batch_norm_on_2d_features() -> None:
    bn, p = _bn("bn1d", "f", "b", 5, 2)
    nodes = [_conv("c0", "x", "c", "w"), helper.make_node("GlobalAveragePool", ["c"], ["p"], name="gap"),
             helper.make_node("Flatten", ["p"], ["f"], name="flat"), bn,
             helper.make_node("Gemm", ["b", "fc_w"], ["y"], name="fc", transB=1)]
    end_to_end(_model(nodes, (1, 3, 5, 5), {"w": _w(5, 3, 3, 3), "fc_w": _w(4, 5), **p}),
               kinds={"DEPTHWISE_CONV_2D", "RESHAPE"})


# ------------------------------------------------------------------------ identity, gemm, matmul
def test_identity_of_an_initializer_and_gemm_variants() -> None:
    nodes = [helper.make_node("Identity", ["w"], ["w_alias"], name="Identity_70"),  # torch legacy exporter
             _conv("c0", "x", "c", "w_alias"), helper.make_node("Identity", ["c"], ["ci"], name="id"),
             helper.make_node("Flatten", ["ci"], ["f"], name="flat"),  # after a spatial map: NCHW order
             helper.make_node("Gemm", ["f", "g1"], ["h"], name="no_bias", alpha=0.5),  # no C, transB=0
             helper.make_node("Relu", ["h"], ["hr"], name="relu"),
             helper.make_node("Gemm", ["hr", "g2", "g2b"], ["m"], name="with_bias", transB=1, beta=2.0),
             helper.make_node("MatMul", ["m", "mm"], ["y"], name="matmul")]
    inits = {"w": _w(4, 3, 3, 3), "g1": _w(4 * 3 * 3, 7), "g2": _w(6, 7), "g2b": _w(6), "mm": _w(6, 3)}
    end_to_end(_model(nodes, (1, 3, 5, 5), inits), kinds={"FULLY_CONNECTED"})
    bad = [_conv("c0", "x", "c", "w"), helper.make_node("Flatten", ["c"], ["f"], name="flat"),
           helper.make_node("Gemm", ["f", "g"], ["y"], name="gemm_ta", transA=1)]
    with pytest.raises(UnsupportedOpError, match=r"node 'gemm_ta': op 'Gemm'.*supported: transA=0"):
        import_onnx(_model(bad, (1, 3, 1, 1), {"w": _w(4, 3, 1, 1), "g": _w(1, 4)}))


def test_exporter_constant_folding_and_squeeze_unsqueeze() -> None:
    # torch dynamo style: weights reshaped / transposed by nodes, Squeeze after the global pool,
    # MatMul + Add bias, Unsqueeze back to a map for a 1x1 conv
    nodes = [helper.make_node("Reshape", ["w_flat", "w_shape"], ["w"], name="w_view"),
             _conv("c0", "x", "c", "w", pads=[1, 1, 1, 1]),
             helper.make_node("GlobalAveragePool", ["c"], ["p"], name="gap"),
             helper.make_node("Squeeze", ["p", "hw"], ["f"], name="squeeze"),
             helper.make_node("Transpose", ["lin_w"], ["lin_wt"], name="t", perm=[1, 0]),
             helper.make_node("MatMul", ["f", "lin_wt"], ["m"], name="linear"),
             helper.make_node("Add", ["m", "lin_b"], ["mb"], name="linear_bias"),
             helper.make_node("Unsqueeze", ["mb", "hw"], ["u"], name="unsqueeze"),
             _conv("c1", "u", "y", "w1")]
    inits = {"w_flat": _w(6 * 3 * 3 * 3), "w_shape": np.array([6, 3, 3, 3], np.int64),
             "hw": np.array([2, 3], np.int64), "lin_w": _w(5, 6), "lin_b": _w(5), "w1": _w(4, 5, 1, 1)}
    model = _model(nodes, (1, 3, 5, 5), inits)
    kinds = [op.kind for op in import_onnx(model).ops]
    assert kinds == ["CONV_2D", "MEAN", "RESHAPE", "FULLY_CONNECTED", "RESHAPE", "CONV_2D"]
    end_to_end(model)


# ------------------------------------------------------------------------ grouped conv, shuffle, split
@pytest.mark.parametrize(("cin", "cout", "group", "stride"), [(8, 8, 2, 1), (12, 6, 3, 2), (8, 16, 4, 1)])
def test_grouped_convolution_is_one_conv_2d(cin: int, cout: int, group: int, stride: int) -> None:
    nodes = [_conv("c0", "x", "c", "w0"),
             _conv("grouped", "c", "y", "wg", group=group, pads=[1, 1, 1, 1], strides=[stride, stride])]
    model = _model(nodes, (1, 3, 7, 7), {"w0": _w(cin, 3, 1, 1), "wg": _w(cout, cin // group, 3, 3)})
    g = import_onnx(model)
    assert [op.kind for op in g.ops] == ["CONV_2D", "CONV_2D"]
    end_to_end(model)


@pytest.mark.parametrize("spec", ["explicit", "wildcards"])
def test_channel_shuffle_is_an_exact_gather(spec: str) -> None:
    n, c, g, hw = 1, 12, 3, 4
    shapes = {"s5": np.array([n, g, c // g, hw, hw]), "s4": np.array([n, c, hw, hw])}
    if spec == "wildcards":
        shapes = {"s5": np.array([0, g, -1, hw, hw]), "s4": np.array([0, -1, hw, hw])}
    nodes = [_conv("c0", "x", "c", "w0"),
             helper.make_node("Reshape", ["c", "s5"], ["r5"], name="view"),
             helper.make_node("Transpose", ["r5"], ["t5"], name="swap", perm=[0, 2, 1, 3, 4]),
             helper.make_node("Reshape", ["t5", "s4"], ["s"], name="shuffle"),
             _conv("c1", "s", "y", "w1")]
    inits = {"w0": _w(c, 3, 1, 1), "w1": _w(5, c, 1, 1), **{k: v.astype(np.int64) for k, v in shapes.items()}}
    model = _model(nodes, (1, 3, hw, hw), inits)
    gather = [op for op in import_onnx(model).ops if op.kind == "GATHER"]
    assert len(gather) == 1 and gather[0].options["indices"].tolist() == [0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11]
    end_to_end(model, batch=1 if spec == "explicit" else 3)


def test_channel_split_then_concat() -> None:
    # ShuffleNet v2 unit: chunk into two, convolve one half, concatenate (different scales)
    nodes = [_conv("c0", "x", "c", "w0"),
             helper.make_node("Split", ["c", "sizes"], ["a", "b"], name="chunk", axis=1),
             _conv("cb", "b", "b2", "wb", pads=[1, 1, 1, 1]),
             helper.make_node("Concat", ["a", "b2"], ["y"], name="cat", axis=1)]
    inits = {"w0": _w(8, 3, 1, 1), "wb": _w(4, 4, 3, 3), "sizes": np.array([4, 4], np.int64)}
    end_to_end(_model(nodes, (1, 3, 5, 5), inits), kinds={"GATHER", "CONCATENATION"})


def test_densenet_style_repeated_concat_and_flatten_variants() -> None:
    nodes, inits, x = [], {}, "c"
    nodes.append(_conv("stem", "x", "c", "w_stem", pads=[1, 1, 1, 1]))
    inits["w_stem"] = _w(4, 3, 3, 3)
    channels = 4
    for i in range(3):  # x = concat(x, conv(relu(bn(x)))): growing channels, one shared scale
        bn, p = _bn(f"bn{i}", x, f"b{i}", channels, 10 + i)
        nodes += [bn, helper.make_node("Relu", [f"b{i}"], [f"r{i}"], name=f"relu{i}"),
                  _conv(f"conv{i}", f"r{i}", f"n{i}", f"w{i}", pads=[1, 1, 1, 1]),
                  helper.make_node("Concat", [x, f"n{i}"], [f"cat{i}"], name=f"cat{i}", axis=1)]
        inits.update(p)
        inits[f"w{i}"] = _w(3, channels, 3, 3, seed=i)
        x, channels = f"cat{i}", channels + 3
    nodes += [helper.make_node("AveragePool", [x], ["t"], name="transition", kernel_shape=[2, 2], strides=[2, 2]),
              helper.make_node("GlobalAveragePool", ["t"], ["g"], name="gap"),
              helper.make_node("Reshape", ["g", "flat_shape"], ["f"], name="flatten"),
              helper.make_node("Gemm", ["f", "fc"], ["y"], name="fc", transB=1)]
    inits.update(flat_shape=np.array([0, -1], np.int64), fc=_w(5, channels))
    end_to_end(_model(nodes, (1, 3, 6, 6), inits), kinds={"CONCATENATION"})


@pytest.mark.parametrize(("node", "inits", "match"), [
    (helper.make_node("Transpose", ["c"], ["y"], name="tr", perm=[0, 2, 3, 1]), {},
     r"node 'tr': op 'Transpose'.*perm \(0, 2, 3, 1\).*supported"),
    (helper.make_node("Reshape", ["c", "s"], ["y"], name="rs"), {"s": np.array([1, 2, 2, 16], np.int64)},
     r"node 'rs': op 'Reshape'.*supported: flattening"),
    (helper.make_node("MaxPool", ["c"], ["y"], name="mp", kernel_shape=[2, 2], pads=[2, 2, 0, 0]), {},
     r"node 'mp': op 'MaxPool'.*supported: pads smaller than the kernel"),
    (helper.make_node("Split", ["c"], ["y", "z"], name="sp", axis=2), {},
     r"node 'sp': op 'Split'.*supported: channels"),
    (helper.make_node("MaxPool", ["c"], ["y"], name="mp1d", kernel_shape=[2]), {},
     r"node 'mp1d': op 'MaxPool'.*supported: 2-D windows"),
    (helper.make_node("AveragePool", ["c"], ["y"], name="ap_big", kernel_shape=[5, 5]), {},
     r"node 'ap_big': op 'AveragePool'.*supported: positive windows"),
    (helper.make_node("Gemm", ["c", "w"], ["y"], name="gemm_map", transB=1), {},
     r"node 'gemm_map': op 'Gemm'"),
])
def test_unsupported_combinations_name_node_op_and_what_is_supported(node, inits, match) -> None:
    model = _model([_conv("c0", "x", "c", "w"), node], (1, 3, 4, 4), {"w": _w(4, 3, 1, 1), **inits})
    with pytest.raises((UnsupportedOpError, OnnxImportError), match=match):
        import_onnx(model)


# ------------------------------------------------------------------------ Gluon ResNets
def _gluon_resnet(name: str):
    import mxnet as mx

    mx.random.seed(0)
    net = mx.gluon.model_zoo.vision.get_model(name, pretrained=False, classes=10)
    net.initialize(mx.init.Xavier())
    net(mx.nd.zeros((1, 3, 32, 32)))
    for p in net.collect_params().values():  # BN statistics a trained net would have
        if p.name.endswith("running_var"):
            p.set_data(mx.nd.random.uniform(0.5, 1.5, p.shape))
        elif p.name.endswith(("running_mean", "beta")):
            p.set_data(mx.nd.random.normal(0, 0.1, p.shape))
    return net


@pytest.mark.parametrize(("name", "new_kinds"), [("resnet18_v1", {"PADV2"}),
                                                 ("resnet18_v2", {"PADV2", "DEPTHWISE_CONV_2D"})])
def test_gluon_resnet18_imports_quantises_and_runs_on_tflite(name: str, new_kinds: set[str]) -> None:
    import mxnet as mx

    from edge_agent.int8.onnx_export import export_onnx

    net = _gluon_resnet(name)
    g = import_onnx(export_onnx(net, (1, 3, 32, 32)))
    assert new_kinds <= {op.kind for op in g.ops}
    rng = np.random.default_rng(1)
    x = rng.normal(0, 1, (2, 3, 32, 32)).astype(np.float32)
    logits = net(mx.nd.array(x)).asnumpy()
    np.testing.assert_allclose(run_float(g, x), logits, rtol=1e-3, atol=1e-4)
    q = quantize_graph(g, np.concatenate([x, rng.normal(0, 1, (6, 3, 32, 32)).astype(np.float32)]))
    tfl = write_tflite(q)
    xi = quantize_input(x, q)
    ours = run_graph(q, xi)
    np.testing.assert_array_equal(ours, run_tflite(tfl, xi, reference_kernels=True))
    out = q.tensors[q.outputs[0]]
    deq = (ours.astype(np.float32) - out.zero_point[0]) * out.scale[0]
    assert np.abs(deq - logits).max() < 0.15 * np.abs(logits).max()
