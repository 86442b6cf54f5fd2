"""`make test-arm`: the project on an emulated Raspberry Pi OS (Debian Bookworm arm64, and
armhf for 32-bit Pi OS), under qemu-user with binfmt_misc, as root.

For each architecture (the two side by side, one thread each: qemu-user runs on one core):
  1. a Bookworm root file system from Debian's packages (debootstrap), cached as a tarball
     under build/arm/ and unpacked fresh for every run (outside the source tree:
     $EDGE_AGENT_ARM_WORK, default /var/tmp/edge-agent-test-arm);
  2. `make deb ARCH=<arch>` on the host, `apt-get install ./edge-agent_*_<arch>.deb` in the
     root (chroot; the postinst builds the venv from the wheels with the root's Python 3.11);
  3. in the root: `edge-agent doctor`, `edge-agent probe` (the kernels' auxv check must win
     over the host's /proc/cpuinfo), `edge-agent kernels --bench` (native must run a NEON
     variant), `edge-agent finetune --trainer numpy`, a first job given the choice
     `kernels --bench` measured (as the fleet would relay it: it must re-check that choice,
     not measure every engine, as its report's notes say); arm64: probe and the native kernels
     again as a Raspberry Pi 4's Cortex-A72 (QEMU_CPU=cortex-a72: no dot product, so the
     plain NEON variant); armhf: `--trainer mxnet` refused with one line.
Then one fleet on the host's `edge-coordinator serve` and mosquitto (the chroots share the
host's network namespace), with `edge-agent run` in each root, as a Pi 4 (arm64) and a
32-bit Pi Zero 2 W (armhf), and two jobs on a multi-depth bundle:
  A. `--depth 1` on every device: a mixed arm64 + armhf round that trains the deep tail
     (conv + BatchNorm + dense) on both, in numpy -- the 32-bit device is selected because
     numpy trains that depth (issue 35 #25);
  B. `--depth 1 --param trainer=mxnet`: the coordinator leaves the 32-bit device out (its
     hello says no MXNet) and the arm64 device trains the deep tail with MXNet Gluon, as
     its result (in the update's metrics) says (#24); its model reaches it as a head patch
     on job A's version.
Bundles and data are made on the host. Prints one line per check and "N passed, N failed".

What emulation cannot tell: speed, sensors, accelerators, thermal behaviour (see
docs/deployment.md, "Verified under emulation").

usage: tests/arm/emulated_pi.py [--arch arm64,armhf] [--keep] [--serial]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

BUILD = REPO / "build" / "arm"  # cached root tarballs, host-made bundles
# Unpacked roots (with /proc and /dev mounted in them) live outside the source tree:
# setuptools walks the whole tree on every `pip install -e .`, into a mounted /proc too.
WORK = Path(os.environ.get("EDGE_AGENT_ARM_WORK", "/var/tmp/edge-agent-test-arm"))
SUITE, MIRROR = "bookworm", "http://deb.debian.org/debian"
# What the package Depends on is pre-installed so `apt-get install ./x.deb` needs no network.
# debootstrap's resolver misses what provides python3.11-venv's python3.11-distutils
# (python3-distutils, which needs python3 and python3-lib2to3): named explicitly.
COMMON = ["python3", "python3.11", "python3.11-venv", "python3-distutils", "python3-lib2to3",
          "passwd", "init-system-helpers"]
INCLUDE = {
    "arm64": COMMON + ["libopenblas0-pthread", "liblapacke", "libgomp1", "libgfortran5", "patchelf"],
    # python3-cffi-backend provides the python3-cffi-backend-api-* that cryptography needs.
    "armhf": COMMON + ["python3-numpy", "python3-cryptography", "python3-cffi-backend"],
}
QEMU = {"arm64": "qemu-aarch64", "armhf": "qemu-arm"}
MACHINE = {"arm64": "aarch64", "armhf": "armv7l"}
NEON = {"arm64": {"neon", "neon_dot"}, "armhf": {"armv7_neon"}}
# The board each architecture's agent runs on in the fleet (tests/fixtures/boards).
BOARD = {"arm64": "raspberry-pi-4", "armhf": "raspberry-pi-zero-2w-32bit"}
PI4_CPU = "cortex-a72"  # QEMU_CPU: the Pi 4's core (Armv8.0-A: NEON, no dot product)
ENV = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root", "LANG=C.UTF-8",
       "PYTHONUNBUFFERED=1", "DEBIAN_FRONTEND=noninteractive"]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sh(cmd: list[str], *, timeout: float = 3600, check: bool = True, **kw: object) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} -> {proc.returncode}\n{(proc.stdout + proc.stderr)[-4000:]}")
    return proc


class Results:
    def __init__(self) -> None:
        self.passed: list[str] = []
        self.failed: list[str] = []

    def check(self, name: str, fn: Callable[[], str | None]) -> bool:
        start = time.monotonic()
        try:
            detail = fn() or ""
        except Exception as exc:  # noqa: BLE001 - every failure is reported, then the run goes on
            self.failed.append(name)
            text = str(exc) if isinstance(exc, AssertionError) else traceback.format_exc()
            print(f"FAIL {name} ({time.monotonic() - start:.0f} s)\n     " + text.strip().replace("\n", "\n     "),
                  flush=True)
            return False
        self.passed.append(name)
        print(f"ok   {name} ({time.monotonic() - start:.0f} s) {detail}", flush=True)
        return True


# ---------------------------------------------------------------------------- binfmt + root

def ensure_binfmt(arch: str) -> str:
    misc = Path("/proc/sys/fs/binfmt_misc")
    if not (misc / "status").exists():
        sh(["mount", "-t", "binfmt_misc", "binfmt_misc", str(misc)])
    name = QEMU[arch]
    entry = misc / name
    if not entry.exists() or "enabled" not in entry.read_text():
        sh(["update-binfmts", "--enable", name])
    text = entry.read_text()
    assert "enabled" in text, text
    # F (fix binary): the kernel opens the interpreter now, so it works inside the chroot.
    flags = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("flags:")), "")
    assert "F" in flags, f"{name} is registered without the F flag ({flags!r}): install qemu-user-static"
    return f"{name}: {next(line for line in text.splitlines() if line.startswith('interpreter'))}"


def rootfs_tarball(arch: str) -> Path:
    key = hashlib.sha256(json.dumps([SUITE, MIRROR, arch, INCLUDE[arch]]).encode()).hexdigest()[:12]
    return BUILD / f"{SUITE}-{arch}-{key}.tar"


def ensure_rootfs(arch: str) -> str:
    """The cached root tarball, built with debootstrap when missing (the slow part: the
    second stage runs every maintainer script under qemu)."""
    tarball = rootfs_tarball(arch)
    if tarball.is_file():
        return f"cached {tarball.name} ({tarball.stat().st_size >> 20} MiB)"
    BUILD.mkdir(parents=True, exist_ok=True)
    WORK.mkdir(parents=True, exist_ok=True)
    work = WORK / f"debootstrap-{arch}"
    if work.exists():
        unmount_all(work)  # a killed debootstrap leaves its /proc mounted
        shutil.rmtree(work)
    start = time.monotonic()
    sh(["debootstrap", f"--arch={arch}", "--variant=minbase", f"--include={','.join(INCLUDE[arch])}", SUITE,
        str(work), MIRROR], timeout=7200)
    sh(["chroot", str(work), "apt-get", "clean"])
    partial = tarball.with_suffix(".tmp")
    sh(["tar", "-C", str(work), "--numeric-owner", "-cf", str(partial), "."])
    partial.rename(tarball)  # only a complete tarball is ever reused
    shutil.rmtree(work)
    return f"built {tarball.name} in {time.monotonic() - start:.0f} s"


def unmount_all(path: Path) -> None:
    """Whatever is mounted under `path` (also by a run that was killed), deepest first:
    never delete a tree with /proc or /dev mounted in it."""
    try:
        mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
    except OSError:
        return
    prefix = str(path.resolve()) + "/"
    for where in sorted((m for m in mounts if m.startswith(prefix)), key=len, reverse=True):
        subprocess.run(["umount", "-l", where], capture_output=True, check=False)


class Root:
    """A fresh copy of the cached root with /proc, /sys and /dev mounted."""

    def __init__(self, arch: str) -> None:
        self.arch = arch
        self.path = WORK / f"root-{arch}"
        self.mounts: list[Path] = []
        self.installed = False  # the .deb is installed: checks and the fleet may run here

    def unpack(self) -> str:
        self.umount()
        if self.path.exists():
            shutil.rmtree(self.path)
        self.path.mkdir(parents=True)
        sh(["tar", "-C", str(self.path), "--numeric-owner", "-xf", str(rootfs_tarball(self.arch))])
        for target, opts in (("proc", ["-t", "proc", "proc"]), ("sys", ["-t", "sysfs", "sysfs"]),
                             ("dev", ["--bind", "/dev"]), ("dev/shm", ["-t", "tmpfs", "shm"])):
            where = self.path / target
            where.mkdir(parents=True, exist_ok=True)
            sh(["mount", *opts, str(where)])
            self.mounts.append(where)
        return str(self.path)

    def umount(self) -> None:
        unmount_all(self.path)
        self.mounts.clear()

    def run(self, *cmd: str, timeout: float = 1800, check: bool = True,
            env: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
        """`cmd` in the root; `env`: more NAME=VALUE (QEMU_CPU reaches qemu through it)."""
        return sh(["chroot", str(self.path), "/usr/bin/env", "-i", *ENV, *env, *cmd], timeout=timeout, check=check)

    def popen(self, *cmd: str, log_path: Path) -> subprocess.Popen:
        out = open(log_path, "ab")  # noqa: SIM115 - handed to the child
        try:
            return subprocess.Popen(["chroot", str(self.path), "/usr/bin/env", "-i", *ENV, *cmd], stdout=out,
                                    stderr=subprocess.STDOUT)
        finally:
            out.close()


# ---------------------------------------------------------------------------- host-made inputs

def make_inputs(dest: Path) -> dict[str, Path]:
    """The digits bundle (head: one dense layer), a multi-depth one (depth 1: conv3 + BN +
    dense, depth 2: conv2 too) and two devices' data, made on the host; cached."""
    from edge_agent.sim import scenario as demo

    dest.mkdir(parents=True, exist_ok=True)
    sc = demo.scenario()
    data = {arch: demo.write_data(dest / f"data-{arch}", dev.images, dev.labels, "npz")
            for arch, dev in zip(("arm64", "armhf"), sc.devices[1:], strict=True)}
    return {"digits": Path(demo.ensure_bundle(dest / "digits")),
            "deep": Path(demo.ensure_bundle(dest / "digits-deep", depths=2)),
            **{f"data-{arch}": path for arch, path in data.items()}}


