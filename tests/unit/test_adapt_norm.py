"""The prefix adapted to a device's camera (int8/adapt_norm.py, train/job_adapt.py): the
statistics it re-estimates, what it recovers on real data, and the job's evidence-based use.

Real data: scikit-learn's digits split over the demo scenario's devices, seen through a
strongly shifted camera (sim/camera_shift.py); the demo's digits CNN (conv + BatchNorm).
"""

from __future__ import annotations

import dataclasses
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


def test_only_the_first_layers_are_adapted_the_later_ones_keep_the_bundles_statistics(bundle, devices) -> None:
    graph = import_onnx(bundle.onnx_bytes(), split=bundle.manifest.split_tensor)
    x = bundle.manifest.input.normalise(_pixels(shift_images(devices[0].images, CAMERA)))
    norm = [i for i, op in enumerate(graph.ops) if op.norm is not None]
    assert len(norm) >= 2
    ranges: dict = {}
    adapted, report = an.adapt_graph(graph, x, max_images=len(x), layers=1, ranges=ranges)
    assert len(report.layers) == 1  # the adapted layer's shift ...
    assert {op.output for op in graph.ops} <= set(ranges)  # ... and every tensor's range, for re-quantising
    # the ops after the adapted one ran a few images at a time through all of them: the ranges
    # of every op over every image (every layer measured, so that pass runs op by op; the
    # adapted op's folded weights round a little differently from its statistics pass)
    op_by_op: dict = {}
    an._walk(dataclasses.replace(graph, ops=adapted.ops), x.astype(np.float32), measure=len(norm), ranges=op_by_op)
    assert op_by_op.keys() == ranges.keys()
    assert np.allclose([op_by_op[k] for k in ranges], [ranges[k] for k in ranges], rtol=1e-4, atol=1e-5)
    bare, bare_report = an.adapt_graph(graph, x, max_images=len(x), layers=1)  # no ranges asked for:
    assert len(bare_report.layers) == 1  # the pass ends at the adapted layer ...
    assert all(b is g for b, g in zip(bare.ops[norm[0] + 1:], graph.ops[norm[0] + 1:], strict=True))  # ... the rest as is
    assert np.array_equal(bare.ops[norm[0]].bias, adapted.ops[norm[0]].bias)
    first = norm[0]
    assert not np.array_equal(adapted.ops[first].bias, graph.ops[first].bias)
    for i in norm[1:]:  # same weights, bias and recorded statistics as the bundle's
        assert np.array_equal(adapted.ops[i].weight, graph.ops[i].weight)
        assert np.array_equal(adapted.ops[i].bias, graph.ops[i].bias)
    after = an.measure_shift(adapted, x, layers=99, images=len(x))
    assert after.layers[0].distance < 1e-3 < after.layers[1].distance  # the second still sees the camera's shift
    assert an.ADAPT_LAYERS == an.SHIFT_LAYERS  # adapted where the shift is measured


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


def test_auto_adapts_a_far_cameras_prefix_without_judging_it_on_validation(bundle, devices, tmp_path: Path) -> None:
    """The bundle's untrained tail on the validation split was the judge once; it disagreed with
    the trained tail's held-out accuracy on 5 of 8 bench devices (job_adapt.py), so a far
    camera is adapted, and the report says which layers."""
    for dev in devices:
        data = demo.write_data(tmp_path / dev.device_id, shift_images(dev.images, CAMERA), dev.labels, "npz")
        report = run_finetune(model=bundle.path, data=data, state_dir=tmp_path / f"state-{dev.device_id}",
                              cache_dir=tmp_path / "cache", **FAST)
        ad = report["adaptation"]
        assert ad["requested"] == "auto" and ad["shift"]["distance"] >= ADAPT_SHIFT
        assert ad["kind"] == "bn" and "validation" not in ad, ad
        assert f"the first {an.ADAPT_LAYERS} normalised layers" in ad["reason"]
        assert Path(ad["prefix"]).is_file()
        assert report["feature_cache"]["computed"] + report["feature_cache"]["hits"] == report["data"]["loaded"]
    forced = run_finetune(model=bundle.path, data=data, state_dir=tmp_path / "state-bn", cache_dir=tmp_path / "cache",
                          adapt="bn", **FAST)
    assert forced["adaptation"]["kind"] == "bn" and "--adapt bn" in forced["adaptation"]["reason"]
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


