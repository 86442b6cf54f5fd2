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

from ..errors import EXIT_OK, InputError
from .engine import ENV_FORCE_BACKEND, ENV_FORCE_WRONG

DESCRIPTION = """\
List every int8 engine for a model's frozen backbone on this device: whether it is
available (and why not), and with --bench its latency at the training batch size, its
agreement with the numpy reference, and which engine is chosen (the fastest correct one).

Agreement: engines that run the bundle's own int8 .tflite (tflite, edgetpu, native,
reference) must match the reference within 1 int8 unit; mxnet-onednn calibrates its own
int8 scales, so it is compared in float (within a few output quantisation steps). Both
must give the head the same top-1 on every check sample that is not a near-tie.

The decision is cached in the state directory per (model sha256, hardware fingerprint,
edge-agent version, batch size, threads, candidate list); training reuses it. Without
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
    from ..atomic import read_limited

    try:
        report = json.loads(read_limited(path, 4 << 20))
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: not a readable probe report ({exc})") from None
    if not isinstance(report, dict):
        raise InputError(f"{path}: a probe report must be a JSON object")
    return report


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
                                             state_dir=state_dir, repeats=args.repeats, use_cache=False)
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
                          "candidates": [r.__dict__ for r in rows]}, indent=2))
    else:
        print(render(info, rows, selection, forced))
    return EXIT_OK


def _agreement(row: Any) -> str:
    if row.max_diff is None:
        return "-"
    unit = "unit" if row.agreement == "int8" else "steps"
    top1 = ""
    if row.top1_match is not None and row.top1_checked is not None:
        top1 = f"top-1 {round(row.top1_match * row.top1_checked)}/{row.top1_checked}"
    verdict = "ok" if row.correct else "WRONG"
    return f"{verdict}: {row.agreement} max {row.max_diff:.3g}/{row.tolerance:g} {unit}, {top1}"


def render(info: dict[str, Any], rows: list[Any], selection: Any, forced: str | None) -> str:
    lines = [
        f"model:    {info['model']} {info['version']} (sha256 {info['sha256'][:16]}...)",
        f"device:   hardware {info['hardware']}, profile {info['profile'] or 'none'}, "
        f"batch {info['batch_size']}, threads {info['threads'] or 'all cores'}",
        "",
        f"  {'ENGINE':<13} {'AVAILABLE':<9} {'MS/BATCH':>9} {'IMAGES/S':>9}  {'AGREEMENT':<42} DETAIL",
    ]
    for r in rows:
        mark = "*" if r.chosen else " "
        ms = f"{r.latency_ms:.2f}" if r.latency_ms is not None else "-"
        ips = f"{r.images_per_s:.0f}" if r.images_per_s is not None else "-"
        detail = r.error or r.reason
        lines.append(f"{mark} {r.name:<13} {'yes' if r.available else 'no':<9} {ms:>9} {ips:>9}  "
                     f"{_agreement(r):<42} {detail}")
    lines.append("")
    if selection is None:
        lines.append("chosen:   not benchmarked yet on this device (run with --bench)")
    else:
        how = (f"forced by {ENV_FORCE_BACKEND}={forced}" if selection.forced else
               f"fastest correct engine, cached {selection.created}" if selection.cached else
               "fastest correct engine (measured now)")
        lines.append(f"chosen:   {selection.chosen} ({how})")
        if selection.cache_file:
            lines.append(f"cache:    {selection.cache_file}")
        lines.extend(f"note:     {n}" for n in selection.notes)
    if forced and (selection is None or not selection.forced):
        lines.append(f"note:     {ENV_FORCE_BACKEND}={forced} is set: training will use {forced}")
    lines.append("agreement: int8 = max |engine - reference| in int8 units on the bundle's own model; "
                 "float = in output quantisation steps (engines with their own calibration).")
    return "\n".join(lines)
