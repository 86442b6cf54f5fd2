"""Re-quantising a multi-depth bundle's int8 prefixes after a round at depth
(int8/requantize.py, coordinator/artefacts.py ModelArtefacts._build_dir).

The bundle: the digits CNN with create_bundle(depths=2) -- depth 0's int8 prefix runs
conv1..conv3 (the head is the dense layer), depth 1's conv1 + conv2 (its tail holds conv3),
depth 2's conv1 (its tail holds conv2 and conv3). A round that trained at depth 2 changes
conv2 or conv3, which depth 0's (and for conv2 depth 1's) prefix had frozen.

Oracles: create_bundle on the same net with the changed weight (what a rebuilt prefix must
be, byte for byte: same graph, same stored calibration, same method), and the fp32 net
with the new weight (run_float of the built version's Bundle.onnx_bytes()), which the
rebuilt int8 prefix must track and the old one does not.
"""

from __future__ import annotations

import dataclasses
import tarfile
from pathlib import Path

import numpy as np
import pytest

from edge_agent.int8.bundle import (
    BACKBONE_INT8,
    BACKBONE_ONNX,
    ORACLE,
    BundleError,
    depth_file,
    load_bundle,
    unpack_bundle,
)
from edge_agent.int8.bundle_create import create_bundle
from edge_agent.int8.engines.reference import QGraphRunner
from edge_agent.int8.float_graph import run_float
from edge_agent.int8.onnx_import import import_onnx
from edge_agent.int8.requantize import refresh_prefixes
from edge_agent.sim import models
from edge_agent.train.trainer import head_from_bundle

LABELS = [str(i) for i in range(10)]
PREFIXES = [depth_file(k, BACKBONE_INT8) for k in range(3)]  # depth 0, 1, 2
CONV2, CONV3 = "features_conv2_weight", "features_conv3_weight"


@pytest.fixture(scope="module")
def calib() -> np.ndarray:
    return np.random.default_rng(0).uniform(0, 1, (64, 1, 8, 8)).astype(np.float32)


@pytest.fixture(scope="module")
def make(calib, tmp_path_factory: pytest.TempPathFactory):
    """make(name, changes={param: new value}, depths=2) -> the bundle of the digits CNN with
    those values (the same net otherwise), built once per name."""
    net = models.initialize(models.digits_cnn(), seed=0, randomize_bn=True)
    params = net.collect_params()
    original = {n: p.data().asnumpy().copy() for n, p in params.items()}
    root = tmp_path_factory.mktemp("requantize")
    built: dict[str, object] = {}

    def build(name: str, changes: dict[str, np.ndarray] | None = None, depths: int = 2, bias_correction: bool = False):
        if name not in built:
            import mxnet as mx

            for n, v in (changes or {}).items():
                params[n].set_data(mx.nd.array(v))
            try:
                built[name] = create_bundle(net, root / name, calibration=calib, labels=LABELS, name="digits",
                                            version="1", input_shape=(1, 8, 8), depths=depths,
                                            bias_correction=bias_correction)
            finally:
                for n in changes or {}:
                    params[n].set_data(mx.nd.array(original[n]))
        return built[name]

    build.original = original  # type: ignore[attr-defined]
    return build


def _changed(original: dict[str, np.ndarray], name: str) -> np.ndarray:
    """A weight a round could produce, far enough from the old one to matter: some signs flipped."""
    w = original[name]
    flip = np.random.default_rng(1).choice(np.float32([-1.0, 1.0, 1.0]), size=w.shape)
    return (w * flip * np.float32(1.3)).astype(np.float32)


def _files(bundle) -> dict[str, bytes]:
    return {f: bundle.read(f) for f in bundle.manifest.files}


