"""Gluon model definitions for tests, benchmarks and the demo, and a small trainer.

Every model is a HybridBlock with two children: `.features` (the frozen backbone that is
exported to ONNX and quantised to int8) and `.output` (the head that is fine-tuned on the
device). Block prefixes are fixed so that exported ONNX node names are stable across
processes (Gluon's default prefixes come from global counters).

MXNet is imported inside functions only: the idle daemon imports this package without
loading MXNet.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # pragma: no cover - typing only
    from mxnet.gluon import HybridBlock

# (expansion t, output channels c, repeats n, first stride s), as in MobileNetV2 Table 2.
MOBILENET_V2_SETTINGS: tuple[tuple[int, int, int, int], ...] = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)


def make_divisible(value: float, divisor: int = 8) -> int:
    """Round a channel count to a multiple of `divisor`, never below 90% of `value`."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    if rounded < 0.9 * value:
        rounded += divisor
    return rounded


@functools.cache
def _classifier_class() -> Any:
    """Build the Classifier class lazily (its base class lives in MXNet)."""
    from mxnet import gluon

    class Classifier(gluon.HybridBlock):
        """`features` (backbone) followed by `output` (head)."""

        def __init__(self, features: Any, output: Any, prefix: str) -> None:
            super().__init__(prefix=prefix)
            self.features = features  # attribute assignment registers the child blocks
            self.output = output

        def hybrid_forward(self, F: Any, x: Any) -> Any:  # noqa: N803 - Gluon's name
            return self.output(self.features(x))

    return Classifier


def digits_cnn(num_classes: int = 10) -> HybridBlock:
    """A small plain CNN for 1x8x8 images (scikit-learn's digits).

    features: conv-BN-ReLU x2, max pool, conv-BN-ReLU, global average pool -> (N, 32, 1, 1)
    output:   flatten + dense -> (N, num_classes)
    """
    from mxnet.gluon import nn

    features = nn.HybridSequential(prefix="features_")
    with features.name_scope():
        features.add(
            nn.Conv2D(16, 3, padding=1, use_bias=False, in_channels=1, prefix="conv1_"),
            nn.BatchNorm(in_channels=16, prefix="bn1_"),
            nn.Activation("relu", prefix="relu1_"),
            nn.Conv2D(32, 3, padding=1, use_bias=False, in_channels=16, prefix="conv2_"),
            nn.BatchNorm(in_channels=32, prefix="bn2_"),
            nn.Activation("relu", prefix="relu2_"),
            nn.MaxPool2D(2, prefix="pool1_"),
            nn.Conv2D(32, 3, padding=1, in_channels=32, prefix="conv3_"),
            nn.BatchNorm(in_channels=32, prefix="bn3_"),
            nn.Activation("relu", prefix="relu3_"),
            nn.GlobalAvgPool2D(prefix="gap_"),
        )
    output = nn.HybridSequential(prefix="output_")
    with output.name_scope():
        output.add(nn.Flatten(prefix="flatten_"), nn.Dense(num_classes, in_units=32, prefix="fc_"))
    return _classifier_class()(features, output, prefix="digits_cnn_")


@functools.cache
def _inverted_residual_class() -> Any:
    from mxnet import gluon
    from mxnet.gluon import nn

    class InvertedResidual(gluon.HybridBlock):
        """1x1 expand (ReLU6) -> 3x3 depthwise (ReLU6) -> 1x1 linear project (+ skip)."""

        def __init__(self, in_c: int, out_c: int, stride: int, expand: int, prefix: str) -> None:
            super().__init__(prefix=prefix)
            hidden = in_c * expand
            self.use_skip = stride == 1 and in_c == out_c
            with self.name_scope():
                self.body = nn.HybridSequential(prefix="")
                if expand != 1:
                    self.body.add(*_conv_bn(hidden, 1, 1, 1, in_c, "expand_", relu6=True))
                self.body.add(*_conv_bn(hidden, 3, stride, hidden, hidden, "dw_", relu6=True))
                self.body.add(*_conv_bn(out_c, 1, 1, 1, hidden, "project_", relu6=False))

        def hybrid_forward(self, F: Any, x: Any) -> Any:  # noqa: N803 - Gluon's name
            out = self.body(x)
            return out + x if self.use_skip else out

    return InvertedResidual


