"""A bundle's trainable tails through the project's own ONNX importer (issue 41,
int8/tail_import.py): torch dynamo exports, which mxnet.contrib.onnx could not import past
the head (opset 18), now get their training depths like the legacy exports.

Oracles: onnx's own ReferenceEvaluator running the fp32 ONNX model (a depth's fp32 prefix
followed by its tail must be the whole model), the model's initialisers (what the tails'
parameters must be, by name and value, for requantize.py to write them back), and held-out
digits the fine-tune never sees. The fixtures are committed torchvision exports
(tests/fixtures/models/, 32x32 inputs, trained on digits, classifiers re-initialised).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edge_agent.int8.bundle import (
    HEAD_SYMBOL,
    bundle_params,
    depth_file,
    load_bundle,
    symbol_variables,
)
from edge_agent.int8.bundle_create import create_bundle
from edge_agent.int8.float_graph import run_float
from edge_agent.int8.onnx_import import import_onnx, load_onnx
from tests.fixtures.models import zoo

SIZE = 32
MEAN, STD = 0.3, 0.4  # zoo.training_digits' normalisation, as the bundle's input spec
SPLITS = {r["file"]: r["split"] for r in json.loads((zoo.HERE / "fixtures.json").read_text())["models"]}
DYNAMO = ["resnet18.dynamo.onnx", "mobilenet_v3_small.dynamo.onnx"]
# a tail through ShuffleNet's channel shuffles (Reshape to 5-D, Transpose, Reshape back)
SHUFFLED = ["shufflenet_v2_x0_5.legacy.onnx"]


def _create(source, dest: Path, *, split: str | None, depths: int = 2, calibration=None):
    x = zoo.digits(SIZE)[0][:32] if calibration is None else calibration
    return create_bundle(source, dest, calibration=x, labels=zoo.LABELS, name="tail", version="1", split=split,
                         depths=depths, scale=1 / 255, mean=(MEAN,) * 3, std=(STD,) * 3)


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tail-bundles")
    for name in DYNAMO + SHUFFLED:
        _create(zoo.HERE / name, root / name, split=SPLITS[name])
    return {name: root / name for name in DYNAMO + SHUFFLED}


def _tail_logits(view, features: np.ndarray) -> np.ndarray:
    """The depth's fp32 tail (its MXNet symbol + the bundle's parameters) on the cut activation."""
    import mxnet as mx

    sym = mx.sym.load_json(view.read(HEAD_SYMBOL).decode())
    params, kinds = bundle_params(view)
    args = {n: mx.nd.array(v) for n, v in params.items() if kinds[n] == "arg" and n in sym.list_arguments()}
    aux = {n: mx.nd.array(v) for n, v in params.items() if kinds[n] == "aux" and n in sym.list_auxiliary_states()}
    exe = sym.bind(mx.cpu(), args={view.manifest.split_tensor: mx.nd.array(features), **args}, aux_states=aux,
                   grad_req="null")
    return exe.forward(is_train=False)[0].asnumpy()


@pytest.mark.parametrize("name", DYNAMO)
def test_a_dynamo_export_records_depths_whose_tails_hold_the_models_initialisers(name, bundles) -> None:
    b = load_bundle(bundles[name])
    depths = b.manifest.depths
    assert [d.depth for d in depths] == [0, 1, 2], [(d.depth, d.tensor) for d in depths]
    model = load_onnx(zoo.HERE / name)
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    params, kinds = bundle_params(b)
    # every parameter is an ONNX initialiser, same shape and value: a trained tail can be
    # written back into backbone.onnx by name (requantize.py); none is a renamed copy
    assert params and set(params) <= set(inits), sorted(set(params) - set(inits))[:5]
    for n, v in params.items():
        np.testing.assert_array_equal(v, inits[n].astype(np.float32), err_msg=n)
    # tails nest, and a deeper one trains more
    names = [symbol_variables(b.read(depth_file(d.depth, HEAD_SYMBOL))) - {d.tensor} for d in depths]
    assert names[0] < names[1] < names[2]
    assert set().union(*names) == set(params)


@pytest.mark.parametrize("name", DYNAMO + SHUFFLED)
def test_prefix_then_tail_at_each_depth_is_the_onnx_model(name, bundles) -> None:
    from onnx.reference import ReferenceEvaluator

    b = load_bundle(bundles[name])
    assert [d.depth for d in b.manifest.depths] == [0, 1, 2], [(d.depth, d.tensor) for d in b.manifest.depths]
    x = zoo.digits(SIZE)[2][:4]
    model = load_onnx(zoo.HERE / name)
    evaluator = ReferenceEvaluator(model)
    want = np.concatenate([evaluator.run(None, {model.graph.input[0].name: x[i:i + 1]})[0] for i in range(len(x))])
    for k in (1, 2):
        view = b.at_depth(k)
        cut = run_float(import_onnx(view.onnx_bytes(), split=view.manifest.split_tensor), x)
        got = _tail_logits(view, cut)
        scale = float(np.abs(want).max())
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * scale, err_msg=f"depth {k}")


def test_a_fine_tune_at_depth_1_of_a_dynamo_bundle_raises_held_out_accuracy(bundles, tmp_path) -> None:
    from edge_agent.inference.predictor import DepthPredictor, tail_params
    from edge_agent.sim import models
    from edge_agent.sim.scenario import to_pixels, upsample
    from edge_agent.train.job import run_finetune

    bundle = bundles["resnet18.dynamo.onnx"]
    x_train, y_train, x_test, y_test = models.load_digits_split(test_fraction=0.4)

    def pixels(x: np.ndarray) -> np.ndarray:  # raw 3-channel camera pixels; the bundle normalises them
        return to_pixels(np.repeat(upsample(x, SIZE), 3, axis=1))

    pick = np.random.default_rng(0).permutation(len(x_train))[:240]
    data = tmp_path / "digits.npz"
    np.savez(data, x=pixels(x_train[pick]), y=y_train[pick].astype(np.int64))
    report = run_finetune(model=bundle, data=data, state_dir=tmp_path / "state", cache_dir=tmp_path / "cache",
                          depth=1, epochs=8, patience=4, batch_size=16, val_fraction=0.25, engine="reference",
                          profile="raspberry-pi-4", checkpoint_every=3)
    assert report["depth"]["depth"] == 1
    b = load_bundle(bundle)
    tail = symbol_variables(b.read(depth_file(1, HEAD_SYMBOL))) - {b.manifest.depths[1].tensor}
    assert set(report["head"]["params"]) == tail and len(tail) > 2  # the classifier and convs before it

    held = np.random.default_rng(1).permutation(len(x_test))[:200]
    raw, labels = pixels(x_test[held]).astype(np.float32), y_test[held]
    own = DepthPredictor(b, depth=1)
    tuned = DepthPredictor(b, depth=1, params=tail_params(b, report["head"]["file"]))
    try:
        before, after = own.accuracy(raw, labels), tuned.accuracy(raw, labels)
    finally:
        own.close()
        tuned.close()
    print(f"\nheld-out digits at depth 1 ({report['trainer']} trainer): {before:.3f} -> {after:.3f}")
    assert after >= max(0.6, before + 0.3)


# ----------------------------------------------------------------- BatchNorm, and a refusal
def _chain_model(*, odd_fold: bool = False) -> onnx.ModelProto:
    """Three conv -> BatchNorm (opset 18, training_mode=0) -> Relu stages, ReduceMean with
    its axes as an input, Flatten, Gemm. `odd_fold`: the middle conv's output is scaled by a
    per-channel Constant node (folded into its weights: no initialiser holds the result)."""
    rng = np.random.default_rng(3)
    inits: dict[str, np.ndarray] = {}
    nodes, x = [], "x"
    for i, cin in enumerate((3, 8, 8), start=1):
        inits[f"conv{i}.weight"] = (rng.normal(size=(8, cin, 3, 3)) * 0.3).astype(np.float32)
        inits[f"conv{i}.bias"] = (rng.normal(size=8) * 0.1).astype(np.float32)
        nodes.append(helper.make_node("Conv", [x, f"conv{i}.weight", f"conv{i}.bias"], [f"c{i}"], name=f"conv{i}",
                                      pads=[1, 1, 1, 1]))
        y = f"c{i}"
        if odd_fold and i == 2:
            scale = numpy_helper.from_array(rng.uniform(0.5, 1.5, (1, 8, 1, 1)).astype(np.float32))
            nodes += [helper.make_node("Constant", [], ["s2"], name="scale2_value", value=scale),
                      helper.make_node("Mul", [y, "s2"], ["m2"], name="scale2")]
            y = "m2"
        for p, v in (("weight", rng.uniform(0.5, 1.5, 8)), ("bias", rng.normal(size=8) * 0.1),
                     ("running_mean", rng.normal(size=8) * 0.1), ("running_var", rng.uniform(0.5, 1.5, 8))):
            inits[f"bn{i}.{p}"] = v.astype(np.float32)
        nodes += [helper.make_node("BatchNormalization", [y, *(f"bn{i}.{p}" for p in
                                                             ("weight", "bias", "running_mean", "running_var"))],
                                   [f"b{i}"], name=f"bn{i}", epsilon=1e-5, momentum=0.9, training_mode=0),
                  helper.make_node("Relu", [f"b{i}"], [f"r{i}"], name=f"relu{i}")]
        x = f"r{i}"
    inits["axes"] = np.array([2, 3], np.int64)
    inits["fc.weight"] = (rng.normal(size=(10, 8)) * 0.3).astype(np.float32)
    inits["fc.bias"] = np.zeros(10, np.float32)
    nodes += [helper.make_node("ReduceMean", [x, "axes"], ["pooled"], name="pool", keepdims=1),
              helper.make_node("Flatten", ["pooled"], ["flat"], name="flatten"),
              helper.make_node("Gemm", ["flat", "fc.weight", "fc.bias"], ["logits"], name="fc", transB=1)]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 10])],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_batchnorm_in_a_tail_stays_a_batchnorm_on_the_models_initialisers(tmp_path) -> None:
    from onnx.reference import ReferenceEvaluator

    model = _chain_model()
    calib = np.random.default_rng(0).normal(size=(16, 3, 8, 8)).astype(np.float32)
    b = _create(model.SerializeToString(), tmp_path / "b", split="pool", calibration=calib)
    assert [(d.depth, d.tensor) for d in b.manifest.depths] == [(0, "pooled"), (1, "r2"), (2, "r1")]
    view = b.at_depth(2)
    nodes = json.loads(view.read(HEAD_SYMBOL))["nodes"]
    assert sum(n["op"] == "BatchNorm" for n in nodes) == 2  # bn2, bn3: not folded into the convs
    params, kinds = bundle_params(b)
    assert {n for n, k in kinds.items() if k == "aux"} == {f"bn{i}.{s}" for i in (2, 3)
                                                           for s in ("running_mean", "running_var")}
    assert {"bn2.weight", "bn2.bias", "conv2.weight", "conv2.bias"} <= {n for n, k in kinds.items() if k == "arg"}
    x = np.random.default_rng(1).normal(size=(3, 3, 8, 8)).astype(np.float32)
    evaluator = ReferenceEvaluator(model)
    want = np.concatenate([evaluator.run(None, {"x": x[i:i + 1]})[0] for i in range(len(x))])
    cut = run_float(import_onnx(view.onnx_bytes(), split="r1"), x)
    np.testing.assert_allclose(_tail_logits(view, cut), want, rtol=1e-4, atol=1e-5)


def test_a_fold_the_tail_cannot_replay_stops_the_depths_there_naming_the_node(tmp_path, caplog) -> None:
    calib = np.random.default_rng(0).normal(size=(16, 3, 8, 8)).astype(np.float32)
    with caplog.at_level("WARNING", logger="edge_agent.int8.bundle_create"):
        b = _create(_chain_model(odd_fold=True).SerializeToString(), tmp_path / "b", split="pool", calibration=calib)
    # depth 1 (conv3 on) stands; depth 2 would train conv2, whose weights the float graph
    # scaled by a Constant no initialiser holds: nothing could re-quantise its prefix
    assert [(d.depth, d.tensor) for d in b.manifest.depths] == [(0, "pooled"), (1, "r2")]
    assert "depth 2 (r1) and deeper not recorded" in caplog.text and "node conv2 (CONV_2D)" in caplog.text
    assert set(bundle_params(b)[0]) <= {i.name for i in _chain_model(odd_fold=True).graph.initializer}


def test_a_model_ending_in_softmax_gets_a_tail_that_gives_its_logits(tmp_path) -> None:
    from onnx.reference import ReferenceEvaluator

    model = _chain_model()
    model.graph.node.append(helper.make_node("Softmax", ["logits"], ["probs"], name="softmax", axis=1))
    del model.graph.output[:]
    model.graph.output.append(helper.make_tensor_value_info("probs", TensorProto.FLOAT, [1, 10]))
    calib = np.random.default_rng(0).normal(size=(16, 3, 8, 8)).astype(np.float32)
    b = _create(model.SerializeToString(), tmp_path / "b", split="pool", calibration=calib, depths=1)
    assert [d.depth for d in b.manifest.depths] == [0, 1]
    view = b.at_depth(1)
    assert all(n["op"] not in ("softmax", "SoftmaxActivation") for n in json.loads(view.read(HEAD_SYMBOL))["nodes"])
    x = np.random.default_rng(1).normal(size=(2, 3, 8, 8)).astype(np.float32)
    probs = np.concatenate([ReferenceEvaluator(model).run(None, {"x": x[i:i + 1]})[0] for i in range(len(x))])
    logits = _tail_logits(view, run_float(import_onnx(view.onnx_bytes(), split="r2"), x))
    soft = np.exp(logits - logits.max(axis=1, keepdims=True))
    np.testing.assert_allclose(soft / soft.sum(axis=1, keepdims=True), probs, rtol=1e-4, atol=1e-6)
    assert not np.allclose(logits, probs, atol=1e-3)  # logits, not probabilities
