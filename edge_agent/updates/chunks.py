"""Chunking of an update payload for MQTT, and reassembly on the coordinator.

Chunk layout, version 1 (little-endian), one chunk per MQTT message:

    magic "EAUC" | version u8 (=1) | flags u8 (=0) | sha256 of the whole payload (32)
    index u16 | count u16 | payload length u32 | signature length u16 | data length u32
    signature (chunk 0 only) | data | CRC32 u32 of everything before it

56 bytes of overhead per chunk. Each chunk is at most `chunk_size` bytes (default 64 KiB,
so any single message fits AWS IoT Core's 128 KiB cap with room for the topic).

The sha256 is both the grouping key (chunks of concurrent updates cannot mix) and the
end-to-end check of the reassembled payload. The signature slot is where the protocol
layer puts its signature *of that sha256*; this module carries the bytes and never
interprets them (verification is the protocol's job). Reassembly accepts chunks in any
order and ignores exact duplicates (QoS 1 redelivers); it rejects truncated, bit-flipped,
conflicting and foreign chunks, and a payload whose sha256 does not match, each with an
error naming the chunk and update.
"""

from __future__ import annotations

import struct
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field

from .errors import ChunkError, UnsupportedVersionError, UpdateTooLargeError
from .wire import DEFAULT_MAX_PAYLOAD_BYTES, payload_digest

CHUNK_MAGIC = b"EAUC"
CHUNK_VERSION = 1
_HEAD = struct.Struct("<4sBB32sHHIHI")
CHUNK_OVERHEAD = _HEAD.size + 4  # + CRC32
DEFAULT_CHUNK_SIZE = 64 * 1024
DEFAULT_MAX_CHUNK_BYTES = 128 * 1024  # what the receiver accepts: AWS IoT Core's message cap
MAX_CHUNKS = 0xFFFF
MAX_SIGNATURE_BYTES = 1024


def _check_sizes(chunk_size: int, signature: int) -> None:
    if signature > MAX_SIGNATURE_BYTES:
        raise ValueError(f"signature of {signature} bytes is over {MAX_SIGNATURE_BYTES}")
    if chunk_size < CHUNK_OVERHEAD + signature + 1:
        raise ValueError(
            f"chunk_size {chunk_size} leaves no room for data ({CHUNK_OVERHEAD} + {signature} overhead)"
        )


