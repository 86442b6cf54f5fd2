"""Training checkpoints that survive kill -9 and brown-outs.

A checkpoint is a small NPZ (no pickles) of named float arrays -- head parameters,
optimiser state, the best parameters so far -- plus a JSON metadata record (step, epoch,
RNG position, energy used, governor state, which model it belongs to). The NPZ bytes are
framed by `atomic.write_checked` (length + sha256) and written temp -> fsync -> rename ->
fsync dir, so after a crash a file is either complete or detectably bad.

Files are `ckpt-<seq>.ckpt` with a sequence number that only grows. The newest `keep`
(default 2) are kept, so the previous one is still there if the newest turns out
truncated or zero-filled (what an SD card can leave after power loss despite fsync). A
file that fails its check is renamed `*.corrupt` (never deleted on sight: it is evidence)
and loading falls back to the next newest. A checkpoint that verifies but belongs to
another model or job raises `CheckpointMismatchError` and is left untouched.
"""

from __future__ import annotations

import io
import json
import os
import re
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic import CorruptFileError, FileTooLargeError, fsync_dir, read_checked, write_checked
from ..errors import InputError

FORMAT = 1
META_KEY = "__meta__"
MAX_CHECKPOINT_BYTES = 512 << 20
MAX_ARRAYS = 10_000
KEEP_CORRUPT = 2
_NAME = re.compile(r"^ckpt-(\d{1,12})\.ckpt(\.corrupt)?$")
_TMP = re.compile(r"^\.ckpt-\d{1,12}\.ckpt\..*\.tmp$")


class CheckpointMismatchError(InputError):
    """A valid checkpoint that belongs to another model or job configuration."""


@dataclass
class Checkpoint:
    step: int
    meta: dict[str, Any]
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    path: Path | None = None

    def to_bytes(self) -> bytes:
        meta = dict(self.meta, step=int(self.step), format=FORMAT)
        encoded = np.frombuffer(json.dumps(meta, sort_keys=True).encode(), dtype=np.uint8)
        buf = io.BytesIO()
        np.savez(buf, **{META_KEY: encoded}, **{k: np.ascontiguousarray(v) for k, v in self.arrays.items()})
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, payload: bytes, *, where: str = "checkpoint") -> Checkpoint:
        """Parse a verified payload; raises CorruptFileError on anything unexpected."""
        try:
            with zipfile.ZipFile(io.BytesIO(payload)) as archive:
                infos = archive.infolist()
                if len(infos) > MAX_ARRAYS or sum(i.file_size for i in infos) > MAX_CHECKPOINT_BYTES:
                    raise CorruptFileError(f"{where}: too many or too large arrays")
            npz = np.load(io.BytesIO(payload), allow_pickle=False)
            meta = json.loads(npz[META_KEY].tobytes().decode("utf-8"))
            arrays = {k: npz[k] for k in npz.files if k != META_KEY}
        except CorruptFileError:
            raise
        except (zipfile.BadZipFile, KeyError, ValueError, OSError, EOFError, UnicodeDecodeError) as exc:
            raise CorruptFileError(f"{where}: not a readable checkpoint ({type(exc).__name__}: {exc})") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise CorruptFileError(f"{where}: unknown checkpoint format {meta.get('format') if isinstance(meta, dict) else meta!r}")
        step = meta.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CorruptFileError(f"{where}: bad step {step!r}")
        for key, value in arrays.items():
            if value.dtype.kind not in "fiub":
                raise CorruptFileError(f"{where}: array {key!r} has dtype {value.dtype}")
            if value.dtype.kind == "f" and not np.isfinite(value).all():
                raise CorruptFileError(f"{where}: array {key!r} has non-finite values")
        return cls(step=step, meta=meta, arrays=arrays)


class CheckpointStore:
    """The checkpoints of one job, in one directory."""

    def __init__(self, directory: str | os.PathLike[str], *, keep: int = 2) -> None:
        if keep < 2:
            raise ValueError("keep at least 2 checkpoints: the previous one is the fallback")
        self.dir = Path(directory)
        self.keep = keep
        self.problems: list[str] = []  # corrupt files met while loading
        self.dir.mkdir(parents=True, exist_ok=True)
        self._remove_stale_temps()

    def _entries(self) -> list[tuple[int, Path, bool]]:
        """(sequence, path, corrupt) for every checkpoint file, oldest first."""
        out = []
        for entry in self.dir.iterdir():
            match = _NAME.match(entry.name)
            if match:
                out.append((int(match.group(1)), entry, bool(match.group(2))))
        return sorted(out)

    def _remove_stale_temps(self) -> None:
        """Temp files left by a write that was killed before its rename."""
        for entry in self.dir.iterdir():
            if _TMP.match(entry.name):
                entry.unlink(missing_ok=True)

    def paths(self) -> list[Path]:
        """Good-looking (not yet found corrupt) checkpoint files, newest first."""
        return [p for _, p, corrupt in reversed(self._entries()) if not corrupt]

    def save(self, checkpoint: Checkpoint) -> Path:
        """Write a new checkpoint durably, then drop all but the newest `keep`."""
        entries = self._entries()
        seq = (entries[-1][0] + 1) if entries else 1
        path = self.dir / f"ckpt-{seq:08d}.ckpt"
        write_checked(path, checkpoint.to_bytes())
        good = [p for _, p, corrupt in self._entries() if not corrupt]
        for old in good[:-self.keep]:
            old.unlink(missing_ok=True)
        if len(good) > self.keep:
            fsync_dir(self.dir)
        checkpoint.path = path
        return path

    def load_latest(self, *, expect: Mapping[str, Any] | None = None) -> Checkpoint | None:
        """The newest checkpoint that verifies, or None if there is none.

        Corrupt files are renamed `*.corrupt` and skipped. `expect` maps metadata keys to
        required values (model hash, head signature); a verified checkpoint that differs
        raises CheckpointMismatchError and stays where it is.
        """
        for path in self.paths():
            try:
                checkpoint = Checkpoint.from_bytes(read_checked(path, MAX_CHECKPOINT_BYTES), where=str(path))
            except FileNotFoundError:
                continue
            except (CorruptFileError, FileTooLargeError) as exc:
                self.problems.append(str(exc))
                self._quarantine(path)
                continue
            for key, want in (expect or {}).items():
                have = checkpoint.meta.get(key)
                if have != want:
                    raise CheckpointMismatchError(
                        f"{path}: checkpoint is for {key} {str(have)[:80]!r}, this job has {str(want)[:80]!r}; "
                        f"it was left in place -- use another state directory for this model")
            checkpoint.path = path
            return checkpoint
        return None

    def _quarantine(self, path: Path) -> None:
        target = path.with_name(path.name + ".corrupt")
        try:
            os.replace(path, target)
        except FileNotFoundError:
            return
        corrupt = [p for _, p, bad in self._entries() if bad]
        for old in corrupt[:-KEEP_CORRUPT]:
            old.unlink(missing_ok=True)
        fsync_dir(self.dir)

    def clear(self) -> None:
        """Remove every checkpoint (a finished job's, before a new job starts here)."""
        for _, path, _ in self._entries():
            path.unlink(missing_ok=True)
        fsync_dir(self.dir)
