"""The oracle's answers made with the bundle (oracle.npz, and one per depth): the same verdicts
as computing them on the device, used only where they are this prefix's and this reference's,
and anything else -- another backbone, a damaged or forged file -- computed on the device."""

from __future__ import annotations

import copy
import io
import logging

import numpy as np
import pytest

from edge_agent.int8 import bundle_create as BC
from edge_agent.int8 import oracle_answers
from edge_agent.int8 import selection as sel
from edge_agent.int8.agreement import Oracle, check_batch_for
from edge_agent.int8.bundle import ORACLE, depth_file, load_bundle
from edge_agent.int8.bundle_files import write_bundle_dir
from edge_agent.int8.oracle_answers import load
from edge_agent.sim import models

PROBE = {"cpu": {"arch": "x86_64", "count": 2, "int8_features": {"avx2": True}}, "accelerators": [],
         "board": {"model": "test board"}}
VERDICT = ("correct", "basis", "max_diff", "tolerance", "top1_match", "top1_checked", "agreement_samples",
           "top1_fp32", "reference_top1_fp32", "mean_steps", "rounding_sensitivity", "agreement_decided")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    x_train, y_train, _, _ = models.load_digits_split()
    net = models.digits_cnn()
    models.fit_classifier(net, x_train, y_train, epochs=3)
    root = tmp_path_factory.mktemp("oracle")
    kw = dict(labels=[str(i) for i in range(10)], name="digits", input_shape=(1, 8, 8), scale=1 / 16, version="1")
    return root, BC.create_bundle(net, root / "with", calibration=x_train[:64], **kw)


def _rewrite(bundle, dest, **changes):
    """The bundle's files with `changes` (name -> bytes, or None to drop), written to `dest`."""
    files = {f: bundle.read(f) for f in bundle.manifest.files}
    for name, data in changes.items():
        name = name.replace("_", ".")
        if data is None:
            files.pop(name)
        else:
            files[name] = data
    return write_bundle_dir(dest, files, copy.deepcopy(bundle.manifest), overwrite=True)


def _npz(**arrays) -> bytes:
    out = io.BytesIO()
    np.savez_compressed(out, **arrays)
    return out.getvalue()


def _select(bundle, tmp_path):
    selection, _ = sel.select_engine(bundle, probe=PROBE, preference=["tflite", "native"], state_dir=tmp_path,
                                     use_cache=False, repeats=2, batch_size=16, threads=1, env={})
    return {c.name: {f: getattr(c, f) for f in VERDICT} for c in selection.candidates}


def test_a_created_bundle_carries_the_answers_and_they_give_the_same_verdicts(made, tmp_path):
    root, bundle = made
    assert ORACLE in bundle.manifest.files and load(bundle, 64) is not None
    stored = Oracle(bundle, check_batch_for(bundle, 16))
    without = _rewrite(bundle, root / "without", oracle_npz=None)
    computed = Oracle(without, check_batch_for(without, 16))
    assert stored.answers_stored and not computed.answers_stored
    np.testing.assert_array_equal(stored.float, computed.float)
    np.testing.assert_array_equal(stored.int8, computed.int8)
    np.testing.assert_array_equal(stored.fp32_top1, computed.fp32_top1)
    assert stored.rounding_sensitivity() == computed.rounding_sensitivity()
    assert stored.ref_agreement == computed.ref_agreement and stored.inconclusive == computed.inconclusive == ""
    assert _select(bundle, tmp_path / "a") == _select(without, tmp_path / "b")


