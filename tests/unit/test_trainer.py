"""The MXNet head trainer: learns, resumes bit-for-bit, stops early, balances classes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edge_agent.errors import ConfigError, InputError
from edge_agent.train.trainer import (
    HeadTrainer,
    TrainConfig,
    class_weights,
    head_layers,
    linear_head,
)

N, D, K = 240, 12, 4


def _problem(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centres = rng.normal(0, 2.0, (K, D))
    y = rng.integers(0, K, N)
    x = (centres[y] + rng.normal(0, 1.0, (N, D))).astype(np.float32)
    return x[:, :, None, None], y


def _trainer(config: TrainConfig, y: np.ndarray | None = None, head: tuple[str, dict] | None = None) -> HeadTrainer:
    sym, params = head or linear_head(D, K, input_name="feat")
    return HeadTrainer(symbol_json=sym, params=params, input_name="feat", num_classes=K, config=config, train_labels=y)


def _train(t: HeadTrainer, x: np.ndarray, y: np.ndarray, epochs: int, *, swap_at: int | None = None,
           make: callable = None) -> HeadTrainer:
    step = 0
    for epoch in range(epochs):
        for b in range(t.batches_per_epoch(len(y))):
            if step == swap_at:  # simulate a restart: a fresh trainer loads the saved state
                meta, arrays = t.state()
                t = make()
                t.load_state(json.loads(json.dumps(meta)), arrays)
            idx = t.batch_indices(len(y), epoch, b)
            t.step(x[idx], y[idx])
            step += 1
    return t


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_training_learns_and_a_resumed_run_is_bit_identical(optimizer: str) -> None:
    x, y = _problem()
    config = TrainConfig(optimizer=optimizer, lr=0.05, batch_size=32, weight_decay=1e-3)
    first = _trainer(config)
    loss0, acc0 = first.evaluate(x, y)
    straight = _train(first, x, y, 4)
    loss1, acc1 = straight.evaluate(x, y)
    assert loss1 < loss0 * 0.5 and acc1 > max(acc0 + 0.2, 0.85)
    resumed = _train(_trainer(config), x, y, 4, swap_at=13, make=lambda: _trainer(config))
    for name, value in straight.params().items():
        np.testing.assert_array_equal(resumed.params()[name], value)


def test_early_stopping_keeps_the_best_parameters() -> None:
    x, y = _problem()
    t = _trainer(TrainConfig(patience=2))
    assert t.end_epoch(0, 1.0) is False
    best = t.params()
    t.step(x[:32], y[:32])
    assert t.end_epoch(1, 1.5) is False and t.end_epoch(2, 1.2) is True
    t.restore_best()
    for name, value in best.items():
        np.testing.assert_array_equal(t.params()[name], value)
    assert t.best_epoch == 0 and t.end_epoch(3, float("nan")) is False


def test_class_balancing_weights_rare_classes_up() -> None:
    labels = np.array([0] * 90 + [1] * 10)
    w = class_weights(labels, 3)
    np.testing.assert_allclose(w, [100 / 180, 100 / 20, 0.0])
    x, y = _problem()
    keep = np.concatenate([np.flatnonzero(y != 3), np.flatnonzero(y == 3)[:4]])  # class 3 is rare
    xs, ys = x[keep], y[keep]
    results = {}
    for balance in (False, True):
        t = _train(_trainer(TrainConfig(lr=0.02, balance=balance), ys), xs, ys, 2)
        pred = t.predict(x).argmax(axis=1)
        results[balance] = float((pred[y == 3] == 3).mean())
    assert results[True] > results[False]


def test_train_last_freezes_earlier_layers() -> None:
    import mxnet as mx

    data = mx.sym.var("feat")
    hidden = mx.sym.Activation(mx.sym.FullyConnected(mx.sym.flatten(data), num_hidden=8, name="fc1"), act_type="relu")
    out = mx.sym.FullyConnected(hidden, num_hidden=K, name="fc2")
    rng = np.random.default_rng(0)
    params = {"fc1_weight": rng.normal(0, 0.3, (8, D)).astype(np.float32), "fc1_bias": np.zeros(8, np.float32),
              "fc2_weight": rng.normal(0, 0.3, (K, 8)).astype(np.float32), "fc2_bias": np.zeros(K, np.float32)}
    assert head_layers(out.tojson(), set(params)) == [["fc1_weight", "fc1_bias"], ["fc2_weight", "fc2_bias"]]
    x, y = _problem()
    t = _train(_trainer(TrainConfig(train_last=1), head=(out.tojson(), params)), x, y, 1)
    got = t.params()
    np.testing.assert_array_equal(got["fc1_weight"], params["fc1_weight"])
    assert not np.array_equal(got["fc2_weight"], params["fc2_weight"])
    assert t.trainable == ["fc2_weight", "fc2_bias"]


def test_bad_state_and_bad_heads_are_clear_errors() -> None:
    t = _trainer(TrainConfig())
    meta, arrays = t.state()
    other = HeadTrainer(symbol_json=linear_head(D, 5, input_name="feat")[0], params=linear_head(D, 5)[1],
                        input_name="feat", num_classes=5, config=TrainConfig())
    with pytest.raises(InputError, match="other parameters"):
        other.load_state(meta, arrays)
    sgd = _trainer(TrainConfig(optimizer="sgd"))
    with pytest.raises(InputError, match="optimizer 'adam'"):
        sgd.load_state(meta, arrays)
    with pytest.raises(InputError, match="missing"):
        _trainer(TrainConfig(), head=(linear_head(D, K)[0], {}))
    with pytest.raises(InputError, match="not MXNet symbol JSON|cannot load"):
        _trainer(TrainConfig(), head=("{not json", {}))


@pytest.mark.parametrize("kwargs", [{"optimizer": "rmsprop"}, {"lr": 0.0}, {"lr": float("nan")},
                                    {"batch_size": 0}, {"epochs": True}, {"train_last": 0}])
def test_config_is_validated(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        TrainConfig(**kwargs)
