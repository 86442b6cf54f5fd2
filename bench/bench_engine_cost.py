"""What each int8 engine would cost a fine-tune job, and whether it is accurate enough.

The camera scenario's MobileNetV2 bundle (edge_agent.sim.scenario.ensure_mobilenet_bundle,
width 0.5, 96x96, built once and reused) goes through the engine selection a job runs
(`select_engine`, batch 32, every engine, no cache): per engine its prepare cost (CPU-s and
J), per-image cost at the batch size, peak RSS growth over prepare + runs, top-1 agreement
with the fp32 model on the bundle's calibration samples against the reference's, and the
predicted job energy for 100, 1,000 and 10,000 images; * marks the engine chosen for that
job size. J = CPU-seconds x the matched board profile's (load_w - idle_w) / cores.
"""

from __future__ import annotations

import tempfile
from pathlib import Path


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


def run(quick: bool = False) -> str:
    from bench.bench_kernels import _cpu
    from bench.run import machine_description
    from edge_agent.int8.bundle import load_bundle
    from edge_agent.int8.selection import default_probe, profile_settings, select_engine
    from edge_agent.sim.scenario import ensure_mobilenet_bundle

    model, _mhz, flags = _cpu()
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
    ]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(run(quick=True))
