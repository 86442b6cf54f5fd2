"""Issue 41: shapes that are constant at the bundle's input size are folded (onnx_fold.py);
every refusal names the node and the op; `model nodes` marks which split points `model
create` accepts (split_check.py), with create's own reason where it refuses.

Hand-built graphs written the way torch's legacy exporter writes ShuffleNet v2 (chunk as
Shape -> Gather -> Add -> Div -> Mul -> Slice, view() targets as Shape -> Gather ->
Unsqueeze -> Concat), checked against onnx's ReferenceEvaluator on the unfolded model; then
the committed torchvision fixtures (tests/fixtures/models).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from edge_agent.coordinator.cli import main as coordinator_main
from edge_agent.errors import EXIT_OK
from edge_agent.int8.float_graph import run_float
from edge_agent.int8.graph import UnsupportedOpError
from edge_agent.int8.onnx_fold import fold_shapes
from edge_agent.int8.onnx_import import import_onnx, load_onnx, node_names
from edge_agent.int8.split_check import SplitChecker, check_split

MODELS = Path(__file__).resolve().parents[1] / "fixtures" / "models"
SHUFFLENET = MODELS / "shufflenet_v2_x0_5.legacy.onnx"
SQUEEZENET_DYNAMO = MODELS / "squeezenet1_1.dynamo.onnx"


def _i64(name: str, *values: int) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], name=f"c_{name}",
                            value=numpy_helper.from_array(np.array(values, np.int64), name))


def _scalar(name: str, value: int) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], name=f"c_{name}",
                            value=numpy_helper.from_array(np.array(value, np.int64), name))


def _shuffle_block(c: int, h: int, w: int, groups: int, *, batch: int | str = 1) -> onnx.ModelProto:
    """conv -> chunk(2) as Shape arithmetic -> conv on one half -> concat -> channel shuffle
    whose view() targets are Shape arithmetic too (torch's legacy exporter, ShuffleNet v2)."""
    rng = np.random.default_rng(c * 100 + h * 10 + w)
    half = c // 2
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["a"], name="conv0"),
        helper.make_node("Shape", ["a"], ["s"], name="shape"),
        _i64("one", 1), _i64("two", 2), _i64("zero", 0), _i64("axis1", 1),
        helper.make_node("Gather", ["s", "one"], ["ch"], name="gather_c", axis=0),
        helper.make_node("Add", ["ch", "one"], ["ch1"], name="add"),
        helper.make_node("Div", ["ch1", "two"], ["halfc"], name="div"),  # (C + 1) // 2 as torch writes chunk
        helper.make_node("Mul", ["halfc", "one"], ["end0"], name="mul0"),
        helper.make_node("Mul", ["halfc", "two"], ["end1"], name="mul1"),
        helper.make_node("Slice", ["a", "zero", "end0", "axis1"], ["left"], name="slice_left"),
        helper.make_node("Slice", ["a", "end0", "end1", "axis1"], ["right"], name="slice_right"),
        helper.make_node("Conv", ["right", "w1"], ["r1"], name="conv1"),
        helper.make_node("Relu", ["r1"], ["r2"], name="relu1"),
        helper.make_node("Concat", ["left", "r2"], ["cat"], name="concat", axis=1),
        helper.make_node("Shape", ["cat"], ["s2"], name="shape2"),
        _scalar("idx0", 0), _scalar("idx2", 2), _scalar("idx3", 3), _i64("g", groups), _i64("cg", c // groups),
        helper.make_node("Gather", ["s2", "idx0"], ["n"], name="gather_n", axis=0),
        helper.make_node("Gather", ["s2", "idx2"], ["hh"], name="gather_h", axis=0),
        helper.make_node("Gather", ["s2", "idx3"], ["ww"], name="gather_w", axis=0),
        *[helper.make_node("Unsqueeze", [t, "zero"], [f"{t}_u"], name=f"unsq_{t}") for t in ("n", "hh", "ww")],
        helper.make_node("Concat", ["n_u", "g", "cg", "hh_u", "ww_u"], ["shape5"], name="concat_shape5", axis=0),
        helper.make_node("Reshape", ["cat", "shape5"], ["v5"], name="reshape5"),
        helper.make_node("Transpose", ["v5"], ["t5"], name="transpose", perm=[0, 2, 1, 3, 4]),
        _i64("minus1", -1),
        helper.make_node("Concat", ["n_u", "minus1", "hh_u", "ww_u"], ["shape4"], name="concat_shape4", axis=0),
        helper.make_node("Reshape", ["t5", "shape4"], ["y"], name="reshape4"),
    ]
    inits = [numpy_helper.from_array(rng.normal(size=(c, 3, 1, 1)).astype(np.float32), "w0"),
             numpy_helper.from_array(rng.normal(size=(half, half, 1, 1)).astype(np.float32), "w1")]
    graph = helper.make_graph(nodes, "shuffle", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, h, w])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def _reference(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    return ReferenceEvaluator(model).run(None, {"x": x})[0]


# ----------------------------------------------------------------- the folding function
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(half=st.integers(1, 6), groups=st.sampled_from([1, 2]), h=st.integers(1, 5), w=st.integers(1, 5),
       seed=st.integers(0, 2**16))
def test_folded_shuffle_computes_what_the_unfolded_graph_does(half: int, groups: int, h: int, w: int,
                                                              seed: int) -> None:
    model = _shuffle_block(2 * half, h, w, groups)
    before = model.SerializeToString()
    folded = fold_shapes(model)
    assert model.SerializeToString() == before  # pure: the input model is untouched
    kinds = [n.op_type for n in folded.graph.node]
    assert "Shape" not in kinds and "Gather" not in kinds and "Div" not in kinds
    assert [n.name for n in folded.graph.node] == [n.name for n in model.graph.node]  # split points stay
    x = np.random.default_rng(seed).normal(size=(1, 3, h, w)).astype(np.float32)
    expected = _reference(model, x)
    np.testing.assert_array_equal(_reference(folded, x), expected)
    # and the importer maps it to TFLite ops: the chunk and the shuffle are GATHERs
    graph = import_onnx(model)
    assert {op.kind for op in graph.ops} <= {"CONV_2D", "GATHER", "CONCATENATION"}
    np.testing.assert_allclose(run_float(graph, x).reshape(expected.shape), expected, rtol=1e-5, atol=1e-5)


def test_folding_leaves_a_graph_without_shapes_and_float_weights_alone() -> None:
    w = numpy_helper.from_array(np.ones((4, 3, 1, 1), np.float32), "w")
    k = numpy_helper.from_array(np.full((1,), 2.0, np.float32), "k")
    nodes = [helper.make_node("Mul", ["w", "k"], ["w2"], name="scale_weight"),  # float constant arithmetic
             helper.make_node("Conv", ["x", "w2"], ["y"], name="conv")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 2, 2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w, k])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    assert fold_shapes(model) is model  # no Shape / Size: nothing to fold, no copy
    model.graph.node.append(helper.make_node("Shape", ["y"], ["s"], name="shape"))
    folded = fold_shapes(model)
    assert [n.op_type for n in folded.graph.node] == ["Mul", "Conv", "Constant"]  # the weight's Mul stays
    assert numpy_helper.to_array(folded.graph.node[2].attribute[0].t).tolist() == [1, 4, 2, 2]


