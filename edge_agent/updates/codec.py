"""The delta codec as pure functions: delta, top-k sparsification, quantisation, decoding.

    delta = new - base                           compute_delta (float32, refuses NaN/Inf)
    positions = top-k by |delta|                 select_topk (per tensor or global; zeros never kept)
    EncodedTensor = indices + quantised values   encode_tensors
    dense delta  <- EncodedTensor                decode_tensors

Tensors are `Mapping[str, np.ndarray]` in the model's parameter order; the `TensorSpec`
table (name, shape, dtype) travels in the wire header so a receiver can check it against
its model. Deltas are always float32 (the model's dtype is recorded, not used for the
arithmetic): apply them as `base + delta.astype(base.dtype)`.

Error bound of one round trip, per element: a dropped element decodes to 0, and every
dropped |x| is <= every kept |x| of its selection scope; a kept element is within
`quantize.error_bound` of x. `round_trip_bound` returns that per tensor.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .errors import NonFiniteDeltaError, TensorTableMismatchError, UpdateFormatError
from .indices import MAX_ELEMENTS_PER_TENSOR, decode_indices, encode_indices
from .quantize import SUPPORTED_BITS, dequantize, error_bound, quantize

DTYPES = ("float32", "float16", "float64")
SCOPES = ("global", "tensor")
MAX_NAME_BYTES = 255
MAX_NDIM = 8

Tensors = Mapping[str, np.ndarray]


@dataclass(frozen=True)
class TensorSpec:
    """One entry of the tensor table: what the receiving model must have."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def describe(self) -> str:
        return f"{self.name} {self.dtype}{list(self.shape)}"


@dataclass(frozen=True)
class EncodedTensor:
    """One tensor's compressed delta: k kept positions, their codes and the codec parameters."""

    spec: TensorSpec
    k: int
    bits: int
    scale: float  # float32 value; 0.0 when bits == 32 or k == 0
    index_kind: int  # indices.INDEX_*
    index_bytes: bytes
    value_bytes: bytes


def validate_spec(spec: TensorSpec) -> None:
    """Refuse a spec the wire format cannot carry (name length, rank, size, dtype)."""
    if not spec.name or len(spec.name.encode("utf-8")) > MAX_NAME_BYTES:
        raise UpdateFormatError(
            f"tensor name {spec.name!r} must be 1..{MAX_NAME_BYTES} UTF-8 bytes"
        )
    if spec.dtype not in DTYPES:
        raise UpdateFormatError(
            f"tensor {spec.name!r}: dtype {spec.dtype!r} is not one of {DTYPES}"
        )
    if len(spec.shape) > MAX_NDIM or any(d < 0 for d in spec.shape):
        raise UpdateFormatError(
            f"tensor {spec.name!r}: shape {spec.shape} (at most {MAX_NDIM} non-negative dims)"
        )
    if spec.numel >= MAX_ELEMENTS_PER_TENSOR:
        raise UpdateFormatError(
            f"tensor {spec.name!r}: {spec.numel} elements is over {MAX_ELEMENTS_PER_TENSOR - 1}"
        )


def tensor_table(tensors: Tensors) -> tuple[TensorSpec, ...]:
    """The table of a model's (or delta's) tensors, in the mapping's order."""
    table = []
    for name, arr in tensors.items():
        arr = np.asarray(arr)
        if arr.dtype.name not in DTYPES:
            raise UpdateFormatError(f"tensor {name!r}: dtype {arr.dtype} is not one of {DTYPES}")
        spec = TensorSpec(str(name), tuple(int(d) for d in arr.shape), arr.dtype.name)
        validate_spec(spec)
        table.append(spec)
    return tuple(table)


def check_table(
    actual: Sequence[TensorSpec], expected: Sequence[TensorSpec], *, what: str = "update"
) -> None:
    """Raise TensorTableMismatchError listing every difference (matched by name)."""
    got = {s.name: s for s in actual}
    want = {s.name: s for s in expected}
    problems = [f"missing tensor {n!r}" for n in want if n not in got]
    problems += [f"unexpected tensor {n!r}" for n in got if n not in want]
    for name in want.keys() & got.keys():
        a, e = got[name], want[name]
        if a.shape != e.shape:
            problems.append(f"tensor {name!r}: shape {a.shape} in {what}, model has {e.shape}")
        if a.dtype != e.dtype:
            problems.append(f"tensor {name!r}: dtype {a.dtype} in {what}, model has {e.dtype}")
    if problems:
        raise TensorTableMismatchError(
            f"{what} does not match the model: " + "; ".join(sorted(problems))
        )


def check_finite(delta: Tensors, *, what: str = "delta") -> None:
    """Refuse NaN/Inf anywhere, naming the tensor, the counts and the first bad index."""
    for name, arr in delta.items():
        arr = np.asarray(arr)
        bad = ~np.isfinite(arr)
        if bad.any():
            first = tuple(int(i) for i in np.argwhere(bad)[0])
            n_nan = int(np.isnan(arr).sum())
            raise NonFiniteDeltaError(
                f"{what} for tensor {name!r} has {n_nan} NaN and {int(bad.sum()) - n_nan} Inf "
                f"values (first at index {first}); refusing to encode it (diverged training?)"
            )


def compute_delta(new: Tensors, base: Tensors) -> dict[str, np.ndarray]:
    """delta = new - base per tensor, as float32 (computed in float64: exact for float32
    models). Refuses mismatched tables and non-finite results (including float32 overflow)."""
    check_table(tensor_table(new), tensor_table(base), what="new model")
    with np.errstate(over="ignore", invalid="ignore"):
        delta = {
            name: (np.asarray(new[name], np.float64) - np.asarray(base[name], np.float64)).astype(
                np.float32
            )
            for name in new
        }
    check_finite(delta)
    return delta