def test_a_later_job_on_the_same_camera_serves_the_prefix_an_earlier_one_adapted(
        bundle, devices, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The adapted prefix is remembered per bundle prefix: a later job at about the same shift,
    on images that grew by less than REUSE_GROWTH, serves it without re-estimating; more
    images, an unreadable record or one used REUSE_USES times adapt again and rewrite it."""
    import json

    from edge_agent.train.job_adapt import REUSE_SUFFIX, REUSE_USES

    dev = next(d for d in devices if d.device_id == "dev-03")
    seen = shift_images(dev.images, CAMERA)
    cache = tmp_path / "cache"

    def job(n: int, count: int) -> dict:
        data = demo.write_data(tmp_path / f"data-{n}", seen[:count], dev.labels[:count], "npz")
        return run_finetune(model=bundle.path, data=data, state_dir=tmp_path / f"state-{n}", cache_dir=cache,
                            **FAST)["adaptation"]

    walks: list[int] = []  # statistics passes (not CPU seconds: a few ms on this small CNN)
    real_walk = an.adapt_graph
    monkeypatch.setattr(an, "adapt_graph", lambda *args, **kw: walks.append(1) or real_walk(*args, **kw))
    some = int(len(seen) * 0.6)
    first = job(1, some)
    assert first["kind"] == "bn" and not first["remembered"] and not first["cached"] and len(walks) == 1, first
    grown = job(2, some + 5)  # other images, about as many: the earlier prefix is served
    assert grown["kind"] == "bn" and grown["remembered"] and grown["cached"], grown
    assert grown["prefix_sha256"] == first["prefix_sha256"] and "by an earlier job" in grown["reason"]
    assert len(walks) == 1
    [path] = (cache / "adapted-prefixes").glob(f"*{REUSE_SUFFIX}")
    record = json.loads(path.read_text())
    assert record["uses"] == 1 and record["prefix"] == Path(first["prefix"]).name

    more = job(3, len(seen))  # grown by more than REUSE_GROWTH: adapted again on what it has now
    assert len(seen) > some * 1.5 and not more["remembered"] and len(walks) == 2, more
    assert json.loads(path.read_text())["uses"] == 0

    path.write_text("{not json")  # unreadable: ignored, adapted again, rewritten
    assert not job(4, len(seen) - 3)["remembered"] and len(walks) == 3
    assert json.loads(path.read_text())["uses"] == 0

    path.write_text(json.dumps({**json.loads(path.read_text()), "uses": REUSE_USES}))  # worn out
    assert not job(5, len(seen) - 6)["remembered"] and len(walks) == 4


def test_an_earlier_adaptation_covers_the_shift_it_was_made_at_and_about_the_same_data() -> None:
    from edge_agent.train.job_adapt import REUSE_SHIFT_TOLERANCE, EarlierAdaptation

    e = EarlierAdaptation.from_json({"shift": 0.5, "images": 100, "prefix": "a.tflite", "uses": 2})
    assert e.covers(0.5 + REUSE_SHIFT_TOLERANCE * 0.9, 140) and e.covers(0.45, 70)
    assert not e.covers(0.5 + REUSE_SHIFT_TOLERANCE * 1.1, 100)  # another camera
    assert not e.covers(0.5, 151) and not e.covers(0.5, 66)  # the data grew (or shrank) by half
    for bad in ({"prefix": "../../etc/passwd.tflite"}, {"prefix": "x.bin"}, {"prefix": None}, {"shift": True},
                {"uses": -1}, {"images": None}, {"shift": "far"}):
        with pytest.raises(ValueError):
            EarlierAdaptation.from_json({**e.to_json(), **bad})


def test_a_shift_next_to_the_threshold_is_not_printed_as_the_threshold() -> None:
    from edge_agent.train.job_adapt import shift_text

    assert shift_text(0.2497) == "0.2497" and shift_text(0.2503) == "0.2503"  # not "0.25 < 0.25"
    assert shift_text(0.67) == "0.67" and shift_text(0.24) == "0.24"


def test_a_histogram_calibrated_prefix_is_adapted_too(bundle, devices) -> None:
    """With a histogram method the adapting pass ends at the adapted layers (the calibration
    runs its own passes): the prefix it writes still carries the device's statistics."""
    from edge_agent.int8.tflite_reader import read_tflite

    graph = import_onnx(bundle.onnx_bytes(), split=bundle.manifest.split_tensor)
    x = bundle.manifest.input.normalise(_pixels(shift_images(devices[0].images, CAMERA)))
    for method in ("minmax", "percentile"):
        adapted, plain = (read_tflite(an.quantised_prefix(graph, x, method=method, layers=n)) for n in (1, 0))
        assert [op.kind for op in adapted.ops] == [op.kind for op in plain.ops], method
        # the first convolution's int32 bias carries the device's statistics: the same
        # calibration without them (layers=0) quantises another
        bias = [q.tensor(q.ops[0].inputs[2]).data for q in (adapted, plain)]
        assert not np.array_equal(*bias), method
