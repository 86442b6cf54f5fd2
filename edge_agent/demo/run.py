"""`make demo`: a whole fleet on this machine, trained by remote-triggered rounds.

    python -m edge_agent.demo [--devices 4] [--rounds 3] [--out demo-out]

(tests/integration/test_demo.py runs a shortened demo, 2 devices and 2 rounds, and checks
its report.)

1. trains the base model (the digits CNN on clean digits) and packs it as a bundle;
2. starts `edge-coordinator serve --embedded-broker --auto-approve` (amqtt on 127.0.0.1)
   and registers the bundle (`edge-coordinator model register`);
3. sets up N devices with `edge-agent init` -- each with its own state directory, its own
   non-IID share of the digits seen through its own camera, and a simulated Raspberry Pi 4
   whose small battery drains while it trains -- and starts N `edge-agent run` processes;
4. runs `edge-coordinator train --rounds R` (its live progress is what you see), then
   prints one line per round: devices, local accuracy before/after (mean over devices, on
   their own validation split), the global model's accuracy on held-out digits, bytes up
   and down, compression ratio and energy; writes demo-out/demo-report.json and
   demo-out/demo-plot.png.

While it runs, the coordinator serves its read-only web dashboard (`serve --ui`, by default
on http://127.0.0.1:8080/ or a free port; `--ui off` to skip, `--ui-linger S` to keep it up
after the report). Every process it starts is stopped on exit, Ctrl-C included. Logs: demo-out/**/*.log.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..coordinator.strategies import AGGREGATORS

PY = sys.executable
T0 = time.monotonic()


def say(text: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {text}", flush=True)


class Processes:
    """Child processes, each with its log file; all stopped by `stop_all` (SIGTERM, then KILL)."""

    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.procs.append((name, proc))
        return proc

    def check(self) -> None:
        for name, proc in self.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with code {proc.returncode}; see its log under demo-out/")

    def stop_all(self, timeout: float = 30.0) -> None:
        for _, proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for _, proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        self.procs.clear()


def run_cli(argv: list[str], *, log: Path | None = None) -> str:
    """Run a command to completion; its output (stdout) is returned, and logged if asked."""
    done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=300)
    if log is not None:
        with open(log, "a") as out:
            out.write(f"$ {' '.join(argv)}\n{done.stdout}{done.stderr}\n")
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv[2:])}` failed ({done.returncode}): {(done.stderr or done.stdout)[-800:]}")
    return done.stdout


def wait_for(what: str, predicate: Any, timeout: float, procs: Processes) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        procs.check()
        if predicate():
            return
        time.sleep(0.2)
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")


DEMO_DEPTHS = 2  # the digits CNN's two convs below the pool: a device may train them too (--depth)


def build_base(out: Path, n_devices: int) -> Path:
    from ..int8.bundle import load_bundle
    from ..sim import scenario as demo

    target = out / "base-bundle"
    with contextlib.suppress(Exception):
        if len(load_bundle(target).manifest.depths) == DEMO_DEPTHS + 1:  # built by this demo version
            say(f"base model: reusing {target} (delete it to train again)")
            return target
    say("training the base model (digits CNN on clean digits, no device camera) ...")
    sc = demo.scenario(n_devices=n_devices)  # the base shares: no device's data, no held-out digit
    demo.build_bundle(target, sc.base_x, sc.base_y, name="digits", version="1", overwrite=True, depths=DEMO_DEPTHS)
    say(f"base model: bundle at {target} (int8 backbone + MXNet head; {DEMO_DEPTHS} deeper training depths)")
    return target


SHIFTED_BLUR = 0.6  # pixels of an 8x8 digit: a wider blur leaves little to read


def setup_devices(args: argparse.Namespace, out: Path, port: int, key: str) -> dict[str, dict[str, Any]]:
    from ..sim import scenario as demo
    from ..sim.camera_shift import ShiftedCamera, shift_images
    from .fleet import write_sysfs

    sc = demo.scenario(n_devices=args.devices)
    devices: dict[str, dict[str, Any]] = {}
    inits = []
    for i, dev in enumerate(sc.devices):
        name = f"pi-{i + 1}"
        home = out / "devices" / name
        pct = max(50.0, 95.0 - 5.0 * i)
        shifted = i == len(sc.devices) - 1 and len(sc.devices) > 1  # the last device's camera is far off
        images = shift_images(dev.images, ShiftedCamera(blur_sigma=SHIFTED_BLUR)) if shifted else dev.images
        data = demo.write_data(home / "data", images, dev.labels, "npz")
        root = write_sysfs(home / "sysfs", battery_pct=pct)
        config = home / "agent.toml"
        argv = [PY, "-m", "edge_agent.agent.cli", "init", "--broker", f"127.0.0.1:{port}", "--fleet", "demo",
                "--coordinator-key", key, "--state-dir", str(home / "state"), "--config", str(config),
                "--sysfs-root", str(root), "--data-dir", str(data), "--name", name, "--force"]
        inits.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        devices[name] = {"home": home, "root": root, "state": home / "state", "config": config, "battery": pct,
                         "samples": len(dev.labels), "classes": int(len(set(dev.labels.tolist()))),
                         "camera": "strongly shifted (blur, gamma, tint, noise)" if shifted else "its own"}
    for (name, info), proc in zip(devices.items(), inits, strict=True):
        text = proc.communicate(timeout=120)[0].decode(errors="replace")
        if proc.returncode != 0:
            raise RuntimeError(f"edge-agent init for {name} failed: {text[-800:]}")
        (info["home"] / "init.log").write_text(text)
        with open(info["config"], "a") as conf:  # quicker state reports than a field device needs
            conf.write("\n[service]\nstate_interval_s = 2\nupload_ack_timeout_s = 20\nupload_retry_min_s = 1\n"
                       "upload_retry_max_s = 10\n")
    return devices


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m edge_agent.demo",
                                description="A coordinator and N agent processes on this machine: base model, "
                                            "then R remote-triggered fine-tune rounds; prints a per-round table.",
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="example:\n  python -m edge_agent.demo --devices 4 --rounds 3")
    p.add_argument("--devices", type=int, default=4, help="agent processes (default 4)")
    p.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    p.add_argument("--min-devices", type=int, default=None,
                   help="accepted updates a round needs (default: all devices but one, at least 1)")
    p.add_argument("--epochs", type=int, default=3, help="local epochs per round (default 3)")
    p.add_argument("--depth", default="auto", metavar="auto|head|N",
                   help="how deep the devices train (default auto: each device's planner decides)")
    p.add_argument("--update-bytes", type=int, default=None,
                   help="byte budget of each update (default: the agent's, which adapts to the trained tensors)")
    p.add_argument("--deadline", default="150s", help="per-round deadline (default 150s)")
    p.add_argument("--aggregator", choices=AGGREGATORS, default=None,
                   help="the jobs' aggregation rule (default: the coordinator's choice for the fleet -- trust with "
                        "the demo's server set, median_trust with --no-server-set)")
    p.add_argument("--no-server-set", dest="server_set", action="store_false",
                   help="register the base model without its labelled server set (half the held-out digits)")
    p.add_argument("--out", default="demo-out", help="working directory (default ./demo-out)")
    p.add_argument("--ui", default="auto", metavar="ADDR:PORT|auto|off",
                   help="the coordinator's web dashboard (default auto: 127.0.0.1:8080, or a free port if taken)")
    p.add_argument("--ui-linger", type=float, default=0.0, metavar="SECONDS",
                   help="keep the coordinator and its dashboard up this long after the report (default 0)")
    args = p.parse_args(argv)
    if not 0 <= args.ui_linger <= 86400:
        p.error("--ui-linger must be 0..86400 seconds")
    if not 1 <= args.devices <= 16 or not 1 <= args.rounds <= 20:
        p.error("--devices must be 1..16 and --rounds 1..20")
    if args.min_devices is None:
        args.min_devices = max(1, args.devices - 1)
    elif not 1 <= args.min_devices <= args.devices:
        p.error("--min-devices must be 1..--devices")

    def interrupted(*_: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    procs = Processes()
    batteries: list[Any] = []
    try:
        out = Path(args.out).resolve()
        for stale in ("coordinator", "devices", "demo-report.json", "demo-plot.png"):
            path = out / stale
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        out.mkdir(parents=True, exist_ok=True)
        return run(args, out, procs, batteries)
    except KeyboardInterrupt:
        print("\ninterrupted: stopping the coordinator and the agents ...", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1
    finally:
        for battery in batteries:
            battery.stop()
        procs.stop_all()


def run(args: argparse.Namespace, out: Path, procs: Processes, batteries: list[Any]) -> int:
    from ..coordinator.registry import Registry
    from ..coordinator.service_files import read_serve_file
    from ..transport.broker import free_port
    from .fleet import (
        BATTERY_WH,
        LOAD_W,
        BatterySimulator,
        GlobalEvaluator,
        held_out,
        server_and_test,
    )
    from .report import collect, plot, print_table

    bundle = build_base(out, args.devices)
    port = free_port()
    coord = out / "coordinator"
    cli = [PY, "-m", "edge_agent.coordinator.cli"]
    ui = dashboard_address(args.ui)
    procs.start("coordinator", [*cli, "serve", "--embedded-broker", "--broker", f"127.0.0.1:{port}", "--auto-approve",
                                "--fleet", "demo", "--state-dir", str(coord), "--tick", "0.5",
                                *(["--ui", ui] if ui else [])], out / "coordinator.log")
    say(f"coordinator: `edge-coordinator serve --embedded-broker` on 127.0.0.1:{port} (amqtt in-process), "
        f"state {coord}")
    wait_for("the coordinator to connect", lambda: (read_serve_file(coord) or {}).get("connected"), 60, procs)
    if ui:
        say(f"dashboard (read-only, live): http://{ui}/  -- open it in a browser while the demo runs")
    key = run_cli([*cli, "key", "--state-dir", str(coord)]).strip()
    x, y = held_out(args.devices)
    (server_x, server_y), (x, y) = server_and_test(x, y, args.devices)
    register = [*cli, "model", "register", str(bundle), "--name", "digits", "--version", "1", "--state-dir", str(coord)]
    if args.server_set:
        from ..sim import scenario as demo

        register += ["--validation", str(demo.write_data(out / "server-set", server_x, server_y, "npz"))]
    run_cli(register, log=out / "cli.log")
    say(f"registered the base bundle as model digits 1; coordinator key {key[:16]}..."
        + (f"; its server set: {len(server_y)} labelled held-out digits the coordinator scores every version on"
           if args.server_set else "; no server set (--no-server-set)"))

    devices = setup_devices(args, out, port, key)
    for name, info in devices.items():
        procs.start(name, [PY, "-m", "edge_agent.agent.cli", "run", "--config", str(info["config"])],
                    info["home"] / "agent.log")
    battery = BatterySimulator({n: (d["root"], d["state"], d["battery"]) for n, d in devices.items()}).start()
    batteries.append(battery)
    say(f"{len(devices)} agents started: " + ", ".join(
        f"{n} ({d['samples']} digits, {d['classes']} classes, battery {d['battery']:.0f}%)" for n, d in devices.items()))

    evaluator = GlobalEvaluator(bundle, x, y, cache_dir=out / "cache")
    say(f"global test set: {len(y)} held-out digits through the devices' cameras (int8 backbone: {evaluator.engine})")

    registry = Registry(state_dir=coord)
    try:
        def online() -> bool:
            now = time.time()
            return sum(d.approved and d.is_online(now, 300) and d.battery_pct is not None
                       for d in registry.list_devices()) >= len(devices)

        wait_for(f"{len(devices)} devices to enrol and report", online, 120, procs)
        say(f"{len(devices)} devices enrolled and online; `edge-coordinator train` (its live progress follows):")
        train = [*cli, "train", "--model", "digits@1", "--devices", "all", "--rounds", str(args.rounds),
                 "--min-devices", str(args.min_devices), "--deadline", args.deadline, "--budget-wh", "0.05",
                 "--epochs", str(args.epochs), "--batch-size", "16",
                 *(["--update-bytes", str(args.update_bytes)] if args.update_bytes else []),
                 *(["--aggregator", args.aggregator] if args.aggregator else []),
                 *(["--depth", args.depth] if args.depth != "auto" else []), "--state-dir", str(coord)]
        print("  $ edge-coordinator " + " ".join(train[3:]), flush=True)
        code = subprocess.run(train, check=False).returncode
        if code != 0:
            raise RuntimeError(f"edge-coordinator train exited with {code}; see {out}/coordinator.log")
        fleet = {n: {"samples": d["samples"], "classes": d["classes"], "battery": d["battery"],
                     "battery_end": round(battery.pct(n), 1), "simulated_wh": round(battery.spent[n], 5),
                 "camera": d["camera"]}
                 for n, d in devices.items()}
        report = collect(registry, evaluator, devices=fleet)
        last = (report["rounds"] or [{}])[-1].get("per_device") or {}
        report["adaptation"] = {n: {"camera": d["camera"], **{k: last.get(n, {}).get(k) for k in ("depth", "adapted", "shift",
                                                                                     "adaptation")}}
                                for n, d in devices.items()}
    finally:
        registry.close()
    report.update(wall_time_s=round(time.monotonic() - T0, 1), battery_wh=BATTERY_WH, load_w=LOAD_W)
    print_table(report)
    from ..train.job_adapt import shift_text

    for name, ad in report["adaptation"].items():  # what each device's last job did below the cut
        shift = "" if ad["shift"] is None else f"shift {shift_text(ad['shift'])} from the base model's images; "
        say(f"{name} (camera: {ad['camera']}): {shift}its int8 prefix "
            f"{'adapted to its camera (--adapt: its first BatchNorm layers re-estimated, re-quantised)' if ad['adapted'] else 'as the bundle has it'}"
            f", trained at depth {ad['depth']} ({ad['adaptation']})")
    (out / "demo-report.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out / "demo-plot.png")
    say(f"wrote {out / 'demo-report.json'} and {out / 'demo-plot.png'}")
    from ..sim.application import demo_loop

    demo_loop(out, devices, say)  # the local inference service's feedback loop (edge_agent/sim/application.py)
    if ui and args.ui_linger > 0:
        say(f"the dashboard stays up at http://{ui}/ for {args.ui_linger:.0f} s (Ctrl-C ends it sooner)")
        time.sleep(args.ui_linger)
    return 0


def dashboard_address(choice: str) -> str | None:
    """`--ui`: off, an explicit ADDR:PORT, or auto (127.0.0.1:8080 when free, else a free port)."""
    if choice == "off":
        return None
    if choice != "auto":
        return choice
    import socket

    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", 8080))
            return "127.0.0.1:8080"
        except OSError:
            pass
    from ..transport.broker import free_port

    return f"127.0.0.1:{free_port()}"


if __name__ == "__main__":
    raise SystemExit(main())
