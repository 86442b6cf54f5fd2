"""`edge-agent kernels`: which int8 engines can run a model here, how fast, and which one wins.

The lead's edge_agent/cli.py calls `register(subparsers)`; the handler returns an exit code.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from ..errors import EXIT_OK
from .engine import ENV_FORCE_BACKEND, ENV_FORCE_WRONG

DESCRIPTION = """\
List every int8 engine for a model's frozen backbone on this device: whether it is
available (and why not), and with --bench what it costs and whether it is correct, and
which engine is chosen: the correct one with the least predicted energy for a job of
--images images (prepare + images x per-image, at its best thread count, within the
profile's memory cap). --bench measures the engines one at a time (each closed before
the next is prepared) and skips one whose predicted memory would take the process over
the cap (--memory-cap-mb, else the profile's), saying so in its row. The predicted energy for 100, 1,000 and 10,000 images is shown,
with a * on the engine each would choose.

Correct: the engine's top-1 through the bundle's head agrees with the fp32 model on the
bundle's calibration samples (up to 256) at most 0.5 points (and one sample) less often
than the bit-exact numpy reference does, and its features are within a loose sanity bound
of the reference's (mean under 10 output steps: catches layout and scale bugs). The
int8-unit distance to the reference is shown as a diagnostic.

That task-level check needs at least 32 calibration samples whose top-1 is decided
(not a near-tie that one output step of rounding could flip). With fewer -- a bundle with
few samples, a net whose features say nothing (random weights: every sample a tie) -- or
without the onnx package, it is INCONCLUSIVE, never ok: the table says so and the
unit-level comparison decides instead (every output within the graph's measured rounding
sensitivity of the reference, capped at 8 int8 units / 48 output steps, and the
same top-1 on the decided check samples). A graph that rounding moves by more than the cap
is reported as too sensitive to judge by units: there only a conclusive task-level check
can accept an engine further off than the cap.

Energy: CPU-seconds x the board profile's (load_w - idle_w) / cores (else 2 W). The
reference is timed only when no other engine is correct.

The measurements are cached in the state directory per (model sha256, hardware
fingerprint, edge-agent version, batch size, threads, candidate list); `edge-agent
finetune` reads the same directory (unless it is given --cache-dir) and re-checks the
cached choice on a few batches before using it. Without
--bench this command only shows the cached decision, if there is one.
"""

EPILOG = f"""\
examples:
  edge-agent kernels --model /var/lib/edge-agent/models/digits-3
  edge-agent kernels --model digits-3.tar.gz --bench --batch-size 32
  edge-agent kernels --model digits-3 --bench --backends tflite,reference --json
  {ENV_FORCE_BACKEND}=reference edge-agent kernels --model digits-3 --bench
  edge-agent kernels --model digits-3 --engine tflite --force-engine

exit codes: 0 ok, 64 bad command line (an unknown engine in --backends, a count < 1),
65 bad bundle, 69 no engine (or not the forced one) can run the model, or the forced one
disagrees with the reference (without --force-engine), 78 {ENV_FORCE_BACKEND} / --engine
names an unknown engine.
"""


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return value


def _backends(text: str) -> list[str]:
    """A,B,...: known engine names, in preference order."""
    from .engines import engine_names

    names = [b.strip() for b in text.split(",") if b.strip()]
    unknown = [n for n in names if n not in engine_names()]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown engine {', '.join(unknown) or text!r}; "
                                         f"known: {', '.join(engine_names())}")
    return names


def register(subparsers: Any) -> None:
    """Add `kernels` to the edge-agent argparse subcommands."""
    parser = subparsers.add_parser(
        "kernels", help="list int8 engines for a model, benchmark them and pick one",
        description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, metavar="BUNDLE",
                        help="model bundle directory, or its .tar.gz archive")
    parser.add_argument("--bench", action="store_true",
                        help="prepare, check and time every available engine now (and cache the choice)")
    parser.add_argument("--batch-size", type=_at_least_one, default=None, metavar="N",
                        help="batch size to time (default: the board profile's training batch size, else 32)")
    parser.add_argument("--threads", type=_at_least_one, default=None, metavar="N",
                        help="threads per engine, capped at the usable cores (default: the profile's "
                             "int8.threads, else all cores); on a busy machine 1 can be fastest")
    parser.add_argument("--backends", type=_backends, default=None, metavar="A,B,...",
                        help="candidates in preference order (default: the board profile's int8.backends, "
                             "else every engine)")
    parser.add_argument("--engine", default=None, metavar="NAME",
                        help=f"check and time only this engine and choose it (like {ENV_FORCE_BACKEND}); "
                             "an engine that disagrees with the reference is an error (exit 69)")
    parser.add_argument("--force-engine", action="store_true",
                        help=f"with --engine (or {ENV_FORCE_BACKEND}): use it even if it disagrees with "
                             f"the reference, with a warning ({ENV_FORCE_WRONG}=1)")
    parser.add_argument("--memory-cap-mb", type=_at_least_one, default=None, metavar="MB",
                        help="skip (with the reason in its row) an engine whose predicted memory would take "
                             "the process over MB (default: the board profile's training memory_cap_mb)")
    parser.add_argument("--images", type=_at_least_one, default=1000, metavar="N",
                        help="job size the choice minimises the predicted energy of (default 1000)")
    parser.add_argument("--repeats", type=_at_least_one, default=5, metavar="N", help="timed runs per engine (median)")
    parser.add_argument("--state-dir", default=None, metavar="DIR",
                        help="where the decision is cached (default: $EDGE_AGENT_STATE_DIR, "
                             "/var/lib/edge-agent if writable, else ~/.local/state/edge-agent)")
    parser.add_argument("--probe-report", default=None, metavar="FILE",
                        help="use this `edge-agent probe --json` report instead of probing now")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(func=run_kernels)


def default_state_dir() -> Path:
    env = os.environ.get("EDGE_AGENT_STATE_DIR")
    if env:
        return Path(env)
    system = Path("/var/lib/edge-agent")
    if system.is_dir() and os.access(system, os.W_OK):
        return system
    return Path.home() / ".local" / "state" / "edge-agent"


def _read_probe(path: str) -> dict[str, Any]:
    from ..atomic import read_json_object

    return read_json_object(path, 4 << 20, "probe report")


def run_kernels(args: argparse.Namespace) -> int:
    """`edge-agent kernels` (errors: run_command in cli.main)."""
    from . import selection as sel
    from .bundle import load_bundle, unpack_bundle

    report = _read_probe(args.probe_report) if args.probe_report else sel.default_probe()
    profile = sel.profile_settings(report)
    preference = args.backends or profile.get("backends")
    batch_size = args.batch_size or int(profile.get("batch_size", 32))
    from .engines._common import thread_count

    threads = thread_count(args.threads or profile.get("threads"))  # never more than the usable CPUs
    state_dir = Path(args.state_dir) if args.state_dir else default_state_dir()
    with tempfile.TemporaryDirectory(prefix="edge-agent-kernels-") as tmp:
        model = Path(args.model)
        bundle = unpack_bundle(model, Path(tmp) / "bundle") if model.is_file() else load_bundle(model)
        env = dict(os.environ)
        if args.engine:
            env[ENV_FORCE_BACKEND] = args.engine
        if args.force_engine:
            env[ENV_FORCE_WRONG] = "1"
        if args.bench or args.engine:
            selection, _ = sel.select_engine(bundle, probe=report, preference=preference,
                                             batch_size=batch_size, threads=threads, env=env,
                                             state_dir=state_dir, repeats=args.repeats, use_cache=False,
                                             images=args.images, watts_per_cpu=profile.get("watts_per_cpu"),
                                             mem_cap_mb=args.memory_cap_mb or profile.get("memory_cap_mb"),
                                             measure_all=True)
            rows = selection.candidates
        else:
            selection = sel.cached_selection(bundle, probe=report, preference=preference,
                                             batch_size=batch_size, threads=threads, state_dir=state_dir)
            rows = sel.availability_report(preference, report)
            if selection is not None:  # show the cached timings next to today's availability
                for row in rows:
                    old = selection.candidate(row.name)
                    if old is not None and old.latency_ms is not None:
                        row.__dict__.update({k: v for k, v in old.__dict__.items()
                                             if k not in ("name", "available", "reason")})
        info = {"model": bundle.manifest.name, "version": bundle.manifest.version, "sha256": bundle.sha256,
                "batch_size": batch_size, "threads": threads, "profile": profile.get("profile"),
                "hardware": sel.hardware_fingerprint(report), "state_dir": str(state_dir)}
    forced = env.get(ENV_FORCE_BACKEND, "").strip() or None
    if args.json:
        print(json.dumps({**info, "forced": forced, "chosen": selection.chosen if selection else None,
                          "cached": bool(selection and selection.cached),
                          "cache_file": selection.cache_file if selection else "",
                          "notes": selection.notes if selection else [],
                          # what this device reports to its fleet (shared_choice.py), or null
                          "share": selection.share if selection and selection.source == "measured" else None,
                          "candidates": [r.__dict__ for r in rows]}, indent=2))
    else:
        print(render(info, rows, selection, forced))
    return EXIT_OK


def _agreement(row: Any) -> str:
    verdict = "ok" if row.correct else "WRONG"
    if row.top1_fp32 is not None and row.reference_top1_fp32 is not None:
        return f"{verdict} {row.top1_fp32:.1%} (ref {row.reference_top1_fp32:.1%}, n={row.agreement_samples})"
    if row.max_diff is None:
        return "-"
    unit = "unit" if row.agreement == "int8" else "steps"
    if row.top1_checked:
        top1 = f"top-1 {round((row.top1_match or 0.0) * row.top1_checked)}/{row.top1_checked}"
    else:
        top1 = "top-1 inconclusive (0 decided)"
    basis = "inconclusive -> units " if row.inconclusive else ""
    return f"{basis}{verdict}: {row.agreement} max {row.max_diff:.3g}/{row.tolerance:g} {unit}, {top1}"


def _diagnostic(row: Any) -> str:
    if row.max_diff is None:
        return ""
    unit = "int8 units" if row.agreement == "int8" else "output steps"
    mean = f", mean {row.mean_steps:.2g} steps" if row.mean_steps is not None else ""
    tol = f" (rounding tolerance {row.tolerance:g})" if row.tolerance is not None and row.basis != "task" else ""
    sens = ""
    if row.rounding_sensitivity is not None:
        sens = f"; graph rounding sensitivity {row.rounding_sensitivity:g} units"
        sens += " (too sensitive to judge by units)" if row.too_sensitive else ""
    return f"max {row.max_diff:.3g} {unit} from the reference{tol}{mean}{sens}"


def _num(value: float | None, fmt: str) -> str:
    return format(value, fmt) if value is not None else "-"


def render(info: dict[str, Any], rows: list[Any], selection: Any, forced: str | None) -> str:
    from .selection import PREDICT_IMAGES

    chosen_for = selection.chosen_for if selection is not None else {}
    sizes = "".join(f" {'J@' + format(n, ','):>10}" for n in PREDICT_IMAGES)
    lines = [
        f"model:    {info['model']} {info['version']} (sha256 {info['sha256'][:16]}...)",
        f"device:   hardware {info['hardware']}, profile {info['profile'] or 'none'}, "
        f"batch {info['batch_size']}, threads {info['threads'] or 'all cores'}",
        "",
        f"  {'ENGINE':<13} {'AVAIL':<5} {'THR':>3} {'MS/BATCH':>9} {'mJ/IMG':>7} {'PREP CPU-s':>10} {'PREP J':>7} "
        f"{'PEAK MB':>7}{sizes}  {'TOP-1 VS FP32':<30} DETAIL",
    ]
    for r in rows:
        mark = "*" if r.chosen else " "
        pred = "".join(f" {_num(r.predicted_j.get(str(n)), '.1f') + ('*' if chosen_for.get(str(n)) == r.name else ' '):>10}"
                       for n in PREDICT_IMAGES)
        detail = r.error or r.reason
        lines.append(f"{mark} {r.name:<13} {'yes' if r.available else 'no':<5} {_num(r.threads, 'd'):>3} "
                     f"{_num(r.latency_ms, '.2f'):>9} {_num(r.per_image_j and r.per_image_j * 1e3, '.2f'):>7} "
                     f"{_num(r.prepare_cpu_s, '.2f'):>10} {_num(r.prepare_j, '.2f'):>7} {_num(r.peak_mb, '.0f'):>7}"
                     f"{pred}  {_agreement(r):<30} {detail}")
        if _diagnostic(r):
            lines.append(f"  {'':<13} diagnostic: {_diagnostic(r)}")
    lines.append("")
    if selection is None:
        lines.append("chosen:   not benchmarked yet on this device (run with --bench)")
    else:
        how = (f"forced by {ENV_FORCE_BACKEND}={forced}" if selection.forced else
               f"least predicted energy for {selection.images:,} images, cached {selection.created}" if selection.cached else
               f"least predicted energy for {selection.images:,} images (measured now)")
        lines.append(f"chosen:   {selection.chosen} with {selection.threads or '-'} thread(s) ({how})")
        if chosen_for:
            lines.append("by size:  " + ", ".join(f"{int(n):,} images: {e}" for n, e in chosen_for.items()))
        if selection.energy_j:
            lines.append(f"cost:     this selection used ~{selection.energy_j:.1f} J")
        if selection.cache_file:
            lines.append(f"cache:    {selection.cache_file}")
    # how the engines were judged (the same for every engine: said once, without its name)
    from .agreement import evidence_notes

    judged = list(dict.fromkeys(note.split(": ", 1)[1] for r in rows for note in evidence_notes(r)))
    if selection is not None:
        lines.extend(f"note:     {n}" for n in selection.notes if n.split(": ", 1)[-1] not in judged)
    lines.extend(f"note:     {n}" for n in judged)
    if forced and (selection is None or not selection.forced):
        lines.append(f"note:     {ENV_FORCE_BACKEND}={forced} is set: training will use {forced}")
    lines.append("J@N: predicted job energy for N images (prepare + N x per-image); * = chosen for that size. "
                 "Top-1 vs fp32 on the bundle's calibration samples; the int8 distance is a diagnostic.")
    return "\n".join(lines)
