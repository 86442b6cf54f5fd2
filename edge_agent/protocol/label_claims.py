"""What a device says about the labels it trained on, as carried in its update's metrics.

- `label_counts`: its training samples per class, "12,0,5,...".
- `label_predicted`: the mean class probabilities the model it was given assigns to those same
  samples before training, in parts per PREDICTED_SCALE, "1150,480,...". Training moves the
  output bias along counts/total - predicted (the bias gradient of the cross-entropy), which
  is what the coordinator's label-claim check compares the update with
  (coordinator/strategies/claims.py).

Both come from the device, so the coordinator validates them and treats them as claims: an
unusable one is None, never an error.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

PREDICTED_SCALE = 10_000
MAX_COUNT = 10**9
MAX_TEXT = 256  # a result metric's longest string (coordinator/service_messages.py)
SUM_TOLERANCE = 0.02  # rounding each of up to ~50 classes to 1/PREDICTED_SCALE stays well inside


@dataclass(frozen=True)
class LabelClaims:
    """A device's claims for one update: what it trained on and what its base predicted there."""

    counts: tuple[int, ...]
    predicted: tuple[float, ...]

    @classmethod
    def of(cls, probabilities: np.ndarray, labels: np.ndarray, class_weight: np.ndarray | None = None
           ) -> LabelClaims:
        """From the base model's class probabilities (N, classes) on the training samples (the
        trainer's softmax: train/dense_head.log_softmax) and their labels. With per-class loss
        weights (--balance) the gradient mixes the classes by weight x count, so the counts are
        those shares of N and the predictions are weighted the same."""
        p = np.asarray(probabilities, np.float64)
        y = np.asarray(labels, np.intp)  # bincount takes the platform int (int32 on armhf)
        w = np.ones(len(y)) if class_weight is None else np.asarray(class_weight, np.float64)[y]
        if not len(y) or w.sum() <= 0:
            return cls(tuple([0] * p.shape[1]), tuple([0.0] * p.shape[1]))
        probs = (w[:, None] * p).sum(axis=0) / w.sum()
        counts = np.bincount(y, weights=w, minlength=p.shape[1]) * (len(y) / w.sum())
        return cls(tuple(int(round(c)) for c in counts), tuple(float(p) for p in probs))

    def to_json(self) -> dict[str, list[Any]]:
        return {"counts": list(self.counts), "predicted": [round(p, 6) for p in self.predicted]}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> LabelClaims:
        return cls(tuple(int(c) for c in d["counts"]), tuple(float(p) for p in d["predicted"]))

    def metrics(self) -> dict[str, str]:
        """The update metrics that carry them (each left out when it would not fit)."""
        out = {"label_counts": encode_counts(self.counts), "label_predicted": encode_predicted(self.predicted)}
        return {k: v for k, v in out.items() if v is not None}


def encode_counts(counts: Sequence[int]) -> str | None:
    """The metric text for per-class counts; None when there are none or it would not fit."""
    text = ",".join(str(int(c)) for c in counts)
    return text if 0 < len(text) <= MAX_TEXT else None


def decode_counts(raw: Any, num_classes: int) -> tuple[int, ...] | None:
    """A device's reported per-class counts, validated: None when absent or unusable."""
    counts = _integers(raw, num_classes, 16, MAX_COUNT)
    return counts if counts is not None and any(counts) else None


def _integers(raw: Any, num_classes: int, max_chars: int, most: int) -> tuple[int, ...] | None:
    """One comma-separated integer in [0, most] per class, or None."""
    if not isinstance(raw, str) or len(raw) > max_chars * num_classes + 16:
        return None
    try:
        values = tuple(int(v) for v in raw.split(","))
    except ValueError:
        return None
    if len(values) != num_classes or any(v < 0 or v > most for v in values):
        return None
    return values


def encode_predicted(probabilities: Sequence[float]) -> str | None:
    """The metric text for mean predicted probabilities; None when not finite or too long."""
    if not probabilities or not all(math.isfinite(p) for p in probabilities):
        return None
    text = ",".join(str(round(min(max(float(p), 0.0), 1.0) * PREDICTED_SCALE)) for p in probabilities)
    return text if len(text) <= MAX_TEXT else None


def decode_predicted(raw: Any, num_classes: int) -> tuple[float, ...] | None:
    """A device's reported mean predicted probabilities, validated and renormalised: None when
    absent, of the wrong length, out of range or not summing to one."""
    parts = _integers(raw, num_classes, 8, PREDICTED_SCALE)
    if parts is None:
        return None
    total = sum(parts)
    if abs(total - PREDICTED_SCALE) > SUM_TOLERANCE * PREDICTED_SCALE:
        return None
    return tuple(p / total for p in parts)
