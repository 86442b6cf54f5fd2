"""The model-zoo matrix as figures: per architecture, int8 engine speeds vs MXNet fp32,
int8-vs-fp32 top-1 agreement, and the engine selection would choose on this machine.

Architectures and measurements are those of tests/unit/test_model_zoo.py (defined in
tests/fixtures/models/zoo.py): the Gluon model zoo built at the smallest width and a small
input, and torchvision's exports (legacy and dynamo exporters) committed as fixtures.
Speeds come from the engine selection itself (`select_engine`, batch 32, interleaved
rounds, median), divided by 32 for ms per image; MXNet fp32 is the backbone in MXNet
(Gluon: the net's `.features`, hybridised; ONNX: MXNet's ONNX importer on backbone.onnx,
"n/a" where it lacks an op), timed in the same process right after. Agreement is on
held-out digits through a linear head fitted on the fp32 features, on briefly trained nets
(tests/fixtures/models/zoo.py).
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
ENGINES = ("native", "tflite", "mxnet-onednn", "reference")
QUICK = {"gluon-resnet18_v1", "gluon-squeezenet1.1", "gluon-mobilenetv2_0.25", "torch-resnet18-legacy",
         "torch-mobilenet_v2-legacy", "torch-mobilenet_v3_small-legacy"}  # one per family


def _fp32_ms(run: Callable[[np.ndarray], np.ndarray] | None, x: np.ndarray, rounds: int) -> float | None:
    if run is None:
        return None
    run(x)  # warm-up (hybridisation, allocation)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        run(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000.0 / len(x)


def _hybridised(built: Any) -> Callable[[np.ndarray], np.ndarray] | None:
    """Gluon: the backbone hybridised with static memory (how MXNet runs at its best)."""
    if built.arch.source != "gluon":
        return built.mxnet_fp32
    import mxnet as mx

    features = built.net.features
    features.hybridize(static_alloc=True, static_shape=True)
    return lambda x: features(mx.nd.array(x)).asnumpy()


def _refuse_batch1_reshape(bundle: Any) -> None:
    """A head Reshape with the export batch (1) baked in kills the process inside MXNet
    (SIGABRT/SIGSEGV, no exception) at any batch > 1: report it instead of dying."""
    import json

    from edge_agent.int8.bundle import HEAD_SYMBOL

    for node in json.loads(bundle.read(HEAD_SYMBOL))["nodes"]:
        shape = node.get("attrs", {}).get("shape", "").replace("(", "[").replace(" ", "")
        if node["op"] == "Reshape" and shape.startswith("[1,"):
            raise RuntimeError(f"head Reshape {node['name']!r} to {shape}: batch 1 baked in (MXNet aborts at batch > 1)")


def _row(arch: Any, rounds: int) -> tuple[str, str]:
    from tests.fixtures.models import zoo

    with tempfile.TemporaryDirectory(prefix="bench-zoo-") as tmp:
        built = zoo.build(arch, Path(tmp) / "bundle")
        _refuse_batch1_reshape(built.bundle)
        result = zoo.measure(built, batch_size=BATCH, repeats=rounds)
        x = zoo.digits(arch.size)[2][:BATCH]
        fp32 = _fp32_ms(_hybridised(built), x, rounds)
    by_name = {c.name: c for c in result.candidates}
    cells = []
    for name in ENGINES:
        c = by_name.get(name)
        judged_by_units = "†" if c is not None and getattr(c, "inconclusive", "") else ""
        if c is None or not c.available:
            cells.append("-")
        elif c.error:
            cells.append("fails")
        elif c.correct is False:  # not timed: selection never runs a wrong engine
            unit = "units" if c.agreement == "int8" else "steps"
            cells.append((f"WRONG ({c.max_diff:.0f} {unit})" if c.max_diff is not None else "WRONG") + judged_by_units)
        elif c.latency_ms is None:
            cells.append("oracle" if name == "reference" else "not timed")
        else:
            ms = c.latency_ms / BATCH
            cells.append(f"{ms:.2f}" + (f" ({fp32 / ms:.1f}x)" if fp32 else "") + judged_by_units)
    notes = [f"{c.name}: {c.error[:120]}" for c in result.candidates if c.error]
    inconclusive = next((c.inconclusive for c in result.candidates if getattr(c, "inconclusive", "")), "")
    if inconclusive:
        notes.append(f"† task-level agreement inconclusive ({inconclusive}): judged by the unit-level comparison")
    line = (f"| {arch.id} | {arch.size} | {f'{fp32:.2f}' if fp32 else 'n/a'} | " + " | ".join(cells)
            + f" | {result.chosen} | {result.agreement:.1%} | {result.fp32_accuracy:.1%} / {result.int8_accuracy:.1%}"
            f" | {result.finetune_before:.1%} -> {result.finetune_after:.1%} |")
    return line, "; ".join(notes)


def run(quick: bool = False) -> str:
    from edge_agent.int8.engines._common import usable_cpus
    from tests.fixtures.models import zoo

    rounds = 2 if quick else 3
    archs = [a for a in zoo.all_archs() if not quick or a.id in QUICK]
    out = ["## Model zoo: int8 engines vs MXNet fp32 per architecture", "",
           f"Per-image milliseconds at batch {BATCH} ({usable_cpus()} threads), median of {rounds} interleaved "
           "rounds from the engine selection itself; (Nx) = speed-up over MXNet fp32. 'chosen' is the "
           "engine `select_engine` picks here (from the engines that pass its agreement check); "
           "'WRONG (n units/steps)': flagged by that check (max distance to the reference), so never run; "
           "†: that check's task-level part was inconclusive (too few decided samples), units decided; "
           "'oracle': the numpy reference, which the others are checked against. Agreement: int8 "
           f"top-1 == fp32 top-1 on {zoo.N_TEST} held-out digits (upsampled to the input size, 3 channels) "
           "through a linear head fitted on the fp32 backbone's features; accuracy of that head on "
           "fp32 / int8 features; fine-tune: the bundle's own head trained on int8 features (12 epochs, "
           f"{zoo.N_TRAIN} digits). Nets briefly trained on the training digits, classifier re-initialised "
           "(Gluon: `zoo.train_gluon`; torchvision: make_torch_fixtures.py). "
           "Command: `python -m bench.run --only bench_model_zoo`.", "",
           "| architecture | input | MXNet fp32 | " + " | ".join(ENGINES)
           + " | chosen | top-1 agreement | accuracy fp32 / int8 | fine-tune |",
           "|---|---|---|" + "---|" * len(ENGINES) + "---|---|---|---|"]
    failed = []
    notes = []
    for arch in archs:
        try:
            line, note = _row(arch, rounds)
            out.append(line)
            if note:
                notes.append(f"- {arch.id}: {note}")
        except Exception as exc:  # an architecture that does not import yet is a line, not a crash
            failed.append(f"- {arch.id}: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}")
    if notes:
        out += ["", "Engine errors, and checks whose task-level part was inconclusive:", *notes]
    if failed:
        out += ["", "Not imported yet:", *failed]
    return "\n".join(out) + "\n\n" + memory_table(quick)


# ---------------------------------------------------------------- memory at real size
# Issue 41's "memory a Pi can hold": Gluon model-zoo networks at their real size (random
# weights, pretrained=False: nothing downloaded), each step a fresh child measured by wait4.
MEMORY_ARCHS = (("resnet50_v1", 224, "resnetv10_pool1_fwd"), ("densenet121", 224, None))
MEMORY_QUICK = ("resnet50_v1",)
CREATE_ALLOWANCE_MB = 300.0  # `model create` target: 2 x the model file + this
KERNELS_BOUND_MB = 1024.0  # `kernels --bench` target on a 2 GB board (and its cap here)
MEMORY_BATCH = 32  # the Pi profiles' training batch
MEMORY_CALIBRATION = 32
MEMORY_DEPTHS = 3  # `model create`'s default


def _export_zoo_net(name: str, size: int, dest: Path) -> str:
    """A child: the Gluon net exported to dest/net.onnx (the project's exporter) and 32
    random calibration samples to dest/calib.npz; returns the split (the end of .features)."""
    import json
    import sys

    from bench._procs import peak_rss_run

    code = (
        "import json, sys, numpy as np, mxnet as mx\n"
        "from mxnet.gluon.model_zoo import vision\n"
        "from edge_agent.int8.onnx_export import export_onnx\n"
        "name, size, dest = sys.argv[1], int(sys.argv[2]), sys.argv[3]\n"
        "net = vision.get_model(name, pretrained=False, classes=10)\n"
        "mx.random.seed(0)\n"
        "net.initialize(mx.init.Xavier(rnd_type='gaussian', factor_type='in', magnitude=2))\n"
        "net.hybridize()\n"
        "net(mx.nd.zeros((1, 3, size, size)))\n"
        "open(dest + '/net.onnx', 'wb').write(export_onnx(net, (1, 3, size, size)))\n"
        f"x = np.random.default_rng(0).standard_normal(({MEMORY_CALIBRATION}, 3, size, size)).astype(np.float32)\n"
        "np.savez(dest + '/calib.npz', x=x)\n"
        "print(json.dumps({'split': net.features(mx.sym.var('data')).name}))\n")
    rc, out, err, _ = peak_rss_run([sys.executable, "-c", code, name, str(size), str(dest)])
    if rc != 0:
        raise RuntimeError(f"exporting {name}: {err.strip().splitlines()[-1:]}")
    return json.loads(out.strip().splitlines()[-1])["split"]


def _memory_row(name: str, size: int, split: str | None, tmp: Path) -> tuple[str, list[str]]:
    import json
    import sys

    from bench._procs import peak_rss_run

    split = split or _export_zoo_net(name, size, tmp)  # the end of .features (the zoo's backbone)
    if not (tmp / "net.onnx").exists():
        _export_zoo_net(name, size, tmp)
    file_mb = (tmp / "net.onnx").stat().st_size / 2**20
    bundle = tmp / "bundle"
    rc, _, err, create_mb = peak_rss_run([
        sys.executable, "-m", "edge_agent.coordinator.cli", "model", "create", "--onnx", str(tmp / "net.onnx"),
        "--split", split, "--calib", str(tmp / "calib.npz"), "--labels", ",".join("0123456789"), "--name", "zoo",
        "--version", "1", "--depths", str(MEMORY_DEPTHS), "--output", str(bundle)])
    notes = [] if rc == 0 else [f"{name}: model create exit {rc}: {err.strip().splitlines()[-1][:200]}"]
    create_bound = 2 * file_mb + CREATE_ALLOWANCE_MB
    kernels_mb, chosen = float("nan"), "-"
    if rc == 0:
        rc, out, err, kernels_mb = peak_rss_run([
            sys.executable, "-m", "edge_agent.cli", "kernels", "--model", str(bundle), "--bench", "--json",
            "--batch-size", str(MEMORY_BATCH), "--memory-cap-mb", str(int(KERNELS_BOUND_MB)), "--repeats", "2",
            "--state-dir", str(tmp / "state")])
        if rc == 0:
            result = json.loads(out[out.index("{"):])
            chosen = str(result["chosen"])
            notes += [f"{name}: {c['name']}: {c['reason'][c['reason'].index('not prepared'):]}" for c in result["candidates"]
                      if "not prepared" in c["reason"]]
        else:
            notes.append(f"{name}: kernels --bench exit {rc}: {err.strip().splitlines()[-1][:200]}")
    met = f"{'yes' if create_mb <= create_bound else 'no'} / {'yes' if kernels_mb <= KERNELS_BOUND_MB else 'no'}"
    line = (f"| {name} | {size} | {file_mb:.0f} | {create_mb:.0f} | {create_bound:.0f} | {kernels_mb:.0f} "
            f"| {KERNELS_BOUND_MB:.0f} | {chosen} | {met} |")
    return line, notes


def memory_table(quick: bool = False) -> str:
    """Peak RSS of `model create` and `kernels --bench` per network (module comment above)."""
    out = ["## Model zoo at real size: peak memory of model create and kernels --bench", "",
           "Gluon model-zoo networks at 224x224 (random weights, 10 classes), exported to ONNX by the project's "
           f"exporter; {MEMORY_CALIBRATION} calibration samples; each step a fresh child process, its peak RSS "
           f"from wait4 (ru_maxrss). `edge-coordinator model create --onnx --depths {MEMORY_DEPTHS}` against "
           f"2 x the file + {CREATE_ALLOWANCE_MB:.0f} MB; `edge-agent kernels --bench --batch-size {MEMORY_BATCH} "
           f"--memory-cap-mb {KERNELS_BOUND_MB:.0f}` (a 2 GB Pi-class board: the engines measured one at a time, "
           f"one predicted over the cap skipped) against {KERNELS_BOUND_MB:.0f} MB. "
           "Command: `python -m bench.bench_model_zoo --memory`.", "",
           "| network | input | file MB | create peak MB | 2x file + 300 | kernels --bench peak MB | bound "
           "| chosen | met (create / kernels) |",
           "|---|---|---|---|---|---|---|---|---|"]
    notes: list[str] = []
    for name, size, split in MEMORY_ARCHS:
        if quick and name not in MEMORY_QUICK:
            continue
        try:
            with tempfile.TemporaryDirectory(prefix="bench-zoo-memory-") as tmp:
                line, why = _memory_row(name, size, split, Path(tmp))
            out.append(line)
            notes += why
        except Exception as exc:  # one network failing is a line, not a crash
            out.append(f"| {name} | {size} | failed: {type(exc).__name__}: {str(exc)[:160]} | | | | | | |")
    if notes:
        out += ["", "Notes:", *(f"- {n}" for n in notes)]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    import sys

    if "--memory" not in sys.argv[1:]:
        sys.exit("usage: python -m bench.bench_model_zoo --memory [--quick]  (the matrix: python -m bench.run "
                 "--only bench_model_zoo)")
    print(memory_table(quick="--quick" in sys.argv[1:]))
