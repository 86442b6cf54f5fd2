"""Single-instance locks on a state directory, for the agent (`edge-agent run`) and the
coordinator (`edge-coordinator serve`) alike: two processes on one state directory write
the same files and, with one MQTT client id, take each other's broker session over and over.

flock(2) locks: held until the process closes them or exits (a kill -9 releases them too,
so a crash never leaves a stale lock behind). An exclusively held lock file also says whose
it is (the holder's pid), for the refusal of the second process.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from .errors import EXIT_UNAVAILABLE, EdgeAgentError


class AlreadyRunning(EdgeAgentError):
    """Another process holds this state directory (exit 69: the service is unavailable to us)."""

    exit_code = EXIT_UNAVAILABLE


def hold_locks(directory: Path, locks: Sequence[tuple[str, bool]],
               busy: Callable[[str, str], str]) -> list[int]:
    """Take each (file name, exclusive) lock in `directory` (created if needed) without
    waiting; returns their descriptors (close them to release). If one is held elsewhere,
    those already taken are released and AlreadyRunning(busy(name, holder pid or "?")) raised."""
    directory.mkdir(parents=True, exist_ok=True)
    fds: list[int] = []
    try:
        for name, exclusive in locks:
            fds.append(os.open(directory / name, os.O_RDWR | os.O_CREAT, 0o644))
            try:
                fcntl.flock(fds[-1], (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
            except BlockingIOError:
                raise AlreadyRunning(busy(name, _holder(fds[-1]))) from None
            if exclusive:  # ours alone now: say whose it is
                os.ftruncate(fds[-1], 0)
                os.pwrite(fds[-1], f"{os.getpid()}\n".encode(), 0)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return "?"
    return text if text.isdigit() else "?"
