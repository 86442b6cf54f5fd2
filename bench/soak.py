"""Soak: a real fleet (mosquitto, `edge-coordinator serve`, 4 `edge-agent run` daemons)
for many short rounds, sampling every process, to show what grows and what stays flat.

    python -m bench.soak --rounds 1000 [--agents 4] [--rounds-per-job 25] [--out DIR]
    make soak                      # 1,000 rounds, writes the bench_soak section of BENCHMARKS.md

Rounds are made short, not fake: the digits bundle (a tiny CNN), a few dozen samples per
device, one epoch, a 0.2 s coordinator tick. Jobs of `--rounds-per-job` rounds are queued
back to back with `train --detach`; every `--cancel-every`-th job is cancelled after its
first round (an ordinary cancel, as an operator does). Every `--sample-every` rounds the
soak records, per process (coordinator, each agent daemon, mosquitto): RSS, open fds,
threads, CPU seconds; per state directory: bytes on disk and files; on the broker: the
retained messages under the fleet's topics and their bytes (a fresh subscriber counts
them). After the warm-up it fits a line (least squares) through each series and reports
the growth per 1,000 rounds, and the agent CPU seconds per round at the start and the end.

Nothing here changes behaviour: the retention the coordinator applies is its own
defaults plus whatever `--serve-arg` passes to `serve`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
STOP = threading.Event()  # SIGTERM / SIGINT: stop queueing, report what was measured
PY = sys.executable
CLK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


# ---------------------------------------------------------------- measuring a process / a directory
def proc_sample(pid: int) -> dict[str, float] | None:
    """RSS (MiB), fds, threads and CPU seconds of a live process (None if it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        stat = Path(f"/proc/{pid}/stat").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    rss = threads = 0.0
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) / 1024.0
        elif line.startswith("Threads:"):
            threads = float(line.split()[1])
    return {"rss_mib": rss, "fds": float(fds), "threads": threads,
            "cpu_s": (int(fields[11]) + int(fields[12])) / CLK}


def dir_usage(path: Path, skip: tuple[str, ...] = ()) -> tuple[int, int]:
    """(bytes, files) under `path` (apparent sizes), skipping top-level names in `skip`."""
    total = files = 0
    for dirpath, dirnames, filenames in os.walk(path):
        if Path(dirpath) == path:
            dirnames[:] = [d for d in dirnames if d not in skip]
            filenames = [f for f in filenames if f not in skip]
        for name in filenames:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
                files += 1
            except OSError:
                pass
    return total, files


def retained(port: int, topic_filter: str, timeout: float = 30.0) -> tuple[int, int]:
    """(messages, payload bytes) the broker holds retained under `topic_filter`: a fresh
    clean-session subscriber receives them all before its own later sentinel message."""
    import paho.mqtt.client as mqtt

    sentinel = f"soak-sentinel/{uuid.uuid4().hex}"
    count = size = 0
    done = threading.Event()

    def on_message(client: Any, userdata: Any, msg: Any) -> None:
        nonlocal count, size
        if msg.topic == sentinel:
            done.set()
        elif msg.retain and msg.payload:
            count += 1
            size += len(msg.payload)

    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"soak-{uuid.uuid4().hex[:8]}",
                         clean_session=True)
    client.on_message = on_message
    client.connect("127.0.0.1", port, keepalive=30)
    client.loop_start()
    try:
        client.subscribe([(topic_filter, 0), (sentinel, 0)])[1]
        time.sleep(0.2)
        client.publish(sentinel, b"x", qos=0)
        if not done.wait(timeout):
            raise RuntimeError("the retained-message count did not finish")
    finally:
        client.loop_stop()
        client.disconnect()
    return count, size


