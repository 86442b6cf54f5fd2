"""Compact coding of the positions kept by top-k: gaps as varints or Rice codes, or a bitmap.

A sparse tensor of n elements with k kept positions costs one of
  - varints: LEB128 of the gaps between sorted positions (gap = idx[i] - idx[i-1] - 1,
    starting from -1): 1 byte per position while gaps stay below 128 (k/n > ~1/128), 2 up
    to 16383;
  - Rice codes of the same gaps (Golomb-Rice with parameter r, gap = q * 2**r + rem): q in
    unary plus r bits of rem, about log2(n/k) + 2 bits per position. Unary parts and
    remainders go in two separate bit streams so that both code and decode vectorise
    (the unary stream's zero bits are the terminators): 1 byte r | unary | remainders;
  - a bitmap: ceil(n / 8) bytes whatever k is, best once k/n exceeds about 1/8;
  - nothing at all when every element is kept (k == n).
`encode_indices` picks the smallest. Everything is vectorised numpy (no Python loop per
element): this code runs on a Raspberry Pi for every update.
"""

from __future__ import annotations

import math

import numpy as np

from .errors import UpdateFormatError

INDEX_ALL = 0  # k == n: positions implied, no bytes
INDEX_VARINT = 1  # delta-coded LEB128 varints
INDEX_BITMAP = 2  # one bit per element, MSB first (np.packbits order)
INDEX_RICE = 3  # Golomb-Rice coded gaps, unary and remainder streams apart
INDEX_KINDS = {INDEX_ALL: "all", INDEX_VARINT: "varint", INDEX_BITMAP: "bitmap", INDEX_RICE: "rice"}
MAX_RICE_PARAM = 31

MAX_VARINT_BYTES = 5  # 35 bits: enough for any position below MAX_ELEMENTS_PER_TENSOR
MAX_ELEMENTS_PER_TENSOR = 1 << 31


def varint_sizes(values: np.ndarray) -> np.ndarray:
    """Bytes each non-negative value takes as a LEB128 varint (values < 2**35)."""
    v = np.asarray(values, dtype=np.uint64)
    sizes = np.ones(v.shape, dtype=np.int64)
    for shift in (7, 14, 21, 28):
        sizes += v >= np.uint64(1 << shift)
    return sizes


def varint_encode(values: np.ndarray) -> bytes:
    """LEB128 encoding of non-negative integers < 2**35 (vectorised)."""
    v = np.asarray(values, dtype=np.uint64).ravel()
    if v.size == 0:
        return b""
    sizes = varint_sizes(v)
    offsets = np.cumsum(sizes) - sizes
    out = np.empty(int(sizes.sum()), dtype=np.uint8)
    for j in range(int(sizes.max())):
        sel = sizes > j
        chunk = (v[sel] >> np.uint64(7 * j)) & np.uint64(0x7F)
        more = np.where(sizes[sel] > j + 1, np.uint64(0x80), np.uint64(0))
        out[offsets[sel] + j] = (chunk | more).astype(np.uint8)
    return out.tobytes()


def varint_decode(data: bytes, count: int, *, where: str = "varints") -> np.ndarray:
    """Decode exactly `count` canonical LEB128 varints filling all of `data` (vectorised).

    Raises UpdateFormatError if the bytes hold a different number of varints, end inside
    one, or use an over-long or non-canonical encoding.
    """
    b = np.frombuffer(data, dtype=np.uint8)
    if count == 0:
        if b.size:
            raise UpdateFormatError(f"{where}: {b.size} bytes for 0 values")
        return np.empty(0, dtype=np.int64)
    if b.size == 0:
        raise UpdateFormatError(f"{where}: no bytes for {count} values")
    terminal = b < 0x80
    if not terminal[-1]:
        raise UpdateFormatError(f"{where}: truncated (last varint has no final byte)")
    ends = np.flatnonzero(terminal)
    if ends.size != count:
        raise UpdateFormatError(f"{where}: holds {ends.size} values, header says {count}")
    starts = np.concatenate(([0], ends[:-1] + 1))
    lengths = ends - starts + 1
    if int(lengths.max()) > MAX_VARINT_BYTES:
        raise UpdateFormatError(f"{where}: varint longer than {MAX_VARINT_BYTES} bytes")
    if np.any((lengths > 1) & (b[ends] == 0)):
        raise UpdateFormatError(f"{where}: non-canonical varint (trailing zero byte)")
    pos = np.arange(b.size) - np.repeat(starts, lengths)
    parts = (b & 0x7F).astype(np.uint64) << (7 * pos).astype(np.uint64)
    return np.add.reduceat(parts, starts).astype(np.int64)  # bit fields are disjoint: sum == or


