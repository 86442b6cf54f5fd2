"""The coordinator's own files in its state directory: its signing key, serve.json (what a
running `serve` says about itself, read by the CLI) and the lock that keeps a second
`serve` off the same directory."""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any

from ..atomic import atomic_write_text, read_limited
from ..errors import EXIT_UNAVAILABLE, EdgeAgentError, InputError
from ..keys import load_or_create_private_key

SERVE_FILE = "serve.json"
KEY_FILE = "keys/coordinator.key"
PUBLIC_KEY_FILE = "coordinator.pub"


def coordinator_key(state_dir: str | Path) -> tuple[Any, str]:
    """The coordinator's signing key (created, 0600, on first use) and its public key text,
    also written to <state_dir>/coordinator.pub for `edge-agent init --coordinator-key`."""
    from ..config import public_key_text

    root = Path(state_dir)
    (root / "keys").mkdir(mode=0o700, parents=True, exist_ok=True)
    key, _ = load_or_create_private_key(root / KEY_FILE)
    text = public_key_text(key)
    pub = root / PUBLIC_KEY_FILE
    try:
        current = read_limited(pub, 4096).decode().strip()
    except (OSError, InputError, UnicodeDecodeError):
        current = ""
    if current != text:
        atomic_write_text(pub, text + "\n")
    return key, text


def read_serve_file(state_dir: str | Path) -> dict[str, Any] | None:
    """What a running (or the last) `serve` wrote about itself; None if nothing readable."""
    try:
        obj = json.loads(read_limited(Path(state_dir) / SERVE_FILE, 64 * 1024))
    except (OSError, ValueError, InputError):
        return None
    return obj if isinstance(obj, dict) else None


def serving(info: dict[str, Any] | None, *, now: float | None = None, stale_s: float = 15.0) -> bool:
    """Is the coordinator described by serve.json alive (fresh heartbeat, process exists)?"""
    if not info or info.get("stopped_at"):
        return False
    beat, pid = info.get("heartbeat_at"), info.get("pid")
    if not isinstance(beat, int | float) or not isinstance(pid, int):
        return False
    if (time.time() if now is None else now) - beat > stale_s:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class AlreadyServing(EdgeAgentError):
    """Another `serve` holds this state directory (two would fight over one client id)."""

    exit_code = EXIT_UNAVAILABLE


def lock_state_dir(state_dir: Path) -> int:
    state_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(state_dir / "serve.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        pid = (read_serve_file(state_dir) or {}).get("pid", "?")
        raise AlreadyServing(f"{state_dir}: another edge-coordinator serve (pid {pid}) is using this state "
                             "directory") from None
    return fd  # held until the process exits (a kill -9 releases it too)
