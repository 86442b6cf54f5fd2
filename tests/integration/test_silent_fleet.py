"""A fleet made silent by its broker's ACL, through the shipped TLS + ACL config
(packaging/mosquitto) on a real mosquitto: the new-operator mistake of docs/deployment.md
before issue 35, an ACL rendered for fleet `farm1` while serve and the agents use `farm`.

MQTT 3.1.1 acknowledges a denied publish and drops it, so both sides log "connected". Now:
serve's own loopback message is lost (a `broker:` PROBLEM in `status` and `devices`), the
agent's hello is never answered (its log, systemd STATUS= and `run --check`, exit 69).
Then the ACL is fixed and mosquitto reloaded (SIGHUP: connections stay): the coordinator
refuses the agent's states as from an unknown key, the agent sends its hello again, and the
device appears and is approved, without restarting anything."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.conftest import REPO, AgentProcess, ServeProcess, board_tree, wait_for
from tests.integration.shipped_broker import FleetBroker, make_certs

pytestmark = pytest.mark.integration
WAIT_S = 120  # bounds a hang only: every wait ends on what the processes report


class Notify:
    """A datagram socket playing systemd's $NOTIFY_SOCKET: the agent's STATUS= lines."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setblocking(False)
        self.lines: list[str] = []

    def statuses(self) -> list[str]:
        while True:
            try:
                self.lines += self.sock.recv(4096).decode().split("\n")
            except BlockingIOError:
                return [ln[len("STATUS="):] for ln in self.lines if ln.startswith("STATUS=")]


def tls_agent(fleet, tmp: Path, broker: FleetBroker, cert_dir: Path, *, silence_s: float,  # noqa: ANN001
              **kw) -> AgentProcess:
    """An agent process with its own device certificate (CN = its id), connecting over TLS."""
    agent = AgentProcess(fleet, tmp, broker.port, sysfs_root=board_tree(tmp / "board"),
                         extra_toml=f"coordinator_silence_s = {silence_s}\n", **kw)
    assert make_certs("device", agent.id, "--dir", cert_dir).returncode == 0
    text = agent.config.read_text().replace("tls = false", "tls = true", 1)
    tls = (f'ca_file = "{cert_dir}/ca.pem"\ncert_file = "{cert_dir}/{agent.id}.pem"\n'
           f'key_file = "{cert_dir}/{agent.id}.key"\n')
    agent.config.write_text(text.replace("[coordinator]", tls + "\n[coordinator]", 1))
    return agent


def run_check(agent: AgentProcess) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "edge_agent.agent.cli", "run", "--config", str(agent.config), "--check"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)


def broken_fleet(fleet, tmp: Path, *, silence_s: float, notify: Notify | None = None,  # noqa: ANN001
                 ) -> tuple[Path, FleetBroker, ServeProcess, AgentProcess]:
    """Certificates, the shipped broker with the ACL rendered for `farm1` (the docs' mistake),
    serve and one agent on `farm`, all started."""
    certs = tmp / "fleet-certs"
    for args in (["init"], ["server", "127.0.0.1"], ["coordinator"],
                 ["acl", "--fleet", "farm1", "--prefix", fleet.topics.prefix]):
        assert make_certs(*args, "--dir", certs).returncode == 0, args
    broker = FleetBroker(workdir=tmp / "mosquitto", cert_dir=certs)
    broker.start()
    serve = ServeProcess(fleet, tmp, broker.port, auto_approve=False, extra=(
        "--tls", "--ca-file", str(certs / "ca.pem"), "--cert-file", str(certs / "coordinator.pem"),
        "--key-file", str(certs / "coordinator.key"), "--silence-alert", "3s"))
    env = {"NOTIFY_SOCKET": str(notify.path)} if notify else None
    agent = tls_agent(fleet, tmp, broker, certs, silence_s=silence_s, env=env)
    serve.start()
    agent.start()
    return certs, broker, serve, agent


