"""Head patches: a new version as its manifest + changed files, rebuilt on the device from
a verified local version; anything that does not add up is refused and leaves nothing."""

from __future__ import annotations

import io
import shutil
import tarfile
from pathlib import Path

import pytest

from edge_agent.int8 import bundle as B
from edge_agent.int8 import bundle_create as BC
from edge_agent.int8.bundle_patch import apply_patch, pack_patch, patch_version
from edge_agent.sim import models
from tests.conftest import new_head_version

LABELS = [str(i) for i in range(10)]


@pytest.fixture(scope="module")
def versions(tmp_path_factory: pytest.TempPathFactory) -> tuple[B.Bundle, B.Bundle, B.Bundle]:
    x_train, y_train, _, _ = models.load_digits_split()
    net = models.digits_cnn()
    models.fit_classifier(net, x_train, y_train, epochs=1)
    root = tmp_path_factory.mktemp("patch")
    kwargs = dict(labels=LABELS, name="digits", input_shape=(1, 8, 8), scale=1 / 16)
    v1 = BC.create_bundle(net, root / "v1", calibration=x_train[:64], version="1", **kwargs)
    v2 = new_head_version(root / "v1", root / "v2", version="2", shift=0.01)
    other = BC.create_bundle(net, root / "other", calibration=x_train[64:96], version="9", **kwargs)  # other int8
    return v1, v2, other


def test_a_head_patch_carries_only_the_head_and_rebuilds_the_same_version(versions, tmp_path: Path) -> None:
    v1, v2, _ = versions
    archive, carried = pack_patch(v2.path, v1.path, tmp_path / "v2.head.tar.gz")
    assert carried == [B.HEAD_PARAMS]
    with tarfile.open(archive) as tar:
        assert tar.getnames() == [B.MANIFEST, B.HEAD_PARAMS]
    full = B.pack_bundle(v2.path, tmp_path / "v2.tar.gz")
    assert archive.stat().st_size * 5 < full.stat().st_size  # the backbone stays on the device
    assert pack_patch(v2.path, v1.path, tmp_path / "again.tar.gz")[0].read_bytes() == archive.read_bytes()
    rebuilt = apply_patch(archive, v1.path, tmp_path / "installed" / "2")
    assert rebuilt.sha256 == v2.sha256 and rebuilt.manifest.version == "2"
    for fname in v2.manifest.files:
        assert rebuilt.read(fname) == v2.read(fname)
    assert patch_version("r3") == "r3.head"


def test_a_patch_onto_another_backbone_or_a_damaged_base_is_refused_and_leaves_nothing(
        versions, tmp_path: Path) -> None:
    v1, v2, other = versions
    archive, _ = pack_patch(v2.path, v1.path, tmp_path / "p.tar.gz")
    dest = tmp_path / "models" / "2"
    with pytest.raises(B.BundleError, match="another backbone_int8.tflite|another"):
        apply_patch(archive, other.path, dest)  # same file names, other int8 bytes
    damaged = Path(shutil.copytree(v1.path, tmp_path / "damaged"))
    (damaged / "backbone.onnx").unlink()
    with pytest.raises(B.BundleError, match="needs backbone.onnx"):
        apply_patch(archive, damaged, dest)
    assert not dest.exists() and [p.name for p in dest.parent.iterdir()] == []  # no temp dirs left


def test_a_patch_whose_head_does_not_match_its_manifest_is_refused(versions, tmp_path: Path) -> None:
    v1, v2, _ = versions
    archive, _ = pack_patch(v2.path, v1.path, tmp_path / "p.tar.gz")
    forged = io.BytesIO()
    with tarfile.open(archive) as src, tarfile.open(fileobj=forged, mode="w:gz") as out:
        for member in src:
            data = src.extractfile(member).read()  # type: ignore[union-attr]
            if member.name == B.HEAD_PARAMS:
                data = v1.read(B.HEAD_PARAMS)  # the old head under the new manifest
            info = tarfile.TarInfo(member.name)
            info.size = len(data)
            out.addfile(info, io.BytesIO(data))
    bad = tmp_path / "forged.tar.gz"
    bad.write_bytes(forged.getvalue())
    with pytest.raises(B.BundleError, match="sha256"):
        apply_patch(bad, v1.path, tmp_path / "x")
    no_manifest = io.BytesIO()
    with tarfile.open(fileobj=no_manifest, mode="w:gz") as out:
        info = tarfile.TarInfo(B.HEAD_PARAMS)
        info.size = 4
        out.addfile(info, io.BytesIO(b"\0\0\0\0"))
    (tmp_path / "nomanifest.tar.gz").write_bytes(no_manifest.getvalue())
    with pytest.raises(B.BundleError, match="missing from the patch"):
        apply_patch(tmp_path / "nomanifest.tar.gz", v1.path, tmp_path / "y")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
