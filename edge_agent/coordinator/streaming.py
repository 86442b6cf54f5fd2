"""Streaming aggregation (issue 18): O(1) work per received update, bounded memory at close.

The coordinator keeps what arrived (the signed, compressed payload, ~40 kB for a 1M-parameter
head at 2 %) and never a dense copy. Each update is decoded ONCE at arrival into a sparse
vector over the head's flat coordinates (`decode_sparse`: positions + float32 values, the
tensors concatenated in the base head's order), its norm is taken, and it is folded into
the round's `RunningSum` (sum_i a_i d_i in float64, a_i its arrival weight). Closing a
FedAvg round then costs O(P + outliers): the sum is corrected for the updates screening
rejected, the round's weight cap and the clipping (`RunningSum.combine`), each correction
one decode of one stored payload -- never a reload of every participant.

The running sums are memory only. After a restart they are rebuilt from the stored
payloads of the round's pending updates on first touch (rounds.py), which is exact: a sum
of the same terms (in another order: float64, so the float32 result differs by at most
rounding).

Coordinate-wise rules (median, trimmed mean) need per coordinate only the entries that
can land in the sorted window [lo, hi): a coordinate whose negatives all sort below `lo`
and positives all above `hi` has a window of zeros (robust.py `sparse_window_sum`). The
signs per coordinate (`SignCounts`, 8 bytes per coordinate) are kept with the running sum,
so at close the "hot" coordinates are known without reading an update; only their entries
are gathered, in passes over the stored updates that each hold at most `cache_bytes`
(8 bytes per entry), and sorted by blocks of `block_bytes`. With sparse updates from many
devices few coordinates are hot: 10,000 x 1M at 2 % used to re-decode every update for each
of ~136 blocks (about an hour of decoding). The direction check's median keeps what it
gathered, with the trimmed mean's hot entries too (`HotCache`), so the cosines and the mean
read no update again: a trimmed-mean close is one pass over the stored updates when the hot
entries fit `cache_bytes`, a few passes otherwise. Updates are decoded once and kept when
all of them fit in `cache_bytes`. Multi-Krum's Gram matrix runs by dense coordinate blocks
of N rows (`block_gram`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..updates.codec import EncodedTensor
from ..updates.errors import UpdateFormatError
from ..updates.indices import decode_indices
from ..updates.quantize import dequantize
from .robust import clip_scales, cosine, krum_select, round_weights, sparse_window_sum, window

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


class RunningSum:
    """sum_i a_i d_i over the updates folded so far (float64), who is in it, and their signs
    per coordinate (for median / trimmed mean at close)."""

    def __init__(self, size: int) -> None:
        self.vec = np.zeros(size, dtype=np.float64)
        self.signs = SignCounts(size)
        self.members: dict[str, float] = {}  # device -> the weight it was folded with
        self.present: dict[str, tuple[int, ...] | None] = {}  # device -> the tensors it carried

    def fold(self, device: str, sp: Sparse, weight: float) -> None:
        if device in self.members:
            return
        self.vec[sp.idx] += weight * sp.vals.astype(np.float64)
        self.signs.add(sp)
        self.members[device] = float(weight)
        self.present[device] = sp.present

    def unfold(self, device: str, sp: Sparse) -> None:
        self.present.pop(device, None)
        weight = self.members.pop(device, None)
        if weight is not None:
            self.vec[sp.idx] -= weight * sp.vals.astype(np.float64)
            self.signs.add(sp, -1)

    def sign_counts(self, devices: Sequence[str], load: Callable[[str], Sparse]) -> SignCounts:
        """The signs of exactly `devices`: the folded counts corrected by one decode per device
        that differs (screening's rejections, legacy rows), or a fresh pass when most differ."""
        want = set(devices)
        extra = [d for d in devices if d not in self.members]
        missing = [d for d in self.members if d not in want]
        if len(extra) + len(missing) > max(4, len(want) // 2):
            return SignCounts.of([lambda d=d: load(d) for d in devices], self.vec.size)
        out = self.signs.copy()
        for d in extra:
            out.add(load(d))
        for d in missing:
            out.add(load(d), -1)
        return out

    def combine(self, coefs: Mapping[str, float], load: Callable[[str], Sparse], *,
                norms: Mapping[str, float]) -> tuple[np.ndarray, int]:
        """sum_i coefs[i] d_i over exactly the devices in `coefs` (every one folded or not):
        the running sum plus one correction per device whose coefficient differs from its
        folded weight (rejected ones have coefficient 0). Rebuilt from scratch instead when
        the corrections would be many or large next to the result (float64 cancellation).
        Returns (vector, number of payloads decoded)."""
        fix = {d: c - self.members.get(d, 0.0) for d, c in coefs.items() if c != self.members.get(d, 0.0)}
        fix.update({d: -w for d, w in self.members.items() if d not in coefs and w})
        kept = sum(abs(c) * norms.get(d, 0.0) for d, c in coefs.items())
        moved = sum(abs(c) * norms.get(d, 0.0) for d, c in fix.items())
        rebuild = len(fix) > max(4, len(coefs) // 2) or not math.isfinite(moved) or moved > 1e4 * max(kept, 1e-300)
        if rebuild:
            out = np.zeros_like(self.vec)
            for d, c in coefs.items():
                if c:
                    sp = load(d)
                    out[sp.idx] += c * sp.vals.astype(np.float64)
            return out, sum(1 for c in coefs.values() if c)
        out = self.vec.copy()
        for d, c in fix.items():
            sp = load(d)
            out[sp.idx] += c * sp.vals.astype(np.float64)
        return out, len(fix)


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


def window_hot(signs: SignCounts, n: int, aggregator: str, trim_fraction: float) -> np.ndarray:
    """The coordinates whose window of n sorted values ([lo, hi) of `aggregator`) can hold a
    non-zero value: negatives reaching past lo, or positives below hi."""
    lo, hi = window(n, aggregator, trim_fraction)
    return (signs.neg > lo) | (signs.pos > n - hi)


class HotCache:
    """The entries of a round's updates at a set of coordinates (`have`), kept in memory
    between the coordinate-wise rules of one close. The direction check's median gathers,
    in the same pass, the entries the aggregator's window will need (`also`: the trimmed
    mean's hot coordinates, a superset of the median's), so a trimmed-mean round reads its
    stored updates once for the median, the cosines and the mean, not three times. Used only
    when what it would hold fits `cache_bytes` (8 bytes an entry)."""

    def __init__(self, also: Callable[[SignCounts, int], np.ndarray] | None = None,
                 cache_bytes: int = CACHE_BYTES) -> None:
        self.also, self.cache_bytes = also, cache_bytes
        self.have: np.ndarray | None = None
        self.parts: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def covers(self, devices: Sequence[str], coords: np.ndarray) -> bool:
        """Holds every entry of `devices` at the coordinates where `coords` is true."""
        return (self.have is not None and all(d in self.parts for d in devices)
                and not bool((coords & ~self.have).any()))

    def fill(self, devices: Sequence[str], get: Callable[[int], Sparse], signs: SignCounts, hot: np.ndarray) -> bool:
        """One pass: keep each update's entries at `hot` and at what `also` adds, or at `hot`
        alone if the two do not fit; False (nothing kept) if not even that does."""
        entries = signs.neg.astype(np.int64) + signs.pos
        masks = ([hot | self.also(signs, len(devices))] if self.also is not None else []) + [hot]
        mask = next((m for m in masks if 8 * int(entries[m].sum()) <= self.cache_bytes), None)
        if mask is None:
            return False
        self.have, self.parts = None, {}
        for i, d in enumerate(devices):
            sp = get(i)
            pick = mask[sp.idx]
            self.parts[d] = (sp.idx[pick], sp.vals[pick])
        self.have = mask
        return True

    def hot_parts(self, devices: Sequence[str], hot: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        out = []
        for d in devices:
            idx, vals = self.parts[d]
            pick = hot[idx]
            out.append((idx[pick], vals[pick]))
        return out

    def dot(self, device: str, vec: np.ndarray) -> float:
        """<d, vec> for a `vec` that is zero wherever `have` is false."""
        idx, vals = self.parts[device]
        return _dot(vals.astype(np.float64), vec[idx])


def block_window_mean(loads: Sequence[Callable[[], Sparse]], kept: int, size: int, lo: int, hi: int, *,
                      signs: SignCounts | None = None, devices: Sequence[str] | None = None,
                      hot_cache: HotCache | None = None, block_bytes: int = BLOCK_BYTES,
                      cache_bytes: int = CACHE_BYTES) -> np.ndarray:
    """Coordinate-wise mean of the sorted positions [lo, hi) over the updates `loads`
    (median / trimmed mean). `kept` = their total entries; `signs` = their SignCounts (one
    extra pass over the updates without it). Only the entries of hot coordinates are
    gathered: from `hot_cache` (keyed by `devices`, filled here if they fit), else in passes
    of at most cache_bytes; then sorted by blocks of block_bytes."""
    n = len(loads)
    get = _source(loads, kept, cache_bytes)
    if signs is None:
        signs = SignCounts.of([lambda i=i: get(i) for i in range(n)], size)
    neg, pos = signs.neg, signs.pos
    hot = (neg > lo) | (pos > n - hi)  # window_hot's test for this [lo, hi)
    need = np.where(hot, neg.astype(np.int64) + pos, 0)
    out = np.zeros(size, dtype=np.float64)
    if not need.any():
        return out  # every window holds zeros only: nothing to read
    if hot_cache is not None and devices is not None and (
            hot_cache.covers(devices, hot) or hot_cache.fill(devices, get, signs, hot)):
        _window_blocks(hot_cache.hot_parts(devices, hot), out, 0, size, need, signs, n, lo, hi, block_bytes)
        return out
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


# ---------------------------------------------------------------- closing a round
Load = Callable[[str], Sparse]


def direction_check(good: Sequence[str], load: Load, norms: Mapping[str, float], size: int, kept: int,
                    min_cosine: float, acc: RunningSum | None = None, hot_cache: HotCache | None = None
                    ) -> tuple[list[str], dict[str, str], str, dict[str, float]]:
    """Step 5 of robust.py's screening: (kept devices, device -> why rejected, undecidable,
    device -> cosine with the round's coordinate-wise median; empty with 2 updates). `acc`:
    the round's running sum, whose sign counts spare the median a pass over the updates;
    `hot_cache`: the entries the median gathers, kept for the cosines and the aggregator."""
    if len(good) == 2:
        a, b = good
        c = cosine(load(a).dot(load(b)), norms[a], norms[b])
        if c < min_cosine:
            return [], {}, (f"undecidable: the 2 updates point apart (cosine {c:.3f} < {min_cosine:g}) and "
                            "there is no majority to tell which is honest"), {}
        return list(good), {}, "", {}
    lo, hi = window(len(good), "median", 0.0)
    med = block_window_mean([lambda d=d: load(d) for d in good], kept, size, lo, hi,
                            signs=acc.sign_counts(good, load) if acc is not None else None,
                            devices=good, hot_cache=hot_cache)
    med_norm = norm2(med)
    cached = hot_cache is not None and hot_cache.covers(good, med != 0)
    out, rejected, cosines = [], {}, {}
    for d in good:
        c = cosine(hot_cache.dot(d, med) if cached else load(d).dot_dense(med), norms[d], med_norm)
        if med_norm > 0:
            cosines[d] = c
        if c < min_cosine and med_norm > 0:
            rejected[d] = (f"direction_outlier: cosine {c:.3f} with the round's coordinate-wise median "
                           f"< {min_cosine:g}")
        else:
            out.append(d)
    return out, rejected, "", cosines


def per_tensor_mean(vec: np.ndarray, weights: Mapping[str, float], present: Mapping[str, tuple[int, ...] | None],
                    layout: Layout) -> np.ndarray:
    """sum_i w_i d_i divided, tensor by tensor, by the weight of the updates that carry that
    tensor (HeteroFL's rule): in a round where some devices trained only the head and others
    the last blocks too, the blocks get the mean of those who trained them, not a mean
    diluted by the head-only devices' absent (zero) deltas."""
    out = vec.copy()
    for t, name in enumerate(layout.names):
        total = sum(w for d, w in weights.items() if present.get(d) is None or t in present[d])
        lo = layout.offsets[name]
        hi = lo + math.prod(layout.shapes[name])
        out[lo:hi] = out[lo:hi] / total if total > 0 else 0.0
    return out


def aggregate_updates(aggregator: str, good: Sequence[str], *, weights: Mapping[str, float],
                      norms: Mapping[str, float], kept: Mapping[str, int], load: Load, acc: RunningSum, size: int,
                      center: float, clip_mult: float, samples_mult: float, trim_fraction: float,
                      krum_fraction: float, layout: Layout | None = None,
                      hot_cache: HotCache | None = None) -> tuple[np.ndarray, dict[str, Any]]:
    """The aggregate delta (flat float64) of the screened updates `good`, and what to record
    of it (metrics; "excluded": devices Multi-Krum left out). `hot_cache`: entries the
    direction check gathered (median / trimmed mean use them when they cover the window)."""
    total_kept = sum(kept.get(d) or size for d in good)
    if aggregator in ("fedavg", "fedavg_clipped"):
        capped = round_weights([weights[d] for d in good], samples_mult)
        bound = clip_mult * center
        scales = clip_scales([norms[d] for d in good], bound) if aggregator == "fedavg_clipped" else [1.0] * len(good)
        coefs = {d: w * s for d, w, s in zip(good, capped, scales, strict=True)}
        vec, decoded = acc.combine(coefs, load, norms=norms)
        info: dict[str, Any] = {"weights_capped": sum(c < weights[d] for d, c in zip(good, capped, strict=True)),
                                "decoded_at_close": decoded}
        if aggregator == "fedavg_clipped":
            info |= {"clip_bound": float(bound), "clipped": sum(s < 1 for s in scales)}
        present = {d: acc.present[d] if d in acc.present else load(d).present for d in good}
        if layout is not None and any(p is not None for p in present.values()):
            info["partial_updates"] = sum(p is not None for p in present.values())
            return per_tensor_mean(vec, dict(zip(good, capped, strict=True)), present, layout), info
        return vec / sum(capped), info
    loads = [lambda d=d: load(d) for d in good]
    if aggregator in ("median", "trimmed_mean"):
        lo, hi = window(len(good), aggregator, trim_fraction)
        return (block_window_mean(loads, total_kept, size, lo, hi, signs=acc.sign_counts(good, load),
                                  devices=good, hot_cache=hot_cache), {"trimmed_each_end": lo})
    if aggregator == "multi_krum":
        chosen = [good[i] for i in krum_select(block_gram(loads, total_kept, size), krum_fraction)]
        vec = np.zeros(size, dtype=np.float64)
        for d in chosen:
            sp = load(d)
            vec[sp.idx] += sp.vals.astype(np.float64)
        return vec / len(chosen), {"excluded": [d for d in good if d not in chosen]}
    raise ValueError(f"unknown aggregator {aggregator!r}")
