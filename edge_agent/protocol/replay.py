"""Replay-protection state that survives crashes: sequence counters and windows."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ..atomic import read_checked, write_checked
from ..errors import InputError
from .schema import validate_id

Clock = Callable[[], float]


class SequenceCounter:
    """Strictly increasing sequence numbers that survive restarts and state loss.

    Leases a block ahead on disk (one write per `lease` numbers), and floors every number
    at the wall clock (whole seconds x 10**6), so a device whose state was lost or
    re-imaged still sends numbers above its past ones.
    """

    def __init__(self, *, path: str | Path, lease: int = 3600 * 10**6, clock: Clock = time.time) -> None:
        if lease < 1:
            raise ValueError("lease must be >= 1")
        self.path, self._lease, self._clock, self._lock = Path(path), lease, clock, threading.Lock()
        self._reserved = 0
        try:
            self._reserved = int(read_checked(self.path, 64).decode())
        except FileNotFoundError:
            pass
        except (InputError, ValueError):  # corrupt: the time floor keeps us monotonic anyway
            self._reserved = 0
        self._next = self._reserved

    def next(self) -> int:
        with self._lock:
            candidate = max(self._next, int(self._clock()) * 10**6, 1)
            if candidate >= self._reserved:
                self._reserved = candidate + self._lease
                write_checked(self.path, str(self._reserved).encode(), mode=0o600)
            self._next = candidate + 1
            return candidate


class ReplayWindow:
    """Per-sender sliding window of accepted sequence numbers, persisted before accepting.

    A number above the highest seen is accepted; within `size` below it, accepted once;
    further below, refused. A lost or corrupt window file resets to "accept only messages
    issued from now on", so a crash or a zero-filled file never reopens a replay.
    """

    def __init__(self, *, directory: str | Path, size: int = 1024, clock: Clock = time.time) -> None:
        if not 1 <= size <= 65536:
            raise ValueError("size must be 1..65536")
        self.directory, self.size, self._clock = Path(directory), size, clock
        self._state: dict[str, tuple[int, int, int]] = {}  # sender -> (high, mask, floor_iat)
        self._lock = threading.Lock()

    def _load(self, sender: str) -> tuple[int, int, int]:
        if sender in self._state:
            return self._state[sender]
        path = self.directory / f"{validate_id(sender, 'sender')}.replay"
        try:
            obj = json.loads(read_checked(path, 64 * 1024))
            state = (int(obj["high"]), int(obj["mask"], 16), int(obj["floor"]))
        except FileNotFoundError:
            state = (0, 0, 0)
        except (InputError, ValueError, KeyError, TypeError):
            state = (0, 0, int(self._clock()))  # unknown history: only trust what is issued from now
            self._save(sender, state)
        self._state[sender] = state
        return state

    def _save(self, sender: str, state: tuple[int, int, int]) -> None:
        high, mask, floor = state
        write_checked(self.directory / f"{sender}.replay",
                      json.dumps({"high": high, "mask": f"{mask:x}", "floor": floor}).encode(), mode=0o600)

    def check_and_record(self, sender: str, seq: int, issued_at: int) -> str | None:
        """Record `seq` and return None if it is new, else why it is refused."""
        with self._lock:
            high, mask, floor = self._load(sender)
            if issued_at < floor:
                return f"issued at {issued_at}, before this sender's replay window was reset at {floor}"
            if seq > high:
                shift = seq - high
                mask = ((mask << shift) | 1) & ((1 << self.size) - 1) if shift < self.size else 1
                high = seq
            elif high - seq >= self.size:
                return f"sequence {seq} is older than the window ({self.size} below {high})"
            elif mask >> (high - seq) & 1:
                return f"sequence {seq} from {sender} was already accepted"
            else:
                mask |= 1 << (high - seq)
            self._save(sender, (high, mask, floor))  # durable before the caller acts on it
            self._state[sender] = (high, mask, floor)
            return None
