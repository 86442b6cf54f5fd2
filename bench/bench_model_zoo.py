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


# ---------------------------------------------------------------- the full matrix
# Issue 41's matrix at real width: every torchvision CNN family, both exporters, 64x64
# digits, briefly trained (make_torch_fixtures.py --full DIR: hundreds of MB, never
# committed). Each export is measured in a child of its own (its peak RSS, and a crash is a
# row): bundled with FULL_DEPTHS training depths, the engine selection and agreement of the
# smaller matrix (zoo.measure), then a real `run_finetune` at depth 1 with the chosen
# engine, judged on held-out digits through the bundle's own tail before and after.
FULL_DEPTHS = 3
FULL_TEST = 300  # held-out digits for the depth-1 fine-tune's before / after


def full_one(where: Path, arch_id: str) -> dict[str, Any]:
    """One export of the full matrix (runs in a child: see full_matrix)."""
    from edge_agent.inference.predictor import DepthPredictor, tail_params
    from edge_agent.train.job import run_finetune
    from tests.fixtures.models import zoo

    arch = next(a for a in zoo.GLUON_FULL + zoo.torch_archs(where) if a.id == arch_id)
    row: dict[str, Any] = {"id": arch_id}
    with tempfile.TemporaryDirectory(prefix="bench-zoo-full-") as tmp_name:
        tmp = Path(tmp_name)
        built = zoo.build(arch, tmp / "bundle", depths=FULL_DEPTHS)
        row["create_s"] = built.create_s
        row["depths"] = [d.depth for d in built.bundle.manifest.depths]
        row["onnx_mb"] = len(built.bundle.onnx_bytes()) / 2**20  # the fp32 backbone the bundle keeps
        result = zoo.measure(built, batch_size=BATCH, repeats=1)
        row.update(chosen=result.chosen, agreement=result.agreement, fp32_accuracy=result.fp32_accuracy,
                   int8_accuracy=result.int8_accuracy, head_before=result.finetune_before,
                   head_after=result.finetune_after)
        if len(row["depths"]) < 2:
            return row
        x_train, y_train, x_test, y_test = zoo.digits(arch.size)
        np.savez(tmp / "digits.npz", x=x_train, y=y_train.astype(np.int64))
        report = run_finetune(model=built.bundle.path, data=tmp / "digits.npz", state_dir=tmp / "state",
                              cache_dir=tmp / "cache", depth=1, epochs=8, patience=4, batch_size=16,
                              val_fraction=0.25, profile="raspberry-pi-4")
        row["job_engine"] = report["engine"]["name"]  # the job's own selection, through the bundle's head
        own = DepthPredictor(built.bundle, depth=1)
        tuned = DepthPredictor(built.bundle, depth=1, params=tail_params(built.bundle, report["head"]["file"]))
        try:
            row["depth1_before"] = own.accuracy(x_test[:FULL_TEST], y_test[:FULL_TEST])
            row["depth1_after"] = tuned.accuracy(x_test[:FULL_TEST], y_test[:FULL_TEST])
        finally:
            own.close()
            tuned.close()
    return row


def full_matrix(where: Path, only: tuple[str, ...] = ()) -> str:
    """The full matrix's table (module comment above), one child per export (those whose
    id contains one of `only`, if given)."""
    import json
    import sys

    from bench._procs import peak_rss_run
    from tests.fixtures.models import zoo

    index = json.loads((where / "fixtures.json").read_text())["models"] if (where / "fixtures.json").exists() else []
    out = ["## Model zoo at real width: every CNN family, both exporters (issue 41)", "",
           "torchvision's classes at their real width, 10 classes, 64x64 digits (3 channels), briefly trained and "
           "the classifier re-initialised (`tests/fixtures/models/make_torch_fixtures.py --full DIR`, in a torch "
           "venv: never a project dependency), exported by the legacy and the dynamo exporter; and the Gluon "
           "zoo's large nets at their real width (zoo.GLUON_FULL: the same digits, trained by `zoo.train_gluon`; "
           "densenet121's and inceptionv3's fixed average pools made global). Each in a child of its own: "
           f"`create_bundle` with {FULL_DEPTHS} training depths, the engine selection and its chosen engine's top-1 "
           f"agreement with fp32 on {zoo.N_TEST} held-out digits (as in the matrix above), then `run_finetune` at "
           f"depth 1 (the job selecting its engine itself) on {zoo.N_TRAIN} digits (8 epochs, patience 4), held-out accuracy on "
           f"{FULL_TEST} digits through the bundle's own depth-1 tail before and after. Met: >= 2 depths past the "
           "head, agreement >= 99 %, the depth-1 fine-tune raises held-out accuracy. Peak RSS: the child's, all of "
           "it. Command: `python -m bench.bench_model_zoo --full DIR`.", "",
           "| network | opset | file MB | depths | chosen | top-1 agreement | fp32 accuracy | depth-1 fine-tune "
           "| create s | peak RSS MB | met |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    entries = [(a.id, "-", None, "") for a in zoo.GLUON_FULL] + [
        (f"torch-{f['id']}", str(f.get("opset", "-")), f.get("bytes"), f.get("error", "")) for f in index]
    entries = [e for e in entries if not only or any(o in e[0] for o in only)]
    failed, met_count = [], 0
    for arch_id, opset, size, export_error in entries:
        if export_error:
            failed.append(f"- {arch_id}: the export itself failed: {export_error[:200]}")
            continue
        rc, stdout, err, rss = peak_rss_run([sys.executable, "-m", "bench.bench_model_zoo", "--full-one", str(where),
                                             arch_id], timeout=3600)
        if rc != 0:
            last = [ln for ln in err.strip().splitlines() if ln.strip()][-1:] or [f"exit {rc}"]
            failed.append(f"- {arch_id}: {last[0][:300]}")
            print(f"{arch_id}: FAILED {last[0][:300]}", flush=True)
            continue
        r = json.loads(stdout.strip().splitlines()[-1])
        deep = f"{r['depth1_before']:.1%} -> {r['depth1_after']:.1%}" if "depth1_after" in r else "-"
        met = (len(r["depths"]) >= 3 and r["agreement"] >= 0.99
               and r.get("depth1_after", 0.0) > r.get("depth1_before", 1.0))
        met_count += met
        file_mb = f"{size / 2**20:.1f}" if size else f"{r['onnx_mb']:.1f}"
        line = (f"| {arch_id} | {opset} | {file_mb} | {len(r['depths']) - 1} | {r['chosen']} | {r['agreement']:.1%} "
                f"| {r['fp32_accuracy']:.1%} | {deep} | {r['create_s']:.0f} | {rss:.0f} | {'yes' if met else '**no**'} |")
        out.append(line)
        print(line, flush=True)
    out += ["", f"Met: {met_count} of {len(entries)}."]
    if failed:
        out += ["", "Not bundled:", *failed]
    return "\n".join(out) + "\n"


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
    import json
    import sys

    args = sys.argv[1:]
    if args[:1] == ["--full-one"] and len(args) == 3:
        print(json.dumps(full_one(Path(args[1]), args[2])))
        sys.exit(0)
    if args[:1] == ["--full"] and len(args) >= 2:
        print(full_matrix(Path(args[1]), tuple(args[2:])))
        sys.exit(0)
    if "--memory" not in sys.argv[1:]:
        sys.exit("usage: python -m bench.bench_model_zoo --memory [--quick]  (the matrix: python -m bench.run "
                 "--only bench_model_zoo)")
    print(memory_table(quick="--quick" in sys.argv[1:]))