# ---------------------------------------------------------------- the fleet
class Fleet:
    def __init__(self, args: argparse.Namespace, out: Path) -> None:
        self.args, self.out = args, out
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.broker: Any = None
        self.prefix = f"soak{uuid.uuid4().hex[:6]}/edgeft/v1"
        self.coord_dir = out / "coordinator"
        self.agent_dirs: dict[str, Path] = {}
        self.cli = [PY, "-m", "edge_agent.coordinator.cli"]
        self.releases = 0  # screening quarantines the soak lifted

    def start(self) -> None:
        from edge_agent import keys
        from edge_agent.config import public_key_text, render_config
        from edge_agent.demo.fleet import set_battery, write_sysfs
        from edge_agent.int8.bundle import pack_bundle
        from edge_agent.sim import scenario as demo
        from edge_agent.transport.broker import MosquittoBroker

        a = self.args
        bundle = demo.ensure_bundle(Path(a.cache) / "digits-bundle")
        archive = pack_bundle(bundle, self.out / "digits-1.tar.gz")
        self.broker = MosquittoBroker(workdir=self.out / "mosquitto")
        self.broker.start()
        coord_key = keys.generate_private_key()
        (self.coord_dir / "keys").mkdir(parents=True, exist_ok=True, mode=0o700)
        keys.save_private_key(self.coord_dir / "keys" / "coordinator.key", coord_key)
        self.run([*self.cli, "model", "register", str(archive), "--name", "digits", "--version", "1",
                  "--state-dir", str(self.coord_dir)])
        self.spawn("coordinator", [*self.cli, "serve", "--broker", f"127.0.0.1:{self.broker.port}", "--fleet", "soak",
                                   "--topic-prefix", self.prefix, "--state-dir", str(self.coord_dir), "--tick", "0.2",
                                   "--ack-interval", "0.5", "--auto-approve", *a.serve_arg],
                   self.out / "coordinator.log")
        sc = demo.scenario(n_devices=a.agents)
        for i, dev in enumerate(sc.devices):
            name = f"soak-{i + 1}"
            home = self.out / "agents" / name
            state = home / "state"
            key = keys.generate_private_key()
            keys.save_private_key(state / "keys" / "device.key", key)
            n = min(a.samples, len(dev.labels))
            data = demo.write_data(home / "data", dev.images[:n], dev.labels[:n], "npz")
            root = write_sysfs(home / "sysfs", battery_pct=95)
            set_battery(root, energy_wh=0.45, watts=2.7, status="Charging")  # on power: never waits to charge
            # A charging battery's fuel gauge gives no reading; on mains a Pi meters its CPU time
            # (cpu-estimate over /proc/stat): the fixture has none, so the host's real one.
            # Without it every job ran unmetered and a slow one (>= 10 samples) stopped "error".
            (root / "proc" / "stat").symlink_to("/proc/stat")
            text = render_config(device_name=name, fleet="soak", broker_host="127.0.0.1", broker_port=self.broker.port,
                                 coordinator_public_key=public_key_text(coord_key), state_dir=state,
                                 device_id=keys.fingerprint(key), sysfs_root=str(root), data_dir=str(data),
                                 topic_prefix=self.prefix)
            text, n = re.subn(r"max_jobs_per_day = [0-9]+", "max_jobs_per_day = 1000", text)  # a year in an hour
            if n != 1:
                raise RuntimeError("agent.toml has no max_jobs_per_day line to raise")
            # keep_job_records: the same bound as the default 500, reached within the soak (a
            # year in an hour would otherwise spend half the run filling it)
            text += ("\n[service]\nstate_interval_s = 30\nprogress_interval_s = 5\nupload_ack_timeout_s = 5\n"
                     f"upload_retry_min_s = 0.5\nupload_retry_max_s = 5\nkeep_job_records = {a.keep_job_records}\n")
            (home / "agent.toml").write_text(text)
            self.agent_dirs[name] = state
            self.spawn(name, [PY, "-m", "edge_agent.agent.cli", "run", "--config", str(home / "agent.toml")],
                       home / "agent.log")

    def spawn(self, name: str, argv: list[str], log: Path) -> None:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as fh:
            self.procs[name] = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def run(self, argv: list[str]) -> str:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=ROOT, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[2:6])}... exited {done.returncode}: {(done.stderr or done.stdout)[-800:]}")
        return done.stdout

    def check(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode} (logs under {self.out})")

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if self.broker is not None:
            self.broker.stop()

    def sample(self, rounds: int, jobs: int) -> dict[str, Any]:
        row: dict[str, Any] = {"round": rounds, "jobs": jobs, "t": time.time()}
        pids = {n: p.pid for n, p in self.procs.items()}
        pids["mosquitto"] = self.broker._proc.pid if self.broker and self.broker._proc else 0
        for name, pid in pids.items():
            got = proc_sample(pid)
            if got:
                row.update({f"{name}.{k}": v for k, v in got.items()})
        row["coordinator.disk"], row["coordinator.files"] = dir_usage(self.coord_dir)
        for part in ("updates", "models", "bundles"):  # the received updates; the versions kept
            row[f"coordinator.{part}"] = dir_usage(self.coord_dir / part)[0]
        wal = self.coord_dir / "registry.sqlite3-wal"
        row["coordinator.wal"] = wal.stat().st_size if wal.exists() else 0
        row["coordinator.registry"] = row["coordinator.disk"] - sum(
            row[f"coordinator.{p}"] for p in ("updates", "models", "bundles"))
        for name, state in self.agent_dirs.items():
            row[f"{name}.disk"], row[f"{name}.files"] = dir_usage(state)
        row["broker.retained"], row["broker.retained_bytes"] = retained(self.broker.port, self.prefix.split("/")[0] + "/#")
        return row