def test_a_change_in_the_head_only_rebuilds_nothing(make):
    root = make("root")
    params = head_from_bundle(root)[1]
    files = _files(root)
    assert refresh_prefixes(files, root.manifest, params) == []  # the root's own values
    head = {**params, "output_fc_weight": params["output_fc_weight"] * 2, "output_fc_bias": params["output_fc_bias"] + 1}
    assert refresh_prefixes(files, root.manifest, head) == []
    assert files == _files(root)  # not a byte rewritten
    # a head-only bundle has no prefixes to refresh, whatever changed
    flat = make("flat", depths=0)
    flat_files = _files(flat)
    changed = {**head_from_bundle(flat)[1], CONV3: _changed(make.original, CONV3)}
    assert refresh_prefixes(flat_files, flat.manifest, changed) == [] and flat_files == _files(flat)


@pytest.mark.parametrize("tensor, rebuilt", [
    (CONV3, [PREFIXES[0]]),  # frozen in depth 0's prefix only: depth 1's and 2's tails hold it
    (CONV2, PREFIXES[:2]),  # frozen in depths 0 and 1; depth 2's tail holds it
    ("features_bn2_running_var", PREFIXES[:2]),  # BatchNorm statistics are folded into the prefix too
    ("features_bn1_gamma", PREFIXES),  # conv1's BN: in every prefix (a tensor no tail holds)
])
def test_exactly_the_prefixes_that_freeze_a_changed_weight_are_rebuilt_as_create_bundle_would(
        make, tensor, rebuilt):
    root = make("root")
    if tensor.endswith("running_var"):
        value = (make.original[tensor] * np.float32(3.0) + np.float32(0.5)).astype(np.float32)
    elif tensor.endswith("gamma"):
        value = (make.original[tensor] * np.float32(-2.0)).astype(np.float32)
    else:
        value = _changed(make.original, tensor)
    want = make(f"with-{tensor}", {tensor: value})
    params = {**head_from_bundle(root)[1], tensor: value}
    files = _files(root)
    assert refresh_prefixes(files, root.manifest, params) == rebuilt
    for k, fname in enumerate(PREFIXES):
        assert files[fname] == want.read(fname), fname  # byte for byte what create_bundle makes
        assert (files[fname] != root.read(fname)) == (fname in rebuilt), fname
        # the oracle's answers go with their prefix: a rebuilt one's are dropped, the others' kept
        assert (depth_file(k, ORACLE) in files) == (fname not in rebuilt), k
    assert files[BACKBONE_ONNX] == root.read(BACKBONE_ONNX)  # the root's fp32 backbone is kept


def test_a_prefix_is_re_quantised_with_bias_correction_only_if_its_root_was(make):
    corrected = make("corrected-root", bias_correction=True)
    assert corrected.manifest.extra["bias_correction"] is True
    value = _changed(make.original, CONV3)
    want = make(f"corrected-with-{CONV3}", {CONV3: value}, bias_correction=True)
    files = _files(corrected)
    assert refresh_prefixes(files, corrected.manifest, {**head_from_bundle(corrected)[1], CONV3: value}) == [PREFIXES[0]]
    assert files[PREFIXES[0]] == want.read(PREFIXES[0])  # byte for byte, corrections and all
    root = make("root")
    assert root.manifest.extra["bias_correction"] is False
    assert root.read(PREFIXES[0]) != corrected.read(PREFIXES[0])  # the corrections move some biases
    want = make(f"with-{CONV3}", {CONV3: value})
    files = _files(root)
    assert refresh_prefixes(files, root.manifest, {**head_from_bundle(root)[1], CONV3: value}) == [PREFIXES[0]]
    assert files[PREFIXES[0]] == want.read(PREFIXES[0])
    # a root made before bias correction existed records nothing: its prefixes stay uncorrected
    legacy = dataclasses.replace(root.manifest, extra={k: v for k, v in root.manifest.extra.items()
                                                       if k != "bias_correction"})
    files = _files(root)
    refresh_prefixes(files, legacy, {**head_from_bundle(root)[1], CONV3: value})
    assert files[PREFIXES[0]] == want.read(PREFIXES[0])


def test_a_parameter_of_the_wrong_shape_is_refused(make):
    root = make("root")
    params = {**head_from_bundle(root)[1], CONV2: np.zeros((32, 16, 1, 1), np.float32)}
    with pytest.raises(BundleError, match=CONV2):
        refresh_prefixes(_files(root), root.manifest, params)