# ---------------------------------------------------------------------------- the checks

_DEB_LOCK = threading.Lock()  # the builds share build/deb and dist/


def build_deb(arch: str) -> Path:
    # `make test-arm` has made the venv (its prerequisite): -o keeps `make deb` from redoing it.
    with _DEB_LOCK:
        sh(["make", "-C", str(REPO), "-o", ".venv/.installed-test", "deb", f"ARCH={arch}"], timeout=3600)
    (deb,) = (REPO / "dist").glob(f"edge-agent_*_{arch}.deb")
    return deb


def prepare_arch(root: Root, res: Results, inputs: dict[str, Path]) -> None:
    """One architecture's root, installed (`root.installed`: the fleet runs in it, so it
    stays mounted) and checked on its own."""
    arch = root.arch
    box: dict[str, Path] = {}
    if not res.check(f"{arch}: root file system", lambda: ensure_rootfs(arch)):
        return

    def deb() -> str:
        box["deb"] = build_deb(arch)
        return f"{box['deb'].name} ({box['deb'].stat().st_size / 1e6:.1f} MB)"

    if not res.check(f"{arch}: make deb ARCH={arch}", deb):
        return
    if not res.check(f"{arch}: unpack + mount", root.unpack):
        return

    def install() -> str:
        work = root.path / "work"
        shutil.copytree(inputs["digits"], work / "digits")
        shutil.copytree(inputs["deep"], work / "digits-deep")
        shutil.copytree(inputs[f"data-{arch}"].parent, work / "data")
        shutil.copyfile(box["deb"], root.path / "tmp" / box["deb"].name)
        done = root.run("apt-get", "install", "-y", "--no-install-recommends", f"/tmp/{box['deb'].name}")
        version = root.run("edge-agent", "--version").stdout.strip()
        return f"{version}; {done.stdout.strip().splitlines()[-1][:120]}"

    if not res.check(f"{arch}: apt-get install ./{box['deb'].name}", install):
        return
    root.installed = True
    res.check(f"{arch}: edge-agent doctor", lambda: doctor(root, arch))
    res.check(f"{arch}: edge-agent probe", lambda: probe(root, arch))
    res.check(f"{arch}: edge-agent kernels --bench", lambda: kernels(root, arch))
    res.check(f"{arch}: edge-agent finetune --trainer numpy", lambda: finetune(root, "numpy", "/work/digits"))
    res.check(f"{arch}: a first job with the fleet's engine choice skips the full measurement",
              lambda: shared_choice(root))
    if arch == "arm64":
        res.check(f"{arch}: probe + native kernels as a Pi 4 (QEMU_CPU={PI4_CPU}: no dot product)",
                  lambda: pi4_kernels(root))
    else:
        res.check(f"{arch}: --trainer mxnet refused in one line (no MXNet on 32-bit ARM)",
                  lambda: no_mxnet(root))