def _gaps(idx: np.ndarray) -> np.ndarray:
    return np.diff(idx, prepend=-1) - 1


def _varint_bytes(gaps: np.ndarray) -> int:
    total = gaps.size
    for shift in (7, 14, 21, 28):  # one extra byte per 7 bits; most gaps stop at the first
        over = int(np.count_nonzero(gaps >= 1 << shift))
        if not over:
            break
        total += over
    return total


def rice_options(gap_sum: int, k: int) -> list[int]:
    """Rice parameters worth trying for k gaps summing to `gap_sum`: around the optimum for
    geometric gaps, ceil(log2(mean * ln 2)). The one definition both the encoder and the
    budget's size arithmetic use, so their sizes agree to the byte."""
    guess = math.ceil(math.log2(max(gap_sum / k * math.log(2.0), 1.0)))
    return [r for r in (guess - 1, guess, guess + 1) if 0 <= r <= MAX_RICE_PARAM]


def rice_bytes(k: int, unary_bits_over_k: int, r: int) -> int:
    """Bytes of a Rice coding: parameter byte, unary stream (sum(gap >> r) + k bits) and
    remainders (k * r bits)."""
    return 1 + (unary_bits_over_k + k + 7) // 8 + (k * r + 7) // 8


def _rice_param(gaps: np.ndarray) -> tuple[int, int]:
    """(r, bytes) of the best Rice parameter for these gaps."""
    options = rice_options(int(gaps.sum()), gaps.size)
    return min((rice_bytes(gaps.size, int(np.sum(gaps >> r)), r), r) for r in options)[::-1]


def index_cost(idx: np.ndarray, n: int) -> tuple[int, int]:
    """(kind, bytes) of the cheapest coding of sorted unique positions `idx` in range(n)."""
    k = int(idx.size)
    if k == n:
        return INDEX_ALL, 0
    if k == 0:
        return INDEX_VARINT, 0
    gaps = _gaps(idx)
    costs = [
        (_varint_bytes(gaps), INDEX_VARINT),
        (_rice_param(gaps)[1], INDEX_RICE),
        ((n + 7) // 8, INDEX_BITMAP),
    ]
    nbytes, kind = min(costs)  # ties: the simpler coding (lower kind number) wins
    return kind, nbytes


def _rice_encode(gaps: np.ndarray) -> bytes:
    r, _ = _rice_param(gaps)
    q = (gaps >> r).astype(np.int64)
    unary = np.ones(int(q.sum()) + q.size, dtype=np.uint8)
    unary[np.cumsum(q + 1) - 1] = 0  # each gap's unary part ends with a 0 bit
    rem = (gaps & ((1 << r) - 1)).astype(np.uint64)
    shifts = np.arange(r - 1, -1, -1, dtype=np.uint64)
    rem_bits = ((rem[:, None] >> shifts) & np.uint64(1)).astype(np.uint8).ravel()
    return bytes([r]) + np.packbits(unary).tobytes() + np.packbits(rem_bits).tobytes()


def _rice_decode(data: bytes, k: int, n: int, where: str) -> np.ndarray:
    if k == 0 or len(data) < 2:
        raise UpdateFormatError(f"{where}: Rice coding of {k} positions in {len(data)} bytes")
    r = data[0]
    if r > MAX_RICE_PARAM:
        raise UpdateFormatError(f"{where}: Rice parameter {r} is over {MAX_RICE_PARAM}")
    rem_len = (k * r + 7) // 8
    if len(data) - 1 - rem_len < 1:
        raise UpdateFormatError(f"{where}: Rice streams need more than {len(data)} bytes")
    unary = np.unpackbits(
        np.frombuffer(data, dtype=np.uint8, count=len(data) - 1 - rem_len, offset=1)
    )
    ends = np.flatnonzero(unary == 0)
    if ends.size < k:
        raise UpdateFormatError(
            f"{where}: Rice unary stream ends {ends.size} gaps, header says {k}"
        )
    tail = unary[ends[k - 1] + 1 :]
    if tail.size >= 8 or tail.any():
        raise UpdateFormatError(f"{where}: Rice unary stream has data past its {k} gaps")
    q = np.diff(ends[:k], prepend=-1) - 1
    if int(q.max()) > n >> r:
        raise UpdateFormatError(f"{where}: Rice gap is past the tensor's {n} elements")
    rem_bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8, offset=len(data) - rem_len))
    if rem_bits[k * r :].any():
        raise UpdateFormatError(f"{where}: Rice remainder padding is not zero")
    weights = (1 << np.arange(r - 1, -1, -1)).astype(np.int64)
    rem = rem_bits[: k * r].reshape(k, r).astype(np.int64) @ weights if r else np.zeros(k, np.int64)
    return (q << r) | rem


