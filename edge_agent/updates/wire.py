"""Wire format of one model update (the payload that chunks.py splits for MQTT).

Version 1, all integers little-endian, "varint" = unsigned LEB128, "str" = varint byte
length + UTF-8:

    magic "EAUP" | format version u8 (=1) | flags u8 (=0)
    model_name str | model_version str | job_id str | device_id str | round varint
    scope u8 (0 global top-k, 1 per-tensor top-k)
    n_tensors varint, then per tensor (the tensor table with its codec parameters):
        name str | dtype u8 (1 float32, 2 float16, 3 float64) | ndim u8 | dims varint*ndim
        k varint (kept values) | bits u8 (1, 4, 8, 32) | index coding u8 (0 all,
        1 varint, 2 bitmap, 3 Rice; see indices.py) | index length varint
        | scale f32 (only when bits != 32 and k > 0)
    body: per tensor, index bytes then value bytes (their lengths follow from the table)

The payload carries no checksum of its own: the chunk layer puts a CRC32 on every chunk
and the sha256 of the whole payload on every chunk. That sha256 (`payload_digest`) is what
the protocol layer signs; chunks.py carries the signature next to it.
(job_id, device_id, round) is the key the coordinator de-duplicates on.

Every field is bounded before anything is allocated: payload size, string lengths, tensor
count, rank, elements per tensor and in total (a 100-byte payload must not be able to
declare a 10 GB tensor), and, when the caller passes the model's table, the table is
checked before any tensor is decoded.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .codec import (
    DTYPES,
    MAX_NDIM,
    EncodedTensor,
    Tensors,
    TensorSpec,
    check_table,
    decode_tensors,
    encode_delta,
    validate_spec,
)
from .errors import UnsupportedVersionError, UpdateFormatError, UpdateTooLargeError
from .indices import INDEX_KINDS, MAX_ELEMENTS_PER_TENSOR, expected_index_bytes
from .quantize import SUPPORTED_BITS, value_bytes

MAGIC = b"EAUP"
FORMAT_VERSION = 1
MAX_ID_BYTES = 128  # model name/version, job id, device id
MAX_TENSORS = 4096
DEFAULT_MAX_PAYLOAD_BYTES = 64 << 20
DEFAULT_MAX_ELEMENTS = 1 << 26  # 64 Mi floats = 256 MB of decoded delta
_SCOPE_CODES = {"global": 0, "tensor": 1}
_DTYPE_CODES = {name: i + 1 for i, name in enumerate(DTYPES)}
_F32 = struct.Struct("<f")


@dataclass(frozen=True)
class UpdateHeader:
    """Who sent which update of which model: the coordinator's de-dup key is `key`."""

    model_name: str
    model_version: str
    job_id: str
    device_id: str
    round: int
    scope: str = "global"

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.job_id, self.device_id, self.round)


@dataclass(frozen=True)
class DecodedUpdate:
    header: UpdateHeader
    table: tuple[TensorSpec, ...]
    deltas: dict[str, np.ndarray]  # dense float32, shaped as the table
    digest: str  # sha256 hex of the payload (what the protocol layer signs)
    payload_bytes: int


def payload_digest(payload: bytes) -> bytes:
    """sha256 of the whole payload: carried by every chunk, and what gets signed."""
    return hashlib.sha256(payload).digest()


def _uv(value: int) -> bytes:
    """LEB128 of one non-negative int (pure Python: headers hold a few dozen of these)."""
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _str(value: str, what: str) -> bytes:
    raw = value.encode("utf-8")
    if not 0 < len(raw) <= MAX_ID_BYTES:
        raise UpdateFormatError(f"{what} {value!r} must be 1..{MAX_ID_BYTES} UTF-8 bytes")
    return _uv(len(raw)) + raw


