"""The close's `choose` step (round_close.py): a rule's second candidate replaces the first only
when the server set's gate split gets at least as many samples right with it and its mean loss
is lower; otherwise, or without a server set or a second candidate, the first goes on. The gate
split is faked at the project's own interface (the aggregation's `tail`): a head gets right as
many of 10 samples as ten times its first weight, at a mean loss of 1 - that weight plus its
second."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from edge_agent.coordinator.round_close import Close, RoundCloser
from edge_agent.coordinator.strategies import Aggregate
from edge_agent.coordinator.streaming import Layout


class _Tail:
    def __init__(self, can_gate: bool = True) -> None:
        self.data = SimpleNamespace(can_gate=can_gate)
        self.scored_heads: list[float] = []

    def scored(self, head: dict[str, np.ndarray]) -> tuple[np.ndarray, float]:
        x, bump = float(head["w"][0]), float(head["w"][1])
        if not np.isfinite([x, bump]).all():
            raise AssertionError("apply_delta lets no non-finite head through")
        self.scored_heads.append(x)
        return np.arange(10) < int(round(10 * x)), 1.0 - x + bump


def _close(tail: _Tail | None, first: float, second: float | None, bump: float = 0.0) -> tuple[Close, RoundCloser]:
    """Candidates scoring `first` and `second`; the second's loss raised by `bump`."""
    head = {"w": np.zeros(2, np.float32)}
    alt = None if second is None else Aggregate(np.array([second, bump]), {"d0": 0.0, "d1": 0.25},
                                                 info={"server_share": 0.75, "server_stands_in": True})
    agg = Aggregate(np.array([first, 0.0]), {"d0": 0.0, "d1": 0.5}, info={"server_share": 0.5, "trust": {"d0": 0.0}},
                    notes={"d1": "a note"}, alternative=alt)
    job, rnd = SimpleNamespace(id="j"), SimpleNamespace(number=1, base_version="1")
    c = Close(job, rnd, 0.0, SimpleNamespace(version="1"), head, Layout(head), aggregate=agg)
    closer = RoundCloser(registry=None, policy=None, clock=lambda: 0.0, heads=None,
                         aggregation=SimpleNamespace(tail=lambda job, version: tail), strikes=None, gate=None)
    return c, closer


def test_the_second_candidate_goes_on_when_the_gate_split_scores_it_higher() -> None:
    tail = _Tail()
    c, closer = _close(tail, 0.3, 0.6)
    closer.choose(c)
    assert c.aggregate is not None and c.metrics["candidates_correct"] == [3, 6]
    np.testing.assert_allclose(c.metrics["candidates_loss"], [0.7, 0.4], atol=1e-6)
    np.testing.assert_allclose(c.aggregate.vec, [0.6, 0.0])
    assert c.aggregate.shares == {"d0": 0.0, "d1": 0.25}
    # the first's record and verdict notes stay; the second's server share replaces the first's
    assert c.aggregate.info == {"server_share": 0.75, "trust": {"d0": 0.0}, "server_stands_in": True}
    assert c.aggregate.notes == {"d1": "a note"} and c.aggregate.alternative is None


@pytest.mark.parametrize("second", [0.3, 0.2])
def test_an_exact_tie_or_a_worse_second_candidate_keeps_the_first(second: float) -> None:
    c, closer = _close(_Tail(), 0.3, second)
    closer.choose(c)
    assert c.aggregate is not None and c.aggregate.alternative is None
    np.testing.assert_allclose(c.aggregate.vec, [0.3, 0.0])
    assert c.aggregate.shares["d1"] == 0.5 and "server_stands_in" not in c.aggregate.info


def test_a_tie_in_right_answers_goes_to_the_lower_loss() -> None:
    c, closer = _close(_Tail(), 0.3, 0.3, bump=-0.05)
    closer.choose(c)
    assert c.aggregate is not None and c.aggregate.info.get("server_stands_in") is True
    np.testing.assert_allclose(c.aggregate.vec, [0.3, -0.05])


def test_more_right_answers_at_a_higher_loss_keep_the_first() -> None:
    """The gate counts right answers and the loss is the finer evidence: the second goes on
    only when both agree it is no worse."""
    c, closer = _close(_Tail(), 0.3, 0.6, bump=0.5)
    closer.choose(c)
    assert c.aggregate is not None and "server_stands_in" not in c.aggregate.info
    np.testing.assert_allclose(c.aggregate.vec, [0.3, 0.0])
    assert c.metrics["candidates_correct"] == [3, 6]


@pytest.mark.parametrize("tail", [None, _Tail(can_gate=False)])
def test_without_a_gate_split_the_first_candidate_goes_on_unscored(tail: _Tail | None) -> None:
    c, closer = _close(tail, 0.3, 0.9)
    closer.choose(c)
    assert c.aggregate is not None and c.aggregate.alternative is None
    np.testing.assert_allclose(c.aggregate.vec, [0.3, 0.0])
    assert "candidates_correct" not in c.metrics
    assert tail is None or tail.scored_heads == []


def test_a_rule_with_one_candidate_is_not_scored_at_all() -> None:
    tail = _Tail()
    c, closer = _close(tail, 0.3, None)
    closer.choose(c)
    assert tail.scored_heads == [] and "candidates_correct" not in c.metrics


def test_an_unusable_second_candidate_leaves_the_first() -> None:
    """A non-finite second candidate (apply_delta refuses it): the first goes on, nothing raised."""
    tail = _Tail()
    c, closer = _close(tail, 0.3, float("inf"))
    closer.choose(c)
    assert c.aggregate is not None and not c.failed
    np.testing.assert_allclose(c.aggregate.vec, [0.3, 0.0])
