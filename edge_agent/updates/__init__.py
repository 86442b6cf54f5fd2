"""Compressed model updates: delta codec, error feedback, byte budget, wire format, chunks.

Device side: `UpdateEncoder` (residual + `CompressionPolicy` + codec) -> `EncodedUpdate`
-> `.chunks()` for MQTT. Coordinator side: `Reassembler.add(chunk)` -> payload ->
`decode_update(payload, expected_table=...)` -> dense float32 deltas.

Modules: codec (pure maths), quantize, indices, budget, policy (warm-up), wire (payload
format), chunks (CRC32 chunks, reassembly), residual (crash-safe store), encoder, errors.
"""

from __future__ import annotations

from .budget import choose_for_budget, per_update_budget
from .chunks import Reassembled, Reassembler, split_chunks
from .codec import TensorSpec, compute_delta, tensor_table
from .encoder import EncodedUpdate, UpdateEncoder
from .errors import (
    BudgetError,
    ChunkError,
    NonFiniteDeltaError,
    TensorTableMismatchError,
    UnsupportedVersionError,
    UpdateError,
    UpdateFormatError,
    UpdateTooLargeError,
)
from .policy import UNCOMPRESSED, CompressionPolicy
from .residual import ResidualStore
from .wire import DecodedUpdate, UpdateHeader, decode_update, payload_digest

__all__ = [
    "UNCOMPRESSED",
    "BudgetError",
    "ChunkError",
    "CompressionPolicy",
    "DecodedUpdate",
    "EncodedUpdate",
    "NonFiniteDeltaError",
    "Reassembled",
    "Reassembler",
    "ResidualStore",
    "TensorSpec",
    "TensorTableMismatchError",
    "UnsupportedVersionError",
    "UpdateEncoder",
    "UpdateError",
    "UpdateFormatError",
    "UpdateHeader",
    "UpdateTooLargeError",
    "choose_for_budget",
    "compute_delta",
    "decode_update",
    "payload_digest",
    "per_update_budget",
    "split_chunks",
    "tensor_table",
]