def _pack_header(header: UpdateHeader, encoded: Sequence[EncodedTensor]) -> bytearray:
    if header.scope not in _SCOPE_CODES:
        raise UpdateFormatError(f"scope {header.scope!r} is not one of {tuple(_SCOPE_CODES)}")
    if not 0 <= header.round < 1 << 32:
        raise UpdateFormatError(f"round {header.round} is outside 0..2**32-1")
    if len(encoded) > MAX_TENSORS:
        raise UpdateFormatError(f"{len(encoded)} tensors is over the limit of {MAX_TENSORS}")
    out = bytearray(MAGIC + bytes([FORMAT_VERSION, 0]))
    out += _str(header.model_name, "model name") + _str(header.model_version, "model version")
    out += _str(header.job_id, "job id") + _str(header.device_id, "device id")
    out += _uv(header.round) + bytes([_SCOPE_CODES[header.scope]]) + _uv(len(encoded))
    for enc in encoded:
        validate_spec(enc.spec)
        name = enc.spec.name.encode("utf-8")
        out += _uv(len(name)) + name + bytes([_DTYPE_CODES[enc.spec.dtype], len(enc.spec.shape)])
        for d in enc.spec.shape:
            out += _uv(d)
        out += _uv(enc.k) + bytes([enc.bits, enc.index_kind]) + _uv(len(enc.index_bytes))
        if enc.bits != 32 and enc.k:
            out += _F32.pack(enc.scale)
    return out


def pack_update(header: UpdateHeader, encoded: Sequence[EncodedTensor]) -> bytes:
    """Serialise a header and encoded tensors into one payload."""
    out = _pack_header(header, encoded)
    for enc in encoded:
        out += enc.index_bytes + enc.value_bytes
    return bytes(out)


def header_size(header: UpdateHeader, encoded: Sequence[EncodedTensor]) -> int:
    """Bytes of the header and tensor table alone (the fixed overhead of an update)."""
    return len(_pack_header(header, encoded))


def encode_update(
    header: UpdateHeader,
    delta: Tensors,
    *,
    density: float,
    bits: int = 8,
    table: Sequence[TensorSpec] | None = None,
) -> bytes:
    """Fixed-rate convenience: top-k at `density` (scope from the header), `bits`, packed.
    `table`: the model's tensor table to declare (codec.model_table)."""
    encoded = encode_delta(delta, density=density, bits=bits, scope=header.scope, table=table)
    return pack_update(header, encoded)


