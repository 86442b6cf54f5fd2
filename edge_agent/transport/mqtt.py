"""A small paho-mqtt 2.x wrapper: MQTT 3.1.1, QoS 1, TLS, last will, jittered reconnect.

paho's own reconnect doubles a fixed delay (no jitter) and its in-memory session dies with
the process, so this wrapper runs a supervisor thread: connect, hand the socket to a paho
network thread (`loop_start`) until the connection drops, wait a full-jitter backoff, and
connect again, re-subscribing and re-signing the will each time. Publishing is refused
(returns None/False) while disconnected, so paho never queues stale messages in memory;
the caller's on-disk outbox is the queue. Nothing raises into paho's thread. Validation of
payloads is the protocol's job.

Back-pressure: `admit(topic, payload)`, called in paho's network thread, sorts each message:
"priority" (cheap checks passed: a valid signature by a trusted key, e.g. the daemon's
signed commands, or a device's one-shot report), "resend" (signed too, but its sender sends
it again if it is lost: an update chunk waits for an ack and is resent without one, a state
is republished), "bulk" (anything else), or "drop[:why]" (e.g. a device over its ingress
budget at the coordinator). `get()` still returns messages in arrival order (a command sent
after others is handled after them), but when the inbox is full the oldest message of the
least important lane goes: bulk, then resend, then priority, and a message less important
than everything queued is the one dropped. So a junk flood only ever pushes out older junk,
a burst of update chunks pushes out chunks (their devices resend them), never a report sent
once; at most `priority_size` priority messages are kept. Drops are counted and logged as
one summary line per DROP_LOG_INTERVAL_S, not one line per message.
"""

from __future__ import annotations

import logging
import random
import ssl
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

from .backoff import full_jitter

log = logging.getLogger(__name__)
DROP_LOG_INTERVAL_S = 10.0
LANES = ("priority", "resend", "bulk", "drop")
_DROP_ORDER = ("bulk", "resend", "priority")  # who goes first when the inbox is full
_DROP_STAT = {"bulk": "dropped_inbox_full", "resend": "dropped_resend_full", "priority": "dropped_priority_full"}
_DROP_WHAT = {"bulk": "unverified", "resend": "resendable signed", "priority": "signed"}
Admit = Callable[[str, bytes], str]


@dataclass(frozen=True)
class TlsConfig:
    """TLS to the broker. `ca_certs=None` trusts the system CAs; client cert for mutual TLS."""

    ca_certs: str | None = None
    certfile: str | None = None
    keyfile: str | None = None
    insecure: bool = False  # skip hostname verification: only for testing IP-addressed brokers


@dataclass(frozen=True)
class Will:
    topic: str
    payload: bytes
    retain: bool = True


@dataclass(frozen=True)
class Received:
    topic: str
    payload: bytes
    retain: bool
    received_at: float



class _PahoLog:
    """paho's log lines, less one: "Client is not connected" from paho's network thread when
    it runs once more after the session ended (our disconnect, or the broker's). That is
    benign, but paho logs it at ERROR, and a clean SIGTERM logged it now and then (CI)."""

    def __init__(self, logger: logging.Logger, winding_down: threading.Event) -> None:
        self.logger, self.winding_down = logger, winding_down

    def log(self, level: int, msg: str, *args: Any) -> None:
        if self.winding_down.is_set() and str(msg).startswith("Client is not connected"):
            level = logging.DEBUG
        self.logger.log(level, msg, *args)

    def __getattr__(self, name: str) -> Any:  # anything else paho asks of a Logger
        return getattr(self.logger, name)

