"""The int8 engines: registry, availability with reasons, agreement with the reference,
and quantisation accuracy on real data (scikit-learn's digits, held-out split)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edge_agent.int8 import bundle_create as BC
from edge_agent.int8 import engines
from edge_agent.int8.engines._common import EngineError, thread_count, usable_cpus
from edge_agent.int8.engines.edgetpu import EdgeTpuEngine
from edge_agent.int8.engines.mxnet_onednn import MxnetOnednnEngine
from edge_agent.int8.engines.reference import ReferenceEngine
from edge_agent.int8.engines.tflite import TfliteEngine, TfliteRunner
from edge_agent.int8.quantize import quantize_input
from edge_agent.int8.selection import FLOAT_TOLERANCE_STEPS
from edge_agent.sim import models

CORAL_PROBE = {"accelerators": [{"kind": "coral-usb", "runtime_loads": False}]}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The digits CNN trained to ~98% held-out accuracy, and its bundle."""
    x_train, y_train, x_test, y_test = models.load_digits_split()
    net = models.digits_cnn()
    models.fit_classifier(net, x_train, y_train, epochs=3)  # 99% held-out (seeded)
    dest = tmp_path_factory.mktemp("engines") / "digits"
    bundle = BC.create_bundle(net, dest, calibration=x_train[:256], labels=[str(i) for i in range(10)],
                             name="digits", version="1", input_shape=(1, 8, 8), scale=1 / 16)
    return net, bundle, x_test, y_test


@pytest.fixture(scope="module")
def reference(trained):
    return ReferenceEngine().prepare(trained[1])


# ------------------------------------------------------------------ registry


def test_registry_order_and_lazy_loading():
    names = engines.engine_names()
    assert names.index("edgetpu") < names.index("tflite") < names.index("mxnet-onednn") < names.index("reference")
    assert isinstance(engines.load_engine("reference"), ReferenceEngine)
    with pytest.raises(KeyError, match="unknown int8 engine 'cuda'"):
        engines.load_engine("cuda")


def test_a_broken_engine_reports_itself_and_never_breaks_the_others():
    saved = list(engines.ENGINES)
    try:
        engines.register_engine("ghost", "edge_agent.int8.engines.ghost:Ghost", before="reference")
        engines.register_engine("typo", "json:NoSuchEngine")
        assert engines.engine_names()[-3:] == ["ghost", "reference", "typo"]
        ghost, typo = engines.load_engine("ghost"), engines.load_engine("typo")
        assert not ghost.availability().available and "not built into" in ghost.availability().reason
        assert "import failed" in typo.availability().reason and "NoSuchEngine" in typo.availability().reason
        with pytest.raises(RuntimeError, match="unavailable"):
            ghost.prepare(None)
        assert engines.load_engine("reference").availability().available
    finally:
        engines.ENGINES[:] = saved


