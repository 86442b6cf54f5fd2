"""systemd notification and watchdog, without a dependency: a datagram to $NOTIFY_SOCKET.

The unit is `Type=notify` with `WatchdogSec=`. The daemon says READY=1 once it is serving,
STATUS=... as it changes state, and WATCHDOG=1 at half the watchdog interval — but only
while its main loop keeps calling `Watchdog.alive()`. A main loop that hangs (a stuck
broker call, a deadlock) stops the pings, and systemd restarts the service.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


def _address(raw: str) -> str | bytes:
    # "@name" is a Linux abstract-namespace socket: a leading NUL byte on the wire.
    return b"\0" + raw[1:].encode() if raw.startswith("@") else raw


def notify(message: str, *, socket_path: str | None = None) -> bool:
    """Send one sd_notify message; False (never an exception) when not under systemd."""
    target = socket_path if socket_path is not None else os.environ.get("NOTIFY_SOCKET", "")
    if not target:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(_address(target))
            sock.sendall(message.encode())
        return True
    except OSError as exc:  # systemd gone or socket unwritable: the daemon keeps running
        log.debug("sd_notify %r failed: %s", message, exc)
        return False


def watchdog_interval_s() -> float | None:
    """The watchdog interval systemd asked for, or None (WATCHDOG_USEC, WATCHDOG_PID)."""
    usec = os.environ.get("WATCHDOG_USEC", "")
    pid = os.environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid and pid != str(os.getpid()):
        return None  # meant for another process (e.g. we are a child)
    return int(usec) / 1e6


class Watchdog:
    """Pings systemd at half the interval while the main loop proves it is alive."""

    def __init__(self, *, interval_s: float | None = None, socket_path: str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s if interval_s is not None else watchdog_interval_s()
        if self.interval_s is not None and self.interval_s <= 0:
            raise ValueError(f"watchdog interval must be positive, got {self.interval_s}")
        self._socket_path = socket_path
        self._clock = clock
        self._last_alive = clock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.pings = 0

    @property
    def enabled(self) -> bool:
        return self.interval_s is not None

    def alive(self) -> None:
        """Called by the main loop on every iteration."""
        self._last_alive = self._clock()

    def ready(self, status: str = "") -> None:
        notify("READY=1" + (f"\nSTATUS={status}" if status else ""), socket_path=self._socket_path)

    def status(self, status: str) -> None:
        notify(f"STATUS={status}", socket_path=self._socket_path)

    def start(self) -> None:
        if not self.enabled or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="sd-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        notify("STOPPING=1", socket_path=self._socket_path)
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        assert self.interval_s is not None
        half = self.interval_s / 2
        while not self._stop.wait(half):
            # A main loop silent for a whole interval is stuck: stop vouching for it.
            if self._clock() - self._last_alive < self.interval_s:
                if notify("WATCHDOG=1", socket_path=self._socket_path):
                    self.pings += 1
            else:
                log.warning("main loop silent for %.1f s; withholding the watchdog ping",
                            self._clock() - self._last_alive)
