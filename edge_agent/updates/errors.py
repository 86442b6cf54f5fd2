"""Errors of the update codec and wire format.

All are `InputError`s (exit code 65, EX_DATAERR): an update that cannot be encoded or a
payload/chunk that cannot be accepted. Each message says what was wrong and where (which
tensor, which chunk of which update), so that an operator can act on a single log line.
"""

from __future__ import annotations

from ..errors import InputError


class UpdateError(InputError):
    """Base class: a model update could not be encoded, decoded or accepted."""


class NonFiniteDeltaError(UpdateError):
    """A delta holds NaN or Inf (or a value beyond float32): refused at encode, never sent."""


class UpdateFormatError(UpdateError):
    """A payload or chunk is malformed: truncated, bad magic, field out of range."""


class UnsupportedVersionError(UpdateFormatError):
    """A payload or chunk declares a format version this code does not read."""


class ChunkError(UpdateFormatError):
    """A chunk failed its CRC32, conflicts with or does not belong with its siblings, or the
    reassembled payload failed its sha256."""


class TensorTableMismatchError(UpdateError):
    """The update's tensor table (names, shapes, dtypes) is not the expected model's."""


class UpdateTooLargeError(UpdateError):
    """A payload, chunk or decoded tensor is over the configured size limit."""


class BudgetError(UpdateError):
    """A byte budget cannot be met (smaller than the update's fixed overhead)."""
