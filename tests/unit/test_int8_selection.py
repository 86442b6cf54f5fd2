"""Engine selection: agreement with the reference, fastest correct wins, the cache, the
forced override, and the fallback when an engine is missing.

Fake engines are Int8Engine subclasses (the project's own interface) wrapping the real
reference runner, so agreement is checked against real int8 outputs."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from edge_agent.errors import EXIT_UNAVAILABLE, ConfigError
from edge_agent.int8 import bundle_create as BC
from edge_agent.int8 import selection as sel
from edge_agent.int8 import selection_cache
from edge_agent.int8.engine import (
    ENV_FORCE_BACKEND,
    ENV_FORCE_WRONG,
    Availability,
    Int8Engine,
    Runner,
)
from edge_agent.int8.engines.edgetpu import EdgeTpuEngine
from edge_agent.int8.engines.reference import QGraphRunner, ReferenceEngine
from edge_agent.sim import models

PROBE = {"cpu": {"arch": "x86_64", "count": 2, "int8_features": {"avx2": True}}, "accelerators": [],
         "board": {"model": "test board"}}
LABELS = [str(i) for i in range(10)]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    x_train, y_train, _, _ = models.load_digits_split()
    net = models.digits_cnn()
    models.fit_classifier(net, x_train, y_train, epochs=3)
    root = tmp_path_factory.mktemp("selection")
    kwargs = dict(calibration=x_train[:64], labels=LABELS, name="digits", input_shape=(1, 8, 8), scale=1 / 16)
    other = dict(kwargs, calibration=x_train[64:96])  # other int8 scales: another backbone
    return (BC.create_bundle(net, root / "v1", version="1", **kwargs),
            BC.create_bundle(net, root / "v2", version="2", **kwargs),
            BC.create_bundle(net, root / "v3", version="3", **other))


@pytest.fixture(scope="module")
def bundle(made):
    return made[0]


class Shifted(QGraphRunner):
    """The reference's int8 output moved by `shift` units, after burning `delay` CPU seconds.

    Delays are 0.25 s of busy CPU, far above one batch's compute, so that "costlier" stays
    costlier on a loaded machine or one core (selection minimises CPU-seconds, median of
    interleaved rounds, never a single run). A shift of 40 units is a gross bug (a scale or
    layout error): a few units are rounding, which the task-level rule accepts."""

    def __init__(self, graph, shift: int, delay: float) -> None:
        super().__init__(graph)
        self.shift, self.delay = shift, delay

    def _invoke(self, x):
        end = time.process_time() + self.delay
        while time.process_time() < end:
            pass
        y = super()._invoke(x).astype(np.int16) + self.shift
        return np.clip(y, -128, 127).astype(np.int8)


class FakeEngine(Int8Engine):
    def __init__(self, name: str, *, shift: int = 0, delay: float = 0.0, available: bool = True,
                 fail: str = "") -> None:
        self.name, self.shift, self.delay, self.available, self.fail = name, shift, delay, available, fail
        self.prepared = 0

    def availability(self, probe=None) -> Availability:
        return Availability(self.available, "fake" if self.available else "fake: switched off")

    def prepare(self, model, *, threads=None) -> Runner:
        self.prepared += 1
        if self.fail:
            raise RuntimeError(self.fail)
        return Shifted(model.qgraph(), self.shift, self.delay)


def _select(bundle, engines, tmp_path, **kw):
    kw.setdefault("probe", PROBE)
    kw.setdefault("env", {})
    kw.setdefault("threads", 1)  # one prepare per engine (more threads: one per thread count)
    return sel.select_engine(bundle, engines=engines, state_dir=tmp_path, repeats=2, batch_size=16, **kw)[0]


def test_the_fastest_correct_engine_wins(bundle, tmp_path):
    fast_wrong = FakeEngine("fast-wrong", shift=40)
    slow_right = FakeEngine("slow-right", shift=1, delay=0.25)
    fast_right = FakeEngine("fast-right", delay=0.0)
    broken = FakeEngine("broken", fail="no such device")
    off = FakeEngine("off", available=False)
    selection = _select(bundle, [(e.name, e) for e in (fast_wrong, slow_right, fast_right, broken, off)], tmp_path)
    rows = {c.name: c for c in selection.candidates}
    assert selection.chosen == "fast-right" and rows["fast-right"].chosen
    assert rows["fast-wrong"].agreement == "int8" and rows["fast-wrong"].max_diff == 40 and not rows["fast-wrong"].correct
    assert rows["slow-right"].max_diff == 1 and rows["slow-right"].correct
    assert rows["slow-right"].latency_ms > rows["fast-right"].latency_ms
    assert rows["broken"].error == "RuntimeError: no such device" and rows["broken"].correct is False
    assert not rows["off"].available and rows["off"].latency_ms is None and off.prepared == 0
    assert rows["fast-right"].top1_match == 1.0 and rows["fast-right"].top1_checked > 0


def test_a_wrong_fast_engine_never_wins_even_alone_with_a_slow_reference(bundle, tmp_path):
    selection = _select(bundle, [("fast-wrong", FakeEngine("fast-wrong", shift=-40)),
                                 ("reference", ReferenceEngine())], tmp_path)
    assert selection.chosen == "reference"


def test_nothing_correct_is_an_unavailable_error(bundle, tmp_path):
    with pytest.raises(sel.EngineUnavailableError, match="no int8 engine.*wrong: fake") as info:
        _select(bundle, [("wrong", FakeEngine("wrong", shift=40)), ("off", FakeEngine("off", available=False))],
                tmp_path)
    assert info.value.exit_code == EXIT_UNAVAILABLE


def test_the_cache_is_reused_and_invalidated(made, tmp_path, monkeypatch):
    v1, v2, v3 = made
    engine = FakeEngine("fake")
    engines = [("fake", engine), ("reference", ReferenceEngine())]
    first = _select(v1, engines, tmp_path)
    assert not first.cached and engine.prepared == 1
    cache_file = tmp_path / sel.CACHE_DIR
    assert len(list(cache_file.iterdir())) == 1
    again = _select(v1, engines, tmp_path)
    assert again.cached and again.chosen == first.chosen and engine.prepared == 1  # nothing re-measured
    assert again.candidate(first.chosen).latency_ms == first.candidate(first.chosen).latency_ms
    # a new version with the same int8 backbone (a new head: every federated round) reuses it
    assert v2.sha256 != v1.sha256 and _select(v2, engines, tmp_path).cached and engine.prepared == 1
    # another backbone, other hardware, another edge-agent version, another batch size: each re-selects
    assert v3.manifest.files["backbone_int8.tflite"].sha256 != v1.manifest.files["backbone_int8.tflite"].sha256
    _select(v3, engines, tmp_path)
    assert engine.prepared == 2
    _select(v1, engines, tmp_path, probe={**PROBE, "cpu": {**PROBE["cpu"], "int8_features": {"avx2": True, "avx512_vnni": True}}})
    assert engine.prepared == 3
    monkeypatch.setattr(selection_cache, "__version__", "99.0")  # the cache key's version
    _select(v1, engines, tmp_path)
    assert engine.prepared == 4
    monkeypatch.undo()
    sel.select_engine(v1, engines=engines, state_dir=tmp_path, repeats=2, batch_size=8, probe=PROBE, env={},
                      threads=1)
    assert engine.prepared == 5
    assert len(list(cache_file.iterdir())) == 5
    assert _select(v1, engines, tmp_path).cached and engine.prepared == 5


def test_a_corrupt_or_stale_cache_entry_is_measured_again(bundle, tmp_path):
    engine = FakeEngine("fake")
    engines = [("fake", engine), ("reference", ReferenceEngine())]
    _select(bundle, engines, tmp_path)
    (path,) = (tmp_path / sel.CACHE_DIR).iterdir()
    path.write_bytes(b"\0" * 100)  # zero-filled by a power cut
    assert not _select(bundle, engines, tmp_path).cached and engine.prepared == 2
    obj = json.loads(path.read_text())  # rewritten whole
    obj["chosen"] = "fast-but-wrong"
    path.write_text(json.dumps(obj))
    assert not _select(bundle, engines, tmp_path).cached and engine.prepared == 3


def test_a_cached_engine_that_disappeared_is_replaced(bundle, tmp_path):
    fake = FakeEngine("fake")
    _select(bundle, [("fake", fake), ("reference", FakeEngine("reference", delay=0.25))], tmp_path)
    assert _select(bundle, [("fake", fake), ("reference", ReferenceEngine())], tmp_path).chosen == "fake"
    fake.available = False  # e.g. its library was uninstalled
    selection = _select(bundle, [("fake", fake), ("reference", ReferenceEngine())], tmp_path)
    assert not selection.cached and selection.chosen == "reference"


def test_forced_engine_is_used_checked_and_never_cached(bundle, tmp_path):
    fast = FakeEngine("fast")
    engines = [("fast", fast), ("reference", ReferenceEngine())]
    selection = _select(bundle, engines, tmp_path, env={ENV_FORCE_BACKEND: "reference"})
    assert selection.forced and selection.chosen == "reference" and fast.prepared == 0
    assert "not tried" in selection.candidate("fast").reason
    assert selection.candidate("reference").correct and not (tmp_path / sel.CACHE_DIR).exists()
    # an engine marked wrong is never run unless forced anyway, and then with a warning
    with pytest.raises(sel.EngineUnavailableError, match="wrong: the engine disagrees.*--force-engine") as err:
        _select(bundle, [("wrong", FakeEngine("wrong", shift=40))], tmp_path, env={ENV_FORCE_BACKEND: "wrong"})
    assert err.value.exit_code == EXIT_UNAVAILABLE
    wrong = _select(bundle, [("wrong", FakeEngine("wrong", shift=40))], tmp_path,
                    env={ENV_FORCE_BACKEND: "wrong", ENV_FORCE_WRONG: "1"})
    assert wrong.chosen == "wrong" and "disagrees" in wrong.notes[0]


def test_forced_engine_unknown_or_unavailable(bundle, tmp_path):
    engines = [("reference", ReferenceEngine())]
    with pytest.raises(ConfigError, match=f"{ENV_FORCE_BACKEND}=cuda: unknown engine; known: reference"):
        _select(bundle, engines, tmp_path, env={ENV_FORCE_BACKEND: "cuda"})
    with pytest.raises(sel.EngineUnavailableError, match="edgetpu.*no Coral Edge TPU found"):
        _select(bundle, [*engines, ("edgetpu", EdgeTpuEngine())], tmp_path, env={ENV_FORCE_BACKEND: "edgetpu"})


def test_real_registry_falls_back_from_edgetpu_and_checks_every_engine(bundle, tmp_path):
    coral = {**PROBE, "accelerators": [{"kind": "coral-usb", "runtime_loads": False}]}
    # a job of 10^7 images: long enough that mxnet-onednn's multi-second prepare could pay off
    selection, runner = sel.select_engine(bundle, probe=coral, preference=["edgetpu", "tflite", "mxnet-onednn",
                                                                          "reference", "npu9000"],
                                          state_dir=tmp_path, repeats=2, batch_size=16, env={},
                                          keep_runner=True, images=10**7)
    rows = {c.name: c for c in selection.candidates}
    assert not rows["edgetpu"].available and "libedgetpu.so.1 does not load" in rows["edgetpu"].reason
    assert not rows["npu9000"].available and "unknown engine" in rows["npu9000"].reason
    assert rows["tflite"].agreement == "int8" and rows["tflite"].max_diff <= 1 and rows["tflite"].correct
    assert rows["mxnet-onednn"].agreement == "float" and rows["mxnet-onednn"].correct
    assert rows["reference"].latency_ms is None and "not timed" in rows["reference"].reason  # tflite is correct
    assert selection.chosen in ("tflite", "mxnet-onednn", "reference")
    assert runner.run(bundle.calibration()[:4]).shape == (4, 32, 1, 1)


def test_an_engine_whose_prepare_costs_more_than_the_whole_job_is_not_prepared(bundle, tmp_path):
    """mxnet-onednn says it costs ~6 CPU-s to prepare (an MXNet import, its own quantisation):
    for 1,000 images of a net tflite runs in microseconds, that is never worth paying."""
    selection, _ = sel.select_engine(bundle, probe=PROBE, preference=["tflite", "mxnet-onednn"], state_dir=tmp_path,
                                     repeats=2, batch_size=16, env={}, images=1000, use_cache=False, threads=1)
    onednn = selection.candidate("mxnet-onednn")
    assert onednn.available and onednn.correct is None and onednn.prepare_cpu_s is None
    assert "not prepared: its prepare alone" in onednn.reason and "1,000-image job on tflite" in onednn.reason
    assert selection.chosen == "tflite"


def test_near_ties_are_left_out_of_the_top1_check(bundle):
    """A head whose classes 0 and 1 tie on every sample: a one-unit wobble may flip them."""
    def logits(features):
        flat = features.reshape(len(features), -1)
        return np.stack([flat.sum(1), flat.sum(1) + 1e-6, flat.sum(1) - 100.0], axis=1)

    oracle = sel.Oracle(bundle, sel.check_batch_for(bundle, 8), logits=logits)
    assert not oracle.decided(1.0).any()

    def clear(features):  # a margin of 1000 logits: nothing is a near-tie
        flat = features.reshape(len(features), -1)
        return np.stack([flat.sum(1) + 1000.0, flat.sum(1)], axis=1)

    assert sel.Oracle(bundle, sel.check_batch_for(bundle, 8), logits=clear).decided(1.0).all()


def test_check_batch_repeats_calibration_up_to_the_batch_size(bundle):
    x = sel.check_batch_for(bundle, 150)
    calib = bundle.calibration()
    assert x.shape == (150, 1, 8, 8)
    np.testing.assert_array_equal(x[64:128], calib)


def test_fingerprint_follows_what_decides_engine_choice():
    base = sel.hardware_fingerprint(PROBE)
    assert base == sel.hardware_fingerprint(json.loads(json.dumps(PROBE)))
    assert base != sel.hardware_fingerprint({**PROBE, "accelerators": [{"kind": "coral-usb"}]})


def _tied(features):
    """A head on which every sample ties classes 0 and 1 (as random-weight nets, whose
    features are ~1e-10, tie every class): its top-1 says nothing about the features."""
    flat = features.reshape(len(features), -1)
    return np.stack([flat.sum(1), flat.sum(1) + 1e-6, flat.sum(1) - 100.0], axis=1)


def test_an_agreement_check_with_no_decided_sample_is_inconclusive_never_ok(bundle, tmp_path):
    """Every engine once 'agreed' on such a head with top1_checked 0: the tie makes the same
    top-1 for any features. Now the check says it is inconclusive and units decide."""
    from edge_agent.int8.cli import render

    off_by_5 = FakeEngine("off-by-5", shift=5)  # 5 int8 units: more than this graph's rounding (2)
    exact = FakeEngine("exact")
    selection = _select(bundle, [("off-by-5", off_by_5), ("exact", exact)], tmp_path, logits=_tied)
    rows = {c.name: c for c in selection.candidates}
    for row in rows.values():
        assert row.basis == "units" and row.agreement_decided == 0
        assert row.inconclusive.startswith("0 of 64 calibration samples have a top-1")
        assert row.top1_checked == 0 and row.top1_match is None and row.top1_fp32 is None
    tolerance = rows["off-by-5"].tolerance  # the graph's own rounding sensitivity, measured
    assert 1 <= tolerance < 5 and rows["exact"].tolerance == tolerance
    assert rows["off-by-5"].correct is False and rows["off-by-5"].max_diff == 5
    assert rows["exact"].correct is True and selection.chosen == "exact"
    assert any("task-level agreement inconclusive" in note for note in selection.notes)  # the job's report
    with open(selection.cache_file) as f:
        cached = json.load(f)["candidates"]
    assert all(c["inconclusive"].startswith("0 of 64") and c["basis"] == "units" for c in cached)
    info = {"model": "digits", "version": "1", "sha256": "0" * 64, "hardware": "h", "profile": None,
            "batch_size": 16, "threads": 1}
    text = render(info, selection.candidates, selection, None)
    line = next(t for t in text.splitlines() if t.startswith("* exact"))
    assert f"inconclusive -> units ok: int8 max 0/{tolerance:g} unit, top-1 inconclusive (0 decided)" in line
    assert "note:     task-level agreement inconclusive (0 of 64 calibration samples" in text
    assert " ok " not in text.replace("units ok", "")  # no task-level "ok" anywhere



def test_a_measured_selection_reads_the_calibration_samples_once(bundle, tmp_path, monkeypatch):
    """The check batch, the phase prices and the oracle all come from one decode of
    calibration.npz (each was a decode of its own: ~0.07 CPU-s on the camera bundle)."""
    reads = []
    real = type(bundle).calibration
    monkeypatch.setattr(type(bundle), "calibration", lambda self: reads.append(1) or real(self))
    selection, _ = sel.select_engine(bundle, probe=PROBE, preference=["tflite", "native"], state_dir=tmp_path,
                                     use_cache=False, repeats=2, batch_size=16, threads=1, env={})
    assert selection.chosen in ("tflite", "native") and len(reads) == 1
