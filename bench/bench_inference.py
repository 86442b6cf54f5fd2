"""The local inference service (edge_agent/inference/): what an application gets from it.

1. Latency and throughput of `POST /v1/predict` (one image per request, a keep-alive client
   on the Unix socket, a separate `edge-agent serve` process) against the engine's bare
   per-image time (the same selected engine and threads, `runner.run` on one image in this
   process), side by side: rounds interleave the two, the overhead is the median of the
   rounds' p50 ratios. On the demo digits CNN (8x8) and a MobileNetV2 bundle (w0.5, 96x96).
2. p99 while a local fine-tune runs in the background (POST /v1/finetune; the child in
   SCHED_IDLE, `training_priority = "idle"`, and for contrast "normal") against the idle p99.
3. The daemon's RSS (`edge-agent run` with [serve], a real mosquitto, the demo model loaded
   and 200 requests served) and whether libmxnet is mapped; the daemon without [serve] beside it.
4. A hot swap under 100 requests/s (open loop, 4 client threads): a new fleet version
   installed mid-run; failed requests, and every response's version.
5. The feedback loop (edge_agent.sim.application.feedback_round) on non-IID camera digits
   (the demo CNN with 2 trainable depths; 3 devices x 2 seeds, a base model per seed) and on
   textures (MobileNetV2 w0.5 at 64x64, 4 depths; 3 devices x 2 scenario seeds): accuracy of
   the served model on the application's next samples before and after N posted samples and
   one local fine-tune, and whether the personal model is served only where it is better on
   the device's held-out samples.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def _cache() -> Path:
    return Path(os.environ.get("EDGE_AGENT_BENCH_CACHE") or ROOT / "build" / "bench-cache")


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.1f} (1 min), {five:.1f} (5 min) on {os.cpu_count()} cores"


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


class Device:
    """A state directory with `bundle` installed as <name>/1, served by `edge-agent serve`
    (a separate process) or in this process (InferenceServer)."""

    def __init__(self, root: Path, bundle: Path, name: str, *, cache: Path, **serve: Any) -> None:
        from edge_agent import keys
        from edge_agent.config import public_key_text

        self.root, self.state, self.data, self.sock = root, root / "state", root / "data", root / "inference.sock"
        models = self.state / "models" / name
        models.mkdir(parents=True)
        shutil.copytree(bundle, models / "1")
        os.symlink("1", models / "current")
        cache.mkdir(parents=True, exist_ok=True)
        os.symlink(cache, self.state / "cache")  # one engine decision per backbone for every device
        self.name = name
        settings = {"enabled": True, "socket": str(self.sock), "refresh_s": 0.25, **serve}
        key = public_key_text(keys.generate_private_key().public_key())
        keys.save_private_key(self.state / "keys" / "device.key", keys.generate_private_key())  # for `run`
        self.serve_lines = "\n".join(f"{k} = {json.dumps(v)}" for k, v in settings.items())
        self.key = key
        self.config = self._config()
        self.proc: subprocess.Popen[bytes] | None = None

    def _config(self, port: int = 1883, serve: bool = True) -> Path:
        path = self.root / ("agent.toml" if serve else "agent-noserve.toml")
        path.write_text(f'[device]\nname = "bench"\nstate_dir = "{self.state}"\nprofile = "raspberry-pi-4"\n'
                        f'[broker]\nhost = "127.0.0.1"\nport = {port}\n[coordinator]\npublic_key = "{self.key}"\n'
                        f'[data]\ndir = "{self.data}"\n' + (f"[serve]\n{self.serve_lines}\n" if serve else ""))
        return path

    def start(self, command: str = "serve", config: Path | None = None) -> Device:
        from edge_agent.sim.application import LocalClient

        log = open(self.root / f"{command}.log", "ab")  # noqa: SIM115 - the child's
        self.proc = subprocess.Popen([sys.executable, "-m", "edge_agent.cli", command, "--config",
                                      str(config or self.config)], cwd=ROOT, stdout=log, stderr=log)
        log.close()
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError((self.root / f"{command}.log").read_text()[-2000:])
            if self.sock.exists():
                try:
                    if LocalClient(str(self.sock), timeout=5).request("GET", "/v1/health")[0] == 200:
                        return self
                except OSError:
                    pass
            time.sleep(0.1)
        raise RuntimeError("the service did not come up")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(60)
        self.proc = None

    def rss_mb(self) -> float:
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
        return float("nan")

    def maps_mxnet(self) -> bool:
        assert self.proc is not None
        return "libmxnet" in Path(f"/proc/{self.proc.pid}/maps").read_text()


def _timed_requests(client: Any, x: np.ndarray, n: int, offset: int = 0) -> list[float]:
    from edge_agent.sim.application import npy_bytes

    out = []
    for i in range(n):
        body = npy_bytes(x[(offset + i) % len(x)])
        t0 = time.perf_counter()
        status, _ = client.request("POST", "/v1/predict?k=1", body)
        out.append(time.perf_counter() - t0)
        if status != 200:
            raise RuntimeError(f"predict answered {status}")
    return out


# ---------------------------------------------------------------- 1 + 2: latency


def _latency(tmp: Path, label: str, bundle: Path, name: str, x: np.ndarray, rounds: int, per_round: int,
             finetune_samples: tuple[np.ndarray, list[str]] | None) -> dict[str, Any]:
    from edge_agent.inference.predictor import open_predictor
    from edge_agent.int8.bundle import load_bundle
    from edge_agent.int8.selection import default_probe
    from edge_agent.sim.application import LocalClient

    cache = tmp / "cache"
    dev = Device(tmp / label, bundle, name, cache=cache, max_inflight=64).start()
    try:
        client = LocalClient(str(dev.sock))
        served = client.model()["served"]
        bare = open_predictor(load_bundle(bundle), state_dir=cache, probe=default_probe())
        spec_x = bare.spec.normalise(x)
        ratios, http_all, bare_all = [], [], []
        _timed_requests(client, x, 20)  # warm both
        for i in range(20):
            bare.runner.run(spec_x[i:i + 1])
        t_start, n_http = time.perf_counter(), 0
        for r in range(rounds):
            b = []
            for i in range(per_round):
                t0 = time.perf_counter()
                bare.runner.run(spec_x[(r * per_round + i) % len(x)][None])
                b.append(time.perf_counter() - t0)
            h = _timed_requests(client, x, per_round, r * per_round)
            n_http += len(h)
            ratios.append(statistics.median(h) / statistics.median(b))
            http_all += h
            bare_all += b
        elapsed_http = sum(http_all)
        out: dict[str, Any] = {
            "label": label, "engine": served["engine"], "tail": served["tail"],
            "bare_p50_ms": 1000 * statistics.median(bare_all), "http_p50_ms": 1000 * statistics.median(http_all),
            "http_p99_ms": 1000 * _pct(http_all, 99), "overhead": statistics.median(ratios) - 1.0,
            "overhead_rounds": [round(v - 1, 3) for v in ratios], "throughput": n_http / elapsed_http,
            "requests": n_http, "wall_s": time.perf_counter() - t_start}
        bare.close()
        if finetune_samples is not None:
            out["finetune"] = _p99_under_finetune(client, x, finetune_samples, per_round)
        client.close()
    finally:
        dev.stop()
    if finetune_samples is not None:  # the same, with the fine-tune at normal priority (contrast)
        dev2 = Device(tmp / f"{label}-normal", bundle, name, cache=cache, max_inflight=64,
                      training_priority="normal").start()
        try:
            client = LocalClient(str(dev2.sock))
            _timed_requests(client, x, 20)
            out["finetune_normal"] = _p99_under_finetune(client, x, finetune_samples, per_round)
            client.close()
        finally:
            dev2.stop()
    return out


def _p99_under_finetune(client: Any, x: np.ndarray, samples: tuple[np.ndarray, list[str]], per_round: int
                        ) -> dict[str, Any]:
    """Requests while the local fine-tune runs, in windows that alternate with the fine-tune
    stopped (SIGSTOP) and running (SIGCONT): both sides see the same background load."""
    import signal

    fx, fy = samples
    for i in range(len(fx)):
        client.post_sample(fx[i], fy[i])
    pid = client.finetune()["pid"]
    running: list[float] = []
    stopped: list[float] = []
    t0 = time.perf_counter()
    try:
        while client.model()["finetune"]["running"]:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                break
            stopped += _timed_requests(client, x, per_round, len(stopped))
            os.kill(pid, signal.SIGCONT)
            running += _timed_requests(client, x, per_round, len(running))
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    took = time.perf_counter() - t0
    last = None
    for _ in range(100):
        last = client.model()["finetune"]["last"]
        if last:
            break
        time.sleep(0.1)
    return {"p99_ms": 1000 * _pct(running, 99), "p50_ms": 1000 * statistics.median(running),
            "stopped_p99_ms": 1000 * _pct(stopped, 99), "ratio_p99": _pct(running, 99) / _pct(stopped, 99),
            "requests": len(running) + len(stopped), "finetune_s": took,
            "finetune": {k: last.get(k) for k in ("status", "depth", "priority")} if last else None}


# ---------------------------------------------------------------- 3: the daemon's RSS


def _daemon_rss(tmp: Path, bundle: Path, x: np.ndarray) -> dict[str, Any]:
    from edge_agent.sim.application import LocalClient
    from edge_agent.transport.broker import MosquittoBroker

    broker = MosquittoBroker(workdir=tmp / "mosquitto")
    broker.start()
    out: dict[str, Any] = {}
    try:
        dev = Device(tmp / "daemon", bundle, "digits-cnn", cache=tmp / "cache")
        cfg = dev._config(port=broker.port)
        dev.start("run", cfg)
        client = LocalClient(str(dev.sock))
        _timed_requests(client, x, 200)
        time.sleep(1.0)
        out["rss_mb"], out["mxnet"] = dev.rss_mb(), dev.maps_mxnet()
        out["served"] = client.model()["served"]
        client.close()
        dev.stop()
        plain = dev._config(port=broker.port, serve=False)
        dev.proc = subprocess.Popen([sys.executable, "-m", "edge_agent.cli", "run", "--config", str(plain)], cwd=ROOT,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(8.0)  # (no socket to wait on: the idle daemon, for reference only)
        out["rss_no_serve_mb"] = dev.rss_mb()
        dev.stop()
    finally:
        broker.stop()
    return out


# ---------------------------------------------------------------- 4: hot swap at 100 requests/s


def _hot_swap(tmp: Path, bundle: Path, x: np.ndarray, seconds: float, rate: float = 100.0) -> dict[str, Any]:
    from edge_agent.int8 import bundle as B
    from edge_agent.mxparams import dump_params, load_params
    from edge_agent.sim.application import LocalClient, npy_bytes

    dev = Device(tmp / "swap", bundle, "digits-cnn", cache=tmp / "cache", max_inflight=256).start()
    results: list[tuple[float, int, str, float]] = []
    lock = threading.Lock()
    t0 = time.perf_counter() + 0.5
    n = int(seconds * rate)
    next_i = [0]

    def worker() -> None:
        client = LocalClient(str(dev.sock))
        while True:
            with lock:
                i = next_i[0]
                next_i[0] += 1
            if i >= n:
                break
            due = t0 + i / rate
            delay = due - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            start = time.perf_counter()
            try:
                status, body = client.request("POST", "/v1/predict", npy_bytes(x[i % len(x)]))
                version = body.get("model", {}).get("version", "")
            except OSError:
                status, version = 0, ""
            with lock:
                results.append((start - t0, status, version, time.perf_counter() - start))
        client.close()

    try:
        threads = [threading.Thread(target=worker) for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.5 + seconds / 2)
        models = dev.state / "models" / "digits-cnn"
        base = B.load_bundle(bundle)
        files = {f: base.read(f) for f in base.manifest.files}
        head = load_params(files[B.HEAD_PARAMS])
        files[B.HEAD_PARAMS] = dump_params({k: (v + np.float32(0.01)).astype(v.dtype) for k, v in head.items()})
        manifest = base.manifest
        manifest.version, manifest.parent_version = "2", "1"
        B.write_bundle_dir(models / "2", files, manifest)
        flip = time.perf_counter() - t0
        os.symlink("2", models / "current.new")
        os.replace(models / "current.new", models / "current")
        for t in threads:
            t.join()
    finally:
        dev.stop()
    results.sort()
    versions = [v for _, _, v, _ in results]
    first_v2 = next((t for t, _, v, _ in results if v.endswith("/2")), None)
    around = [lat for t, _, _, lat in results if abs(t - flip) < 1.0]
    return {"requests": len(results), "failed": sum(1 for _, s, _, _ in results if s != 200),
            "unnamed": sum(1 for v in versions if not v), "versions": sorted(set(versions)),
            "achieved_rate": len(results) / max(results[-1][0], 1e-9), "swap_after_s": (first_v2 - flip) if first_v2 else None,
            "p99_ms": 1000 * _pct([r[3] for r in results], 99), "p99_around_swap_ms": 1000 * _pct(around, 99),
            "v1_after_v2": sum(1 for i, v in enumerate(versions) if v.endswith("/1") and "digits-cnn/2" in versions[:i])}


# ---------------------------------------------------------------- 5: the feedback loop


def _feedback(tmp: Path, what: str, bundle: Path, name: str, devices: list[tuple[str, Any, Any]], seed: int,
              epochs: int) -> list[dict[str, Any]]:
    from edge_agent.inference.server import InferenceServer, ServeOptions
    from edge_agent.sim.application import LocalClient, feedback_round

    rows = []
    for dev_id, feedback, nxt in devices:
        root = tmp / f"{what}-s{seed}-{dev_id}"
        dev = Device(root, bundle, name, cache=tmp / f"cache-{what}")
        opts = ServeOptions(state_dir=dev.state, data_dir=dev.data, socket_path=dev.sock, refresh_s=0.25,
                            finetune_args=("--epochs", str(epochs)))
        server = InferenceServer(opts)
        server.start()
        client = LocalClient(str(dev.sock), timeout=600)
        try:
            r = feedback_round(client, dev_id, feedback, nxt).to_json()
        finally:
            client.close()
            server.stop()
        r.update(what=what, seed=seed, next=len(nxt[0]))
        rows.append(r)
    return rows


def _digits_devices(seed: int) -> tuple[Path, list[tuple[str, Any, Any]]]:
    from edge_agent.sim import scenario as demo

    bundle = demo.ensure_bundle(_cache() / f"digits-cnn-s{seed}-d2", seed=seed, depths=2)
    out = []
    for dev in demo.scenario(seed=seed).devices:
        x = demo.to_pixels(dev.images).astype(np.float32)
        y = [demo.LABELS[v] for v in dev.labels]
        n = len(x) // 2
        out.append((dev.device_id, (x[:n], y[:n]), (x[n:], y[n:])))
    return bundle, out


def _texture_devices(seed: int) -> tuple[Path, list[tuple[str, Any, Any]]]:
    from edge_agent.int8.bundle import load_bundle
    from edge_agent.sim import scenario as demo
    from edge_agent.sim import textures

    size = 64
    dest = _cache() / "textures-mobilenet-w0.5-s64-e8-d4"  # bench_depth's base model (seed 0), built once
    try:
        load_bundle(dest)
    except Exception:  # noqa: BLE001 - build once, reuse while it verifies
        base = textures.scenario(size=32, n_devices=3, seed=0)
        demo.build_mobilenet_bundle(dest, demo.upsample(base.base_x, size), base.base_y, width=0.5, epochs=8,
                                    name="textures", overwrite=True, save_params=dest.with_name(dest.name + ".params"),
                                    depths=4, labels=textures.CLASSES)
    sc = textures.scenario(size=32, n_devices=3, seed=seed)
    out = []
    for dev in sc.devices:
        x = demo.to_pixels(demo.upsample(dev.images, size)).astype(np.float32)
        hx = demo.to_pixels(demo.upsample(dev.heldout_images, size)).astype(np.float32)
        out.append((f"{dev.device_id}", (x, [textures.CLASSES[v] for v in dev.labels]),
                    (hx, [textures.CLASSES[v] for v in dev.heldout_labels])))
    return dest, out


# ---------------------------------------------------------------- report


def run(quick: bool = False) -> str:
    from edge_agent.sim import scenario as demo

    from .run import machine_description

    load_before = _load()
    tmp = Path(tempfile.mkdtemp(prefix="bench-inference-"))
    rounds, per_round = (3, 30) if quick else (7, 60)
    try:
        digits = demo.ensure_bundle(_cache() / "digits-cnn-s0", seed=0)
        dev = demo.scenario(seed=0).devices[0]
        dx = demo.to_pixels(dev.images).astype(np.float32)
        dy = [demo.LABELS[v] for v in dev.labels]
        mob, _, _ = demo.ensure_mobilenet_bundle(_cache() / "digits-mobilenet-w0.5-s96-e3-d4", width=0.5, size=96,
                                                 epochs=3, depths=4)
        cam = demo.camera_scenario(size=96, seed=0).devices[0]
        mx_ = demo.to_pixels(cam.images).astype(np.float32)
        my = [demo.LABELS[v] for v in cam.labels]
        lat = [_latency(tmp / "lat", "digits CNN (1x8x8)", digits, "digits-cnn", dx, rounds, per_round,
                        (dx[:100], dy[:100])),
               _latency(tmp / "lat", "MobileNetV2 w0.5 (3x96x96)", mob, "digits-mobilenet", mx_, rounds, per_round,
                        (mx_[:60], my[:60]) if not quick else None)]
        rss = _daemon_rss(tmp / "rss", digits, dx)
        swap = _hot_swap(tmp / "hs", digits, dx, 4.0 if quick else 10.0)
        loops: list[dict[str, Any]] = []
        for seed in (0,) if quick else (0, 1):
            bundle, devices = _digits_devices(seed)
            loops += _feedback(tmp / "fb", "camera digits", bundle, "digits-cnn", devices[:2 if quick else 3], seed, 20)
        for seed in () if quick else (0, 1):
            bundle, devices = _texture_devices(seed)
            loops += _feedback(tmp / "fb", "textures", bundle, "textures", devices, seed, 10)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _report(lat, rss, swap, loops, machine_description(), load_before, _load(), quick)


def _report(lat: list[dict[str, Any]], rss: dict[str, Any], swap: dict[str, Any], loops: list[dict[str, Any]],
            machine: str, load_before: str, load_after: str, quick: bool) -> str:
    lines = ["## Local inference service (bench_inference)", "",
             f"Machine: {machine}. Load: {load_before} before, {load_after} after (a shared machine: other "
             "engineers' jobs ran meanwhile; ratios are measured side by side).", "",
             "### POST /v1/predict vs the engine's bare per-image time", "",
             "One image per request (.npy body), a keep-alive client on the Unix socket, the service in its own "
             "`edge-agent serve` process; bare = the same selected engine and threads running one image in the "
             "bench process. Overhead = median over interleaved rounds of (p50 HTTP / p50 bare) - 1.", "",
             "| model | engine / tail | bare p50 | HTTP p50 | HTTP p99 | p50 overhead (rounds) | throughput |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in lat:
        lines.append(f"| {r['label']} | {r['engine']} / {r['tail']} | {r['bare_p50_ms']:.3f} ms | {r['http_p50_ms']:.3f} ms "
                     f"| {r['http_p99_ms']:.3f} ms | {100 * r['overhead']:+.0f} % ({', '.join(f'{100 * v:+.0f}' for v in r['overhead_rounds'])}) "
                     f"| {r['throughput']:.0f} req/s |")
    lines += ["", "### p99 while a local fine-tune runs", "",
              "POST /v1/finetune after posting samples; while it runs, windows of requests alternate with the "
              "fine-tune child stopped (SIGSTOP: the idle side, under the same background load) and running.", "",
              "| model | fine-tune priority | p99, fine-tune stopped | p99, fine-tune running | ratio | requests | fine-tune |",
              "|---|---|---:|---:|---:|---:|---|"]
    for r in lat:
        for key, prio in (("finetune", "idle (SCHED_IDLE, default)"), ("finetune_normal", "normal (contrast)")):
            f = r.get(key)
            if f:
                lines.append(f"| {r['label']} | {prio} | {f['stopped_p99_ms']:.3f} ms | {f['p99_ms']:.3f} ms "
                             f"| {f['ratio_p99']:.2f}x | {f['requests']} | {f['finetune_s']:.0f} s, {f['finetune']} |")
    lines += ["", "### The daemon's memory", "",
              f"`edge-agent run` with [serve] (real mosquitto), the demo model loaded on {rss['served']['engine']} "
              f"({rss['served']['tail']} tail), after 200 requests: **RSS {rss['rss_mb']:.1f} MB**; libmxnet mapped: "
              f"{'yes' if rss['mxnet'] else 'no'}. The same daemon without [serve]: {rss['rss_no_serve_mb']:.1f} MB.", "",
              "### Hot swap at 100 requests/s", "",
              f"{swap['requests']} requests (open loop, achieved {swap['achieved_rate']:.0f}/s), a new fleet version "
              f"installed half-way: **{swap['failed']} failed**, {swap['unnamed']} without a version; versions answering: "
              f"{', '.join(swap['versions'])}; the new one answered {swap['swap_after_s']:.2f} s after `current` flipped "
              f"(the refresh interval plus loading it); v1 answers after the first v2 one: {swap['v1_after_v2']} "
              f"(requests already in flight); p99 {swap['p99_ms']:.1f} ms overall, {swap['p99_around_swap_ms']:.1f} ms within 1 s of the swap.",
              "", "### The feedback loop: the served model's accuracy on the application's next samples", "",
              "Per device: predict its next samples (before), post N labelled samples (wrong predictions corrected by "
              "prediction id, right ones confirmed), one local fine-tune (POST /v1/finetune), predict the same next "
              "samples (after). Personal = the device's own tail; it is served only where its held-out accuracy beats "
              "the fleet version's.", "",
              "| data | seed | device | N posted (held out) | next | before | after | served after | fleet / personal held-out acc | personal only if better |",
              "|---|---:|---|---:|---:|---:|---:|---|---|---|"]
    for r in loops:
        personal_served = "+" in r["served_after"]
        fa, pa = r["fleet_accuracy"], r["personal_accuracy"]
        consistent = (personal_served == (pa is not None and fa is not None and pa > fa))
        lines.append(f"| {r['what']} | {r['seed']} | {r['device']} | {r['posted']} ({r['held_out_posted']}) | {r['next']} "
                     f"| {100 * r['before']:.1f} % | {100 * r['after']:.1f} % | {'personal' if personal_served else 'fleet'} "
                     f"(depth {r['finetune'].get('depth')}) | {_acc(fa)} / {_acc(pa)} | {'yes' if consistent else 'NO'} |")
    for what in sorted({r["what"] for r in loops}):
        rows = [r for r in loops if r["what"] == what]
        before = statistics.mean(r["before"] for r in rows)
        after = statistics.mean(r["after"] for r in rows)
        lines.append(f"\n**{what}**: mean over {len(rows)} device-runs: {100 * before:.1f} % -> {100 * after:.1f} % "
                     f"({100 * (after - before):+.1f} points).")
    lines += ["", f"{'Quick run (fewer rounds, no textures).' if quick else ''}".strip()]
    return "\n".join(lines) + "\n"


def _acc(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f} %"


if __name__ == "__main__":
    print(run(quick="--quick" in sys.argv))
