"""The prefix adapted to a device's camera (int8/adapt_norm.py, train/job_adapt.py): the
statistics it re-estimates, what it recovers on real data, and the job's evidence-based use.

Real data: scikit-learn's digits split over the demo scenario's devices, seen through a
strongly shifted camera (sim/camera_shift.py); the demo's digits CNN (conv + BatchNorm).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edge_agent.errors import UsageError
from edge_agent.inference.predictor import Predictor
from edge_agent.int8 import adapt_norm as an
from edge_agent.int8.bundle import BACKBONE_INT8, HashMismatchError, load_bundle
from edge_agent.int8.engines import load_engine
from edge_agent.int8.onnx_import import import_onnx
from edge_agent.sim import scenario as demo
from edge_agent.sim.camera_shift import ShiftedCamera, shift_images
from edge_agent.train.job import run_finetune
from edge_agent.train.job_adapt import ADAPT_SHIFT

CAMERA = ShiftedCamera(blur_sigma=0.6)  # 8x8 digits: a wider blur leaves nothing to read
FAST = {"epochs": 20, "patience": 4, "val_fraction": 0.3, "profile": "raspberry-pi-4", "batch_size": 32}


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> object:
    return load_bundle(demo.ensure_bundle(tmp_path_factory.getbasetemp() / "digits-bundle"))


@pytest.fixture(scope="module")
def devices() -> list[object]:
    return demo.scenario().devices


def _pixels(images: np.ndarray) -> np.ndarray:
    return demo.to_pixels(images).astype(np.float32)


def test_every_adapted_layer_has_its_normalisation_statistics_on_the_device_images(bundle, devices) -> None:
    graph = import_onnx(bundle.onnx_bytes(), split=bundle.manifest.split_tensor)
    assert an.normalised_layers(graph) >= 2
    x = bundle.manifest.input.normalise(_pixels(shift_images(devices[0].images, CAMERA)))
    before = an.measure_shift(graph, x, layers=99, images=len(x))
    adapted, _ = an.adapt_graph(graph, x, max_images=len(x))
    after = an.measure_shift(adapted, x, layers=99, images=len(x))
    assert before.distance >= ADAPT_SHIFT
    assert len(after.layers) == an.normalised_layers(graph)
    for layer in after.layers:  # mean beta, std |gamma| at every layer, the later ones on adapted inputs
        assert layer.mean_shift < 1e-3 and layer.scale_shift < 1e-3, layer
    # the bundle's own images are close to the statistics it was built with; the camera's are not
    assert an.measure_shift(graph, bundle.calibration()).distance < ADAPT_SHIFT < before.distance


def test_the_adapted_int8_prefix_recovers_what_a_strong_camera_costs(bundle, devices, tmp_path: Path) -> None:
    graph = import_onnx(bundle.onnx_bytes(), split=bundle.manifest.split_tensor)
    gains = []
    for dev in devices[:2]:
        seen = shift_images(dev.images, CAMERA)
        half = len(seen) // 2  # adapt on the first half (no labels), judge on the second
        path = tmp_path / f"{dev.device_id}.tflite"
        path.write_bytes(an.quantised_prefix(graph, bundle.manifest.input.normalise(_pixels(seen[:half]))))
        view = an.adapted_view(bundle, path)
        assert view.sha256 != bundle.sha256 and view.manifest.files[BACKBONE_INT8].size == path.stat().st_size
        base = Predictor(bundle, engine="reference")
        adapted = Predictor(bundle, engine="reference", runner=load_engine("reference").prepare(view))
        gains.append(adapted.accuracy(_pixels(seen[half:]), dev.labels[half:])
                     - base.accuracy(_pixels(seen[half:]), dev.labels[half:]))
    assert np.mean(gains) >= 0.10, gains  # measured: +27 and +18 points
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))  # an adapted prefix changed on disk is refused
    with pytest.raises(HashMismatchError):
        view.tflite_bytes()


def test_auto_keeps_the_adaptation_only_when_the_validation_split_says_it_helps(
        bundle, devices, tmp_path: Path) -> None:
    for dev in devices:
        data = demo.write_data(tmp_path / dev.device_id, shift_images(dev.images, CAMERA), dev.labels, "npz")
        report = run_finetune(model=bundle.path, data=data, state_dir=tmp_path / f"state-{dev.device_id}",
                              cache_dir=tmp_path / "cache", **FAST)
        ad = report["adaptation"]
        assert ad["requested"] == "auto" and ad["shift"]["distance"] >= ADAPT_SHIFT
        loss = ad["validation"]["loss"]
        assert (ad["kind"] == "bn") == (loss[1] < loss[0]), ad
        assert (ad["prefix"] is not None) == (ad["kind"] == "bn")
        if ad["kind"] == "bn":
            assert Path(ad["prefix"]).is_file()
            assert report["feature_cache"]["computed"] + report["feature_cache"]["hits"] == report["data"]["loaded"]
    forced = run_finetune(model=bundle.path, data=data, state_dir=tmp_path / "state-bn", cache_dir=tmp_path / "cache",
                          adapt="bn", **FAST)
    assert forced["adaptation"]["kind"] == "bn" and forced["adaptation"]["validation"] is None
    again = run_finetune(model=bundle.path, data=data, state_dir=tmp_path / "state-bn2", cache_dir=tmp_path / "cache",
                         adapt="bn", **FAST)
    assert again["adaptation"]["cached"] and again["adaptation"]["prefix_sha256"] == forced["adaptation"]["prefix_sha256"]
    assert again["feature_cache"]["hits"] == again["data"]["loaded"]  # same adapted prefix, same features
    plain = run_finetune(model=bundle.path, data=data, state_dir=tmp_path / "state-none",
                         cache_dir=tmp_path / "cache", adapt="none", **FAST)
    assert plain["adaptation"]["kind"] == "none" and plain["adaptation"]["shift"] is None


def test_the_bundles_own_images_are_not_adapted(bundle, tmp_path: Path) -> None:
    calib = bundle.calibration()
    raw = np.clip(np.round(calib / bundle.manifest.input.scale), 0, 255).astype(np.uint8)
    labels = np.arange(len(raw)) % len(bundle.manifest.labels)
    np.savez(tmp_path / "own.npz", x=raw, y=labels)
    report = run_finetune(model=bundle.path, data=tmp_path / "own.npz", state_dir=tmp_path / "state", **FAST)
    assert report["adaptation"]["kind"] == "none"
    assert "close to the bundle's" in report["adaptation"]["reason"]


def test_a_bad_adapt_value_is_refused_before_anything_runs(bundle, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="adapt: expected one of auto, bn, none"):
        run_finetune(model=bundle.path, data=tmp_path / "nothing.npz", state_dir=tmp_path / "state", adapt="yes")
    assert not (tmp_path / "state").exists()


def test_the_service_runs_the_devices_engine_on_an_adapted_prefix(bundle, devices, tmp_path: Path) -> None:
    """open_predictor with a personal tail's adapted prefix: the engine the device selected for
    the bundle's own prefix runs it, and answers as the reference does on it."""
    from edge_agent.inference.predictor import open_predictor

    graph = import_onnx(bundle.onnx_bytes(), split=bundle.manifest.split_tensor)
    seen = _pixels(shift_images(devices[0].images, CAMERA))
    path = tmp_path / "prefix.tflite"
    path.write_bytes(an.quantised_prefix(graph, bundle.manifest.input.normalise(seen)))
    served = open_predictor(bundle, state_dir=tmp_path / "cache", prefix=path, select_in_child=False)
    reference = Predictor(bundle, engine="reference", prefix=path)
    assert served.view.manifest.files[BACKBONE_INT8].size == path.stat().st_size
    assert served.engine != "reference"  # the selected engine, not a fallback
    same = (served.logits(seen).argmax(axis=1) == reference.logits(seen).argmax(axis=1)).mean()
    assert same >= 0.97, same
    served.close()