# ---------------------------------------------------------------- the rounds
class Received:
    """Update bytes the coordinator received over the whole run: retention deletes the rows of
    old updates, so a sum over the table would stop counting once pruning starts."""

    def __init__(self) -> None:
        self.seen: set[tuple[str, str, int]] = set()
        self.bytes = 0
        self.since = 0.0

    def add(self, db: Any) -> None:
        rows = db.execute("SELECT job_id, device_id, round, wire_bytes, received_at FROM updates "
                          "WHERE received_at >= ?", (self.since - 60.0,)).fetchall()
        for job, device, rnd, size, at in rows:
            if (job, device, rnd) not in self.seen:
                self.seen.add((job, device, rnd))
                self.bytes += int(size)
            self.since = max(self.since, float(at))


def registry_counts(coord_dir: Path, received: Received | None = None) -> dict[str, Any]:
    """Finished rounds, jobs, update bytes received (from the registry, read-only)."""
    import sqlite3

    db = sqlite3.connect(f"file:{coord_dir / 'registry.sqlite3'}?mode=ro", uri=True, timeout=30)
    try:
        rounds = db.execute("SELECT state, COUNT(*) FROM rounds GROUP BY state").fetchall()
        up = db.execute("SELECT COUNT(*), COALESCE(SUM(wire_bytes), 0) FROM updates").fetchone()
        if received is not None:
            received.add(db)
            up = (up[0], received.bytes)
        models = db.execute("SELECT COUNT(*) FROM model_versions").fetchone()[0]
        active = db.execute("SELECT COUNT(*) FROM jobs WHERE status IN ('pending', 'running')").fetchone()[0]
        try:
            quarantined = [r[0] for r in db.execute("SELECT id FROM devices WHERE quarantined_at IS NOT NULL")]
        except sqlite3.OperationalError:  # a registry without quarantine
            quarantined = []
    finally:
        db.close()
    by_state = dict(rounds)
    return {"finished": sum(v for k, v in by_state.items() if k not in ("open", "closing")), "by_state": by_state,
            "updates": up[0], "update_wire_bytes": up[1], "model_rows": models, "active_jobs": active,
            "quarantined": quarantined}


