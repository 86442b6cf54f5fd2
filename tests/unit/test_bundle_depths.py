"""Multi-depth bundles (issue 15): create_bundle(depths=N), manifest.depths, the per-depth
files and Bundle.at_depth(k), and the validation of an untrusted manifest's depths.

Oracles: the Gluon net's own forward (each depth's fp32 prefix followed by its fp32 tail
is the whole net), the Gluon net's parameters (what each tail must hold), and, for the
int8 prefixes, the fp32 prefix they were quantised from. One bundle is built per module.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from edge_agent.int8 import bundle as B
from edge_agent.int8 import bundle_create as BC
from edge_agent.int8.engines.reference import QGraphRunner
from edge_agent.int8.float_graph import run_float
from edge_agent.int8.onnx_import import import_onnx
from edge_agent.sim import models

LABELS = [str(i) for i in range(10)]
SHAPE = (3, 32, 32)
DEPTHS = 3
# the nearest three training depths of MobileNetV2 w0.35 (test_depth_cuts.py has them all)
CUTS = [("features_gap_fwd", "head"), ("features_block16_project_bn_fwd", "1x1-input"),
        ("features_block15__plus0", "add"), ("features_block14__plus0", "add")]
# what each depth's tail holds, by the Gluon blocks it starts after
TAIL_BLOCKS = [("output_fc",), ("features_head", "output_fc"), ("features_block16", "features_head", "output_fc"),
               ("features_block15", "features_block16", "features_head", "output_fc")]
# what manifest.json held before depths existed: a head-only bundle's keys stay exactly these
HEAD_ONLY_KEYS = {"format_version", "name", "version", "parent_version", "created", "source", "input", "labels",
                  "split", "files", "extra"}


@pytest.fixture(scope="module")
def net():
    return models.initialize(models.mobilenet_v2(0.35, len(LABELS), SHAPE[-1]), seed=0, randomize_bn=True)


@pytest.fixture(scope="module")
def x() -> np.ndarray:
    return np.random.default_rng(0).normal(0.0, 1.0, (24, *SHAPE)).astype(np.float32)


@pytest.fixture(scope="module")
def logits(net, x) -> np.ndarray:
    import mxnet as mx

    return net(mx.nd.array(x)).asnumpy()


def _create(net, x, dest: Path, **kwargs) -> B.Bundle:
    return BC.create_bundle(net, dest, calibration=x[:16], labels=LABELS, name="mbv2", version="1",
                            input_shape=SHAPE, **kwargs)


@pytest.fixture(scope="module")
def deep(net, x, tmp_path_factory) -> B.Bundle:
    return _create(net, x, tmp_path_factory.mktemp("bundles") / "deep", depths=DEPTHS)


@pytest.fixture(scope="module")
def flat(net, x, tmp_path_factory) -> B.Bundle:
    return _create(net, x, tmp_path_factory.mktemp("bundles") / "flat")


@pytest.fixture(scope="module")
def fp32_prefixes(deep, x) -> list[np.ndarray]:
    """Each depth's fp32 prefix output on x (the float graph of backbone.onnx up to the cut)."""
    out = []
    for k in range(DEPTHS + 1):
        view = deep.at_depth(k)
        out.append(run_float(import_onnx(view.onnx_bytes(), split=view.manifest.split_tensor), x))
    return out


@pytest.fixture()
def damaged(deep, tmp_path) -> Path:
    """A private copy of the deep bundle that a test may damage."""
    return Path(shutil.copytree(deep.path, tmp_path / "copy"))


def _raw(bundle: B.Bundle) -> dict:
    return json.loads((bundle.path / B.MANIFEST).read_bytes())


def _depth_files(n: int) -> list[str]:
    return [B.depth_file(k, f) for k in range(1, n + 1) for f in (B.BACKBONE_INT8, B.HEAD_SYMBOL, B.HEAD_PARAMS)]


