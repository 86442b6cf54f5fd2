"""The numpy tail trainer (dense_head.NumpyTailTrainer, running train/numpy_tail.py) against
MXNet, the oracle: on the real tails of a multi-depth MobileNetV2 bundle (depths 1-3: the
last 1x1 conv, + the last inverted residual block, + the one before with its residual add)
and of the digits CNN (a full 3x3 conv with bias, ReLU, max pooling), the
forward equals MXNet's, the gradients equal MXNet autograd's, and Adam / SGD steps give
HeadTrainer's parameters and BatchNorm statistics; checkpoints resume bit for bit (also
under kill -9 in a real job); an op it does not compute sends the tail to MXNet Gluon; and
training on real digits features raises held-out accuracy without importing MXNet.

Tolerances: float32 either way, only summation orders differ (BLAS vs MXNet's kernels).
A BatchNorm shift feeding another BatchNorm through linear ops has a gradient that is zero
in exact arithmetic, so both sides hold rounding noise there, which Adam's normalisation
turns into steps of up to lr: such tensors are compared to that bound, all others tightly
(under Adam, all but the few elements whose own gradient is near zero; SGD and the
gradients themselves are compared element by element).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edge_agent.errors import ConfigError
from edge_agent.int8.bundle import load_bundle
from edge_agent.int8.bundle_create import create_bundle
from edge_agent.sim import models
from edge_agent.sim import scenario as demo
from edge_agent.train.dense_head import NumpyTailTrainer, make_head_trainer
from edge_agent.train.numpy_tail import UnsupportedTail, unsupported
from edge_agent.train.trainer import HeadTrainer, TrainConfig, head_from_bundle

SHAPE = (3, 64, 64)  # MobileNetV2's last blocks then run on 2x2 pixels: the 3x3 taps see padding and neighbours
K = 6
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def mbv2(tmp_path_factory: pytest.TempPathFactory):
    net = models.initialize(models.mobilenet_v2(0.35, K, SHAPE[-1]), seed=0, randomize_bn=True)
    calib = np.random.default_rng(0).normal(0, 1, (16, *SHAPE)).astype(np.float32)
    dest = tmp_path_factory.mktemp("mbv2") / "mbv2"
    create_bundle(net, dest, calibration=calib, labels=[str(i) for i in range(K)], name="mbv2", version="1",
                  input_shape=SHAPE, depths=3)
    return load_bundle(dest)


@pytest.fixture(scope="module")
def digits_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo.ensure_bundle(tmp_path_factory.getbasetemp() / "digits-bundle-depths", depths=2)


def _tail(bundle, depth: int) -> tuple[str, dict[str, np.ndarray], str, tuple[int, ...]]:
    view = bundle.at_depth(depth)
    sym, params = head_from_bundle(view)
    return sym, params, view.manifest.split_tensor, tuple(view.manifest.feature_shape)


def _batch(shape: tuple[int, ...], n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, K, n)
    y[: n // 3] = 0  # unbalanced: class weights matter
    return rng.normal(0.5, 1.0, (n, *shape)).astype(np.float32), y


def _pair(sym, params, name, shape, config, y, classes=K):
    ours = NumpyTailTrainer(symbol_json=sym, params=params, input_name=name, num_classes=classes, config=config,
                            train_labels=y, input_shape=shape)
    oracle = HeadTrainer(symbol_json=sym, params=params, input_name=name, num_classes=classes, config=config,
                         train_labels=y)
    return ours, oracle


def _mxnet_grads(oracle: HeadTrainer, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """MXNet's training-mode logits and d(mean weighted loss)/d(parameter), by autograd."""
    mx = oracle.mx
    own = oracle.block.collect_params()
    for p in own.values():
        if p.grad_req != "null":
            p.zero_grad()
    with mx.autograd.record():
        out = oracle.block(mx.nd.array(x))
        loss = oracle._loss(out, mx.nd.array(y.astype(np.float32)), mx.nd.array(oracle.class_weight[y].reshape(-1, 1)))
    loss.backward()
    return out.asnumpy(), {n: own[n].grad().asnumpy() / len(y) for n in oracle.trainable}


def _ours_grads(ours: NumpyTailTrainer, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    logits, values, caches = ours.program.forward(ours._w, x, train=True)
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(y)), y] -= 1
    p *= (ours.class_weight[y] / len(y))[:, None]
    return logits, ours.program.backward(values, caches, p.astype(np.float32))