def test_an_acl_for_another_fleet_is_reported_by_serve_and_the_agent(fleet, tmp_path: Path):  # noqa: ANN001
    """Item 7: every message denied while both sides say "connected" is a PROBLEM on both."""
    notify = Notify(tmp_path / "notify.sock")
    certs, broker, serve, agent = broken_fleet(fleet, tmp_path, silence_s=2, notify=notify)
    try:
        def status() -> str:
            return serve.cli("status").stdout

        # serve: its own messages are lost; and no device is heard
        assert wait_for(lambda: "PROBLEM: broker:" in status(), WAIT_S), serve.log_tail()
        assert wait_for(lambda: "PROBLEM: silence:" in status(), WAIT_S), serve.log_tail()
        shown = status()
        assert f"{fleet.topics.prefix}/farm/#" in shown and "make-certs acl --fleet farm --prefix" in shown, shown
        devices = serve.cli("devices").stdout
        assert "no devices yet" in devices and "PROBLEM: broker:" in devices, devices
        assert " ERROR edge_agent.coordinator.service: broker: " in serve.log_tail(20_000)

        # the agent: its hello is never answered
        assert wait_for(lambda: "has not answered this device's hello" in agent.log_tail(20_000), WAIT_S), \
            agent.log_tail()
        assert wait_for(lambda: any("coordinator silent" in s for s in notify.statuses()), WAIT_S), notify.statuses()
        check = run_check(agent)
        assert check.returncode == 69, check.stdout + check.stderr
        assert "PROBLEM" in check.stdout and "make-certs acl --fleet farm" in check.stdout, check.stdout
        assert agent.alive and serve.alive

        # fixed (and mosquitto reloaded): both problems go away by themselves
        assert make_certs("acl", "--fleet", "farm", "--prefix", fleet.topics.prefix, "--force",
                          "--dir", certs).returncode == 0
        broker.reload()
        assert wait_for(lambda: "PROBLEM" not in status(), WAIT_S), status()
        assert wait_for(lambda: run_check(agent).returncode == 0, WAIT_S), run_check(agent).stdout
        assert "answered this device's hello" in run_check(agent).stdout
        assert wait_for(lambda: "coordinator silent" not in notify.statuses()[-1], WAIT_S), notify.statuses()
    finally:
        agent.stop()
        serve.stop()
        broker.stop()
        notify.sock.close()


def test_after_the_acl_is_fixed_the_device_appears_without_an_agent_restart(fleet, tmp_path: Path):  # noqa: ANN001
    """Item 8: the hello was denied, the states now arrive from a key the coordinator does not
    know: it says so to the device, which sends its hello again. (The agent's own re-send
    after silence is an hour away here: only the refusal can bring it back in this test.)"""
    certs, broker, serve, agent = broken_fleet(fleet, tmp_path, silence_s=3600)
    try:
        denied = f"Denied PUBLISH from {agent.id} "  # its hello and states, until the ACL is fixed
        assert wait_for(lambda: broker.log_tail(100_000).count(denied) >= 3, WAIT_S), broker.log_tail()
        assert make_certs("acl", "--fleet", "farm", "--prefix", fleet.topics.prefix, "--force",
                          "--dir", certs).returncode == 0
        broker.reload()  # connections stay: the agent is neither restarted nor reconnected
        assert wait_for(lambda: "PENDING" in serve.cli("devices").stdout, WAIT_S), serve.log_tail() + agent.log_tail()
        serve.cli("approve", agent.id)
        assert wait_for(lambda: agent.id in approved_online(serve), WAIT_S), serve.log_tail() + agent.log_tail()
        log = agent.log_tail(50_000)
        assert "does not know this device" in log, log  # the coordinator's refusal of its state
        assert log.count("connected to 127.0.0.1") == 1, log  # one connection throughout
    finally:
        agent.stop()
        serve.stop()
        broker.stop()


def approved_online(serve: ServeProcess) -> list[str]:
    with serve.registry() as reg:
        now = time.time()
        return [d.id for d in reg.list_devices() if d.approved and d.is_online(now, 300)]