def test_a_round_at_depth_builds_a_version_whose_prefixes_track_its_fp32_net(make, calib, tmp_path):
    from edge_agent.coordinator.artefacts import ModelArtefacts
    from edge_agent.coordinator.registry import Registry
    from edge_agent.int8.bundle_patch import apply_patch

    root = make("root")
    value = _changed(make.original, CONV2)
    want = make(f"with-{CONV2}", {CONV2: value})
    reg = Registry(state_dir=tmp_path / "coordinator")
    arts = ModelArtefacts(reg)
    v1 = arts.register_bundle(root.path, name="digits", version="1")
    head = {**reg.load_head(v1), CONV2: value}  # what an aggregated round at depth 2 produced
    v2 = reg.add_model_version(name="digits", version="2", head=head, parent="1", bundle_path=v1.bundle_path,
                               head_only=True)
    built = unpack_bundle(arts.archive_for(v2).path, tmp_path / "v2")
    assert built.manifest.version == "2" and built.manifest.parent_version == "1"
    assert built.manifest.extra["requantised"] == PREFIXES[:2] and built.manifest.extra["head_only"] is False
    for fname in PREFIXES:
        assert built.read(fname) == want.read(fname), fname
    assert built.read(BACKBONE_ONNX) == root.read(BACKBONE_ONNX)
    np.testing.assert_array_equal(head_from_bundle(built)[1][CONV2], value)

    for depth in (0, 1, 2):
        new, old, ref = built.at_depth(depth), root.at_depth(depth), want.at_depth(depth)
        split = new.manifest.split_tensor
        fp32 = run_float(import_onnx(new.onnx_bytes(), split=split), calib)  # the fp32 net with the new weight
        np.testing.assert_allclose(fp32, run_float(import_onnx(ref.onnx_bytes(), split=split), calib),
                                   rtol=1e-5, atol=1e-5)
        out = new.qgraph().tensor(new.qgraph().outputs[0])
        step = float(out.scale.reshape(-1)[0])
        err_new = np.abs(QGraphRunner(new.qgraph()).run(calib) - fp32).max()
        err_old = np.abs(QGraphRunner(old.qgraph()).run(calib) - fp32).max()
        print(f"\ndepth {depth}: int8 vs fp32 with the new weight: rebuilt {err_new / step:.1f} steps, "
              f"old {err_old / step:.1f} steps")
        assert err_new <= 4 * step
        if depth < 2:  # a prefix that froze the old weight is far off the new net
            assert err_old > 10 * err_new
        else:  # depth 2's prefix does not hold conv2: it was right before and is the same file
            assert built.read(PREFIXES[2]) == root.read(PREFIXES[2])

    # the answers of the prefix that was kept still hold; the rebuilt ones' are not shipped
    from edge_agent.int8.oracle_answers import load

    assert [built.at_depth(d).has(ORACLE) for d in (0, 1, 2)] == [False, False, True]
    kept, fresh = load(built.at_depth(2), 64), load(root.at_depth(2), 64)
    np.testing.assert_array_equal(kept.ref_int8, fresh.ref_int8)
    np.testing.assert_allclose(kept.fp32, run_float(import_onnx(built.at_depth(2).onnx_bytes(),
                                                                split=built.at_depth(2).manifest.split_tensor),
                                                    built.calibration()[:64]), rtol=1e-5, atol=1e-5)

    # the patch a device already running version 1 fetches carries the rebuilt prefixes
    patch = arts.patch_for(v2)
    assert patch is not None
    with tarfile.open(patch.path) as tar:
        carried = {Path(m.name).name for m in tar.getmembers() if m.isfile()}
    assert set(PREFIXES[:2]) <= carried and PREFIXES[2] not in carried and BACKBONE_ONNX not in carried
    patched = apply_patch(patch.path, root.path, tmp_path / "patched")
    assert patched.sha256 == built.sha256
    assert load_bundle(patched.path).read(BACKBONE_INT8) == want.read(BACKBONE_INT8)
