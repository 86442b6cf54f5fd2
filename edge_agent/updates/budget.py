"""Byte budget: the k and bit width that minimise reconstruction error within a wire budget.

Given a delta and a budget in bytes *on the wire* (every chunk, header, tensor table, CRC
and signature slot counted), `choose_for_budget` tries every allowed bit width; for each it
searches the largest global top-k whose exact encoded size fits (size grows with k, except
for a few bytes where a tensor becomes fully kept and its index coding vanishes, so the
search finds a k that fits while k + 1 does not), then keeps the (k, bits) whose decoded
delta is closest to the input in squared error. Exact sizes come from the same functions
the encoder uses, so the chosen update always fits.

`per_update_budget` turns a link's allowance (bytes per day) into bytes per update.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .chunks import DEFAULT_CHUNK_SIZE, wire_size
from .codec import (
    EncodedTensor,
    Tensors,
    TensorSpec,
    check_finite,
    encode_tensors,
    tensor_table,
)
from .errors import BudgetError
from .indices import rice_options
from .quantize import SUPPORTED_BITS, dequantize, quantize, value_bytes
from .wire import UpdateHeader, header_size

AWS_IOT_CORE_MAX_MESSAGE = 128 * 1024
AZURE_IOT_HUB_MAX_MESSAGE = 256 * 1024


@dataclass(frozen=True)
class BudgetChoice:
    k: int  # values kept, all tensors together
    bits: int
    wire_bytes: int  # exact bytes of all chunks
    sq_error: float  # ||delta - decoded||^2
    encoded: list[EncodedTensor]


def per_update_budget(bytes_per_day: int, updates_per_day: float, *, reserve: float = 0.1) -> int:
    """Bytes per update on a link allowing `bytes_per_day`, keeping `reserve` (a fraction)
    for retransmissions and the rest of the protocol."""
    if bytes_per_day <= 0 or updates_per_day <= 0:
        raise ValueError("bytes_per_day and updates_per_day must be positive")
    if not 0.0 <= reserve < 1.0:
        raise ValueError(f"reserve must be in [0, 1), got {reserve}")
    return int(bytes_per_day * (1.0 - reserve) / updates_per_day)


def _uv_len(value: int) -> int:
    """Bytes of `value` as a LEB128 varint."""
    return max(1, (value.bit_length() + 6) // 7)


class _Sizer:
    """Exact wire size of "global top-k, at `bits`" for any k, in O(k_cap) per query."""

    def __init__(
        self,
        delta: Tensors,
        header: UpdateHeader,
        chunk_size: int,
        signature_bytes: int,
        k_cap: int,
    ) -> None:
        self.table = tensor_table(delta)
        self.header = header
        self.chunk_size = chunk_size
        self.signature_bytes = signature_bytes
        self.flats = [np.asarray(delta[s.name], dtype=np.float32).ravel() for s in self.table]
        mags = np.abs(np.concatenate(self.flats)) if self.flats else np.empty(0, np.float32)
        self.total_sq = float(np.sum(np.square(mags, dtype=np.float64)))
        self.all_nonzero = int(np.count_nonzero(mags))
        self.nonzero = min(self.all_nonzero, k_cap)  # the k the search may reach
        # Only the largest `k_cap` magnitudes can ever be kept: sort just those, by
        # (magnitude desc, position) so ties resolve the same way every time.
        top = (
            np.argpartition(-mags, self.nonzero - 1)[: self.nonzero]
            if self.nonzero
            else np.empty(0, np.int64)
        )
        # Candidates in position order with their rank by (magnitude desc, position):
        # the top k are then one linear mask, already in position order.
        self.candidates = np.sort(top).astype(np.int64)
        by_magnitude = np.argsort(-mags[self.candidates], kind="stable")
        self.rank = np.empty(self.candidates.size, dtype=np.int64)
        self.rank[by_magnitude] = np.arange(self.candidates.size)
        self.offsets = np.cumsum([0] + [f.size for f in self.flats])
        self.numels = [f.size for f in self.flats]
        empty = [EncodedTensor(spec, 0, 32, 0.0, 1, b"", b"") for spec in self.table]
        self.header_base = header_size(header, empty)
        self._sizes: dict[tuple[int, int], int] = {}

    def positions(self, k: int) -> list[np.ndarray]:
        """Per tensor, sorted positions of the k largest magnitudes overall."""
        kept = self.candidates[self.rank < k]
        cuts = np.searchsorted(kept, self.offsets)
        return [kept[cuts[i] : cuts[i + 1]] - self.offsets[i] for i in range(len(self.table))]

    def index_bytes(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(kept values, index bytes) per tensor for the top k: `indices.index_cost` for all
        tensors at once (the search asks this a few dozen times per update)."""
        kept = self.candidates[self.rank < k]
        cuts = np.searchsorted(kept, self.offsets)
        kt = np.diff(cuts)
        n_t = len(self.table)
        tid = np.repeat(np.arange(n_t), kt)
        gaps = np.diff(kept, prepend=-1) - 1
        firsts = cuts[:-1][kt > 0]  # a tensor's first gap counts from its own start
        gaps[firsts] = kept[firsts] - self.offsets[:-1][kt > 0]
        varint = kt.copy()
        for shift in (7, 14, 21, 28):
            big = gaps >= 1 << shift
            if not big.any():
                break
            varint += np.bincount(tid[big], minlength=n_t)
        gap_sum = np.bincount(tid, weights=gaps, minlength=n_t)
        partial = (kt > 0) & (kt < self.numels)  # the others cost nothing ('all' or empty)
        # Up to 3 Rice parameters per tensor (indices.rice_options), evaluated for all
        # tensors at once: option j of tensor t is options[t][j], or unusable (cost = inf).
        options = [
            rice_options(int(gap_sum[t]), int(kt[t])) if partial[t] else [] for t in range(n_t)
        ]
        rice = np.full(n_t, np.inf)
        for j in range(3):
            r_t = np.array([o[j] if j < len(o) else 0 for o in options], dtype=np.int64)
            unary = np.bincount(tid, weights=gaps >> r_t[tid], minlength=n_t)
            cost = 1 + (unary + kt + 7) // 8 + (kt * r_t + 7) // 8
            usable = np.array([j < len(o) for o in options])
            rice = np.where(usable, np.minimum(rice, cost), rice)
        bitmap = (np.asarray(self.numels) + 7) // 8
        best = np.minimum(np.minimum(varint, bitmap), rice)
        return kt, np.where(partial, best, 0).astype(np.int64)

    def size(self, k: int, bits: int) -> int:
        if (k, bits) in self._sizes:
            return self._sizes[(k, bits)]
        kt, nbytes = self.index_bytes(k)
        payload = self.header_base
        for k_t, nb in zip(kt.tolist(), nbytes.tolist(), strict=True):
            # The header differs from the k=0 one only in these varints and the scale.
            payload += _uv_len(k_t) - 1 + _uv_len(nb) - 1 + (4 if k_t and bits != 32 else 0)
            payload += nb + value_bytes(k_t, bits)
        size = self._sizes[(k, bits)] = wire_size(payload, self.chunk_size, self.signature_bytes)
        return size

    def sq_error(self, k: int, bits: int) -> float:
        """||x - decode(encode(x))||^2 without building dense tensors: the dropped energy
        plus the quantisation error of the kept values."""
        err = self.total_sq
        for flat, pos in zip(self.flats, self.positions(k), strict=True):
            v = flat[pos].astype(np.float64)
            scale, codes = quantize(v, bits)
            q = dequantize(codes, v.size, bits, scale).astype(np.float64)
            err += float(np.sum((v - q) ** 2) - np.sum(v**2))
        return max(err, 0.0)

    def largest_k(self, bits: int, budget: int) -> int | None:
        """Largest k whose update fits `budget` (None if not even k=0 fits).

        Size is monotone and nearly linear in k, so: a few secant steps land close to the
        answer, galloping from the last probe brackets it, bisection finishes. About a dozen
        size queries instead of log2(n) full-size ones.
        """
        s0 = self.size(0, bits)
        if s0 > budget:
            return None
        lo, hi = 0, self.nonzero + 1  # size(lo) fits; hi is the first k known not to fit
        fits = True

        def probe(k: int) -> bool:
            nonlocal lo, hi
            ok = self.size(k, bits) <= budget
            lo, hi = (k, hi) if ok else (lo, k)
            return ok

        slope = bits / 8 + 1.0  # first guess of bytes per kept value: codes + ~1 byte of index
        k_prev, s_prev = 0, s0
        for _ in range(6):  # secant steps through the last two probes
            if hi - lo <= 1:
                return lo
            k = min(max(k_prev + int((budget - s_prev) / slope), lo + 1), hi - 1)
            fits = probe(k)
            s_k = self.size(k, bits)
            if s_k == budget:
                break
            slope = max((s_k - s_prev) / (k - k_prev), 1e-3) if k != k_prev else slope
            k_prev, s_prev = k, s_k
        gap = 1
        while hi - lo > 1:  # gallop away from the last probe until the answer is bracketed
            k = min(lo + gap, hi - 1) if fits else max(hi - gap, lo + 1)
            if probe(k) != fits:
                break
            gap *= 2
        while hi - lo > 1:
            probe((lo + hi) // 2)
        return lo


def choose_for_budget(
    delta: Tensors,
    header: UpdateHeader,
    budget_bytes: int,
    *,
    bits_choices: Sequence[int] = SUPPORTED_BITS,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    signature_bytes: int = 0,
    table: Sequence[TensorSpec] | None = None,
) -> BudgetChoice:
    """Best (k, bits) for a finite delta within `budget_bytes` on the wire (global top-k).

    `table` is the model's tensor table for the header (codec.model_table).
    Raises BudgetError when even an update with no values (header and tensor table alone)
    does not fit.
    """
    check_finite(delta)
    bad = [b for b in bits_choices if b not in SUPPORTED_BITS]
    if bad or not bits_choices:
        raise ValueError(
            f"bits_choices {tuple(bits_choices)} must be non-empty, from {SUPPORTED_BITS}"
        )
    if header.scope != "global":
        raise ValueError("a byte budget selects top-k globally: use a header with scope='global'")
    # Only the top `k_cap` magnitudes are ranked (sorting all of a large delta dominates the
    # cost otherwise). Start from about twice what a ~1-byte index allows; if a bit width's
    # answer reaches the cap, widen it, up to the hard limit of 8 values per byte (1-bit
    # codes, free indices). Results are exact: an answer below the cap is unaffected by it.
    min_bits = min(bits_choices)
    hard_cap = max(0, 8 * budget_bytes // min_bits)
    k_cap = min(hard_cap, int(2 * budget_bytes / (1 + min_bits / 8)) + 64)
    while True:
        sizer = _Sizer(delta, header, chunk_size, signature_bytes, k_cap)
        ks = {bits: sizer.largest_k(bits, budget_bytes) for bits in sorted(set(bits_choices))}
        capped = sizer.nonzero < sizer.all_nonzero and sizer.nonzero in ks.values()
        if not capped or k_cap >= hard_cap:
            break
        k_cap = min(hard_cap, 4 * k_cap)
    best: tuple[float, int, int, int] | None = None  # (error, wire bytes, bits, k)
    for bits, k in ks.items():
        if k is not None:
            candidate = (sizer.sq_error(k, bits), sizer.size(k, bits), bits, k)
            best = candidate if best is None or candidate[:2] < best[:2] else best
    if best is None:
        minimum = min(sizer.size(0, b) for b in bits_choices)
        raise BudgetError(
            f"budget of {budget_bytes} bytes is below this update's fixed overhead of {minimum} "
            f"bytes (header, {len(sizer.table)}-tensor table, chunk framing)"
        )
    err, wire, bits, k = best
    kept = dict(zip((s.name for s in sizer.table), sizer.positions(k), strict=True))
    return BudgetChoice(k, bits, wire, err, encode_tensors(delta, kept, bits, table=table))
