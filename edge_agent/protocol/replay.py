"""Replay-protection state that survives crashes: sequence counters and windows."""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ..atomic import read_checked, write_checked
from ..errors import InputError
from .schema import MAX_SEQ, validate_id

Clock = Callable[[], float]
log = logging.getLogger(__name__)
INIT_MARKER = ".initialised"  # not a valid sender id, so never a sender's file


class SequenceCounter:
    """Strictly increasing sequence numbers that stay near the clock across restarts.

    seq = max(last + 1, clock in whole seconds x 10**6): consecutive within a second, so a
    verifier's 1024-number window spans the messages of a second or more. What is persisted is a small lease: a
    high-water mark `lease` above the last number issued, written (crash-safely) at most
    once per lease while signing continuously; a restart resumes above it. So a restart
    moves a signer at most `lease` (1 s) ahead of its clock, where an hour-long lease made
    22 restarts put a device ~20 h ahead, and every verifier refused anything honest that
    came after a lost counter file. A lost or corrupt file loses nothing while the clock is
    right: the clock floor is above every number issued more than a lease ago.

    If the file cannot be written (disk full, read-only), numbers keep coming from the
    clock floor in memory: refusing to sign would silence the refusal that reports the fault.

    Recovery when verifiers are ahead (a clock that was set far ahead, or counters from
    older versions): put a plain integer in `<path>.floor`; the next start resumes above it
    (docs/fleet.md, "Lost sequence counter").
    """

    def __init__(self, *, path: str | Path, lease: int = 10**6, clock: Clock = time.time) -> None:
        if lease < 1:
            raise ValueError("lease must be >= 1")
        self.path, self._lease, self._clock, self._lock = Path(path), lease, clock, threading.Lock()
        self._reserved = 0
        self.problem: str | None = None  # why the counter file is not (or could not be) used
        try:
            self._reserved = int(read_checked(self.path, 64).decode())
        except FileNotFoundError:
            pass
        except (InputError, ValueError, OSError) as exc:  # corrupt: the clock floor keeps us monotonic
            self.problem = f"{self.path} unreadable ({exc}); numbers restart from the clock"
            log.warning("sequence counter: %s", self.problem)
        self._floor_file = self.path.with_name(self.path.name + ".floor")
        try:
            floor = int(self._floor_file.read_text(encoding="ascii")[:32].strip())
            if not 0 <= floor <= MAX_SEQ:
                raise ValueError(f"{floor} is outside 0..{MAX_SEQ}")
            self._reserved = max(self._reserved, floor + 1)
            log.warning("sequence counter: resuming above %d from %s", floor, self._floor_file)
        except FileNotFoundError:
            self._floor_file = None  # type: ignore[assignment]
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            log.error("sequence counter: ignored %s: %s", self._floor_file, exc)
            self._floor_file = None  # type: ignore[assignment]
        self._next = self._reserved

    def next(self) -> int:
        with self._lock:
            candidate = max(self._next, int(self._clock()) * 10**6, 1)
            if candidate >= self._reserved:
                self._reserved = candidate + self._lease
                try:
                    write_checked(self.path, str(self._reserved).encode(), mode=0o600)
                    if self._floor_file is not None:  # persisted above it: the floor did its job
                        self._floor_file.unlink(missing_ok=True)
                        self._floor_file = None  # type: ignore[assignment]
                except OSError as exc:
                    if self.problem is None or "cannot write" not in self.problem:
                        log.error("sequence counter: cannot write %s (%s); numbering from the clock",
                                  self.path, exc.strerror or exc)
                    self.problem = f"cannot write {self.path}: {exc.strerror or exc}"
            self._next = candidate + 1
            return candidate