def test_a_symbolic_batch_is_not_made_up_and_the_refusal_names_node_and_op() -> None:
    model = _shuffle_block(4, 2, 2, 2, batch="N")
    folded = fold_shapes(model)
    by_name = {n.name: n.op_type for n in folded.graph.node}
    assert by_name["gather_c"] == "Gather" and by_name["slice_left"] == "Slice"  # Shape(a) has N in it
    assert by_name["shape"] == "Shape"
    with pytest.raises(UnsupportedOpError) as err:
        import_onnx(model)
    assert err.value.node == "shape" and err.value.op == "Shape"
    assert "node 'shape': op 'Shape' is not supported" in str(err.value)


# ----------------------------------------------------------------- the torchvision fixtures
def test_shufflenet_v2_legacy_imports_and_matches_the_unfolded_onnx() -> None:
    original = onnx.load(str(SHUFFLENET))
    model = load_onnx(SHUFFLENET)
    assert node_names(model) == [n.name for n in original.graph.node]  # `--split` names unchanged
    assert "Shape" not in {n.op_type for n in model.graph.node}
    graph = import_onnx(model)  # the whole net: ReduceMean, then the Gemm classifier
    kinds = [op.kind for op in graph.ops]
    assert kinds.count("GATHER") == 42  # 26 channel slices (chunk) + 16 channel shuffles
    assert kinds[-1] == "FULLY_CONNECTED" and graph.output_shape == (1, 10)
    x = np.random.default_rng(0).normal(size=(2, 3, 32, 32)).astype(np.float32)
    evaluator = ReferenceEvaluator(original)  # onnx's own evaluator, on the Shape subgraphs as exported
    expected = np.concatenate([evaluator.run(None, {"input": x[i:i + 1]})[0] for i in range(2)])
    np.testing.assert_allclose(run_float(graph, x), expected, rtol=1e-4, atol=1e-4)


