"""`TailEvidence.scored` (coordinator/evidence.py): per gate sample right or wrong, as
`correct` says, and the mean cross-entropy of the head's outputs -- checked against an
independent log-softmax (scipy) on the project's MLP head with random features."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.special import log_softmax

from edge_agent.coordinator.evidence import SplitData, TailEvidence
from edge_agent.coordinator.streaming import Layout
from edge_agent.errors import InputError
from edge_agent.sim.poisoning import Model, mlp_init, train_config

FEATURES, CLASSES = 12, 4


def _tail(gate: int = 60) -> tuple[TailEvidence, Model, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    x = rng.standard_normal((gate, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, gate)
    data = SplitData(root_x=x[:0], root_y=y[:0], gate_x=x, gate_y=y, num_classes=CLASSES)
    model = Model(FEATURES, CLASSES)
    head = mlp_init(FEATURES, CLASSES, 0)
    tail = TailEvidence(data=data, symbol_json=model.symbol, input_name="features", layout=Layout(head),
                        config=train_config(seed=1), backend="numpy")
    return tail, model, x, y


def test_scored_counts_what_correct_counts_and_its_loss_is_the_cross_entropy() -> None:
    tail, model, x, y = _tail()
    head = mlp_init(FEATURES, CLASSES, 3)
    ok, loss = tail.scored(head)
    np.testing.assert_array_equal(ok, tail.correct(head))
    logits = np.asarray(model.trainer(head, 0).predict(x), np.float64)
    assert loss == pytest.approx(float(-log_softmax(logits, axis=1)[np.arange(len(y)), y].mean()), rel=1e-9)


def test_a_head_that_says_nothing_costs_log_of_the_classes_and_a_confident_wrong_one_more() -> None:
    tail, _, _, y = _tail()
    silent = mlp_init(FEATURES, CLASSES, 3)
    silent["fc2_weight"][:] = 0.0
    assert tail.scored(silent)[1] == pytest.approx(np.log(CLASSES), rel=1e-6)
    wrong = dict(silent)
    wrong["fc2_bias"] = np.full(CLASSES, -5.0, np.float32)
    rarest = int(np.argmin(np.bincount(y, minlength=CLASSES)))
    wrong["fc2_bias"][rarest] = 5.0  # every sample called the rarest class, with confidence
    ok, loss = tail.scored(wrong)
    assert ok.sum() == (y == rarest).sum() and loss > np.log(CLASSES) + 1.0


def test_too_small_a_gate_split_cannot_score() -> None:
    tail, *_ = _tail(gate=5)
    with pytest.raises(InputError, match="fewer than"):
        tail.scored(mlp_init(FEATURES, CLASSES, 0))
