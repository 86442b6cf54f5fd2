"""Is the coordinator hearing this device? The agent's side of "no silent fleet".

Under MQTT 3.1.1 a broker acknowledges a publish that its ACL denies and drops it, so an
agent whose certificate is pinned to another fleet logs "connected", gets every PUBACK, and
nothing it says arrives. What it can see is the coordinator's answer: `serve` replies to a
fresh hello with a signed `ping` command whose cmd_id is `hello-<seq>` (no `pong` is sent
back), and refuses a state from a key it does not know with a signed `refusal` on the
device's `ack` topic. Any verified command or ack counts as heard too.

So, per hello the daemon sends (at every (re)connection):
- acknowledged: fine; the next hello goes out at the next reconnection;
- refused as `unknown_key` (the coordinator dropped its hello: an ACL fixed while the agent
  stayed connected, a registry reset): the hello is sent again at once (at most every
  REFUSAL_GAP_S);
- no answer within `silence_s`: a problem (log, systemd STATUS=, `run --check`), and the
  hello is sent again, then after 2x, 4x... `silence_s` (at most MAX_RESEND_S apart).

The state is kept in STATE_DIR/link.json for `edge-agent run --check`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..atomic import atomic_write_json

log = logging.getLogger(__name__)
LINK_FILE = "link.json"
REFUSAL_GAP_S = 10.0  # a burst of refusals re-sends the hello once
MAX_RESEND_S = 3600.0
HELLO_ACK_PREFIX = "hello-"  # cmd_id of the coordinator's answer to a hello (a ping)


class CoordinatorLink:
    """What the daemon knows about being heard; `save()`d to STATE_DIR/link.json on changes."""

    def __init__(self, *, path: Path, fleet: str, hello_topic: str, silence_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        if silence_s <= 0:
            raise ValueError(f"silence_s must be positive, got {silence_s}")
        self.path, self.fleet, self.hello_topic, self.silence_s = Path(path), fleet, hello_topic, silence_s
        self._clock, self._wall = clock, wall
        self.waiting_since: float | None = None  # monotonic: first hello not answered yet
        self.sent_at: float | None = None  # monotonic: the last hello
        self.sent = 0  # hellos sent while waiting
        self.acknowledged_at: float | None = None  # wall clock
        self.refusal: str | None = None  # the last "unknown_key" refusal's text, while waiting
        self._resend_now = False
        self._refusal_resend_at: float | None = None  # monotonic: the last hello a refusal asked for
        self._reported = False  # the problem was logged

    # ---- events ----
    def hello_sent(self) -> None:
        now = self._clock()
        if self.waiting_since is None:
            self.waiting_since, self.sent = now, 0
        self.sent_at, self._resend_now = now, False
        self.sent += 1
        self.save()

    def heard(self, what: str) -> None:
        """A verified message from the coordinator addressed to this device."""
        if self.waiting_since is None:
            return
        if self._reported:
            log.warning("the coordinator hears this device again (%s) after %.0f s of silence", what,
                        self._clock() - self.waiting_since)
        else:
            log.info("the coordinator heard this device's hello (%s)", what)
        self.waiting_since, self.refusal, self._reported = None, None, False
        self.acknowledged_at = self._wall()
        self.save()

    def refused(self, reason: str, detail: str) -> None:
        """The coordinator refused something we sent as from a key it does not know."""
        if reason != "unknown_key":
            return
        first = self.refusal is None
        self.refusal = f"{reason}: {detail[:200]}"
        now = self._clock()
        if self._refusal_resend_at is None or now - self._refusal_resend_at >= REFUSAL_GAP_S:
            self._resend_now, self._refusal_resend_at = True, now  # (a hello just before it was lost too)
        if first:
            log.warning("the coordinator does not know this device (%s): sending the hello again", self.refusal)

    # ---- decisions ----
    def hello_due(self) -> bool:
        """Send the hello again now? (A refusal, or no answer for the current interval.)"""
        if self._resend_now:
            return True
        if self.waiting_since is None or self.sent_at is None:
            return False
        interval = min(MAX_RESEND_S, self.silence_s * 2 ** max(0, self.sent - 1))
        return self._clock() - self.sent_at >= interval

    def problem(self) -> str | None:
        """The problem text once the hello has waited `silence_s` (logged the first time)."""
        text = self._text()
        if text is not None and not self._reported:
            self._reported = True
            log.warning("%s", text)
            self.save()
        return text

    def _text(self) -> str | None:
        if self.waiting_since is None:
            return None
        waited = self._clock() - self.waiting_since
        if waited < self.silence_s:
            return None
        text = (f"the coordinator has not answered this device's hello for {_minutes(waited)} ({self.sent} sent "
                f"on {self.hello_topic}): the broker may be dropping its messages (its ACL rendered for another "
                f"fleet than {self.fleet!r}: `make-certs acl --fleet {self.fleet}`), or no `edge-coordinator "
                f"serve --fleet {self.fleet}` runs on this broker")
        if self.refusal:
            text += f"; the coordinator refused its messages ({self.refusal})"
        return text

    def status(self) -> str:
        """A short clause for systemd's STATUS= line ('' when all is well)."""
        if self.problem() is None:
            return ""
        return f"coordinator silent for {_minutes(self._clock() - (self.waiting_since or self._clock()))} (see log)"

    # ---- the file `run --check` reads ----
    def save(self) -> None:
        now_m, now_w = self._clock(), self._wall()

        def wall(t: float | None) -> float | None:
            return None if t is None else now_w - (now_m - t)

        doc: dict[str, Any] = {"pid": os.getpid(), "fleet": self.fleet, "hello_topic": self.hello_topic,
                               "updated_at": now_w, "hello_sent_at": wall(self.sent_at),
                               "waiting_since": wall(self.waiting_since), "hellos_sent": self.sent,
                               "acknowledged_at": self.acknowledged_at, "problem": self._text()}
        try:
            atomic_write_json(self.path, doc)
        except OSError as exc:  # the daemon's other writes will say more; this is only a report
            log.debug("%s not written: %s", self.path, exc)


def read_link(path: Path) -> dict[str, Any] | None:
    """STATE_DIR/link.json as the daemon last wrote it (None: absent or unreadable)."""
    import json

    try:
        raw = Path(path).read_bytes()[:65536]
        doc = json.loads(raw)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"