def doctor(root: Root, arch: str) -> str:
    done = root.run("edge-agent", "doctor", "--json", check=False)
    checks = {c["name"]: c for c in json.loads(done.stdout)}
    assert done.returncode == 0, done.stdout + done.stderr
    native = checks["native"]
    assert native["ok"] and any(f"variant {v} " in native["detail"] for v in NEON[arch]), native
    if arch == "arm64":
        mx = checks["mxnet"]
        assert mx["ok"] and mx["data"]["dot_ok"] and mx["data"]["onednn"], mx
        assert checks["mxnet-repair"]["ok"], checks["mxnet-repair"]  # the shipped repair, sha256 checked
        return f"{native['detail']}; mxnet {mx['detail']}"
    assert not checks["mxnet"]["ok"] and not checks["mxnet"]["required"], checks["mxnet"]
    return f"{native['detail']}; mxnet: {checks['mxnet']['detail'][:60]}"


def probe(root: Root, arch: str) -> str:
    report = json.loads(root.run("edge-agent", "probe", "--json").stdout)
    cpu = report["cpu"]
    check = cpu["kernel_check"]
    assert cpu["arch"] == MACHINE[arch], cpu["arch"]
    runs = {name for name, ok in check["variants"].items() if ok}
    assert runs & NEON[arch], check
    feature = "asimd" if arch == "arm64" else "neon"
    assert cpu["int8_features"][feature] is True, cpu["int8_features"]
    # The host's /proc/cpuinfo is x86: the two disagree, and the report shows both.
    assert check["disagree"].get(feature) == {"cpuinfo": False, "kernels": True}, check["disagree"]
    human = root.run("edge-agent", "probe").stdout
    assert "Kernels check: runs" in human and "the kernels' check says yes (used)" in human, human
    return f"arch {cpu['arch']}, kernels run {sorted(runs)}, disagree {sorted(check['disagree'])}"


