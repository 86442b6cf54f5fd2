"""A `Channel` = an MqttClient + the protocol: verified receive, signed send, refusals.

Both the agent daemon and the coordinator loop on `receive()`: every message comes back
either as a verified `Message` or as a `Rejection` (already logged, rate-limited, and
counted by reason); neither raises, whatever the bytes were. `reply_to(rejection)` tells
the sender why, where that is useful and cannot start a loop: a device answers refused
commands with a `refusal` on its progress topic; the coordinator answers refused update
chunks with a `rejected, retry` ack. Nobody answers a refusal, or junk on other topics.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from ..protocol import Kind, Message, Rejection, Signer, Verifier
from .mqtt import MqttClient
from .uplink import rejection_ack

log = logging.getLogger(__name__)


class _Bucket:
    """Token bucket: at most `burst` at once, refilled at `rate` per second."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float]) -> None:
        self.rate, self.burst, self._clock = rate, burst, clock
        self._tokens, self._at = float(burst), clock()
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
            self._at = now
            if self._tokens >= 1:
                self._tokens -= 1
                return True
            return False


class Channel:
    def __init__(self, *, client: MqttClient, signer: Signer, verifier: Verifier, role: str,
                 reply_rate: float = 1.0, reply_burst: int = 5, log_rate: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if role not in ("device", "coordinator"):
            raise ValueError(f"role must be 'device' or 'coordinator', not {role!r}")
        if reply_rate <= 0 or reply_burst < 1 or log_rate <= 0:
            raise ValueError("rates and burst must be positive")
        self.client, self.signer, self.verifier, self.role = client, signer, verifier, role
        self.topics = signer.topics
        self._replies = _Bucket(reply_rate, reply_burst, clock)
        self._logs = _Bucket(log_rate, int(max(log_rate, 1)) * 2, clock)
        self.rejected: Counter[str] = Counter()  # by reason
        self.accepted = 0

    def receive(self, timeout: float | None = None) -> Message | Rejection | None:
        """The next message, verified; None if nothing arrived within `timeout`."""
        rec = self.client.get(timeout)
        if rec is None:
            return None
        try:
            result = self.verifier.open(rec.topic, rec.payload)
        except Exception:  # a bug or a failing key store must not kill the receive loop
            log.exception("verifier failed on a message on %r", rec.topic[:200])
            self.rejected["internal_error"] += 1
            return None
        if isinstance(result, Rejection):
            self.rejected[str(result.reason)] += 1
            if self._logs.take():
                log.warning("dropped: %s", result)
        else:
            self.accepted += 1
        return result

    def send(self, topic: str, kind: Kind, body: Mapping[str, Any], *, ttl: float, retain: bool = False,
             timeout: float = 10.0) -> bool:
        """Sign and publish a control message; True once the broker acknowledged it."""
        return self.client.publish_wait(topic, self.signer.control(topic, kind, body, ttl=ttl), retain=retain,
                                        timeout=timeout)

    def reply_to(self, rejection: Rejection, *, ttl: float = 3600.0) -> bool:
        """Tell the sender why its message was refused (policy in the module doc); True if sent."""
        route = rejection.route
        if route is None or route.device is None or rejection.kind == Kind.REFUSAL:
            return False
        if self.role == "device" and route.channel == "cmd" and route.device == self.signer.key_id:
            topic = self.topics.device(self.signer.key_id, "progress")
            reply: tuple[str, bytes] | None = (topic, self.signer.control(topic, Kind.REFUSAL,
                                                                         rejection.refusal_body(), ttl=ttl))
        elif self.role == "coordinator" and route.channel == "update":
            reply = rejection_ack(self.signer, self.topics, rejection, ttl=ttl)
        else:
            return False
        if reply is None or not self._replies.take():
            return False
        return self.client.publish_wait(reply[0], reply[1], timeout=5.0)
