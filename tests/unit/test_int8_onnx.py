"""ONNX export (MXNet) and import into the float graph; the numpy float executor.

Oracles: MXNet's own forward for exported Gluon nets, and onnx's ReferenceEvaluator (an
independent implementation of ONNX semantics) for hand-built graphs.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from edge_agent.atomic import FileTooLargeError
from edge_agent.errors import InputError
from edge_agent.int8.float_graph import run_float
from edge_agent.int8.graph import OP_OPTIONS, UnsupportedOpError
from edge_agent.int8.onnx_export import OnnxExportError, export_onnx
from edge_agent.int8.onnx_import import (
    OnnxImportError,
    import_onnx,
    load_onnx,
    node_names,
)
from edge_agent.sim import models

DIGITS_SHAPE = (1, 1, 8, 8)
MOBILE_SHAPE = (1, 3, 32, 32)


@pytest.fixture(scope="module")
def digits() -> tuple[object, bytes, bytes]:
    net = models.initialize(models.digits_cnn(), seed=0, randomize_bn=True)
    return net, export_onnx(net, DIGITS_SHAPE), export_onnx(net.features, DIGITS_SHAPE)


@pytest.fixture(scope="module")
def mobile() -> tuple[object, bytes]:
    net = models.initialize(models.mobilenet_v2(0.35, 10, 32), seed=0, randomize_bn=True)
    return net, export_onnx(net, MOBILE_SHAPE)


def _mx(block: object, x: np.ndarray) -> np.ndarray:
    import mxnet as mx

    return block(mx.nd.array(x)).asnumpy()


# ----------------------------------------------------------------- MXNet-exported nets
def test_digits_float_graph_matches_mxnet(digits) -> None:
    net, whole, backbone = digits
    x = np.random.default_rng(1).random((9, 1, 8, 8), dtype=np.float32)
    g = import_onnx(backbone)
    assert [op.kind for op in g.ops] == ["CONV_2D", "CONV_2D", "MAX_POOL_2D", "CONV_2D", "MEAN"]
    assert [op.options.get("activation") for op in g.ops[:2]] == ["RELU", "RELU"]
    assert g.output_shape == (1, 32, 1, 1)
    np.testing.assert_allclose(run_float(g, x), _mx(net.features, x), rtol=1e-5, atol=1e-6)
    full = import_onnx(whole)
    assert full.ops[-1].kind == "FULLY_CONNECTED"
    np.testing.assert_allclose(run_float(full, x), _mx(net, x), rtol=1e-5, atol=1e-6)


def test_mobilenet_float_graph_matches_mxnet(mobile) -> None:
    net, data = mobile
    g = import_onnx(data, split="features_gap_fwd")
    kinds = [op.kind for op in g.ops]
    assert set(kinds) <= set(OP_OPTIONS)
    assert kinds.count("DEPTHWISE_CONV_2D") == 17
    assert kinds.count("ADD") == 10  # one per skip connection
    # stride-2 3x3 convs with pads 1 differ from TFLite's SAME (extra cell first): explicit PAD
    assert kinds.count("PAD") == 5
    assert all(op.options["activation"] == "RELU6" for op in g.ops if op.kind == "DEPTHWISE_CONV_2D")
    assert g.output_shape == (1, 1280, 1, 1)
    x = np.random.default_rng(2).normal(size=(4, 3, 32, 32)).astype(np.float32)
    np.testing.assert_allclose(run_float(g, x), _mx(net.features, x), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(run_float(import_onnx(data), x), _mx(net, x), rtol=1e-4, atol=1e-5)


def test_split_by_node_or_tensor_name_cuts_the_backbone(digits) -> None:
    net, whole, _ = digits
    x = np.random.default_rng(3).random((3, 1, 8, 8), dtype=np.float32)
    expected = _mx(net.features[:7], x)  # conv-bn-relu x2 + max pool
    g = import_onnx(whole, split="features_pool1_fwd")
    assert g.output == "features_pool1_fwd"
    np.testing.assert_allclose(run_float(g, x), expected, rtol=1e-5, atol=1e-6)
    # BN folding follows the split: cutting at the BN keeps it, cutting at the conv drops it
    at_bn = import_onnx(whole, split="features_bn1_fwd")
    np.testing.assert_allclose(run_float(at_bn, x), _mx(net.features[:2], x), rtol=1e-5, atol=1e-6)
    at_conv = import_onnx(whole, split="features_conv1_fwd")
    np.testing.assert_allclose(run_float(at_conv, x), _mx(net.features[:1], x), rtol=1e-5, atol=1e-6)


def test_a_cut_converts_only_the_weights_its_nodes_read(digits) -> None:
    """A prefix import never reads the tail's initialisers (resnet50's depth prefixes each
    converted the tail's ~60 MB): one past the cut, unreadable, is not met until it is used."""
    _, whole, _ = digits
    model = onnx.load_from_string(whole)
    late = next(t for t in model.graph.initializer if t.name.endswith("fc_weight"))
    del late.float_data[-1]  # its dims now promise more than its data holds
    g = import_onnx(model, split="features_pool1_fwd")
    assert g.output == "features_pool1_fwd"
    with pytest.raises(OnnxImportError, match=f"initializer {late.name!r}: unreadable"):
        import_onnx(model)


