"""Streaming aggregation's machinery (issue 18): O(1) work per received update, bounded
memory at close. The rules themselves are in strategies/; this module holds what they share.

The coordinator keeps what arrived (the signed, compressed payload, ~40 kB for a 1M-parameter
head at 2 %) and never a dense copy. Each update is decoded ONCE at arrival into a sparse
vector over the head's flat coordinates (`decode_sparse`: positions + float32 values, the
tensors concatenated in the base head's order, as `Layout` lays them out), its norm is
taken, and the round's rule folds it into its partial (strategies/base.py).

Coordinate-wise rules (median, trimmed mean, median trust) need per coordinate only the
entries that can land in the sorted window [lo, hi): a coordinate whose negatives all sort
below `lo` and positives all above `hi` has a window of zeros (`sparse_window_sum`). The
signs per coordinate (`SignCounts`, 8 bytes per coordinate) are counted as updates arrive,
so at close the "hot" coordinates are known without reading an update; only their entries
are gathered, in passes over the stored updates that each hold at most `cache_bytes`
(8 bytes per entry), and sorted by blocks of `block_bytes` (`block_window_mean`). With
sparse updates from many devices few coordinates are hot: 10,000 x 1M at 2 % used to
re-decode every update for each of ~136 blocks (about an hour of decoding). Updates are
decoded once and kept when all of them fit in `cache_bytes`. Multi-Krum's Gram matrix runs
by dense coordinate blocks of N rows (`block_gram`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..updates.codec import EncodedTensor
from ..updates.errors import UpdateFormatError
from ..updates.indices import decode_indices
from ..updates.quantize import dequantize

BLOCK_BYTES = 64 << 20  # working memory of one coordinate block
CACHE_BYTES = 256 << 20  # decode every update once if all of them fit here


class Layout:
    """The head's tensors as one flat float vector: name -> (offset, shape)."""

    def __init__(self, head: Mapping[str, np.ndarray]) -> None:
        self.names = list(head)
        self.shapes = {n: tuple(np.shape(head[n])) for n in self.names}
        self.offsets: dict[str, int] = {}
        off = 0
        for n in self.names:
            self.offsets[n] = off
            off += math.prod(self.shapes[n])
        self.size = off

    def unflatten(self, vec: np.ndarray, dtype: type = np.float32) -> dict[str, np.ndarray]:
        return {n: vec[self.offsets[n]:self.offsets[n] + math.prod(self.shapes[n])].reshape(self.shapes[n])
                .astype(dtype) for n in self.names}


@dataclass(frozen=True)
class Sparse:
    """One decoded update: sorted unique flat positions (int32 below 2**31 coordinates), their
    float32 values, its norm."""

    idx: np.ndarray
    vals: np.ndarray
    norm: float  # float64 L2 norm (inf if it overflows)
    max_abs: float
    present: tuple[int, ...] | None = None  # the layout's tensors it carries (None: all)

    @property
    def kept(self) -> int:
        return int(self.idx.size)

    def dot(self, other: Sparse) -> float:
        common, ia, ib = np.intersect1d(self.idx, other.idx, assume_unique=True, return_indices=True)
        return _dot(self.vals[ia].astype(np.float64), other.vals[ib].astype(np.float64))

    def dot_dense(self, vec: np.ndarray) -> float:
        return _dot(self.vals.astype(np.float64), vec[self.idx])


def _dot(a: np.ndarray, b: np.ndarray) -> float:
    """Not BLAS: multi-threaded ddot on a busy 2-core machine took ~25 ms for 20k values."""
    return float(np.multiply(a, b).sum())


def norm2(vec: np.ndarray) -> float:
    return math.sqrt(_dot(vec, vec))


def _stats(idx: np.ndarray, vals: np.ndarray, present: tuple[int, ...] | None = None) -> Sparse:
    v64 = vals.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        norm = math.sqrt(_dot(v64, v64)) if v64.size else 0.0
    return Sparse(idx, vals, norm, float(np.abs(v64).max()) if v64.size else 0.0, present)


def decode_sparse(encoded: Sequence[EncodedTensor], layout: Layout) -> Sparse:
    """The sparse flat vector of a received update (its table already checked against the
    head's). A tensor the update leaves out (a job at one depth of a multi-depth model) has
    no values and is not in `present`, so FedAvg averages it over the updates that trained
    it (`per_tensor_mean`), not as a zero. Raises UpdateFormatError for bad codes (NaN/Inf raw values included)."""
    by_name = {e.spec.name: e for e in encoded}
    parts_i, parts_v = [], []
    for name in layout.names:
        e = by_name.get(name)
        if e is None:
            continue
        n = e.spec.numel
        if not 0 <= e.k <= n:
            raise UpdateFormatError(f"tensor {name!r}: k={e.k} is outside 0..{n}")
        idx = decode_indices(e.index_kind, e.index_bytes, e.k, n, where=f"tensor {name!r} indices")
        vals = dequantize(e.value_bytes, e.k, e.bits, e.scale, where=f"tensor {name!r} values")
        parts_i.append(idx + layout.offsets[name])
        parts_v.append(vals)
    idx = np.concatenate(parts_i) if parts_i else np.empty(0, np.int64)
    vals = np.concatenate(parts_v) if parts_v else np.empty(0, np.float32)
    present = None if all(n in by_name for n in layout.names) else \
        tuple(i for i, n in enumerate(layout.names) if n in by_name)
    return _stats(idx.astype(_index_dtype(layout.size)), vals.astype(np.float32), present)


