"""Crash-safe persistence of the error-feedback residual across reboots.

The residual is what compression has not yet sent; losing it silently loses that part of
training, and a corrupt one would poison every later update. So it is written with
`atomic.write_checked` (temp + fsync + rename, framed with length and sha256) and read back
with every field validated: a truncated, zero-filled or bit-flipped file, a file for
another model, or one holding NaN/Inf is refused with a clear error; the caller then
starts from a zero residual (logging why), which costs accuracy only transiently.

File payload: b"EARS" | version u8 | JSON length u32 LE | JSON
{"model": ..., "round": ..., "tensors": [[name, shape, dtype], ...]} | float32 LE data.
`round` is the last round whose update this residual follows: after a reboot the agent
knows whether round r's update was committed (and, since encoding is deterministic, can
re-encode round r byte-identically from the round r-1 residual if it was not).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..atomic import CorruptFileError, read_checked, write_checked
from .codec import Tensors, TensorSpec, check_table, tensor_table, validate_spec

_MAGIC = b"EARS"
_VERSION = 1
_HEAD = struct.Struct("<4sBI")
_MAX_JSON = 1 << 20
DEFAULT_MAX_RESIDUAL_BYTES = 1 << 30


@dataclass(frozen=True)
class StoredResidual:
    model_name: str
    round: int
    table: tuple[TensorSpec, ...]
    residual: dict[str, np.ndarray]  # float32, shaped as the table


class ResidualStore:
    """One residual file (e.g. /var/lib/edge-agent/residual/<model>.bin)."""

    def __init__(
        self, path: str | os.PathLike[str], *, max_bytes: int = DEFAULT_MAX_RESIDUAL_BYTES
    ) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes

    def save(self, residual: Tensors, *, model_name: str, round: int) -> None:
        """Persist `residual` (float32) as the state after `round`'s update, atomically."""
        table = tensor_table({n: np.asarray(a, dtype=np.float32) for n, a in residual.items()})
        meta = {
            "model": model_name,
            "round": int(round),
            "tensors": [[s.name, list(s.shape), s.dtype] for s in table],
        }
        blob = json.dumps(meta, separators=(",", ":")).encode()
        data = b"".join(
            np.ascontiguousarray(residual[s.name], dtype="<f4").tobytes() for s in table
        )
        write_checked(self.path, _HEAD.pack(_MAGIC, _VERSION, len(blob)) + blob + data)

    def load(self, *, expected_table: Sequence[TensorSpec] | None = None) -> StoredResidual | None:
        """The stored residual, None when there is none yet.

        Raises CorruptFileError (an InputError) for a damaged file, and
        TensorTableMismatchError when it belongs to a model with another table.
        """
        if not self.path.exists():
            return None
        where = str(self.path)
        raw = read_checked(self.path, self.max_bytes)
        if len(raw) < _HEAD.size:
            raise CorruptFileError(f"{where}: residual file too short")
        magic, version, jlen = _HEAD.unpack_from(raw)
        if magic != _MAGIC:
            raise CorruptFileError(f"{where}: not a residual file (magic {magic!r})")
        if version != _VERSION:
            raise CorruptFileError(f"{where}: residual format version {version} is not supported")
        if jlen > min(_MAX_JSON, len(raw) - _HEAD.size):
            raise CorruptFileError(f"{where}: residual metadata length {jlen} is out of range")
        try:
            meta = json.loads(raw[_HEAD.size : _HEAD.size + jlen])
            model_name, rnd = str(meta["model"]), int(meta["round"])
            table = tuple(
                TensorSpec(str(n), tuple(int(d) for d in shape), str(dt))
                for n, shape, dt in meta["tensors"]
            )
            for spec in table:
                validate_spec(spec)
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptFileError(f"{where}: residual metadata is invalid ({exc})") from exc
        data = raw[_HEAD.size + jlen :]
        needed = 4 * sum(s.numel for s in table)
        if len(data) != needed:
            raise CorruptFileError(
                f"{where}: {len(data)} bytes of residual data, its table needs {needed}"
            )
        if expected_table is not None:
            # A residual is always float32, whatever the model's dtype: compare names and shapes.
            as_f32 = [TensorSpec(s.name, s.shape, "float32") for s in expected_table]
            check_table(table, as_f32, what=f"residual {where}")
        residual, offset = {}, 0
        for spec in table:
            arr = np.frombuffer(data, dtype="<f4", count=spec.numel, offset=offset).astype(
                np.float32
            )
            if not np.isfinite(arr).all():
                raise CorruptFileError(
                    f"{where}: residual of tensor {spec.name!r} holds NaN or Inf"
                )
            residual[spec.name] = arr.reshape(spec.shape)
            offset += 4 * spec.numel
        return StoredResidual(model_name, rnd, table, residual)

    def clear(self) -> None:
        """Forget the residual (e.g. the model's table changed)."""
        self.path.unlink(missing_ok=True)
