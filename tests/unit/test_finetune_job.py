"""The fine-tune job end to end: real digits bundle, int8 engine, feature cache, MXNet head.

The real-data check: scikit-learn's digits split over simulated devices; the base model is
trained on other devices' clean images; each device fine-tunes on its own share seen
through its own camera and must get clearly better on its local validation split.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest

from edge_agent.errors import InputError
from edge_agent.sim import scenario as demo
from edge_agent.train.checkpoints import CheckpointMismatchError
from edge_agent.train.job import JobStateError, Progress, run_finetune

FAST = {"epochs": 30, "patience": 5, "val_fraction": 0.3, "profile": "raspberry-pi-4", "batch_size": 32}


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo.ensure_bundle(tmp_path_factory.getbasetemp() / "digits-bundle")


@pytest.fixture(scope="module")
def devices(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("devices")
    sc = demo.scenario()
    return {d.device_id: demo.write_data(root / d.device_id, d.images, d.labels, fmt)
            for d, fmt in zip(sc.devices, ("images", "csv", "npz"), strict=True)}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


def _shipped_accuracy(bundle: Path, data: Path) -> float:
    """The bundle's own prefix and head on the job's validation split (the same content-hash split)."""
    from edge_agent.data import load_dataset, split_dataset
    from edge_agent.inference.predictor import Predictor
    from edge_agent.int8.bundle import load_bundle

    b = load_bundle(bundle)
    _, val = split_dataset(load_dataset(data, b.manifest.input, b.manifest.labels), FAST["val_fraction"])
    shipped = Predictor(b, engine="native")
    try:
        logits = shipped.tail.logits(shipped.runner.run(val.x))  # val.x: normalised, as the model takes it
    finally:
        shipped.close()
    return float((np.asarray(logits).argmax(axis=1) == np.asarray(val.y)).mean())


def test_each_device_improves_on_its_own_camera_data_in_every_format(
        bundle: Path, devices: dict[str, Path], cache_dir: Path, tmp_path: Path) -> None:
    import mxnet as mx

    rows = []
    for device, data in devices.items():
        events: list[Progress] = []
        report = run_finetune(model=bundle, data=data, state_dir=tmp_path / device, cache_dir=cache_dir,
                              progress=events.append, **FAST)
        acc = report["accuracy"]
        # the base model as shipped: a prefix adapted to the camera (train/job_adapt.py) already
        # raises "before", the untrained tail through it; the job's gain counts from the bundle's own
        rows.append((device, report["data"]["format"], _shipped_accuracy(bundle, data), acc["after"],
                     acc["validation_samples"]))
        assert report["stop_reason"] in ("done", "early-stopped")
        # never worse by more than one validation sample (the noise floor of a small split)
        assert acc["after"] >= acc["before"] - 1.0 / acc["validation_samples"] - 1e-5  # report rounds to 6 places
        assert report["steps"] > 0 and report["duration_s"] > 0 and report["peak_rss_mb"] > 50
        assert report["energy"]["wh"] > 0 and report["energy"]["source"]
        assert report["data"]["loaded"] == report["data"]["train"] + report["data"]["validation"]
        # the trained head: in the report and as an MXNet params file a bundle can take
        saved = mx.nd.load(report["head"]["file"])
        weight = report["head"]["params"]["fc_weight" if "fc_weight" in report["head"]["params"] else
                                          next(iter(report["head"]["params"]))]
        key = next(k for k in saved if k.endswith(next(iter(report["head"]["params"]))))
        np.testing.assert_allclose(saved[key].asnumpy().reshape(-1), weight["values"], rtol=1e-6)
        assert json.loads((tmp_path / device / "report.json").read_text())["accuracy"] == acc
        phases = {e.phase for e in events}
        assert {"data", "train", "checkpoint", "done"} <= phases
        assert events[-1].phase == "done" and events[-1].detail == report["stop_reason"]
    print("\nreal-data check (device, format, accuracy before -> after, validation samples):")
    for row in rows:
        print("  {} {:<6} {:.3f} -> {:.3f}  (n={})".format(*row))
    gains = [after - before for _, _, before, after, _ in rows]
    assert np.mean(gains) >= 0.10
    for _, _, before, after, _ in rows:
        if before < 0.9:  # where the camera really hurts the base model, adapting must help clearly
            assert after - before >= 0.10


def test_a_later_job_computes_features_only_for_new_samples(
        bundle: Path, devices: dict[str, Path], tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"  # its own cache: what another test computed must not matter
    npz = np.load(devices["dev-05"])
    grown = tmp_path / "grown.npz"
    extra = np.clip(npz["x"][:10].astype(int) + 7, 0, 255)
    np.savez(grown, x=np.concatenate([npz["x"], extra]), y=np.concatenate([npz["y"], npz["y"][:10]]))
    first = run_finetune(model=bundle, data=devices["dev-05"], state_dir=tmp_path / "a", cache_dir=cache_dir,
                         epochs=1, profile="raspberry-pi-4")
    again = run_finetune(model=bundle, data=devices["dev-05"], state_dir=tmp_path / "a", cache_dir=cache_dir,
                         epochs=1, profile="raspberry-pi-4")  # a finished job's state is reused
    second = run_finetune(model=bundle, data=grown, state_dir=tmp_path / "a", cache_dir=cache_dir,
                          epochs=1, profile="raspberry-pi-4")
    assert first["feature_cache"]["computed"] == first["data"]["loaded"] > 0  # an empty cache
    assert again["feature_cache"]["computed"] == 0 and again["feature_cache"]["hits"] == first["data"]["loaded"]
    assert second["feature_cache"]["hits"] == first["data"]["loaded"]
    assert second["feature_cache"]["computed"] == second["data"]["loaded"] - first["data"]["loaded"] > 0


def test_checkpoints_come_every_checkpoint_every_steps_not_every_epoch(
        bundle: Path, devices: dict[str, Path], cache_dir: Path, tmp_path: Path) -> None:
    """A brown-out loses at most `checkpoint_every` steps, and a job of many short epochs does
    not write a checkpoint at each of them (CPU time and flash writes on the device)."""
    events: list[Progress] = []
    report = run_finetune(model=bundle, data=devices["dev-04"], state_dir=tmp_path / "s", cache_dir=cache_dir,
                          epochs=10, patience=100, checkpoint_every=7, batch_size=64, profile="raspberry-pi-4",
                          progress=events.append)
    per_epoch = report["steps"] // 10
    assert report["stop_reason"] == "done" and 1 <= per_epoch < 7  # epochs shorter than the interval
    saved = [e.step for e in events if e.phase == "checkpoint"]
    gaps = np.diff([0, *saved])
    assert saved[-1] == report["steps"] and len(saved) < 10  # fewer than one an epoch, and the end
    assert gaps.max() <= 7 and (gaps[:-1] >= 7).all(), saved  # none more than 7 steps apart, none sooner


@pytest.mark.parametrize("adapt", ["bn", "none"])
def test_cancel_checkpoint_and_resume_match_an_uninterrupted_run(
        bundle: Path, devices: dict[str, Path], cache_dir: Path, tmp_path: Path, adapt: str) -> None:
    common = dict(model=bundle, data=devices["dev-04"], cache_dir=cache_dir, epochs=6, patience=10,
                  checkpoint_every=3, profile="raspberry-pi-4", batch_size=16, adapt=adapt)
    straight = run_finetune(state_dir=tmp_path / "straight", **common)

    def sigterm_at_step_7(ev: Progress) -> None:
        if ev.phase == "train" and ev.step == 7:
            os.kill(os.getpid(), signal.SIGTERM)  # what systemd sends on shutdown

    stopped = run_finetune(state_dir=tmp_path / "cut", progress=sigterm_at_step_7, **common)
    assert stopped["stop_reason"] == "cancelled" and stopped["steps"] == 7
    with pytest.raises(JobStateError, match="pass --resume"):
        run_finetune(state_dir=tmp_path / "cut", **common)
    # the adapted prefix is remade on resume if its cache is gone: the same bytes (train/job_adapt.py)
    shutil.rmtree(cache_dir / "adapted-prefixes", ignore_errors=True)
    events: list[Progress] = []
    resumed = run_finetune(state_dir=tmp_path / "cut", resume=True, progress=events.append, **common)
    assert any("resumed from" in e.detail and "step 7" in e.detail for e in events)
    assert resumed["stop_reason"] == straight["stop_reason"] and resumed["steps"] == straight["steps"]
    assert resumed["accuracy"] == straight["accuracy"]
    for name, p in straight["head"]["params"].items():
        assert resumed["head"]["params"][name]["values"] == p["values"]  # bit-identical
    assert resumed["energy"]["wh"] > stopped["energy"]["wh"]  # energy carried across the restart
    assert resumed["adaptation"]["kind"] == straight["adaptation"]["kind"] == ("bn" if adapt == "bn" else "none")
    assert resumed["adaptation"]["prefix_sha256"] == straight["adaptation"]["prefix_sha256"]


def test_a_checkpoint_from_another_model_is_refused_and_kept(
        bundle: Path, devices: dict[str, Path], cache_dir: Path, tmp_path: Path) -> None:
    def cancel_at_3(ev: Progress) -> None:
        if ev.phase == "train" and ev.step == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    run_finetune(model=bundle, data=devices["dev-05"], state_dir=tmp_path / "s", cache_dir=cache_dir,
                 progress=cancel_at_3, profile="raspberry-pi-4", checkpoint_every=1)
    other = tmp_path / "other-bundle"
    shutil.copytree(bundle, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["version"] = "2"
    (other / "manifest.json").write_text(json.dumps(manifest))
    before = sorted(p.name for p in (tmp_path / "s" / "checkpoints").iterdir())
    with pytest.raises(CheckpointMismatchError, match="another state directory") as err:
        run_finetune(model=other, data=devices["dev-05"], state_dir=tmp_path / "s", cache_dir=cache_dir,
                     resume=True, profile="raspberry-pi-4")
    assert err.value.exit_code == 65
    assert sorted(p.name for p in (tmp_path / "s" / "checkpoints").iterdir()) == before


def test_bad_data_is_counted_or_refused(bundle: Path, devices: dict[str, Path], cache_dir: Path,
                                        tmp_path: Path) -> None:
    data = tmp_path / "photos"
    shutil.copytree(devices["dev-03"], data)
    (data / "3" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(40))
    (data / "7" / "zeros.jpg").write_bytes(bytes(500))
    (data / "cat").mkdir()
    (data / "cat" / "c.png").write_bytes((data / "3" / next(iter(os.listdir(data / "3")))).read_bytes())
    with pytest.raises(InputError, match=r"sub-folder\(s\) 'cat' match none of the model's labels"):
        run_finetune(model=bundle, data=data, state_dir=tmp_path / "s0", cache_dir=cache_dir, epochs=1,
                     profile="raspberry-pi-4")
    report = run_finetune(model=bundle, data=data, state_dir=tmp_path / "s", cache_dir=cache_dir, epochs=1,
                          profile="raspberry-pi-4", skip_unknown=True)
    assert report["data"]["skipped"] == {"unreadable-image": 2, "unknown-label": 1}
    assert report["data"]["unknown_labels"] == ["cat"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="empty"):
        run_finetune(model=bundle, data=tmp_path / "empty", state_dir=tmp_path / "e", cache_dir=cache_dir)
    only_unknown = tmp_path / "unknown.npz"
    np.savez(only_unknown, x=np.zeros((3, 8, 8)), y=np.array(["cat", "dog", "cow"]))
    with pytest.raises(InputError, match="unknown-label: 3"):
        run_finetune(model=bundle, data=only_unknown, state_dir=tmp_path / "u", cache_dir=cache_dir,
                     skip_unknown=True)


def test_one_job_per_state_directory(bundle: Path, devices: dict[str, Path], tmp_path: Path) -> None:
    state = tmp_path / "busy"
    state.mkdir()
    with open(state / "lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(JobStateError, match="another fine-tune job"):
            run_finetune(model=bundle, data=devices["dev-05"], state_dir=state)


_PHASE_PROBE = """
import json, sys
from edge_agent.train.job import run_finetune
seen = {}
def progress(event):
    seen.setdefault(event.phase, "mxnet" in sys.modules)