def test_a_later_job_on_the_same_camera_takes_the_earlier_verdict(bundle, devices, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """auto's verdict is remembered per prefix: the next job at about the same shift serves
    the prefix kept before without re-estimating or judging it, and does not pay again for
    an adaptation rejected before; an unreadable verdict, or one used VERDICT_USES times,
    is judged again and rewritten."""
    import json

    from edge_agent.train.job_adapt import VERDICT_USES

    dev = next(d for d in devices if d.device_id == "dev-03")  # its camera: shift 0.84, loss 2.57 -> 1.59 adapted
    data = demo.write_data(tmp_path / "data", shift_images(dev.images, CAMERA), dev.labels, "npz")
    cache = tmp_path / "cache"

    def job(n: int) -> dict:
        return run_finetune(model=bundle.path, data=data, state_dir=tmp_path / f"state-{n}", cache_dir=cache,
                            **FAST)["adaptation"]

    walks: list[int] = []  # statistics passes (not CPU seconds: on this small CNN the pass and the
    real_walk = an.adapt_graph  # judgement are a few ms, within a loaded machine's noise)
    monkeypatch.setattr(an, "adapt_graph", lambda *args, **kw: walks.append(1) or real_walk(*args, **kw))
    first = job(1)
    assert first["kind"] == "bn" and not first["remembered"] and first["validation"] is not None, first
    assert len(walks) == 1 and not first["cached"]
    again = job(2)
    assert again["kind"] == "bn" and again["remembered"] and again["validation"] is None, again  # not judged
    assert again["prefix_sha256"] == first["prefix_sha256"] and "kept" in again["reason"]
    assert len(walks) == 1 and again["cached"]  # the kept prefix served, no statistics pass
    [path] = (cache / "adapted-prefixes").glob("*.verdict.json")
    verdict = json.loads(path.read_text())
    assert verdict["kept"] and verdict["uses"] == 1 and verdict["prefix"] == Path(first["prefix"]).name

    path.write_text(json.dumps({**verdict, "kept": False, "prefix": None}))  # as an earlier rejection left it
    rejected = job(3)
    assert rejected["kind"] == "none" and rejected["prefix"] is None and rejected["remembered"], rejected
    assert "validation rejected adapting on an earlier job" in rejected["reason"]

    path.write_text("{not json")  # unreadable: ignored, judged again, rewritten
    judged = job(4)
    assert judged["kind"] == "bn" and not judged["remembered"] and judged["validation"] is not None, judged
    assert json.loads(path.read_text())["uses"] == 0

    path.write_text(json.dumps({**json.loads(path.read_text()), "uses": VERDICT_USES}))  # worn out: judged again
    assert job(5)["validation"] is not None


def test_a_verdict_covers_the_shift_it_was_judged_at_and_about_the_same_data() -> None:
    from edge_agent.train.job_adapt import VERDICT_SHIFT_TOLERANCE, Verdict

    v = Verdict.from_json({"shift": 0.5, "kept": False, "images": 100, "prefix": None,
                           "validation": {"loss": [0.7, 0.8]}, "uses": 2})
    assert v.covers(0.5 + VERDICT_SHIFT_TOLERANCE * 0.9, 140) and v.covers(0.45, 70)
    assert not v.covers(0.5 + VERDICT_SHIFT_TOLERANCE * 1.1, 100)  # another camera
    assert not v.covers(0.5, 151) and not v.covers(0.5, 66)  # the data grew (or shrank) by half
    for bad in ({"prefix": "../../etc/passwd.tflite"}, {"prefix": "x.bin"}, {"kept": "yes"}, {"uses": -1},
                {"validation": {"loss": "low"}}, {"images": None}):
        with pytest.raises(ValueError):
            Verdict.from_json({**v.to_json(), **bad})
