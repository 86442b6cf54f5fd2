"""Aggregation maths: properties of FedAvg, the trimmed mean, norm screening, apply_delta."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from edge_agent.coordinator.aggregate import (
    apply_delta,
    check_tensor_table,
    fedavg,
    screen_updates,
    trimmed_mean,
    update_norm,
)
from edge_agent.updates.errors import NonFiniteDeltaError, TensorTableMismatchError

FAST = settings(max_examples=40, deadline=None)
values = st.floats(-100, 100, allow_nan=False, width=32)
shapes = st.sampled_from([(3,), (2, 3), (4, 1, 2)])


@st.composite
def delta_lists(draw: st.DrawFn, min_size: int = 1, max_size: int = 6) -> list[dict[str, np.ndarray]]:
    """Several deltas sharing one tensor table (a weight and a bias)."""
    w_shape, n = draw(shapes), draw(st.integers(min_size, max_size))
    arrays = hnp.arrays(np.float32, w_shape, elements=values)
    biases = hnp.arrays(np.float32, (w_shape[0],), elements=values)
    return [{"w": draw(arrays), "b": draw(biases)} for _ in range(n)]


samples = st.integers(1, 10_000)


@FAST
@given(delta_lists(max_size=1), st.integers(1, 8), samples)
def test_fedavg_of_identical_updates_is_that_update(deltas: list, copies: int, n: int) -> None:
    out = fedavg([(deltas[0], n + i) for i in range(copies)])
    for name, arr in deltas[0].items():
        np.testing.assert_allclose(out[name], arr, rtol=1e-6, atol=1e-5)
        assert out[name].dtype == np.float32


@FAST
@given(delta_lists(min_size=2), st.data())
def test_fedavg_weights_are_proportional_to_samples(deltas: list, data: st.DataObject) -> None:
    counts = data.draw(st.lists(samples, min_size=len(deltas), max_size=len(deltas)))
    out = fedavg(list(zip(deltas, counts, strict=True)))
    total = sum(counts)
    for name in deltas[0]:
        want = sum(c * d[name].astype(np.float64) for d, c in zip(deltas, counts, strict=True)) / total
        np.testing.assert_allclose(out[name], want, rtol=1e-5, atol=1e-4)
    # scaling every count by the same factor changes nothing; a zero count removes an update
    scaled = fedavg([(d, 3 * c) for d, c in zip(deltas, counts, strict=True)])
    for name in out:
        np.testing.assert_allclose(scaled[name], out[name], rtol=1e-5, atol=1e-4)
    without_first = fedavg([(deltas[0], 0)] + list(zip(deltas[1:], counts[1:], strict=True)))
    rest = fedavg(list(zip(deltas[1:], counts[1:], strict=True)))
    for name in out:
        np.testing.assert_allclose(without_first[name], rest[name], rtol=1e-6, atol=1e-5)


def test_fedavg_weighting_example() -> None:
    a, b = {"w": np.array([0.0, 10.0], np.float32)}, {"w": np.array([10.0, 0.0], np.float32)}
    np.testing.assert_allclose(fedavg([(a, 1), (b, 3)])["w"], [7.5, 2.5])


@FAST
@given(delta_lists(min_size=4, max_size=9), st.floats(1e6, 1e30), st.integers(0, 8))
def test_trimmed_mean_is_robust_to_one_huge_outlier(honest: list, huge: float, where: int) -> None:
    outlier = {k: np.full_like(v, huge if where % 2 else -huge) for k, v in honest[0].items()}
    updates = [(d, 1) for d in honest]
    updates.insert(where % (len(updates) + 1), (outlier, 10**6))  # a huge sample count does not help it
    beta = 1.0 / len(updates) + 1e-9  # trims exactly one value off each end
    out = trimmed_mean(updates, beta)
    for name in honest[0]:
        stack = np.stack([d[name] for d in honest])
        assert (out[name] >= stack.min(axis=0) - 1e-4).all() and (out[name] <= stack.max(axis=0) + 1e-4).all()


def test_trimmed_mean_without_trimming_is_the_plain_mean() -> None:
    ups = [({"w": np.array([x], np.float32)}, n) for x, n in ((1.0, 1), (2.0, 100), (6.0, 1))]
    assert trimmed_mean(ups, 0.0)["w"][0] == pytest.approx(3.0)  # unweighted
    assert trimmed_mean(ups, 0.34)["w"][0] == pytest.approx(2.0)  # the median of three
    with pytest.raises(ValueError):
        trimmed_mean(ups, 0.5)


@FAST
@given(delta_lists(min_size=3, max_size=8), st.sampled_from([np.nan, np.inf, -np.inf]), st.integers(0, 7))
def test_screening_rejects_non_finite_updates(deltas: list, bad: float, which: int) -> None:
    which %= len(deltas)
    deltas[which] = {k: v.copy() for k, v in deltas[which].items()}
    deltas[which]["w"].flat[0] = bad
    res = screen_updates(deltas)
    assert which in {i for i, _ in res.rejected}
    assert which not in res.accepted
    assert dict(res.rejected)[which].startswith("non_finite")


@FAST
@given(st.integers(3, 10), st.floats(20, 1e6), st.integers(0, 9), st.integers(0, 2**32 - 1))
@example(n=8, factor=20.0, which=0, seed=3331)  # honest 1.18 vs median 0.85 was rejected with a 0.1 floor
def test_screening_rejects_a_norm_outlier_and_keeps_the_honest(n: int, factor: float, which: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    # honest updates: random directions, norms within 1 +- 20%
    dirs = [rng.normal(size=16) for _ in range(n)]
    deltas = [{"w": (d / np.linalg.norm(d) * rng.uniform(0.8, 1.2)).astype(np.float32)} for d in dirs]
    which %= n + 1
    deltas.insert(which, {"w": (deltas[0]["w"] * factor).astype(np.float32)})
    res = screen_updates(deltas, k=3.5)
    assert [i for i, _ in res.rejected] == [which]
    assert dict(res.rejected)[which].startswith("norm_outlier")
    assert res.accepted == [i for i in range(n + 1) if i != which]


def test_screening_needs_three_updates_to_judge_norms() -> None:
    small, big = {"w": np.ones(4, np.float32)}, {"w": np.full(4, 1000.0, np.float32)}
    assert screen_updates([small, big]).rejected == []
    assert screen_updates([small, big]).threshold is None
    assert [i for i, _ in screen_updates([small, small, big]).rejected] == [2]
    # near-identical norms are not outliers (the spread floor), whatever MAD says
    same = [{"w": np.ones(4, np.float32)} for _ in range(4)] + [{"w": np.full(4, 1.05, np.float32)}]
    assert screen_updates(same).rejected == []


def test_update_norm_is_global_l2() -> None:
    assert update_norm({"a": np.array([3.0], np.float32), "b": np.array([[4.0]], np.float32)}) == pytest.approx(5.0)


def test_tensor_table_check_lists_every_difference() -> None:
    base = {"w": np.zeros((2, 3)), "b": np.zeros(2)}
    check_tensor_table({"w": (2, 3), "b": (2,)}, base)  # shapes alone are enough
    with pytest.raises(TensorTableMismatchError) as err:
        check_tensor_table({"w": np.zeros((3, 2)), "x": np.zeros(1)}, base)
    msg = str(err.value)
    assert "missing tensor 'b'" in msg and "unexpected tensor 'x'" in msg and "shape (3, 2)" in msg
    with pytest.raises(TensorTableMismatchError):
        fedavg([({"w": np.zeros(2)}, 1), ({"w": np.zeros(3)}, 1)])


def test_apply_delta_keeps_base_dtypes_and_refuses_overflow() -> None:
    base = {"w": np.array([1.0, 2.0], np.float16), "b": np.array([0.5], np.float32)}
    out = apply_delta(base, {"w": np.array([0.5, -1.0], np.float32), "b": np.array([1.0], np.float32)})
    assert list(out) == ["w", "b"] and out["w"].dtype == np.float16
    np.testing.assert_array_equal(out["w"], np.array([1.5, 1.0], np.float16))
    np.testing.assert_array_equal(out["b"], [1.5])
    with pytest.raises(NonFiniteDeltaError):
        apply_delta(base, {"w": np.array([1e6, 0], np.float32), "b": np.zeros(1, np.float32)})
    with pytest.raises(TensorTableMismatchError):
        apply_delta(base, {"w": np.zeros(2, np.float32)})


@pytest.mark.parametrize("bad", [[], [({"w": np.zeros(1)}, -1)], [({"w": np.zeros(1)}, 0)],
                                 [({"w": np.zeros(1)}, float("nan"))]])
def test_fedavg_refuses_bad_weights(bad: list) -> None:
    with pytest.raises(ValueError):
        fedavg(bad)
