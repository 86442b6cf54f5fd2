"""int8 engines vs MXNet fp32 on a MobileNetV2-style backbone, and quantisation accuracy.

Throughput: the backbone of `models.mobilenet_v2` (random weights, BN statistics randomised
so folding matters) at batch 32, run by MXNet fp32 (hybridised Gluon, static memory) and by
every int8 engine on the same bundle. All are timed side by side in one process: each
round runs every engine once, in turn, and the figure is the median over rounds, so load
drifting on the shared machine hits all engines alike. Ratios are to MXNet fp32.

Accuracy: the digits CNN trained in MXNet on scikit-learn's digits, quantised (min/max
calibration on 256 training images), top-1 on the held-out quarter: fp32 vs each engine.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

BATCH = 32
CONFIGS = ((0.35, 96), (0.5, 128))  # (width, input size)


def _fp32_runner(net: Any) -> Callable[[np.ndarray], Any]:
    import mxnet as mx

    features = net.features
    features.hybridize(static_alloc=True, static_shape=True)

    def run(x: np.ndarray) -> Any:
        return features(mx.nd.array(x)).asnumpy()

    return run


def _engine_runners(bundle: Any, threads: int) -> tuple[dict[str, Any], list[str]]:
    """Prepared runners per engine row, and a line for each engine that cannot run."""
    from edge_agent.int8 import engines
    from edge_agent.int8.engines.tflite import TfliteRunner
    from edge_agent.int8.selection import default_probe

    probe = default_probe()
    runners: dict[str, Any] = {}
    missing: list[str] = []
    for name in engines.engine_names():
        engine = engines.load_engine(name)
        avail = engine.availability(probe)
        if not avail.available:
            missing.append(f"{name}: {avail.reason}")
            continue
        try:
            if name == "tflite":
                runners[f"tflite, XNNPACK int8, {threads} threads"] = engine.prepare(bundle, threads=threads)
                runners["tflite, XNNPACK int8, 1 thread"] = engine.prepare(bundle, threads=1)
                runners[f"tflite, builtin kernels, {threads} threads"] = TfliteRunner(
                    bundle.tflite_bytes(), threads=threads, delegates=[])  # what the wheel does by default
            else:
                runners[f"{name}, {threads} threads"] = engine.prepare(bundle, threads=threads)
                if name == "native" and threads > 1:  # side by side with XNNPACK at 1 thread too
                    runners["native, 1 thread"] = engine.prepare(bundle, threads=1)
        except Exception as exc:  # a failing engine is a line in the report, not a crash
            missing.append(f"{name}: prepare failed: {type(exc).__name__}: {exc}")
    return runners, missing


PAUSE_S = 0.05  # before each timed call: the previous row's thread pool (XNNPACK's, OpenMP's) stops spinning


def _time_side_by_side(runs: dict[str, Callable[[], Any]], rounds: int, slow: dict[str, int]) -> dict[str, float]:
    """Median seconds per call, rounds interleaved, each call after a PAUSE_S pause (a pool that
    still spins on the second core would slow whichever 2-thread row runs next); `slow` caps
    the rounds of some rows."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():
        run()  # warm-up: allocation, weight packing, oneDNN primitive creation
    for index in range(rounds):
        for name, run in runs.items():
            if index >= slow.get(name, rounds):
                continue
            time.sleep(PAUSE_S)
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def _throughput(width: float, size: int, rounds: int, threads: int) -> tuple[list[str], float]:
    from edge_agent.int8.bundle_create import create_bundle
    from edge_agent.int8.selection import Candidate, Oracle
    from edge_agent.sim import models

    net = models.initialize(models.mobilenet_v2(width, num_classes=10, input_size=size), randomize_bn=True)
    rng = np.random.default_rng(0)
    calib = rng.normal(0.0, 1.0, (64, 3, size, size)).astype(np.float32)
    x = rng.normal(0.0, 1.0, (BATCH, 3, size, size)).astype(np.float32)
    with tempfile.TemporaryDirectory(prefix="bench-int8-") as tmp:
        bundle = create_bundle(net, Path(tmp) / "mbv2", calibration=calib, labels=[str(i) for i in range(10)],
                               name="mbv2", version="1", input_shape=(3, size, size))
        runners, missing = _engine_runners(bundle, threads)
        oracle = Oracle(bundle, calib[:BATCH])
        agreement = {}
        for name, runner in runners.items():
            cand = Candidate(name, True, "")
            oracle.check(runner, cand)
            unit = "int8 unit(s)" if cand.agreement == "int8" else "output steps"
            agreement[name] = f"max {cand.max_diff:.3g} {unit}"
        fp32 = _fp32_runner(net)
        runs: dict[str, Callable[[], Any]] = {"MXNet fp32": lambda: fp32(x)}
        runs.update({name: (lambda r=runner: r.run(x)) for name, runner in runners.items()})
        slow = {name: min(rounds, 3) for name in runs if name.startswith(("reference", "tflite, builtin"))}
        seconds = _time_side_by_side(runs, rounds, slow)
    base = seconds["MXNet fp32"]
    lines = [f"### MobileNetV2 width {width}, {size}x{size}, batch {BATCH}", "",
             "| engine | ms / batch | images/s | vs MXNet fp32 | agreement with reference |",
             "| --- | ---: | ---: | ---: | --- |"]
    best = 0.0
    for name, sec in sorted(seconds.items(), key=lambda kv: kv[1]):
        ratio = base / sec
        if name != "MXNet fp32":
            best = max(best, ratio)
        lines.append(f"| {name} | {sec * 1000:.1f} | {BATCH / sec:.0f} | {ratio:.2f}x | {agreement.get(name, '-')} |")
    lines += [""] + [f"- not run: {m}" for m in missing] + ([""] if missing else [])
    return lines, best