class MqttClient:
    """One MQTT connection kept alive in the background. Keyword-only, validated arguments."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        client_id: str,
        clean_session: bool = True,
        keepalive: int = 60,
        tls: TlsConfig | None = None,
        username: str | None = None,
        password: str | None = None,
        will: Will | Callable[[], Will] | None = None,
        subscriptions: Iterable[str] = (),
        on_connected: Callable[[MqttClient], None] | None = None,
        backoff_base: float = 1.0,
        backoff_cap: float = 120.0,
        connect_timeout: float = 10.0,
        inbox_size: int = 1000,
        priority_size: int = 256,
        admit: Admit | None = None,
        max_payload: int = 256 * 1024,
        max_queued: int = 1000,
        rng: random.Random | None = None,
        logger: logging.Logger | None = None,
    ) -> None:
        if not host or not 0 < port < 65536:
            raise ValueError(f"bad broker address {host!r}:{port}")
        if not client_id or len(client_id.encode()) > 128:
            raise ValueError("client_id must be 1..128 bytes")
        if not 5 <= keepalive <= 65535:
            raise ValueError("keepalive must be 5..65535 s")
        if not 0 < backoff_base <= backoff_cap:
            raise ValueError("need 0 < backoff_base <= backoff_cap")
        if connect_timeout <= 0 or inbox_size < 1 or priority_size < 1 or max_payload < 1 or max_queued < 1:
            raise ValueError("connect_timeout, inbox_size, priority_size, max_payload and max_queued must be positive")
        self.host, self.port, self.client_id, self.keepalive = host, port, client_id, keepalive
        self._will = will
        self._on_connected = on_connected
        self._backoff = (backoff_base, backoff_cap)
        self._rng = rng or random.Random()
        self._log = logger or log
        self.max_payload = max_payload
        self._admit = admit
        # Lanes of (arrival number, message); get() takes the lowest number of their heads.
        self._lanes: dict[str, deque[tuple[int, Received]]] = {lane: deque() for lane in _DROP_ORDER}
        self._inbox_size, self._priority_size, self._arrivals = inbox_size, priority_size, 0
        self._ready = threading.Condition(threading.Lock())
        self._drops: Counter[str] = Counter()  # since the last summary line, by why
        self._drops_logged_at = 0.0
        self._subs: set[str] = set()
        self._taps: dict[str, Callable[[bytes], None]] = {}  # topic -> callback (tap())
        for topic_filter in subscriptions:
            self._check_filter(topic_filter)
            self._subs.add(topic_filter)
        # Guards _connected and paho calls from user threads; re-entrant because paho may run
        # our on_disconnect inline from a failed write.
        self._lock = threading.RLock()
        self._connected = False
        self._up = threading.Event()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stats = {"connects": 0, "connect_failures": 0, "disconnects": 0, "received": 0, "priority": 0, "resend": 0,
                       "dropped_oversize": 0, "dropped_inbox_full": 0, "dropped_resend_full": 0,
                       "dropped_priority_full": 0,
                       "dropped_admit": 0, "callback_errors": 0}
        c = paho.Client(CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=clean_session,
                        protocol=paho.MQTTv311, reconnect_on_failure=False)
        c.connect_timeout = connect_timeout
        c.max_queued_messages_set(max_queued)
        self._winding_down = threading.Event()  # between leaving a session and paho's thread joined
        c.enable_logger(_PahoLog(self._log.getChild("paho"), self._winding_down))  # type: ignore[arg-type]
        if username is not None:
            c.username_pw_set(username, password)
        if tls is not None:
            c.tls_set(ca_certs=tls.ca_certs, certfile=tls.certfile, keyfile=tls.keyfile,
                      cert_reqs=ssl.CERT_REQUIRED, tls_version=ssl.PROTOCOL_TLS_CLIENT)
            c.tls_insecure_set(tls.insecure)
        c.on_connect, c.on_disconnect, c.on_message = self._on_connect, self._on_disconnect, self._on_message
        c.on_subscribe = self._on_subscribe
        self._client = c

    @staticmethod
    def _check_filter(topic_filter: str) -> None:
        if not topic_filter or len(topic_filter.encode()) > 1024 or "\0" in topic_filter:
            raise ValueError(f"bad topic filter {topic_filter!r}")

    # ---- lifecycle ----
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("already started")
        self._thread = threading.Thread(target=self._supervise, name=f"mqtt-{self.client_id}", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Disconnect cleanly (no last will is sent) and stop the threads."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def __enter__(self) -> MqttClient:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def connected(self) -> bool:
        return self._connected

    def wait_connected(self, timeout: float | None = None) -> bool:
        """Wait until connected and the broker has confirmed the standing subscriptions."""
        return self._up.wait(timeout)

    @property
    def ready(self) -> bool:
        """Connected, and the broker has confirmed the standing subscriptions (taps too)."""
        return self._up.is_set()

    def tap(self, topic: str, callback: Callable[[bytes], None]) -> None:
        """Subscribe to exactly `topic` (no wildcards), now and after every reconnect; its
        messages go to `callback(payload)` in the network thread, never to the inbox. For a
        client's own loopback check: what it publishes there must come back (LoopbackProbe)."""
        self._check_filter(topic)
        if "+" in topic or "#" in topic:
            raise ValueError(f"a tap is one topic, not a filter: {topic!r}")
        with self._lock:
            self._taps[topic] = callback
        self.subscribe(topic)

    @property
    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._stats)

    def _count(self, name: str) -> None:
        with self._lock:
            self._stats[name] += 1

    def _supervise(self) -> None:
        attempt = 0
        while not self._stop.is_set():
            self._wake.clear()
            self._had_session = False
            try:
                will = self._will() if callable(self._will) else self._will
                with self._lock:
                    self._client.will_clear()
                    if will is not None:
                        self._client.will_set(will.topic, will.payload, qos=1, retain=will.retain)
                    self._client.connect(self.host, self.port, self.keepalive)
                    self._client.loop_start()
            except Exception as exc:  # OSError, ssl.SSLError, a will factory failing
                self._count("connect_failures")
                delay = full_jitter(attempt, base=self._backoff[0], cap=self._backoff[1], rng=self._rng)
                self._log.warning("mqtt %s: cannot connect to %s:%d (%s); retrying in %.1f s",
                                  self.client_id, self.host, self.port, exc, delay)
                attempt += 1
                self._stop.wait(delay)
                continue
            woke = True
            while not self._wake.wait(self.keepalive):  # set by on_disconnect or stop()
                if not self._client.is_connected():  # no CONNACK within a keepalive
                    self._log.warning("mqtt %s: no session after %d s; reconnecting", self.client_id, self.keepalive)
                    woke = False
                    break
            self._winding_down.set()
            if self._stop.is_set() or not woke:
                with self._lock:
                    self._client.disconnect()  # paho's loop only ends with unacked messages once the socket closes
            self._client.loop_stop()  # joins paho's network thread
            self._winding_down.clear()
            self._set_down()
            if self._stop.is_set():
                break
            attempt = 0 if self._had_session else attempt + 1
            delay = full_jitter(attempt, base=self._backoff[0], cap=self._backoff[1], rng=self._rng)
            self._log.info("mqtt %s: disconnected; reconnecting in %.1f s", self.client_id, delay)
            self._stop.wait(delay)

    def _set_down(self) -> None:
        with self._lock:
            self._connected = False
        self._up.clear()

    # ---- paho callbacks: run in paho's thread, must never raise ----
    def _on_connect(self, client: paho.Client, userdata: Any, flags: Any, reason: Any, properties: Any) -> None:
        try:
            if reason.is_failure:
                self._count("connect_failures")
                self._had_session = False
                self._log.error("mqtt %s: broker refused the connection: %s", self.client_id, reason)
                return
            self._had_session = True
            with self._lock:
                self._connected = True
                self._stats["connects"] += 1
                subs = sorted(self._subs)
            self._log.info("mqtt %s: connected to %s:%d", self.client_id, self.host, self.port)
            if subs:  # "up" once the broker confirms them, so nothing published after is missed
                self._sub_mid = client.subscribe([(s, 1) for s in subs])[1]
            else:
                self._up.set()
            if self._on_connected is not None:
                self._on_connected(self)
        except Exception:
            self._count("callback_errors")
            self._log.exception("mqtt %s: error in the on-connect handler", self.client_id)

    _had_session = False
    _sub_mid: int | None = None

    def _on_subscribe(self, client: paho.Client, userdata: Any, mid: int, reasons: Any, properties: Any) -> None:
        try:
            refused = [str(r) for r in reasons if r.is_failure]
            if refused:
                self._log.error("mqtt %s: broker refused a subscription: %s", self.client_id, ", ".join(refused))
            if mid == self._sub_mid:
                self._up.set()
        except Exception:
            self._count("callback_errors")
            self._log.exception("mqtt %s: error in the on-subscribe handler", self.client_id)

    def _on_disconnect(self, client: paho.Client, userdata: Any, flags: Any, reason: Any, properties: Any) -> None:
        try:
            self._set_down()
            self._count("disconnects")
            if not self._stop.is_set():
                self._log.warning("mqtt %s: connection lost (%s)", self.client_id, reason)
        except Exception:
            self._log.exception("mqtt %s: error in the on-disconnect handler", self.client_id)
        finally:
            self._wake.set()  # the supervisor must always learn about it

    def _on_message(self, client: paho.Client, userdata: Any, msg: paho.MQTTMessage) -> None:
        try:
            tapped = self._taps.get(msg.topic)
            if tapped is not None:
                tapped(bytes(msg.payload))
                return
            size = len(msg.payload)
            if size > self.max_payload:
                self._dropped("dropped_oversize", f"over {self.max_payload} bytes")
                return
            item = Received(msg.topic, bytes(msg.payload), bool(msg.retain), time.time())
            lane = "bulk"
            if self._admit is not None:
                try:
                    lane = self._admit(item.topic, item.payload)
                except Exception:  # the sorter must not lose messages: treat as unverified
                    self._count("callback_errors")
                    lane = "bulk"
                if lane.startswith("drop"):  # "drop" or "drop:<why>"
                    self._dropped("dropped_admit", lane[5:][:200] or "refused by admit")
                    return
                if lane not in LANES:
                    lane = "bulk"
            victim, take, lanes = None, True, self._lanes
            with self._ready:
                if lane == "priority" and len(lanes["priority"]) >= self._priority_size:
                    victim = "priority"
                elif sum(len(q) for q in lanes.values()) >= self._inbox_size:
                    victim = next(v for v in _DROP_ORDER if lanes[v])  # the least important, oldest first
                    if _DROP_ORDER.index(victim) > _DROP_ORDER.index(lane):
                        victim, take = lane, False  # it matters less than all that waits: it goes
                if take:
                    if victim is not None:
                        lanes[victim].popleft()
                    self._arrivals += 1
                    lanes[lane].append((self._arrivals, item))
                    self._ready.notify()
            self._count("received")
            if lane in ("priority", "resend"):
                self._count(lane)
            if victim is not None:
                self._dropped(_DROP_STAT[victim], f"inbox full ({self._inbox_size}), oldest {_DROP_WHAT[victim]} "
                                                  "message dropped")
        except Exception:  # e.g. a topic that is not UTF-8
            self._count("callback_errors")
            self._dropped("callback_errors", "undecodable")

    def _dropped(self, stat: str, why: str) -> None:
        """Count a dropped message; log a summary at most once per DROP_LOG_INTERVAL_S."""
        with self._lock:
            if stat != "callback_errors":
                self._stats[stat] += 1
            self._drops[why] += 1
        self._log_drops()

    def _log_drops(self, *, force: bool = False) -> None:
        now = time.monotonic()
        with self._lock:
            if not self._drops or (not force and now - self._drops_logged_at < DROP_LOG_INTERVAL_S):
                return
            drops, self._drops = self._drops, Counter()
            since = now - self._drops_logged_at
            self._drops_logged_at = now
        what = ", ".join(f"{n} {why}" for why, n in drops.most_common())
        self._log.warning("mqtt %s: dropped %d received messages%s: %s", self.client_id, sum(drops.values()),
                          f" in the last {since:.0f} s" if since < 3600 else "", what)

    # ---- user API (any thread) ----
    def get(self, timeout: float | None = None) -> Received | None:
        """Next received message in arrival order, or None after `timeout` seconds."""
        self._log_drops()  # a summary still due after a flood ended
        lanes = self._lanes
        with self._ready:
            if not self._ready.wait_for(lambda: any(lanes.values()), timeout):
                return None
            first = min((q for q in lanes.values() if q), key=lambda q: q[0][0])
            return first.popleft()[1]

    @property
    def pending(self) -> int:
        """Messages received and not yet taken by get()."""
        with self._ready:
            return sum(len(q) for q in self._lanes.values())

    def subscribe(self, topic_filter: str) -> None:
        """Subscribe now (if connected) and after every reconnect, at QoS 1."""
        self._check_filter(topic_filter)
        with self._lock:
            self._subs.add(topic_filter)
            if self._connected:
                self._client.subscribe(topic_filter, qos=1)

    def unsubscribe(self, topic_filter: str) -> None:
        with self._lock:
            self._subs.discard(topic_filter)
            if self._connected:
                self._client.unsubscribe(topic_filter)

    def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> paho.MQTTMessageInfo | None:
        """Publish at QoS 1; None when disconnected (nothing is queued in memory)."""
        with self._lock:
            if not self._connected:
                return None
            info = self._client.publish(topic, payload, qos=1, retain=retain)
        return info if info.rc == paho.MQTT_ERR_SUCCESS else None

    def publish_wait(self, topic: str, payload: bytes, *, retain: bool = False, timeout: float = 10.0) -> bool:
        """Publish at QoS 1 and wait for the broker's PUBACK; False if not acknowledged in time."""
        return self.wait_published([self.publish(topic, payload, retain=retain)], timeout=timeout)[0]

    def wait_published(self, infos: list[paho.MQTTMessageInfo | None], *, timeout: float = 10.0) -> list[bool]:
        """Wait (one deadline for all) for the PUBACKs of messages already handed to `publish`:
        a sender of many messages publishes them all first, so their round trips overlap
        instead of adding up. False for a message not published (None) or not acknowledged."""
        deadline = time.monotonic() + timeout
        done = []
        for info in infos:
            ok = info is not None
            try:
                while ok and not info.is_published():
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 or not self._connected:
                        ok = False
                        break
                    info.wait_for_publish(min(remaining, 0.5))
            except (ValueError, RuntimeError):
                ok = False
            done.append(ok)
        return done
