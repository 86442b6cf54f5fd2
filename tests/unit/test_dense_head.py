"""The numpy dense-head trainer against MXNet Gluon's HeadTrainer: the same numbers, step
by step, for both head forms this project meets, both optimisers, class weights and weight
decay; its checkpoints resume exactly; anything that is not one dense layer goes to Gluon."""

from __future__ import annotations

import numpy as np
import pytest

from edge_agent.errors import ConfigError, InputError
from edge_agent.train.dense_head import (
    DenseForm,
    DenseHeadTrainer,
    dense_head_form,
    make_head_trainer,
)
from edge_agent.train.trainer import HeadTrainer, TrainConfig, linear_head

D, K, N = 24, 5, 96


def _gemm_head(seed: int = 0) -> tuple[str, dict[str, np.ndarray]]:
    """The form the ONNX importer gives this project's bundles (Gemm with alpha / beta)."""
    import mxnet as mx

    x = mx.sym.flatten(mx.sym.flatten(mx.sym.var("feat")))
    w, b = mx.sym.var("output_fc_weight"), mx.sym.var("output_fc_bias")
    out = mx.sym.broadcast_add(mx.sym.linalg.gemm2(x, w, transpose_b=True, alpha=0.5), b * 2.0)
    rng = np.random.default_rng(seed)
    return out.tojson(), {"output_fc_weight": rng.normal(0, 0.2, (K, D)).astype(np.float32),
                          "output_fc_bias": rng.normal(0, 0.1, K).astype(np.float32)}


def _data(seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, K, N)
    y[:40] = 0  # unbalanced, so class weights matter
    centres = rng.normal(0, 0.5, (K, D))  # overlapping: the loss stays O(1)
    return (centres[y] + rng.normal(0, 1.0, (N, D))).astype(np.float32).reshape(N, D, 1, 1), y


def _both(head: tuple[str, dict[str, np.ndarray]], config: TrainConfig, y: np.ndarray):
    sym, params = head
    gluon = HeadTrainer(symbol_json=sym, params=params, input_name="feat", num_classes=K, config=config,
                        train_labels=y)
    ours = make_head_trainer(symbol_json=sym, params=params, input_name="feat", num_classes=K, config=config,
                             train_labels=y)
    assert isinstance(ours, DenseHeadTrainer) and ours.backend == "numpy"
    return gluon, ours