def _accuracy(epochs: int) -> list[str]:
    import mxnet as mx

    from edge_agent.int8 import engines
    from edge_agent.int8.bundle_create import create_bundle
    from edge_agent.int8.selection import default_probe
    from edge_agent.sim import models

    x_train, y_train, x_test, y_test = models.load_digits_split()
    net = models.digits_cnn()
    models.fit_classifier(net, x_train, y_train, epochs=epochs)
    fp32 = float(np.mean(models.predict(net, x_test).argmax(1) == y_test))
    probe = default_probe()
    lines = [f"### Quantisation accuracy: digits CNN, held-out split ({len(y_test)} images)", "",
             "| engine | fp32 top-1 | int8 top-1 | difference (points) |", "| --- | ---: | ---: | ---: |"]
    with tempfile.TemporaryDirectory(prefix="bench-int8-digits-") as tmp:
        bundle = create_bundle(net, Path(tmp) / "digits", calibration=x_train[:256],
                               labels=[str(i) for i in range(10)], name="digits", version="1",
                               input_shape=(1, 8, 8), scale=1 / 16)
        head = bundle.head_block()
        for name in engines.engine_names():
            engine = engines.load_engine(name)
            if not engine.availability(probe).available:
                continue
            try:
                features = engine.prepare(bundle).run(x_test)
            except Exception as exc:  # e.g. edgetpu without a compiled model
                lines.append(f"| {name} | {fp32 * 100:.2f}% | not run: {exc} | - |")
                continue
            int8 = float(np.mean(head(mx.nd.array(features)).asnumpy().argmax(1) == y_test))
            lines.append(f"| {name} | {fp32 * 100:.2f}% | {int8 * 100:.2f}% | {(int8 - fp32) * 100:+.2f} |")
    return lines + [""]


def _vcpu_packing_note() -> str:
    """Some VMs' kernels pack tasks onto fewer vCPUs (sched_vcpu_pack on the command line): a
    pool thread woken after the pause then often shares the caller's vCPU. Say so where it is
    set, since it skews the 2-thread rows (on this EPYC VM: 7 ms vs 13 ms for the same native
    graph, back to back vs after 50 ms idle)."""
    try:
        words = Path("/proc/cmdline").read_text().split()
    except OSError:
        return ""
    pack = [w for w in words if w.startswith("sched_vcpu_pack")]
    if not pack:
        return ""
    return (f"This machine's kernel command line has `{pack[0]}` (a VM setting that packs tasks onto fewer "
            "vCPUs): a pool thread woken after the pause can land on the caller's vCPU, so 2-thread rows "
            "vary from run to run here (without that setting Linux wakes it on its previous core when that core is idle). ")


def run(quick: bool = False) -> str:
    from edge_agent.int8.engines._common import usable_cpus

    threads = usable_cpus()
    rounds = 5 if quick else 15
    configs = CONFIGS[:1] if quick else CONFIGS
    from bench.cpu import cpu_line

    out = ["## int8 engines vs MXNet fp32", "", cpu_line(), "",
           f"Batch {BATCH}, {threads} threads for every engine (MXNet: OpenMP), random weights; median of "
           f"{rounds} interleaved rounds (the numpy reference and TFLite's builtin kernels: 3), each call "
           f"{PAUSE_S * 1000:.0f} ms after the previous one (so no other row's pool still spins). "
           + _vcpu_packing_note() +
           "Agreement is checked on the bundle's calibration batch (int8 units for engines running "
           "the bundle's .tflite, output quantisation steps for mxnet-onednn, which calibrates its "
           "own scales). Command: `python -m bench.run --only bench_int8`.", ""]
    best_ratios = []
    for width, size in configs:
        lines, best = _throughput(width, size, rounds, threads)
        out += lines
        best_ratios.append(best)
    target = 2.5
    verdict = "met" if min(best_ratios) >= target else "NOT met"
    out += [f"Best int8 engine vs MXNet fp32: {', '.join(f'{r:.2f}x' for r in best_ratios)} "
            f"(target >= {target}x: {verdict}).", ""]
    out += _accuracy(epochs=3)
    return "\n".join(out)


if __name__ == "__main__":
    print(run(quick=True))