def _degenerate(grads: dict[str, np.ndarray]) -> set[str]:
    """Tensors whose gradient is rounding noise (module doc)."""
    scale = max(float(np.linalg.norm(g)) for g in grads.values())
    return {n for n, g in grads.items() if np.linalg.norm(g) < 1e-5 * scale}


CASES = [(d, bn) for d in (1, 2, 3) for bn in ("update", "frozen")]


@pytest.mark.parametrize(("depth", "bn"), CASES)
def test_forward_and_gradients_equal_mxnet(mbv2, depth: int, bn: str) -> None:
    sym, params, name, shape = _tail(mbv2, depth)
    x, y = _batch(shape, 24)
    config = TrainConfig(bn=bn, balance=True)
    ours, oracle = _pair(sym, params, name, shape, config, y)
    assert ours.signature() == oracle.signature() and ours.trainable == oracle.trainable
    assert ours.aux_names() == oracle.aux_names() and ours.aux_names()
    np.testing.assert_allclose(ours.predict(x), oracle.predict(x), rtol=1e-4, atol=1e-4)
    mx_logits, mx_grads = _mxnet_grads(oracle, x, y)
    logits, grads = _ours_grads(ours, x, y)
    np.testing.assert_allclose(logits, mx_logits, rtol=1e-4, atol=1e-4)  # training mode: batch statistics
    assert set(grads) == set(mx_grads)
    noise = _degenerate(mx_grads)
    assert len(noise) <= 2  # the premise: almost every tensor has a real gradient
    scale = max(float(np.linalg.norm(g)) for g in mx_grads.values())
    for n, g in mx_grads.items():
        err = float(np.linalg.norm(grads[n] - g))
        assert err <= 1e-3 * float(np.linalg.norm(g)) + 1e-5 * scale, (n, err, float(np.linalg.norm(g)))


@pytest.mark.parametrize(("depth", "bn", "tail", "optimizer"),
                         [(d, bn, "full", "adam") for d, bn in CASES]
                         + [(d, "update", "bias", "adam") for d in (1, 2, 3)]
                         + [(2, "frozen", "bias", "adam"), (3, "update", "full", "sgd")])
def test_optimiser_steps_equal_headtrainer(mbv2, depth: int, bn: str, tail: str, optimizer: str) -> None:
    sym, params, name, shape = _tail(mbv2, depth)
    x, y = _batch(shape, 48, seed=1)
    lr = 0.001 if optimizer == "adam" else 0.05
    config = TrainConfig(optimizer=optimizer, lr=lr, weight_decay=1e-3, bn=bn, tail=tail, batch_size=16,
                         balance=True)
    ours, oracle = _pair(sym, params, name, shape, config, y)
    assert ours.trainable == oracle.trainable
    if tail == "bias":
        assert all(np.ndim(params[n]) == 1 for n in ours.trainable if not n.startswith("output_fc"))
    probe = HeadTrainer(symbol_json=sym, params=params, input_name=name, num_classes=K, config=config,
                        train_labels=y)  # its backward moves its BatchNorm statistics: not the oracle's
    noise = _degenerate(_mxnet_grads(probe, x[:16], y[:16])[1]) if optimizer == "adam" else set()
    steps = 3
    for s in range(steps):
        idx = slice(16 * s, 16 * (s + 1))
        assert ours.step(x[idx], y[idx]) == pytest.approx(oracle.step(x[idx], y[idx]), rel=1e-4)
    mine, theirs = ours.params(), oracle.params()
    assert set(mine) == set(theirs)
    for n, value in theirs.items():
        if n in noise:
            assert np.abs(mine[n] - value).max() <= 2 * steps * lr * 1.01, n
            continue
        tight = np.isclose(mine[n], value, rtol=2e-4, atol=2e-5 * max(1.0, float(np.abs(value).max())))
        if optimizer == "sgd":
            assert tight.all(), n
        else:  # Adam steps an element with a near-zero gradient by ~lr whatever its sign: few, bounded
            assert tight.mean() >= 0.95 and np.abs(mine[n] - value).max() <= 2 * steps * lr * 1.01, n
        moved = not np.array_equal(theirs[n], params[n])
        assert moved == (n in ours.trainable or (bn == "update" and n in ours.aux_names())), n
    np.testing.assert_allclose(ours.predict(x), oracle.predict(x), rtol=1e-3, atol=1e-3)


