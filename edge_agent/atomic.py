"""Crash-safe files: every file the agent writes goes through here.

Writes are temp file + fsync + rename + fsync of the directory, so a reader sees either
the old content or the new, never a mix. Power loss on SD cards can still leave a file
zero-filled or truncated after the rename is on disk, so `write_checked` frames the payload
with its length and sha256 and `read_checked` refuses anything that does not match.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import struct
import tempfile
from pathlib import Path
from typing import Any

from .errors import InputError

_CHECKED_MAGIC = b"EAC1"
_CHECKED_HEADER = struct.Struct(">4sQ32s")  # magic, payload length, sha256(payload)


class CorruptFileError(InputError):
    """A file failed its integrity check (truncated, zero-filled, bit-flipped)."""


class FileTooLargeError(InputError):
    """A file is larger than the limit its reader accepts."""


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make a rename or unlink inside `directory` durable."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, *, mode: int = 0o644,
                       exclusive: bool = False) -> None:
    """Replace `path` with `data` atomically and durably. `exclusive`: create it only if it
    does not exist (FileExistsError otherwise), as atomically: the whole file is linked into
    place or nothing is, so two processes creating it at once cannot both win."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        if exclusive:
            _link_new(tmp, target)
        else:
            os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(target.parent)


def _link_new(tmp: str, target: Path) -> None:
    """Put the written `tmp` at `target` only if nothing is there: FileExistsError otherwise."""
    try:
        os.link(tmp, target)
    except FileExistsError:
        raise
    except OSError as exc:  # a filesystem without hard links (vfat): the check and the rename, not atomic
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV):
            raise
        if target.exists():
            raise FileExistsError(errno.EEXIST, "file exists", str(target)) from exc
        os.replace(tmp, target)
        return
    os.unlink(tmp)


def atomic_write_text(path: str | os.PathLike[str], text: str, *, mode: int = 0o644) -> None:
    atomic_write_bytes(path, text.encode("utf-8"), mode=mode)


def atomic_write_json(path: str | os.PathLike[str], obj: Any, *, mode: int = 0o644) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode(), mode=mode)


def read_limited(path: str | os.PathLike[str], max_bytes: int) -> bytes:
    """Read a whole file, refusing (before reading it) anything over `max_bytes`."""
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size > max_bytes:
            raise FileTooLargeError(f"{path}: {size} bytes is over the limit of {max_bytes}")
        data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:  # grew while reading (or a /proc-like file without a size)
        raise FileTooLargeError(f"{path}: more than {max_bytes} bytes")
    return data


def read_json_object(path: str | os.PathLike[str], max_bytes: int, what: str) -> dict[str, Any]:
    """A size-limited JSON file that must hold an object; InputError naming `what` otherwise."""
    try:
        obj = json.loads(read_limited(path, max_bytes))
    except (OSError, ValueError) as exc:  # FileTooLargeError is an InputError, not an OSError
        raise InputError(f"{path}: not a readable {what} ({str(exc)[:200]})") from None
    if not isinstance(obj, dict):
        raise InputError(f"{path}: {what} is not a JSON object")
    return obj


def frame_checked(payload: bytes) -> bytes:
    """Frame `payload` with magic, length and sha256 so corruption is detectable."""
    return _CHECKED_HEADER.pack(_CHECKED_MAGIC, len(payload), hashlib.sha256(payload).digest()) + payload


def unframe_checked(data: bytes, *, where: str = "data") -> bytes:
    """Inverse of `frame_checked`; raises CorruptFileError on any mismatch."""
    if len(data) < _CHECKED_HEADER.size:
        raise CorruptFileError(f"{where}: truncated ({len(data)} bytes, header needs {_CHECKED_HEADER.size})")
    magic, length, digest = _CHECKED_HEADER.unpack_from(data)
    if magic != _CHECKED_MAGIC:
        kind = "zero-filled" if not any(data[:64]) else f"bad magic {magic!r}"
        raise CorruptFileError(f"{where}: {kind}")
    payload = data[_CHECKED_HEADER.size :]
    if len(payload) != length:
        raise CorruptFileError(f"{where}: payload is {len(payload)} bytes, header says {length}")
    if hashlib.sha256(payload).digest() != digest:
        raise CorruptFileError(f"{where}: sha256 mismatch")
    return payload


def write_checked(path: str | os.PathLike[str], payload: bytes, *, mode: int = 0o644) -> None:
    """Atomically write `payload` framed with its length and sha256."""
    atomic_write_bytes(path, frame_checked(payload), mode=mode)


def read_checked(path: str | os.PathLike[str], max_bytes: int) -> bytes:
    """Read a file written by `write_checked`; raises CorruptFileError if it does not verify."""
    return unframe_checked(read_limited(path, max_bytes + _CHECKED_HEADER.size), where=str(path))


def sha256_file(path: str | os.PathLike[str], chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()
