"""Model bundles: creation from Gluon and ONNX, verification, archives, bad input."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest

from edge_agent.errors import InputError
from edge_agent.int8 import bundle as B
from edge_agent.int8 import bundle_create as BC
from edge_agent.int8.calibration_input import load_calibration
from edge_agent.sim import models

LABELS = [str(i) for i in range(10)]


@pytest.fixture(scope="module")
def digits():
    """A digits CNN trained briefly (bundle mechanics need real weights, not accuracy)."""
    x_train, y_train, x_test, y_test = models.load_digits_split()
    net = models.digits_cnn()
    models.fit_classifier(net, x_train, y_train, epochs=2)
    return net, x_train, x_test


@pytest.fixture(scope="module")
def bundle_dir(digits, tmp_path_factory) -> Path:
    net, x_train, _ = digits
    dest = tmp_path_factory.mktemp("bundles") / "digits-1"
    BC.create_bundle(net, dest, calibration=x_train[:128], labels=LABELS, name="digits", version="1",
                    input_shape=(1, 8, 8), scale=1 / 16)
    return dest


@pytest.fixture()
def copy(bundle_dir, tmp_path) -> Path:
    """A private copy of the bundle that a test may damage."""
    return Path(shutil.copytree(bundle_dir, tmp_path / "copy"))


def _manifest(path: Path) -> dict:
    return json.loads((path / B.MANIFEST).read_text())


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


# ------------------------------------------------------------------ creation


def test_gluon_bundle_has_manifest_hashes_and_a_head_matching_the_net(digits, bundle_dir):
    import mxnet as mx

    net, _, x_test = digits
    bundle = B.load_bundle(bundle_dir)
    m = bundle.manifest
    assert (m.name, m.version, m.parent_version, m.format_version) == ("digits", "1", None, B.FORMAT_VERSION)
    assert m.input.shape == (1, 8, 8) and m.input.layout == "NCHW" and m.input.scale == pytest.approx(1 / 16)
    assert m.split_tensor == "features_gap_fwd" and m.feature_shape == (32, 1, 1)
    assert sorted(m.files) == sorted([*B.REQUIRED_FILES, B.ORACLE])  # the oracle's answers: oracle_answers.py
    for fname, entry in m.files.items():
        data = (bundle_dir / fname).read_bytes()
        assert entry.sha256 == hashlib.sha256(data).hexdigest() and entry.size == len(data)
    assert bundle.sha256 == hashlib.sha256((bundle_dir / B.MANIFEST).read_bytes()).hexdigest()
    # the head from the bundle turns the fp32 backbone's features into the net's logits
    x = mx.nd.array(x_test[:16])
    logits = bundle.head_block()(net.features(x)).asnumpy()
    np.testing.assert_allclose(logits, net(x).asnumpy(), rtol=1e-5, atol=1e-5)
    assert bundle.calibration().shape == (128, 1, 8, 8)


def test_onnx_file_source_with_explicit_split(digits, tmp_path):
    from edge_agent.int8.onnx_export import export_onnx

    net, x_train, _ = digits
    onnx_path = tmp_path / "digits.onnx"
    onnx_path.write_bytes(export_onnx(net, (1, 1, 8, 8)))
    bundle = BC.create_bundle(onnx_path, tmp_path / "b", calibration=x_train[:32], labels=LABELS,
                             name="digits", version="2", parent_version="1", split="features_gap_fwd")
    assert bundle.manifest.source == "onnx:digits.onnx" and bundle.manifest.parent_version == "1"
    assert bundle.qgraph().tensor(bundle.qgraph().outputs[0]).shape[-1] == 32


def test_calibration_folder_of_npy_and_images(digits, tmp_path):
    from PIL import Image

    _, x_train, _ = digits
    spec = B.InputSpec(shape=(1, 8, 8), scale=1 / 255)
    folder = tmp_path / "calib"
    folder.mkdir()
    np.save(folder / "batch.npy", x_train[:5])
    np.save(folder / "one.npy", x_train[5])
    Image.fromarray((x_train[6, 0] * 255).astype(np.uint8)).resize((16, 16)).save(folder / "img.png")
    (folder / "README.txt").write_text("ignored")
    calib = load_calibration(folder, spec)  # files in name order: batch, img, one
    assert calib.shape == (7, 1, 8, 8)
    np.testing.assert_array_equal(calib[:5], x_train[:5])
    np.testing.assert_array_equal(calib[6], x_train[5])
    # the image was resized back to 8x8 and normalised with scale 1/255: close to the source
    assert np.abs(calib[5] - x_train[6]).mean() < 0.1


def test_calibration_images_are_decoded_like_the_fine_tunes_data(tmp_path):
    """A 16-bit calibration PNG was clipped at 255 (the input scale calibrated on white);
    `model create` now reads images as edge-agent finetune does (edge_agent.data)."""
    from PIL import Image

    spec = B.InputSpec(shape=(1, 4, 4), scale=1 / 255)
    grey16 = (np.arange(16).reshape(4, 4) * 4369).astype(np.uint16)  # 0 .. 65535
    (tmp_path / "deep").mkdir()
    Image.fromarray(grey16).save(tmp_path / "deep" / "gradient.png")
    calib = load_calibration(tmp_path / "deep", spec)
    np.testing.assert_allclose(calib[0, 0] * 255.0, grey16 / 257.0, atol=1e-3)
    (tmp_path / "clear").mkdir()
    Image.new("LA", (4, 4), (200, 0)).save(tmp_path / "clear" / "transparent.png")
    with pytest.raises(InputError, match="transparent.png: transparent-image: 16 of 16 pixels"):
        load_calibration(tmp_path / "clear", spec)


@pytest.mark.parametrize(("array", "message"), [
    (np.zeros((4, 8, 8), np.float32), "expected (N, 1, 8, 8)"),
    (np.zeros((4, 3, 8, 8), np.float32), "expected (N, 1, 8, 8)"),
    (np.zeros((0, 1, 8, 8), np.float32), "N >= 1"),
])
def test_calibration_of_the_wrong_shape_is_refused_with_where(tmp_path, array, message):
    path = tmp_path / "calib.npz"
    np.savez(path, x=array)
    with pytest.raises(InputError, match="calib.npz") as info:
        load_calibration(path, B.InputSpec(shape=(1, 8, 8)))
    assert message in str(info.value)


def test_calibration_with_nan_names_the_first_bad_index(digits, tmp_path, bundle_dir):
    net, x_train, _ = digits
    bad = x_train[:16].copy()
    bad[3, 0, 2, 5] = np.nan
    np.savez(tmp_path / "calib.npz", images=bad)
    with pytest.raises(InputError, match=r"calib.npz\['images'\].*non-finite.*\(3, 0, 2, 5\)"):
        BC.create_bundle(net, tmp_path / "out", calibration=tmp_path / "calib.npz", labels=LABELS,
                        name="digits", version="1", input_shape=(1, 8, 8))
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []


def test_npz_with_ambiguous_arrays_and_garbage_files(tmp_path):
    spec = B.InputSpec(shape=(1, 8, 8))
    np.savez(tmp_path / "two.npz", a=np.zeros((2, 1, 8, 8)), b=np.zeros((2, 1, 8, 8)))
    with pytest.raises(InputError, match="several arrays"):
        load_calibration(tmp_path / "two.npz", spec)
    (tmp_path / "junk.npz").write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(InputError, match="junk.npz: not a readable NPZ"):
        load_calibration(tmp_path / "junk.npz", spec)
    with pytest.raises(InputError, match="not found"):
        load_calibration(tmp_path / "missing", spec)


def test_npz_members_are_size_checked_before_inflating(tmp_path):
    buf = io.BytesIO()
    np.savez_compressed(buf, x=np.zeros((100, 1, 8, 8), np.float32))  # 25 KB inflated, tiny on disk
    with pytest.raises(InputError, match=r"calib.npz: 25\d{3} bytes uncompressed, over the limit of 4096"):
        B._load_npz_array(buf.getvalue(), B.InputSpec(shape=(1, 8, 8)), where="calib.npz", max_bytes=4096)


def test_unknown_split_node_lists_the_nodes(digits, tmp_path):
    net, x_train, _ = digits
    with pytest.raises(InputError, match="unknown split node 'nope'.*features_gap_fwd \\[pool"):
        BC.create_bundle(net, tmp_path / "b", calibration=x_train[:8], labels=LABELS, name="d",
                        version="1", input_shape=(1, 8, 8), split="nope")
    with pytest.raises(InputError, match="is the model's output"):
        BC.create_bundle(net, tmp_path / "b", calibration=x_train[:8], labels=LABELS, name="d",
                        version="1", input_shape=(1, 8, 8), split="output_fc_fwd")
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("cut", ["truncated", "garbage", "empty"])
def test_corrupt_onnx_is_refused_clearly(digits, tmp_path, cut):
    from edge_agent.int8.onnx_export import export_onnx

    net, x_train, _ = digits
    data = export_onnx(net, (1, 1, 8, 8))
    data = {"truncated": data[: len(data) // 2], "garbage": bytes(range(256)) * 8, "empty": b""}[cut]
    path = tmp_path / "model.onnx"
    path.write_bytes(data)
    with pytest.raises(InputError, match=r"model\.onnx: (empty file|not a valid ONNX|invalid ONNX)"):
        BC.create_bundle(path, tmp_path / "b", calibration=x_train[:8], labels=LABELS, name="d",
                        version="1", split="features_gap_fwd")
    assert not (tmp_path / "b").exists()


def test_bad_identity_fails_before_any_work(digits, tmp_path):
    net, x_train, _ = digits
    with pytest.raises(B.ManifestError, match="'name'.*is not 1-64"):
        BC.create_bundle(net, tmp_path / "b", calibration=x_train[:8], labels=LABELS, name="../evil",
                        version="1", input_shape=(1, 8, 8))
    with pytest.raises(B.ManifestError, match="labels"):
        BC.create_bundle(net, tmp_path / "b", calibration=x_train[:8], labels=[], name="d",
                        version="1", input_shape=(1, 8, 8))


def test_existing_bundle_is_kept_unless_overwrite(digits, bundle_dir, tmp_path):
    net, x_train, _ = digits
    dest = Path(shutil.copytree(bundle_dir, tmp_path / "dest"))
    before = B.load_bundle(dest).sha256
    kwargs = dict(calibration=x_train[:16], labels=LABELS, name="digits", version="2", input_shape=(1, 8, 8))
    with pytest.raises(B.BundleError, match="already exists"):
        BC.create_bundle(net, dest, **kwargs)
    assert B.load_bundle(dest).sha256 == before
    replaced = BC.create_bundle(net, dest, overwrite=True, **kwargs)
    assert replaced.manifest.version == "2" and replaced.sha256 != before
    assert _leftovers(tmp_path) == []


def test_a_failure_after_files_are_written_leaves_nothing(bundle_dir, tmp_path):
    bundle = B.load_bundle(bundle_dir)
    files = {f: (bundle_dir / f).read_bytes() for f in B.REQUIRED_FILES}
    files[B.CALIBRATION] = b"not an npz"  # hashes are computed over it, then the check fails
    with pytest.raises(InputError, match="not a readable NPZ"):
        B.write_bundle_dir(tmp_path / "new", files, bundle.manifest)
    assert not (tmp_path / "new").exists() and _leftovers(tmp_path) == []


def test_staged_files_are_moved_in_and_a_wrong_one_leaves_nothing(bundle_dir, tmp_path):
    """model create stages its large files as they are made (bundle_files.Staging): the
    bundle holds them as staged, and one that does not verify leaves neither bundle nor stage."""
    from edge_agent.int8.bundle_files import Staging

    bundle = B.load_bundle(bundle_dir)
    files = {f: (bundle_dir / f).read_bytes() for f in B.REQUIRED_FILES}
    dest = tmp_path / "staged"
    with Staging(dest) as staging:
        chunks = [files[B.BACKBONE_ONNX][i:i + 1000] for i in range(0, len(files[B.BACKBONE_ONNX]), 1000)]
        staged = {**files, B.BACKBONE_ONNX: staging.put(B.BACKBONE_ONNX, iter(chunks)),
                  B.BACKBONE_INT8: staging.put(B.BACKBONE_INT8, files[B.BACKBONE_INT8])}
        made = B.write_bundle_dir(dest, staged, bundle.manifest)
        assert not (staging.dir / B.BACKBONE_ONNX).exists()  # moved, not copied
    assert {f: made.read(f) for f in B.REQUIRED_FILES} == files and _leftovers(tmp_path) == []
    with Staging(tmp_path / "bad") as staging:
        wrong = staging.put(B.CALIBRATION, b"not an npz")
        with pytest.raises(InputError, match="not a readable NPZ"):
            B.write_bundle_dir(tmp_path / "bad", {**files, B.CALIBRATION: wrong}, bundle.manifest)
    assert not (tmp_path / "bad").exists() and _leftovers(tmp_path) == []


# ------------------------------------------------------------------ verification


@pytest.mark.parametrize("fname", list(B.REQUIRED_FILES))
def test_a_flipped_byte_in_any_file_is_caught(copy, fname):
    path = copy / fname
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(B.HashMismatchError, match=f"{fname}: sha256 .* does not match"):
        B.load_bundle(copy)


def test_truncated_missing_and_zero_filled_files(copy):
    tfl = copy / B.BACKBONE_INT8
    size = tfl.stat().st_size
    tfl.write_bytes(tfl.read_bytes()[:100])
    with pytest.raises(B.HashMismatchError, match=rf"100 bytes, manifest.json says {size} \(truncated\?\)"):
        B.load_bundle(copy)
    tfl.write_bytes(bytes(size))  # what an SD card leaves after power loss
    with pytest.raises(B.HashMismatchError, match="sha256"):
        B.load_bundle(copy)
    tfl.unlink()
    with pytest.raises(B.BundleError, match="missing"):
        B.load_bundle(copy)


def test_a_file_swapped_after_loading_is_caught_on_read(copy):
    bundle = B.load_bundle(copy)
    (copy / B.HEAD_PARAMS).write_bytes(b"\0" * bundle.manifest.files[B.HEAD_PARAMS].size)
    with pytest.raises(B.HashMismatchError):
        bundle.read(B.HEAD_PARAMS)


def test_a_parsed_prefix_is_kept_but_every_caller_gets_its_own_and_the_bytes_are_still_checked(copy):
    """Bundle.qgraph keeps the process's parse of a prefix (a job asked for it 14 times): a
    caller that changes its graph changes nobody else's, and a prefix changed on disk after
    the parse is still refused on read."""
    bundle = B.load_bundle(copy)
    first = bundle.qgraph()
    name = next(n for n, t in first.tensors.items() if t.data is not None)
    want = first.tensors[name].data.copy()
    first.tensors[name].data[...] = 0  # what a caller may do to its copy
    first.ops.clear()
    again = B.load_bundle(copy).qgraph()
    assert again is not first and again.ops and np.array_equal(again.tensors[name].data, want)
    tfl = copy / B.BACKBONE_INT8
    data = bytearray(tfl.read_bytes())
    data[len(data) // 2] ^= 0x01
    tfl.write_bytes(bytes(data))
    with pytest.raises(B.HashMismatchError):
        bundle.qgraph()


@pytest.mark.parametrize("field", ["format_version", "name", "version", "parent_version", "input",
                                   "labels", "split", "files"])
def test_manifest_missing_a_field_names_it(copy, field):
    manifest = _manifest(copy)
    del manifest[field]
    (copy / B.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(B.ManifestError, match=f"manifest.json: missing field '{field}'"):
        B.load_bundle(copy)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda m: m.update(format_version=99), "format_version 99 is not supported"),
    (lambda m: m["input"].update(shape=[1, 8]), "input.shape: must be a list of 3"),
    (lambda m: m["input"].update(layout="NHWC"), "input.layout must be 'NCHW'"),
    (lambda m: m["input"]["normalisation"].update(std=[0.0]), "std: must be a list of 1 finite positive"),
    (lambda m: m["files"].update({"../evil": {"sha256": "0" * 64, "size": 1}}), "unexpected file name"),
    (lambda m: m["files"][B.BACKBONE_ONNX].update(sha256="XYZ"), "not 64 lowercase hex"),
    (lambda m: m["files"].pop(B.HEAD_PARAMS), "missing entries for head.params"),
    (lambda m: m.update(labels="0,1"), "field 'labels' must be list"),
    (lambda m: m.update(name=True), "field 'name' must be str"),
])
def test_manifest_with_bad_fields(copy, edit, message):
    manifest = _manifest(copy)
    edit(manifest)
    (copy / B.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(B.ManifestError) as info:
        B.load_bundle(copy)
    assert message in str(info.value)


def test_manifest_that_is_not_json_or_too_large(copy):
    (copy / B.MANIFEST).write_bytes(b"{not json")
    with pytest.raises(B.ManifestError, match="not valid JSON"):
        B.load_bundle(copy)
    (copy / B.MANIFEST).write_bytes(b" " * (B.MAX_MANIFEST_BYTES + 1))
    with pytest.raises(InputError, match="over the limit"):
        B.load_bundle(copy)


# ------------------------------------------------------------------ archives


def test_pack_unpack_round_trip_is_verified_and_reproducible(bundle_dir, tmp_path):
    first = B.pack_bundle(bundle_dir, tmp_path / "a.tar.gz")
    second = B.pack_bundle(bundle_dir, tmp_path / "b.tar.gz")
    assert first.read_bytes() == second.read_bytes()  # no timestamps or owners inside
    restored = B.unpack_bundle(first, tmp_path / "restored")
    assert restored.sha256 == B.load_bundle(bundle_dir).sha256
    with pytest.raises(B.BundleError, match="already exists"):
        B.unpack_bundle(first, tmp_path / "restored")


def _tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes]]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for info, data in members:
            info.size = len(data) if info.isreg() else 0
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return path


def _reg(name: str) -> tarfile.TarInfo:
    return tarfile.TarInfo(name)


def _link(name: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
    return info


@pytest.mark.parametrize("escape", ["../evil", "../../evil", "ABS/evil"])
def test_a_member_that_escapes_the_extraction_dir_is_refused_and_writes_nothing(tmp_path, escape):
    # The bundle unpacks into base/out (through a temp dir beside it); each hostile name is
    # checked at the exact path a naive extractor writes it to -- shown first with tarfile.
    base = tmp_path / "a" / "b"
    base.mkdir(parents=True)
    name = escape.replace("ABS", str(tmp_path / "abs"))
    target = {"../evil": base / "evil", "../../evil": tmp_path / "a" / "evil",
              "ABS/evil": tmp_path / "abs" / "evil"}[escape]
    archive = _tar(tmp_path / "evil.tar.gz", [(_reg(B.MANIFEST), b"{}"), (_reg(name), b"pwned")])
    naive = base / "naive"
    naive.mkdir()
    with tarfile.open(archive) as tar:  # the control: what trusting the archive would do
        tar.extractall(naive, **({"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}))
    assert target.read_bytes() == b"pwned"
    target.unlink()
    with pytest.raises(B.BundleError) as err:
        B.unpack_bundle(archive, base / "out")
    assert f"member {repr(name)[:80]}: unexpected name" in str(err.value)  # one clear line
    assert "Traceback" not in str(err.value) and "\n" not in str(err.value)
    assert not target.exists() and not (base / "out").exists() and _leftovers(base) == []


@pytest.mark.parametrize(("members", "message"), [
    ([(_reg("sub/manifest.json"), b"x")], "unexpected name"),
    ([(_link("manifest.json"), b"")], "not a regular file"),
    ([(_reg("manifest.json"), b"{}"), (_reg("manifest.json"), b"{}")], "appears twice"),
    ([(_reg("calibration.npz"), b"x" * 4096)], "too large"),
])
def test_hostile_archives_are_refused_and_leave_nothing(tmp_path, members, message):
    archive = _tar(tmp_path / "evil.tar.gz", members)
    with pytest.raises(B.BundleError, match=message):
        B.unpack_bundle(archive, tmp_path / "out", max_bytes=1024)
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []


def test_truncated_and_non_archives(bundle_dir, tmp_path):
    good = B.pack_bundle(bundle_dir, tmp_path / "good.tar.gz").read_bytes()
    (tmp_path / "cut.tar.gz").write_bytes(good[: len(good) // 2])
    with pytest.raises(B.BundleError, match="not a readable bundle archive|truncated"):
        B.unpack_bundle(tmp_path / "cut.tar.gz", tmp_path / "out")
    (tmp_path / "junk.tar.gz").write_bytes(b"definitely not gzip")
    with pytest.raises(B.BundleError, match="not a readable bundle archive"):
        B.unpack_bundle(tmp_path / "junk.tar.gz", tmp_path / "out")
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []


def test_archive_with_a_tampered_member_is_refused(bundle_dir, tmp_path):
    members = []
    for fname in [B.MANIFEST, *B.REQUIRED_FILES]:
        data = (bundle_dir / fname).read_bytes()
        if fname == B.BACKBONE_INT8:
            data = data[:-1] + bytes([data[-1] ^ 0xFF])
        members.append((_reg(fname), data))
    archive = _tar(tmp_path / "tampered.tar.gz", members)
    with pytest.raises(B.HashMismatchError, match="backbone_int8.tflite"):
        B.unpack_bundle(archive, tmp_path / "out")
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []
