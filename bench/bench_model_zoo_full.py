"""The model-zoo matrix at real width (issue 41): every torchvision CNN family by both of
PyTorch's exporters, and the Gluon zoo's large nets, each bundled with training depths,
selected, checked for top-1 agreement and fine-tuned at depth 1.

The torchvision exports are hundreds of MB and need torch, which is never a dependency of
edge-agent: `make zoo-fixtures` makes them in a venv of their own (build/torchvenv) into
build/zoo-full (make_torch_fixtures.py --full). The Gluon nets are built here (zoo.GLUON_FULL).

    make zoo-fixtures                                        # once: ~15 min
    python -m bench.run --only bench_model_zoo_full          # the section in BENCHMARKS.md
    python -m bench.bench_model_zoo_full build/zoo-full torch-resnet   # some rows, printed
    ZOO_BIAS_CORRECTION=1 python -m bench.bench_model_zoo_full build/zoo-full torch-mnasnet
                                     # the same, bundled with `model create --bias-correction`
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from bench.bench_model_zoo import BATCH

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "build" / "zoo-full"


# Issue 41's matrix at real width: every torchvision CNN family, both exporters, 64x64
# digits, briefly trained (make_torch_fixtures.py --full DIR: hundreds of MB, never
# committed). Each export is measured in a child of its own (its peak RSS, and a crash is a
# row): bundled with FULL_DEPTHS training depths, the engine selection and agreement of the
# smaller matrix (zoo.measure), then a real `run_finetune` at depth 1 (the job selects its
# engine itself), judged on held-out digits through the bundle's own tail before and after.
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
        built = zoo.build(arch, tmp / "bundle", depths=FULL_DEPTHS,
                          bias_correction=os.environ.get("ZOO_BIAS_CORRECTION") == "1")
        row["create_s"] = built.create_s
        row["depths"] = [d.depth for d in built.bundle.manifest.depths]
        row["onnx_mb"] = len(built.bundle.onnx_bytes()) / 2**20  # the fp32 backbone the bundle keeps
        result = zoo.measure(built, batch_size=BATCH, repeats=1)
        row.update(chosen=result.chosen, agreement=result.agreement, fp32_accuracy=result.fp32_accuracy,
                   int8_accuracy=result.int8_accuracy, head_before=result.finetune_before,
                   head_after=result.finetune_after, own_agreement=result.own_agreement,
                   own_fp32_accuracy=result.own_fp32_accuracy)
        if len(row["depths"]) < 2:
            return row
        x_train, y_train, x_test, y_test = zoo.digits(arch.size)
        np.savez(tmp / "digits.npz", x=x_train, y=y_train.astype(np.int64))
        report = run_finetune(model=built.bundle.path, data=tmp / "digits.npz", state_dir=tmp / "state",
                              cache_dir=tmp / "cache", depth=1, epochs=8, patience=4, batch_size=16,
                              val_fraction=0.25, profile="raspberry-pi-4")
        own = DepthPredictor(built.bundle, depth=1)
        tuned = DepthPredictor(built.bundle, depth=1, params=tail_params(built.bundle, report["head"]["file"]))
        x_held, y_held = x_test[:FULL_TEST], y_test[:FULL_TEST]
        try:
            row["depth1_before"], row["depth1_after"] = own.accuracy(x_held, y_held), tuned.accuracy(x_held, y_held)
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
           f"{FULL_TEST} digits through the bundle's own depth-1 tail before and after. Agreement is judged through a linear "
           f"head fitted on {zoo.N_TRAIN} digits' fp32 features and, where the fixture kept it (`.classifier.npz`, "
           "torchvision exports made since 2026-12-05), through the classifier the net was trained with: the "
           "bundle's head with its trained parameters ('own classifier'; its fp32 accuracy in brackets). Met: >= 2 "
           "depths past the head, both agreements >= 99 %, the depth-1 fine-tune raises held-out accuracy. "
           "Peak RSS: the child's, all of "
           "it. Command: `make zoo-fixtures`, then `python -m bench.run --only bench_model_zoo_full`.", "",
           "| network | opset | file MB | depths | chosen | top-1 agreement | fp32 accuracy | own classifier "
           "| depth-1 fine-tune | create s | peak RSS MB | met |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    entries = [(a.id, "-", None, "") for a in zoo.GLUON_FULL] + [
        (f"torch-{f['id']}", str(f.get("opset", "-")), f.get("bytes"), f.get("error", "")) for f in index]
    entries = [e for e in entries if not only or any(o in e[0] for o in only)]
    failed, met_count = [], 0
    for arch_id, opset, size, export_error in entries:
        if export_error:
            failed.append(f"- {arch_id}: the export itself failed: {export_error[:200]}")
            continue
        rc, stdout, err, rss = peak_rss_run([sys.executable, "-m", "bench.bench_model_zoo_full", "--one", str(where),
                                             arch_id], timeout=3600)
        if rc != 0:
            last = [ln for ln in err.strip().splitlines() if ln.strip()][-1:] or [f"exit {rc}"]
            failed.append(f"- {arch_id}: {last[0][:300]}")
            print(f"{arch_id}: FAILED {last[0][:300]}", flush=True)
            continue
        r = json.loads(stdout.strip().splitlines()[-1])
        deep = f"{r['depth1_before']:.1%} -> {r['depth1_after']:.1%}" if "depth1_after" in r else "-"
        own = r.get("own_agreement")
        met = (len(r["depths"]) >= 3 and r["agreement"] >= 0.99 and (own is None or own >= 0.99)
               and r.get("depth1_after", 0.0) > r.get("depth1_before", 1.0))
        own_cell = f"{own:.1%} ({r['own_fp32_accuracy']:.1%})" if own is not None else "-"
        met_count += met
        file_mb = f"{size / 2**20:.1f}" if size else f"{r['onnx_mb']:.1f}"
        line = (f"| {arch_id} | {opset} | {file_mb} | {len(r['depths']) - 1} | {r['chosen']} | {r['agreement']:.1%} "
                f"| {r['fp32_accuracy']:.1%} | {own_cell} | {deep} | {r['create_s']:.0f} | {rss:.0f} | {'yes' if met else '**no**'} |")
        out.append(line)
        print(line, flush=True)
    out += ["", f"Met: {met_count} of {len(entries)}."]
    if failed:
        out += ["", "Not bundled:", *failed]
    return "\n".join(out) + "\n"


def run(quick: bool = False) -> str:
    """bench.run's entry: the full matrix over build/zoo-full (`quick`: one row per source)."""
    if not (FIXTURES / "fixtures.json").exists():
        raise RuntimeError(f"no {FIXTURES.relative_to(ROOT)}/fixtures.json: run `make zoo-fixtures` first "
                           "(torch in build/torchvenv, never a project dependency)")
    return full_matrix(FIXTURES, ("gluon-resnet50_v1", "torch-resnet18-") if quick else ())


if __name__ == "__main__":
    import json
    import sys

    args = sys.argv[1:]
    if args[:1] == ["--one"] and len(args) == 3:
        print(json.dumps(full_one(Path(args[1]), args[2])))
    elif args and not args[0].startswith("-"):
        print(full_matrix(Path(args[0]), tuple(args[1:])))
    else:
        sys.exit("usage: python -m bench.bench_model_zoo_full DIR [ID-PART...]   (rows whose id contains a part)\n"
                 "       python -m bench.bench_model_zoo_full --one DIR ID       (one row as JSON: the child)")