def _index_dtype(size: int) -> type:
    return np.int32 if size < 2**31 else np.int64  # 8 bytes per kept entry instead of 12


def sparse_from_dense(delta: Mapping[str, np.ndarray], layout: Layout) -> Sparse:
    """A dense delta (a legacy stored .npz) as a Sparse over the layout."""
    flat = np.concatenate([np.asarray(delta[n], np.float32).ravel() for n in layout.names]) if layout.names \
        else np.empty(0, np.float32)
    idx = np.flatnonzero(flat).astype(_index_dtype(layout.size))
    return _stats(idx, flat[idx])


class SignCounts:
    """Per coordinate: how many of a set of updates are negative there, and how many positive
    (int32; each update holds a position at most once). What the coordinate-wise rules need
    to tell which coordinates' windows can hold a non-zero value."""

    def __init__(self, size: int) -> None:
        self.neg = np.zeros(size, dtype=np.int32)
        self.pos = np.zeros(size, dtype=np.int32)

    def add(self, sp: Sparse, sign: int = 1) -> None:
        self.neg[sp.idx[sp.vals < 0]] += sign
        self.pos[sp.idx[sp.vals > 0]] += sign

    def copy(self) -> SignCounts:
        out = SignCounts(0)
        out.neg, out.pos = self.neg.copy(), self.pos.copy()
        return out

    @classmethod
    def of(cls, loads: Sequence[Callable[[], Sparse]], size: int) -> SignCounts:
        """Counted by one pass over the updates."""
        out = cls(size)
        for load in loads:
            out.add(load())
        return out