def select_topk(flat: np.ndarray, k: int) -> np.ndarray:
    """Sorted positions of the k largest |flat| (never an exact zero; ties broken arbitrarily
    but deterministically)."""
    mags = np.abs(np.asarray(flat, dtype=np.float32).ravel())
    nonzero = np.flatnonzero(mags)
    if k >= nonzero.size:
        return nonzero.astype(np.int64)
    if k <= 0:
        return np.empty(0, dtype=np.int64)
    top = np.argpartition(mags, mags.size - k)[mags.size - k :]
    return np.sort(top).astype(np.int64)


def kept_count(n: int, density: float) -> int:
    """ceil(density * n), at least 1 for a non-empty tensor and a positive density."""
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density}")
    return min(n, max(1, math.ceil(density * n))) if n else 0


def select_positions(
    delta: Tensors, density: float, scope: str = "global"
) -> dict[str, np.ndarray]:
    """Top-k positions per tensor: k = ceil(density * n) of each tensor ("tensor"), or of all
    tensors pooled with one threshold ("global")."""
    if scope == "tensor":
        return {
            name: select_topk(arr, kept_count(np.size(arr), density)) for name, arr in delta.items()
        }
    if scope != "global":
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    names = list(delta)
    flats = [np.abs(np.asarray(delta[n], dtype=np.float32).ravel()) for n in names]
    pooled = np.concatenate(flats) if flats else np.empty(0, np.float32)
    keep = select_topk(pooled, kept_count(pooled.size, density))
    mask = np.zeros(pooled.size, dtype=bool)
    mask[keep] = True
    out, offset = {}, 0
    for name, flat in zip(names, flats, strict=True):
        out[name] = np.flatnonzero(mask[offset : offset + flat.size]).astype(np.int64)
        offset += flat.size
    return out


def encode_tensor(
    spec: TensorSpec, flat: np.ndarray, positions: np.ndarray, bits: int
) -> EncodedTensor:
    """Encode one flat float32 tensor keeping `positions` (sorted, unique) at `bits`."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"unsupported bit width {bits}; choose one of {SUPPORTED_BITS}")
    positions = np.asarray(positions, dtype=np.int64)
    kind, index_bytes = encode_indices(positions, spec.numel)
    scale, value_bytes = quantize(flat[positions], bits)
    return EncodedTensor(spec, int(positions.size), bits, scale, kind, index_bytes, value_bytes)


def model_table(delta: Tensors, table: Sequence[TensorSpec] | None) -> tuple[TensorSpec, ...]:
    """The table to put on the wire for `delta`: the model's own `table` when given (deltas
    are float32 whatever the model's dtype; names and shapes must match it), else the
    delta's."""
    if table is None:
        return tensor_table(delta)
    as_f32 = [TensorSpec(s.name, s.shape, "float32") for s in table]
    check_table(
        tensor_table({n: np.asarray(a, np.float32) for n, a in delta.items()}), as_f32, what="delta"
    )
    return tuple(table)


def encode_tensors(
    delta: Tensors,
    positions: Mapping[str, np.ndarray],
    bits: int | Mapping[str, int],
    *,
    table: Sequence[TensorSpec] | None = None,
) -> list[EncodedTensor]:
    """Encode every tensor of a (finite) delta with its kept positions and bit width.

    `table` is the model's tensor table (see `model_table`); by default the delta's own.
    """
    out = []
    for spec in model_table(delta, table):
        flat = np.asarray(delta[spec.name], dtype=np.float32).ravel()
        b = bits if isinstance(bits, int) else bits[spec.name]
        out.append(encode_tensor(spec, flat, positions[spec.name], b))
    return out


def encode_delta(
    delta: Tensors,
    *,
    density: float,
    bits: int = 8,
    scope: str = "global",
    table: Sequence[TensorSpec] | None = None,
) -> list[EncodedTensor]:
    """check_finite + top-k at `density` + quantisation at `bits`: the fixed-rate codec."""
    check_finite(delta)
    return encode_tensors(delta, select_positions(delta, density, scope), bits, table=table)


def decode_tensor(enc: EncodedTensor) -> np.ndarray:
    """Dense float32 delta of one encoded tensor, shaped as its spec."""
    where = f"tensor {enc.spec.name!r}"
    n = enc.spec.numel
    if not 0 <= enc.k <= n:
        raise UpdateFormatError(f"{where}: k={enc.k} is outside 0..{n}")
    idx = decode_indices(enc.index_kind, enc.index_bytes, enc.k, n, where=f"{where} indices")
    vals = dequantize(enc.value_bytes, enc.k, enc.bits, enc.scale, where=f"{where} values")
    dense = np.zeros(n, dtype=np.float32)
    dense[idx] = vals
    return dense.reshape(enc.spec.shape)


def decode_tensors(encoded: Sequence[EncodedTensor]) -> dict[str, np.ndarray]:
    """Dense float32 deltas of all encoded tensors, in table order."""
    return {enc.spec.name: decode_tensor(enc) for enc in encoded}


def round_trip_bound(flat: np.ndarray, enc: EncodedTensor) -> np.ndarray:
    """Per-element bound on |decode - flat| for this encoding (the codec's stated bound):
    the kept values' quantisation bound at kept positions, |x| itself elsewhere (dropped
    values decode to exactly 0)."""
    flat = np.abs(np.asarray(flat, dtype=np.float64).ravel())
    bound = flat.copy()
    if enc.k:
        idx = decode_indices(enc.index_kind, enc.index_bytes, enc.k, enc.spec.numel)
        kept = flat[idx]
        bound[idx] = error_bound(enc.bits, enc.scale, float(kept.min()), float(kept.max()))
    return bound
