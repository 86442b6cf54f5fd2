"""docs/deployment.md, executed: a new operator's walk from nothing to two approved devices
and a completed two-round job, through the shipped TLS + ACL broker config.

The test reads the doc's `sh` blocks in order and runs their commands: `make-certs` for
the CA, the broker, the coordinator and each device; the shipped mosquitto config and the
ACL `make-certs acl` rendered, on a real mosquitto; `edge-coordinator serve`; the starter
model; for two devices `edge-agent init`, their certificates, `run --check` and the daemon;
`approve`, `tag`, and `train` of step 8, which must end with the job done. So the doc cannot
drift from the code (a fleet rendered into the ACL that is not the one serve and the agents
use fails here, as it failed the operator in issue 35).

What the test must substitute, and nothing else (SUBSTITUTIONS below, applied to each word):
- this machine plays every host. `/etc/...`, `/srv/...` and `/var/lib/...` are per-host
  temporary roots; the workstation's home and the devices' (`pi@barn-N:`, where `scp`
  copies) are temporary directories, and `cd edge-agent` is a temporary checkout that links
  this one's `.venv` and `packaging/` (the doc writes fleet-certs/, models/ there).
- the broker's name and address (broker.example.org, 192.0.2.10) are 127.0.0.1, and its
  port 8883 a free loopback port; the installed mosquitto config is rewritten the same way
  (its /etc paths and `listener 8883`), as `tests/integration/shipped_broker.py` does.
- `sudo` is dropped, and `install -o/-g` owner options (no such users here); `apt`/`apt-get`
  are not run (.ci/run installs mosquitto; the .deb has its own tests), nor `journalctl`
  or `systemctl status` (the test reads the logs itself). `systemctl restart mosquitto`
  starts mosquitto with what Debian's package provides around conf.d (a main config that
  includes it); `systemctl start edge-agent` starts what the unit's ExecStart runs,
  `edge-agent run --config /etc/edge-agent/agent.toml`. Step 4 (the package or
  install-service) is not run: it has its own tests; the directories it creates
  (/etc/edge-agent, /var/lib/edge-agent) are made here, and the agent runs from this
  checkout's venv. The optional section after step 8, local inference for the device's
  own applications, has its own test (tests/integration/test_inference_service.py).
- `edge-agent init` is given its defaults that name absolute paths (--config, --state-dir)
  under the device's root, and `--sysfs-root` a captured Raspberry Pi 4 tree with a
  battery (this machine is not a Pi).
- the placeholders the doc asks the reader to fill in: the example device id, enrolment
  code and `BASE64-FROM-STEP-3` become what `init` and `edge-coordinator key` printed;
  `barn-1` / `device-1` become `barn-N` / `device-N` for the N-th device.
- `serve` is started in the background (the doc gives it its own terminal); commands that
  report what happens later (`devices`, `run --check` after the start, `status`) are run
  again until they show it (bounded: it would otherwise hang).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.integration.conftest import REPO, board_tree
from tests.integration.shipped_broker import debian_main_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
DOC = REPO / "docs" / "deployment.md"
BIN = Path(os.environ.get("VIRTUAL_ENV") or REPO / ".venv") / "bin"
DEVICES = 2
WAIT_S = 300  # bounds a hang only: each wait ends on what a command prints
DOC_DEVICE_ID = "hbd2w7q4xk5nj3tqv6c2a7mz"
DOC_CODE = "ABCD-EFGH-IJKL"
DOC_KEY = "BASE64-FROM-STEP-3"
NOT_RUN = {("apt-get",), ("apt",), ("journalctl",), ("systemctl", "status")}


@dataclass
class Block:
    section: str  # the "## N." heading it is under
    where: str  # workstation | broker | device
    commands: list[list[str]]  # words of each command (continuations joined, comments dropped)


def read_blocks(text: str) -> list[Block]:
    blocks, section, lines, inside = [], "", [], False
    for line in text.splitlines():
        if not inside and line.startswith("## "):
            section = line[3:].strip()
        elif not inside and line.strip() == "```sh":
            inside, lines = True, []
        elif inside and line.strip() == "```":
            inside = False
            first = lines[0].strip() if lines else ""
            where = next((w for w in ("workstation", "broker", "device") if first.startswith(f"# on the {w}")), None)
            assert where, f"{DOC.name}: a sh block under {section!r} must start with '# on the workstation|broker " \
                          f"host|device': {first!r}"
            blocks.append(Block(section, where, commands(lines)))
        elif inside:
            lines.append(line)
    return blocks


def commands(lines: list[str]) -> list[list[str]]:
    out, pending = [], ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        words = shlex.split(pending + line, comments=True)
        pending = ""
        if words:
            out.append(words)
    return out


@dataclass
class Host:
    name: str
    root: Path  # what / is for its /etc, /srv, /var
    home: Path
    cwd: Path
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Device:
    n: int
    host: Host
    id: str = ""
    code: str = ""
    approved: bool = False
    agent: subprocess.Popen[bytes] | None = None


class Walk:
    """Runs the doc's commands with the substitutions of the module docstring."""

    def __init__(self, tmp: Path) -> None:
        from edge_agent.transport.broker import free_port

        self.tmp, self.port = tmp, free_port()
        ws = tmp / "workstation"
        ws.mkdir()
        self.workstation = Host("workstation", tmp / "workstation-root", ws, ws, {})
        checkout = ws / "edge-agent"  # `cd edge-agent`: a checkout writing its files here, not into this one
        checkout.mkdir()
        (checkout / ".venv").symlink_to(BIN.parent)
        (checkout / "packaging").symlink_to(REPO / "packaging")
        self.checkout = checkout
        self.broker_host = Host("broker", tmp / "broker-root", checkout, checkout, {})
        etc = self.broker_host.root / "etc" / "mosquitto"
        (etc / "conf.d").mkdir(parents=True)  # what the mosquitto package installs
        self.broker_log = tmp / "mosquitto.log"
        (etc / "mosquitto.conf").write_text("\n".join(debian_main_config(tmp) + [f"include_dir {etc}/conf.d"]) + "\n")
        self.mosquitto: subprocess.Popen[bytes] | None = None
        self.serve: subprocess.Popen[bytes] | None = None
        self.serve_log = tmp / "serve.log"
        self.key = ""
        self.devices = []
        for n in range(1, DEVICES + 1):
            home = tmp / f"barn-{n}" / "home"
            home.mkdir(parents=True)
            root = tmp / f"barn-{n}" / "root"
            for d in ("etc/edge-agent", "var/lib/edge-agent"):  # what step 4 (package, install-service) makes
                (root / d).mkdir(parents=True)
            self.devices.append(Device(n, Host(f"barn-{n}", root, home, home, {})))
        self.board = board_tree(tmp / "pi4-board", battery_pct=80)
        self.ran: list[str] = []
        self.skipped: list[str] = []

    # ---- substitutions ----
    def word(self, w: str, host: Host, dev: Device | None) -> str:
        w = w.replace("broker.example.org", "127.0.0.1").replace("192.0.2.10", "127.0.0.1")
        w = re.sub(r"(?<=127\.0\.0\.1:)8883\b", str(self.port), w)
        if w == "~" or w.startswith("~/"):
            w = str(host.home) + w[1:]
        if re.match(r"/(etc|srv|var)/", w):
            w = str(host.root) + w
        if w.startswith("/opt/edge-agent/venv/bin/"):
            w = str(BIN / w.rsplit("/", 1)[1])
        if dev is not None:
            w = w.replace(DOC_DEVICE_ID, dev.id or DOC_DEVICE_ID).replace(DOC_CODE, dev.code or DOC_CODE)
            w = w.replace("barn-1", f"barn-{dev.n}").replace("device-1", f"device-{dev.n}")
        return w.replace(DOC_KEY, self.key or DOC_KEY)

    def expand(self, words: list[str], host: Host, dev: Device | None) -> list[str]:
        out: list[str] = []
        for w in words:
            if w.startswith("$") and w[1:] in host.env:  # an unquoted variable: split into words
                out += host.env[w[1:]].split()
            else:
                out.append(self.word(w, host, dev))
        if out and out[0] == "sudo":
            out = out[1:]
        if out and out[0] in ("edge-agent", "edge-coordinator"):
            out[0] = str(BIN / out[0])
        return [str(self.port) if w == "8883" and i and out[i - 1] == "-p" else w for i, w in enumerate(out)]

    def env(self, host: Host) -> dict[str, str]:
        return {**os.environ, "HOME": str(host.home), "PATH": f"{BIN}:{os.environ['PATH']}", "PYTHONUNBUFFERED": "1",
                **host.env}

    # ---- running ----
    def run(self, argv: list[str], host: Host, *, check: bool = True, timeout: float = 600) -> str:
        done = subprocess.run(argv, cwd=host.cwd, env=self.env(host), capture_output=True, text=True, timeout=timeout)
        self.ran.append(shlex.join(argv))
        assert not check or done.returncode == 0, f"{shlex.join(argv)} -> {done.returncode}\n{done.stdout}\n" \
                                                  f"{done.stderr}\n{self.logs()}"
        return done.stdout + done.stderr

    def until(self, argv: list[str], host: Host, shows, what: str) -> str:  # noqa: ANN001
        deadline = time.monotonic() + WAIT_S
        while True:
            out = self.run(argv, host, check=False)
            if shows(out):
                return out
            assert time.monotonic() < deadline, f"{shlex.join(argv)} never showed {what}:\n{out}\n{self.logs()}"
            time.sleep(0.5)

    def command(self, words: list[str], block: Block, host: Host, dev: Device | None) -> None:
        argv = self.expand(words, host, dev)
        prog = os.path.basename(argv[0])
        if len(argv) == 1 and "=" in argv[0] and not argv[0].startswith("-"):  # M="..."
            name, value = argv[0].split("=", 1)
            host.env[name] = value
            return
        if (prog,) in NOT_RUN or tuple([prog, *argv[1:2]]) in NOT_RUN:
            self.skipped.append(shlex.join(argv))
            return
        if prog == "cd":
            assert argv[1:] == ["edge-agent"], argv
            host.cwd = self.checkout
            return
        if prog == "install":
            args, skip = [], False
            for w in argv[1:]:
                if skip:
                    skip = False
                elif w in ("-o", "-g"):
                    skip = True
                else:
                    args.append(w)
            self.run(["install", *args], host)
        elif prog == "scp":
            *sources, target = argv[1:]
            assert dev is not None and target == f"pi@barn-{dev.n}:", target
            for src in sources:
                shutil.copy(host.cwd / src, dev.host.home)
            self.ran.append(shlex.join(argv))
        elif prog == "systemctl":
            self.systemctl(argv[1:], dev)
        elif prog == "mosquitto_pub":
            out = self.run(argv, host)
            assert "Not authorized" not in out and "rror" not in out, out  # the ACL lets the coordinator publish
        elif prog == "edge-coordinator" and argv[1] == "serve":
            log = open(self.serve_log, "ab")  # noqa: SIM115 - handed to the child
            self.serve = subprocess.Popen(argv, cwd=host.cwd, env=self.env(host), stdout=log, stderr=subprocess.STDOUT)
            log.close()
            self.ran.append(shlex.join(argv))
        elif prog == "edge-coordinator":
            self.coordinator(argv, host, dev)
        elif prog == "edge-agent" and argv[1] == "init":
            root = dev.host.root
            out = self.run([*argv, "--config", f"{root}/etc/edge-agent/agent.toml", "--state-dir",
                            f"{root}/var/lib/edge-agent", "--sysfs-root", str(self.board)], host)
            dev.id = re.search(r"device id:\s+(\S+)", out)[1]
            dev.code = re.search(r"enrolment code:\s+(\S+)", out)[1]
        elif prog == "edge-agent" and argv[1] == "run" and "--check" in argv and dev.agent is not None:
            out = self.until(argv, host, lambda o: "answered this device's hello" in o or "PROBLEM" in o,
                             "the coordinator's answer")
            assert "PROBLEM" not in out, out
        else:
            self.run(argv, host)

    def coordinator(self, argv: list[str], host: Host, dev: Device | None) -> None:
        what = argv[1]
        if what == "key":
            self.key = self.run(argv, host).strip().splitlines()[-1]
        elif what == "status" and self.devices[0].agent is None:  # step 3: has serve checked its link yet?
            out = self.until(argv, host, lambda o: "link: the broker delivers" in o or "PROBLEM" in o,
                             "serve's link check")
            assert "PROBLEM" not in out, out  # e.g. an ACL for another fleet
        elif what == "devices" and dev is not None:
            row = rf"^{dev.id} +{dev.code} +\S+ +" + ("yes +yes " if dev.approved else "PENDING ")
            self.until(argv, host, lambda o: re.search(row, o, re.M) is not None,
                       f"{dev.id} {'approved and online' if dev.approved else 'pending approval'}")
        elif what == "approve" and dev is not None:
            self.run(argv, host)
            dev.approved = True
        else:
            self.run(argv, host)

    def systemctl(self, args: list[str], dev: Device | None) -> None:
        if args == ["restart", "mosquitto"]:
            conf = self.broker_host.root / "etc" / "mosquitto"
            installed = conf / "conf.d" / "edge-agent-fleet.conf"
            text = installed.read_text().replace("/etc/mosquitto/", f"{conf}/")
            assert text.count("listener 8883\n") == 1, text
            installed.write_text(text.replace("listener 8883\n", f"listener {self.port} 127.0.0.1\n"))
            self.mosquitto = subprocess.Popen(["mosquitto", "-c", str(conf / "mosquitto.conf")],
                                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            from edge_agent.transport.broker import _port_open

            deadline = time.monotonic() + 60
            while not _port_open("127.0.0.1", self.port):
                assert self.mosquitto.poll() is None, self.mosquitto.stderr.read().decode()
                assert time.monotonic() < deadline, "mosquitto did not listen"
                time.sleep(0.05)
        elif args == ["start", "edge-agent"]:
            assert dev is not None
            unit = (REPO / "packaging/systemd/edge-agent.service").read_text()
            execstart = shlex.split(re.search(r"^ExecStart=(.*)$", unit, re.M)[1])
            argv = [str(BIN / "edge-agent"), *[self.word(w, dev.host, dev) for w in execstart[1:]]]
            log = open(self.tmp / f"agent-{dev.n}.log", "ab")  # noqa: SIM115 - handed to the child
            dev.agent = subprocess.Popen(argv, cwd=dev.host.home, env=self.env(dev.host), stdout=log,
                                         stderr=subprocess.STDOUT)
            log.close()
        else:
            raise AssertionError(f"systemctl {args}: not a command this walk knows")
        self.ran.append("systemctl " + shlex.join(args))

    def logs(self) -> str:
        parts = [f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in
                 [self.serve_log, *sorted(self.tmp.glob("agent-*.log"))] if p.exists()]
        return "\n".join(parts)

    def stop(self) -> None:
        for proc in [d.agent for d in self.devices] + [self.serve, self.mosquitto]:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)


