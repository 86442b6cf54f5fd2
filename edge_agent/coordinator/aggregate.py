"""Update arithmetic as pure numpy functions (no I/O, no state): the checks every received
table passes, a delta's norm and finiteness, and applying an aggregate to a head.

The aggregation rules themselves -- each with its streaming form and its dense reference --
are in strategies/.

A "delta" (or "weights") is a mapping tensor name -> ndarray, as `updates.decode_update`
returns it. Arithmetic is float64 and the results are cast back to the base's dtypes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..updates.errors import NonFiniteDeltaError, TensorTableMismatchError

Weights = Mapping[str, np.ndarray]


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(x) if isinstance(x, tuple) else tuple(np.shape(x))


def check_tensor_table(params: Mapping[str, Any], base: Mapping[str, Any], *, what: str = "update",
                       subset: bool = False) -> None:
    """Names and shapes of `params` must be exactly those of `base` (dtypes may differ:
    deltas are float32 whatever the model's dtype). Values are arrays or shape tuples (so
    a received table is checked before anything is allocated). Lists every difference.
    `subset`: a received update may leave tensors out (a job at one depth of a multi-depth
    model trains some of them; the rest have a zero delta), but not all of them."""
    problems = [] if subset and params else [f"missing tensor {n!r}" for n in base if n not in params]
    problems += [f"unexpected tensor {n!r}" for n in params if n not in base]
    problems += [f"tensor {n!r}: shape {_shape(params[n])} in {what}, model has {_shape(base[n])}"
                 for n in base if n in params and _shape(params[n]) != _shape(base[n])]
    if problems:
        raise TensorTableMismatchError(f"{what} does not match the model: " + "; ".join(problems))


def non_finite(delta: Weights) -> str | None:
    """Why `delta` is not finite ("tensor 'w': 3 NaN, 1 Inf"), or None if it is."""
    for name, arr in delta.items():
        arr = np.asarray(arr)
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            n_nan = int(np.isnan(arr).sum())
            return f"tensor {name!r}: {n_nan} NaN, {int((~np.isfinite(arr)).sum()) - n_nan} Inf"
    return None


def update_norm(delta: Weights) -> float:
    """Global L2 norm over all tensors (float64; inf or nan when the delta is not finite)."""
    total = 0.0
    for arr in delta.values():
        a = np.asarray(arr, dtype=np.float64).ravel()
        total += float(np.dot(a, a))
    return math.sqrt(total) if not math.isnan(total) else math.nan


def apply_delta(base: Weights, delta: Weights) -> dict[str, np.ndarray]:
    """base + delta per tensor, in the base's order and dtypes; refuses a mismatched table
    and a non-finite result (e.g. float16 overflow)."""
    check_tensor_table(delta, base, what="delta")
    out = {}
    for name, arr in base.items():
        arr = np.asarray(arr)
        with np.errstate(over="ignore", invalid="ignore"):
            out[name] = (arr.astype(np.float64) + np.asarray(delta[name], dtype=np.float64)).astype(arr.dtype)
    why = non_finite(out)
    if why is not None:
        raise NonFiniteDeltaError(f"applying the delta gives non-finite parameters ({why})")
    return out