class ReplayWindow:
    """Per-sender sliding window of accepted sequence numbers, persisted before accepting.

    A number above the highest seen is accepted; within `size` below it, accepted once;
    further below, refused. A corrupt window file resets to "accept only messages issued
    from now on", so a zero-filled file never reopens a replay.

    A missing file is ambiguous: a sender never heard from, or a file that was lost. With
    `strict_missing` (the agent: its one sender is the coordinator) a missing file is
    treated as lost, never as empty, once this directory has been in use (its marker file
    exists): only messages issued after this process started are accepted. That is the
    re-synchronisation: the refused command is answered with a `replayed` refusal saying so,
    and the coordinator's next command (issued now) is accepted. The very first start of a
    device (no marker yet) creates an empty window for each of `known_senders` (so what is
    queued for it, then or after later restarts, is accepted) -- unless the caller knows
    the device has been `enrolled` before (it has signed messages, jobs or queued updates):
    then a directory without a marker was lost (deleted), not new, and each known sender's
    window is written with "refuse everything issued before this start", so a captured,
    unexpired command cannot be replayed into it, after this start or a later one.

    `fault_file` is a test hook (the daemon passes it only with EDGE_AGENT_TEST_HOOKS=1):
    while that file exists every write fails with ENOSPC, as on a full disk.
    """

    def __init__(self, *, directory: str | Path, size: int = 1024, clock: Clock = time.time,
                 strict_missing: bool = False, known_senders: tuple[str, ...] = (), enrolled: bool = False,
                 fault_file: Path | None = None) -> None:
        if not 1 <= size <= 65536:
            raise ValueError("size must be 1..65536")
        self.directory, self.size, self._clock = Path(directory), size, clock
        self._state: dict[str, tuple[int, int, int]] = {}  # sender -> (high, mask, floor_iat)
        self._lock = threading.Lock()
        self._fault_file = fault_file
        self._started = int(clock())
        self._strict = False
        if strict_missing:
            marker = self.directory / INIT_MARKER
            used = marker.exists() or any(self.directory.glob("*.replay"))
            self._strict = used or enrolled
            try:
                if not used:  # first start, or a lost directory: the senders we expect get a window
                    # now (so a missing one later is lost): empty on a first start, and on a lost
                    # directory one that refuses what was issued before this start (as a lost file)
                    floor = self._started + 1 if enrolled else 0
                    if enrolled:
                        log.warning("replay windows in %s are missing but this device was enrolled before: "
                                    "accepting only messages issued after %d", self.directory, self._started)
                    for sender in known_senders:
                        self._save(validate_id(sender, "sender"), (0, 0, floor))
                if not marker.exists():
                    write_checked(marker, str(self._started).encode(), mode=0o600)
            except OSError as exc:  # (disk full at first start: a missing window is then treated as lost)
                log.error("replay window: cannot initialise %s: %s", self.directory, exc.strerror or exc)

    def _load(self, sender: str) -> tuple[int, int, int]:
        if sender in self._state:
            return self._state[sender]
        path = self.directory / f"{validate_id(sender, 'sender')}.replay"
        try:
            obj = json.loads(read_checked(path, 64 * 1024))
            state = (int(obj["high"]), int(obj["mask"], 16), int(obj["floor"]))
        except FileNotFoundError:
            state = (0, 0, 0)
            if self._strict:  # lost, not new: re-synchronise on what is issued from now on
                # issued *after* the second this process started: iat has 1 s resolution, and a
                # message captured earlier in that same second must not pass as new
                state = (0, 0, self._started + 1)
                log.warning("replay window of %s is missing: accepting only messages issued after %d",
                            sender, self._started)
        except (InputError, ValueError, KeyError, TypeError):
            state = (0, 0, int(self._clock()))  # unknown history: only trust what is issued from now
            self._save(sender, state)
        self._state[sender] = state
        return state

    def _save(self, sender: str, state: tuple[int, int, int]) -> None:
        high, mask, floor = state
        if self._fault_file is not None and self._fault_file.exists():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.directory / f"{sender}.replay"))
        write_checked(self.directory / f"{sender}.replay",
                      json.dumps({"high": high, "mask": f"{mask:x}", "floor": floor}).encode(), mode=0o600)

    def expect(self, sender: str) -> None:
        """A sender this side was just told to trust (the coordinator's new key, from a
        verified rotation): an empty window for it now, unless it has one, so a restart before
        its first message does not take the missing window for a lost one."""
        with self._lock:
            if (self.directory / f"{validate_id(sender, 'sender')}.replay").exists():
                return
            self._save(sender, (0, 0, 0))
            self._state[sender] = (0, 0, 0)

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