def test_unknown_split_node_lists_valid_names(digits) -> None:
    _, whole, _ = digits
    with pytest.raises(OnnxImportError, match="unknown split node 'features_nope'") as err:
        import_onnx(whole, split="features_nope")
    # a few block boundaries with shapes, not every node name
    assert "features_gap_fwd [pool 1x32x1x1]" in str(err.value) and "model nodes" in str(err.value)
    assert "features_bn1_fwd" not in str(err.value)
    assert "features_gap_fwd" in node_names(load_onnx(whole))


def test_export_rejects_bad_arguments() -> None:
    with pytest.raises(OnnxExportError, match="NCHW"):
        export_onnx(models.digits_cnn(), (8, 8))
    with pytest.raises(OnnxExportError, match="HybridBlock"):
        export_onnx(object(), DIGITS_SHAPE)


# ----------------------------------------------------------------- untrusted bytes
@pytest.mark.parametrize("keep", [0.5, 0.9, 0.999, 16])
def test_truncated_onnx_is_a_clear_error(digits, keep: float) -> None:
    data = digits[2]
    cut = int(len(data) * keep) if keep < 1 else int(keep)
    with pytest.raises(OnnxImportError, match="truncated or corrupt"):
        import_onnx(data[:cut])


def test_corrupt_onnx_bytes_are_clear_errors(digits, tmp_path) -> None:
    data = digits[2]
    for bad in (b"\xff" * 64, b"not an onnx file at all", bytes(len(data)), data[:5] + b"\x00\xff\xfe" + data[8:]):
        with pytest.raises(OnnxImportError):
            load_onnx(bad)
    with pytest.raises(OnnxImportError, match="empty"):
        load_onnx(b"")
    path = tmp_path / "model.onnx"
    path.write_bytes(data[: len(data) // 3])
    with pytest.raises(OnnxImportError, match=str(path)):
        load_onnx(path)
    with pytest.raises(OnnxImportError, match="cannot read"):
        load_onnx(tmp_path / "missing.onnx")
    path.write_bytes(data)
    assert len(import_onnx(path).ops) == 5
    with pytest.raises(FileTooLargeError):
        load_onnx(path, max_bytes=1000)
    with pytest.raises(FileTooLargeError):
        load_onnx(data, max_bytes=1000)
    assert issubclass(OnnxImportError, InputError)


def test_external_data_is_refused(digits) -> None:
    model = onnx.load_from_string(digits[2])
    init = model.graph.initializer[0]
    init.data_location = TensorProto.EXTERNAL
    init.external_data.add(key="location", value="../../etc/passwd")
    with pytest.raises(OnnxImportError, match="external data"):
        load_onnx(model.SerializeToString())


# ----------------------------------------------------------------- hand-built graphs
def _model(nodes: list, shape: tuple[int, ...], out_rank: int,
           inits: dict[str, np.ndarray] | None = None, opset: int = 13) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None] * out_rank)],
        [numpy_helper.from_array(v.astype(v.dtype), k) for k, v in (inits or {}).items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(model)
    return model


def _check_against_onnx(model: onnx.ModelProto, shape: tuple[int, ...], kinds: list[str]) -> None:
    g = import_onnx(model.SerializeToString())
    assert [op.kind for op in g.ops] == kinds
    x = np.random.default_rng(4).normal(size=(2, *shape[1:])).astype(np.float32)
    expected = np.concatenate([ReferenceEvaluator(model).run(None, {"x": x[i:i + 1]})[0] for i in range(2)])
    np.testing.assert_allclose(run_float(g, x), expected, rtol=1e-4, atol=1e-5)


def _w(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32) * 0.3


def test_branches_concat_pools_and_pad_match_onnx_reference() -> None:
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv_same", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu"),
        helper.make_node("Conv", ["x", "w2"], ["c2"], name="conv_asym", pads=[1, 1, 3, 1], dilations=[2, 1]),
        helper.make_node("Clip", ["c2", "lo", "hi"], ["r2"], name="relu6"),
        helper.make_node("Concat", ["r1", "r2"], ["cat"], name="concat", axis=1),
        helper.make_node("AveragePool", ["cat"], ["ap"], name="avg", kernel_shape=[3, 3],
                         strides=[2, 2], pads=[1, 1, 1, 1]),
        helper.make_node("MaxPool", ["ap"], ["mp"], name="max", kernel_shape=[2, 2], strides=[1, 1]),
        helper.make_node("Pad", ["mp", "pads"], ["pd"], name="pad"),
        helper.make_node("Identity", ["pd"], ["id"], name="ident"),
        helper.make_node("GlobalMaxPool", ["id"], ["y"], name="gmp"),
    ]
    inits = {"w1": _w(4, 3, 3, 3), "b1": _w(4, seed=1), "w2": _w(5, 3, 3, 3, seed=2),
             "lo": np.array(0, np.float32), "hi": np.array(6, np.float32),
             "pads": np.array([0, 0, 1, 0, 0, 0, 0, 2], np.int64)}
    _check_against_onnx(_model(nodes, (1, 3, 9, 9), 4, inits), (1, 3, 9, 9),
                        ["CONV_2D", "PAD", "CONV_2D", "CONCATENATION", "AVERAGE_POOL_2D",
                         "MAX_POOL_2D", "PAD", "MAX_POOL_2D"])


