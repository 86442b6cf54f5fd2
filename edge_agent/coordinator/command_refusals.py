"""Devices refusing this coordinator's commands for a reason that is ours, not theirs: as
replayed (our sequence counter is behind theirs) or as signed by a key they do not know (our
key is not the one they were given). One device saying so is its own trouble; several, or
every approved one, within REPLAYED_WINDOW_S is a fleet-wide problem shown by `status`, with
the fix (docs/fleet.md). A device that takes a command again is forgotten.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from pathlib import Path

from ..protocol import Kind, Reason, Signer

log = logging.getLogger("edge_agent.coordinator.service")  # the service's log: one place to watch

REPLAYED_WINDOW_S = 900.0
_WINDOW_HIGH = re.compile(r"\((?:[0-9]+) below (?P<high>[0-9]{1,16})\)")  # ReplayWindow's "older than" detail


class CommandRefusals:
    """The devices refusing our commands as replayed / unknown_key, and the problem lines they
    make in `problems` (the coordinator's list, shared: kept up to date in place)."""

    def __init__(self, *, signer: Signer, state_dir: Path, approved: Callable[[], int], problems: list[str],
                 clock: Callable[[], float] = time.time) -> None:
        self.signer = signer
        self.state_dir = state_dir
        self.approved = approved  # how many devices are approved now
        self.problems = problems
        self.clock = clock
        self.replayed: dict[str, tuple[float, int]] = {}  # device -> (when, its window's high or 0)
        self.unknown_key: dict[str, float] = {}  # device -> when it refused our command as unknown_key

    def refused(self, device: str, reason: str, ref_kind: str | None, detail: str) -> None:
        """A device's refusal of one of our messages."""
        if ref_kind != Kind.CMD:
            return
        high = _WINDOW_HIGH.search(detail)
        if reason == Reason.REPLAYED and (high or "already accepted" in detail):  # not a re-sync after a lost window
            self.replayed[device] = (self.clock(), int(high["high"]) if high else 0)
            self._check_replayed()
        if reason == Reason.UNKNOWN_KEY:  # it does not know our key
            self.unknown_key[device] = self.clock()
            self._check_unknown_key()

    def obeyed(self, device: str) -> None:
        """The device took a command of ours again (its progress names one)."""
        if self.replayed.pop(device, None):
            self._check_replayed()
        if self.unknown_key.pop(device, None):
            self._check_unknown_key()

    def _check_replayed(self) -> None:
        """Our own counter behind the devices' (keys/seq lost or restored from a backup, or a
        clock set back): docs/fleet.md, "Lost sequence counter"."""
        now = self.clock()
        self.replayed = recent = {d: v for d, v in self.replayed.items() if now - v[0] < REPLAYED_WINDOW_S}
        problem = None
        if recent and (len(recent) >= 2 or len(recent) >= self.approved()):
            floor = max(max(v[1] for v in recent.values()), self.signer.sequence.next()) + 1
            problem = (f"replayed: {len(recent)} device(s) refuse this coordinator's commands as replayed: its "
                       f"sequence counter ({self.state_dir / 'keys' / 'seq'}) is behind theirs (lost, restored "
                       f"from a backup, or the clock was set back). Fix: stop serve, `echo {floor} > "
                       f"{self.state_dir / 'keys' / 'seq.floor'}`, start serve (docs/fleet.md, Lost sequence counter)")
        self._show("replayed:", problem)

    def _check_unknown_key(self) -> None:
        """Our key not the one the devices were given (keys/coordinator.key replaced, or re-made
        after it was lost): the ways back."""
        now = self.clock()
        self.unknown_key = {d: t for d, t in self.unknown_key.items() if now - t < REPLAYED_WINDOW_S}
        n = len(self.unknown_key)
        problem = None
        if n and (n >= 2 or n >= self.approved()):
            problem = (f"unknown_key: {n} device(s) refuse this coordinator's commands as signed by a key they do not "
                       f"know: this coordinator's key ({self.signer.key_id}, {self.state_dir / 'keys' / 'coordinator.key'}"
                       ") is not the one they trust. Fix: restore the key they were given from a backup (then "
                       "`edge-coordinator key rotate` moves them to a new key they can verify), or re-enrol each device "
                       "with `edge-agent init --coordinator-key $(edge-coordinator key) --force` (docs/fleet.md, "
                       "Rotating the coordinator key)")
        self._show("unknown_key:", problem)

    def _show(self, prefix: str, problem: str | None) -> None:
        """`problem` (or none) as the one problem line starting with `prefix`; logged when new."""
        before = " ".join(self.problems)  # a problem already shown is not logged again
        self.problems[:] = [p for p in self.problems if not p.startswith(prefix)]
        if problem is None:
            return
        if problem.split(" Fix:")[0] not in before:
            log.error("%s", problem)
        self.problems.append(problem)
