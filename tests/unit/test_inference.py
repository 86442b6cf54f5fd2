"""The one inference path (edge_agent.inference): inputs, top-k, the sample store writing
into the data set the fine-tune reads, the model slot's swaps and the local guard, and
`edge-agent predict` -- on the real digits bundle, real engines, real files."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edge_agent.data import load_dataset, sample_hash, split_dataset
from edge_agent.inference.inputs import InputRejected, decode
from edge_agent.inference.predictor import Predictor, tail_params, top_k
from edge_agent.inference.samples import SampleStore, UnknownLabel, held_out
from edge_agent.inference.serving import HEAD_FILE, META_FILE, ModelManager, ModelSlot
from edge_agent.int8.bundle import load_bundle
from edge_agent.mxparams import dump_params, join_names

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from edge_agent.sim import scenario as demo

    return demo.ensure_bundle(tmp_path_factory.getbasetemp() / "digits-bundle")


@pytest.fixture(scope="module")
def device() -> tuple[np.ndarray, list[str]]:
    """One device's own digits through its camera, as raw 0..255 pixels."""
    from edge_agent.sim import scenario as demo

    dev = demo.scenario().devices[0]
    return demo.to_pixels(dev.images).astype(np.float32), [demo.LABELS[v] for v in dev.labels]


