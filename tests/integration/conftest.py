"""Integration fixtures: a real mosquitto per test (free loopback port, generated config in
tmp_path), a unique topic prefix per test, and a small fleet (coordinator + devices) wired
the way the agent daemon and the coordinator will wire the transport."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from edge_agent import keys
from edge_agent.protocol import (
    Kind,
    Message,
    Rejection,
    ReplayWindow,
    SequenceCounter,
    Signer,
    Topics,
    TrustStore,
    Verifier,
)
from edge_agent.protocol.hello import ANSWER_PREFIX as HELLO_ANSWER
from edge_agent.transport import (
    Channel,
    MqttClient,
    Outbox,
    UpdateReceiver,
    Uploader,
    Will,
    ack_message,
)
from edge_agent.transport.broker import MosquittoBroker

FAST = {"keepalive": 5, "backoff_base": 0.05, "backoff_cap": 0.5, "connect_timeout": 2.0}


def wait_for(predicate: Callable[[], Any], timeout: float = 60.0, interval: float = 0.02) -> bool:
    """Poll `predicate` until true or `timeout` (no fixed sleeps in tests). The timeout only
    bounds a hang: never use a False result to prove that something did not happen."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


@pytest.fixture
def mosquitto(tmp_path: Path):
    broker = MosquittoBroker(workdir=tmp_path / "mosquitto")
    broker.start()
    yield broker
    broker.stop()


@pytest.fixture
def topic_prefix() -> str:
    return f"t-{uuid.uuid4().hex[:12]}/edgeft/v1"


@dataclass
class Side:
    name: str
    key: keys.Ed25519PrivateKey
    id: str
    signer: Signer
    trust: TrustStore
    verifier: Verifier
    client: MqttClient
    channel: Channel
    home: Path


class Fleet:
    """Builds a coordinator and devices on one broker; stops every client it made."""

    def __init__(self, tmp_path: Path, prefix: str) -> None:
        self.tmp, self.topics = tmp_path, Topics(fleet="farm", prefix=prefix)
        self.coord_key = keys.generate_private_key()
        self.coord_id = keys.fingerprint(self.coord_key)
        self.clients: list[MqttClient] = []
        self.threads: list[_Loop] = []

    def _side(self, name: str, key: keys.Ed25519PrivateKey, role: str, port: int, subs: list[str],
              will: Callable[[Signer], Will] | None, **client_kw: Any) -> Side:
        home = self.tmp / name
        signer = Signer(key=key, topics=self.topics, sequence=SequenceCounter(path=home / "seq"))
        trust = TrustStore()
        verifier = Verifier(topics=self.topics, trust=trust, replay=ReplayWindow(directory=home / "replay"))
        client = MqttClient(host="127.0.0.1", port=port, client_id=f"{name}-{uuid.uuid4().hex[:6]}",
                            subscriptions=subs, will=(lambda: will(signer)) if will else None,
                            **{**FAST, **client_kw})
        self.clients.append(client)
        channel = Channel(client=client, signer=signer, verifier=verifier, role=role)
        return Side(name, key, keys.fingerprint(key), signer, trust, verifier, client, channel, home)

    def coordinator(self, port: int, *, start: bool = True, **client_kw: Any) -> Side:
        side = self._side("coord", self.coord_key, "coordinator", port, self.topics.coordinator_subscriptions(),
                          None, **client_kw)
        if start:
            side.client.start()
            assert side.client.wait_connected(60)
        return side

    def device(self, port: int, *, name: str = "dev", key: keys.Ed25519PrivateKey | None = None, enrol: Side | None = None,
               start: bool = True, **client_kw: Any) -> Side:
        key = key or keys.generate_private_key()
        dev_id = keys.fingerprint(key)

        def will(signer: Signer) -> Will:
            topic = self.topics.device(dev_id, "state")
            return Will(topic, signer.control(topic, Kind.STATE, {"status": "offline"}, ttl=86400))

        side = self._side(name, key, "device", port, self.topics.device_subscriptions(dev_id), will, **client_kw)
        side.trust.add(self.coord_key.public_key(), role="coordinator")
        if enrol is not None:
            enrol.trust.add(key.public_key(), role="device")
        if start:
            side.client.start()
            assert side.client.wait_connected(60)
        return side

    def close(self) -> None:
        for loop in self.threads:
            loop.stop()
        for client in self.clients:
            client.stop()

    def loop_errors(self) -> list[str]:
        """Every exception a loop died of (or a loop that would not stop), formatted."""
        import traceback

        found = []
        for loop in self.threads:
            found += [f"{loop.name}: " + "".join(traceback.format_exception(exc)) for exc in loop.errors]
            if loop.hung:
                found.append(f"{loop.name}: still running 10 s after stop()")
        return found