def kernels(root: Root, arch: str) -> str:
    done = root.run("edge-agent", "kernels", "--model", "/work/digits", "--bench", "--json", "--repeats", "2",
                    "--state-dir", "/work/kernels-state", timeout=1800)
    report = json.loads(done.stdout)
    cands = {c["name"]: c for c in report["candidates"]}
    native = cands["native"]
    assert native["available"] and native["correct"], native
    assert any(f"variant {v} " in native["reason"] for v in NEON[arch]), native["reason"]
    if arch == "arm64":
        assert cands["mxnet-onednn"]["available"] and cands["mxnet-onednn"]["correct"], cands["mxnet-onednn"]
        assert cands["tflite"]["available"], cands["tflite"]
    else:
        assert not cands.get("mxnet-onednn", {"available": False})["available"]
    return f"native: {native['reason']}; chosen {report['chosen']}; " + ", ".join(
        f"{n} {c['latency_ms']:.0f} ms" for n, c in cands.items() if c.get("latency_ms"))


def shared_choice(root: Root) -> str:
    """A first job given the choice `kernels --bench` measured above (what this device reports
    to its coordinator, as a device of the same kind would receive it in a finetune command)
    re-checks it instead of measuring every engine (issue 37)."""
    done = root.run("edge-agent", "kernels", "--model", "/work/digits", "--json", "--state-dir", "/work/kernels-state")
    share = json.loads(done.stdout)["share"]
    assert share, "kernels --bench left no choice to share"
    (root.path / "work" / "choices.json").write_text(json.dumps([share]))
    root.run("edge-agent", "finetune", "--model", "/work/digits", "--data", "/work/data/data.npz", "--trainer",
             "numpy", "--epochs", "1", "--state-dir", "/work/ft-shared", "--cache-dir", "/work/ft-shared-cache",
             "--engine-choices", "/work/choices.json", "--report", "/work/ft-shared.json", "-q", timeout=1800)
    engine = json.loads((root.path / "work" / "ft-shared.json").read_text())["engine"]
    adopted = [n for n in engine["notes"] if "as measured by a device of this kind" in n]
    assert engine["name"] == share["engine"] and adopted, engine
    return f"{share['engine']}: {adopted[0]}"