class _Reader:
    """Bounds-checked cursor: every read names what it was reading when data runs out."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int, what: str) -> bytes:
        if n > len(self.data) - self.pos:
            raise UpdateFormatError(
                f"update truncated reading {what} at byte {self.pos}: needs {n}, {len(self.data) - self.pos} left"
            )
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def u8(self, what: str) -> int:
        return self.take(1, what)[0]

    def varint(self, what: str, limit: int) -> int:
        value = 0
        for i in range(10):
            byte = self.u8(what)
            value |= (byte & 0x7F) << (7 * i)
            if byte < 0x80:
                if value > limit:
                    raise UpdateFormatError(
                        f"update field {what} = {value} is over the limit of {limit}"
                    )
                return value
        raise UpdateFormatError(f"update field {what}: varint longer than 10 bytes")

    def string(self, what: str) -> str:
        n = self.varint(f"{what} length", MAX_ID_BYTES)
        try:
            return self.take(n, what).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise UpdateFormatError(f"update field {what} is not valid UTF-8") from exc


def unpack_update(
    payload: bytes,
    *,
    expected_table: Sequence[TensorSpec] | None = None,
    max_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    max_elements: int = DEFAULT_MAX_ELEMENTS,
) -> tuple[UpdateHeader, list[EncodedTensor]]:
    """Parse and validate a payload (no decoding of values yet)."""
    if len(payload) > max_bytes:
        raise UpdateTooLargeError(
            f"update payload of {len(payload)} bytes is over the limit of {max_bytes}"
        )
    r = _Reader(bytes(payload))
    magic = r.take(4, "magic")
    if magic != MAGIC:
        raise UpdateFormatError(f"not a model update: magic {magic!r}, expected {MAGIC!r}")
    version = r.u8("format version")
    if version != FORMAT_VERSION:
        raise UnsupportedVersionError(
            f"update format version {version} is not supported (this code reads version {FORMAT_VERSION})"
        )
    if (flags := r.u8("flags")) != 0:
        raise UpdateFormatError(
            f"update flags {flags:#04x}: no flags are defined in version {FORMAT_VERSION}"
        )
    model_name, model_version = r.string("model name"), r.string("model version")
    job_id, device_id = r.string("job id"), r.string("device id")
    rnd = r.varint("round", (1 << 32) - 1)
    scope_code = r.u8("scope")
    scopes = {v: k for k, v in _SCOPE_CODES.items()}
    if scope_code not in scopes:
        raise UpdateFormatError(f"update scope code {scope_code} is unknown")
    header = UpdateHeader(model_name, model_version, job_id, device_id, rnd, scopes[scope_code])
    n_tensors = r.varint("tensor count", MAX_TENSORS)
    dtypes = {v: k for k, v in _DTYPE_CODES.items()}
    entries: list[tuple[TensorSpec, int, int, int, int, float]] = []
    total = 0
    for t in range(n_tensors):
        name_len = r.varint(f"tensor {t} name length", 255)
        try:
            name = r.take(name_len, f"tensor {t} name").decode("utf-8")
        except UnicodeDecodeError as exc:
            raise UpdateFormatError(f"tensor {t} name is not valid UTF-8") from exc
        where = f"tensor {t} {name!r}"
        dcode = r.u8(f"{where} dtype")
        if dcode not in dtypes:
            raise UpdateFormatError(f"{where}: dtype code {dcode} is unknown")
        ndim = r.u8(f"{where} rank")
        if ndim > MAX_NDIM:
            raise UpdateFormatError(f"{where}: rank {ndim} is over {MAX_NDIM}")
        shape = tuple(r.varint(f"{where} dim {i}", MAX_ELEMENTS_PER_TENSOR) for i in range(ndim))
        spec = TensorSpec(name, shape, dtypes[dcode])
        validate_spec(spec)
        k = r.varint(f"{where} k", spec.numel)
        bits = r.u8(f"{where} bits")
        if bits not in SUPPORTED_BITS:
            raise UpdateFormatError(f"{where}: bit width {bits} is not one of {SUPPORTED_BITS}")
        kind = r.u8(f"{where} index coding")
        if kind not in INDEX_KINDS:
            raise UpdateFormatError(f"{where}: index coding {kind} is unknown")
        index_len = r.varint(f"{where} index length", max_bytes)
        implied = expected_index_bytes(kind, spec.numel)
        if implied is not None and index_len != implied:
            raise UpdateFormatError(
                f"{where}: index length {index_len}, {INDEX_KINDS[kind]} coding needs {implied}"
            )
        scale = _F32.unpack(r.take(4, f"{where} scale"))[0] if bits != 32 and k else 0.0
        total += spec.numel
        entries.append((spec, k, bits, kind, index_len, scale))
    table = tuple(e[0] for e in entries)
    if len({s.name for s in table}) != len(table):
        raise UpdateFormatError("update tensor table names a tensor twice")
    if expected_table is not None:
        check_table(table, expected_table)
    if total > max_elements:
        raise UpdateTooLargeError(
            f"update declares {total} elements, over the limit of {max_elements}"
        )
    body = len(payload) - r.pos
    needed = sum(e[4] + value_bytes(e[1], e[2]) for e in entries)
    if body != needed:
        raise UpdateFormatError(f"update body is {body} bytes, its tensor table needs {needed}")
    encoded = []
    for spec, k, bits, kind, index_len, scale in entries:
        index_bytes = r.take(index_len, f"{spec.name!r} indices")
        values = r.take(value_bytes(k, bits), f"{spec.name!r} values")
        encoded.append(EncodedTensor(spec, k, bits, scale, kind, index_bytes, values))
    return header, encoded


def decode_update(
    payload: bytes,
    *,
    expected_table: Sequence[TensorSpec] | None = None,
    max_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    max_elements: int = DEFAULT_MAX_ELEMENTS,
) -> DecodedUpdate:
    """Parse, validate and decode a payload into dense float32 deltas.

    Pass the receiving model's `expected_table` (codec.tensor_table(model)) to refuse an
    update for another model before decoding anything.
    """
    header, encoded = unpack_update(
        payload, expected_table=expected_table, max_bytes=max_bytes, max_elements=max_elements
    )
    return DecodedUpdate(
        header=header,
        table=tuple(e.spec for e in encoded),
        deltas=decode_tensors(encoded),
        digest=payload_digest(payload).hex(),
        payload_bytes=len(payload),
    )
