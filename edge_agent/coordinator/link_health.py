"""What `serve` says when its link to the fleet is silent: the two ways a broker's ACL (or a
wrong --fleet / --topic-prefix) makes a fleet invisible while everything logs "connected".

1. Its own messages go nowhere: a `LoopbackProbe` (transport/loopback.py) on a topic under
   the fleet's root. The shipped ACL grants the coordinator `<root>/#`; rendered for another
   fleet, the nonce never comes back, and neither would a command, a model or an ack.
2. No device is heard: connected for `silence_s` and not one message has arrived on the
   fleet's device topics (devices on another fleet or prefix, or denied by the ACL).

Each becomes a line in `problems` (serve.json: `edge-coordinator status` and `devices`
print it) and one log line when it starts and when it ends.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable

from ..protocol import Topics
from ..transport import MqttClient
from ..transport.loopback import LoopbackProbe

log = logging.getLogger("edge_agent.coordinator.service")
PREFIXES = ("broker:", "silence:")
PROBE_TIMEOUT_S = 30.0


def probe_topic(topics: Topics, client_id: str) -> str:
    """One topic per client (a worker of a group probes its own), fixed across restarts (a
    persistent session keeps its subscriptions: a new name per start would pile them up)."""
    return f"{topics.root}/probe/{hashlib.sha256(client_id.encode()).hexdigest()[:16]}"


class LinkHealth:
    """`update(problems)` from serve's tick: returns `problems` with this module's lines
    (those starting with PREFIXES) replaced by the current ones."""

    def __init__(self, *, client: MqttClient, topics: Topics, client_id: str, heard: Callable[[], int],
                 silence_s: float = 600.0, probe_timeout_s: float = PROBE_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if silence_s <= 0:
            raise ValueError(f"silence_s must be positive, got {silence_s}")
        self.client, self.topics, self.heard, self.silence_s, self._clock = client, topics, heard, silence_s, clock
        probe_timeout_s = min(probe_timeout_s, silence_s)  # a short --silence-alert shortens both
        self.probe = LoopbackProbe(client, probe_topic(topics, client_id), timeout_s=probe_timeout_s,
                                   retry_s=2 * probe_timeout_s, every_s=max(300.0, probe_timeout_s), clock=clock)
        self._connected_for = 0.0  # seconds connected so far (the silence counts only those)
        self._last = clock()
        self._ever_heard = False
        self._shown: set[str] = set()  # prefixes currently reported (logged once per start/end)

    def update(self, problems: list[str]) -> list[str]:
        now = self._clock()
        if self.client.ready:
            self._connected_for += now - self._last
        self._last = now
        self.probe.step()
        self._ever_heard = self._ever_heard or self.heard() > 0
        current = [p for p in (self._probe_problem(), self._silence_problem()) if p]
        for prefix in PREFIXES:
            line = next((p for p in current if p.startswith(prefix)), None)
            if line and prefix not in self._shown:
                (log.error if prefix == "broker:" else log.warning)("%s", line)
                self._shown.add(prefix)
            elif not line and prefix in self._shown:
                log.info("%s resolved: %s", prefix.rstrip(":"), "the broker delivers this coordinator's messages again"
                         if prefix == "broker:" else "a device was heard")
                self._shown.discard(prefix)
        return [p for p in problems if not p.startswith(PREFIXES)] + current

    def summary(self) -> dict[str, float | bool | None]:
        """For serve.json: `status` says the link was checked, not only that nothing is wrong."""
        return {"loopback_ok_at": self.probe.ok_at, "loopback_failed_since": self.probe.failed_since,
                "device_heard": self._ever_heard}

    def _probe_problem(self) -> str | None:
        p = self.probe
        if p.failed_since is None:
            return None
        t = self.topics
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(p.failed_since))
        return (f"broker: this coordinator's own test message on {p.topic} did not come back ({p.lost} lost in a "
                f"row since {since}): the broker drops what it publishes to or reads from {t.root}/#, so no device "
                f"gets its commands, models or acks. Its certificate's ACL is probably for another fleet or prefix: "
                f"`make-certs acl --fleet {t.fleet}" + (f" --prefix {t.prefix}" if t.prefix != "edgeft/v1" else "")
                + "`, install it and reload mosquitto (docs/deployment.md, Troubleshooting)")

    def _silence_problem(self) -> str | None:
        if self._ever_heard or self._connected_for < self.silence_s:
            return None
        t = self.topics
        took = self._connected_for
        return (f"silence: connected for {f'{took:.0f} s' if took < 120 else f'{took / 60:.0f} min'} and not one "
                f"device message has arrived "
                f"on {t.root}/devices/+/...: are the agents on fleet {t.fleet!r} (`edge-agent init --fleet "
                f"{t.fleet}`) and topic prefix {t.prefix!r}, on this broker, and does its ACL let them publish "
                f"there (`make-certs acl --fleet {t.fleet}`)?")