def _answers_files(n: int) -> list[str]:
    """The oracle's answers of every depth's prefix (oracle_answers.py), depth 0's included."""
    return [B.depth_file(k, B.ORACLE) for k in range(n + 1)]


# ------------------------------------------------------------------ creation


def test_manifest_lists_depth_0_to_n_in_order_with_their_files(deep):
    m = deep.manifest
    assert [d.depth for d in m.depths] == list(range(DEPTHS + 1))
    assert [(d.tensor, d.kind) for d in m.depths] == CUTS
    assert m.depths[0].feature_shape == m.feature_shape == (1280, 1, 1) and m.depths[0].tensor == m.split_tensor
    assert [d.feature_shape for d in m.depths[1:]] == [(112, 1, 1), (56, 1, 1), (56, 1, 1)]
    assert sorted(m.files) == sorted([*B.REQUIRED_FILES, *_depth_files(DEPTHS), *_answers_files(DEPTHS)])
    for fname in _depth_files(DEPTHS):  # on disk, and pinned by the manifest like every other file
        assert (deep.path / fname).stat().st_size == m.files[fname].size > 0
    # the raw JSON says the same, and reads back to the same bytes
    raw = (deep.path / B.MANIFEST).read_bytes()
    assert [d["depth"] for d in json.loads(raw)["depths"]] == list(range(DEPTHS + 1))
    assert B.parse_manifest(raw).to_bytes() == raw
    # costs: a partition of one net, deeper = more to train and less to run frozen
    costs = [d.costs for d in m.depths]
    assert len({c["prefix_macs"] + c["tail_macs"] for c in costs}) == 1
    for d in m.depths:
        assert d.costs["cut_elements"] == int(np.prod(d.feature_shape))
    for shallow, deeper in zip(costs, costs[1:], strict=False):
        assert deeper["tail_params"] > shallow["tail_params"] and deeper["prefix_macs"] < shallow["prefix_macs"]
    assert costs[0]["tail_params"] == 1280 * 10 + 10  # the classifier alone


@pytest.mark.parametrize("k", range(DEPTHS + 1))
def test_each_depth_fp32_prefix_then_its_tail_is_the_whole_net(deep, fp32_prefixes, logits, k):
    import mxnet as mx

    view = deep.at_depth(k)
    spec = deep.manifest.depths[k]
    assert (view.depth, view.manifest.split_tensor, view.manifest.feature_shape) == (k, spec.tensor,
                                                                                      spec.feature_shape)
    features = fp32_prefixes[k]
    assert features.shape == (len(logits), *spec.feature_shape)
    out = view.head_block()(mx.nd.array(features)).asnumpy()
    np.testing.assert_allclose(out, logits, rtol=1e-4, atol=1e-4)
    # the tail is depth k's and not another's: besides parameters it reads this cut's tensor only
    sym = mx.sym.load_json(view.read(B.HEAD_SYMBOL).decode())
    stored = set(B.bundle_params(deep)[0])
    assert [i for i in sym.list_inputs() if i not in stored] == [spec.tensor]


def test_each_int8_prefix_is_its_own_depths_prefix(deep, fp32_prefixes, x):
    shapes = [d.feature_shape for d in deep.manifest.depths]
    for k in range(DEPTHS + 1):
        view = deep.at_depth(k)
        assert view.tflite_bytes() == (deep.path / B.depth_file(k, B.BACKBONE_INT8)).read_bytes()
        q = QGraphRunner(view.qgraph()).run(x)
        assert q.shape == (len(x), *view.manifest.feature_shape)
        # int8 tracks the fp32 prefix it was quantised from -- and is far from any other
        # depth's of the same shape (depths 2 and 3 are both 56x1x1)
        scale = float(np.abs(fp32_prefixes[k]).max())
        err = float(np.abs(q - fp32_prefixes[k]).max()) / scale
        assert err < 0.05, (k, err)
        for j in range(DEPTHS + 1):
            if j != k and shapes[j] == shapes[k]:
                assert float(np.abs(q - fp32_prefixes[j]).max()) / scale > 10 * err, (k, j)


