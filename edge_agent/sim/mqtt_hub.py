"""Many paho MQTT clients in one thread: an epoll selector over their sockets plus a timer heap.

A thread per client (paho's `loop_start`, the agent's `MqttClient`) does not scale to
10,000 simulated devices on two cores; paho's external-loop API does: each client's socket
is registered here (`on_socket_open` / `on_socket_register_write`), readable -> `loop_read`,
writable -> `loop_write`, and `loop_misc` (keepalive) once a second. Everything a simulated
device does runs in this thread (its callbacks and timers), so nothing needs a lock.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import paho.mqtt.client as paho

log = logging.getLogger(__name__)


class Hub:
    """One thread driving many paho clients; `call_later` / `call_soon` schedule work on it."""

    def __init__(self, *, name: str = "mqtt-hub") -> None:
        self._sel = selectors.DefaultSelector()
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._clients: set[paho.Client] = set()
        self._stop = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._incoming: list[Callable[[], None]] = []
        self._lock = threading.Lock()  # only for call_soon from other threads
        self.errors = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    # ---- clients ----
    def attach(self, client: paho.Client) -> None:
        """Wire `client`'s socket callbacks to this hub (before `connect`)."""
        client.on_socket_open = self._open
        client.on_socket_close = self._close
        client.on_socket_register_write = self._want_write
        client.on_socket_unregister_write = self._no_write
        self._clients.add(client)

    def detach(self, client: paho.Client) -> None:
        self._clients.discard(client)

    def _open(self, client: paho.Client, userdata: Any, sock: Any) -> None:
        self._sel.register(sock, selectors.EVENT_READ, client)

    def _close(self, client: paho.Client, userdata: Any, sock: Any) -> None:
        try:
            self._sel.unregister(sock)
        except (KeyError, ValueError):
            pass

    def _want_write(self, client: paho.Client, userdata: Any, sock: Any) -> None:
        try:
            self._sel.modify(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, client)
        except (KeyError, ValueError):
            pass

    def _no_write(self, client: paho.Client, userdata: Any, sock: Any) -> None:
        try:
            self._sel.modify(sock, selectors.EVENT_READ, client)
        except (KeyError, ValueError):
            pass

    # ---- scheduling ----
    def call_later(self, delay: float, fn: Callable[[], None]) -> None:
        """Run `fn` on the hub thread after `delay` s (call from the hub thread)."""
        heapq.heappush(self._timers, (time.monotonic() + max(0.0, delay), next(self._seq), fn))

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the hub thread (thread-safe)."""
        with self._lock:
            self._incoming.append(fn)
        try:
            self._wake_w.send(b"x")
        except BlockingIOError:
            pass

    # ---- the loop ----
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self.call_soon(lambda: None)
        self._thread.join(timeout)

    def _run_safely(self, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except Exception:  # one device's bug must not stop the other 9,999
            self.errors += 1
            if self.errors <= 20:
                log.exception("simulated device step failed")

    def _run(self) -> None:
        next_misc = time.monotonic() + 1.0
        while not self._stop.is_set():
            now = time.monotonic()
            timeout = min(next_misc - now, self._timers[0][0] - now if self._timers else 1.0)
            for key, events in self._sel.select(max(0.0, min(timeout, 0.5))):
                client = key.data
                if client is None:
                    try:
                        self._wake_r.recv(65536)
                    except BlockingIOError:
                        pass
                    continue
                if events & selectors.EVENT_READ:
                    self._run_safely(client.loop_read)
                if events & selectors.EVENT_WRITE:
                    self._run_safely(client.loop_write)
            with self._lock:
                incoming, self._incoming = self._incoming, []
            for fn in incoming:
                self._run_safely(fn)
            now = time.monotonic()
            while self._timers and self._timers[0][0] <= now:
                _, _, fn = heapq.heappop(self._timers)
                self._run_safely(fn)
            if now >= next_misc:
                next_misc = now + 1.0
                for client in list(self._clients):
                    self._run_safely(client.loop_misc)