def host_of(walk: Walk, block: Block, dev: Device | None) -> Host:
    if block.where == "workstation":
        return walk.workstation
    if block.where == "broker":
        return walk.broker_host
    assert dev is not None, f"a device block outside the per-device steps: {block.section}"
    return dev.host


def test_the_doc_is_one_fleet_everywhere() -> None:
    """The mistake of issue 35 at a glance: every --fleet, and every fleet in a topic."""
    fleets = []
    for block in read_blocks(DOC.read_text()):
        for words in block.commands:
            for i, w in enumerate(words):
                if w == "--fleet":
                    fleets.append((shlex.join(words[:3]), words[i + 1]))
                elif w.startswith("edgeft/v1/"):
                    fleets.append((shlex.join(words[:3]), w.split("/")[2]))
    assert len(fleets) >= 5 and len({f for _, f in fleets}) == 1, fleets  # acl, check, serve, init x2


def test_a_new_operator_following_the_deployment_doc_gets_two_devices_and_a_two_round_job(tmp_path: Path) -> None:
    blocks = read_blocks(DOC.read_text())
    walk = Walk(tmp_path)
    per_device = [b for b in blocks if b.section.startswith(("5.", "6.", "7."))]
    once_before = [b for b in blocks if b.section.startswith(("1.", "2.", "3."))]
    once_after = [b for b in blocks if b.section.startswith("8.")]
    not_walked = [b for b in blocks if b not in per_device + once_before + once_after]
    # step 4 (see above), and the optional local inference service (test_inference_service.py)
    assert all(b.section.startswith(("4.", "Local inference")) for b in not_walked), [b.section for b in not_walked]
    assert once_before and per_device and once_after
    try:
        for block in once_before:
            for words in block.commands:
                walk.command(words, block, host_of(walk, block, None), None)
        for dev in walk.devices:
            for block in per_device:
                for words in block.commands:
                    walk.command(words, block, host_of(walk, block, dev), dev)
        for block in once_after:
            for words in block.commands:
                walk.command(words, block, host_of(walk, block, None), None)

        from edge_agent.coordinator.records import JobStatus, RoundState
        from edge_agent.coordinator.registry import Registry

        with Registry(state_dir=walk.workstation.home / ".local/share/edge-coordinator") as reg:
            devices = {d.id: d for d in reg.list_devices()}
            assert sorted(devices) == sorted(d.id for d in walk.devices)
            assert all(d.approved and "barn" in d.tags for d in devices.values())
            (job,) = reg.list_jobs()
            assert job.status is JobStatus.DONE and job.rounds == 2, job
            rounds = reg.list_rounds(job.id)
            assert [r.state for r in rounds] == [RoundState.AGGREGATED] * 2
            assert all(sorted(r.participants) == sorted(devices) for r in rounds)
        assert not [c for c in walk.skipped if not c.startswith(("apt", "journalctl", "systemctl status"))]
        assert walk.serve is not None and walk.serve.poll() is None, walk.logs()
        walk.serve.send_signal(signal.SIGTERM)  # a clean stop: exit 0, and no ERROR in its log
        assert walk.serve.wait(60) == 0
        errors = [ln for ln in walk.serve_log.read_text().splitlines() if " ERROR " in ln[:40]]
        assert errors == [], errors
    finally:
        walk.stop()