def _conv_bn(
    channels: int, kernel: int, stride: int, groups: int, in_c: int, prefix: str, *, relu6: bool
) -> list[Any]:
    from mxnet.gluon import nn

    layers: list[Any] = [
        nn.Conv2D(channels, kernel, strides=stride, padding=kernel // 2, groups=groups,
                  use_bias=False, in_channels=in_c, prefix=f"{prefix}conv_"),
        nn.BatchNorm(in_channels=channels, prefix=f"{prefix}bn_"),
    ]
    if relu6:
        # clip(0, 6) exports to ONNX Clip, which the importer fuses as RELU6
        layers.append(nn.HybridLambda(lambda F, x: F.clip(x, 0.0, 6.0), prefix=f"{prefix}relu6_"))
    return layers


def mobilenet_v2(
    width: float = 0.35,
    num_classes: int = 10,
    input_size: int = 32,
    *,
    settings: Sequence[tuple[int, int, int, int]] = MOBILENET_V2_SETTINGS,
    last_channels: int = 1280,
) -> HybridBlock:
    """A MobileNetV2-style net: inverted residual blocks, ReLU6, BN, global average pool.

    `input_size` must be a multiple of the total stride so every feature map stays whole;
    `settings` can shorten the network for quick tests.
    """
    from mxnet.gluon import nn

    if width <= 0:
        raise ValueError(f"mobilenet_v2: width must be > 0, got {width}")
    total_stride = 2 * int(np.prod([s for _, _, _, s in settings]))
    if input_size < total_stride or input_size % total_stride:
        raise ValueError(
            f"mobilenet_v2: input_size {input_size} is not a multiple of the total stride {total_stride}"
        )
    block_cls = _inverted_residual_class()
    stem = make_divisible(32 * width)
    last = make_divisible(last_channels * max(1.0, width))
    features = nn.HybridSequential(prefix="features_")
    with features.name_scope():
        features.add(*_conv_bn(stem, 3, 2, 1, 3, "stem_", relu6=True))
        in_c, index = stem, 0
        for expand, channels, repeats, stride in settings:
            out_c = make_divisible(channels * width)
            for i in range(repeats):
                features.add(block_cls(in_c, out_c, stride if i == 0 else 1, expand, f"block{index}_"))
                in_c, index = out_c, index + 1
        features.add(*_conv_bn(last, 1, 1, 1, in_c, "head_", relu6=True))
        features.add(nn.GlobalAvgPool2D(prefix="gap_"))
    output = nn.HybridSequential(prefix="output_")
    with output.name_scope():
        output.add(nn.Flatten(prefix="flatten_"), nn.Dense(num_classes, in_units=last, prefix="fc_"))
    return _classifier_class()(features, output, prefix="mobilenet_v2_")


def initialize(net: HybridBlock, *, seed: int = 0, randomize_bn: bool = False) -> HybridBlock:
    """Initialise all parameters deterministically (Xavier), skipping initialised ones.

    `randomize_bn` gives BatchNorm non-trivial statistics, so that an untrained net still
    exercises batch-norm folding in quantisation tests.
    """
    import mxnet as mx

    mx.random.seed(seed)
    params = net.collect_params()
    fresh = {name: p for name, p in params.items() if p._data is None}  # noqa: SLF001
    for p in fresh.values():
        p.initialize(default_init=mx.init.Xavier(magnitude=2.0))
    if randomize_bn:
        rng = np.random.default_rng(seed)
        for name, p in params.items():
            shape = p.shape
            if name.endswith("_gamma"):
                p.set_data(rng.uniform(0.5, 1.5, shape).astype(np.float32))
            elif name.endswith(("_beta", "_running_mean")):
                p.set_data(rng.normal(0.0, 0.1, shape).astype(np.float32))
            elif name.endswith("_running_var"):
                p.set_data(rng.uniform(0.5, 2.0, shape).astype(np.float32))
    return net


