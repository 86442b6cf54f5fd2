"""Update arithmetic (aggregate.py): the tensor-table check, the global norm, applying an
aggregate to a head. The rules themselves are tested in test_strategies.py."""

from __future__ import annotations

import numpy as np
import pytest

from edge_agent.coordinator.aggregate import (
    apply_delta,
    check_tensor_table,
    non_finite,
    update_norm,
)
from edge_agent.updates.errors import NonFiniteDeltaError, TensorTableMismatchError


def test_update_norm_is_global_l2() -> None:
    assert update_norm({"a": np.array([3.0], np.float32), "b": np.array([[4.0]], np.float32)}) == pytest.approx(5.0)


def test_non_finite_names_the_tensor_and_counts() -> None:
    assert non_finite({"w": np.ones(3, np.float32)}) is None
    why = non_finite({"w": np.array([np.nan, np.inf, 1.0, np.nan], np.float32)})
    assert why == "tensor 'w': 2 NaN, 1 Inf"


def test_tensor_table_check_lists_every_difference() -> None:
    base = {"w": np.zeros((2, 3)), "b": np.zeros(2)}
    check_tensor_table({"w": (2, 3), "b": (2,)}, base)  # shapes alone are enough
    with pytest.raises(TensorTableMismatchError) as err:
        check_tensor_table({"w": np.zeros((3, 2)), "x": np.zeros(1)}, base)
    msg = str(err.value)
    assert "missing tensor 'b'" in msg and "unexpected tensor 'x'" in msg and "shape (3, 2)" in msg
    check_tensor_table({"b": (2,)}, base, subset=True)  # one depth's tensors of a multi-depth model
    with pytest.raises(TensorTableMismatchError):
        check_tensor_table({}, base, subset=True)  # ... but not none of them


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