def test_shufflenet_int8_prefix_agrees_with_fp32(tmp_path: Path) -> None:
    """The matrix's measurement (zoo.measure: selection's agreement check of every engine,
    then int8-vs-fp32 top-1 on the 719 held-out digits) on the bundle at /ReduceMean. Not in
    the matrix itself: this fixture was trained with Adam to 91 % held-out and its int8
    top-1 agrees with fp32 on 98 % (the matrix's bar is 99 %, see test_model_zoo's doc);
    so the bar here is that every engine passes the agreement check and agreement >= 97 %."""
    from tests.fixtures.models import zoo

    arch = next(a for a in zoo.torch_archs() if a.id == "torch-shufflenet_v2_x0_5-legacy")
    result = zoo.measure(zoo.build(arch, tmp_path / "bundle"))
    available = {c.name: c for c in result.candidates if c.available}
    assert {"reference", "native", "tflite"} <= set(available)
    assert all(not c.error and c.correct is not False for c in available.values())
    assert available["native"].correct is True and result.chosen in available
    assert result.fp32_accuracy >= 0.85 and result.agreement >= 0.97, (result.fp32_accuracy, result.agreement)


# ----------------------------------------------------------------- model nodes vs model create
def _shufflenet_with_tanh(after: str = "/stage3/stage3.0/Concat_output_0") -> onnx.ModelProto:
    """The fixture with a Tanh inserted after `after`: MXNet imports Tanh (a head holding it
    is fine), the int8 path does not (a backbone holding it is refused)."""
    model = load_onnx(SHUFFLENET)
    for node in model.graph.node:
        node.input[:] = [f"{after}_tanh" if i == after else i for i in node.input]
    k = next(i for i, n in enumerate(model.graph.node) if after in n.output)
    model.graph.node.insert(k + 1, helper.make_node("Tanh", [after], [f"{after}_tanh"], name="odd_tanh"))
    return model


def test_split_check_and_create_agree(tmp_path: Path) -> None:
    from edge_agent.int8.bundle import BundleError
    from edge_agent.int8.bundle_create import create_bundle

    model = _shufflenet_with_tanh()
    source = model.SerializeToString()
    checker = SplitChecker(load_onnx(source), "onnx model")  # create's `where` for bytes
    accepted, refused = checker.check("/stage2/stage2.3/Concat"), checker.check("/stage4/stage4.0/Concat")
    assert accepted.to_json() == {"accepted": True, "reason": None, "head_checked": True}
    assert not refused.accepted
    assert "node 'odd_tanh': op 'Tanh' is not supported by the int8 path" in (refused.reason or "")
    x = np.random.default_rng(0).normal(size=(8, 3, 32, 32)).astype(np.float32)
    common = dict(calibration=x, labels=[str(i) for i in range(10)], name="s", version="1")
    bundle = create_bundle(source, tmp_path / "ok", split="/stage2/stage2.3/Concat", **common)
    assert tuple(bundle.manifest.feature_shape) == (48, 4, 4)
    with pytest.raises(BundleError) as err:
        create_bundle(source, tmp_path / "no", split="/stage4/stage4.0/Concat", **common)
    assert str(err.value) == refused.reason