def fit_classifier(
    net: HybridBlock,
    x: np.ndarray,
    y: np.ndarray,
    *,
    epochs: int = 10,
    batch_size: int = 64,
    lr: float = 0.01,
    seed: int = 0,
) -> list[float]:
    """Train `net` (softmax cross-entropy, Adam) deterministically; returns per-epoch mean loss."""
    import mxnet as mx
    from mxnet import autograd, gluon

    x = np.ascontiguousarray(x, dtype=np.float32)
    y = np.asarray(y)
    if len(x) != len(y) or len(x) == 0:
        raise ValueError(f"fit_classifier: {len(x)} samples but {len(y)} labels")
    initialize(net, seed=seed)
    np_rng = np.random.RandomState(seed)
    mx.random.seed(seed)
    trainer = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": lr})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    history: list[float] = []
    for _ in range(epochs):
        order = np_rng.permutation(len(x))
        total = 0.0
        for start in range(0, len(x), batch_size):
            idx = order[start : start + batch_size]
            data = mx.nd.array(x[idx])
            label = mx.nd.array(y[idx].astype(np.float32))
            with autograd.record():
                loss = loss_fn(net(data), label)
            loss.backward()
            trainer.step(len(idx))
            total += float(loss.sum().asscalar())
        history.append(total / len(x))
    refresh_batchnorm(net, x[np_rng.permutation(len(x))[:2048]])
    return history


def _blocks(block: Any) -> list[Any]:
    out = [block]
    for child in block._children.values():
        out.extend(_blocks(child))
    return out


def refresh_batchnorm(net: HybridBlock, x: np.ndarray) -> None:
    """Set every BatchNorm's running statistics to the statistics of `x` (one batch).

    During a short training run the running averages (momentum 0.9) lag far behind the
    moving weights, so inference-mode accuracy can sit near chance while training-mode
    accuracy is high. One training pass with momentum 0 replaces them exactly.
    """
    import mxnet as mx
    from mxnet import autograd
    from mxnet.gluon import nn

    blocks = _blocks(net)
    norms = [b for b in blocks if isinstance(b, nn.BatchNorm)]
    if not norms:
        return
    saved = [b._kwargs["momentum"] for b in norms]

    def clear() -> None:  # cached graphs baked the old momentum in
        for b in blocks:
            if hasattr(b, "_clear_cached_op"):
                b._clear_cached_op()

    try:
        for b in norms:
            b._kwargs["momentum"] = 0.0
        clear()
        with autograd.record():  # MXNet updates running statistics in the backward pass
            out = net(mx.nd.array(np.ascontiguousarray(x, dtype=np.float32)))
        out.backward()  # the gradients are discarded: no optimiser step follows
        out.wait_to_read()
    finally:
        for b, m in zip(norms, saved, strict=True):
            b._kwargs["momentum"] = m
        clear()


def predict(net: HybridBlock, x: np.ndarray, *, batch_size: int = 256) -> np.ndarray:
    """Forward `x` (NCHW float32) through `net` in inference mode; returns float32 outputs."""
    import mxnet as mx

    outs = [
        net(mx.nd.array(np.ascontiguousarray(x[i : i + batch_size], dtype=np.float32))).asnumpy()
        for i in range(0, len(x), batch_size)
    ]
    return np.concatenate(outs, axis=0)


def load_digits_split(*, test_fraction: float = 0.25, seed: int = 0) -> tuple[np.ndarray, ...]:
    """scikit-learn's digits (bundled, no download) as NCHW float32 in [0, 1], split
    deterministically (stratified per class): x_train, y_train, x_test, y_test."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = (data.images.astype(np.float32) / 16.0)[:, None, :, :]
    y = data.target.astype(np.int64)
    rng = np.random.RandomState(seed)
    test_idx: list[np.ndarray] = []
    for label in np.unique(y):
        members = rng.permutation(np.flatnonzero(y == label))
        test_idx.append(members[: int(round(len(members) * test_fraction))])
    test_mask = np.zeros(len(y), dtype=bool)
    test_mask[np.concatenate(test_idx)] = True
    return x[~test_mask], y[~test_mask], x[test_mask], y[test_mask]
