"""Data augmentation that survives feature caching: K extra views of each training image,
made before the int8 prefix runs, cached as samples of their own.

A job trains over cached prefix activations, so augmenting inside the training loop is
impossible (the prefix would have to run every epoch). Instead each training sample gets
K fixed views -- a shifted crop, a brightness change, optionally a horizontal flip (off by
default: a mirrored digit is another digit) -- drawn from a generator seeded by the
sample's own content hash, so the same image always yields the same views and a later
job finds them in the feature cache. Views join the training split only; validation stays
the device's real images.
"""

from __future__ import annotations

import numpy as np

from ..data import LocalDataset, sample_hash
from ..errors import UsageError

KINDS = ("crop", "brightness", "flip")
DEFAULT_KINDS = ("crop", "brightness")
MAX_VIEWS = 8


def parse_kinds(text: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    kinds = tuple(k.strip() for k in text.split(",") if k.strip()) if isinstance(text, str) else tuple(text)
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise UsageError(f"augmentation kinds: expected some of {', '.join(KINDS)}, got {text!r:.60}")
    return kinds


def _view(x: np.ndarray, rng: np.random.Generator, kinds: tuple[str, ...]) -> np.ndarray:
    """One view of a normalised (C, H, W) sample."""
    out = x
    if "crop" in kinds:  # shift by up to 1/8 of the side, edges repeated (a camera a little off)
        h, w = x.shape[1:]
        dy, dx = (int(rng.integers(-max(1, s // 8), max(1, s // 8) + 1)) for s in (h, w))
        padded = np.pad(x, ((0, 0), (abs(dy), abs(dy)), (abs(dx), abs(dx))), mode="edge")
        out = padded[:, abs(dy) - dy:abs(dy) - dy + h, abs(dx) - dx:abs(dx) - dx + w]
    if "brightness" in kinds:  # +-15 % of the sample's own range
        spread = float(out.max() - out.min()) or 1.0
        out = out + np.float32(rng.uniform(-0.15, 0.15) * spread)
    if "flip" in kinds and rng.random() < 0.5:
        out = out[:, :, ::-1]
    return np.ascontiguousarray(out, np.float32)


def augmented_views(train: LocalDataset, views: int, *, kinds: tuple[str, ...] = DEFAULT_KINDS,
                    seed: int = 0) -> LocalDataset:
    """`views` views of every sample of `train`, as a dataset of their own (labels kept)."""
    if not isinstance(views, int) or isinstance(views, bool) or not 0 <= views <= MAX_VIEWS:
        raise UsageError(f"augment: expected 0..{MAX_VIEWS} views per image, got {views!r}")
    if views == 0 or len(train) == 0:
        return train.subset(np.empty(0, np.int64))
    xs, ys, hashes = [], [], []
    for i in range(len(train)):
        rng = np.random.default_rng([seed, int(train.hashes[i][:15], 16)])
        for _ in range(views):
            v = _view(train.x[i], rng, kinds)
            xs.append(v)
            ys.append(train.y[i])
            hashes.append(sample_hash(v))
    return LocalDataset(np.stack(xs), np.asarray(ys, np.int64), hashes, train.labels, train.report)


def concat(a: LocalDataset, b: LocalDataset) -> LocalDataset:
    """Two datasets as one (a's labels and report)."""
    return LocalDataset(np.concatenate([a.x, b.x]), np.concatenate([a.y, b.y]), [*a.hashes, *b.hashes], a.labels,
                        a.report)