report = run_finetune(model=sys.argv[1], data=sys.argv[2], state_dir=sys.argv[3], cache_dir=sys.argv[4],
                      trainer=sys.argv[5], engine="tflite", epochs=2, val_fraction=0.3, profile="raspberry-pi-4", progress=progress)
print(json.dumps({"mxnet_at_first": seen, "mxnet_at_end": "mxnet" in sys.modules, "trainer": report["trainer"],
                  "hidden": [m for m in ("sklearn", "scipy") if m in sys.modules],
                  "head": report["head"]["file"], "steps": report["steps"]}))
"""


@pytest.mark.parametrize("trainer", ["auto", "mxnet"])
def test_the_training_process_loads_mxnet_only_after_the_features_and_only_when_needed(
        bundle: Path, devices: dict[str, Path], tmp_path: Path, trainer: str) -> None:
    # A fresh interpreter, as the agent's training child is: the int8 features (here with
    # TFLite) run before
    # MXNet is imported (their peaks must not stack); a one-dense-layer head (these bundles')
    # trains in numpy, so with trainer="auto" MXNet is never imported; with Gluon, MXNet's
    # optional scikit-learn / SciPy imports are hidden (installed for the tests, unused).
    import subprocess
    import sys

    from edge_agent.mxparams import load_params

    data = next(iter(devices.values()))

    def job(name: str) -> dict:
        out = subprocess.run([sys.executable, "-c", _PHASE_PROBE, str(bundle), str(data), str(tmp_path / name),
                              str(tmp_path / f"{name}-cache"), trainer],
                             capture_output=True, text=True, timeout=600, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    # the engine is pinned: an engine selection tries mxnet-onednn (which loads MXNet), and
    # for this small CNN it may well choose it -- then MXNet is the feature engine
    result = job("job")
    first = result["mxnet_at_first"]
    assert first["data"] is False and first["features"] is False  # no MXNet up to the features
    assert result["steps"] > 0 and result["hidden"] == []
    if trainer == "auto":
        assert result["trainer"] == "numpy" and result["mxnet_at_end"] is False
    else:
        assert result["trainer"] == "mxnet" and first["train"] is True
    # the head, written without MXNet, is an MXNet params file (the fleet test loads it with MXNet)
    assert all(k.startswith(("arg:", "aux:")) for k in load_params(Path(result["head"]).read_bytes()))


def test_mxnet_import_hides_sklearn_only_while_mxnet_imports() -> None:
    import subprocess
    import sys

    script = ("import sys; from edge_agent.int8.mxnet_import import mxnet; mx = mxnet(); "
              "assert 'sklearn' not in sys.modules and 'scipy' not in sys.modules; "
              "assert float(mx.nd.ones((2,)).sum().asscalar()) == 2.0; assert mxnet() is mx; "
              "import sklearn.base; print('ok', mx.model.BASE_ESTIMATOR is object)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split() == ["ok", "True"]  # hidden during the import, importable after it


def test_the_job_runs_numpys_blas_on_one_thread_and_collects_only_its_own_objects(
        bundle: Path, devices: dict[str, Path], cache_dir: Path, tmp_path: Path) -> None:
    """A job's matrix products are small: a second OpenBLAS thread spins instead of helping
    (edge_agent/blas.py). Inside the job BLAS runs one thread, and cycle collections leave
    out the objects that existed before it (edge_agent/heap.py); after it, both as before."""
    import gc

    from threadpoolctl import threadpool_info

    def blas_threads() -> list[int]:
        return [pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"]

    before, during, frozen = blas_threads(), [], []
    assert before  # numpy's OpenBLAS is loaded
    assert gc.get_freeze_count() == 0

    def progress(event: Progress) -> None:
        during.append(blas_threads())
        frozen.append(gc.get_freeze_count())

    report = run_finetune(model=bundle, data=next(iter(devices.values())), state_dir=tmp_path / "blas",
                          cache_dir=cache_dir, progress=progress, **FAST)
    assert report["steps"] > 0 and during
    assert all(counts and set(counts) == {1} for counts in during)
    assert blas_threads() == before
    assert min(frozen) > 1000 and gc.get_freeze_count() == 0  # the imports' objects, frozen for the job only
