"""The coordinator's own files in its state directory: its signing key, serve.json (what a
running `serve` says about itself, read by the CLI) and the lock that keeps a second
`serve` off the same directory."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from ..atomic import atomic_write_text, read_limited
from ..errors import ConfigError, InputError
from ..keys import load_or_create_private_key
from ..locks import AlreadyRunning, hold_locks

SERVE_FILE = "serve.json"
KEY_FILE = "keys/coordinator.key"
PUBLIC_KEY_FILE = "coordinator.pub"


def coordinator_key(state_dir: str | Path, *, devices: int = 0) -> tuple[Any, str]:
    """The coordinator's signing key (created, 0600, on first use) and its public key text,
    also written to <state_dir>/coordinator.pub for `edge-agent init --coordinator-key`.

    A missing key is created only on a first start. Once devices may trust it -- `devices`
    are enrolled in the registry, or coordinator.pub says a key was made here -- a missing
    key is a lost one: a new key would be a new trust anchor that every device refuses
    (unknown_key), so this raises a ConfigError (exit 78) naming the ways back."""
    from ..config import public_key_text

    root = Path(state_dir)
    pub = root / PUBLIC_KEY_FILE
    try:
        current = read_limited(pub, 4096).decode().strip()
    except (OSError, InputError, UnicodeDecodeError):
        current = ""
    if not (root / KEY_FILE).exists() and (devices or current):
        raise ConfigError(lost_key_message(root, current, devices))
    (root / "keys").mkdir(mode=0o700, parents=True, exist_ok=True)
    key, _ = load_or_create_private_key(root / KEY_FILE)
    text = public_key_text(key)
    if current != text:
        atomic_write_text(pub, text + "\n")
    return key, text


def lost_key_message(root: Path, public: str, devices: int) -> str:
    trusted = f" (public key {public[:44]})" if public else ""
    who = f"{devices} enrolled device(s)" if devices else "devices given coordinator.pub"
    return (f"{root / KEY_FILE} is missing, but {who} trust the key it held{trusted}: a new key would be refused "
            "by every one of them (unknown_key), so none is made. Restore the file from a backup (0600), then "
            "start again; to move to a new key afterwards, `edge-coordinator key rotate` signs the new key with "
            "the old one, and devices switch by themselves. If the key is lost for good: `edge-coordinator key "
            "rotate --without-old-key`, then re-run `edge-agent init --coordinator-key NEWKEY --force` on every "
            "device (docs/fleet.md, Rotating the coordinator key)")


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
    if info.get("host") not in (None, socket.gethostname()):  # a workers group's leader on another host
        return True  # (its pid means nothing here): the fresh heartbeat says it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class AlreadyServing(AlreadyRunning):
    """Another `serve` holds this state directory (two would fight over one client id)."""


def lock_state_dir(state_dir: Path, *, worker: str | None = None) -> list[int]:
    """The serve locks of a state directory, held until the process exits (a kill -9
    releases them too). A lone serve holds serve.lock exclusively. Workers of a group share
    the directory (bundles, heads, stored payloads): each holds serve.lock shared and its
    own serve-<worker>.lock exclusively, so workers run side by side, two with one worker id
    (one MQTT client id) do not, and a lone serve and workers never run on one directory."""
    def busy(name: str, holder: str) -> str:
        pid = (read_serve_file(state_dir) or {}).get("pid", holder)
        what = (f"serve worker {worker}" if name != "serve.lock" else
                f"serve (pid {pid}) outside a workers group" if worker is not None else f"serve (pid {pid})")
        return f"{state_dir}: another edge-coordinator {what} is using this state directory"

    locks = [("serve.lock", worker is None), *([(f"serve-{worker}.lock", True)] if worker is not None else [])]
    try:
        return hold_locks(state_dir, locks, busy)
    except AlreadyRunning as exc:
        raise AlreadyServing(str(exc)) from None
