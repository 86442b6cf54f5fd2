"""`make bench`: run every bench/bench_*.py and rewrite BENCHMARKS.md.

Each benchmark module defines `run(quick: bool = False) -> str` returning a Markdown
section (its own `## Heading`, the figures, and how they were measured). Benchmarks compare
side by side in one run, as ratios, median of repetitions: the machine is shared and noisy.

Each section is kept between `<!-- bench:NAME -->` markers with the command that produced
it, so `--only NAME` re-runs one benchmark and replaces just its section. A benchmark that
fails never replaces its figures: its earlier section stays, with a line saying that the
latest run failed and why (the traceback goes to stderr, the exit code is 1); only a
benchmark that never had a section gets a FAILED one. Paths inside the repository are
written repo-relative and the home directory as `~`, so the file names no machine.
Usage: python -m bench.run [--quick] [--only NAME ...] [--output FILE]
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import re
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def machine_description() -> str:
    from bench.cpu import cpu_info

    cpu, _, flags = cpu_info()
    isa = ", ".join(f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni") if f in flags)
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kb / 1048576:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    return (
        f"{cpu} ({os.cpu_count()} cores{mem}; {isa or 'no AVX2'}), "
        f"{platform.system()} {platform.machine()}, Python {platform.python_version()}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    parser.add_argument("--only", nargs="*", help="bench module names, e.g. bench_codec")
    parser.add_argument("--output", default=str(ROOT / "BENCHMARKS.md"))
    args = parser.parse_args(argv)
    names = sorted(p.stem for p in (ROOT / "bench").glob("bench_*.py"))
    if args.only:
        names = [n for n in names if n in args.only]
    given = sys.argv[1:] if argv is None else argv
    command = "make bench" if not (args.quick or args.only) else "python -m bench.run " + " ".join(given)
    sections: dict[str, str] = {}
    failures: dict[str, str] = {}
    from bench._procs import compile_project

    compile_project()  # every bench's children import compiled modules, as an installed agent does
    for name in names:
        print(f"[bench] {name} ...", flush=True)
        load_before = _load()
        start = time.perf_counter()
        try:
            module = importlib.import_module(f"bench.{name}")
            body = module.run(quick=args.quick).rstrip() + "\n"
        except Exception:  # one broken benchmark must not hide the others' figures
            trace = traceback.format_exc()
            print(trace, file=sys.stderr, flush=True)
            failures[name] = trace.strip().splitlines()[-1]
            body = f"## {name}\n\nFAILED:\n\n```\n{repo_relative(trace)}```\n"
        elapsed = time.perf_counter() - start
        sections[name] = (f"<!-- bench:{name} -->\n{repo_relative(body)}\n_Produced by `{command}` on "
                          f"{time.strftime('%Y-%m-%d')} in {elapsed:.0f} s; load average {load_before} before, "
                          f"{_load()} after, on {os.cpu_count()} cores._\n<!-- /bench:{name} -->\n")
        print(f"[bench] {name} {'FAILED' if name in failures else 'done'} in {elapsed:.0f} s", flush=True)
    output = Path(args.output)
    earlier = _existing_sections(output) if output.exists() else {}
    kept = merge_sections(earlier, sections, failures, keep_others=bool(args.only),
                          note=f"`{command}` on {time.strftime('%Y-%m-%d')}")
    for name in failures:
        where = "kept its earlier section" if name in earlier else "no earlier section to keep"
        print(f"[bench] {name} FAILED ({repo_relative(failures[name])}); {where}", file=sys.stderr)
    header = (
        "# Benchmarks\n\n"
        "Written by `make bench` (all benchmarks) or `python -m bench.run --only NAME` (one "
        "section, replaced in place); each section names the command that produced it.\n\n"
        f"Machine: {machine_description()}.\n\n"
        "The machine is shared and noisy: figures are ratios measured side by side in one run, "
        "medians of repetitions.\n\n"
    )
    output.write_text(header + "\n".join(kept[name] for name in sorted(kept)))
    print(f"[bench] wrote {output}")
    return 1 if failures else 0


FAILED_NOTE = "_Latest run FAILED"


def _load() -> str:
    """The 1-minute load average (the machine is shared: figures are read against it)."""
    try:
        return f"{os.getloadavg()[0]:.1f}"
    except OSError:
        return "unknown"


def merge_sections(earlier: dict[str, str], new: dict[str, str], failures: dict[str, str], *,
                   keep_others: bool, note: str) -> dict[str, str]:
    """The sections to write: the new ones, except that a failed benchmark keeps its earlier
    section, marked with what failed (`note`: the command and date). `keep_others`: earlier
    sections of benchmarks that did not run stay (--only)."""
    out = dict(earlier) if keep_others else {}
    for name, section in new.items():
        old = earlier.get(name)
        if name not in failures or old is None:
            out[name] = section
            continue
        lines = [line for line in old.rstrip("\n").splitlines() if not line.startswith(FAILED_NOTE)]
        why = repo_relative(failures[name])[:300]
        lines.insert(len(lines) - 1, f"{FAILED_NOTE} ({note}: {why}); the figures above are from the run "
                                     "named above, kept._")
        out[name] = "\n".join(lines) + "\n"
    return out


def repo_relative(text: str) -> str:
    """`text` with this repository's absolute paths made relative to it and the home directory
    written as ~ (BENCHMARKS.md is committed: it must not carry one machine's paths)."""
    text = text.replace(f"{ROOT}{os.sep}", "").replace(str(ROOT), ".")
    home = str(Path.home())
    return text.replace(f"{home}{os.sep}", f"~{os.sep}") if len(home) > 1 else text


def _existing_sections(path: Path) -> dict[str, str]:
    """The marked sections of an earlier BENCHMARKS.md, by benchmark name."""
    text = path.read_text()
    return {m.group(1): m.group(0) + "\n"
            for m in re.finditer(r"<!-- bench:(\w+) -->.*?<!-- /bench:\1 -->", text, flags=re.S)}

if __name__ == "__main__":
    raise SystemExit(main())
