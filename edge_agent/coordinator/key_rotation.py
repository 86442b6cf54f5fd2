"""Rotating the coordinator's signing key so that devices can follow (`edge-coordinator key
rotate`).

A device trusts exactly one coordinator key, the one `edge-agent init --coordinator-key`
gave it. A new key alone would be a new trust anchor every device refuses (unknown_key). So a
rotation is a statement signed by the OLD key -- "the coordinator's key is now NEW" -- and a
device accepts a new coordinator key only that way (agent/coordinator_trust.py).

    edge-coordinator key rotate        (serve stopped: it holds the key)
      keys/coordinator.key         -> keys/retired/<old key id>.key  (kept, 0600)
      a new keys/coordinator.key, coordinator.pub
    edge-coordinator serve
      publishes, for every retired key K, retained on <prefix>/<fleet>/coordinator/key/<K id>:
      a `key_rotation` {public_key: NEW} signed by K (re-signed on every connection, so it
      never expires), before any command signed by the new key
    edge-agent run (trusting K)
      subscribed to coordinator/key/<K id>: verifies it with K, persists NEW, trusts NEW
      instead of K, and follows coordinator/key/<NEW id> from then on

Every retired key keeps pointing at the current key, so a device that slept through several
rotations moves in one step. A retired key signs nothing but these statements; whoever holds
it could still point devices that have not moved yet elsewhere, so after a key was stolen,
re-enrol the devices instead (`--without-old-key` and `edge-agent init` on each).
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path
from typing import Any

from ..atomic import atomic_write_text
from ..errors import EXIT_OK, EdgeAgentError, InputError
from ..keys import fingerprint, generate_private_key, load_private_key, save_private_key
from ..protocol import Kind, Signer, Topics
from .service_files import KEY_FILE, PUBLIC_KEY_FILE, lock_state_dir

log = logging.getLogger(__name__)
RETIRED_DIR = "keys/retired"
ROTATION_TTL = 365 * 86400.0


def retired_keys(state_dir: Path) -> list[Any]:
    """The coordinator's earlier keys (private), oldest rotation first; one that cannot be
    read is logged and left out (the others' devices must still be able to follow)."""
    folder = Path(state_dir) / RETIRED_DIR
    paths = sorted(folder.glob("*.key"), key=lambda p: p.stat().st_mtime) if folder.is_dir() else []
    found = []
    for path in paths:
        try:
            found.append(load_private_key(path))
        except (OSError, EdgeAgentError) as exc:  # KeyFileError: unreadable, malformed, too open
            log.error("retired coordinator key %s unusable: %s; devices still trusting it cannot follow the "
                      "rotation (restore it, or re-enrol them)", path, exc)
    return found


def rotation_messages(state_dir: Path, topics: Topics, sequence: Any, public_key: str) -> list[tuple[str, bytes]]:
    """(topic, signed payload) of each retired key's statement that the key is now
    `public_key`, freshly signed (to be published retained)."""
    out = []
    for old in retired_keys(state_dir):
        topic = topics.coordinator_key(fingerprint(old))
        signer = Signer(key=old, topics=topics, sequence=sequence)
        body = {"public_key": public_key, "rotated_at": int(time.time()),
                "detail": f"coordinator key {fingerprint(old)} is retired"}
        out.append((topic, signer.control(topic, Kind.KEY_ROTATION, body, ttl=ROTATION_TTL)))
    return out


def rotate(state_dir: Path, *, without_old_key: bool = False) -> tuple[str | None, Any]:
    """Make a new coordinator key: the current one is retired (kept to sign the rotation),
    unless `without_old_key` (it is lost: devices cannot follow). Returns (old key id or
    None, new key). Refused while serve runs on this directory (exit 69): it holds the key."""
    from ..config import public_key_text

    root = Path(state_dir).resolve()
    if not (root / "keys").is_dir() and not without_old_key:
        raise InputError(f"{root}: no coordinator key here to rotate (a new coordinator makes its key on first "
                         "start: edge-coordinator key)")
    locks = lock_state_dir(root)
    try:
        old_id = None
        current = root / KEY_FILE
        if not without_old_key:
            if not current.exists():
                raise InputError(f"{current} is missing: a rotation devices can verify is signed by the old key. "
                                 "Restore it from a backup, or use --without-old-key and re-enrol every device "
                                 "(edge-agent init --coordinator-key NEWKEY --force)")
            old = load_private_key(current)
            old_id = fingerprint(old)
            (root / RETIRED_DIR).mkdir(mode=0o700, parents=True, exist_ok=True)
            save_private_key(root / RETIRED_DIR / f"{old_id}.key", old)  # first: a crash here keeps the old key
        new = generate_private_key()
        (root / "keys").mkdir(mode=0o700, parents=True, exist_ok=True)
        save_private_key(current, new)  # atomic: either key is there, never none
        atomic_write_text(root / PUBLIC_KEY_FILE, public_key_text(new) + "\n")
        return old_id, new
    finally:
        for fd in locks:
            os.close(fd)


def cmd_key_rotate(args: argparse.Namespace) -> int:
    from ..config import public_key_text
    from .fleet_cli import state_dir

    old_id, new = rotate(state_dir(args), without_old_key=args.without_old_key)
    print(public_key_text(new))
    if old_id is not None:
        print(f"rotated: coordinator key {old_id} -> {fingerprint(new)}. The old key is kept in "
              f"{state_dir(args) / RETIRED_DIR} to sign the rotation: start serve, and it publishes the new key, "
              "signed by the old one; each device switches when it hears it (at once if online, else on "
              "reconnecting). Give new devices the new key (edge-agent init --coordinator-key).")
    else:
        print(f"new coordinator key {fingerprint(new)}, NOT signed by the old one: no device can verify it. "
              "Re-run `edge-agent init --coordinator-key <the key above> --force` on every device.")
    return EXIT_OK
