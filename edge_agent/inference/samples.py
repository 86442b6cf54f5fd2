"""Labelled samples an application gives the device, stored into the data set the
fine-tune reads (agent.toml [data] dir; edge_agent.data's image-folder layout):

    <data>/<label>/<hash>.png    integer 0..255 pixels, 1 or 3 channels, at the model's input size
    <data>/<label>/<hash>.npy    any other raw values (C, H, W) float32

`<hash>` is the first 40 hex digits of edge_agent.data.sample_hash of the normalised
sample -- the hash the loader deduplicates by and splits train / validation by, so a sample
the service holds out is the sample the fine-tune validates on and the guard judges by.

Every write is atomic (edge_agent.atomic: temp file, fsync, rename, fsync dir): a kill -9
at any point leaves the sample either whole in its label folder or not there at all (a
hidden temp file, which the loader ignores and the next start removes). The answer is sent
only after the rename is durable, so an acknowledged sample is never lost.

Limits: `max_per_label` samples per label and `max_bytes` in all; the oldest sample of the
label (or of the whole set, for bytes) makes room -- the application's newest samples are
the ones that describe the device's world now. Samples older than `max_age_days` are pruned.
Only files this store named (a 40-hex-digit stem) are ever evicted; a user's own images in
the same folders count for nothing here and are never touched.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic import atomic_write_bytes, fsync_dir
from ..data import ARRAY_SUFFIX, hash_fraction, sample_hash
from ..errors import InputError
from ..sample_decode import decode_array_sample, decode_image_bytes

log = logging.getLogger(__name__)
HASH_CHARS = 40
_STEM_RE = re.compile(r"^[0-9a-f]{40}$")
VAL_FRACTION = 0.2  # edge_agent.data.DEFAULT_VAL_FRACTION: the same split as the fine-tune's
MAX_SAMPLE_FILE = 64 << 20


class UnknownLabel(InputError):
    """A label that is not one of the model's."""


@dataclass
class _Entry:
    label: str
    path: Path
    size: int
    mtime: float


@dataclass(frozen=True)
class Stored:
    """What happened to a posted sample."""

    status: str  # "stored" | "duplicate" | "relabelled"
    sample_hash: str
    label: str
    path: str
    held_out: bool  # in the validation split (the guard judges models on it; never trained on)
    evicted: list[str] = field(default_factory=list)


def held_out(content_hash: str) -> bool:
    """In the validation split (edge_agent.data.split_indices decides it from the hash alone)."""
    return hash_fraction(content_hash) < VAL_FRACTION