def test_daemon_side_modules_do_not_import_mxnet_onnx_or_tflite():
    code = ("import sys, edge_agent.int8.bundle, edge_agent.int8.selection, edge_agent.int8.cli, "
            "edge_agent.int8.engines as e\n"
            "[e.load_engine(n) for n in e.engine_names()]\n"
            "print(sorted(m for m in ('mxnet', 'onnx', 'tflite_runtime') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_thread_count_never_oversubscribes():
    cpus = usable_cpus()
    assert thread_count(None) == cpus and thread_count(1) == 1 and thread_count(cpus * 8) == cpus


# ------------------------------------------------------------------ agreement


def test_tflite_agrees_with_the_reference_within_one_unit(trained, reference):
    _, bundle, x_test, _ = trained
    engine = TfliteEngine()
    avail = engine.availability()
    assert avail.available and "XNNPACK with int8" in avail.reason
    runner = engine.prepare(bundle, threads=1)
    q = quantize_input(x_test[:64], reference.graph)
    ours, ref = runner.run_int8(q), reference.run_int8(q)
    assert ours.dtype == np.int8 and ours.shape == ref.shape == (64, 1, 1, 32)
    assert np.abs(ours.astype(int) - ref.astype(int)).max() <= 1
    # the float entry point is the int8 one with (de)quantisation at the edges, in NCHW
    features = runner.run(x_test[:64])
    assert features.shape == (64, 32, 1, 1) and features.dtype == np.float32
    scale = float(reference.graph.tensor(reference.graph.outputs[0]).scale[0])
    assert np.abs(features - reference.run(x_test[:64])).max() <= scale * 1.001
    # batch size changes re-plan the interpreter
    assert runner.run(x_test[:3]).shape == (3, 32, 1, 1)
    with pytest.raises(ValueError, match=r"batch shape \(2, 8, 8\)"):
        runner.run(x_test[:2, 0])


def test_mxnet_onednn_agrees_in_float(trained, reference):
    _, bundle, x_test, _ = trained
    engine = MxnetOnednnEngine()
    assert engine.availability().available
    runner = engine.prepare(bundle)
    features = runner.run(x_test[:64])
    scale = float(reference.graph.tensor(reference.graph.outputs[0]).scale[0])
    steps = np.abs(features - reference.run(x_test[:64])).max() / scale
    assert 0 < steps <= FLOAT_TOLERANCE_STEPS  # its own calibration: close, not identical
    with pytest.raises(NotImplementedError):
        runner.run_int8(quantize_input(x_test[:4], reference.graph))


def test_int8_top1_within_one_point_of_fp32_on_held_out_digits(trained, reference):
    import mxnet as mx

    net, bundle, x_test, y_test = trained
    head = bundle.head_block()
    fp32 = float(np.mean(models.predict(net, x_test).argmax(1) == y_test))
    assert fp32 > 0.95
    runners = {"reference": reference, "tflite": TfliteEngine().prepare(bundle),
               "mxnet-onednn": MxnetOnednnEngine().prepare(bundle)}
    for name, runner in runners.items():
        int8 = float(np.mean(head(mx.nd.array(runner.run(x_test))).asnumpy().argmax(1) == y_test))
        assert abs(fp32 - int8) <= 0.01, f"{name}: int8 top-1 {int8:.4f} vs fp32 {fp32:.4f}"


def test_corrupt_or_truncated_tflite_never_reaches_the_interpreter(trained):
    """tflite-runtime segfaults on some truncated flatbuffers: the reader must refuse first."""
    from edge_agent.int8.tflite_reader import TFLiteFormatError

    data = trained[1].tflite_bytes()
    for cut in (len(data) // 3, len(data) // 2, len(data) - 7):
        with pytest.raises(TFLiteFormatError, match="bad.tflite"):
            TfliteRunner(data[:cut], where="bad.tflite")
    with pytest.raises(TFLiteFormatError, match=r"zeroed.tflite: not a TFLite model \(zero-filled"):
        TfliteRunner(bytes(len(data)), where="zeroed.tflite")


# ------------------------------------------------------------------ Edge TPU discovery


def test_edgetpu_needs_a_coral_in_the_probe_and_says_why_not():
    engine = EdgeTpuEngine()
    assert "no hardware probe report" in engine.availability(None).reason
    none = engine.availability({"accelerators": [{"kind": "hailo"}]})
    assert not none.available and none.reason == "no Coral Edge TPU found by the hardware probe"
    assert not engine.availability({"accelerators": "garbage"}).available
    # a Coral is present but the runtime is not installed here: the delegate does not load
    found = engine.availability(CORAL_PROBE)
    assert not found.available
    assert found.reason.startswith("coral-usb found, but libedgetpu.so.1 does not load")


def test_edgetpu_prepare_needs_a_compiled_model_and_a_delegate(trained, tmp_path):
    engine = EdgeTpuEngine()
    with pytest.raises(EngineError, match="no Edge TPU-compiled model.*edgetpu_compiler"):
        engine.prepare(trained[1])
    # a library that loads but is no TFLite delegate is reported, not raised
    not_a_delegate = next((Path(np.__file__).parent / "core").glob("_multiarray_umath*.so"))
    avail = EdgeTpuEngine(library=str(not_a_delegate)).availability(CORAL_PROBE)
    assert not avail.available and "does not load" in avail.reason
