"""Importing models nobody here wrote: ONNX files as exporters write them (ir_version 10,
old opsets, external data), split points (`model nodes`, candidate_cuts), `model create`'s
checks, heads that are not one dense layer, forced engines marked wrong, and odd graphs
that must be exit 65 with the node and op named, never a traceback.

Models are hand-built with onnx.helper (tiny, random weights); commands run as the user
runs them (the CLIs' main), against real MXNet, onnx and the reference engine.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edge_agent.atomic import FileTooLargeError
from edge_agent.cli import main as agent_main
from edge_agent.coordinator.cli import main as coordinator_main
from edge_agent.errors import EXIT_DATAERR, EXIT_OK, EXIT_UNAVAILABLE
from edge_agent.int8 import engines as registry
from edge_agent.int8.agreement import ROUNDING_SENSITIVITY_CAP
from edge_agent.int8.bundle import load_bundle
from edge_agent.int8.cut_points import candidate_cuts
from edge_agent.int8.engine import Availability, Int8Engine, Runner
from edge_agent.int8.engines.reference import QGraphRunner
from edge_agent.int8.onnx_import import OnnxImportError, import_onnx, load_onnx

PROBE = {"cpu": {"arch": "x86_64", "count": 2, "int8_features": {"avx2": True}}, "accelerators": [],
         "board": {"model": "test board"}, "profile": {"name": None}}
RNG = np.random.default_rng(0)


def _w(*shape: int) -> np.ndarray:
    return (RNG.standard_normal(shape) * 0.3).astype(np.float32)


def _graph(nodes: list, inits: dict[str, np.ndarray], *, shape=(1, 3, 8, 8), out="y", out_shape=None,
           opset: int = 13, ir: int = 8, in_type: int = TensorProto.FLOAT) -> onnx.ModelProto:
    out_shape = out_shape or ["n", "c", "h", "w"]  # the checker wants a shape, even symbolic
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", in_type, list(shape))],
                          [helper.make_tensor_value_info(out, TensorProto.FLOAT, out_shape)],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir)


def _resnetish(classes: int = 4) -> onnx.ModelProto:
    """stem conv -> residual block (conv-relu-conv + skip, add, relu) -> GAP -> flatten -> Gemm."""
    nodes = [
        helper.make_node("Conv", ["x", "w0", "b0"], ["s"], name="stem", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["s"], ["s_r"], name="stem_relu"),
        helper.make_node("Conv", ["s_r", "w1", "b1"], ["c1"], name="block/conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["c1_r"], name="block/relu1"),
        helper.make_node("Conv", ["c1_r", "w2", "b2"], ["c2"], name="block/conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c2", "s_r"], ["sum"], name="block/add"),
        helper.make_node("Relu", ["sum"], ["block_out"], name="block/relu2"),
        helper.make_node("GlobalAveragePool", ["block_out"], ["gap"], name="gap"),
        helper.make_node("Flatten", ["gap"], ["flat"], name="flatten"),
        helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["y"], name="fc", transB=1),
    ]
    inits = {"w0": _w(8, 3, 3, 3), "b0": _w(8), "w1": _w(8, 8, 3, 3), "b1": _w(8), "w2": _w(8, 8, 3, 3),
             "b2": _w(8), "fc_w": _w(classes, 8), "fc_b": _w(classes)}
    return _graph(nodes, inits, out_shape=[1, classes])


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("import-ux")
    onnx.save(_resnetish(), root / "resnetish.onnx")
    np.savez(root / "calib.npz", x=RNG.standard_normal((8, 3, 8, 8)).astype(np.float32))
    return root


def _create(files: Path, model: str | Path, out: Path, *extra: str, labels: str = "a,b,c,d") -> int:
    return coordinator_main(["model", "create", "--onnx", str(model), "--calib", str(files / "calib.npz"),
                             "--labels", labels, "--name", "m", "--version", "1", "--output", str(out),
                             "--overwrite", *extra])


# ----------------------------------------------------------------- load_onnx
def test_ir_version_10_is_lowered_and_newer_or_4bit_refused(files) -> None:
    model = _resnetish()
    model.ir_version = 10
    assert load_onnx(model.SerializeToString()).ir_version == onnx.IR_VERSION
    model.ir_version = 11
    with pytest.raises(OnnxImportError, match="ir_version 11 is newer"):
        load_onnx(model.SerializeToString())
    model.ir_version = 10
    model.graph.value_info.append(helper.make_tensor_value_info("s", 22, [1, 8, 8, 8]))  # INT4
    with pytest.raises(OnnxImportError, match="4-bit"):
        load_onnx(model.SerializeToString())


def test_old_opset_is_converted_and_imports() -> None:
    # opset 10: Clip's bounds are attributes, Dropout has a ratio attribute
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
             helper.make_node("Clip", ["c"], ["r"], name="clip", min=0.0, max=6.0),
             helper.make_node("Dropout", ["r"], ["y"], name="drop", ratio=0.5)]
    model = _graph(nodes, {"w": _w(4, 3, 1, 1)}, opset=10, ir=5)
    graph = import_onnx(model.SerializeToString())
    assert [op.kind for op in graph.ops] == ["CONV_2D"] and graph.ops[0].options["activation"] == "RELU6"


def test_external_data_is_inlined_from_the_models_directory(files, tmp_path) -> None:
    model = _resnetish()
    onnx.save(onnx.ModelProto.FromString(model.SerializeToString()), tmp_path / "ext.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
              location="ext.onnx.data", size_threshold=0)
    loaded = load_onnx(tmp_path / "ext.onnx")
    assert all(t.data_location == TensorProto.DEFAULT and not t.external_data for t in loaded.graph.initializer)
    np.testing.assert_array_equal(numpy_helper.to_array(loaded.graph.initializer[0]),
                                  numpy_helper.to_array(model.graph.initializer[0]))
    with pytest.raises(FileTooLargeError):
        load_onnx(tmp_path / "ext.onnx", max_bytes=(tmp_path / "ext.onnx").stat().st_size + 100)
    # the bundle is self-contained: backbone.onnx carries the weights
    assert _create(files, tmp_path / "ext.onnx", tmp_path / "b", "--split", "flatten") == EXIT_OK
    backbone = onnx.load_from_string((tmp_path / "b" / "backbone.onnx").read_bytes())
    assert not any(t.external_data for t in backbone.graph.initializer)
    (tmp_path / "ext.onnx.data").unlink()
    with pytest.raises(OnnxImportError, match="cannot read external data 'ext.onnx.data'"):
        load_onnx(tmp_path / "ext.onnx")


@pytest.mark.parametrize("location", ["../secret.bin", "/etc/hostname", "sub/../../x.bin", ""])
def test_external_data_outside_the_models_directory_is_refused(tmp_path, location) -> None:
    model = _resnetish()
    init = model.graph.initializer[0]
    init.ClearField("raw_data")
    del init.float_data[:]
    init.data_location = TensorProto.EXTERNAL
    init.external_data.add(key="location", value=location)
    (tmp_path / "m").mkdir()
    (tmp_path / "secret.bin").write_bytes(b"\0" * 4096)
    onnx.save(model, tmp_path / "m" / "model.onnx")
    with pytest.raises(OnnxImportError, match="is not a file inside"):
        load_onnx(tmp_path / "m" / "model.onnx")
    with pytest.raises(OnnxImportError, match="give the model as a file"):
        load_onnx((tmp_path / "m" / "model.onnx").read_bytes())


# ----------------------------------------------------------------- split points
def test_candidate_cuts_are_block_boundaries_that_split_the_graph() -> None:
    cuts = {c.name: c for c in candidate_cuts(_resnetish())}
    # the residual block's output (after its relu), the pool, the classifier's input
    assert cuts["block/relu2"].kind == "add" and cuts["block/relu2"].shape == (1, 8, 8, 8)
    assert cuts["gap"].kind == "pool" and cuts["gap"].shape == (1, 8, 1, 1)
    assert cuts["flatten"].kind == "classifier-input" and cuts["flatten"].shape == (1, 8)
    # inside the block the skip path also needs stem_relu: not a valid single-tensor cut
    assert not {"block/conv1", "block/relu1", "block/conv2", "block/add", "fc"} & set(cuts)
    assert [c.index for c in cuts.values()] == sorted(c.index for c in cuts.values())


def test_model_nodes_lists_split_points(files, capsys) -> None:
    assert coordinator_main(["model", "nodes", str(files / "resnetish.onnx")]) == EXIT_OK
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["SPLIT", "SHAPE", "KIND", "CREATE"]
    assert ["block/relu2", "1x8x8x8", "add", "yes"] in [line.split() for line in lines]
    assert coordinator_main(["model", "nodes", str(files / "resnetish.onnx"), "--json", "--no-check"]) == EXIT_OK
    rows = json.loads(capsys.readouterr().out)
    assert {"name": "gap", "tensor": "gap", "shape": [1, 8, 1, 1], "kind": "pool", "index": 7} in rows


def test_unknown_split_names_a_few_useful_candidates(files, tmp_path, capsys) -> None:
    assert _create(files, files / "resnetish.onnx", tmp_path / "b", "--split", "nope") == EXIT_DATAERR
    err = capsys.readouterr().err
    assert "unknown split node 'nope'" in err and "gap [pool 1x8x1x1]" in err and "model nodes" in err
    assert "block/conv1" not in err and len(err) < 500


def test_mxnet_model_nodes_and_create_take_the_shape_from_calib(tmp_path, capsys) -> None:
    import mxnet as mx

    from edge_agent.sim import models

    net = models.initialize(models.digits_cnn(), seed=0)
    net.hybridize()
    net(mx.nd.zeros((1, 1, 8, 8)))
    net.export(str(tmp_path / "digits"))
    np.savez(tmp_path / "calib.npz", x=RNG.standard_normal((8, 1, 8, 8)).astype(np.float32))
    assert coordinator_main(["model", "nodes", "--mxnet", str(tmp_path / "digits"),
                             "--calib", str(tmp_path / "calib.npz")]) == EXIT_OK
    assert "features_gap_fwd" in capsys.readouterr().out
    args = ["model", "create", "--mxnet", str(tmp_path / "digits"), "--split", "features_gap_fwd",
            "--labels", ",".join("0123456789"), "--name", "d", "--version", "1", "--output", str(tmp_path / "b")]
    assert coordinator_main([*args, "--calib", str(tmp_path / "calib.npz")]) == EXIT_OK  # no --input-shape
    assert load_bundle(tmp_path / "b").manifest.input.shape == (1, 8, 8)
    (tmp_path / "png").mkdir()
    assert coordinator_main([*args, "--calib", str(tmp_path / "png"), "--overwrite"]) == EXIT_DATAERR
    assert "--mxnet needs --input-shape" in capsys.readouterr().err


# ----------------------------------------------------------------- model create's checks
@pytest.mark.parametrize("labels, why", [
    ("a,b,c", "the head outputs 4 classes but 3 labels were given"),
    ("a,b,c,d,e", "the head outputs 4 classes but 5 labels were given"),
    ("a,b,a,c", "labels: 'a' given more than once"),
])
def test_labels_must_match_the_head(files, tmp_path, capsys, labels, why) -> None:
    assert _create(files, files / "resnetish.onnx", tmp_path / "b", "--split", "gap", labels=labels) == EXIT_DATAERR
    assert why in capsys.readouterr().err and not (tmp_path / "b").exists()


def test_a_parameter_free_head_is_refused(files, tmp_path, capsys) -> None:
    # squeezenet's pattern: conv classifier, relu, global pool, flatten; cut after the classifier
    nodes = [helper.make_node("Conv", ["x", "w0"], ["f"], name="features"),
             helper.make_node("Relu", ["f"], ["f_r"], name="features_relu"),
             helper.make_node("Conv", ["f_r", "wc", "bc"], ["c"], name="classifier"),
             helper.make_node("Relu", ["c"], ["c_r"], name="classifier_relu"),
             helper.make_node("GlobalAveragePool", ["c_r"], ["p"], name="pool"),
             helper.make_node("Flatten", ["p"], ["y"], name="flatten")]
    onnx.save(_graph(nodes, {"w0": _w(8, 3, 3, 3), "wc": _w(4, 8, 1, 1), "bc": _w(4)}, out_shape=[1, 4]),
              tmp_path / "sq.onnx")
    assert _create(files, tmp_path / "sq.onnx", tmp_path / "b", "--split", "classifier_relu") == EXIT_DATAERR
    err = capsys.readouterr().err
    assert "has no parameters: nothing to fine-tune" in err and "--split features_relu" in err
    # split before the conv classifier: the head is conv + relu + pool + flatten, and the
    # agent's kernels check runs it (through MXNet: it is not one dense layer)
    assert _create(files, tmp_path / "sq.onnx", tmp_path / "b", "--split", "features_relu") == EXIT_OK
    (tmp_path / "probe.json").write_text(json.dumps(PROBE))
    assert agent_main(["kernels", "--model", str(tmp_path / "b"), "--bench", "--backends", "reference",
                       "--batch-size", "4", "--repeats", "1", "--state-dir", str(tmp_path / "st"),
                       "--probe-report", str(tmp_path / "probe.json")]) == EXIT_OK
    assert "ok: int8 max 0/1 unit" in capsys.readouterr().out


def test_gemm_without_bias_in_the_head(files, tmp_path) -> None:
    model = _resnetish()
    fc = model.graph.node[-1]
    del fc.input[2:]
    onnx.save(model, tmp_path / "nobias.onnx")
    assert _create(files, tmp_path / "nobias.onnx", tmp_path / "b", "--split", "flatten") == EXIT_OK
    import mxnet as mx

    feats = RNG.standard_normal((2, 8)).astype(np.float32)
    out = load_bundle(tmp_path / "b").head_block()(mx.nd.array(feats)).asnumpy()
    w = numpy_helper.to_array(model.graph.initializer[-2])
    np.testing.assert_allclose(out, feats @ w.T, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------- deep graphs: whose int8 is right
def _deep_residual(blocks: int = 12, c: int = 16) -> onnx.ModelProto:
    """MobileNetV2-like inverted residuals as torch exports them (Clip(0, 6) with min/max
    inputs, no BatchNorm), random weights: deep enough that 1-unit rounding differences
    per op add up to several units at the output."""
    rng = np.random.default_rng(1)

    def w(*s: int) -> np.ndarray:
        return (rng.standard_normal(s) * 1.5 / np.sqrt(np.prod(s[1:]))).astype(np.float32)

    nodes = [helper.make_node("Conv", ["x", "w_stem"], ["t"], name="stem", pads=[1, 1, 1, 1])]
    inits = {"w_stem": w(c, 3, 3, 3), "lo": np.array(0, np.float32), "hi": np.array(6, np.float32)}
    cur = "t"
    for i in range(blocks):
        inits |= {f"wa{i}": w(2 * c, c, 1, 1), f"wb{i}": w(2 * c, 1, 3, 3), f"wc{i}": w(c, 2 * c, 1, 1)}
        nodes += [helper.make_node("Conv", [cur, f"wa{i}"], [f"a{i}"], name=f"b{i}/expand"),
                  helper.make_node("Clip", [f"a{i}", "lo", "hi"], [f"ar{i}"], name=f"b{i}/relu6a"),
                  helper.make_node("Conv", [f"ar{i}", f"wb{i}"], [f"d{i}"], name=f"b{i}/dw", group=2 * c,
                                   pads=[1, 1, 1, 1]),
                  helper.make_node("Clip", [f"d{i}", "lo", "hi"], [f"dr{i}"], name=f"b{i}/relu6b"),
                  helper.make_node("Conv", [f"dr{i}", f"wc{i}"], [f"p{i}"], name=f"b{i}/project"),
                  helper.make_node("Add", [f"p{i}", cur], [f"s{i}"], name=f"b{i}/add")]
        cur = f"s{i}"
    nodes += [helper.make_node("GlobalAveragePool", [cur], ["gap"], name="gap"),
              helper.make_node("Flatten", ["gap"], ["flat"], name="flatten"),
              helper.make_node("Gemm", ["flat", "fc"], ["y"], name="fc", transB=1)]
    inits["fc"] = w(4, c)
    return _graph(nodes, inits, shape=(1, 3, 8, 8), out_shape=[1, 4])


def test_deep_graph_tflite_agrees_within_the_graphs_rounding_sensitivity(tmp_path, capsys) -> None:
    """torchvision mobilenet_v2 had tflite 'WRONG: int8 max 23/1 unit'. The reference is
    right: TFLite's own reference kernels match it bit for bit; the optimized kernels differ
    by 1 unit per op in a few outputs, which a deep graph amplifies. The int8 tolerance is
    now that measured amplification, so tflite passes while every engine is still checked."""
    from edge_agent.int8 import selection as sel
    from edge_agent.int8.engines.reference import ReferenceEngine
    from edge_agent.int8.engines.tflite import TfliteEngine
    from edge_agent.int8.testing import run_tflite

    onnx.save(_deep_residual(), tmp_path / "deep.onnx")
    np.savez(tmp_path / "calib.npz", x=np.random.default_rng(2).standard_normal((16, 3, 8, 8)).astype(np.float32))
    assert coordinator_main(["model", "create", "--onnx", str(tmp_path / "deep.onnx"), "--calib",
                             str(tmp_path / "calib.npz"), "--labels", "a,b,c,d", "--name", "deep", "--version", "1",
                             "--split", "flatten", "--output", str(tmp_path / "b")]) == EXIT_OK
    bundle = load_bundle(tmp_path / "b")
    oracle = sel.Oracle(bundle, sel.check_batch_for(bundle, 8))
    tflite_ref = run_tflite(bundle.read("backbone_int8.tflite"), oracle.q, reference_kernels=True)
    np.testing.assert_array_equal(tflite_ref, oracle.int8)  # TFLite's reference == ours
    optimized = run_tflite(bundle.read("backbone_int8.tflite"), oracle.q, reference_kernels=False)
    off = int(np.abs(optimized.astype(int) - oracle.int8.astype(int)).max())
    assert off > sel.INT8_TOLERANCE_UNITS  # what the old 1-unit rule called WRONG
    assert off <= oracle.int8_tolerance() <= 4 * max(off, 1)
    selection, _ = sel.select_engine(bundle, probe=PROBE, batch_size=8, repeats=1, env={}, use_cache=False,
                                     engines=[("tflite", TfliteEngine()), ("reference", ReferenceEngine())])
    assert selection.candidate("tflite").correct


class _Off(QGraphRunner):
    """The reference, off by `units` int8 units (an int8 engine) or by `steps` output steps
    with no int8 edge (an engine with its own calibration, like mxnet-onednn)."""

    def __init__(self, graph, *, units: int = 0, steps: float = 0.0) -> None:
        super().__init__(graph)
        self.units, self.steps = units, steps
        self.step = float(graph.tensor(graph.outputs[0]).scale[0])

    def run_int8(self, batch_nhwc):
        if self.steps:
            raise NotImplementedError("float edges")
        return np.clip(super().run_int8(batch_nhwc).astype(np.int16) + self.units, -128, 127).astype(np.int8)

    def run(self, batch):
        return super().run(batch) + np.float32((self.units + self.steps) * self.step)


class _OffEngine(Int8Engine):
    def __init__(self, name: str, **off: float) -> None:
        self.name, self.off = name, off

    def availability(self, probe=None) -> Availability:
        return Availability(True, "test engine")

    def prepare(self, model, *, threads=None) -> Runner:
        return _Off(model.qgraph(), **self.off)


def test_a_graph_that_amplifies_rounding_cannot_loosen_its_tolerance_past_the_cap(tmp_path) -> None:
    """efficientnet: tflite passed at 35 units against a self-measured tolerance of 94, and
    mxnet-onednn at 71 steps against 564. 40 random residual blocks amplify a 1-unit rounding
    flip to ~18 units; with 16 calibration samples the task level cannot decide, so units do,
    and they stop at the cap: 12 units (or 60 steps) off is refused, and the graph is
    reported as too sensitive for units to judge."""
    from edge_agent.int8 import selection as sel
    from edge_agent.int8.cli import render
    from edge_agent.int8.engines.reference import ReferenceEngine

    onnx.save(_deep_residual(blocks=40), tmp_path / "deep.onnx")
    np.savez(tmp_path / "calib.npz", x=np.random.default_rng(2).standard_normal((16, 3, 8, 8)).astype(np.float32))
    assert _create(tmp_path, tmp_path / "deep.onnx", tmp_path / "b", "--split", "flatten") == EXIT_OK
    bundle = load_bundle(tmp_path / "b")
    engines = [("int8-off-12", _OffEngine("int8-off-12", units=12)),
               ("float-off-60", _OffEngine("float-off-60", steps=60.0)), ("reference", ReferenceEngine())]
    selection, _ = sel.select_engine(bundle, probe=PROBE, batch_size=8, repeats=1, env={}, use_cache=False,
                                     engines=engines, threads=1)
    rows = {c.name: c for c in selection.candidates}
    int8_row, float_row = rows["int8-off-12"], rows["float-off-60"]
    assert int8_row.basis == "units" and int8_row.inconclusive.startswith("16 calibration samples")
    assert int8_row.rounding_sensitivity > 12 > sel.ROUNDING_SENSITIVITY_CAP  # it would have passed: 12 <= sensitivity
    assert int8_row.too_sensitive and int8_row.tolerance == sel.ROUNDING_SENSITIVITY_CAP
    assert int8_row.correct is False and int8_row.max_diff == 12
    assert float_row.tolerance == sel.FLOAT_TOLERANCE_STEPS * sel.ROUNDING_SENSITIVITY_CAP / 2 < 60
    assert float_row.correct is False
    assert selection.chosen == "reference"
    text = " ".join(render({"model": "deep", "version": "1", "sha256": bundle.sha256, "hardware": "h", "profile": None,
                            "batch_size": 8, "threads": 1}, selection.candidates, selection, None).split())
    assert "this graph is too sensitive to judge an engine by units" in text
    assert "cannot be accepted without a conclusive task-level check" in text


# ----------------------------------------------------------------- mxnet-onednn on imported graphs
def _torch_style() -> onnx.ModelProto:
    """What torch's legacy exporter writes: Clip bounds from Constant nodes (the old
    mxnet.contrib.onnx import died on them with KeyError '.../Constant'), a stride-2 conv
    with TFLite-asymmetric SAME padding, a squeeze-and-excitation Sigmoid * Mul, HardSwish,
    a fire-style Concat, an explicit-pad MaxPool, then pool, flatten and a bias-free Gemm."""
    const = [helper.make_node("Constant", [], [n], name=f"/c/{n}", value=numpy_helper.from_array(np.array(v, np.float32)))
             for n, v in (("lo", 0.0), ("hi", 6.0))]
    nodes = [*const,
             helper.make_node("Conv", ["x", "w0", "b0"], ["c0"], name="/stem/Conv", strides=[2, 2], pads=[0, 0, 1, 1]),
             helper.make_node("Clip", ["c0", "lo", "hi"], ["r0"], name="/stem/Clip"),
             helper.make_node("GlobalAveragePool", ["r0"], ["se_p"], name="/se/pool"),
             helper.make_node("Conv", ["se_p", "w_se", "b_se"], ["se_c"], name="/se/fc"),
             helper.make_node("Sigmoid", ["se_c"], ["se_s"], name="/se/sigmoid"),
             helper.make_node("Mul", ["r0", "se_s"], ["se"], name="/se/mul"),
             helper.make_node("Conv", ["se", "w1", "b1"], ["e1"], name="/fire/e1"),
             helper.make_node("Conv", ["se", "w3", "b3"], ["e3"], name="/fire/e3", pads=[1, 1, 1, 1]),
             helper.make_node("Concat", ["e1", "e3"], ["cat"], name="/fire/concat", axis=1),
             helper.make_node("HardSwish", ["cat"], ["hs"], name="/hs"),
             helper.make_node("MaxPool", ["hs"], ["mp"], name="/pool", kernel_shape=[3, 3], strides=[2, 2],
                              pads=[1, 1, 1, 1]),
             helper.make_node("GlobalAveragePool", ["mp"], ["gap"], name="/gap"),
             helper.make_node("Flatten", ["gap"], ["flat"], name="/flatten"),
             helper.make_node("Gemm", ["flat", "fc"], ["y"], name="/fc", transB=1)]
    inits = {"w0": _w(8, 3, 3, 3), "b0": _w(8), "w_se": _w(8, 8, 1, 1), "b_se": _w(8), "w1": _w(4, 8, 1, 1),
             "b1": _w(4), "w3": _w(4, 8, 3, 3), "b3": _w(4), "fc": _w(4, 8)}
    return _graph(nodes, inits, shape=(1, 3, 12, 12), out_shape=[1, 4], opset=14)


@pytest.mark.parametrize("make, split", [(_torch_style, None), (_resnetish, None), (_deep_residual, "flatten")])
def test_mxnet_symbol_from_the_float_graph_matches_run_float(make, split) -> None:
    import mxnet as mx

    from edge_agent.int8.float_graph import run_float
    from edge_agent.int8.mxnet_graph import float_graph_to_mxnet

    graph = import_onnx(make().SerializeToString(), split=split)
    sym, params = float_graph_to_mxnet(graph, mx)
    x = RNG.standard_normal((3, *graph.input_shape[1:])).astype(np.float32)
    exe = sym.bind(mx.cpu(), {graph.input: mx.nd.array(x), **params})
    np.testing.assert_allclose(exe.forward()[0].asnumpy(), run_float(graph, x), rtol=1e-4, atol=1e-5)


def test_mxnet_onednn_runs_a_torch_style_import(files, tmp_path) -> None:
    from edge_agent.int8.engines.mxnet_onednn import MxnetOnednnEngine
    from edge_agent.int8.float_graph import run_float

    onnx.save(_torch_style(), tmp_path / "t.onnx")
    np.savez(tmp_path / "calib.npz", x=RNG.standard_normal((32, 3, 12, 12)).astype(np.float32))
    assert coordinator_main(["model", "create", "--onnx", str(tmp_path / "t.onnx"), "--calib", str(tmp_path / "calib.npz"),
                             "--labels", "a,b,c,d", "--name", "t", "--version", "1", "--split", "/gap",
                             "--output", str(tmp_path / "b")]) == EXIT_OK
    bundle = load_bundle(tmp_path / "b")
    runner = MxnetOnednnEngine().prepare(bundle, threads=1)
    x = bundle.calibration()[:8]
    fp32 = run_float(import_onnx(bundle.onnx_bytes()), x)
    out = runner.run(x)
    assert out.shape == fp32.shape == (8, 8, 1, 1)
    # int8 with its own calibration: close to fp32 relative to the feature range
    assert np.abs(out - fp32).max() < 0.1 * np.abs(fp32).max()


# ----------------------------------------------------------------- forced engines
# Off by more than any rounding tolerance the unit-level check follows: 3 units once passed
# as "ok" in CI, where the test graph's measured rounding sensitivity came out at 3.
SHIFT = int(ROUNDING_SENSITIVITY_CAP) + 4


class ShiftedRunner(QGraphRunner):
    """The reference, off by SHIFT int8 units: an engine that fails the agreement check."""

    def _invoke(self, x):
        return np.clip(super()._invoke(x).astype(np.int16) + SHIFT, -128, 127).astype(np.int8)


class ShiftedEngine(Int8Engine):
    name = "shifted"

    def availability(self, probe=None) -> Availability:
        return Availability(True, f"test engine, {SHIFT} units off")

    def prepare(self, model, *, threads=None) -> Runner:
        return ShiftedRunner(model.qgraph())


@pytest.fixture()
def shifted():
    registry.register_engine("shifted", f"{__name__}:ShiftedEngine")
    yield
    registry.ENGINES[:] = [s for s in registry.ENGINES if s.name != "shifted"]


def test_an_engine_marked_wrong_runs_only_with_force_engine(files, tmp_path, capsys, monkeypatch, shifted) -> None:
    monkeypatch.delenv("EDGE_AGENT_INT8_BACKEND", raising=False)
    monkeypatch.delenv("EDGE_AGENT_INT8_FORCE", raising=False)
    assert _create(files, files / "resnetish.onnx", tmp_path / "b", "--split", "gap") == EXIT_OK
    (tmp_path / "probe.json").write_text(json.dumps(PROBE))
    args = ["kernels", "--model", str(tmp_path / "b"), "--batch-size", "4", "--repeats", "1",
            "--state-dir", str(tmp_path / "st"), "--probe-report", str(tmp_path / "probe.json"), "--engine", "shifted"]
    capsys.readouterr()
    assert agent_main(args) == EXIT_UNAVAILABLE
    err = capsys.readouterr().err
    assert "shifted: the engine disagrees with the reference" in err and "--force-engine" in err
    assert agent_main([*args, "--force-engine", "--json"]) == EXIT_OK
    report = json.loads(capsys.readouterr().out)
    row = next(c for c in report["candidates"] if c["name"] == "shifted")
    assert report["chosen"] == "shifted" and row["correct"] is False and "used anyway" in report["notes"][0]
    # finetune refuses it the same way, before any training
    data = tmp_path / "data.npz"
    np.savez(data, x=RNG.standard_normal((16, 3, 8, 8)).astype(np.float32), y=np.array(list("abcd") * 4))
    assert agent_main(["finetune", "--model", str(tmp_path / "b"), "--data", str(data), "--engine", "shifted",
                       "--state-dir", str(tmp_path / "ft"), "--epochs", "1", "-q"]) == EXIT_UNAVAILABLE, capsys.readouterr().err
    err = capsys.readouterr().err
    assert "disagrees with the reference" in err, err


# ----------------------------------------------------------------- odd graphs: exit 65, never a traceback
def _odd_models() -> list[tuple[str, onnx.ModelProto, list[str]]]:
    conv = helper.make_node("Conv", ["x", "w"], ["c"], name="conv")
    w = {"w": _w(4, 3, 1, 1)}
    cases = [
        ("unknown op", _graph([conv, helper.make_node("Erf", ["c"], ["y"], name="erf")], w),
         ["erf", "'Erf'", "supported ops: Add"]),
        ("custom domain", _graph([conv, helper.make_node("Gelu", ["c"], ["y"], name="gelu", domain="com.x")], w),
         ["gelu", "com.x.Gelu"]),
        ("missing input", _graph([helper.make_node("Conv", ["x", "nowhere"], ["y"], name="conv")], {}),
         ["nowhere"]),
        ("cycle", _graph([helper.make_node("Add", ["x", "b"], ["a"], name="add1"),
                          helper.make_node("Relu", ["a"], ["b"], name="relu1"),
                          helper.make_node("Relu", ["a"], ["y"], name="relu2")], {}), []),
        ("dynamic shape", _graph([conv, helper.make_node("Relu", ["c"], ["y"], name="r")], w,
                                 shape=("N", 3, "H", "W")), ["dimensions H, W are dynamic"]),
        ("int input", _graph([conv, helper.make_node("Relu", ["c"], ["y"], name="r")], w,
                             in_type=TensorProto.INT64), []),
        ("zero-size", _graph([conv, helper.make_node("Relu", ["c"], ["y"], name="r")], w, shape=(1, 3, 0, 8)),
         []),
        ("huge dims", _graph([conv, helper.make_node("Relu", ["c"], ["y"], name="r")], w,
                             shape=(1, 3, 1 << 40, 1 << 40)), []),
        ("conv without weight", _graph([helper.make_node("Conv", ["x"], ["y"], name="conv")], {}), ["conv"]),
        ("pool without kernel", _graph([conv, helper.make_node("MaxPool", ["c"], ["y"], name="pool")], w),
         ["node 'pool' (op MaxPool)", "kernel_shape"]),
        ("wrong weight rank", _graph([helper.make_node("Conv", ["x", "w"], ["y"], name="conv")],
                                     {"w": _w(4, 3)}), ["conv"]),
        ("no nodes", _graph([], {}, out="x"), []),
        ("two inputs", None, ["exactly one data input"]),
    ]
    cases[1][1].opset_import.append(helper.make_opsetid("com.x", 1))
    two = _graph([conv, helper.make_node("Add", ["c", "x2"], ["y"], name="add")], w)
    two.graph.input.append(helper.make_tensor_value_info("x2", TensorProto.FLOAT, [1, 4, 8, 8]))
    cases[-1] = ("two inputs", two, ["exactly one data input"])
    return cases


def test_odd_graphs_are_exit_65_naming_node_and_op(files, tmp_path, capsys) -> None:
    failures = []
    for what, model, expect in _odd_models():
        split = model.graph.output[0].name  # the odd part is the backbone: a tail is the head
        model.graph.node.append(helper.make_node("Relu", [split], ["z"], name="tail"))
        model.graph.output[0].name = "z"
        path = tmp_path / f"{what.replace(' ', '_')}.onnx"
        path.write_bytes(model.SerializeToString())
        code = _create(files, path, tmp_path / "b", "--split", split, labels="a")
        err = capsys.readouterr().err
        if code != EXIT_DATAERR or "Traceback" in err or not all(e in err for e in expect):
            failures.append(f"{what}: exit {code}: {err.strip()[:300]}")
        code = coordinator_main(["model", "nodes", str(path)])  # listing: a list or one clear line
        err = capsys.readouterr().err
        if code not in (EXIT_OK, EXIT_DATAERR) or "Traceback" in err:
            failures.append(f"model nodes {what}: exit {code}: {err.strip()[:300]}")
    assert not failures, "\n".join(failures)