def test_the_params_files_hold_every_tail_with_the_nets_values_split_by_depth(deep, net):
    import mxnet as mx

    stored = B.bundle_params(deep)[0]
    # split by depth: head.params the head's, depth<k>-head.params what depth k adds (disjoint)
    parts = [set(k.split(":", 1)[1] for k in mx.nd.load(str(deep.path / B.depth_file(d, B.HEAD_PARAMS))))
             for d in range(DEPTHS + 1)]
    assert sum(map(len, parts)) == len(set().union(*parts)) == len(stored)
    assert parts[0] == {"output_fc_weight", "output_fc_bias"}
    gluon = {name: p.data().asnumpy() for name, p in net.collect_params().items()}
    needed: set[str] = set()
    for k, blocks in enumerate(TAIL_BLOCKS):
        view = deep.at_depth(k)
        sym = mx.sym.load_json(view.read(B.HEAD_SYMBOL).decode())
        names = (set(sym.list_arguments()) | set(sym.list_auxiliary_states())) - {view.manifest.split_tensor}
        assert names <= set(stored), (k, sorted(names - set(stored)))
        # exactly the Gluon parameters after the cut: the blocks the tail starts after
        assert names == {n for n in gluon if n.startswith(tuple(b + "_" for b in blocks))}, k
        assert set(view.head_block().collect_params()) == names
        assert names == set().union(*parts[:k + 1]), k  # depth k's tail: the files of depths 0..k
        needed |= names
    assert set(stored) == needed  # the deepest tail's, nothing else
    for name, value in stored.items():
        np.testing.assert_array_equal(value, gluon[name], err_msg=name)


