"""MXNet's ndarray list file (`head.params`) read and written with numpy alone.

The coordinator registers a bundle's head and publishes new versions of it; the fine-tune
job reads the base head and writes the trained one; the update encoder diffs the two. All
need the head parameters as named numpy arrays, and none should pay MXNet's import for it
(~130 MB and ~1.7 CPU-s: the idle service stays small, and the training child imports
MXNet only after the int8 features, so the two peaks do not stack). The format is the one `mx.nd.save` writes
(MXNet 1.x, dense CPU arrays; little-endian):

    u64 0x112 (list magic) | u64 reserved (0) | u64 n_arrays
    per array: u32 0xF993FAC9 (V2) or 0xF993FACA (V3) | i32 storage type (0 = dense)
               | u32 ndim | i64 dims[ndim] | i32 dev_type | i32 dev_id | i32 dtype flag | data
               (ndim 0 under V2 is an empty "none" array: no context, no data follow)
    u64 n_names | per name: u64 length | UTF-8 bytes

Names keep MXNet's "arg:" / "aux:" prefixes; `split_names` separates them. Every length is
bounded before anything is allocated: the file is untrusted (it comes from a bundle).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping

import numpy as np

from .errors import InputError

LIST_MAGIC = 0x112
V2_MAGIC, V3_MAGIC = 0xF993FAC9, 0xF993FACA
DTYPES = {0: np.float32, 1: np.float64, 2: np.float16, 3: np.uint8, 4: np.int32, 5: np.int8, 6: np.int64}
_FLAGS = {np.dtype(t): f for f, t in DTYPES.items()}
MAX_ARRAYS = 100_000
MAX_NDIM = 32
MAX_NAME_BYTES = 4096
MAX_FILE_BYTES = 1 << 30


class ParamsFormatError(InputError):
    """Bytes that are not an MXNet ndarray list file this module understands."""


class _Reader:
    def __init__(self, data: bytes, where: str) -> None:
        self.data, self.pos, self.where = data, 0, where

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise ParamsFormatError(f"{self.where}: truncated at byte {self.pos} reading {what} ({n} bytes)")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str, what: str) -> tuple[int, ...]:
        s = struct.Struct("<" + fmt)
        return s.unpack(self.take(s.size, what))


def load_params(data: bytes, *, where: str = "head.params") -> dict[str, np.ndarray]:
    """Parse `mx.nd.save` bytes -> {name (with arg:/aux: prefix): array}, in file order."""
    if len(data) > MAX_FILE_BYTES:
        raise ParamsFormatError(f"{where}: {len(data)} bytes is over the {MAX_FILE_BYTES}-byte limit")
    r = _Reader(bytes(data), where)
    magic, _reserved, count = r.unpack("QQQ", "header")
    if magic != LIST_MAGIC:
        raise ParamsFormatError(f"{where}: not an MXNet ndarray file (magic {magic:#x}, expected {LIST_MAGIC:#x})")
    if count > MAX_ARRAYS:
        raise ParamsFormatError(f"{where}: {count} arrays is over the limit of {MAX_ARRAYS}")
    arrays = [_read_array(r, i) for i in range(count)]
    (n_names,) = r.unpack("Q", "name count")
    if n_names != count:
        raise ParamsFormatError(f"{where}: {count} arrays but {n_names} names (unnamed lists are not parameters)")
    names = []
    for i in range(n_names):
        (length,) = r.unpack("Q", f"name {i} length")
        if length > MAX_NAME_BYTES:
            raise ParamsFormatError(f"{where}: name {i} of {length} bytes is over {MAX_NAME_BYTES}")
        try:
            names.append(r.take(length, f"name {i}").decode("utf-8"))
        except UnicodeDecodeError:
            raise ParamsFormatError(f"{where}: name {i} is not UTF-8") from None
    if r.pos != len(r.data):
        raise ParamsFormatError(f"{where}: {len(r.data) - r.pos} trailing bytes")
    if len(set(names)) != len(names):
        raise ParamsFormatError(f"{where}: a parameter name appears twice")
    return dict(zip(names, arrays, strict=True))


def _read_array(r: _Reader, i: int) -> np.ndarray:
    (magic,) = r.unpack("I", f"array {i} magic")
    if magic not in (V2_MAGIC, V3_MAGIC):
        raise ParamsFormatError(f"{r.where}: array {i}: magic {magic:#x} (only MXNet >= 1.0 files are read)")
    (stype,) = r.unpack("i", f"array {i} storage type")
    if stype != 0:
        raise ParamsFormatError(f"{r.where}: array {i}: sparse storage type {stype} is not supported")
    (ndim,) = r.unpack("I", f"array {i} ndim")
    if ndim > MAX_NDIM:
        raise ParamsFormatError(f"{r.where}: array {i}: {ndim} dimensions is over {MAX_NDIM}")
    dims = r.unpack(f"{ndim}q", f"array {i} shape") if ndim else ()
    if ndim == 0 and magic == V2_MAGIC:
        return np.zeros((0,), np.float32)  # a "none" array: nothing else was written
    if any(d < 0 for d in dims):
        raise ParamsFormatError(f"{r.where}: array {i}: unknown dimension in shape {dims}")
    r.unpack("ii", f"array {i} context")
    (flag,) = r.unpack("i", f"array {i} dtype")
    if flag not in DTYPES:
        raise ParamsFormatError(f"{r.where}: array {i}: dtype flag {flag} is not supported")
    dtype = np.dtype(DTYPES[flag]).newbyteorder("<")
    numel = 1
    for d in dims:
        numel *= d
    if numel * dtype.itemsize > len(r.data) - r.pos:  # before allocating anything
        raise ParamsFormatError(f"{r.where}: array {i}: shape {dims} needs more bytes than the file has")
    raw = r.take(numel * dtype.itemsize, f"array {i} data")
    return np.frombuffer(raw, dtype=dtype).astype(dtype.newbyteorder("="), copy=True).reshape(dims)


def dump_params(params: Mapping[str, np.ndarray]) -> bytes:
    """{name: array} -> bytes that `mx.nd.load` reads (V2 dense CPU arrays)."""
    head = [struct.pack("<QQQ", LIST_MAGIC, 0, len(params))]
    for name, value in params.items():
        arr = np.ascontiguousarray(value)
        if arr.dtype not in _FLAGS:
            raise InputError(f"parameter {name!r}: dtype {arr.dtype} cannot be stored in an MXNet file")
        if arr.ndim == 0:
            arr = arr.reshape(1)  # V2 reads a 0-dim shape as "none"; MXNet itself stores scalars as (1,)
        head.append(struct.pack(f"<IiI{arr.ndim}q", V2_MAGIC, 0, arr.ndim, *arr.shape))
        head.append(struct.pack("<iii", 1, 0, _FLAGS[arr.dtype]))
        head.append(arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes())
    head.append(struct.pack("<Q", len(params)))
    for name in params:
        encoded = name.encode("utf-8")
        head.append(struct.pack("<Q", len(encoded)) + encoded)
    return b"".join(head)


def split_names(params: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(arrays by bare name, bare name -> prefix) -- the trainer's names are bare
    ("output_fc_weight"); the file keeps "arg:" / "aux:" so it can be written back."""
    bare: dict[str, np.ndarray] = {}
    prefixes: dict[str, str] = {}
    for key, value in params.items():
        prefix, sep, name = key.partition(":")
        if not sep:
            prefix, name = "", key
        if name in bare:
            raise ParamsFormatError(f"parameter {name!r} appears both as arg: and aux:")
        bare[name], prefixes[name] = value, prefix
    return bare, prefixes


def join_names(arrays: Mapping[str, np.ndarray], prefixes: Mapping[str, str]) -> dict[str, np.ndarray]:
    """Inverse of split_names (names without a recorded prefix are written as arg:)."""
    return {(f"{prefixes.get(n, 'arg')}:{n}" if prefixes.get(n, "arg") else n): a for n, a in arrays.items()}