def _digits_tail_symbol(digits_bundle: Path) -> tuple[str, dict[str, np.ndarray], str, tuple[int, ...]]:
    return _tail(load_bundle(digits_bundle), 2)


def test_digits_cnn_tail_full_conv_bias_relu_max_pool_equal_mxnet(digits_bundle: Path) -> None:
    sym, params, name, shape = _digits_tail_symbol(digits_bundle)
    ops = {n["op"] for n in json.loads(sym)["nodes"]}
    # the premise (ONNX-imported ops); mxnet.contrib.onnx also put a zero-width Pad before the
    # max pool, the float-graph tail import (int8/tail_import.py) does not
    assert {"Convolution", "relu", "Pooling", "BatchNorm"} <= ops
    x, y = _batch(shape, 16, seed=2)
    x = np.maximum(x, 0)  # the cut is after a ReLU
    for bn in ("update", "frozen"):
        ours, oracle = _pair(sym, params, name, shape, TrainConfig(bn=bn, lr=0.002), y, 10)
        mx_logits, mx_grads = _mxnet_grads(oracle, x, y)
        logits, grads = _ours_grads(ours, x, y)
        np.testing.assert_allclose(logits, mx_logits, rtol=1e-4, atol=1e-4)
        scale = max(float(np.linalg.norm(g)) for g in mx_grads.values())
        for n, g in mx_grads.items():
            assert np.linalg.norm(grads[n] - g) <= 1e-3 * np.linalg.norm(g) + 1e-5 * scale, n
        noise = _degenerate(mx_grads)  # conv3's bias, when BN3 uses batch statistics
        assert noise == ({"features_conv3_bias"} if bn == "update" else set())
        ours, oracle = _pair(sym, params, name, shape, TrainConfig(bn=bn, lr=0.002), y, 10)  # statistics unmoved
        start = {n: np.array(v, copy=True) for n, v in oracle.params().items()}
        for _ in range(3):
            ours.step(x, y), oracle.step(x, y)
        for n, value in oracle.params().items():
            got = ours.params()[n]
            # Adam's step is at most lr per element and step, whatever the gradient.
            assert np.abs(got - value).max() <= 2 * 3 * 0.002 * 1.01, n
            if n in noise or (noise and n == "features_bn3_running_mean"):  # the mean of that noisy bias
                continue
            # Adam normalises each gradient element, so where one is tiny the two libraries'
            # fp32 rounding (MXNet's oneDNN takes AVX-512 paths on CPUs that have them) can move
            # that element's step by a visible fraction of lr; the steps as a whole must agree.
            want_step, got_step = value - start[n], got - start[n]
            assert np.linalg.norm(got_step - want_step) <= 0.01 * np.linalg.norm(want_step) + 1e-7, n