def test_a_deep_shufflenet_head_imports_into_mxnet_exactly() -> None:
    """Behind the CREATE column's "yes" at a deep cut: the head (Slice channel splits, the
    5-D shuffle) imported into MXNet computes what onnx's evaluator does, batch of 3."""
    import mxnet as mx
    from onnx import utils as onnx_utils

    from edge_agent.int8.bundle_create import onnx_to_mxnet

    model = load_onnx(SHUFFLENET)
    tensor = "/stage2/stage2.0/Concat_output_0"
    head = onnx_utils.Extractor(model).extract_model([tensor], ["logits"])
    x = np.random.default_rng(1).normal(size=(3, 48, 4, 4)).astype(np.float32)
    evaluator = ReferenceEvaluator(head)
    expected = np.concatenate([evaluator.run(None, {tensor: x[i:i + 1]})[0] for i in range(3)])
    sym, args, aux = onnx_to_mxnet(head.SerializeToString())
    block = mx.gluon.SymbolBlock(sym, mx.sym.var(tensor))
    params = block.collect_params()
    for name, value in {**args, **aux}.items():
        params[name]._load_init(value, mx.cpu())  # noqa: SLF001 - as zoo._mxnet_backbone does
    np.testing.assert_allclose(block(mx.nd.array(x)).asnumpy(), expected, rtol=1e-4, atol=1e-5)


def test_squeezenet_dynamo_head_imports_and_a_refusal_names_node_and_op() -> None:
    """torch's dynamo exporter writes squeezenet's global mean as opset-18 ReduceMean (axes
    an input, noop_with_empty_axes): MXNet failed on it naming neither; now it imports."""
    model = load_onnx(SQUEEZENET_DYNAMO)
    verdict = check_split(model, "node_cat_7", str(SQUEEZENET_DYNAMO))
    assert verdict.accepted and verdict.head_checked, verdict.reason
    # an op MXNet's importer does not have, after the split: named with its node
    model.graph.node.append(helper.make_node("Einsum", ["view"], ["e"], name="odd_einsum", equation="ij->ij"))
    model.graph.output[0].name = "e"
    verdict = check_split(model, "node_cat_7", "m")
    assert not verdict.accepted and "node 'odd_einsum' (op Einsum)" in (verdict.reason or "")


def test_model_nodes_marks_what_create_accepts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "shufflenet_tanh.onnx"
    path.write_bytes(_shufflenet_with_tanh().SerializeToString())
    assert coordinator_main(["model", "nodes", str(path)]) == EXIT_OK
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["SPLIT", "SHAPE", "KIND", "CREATE"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert rows["/stage2/stage2.3/Concat"].split()[-1] == "yes"
    assert rows["/ReduceMean"].endswith("no: backbone up to '/ReduceMean_output_0': node 'odd_tanh': op 'Tanh' "
                                        "is not supported by the int8 path: supported ops: Add, AveragePool, "
                                        "BatchNormalization, Clip, Concat, Constant, Conv, Div, Dropout, Flatten, "
                                        "Gemm, GlobalAveragePool, GlobalMaxPool, HardSigmoid, HardSwish, Identity, "
                                        "MatMul, MaxPool, Mul, Pad, ReduceMean, Relu, Reshape, Sigmoid, Slice, "
                                        "Split, Squeeze, Sub, Transpose, Unsqueeze")
    # JSON carries the same verdicts ("create"; SplitVerdict.to_json); --no-check lists only
    assert coordinator_main(["model", "nodes", str(path), "--json", "--no-check"]) == EXIT_OK
    listed = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in listed] == [line.split()[0] for line in lines[1:]]
    assert not any("create" in r for r in listed)


def test_a_malformed_node_is_refused_naming_node_and_op() -> None:
    """Handlers' own refusals (OnnxImportError, not only UnsupportedOpError) name the op too."""
    from edge_agent.int8.onnx_import import OnnxImportError

    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y"], name="conv")]
    inits = [numpy_helper.from_array(np.ones((4, 3, 1, 1), np.float32), "w"),
             numpy_helper.from_array(np.ones(5, np.float32), "b")]  # 5 biases for 4 channels
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    with pytest.raises(OnnxImportError) as err:
        import_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))
    assert str(err.value) == "node 'conv' (op Conv): bias shape (5,) for 4 output channels"