def finetune(root: Root, trainer: str, bundle: str) -> str:
    name = f"ft-{trainer}"
    root.run("edge-agent", "finetune", "--model", bundle, "--data", "/work/data/data.npz", "--trainer",
             trainer, "--epochs", "2", "--state-dir", f"/work/{name}", "--report", f"/work/{name}.json",
             "-q", timeout=1800)
    report = json.loads((root.path / "work" / f"{name}.json").read_text())
    assert report["epochs_done"] == 2 and report["trainer"] == trainer, {k: report.get(k) for k in ("epochs_done",
                                                                                                   "trainer")}
    params = sorted(report["head"]["params"])
    acc = report["accuracy"]
    return (f"accuracy {acc['before']:.3f} -> {acc['after']:.3f} on {acc['validation_samples']} samples, "
            f"engine {report['engine']['name']}, trained {len(params)} tensors")


def pi4_kernels(root: Root) -> str:
    """A Pi 4's core has no dot product: the kernels' own check must see that (the host's
    /proc/cpuinfo cannot tell), run the plain NEON variant and agree with the reference."""
    cpu = (f"QEMU_CPU={PI4_CPU}",)
    check = json.loads(root.run("edge-agent", "probe", "--json", env=cpu).stdout)["cpu"]["kernel_check"]
    runs = {name for name, ok in check["variants"].items() if ok}
    assert "neon" in runs and "neon_dot" not in runs, check
    done = root.run("edge-agent", "kernels", "--model", "/work/digits", "--bench", "--json", "--repeats", "1",
                    "--backends", "native,reference", "--state-dir", "/work/kernels-a72", env=cpu, timeout=1800)
    native = {c["name"]: c for c in json.loads(done.stdout)["candidates"]}["native"]
    assert native["available"] and native["correct"], native
    assert "variant neon " in native["reason"], native["reason"]
    return f"kernels run {sorted(runs)}; native: {native['reason']}"


def no_mxnet(root: Root) -> str:
    done = root.run("edge-agent", "finetune", "--model", "/work/digits-deep", "--data", "/work/data/data.npz",
                    "--trainer", "mxnet", "--epochs", "1", "--state-dir", "/work/ft-refused", check=False)
    err = done.stderr.strip().splitlines()
    assert done.returncode == 69 and "Traceback" not in done.stderr, (done.returncode, done.stderr[-2000:])
    assert any("MXNet is not installed" in line for line in err), err
    return err[-1][:120]


