"""Model definitions and the small deterministic trainer (real MXNet, real digits data)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from edge_agent.sim import models


def test_module_imports_without_mxnet() -> None:
    code = "import sys, edge_agent.sim.models; assert 'mxnet' not in sys.modules, 'mxnet imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize(("value", "expected"), [(32 * 0.35, 16), (16 * 0.35, 8), (24 * 0.5, 16),
                                                 (1280, 1280), (3, 8), (100, 104)])
def test_make_divisible(value: float, expected: int) -> None:
    assert models.make_divisible(value) == expected


def test_digits_cnn_split_shapes() -> None:
    import mxnet as mx

    net = models.initialize(models.digits_cnn(num_classes=7), seed=1)
    x = mx.nd.array(np.random.default_rng(0).random((5, 1, 8, 8), dtype=np.float32))
    feats = net.features(x)
    assert feats.shape == (5, 32, 1, 1)
    out = net(x).asnumpy()
    assert out.shape == (5, 7)
    np.testing.assert_allclose(out, net.output(feats).asnumpy(), rtol=1e-6)


def test_mobilenet_v2_structure_and_shapes() -> None:
    import mxnet as mx

    net = models.initialize(models.mobilenet_v2(0.5, num_classes=4, input_size=64), seed=0)
    blocks = [b for b in net.features._children.values() if hasattr(b, "use_skip")]
    assert len(blocks) == sum(n for _, _, n, _ in models.MOBILENET_V2_SETTINGS) == 17
    # skips exactly where stride 1 and channels match: 10 of 17 in MobileNetV2
    assert sum(b.use_skip for b in blocks) == 10
    x = mx.nd.array(np.random.default_rng(0).normal(size=(2, 3, 64, 64)).astype(np.float32))
    assert net.features(x).shape == (2, 1280, 1, 1)
    assert net(x).shape == (2, 4)
    narrow = models.mobilenet_v2(0.35, 4, 32, settings=((1, 16, 1, 1), (6, 24, 2, 2)), last_channels=64)
    models.initialize(narrow)
    assert narrow.features(mx.nd.zeros((1, 3, 32, 32))).shape == (1, 64, 1, 1)


def test_mobilenet_v2_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="multiple of the total stride 32"):
        models.mobilenet_v2(0.35, 10, 48)
    with pytest.raises(ValueError, match="width"):
        models.mobilenet_v2(0.0, 10, 32)


def test_digits_split_is_deterministic_stratified_and_disjoint() -> None:
    a = models.load_digits_split(seed=3)
    b = models.load_digits_split(seed=3)
    for u, v in zip(a, b, strict=True):
        np.testing.assert_array_equal(u, v)
    x_train, y_train, x_test, y_test = a
    assert x_train.shape[1:] == (1, 8, 8) and x_train.dtype == np.float32
    assert len(x_train) + len(x_test) == 1797
    assert x_train.min() >= 0.0 and x_train.max() <= 1.0
    per_class = np.bincount(y_test) / np.bincount(np.concatenate([y_train, y_test]))
    assert np.all(np.abs(per_class - 0.25) < 0.02)
    train_rows = {row.tobytes() for row in x_train}
    # digits has a few duplicate images; the split itself must not put one sample in both
    assert sum(row.tobytes() in train_rows for row in x_test) < 10


def test_fit_classifier_is_deterministic_and_learns() -> None:
    x_train, y_train, x_test, y_test = models.load_digits_split()
    x, y = x_train[:400], y_train[:400]
    runs = []
    for _ in range(2):
        net = models.digits_cnn()
        history = models.fit_classifier(net, x, y, epochs=4, batch_size=64, lr=0.01, seed=7)
        runs.append((history, models.predict(net, x_test)))
    assert runs[0][0] == runs[1][0]
    np.testing.assert_array_equal(runs[0][1], runs[1][1])
    history, logits = runs[0]
    assert history[-1] < history[0] * 0.5
    assert (logits.argmax(1) == y_test).mean() > 0.6  # 10 classes: chance is 0.1


def test_fit_classifier_rejects_mismatched_labels() -> None:
    with pytest.raises(ValueError, match="3 samples but 2 labels"):
        models.fit_classifier(models.digits_cnn(), np.zeros((3, 1, 8, 8)), np.zeros(2), epochs=1)
