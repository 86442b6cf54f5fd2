"""`make test-arm`: the project on an emulated Raspberry Pi OS (Debian Bookworm arm64, and
armhf for 32-bit Pi OS), under qemu-user with binfmt_misc, as root.

For each architecture:
  1. a Bookworm root file system from Debian's packages (debootstrap), cached as a tarball
     under build/arm/ and unpacked fresh for every run (outside the source tree:
     $EDGE_AGENT_ARM_WORK, default /var/tmp/edge-agent-test-arm);
  2. `make deb ARCH=<arch>` on the host, `apt-get install ./edge-agent_*_<arch>.deb` in the
     root (chroot; the postinst builds the venv from the wheels with the root's Python 3.11);
  3. in the root: `edge-agent doctor`, `edge-agent probe` (the kernels' auxv check must win
     over the host's /proc/cpuinfo), `edge-agent kernels --bench` (native must run a NEON
     variant), `edge-agent finetune` with the numpy trainer and -- arm64 -- the MXNet trainer
     on a deep tail (conv + BatchNorm + dense); armhf must refuse MXNet with one line;
  4. arm64: one remote-triggered round of the chroot's agent against `edge-coordinator
     serve` and mosquitto on the host (the chroot shares the host's network namespace).
Bundles and data are made on the host. Prints one line per check and "N passed, N failed".

What emulation cannot tell: speed, sensors, accelerators, thermal behaviour (see
docs/deployment.md, "Verified under emulation").

usage: tests/arm/emulated_pi.py [--arch arm64,armhf] [--keep]
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
import time
import traceback
from collections.abc import Callable
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

    def run(self, *cmd: str, timeout: float = 1800, check: bool = True) -> subprocess.CompletedProcess:
        return sh(["chroot", str(self.path), "/usr/bin/env", "-i", *ENV, *cmd], timeout=timeout, check=check)

    def popen(self, *cmd: str, log_path: Path) -> subprocess.Popen:
        out = open(log_path, "ab")  # noqa: SIM115 - handed to the child
        try:
            return subprocess.Popen(["chroot", str(self.path), "/usr/bin/env", "-i", *ENV, *cmd], stdout=out,
                                    stderr=subprocess.STDOUT)
        finally:
            out.close()


# ---------------------------------------------------------------------------- host-made inputs

def make_inputs(dest: Path) -> dict[str, Path]:
    """The digits bundle (head: one dense layer), a deep-tail bundle (conv3 + BN + dense,
    split after pool1) and one device's data, made on the host with MXNet; cached."""
    import numpy as np

    from edge_agent.int8.bundle import load_bundle
    from edge_agent.int8.bundle_create import create_bundle
    from edge_agent.sim import scenario as demo
    from edge_agent.sim.models import digits_cnn, fit_classifier

    dest.mkdir(parents=True, exist_ok=True)
    digits = demo.ensure_bundle(dest / "digits")
    deep = dest / "digits-deep"
    try:
        load_bundle(deep)
    except Exception:  # noqa: BLE001 - missing or half-written: build it
        sc = demo.scenario(seed=0)
        net = digits_cnn()
        fit_classifier(net, sc.base_x, sc.base_y, epochs=2, seed=0)
        calib = demo.to_pixels(sc.base_x[:64]).astype(np.float32) * np.float32(demo.PIXEL_SCALE)
        create_bundle(net, deep, calibration=calib, labels=demo.LABELS, name="digits-deep", version="1",
                      input_shape=(1, 8, 8), scale=demo.PIXEL_SCALE, split="features_pool1_fwd", overwrite=True)
    dev = demo.scenario().devices[2]
    data = demo.write_data(dest / "data", dev.images, dev.labels, "npz")
    return {"digits": Path(digits), "deep": deep, "data": data}


# ---------------------------------------------------------------------------- the checks

def build_deb(arch: str) -> Path:
    # `make test-arm` has made the venv (its prerequisite): -o keeps `make deb` from redoing it.
    sh(["make", "-C", str(REPO), "-o", ".venv/.installed-test", "deb", f"ARCH={arch}"], timeout=3600)
    (deb,) = (REPO / "dist").glob(f"edge-agent_*_{arch}.deb")
    return deb