def test_depthwise_bn_mean_flatten_gemm_match_onnx_reference() -> None:
    c = 4
    rng = np.random.default_rng(5)
    nodes = [
        helper.make_node("Conv", ["x", "dw"], ["d"], name="dw", group=c, pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("BatchNormalization", ["d", "g", "b", "m", "v"], ["bn"], name="bn", epsilon=1e-3),
        helper.make_node("Relu", ["bn"], ["r"], name="relu"),
        helper.make_node("Flatten", ["r"], ["f"], name="flat"),  # 4x4 map: NCHW order matters
        helper.make_node("Gemm", ["f", "fc_w", "fc_b"], ["fc"], name="fc", transB=1, alpha=0.5, beta=2.0),
        helper.make_node("MatMul", ["fc", "mm_w"], ["mm"], name="mm"),
        helper.make_node("Add", ["mm_b", "mm"], ["y"], name="mm_bias"),  # constant first
    ]
    inits = {"dw": _w(2 * c, 1, 3, 3), "g": rng.uniform(0.5, 1.5, 2 * c).astype(np.float32),
             "b": _w(2 * c, seed=3), "m": _w(2 * c, seed=4),
             "v": rng.uniform(0.5, 2, 2 * c).astype(np.float32), "fc_w": _w(6, 2 * c * 16, seed=6),
             "fc_b": _w(6, seed=7), "mm_w": _w(6, 3, seed=8), "mm_b": _w(3, seed=9)}
    # opset 15: onnx's reference BatchNormalization-9 uses batch statistics when momentum is set
    _check_against_onnx(_model(nodes, (1, c, 8, 8), 2, inits, opset=15), (1, c, 8, 8),
                        ["PAD", "DEPTHWISE_CONV_2D", "RESHAPE", "FULLY_CONNECTED", "FULLY_CONNECTED"])


def test_residual_add_and_reduce_mean_opset18_match_onnx_reference() -> None:
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[0, 0, 0, 0]),
        helper.make_node("Add", ["c", "x"], ["s"], name="skip"),
        helper.make_node("Relu", ["s"], ["r"], name="relu"),
        helper.make_node("Dropout", ["r"], ["dr"], name="drop"),
        helper.make_node("ReduceMean", ["dr", "axes"], ["y"], name="mean", keepdims=0),
    ]
    inits = {"w": _w(3, 3, 1, 1), "axes": np.array([2, 3], np.int64)}
    model = _model(nodes, (1, 3, 5, 5), 2, inits, opset=18)
    _check_against_onnx(model, (1, 3, 5, 5), ["CONV_2D", "ADD", "MEAN"])
    assert import_onnx(model).ops[1].options["activation"] == "RELU"