def test_depths_0_keeps_the_head_only_layout(flat, deep):
    raw = (flat.path / B.MANIFEST).read_bytes()
    obj = json.loads(raw)
    assert set(obj) == HEAD_ONLY_KEYS and "depths" not in obj
    assert raw == (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()
    assert B.parse_manifest(raw).to_bytes() == raw and flat.manifest.depths == []
    assert sorted(flat.manifest.files) == sorted([*B.REQUIRED_FILES, B.ORACLE])
    # the deep bundle's manifest is the head-only one plus "depths", the depth files and each
    # deeper prefix's answers
    other = _raw(deep)
    assert set(other) == HEAD_ONLY_KEYS | {"depths"}
    assert set(other["files"]) == set(obj["files"]) | set(_depth_files(DEPTHS)) | set(_answers_files(DEPTHS))
    for key in ("input", "labels", "split", "extra", "source"):
        assert other[key] == obj[key], key
    # depth 0 of the deep bundle is the head-only bundle: same backbone, same int8 model
    for fname in (B.BACKBONE_ONNX, B.BACKBONE_INT8):
        assert deep.read(fname) == flat.read(fname), fname
    np.testing.assert_array_equal(deep.calibration(), flat.calibration())
    import mxnet as mx

    assert sorted(mx.nd.load(str(flat.path / B.HEAD_PARAMS))) == ["arg:output_fc_bias", "arg:output_fc_weight"]


def test_depths_argument_is_checked(tmp_path):
    from edge_agent.errors import InputError

    small = models.initialize(models.digits_cnn(), seed=0)  # the check is the same for any net: a quick one
    calib = np.random.default_rng(1).random((4, 1, 8, 8), dtype=np.float32)
    for bad in (-1, B.MAX_DEPTH + 1, True, 1.0, "2"):
        with pytest.raises(InputError, match="depths: must be an integer 0..8, got"):
            BC.create_bundle(small, tmp_path / "b", calibration=calib, labels=LABELS, name="d", version="1",
                             input_shape=(1, 8, 8), depths=bad)
    assert not (tmp_path / "b").exists()


# ------------------------------------------------------------------ views


def test_at_depth_on_a_head_only_bundle_names_the_depths(flat, deep):
    assert flat.at_depth(0) is flat and deep.at_depth(0) is deep
    with pytest.raises(B.BundleError, match=r"no depth 1 \(its depths: 0\.\.0; build it with .*--depths N"):
        flat.at_depth(1)
    with pytest.raises(B.BundleError, match=r"no depth 4 \(its depths: 0\.\.3"):
        deep.at_depth(DEPTHS + 1)
    with pytest.raises(B.BundleError, match=r"no depth -1 "):
        deep.at_depth(-1)


def test_a_view_of_a_view_raises_and_views_are_stable(deep):
    view = deep.at_depth(2)
    assert view.at_depth(2) is view
    for other in (0, 1, 3):
        with pytest.raises(B.BundleError, match="a depth view cannot be viewed at another depth"):
            view.at_depth(other)
    # each view is its own identity (caches keyed by it), the same one every time
    shas = {deep.sha256} | {deep.at_depth(k).sha256 for k in range(1, DEPTHS + 1)}
    assert len(shas) == DEPTHS + 1 and deep.at_depth(2).sha256 == view.sha256
    assert view.path == deep.path and deep.depth == 0
    assert not view.has(B.BACKBONE_EDGETPU) and view.has(B.HEAD_PARAMS)
    assert view.manifest.files[B.BACKBONE_INT8] == deep.manifest.files[B.depth_file(2, B.BACKBONE_INT8)]
    assert view.manifest.files[B.HEAD_SYMBOL] == deep.manifest.files[B.depth_file(2, B.HEAD_SYMBOL)]
    # viewing leaves the bundle itself as it was
    assert deep.manifest.split_tensor == CUTS[0][0] and deep.manifest.files[B.BACKBONE_INT8].size == len(
        (deep.path / B.BACKBONE_INT8).read_bytes())


def test_pack_and_unpack_keep_every_depth(deep, tmp_path):
    archive = B.pack_bundle(deep.path, tmp_path / "deep.tar.gz")
    restored = B.unpack_bundle(archive, tmp_path / "restored")
    assert restored.sha256 == deep.sha256
    for k in range(DEPTHS + 1):
        assert restored.at_depth(k).tflite_bytes() == deep.at_depth(k).tflite_bytes()
        assert restored.at_depth(k).read(B.HEAD_SYMBOL) == deep.at_depth(k).read(B.HEAD_SYMBOL)


# ------------------------------------------------------------------ tampering


@pytest.mark.parametrize("fname", _depth_files(DEPTHS))
def test_a_changed_depth_file_fails_verification(damaged, fname):
    path = damaged / fname
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(B.HashMismatchError, match=f"{fname}: sha256 .* does not match"):
        B.load_bundle(damaged)


def test_depth_files_swapped_or_removed_after_loading(damaged):
    bundle = B.load_bundle(damaged)
    view = bundle.at_depth(3)
    # depth 2's int8 prefix has depth 3's shape: only the hash tells them apart
    shutil.copyfile(damaged / B.depth_file(2, B.BACKBONE_INT8), damaged / B.depth_file(3, B.BACKBONE_INT8))
    with pytest.raises(B.HashMismatchError, match=B.depth_file(3, B.BACKBONE_INT8)):
        view.tflite_bytes()
    with pytest.raises(B.HashMismatchError):
        B.load_bundle(damaged)
    (damaged / B.depth_file(1, B.HEAD_SYMBOL)).unlink()
    with pytest.raises(B.BundleError, match=rf"{B.depth_file(1, B.HEAD_SYMBOL)}: missing"):
        bundle.at_depth(1).head_block()
    assert bundle.at_depth(2).read(B.HEAD_SYMBOL)  # the others still verify


# ------------------------------------------------------------------ manifest validation


def _entry(k: int, **change) -> dict:
    return {"depth": k, "tensor": f"t{k}", "node": "", "kind": "add", "feature_shape": [8, 2, 2],
            "costs": {"prefix_macs": 1, "tail_macs": 1}} | change


def _with_depths(obj: dict, n: int) -> dict:
    """obj with depths 0..n-1 listed, and file entries for each (the parser checks names)."""
    obj = copy.deepcopy(obj)
    obj["depths"] = [_entry(k) for k in range(n)]
    some = obj["files"][B.HEAD_SYMBOL]
    obj["files"] = {f: e for f, e in obj["files"].items() if not f.startswith("depth")}
    obj["files"].update({f: dict(some) for f in _depth_files(min(n - 1, B.MAX_DEPTH))})
    return obj


def _set_cost(key: str, value: object):
    return lambda m: m["depths"][1]["costs"].update({key: value})


def _drop(key: str):
    return lambda m: m["depths"][2].pop(key)


EDITS = {
    "out of order": (lambda m: m["depths"].insert(1, m["depths"].pop(2)), "depths[1]: depth must be 1"),
    "a depth skipped": (lambda m: m["depths"][3].update(depth=5), "depths[3]: depth must be 3"),
    "depth is a bool": (lambda m: m["depths"][1].update(depth=True), "field 'depth' must be int"),
    "depth is a string": (lambda m: m["depths"][1].update(depth="1"), "field 'depth' must be int"),
    "depth 0 missing": (lambda m: m["depths"].pop(0), "depths[0]: depth must be 0"),
    "missing int8 prefix": (lambda m: m["files"].pop("depth2-backbone_int8.tflite"),
                            "depths[2]: files: missing depth2-backbone_int8.tflite"),
    "missing tail": (lambda m: m["files"].pop("depth3-head-symbol.json"),
                     "depths[3]: files: missing depth3-head-symbol.json"),
    "files of an unlisted depth": (lambda m: m["depths"].pop(), "depth files for depths the manifest does not list"),
    "files of a depth beyond": (lambda m: m["files"].update({"depth5-head-symbol.json": m["files"][B.HEAD_SYMBOL]}),
                                "depth files for depths the manifest does not list"),
    "files but no depths": (lambda m: m.pop("depths"), "depth files for depths the manifest does not list"),
    "depth 9 file": (lambda m: m["files"].update({"depth9-head-symbol.json": m["files"][B.HEAD_SYMBOL]}),
                     "unexpected file name"),
    "depth 0 file": (lambda m: m["files"].update({"depth0-backbone_int8.tflite": m["files"][B.HEAD_SYMBOL]}),
                     "unexpected file name"),
    "newline after a depth file": (lambda m: m["files"].update(
        {"depth1-head-symbol.json\n": m["files"][B.HEAD_SYMBOL]}), "unexpected file name"),
    "negative cost": (_set_cost("prefix_macs", -1), "costs must map"),
    "bool cost": (_set_cost("tail_params", True), "costs must map"),
    "huge cost": (_set_cost("tail_macs", 1 << 50), "costs must map"),
    "enormous cost": (_set_cost("tail_macs", 10 ** 400), "costs must map"),
    "float cost": (_set_cost("tail_macs", 1.5), "costs must map"),
    "string cost": (_set_cost("tail_macs", "1"), "costs must map"),
    "null cost": (_set_cost("cut_elements", None), "costs must map"),
    "unknown cost key": (_set_cost("flops", 1), "costs must map"),
    "costs not an object": (lambda m: m["depths"][1].update(costs=[1, 2]), "field 'costs' must be dict"),
    "300-char tensor": (lambda m: m["depths"][1].update(tensor="t" * 300), "1-256 characters"),
    "empty tensor": (lambda m: m["depths"][1].update(tensor=""), "1-256 characters"),
    "257-char kind": (lambda m: m["depths"][1].update(kind="k" * 257), "1-256 characters"),
    "300-char node": (lambda m: m["depths"][1].update(node="n" * 300), "1-256 characters"),
    "tensor not a string": (lambda m: m["depths"][1].update(tensor=["x"]), "field 'tensor' must be str"),
    "zero in feature_shape": (lambda m: m["depths"][1].update(feature_shape=[0, 1, 1]), "feature_shape"),
    "bool in feature_shape": (lambda m: m["depths"][1].update(feature_shape=[True]), "feature_shape"),
    "huge feature_shape": (lambda m: m["depths"][1].update(feature_shape=[1 << 21]), "feature_shape"),
    "long feature_shape": (lambda m: m["depths"][1].update(feature_shape=[1] * 9), "feature_shape"),
    "feature_shape not a list": (lambda m: m["depths"][1].update(feature_shape="56"), "feature_shape"),
    "no tensor": (_drop("tensor"), "missing field 'tensor'"),
    "no node": (_drop("node"), "missing field 'node'"),
    "no kind": (_drop("kind"), "missing field 'kind'"),
    "no costs": (_drop("costs"), "missing field 'costs'"),
    "no feature_shape": (_drop("feature_shape"), "missing field 'feature_shape'"),
    "no depth": (_drop("depth"), "missing field 'depth'"),
    "entry not an object": (lambda m: m["depths"].__setitem__(1, [1]), "depths[1]: must be an object"),
    "depths an object": (lambda m: m.update(depths={"0": {}}), "depths must be a list of at most 9"),
    "depths null": (lambda m: m.update(depths=None), "depths must be a list of at most 9"),
    "more than 9 depths": (lambda m: m.update(_with_depths(m, 10)), "depths must be a list of at most 9"),
}


@pytest.mark.parametrize("case", list(EDITS))
def test_a_bad_depths_manifest_is_a_manifest_error(deep, case):
    edit, message = EDITS[case]
    obj = _raw(deep)
    edit(obj)
    with pytest.raises(B.ManifestError) as info:  # anything else propagates and fails the test
        B.parse_manifest(json.dumps(obj).encode())
    assert message in str(info.value)
    assert "\n" not in str(info.value) and len(str(info.value)) < 400


def test_the_limits_themselves_are_accepted(deep):
    obj = _with_depths(_raw(deep), B.MAX_DEPTH + 1)  # 9 depths: 0..8
    obj["depths"][1].update(tensor="t" * 256, kind="k" * 256, node="n" * 256, feature_shape=[1 << 20])
    obj["depths"][2]["costs"] = {key: (1 << 50) - 1 for key in
                                 ("prefix_macs", "tail_macs", "tail_params", "tail_activations", "cut_elements")}
    obj["depths"][3]["costs"] = {}
    m = B.parse_manifest(json.dumps(obj).encode())
    assert [d.depth for d in m.depths] == list(range(B.MAX_DEPTH + 1))
    assert m.depths[1].tensor == "t" * 256 and m.depths[2].costs["tail_params"] == (1 << 50) - 1


JUNK = [None, True, False, -1, 0, 1.5, float("inf"), 10 ** 30, "", "x" * 1000, [], [1] * 20, [[1]], {}, {"a": 1}]


@pytest.mark.parametrize("key", ["depth", "tensor", "node", "kind", "feature_shape", "costs"])
def test_junk_in_any_depth_field_is_refused_or_read_never_crashes(deep, key):
    base = _raw(deep)
    for value in JUNK:
        for target in ("field", "cost"):
            obj = copy.deepcopy(base)
            if target == "field":
                obj["depths"][1][key] = value
            else:
                obj["depths"][1]["costs"]["tail_params"] = value
            try:
                m = B.parse_manifest(json.dumps(obj).encode())
            except B.ManifestError:
                continue
            # accepted: then it was a well-formed value and it reads back as such
            got = m.depths[1]
            assert isinstance(got.tensor, str) and got.tensor and all(isinstance(v, int) for v in got.costs.values())
            assert all(isinstance(v, int) and v > 0 for v in got.feature_shape)