def encode_indices(idx: np.ndarray, n: int) -> tuple[int, bytes]:
    """Code sorted unique positions `idx` (int64, within range(n)) the cheapest way."""
    idx = np.asarray(idx, dtype=np.int64)
    kind, _ = index_cost(idx, n)
    if kind == INDEX_ALL:
        return kind, b""
    if kind == INDEX_BITMAP:
        mask = np.zeros(n, dtype=bool)
        mask[idx] = True
        return kind, np.packbits(mask).tobytes()
    if kind == INDEX_RICE:
        return kind, _rice_encode(_gaps(idx))
    return kind, varint_encode(_gaps(idx))


def expected_index_bytes(kind: int, n: int) -> int | None:
    """Byte length implied by the kind (None: any length, varints carry their own)."""
    if kind == INDEX_ALL:
        return 0
    if kind == INDEX_BITMAP:
        return (n + 7) // 8
    return None


def decode_indices(kind: int, data: bytes, k: int, n: int, *, where: str = "indices") -> np.ndarray:
    """Inverse of `encode_indices`: sorted unique int64 positions, validated against k and n."""
    if kind == INDEX_ALL:
        if k != n or data:
            raise UpdateFormatError(f"{where}: 'all' coding needs k == n and no bytes")
        return np.arange(n, dtype=np.int64)
    if kind == INDEX_BITMAP:
        if len(data) != (n + 7) // 8:
            raise UpdateFormatError(
                f"{where}: bitmap is {len(data)} bytes, {n} elements need {(n + 7) // 8}"
            )
        bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8))
        if bits[n:].any():
            raise UpdateFormatError(f"{where}: bitmap has bits set past element {n}")
        idx = np.flatnonzero(bits[:n]).astype(np.int64)
        if idx.size != k:
            raise UpdateFormatError(f"{where}: bitmap marks {idx.size} elements, header says {k}")
        return idx
    if kind in (INDEX_VARINT, INDEX_RICE):
        if kind == INDEX_RICE:
            gaps = _rice_decode(data, k, n, where)
        else:
            gaps = varint_decode(data, k, where=where)
        if k and int(gaps.max()) >= n:
            raise UpdateFormatError(
                f"{where}: gap {int(gaps.max())} is past the tensor's {n} elements"
            )
        idx = np.cumsum(gaps + 1) - 1
        if k and int(idx[-1]) >= n:
            raise UpdateFormatError(
                f"{where}: position {int(idx[-1])} is past the tensor's {n} elements"
            )
        return idx
    raise UpdateFormatError(f"{where}: unknown index coding {kind}")
