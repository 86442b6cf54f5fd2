"""What systemd sees of the daemon: READY=1, STATUS=, WATCHDOG=1 only while the main loop
runs, STOPPING=1 and exit 0 on SIGTERM, exit 78 on a bad config; and its idle footprint."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.conftest import REPO, Watcher, board_tree, enrol, wait_for

pytestmark = pytest.mark.integration


class NotifySocket:
    """A datagram socket playing systemd's $NOTIFY_SOCKET."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.05)
        self.messages: list[tuple[float, str]] = []

    def pump(self) -> list[tuple[float, str]]:
        while True:
            try:
                self.messages.append((time.monotonic(), self.sock.recv(4096).decode()))
            except (TimeoutError, BlockingIOError):
                return self.messages

    def count(self, text: str, since: float = 0.0) -> int:
        return sum(1 for t, m in self.pump() if t >= since and text in m.split("\n"))


def vm_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    raise AssertionError("no VmRSS")


def test_watchdog_ready_pings_and_a_hung_loop(mosquitto, fleet, agents, tmp_path):
    notify = NotifySocket(tmp_path / "notify.sock")
    agent = agents(tmp_path, mosquitto.port, sysfs_root=board_tree(tmp_path / "board"),
                   env={"NOTIFY_SOCKET": str(tmp_path / "notify.sock"), "WATCHDOG_USEC": "1000000"})
    watcher = Watcher(fleet, fleet.coordinator(mosquitto.port))
    enrol(watcher, agent)
    watcher.start()
    agent.start()
    assert wait_for(lambda: notify.count("READY=1") == 1, 30), agent.log_tail()
    assert wait_for(lambda: notify.count("WATCHDOG=1") >= 3, 60)  # every 0.5 s while the loop runs
    assert wait_for(lambda: any(m.startswith("STATUS=idle") for _, m in notify.pump()), 60)

    # Idle and connected: small, and free of numpy and MXNet (children load those).
    assert wait_for(lambda: watcher.states(), 20)
    rss = vm_rss_mb(agent.proc.pid)
    print(f"\nidle connected daemon: VmRSS {rss:.1f} MB")
    assert rss <= 60.0
    maps = Path(f"/proc/{agent.proc.pid}/maps").read_text()
    assert "numpy" not in maps and "mxnet" not in maps and "libmxnet" not in maps

    # Make the main loop hang (test hook): the pings stop within one interval...
    hang = agent.state_dir / "debug" / "hang"
    hang.parent.mkdir(parents=True, exist_ok=True)
    hang.touch()

    def silent_for(seconds: float) -> bool:
        pings = [t for t, m in notify.pump() if m == "WATCHDOG=1"]
        return bool(pings) and time.monotonic() - pings[-1] >= seconds

    assert wait_for(lambda: silent_for(2.0), 60)  # four ping periods without a ping: systemd would restart it
    assert agent.alive
    since = time.monotonic()
    # ... and come back when the loop does.
    hang.unlink()
    assert wait_for(lambda: notify.count("WATCHDOG=1", since) >= 2, 60)
    assert agent.terminate() == 0
    assert notify.count("STOPPING=1") == 1


def test_bad_config_exits_78_and_check_validates(tmp_path):
    bad = tmp_path / "agent.toml"
    bad.write_text('[device]\nname = "x"\n[broker]\nhost = "h"\nport = 99999\n')
    run = [sys.executable, "-m", "edge_agent.agent.cli", "run", "--config", str(bad)]
    proc = subprocess.run(run, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 78
    assert f"{bad}:5: broker.port: 99999 is above the maximum" in proc.stderr
    proc = subprocess.run(run + ["--check"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 78 and "broker.port" in proc.stderr
