"""A coordinator under a simulated fleet: a real mosquitto, a real `edge-coordinator serve`
process, and N `SimDevice`s (devices.py) in this process; one job of one round, measured.

    run_load(LoadConfig(devices=1000, params="1m", aggregator="trimmed_mean"), workdir)

Steps: a synthetic bundle whose head has the asked size (the digits bundle's backbone, a
dense head of classes x 1000 features: 100,100 or 1,001,000 parameters) is registered with
`model register`; `serve --auto-approve` starts (its state dir under `workdir`); the devices
connect (hello, state) until the registry shows them all approved and online; `train
--detach` queues one round over all of them; the registry (read-only, through `Registry`:
SQLite or PostgreSQL, whichever serve runs on) then says when it closed. Figures: time to
connect all; updates/s ingested (accepted updates over the span from the first to the last
received_at); the time from the last update to the round's commit (the new version's created_at
and the round's ended_at are both stamped at the commit) and to the new version's manifest
arriving at a subscriber on the broker (what a device sees: the close's real end);
serve's peak RSS (VmHWM); bytes the round added under the state dir; the compressed bytes
received (the updates' wire_bytes).

The broker is started with `max_queued_messages 0` (no per-client cap): mosquitto's default
1,000 would drop QoS 1 chunks queued for a coordinator that is behind a round's burst (each
device would resend after its ack timeout). File descriptor limits are raised to the hard
limit for this process and, inherited, for the broker and serve.

The registry: `run_load(..., db=URL)`, else $EDGE_COORDINATOR_DB, else SQLite; serve and the
CLI get it as $EDGE_COORDINATOR_DB (not `--db`: a URL's password would show in `ps`).
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..coordinator.db import DB_ENV, resolve
from ..coordinator.records import RoundRecord, RoundState
from ..coordinator.registry import Registry
from ..transport.broker import MosquittoBroker
from .devices import SimFleet, SimOptions, UpdatePool

HEADS = {"100k": (100, 1000), "1m": (1000, 1000)}  # (classes, features): 100,100 / 1,001,000 parameters
REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, kw_only=True)
class LoadConfig:
    devices: int = 100
    params: str = "100k"  # a HEADS key
    aggregator: str = "fedavg_clipped"
    dropout: float = 0.05
    slow_share: float = 0.05
    slow_delay_s: float = 0.5
    non_iid: int = 4  # clusters of update directions (1: IID)
    density: float = 0.02
    bits: int = 8
    threads: int = 1
    connect_rate: float = 500.0
    train_s: float = 2.0  # simulated training: uniform in [0, train_s]
    deadline_s: float = 900.0
    tick_s: float = 0.5
    nice: int = 0  # niceness of broker and serve (benchmarks on a shared machine)
    timeout_s: float = 1800.0
    state_interval_s: float = 60.0  # the simulated devices' periodic state (the agent's default)
    profile_serve: bool = False  # serve under cProfile: <workdir>/serve.prof (written when serve stops)
    # Devices the coordinator already knows: enrolled and approved in its registry before serve
    # starts (as after a coordinator restart, or `approve` after a first hello): their hellos
    # then cost serve no trust-store reload (a fresh enrolment does: see docs/fleet.md)
    pre_enrol: bool = False
    # At most this many devices connected and not yet online in the registry (0: no gate,
    # only `connect_rate`): new connections wait for serve, so its inbox never overflows
    connect_backlog: int = 0
    # every this many s of the round, serve dumps its threads' stacks into its log (SIGUSR1,
    # faulthandler): where its loop spends the round, counted in `serve_stacks` (0: never)
    stack_every_s: float = 0.0
    # serve processes: 1, or a workers group of N on PostgreSQL (`serve --workers-group`), which
    # share the devices' messages through MQTT shared subscriptions and the close's work
    # through their saved partials (coordinator/partials.py)
    workers: int = 1


# serve with a SIGUSR1 handler that prints the main thread's stack (faulthandler's format, which
# stack_counts reads). A Python handler, not faulthandler.register(all_threads=True): that one
# walks other threads' frames from inside the signal and can crash the process when a thread
# starts or exits meanwhile (CPython gh-116008, 3.11); a 10,000-device run's serve died of
# SIGSEGV with it. A Python handler runs in the main thread between bytecodes, so a sample
# taken during a blocking C call (a commit, a socket wait) lands on the line that made it.
_STACK_SAMPLER = """
import runpy, signal, sys, threading
def _sample(signum, frame):
    lines = ["Current thread 0x%016x (most recent call first):" % threading.get_ident()]
    while frame is not None:
        lines.append('  File "%s", line %d in %s' % (frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    sys.stderr.write("\\n".join(lines) + "\\n\\n")
    sys.stderr.flush()
signal.signal(signal.SIGUSR1, _sample)
runpy.run_module("edge_agent.coordinator.cli", run_name="__main__", alter_sys=True)
"""


class LoadFailed(RuntimeError):
    """A run that did not finish its round; `partial` holds the figures it got so far (the
    phases, the simulated fleet's counts, serve's log counts, the round's rows if it opened)."""

    def __init__(self, why: str, partial: dict[str, Any]) -> None:
        super().__init__(why)
        self.partial = partial


class LoadBroker(MosquittoBroker):
    """mosquitto for a load test: no connection cap, no per-client queue cap."""

    def config_text(self) -> str:
        extra = ["max_connections -1", "max_queued_messages 0", "max_inflight_messages 100",
                 "connection_messages false"]
        text = super().config_text().replace("connection_messages true\n", "")
        head, _, listener = text.rpartition("listener ")
        return head + "\n".join(extra) + "\nlistener " + listener


def raise_fd_limit() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def wide_head_bundle(base: Path, dest: Path, *, classes: int, features: int) -> tuple[Path, list[str]]:
    """`base` (a head-only bundle with one dense layer) with a classes x features head; the
    backbone is kept as is (simulated devices never run it). Returns (directory, labels)."""
    import re

    from ..int8 import bundle as B
    from ..mxparams import dump_params, load_params

    b = B.load_bundle(base)
    files = {f: b.read(f) for f in b.manifest.files}
    head = load_params(files[B.HEAD_PARAMS])
    wname = next(k for k, v in head.items() if v.ndim == 2)
    bname = next(k for k, v in head.items() if v.ndim == 1)
    rng = np.random.default_rng(0)
    files[B.HEAD_PARAMS] = dump_params({wname: (rng.normal(size=(classes, features)) * 0.05).astype(np.float32),
                                        bname: np.zeros(classes, np.float32)})
    sym = files[B.HEAD_SYMBOL].decode()
    sym = re.sub(r'"__shape__": "\(\d+, \d+\)"', f'"__shape__": "({classes}, {features})"', sym)
    sym = re.sub(r'"__shape__": "\(\d+,\)"', f'"__shape__": "({classes},)"', sym)
    files[B.HEAD_SYMBOL] = sym.encode()
    m = b.manifest
    m.labels = [f"c{i}" for i in range(classes)]
    m.feature_shape = (features, 1, 1)
    m.name, m.version = "simhead", "1"
    B.write_bundle_dir(dest, files, m, overwrite=True)
    return dest, m.labels


def _du(path: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(path):
        for n in names:
            try:
                total += os.lstat(os.path.join(dirpath, n)).st_size
            except OSError:
                pass
    return total


CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (its threads included)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime (fields 14 and 15)


def _hwm_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024.0
    return float("nan")


class LoadRun:
    """The broker, serve and the simulated fleet of one run; `close()` stops all three."""

    def __init__(self, cfg: LoadConfig, workdir: Path, *, db: str | None = None) -> None:
        """`db`: the registry (Registry's `db`: a postgresql:// URL, "sqlite", or None for
        $EDGE_COORDINATOR_DB), resolved once so that serve, the CLI and the reads here agree."""
        self.cfg, self.workdir = cfg, Path(workdir)
        self.db = resolve(db)
        self.dialect = "sqlite" if self.db is None else "postgresql"
        # children read the registry from here ("" is SQLite even if this process's env says otherwise)
        self.env = {**os.environ, DB_ENV: self.db or "", "PYTHONUNBUFFERED": "1"}
        self._reader: Registry | None = None
        self.state = self.workdir / "coordinator"
        self.cli = [sys.executable, "-m", "edge_agent.coordinator.cli"]
        self.broker: LoadBroker | None = None
        self.serve: subprocess.Popen[bytes] | None = None  # the first (or only) serve
        self.serves: list[subprocess.Popen[bytes]] = []
        self.watcher: Any = None  # an MQTT subscriber to the model's manifests: when a version is out
        self.manifests: dict[str, float] = {}  # manifest topic -> when it first arrived (time.time())
        self.fleet: SimFleet | None = None
        self.prefix = f"load{os.getpid()}/edgeft/v1"
        self.partial: dict[str, Any] = {}  # measure()'s figures as they come
        self.job: str | None = None
        self.mark: tuple[float, dict[str, float]] | None = None  # the last phase's end

    def _pre(self) -> Any:
        nice = self.cfg.nice
        return (lambda: os.nice(nice)) if nice else None

    def run_cli(self, *args: str) -> str:
        done = subprocess.run([*self.cli, *args, "--state-dir", str(self.state)], capture_output=True, text=True,
                              cwd=REPO, env=self.env, timeout=600, check=False)
        if done.returncode:
            raise RuntimeError(f"edge-coordinator {' '.join(args[:3])} exited {done.returncode}: {done.stderr[-1500:]}")
        return done.stdout

    def start(self, base_bundle: Path) -> None:
        from .. import keys
        from ..int8.bundle import pack_bundle

        cfg = self.cfg
        raise_fd_limit()
        classes, features = HEADS[cfg.params]
        bundle, self.labels = wide_head_bundle(base_bundle, self.workdir / f"bundle-{cfg.params}", classes=classes,
                                               features=features)
        archive = pack_bundle(bundle, self.workdir / f"simhead-{cfg.params}.tar.gz")
        self.broker = LoadBroker(workdir=self.workdir / "mosquitto")
        self.broker.start()
        if cfg.nice:
            os.setpriority(os.PRIO_PROCESS, self.broker._proc.pid, cfg.nice)  # type: ignore[union-attr]
        key = keys.generate_private_key()
        (self.state / "keys").mkdir(parents=True, exist_ok=True, mode=0o700)
        keys.save_private_key(self.state / "keys" / "coordinator.key", key)
        self.run_cli("model", "register", str(archive), "--name", "simhead", "--version", "1")
        names = self._head_names()  # the pool's tensors are the registered head's
        pool = UpdatePool({names["w"]: np.zeros((classes, features), np.float32),
                           names["b"]: np.zeros(classes, np.float32)},
                          density=cfg.density, bits=cfg.bits, clusters=cfg.non_iid)
        opts = SimOptions(port=self.broker.port, fleet="sim", prefix=self.prefix, dropout=cfg.dropout,
                          slow_share=cfg.slow_share, slow_delay_s=cfg.slow_delay_s, train_s=(0.0, cfg.train_s),
                          state_interval_s=cfg.state_interval_s)
        self.fleet = SimFleet(options=opts, count=cfg.devices, pool=pool, coordinator_key=key.public_key(),
                              threads=cfg.threads, labels=self.labels)
        self.fleet.build()
        if cfg.pre_enrol:
            t0 = time.monotonic()
            self.pre_enrol()
            self.pre_enrol_s = time.monotonic() - t0
        if cfg.profile_serve:
            prof = [sys.executable, "-m", "cProfile", "-o", str(self.workdir / "serve.prof"), "-m",
                    "edge_agent.coordinator.cli"]
        elif cfg.stack_every_s:
            prof = [sys.executable, "-c", _STACK_SAMPLER]
        else:
            prof = self.cli
        if cfg.workers > 1 and self.db is None:
            raise RuntimeError("a workers group needs a PostgreSQL registry (db=postgresql://...)")
        for i in range(cfg.workers):
            group = ["--workers-group", "load", "--worker-id", f"w{i}"] if cfg.workers > 1 else []
            log = open(self.workdir / ("coordinator.log" if i == 0 else f"coordinator-{i}.log"), "ab")  # noqa: SIM115
            self.serves.append(subprocess.Popen(
                [*prof, "serve", "--broker", f"127.0.0.1:{self.broker.port}", "--fleet", "sim", "--topic-prefix",
                 self.prefix, "--state-dir", str(self.state), "--tick", str(cfg.tick_s), "--auto-approve",
                 "--aggregator", cfg.aggregator, *group], stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                env=self.env, preexec_fn=self._pre()))  # noqa: PLW1509
            log.close()
        self.serve = self.serves[0]
        self._wait(self._serving, 120, "serve did not connect to the broker")
        self._watch_manifests()

    def _watch_manifests(self) -> None:
        """Subscribe to the model's manifests, as a device would: the arrival of a new version's
        is when the round's result is out."""
        import paho.mqtt.client as mqtt

        from ..protocol import Topics

        assert self.broker is not None
        topic = f"{Topics(fleet='sim', prefix=self.prefix).root}/models/simhead/+/manifest"
        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"load-watch-{os.getpid()}")

        def on_message(_c: Any, _u: Any, msg: Any) -> None:
            self.manifests.setdefault(msg.topic, time.time())

        client.on_message = on_message
        client.on_connect = lambda c, *_: c.subscribe(topic, qos=1)
        client.connect("127.0.0.1", self.broker.port)
        client.loop_start()
        self.watcher = client

    def pre_enrol(self) -> None:
        """Enrol and approve every simulated device in the registry (serve not running yet)."""
        from ..config import public_key_text

        assert self.fleet is not None
        with Registry(state_dir=self.state, db=self.db or "sqlite") as reg:
            for dev in self.fleet.devices:
                reg.enrol_device(device_id=dev.id, public_key=public_key_text(dev.key), fleet="sim",
                                 board="simulated", profile="sim", approved=True)

    def _head_names(self) -> dict[str, str]:
        with Registry(state_dir=self.state, read_only=True, db=self.db or "sqlite") as reg:
            head = reg.load_head(reg.get_model("simhead", "1"))
        return {"w": next(k for k, v in head.items() if v.ndim == 2), "b": next(k for k, v in head.items() if v.ndim == 1)}

    def _serving(self) -> bool:
        from ..coordinator.service_files import read_serve_file, serving

        self._check()
        info = read_serve_file(self.state)
        return bool(info and serving(info) and info.get("connected"))

    def _check(self) -> None:
        for i, serve in enumerate(self.serves):
            if serve.poll() is not None:
                log = self.workdir / ("coordinator.log" if i == 0 else f"coordinator-{i}.log")
                tail = log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"serve {i} exited {serve.returncode}:\n{tail}")

    def _wait(self, pred: Any, timeout: float, what: str, interval: float = 0.5) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            if time.monotonic() > deadline:
                raise RuntimeError(what)
            time.sleep(interval)

    def _registry(self) -> Registry:
        """One read-only Registry for the run's polls (opened once serve's registry exists). It
        never migrates or takes the write lock (SQLite: a `mode=ro` WAL reader; PostgreSQL: READ
        ONLY snapshots), and each read is a short snapshot, so serve's writes never wait for it."""
        if self._reader is None:
            self._reader = Registry(state_dir=self.state, read_only=True, db=self.db or "sqlite")
        return self._reader

    def online(self) -> int:
        """Devices approved, online and with a state recorded (a battery level: the state's)."""
        reg = self._registry()
        battery = ("(state::jsonb ->> 'battery_pct')" if reg.dialect == "postgresql"
                   else "json_extract(state, '$.battery_pct')")
        # one COUNT per poll (10,000 devices every second): Registry has no counting method for
        # this, so the query runs in its read snapshot, through its dialect layer
        with reg.db.read() as db:
            return int(db.execute("SELECT COUNT(*) FROM devices WHERE approved = 1 AND online = 1 AND "
                                  f"{battery} IS NOT NULL").fetchone()[0])

    def _connect_all(self) -> None:
        """Start every device's connection: at `connect_rate`, and with `connect_backlog` never
        more than that many connected and not yet online in the registry."""
        assert self.fleet is not None
        cfg, fleet = self.cfg, self.fleet
        if not cfg.connect_backlog:
            fleet.start(connect_rate=cfg.connect_rate)
            return
        fleet.start_hubs()
        started, step = 0, 0.2
        while started < cfg.devices:
            self._check()
            room = cfg.connect_backlog - (started - self.online())
            batch = max(0, min(room, max(1, int(cfg.connect_rate * step)), cfg.devices - started))
            fleet.connect(range(started, started + batch))
            started += batch
            time.sleep(step)

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far of serve, the broker and this process (the simulated fleet)."""
        assert self.serve is not None and self.broker is not None
        own = os.times()
        return {"serve": sum(cpu_s(p.pid) for p in self.serves),
                "broker": cpu_s(self.broker._proc.pid),  # type: ignore[union-attr]
                "sim": own.user + own.system}

    def _phase(self, out: dict[str, Any], name: str, since: tuple[float, dict[str, float]]) -> tuple[float, dict[str, float]]:
        """Record phase `name`'s wall time and each process's CPU share of one core over it."""
        now, cpu = time.monotonic(), self.cpu()
        wall = now - since[0]
        out.setdefault("phases", {})[name] = {"wall_s": round(wall, 2), **{
            f"{k}_cpu": round((cpu[k] - since[1][k]) / wall, 3) if wall > 0 else float("nan") for k in cpu}}
        self.mark = (now, cpu)
        return now, cpu

    def measure(self) -> dict[str, Any]:
        """Connect the fleet, run one round, return the figures."""
        assert self.fleet is not None and self.serve is not None
        cfg = self.cfg
        out: dict[str, Any] = self.partial
        if cfg.pre_enrol:
            out["pre_enrol_s"] = round(self.pre_enrol_s, 1)
        t0 = time.monotonic()
        mark = self.mark = (t0, self.cpu())
        self._connect_all()
        self._wait(lambda: sum(d.stats.connected_at is not None for d in self.fleet.devices) >= cfg.devices,  # type: ignore[union-attr]
                   cfg.timeout_s, "not every simulated device connected", 0.2)
        out["connect_s"] = time.monotonic() - t0
        mark = self._phase(out, "connect", mark)
        curve: list[tuple[float, int]] = []
        out["online_curve"] = curve  # (s since the start, devices online in the registry), every ~10 s

        def all_online() -> bool:
            self._check()
            n, t = self.online(), time.monotonic() - t0
            if not curve or t - curve[-1][0] >= 10.0 or n >= cfg.devices:
                curve.append((round(t, 1), n))
            return n >= cfg.devices

        self._wait(all_online, cfg.timeout_s, "the coordinator did not see every device online", 1.0)
        out["online_s"] = time.monotonic() - t0
        mark = self._phase(out, "enrol", mark)
        disk0 = _du(self.state)
        text = self.run_cli("train", "--model", "simhead", "--devices", "all", "--rounds", "1", "--min-devices",
                            str(max(1, sum(not d.drops for d in self.fleet.devices))), "--deadline", f"{int(cfg.deadline_s)}s", "--aggregator", cfg.aggregator,
                            "--detach")
        job = self.job = text.split()[1].rstrip(":")
        t1 = time.monotonic()
        next_stack = [t1 + cfg.stack_every_s]

        def over() -> bool:
            self._check()
            if cfg.stack_every_s and time.monotonic() >= next_stack[0]:
                next_stack[0] += cfg.stack_every_s
                self.serve.send_signal(signal.SIGUSR1)  # type: ignore[union-attr]
            return self._round_over(job)

        self._wait(over, cfg.timeout_s, f"round of job {job} did not end")
        out["round_wall_s"] = time.monotonic() - t1
        self._phase(out, "round", mark)
        out["rss_mb"] = max(_hwm_mb(p.pid) for p in self.serves)
        time.sleep(1.0)  # the new version's files and the WAL settle
        out["disk_mb"] = (_du(self.state) - disk0) / 1e6
        out.update(self._round_figures(job))
        out["sim"] = self.fleet.summary()
        out["serve_log"] = self.log_counts()
        out["serve_stacks"] = self.stack_counts()
        out["config"] = asdict(cfg)
        return out

    def stack_counts(self) -> dict[str, int]:
        """The main thread's innermost coordinator frame in each faulthandler dump (serve's log)."""
        import re

        counts: dict[str, int] = {}
        try:
            text = (self.workdir / "coordinator.log").read_text(errors="replace")
        except OSError:
            return counts
        # faulthandler prints the current thread first, innermost frame first: the main thread
        # is the one running cli.py
        for block in re.split(r"\n(?=(?:Current thread|Thread) 0x)", text):
            frames = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', block)
            if not any(f.endswith("coordinator/cli.py") for f, _, _ in frames):
                continue
            inner = next(((f, n, fn) for f, n, fn in frames if "/edge_agent/coordinator/" in f or
                          "/edge_agent/transport/" in f or "/edge_agent/protocol/" in f), None)
            if inner is not None:
                key = f"{inner[0].split('/edge_agent/', 1)[1]}:{inner[1]} {inner[2]}"
                counts[key] = counts.get(key, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: -kv[1]))

    def log_counts(self) -> dict[str, Any]:
        """What serve's log says about lost work: the MQTT client's drop summaries (one line per
        10 s: "dropped N received messages ...: n why, n why"), loop errors, commands sent."""
        import re

        drops: dict[str, int] = {}
        counts: dict[str, Any] = {"dropped": 0, "dropped_by": drops, "loop_errors": 0, "finetune_sent": 0}
        try:
            text = (self.workdir / "coordinator.log").read_text(errors="replace")
        except OSError:
            return counts
        for line in text.splitlines():
            m = re.search(r"dropped (\d+) received messages[^:]*: (.*)$", line)
            if m:
                counts["dropped"] += int(m[1])
                for n, why in re.findall(r"(\d+) (.+?)(?=, \d+ |$)", m[2]):
                    why = re.sub(r"device \w+", "device *", why.strip())[:80]
                    drops[why] = drops.get(why, 0) + int(n)
            elif "loop step failed" in line:
                counts["loop_errors"] += 1
            elif "finetune sent to" in line:
                counts["finetune_sent"] += 1
        return counts

    def _round(self, job: str) -> RoundRecord | None:
        """The job's round 1 without its participants (one indexed row, polled every 0.5 s)."""
        return next((r for r in self._registry().list_rounds(job, participants=False) if r.number == 1), None)

    def _round_over(self, job: str) -> bool:
        rnd = self._round(job)
        return rnd is not None and rnd.state not in (RoundState.OPEN, RoundState.CLOSING)

    def _round_figures(self, job: str) -> dict[str, Any]:
        reg = self._registry()
        rnd = self._round(job)
        if rnd is None:
            raise RuntimeError(f"job {job} has no round 1 in {reg.where}")
        state, reason, ended, deadline, version = (rnd.state.value, rnd.reason, rnd.ended_at, rnd.deadline_at,
                                                   rnd.aggregated_version)
        # aggregates, not rows: 10,000 updates; Registry has no method for these (see online())
        with reg.db.read() as db:
            ups = db.execute("SELECT status, COUNT(*), COALESCE(SUM(wire_bytes), 0), MIN(received_at), "
                             "MAX(received_at) FROM updates WHERE job_id = ? GROUP BY status", (job,)).fetchall()
            dup = db.execute("SELECT COUNT(*) FROM (SELECT device_id FROM updates WHERE job_id = ? "
                             "GROUP BY device_id HAVING COUNT(*) > 1) AS d", (job,)).fetchone()[0]
        parts = {s.value: n for s, n in reg.participant_counts(job, 1).items()}
        created = reg.get_model("simhead", version).created_at if version else None
        by = {s: (n, b, lo, hi) for s, n, b, lo, hi in ups}
        accepted = by.get("accepted", (0, 0, None, None))
        first = min((v[2] for v in by.values()), default=None)
        last = max((v[3] for v in by.values()), default=None)
        span = (last - first) if first is not None and last is not None else 0.0
        # "deadline": some participant never reported (its dropout message lost?): the close
        # time then measures the deadline, not the coordinator
        closed_by = "deadline" if ended and ended >= deadline else "settled"
        return {"job": job, "round_state": state, "closed_by": closed_by, "round_reason": reason, "new_version": version,
                "accepted": accepted[0], "updates_by_status": {s: v[0] for s, v in by.items()},
                "participants": parts, "duplicate_rows": dup, "received_mb": sum(v[1] for v in by.values()) / 1e6,
                "updates_per_s": (sum(v[0] for v in by.values()) - 1) / span if span > 0 else float("nan"),
                "ingest_span_s": span,
                "last_update_to_version_s": (created - last) if created and last else float("nan"),
                "last_update_to_close_s": (ended - last) if ended and last else float("nan"),
                "last_update_to_broker_s": self._on_broker(version, last)}

    def _on_broker(self, version: str | None, last: float | None, wait_s: float = 30.0) -> float:
        """Seconds from the last update to the new version's first manifest on the broker (its
        head patch's or its archive's, whichever came first); nan if it never came."""
        if not version or last is None:
            return float("nan")
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            seen = [t for topic, t in list(self.manifests.items()) if f"/{version}" in topic]
            if seen:
                return min(seen) - last
            time.sleep(0.05)
        return float("nan")

    def close(self) -> None:
        if self.fleet is not None:
            try:
                self.fleet.stop()
            except Exception:  # stopping must go on to serve and the broker
                pass
        if self.watcher is not None:
            self.watcher.loop_stop()
            self.watcher.disconnect()
        for serve in self.serves:
            if serve.poll() is None:
                serve.terminate()
        for serve in self.serves:
            try:
                serve.wait(60)
            except subprocess.TimeoutExpired:
                serve.kill()
                serve.wait(10)
        if self.broker is not None:
            self.broker.stop()
        if self._reader is not None:
            self._reader.close()
            self._reader = None


def run_load(cfg: LoadConfig, workdir: Path, base_bundle: Path, *, db: str | None = None) -> dict[str, Any]:
    """One measured round (module doc) on registry `db` (LoadRun); everything started is
    stopped before it returns."""
    workdir.mkdir(parents=True, exist_ok=True)
    run = LoadRun(cfg, workdir, db=db)
    run.partial["registry"] = run.dialect  # which engine the figures are from (never the URL)
    try:
        run.start(base_bundle)
        return run.measure()
    except Exception as exc:
        out = run.partial
        out["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        out["config"] = asdict(cfg)
        if run.mark is not None and run.serve is not None:
            run._phase(out, "until_failure", run.mark)
        for what, get in (("sim", lambda: run.fleet.summary() if run.fleet else None), ("serve_log", run.log_counts),
                          ("serve_stacks", run.stack_counts),
                          ("round", lambda: run._round_figures(run.job) if run.job else None)):
            try:
                out[what] = get()
            except Exception as inner:  # what can be had: the error itself is the finding
                out[what] = f"unavailable: {inner}"
        raise LoadFailed(str(exc), out) from exc
    finally:
        run.close()