@pytest.fixture
def fleet(tmp_path: Path, topic_prefix: str):
    """A Fleet; at teardown, an exception in any DeviceLoop / CoordinatorLoop / Watcher fails
    the test (a test that provokes one on purpose checks it and clears `loop.errors`)."""
    f = Fleet(tmp_path, topic_prefix)
    yield f
    f.close()
    errors = f.loop_errors()
    if errors:
        pytest.fail("a test loop failed:\n" + "\n".join(errors), pytrace=False)


class _Loop:
    """A thread running `step()` until stopped. An exception ends it and is kept in `errors`,
    which the `fleet` fixture turns into a test failure at teardown."""

    def __init__(self, fleet: Fleet, name: str) -> None:
        self.name = name
        self._stop = threading.Event()
        self.errors: list[BaseException] = []
        self.hung = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        fleet.threads.append(self)

    def start(self) -> _Loop:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except BaseException as exc:  # the fleet fixture fails the test with it
                self.errors.append(exc)
                return

    def step(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(10)
            self.hung = self._thread.is_alive()


class DeviceLoop(_Loop):
    """What the agent daemon will do: apply acks, refuse bad commands, pump the outbox."""

    def __init__(self, fleet: Fleet, side: Side, outbox: Outbox, *, max_chunks: int | None = None,
                 pause: float = 0.0, chunk_budget: int | None = None, **uploader_kw: Any) -> None:
        """`chunk_budget`: send that many update chunks, then hold until `release()`, so a
        test can restart something at an exact point of an upload on any machine."""
        super().__init__(fleet, f"device-{side.id}")
        self.side, self.outbox, self.max_chunks, self.pause = side, outbox, max_chunks, pause
        self._budget, self._budget_lock = chunk_budget, threading.Lock()
        kw = {"ack_timeout": 1.0, "publish_timeout": 2.0, "retry_base": 0.2, "retry_cap": 1.0, **uploader_kw}
        self.uploader = Uploader(client=side.client, outbox=outbox, signer=side.signer, topics=fleet.topics, **kw)
        self.commands: list[Message] = []
        self.hello_answers: list[Message] = []  # serve's answers to a hello (protocol/hello.py): not commands
        self.rejections: list[Rejection] = []
        self.ack_results: list[str] = []
        self.acks: list[Message] = []

    def step(self) -> None:
        result = self.side.channel.receive(timeout=0.02)
        if isinstance(result, Rejection):
            self.rejections.append(result)
            self.side.channel.reply_to(result)
        elif isinstance(result, Message):
            if result.kind is Kind.ACK:
                self.acks.append(result)
                self.ack_results.append(self.uploader.handle_ack(result))
            elif result.kind is Kind.CMD and result.body["cmd_id"].startswith(HELLO_ANSWER):
                self.hello_answers.append(result)
            elif result.kind is Kind.CMD:
                self.commands.append(result)
        self._pump()
        if self.pause:
            time.sleep(self.pause)

    def release(self, chunks: int | None = None) -> None:
        """Let the loop send `chunks` more update chunks (None: no limit any more)."""
        with self._budget_lock:
            self._budget = chunks

    def _pump(self) -> None:
        with self._budget_lock:
            budget = self._budget
        limits = [n for n in (budget, self.max_chunks) if n is not None]
        limit = min(limits) if limits else None
        if limit == 0:
            return
        sent = self.uploader.pump(max_chunks=limit)
        with self._budget_lock:
            if self._budget is not None:
                self._budget = max(0, self._budget - sent)


@dataclass
class CoordinatorLog:
    completed: list[Any] = field(default_factory=list)
    duplicates: int = 0
    rejections: list[Rejection] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)


