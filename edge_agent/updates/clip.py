"""The device's side of a private job's clipping (DP-FedAvg: coordinator/privacy.py).

The job's `dp_clip` C bounds the L2 norm of what the device *sends*. With error feedback the
encoder sends a compressed form of `delta + residual` (encoder.py), so it is that sum that is
clipped: the delta handed to the encoder is `s (delta + residual) - residual`, s = min(1, C /
||delta + residual||). The encoder then encodes exactly `s (delta + residual)`; top-k keeps a
subset of its coordinates (never a longer vector) and int8 rounding adds at most a little
(the coordinator's tolerance, strategies/dp.py). The residual it keeps afterwards is only the
codec's compression error of the clipped vector: what clipping removed, `(1 - s)(delta +
residual)`, is dropped, not fed back -- fed back, a device clipped round after round would
carry an ever longer residual, and each round's contribution is meant to be the clipped one.

Numpy only: the agent imports it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np


def clip_for_privacy(delta: Mapping[str, np.ndarray], clip: float,
                     residual: Mapping[str, np.ndarray] | None = None) -> tuple[dict[str, np.ndarray], float]:
    """(the delta to encode, the norm of delta + residual before clipping). Residual tensors
    the delta does not carry, or of another shape, are left out (the encoder refuses such a
    residual and starts afresh: call again with residual=None then)."""
    if not clip > 0:
        raise ValueError(f"dp_clip must be positive, got {clip!r}")
    res = {n: np.asarray(r, np.float64) for n, r in (residual or {}).items()
           if n in delta and np.shape(r) == np.shape(delta[n])}
    total = {n: np.asarray(d, np.float64) + res.get(n, 0.0) for n, d in delta.items()}
    norm = math.sqrt(sum(float(np.sum(np.square(v))) for v in total.values()))
    scale = 1.0 if norm <= clip or norm == 0 else clip / norm
    return {n: (scale * v - res.get(n, 0.0)).astype(np.float32) for n, v in total.items()}, norm
