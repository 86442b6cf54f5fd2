"""Not-true distillation (train/dense_head.training_loss): its gradient is the derivative of
its loss, and it pulls only where FedNTD says -- the classes other than each sample's true
one, on the samples the teacher answers right. Property-based (hypothesis)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_agent.errors import ConfigError
from edge_agent.train.dense_head import softmax_loss, training_loss
from edge_agent.train.trainer import TrainConfig

K = 5


@st.composite
def batches(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    n = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    y = rng.integers(0, K, n)
    teacher = rng.normal(0, 2, (n, K))
    right = rng.random(n) < 0.6
    teacher[right, y[right]] += 6.0  # some answered right, the rest as the draw fell
    return rng.normal(0, 2, (n, K)), y, teacher, draw(st.sampled_from([0.5, 1.0, 3.0]))


@settings(max_examples=40, deadline=None)
@given(batches())
def test_the_gradient_is_the_losss_derivative(batch) -> None:
    logits, y, teacher, weight = batch
    ones = np.ones(K, np.float32)
    value, grad = training_loss(logits, y, ones, teacher, weight)
    numeric = np.zeros_like(logits)
    for i, j in np.ndindex(*logits.shape):
        step = np.zeros_like(logits)
        step[i, j] = 1e-5
        numeric[i, j] = (training_loss(logits + step, y, ones, teacher, weight)[0]
                         - training_loss(logits - step, y, ones, teacher, weight)[0]) / 2e-5
    np.testing.assert_allclose(grad, numeric, atol=2e-5 * max(1.0, weight))
    assert value >= softmax_loss(logits, y, ones)[0] - 1e-9  # a KL is never negative


@settings(max_examples=40, deadline=None)
@given(batches())
def test_it_pulls_only_on_the_not_true_classes_of_samples_the_teacher_gets_right(batch) -> None:
    logits, y, teacher, weight = batch
    ones = np.ones(K, np.float32)
    plain = softmax_loss(logits, y, ones)[1]
    pulled = training_loss(logits, y, ones, teacher, weight)[1] - plain
    rows = np.arange(len(y))
    np.testing.assert_allclose(pulled[rows, y], 0.0, atol=1e-6)  # the true class learns freely
    wrong = teacher.argmax(axis=1) != y
    np.testing.assert_allclose(pulled[wrong], 0.0, atol=1e-6)  # the teacher's mistakes are not taught
    same = training_loss(teacher, y, ones, teacher, weight)  # the model answers as the teacher: no pull
    np.testing.assert_allclose(same[1], softmax_loss(teacher, y, ones)[1], atol=1e-6)
    assert training_loss(logits, y, ones, None, weight)[0] == softmax_loss(logits, y, ones)[0]


@pytest.mark.parametrize("bad", [-0.1, 101.0, float("nan"), True, "3"])
def test_a_bad_weight_is_refused(bad) -> None:
    with pytest.raises(ConfigError, match="distill"):
        TrainConfig(distill=bad)


def test_early_stopping_counts_a_gain_under_one_percent_as_none() -> None:
    from edge_agent.train.trainer import TrainerCommon

    common = TrainerCommon(TrainConfig(patience=2), 3, None)
    common.params = lambda: {}  # what a trainer keeps as its best: nothing to keep here
    assert not common.end_epoch(0, 1.0) and common.best_epoch == 0
    assert not common.end_epoch(1, 0.995)  # -0.5 %: no gain
    assert common.end_epoch(2, 0.992) and common.best_epoch == 0  # -0.8 %: patience spent
    fresh = TrainerCommon(TrainConfig(patience=2), 3, None)
    fresh.params = lambda: {}
    fresh.end_epoch(0, 1.0)
    assert not fresh.end_epoch(1, 0.98) and fresh.best_epoch == 1  # -2 %: a gain


def test_a_job_pulls_its_tail_towards_the_bundles_own_answers_only_when_asked(tmp_path) -> None:
    """run_finetune computes the bundle's answers once and trains with them: a label-skewed
    device (dev-05: one 0 and one 5 in 158) ends with another head under --distill 3 than
    without, and its report says which."""
    from edge_agent.inference.predictor import tail_params
    from edge_agent.int8.bundle import load_bundle
    from edge_agent.sim import scenario as demo
    from edge_agent.train.job import run_finetune

    bundle = load_bundle(demo.ensure_bundle(tmp_path / "bundle"))
    dev = next(d for d in demo.scenario().devices if d.device_id == "dev-05")
    data = demo.write_data(tmp_path / "data", dev.images, dev.labels, "npz")
    job = {"epochs": 4, "val_fraction": 0.3, "profile": "raspberry-pi-4", "batch_size": 32, "seed": 3,
           "cache_dir": tmp_path / "cache"}
    heads, claims = {}, {}
    for weight in (0.0, 3.0):
        report = run_finetune(model=bundle.path, data=data, state_dir=tmp_path / f"state-{weight}", distill=weight,
                              **job)
        assert report["depth"]["distill"] == weight and report["steps"] > 0
        heads[weight] = tail_params(bundle, report["head"]["file"])
        claims[weight] = report["label_claims"]
    assert any(not np.allclose(heads[0.0][k], heads[3.0][k]) for k in heads[0.0])
    # the label claims its update is sent with: the training split's counts, and what the
    # bundle (not the trained tail: the same under either weight) predicted on those samples
    assert claims[0.0] == claims[3.0]
    counts, predicted = np.array(claims[0.0]["counts"]), np.array(claims[0.0]["predicted"])
    assert counts.sum() == report["data"]["loaded"] - report["accuracy"]["validation_samples"]
    assert counts[0] <= 1 and counts[5] <= 1 and predicted.sum() == pytest.approx(1.0, abs=1e-5)
    # in label order: the bundle answers this device's commonest digit (7: 48 of 116) most
    assert predicted.argmax() == counts.argmax() == 7 and 0 < np.abs(counts / counts.sum() - predicted).max() < 0.1


def test_the_fleet_simulation_s_devices_distil_as_a_job_does() -> None:
    """sim/poisoning.Model.local_update(distill=W) (bench_poisoning's distilled fleets): the
    updated head's answers stay closer to the base's on the classes other than each sample's."""
    from edge_agent.sim.poisoning import Model, digits_fleet, mlp_init
    from edge_agent.train.trainer import not_true_teacher

    data = digits_fleet(2, seed=0, server_samples=100)
    model = Model(data.features, len(data.labels))
    base = mlp_init(data.features, len(data.labels), 0)
    x, y = data.xs[0], data.ys[0]
    log_q, q, right = not_true_teacher(model.trainer(base, 0).predict(x), y)

    def not_true_kl(distill: float) -> float:
        delta = model.local_update(base, x, y, 5, distill)
        new = {k: base[k] + delta[k] for k in base}
        log_p, _, _ = not_true_teacher(model.trainer(new, 0).predict(x), y)
        finite = np.isfinite(log_q)
        return float((np.where(finite, q * (log_q - np.where(finite, log_p, 0.0)), 0.0).sum(axis=1) * right).mean())

    pulled, free = not_true_kl(10.0), not_true_kl(0.0)
    assert pulled < 0.5 * free
