"""A `Channel` = an MqttClient + the protocol: verified receive, signed send, refusals.

Both the agent daemon and the coordinator loop on `receive()`: every message comes back
either as a verified `Message` or as a `Rejection` (already logged, rate-limited, and
counted by reason); neither raises, whatever the bytes were. `reply_to(rejection)` tells
the sender why, where that is useful and cannot start a loop: a device answers refused
commands with a `refusal` on its progress topic; the coordinator answers refused update
chunks with a `rejected, retry` ack, and a state or progress from a key it does not know
with an `unknown_key` refusal on that device's ack topic (it sends its hello again:
protocol/hello.py), at most once a minute per device. Nobody answers a refusal, or junk on
other topics.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import one_line
from ..protocol import Kind, Message, Rejection, Signer, Verifier
from ..protocol.hello import ASK_AGAIN_CHANNELS, ask_for_hello
from .mqtt import MqttClient
from .uplink import rejection_ack

log = logging.getLogger(__name__)
SUMMARY_S = 10.0
ASK_AGAIN_S = 60.0  # a device whose hello the coordinator lacks is asked again at most this often
ASK_MEMORY = 10_000  # devices remembered for that (oldest forgotten first)


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


class Admission:
    """Sorts received messages in the MQTT network thread (MqttClient's `admit`): signed
    messages from trusted keys on `priority_channels` go to the priority lane, so no junk
    flood can push them out, and on `resend_channels` to the resend lane (what its sender
    sends again if it is lost: a full inbox drops those before a one-shot report); with
    `per_device` (rate/s, burst) each device's topics get a token bucket, and messages over
    it are dropped there (counted by MqttClient, which logs one summary line per interval),
    so one device cannot flood the receiver's queue."""

    MAX_DEVICES = 100_000  # buckets kept (oldest forgotten first): bounded memory under id floods

    def __init__(self, verifier: Verifier, *, priority_channels: tuple[str, ...] = ("cmd", "ack"),
                 resend_channels: tuple[str, ...] = (), per_device: tuple[float, int] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.verifier, self.priority_channels, self.per_device, self._clock = verifier, priority_channels, per_device, clock
        self.resend_channels = resend_channels
        self._buckets: dict[str, _Bucket] = {}
        self.dropped: Counter[str] = Counter()  # by device

    def __call__(self, topic: str, payload: bytes) -> str:
        route = self.verifier.topics.parse(topic)
        if route is None:
            return "bulk"
        if self.per_device is not None and route.device is not None:
            bucket = self._buckets.get(route.device)
            if bucket is None:
                if len(self._buckets) >= self.MAX_DEVICES:
                    self._buckets.pop(next(iter(self._buckets)))
                bucket = self._buckets[route.device] = _Bucket(self.per_device[0], self.per_device[1], self._clock)
            if not bucket.take():
                self.dropped[route.device] += 1
                return f"drop:over the ingress budget of device {route.device}"
        if route.channel in self.priority_channels and self.verifier.authentic(topic, payload):
            return "priority"
        if route.channel in self.resend_channels and self.verifier.authentic(topic, payload):
            return "resend"
        return "bulk"


class Channel:
    def __init__(self, *, client: MqttClient, signer: Signer, verifier: Verifier, role: str,
                 reply_rate: float = 1.0, reply_burst: int = 5, log_rate: float = 0.2,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if role not in ("device", "coordinator"):
            raise ValueError(f"role must be 'device' or 'coordinator', not {role!r}")
        if reply_rate <= 0 or reply_burst < 1 or log_rate <= 0:
            raise ValueError("rates and burst must be positive")
        self.client, self.signer, self.verifier, self.role = client, signer, verifier, role
        self.topics = signer.topics
        self._replies = _Bucket(reply_rate, reply_burst, clock)
        # A fixed ACL makes a whole fleet's states arrive at once from unknown keys: asking each
        # device for its hello has its own, larger budget (and once per device per ASK_AGAIN_S).
        self._asks = _Bucket(20.0, 200, clock)
        self._asked: OrderedDict[str, float] = OrderedDict()
        self._logs = _Bucket(log_rate, int(max(log_rate, 1)) * 2, clock)
        self._clock = clock
        self._unlogged: Counter[str] = Counter()  # rejections not logged one by one, by reason
        self._summary_at = clock()
        self.rejected: Counter[str] = Counter()  # by reason
        self.accepted = 0

    def receive(self, timeout: float | None = None) -> Message | Rejection | None:
        """The next message, verified; None if nothing arrived within `timeout`."""
        rec = self.client.get(timeout)
        if rec is None:
            self._summary()  # what a flood that has ended left unsaid
            return None
        try:
            result = self.verifier.open(rec.topic, rec.payload)
        except OSError as exc:  # a local fault the verifier did not turn into a refusal: one line
            log.error("verifier failed on a message on %r: %s: %s", rec.topic[:200], type(exc).__name__, exc)
            self.rejected["internal_error"] += 1
            return None
        except Exception as exc:  # a bug must not kill the receive loop, nor its sender flood the log
            self.rejected["internal_error"] += 1
            if self._logs.take():  # one line, rate-limited: never a traceback per untrusted message
                log.error("verifier failed on a message on %r: %s", rec.topic[:200], one_line(exc))
            log.debug("verifier failure on %r", rec.topic[:200], exc_info=True)
            return None
        if isinstance(result, Rejection):
            self.rejected[str(result.reason)] += 1
            first = self.rejected[str(result.reason)] == 1
            if first or self._logs.take():  # the first of each reason, then a few, then summaries
                log.warning("dropped: %s", result)
            else:  # counted by reason and claimed sender (the device id, for the operator)
                self._unlogged[f"{result.reason} from {result.sender or (result.route and result.route.device) or '?'}"] += 1
            self._summary()
        else:
            self.accepted += 1
        return result

    def _summary(self) -> None:
        """One line per SUMMARY_S with what was dropped without its own line."""
        now = self._clock()
        if self._unlogged and now - self._summary_at >= SUMMARY_S:
            counts = ", ".join(f"{n} {why}" for why, n in self._unlogged.most_common() if n)
            if counts:
                log.warning("dropped %d more messages in the last %.0f s: %s", sum(self._unlogged.values()),
                            now - self._summary_at, counts)
            self._unlogged.clear()
            self._summary_at = now

    def send(self, topic: str, kind: Kind, body: Mapping[str, Any], *, ttl: float, retain: bool = False,
             timeout: float = 10.0) -> bool:
        """Sign and publish a control message; True once the broker acknowledged it."""
        return self.client.publish_wait(topic, self.signer.control(topic, kind, body, ttl=ttl), retain=retain,
                                        timeout=timeout)

    def send_many(self, messages: list[tuple[str, bytes]], *, timeout: float = 10.0) -> list[bool]:
        """Publish several messages already signed (`signer.control`), then wait for all their
        PUBACKs under one deadline, so their round trips overlap: True for each the broker
        acknowledged. After the first that cannot be handed over (disconnected) the rest are
        not published (False): nothing is queued in memory."""
        infos: list[Any] = []
        for topic, payload in messages:
            infos.append(self.client.publish(topic, payload) if not infos or infos[-1] is not None else None)
        return self.client.wait_published(infos, timeout=timeout)

    def _ask_due(self, device: str) -> bool:
        now = self._clock()
        last = self._asked.get(device)
        if last is not None and now - last < ASK_AGAIN_S:
            return False
        if not self._asks.take():
            return False
        self._asked[device] = now
        self._asked.move_to_end(device)
        while len(self._asked) > ASK_MEMORY:
            self._asked.popitem(last=False)
        return True

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
        elif self.role == "coordinator" and route.channel in ASK_AGAIN_CHANNELS:
            reply = ask_for_hello(self.signer, self.topics, rejection, ttl=ttl)
            if reply is None or not self._ask_due(route.device):
                return False
            return self.client.publish(reply[0], reply[1]) is not None  # not waited for: a burst of these
        else:
            return False
        if reply is None or not self._replies.take():
            return False
        return self.client.publish_wait(reply[0], reply[1], timeout=5.0)