class ArmFleet:
    """mosquitto and `edge-coordinator serve` on the host, `edge-agent run` in each root
    (as the Pi of BOARD[arch]); the model is the multi-depth digits bundle."""

    def __init__(self, roots: list[Root], inputs: dict[str, Path]) -> None:
        from tests.integration.conftest import Fleet

        self.roots, self.inputs = roots, inputs
        self.tmp = Path(tempfile.mkdtemp(prefix="arm-fleet-", dir=WORK))
        self.fleet = Fleet(self.tmp, f"t-arm{os.getpid()}/edgeft/v1")
        self.broker: object | None = None
        self.coord: object | None = None
        self.agents: dict[str, subprocess.Popen] = {}
        self.ids: dict[str, str] = {}  # arch -> device id

    def log(self, arch: str) -> str:
        return (self.tmp / f"agent-{arch}.log").read_text(errors="replace")

    def logs(self) -> str:
        return self.coord.log_tail() + "".join(f"\n--- agent {a}\n{self.log(a)[-3000:]}" for a in self.agents)

    def start(self) -> str:
        from edge_agent import keys
        from edge_agent.config import public_key_text, render_config
        from edge_agent.int8.bundle import pack_bundle
        from edge_agent.transport.broker import MosquittoBroker
        from tests.integration.conftest import ServeProcess, board_tree, online_devices, wait_for

        self.broker = MosquittoBroker(workdir=self.tmp / "mosquitto")
        self.broker.start()
        self.coord = ServeProcess(self.fleet, self.tmp, self.broker.port).start()
        for root in self.roots:
            home = root.path / "work" / "agent"
            key = keys.generate_private_key()
            self.ids[root.arch] = keys.fingerprint(key)
            keys.save_private_key(home / "state" / "keys" / "device.key", key)
            board_tree(home / "board", battery_pct=90, board=BOARD[root.arch])
            text = render_config(device_name=f"pi-{root.arch}", fleet=self.fleet.topics.fleet,
                                 broker_host="127.0.0.1", broker_port=self.broker.port,
                                 coordinator_public_key=public_key_text(self.fleet.coord_key),
                                 state_dir=Path("/work/agent/state"), device_id=self.ids[root.arch],
                                 sysfs_root="/work/agent/board", data_dir="/work/data/data.npz",
                                 topic_prefix=self.fleet.topics.prefix)
            (home / "agent.toml").write_text(text + "\n[service]\nstate_interval_s = 2\nprogress_interval_s = 2\n")
            self.agents[root.arch] = root.popen("edge-agent", "run", "--config", "/work/agent/agent.toml",
                                                log_path=self.tmp / f"agent-{root.arch}.log")
        archive = pack_bundle(self.inputs["deep"], self.tmp / "digits-deep.tar.gz")
        self.coord.cli("model", "register", str(archive), "--name", "digits", "--version", "1")
        want = set(self.ids.values())
        gone = lambda: [a for a, p in self.agents.items() if p.poll() is not None]  # noqa: E731
        assert wait_for(lambda: set(online_devices(self.coord)) == want or gone(), 900, 1.0), self.logs()
        assert not gone(), self.logs()
        with self.coord.registry() as reg:
            caps = {arch: {k: d.state.get(k) for k in ("mxnet", "native")} for d in reg.list_devices()
                    for arch, did in self.ids.items() if d.id == did}
        for arch, cap in caps.items():  # what each hello said it can run
            assert cap["mxnet"] is (arch == "arm64") and cap["native"] in NEON[arch], caps
        return f"online with hello capabilities {caps}"

    def train(self, *args: str) -> tuple[str, object]:
        """`edge-coordinator train` of one round on `digits`; its job record."""
        done = self.coord.cli("train", "--model", "digits", "--devices", "all", "--rounds", "1", "--deadline",
                              "1200s", "--epochs", "1", "--batch-size", "16", "--budget-wh", "1", "--update-bytes",
                              "4096", "--poll", "2", *args, check=False, timeout=1500)
        assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{self.logs()}"
        assert "-> new version" in done.stdout, done.stdout
        with self.coord.registry() as reg:
            job = max(reg.list_jobs(), key=lambda j: j.created_at)
        return done.stdout.strip().splitlines()[-1][:100], job

    def updates(self, job: object) -> dict[str, object]:
        """arch -> the accepted update of each device that took part in the job's round."""
        from edge_agent.coordinator.records import UpdateStatus

        with self.coord.registry() as reg:
            (rnd,) = reg.list_rounds(job.id)
            updates = {u.device_id: u for u in reg.list_updates(job.id, 1)}
        arch_of = {did: arch for arch, did in self.ids.items()}
        assert set(updates) == set(rnd.participants), (rnd.participants, updates)
        assert all(u.status is UpdateStatus.ACCEPTED for u in updates.values()), updates
        return {arch_of[did]: u for did, u in updates.items()}

    def stop(self) -> None:
        for proc in self.agents.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.agents.values():
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if self.coord is not None:
            self.coord.stop()
        self.fleet.close()
        if self.broker is not None:
            self.broker.stop()