def drive(fleet: Fleet, args: argparse.Namespace, log: Any) -> list[dict[str, Any]]:
    from edge_agent.coordinator.registry import Registry

    deadline = time.monotonic() + 300
    while True:
        fleet.check()
        with Registry(state_dir=fleet.coord_dir, read_only=True) as reg:
            now = time.time()
            online = [d for d in reg.list_devices() if d.approved and d.is_online(now, 300) and d.battery_pct is not None]
        if len(online) >= args.agents:
            break
        if time.monotonic() > deadline:
            raise RuntimeError("the agents did not come online")
        time.sleep(0.5)
    samples: list[dict[str, Any]] = []
    jobs = 0
    next_sample = 0
    started = time.monotonic()
    received = Received()
    while True:
        counts = registry_counts(fleet.coord_dir, received)
        done = counts["finished"]
        if done >= next_sample:
            row = fleet.sample(done, jobs)
            row.update({k: counts[k] for k in ("updates", "update_wire_bytes", "model_rows")})
            row["failed_rounds"] = counts["by_state"].get("failed", 0)
            row["aggregated_rounds"] = counts["by_state"].get("aggregated", 0)
            samples.append(row)
            log(f"round {done}/{args.rounds} ({time.monotonic() - started:.0f} s): coord "
                f"{row.get('coordinator.rss_mib', 0):.1f} MiB {row['coordinator.disk'] / 1e6:.2f} MB, agent1 "
                f"{row.get('soak-1.rss_mib', 0):.1f} MiB, retained {row['broker.retained']} / "
                f"{row['broker.retained_bytes'] / 1e6:.2f} MB, rounds {counts['by_state']}")
            next_sample = done + args.sample_every
        if done >= args.rounds or time.monotonic() - started > args.minutes * 60 or STOP.is_set():
            if samples[-1]["round"] != done:
                row = fleet.sample(done, jobs)
                row.update({k: counts[k] for k in ("updates", "update_wire_bytes", "model_rows")})
                row["failed_rounds"] = counts["by_state"].get("failed", 0)
                row["aggregated_rounds"] = counts["by_state"].get("aggregated", 0)
                samples.append(row)
            return samples
        fleet.check()
        for device in counts["quarantined"]:  # robust screening may bench an honest tiny-data device
            fleet.run([*fleet.cli, "devices", "--release", device, "--state-dir", str(fleet.coord_dir)])
            fleet.releases += 1
        if not counts["active_jobs"]:
            n = min(args.rounds_per_job, args.rounds - done)
            jobs += 1
            text = fleet.run([*fleet.cli, "train", "--model", "digits", "--devices", "all", "--rounds", str(n),
                              "--min-devices", str(args.min_devices or max(1, args.agents - 1)), "--deadline", "120s", "--epochs", "1",
                              "--batch-size", "16", "--budget-wh", "0.05", "--update-bytes", "2048",
                              "--wait-for-devices", "--detach", "--state-dir", str(fleet.coord_dir)])
            job_id = text.split()[1].rstrip(":")
            if args.cancel_every and jobs % args.cancel_every == 0 and n > 1:
                cancel_after_first_round(fleet, job_id)
        time.sleep(0.5)


def cancel_after_first_round(fleet: Fleet, job_id: str) -> None:
    """Cancel `job_id` once its second round is open (an operator's ordinary cancel)."""
    import sqlite3

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        fleet.check()
        db = sqlite3.connect(f"file:{fleet.coord_dir / 'registry.sqlite3'}?mode=ro", uri=True, timeout=30)
        try:
            n = db.execute("SELECT COUNT(*) FROM rounds WHERE job_id = ?", (job_id,)).fetchone()[0]
            status = db.execute("SELECT status FROM jobs WHERE id = ?", (job_id,)).fetchone()
        finally:
            db.close()
        if status and status[0] in ("done", "failed", "cancelled"):
            return
        if n >= 2:
            fleet.run([*fleet.cli, "cancel", job_id, "--reason", "soak: ordinary cancel",
                       "--state-dir", str(fleet.coord_dir)])
            return
        time.sleep(0.2)


# ---------------------------------------------------------------- fitting and reporting
def slope(xs: list[float], ys: list[float]) -> float:
    import numpy as np

    if len(xs) < 3 or max(xs) == min(xs):
        return float("nan")
    return float(np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)[0])