def test_answers_that_are_not_this_references_are_not_used(made, caplog):
    root, bundle = made
    with np.load(io.BytesIO(bundle.read(ORACLE))) as z:
        arrays = {k: z[k] for k in z.files}
    forged = {**arrays, "ref_int8": arrays["ref_int8"].copy()}
    forged["ref_int8"][0].flat[0] ^= 1  # one unit of one sample: the spot check's first sample
    tampered = _rewrite(bundle, root / "forged", oracle_npz=_npz(**forged))
    with caplog.at_level(logging.WARNING, logger="edge_agent.int8.agreement"):
        oracle = Oracle(tampered, check_batch_for(tampered, 16))
    assert not oracle.answers_stored and "differ from this reference's" in caplog.text
    np.testing.assert_array_equal(oracle.int8, Oracle(bundle, check_batch_for(bundle, 16)).int8)


@pytest.mark.parametrize("change, why", [
    (dict(backbone_sha256=np.str_("0" * 64)), "another backbone"),
    (dict(extra=np.zeros(3)), "expected"),
    (dict(fp32=np.zeros((3, 2), np.float32)), "shapes"),
    (dict(fp32=np.full((64, 32), np.nan, np.float32)), "non-finite"),
    (dict(ref_int8=np.zeros((64, 1, 1, 32), np.int16)), "dtypes"),
])
def test_an_unusable_answers_file_is_computed_on_the_device_with_a_warning(made, caplog, change, why):
    root, bundle = made
    with np.load(io.BytesIO(bundle.read(ORACLE))) as z:
        arrays = {k: z[k] for k in z.files}
    bad = _rewrite(bundle, root / "bad", oracle_npz=_npz(**{**arrays, **change}))
    with caplog.at_level(logging.WARNING, logger="edge_agent.int8.oracle_answers"):
        assert load(bad, 64) is None
    assert why in caplog.text
    assert not Oracle(bad, check_batch_for(bad, 16)).answers_stored


def test_answers_hold_the_int8_output_once_and_an_older_file_with_float_features_is_still_used(made):
    """The reference's float features are its int8 output dequantised, so the file no longer
    holds them; a bundle made before still carries them (`ref`), and is read as it was."""
    root, bundle = made
    with np.load(io.BytesIO(bundle.read(ORACLE))) as z:
        arrays = {k: z[k] for k in z.files}
    assert "ref" not in arrays
    oracle = Oracle(bundle, check_batch_for(bundle, 16))
    legacy = _rewrite(bundle, root / "legacy", oracle_npz=_npz(**arrays, ref=oracle.ref_samples))
    old = Oracle(legacy, check_batch_for(legacy, 16))
    assert old.answers_stored and oracle.answers_stored
    np.testing.assert_array_equal(old.ref_samples, oracle.ref_samples)
    assert old.ref_samples.dtype == np.float32 and old.ref_samples.shape[0] == 64


def test_not_a_zip_is_refused_too(made, caplog):
    root, bundle = made
    bad = _rewrite(bundle, root / "garbage", oracle_npz=b"PK\x03\x04 not really a zip")
    with caplog.at_level(logging.WARNING, logger="edge_agent.int8.oracle_answers"):
        assert load(bad, 64) is None
    assert "not used" in caplog.text