def run_arch(arch: str, res: Results, inputs: dict[str, Path], *, keep: bool) -> None:
    root = Root(arch)
    box: dict[str, Path] = {}
    if not res.check(f"{arch}: binfmt", lambda: ensure_binfmt(arch)):
        return
    if not res.check(f"{arch}: root file system", lambda: ensure_rootfs(arch)):
        return

    def deb() -> str:
        box["deb"] = build_deb(arch)
        return f"{box['deb'].name} ({box['deb'].stat().st_size / 1e6:.1f} MB)"

    if not res.check(f"{arch}: make deb ARCH={arch}", deb):
        return
    try:
        if not res.check(f"{arch}: unpack + mount", root.unpack):
            return

        def install() -> str:
            work = root.path / "work"
            shutil.copytree(inputs["digits"], work / "digits")
            shutil.copytree(inputs["deep"], work / "digits-deep")
            shutil.copytree(inputs["data"].parent, work / "data")
            shutil.copyfile(box["deb"], root.path / "tmp" / box["deb"].name)
            done = root.run("apt-get", "install", "-y", "--no-install-recommends", f"/tmp/{box['deb'].name}")
            version = root.run("edge-agent", "--version").stdout.strip()
            return f"{version}; {done.stdout.strip().splitlines()[-1][:120]}"

        if not res.check(f"{arch}: apt-get install ./{box['deb'].name}", install):
            return
        res.check(f"{arch}: edge-agent doctor", lambda: doctor(root, arch))
        res.check(f"{arch}: edge-agent probe", lambda: probe(root, arch))
        res.check(f"{arch}: edge-agent kernels --bench", lambda: kernels(root, arch))
        res.check(f"{arch}: edge-agent finetune --trainer numpy", lambda: finetune(root, "numpy", "/work/digits"))
        if arch == "arm64":
            res.check(f"{arch}: edge-agent finetune --trainer mxnet (deep tail)",
                      lambda: finetune(root, "mxnet", "/work/digits-deep"))
            res.check(f"{arch}: remote-triggered round against the host's coordinator + mosquitto",
                      lambda: fleet_round(root, inputs))
        else:
            res.check(f"{arch}: --trainer mxnet refused in one line (no MXNet on 32-bit ARM)",
                      lambda: no_mxnet(root))
    finally:
        root.umount()
        if not keep and root.path.exists():
            shutil.rmtree(root.path, ignore_errors=True)


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


def finetune(root: Root, trainer: str, bundle: str) -> str:
    name = f"ft-{trainer}"
    root.run("edge-agent", "finetune", "--model", bundle, "--data", "/work/data/data.npz", "--trainer",
             trainer, "--epochs", "2", "--state-dir", f"/work/{name}", "--report", f"/work/{name}.json",
             "-q", timeout=1800)
    report = json.loads((root.path / "work" / f"{name}.json").read_text())
    assert report["epochs_done"] == 2 and report["trainer"] == trainer, {k: report.get(k) for k in ("epochs_done",
                                                                                                   "trainer")}
    params = sorted(report["head"]["params"])
    if bundle.endswith("deep"):
        assert any("conv3" in p for p in params) and any("bn3" in p for p in params), params
    acc = report["accuracy"]
    return (f"accuracy {acc['before']:.3f} -> {acc['after']:.3f} on {acc['validation_samples']} samples, "
            f"engine {report['engine']['name']}, trained {len(params)} tensors")


def no_mxnet(root: Root) -> str:
    done = root.run("edge-agent", "finetune", "--model", "/work/digits-deep", "--data", "/work/data/data.npz",
                    "--trainer", "mxnet", "--epochs", "1", "--state-dir", "/work/ft-refused", check=False)
    err = done.stderr.strip().splitlines()
    assert done.returncode == 69 and "Traceback" not in done.stderr, (done.returncode, done.stderr[-2000:])
    assert any("MXNet is not installed" in line for line in err), err
    return err[-1][:120]