def test_unsupported_op_names_the_node_and_op() -> None:
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv0"),
             helper.make_node("Tanh", ["c"], ["y"], name="gate7")]
    model = _model(nodes, (1, 2, 4, 4), 4, {"w": _w(2, 2, 1, 1)})
    with pytest.raises(UnsupportedOpError, match="node 'gate7': op 'Tanh'") as err:
        import_onnx(model)
    assert (err.value.node, err.value.op) == ("gate7", "Tanh")
    # the same model cut before the unsupported node imports fine, by node or tensor name
    for split in ("conv0", "c"):
        g = import_onnx(model, split=split)
        assert [op.kind for op in g.ops] == ["CONV_2D"] and g.output == "c"


@pytest.mark.parametrize(("nodes", "inits", "node", "op"), [
    ([helper.make_node("Clip", ["c", "lo", "hi"], ["y"], name="clip4")],
     {"lo": np.array(0, np.float32), "hi": np.array(4, np.float32)}, "clip4", "Clip"),
    # groups that do not divide the channels (group=2 on 4 channels is a grouped CONV_2D now)
    ([helper.make_node("Conv", ["c", "g"], ["y"], name="grouped", group=3)],
     {"g": _w(3, 1, 1, 1)}, "grouped", "Conv"),
    ([helper.make_node("Flatten", ["c"], ["y"], name="flat_out")], {}, "flat_out", "Flatten"),
    ([helper.make_node("Relu", ["x"], ["y"], name="relu_on_input")], {}, "relu_on_input", "Relu"),
    # the conv output is also used raw (through an Identity alias): Relu cannot be fused
    ([helper.make_node("Identity", ["c"], ["i"], name="alias"),
      helper.make_node("Relu", ["i"], ["r"], name="relu_shared"),
      helper.make_node("Add", ["r", "c"], ["y"], name="sum")], {}, "relu_shared", "Relu"),
    # a constant that would enlarge the activation (a full map is an ADD with a constant now)
    ([helper.make_node("Add", ["c", "k"], ["y"], name="add_map")],
     {"k": _w(2, 4, 4, 4)}, "add_map", "Add"),
])
def test_inexpressible_patterns_are_unsupported(nodes: list, inits: dict, node: str, op: str) -> None:
    conv = helper.make_node("Conv", ["x", "w"], ["c"], name="conv0")
    model = _model([conv, *nodes], (1, 4, 4, 4), 4, {"w": _w(4, 4, 1, 1), **inits})
    with pytest.raises(UnsupportedOpError, match=f"node '{node}': op '{op}'"):
        import_onnx(model)


def test_float_executor_checks_the_input_shape(digits) -> None:
    g = import_onnx(digits[2])
    with pytest.raises(ValueError, match="does not match"):
        run_float(g, np.zeros((2, 1, 9, 8), np.float32))