def test_each_depth_of_a_multi_depth_bundle_uses_its_own_prefixs_answers(tmp_path, monkeypatch):
    """A first job at any depth gets the answers made with the bundle (a federated version that
    re-quantises a prefix drops that prefix's: test_requantize), the same as computing them,
    and a depth's answers are refused for another depth's prefix."""
    x_train, y_train, _, _ = models.load_digits_split()
    net = models.digits_cnn()
    models.fit_classifier(net, x_train, y_train, epochs=1)
    deep = BC.create_bundle(net, tmp_path / "deep", calibration=x_train[:64], labels=[str(i) for i in range(10)],
                            name="digits", input_shape=(1, 8, 8), scale=1 / 16, version="1", depths=1)
    assert {ORACLE, depth_file(1, ORACLE)} <= set(deep.manifest.files)
    without = _rewrite(deep, tmp_path / "without", oracle_npz=None, **{depth_file(1, ORACLE): None})
    for depth in (0, 1):
        view, bare = load_bundle(deep.path).at_depth(depth), without.at_depth(depth)
        assert load(view, 64) is not None and load(bare, 64) is None
        stored, computed = Oracle(view, check_batch_for(view, 16)), Oracle(bare, check_batch_for(bare, 16))
        assert stored.answers_stored and not computed.answers_stored
        np.testing.assert_array_equal(stored.int8, computed.int8)
        np.testing.assert_array_equal(stored.fp32_top1, computed.fp32_top1)
        assert stored.rounding_sensitivity() == computed.rounding_sensitivity()
    swapped = _rewrite(deep, tmp_path / "swapped", oracle_npz=deep.read(depth_file(1, ORACLE)))
    assert load(swapped, 64) is None  # depth 1's answers, for depth 0's prefix: another backbone
    # a backbone over the size for which create computes them: its devices do, as before
    monkeypatch.setattr(oracle_answers, "MULTI_DEPTH_MAX_BYTES", deep.manifest.files["backbone.onnx"].size - 1)
    big = BC.create_bundle(net, tmp_path / "big", calibration=x_train[:64], labels=[str(i) for i in range(10)],
                           name="digits", input_shape=(1, 8, 8), scale=1 / 16, version="1", depths=1)
    assert not {ORACLE, depth_file(1, ORACLE)} & set(big.manifest.files)
    assert not Oracle(big.at_depth(1), check_batch_for(big.at_depth(1), 16)).answers_stored


def test_the_check_batchs_logits_and_decided_samples_are_the_task_levels_computed_once(made):
    """The check batch is the first calibration samples: its logits, and which of its samples
    a one-step move cannot flip, are the task level's first ones, not computed again; a
    larger step is measured once, however many engines are judged at it."""
    from edge_agent.train.dense_head import numpy_head_logits

    _, bundle = made
    head, calls = numpy_head_logits(bundle), []

    def counted(features):
        calls.append(len(features))
        return head(features)

    oracle = Oracle(bundle, check_batch_for(bundle, 16), logits=counted)
    assert oracle.task_level and oracle.answers_stored
    n = len(oracle.samples)
    assert sum(calls) == n + 4 * n + n  # the samples' logits, 4 moved copies (decided), the fp32 features'
    np.testing.assert_allclose(oracle.ref_logits, head(oracle.float), rtol=1e-5, atol=1e-5)  # batch shape: BLAS rounding
    calls.clear()
    at_one = oracle.decided(1.0)
    assert calls == []
    np.testing.assert_array_equal(at_one, oracle._decided(oracle.ref_samples, oracle._logits(oracle.ref_samples), 1.0)[:16])
    calls.clear()
    at_three = oracle.decided(3.0)
    assert sum(calls) == 4 * 16
    assert oracle.decided(3.0) is at_three and sum(calls) == 4 * 16


def test_an_engines_check_runs_each_calibration_sample_once(made):
    """The check batch is the first calibration samples, so an engine's float outputs on it
    are the first of its task-level run over the samples, not a run of their own; its int8
    outputs (compared with the reference's unit for unit) are the one other run."""
    from edge_agent.int8.engines.reference import QGraphRunner
    from edge_agent.int8.selection_cache import Candidate

    _, bundle = made
    oracle = Oracle(bundle, check_batch_for(bundle, 16))
    runs = {"float": 0, "int8": 0}

    class Counted(QGraphRunner):
        def run(self, batch):
            runs["float"] += len(batch)
            return super().run(batch)

        def run_int8(self, batch):
            runs["int8"] += len(batch)
            return super().run_int8(batch)

    row = Candidate("counted", True, "")
    oracle.check(Counted(bundle.qgraph()), row)
    assert row.correct and row.basis == "task" and row.max_diff == 0 and row.top1_match == 1.0
    assert runs == {"float": len(oracle.samples), "int8": 16}
    assert oracle.images_per_check() == len(oracle.samples) + 16