def fleet_round(root: Root, inputs: dict[str, Path]) -> str:
    """`edge-coordinator serve` + mosquitto on the host, `edge-agent run` in the chroot;
    `edge-coordinator train` runs one round; the agent's update is aggregated."""
    from edge_agent import keys
    from edge_agent.config import public_key_text, render_config
    from edge_agent.int8.bundle import pack_bundle
    from edge_agent.transport.broker import MosquittoBroker
    from tests.integration.conftest import (
        Fleet,
        ServeProcess,
        board_tree,
        online_devices,
        register_digits,
        wait_for,
    )

    tmp = Path(tempfile.mkdtemp(prefix="arm-round-", dir=WORK))
    broker = MosquittoBroker(workdir=tmp / "mosquitto")
    broker.start()
    fleet = Fleet(tmp, f"t-arm{os.getpid()}/edgeft/v1")
    coord = ServeProcess(fleet, tmp, broker.port)
    agent = None
    try:
        coord.start()
        home = root.path / "work" / "agent"
        key = keys.generate_private_key()
        keys.save_private_key(home / "state" / "keys" / "device.key", key)
        board_tree(home / "board", battery_pct=90)
        text = render_config(device_name="pi-arm64", fleet=fleet.topics.fleet, broker_host="127.0.0.1",
                             broker_port=broker.port, coordinator_public_key=public_key_text(fleet.coord_key),
                             state_dir=Path("/work/agent/state"), device_id=keys.fingerprint(key),
                             sysfs_root="/work/agent/board", data_dir="/work/data/data.npz",
                             topic_prefix=fleet.topics.prefix)
        text += "\n[service]\nstate_interval_s = 2\nprogress_interval_s = 2\n"
        (home / "agent.toml").write_text(text)
        agent = root.popen("edge-agent", "run", "--config", "/work/agent/agent.toml", log_path=tmp / "agent.log")
        archive = pack_bundle(inputs["digits"], tmp / "digits.tar.gz")
        register_digits(coord, archive.read_bytes(), tmp)

        def agent_log() -> str:
            return (tmp / "agent.log").read_text(errors="replace")[-4000:]

        assert wait_for(lambda: len(online_devices(coord)) == 1 or agent.poll() is not None, 600), \
            coord.log_tail() + agent_log()
        assert agent.poll() is None, agent_log()
        done = coord.cli("train", "--model", "digits", "--devices", "all", "--rounds", "1", "--min-devices", "1",
                         "--deadline", "1200s", "--epochs", "1", "--batch-size", "16", "--budget-wh", "1",
                         "--update-bytes", "1024", "--poll", "1", check=False, timeout=1500)
        assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{coord.log_tail()}\n{agent_log()}"
        assert "-> new version" in done.stdout, done.stdout
        with coord.registry() as reg:
            (dev,) = reg.list_devices()
            caps = {k: dev.state.get(k) for k in ("mxnet", "trainers", "native")}
        assert caps["mxnet"] is True and caps["native"] in NEON["arm64"], caps
        return f"{done.stdout.strip().splitlines()[-1][:100]}; hello capabilities {caps}"
    finally:
        if agent is not None and agent.poll() is None:
            agent.terminate()
            try:
                agent.wait(60)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait(10)
        coord.stop()
        fleet.close()
        broker.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="arm64,armhf", help="comma-separated Debian architectures")
    parser.add_argument("--keep", action="store_true", help=f"keep {WORK}/root-<arch> after the run")
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

    if res.check("host: bundles and data", prepare):
        for arch in [a.strip() for a in args.arch.split(",") if a.strip()]:
            run_arch(arch, res, inputs, keep=args.keep)
    print(f"{len(res.passed)} passed, {len(res.failed)} failed in {time.monotonic() - start:.0f} s", flush=True)
    return 0 if not res.failed else 1


if __name__ == "__main__":
    raise SystemExit(main())