def _png(pixels: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


# ---------------------------------------------------------------- inputs


def test_every_input_form_decodes_to_the_same_raw_sample(bundle_dir: Path, device) -> None:
    spec = load_bundle(bundle_dir).manifest.input
    raw = device[0][0]  # (1, 8, 8)
    forms = {"png": (_png(raw[0]), "image/png"), "npy chw": (_npy(raw), ""), "npy hw": (_npy(raw[0]), ""),
             "npy flat": (_npy(raw.reshape(-1)), "application/x-npy"),
             "json": (json.dumps({"array": raw.tolist()}).encode(), "application/json")}
    for name, (data, ctype) in forms.items():
        out = decode(data, spec, content_type=ctype)
        assert out.shape == (1, 1, 8, 8), name
        np.testing.assert_array_equal(out[0], raw, err_msg=name)
    buf = io.BytesIO()
    np.savez(buf, x=device[0][:5])
    assert decode(buf.getvalue(), spec).shape == (5, 1, 8, 8)  # a batch in an .npz
    fortran = np.asfortranarray(device[0][:3].astype(np.float64))
    np.testing.assert_array_equal(decode(_npy(fortran), spec), device[0][:3])  # any layout and dtype numpy writes


@pytest.mark.parametrize("case, status, words", [
    ("text", 415, "not an image"),
    ("huge", 413, "pixels"),
    ("small", 422, "smaller than the model's input"),
    ("shape", 422, "the model takes (1, 8, 8)"),
    ("nan", 422, "NaN"),
    ("batch", 413, "larger than 4 samples"),
    ("object", 422, "object arrays"),
    ("empty", 400, "empty"),
    ("ctype", 415, "content type"),
    ("json", 400, "not JSON"),
    ("truncated", 422, "unusable image"),
    ("short-npy", 400, "shorter than its shape"),
    ("npy-header", 400, "unreadable header"),
])
def test_bad_inputs_are_refused_with_a_clear_status(bundle_dir: Path, case: str, status: int, words: str) -> None:
    spec = load_bundle(bundle_dir).manifest.input
    good = _png(np.random.default_rng(0).integers(0, 255, (64, 64)))
    data, ctype = {
        "text": (b"hello, I am not a picture", ""),
        "huge": (_png(np.zeros((1200, 1200))), "image/png"),  # 1.44 Mpx over a 1 Mpx limit
        "small": (_png(np.zeros((4, 4))), "image/png"),
        "shape": (_npy(np.zeros((3, 5))), ""),
        "nan": (_npy(np.full((8, 8), np.nan, np.float32)), ""),
        "batch": (_npy(np.zeros((5, 1, 8, 8))), ""),
        "object": (b"", ""),
        "empty": (b"", ""),
        "ctype": (good, "text/html"),
        "json": (b"{not json", "application/json"),
        "truncated": (good[:len(good) // 2], "image/png"),
        "short-npy": (_npy(np.zeros((8, 8)))[:-40], ""),
        "npy-header": (_npy(np.zeros((8, 8))).replace(b"'descr'", b"__import__"), ""),
    }[case]
    if case == "object":
        buf = io.BytesIO()
        np.lib.format.write_array(buf, np.array([{"a": 1}], dtype=object), allow_pickle=True)
        data = buf.getvalue()
    with pytest.raises(InputRejected) as err:
        decode(data, spec, content_type=ctype, max_pixels=1_000_000, max_samples=4)
    assert err.value.status == status and words in str(err.value), str(err.value)


# ---------------------------------------------------------------- predictor


def test_the_served_predictor_is_the_evaluation_path_and_needs_no_mxnet(bundle_dir: Path, device,
                                                                          tmp_path: Path) -> None:
    code = f"""
import sys, json, numpy as np
from edge_agent.int8.bundle import load_bundle
from edge_agent.inference.predictor import open_predictor
p = open_predictor(load_bundle({str(bundle_dir)!r}), state_dir={str(tmp_path)!r})
x = np.load({str(tmp_path / 'x.npy')!r})
print(json.dumps({{"mxnet": "mxnet" in sys.modules, "tail": p.tail_kind, "engine": p.engine,
                  "argmax": p.logits(x).argmax(axis=1).tolist()}}))
"""
    np.save(tmp_path / "x.npy", device[0][:40])
    out = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                    cwd=REPO).stdout.strip().splitlines()[-1])
    assert out["mxnet"] is False and out["tail"] == "numpy-dense"
    ref = Predictor(load_bundle(bundle_dir), engine=out["engine"])  # the evaluation's predictor, same engine
    assert out["argmax"] == ref.logits(device[0][:40]).argmax(axis=1).tolist()


def test_top_k_orders_labels_by_probability() -> None:
    ranked = top_k(np.array([[0.0, 3.0, 1.0], [5.0, 5.0, -1.0]]), ["a", "b", "c"], 2)
    assert ranked[0].labels == ["b", "c"] and ranked[0].scores[0] > ranked[0].scores[1]
    assert ranked[1].labels == ["a", "b"]  # a tie: the lower index first
    assert abs(sum(top_k(np.array([[1.0, 2.0, 3.0]]), ["a", "b", "c"], 3)[0].scores) - 1.0) < 1e-5


# ---------------------------------------------------------------- the sample store


def test_samples_land_in_the_data_set_the_fine_tune_reads(bundle_dir: Path, device, tmp_path: Path) -> None:
    bundle = load_bundle(bundle_dir)
    spec, labels = bundle.manifest.input, bundle.manifest.labels
    store = SampleStore(root=tmp_path / "data", spec=spec, labels=labels)
    x, y = device
    results = [store.add(x[i], y[i]) for i in range(30)]
    assert {r.status for r in results} == {"stored"}
    assert store.add(x[0], y[0]).status == "duplicate"
    arr = np.linspace(0.5, 200.25, 64, dtype=np.float32).reshape(1, 8, 8)  # not integral pixels: kept as .npy
    assert store.add(arr, "4").path.endswith(".npy")
    data = load_dataset(tmp_path / "data", spec, labels)
    assert len(data) == 31 and data.report.skipped_total == 0
    by_hash = dict(zip(data.hashes, data.y, strict=True))
    for r in results:
        assert labels[by_hash[r.sample_hash]] == r.label  # same content hash as the loader's
    _, val = split_dataset(data)
    x_held, y_held = store.held_out_set()
    assert sorted(val.hashes) == sorted(sample_hash(spec.normalise(s[None])[0]) for s in x_held)
    assert all(held_out(h) for h in val.hashes) and len(y_held) == len(val)


def test_a_relabelled_sample_moves_and_unknown_labels_are_refused(bundle_dir: Path, device, tmp_path: Path) -> None:
    bundle = load_bundle(bundle_dir)
    store = SampleStore(root=tmp_path, spec=bundle.manifest.input, labels=bundle.manifest.labels)
    first = store.add(device[0][0], "3")
    moved = store.add(device[0][0], "5")
    assert moved.status == "relabelled" and not Path(first.path).exists() and Path(moved.path).parent.name == "5"
    with pytest.raises(UnknownLabel, match="'cat' is not one of the model's labels"):
        store.add(device[0][1], "cat")
    assert store.counts()["5"] == 1 and len(store) == 1


def test_quotas_evict_the_oldest_and_retention_prunes(bundle_dir: Path, device, tmp_path: Path) -> None:
    bundle = load_bundle(bundle_dir)
    now = [1000.0]
    store = SampleStore(root=tmp_path, spec=bundle.manifest.input, labels=bundle.manifest.labels, max_per_label=3,
                        max_age_days=1.0, clock=lambda: now[0])
    x = device[0]
    kept = []
    for i in range(5):
        now[0] += 1
        kept.append(store.add(x[i], "1"))
    assert store.counts()["1"] == 3 and [Path(k.path).exists() for k in kept] == [False, False, True, True, True]
    one = kept[-1]
    size = Path(one.path).stat().st_size
    small = SampleStore(root=tmp_path / "b", spec=bundle.manifest.input, labels=bundle.manifest.labels,
                        max_bytes=int(size * 2.5), clock=lambda: now[0])
    for i in range(4):
        now[0] += 1
        small.add(x[10 + i], str(i))
    assert len(small) == 2 and small.total_bytes <= size * 2.5
    now[0] += 2 * 86400
    assert store.prune() == 3 and len(store) == 0
    (tmp_path / "1" / ".abc.png.tmp").write_bytes(b"half a sample")  # what a kill -9 mid-write leaves
    SampleStore(root=tmp_path, spec=bundle.manifest.input, labels=bundle.manifest.labels)
    assert not (tmp_path / "1" / ".abc.png.tmp").exists()


# ---------------------------------------------------------------- slot and guard


def _install(root: Path, bundle_dir: Path, version: str) -> None:
    import shutil

    dest = root / "models" / "digits-cnn"
    dest.mkdir(parents=True, exist_ok=True)
    if not (dest / version).exists():
        shutil.copytree(bundle_dir, dest / version)
    tmp = dest / ".current.tmp"
    tmp.unlink(missing_ok=True)
    os.symlink(version, tmp)
    os.replace(tmp, dest / "current")


def _personal(root: Path, bundle_dir: Path, ident: str, transform) -> None:
    bundle = load_bundle(bundle_dir)
    params = {k: transform(k, v) for k, v in tail_params(bundle).items()}
    dest = root / "personal" / "digits-cnn" / "1" / ident
    dest.mkdir(parents=True)
    (dest / HEAD_FILE).write_bytes(dump_params(join_names(params, {})))
    (dest / META_FILE).write_text(json.dumps({"depth": 0, "created": len(ident)}))


def test_the_guard_serves_the_better_model_and_keeps_the_served_one_against_a_worse(
        bundle_dir: Path, device, tmp_path: Path) -> None:
    x, y = device
    held = (x[:60], np.asarray([int(v) for v in y[:60]]))
    _install(tmp_path, bundle_dir, "1")
    manager = ModelManager(models_root=tmp_path / "models", personal_root=tmp_path / "personal", name=None,
                           loader=lambda b, d, p, prefix: Predictor(b, depth=d, params=p, engine="reference", prefix=prefix),
                           held_out=lambda: held, tolerance=0.02)
    assert manager.refresh() and manager.slot.current.version == "digits-cnn/1"
    fleet_acc = manager.fleet.accuracy
    # a personal tail that is worse (its classifier scrambled) is never served
    _personal(tmp_path, bundle_dir, "p1", lambda k, v: v[::-1].copy() if v.ndim == 2 else v)
    manager.refresh()
    assert manager.personal_model.accuracy < fleet_acc and manager.slot.current.kind == "fleet"
    # one trained on the held-out labels' statistics is better: served, the fleet version kept as previous
    feats = manager.fleet.predictor.runner.run(manager.fleet.predictor.spec.normalise(held[0])).reshape(60, -1)
    onehot = np.eye(10, dtype=np.float32)[held[1]]
    w, *_ = np.linalg.lstsq(np.c_[feats, np.ones(60)], onehot, rcond=None)

    def fitted(name: str, v: np.ndarray) -> np.ndarray:
        return (w[:-1].T.astype(np.float32) if v.ndim == 2 else w[-1].astype(np.float32)).reshape(v.shape)

    _personal(tmp_path, bundle_dir, "p22", fitted)
    assert manager.refresh()
    assert manager.slot.current.version == "digits-cnn/1+p22" and manager.slot.previous.version == "digits-cnn/1"
    assert manager.slot.current.accuracy > fleet_acc
    # a new fleet version that is worse than the served model beyond the tolerance: refused, kept
    bad = tmp_path / "bad-bundle"
    import shutil

    shutil.copytree(bundle_dir, bad)
    _install(tmp_path, bundle_dir, "2")
    manager.personal = False
    manager.refresh()
    assert manager.fleet.version == "digits-cnn/2"
    assert manager.slot.current.version == "digits-cnn/1+p22"  # v2 (the base model) is worse on held-out
    assert any(e["event"] == "kept" and e["refused"] == "digits-cnn/2" for e in manager.events)


def test_a_personal_tail_trained_over_an_adapted_prefix_is_served_over_it(bundle_dir: Path, tmp_path: Path) -> None:
    """The service's loader gets the personal tail's adapted int8 prefix (prefix.tflite):
    under a strongly shifted camera it answers better than the fleet version."""
    from edge_agent.inference.serving import PREFIX_FILE
    from edge_agent.int8.adapt_norm import quantised_prefix
    from edge_agent.int8.bundle import BACKBONE_INT8
    from edge_agent.int8.onnx_import import import_onnx
    from edge_agent.sim import scenario as demo
    from edge_agent.sim.camera_shift import ShiftedCamera, shift_images

    dev = demo.scenario().devices[0]
    seen = demo.to_pixels(shift_images(dev.images, ShiftedCamera(blur_sigma=0.6))).astype(np.float32)
    half = len(seen) // 2
    bundle = load_bundle(bundle_dir)
    _install(tmp_path, bundle_dir, "1")
    _personal(tmp_path, bundle_dir, "p1", lambda k, v: v)  # the fleet's own tail, over the adapted prefix
    personal = tmp_path / "personal" / "digits-cnn" / "1" / "p1"
    graph = import_onnx(bundle.onnx_bytes(), split=bundle.manifest.split_tensor)
    (personal / PREFIX_FILE).write_bytes(quantised_prefix(graph, bundle.manifest.input.normalise(seen[:half])))
    (personal / META_FILE).write_text(json.dumps({"depth": 0, "created": 1, "adapted_prefix": True}))
    manager = ModelManager(models_root=tmp_path / "models", personal_root=tmp_path / "personal", name=None,
                           loader=lambda b, d, p, prefix: Predictor(b, depth=d, params=p, engine="reference",
                                                                    prefix=prefix),
                           held_out=lambda: (seen[half:], dev.labels[half:]), tolerance=0.02)
    assert manager.refresh()
    served = manager.slot.current
    assert served.version == "digits-cnn/1+p1" and served.accuracy > manager.fleet.accuracy + 0.05
    import hashlib

    want = hashlib.sha256((personal / PREFIX_FILE).read_bytes()).hexdigest()
    assert served.predictor.view.manifest.files[BACKBONE_INT8].sha256 == want
    assert manager.fleet.predictor.view.manifest.files[BACKBONE_INT8].sha256 != want


def test_a_swap_never_closes_a_model_a_request_still_uses(bundle_dir: Path) -> None:
    from edge_agent.inference.serving import ServedModel

    bundle = load_bundle(bundle_dir)
    closed = []

    def model(v: str) -> ServedModel:
        p = Predictor(bundle, engine="reference")
        p.close = lambda v=v: closed.append(v)  # type: ignore[method-assign]
        return ServedModel(v, "fleet", "digits", v, p)

    slot = ModelSlot()
    a, b, c = model("a"), model("b"), model("c")
    slot.swap(a)
    with slot.use() as serving:
        assert serving is a
        slot.swap(b)
        dropped = slot.swap(c)  # a leaves the slot while the request still holds it
        assert dropped is a
        a.retire()
        assert closed == []  # still in use
    assert closed == ["a"] and slot.current is c and slot.previous is b


# ---------------------------------------------------------------- predict CLI


def test_predict_command_table_json_stdin_and_bad_input(bundle_dir: Path, device, tmp_path: Path) -> None:
    x, y = device
    folder = tmp_path / "in"
    folder.mkdir()
    for i in range(3):
        (folder / f"{i}.png").write_bytes(_png(x[i][0]))
    np.save(tmp_path / "batch.npy", x[:4])
    (folder / "bad.png").write_bytes(b"not a png")
    env = {**os.environ, "EDGE_AGENT_STATE_DIR": str(tmp_path / "state")}
    base = [sys.executable, "-m", "edge_agent.cli", "predict", "--model", str(bundle_dir), "--engine", "reference"]
    table = subprocess.run([*base, str(folder), str(tmp_path / "batch.npy"), "-k", "2"], capture_output=True,
                           text=True, env=env, cwd=REPO)
    assert table.returncode == 65 and "bad.png" in table.stderr and "not an image" in table.stderr
    rows = [line.split("\t") for line in table.stdout.splitlines() if not line.startswith("#")]
    assert len(rows) == 3 + 4 and rows[3][0].endswith("batch.npy[0]") and len(rows[0]) == 4
    expect = Predictor(load_bundle(bundle_dir), engine="reference").logits(x[:4]).argmax(axis=1)
    assert [r[1] for r in rows[3:]] == [str(v) for v in expect]
    js = subprocess.run([*base, "--json", "-"], input=_png(x[0][0]), capture_output=True, env=env, cwd=REPO)
    assert js.returncode == 0
    line = json.loads(js.stdout.decode().strip())
    assert line["input"] == "-" and line["model"] == "digits-cnn/1" and len(line["top"]) == 3
    assert line["label"] == rows[0][1]


def test_the_state_message_carries_the_inference_report_validated() -> None:
    from edge_agent.protocol import Kind
    from edge_agent.protocol.schema import check_body

    body = {"status": "idle", "info": {"served_model": "digits-cnn/1+p1a2", "served_kind": "personal",
                                       "fleet_accuracy": 0.61, "personal_accuracy": 0.83, "held_out": 41,
                                       "inference_wh": 0.0012, "inference_requests": 900}}
    check_body(Kind.STATE, body)
    for key, bad in (("fleet_accuracy", 1.5), ("served_kind", "mine"), ("held_out", -1), ("inference_wh", "a lot")):
        with pytest.raises(ValueError, match=key):
            check_body(Kind.STATE, {"status": "idle", "info": {**body["info"], key: bad}})


def test_a_local_fine_tune_runs_at_idle_priority_unless_the_config_says_otherwise(tmp_path: Path) -> None:
    """[serve] training_priority: "idle" by default (below inference and everything else on the
    board), or what agent.toml names; anything else is refused naming the choices."""
    from edge_agent import keys
    from edge_agent.config import load_config, public_key_text
    from edge_agent.inference.personal import LocalFineTune
    from edge_agent.inference.server import ServeOptions

    key = public_key_text(keys.generate_private_key().public_key())

    def options(serve: str) -> ServeOptions:
        path = tmp_path / "agent.toml"
        path.write_text(f'[device]\nname = "dev"\nstate_dir = "{tmp_path / "state"}"\nprofile = "raspberry-pi-4"\n'
                        f'[broker]\nhost = "127.0.0.1"\n[coordinator]\npublic_key = "{key}"\n'
                        f'[serve]\nenabled = true\n{serve}')
        return ServeOptions.from_config(load_config(path))

    assert options("").training_priority == "idle"
    assert options('training_priority = "nice"\n').training_priority == "nice"
    with pytest.raises(ValueError, match="one of idle, nice, normal"):
        LocalFineTune(state_dir=tmp_path / "state", personal_root=tmp_path / "p", data_dir=tmp_path / "d",
                      priority="sometimes")
