"""On-disk cache of backbone features, keyed by (backbone sha256, sample content hash).

The frozen int8 backbone is the expensive part of a fine-tune; its output for a given
sample never changes, so it is computed once. A later job over a grown data set runs the
backbone only on the new samples.

Layout: `<dir>/<backbone sha256>/seg-<ns>-<pid>.feat`, each segment a `write_checked` NPZ
of (hashes, features) for up to `segment_samples` samples. New features are flushed in
segments while they are computed, so a job killed half-way keeps what it had finished.
A segment that fails its checksum or does not match the expected feature shape is deleted
and its samples recomputed.

Size is bounded by `max_bytes` over all backbones: least recently used segments go first
(a segment's mtime is its last use; reading it in a job touches it).

Activations at a deep cut are spatial maps, 4x larger as float32 than the int8 the
prefix computed: given the prefix output's quantisation (`quant=(scale, zero_point)`),
a segment whose values all lie on that grid is stored as int8 plus the two numbers
(lossless: the engine's output was (q - zero_point) * scale); off-grid values (an engine
that calibrates its own scales) stay float32.
"""

from __future__ import annotations

import io
import os
import re
import time
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..atomic import CorruptFileError, FileTooLargeError, fsync_dir, read_checked, write_checked

DEFAULT_MAX_BYTES = 256 << 20
SEGMENT_SAMPLES = 1024
MAX_SEGMENT_BYTES = 256 << 20
_HEX = re.compile(r"^[0-9a-f]{16,64}$")
_SEGMENT = re.compile(r"^seg-\d+-\d+\.feat$")


@dataclass
class CacheStats:
    requested: int = 0
    hits: int = 0
    computed: int = 0
    segments_read: int = 0
    segments_written: int = 0
    corrupt_segments: int = 0
    evicted_segments: int = 0
    bytes_on_disk: int = 0

    def to_json(self) -> dict[str, int]:
        return asdict(self)


def on_grid(features: np.ndarray, quant: tuple[float, int] | None) -> np.ndarray | None:
    """`features` as int8 on the grid (scale, zero_point), or None if any value is off it."""
    if quant is None or features.size == 0:
        return None
    scale, zero = float(quant[0]), int(quant[1])
    if not (scale > 0 and np.isfinite(scale)) or not -128 <= zero <= 127:
        return None
    q = np.rint(features / np.float32(scale)) + zero
    if q.min() < -128 or q.max() > 127:
        return None
    q8 = q.astype(np.int8)
    if not np.array_equal((q8.astype(np.float32) - zero) * np.float32(scale), features.astype(np.float32)):
        return None  # not exactly what an int8 engine at this grid gives back
    return q8


def _encode(hashes: Sequence[str], features: np.ndarray, quant: tuple[float, int] | None = None) -> bytes:
    buf = io.BytesIO()
    # (N, 32) uint8, not an "S32" array: numpy strips trailing NUL bytes from those
    raw = np.frombuffer(b"".join(bytes.fromhex(h) for h in hashes), dtype=np.uint8).reshape(len(hashes), 32)
    q8 = on_grid(features, quant)
    if q8 is not None and quant is not None:
        np.savez(buf, hashes=raw, q=q8, scale=np.float32([quant[0]]), zero_point=np.int32([quant[1]]))
    else:
        np.savez(buf, hashes=raw, features=np.ascontiguousarray(features, dtype=np.float32))
    return buf.getvalue()


def _decode(payload: bytes, feature_shape: tuple[int, ...] | None, where: str) -> tuple[list[str], np.ndarray]:
    try:
        with zipfile.ZipFile(io.BytesIO(payload)) as archive:
            if sum(i.file_size for i in archive.infolist()) > MAX_SEGMENT_BYTES:
                raise CorruptFileError(f"{where}: segment too large")
        npz = np.load(io.BytesIO(payload), allow_pickle=False)
        raw_hashes = npz["hashes"]
        if "q" in npz.files:
            q, scale, zero = npz["q"], npz["scale"], npz["zero_point"]
            if q.dtype != np.int8 or scale.shape != (1,) or zero.shape != (1,) or not np.isfinite(scale).all() \
                    or not scale[0] > 0:
                raise CorruptFileError(f"{where}: bad int8 segment ({q.dtype}, scale {scale!r:.40})")
            features = (q.astype(np.float32) - np.float32(zero[0])) * np.float32(scale[0])
        else:
            features = npz["features"]
    except CorruptFileError:
        raise
    except (zipfile.BadZipFile, KeyError, ValueError, OSError, EOFError) as exc:
        raise CorruptFileError(f"{where}: unreadable segment ({exc})") from None
    if raw_hashes.dtype != np.uint8 or raw_hashes.ndim != 2 or raw_hashes.shape[1] != 32 \
            or features.dtype != np.float32 \
            or len(features) != len(raw_hashes):
        raise CorruptFileError(f"{where}: unexpected arrays {raw_hashes.dtype}{raw_hashes.shape} / "
                               f"{features.dtype}{features.shape}")
    if feature_shape is not None and tuple(features.shape[1:]) != tuple(feature_shape):
        raise CorruptFileError(f"{where}: features of shape {features.shape[1:]}, expected {feature_shape}")
    if not np.isfinite(features).all():
        raise CorruptFileError(f"{where}: non-finite features")
    return [row.tobytes().hex() for row in raw_hashes], features


