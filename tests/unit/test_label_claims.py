"""protocol/label_claims.py: what a device claims about its labels survives the wire, and what
the coordinator reads from an untrusted metric is either a valid claim or None."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from edge_agent.protocol.label_claims import (
    PREDICTED_SCALE,
    LabelClaims,
    decode_counts,
    decode_predicted,
    encode_counts,
    encode_predicted,
)

probabilities = st.integers(2, 40).flatmap(
    lambda k: hnp.arrays(np.float64, k, elements=st.floats(0.0, 1.0)).filter(lambda a: a.sum() > 0.1)
    .map(lambda a: a / a.sum()))


@given(probabilities)
def test_predicted_probabilities_survive_the_wire_to_the_encoding_step(p):
    text = encode_predicted(p.tolist())
    assert text is not None and len(text) <= 256
    got = decode_predicted(text, len(p))
    assert got is not None and sum(got) == pytest.approx(1.0)
    np.testing.assert_allclose(got, p, atol=len(p) / PREDICTED_SCALE)


@given(st.lists(st.integers(0, 10**6), min_size=2, max_size=30).filter(any))
def test_counts_survive_the_wire(counts):
    assert decode_counts(encode_counts(counts), len(counts)) == tuple(counts)


@pytest.mark.parametrize("raw", [None, 3, "", "5000,5000,x", "5000,5000", "4000,4000,1000", "-1,5001,5000",
                                 "10001,0,0", "3334,3333,3333" + "0" * 400, "5e3,5e3,0"])
def test_a_bad_prediction_report_is_none_never_an_error(raw):
    assert decode_predicted(raw, 3) is None


def test_a_report_that_does_not_fit_a_metric_is_left_out():
    assert encode_predicted([float("nan"), 1.0]) is None and encode_predicted([]) is None
    assert encode_predicted([1 / 100] * 100) is None  # 100 classes x 4 characters > 256
    many = LabelClaims(tuple(range(1, 200)), tuple([1 / 199] * 199))
    assert many.metrics() == {}  # neither fits: the coordinator compares with the round's mean


def _softmax(logits: np.ndarray) -> np.ndarray:
    from edge_agent.train.dense_head import log_softmax

    return np.exp(log_softmax(logits))


def test_claims_are_the_base_s_mean_probabilities_and_the_label_counts():
    logits = np.array([[2.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 5.0, 0.0]])
    claims = LabelClaims.of(_softmax(logits), np.array([0, 0, 1]))
    assert claims.counts == (2, 1, 0)
    e2, e5 = np.exp(2.0), np.exp(5.0)
    want = (np.array([e2, 1, 1]) / (e2 + 2) + np.ones(3) / 3 + np.array([1, e5, 1]) / (e5 + 2)) / 3
    np.testing.assert_allclose(claims.predicted, want)
    assert LabelClaims.from_json(claims.to_json()) == LabelClaims(claims.counts, tuple(round(p, 6) for p in want))
    # --balance: each class weighs 1 / its count, so the gradient mixes the classes evenly
    balanced = LabelClaims.of(_softmax(logits), np.array([0, 0, 1]), np.array([0.5, 1.0, 1.0]))
    assert balanced.counts == (2, 2, 0)  # 1.5 of the 3 samples each, rounded half to even
    want_b = ((np.array([e2, 1, 1]) / (e2 + 2) + np.ones(3) / 3) * 0.5 + np.array([1, e5, 1]) / (e5 + 2)) / 2
    np.testing.assert_allclose(balanced.predicted, want_b)
    metrics = claims.metrics()
    assert metrics["label_counts"] == "2,1,0"
    assert decode_predicted(metrics["label_predicted"], 3) == pytest.approx(tuple(want), abs=2 / PREDICTED_SCALE)
