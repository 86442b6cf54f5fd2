"""What each int8 engine would cost a fine-tune job, and whether it is accurate enough.

The camera scenario's MobileNetV2 bundle (edge_agent.sim.scenario.ensure_mobilenet_bundle,
width 0.5, 96x96, built once and reused) goes through the engine selection a job runs
(`select_engine`, batch 32, every engine, no cache): per engine its prepare cost (CPU-s and
J), per-image cost at the batch size, peak RSS growth over prepare + runs, top-1 agreement
with the fp32 model on the bundle's calibration samples against the reference's, and the
predicted job energy for 100, 1,000 and 10,000 images; * marks the engine chosen for that
job size. J = CPU-seconds x the matched board profile's (load_w - idle_w) / cores.

Then what choosing the int8 engine costs a device before its first training step: a fresh
device (nothing cached, nothing shared) vs one that starts from a choice a device of its kind
measured (the fleet-shared choice the coordinator relays), vs the exhaustive measurement
(every available engine prepared, checked and timed) whose choice both must match.

Bundles: the demo's digits bundle (edge_agent.sim.scenario.ensure_bundle), the camera
scenario's MobileNetV2 0.5 @ 96x96 (ensure_mobilenet_bundle) and three model-zoo
architectures (tests/fixtures/models/zoo.py: Gluon ResNet-18 v1, Gluon MobileNetV2 0.25 and
torchvision's MobileNetV2 export). Each selection runs in its own fresh interpreter
(`python -m bench.bench_engine_cost --child '<json>'`) with its own empty state directory;
CPU-s is that process's CPU time over the `select_engine` call (every thread: XNNPACK's pool
too; the head's top-1 through numpy where it can, as a job does), peak RSS is the process's
VmHWM (the interpreter, numpy and the bundle included), J is CPU-s x the matched board
profile's watts per busy CPU. Medians of 3 runs; the chosen engine is the most frequent one,
with how often it was chosen.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any


def _rows_table(selection: object) -> list[str]:
    from edge_agent.int8.selection import PREDICT_IMAGES

    def num(value: float | None, fmt: str) -> str:
        return format(value, fmt) if value is not None else "-"

    head = "| engine | threads | ms/batch | ms/image | mJ/image | prepare CPU-s | prepare J | peak MB | " \
           "top-1 vs fp32 (reference) | verdict | " + " | ".join(f"J @ {n:,}" for n in PREDICT_IMAGES) + \
           " | diagnostic: distance to the reference |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    chosen_for = selection.chosen_for  # type: ignore[attr-defined]
    for r in selection.candidates:  # type: ignore[attr-defined]
        agree = (f"{r.top1_fp32:.1%} ({r.reference_top1_fp32:.1%}, n={r.agreement_samples})"
                 if r.top1_fp32 is not None else "-")
        verdict = "accepted" if r.correct else ("refused" if r.correct is False else (r.error or r.reason)[:60])
        pred = " | ".join(num(r.predicted_j.get(str(n)), ".1f") + (" *" if chosen_for.get(str(n)) == r.name else "")
                          for n in PREDICT_IMAGES)
        diag = (f"max {r.max_diff:.3g} {'int8 units' if r.agreement == 'int8' else 'output steps'}, "
                f"mean {r.mean_steps:.2g} steps" if r.max_diff is not None and r.mean_steps is not None else "-")
        lines.append(f"| {r.name} | {num(r.threads, 'd')} | {num(r.latency_ms, '.1f')} | "
                     f"{num(r.per_image_s and r.per_image_s * 1e3, '.2f')} | {num(r.per_image_j and r.per_image_j * 1e3, '.2f')} | "
                     f"{num(r.prepare_cpu_s, '.2f')} | {num(r.prepare_j, '.2f')} | {num(r.peak_mb, '.0f')} | {agree} | "
                     f"{verdict} | {pred} | {diag} |")
    return lines


ROOT = Path(__file__).resolve().parent.parent
ZOO = ("gluon-resnet18_v1", "gluon-mobilenetv2_0.25", "torch-mobilenet_v2-legacy")
IMAGES = 1000  # the job size the choice is made for
BATCH = 32


def _hwm_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024.0
    return float("nan")


def child(args: dict[str, Any]) -> dict[str, Any]:
    """One selection in this (fresh) process, measured."""
    import time

    from edge_agent.int8 import selection as sel
    from edge_agent.int8.bundle import load_bundle
    from edge_agent.int8.shared_choice import SharedChoice

    bundle = load_bundle(args["bundle"])
    probe = sel.default_probe()
    profile = sel.profile_settings(probe)
    wpc = float(profile.get("watts_per_cpu") or 2.0)
    shared = [SharedChoice.from_json(args["share"])] if args.get("share") else []
    from edge_agent.train.dense_head import numpy_head_logits

    logits = numpy_head_logits(bundle)  # as a job does: a head numpy computes needs no MXNet for the top-1 check
    base_mb = _hwm_mb()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    selection, _ = sel.select_engine(bundle, probe=probe, batch_size=BATCH, state_dir=args["state"], env={},
                                     logits=logits,
                                     images=IMAGES, watts_per_cpu=wpc, mem_cap_mb=profile.get("memory_cap_mb"),
                                     shared=shared, measure_all=args["mode"] == "exhaustive")
    cpu = time.process_time() - cpu0
    return {"chosen": selection.chosen, "threads": selection.threads, "cpu_s": cpu, "wall_s": time.perf_counter() - wall0,
            "peak_mb": _hwm_mb(), "base_mb": base_mb, "j": cpu * wpc, "source": selection.source,
            "share": selection.share, "notes": selection.notes, "profile": profile.get("profile"), "wpc": wpc,
            "prepared": [c.name for c in selection.candidates if c.prepare_cpu_s is not None]}


def _run_child(args: dict[str, Any]) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("EDGE_AGENT_INT8_BACKEND", None)
    done = subprocess.run([sys.executable, "-m", "bench.bench_engine_cost", "--child", json.dumps(args)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"selection child failed ({done.returncode}): {done.stderr.strip()[-800:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _bundles(tmp: Path) -> list[tuple[str, Path]]:
    from edge_agent.sim.scenario import ensure_bundle, ensure_mobilenet_bundle

    cache = Path(tempfile.gettempdir()) / "edge-agent-bench"
    out = [("demo digits CNN", ensure_bundle(cache / "demo-digits")),
           ("camera MobileNetV2 0.5 @96", ensure_mobilenet_bundle(cache / "camera-mobilenet")[0])]
    from tests.fixtures.models import zoo

    by_id = {a.id: a for a in zoo.all_archs()}
    for arch_id in ZOO:
        if arch_id in by_id:
            arch = by_id[arch_id]
            out.append((f"zoo {arch_id} @{arch.size}", zoo.build(arch, tmp / arch_id).bundle.path))
    return out


def _median(rows: list[dict[str, Any]], field: str) -> float:
    return statistics.median(r[field] for r in rows)


def _chosen(rows: list[dict[str, Any]]) -> str:
    (name, n), = Counter(r["chosen"] for r in rows).most_common(1)
    return f"{name} ({n}/{len(rows)})"


def selection_cost(quick: bool = False) -> str:
    """The selection-cost table (module doc, second part)."""
    repeats = 1 if quick else 3
    lines = []
    profile = wpc = None
    with tempfile.TemporaryDirectory(prefix="bench-selection-cost-") as tmp_name:
        tmp = Path(tmp_name)
        for label, bundle in _bundles(tmp):
            runs: dict[str, list[dict[str, Any]]] = {"fresh": [], "shared": [], "exhaustive": []}
            for i in range(repeats):
                for mode in ("exhaustive", "fresh"):
                    runs[mode].append(_run_child({"bundle": str(bundle), "mode": mode,
                                                  "state": str(tmp / f"{label}-{mode}-{i}".replace(" ", "_"))}))
            share = next((r["share"] for r in runs["fresh"] if r["share"]), None)
            for i in range(repeats if share else 0):
                runs["shared"].append(_run_child({"bundle": str(bundle), "mode": "shared", "share": share,
                                                  "state": str(tmp / f"{label}-shared-{i}".replace(" ", "_"))}))
            fresh, shared, full = runs["fresh"], runs["shared"], runs["exhaustive"]
            profile, wpc = fresh[0]["profile"], fresh[0]["wpc"]
            adopted = sum(r["source"] == "fleet" for r in shared)
            agree = {r["chosen"] for r in fresh + shared} <= {r["chosen"] for r in full}
            lines.append(
                f"| {label} | {_median(full, 'cpu_s'):.2f} | {_median(full, 'peak_mb'):.0f} | {_chosen(full)} | "
                f"{_median(fresh, 'cpu_s'):.2f} | {_median(fresh, 'peak_mb'):.0f} | {_median(fresh, 'j'):.1f} | "
                f"{_chosen(fresh)} | "
                + (f"{_median(shared, 'cpu_s'):.2f} | {_median(shared, 'peak_mb'):.0f} | {_median(shared, 'j'):.2f} | "
                   f"{_chosen(shared)}, adopted {adopted}/{len(shared)} | " if shared else "- | - | - | no share | ")
                + f"{'yes' if agree else 'NO'} | {', '.join(sorted({p for r in fresh for p in r['prepared']}))} |")
    return "\n".join([
        "### What choosing the engine costs: a fresh device vs a fleet-shared choice",
        "",
        f"Board profile {profile or 'none'}: J = CPU-s x {wpc or 2.0:.2f} W per busy CPU. A job of {IMAGES:,} "
        f"images at batch {BATCH}; medians of {repeats} runs, each in a fresh process with an empty state "
        "directory (command below).",
        "",
        "| bundle | exhaustive CPU-s | exhaustive peak MB | exhaustive choice | fresh CPU-s | fresh peak MB | "
        "fresh J | fresh choice | shared CPU-s | shared peak MB | shared J | shared choice | matches exhaustive | "
        "prepared when fresh |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *lines,
        "",
        "Exhaustive: every available engine prepared, checked and timed (mxnet-onednn's multi-second prepare "
        "included). Fresh: what a first job does now -- an engine whose prepare alone costs more than the whole "
        "job on an engine already checked is not prepared. Shared: a device of the same kind (board, CPU "
        "features, backbone, batch, threads) starts from the fresh device's reported choice and only re-checks "
        "it (the engine's output on 8 calibration samples hashes to the reported fingerprint; a few batches "
        "within 2x of the reported time). Peak MB is the whole process's peak RSS (about 80 MB of it is the "
        "interpreter, numpy and the bundle before selection starts). 'matches exhaustive': the fresh and "
        "shared choices are among the exhaustive runs' choices.",
    ]) + "\n"


def run(quick: bool = False) -> str:
    from bench.cpu import cpu_info
    from bench.run import machine_description
    from edge_agent.int8.bundle import load_bundle
    from edge_agent.int8.selection import default_probe, profile_settings, select_engine
    from edge_agent.sim.scenario import ensure_mobilenet_bundle

    model, _mhz, flags = cpu_info()
    isa = sorted(f for f in flags if f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "asimddp", "i8mm"))
    dest = Path(tempfile.gettempdir()) / "edge-agent-bench" / "camera-mobilenet"
    bundle_dir, _params, _built = ensure_mobilenet_bundle(dest)
    bundle = load_bundle(bundle_dir)
    probe = default_probe()
    profile = profile_settings(probe)
    wpc = profile.get("watts_per_cpu")
    with tempfile.TemporaryDirectory(prefix="bench-engine-cost-") as tmp:
        selection, _ = select_engine(bundle, probe=probe, batch_size=32, threads=None, state_dir=tmp,
                                     repeats=3 if quick else 7, use_cache=False, env={}, images=1000,
                                     watts_per_cpu=wpc, mem_cap_mb=profile.get("memory_cap_mb"),
                                     measure_all=True)  # every engine priced, even one a job would skip
    out = [
        "## Engine cost and task-level agreement (camera MobileNetV2)",
        "",
        f"Machine: {machine_description()}. CPU model {model}; int8-relevant flags: {', '.join(isa) or 'none'}.",
        f"Board profile {profile.get('profile') or 'none'}: {wpc or 2.0:.2f} W per busy CPU "
        f"(J = CPU-s x that), memory cap {profile.get('memory_cap_mb') or 'none'} MB. Bundle "
        f"{bundle.manifest.name} (MobileNetV2 0.5, 96x96), batch 32, up to {selection.key['threads']} threads "
        "(each engine at its cheapest thread count), medians of interleaved rounds.",
        "",
        *_rows_table(selection),
        "",
        f"Chosen for 1,000 images: **{selection.chosen}** ({selection.threads} thread(s)); by job size: "
        + ", ".join(f"{int(n):,}: {e}" for n, e in selection.chosen_for.items())
        + f". This selection cost ~{selection.energy_j:.0f} J (probe, agreement, prepares, timing).",
        "",
        "Accepted = top-1 through the head agrees with the fp32 model on the calibration samples at most "
        "max(0.5 points, one sample) less often than the bit-exact reference, and the features are within a "
        "mean of 10 output steps of the reference's (the sanity bound against layout/scale bugs). The reference "
        "itself is prepared and timed only when no other engine is accepted. Peak MB is the growth of the "
        "process's peak RSS over the engine's prepare and runs (the first engine to import MXNet pays for it).",
        "",
        selection_cost(quick),
    ]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(child(json.loads(sys.argv[2]))))
    else:
        print(run(quick="--quick" in sys.argv))
