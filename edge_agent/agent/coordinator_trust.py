"""Which coordinator key this device trusts, and moving that trust when the coordinator
rotates its key (coordinator/key_rotation.py).

The anchor is agent.toml's `[coordinator] public_key` (`edge-agent init --coordinator-key`).
A new key is accepted only from a verified `key_rotation` message -- published retained on
<prefix>/<fleet>/coordinator/key/<trusted key id> and signed by the key trusted now -- and
is then written to <state_dir>/keys/coordinator-rotation.json (crash-safe), so a restart
keeps trusting it. The file counts only while agent.toml still names the key it started
from: `edge-agent init --coordinator-key ... --force` (re-enrolment) starts over from the
configured key. The old key is no longer trusted once the device has moved.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from ..atomic import atomic_write_json, read_limited
from ..errors import InputError
from ..keys import fingerprint
from ..protocol import Message

log = logging.getLogger(__name__)
ROTATION_FILE = "keys/coordinator-rotation.json"
MAX_CHAIN = 64  # keys moved through, kept for the record


class CoordinatorTrust:
    """The coordinator key this device trusts now (`key`, `key_id`, `text`) and `rotate(msg)`."""

    def __init__(self, *, state_dir: Path, configured: Any) -> None:
        from ..config import parse_public_key, public_key_text

        self.path = Path(state_dir) / ROTATION_FILE
        self.configured = public_key_text(configured)
        self.key, self.chain = configured, [fingerprint(configured)]
        try:
            saved = json.loads(read_limited(self.path, 64 * 1024))
            if saved.get("configured") == self.configured:
                self.key = parse_public_key(str(saved["current"]))
                self.chain = [str(k) for k in saved.get("chain", [])][-MAX_CHAIN:] or self.chain
            else:
                log.info("%s: agent.toml names another coordinator key now (re-enrolled): trusting it", self.path)
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError, AttributeError, InputError) as exc:
            # unreadable: the configured key (a device that had moved on refuses the coordinator's
            # commands as unknown_key, and `status` says so; never a key from a damaged file)
            log.error("%s unusable (%s): trusting the configured coordinator key", self.path, exc)
        self.text = public_key_text(self.key)
        self.key_id = fingerprint(self.key)

    def rotate(self, msg: Message) -> Any | None:
        """A verified key_rotation (signed by the key trusted now: the Verifier checked it):
        persist and return the new public key, or None if it names the key trusted already."""
        from ..config import parse_public_key

        if msg.sender != self.key_id:  # (the Verifier only accepts coordinator-signed ones, and the
            return None  # topic's key must have signed it; a rotation of a key we left is old news)
        new = parse_public_key(msg.body["public_key"])
        new_id = fingerprint(new)
        if new_id == self.key_id:
            return None
        chain = [*self.chain, new_id][-MAX_CHAIN:]
        atomic_write_json(self.path, {"configured": self.configured, "current": msg.body["public_key"],
                                      "chain": chain, "rotated_at": msg.body["rotated_at"], "accepted_at": time.time()},
                          mode=0o600)  # before it is trusted: a restart trusts what was accepted
        log.warning("coordinator key rotated: now trusting %s (the rotation was signed by %s, trusted until now)",
                    new_id, self.key_id)
        self.key, self.key_id, self.text, self.chain = new, new_id, msg.body["public_key"], chain
        return new
