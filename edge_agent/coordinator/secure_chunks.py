"""A secure round's masked inputs that arrive in several messages (protocol/schema.py:
`secagg_masked` with `chunk`, `chunks`, `sha256`): each device's chunks wait on disk until all
arrived, then the whole input is checked against its SHA-256 and handed to the round's
running sum (secure_rounds.py) -- a device that sent only some chunks is never in the sum.

    <state dir>/secagg/<job>-r<n>.chunks/<device>/<sha256>.<index>     (0600, crash-safe)

Not in the round's JSON state: that is rewritten on every accepted message, and a device's
chunks together are up to 4 MiB. A chunk is written once (a resend of the same chunk is
ignored); a coordinator restarted between chunks finds them here. Bounded: at most
`budget` bytes of partial inputs a round -- a device's first chunk reserves its whole input's
size, so the devices already begun can always finish; a device beyond it is refused this time
and sends again on the next request (once another's input was folded in, or never: it is then
that phase's dropout). Deleted once folded into the sum, when refused, and at the round's end.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
from pathlib import Path

from ..atomic import atomic_write_bytes, fsync_dir, read_limited
from ..errors import InputError
from ..protocol.schema import masked_chunk_sizes

DEFAULT_BUDGET = 256 << 20  # 64 devices' 1M-parameter inputs at once


class PendingInputs:
    def __init__(self, round_dir: Path, *, budget: int = DEFAULT_BUDGET) -> None:
        self.dir, self.budget = round_dir, budget

    def add(self, device: str, total: int, chunk: int, chunks: int, sha256: str,
            data: bytes) -> tuple[bytes | None, bool]:
        """Keep one chunk of `device`'s input of `total` bytes -> (the whole input once every
        chunk is here and its SHA-256 matches, else None; whether this chunk was new). The
        caller deletes the chunks once the input is in the sum (drop). InputError for a
        chunk that does not fit the round's layout or the device's earlier chunks, a full
        budget, or a reassembly that does not match its hash (its chunks deleted)."""
        sizes = masked_chunk_sizes(total)
        if chunks != len(sizes):
            raise InputError(f"secagg_masked.chunks: this round's masked input is {len(sizes)} messages, got {chunks}")
        if len(data) != sizes[chunk]:
            raise InputError(f"secagg_masked.masked: chunk {chunk} of this round's input is {sizes[chunk]} bytes, "
                             f"got {len(data)}")
        mine = self.dir / device
        have = self._files(mine)
        if any(not p.name.startswith(f"{sha256}.") for p in have):
            raise InputError("secagg_masked.sha256 differs from this device's earlier chunks of the round")
        if not have:
            begun = sum(1 for p in self.dir.iterdir() if p.is_dir()) if self.dir.is_dir() else 0
            if (begun + 1) * total > max(self.budget, total):
                raise InputError(f"secagg_masked: {begun} devices' partial masked inputs are held already "
                                 f"({self.budget >> 20} MiB a round); send again on the next request")
        path = mine / f"{sha256}.{chunk}"
        new = not path.exists()
        if new:  # (a resend: ignored)
            mine.mkdir(mode=0o700, parents=True, exist_ok=True)
            atomic_write_bytes(path, data, mode=0o600)
        if len(self._files(mine)) < len(sizes):
            return None, new
        whole = b"".join(read_limited(mine / f"{sha256}.{i}", size) for i, size in enumerate(sizes))
        if len(whole) != total or hashlib.sha256(whole).hexdigest() != sha256:
            self.drop(device)
            raise InputError("secagg_masked.sha256 does not match the reassembled masked input: its chunks "
                             "are dropped")
        return whole, new

    def drop(self, device: str) -> None:
        """`device`'s chunks go (folded into the sum, refused, or its input already counted)."""
        mine = self.dir / device
        if mine.is_dir():
            shutil.rmtree(mine, ignore_errors=True)
            with contextlib.suppress(OSError):
                fsync_dir(self.dir)

    def clear(self) -> None:
        """The round ended: every partial input goes."""
        shutil.rmtree(self.dir, ignore_errors=True)

    @staticmethod
    def _files(mine: Path) -> list[Path]:
        return [p for p in mine.iterdir() if not p.name.startswith(".")] if mine.is_dir() else []