def analyse(samples: list[dict[str, Any]], agents: list[str], warmup: float) -> dict[str, Any]:
    last = samples[-1]["round"]
    after = [s for s in samples if s["round"] >= warmup * last] or samples
    xs = [float(s["round"]) for s in after]
    res: dict[str, Any] = {"rounds": last, "warmup_round": after[0]["round"], "samples": len(samples)}
    res["failed_rounds"] = samples[-1].get("failed_rounds", 0)

    def per_k(key: str) -> float:
        ys = [float(s.get(key, float("nan"))) for s in after]
        return 1000.0 * slope(xs, ys)

    for proc in ["coordinator", "mosquitto", *agents]:
        for m in ("rss_mib", "fds", "threads"):
            res[f"{proc}.{m}.per_1000"] = per_k(f"{proc}.{m}")
            res[f"{proc}.{m}.range"] = (min(s.get(f"{proc}.{m}", 0) for s in after),
                                        max(s.get(f"{proc}.{m}", 0) for s in after))
    for key in ["coordinator.disk", "coordinator.files", "broker.retained", "broker.retained_bytes",
                "coordinator.updates", "coordinator.models", "coordinator.bundles", "coordinator.registry",
                "coordinator.wal", "aggregated_rounds",
                *(f"{a}.disk" for a in agents), *(f"{a}.files" for a in agents)]:
        res[f"{key}.per_1000"] = per_k(key)
        res[f"{key}.range"] = (min(s[key] for s in after), max(s[key] for s in after))
    # agent CPU per round: first and last quarter of the run after warm-up
    q = max(2, len(after) // 4)
    for a in agents:
        def cpu_rate(rows: list[dict[str, Any]], a: str = a) -> float:
            dr = rows[-1]["round"] - rows[0]["round"]
            return (rows[-1][f"{a}.cpu_s"] - rows[0][f"{a}.cpu_s"]) / dr if dr else float("nan")
        res[f"{a}.cpu_per_round"] = (cpu_rate(after[:q]), cpu_rate(after[-q:]))
    dr = after[-1]["round"] - after[0]["round"]
    res["update_wire_bytes_per_round"] = (after[-1]["update_wire_bytes"] - after[0]["update_wire_bytes"]) / dr if dr else 0
    res["coordinator.disk.per_round"] = res["coordinator.disk.per_1000"] / 1000.0
    res["aggregated_after_warmup"] = after[-1]["aggregated_rounds"] - after[0]["aggregated_rounds"]
    return res


def section(res: dict[str, Any], args: argparse.Namespace, agents: list[str], wall_s: float) -> str:
    def mb(v: float) -> str:
        return f"{v / 1e6:.2f} MB"

    arss = [res[f"{a}.rss_mib.per_1000"] for a in agents]
    lines = [
        "## Soak: a year unattended, in fast-forward (bench/soak.py)",
        "",
        f"{res['rounds']} aggregated-or-ended rounds in jobs of {args.rounds_per_job} (every {args.cancel_every or '-'}"
        f"th job cancelled after its first round), {len(agents)} `edge-agent run` daemons, one "
        f"`edge-coordinator serve`, real mosquitto; digits bundle, {args.samples} samples per device, 1 epoch; "
        f"sampled every {args.sample_every} rounds; lines fitted after round {res['warmup_round']} (warm-up); "
        f"{wall_s / 60:.0f} min wall. `serve` options: {' '.join(args.serve_arg) or '(defaults)'}; agents: "
        f"`max_jobs_per_day = 1000`, `keep_job_records = {args.keep_job_records}`.",
        "",
        "| series (after warm-up) | range | growth per 1,000 rounds | target |",
        "|---|---|---|---|",
        f"| agent daemon RSS (max of {len(agents)}) | "
        f"{min(res[f'{a}.rss_mib.range'][0] for a in agents):.1f}-{max(res[f'{a}.rss_mib.range'][1] for a in agents):.1f} MiB"
        f" | {max(arss):+.2f} MiB (one job per round) | <= 1 MiB per 1,000 jobs |",
        f"| coordinator RSS | {res['coordinator.rss_mib.range'][0]:.1f}-{res['coordinator.rss_mib.range'][1]:.1f} MiB | "
        f"{res['coordinator.rss_mib.per_1000']:+.2f} MiB | flat within 5 MiB |",
        f"| mosquitto RSS | {res['mosquitto.rss_mib.range'][0]:.1f}-{res['mosquitto.rss_mib.range'][1]:.1f} MiB | "
        f"{res['mosquitto.rss_mib.per_1000']:+.2f} MiB | |",
        f"| broker retained messages | {res['broker.retained.range'][0]}-{res['broker.retained.range'][1]} | "
        f"{res['broker.retained.per_1000']:+.1f} | bounded by retention |",
        f"| broker retained bytes | {mb(res['broker.retained_bytes.range'][0])}-{mb(res['broker.retained_bytes.range'][1])}"
        f" | {mb(res['broker.retained_bytes.per_1000'])} | bounded by retention |",
        f"| coordinator state dir | {mb(res['coordinator.disk.range'][0])}-{mb(res['coordinator.disk.range'][1])} | "
        f"{mb(res['coordinator.disk.per_1000'])} ({res['coordinator.disk.per_round']:.0f} B/round; updates received: "
        f"{res['update_wire_bytes_per_round']:.0f} B/round) | <= updates + retained versions |",
        f"| - of which update payloads / versions (heads + bundles) / registry and the rest | "
        f"{mb(res['coordinator.updates.range'][1])} / "
        f"{mb(res['coordinator.models.range'][1] + res['coordinator.bundles.range'][1])} / "
        f"{mb(res['coordinator.registry.range'][1])} (max) | {mb(res['coordinator.updates.per_1000'])} / "
        f"{mb(res['coordinator.models.per_1000'] + res['coordinator.bundles.per_1000'])} / "
        f"{mb(res['coordinator.registry.per_1000'])} | |",
        f"| - of which the SQLite WAL | {mb(res['coordinator.wal.range'][0])}-{mb(res['coordinator.wal.range'][1])} | "
        f"{mb(res['coordinator.wal.per_1000'])} | |",
        f"| coordinator files | {res['coordinator.files.range'][0]}-{res['coordinator.files.range'][1]} | "
        f"{res['coordinator.files.per_1000']:+.1f} | |",
        f"| agent state dir (max) | {mb(min(res[f'{a}.disk.range'][0] for a in agents))}-"
        f"{mb(max(res[f'{a}.disk.range'][1] for a in agents))} | "
        f"{mb(max(res[f'{a}.disk.per_1000'] for a in agents))} | bounded |",
        f"| agent fds / threads (max growth) | | {max(res[f'{a}.fds.per_1000'] for a in agents):+.1f} / "
        f"{max(res[f'{a}.threads.per_1000'] for a in agents):+.1f} | flat |",
        f"| coordinator fds / threads | | {res['coordinator.fds.per_1000']:+.1f} / "
        f"{res['coordinator.threads.per_1000']:+.1f} | flat |",
        "",
        "Agent daemon CPU per round (ms; first vs last quarter after warm-up): " + ", ".join(
            f"{a} {1000 * res[f'{a}.cpu_per_round'][0]:.0f} -> {1000 * res[f'{a}.cpu_per_round'][1]:.0f}"
            for a in agents) + ".",
        "",
        f"Rounds aggregated into a new version after warm-up: {res['aggregated_after_warmup']} of "
        f"{res['rounds'] - res['warmup_round']}. "
        f"Rounds that ended failed: {res.get('failed_rounds', 0)}; screening quarantines the soak lifted: "
        f"{res.get('quarantines_lifted', 0)} (an honest device's tiny-data update can be screened out; the soak "
        "releases it so all 4 keep working).",
        "",
        "RSS is VmRSS of the long-running processes (not the per-job training children); disk is the apparent "
        "size of every file under each state directory; retained messages are counted by a fresh subscriber. "
        "Growth is the least-squares slope over the samples after warm-up, scaled to 1,000 rounds.",
    ]
    return "\n".join(lines) + "\n"


def soak(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    out = Path(args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    t0 = time.monotonic()

    def log(text: str) -> None:
        print(f"[soak {time.monotonic() - t0:7.0f}s] {text}", flush=True)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: STOP.set())
    fleet = Fleet(args, out)
    try:
        fleet.start()
        samples = drive(fleet, args, log)
    finally:
        fleet.stop()
    (out / "samples.json").write_text(json.dumps(samples, indent=1))
    agents = sorted(fleet.agent_dirs)
    res = analyse(samples, agents, args.warmup)
    res["quarantines_lifted"] = fleet.releases
    (out / "result.json").write_text(json.dumps(res, indent=1))
    return section(res, args, agents, time.monotonic() - t0), res


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=1000)
    p.add_argument("--minutes", type=float, default=600.0, help="stop after this long, whatever the count")
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--min-devices", type=int, default=None,
                   help="accepted updates a round needs (default: all agents but one: one update screened out "
                        "does not fail the round)")
    p.add_argument("--rounds-per-job", type=int, default=25)
    p.add_argument("--cancel-every", type=int, default=5, help="cancel every Nth job after its first round (0: never)")
    p.add_argument("--samples", type=int, default=48, help="training samples per device")
    p.add_argument("--keep-job-records", type=int, default=100,
                   help="agents' [service] keep_job_records (default 500 in the field)")
    p.add_argument("--sample-every", type=int, default=10, help="rounds between samples")
    p.add_argument("--warmup", type=float, default=0.2, help="share of the run left out of the fits")
    p.add_argument("--out", default="/tmp/edge-soak")
    p.add_argument("--cache", default=str(ROOT / "build" / "soak-cache"))
    p.add_argument("--serve-arg", action="append", default=[], help="extra `serve` argument (repeatable)")
    p.add_argument("--section", default=None, help="also write the Markdown section here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    text, _ = soak(args)
    print(text)
    if args.section:
        Path(args.section).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