def test_other_ops_equal_mxnet_autograd() -> None:
    """What the bundles' tails do not hold but a tail may: strided and grouped convolution,
    padded / strided average and max pooling, sigmoid / tanh, a residual add, FullyConnected, scalars."""
    import mxnet as mx

    data = mx.sym.var("x")
    a = mx.sym.Convolution(data, kernel=(3, 3), stride=(2, 2), pad=(1, 1), num_filter=8, name="c1")
    a = mx.sym.BatchNorm(a, fix_gamma=False, eps=1e-4, momentum=0.8, name="bn1")
    a = mx.sym.Activation(a, act_type="tanh")
    b = mx.sym.Convolution(a, kernel=(3, 3), pad=(1, 1), num_group=2, num_filter=8, no_bias=True, name="c2")
    a = mx.sym.elemwise_add(mx.sym.Activation(b, act_type="sigmoid"), a)
    a = mx.sym.Pooling(a, kernel=(2, 2), stride=(1, 1), pool_type="avg")
    a = mx.sym.Pooling(a, kernel=(3, 3), stride=(2, 2), pad=(1, 1), pool_type="max")
    a = mx.sym.Pooling(a, global_pool=True, kernel=(1, 1), pool_type="avg")
    out = mx.sym.FullyConnected(mx.sym.flatten(a) * 2.0 - 0.5, num_hidden=K, name="fc") / 3.0
    sym = out.tojson()
    assert unsupported(sym, "x") == []
    rng = np.random.default_rng(3)
    shapes = {"c1_weight": (8, 4, 3, 3), "c1_bias": (8,), "bn1_gamma": (8,), "bn1_beta": (8,),
              "bn1_moving_mean": (8,), "bn1_moving_var": (8,), "c2_weight": (8, 4, 3, 3), "fc_weight": (K, 8),
              "fc_bias": (K,)}
    params = {n: rng.normal(0, 0.5, s).astype(np.float32) for n, s in shapes.items()}
    params["bn1_moving_var"] = np.abs(params["bn1_moving_var"]) + 0.5
    x, y = _batch((4, 7, 7), 12, seed=4)
    for bn in ("update", "frozen"):
        config = TrainConfig(bn=bn, optimizer="sgd", lr=0.1)
        ours, oracle = _pair(sym, params, "x", (4, 7, 7), config, y)
        np.testing.assert_allclose(ours.predict(x), oracle.predict(x), rtol=1e-4, atol=1e-5)
        mx_logits, mx_grads = _mxnet_grads(oracle, x, y)
        logits, grads = _ours_grads(ours, x, y)
        np.testing.assert_allclose(logits, mx_logits, rtol=1e-4, atol=1e-5)
        for n, g in mx_grads.items():
            np.testing.assert_allclose(grads[n], g, rtol=1e-3, atol=1e-6, err_msg=n)
        ours, oracle = _pair(sym, params, "x", (4, 7, 7), config, y)  # statistics unmoved by the probe
        for _ in range(3):
            ours.step(x, y), oracle.step(x, y)
        for n, value in oracle.params().items():
            np.testing.assert_allclose(ours.params()[n], value, rtol=1e-4, atol=1e-6, err_msg=n)


def test_checkpoints_resume_bit_for_bit(mbv2) -> None:
    sym, params, name, shape = _tail(mbv2, 3)
    x, y = _batch(shape, 64, seed=5)
    config = TrainConfig(lr=0.002, batch_size=16)
    make = lambda: NumpyTailTrainer(symbol_json=sym, params=params, input_name=name,  # noqa: E731
                                    num_classes=K, config=config, input_shape=shape)
    straight, resumed = make(), make()
    for t in range(6):
        idx = straight.batch_indices(64, 0, t % 4)
        straight.step(x[idx], y[idx])
        if t < 3:
            resumed.step(x[idx], y[idx])
    straight.end_epoch(0, 1.0)
    meta, arrays = resumed.state()
    json.dumps(meta)  # checkpoint metadata is plain JSON
    fresh = make()
    fresh.load_state(meta, arrays)
    for t in range(3, 6):
        idx = fresh.batch_indices(64, 0, t % 4)
        fresh.step(x[idx], y[idx])
    fresh.end_epoch(0, 1.0)
    for n, value in straight.params().items():
        assert np.array_equal(fresh.params()[n], value), n
    assert np.array_equal(fresh.predict(x), straight.predict(x))
    other = HeadTrainer(symbol_json=sym, params=params, input_name=name, num_classes=K, config=config)
    with pytest.raises(Exception, match="numpy|other parameters"):
        other.load_state(*fresh.state())
    with pytest.raises(Exception, match="mxnet|other parameters"):
        make().load_state(*other.state())


def test_the_tail_trainer_is_chosen_unless_an_op_needs_mxnet(mbv2) -> None:
    import mxnet as mx

    sym, params, name, shape = _tail(mbv2, 2)
    kw = dict(params=params, input_name=name, num_classes=K, config=TrainConfig(), input_shape=shape)
    assert isinstance(make_head_trainer(symbol_json=sym, **kw), NumpyTailTrainer)
    assert isinstance(make_head_trainer(symbol_json=sym, backend="numpy", **kw), NumpyTailTrainer)
    assert isinstance(make_head_trainer(symbol_json=sym, backend="mxnet", **kw), HeadTrainer)
    # an op it does not compute (Dropout is random in training) goes to Gluon
    graph = mx.sym.load_json(sym)
    dropped = mx.sym.Dropout(graph, p=0.2).tojson()
    assert any("Dropout" in w for w in unsupported(dropped, name))
    with pytest.raises(UnsupportedTail, match="Dropout"):
        NumpyTailTrainer(symbol_json=dropped, **kw)
    assert isinstance(make_head_trainer(symbol_json=dropped, **kw), HeadTrainer)
    with pytest.raises(ConfigError, match="needs 'mxnet'"):
        make_head_trainer(symbol_json=dropped, backend="numpy", **kw)
    # shapes are checked at construction: a tail that does not give K classes is refused there
    with pytest.raises(UnsupportedTail, match="classes"):
        NumpyTailTrainer(symbol_json=sym, **{**kw, "num_classes": K + 1})


