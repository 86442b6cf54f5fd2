"""sd_notify and the watchdog against a real datagram socket playing $NOTIFY_SOCKET."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from edge_agent.agent.sdnotify import Watchdog, notify, watchdog_interval_s


class NotifySocket:
    def __init__(self, path: str) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path if not path.startswith("@") else "\0" + path[1:])
        self.sock.settimeout(0.05)
        self.messages: list[str] = []

    def drain(self, seconds: float) -> list[str]:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except TimeoutError:
                pass
        return self.messages


@pytest.fixture()
def notify_socket(tmp_path: Path) -> Iterator[NotifySocket]:
    ns = NotifySocket(str(tmp_path / "notify.sock"))
    yield ns
    ns.sock.close()


def test_notify_without_systemd_is_a_quiet_no(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify("READY=1") is False
    assert notify("READY=1", socket_path="/nonexistent/socket") is False


def test_notify_reaches_file_and_abstract_sockets(notify_socket: NotifySocket) -> None:
    assert notify("READY=1\nSTATUS=idle", socket_path=notify_socket.path)
    abstract = NotifySocket(f"@edge-agent-test-{time.monotonic_ns()}")
    try:
        assert notify("WATCHDOG=1", socket_path=abstract.path)
        assert abstract.drain(0.2) == ["WATCHDOG=1"]
    finally:
        abstract.sock.close()
    assert notify_socket.drain(0.2) == ["READY=1\nSTATUS=idle"]


def test_watchdog_interval_from_systemd_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "60000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert watchdog_interval_s() == 60.0
    monkeypatch.setenv("WATCHDOG_PID", "1")  # meant for another process
    assert watchdog_interval_s() is None
    monkeypatch.setenv("WATCHDOG_USEC", "junk")
    assert watchdog_interval_s() is None
    with pytest.raises(ValueError, match="positive"):
        Watchdog(interval_s=-1)


def test_pings_while_alive_and_stops_when_the_main_loop_hangs(notify_socket: NotifySocket) -> None:
    dog = Watchdog(interval_s=0.4, socket_path=notify_socket.path)
    dog.ready("idle")
    dog.start()
    try:
        end = time.monotonic() + 1.2
        while time.monotonic() < end:  # a healthy main loop
            dog.alive()
            notify_socket.drain(0.05)
        healthy = notify_socket.messages.count("WATCHDOG=1")
        assert notify_socket.messages[0] == "READY=1\nSTATUS=idle"
        assert healthy >= 4  # every 0.2 s for 1.2 s, allowing for a busy machine
        notify_socket.messages.clear()
        notify_socket.drain(1.2)  # the main loop hangs: no alive() calls
        # At most the pings in the first interval after the last alive(), then silence.
        assert notify_socket.messages.count("WATCHDOG=1") <= 2
        notify_socket.messages.clear()
        notify_socket.drain(0.6)
        assert "WATCHDOG=1" not in notify_socket.messages
    finally:
        dog.stop()
    assert "STOPPING=1" in notify_socket.drain(0.2)