def chunk_count(
    payload_len: int, chunk_size: int = DEFAULT_CHUNK_SIZE, signature_bytes: int = 0
) -> int:
    """How many chunks a payload of `payload_len` bytes needs."""
    _check_sizes(chunk_size, signature_bytes)
    first = chunk_size - CHUNK_OVERHEAD - signature_bytes
    if payload_len <= first:
        return 1
    rest = chunk_size - CHUNK_OVERHEAD
    return 1 + -(-(payload_len - first) // rest)


def wire_size(
    payload_len: int, chunk_size: int = DEFAULT_CHUNK_SIZE, signature_bytes: int = 0
) -> int:
    """Total bytes on the wire (all chunks) for a payload of `payload_len` bytes."""
    return (
        payload_len
        + signature_bytes
        + CHUNK_OVERHEAD * chunk_count(payload_len, chunk_size, signature_bytes)
    )


def split_chunks(
    payload: bytes, *, chunk_size: int = DEFAULT_CHUNK_SIZE, signature: bytes = b""
) -> list[bytes]:
    """Split a payload into CRC-protected chunks of at most `chunk_size` bytes each.

    `signature` (e.g. Ed25519 over `payload_digest(payload)`) rides in chunk 0.
    """
    if not payload:
        raise ValueError("refusing to chunk an empty payload")
    count = chunk_count(len(payload), chunk_size, len(signature))
    if count > MAX_CHUNKS:
        raise UpdateTooLargeError(
            f"payload of {len(payload)} bytes needs {count} chunks, over {MAX_CHUNKS}"
        )
    digest = payload_digest(payload)
    chunks, pos = [], 0
    for index in range(count):
        sig = signature if index == 0 else b""
        room = chunk_size - CHUNK_OVERHEAD - len(sig)
        data = payload[pos : pos + room]
        pos += len(data)
        head = _HEAD.pack(
            CHUNK_MAGIC, CHUNK_VERSION, 0, digest, index, count, len(payload), len(sig), len(data)
        )
        body = head + sig + data
        chunks.append(body + struct.pack("<I", zlib.crc32(body)))
    return chunks


@dataclass(frozen=True)
class Chunk:
    digest: bytes
    index: int
    count: int
    payload_len: int
    signature: bytes
    data: bytes

    @property
    def label(self) -> str:
        return f"chunk {self.index + 1}/{self.count} of update {self.digest.hex()[:12]}"


def parse_chunk(raw: bytes, *, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES) -> Chunk:
    """Validate one chunk (size limit first, then magic, version, CRC32, lengths)."""
    if len(raw) > max_chunk_bytes:
        raise UpdateTooLargeError(
            f"chunk of {len(raw)} bytes is over the limit of {max_chunk_bytes}"
        )
    if len(raw) < 6 or raw[:4] != CHUNK_MAGIC:
        raise ChunkError(
            f"not an update chunk (magic {bytes(raw[:4])!r}, expected {CHUNK_MAGIC!r})"
        )
    if raw[4] != CHUNK_VERSION:
        # Every version ends with a CRC32 of the rest: tell a damaged version byte apart
        # from a chunk written by a newer agent.
        if len(raw) < 8 or zlib.crc32(raw[:-4]) != struct.unpack_from("<I", raw, len(raw) - 4)[0]:
            raise ChunkError(
                f"chunk failed its CRC32: bit-flipped or corrupt (version byte reads {raw[4]})"
            )
        raise UnsupportedVersionError(
            f"chunk format version {raw[4]} is not supported (this code reads version {CHUNK_VERSION})"
        )
    if len(raw) < CHUNK_OVERHEAD:
        raise ChunkError(
            f"chunk truncated: {len(raw)} bytes, the header alone needs {CHUNK_OVERHEAD}"
        )
    _, _, flags, digest, index, count, total, sig_len, data_len = _HEAD.unpack_from(raw)
    where = f"chunk {index + 1}/{count} of update {digest.hex()[:12]}"
    expected = CHUNK_OVERHEAD + sig_len + data_len
    (crc,) = struct.unpack_from("<I", raw, len(raw) - 4)
    if zlib.crc32(raw[:-4]) != crc:
        if len(raw) < expected:
            raise ChunkError(
                f"chunk failed its CRC32 and is shorter than its header says ({len(raw)} of "
                f"{expected} bytes): truncated, or a corrupt header ({where})"
            )
        raise ChunkError(f"chunk failed its CRC32: bit-flipped or corrupt (claims to be {where})")
    if len(raw) != expected:
        raise ChunkError(f"{where}: {len(raw)} bytes, its header says {expected}")
    if flags:
        raise ChunkError(f"{where}: flags {flags:#04x} are not defined in version {CHUNK_VERSION}")
    if count == 0 or index >= count:
        raise ChunkError(f"{where}: index out of range")
    if sig_len and index != 0:
        raise ChunkError(f"{where}: only chunk 1 may carry the signature")
    if data_len == 0 or data_len > total:
        raise ChunkError(f"{where}: {data_len} data bytes for a {total}-byte payload")
    body = _HEAD.size
    return Chunk(
        digest,
        index,
        count,
        total,
        bytes(raw[body : body + sig_len]),
        bytes(raw[body + sig_len : -4]),
    )


@dataclass(frozen=True)
class Reassembled:
    payload: bytes
    digest: bytes  # sha256 of payload: verified; what a signature covers
    signature: bytes  # as carried by chunk 1; empty when unsigned; NOT verified here
    chunks: int
    duplicates: int


@dataclass
class _Pending:
    count: int
    payload_len: int
    parts: dict[int, bytes] = field(default_factory=dict)
    signature: bytes = b""
    received: int = 0
    duplicates: int = 0


class Reassembler:
    """Collects chunks of many concurrent updates; returns each payload once it is complete.

    Memory is bounded: at most `max_pending` incomplete updates and `max_pending_bytes`
    buffered (the oldest incomplete update is dropped first, counted in `evicted`).
    Completed digests are remembered (`remember` of them) so late duplicates are ignored.
    """

    def __init__(
        self,
        *,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        max_pending: int = 64,
        max_pending_bytes: int = 256 << 20,
        remember: int = 1024,
    ) -> None:
        limits = (max_chunk_bytes, max_payload_bytes, max_pending, max_pending_bytes, remember)
        if min(limits) < 1:
            raise ValueError(f"Reassembler limits must be positive, got {limits}")
        self.max_chunk_bytes = max_chunk_bytes
        self.max_payload_bytes = max_payload_bytes
        self.max_pending = max_pending
        self.max_pending_bytes = max_pending_bytes
        self._pending: OrderedDict[bytes, _Pending] = OrderedDict()
        self._done: OrderedDict[bytes, None] = OrderedDict()
        self._remember = remember
        self.evicted = 0
        self.late_duplicates = 0

    @property
    def pending(self) -> int:
        return len(self._pending)

    def _buffered(self) -> int:
        return sum(p.received for p in self._pending.values())

    def add(self, raw: bytes) -> Reassembled | None:
        """Take one chunk; return the payload when this chunk completes it, else None."""
        chunk = parse_chunk(raw, max_chunk_bytes=self.max_chunk_bytes)
        if chunk.payload_len > self.max_payload_bytes:
            raise UpdateTooLargeError(
                f"{chunk.label}: payload of {chunk.payload_len} bytes is over the limit of {self.max_payload_bytes}"
            )
        if chunk.digest in self._done:
            self.late_duplicates += 1
            return None
        state = self._pending.get(chunk.digest)
        if state is None:
            state = _Pending(chunk.count, chunk.payload_len)
        elif (state.count, state.payload_len) != (chunk.count, chunk.payload_len):
            raise ChunkError(
                f"{chunk.label} says {chunk.count} chunks / {chunk.payload_len} bytes, earlier chunks "
                f"said {state.count} / {state.payload_len} (foreign or corrupt chunk)"
            )
        if chunk.index in state.parts:
            if state.parts[chunk.index] != chunk.data or (
                chunk.index == 0 and state.signature != chunk.signature
            ):
                raise ChunkError(
                    f"{chunk.label} arrived twice with different contents (foreign or corrupt chunk)"
                )
            state.duplicates += 1
            return None
        if state.received + len(chunk.data) > state.payload_len:
            raise ChunkError(
                f"{chunk.label}: chunks hold more than the {state.payload_len}-byte payload"
            )
        state.parts[chunk.index] = chunk.data
        state.received += len(chunk.data)
        if chunk.index == 0:
            state.signature = chunk.signature
        self._pending[chunk.digest] = state
        self._pending.move_to_end(chunk.digest)
        if len(state.parts) < state.count:
            self._evict(keep=chunk.digest)
            return None
        del self._pending[chunk.digest]
        payload = b"".join(state.parts[i] for i in range(state.count))
        if len(payload) != state.payload_len or payload_digest(payload) != chunk.digest:
            raise ChunkError(
                f"update {chunk.digest.hex()[:12]}: reassembled payload ({len(payload)} bytes) does not "
                "match the sha256 its chunks carry (a foreign or forged chunk); dropped"
            )
        self._done[chunk.digest] = None
        while len(self._done) > self._remember:
            self._done.popitem(last=False)
        return Reassembled(payload, chunk.digest, state.signature, state.count, state.duplicates)

    def _evict(self, keep: bytes) -> None:
        while len(self._pending) > 1 and (
            len(self._pending) > self.max_pending or self._buffered() > self.max_pending_bytes
        ):
            oldest = next(iter(self._pending))
            if oldest == keep:
                break
            del self._pending[oldest]
            self.evicted += 1
