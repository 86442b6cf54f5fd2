"""The coordinator's own evidence: a small labelled server set, split once by content hash
into a gate split (scores every candidate version: gate.py) and a root split (the server's
own update and class directions for the trust rule: strategies/trust.py).

`TailEvidence` works on features at the model's trainable tail (what the devices' int8
backbone gives them) with the project's own head trainer (train/dense_head.py: numpy for a
dense head or a tail numpy computes, MXNet Gluon otherwise), so the server trains exactly as
a device does. Where the features come from is the caller's: `server_set.py` runs a bundle's
int8 prefix on the server set's images; the fleet simulation gives its own.

Everything is deterministic (seeded batch order), so serve workers computing the same round's
evidence get the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..errors import InputError
from .strategies.base import ServerEvidence
from .streaming import Layout

GATE_SHARE = 0.6  # of the server set's samples: the rest is the root split
MIN_GATE = 20  # fewer gate samples than this cannot judge a version
MIN_ROOT = 10  # fewer root samples than this: no server update (no trust rule)
MAX_EPOCH_SCALE = 10


@dataclass(frozen=True)
class SplitData:
    """Features (N, ...) float32 at the tail's input and labels (N,) int64, per split."""

    root_x: np.ndarray
    root_y: np.ndarray
    gate_x: np.ndarray
    gate_y: np.ndarray
    num_classes: int

    def __post_init__(self) -> None:
        for x, y, what in ((self.root_x, self.root_y, "root"), (self.gate_x, self.gate_y, "gate")):
            if len(x) != len(y):
                raise InputError(f"server set {what} split: {len(x)} samples but {len(y)} labels")
            if len(y) and (int(np.min(y)) < 0 or int(np.max(y)) >= self.num_classes):
                raise InputError(f"server set {what} split: labels outside 0..{self.num_classes - 1}")

    @property
    def can_gate(self) -> bool:
        return len(self.gate_y) >= MIN_GATE

    @property
    def can_train(self) -> bool:
        return len(self.root_y) >= MIN_ROOT


def split_by_hash(digests: list[bytes], gate_share: float = GATE_SHARE) -> tuple[np.ndarray, np.ndarray]:
    """(root indices, gate indices): a sample's split depends on its own content hash only, so
    adding samples to a server set never moves the old ones from one split to the other."""
    cut = int(round(gate_share * 2**32))
    gate = np.array([int.from_bytes(d[:4], "big") < cut for d in digests], dtype=bool)
    idx = np.arange(len(digests))
    return idx[~gate], idx[gate]


class TailEvidence:
    """Gate scores, the server update and class gradients of heads of one model version."""

    def __init__(self, *, data: SplitData, symbol_json: str, input_name: str, layout: Layout,
                 config: Any, backend: str = "auto") -> None:
        self.data, self.symbol_json, self.input_name = data, symbol_json, input_name
        self.layout, self.config, self.backend = layout, config, backend
        self._correct: dict[str, np.ndarray] = {}

    def _trainer(self, head: Mapping[str, np.ndarray], config: Any = None) -> Any:
        from ..train.dense_head import make_head_trainer

        shape = tuple(self.data.gate_x.shape[1:] or self.data.root_x.shape[1:])
        return make_head_trainer(symbol_json=self.symbol_json, params=head, input_name=self.input_name,
                                 num_classes=self.data.num_classes, config=config or self.config,
                                 backend=self.backend, input_shape=shape)

    def _flat(self, tensors: Mapping[str, np.ndarray]) -> np.ndarray:
        parts = []
        for name in self.layout.names:
            t = tensors.get(name)
            size = math.prod(self.layout.shapes[name])
            parts.append(np.zeros(size) if t is None else np.asarray(t, np.float64).ravel())
        return np.concatenate(parts) if parts else np.zeros(0)

    def _gate_logits(self, head: Mapping[str, np.ndarray]) -> np.ndarray:
        if not self.data.can_gate:
            raise InputError(f"the server set's gate split has {len(self.data.gate_y)} samples, fewer than {MIN_GATE}")
        return np.asarray(self._trainer(head).predict(self.data.gate_x), np.float64)

    def scored(self, head: Mapping[str, np.ndarray]) -> tuple[np.ndarray, float]:
        """(per gate sample: right or not, the mean cross-entropy) from one forward pass: the
        loss tells apart heads whose counts of right answers tie or differ by noise."""
        from ..train.dense_head import log_softmax

        logits = self._gate_logits(head)
        if not np.isfinite(logits).all():
            raise InputError("the head's outputs on the server set are not finite")
        y = self.data.gate_y
        return logits.argmax(axis=1) == y, float(-log_softmax(logits)[np.arange(len(y)), y].mean())

    def correct(self, head: Mapping[str, np.ndarray], key: str | None = None) -> np.ndarray:
        """Per gate sample: does `head` classify it right (bool). Cached by `key` (a version)."""
        if key is not None and key in self._correct:
            return self._correct[key]
        out = self._gate_logits(head).argmax(axis=1) == self.data.gate_y
        if key is not None:
            if len(self._correct) > 64:
                self._correct.clear()
            self._correct[key] = out
        return out

    def server_evidence(self, head: Mapping[str, np.ndarray], *, device_samples: float | None = None
                        ) -> ServerEvidence | None:
        """The base `head` trained on the root split as a device trains (as many steps as a
        device holding `device_samples` would take), and each class's loss gradient at it."""
        d = self.data
        if not d.can_train:
            return None
        cfg = self.config
        per_epoch = max(1, -(-len(d.root_y) // cfg.batch_size))
        if device_samples:
            want = cfg.epochs * max(1, -(-int(device_samples) // cfg.batch_size))
            cfg = replace(cfg, epochs=int(min(cfg.epochs * MAX_EPOCH_SCALE, max(cfg.epochs, -(-want // per_epoch)))))
        trainer = self._trainer(head, cfg)
        for epoch in range(cfg.epochs):
            for b in range(per_epoch):
                idx = trainer.batch_indices(len(d.root_y), epoch, b)
                if len(idx):
                    trainer.step(d.root_x[idx], d.root_y[idx])
        trained = trainer.params()
        update = self._flat({n: np.asarray(trained[n], np.float64) - np.asarray(head[n], np.float64)
                             for n in trained if n in head})
        fresh = self._trainer(head)
        grads = np.zeros((d.num_classes, self.layout.size))
        counts = np.bincount(d.root_y, minlength=d.num_classes)
        for c in range(d.num_classes):
            if counts[c]:
                pick = d.root_y == c
                grads[c] = self._flat(fresh.gradients(d.root_x[pick], d.root_y[pick]))
        if not (np.isfinite(update).all() and np.isfinite(grads).all()):
            raise InputError("the server update on the root split is not finite (learning rate too high?)")
        return ServerEvidence(update=update, class_gradients=grads, root_counts=counts, weight=float(len(d.root_y)))
