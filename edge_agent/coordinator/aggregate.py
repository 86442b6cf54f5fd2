"""Aggregation maths as pure numpy functions over dense deltas (Flower's `aggregate.py`; no
I/O, no state): the batch reference the streaming coordinator is tested against.

    screen_updates(deltas, k=...)          -> Screening: which updates to use, why others not
    fedavg([(delta, num_samples), ...])    -> sample-weighted mean (McMahan et al. 2017)
    trimmed_mean([(delta, n), ...], beta)  -> coordinate-wise beta-trimmed mean (Yin et al. 2018)
    coordinate_median([(delta, n), ...])   -> coordinate-wise median
    apply_delta(base, delta)               -> new parameters, in the base's dtypes

The coordinator itself aggregates with streaming.py (running sums, coordinate blocks over
the stored compressed updates) under the robust rules of robust.py (bounded sample
weights, clipping, screening from 2 updates, Multi-Krum); robust.py documents what each
aggregator does with few updates.

A "delta" (or "weights") is a mapping tensor name -> ndarray, as `updates.decode_update`
returns it. Arithmetic is float64 and the results are cast back (float32 deltas), so the
order of the updates changes a result by at most float32 rounding.

Norm screening is one-sided: an update much *larger* than the others (a scaled or diverged
one) can drag a mean anywhere, a small one cannot. The outlier rule is the robust
"modified z-score": reject when ||delta|| > median + k * max(1.4826 * MAD, min_spread *
median), applied only with at least `min_updates` finite updates (with two there is no
majority to trust). The `min_spread` floor stops clustered norms (small MAD) from
rejecting an honest update that is merely larger than the rest: honest norms spread by
their data and step counts, and with a floor of 0.25 x median nothing under 1.875 x the
median is ever rejected (0.1 rejected 1.18 against a median of 0.85 -- honest updates
within +-20 % of each other, found by the property test).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..updates.errors import NonFiniteDeltaError, TensorTableMismatchError

Weights = Mapping[str, np.ndarray]
MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its standard deviation


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


@dataclass(frozen=True)
class Screening:
    accepted: list[int]  # indices into the screened list, in order
    rejected: list[tuple[int, str]]  # (index, reason)
    norms: list[float]
    threshold: float | None  # the norm cut-off used (None: too few updates to judge)


def screen_updates(deltas: Sequence[Weights], *, k: float = 3.5, min_updates: int = 3,
                   min_spread: float = 0.25) -> Screening:
    """Reject non-finite updates, then (with >= `min_updates` finite ones) norm outliers."""
    if not (math.isfinite(k) and k > 0) or min_updates < 1 or not (0 <= min_spread < 10):
        raise ValueError(f"need k > 0, min_updates >= 1, 0 <= min_spread < 10 (got {k}, {min_updates}, {min_spread})")
    norms = [update_norm(d) for d in deltas]
    rejected: list[tuple[int, str]] = []
    finite: list[int] = []
    for i, delta in enumerate(deltas):
        why = non_finite(delta)
        if why is None and not math.isfinite(norms[i]):
            why = "norm overflows float64"
        if why is not None:
            rejected.append((i, f"non_finite: {why}"))
        else:
            finite.append(i)
    threshold = None
    if len(finite) >= min_updates:
        fn = np.array([norms[i] for i in finite])
        med = float(np.median(fn))
        spread = max(MAD_TO_SIGMA * float(np.median(np.abs(fn - med))), min_spread * med, 1e-12)
        threshold = med + k * spread
        for i in finite:
            if norms[i] > threshold:
                rejected.append((i, f"norm_outlier: norm {norms[i]:.4g} > {threshold:.4g} "
                                    f"(median {med:.4g} + {k:g} x spread {spread:.4g})"))
    bad = {i for i, _ in rejected}
    return Screening([i for i in range(len(deltas)) if i not in bad], sorted(rejected), norms, threshold)


def _checked(updates: Sequence[tuple[Weights, float]]) -> tuple[list[str], np.ndarray]:
    if not updates:
        raise ValueError("no updates to aggregate")
    first = updates[0][0]
    for i, (delta, _) in enumerate(updates[1:], 1):
        check_tensor_table(delta, first, what=f"update {i}")
    weights = np.array([float(n) for _, n in updates], dtype=np.float64)
    if not np.isfinite(weights).all() or (weights < 0).any():
        raise ValueError(f"sample counts must be finite and >= 0, got {weights.tolist()}")
    return list(first), weights


def fedavg(updates: Sequence[tuple[Weights, float]]) -> dict[str, np.ndarray]:
    """Sum_i n_i * delta_i / sum_i n_i, per tensor, in the first update's dtypes."""
    names, weights = _checked(updates)
    total = weights.sum()
    if total <= 0:
        raise ValueError("the updates' sample counts sum to 0: nothing to weight by")
    out = {}
    for name in names:
        acc = np.zeros(np.shape(updates[0][0][name]), dtype=np.float64)
        for (delta, _), w in zip(updates, weights, strict=True):
            if w:
                acc += (w / total) * np.asarray(delta[name], dtype=np.float64)
        out[name] = acc.astype(np.asarray(updates[0][0][name]).dtype)
    return out


def trimmed_mean(updates: Sequence[tuple[Weights, float]], trim_fraction: float) -> dict[str, np.ndarray]:
    """Coordinate-wise mean after dropping the floor(trim_fraction * n) largest and smallest
    values of each coordinate. Unweighted: a sample count is exactly what a liar inflates."""
    if not 0.0 <= trim_fraction < 0.5:
        raise ValueError(f"trim_fraction must be in [0, 0.5), got {trim_fraction}")
    names, _ = _checked(updates)
    n = len(updates)
    cut = int(math.floor(trim_fraction * n))
    out = {}
    for name in names:
        stack = np.sort(np.stack([np.asarray(d[name], dtype=np.float64) for d, _ in updates]), axis=0)
        out[name] = stack[cut:n - cut].mean(axis=0).astype(np.asarray(updates[0][0][name]).dtype)
    return out


def coordinate_median(updates: Sequence[tuple[Weights, float]]) -> dict[str, np.ndarray]:
    """Coordinate-wise median (mean of the two middle values for an even count), unweighted."""
    names, _ = _checked(updates)
    out = {}
    for name in names:
        stack = np.stack([np.asarray(d[name], dtype=np.float64) for d, _ in updates])
        out[name] = np.median(stack, axis=0).astype(np.asarray(updates[0][0][name]).dtype)
    return out


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