class SampleStore:
    """The service's writer into the data set. Thread-safe (one lock around the index)."""

    def __init__(self, *, root: str | os.PathLike[str], spec: Any, labels: list[str], max_per_label: int = 1000,
                 max_bytes: int = 256 << 20, max_age_days: float | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        if max_per_label < 1 or max_bytes < 1:
            raise ValueError("max_per_label and max_bytes must be >= 1")
        self.root = Path(root)
        self.spec, self.labels = spec, list(labels)
        self.max_per_label, self.max_bytes = int(max_per_label), int(max_bytes)
        self.max_age_s = None if max_age_days is None else float(max_age_days) * 86400.0
        self.clock = clock
        self._lock = threading.Lock()
        self._index: dict[str, _Entry] = {}
        self.version = 0  # bumps on every change: callers cache what they computed from the set
        self.root.mkdir(parents=True, exist_ok=True)
        self._scan()

    # ---- index ----
    def _scan(self) -> None:
        for folder in sorted(p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")):
            for item in folder.iterdir():
                if item.name.startswith(".") and item.name.endswith(".tmp"):  # a write a crash cut short
                    item.unlink(missing_ok=True)
                    continue
                if not item.is_file() or not _STEM_RE.match(item.stem):
                    continue
                st = item.stat()
                self._index[item.stem] = _Entry(folder.name, item, st.st_size, st.st_mtime)

    def __len__(self) -> int:
        return len(self._index)

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self._index.values())

    def counts(self) -> dict[str, int]:
        with self._lock:
            out = dict.fromkeys(self.labels, 0)
            for e in self._index.values():
                out[e.label] = out.get(e.label, 0) + 1
            return out

    def check_label(self, label: str) -> str:
        if label not in self.labels:
            shown = ", ".join(self.labels[:20]) + (" ..." if len(self.labels) > 20 else "")
            raise UnknownLabel(f"label {label[:64]!r} is not one of the model's labels ({shown})")
        return label

    # ---- writing ----
    def _encode(self, raw: np.ndarray) -> tuple[bytes, str]:
        sample = np.asarray(raw, np.float32).reshape(self.spec.shape)
        c = sample.shape[0]
        if c in (1, 3) and sample.min() >= 0 and sample.max() <= 255 and np.array_equal(sample, np.rint(sample)):
            from PIL import Image

            pixels = sample.astype(np.uint8)
            img = Image.fromarray(pixels[0] if c == 1 else pixels.transpose(1, 2, 0), "L" if c == 1 else "RGB")
            buf = io.BytesIO()
            img.save(buf, format="PNG")
            data = buf.getvalue()
            back = decode_image_bytes(data, self.spec)  # what the loader will read: the same numbers
            if np.array_equal(back.reshape(sample.shape), sample):
                return data, ".png"
        buf = io.BytesIO()
        np.save(buf, sample, allow_pickle=False)
        return buf.getvalue(), ARRAY_SUFFIX

    def add(self, raw: np.ndarray, label: str) -> Stored:
        """Store one raw (1, C, H, W) or (C, H, W) sample under `label`, durably."""
        self.check_label(label)
        sample = np.asarray(raw, np.float32).reshape(1, *self.spec.shape)
        digest = sample_hash(self.spec.normalise(sample)[0])
        key = digest[:HASH_CHARS]
        with self._lock:
            entry = self._index.get(key)
            if entry is not None and entry.path.exists():
                if entry.label == label:
                    return Stored("duplicate", digest, label, str(entry.path), held_out(digest))
                target = self.root / label / entry.path.name
                target.parent.mkdir(exist_ok=True)
                os.replace(entry.path, target)
                fsync_dir(target.parent)
                fsync_dir(entry.path.parent)
                self._index[key] = _Entry(label, target, entry.size, entry.mtime)
                self.version += 1
                return Stored("relabelled", digest, label, str(target), held_out(digest))
            data, suffix = self._encode(sample)
            if len(data) > self.max_bytes:
                raise InputError(f"one sample is {len(data)} bytes, over the store's {self.max_bytes}-byte quota")
            evicted = self._make_room(label, len(data))
            target = self.root / label / f"{key}{suffix}"
            atomic_write_bytes(target, data, mode=0o640)
            self._index[key] = _Entry(label, target, len(data), self.clock())
            self.version += 1
            return Stored("stored", digest, label, str(target), held_out(digest), evicted)

    def _make_room(self, label: str, incoming: int) -> list[str]:
        evicted: list[str] = []
        mine = sorted((e.mtime, k) for k, e in self._index.items() if e.label == label)
        while len(mine) >= self.max_per_label:
            evicted.append(self._remove(mine.pop(0)[1]))
        if self.total_bytes + incoming > self.max_bytes:
            oldest = sorted((e.mtime, k) for k, e in self._index.items())
            while oldest and self.total_bytes + incoming > self.max_bytes:
                evicted.append(self._remove(oldest.pop(0)[1]))
        return evicted

    def _remove(self, key: str) -> str:
        entry = self._index.pop(key)
        with contextlib.suppress(FileNotFoundError):
            entry.path.unlink()
            fsync_dir(entry.path.parent)
        return key

    def prune(self) -> int:
        """Remove samples older than max_age_days; how many went."""
        if self.max_age_s is None:
            return 0
        cutoff = self.clock() - self.max_age_s
        with self._lock:
            old = [k for k, e in self._index.items() if e.mtime < cutoff]
            for key in old:
                self._remove(key)
            if old:
                self.version += 1
        return len(old)

    # ---- reading ----
    def held_out_set(self) -> tuple[np.ndarray, np.ndarray]:
        """The validation split of the stored samples: raw (N, C, H, W) and label indices."""
        with self._lock:  # the split needs only the hash's first digits: the file name's
            chosen = sorted((k, e) for k, e in self._index.items() if e.label in self.labels and held_out(k))
        xs, ys = [], []
        for _, entry in chosen:
            try:
                data = entry.path.read_bytes()
                raw = (decode_array_sample(data, self.spec) if entry.path.suffix == ARRAY_SUFFIX
                       else decode_image_bytes(data, self.spec))
            except (OSError, ValueError) as exc:  # evicted meanwhile, or damaged on disk
                log.warning("sample %s unreadable: %s", entry.path, exc)
                continue
            xs.append(raw[0])
            ys.append(self.labels.index(entry.label))
        if not xs:
            return np.empty((0, *self.spec.shape), np.float32), np.empty(0, np.int64)
        return np.stack(xs), np.asarray(ys, np.int64)