class CoordinatorLoop(_Loop):
    """What the coordinator will do: reassemble updates once, ack them, answer bad chunks."""

    def __init__(self, fleet: Fleet, side: Side, **receiver_kw: Any) -> None:
        super().__init__(fleet, "coordinator")
        self.side, self.topics = side, fleet.topics
        self.receiver = UpdateReceiver(ack_interval=0.2, **receiver_kw)
        self.log = CoordinatorLog()
        self.chunks_seen = 0

    def step(self) -> None:
        result = self.side.channel.receive(timeout=0.05)
        if isinstance(result, Rejection):
            self.log.rejections.append(result)
            self.side.channel.reply_to(result)
        elif isinstance(result, Message):
            if result.kind is not Kind.UPDATE_CHUNK:
                self.log.messages.append(result)
                return
            self.chunks_seen += 1
            got = self.receiver.add(result)
            if got.status == "complete":
                self.log.completed.append(got.update)
            elif got.status == "duplicate":
                self.log.duplicates += 1
            if got.ack_due:
                status = "accepted" if got.status == "complete" else "duplicate"
                topic, payload = ack_message(self.side.signer, self.topics, got.key, got.upload, status)
                self.side.client.publish_wait(topic, payload, timeout=2.0)


def update_sentinel(fleet: Fleet, sender: Side, loop: CoordinatorLoop, timeout: float = 60.0) -> None:
    """Publish junk on `sender`'s update topic and wait until `loop` has judged it. One
    client's messages stay in order, so by then the loop has handled everything `sender`
    published before: proof that nothing more (a late duplicate) is on its way."""
    import hashlib

    payload = f"sentinel {uuid.uuid4().hex}".encode()
    digest = hashlib.sha256(payload).hexdigest()
    assert sender.client.publish_wait(fleet.topics.device(sender.id, "update"), payload, timeout=60)
    assert wait_for(lambda: any(r.sha256 == digest for r in list(loop.log.rejections)), timeout), \
        "the sentinel never reached the coordinator loop"


# ---------------------------------------------------------------- the agent daemon as a process
BOARDS = Path(__file__).resolve().parents[1] / "fixtures" / "boards"
REPO = Path(__file__).resolve().parents[2]


def board_tree(dest: Path, *, battery_pct: int | None = 80, board: str = "raspberry-pi-4") -> Path:
    """A copy of a captured board tree, plus a battery gauge the test can drain or charge."""
    import shutil

    shutil.copytree(BOARDS / board, dest)
    if battery_pct is not None:
        set_battery(dest, battery_pct)
    return dest


def set_battery(root: Path, pct: int, status: str = "Discharging") -> None:
    bat = root / "sys" / "class" / "power_supply" / "battery"
    bat.mkdir(parents=True, exist_ok=True)
    for name, value in (("type", "Battery"), ("status", status), ("capacity", str(pct))):
        (bat / name).write_text(value + "\n")


