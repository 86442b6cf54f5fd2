"""Does the broker deliver what this client publishes? A loopback check for MQTT 3.1.1.

Under MQTT 3.1.1 a broker acknowledges a publish its ACL denies and then drops it (mosquitto
only logs "Denied PUBLISH"), so a client whose certificate is pinned to another fleet sees
"connected" and every PUBACK, and nothing it sends arrives anywhere. The one proof a client
can get on its own is a message to itself: it subscribes to one topic of its own under the
root it works in (`MqttClient.tap`), publishes a random nonce there after each new
connection and every `every_s`, and expects it back within `timeout_s`. It does not come
back when the broker denies either the publish or the read of that root.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from .mqtt import MqttClient


class LoopbackProbe:
    """`step()` from the owner's loop; `failed_since` is set while the last nonce was lost."""

    def __init__(self, client: MqttClient, topic: str, *, timeout_s: float = 30.0, every_s: float = 300.0,
                 retry_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < timeout_s <= min(every_s, retry_s):
            raise ValueError("need 0 < timeout_s <= every_s and retry_s")
        self.client, self.topic = client, topic
        self.timeout_s, self.every_s, self.retry_s, self._clock = timeout_s, every_s, retry_s, clock
        self._lock = threading.Lock()
        self._nonce: bytes | None = None  # the one outstanding
        self._sent_at = 0.0
        self._next_at = 0.0
        self._connects = -1
        self.failed_since: float | None = None  # wall-clock time of the first lost nonce in a row
        self.ok_at: float | None = None  # wall-clock time a nonce last came back
        self.lost = 0  # nonces lost in a row
        client.tap(topic, self._returned)

    def _returned(self, payload: bytes) -> None:  # the network thread
        with self._lock:
            if self._nonce is not None and payload == self._nonce:
                self._nonce = None
                self.ok_at, self.failed_since, self.lost = time.time(), None, 0
                self._next_at = self._clock() + self.every_s

    def step(self) -> None:
        now = self._clock()
        if not self.client.ready:  # nothing can come back while down: ask again once up
            with self._lock:
                self._nonce = None
            return
        connects = self.client.stats["connects"]
        with self._lock:
            if self._nonce is not None and now - self._sent_at >= self.timeout_s:
                self._nonce = None
                self.lost += 1
                self.failed_since = self.failed_since or time.time()
                self._next_at = now + self.retry_s
            due = self._nonce is None and (connects != self._connects or now >= self._next_at)
            if not due:
                return
            nonce = os.urandom(16).hex().encode()
            self._nonce, self._sent_at, self._connects = nonce, now, connects  # before it can come back
        if self.client.publish(self.topic, nonce) is None:  # disconnected meanwhile: the next step asks again
            with self._lock:
                if self._nonce == nonce:
                    self._nonce, self._connects = None, -1
