"""The model-zoo matrix (issue 14): networks nobody here wrote import, quantise and fine-tune.

Gluon model-zoo networks are built here (pretrained=False, smallest width, small input);
torchvision networks come as committed ONNX exports from both PyTorch exporters
(tests/fixtures/models/, made by make_torch_fixtures.py: torch is never a dependency).
Each architecture is its own test id: it imports into a bundle split at the global pool /
before the classifier; every available int8 engine passes the selection's agreement check;
int8 top-1 agrees with fp32 on >= 99 % of held-out digits through a head fitted on the fp32
features (random weights would make top-1 meaningless); a short fine-tune of the bundle's
own head on int8 features raises held-out accuracy. See tests/fixtures/models/zoo.py.

The nets are briefly trained on the training digits (Gluon: here, `zoo.train_gluon`, a few
seconds each; torchvision: by make_torch_fixtures.py), their classifiers re-initialised.
Trained features keep int8's rounding away from the decision boundaries, so the issue's
99 % agreement holds (measured on all 719 held-out digits).

What decides the agreement is how well the net is trained, not the quantiser: on the
MobileNets, every conv's own int8 error is at int8's floor (about 0.5 % per layer, per-channel
weights, min/max activation ranges) and compounds over 50+ layers to 7-9 % of the feature
spread, which flips top-1 only near a decision boundary. Trained with Adam for a few
seconds / epochs they reached 70-91 % held-out (train 95-100 %: Adam's minimum generalises
poorly on 1078 digits), so many held-out digits sat near a boundary and agreement was
91-97 %. Trained with Nesterov SGD + weight decay (Gluon mobilenet0.25, torchvision
mobilenet_v2, the latter with 1-pixel shifts) or AdamW for longer (torchvision squeezenet1_1,
no BatchNorm: 40 % held-out after 8 Adam epochs), they reach 95-98 % and agree >= 99 %.
squeezenet's logits pass a ReLU after its classifier conv: re-initialised with PyTorch's
default, most start closed and the fine-tune reached only 30 %; make_torch_fixtures.py
starts it as torchvision does (std 0.01) with a bias of 3.

MATRIX lists the architectures that pass today; bench_model_zoo builds and measures all of
them. Not in MATRIX: the Gluon mobilenet0.5 (passes, 99.6 %; left out for
the suite's time: mobilenet0.25 covers v1), the MobileNetV2s and SqueezeNets (mobilenet v1, v2
and squeezenet1.1 are covered by gluon-mobilenet0.25 and the torchvision exports; training
the Gluon MobileNetV2s / SqueezeNets to >= 95 % takes minutes here, too long for the suite)
and the torchvision efficientnet (Adam-trained, 90 % held-out, agreement below 99 %);
torchvision shufflenet_v2 (legacy), which imports since its Shape subgraphs fold
(onnx_fold.py) but, Adam-trained to 91 % held-out, agrees 98 % (tests/unit/
test_shape_folding.py checks its import against onnx's evaluator, and its engines and
agreement >= 97 % with this measurement). torch-squeezenet1_1-dynamo is the legacy
fixture's network (same weights) as the dynamo exporter writes it (opset 18 ReduceMean).

Then hand-built ONNX graphs, one per exporter quirk, against onnx's ReferenceEvaluator.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from edge_agent.int8.float_graph import run_float
from edge_agent.int8.onnx_import import import_onnx, load_onnx
from tests.fixtures.models import zoo

MATRIX = {"gluon-resnet18_v1", "gluon-resnet18_v2", "gluon-mobilenet0.25",
          "torch-resnet18-legacy", "torch-resnet18-dynamo", "torch-mobilenet_v2-legacy", "torch-mobilenet_v2-dynamo",
          "torch-mobilenet_v3_small-legacy", "torch-mobilenet_v3_small-dynamo", "torch-squeezenet1_1-legacy",
          "torch-squeezenet1_1-dynamo"}
# Engines the selection's agreement check may flag on an architecture (so they are never
# chosen there). On the trained nets of MATRIX none is flagged: an engine flagged there fails.
ENGINE_GAPS: dict[str, set[str]] = {}
ARCHS = [a for a in zoo.all_archs() if a.id in MATRIX]
CORE_ENGINES = {"reference", "native", "tflite"}  # installed with the test extras


# ----------------------------------------------------------------- the matrix
@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS, ids=[a.id for a in ARCHS])
def test_architecture_imports_quantises_and_finetunes(arch: zoo.Arch, tmp_path: Path) -> None:
    built = zoo.build(arch, tmp_path / "bundle")
    assert built.bundle.manifest.feature_shape[0] > 1
    result = zoo.measure(built)
    available = [c for c in result.candidates if c.available]
    assert {c.name for c in available} >= CORE_ENGINES
    for cand in available:  # selection's own check: int8 units / output steps and top-1
        assert not cand.error, (cand.name, cand.error)
        if cand.correct is False:  # flagged: must be a known gap, and never chosen
            assert cand.name in ENGINE_GAPS.get(arch.id, set()) and not cand.chosen, (cand.name, cand.max_diff)
    assert {c.name: c.correct for c in available}["native"] is True  # the project's own kernels
    assert result.chosen in {c.name for c in available if c.correct}
    # the fitted head really classifies (else agreement would be about noise)
    assert result.fp32_accuracy >= 0.9
    assert result.agreement >= 0.99, f"int8 top-1 agrees with fp32 on {result.agreement:.1%} of held-out digits"
    assert result.int8_accuracy >= result.fp32_accuracy - 0.01
    # the bundle's own (random) head, fine-tuned on int8 features with the project's trainer
    assert result.finetune_after >= max(0.5, result.finetune_before + 0.25), \
        (result.finetune_before, result.finetune_after)


def test_torch_fixtures_are_committed_small_and_as_listed() -> None:
    index = json.loads((zoo.HERE / "fixtures.json").read_text())["models"]
    ids = {row["id"] for row in index}
    for name in ("resnet18", "mobilenet_v2", "mobilenet_v3_small", "squeezenet1_1"):  # both exporters each
        assert {f"{name}-legacy", f"{name}-dynamo"} <= ids
    total = sum((zoo.HERE / f).stat().st_size for row in index for f in row["files"])
    assert total <= 22_000_000  # 20.95 MB: squeezenet1_1-dynamo (2.94 MB) took it past the first 20 MB
    assert any(row["external_data"] for row in index) and any(row["ir_version"] >= 10 for row in index)
    for row in index:
        onnx_files = {p.name for p in zoo.HERE.glob(row["file"] + "*")}
        assert onnx_files == set(row["files"]), row["id"]


# ----------------------------------------------------------------- exporter quirks
def _graph_model(nodes: list, shape: tuple[int, ...], inits: dict[str, np.ndarray], *, opset: int,
                 out_rank: int = 4, ir_version: int | None = None) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "quirk", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None] * out_rank)],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    if ir_version is not None:
        model.ir_version = ir_version
    return model


def _w(*shape: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).normal(size=shape) * 0.3).astype(np.float32)


def _matches_reference(model: onnx.ModelProto, source: object = None) -> list[str]:
    """Import (from `source`, default the serialised model), compare with onnx's evaluator;
    returns the op kinds."""
    g = import_onnx(model.SerializeToString() if source is None else source)
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    x = np.random.default_rng(4).normal(size=(2, *shape[1:])).astype(np.float32)
    evaluator = ReferenceEvaluator(model)
    expected = np.concatenate([evaluator.run(None, {"x": x[i:i + 1]})[0] for i in range(2)])
    got = run_float(g, x)
    np.testing.assert_allclose(got.reshape(expected.shape), expected, rtol=1e-4, atol=1e-5)
    return [op.kind for op in g.ops]


def test_identity_on_activations_and_on_weights() -> None:
    # the legacy exporter routes shared weights through Identity: 'Identity_70' feeding a Conv
    nodes = [helper.make_node("Identity", ["w0"], ["w_alias"], name="Identity_70"),
             helper.make_node("Conv", ["x", "w_alias", "b0"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("Identity", ["r"], ["i1"], name="Identity_71"),
             helper.make_node("Identity", ["i1"], ["i2"], name="Identity_72"),
             helper.make_node("MaxPool", ["i2"], ["y"], name="pool", kernel_shape=[2, 2], strides=[2, 2])]
    # (an Identity between a Conv and its Relu is refused today: zoo-findings 1)
    model = _graph_model(nodes, (1, 3, 6, 6), {"w0": _w(4, 3, 3, 3), "b0": _w(4, seed=1)}, opset=13)
    assert _matches_reference(model) == ["CONV_2D", "MAX_POOL_2D"]


def test_gemm_without_bias() -> None:
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
             helper.make_node("GlobalAveragePool", ["c"], ["p"], name="gap"),
             helper.make_node("Flatten", ["p"], ["f"], name="flat"),
             helper.make_node("Gemm", ["f", "fc"], ["y"], name="fc_nobias", transB=1)]
    model = _graph_model(nodes, (1, 3, 4, 4), {"w": _w(5, 3, 1, 1), "fc": _w(7, 5, seed=2)}, opset=13, out_rank=2)
    assert _matches_reference(model)[-1] == "FULLY_CONNECTED"


def _small_conv_model(*, opset: int, ir_version: int | None = None) -> onnx.ModelProto:
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["y"], name="relu")]
    return _graph_model(nodes, (1, 3, 5, 5), {"w": _w(4, 3, 3, 3), "b": _w(4, seed=3)}, opset=opset,
                        ir_version=ir_version)


def test_ir_version_10_from_the_dynamo_exporter() -> None:
    assert _matches_reference(_small_conv_model(opset=18, ir_version=10)) == ["CONV_2D"]


def test_external_data_file_next_to_the_model(tmp_path: Path) -> None:
    model = _small_conv_model(opset=18)
    path = tmp_path / "model.onnx"
    onnx.save_model(onnx.ModelProto.FromString(model.SerializeToString()), str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="model.onnx.data", size_threshold=0)
    assert (tmp_path / "model.onnx.data").exists()
    assert any(i.data_location == TensorProto.EXTERNAL for i in onnx.load(str(path), load_external_data=False)
               .graph.initializer)
    loaded = load_onnx(path)  # inlined: the bundle made from it is self-contained
    assert all(i.data_location != TensorProto.EXTERNAL for i in loaded.graph.initializer)
    assert _matches_reference(model, path) == ["CONV_2D"]


def test_constant_nodes_feeding_reshape() -> None:
    shape = numpy_helper.from_array(np.array([0, -1], np.int64), "shape")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
             helper.make_node("GlobalAveragePool", ["c"], ["p"], name="gap"),
             helper.make_node("Constant", [], ["s"], name="Constant_12", value=shape),
             helper.make_node("Reshape", ["p", "s"], ["y"], name="reshape")]
    model = _graph_model(nodes, (1, 3, 4, 4), {"w": _w(6, 3, 1, 1)}, opset=13, out_rank=2)
    kinds = _matches_reference(model)
    assert kinds[0] == "CONV_2D" and len(kinds) <= 3


@pytest.mark.parametrize("opset", [6, 11, 13, 18])
def test_clip_bounds_as_attributes_or_inputs(opset: int) -> None:
    conv = helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1])
    if opset < 11:
        clip = helper.make_node("Clip", ["c"], ["y"], name="relu6", min=0.0, max=6.0)
        inits = {}
    else:
        clip = helper.make_node("Clip", ["c", "lo", "hi"], ["y"], name="relu6")
        inits = {"lo": np.array(0, np.float32), "hi": np.array(6, np.float32)}
    model = _graph_model([conv, clip], (1, 3, 5, 5), {"w": _w(4, 3, 3, 3, seed=5) * 8, **inits}, opset=opset)
    assert _matches_reference(model) == ["CONV_2D"]
    assert import_onnx(model.SerializeToString()).ops[0].options["activation"] == "RELU6"


@pytest.mark.parametrize("opset", [13, 18])
def test_reduce_mean_axes_as_attribute_or_input(opset: int) -> None:
    conv = helper.make_node("Conv", ["x", "w"], ["c"], name="conv")
    if opset < 18:
        mean = helper.make_node("ReduceMean", ["c"], ["y"], name="mean", axes=[2, 3], keepdims=1)
        inits = {}
    else:
        mean = helper.make_node("ReduceMean", ["c", "axes"], ["y"], name="mean", keepdims=1)
        inits = {"axes": np.array([2, 3], np.int64)}
    model = _graph_model([conv, mean], (1, 3, 4, 4), {"w": _w(4, 3, 1, 1), **inits}, opset=opset)
    assert _matches_reference(model) == ["CONV_2D", "MEAN"]


@pytest.mark.parametrize("opset", [10, 11, 18])
def test_pad_amounts_as_attribute_or_input(opset: int) -> None:
    pads = [0, 0, 1, 2, 0, 0, 2, 1]
    conv = helper.make_node("Conv", ["x", "w"], ["c"], name="conv")
    if opset < 11:
        pad = helper.make_node("Pad", ["c"], ["p"], name="pad", pads=pads, mode="constant")
        inits = {}
    else:
        pad = helper.make_node("Pad", ["c", "pads"], ["p"], name="pad", mode="constant")
        inits = {"pads": np.array(pads, np.int64)}
    pool = helper.make_node("MaxPool", ["p"], ["y"], name="pool", kernel_shape=[2, 2], strides=[2, 2])
    model = _graph_model([conv, pad, pool], (1, 3, 5, 5), {"w": _w(4, 3, 1, 1), **inits}, opset=opset)
    assert _matches_reference(model) == ["CONV_2D", "PAD", "MAX_POOL_2D"]