TRAIN_SCRIPT = r"""
import json, sys
import numpy as np
from edge_agent.int8.bundle import load_bundle
from edge_agent.int8.engines import load_engine
from edge_agent.sim import scenario as demo
from edge_agent.train.dense_head import NumpyTailTrainer, make_head_trainer
from edge_agent.train.trainer import TrainConfig, head_from_bundle
from edge_agent.sim.digits import apply_camera, load_digits_images

view = load_bundle(sys.argv[1]).at_depth(2)
runner = load_engine("reference").prepare(view, threads=1)
sc = demo.scenario()
dev = sc.devices[0]
images, labels = load_digits_images()
held = np.concatenate([d.indices for d in sc.devices[1:]])
spec = view.manifest.input
feats = lambda raw: runner.run(spec.normalise(demo.to_pixels(raw).astype(np.float32)))
x, y = feats(dev.images), np.asarray(dev.labels)
hx, hy = feats(apply_camera(images[held], dev.camera)), labels[held]
sym, params = head_from_bundle(view)
trainer = make_head_trainer(symbol_json=sym, params=params, input_name=view.manifest.split_tensor,
                            num_classes=len(view.manifest.labels), config=TrainConfig(lr=0.002, batch_size=16),
                            input_shape=tuple(view.manifest.feature_shape))
before = trainer.evaluate(hx, hy)[1]
for epoch in range(8):
    for b in range(trainer.batches_per_epoch(len(y))):
        idx = trainer.batch_indices(len(y), epoch, b)
        trainer.step(x[idx], y[idx])
after = trainer.evaluate(hx, hy)[1]
np.savez(sys.argv[2], **trainer.params())
print(json.dumps({"backend": type(trainer).__name__, "before": before, "after": after,
                  "mxnet": "mxnet" in sys.modules, "train": len(y), "held": len(hy)}))
"""


def test_training_on_real_digits_features_raises_held_out_accuracy_without_mxnet(digits_bundle: Path,
                                                                                   tmp_path: Path) -> None:
    out = tmp_path / "trained.npz"
    proc = subprocess.run([sys.executable, "-c", TRAIN_SCRIPT, str(digits_bundle), str(out)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"\nheld-out ({r['held']} digits through device 0's camera), depth 2 in numpy on {r['train']} "
          f"images: {r['before']:.3f} -> {r['after']:.3f}")
    assert r["backend"] == "NumpyTailTrainer" and not r["mxnet"]
    assert r["after"] >= r["before"] + 0.10
    # the trained tensors are MXNet's, by name and layout: MXNet's tail in edge_agent.inference.predictor
    # (the evaluation path of head.params) gives the same held-out accuracy
    from edge_agent.inference.predictor import DepthPredictor
    from edge_agent.sim.digits import apply_camera, load_digits_images

    sc = demo.scenario()
    images, labels = load_digits_images()
    held = np.concatenate([d.indices for d in sc.devices[1:]])
    raw = demo.to_pixels(apply_camera(images[held], sc.devices[0].camera)).astype(np.float32)
    pred = DepthPredictor(load_bundle(digits_bundle), depth=2, params=dict(np.load(out)))
    try:
        assert pred.accuracy(raw, labels[held]) == pytest.approx(r["after"], abs=2.0 / len(held))
    finally:
        pred.close()


def test_kill_9_in_a_numpy_tail_job_resumes_to_the_uninterrupted_result(digits_bundle: Path, tmp_path: Path) -> None:
    """test_finetune_kill9's real-job kills (train / saved / write) at depth 2, numpy trainer."""
    from tests.unit import test_finetune_kill9

    test_finetune_kill9.test_kill_9_during_training_and_checkpoint_writes(digits_bundle, tmp_path, "numpy", 2)