def _blocks(size: int, entries: int, n: int, block_bytes: int) -> list[tuple[int, int]]:
    """Coordinate ranges whose dense n-row block (8 n bytes per coordinate) or entries fit
    in block_bytes."""
    per_coord = max(entries / max(size, 1) * 48, 8.0 * n)
    width = max(1, int(block_bytes // max(per_coord, 1.0)))
    return [(a, min(size, a + width)) for a in range(0, size, width)] or [(0, 0)]


def _ranges(need: np.ndarray, budget: int) -> list[tuple[int, int]]:
    """Split [0, len(need)) into contiguous ranges of at most `budget` needed entries each
    (a coordinate needing more gets a range of its own)."""
    cum = np.cumsum(need, dtype=np.int64)
    out, a, base = [], 0, 0
    while a < need.size:
        b = max(a + 1, int(np.searchsorted(cum, base + budget, side="right")))
        out.append((a, b))
        base, a = int(cum[b - 1]), b
    return out


def _source(loads: Sequence[Callable[[], Sparse]], kept: int, cache_bytes: int) -> Callable[[int], Sparse]:
    """Update i, decoded on first use and kept if all of them fit in cache_bytes."""
    if 8 * kept > cache_bytes:  # int32 position + float32 value per entry
        return lambda i: loads[i]()
    cache: dict[int, Sparse] = {}

    def get(i: int) -> Sparse:
        if i not in cache:
            cache[i] = loads[i]()
        return cache[i]
    return get


def block_window_mean(loads: Sequence[Callable[[], Sparse]], kept: int, size: int, lo: int, hi: int, *,
                      signs: SignCounts | None = None, block_bytes: int = BLOCK_BYTES,
                      cache_bytes: int = CACHE_BYTES) -> np.ndarray:
    """Coordinate-wise mean of the sorted positions [lo, hi) over the updates `loads`
    (median / trimmed mean). `kept` = their total entries; `signs` = their SignCounts (one
    extra pass over the updates without it). Only the entries of hot coordinates are
    gathered, in passes of at most cache_bytes; then sorted by blocks of block_bytes."""
    n = len(loads)
    get = _source(loads, kept, cache_bytes)
    if signs is None:
        signs = SignCounts.of([lambda i=i: get(i) for i in range(n)], size)
    neg, pos = signs.neg, signs.pos
    hot = (neg > lo) | (pos > n - hi)  # a window that can hold a non-zero value
    need = np.where(hot, neg.astype(np.int64) + pos, 0)
    out = np.zeros(size, dtype=np.float64)
    if not need.any():
        return out  # every window holds zeros only: nothing to read
    for a, b in _ranges(need, max(1, cache_bytes // 8)):
        if not need[a:b].any():
            continue
        parts = []  # per update: its hot entries in [a, b)
        for i in range(n):
            sp = get(i)
            s, e = np.searchsorted(sp.idx, (a, b))
            idx = sp.idx[s:e]
            pick = hot[idx]
            parts.append((idx[pick], sp.vals[s:e][pick]))
        _window_blocks(parts, out, a, b, need, signs, n, lo, hi, block_bytes)
    return out


def _window_blocks(parts: Sequence[tuple[np.ndarray, np.ndarray]], out: np.ndarray, a: int, b: int,
                   need: np.ndarray, signs: SignCounts, n: int, lo: int, hi: int, block_bytes: int) -> None:
    """out[a:b] = the window means, from the updates' hot entries in [a, b) (`parts`), sorted
    by blocks of at most block_bytes (~48 bytes an entry while sorting)."""
    for c, d in _ranges(need[a:b], max(1, block_bytes // 48)):
        c, d = c + a, d + a
        cs, vs = [], []
        for idx, vals in parts:
            s, e = np.searchsorted(idx, (c, d))
            cs.append(idx[s:e] - c)
            vs.append(vals[s:e])
        out[c:d] = sparse_window_sum(np.concatenate(cs), np.concatenate(vs), n, lo, hi, d - c,
                                     counts=(signs.neg[c:d], signs.pos[c:d])) / (hi - lo)


def block_gram(loads: Sequence[Callable[[], Sparse]], kept: int, size: int, *,
               block_bytes: int = BLOCK_BYTES, cache_bytes: int = CACHE_BYTES) -> np.ndarray:
    """G_ij = <d_i, d_j> (float64) by dense coordinate blocks of n rows."""
    n = len(loads)
    get = _source(loads, kept, cache_bytes)
    gram = np.zeros((n, n), dtype=np.float64)
    for a, b in _blocks(size, kept, n, block_bytes):
        x = np.zeros((n, b - a), dtype=np.float64)
        for i in range(n):
            sp = get(i)
            s, e = np.searchsorted(sp.idx, (a, b))
            x[i, sp.idx[s:e] - a] = sp.vals[s:e]
        gram += x @ x.T
    return gram


# ---------------------------------------------------------------- coordinate-wise windows
def _by_coord_then_value(coords: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The order sorting by coordinate, then value. Updates carry float32 values: then one
    uint64 key (coordinate, the value's bits made order-preserving) sorts ~3x faster than
    lexsort on two arrays (equal values may swap places: their sum is the same)."""
    f32 = values.astype(np.float32)
    if coords.size and int(coords.max()) < 2**32 and np.array_equal(f32, values):
        bits = f32.view(np.uint32).astype(np.uint64)
        key = np.where(bits >> np.uint64(31), ~bits & np.uint64(0xFFFFFFFF), bits | np.uint64(0x80000000))
        return np.argsort(key | (coords.astype(np.uint64) << np.uint64(32)), kind="stable")
    return np.lexsort((values, coords))


def sparse_window_sum(coords: np.ndarray, values: np.ndarray, n: int, lo: int, hi: int, size: int, *,
                      counts: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """Per coordinate of [0, size): the sum of the sorted positions [lo, hi) of its n values,
    where `coords`/`values` list the non-zero ones (each update at most once per coordinate)
    and every missing value is 0. Exact: the same values are summed in the same ascending
    order as sorting the dense column (zeros add nothing).

    Sparse updates leave most coordinates with a few non-zeros among n: when a coordinate's
    negatives all sort below `lo` and its positives all above `hi`, the window holds only
    zeros, so only the other ("hot") coordinates' entries are sorted. `counts` = (negatives,
    positives) per coordinate over all n updates, when the caller knows them: then the
    entries given may be those of the hot coordinates only (streaming.py gathers no others)."""
    values = np.asarray(values, dtype=np.float64)
    coords = np.asarray(coords, dtype=np.int64)
    nz = values != 0
    coords, values = coords[nz], values[nz]
    if not coords.size:
        return np.zeros(size, dtype=np.float64)
    if counts is None:
        neg = np.bincount(coords[values < 0], minlength=size)
        pos = np.bincount(coords[values > 0], minlength=size)
    else:
        neg, pos = (np.asarray(c, dtype=np.int64) for c in counts)
    hot = (neg > lo) | (pos > n - hi)
    pick = hot[coords]
    coords, values = coords[pick], values[pick]
    if not coords.size:
        return np.zeros(size, dtype=np.float64)
    order = _by_coord_then_value(coords, values)
    cs, vs = coords[order], values[order]
    rank = np.arange(cs.size, dtype=np.int64) - np.searchsorted(cs, cs, side="left")
    zeros = n - neg - pos
    pos_in_column = np.where(vs < 0, rank, rank + zeros[cs])
    keep = (pos_in_column >= lo) & (pos_in_column < hi)
    return np.bincount(cs[keep], weights=vs[keep], minlength=size)