class FeatureCache:
    """Backbone features on disk, bounded by `max_bytes` with LRU eviction of segments."""

    def __init__(self, directory: str | os.PathLike[str], *, max_bytes: int = DEFAULT_MAX_BYTES,
                 segment_samples: int = SEGMENT_SAMPLES) -> None:
        if max_bytes < 0 or segment_samples < 1:
            raise ValueError("max_bytes must be >= 0 and segment_samples >= 1")
        self.dir = Path(directory)
        self.max_bytes = int(max_bytes)
        self.segment_samples = int(segment_samples)
        self.dir.mkdir(parents=True, exist_ok=True)

    def _namespace(self, backbone_sha256: str) -> Path:
        if not _HEX.match(backbone_sha256):
            raise ValueError(f"backbone hash must be lowercase hex, got {backbone_sha256[:80]!r}")
        return self.dir / backbone_sha256

    def _segments(self) -> list[Path]:
        return [seg for ns in self.dir.iterdir() if ns.is_dir() and _HEX.match(ns.name)
                for seg in ns.iterdir() if _SEGMENT.match(seg.name)]

    def features(
        self,
        backbone_sha256: str,
        hashes: Sequence[str],
        x: np.ndarray,
        compute: Callable[[np.ndarray], np.ndarray],
        *,
        batch_size: int = 64,
        feature_shape: tuple[int, ...] | None = None,
        progress: Callable[[int, int], None] | None = None,
        quant: tuple[float, int] | None = None,
    ) -> tuple[np.ndarray, CacheStats]:
        """Features for samples `x` (content hashes `hashes`), computing only the missing.

        `compute` is the backbone (e.g. `Runner.run`): float32 batch -> float32 features.
        `progress(done, total)` is called after each computed batch. `quant`: the backbone
        output's (scale, zero_point), to store on-grid features as int8 (module doc).
        """
        if len(hashes) != len(x):
            raise ValueError(f"{len(hashes)} hashes for {len(x)} samples")
        stats = CacheStats(requested=len(hashes))
        namespace = self._namespace(backbone_sha256)
        namespace.mkdir(parents=True, exist_ok=True)
        wanted = {h: i for i, h in enumerate(hashes)}
        out: np.ndarray | None = None
        found = np.zeros(len(hashes), dtype=bool)
        for seg in sorted(p for p in namespace.iterdir() if _SEGMENT.match(p.name)):
            try:
                seg_hashes, seg_features = _decode(read_checked(seg, MAX_SEGMENT_BYTES), feature_shape, str(seg))
            except FileNotFoundError:
                continue
            except (CorruptFileError, FileTooLargeError):
                stats.corrupt_segments += 1
                seg.unlink(missing_ok=True)
                continue
            stats.segments_read += 1
            used = False
            for row, digest in enumerate(seg_hashes):
                index = wanted.get(digest)
                if index is None or found[index]:
                    continue
                if out is None:
                    out = np.empty((len(hashes), *seg_features.shape[1:]), np.float32)
                if out.shape[1:] != seg_features.shape[1:]:
                    continue  # another shape in the same namespace: ignore, recompute
                out[index] = seg_features[row]
                found[index] = used = True
            if used:
                os.utime(seg)  # last use, for LRU
        stats.hits = int(found.sum())
        missing = np.flatnonzero(~found)
        pending_hashes: list[str] = []
        pending: list[np.ndarray] = []
        for start in range(0, len(missing), max(1, batch_size)):
            idx = missing[start:start + batch_size]
            feats = np.asarray(compute(np.ascontiguousarray(x[idx], dtype=np.float32)), dtype=np.float32)
            if len(feats) != len(idx) or (feature_shape is not None and tuple(feats.shape[1:]) != tuple(feature_shape)):
                raise ValueError(f"backbone returned {feats.shape} for a batch of {len(idx)}"
                                 + (f", expected (N, {', '.join(map(str, feature_shape))})" if feature_shape else ""))
            if out is None:
                out = np.empty((len(hashes), *feats.shape[1:]), np.float32)
            out[idx] = feats
            stats.computed += len(idx)
            pending_hashes.extend(hashes[i] for i in idx)
            pending.append(feats)
            if len(pending_hashes) >= self.segment_samples:
                self._flush(namespace, pending_hashes, pending, stats, quant)
                pending_hashes, pending = [], []
            if progress is not None:
                progress(start + len(idx), len(missing))
        if pending_hashes:
            self._flush(namespace, pending_hashes, pending, stats, quant)
        self._evict(stats)
        if out is None:  # no samples at all
            out = np.empty((0, *(feature_shape or ())), np.float32)
        return out, stats

    def _flush(self, namespace: Path, hashes: list[str], parts: list[np.ndarray], stats: CacheStats,
               quant: tuple[float, int] | None) -> None:
        name = f"seg-{time.time_ns()}-{os.getpid()}.feat"
        write_checked(namespace / name, _encode(hashes, np.concatenate(parts), quant))
        stats.segments_written += 1

    def _evict(self, stats: CacheStats) -> None:
        """Delete least recently used segments until the cache fits in max_bytes."""
        entries = []
        for seg in self._segments():
            try:
                st = seg.stat()
            except FileNotFoundError:
                continue
            entries.append((st.st_mtime_ns, seg.name, seg, st.st_size))
        entries.sort()
        total = sum(e[3] for e in entries)
        touched: set[Path] = set()
        for _, _, seg, size in entries:
            if total <= self.max_bytes:
                break
            seg.unlink(missing_ok=True)
            total -= size
            stats.evicted_segments += 1
            touched.add(seg.parent)
        for directory in touched:
            fsync_dir(directory)
        stats.bytes_on_disk = total

    def size_bytes(self) -> int:
        return sum(seg.stat().st_size for seg in self._segments())