class AgentProcess:
    """`python -m edge_agent.agent.cli run` as a real process with its own key, config and state."""

    def __init__(self, fleet: Fleet, tmp: Path, port: int, *, sysfs_root: Path, data_dir: Path | None = None,
                 extra_toml: str = "", env: dict[str, str] | None = None, name: str = "agent") -> None:
        from edge_agent.config import public_key_text, render_config

        self.home = tmp / name
        self.state_dir = self.home / "state"
        self.key = keys.generate_private_key()
        self.id = keys.fingerprint(self.key)
        keys.save_private_key(self.state_dir / "keys" / "device.key", self.key)
        text = render_config(device_name=name, fleet=fleet.topics.fleet, broker_host="127.0.0.1", broker_port=port,
                             coordinator_public_key=public_key_text(fleet.coord_key), state_dir=self.state_dir,
                             device_id=self.id, sysfs_root=str(sysfs_root),
                             data_dir=str(data_dir) if data_dir else None, topic_prefix=fleet.topics.prefix)
        text = text.replace("port = ", "keepalive_s = 5\nreconnect_min_s = 0.05\nreconnect_max_s = 0.5\nport = ", 1)
        text += ("\n[service]\nstate_interval_s = 1\nprogress_interval_s = 1\nupload_ack_timeout_s = 2\n"
                 "upload_retry_min_s = 0.2\n"
                 "upload_retry_max_s = 1\n" + extra_toml)
        self.config = self.home / "agent.toml"
        self.config.write_text(text)
        self.env = {**__import__("os").environ, "EDGE_AGENT_TEST_HOOKS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        self.log_path = self.home / "agent.log"
        self.proc: Any = None
        self.topics = fleet.topics

    def topic(self, channel: str) -> str:
        return self.topics.device(self.id, channel)

    def start(self) -> AgentProcess:
        import subprocess
        import sys

        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen([sys.executable, "-m", "edge_agent.agent.cli", "run", "--config", str(self.config)],
                                     stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=REPO)
        log.close()
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> None:
        import signal

        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def terminate(self, timeout: float = 60.0) -> int:
        import signal

        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def log_tail(self, n: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.alive:
            try:
                self.terminate(30)
            except Exception:
                self.proc.kill()
                self.proc.wait(10)


class Watcher(CoordinatorLoop):
    """The coordinator's view of one agent: every verified message kept, updates acked."""

    def by_phase(self, phase: str) -> list[Message]:
        return [m for m in list(self.log.messages) if m.kind is Kind.PROGRESS and m.body["phase"] == phase]

    def refusals(self) -> list[Message]:
        return [m for m in list(self.log.messages) if m.kind is Kind.REFUSAL]

    def states(self) -> list[Message]:
        return [m for m in list(self.log.messages) if m.kind is Kind.STATE]

    def command(self, agent: AgentProcess, body: dict[str, Any], *, ttl: float = 600) -> bytes:
        topic = agent.topic("cmd")
        payload = self.side.signer.control(topic, Kind.CMD, body, ttl=ttl)
        assert self.side.client.publish_wait(topic, payload, timeout=60)
        return payload


@pytest.fixture
def agents(fleet: Fleet):
    made: list[AgentProcess] = []

    def make(*args: Any, **kw: Any) -> AgentProcess:
        agent = AgentProcess(fleet, *args, **kw)
        made.append(agent)
        return agent

    yield make
    for agent in made:
        agent.stop()


def enrol(watcher: Watcher, agent: AgentProcess) -> None:
    watcher.side.trust.add(agent.key.public_key(), role="device")


def online_agent(make_agent: Callable[..., AgentProcess], fleet: Fleet, coord: Side, tmp: Path, port: int, *,
                 data_dir: Path | None = None, battery_pct: int = 80,
                 **kw: Any) -> tuple[AgentProcess, Watcher]:
    """A started, enrolled agent (no data unless `data_dir`) that has published its state,
    and the watcher that sees it; `kw` goes to AgentProcess (e.g. env)."""
    if data_dir is None:
        data_dir = tmp / "data"
        data_dir.mkdir()
    agent = make_agent(tmp, port, sysfs_root=board_tree(tmp / "board", battery_pct=battery_pct),
                       data_dir=data_dir, **kw)
    watcher = Watcher(fleet, coord)
    enrol(watcher, agent)
    watcher.start()
    agent.start()
    assert wait_for(lambda: watcher.states(), 60), agent.log_tail()
    return agent, watcher


@pytest.fixture(scope="session")
def digits_bundle(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes]:
    """The demo's digits bundle (built once per session; MXNet runs in this test process,
    never in the agent daemon) and its archive bytes as the coordinator publishes them."""
    from edge_agent.int8.bundle import pack_bundle
    from edge_agent.sim import scenario as demo

    bundle = demo.ensure_bundle(tmp_path_factory.getbasetemp() / "digits-bundle")
    archive = pack_bundle(bundle, tmp_path_factory.mktemp("archive") / "digits.tar.gz")
    return bundle, archive.read_bytes()


def device_data(dest: Path, device: int = 2) -> Path:
    """One simulated device's own digits (through its camera) as an NPZ, as `--data` reads."""
    from edge_agent.sim import scenario as demo

    dev = demo.scenario().devices[device]
    return demo.write_data(dest, dev.images, dev.labels, "npz")


def child_pids(marker: str) -> list[int]:
    """Live `edge_agent.agent.child` processes whose command line mentions `marker`."""
    import os

    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if "edge_agent.agent.child" in cmd and marker in cmd and ") Z " not in stat:
            found.append(int(entry))
    return found


# ---------------------------------------------------------------- the coordinator service as a process
class ServeProcess:
    """`edge-coordinator serve` as a real process, with the fleet's coordinator key and a
    fast tick; `cli(...)` runs other edge-coordinator commands on the same state dir."""

    def __init__(self, fleet: Fleet, tmp: Path, port: int, *, auto_approve: bool = True, embedded: bool = False,
                 extra: tuple[str, ...] = ()) -> None:
        import sys

        self.state_dir = tmp / "coordinator"
        (self.state_dir / "keys").mkdir(parents=True, exist_ok=True, mode=0o700)
        keys.save_private_key(self.state_dir / "keys" / "coordinator.key", fleet.coord_key)
        self.port = port
        self.cli_argv = [sys.executable, "-m", "edge_agent.coordinator.cli"]
        self.argv = [*self.cli_argv, "serve", "--broker", f"127.0.0.1:{port}", "--fleet", fleet.topics.fleet,
                     "--topic-prefix", fleet.topics.prefix, "--state-dir", str(self.state_dir), "--tick", "0.3",
                     "--ack-interval", "0.5", *(["--auto-approve"] if auto_approve else []),
                     *(["--embedded-broker"] if embedded else []), *extra]
        self.log_path = tmp / "coordinator.log"
        self.proc: Any = None

    def start(self, *, wait: bool = True) -> ServeProcess:
        import subprocess

        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        env = {**__import__("os").environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        log.close()
        if wait:
            assert wait_for(self.connected, 120), self.log_tail()
        return self

    def connected(self) -> bool:
        from edge_agent.coordinator.service_files import read_serve_file, serving

        info = read_serve_file(self.state_dir)
        return bool(self.alive and info and serving(info) and info.get("connected") and info.get("pid") == self.proc.pid)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> None:
        import signal

        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> int | None:
        import signal
        import subprocess

        if not self.alive:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)

    def cli(self, *args: str, check: bool = True, timeout: float = 300) -> Any:
        import subprocess

        done = subprocess.run([*self.cli_argv, *args, "--state-dir", str(self.state_dir)], capture_output=True,
                              text=True, timeout=timeout, cwd=REPO, check=False)
        if check:
            assert done.returncode == 0, f"{args}: {done.returncode}\n{done.stdout}\n{done.stderr}"
        return done

    def registry(self) -> Any:
        from edge_agent.coordinator.registry import Registry

        return Registry(state_dir=self.state_dir)

    def log_tail(self, n: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.exists() else ""


@pytest.fixture
def serve(fleet: Fleet, tmp_path: Path):
    made: list[ServeProcess] = []

    def make(port: int, **kw: Any) -> ServeProcess:
        proc = ServeProcess(fleet, tmp_path, port, **kw)
        made.append(proc)
        return proc

    yield make
    for proc in made:
        proc.stop()


def register_digits(coordinator: ServeProcess, archive: bytes, tmp: Path, *, version: str = "1") -> None:
    path = tmp / f"digits-{version}.tar.gz"
    path.write_bytes(archive)
    coordinator.cli("model", "register", str(path), "--name", "digits", "--version", version)


def online_devices(coordinator: ServeProcess) -> list[str]:
    with coordinator.registry() as reg:
        now = time.time()
        return [d.id for d in reg.list_devices() if d.approved and d.is_online(now, 300) and d.battery_pct is not None]


def announce(fleet: Fleet, side: Side, *, battery: int = 90, name: str = "fake") -> None:
    """What an agent says on (re)connecting: a self-signed hello and a retained state."""
    from edge_agent.config import public_key_text

    hello = {"public_key": public_key_text(side.key), "agent": "test",
             "info": {"name": name, "board": "Test Board", "profile": "raspberry-pi-4"}}
    assert side.channel.send(fleet.topics.device(side.id, "hello"), Kind.HELLO, hello, ttl=86400, retain=True)
    state = {"status": "idle", "agent": "test",
             "detail": f"status=idle battery_pct={battery} on_power=false energy_wh=5 name={name}"}
    assert side.channel.send(fleet.topics.device(side.id, "state"), Kind.STATE, state, ttl=86400, retain=True)


def fake_update(reg: Any, side: Side, cmd: Message, *, chunk_size: int = 128, scale: float = 0.01) -> list[bytes]:
    """An uncompressed update for the model a `finetune` command names (random delta)."""
    import numpy as np

    from edge_agent.updates import UNCOMPRESSED, UpdateEncoder

    b = cmd.body
    head = reg.load_head(reg.get_model(b["model"], b["version"]))
    rng = np.random.default_rng(len(side.id))
    delta = {n: (rng.standard_normal(a.shape) * scale).astype(np.float32) for n, a in head.items()}
    encoder = UpdateEncoder(model_name=b["model"], device_id=side.id, policy=UNCOMPRESSED, chunk_size=chunk_size)
    return encoder.encode(delta, job_id=b["job"], round=b["round"], model_version=b["version"]).chunks()