@pytest.mark.parametrize("form", ["fully-connected", "onnx-gemm"])
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_numpy_head_matches_gluon_step_for_step(form: str, optimizer: str) -> None:
    head = linear_head(D, K, input_name="feat", seed=3) if form == "fully-connected" else _gemm_head()
    x, y = _data()
    config = TrainConfig(optimizer=optimizer, lr=0.05, weight_decay=1e-3, batch_size=16, balance=True, seed=7)
    gluon, ours = _both(head, config, y)
    for step in range(3 * gluon.batches_per_epoch(N)):
        idx = gluon.batch_indices(N, step // 6, step % 6)
        # float32 either way; only the summation order differs (BLAS vs MXNet's kernels)
        assert ours.step(x[idx], y[idx]) == pytest.approx(gluon.step(x[idx], y[idx]), rel=1e-4)
    for name, value in gluon.params().items():
        np.testing.assert_allclose(ours.params()[name], value, rtol=1e-4, atol=1e-5, err_msg=name)
    np.testing.assert_allclose(ours.predict(x), gluon.predict(x), rtol=1e-4, atol=1e-4)
    assert ours.evaluate(x, y) == pytest.approx(gluon.evaluate(x, y), rel=1e-4)
    assert gluon.params()[next(iter(gluon.params()))].tolist() != head[1][next(iter(head[1]))].tolist()  # it moved


def test_not_true_distillation_is_the_same_in_numpy_and_gluon() -> None:
    """A teacher (the head's own starting logits, as the job gives it) and a weight: both
    trainers take the same steps, and the pull moves them elsewhere than plain training."""
    head = linear_head(D, K, input_name="feat", seed=3)
    x, y = _data()
    config = TrainConfig(lr=0.05, batch_size=16, seed=7, distill=3.0)
    gluon, ours = _both(head, config, y)
    teacher = ours.predict(x)
    assert 0 < (teacher.argmax(axis=1) == y).mean() < 1  # both kinds of sample: distilled and not
    plain = make_head_trainer(symbol_json=head[0], params=head[1], input_name="feat", num_classes=K,
                              config=TrainConfig(lr=0.05, batch_size=16, seed=7), train_labels=y)
    for step in range(2 * gluon.batches_per_epoch(N)):
        idx = gluon.batch_indices(N, step // 6, step % 6)
        assert ours.step(x[idx], y[idx], teacher[idx]) == pytest.approx(gluon.step(x[idx], y[idx], teacher[idx]),
                                                                        rel=1e-4)
        plain.step(x[idx], y[idx], teacher[idx])  # distill 0: the teacher is not used
    for name, value in gluon.params().items():
        np.testing.assert_allclose(ours.params()[name], value, rtol=1e-4, atol=1e-5, err_msg=name)
        assert np.abs(plain.params()[name] - value).max() > 1e-3, name


def test_numpy_checkpoints_resume_bit_for_bit_and_refuse_the_other_backend() -> None:
    x, y = _data()
    config = TrainConfig(batch_size=16, lr=0.02)
    sym, params = linear_head(D, K, input_name="feat")
    make = lambda: make_head_trainer(symbol_json=sym, params=params, input_name="feat",  # noqa: E731
                                     num_classes=K, config=config)
    straight, resumed = make(), make()
    for t in range(5):
        idx = straight.batch_indices(N, 0, t)
        straight.step(x[idx], y[idx])
        resumed.step(x[idx], y[idx])
    straight.end_epoch(0, 1.5)
    resumed.end_epoch(0, 1.5)
    meta, arrays = resumed.state()
    fresh = make()
    fresh.load_state(meta, arrays)
    assert fresh.best_loss == 1.5 and fresh.best_params is not None
    for t in range(5, 12):
        idx = straight.batch_indices(N, 1, t % 6)
        assert fresh.step(x[idx], y[idx]) == straight.step(x[idx], y[idx])
    for name, value in straight.params().items():
        assert np.array_equal(fresh.params()[name], value)
    gluon = HeadTrainer(symbol_json=sym, params=params, input_name="feat", num_classes=K, config=config)
    with pytest.raises(InputError, match="written by the 'numpy' trainer"):
        gluon.load_state(meta, arrays)
    with pytest.raises(InputError, match="written by the 'mxnet' trainer"):
        make().load_state(*gluon.state())
    broken = {k: v for k, v in arrays.items() if not k.startswith("opt/")}
    with pytest.raises(InputError, match="does not fit"):
        make().load_state(meta, broken)


def test_only_one_dense_layer_is_recognised() -> None:
    import mxnet as mx

    sym, params = linear_head(D, K, input_name="feat")
    assert dense_head_form(sym, "feat") == DenseForm("fc_weight", "fc_bias")
    assert dense_head_form(sym, "other-input") is None
    assert dense_head_form(_gemm_head()[0], "feat") == DenseForm("output_fc_weight", "output_fc_bias", 0.5, 2.0)
    hidden = mx.sym.FullyConnected(mx.sym.var("feat"), num_hidden=8, name="h")
    two = mx.sym.FullyConnected(mx.sym.relu(hidden), num_hidden=K, name="out").tojson()
    no_bias = mx.sym.FullyConnected(mx.sym.var("feat"), num_hidden=K, no_bias=True, name="nb").tojson()
    for text in (two, no_bias, "not json", '{"nodes": [], "heads": []}'):
        assert dense_head_form(text, "feat") is None
    two_params = {"h_weight": np.zeros((8, D), np.float32), "h_bias": np.zeros(8, np.float32),
                  "out_weight": np.zeros((K, 8), np.float32), "out_bias": np.zeros(K, np.float32)}
    cfg = TrainConfig()
    assert isinstance(make_head_trainer(symbol_json=two, params=two_params, input_name="feat", num_classes=K,
                                        config=cfg), HeadTrainer)
    assert isinstance(make_head_trainer(symbol_json=sym, params=params, input_name="feat", num_classes=K,
                                        config=cfg, backend="mxnet"), HeadTrainer)
    with pytest.raises(ConfigError, match="one-dense-layer head"):
        make_head_trainer(symbol_json=two, params=two_params, input_name="feat", num_classes=K, config=cfg,
                          backend="numpy")
    with pytest.raises(ConfigError, match="auto, numpy, mxnet"):
        make_head_trainer(symbol_json=sym, params=params, input_name="feat", num_classes=K, config=cfg,
                          backend="torch")
    with pytest.raises(InputError, match="do not make a 7-class"):
        make_head_trainer(symbol_json=sym, params=params, input_name="feat", num_classes=7, config=cfg)
    with pytest.raises(InputError, match="missing"):
        make_head_trainer(symbol_json=sym, params={"fc_weight": params["fc_weight"]}, input_name="feat",
                          num_classes=K, config=cfg)