def _trained(updates: dict[str, object]) -> str:
    return "; ".join(f"{arch}: {u.metrics.get('trainer')} at depth {u.metrics.get('depth')}, accuracy "
                     f"{u.metrics.get('accuracy_before', 0):.2f} -> {u.metrics.get('accuracy_after', 0):.2f}"
                     for arch, u in sorted(updates.items()))


def deep_round_on_every_device(fleet: ArmFleet) -> str:
    """Job A: every device trains depth 1 (conv3 + BN + dense) in numpy -- the armhf device
    too, since numpy trains that depth (before issue 35 #25 it was left out as 'needs MXNet')."""
    last, job = fleet.train("--min-devices", str(len(fleet.ids)), "--depth", "1")
    updates = fleet.updates(job)
    assert set(updates) == set(fleet.ids), updates
    for arch, u in updates.items():
        assert u.metrics.get("depth") == 1 and u.metrics.get("trainer") == "numpy", (arch, u.metrics)
    return f"{last}; {_trained(updates)}"


def mxnet_round(fleet: ArmFleet) -> str:
    """Job B: `--param trainer=mxnet` on the same depth: the armhf device is not selected
    (no MXNet), the arm64 one trains the deep tail with MXNet Gluon (issue 35 #24)."""
    last, job = fleet.train("--min-devices", "1", "--depth", "1", "--param", "trainer=mxnet")
    updates = fleet.updates(job)
    assert set(updates) == {"arm64"}, updates
    assert updates["arm64"].metrics.get("trainer") == "mxnet", updates["arm64"].metrics
    assert updates["arm64"].metrics.get("depth") == 1, updates["arm64"].metrics
    patched = f"model digits/{job.model_version}: fetching the head patch onto 1"
    assert patched in fleet.log("arm64"), fleet.log("arm64")[-3000:]  # job A's version, as a patch on its root
    return f"{last}; {_trained(updates)}; {patched[6:]}"


def run_fleet(roots: list[Root], res: Results, inputs: dict[str, Path]) -> None:
    arches = " + ".join(r.arch for r in roots)
    fleet = ArmFleet(roots, inputs)
    try:
        if not res.check(f"fleet: serve + mosquitto on the host, `edge-agent run` in {arches}", fleet.start):
            return
        res.check(f"fleet: job A, --depth 1 on {arches} (numpy)", lambda: deep_round_on_every_device(fleet))
        if "arm64" in fleet.ids:
            res.check("fleet: job B, --depth 1 --param trainer=mxnet (arm64 only: MXNet)", lambda: mxnet_round(fleet))
    finally:
        fleet.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="arm64,armhf", help="comma-separated Debian architectures")
    parser.add_argument("--keep", action="store_true", help=f"keep {WORK}/root-<arch> after the run")
    parser.add_argument("--serial", action="store_true", help="prepare one architecture after the other")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("tests/arm/emulated_pi.py: needs root (debootstrap, chroot, mount)", file=sys.stderr)
        return 77
    start = time.monotonic()
    res = Results()
    inputs: dict[str, Path] = {}

    def prepare() -> str:
        inputs.update(make_inputs(BUILD / "inputs"))
        return ", ".join(p.name for p in inputs.values())

    arches = [a.strip() for a in args.arch.split(",") if a.strip()]
    roots = [Root(arch) for arch in arches if res.check(f"{arch}: binfmt", lambda a=arch: ensure_binfmt(a))]
    try:
        if roots and res.check("host: bundles and data", prepare):
            with ThreadPoolExecutor(max_workers=1 if args.serial else len(roots)) as pool:
                list(pool.map(lambda root: prepare_arch(root, res, inputs), roots))
            ready = [r for r in roots if r.installed]
            if ready:
                run_fleet(ready, res, inputs)
    finally:
        for root in roots:
            root.umount()
            if not args.keep and root.path.exists():
                shutil.rmtree(root.path, ignore_errors=True)
    print(f"{len(res.passed)} passed, {len(res.failed)} failed in {time.monotonic() - start:.0f} s", flush=True)
    return 0 if not res.failed else 1


if __name__ == "__main__":
    raise SystemExit(main())
