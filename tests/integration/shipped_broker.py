"""The shipped fleet broker (packaging/mosquitto/edge-agent-fleet.conf + the ACL rendered by
`make-certs acl`) on a real mosquitto on a free loopback port, for every test that runs
through TLS with client certificates and the ACL.

Only the paths and the listener's port are rewritten, and each rewritten line must exist
exactly once, so a test runs the shipped file rather than a copy that could drift."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from edge_agent.transport.broker import MosquittoBroker

REPO = Path(__file__).resolve().parents[2]
SHIPPED_CONF = REPO / "packaging/mosquitto/edge-agent-fleet.conf"
SHIPPED_ACL = REPO / "packaging/mosquitto/acl"
MAKE_CERTS = REPO / "packaging/mosquitto/make-certs"
ETC = "/etc/mosquitto/edge-agent"


def fleet_config(text: str, *, port: int, cert_dir: Path, workdir: Path) -> str:
    """The shipped config with its paths and listener moved into the test; every rewritten
    line must exist exactly once, so a changed shipped file fails here, not silently."""
    rewrites = {
        "listener 8883": f"listener {port} 127.0.0.1",
        f"cafile {ETC}/ca.pem": f"cafile {cert_dir}/ca.pem",
        f"certfile {ETC}/server.pem": f"certfile {cert_dir}/server.pem",
        f"keyfile {ETC}/server.key": f"keyfile {cert_dir}/server.key",
        f"acl_file {ETC}/acl": f"acl_file {cert_dir}/acl",
    }
    lines = text.splitlines()
    for old in rewrites:
        assert lines.count(old) == 1, f"{SHIPPED_CONF.name}: expected the line {old!r} once"
    lines = [rewrites.get(line, line) for line in lines]
    return "\n".join(debian_main_config(workdir) + lines) + "\n"


def debian_main_config(workdir: Path) -> list[str]:
    """What Debian's /etc/mosquitto/mosquitto.conf provides around conf.d, for a test broker."""
    return [f"log_dest file {workdir}/mosquitto.log", "log_type all", "connection_messages true",
            "persistence false", *(["user root"] if os.geteuid() == 0 else [])]


class FleetBroker(MosquittoBroker):
    """MosquittoBroker (start on a free port, wait, stop) with the shipped fleet config."""

    def __init__(self, *, workdir: Path, cert_dir: Path) -> None:
        super().__init__(workdir=workdir)
        self.cert_dir = cert_dir

    def config_text(self) -> str:
        return fleet_config(SHIPPED_CONF.read_text(), port=self.port, cert_dir=self.cert_dir, workdir=self.workdir)

    def reload(self) -> None:
        """SIGHUP: mosquitto re-reads its ACL file; connected clients stay connected."""
        import signal

        assert self._proc is not None
        self._proc.send_signal(signal.SIGHUP)


def make_certs(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(MAKE_CERTS), *map(str, args)], capture_output=True, text=True,
                          timeout=120)
