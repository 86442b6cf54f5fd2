"""Agent parser fuzzing: 10^6 generated messages per parser (bench/fuzz_parsers.py), 0 crashes.

The cases of each parser are split into shards run in parallel processes (one per core);
shard k runs cases [k*n/s, (k+1)*n/s) of the same deterministic stream, so the union is the
same whatever the core count. `--quick` runs 10^4 per parser.
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from bench.fuzz_parsers import TARGETS, FuzzResult, fuzz

CASES = 1_000_000
QUICK_CASES = 10_000
SEED = 2026


@dataclass
class Shard:
    target: str
    first: int
    cases: int


def _run_shard(shard: Shard) -> FuzzResult:
    target = TARGETS[shard.target]()
    try:
        return fuzz(target, shard.cases, seed=SEED, first=shard.first)
    finally:
        target.close()


def fuzz_all(cases: int, workers: int) -> dict[str, FuzzResult]:
    shards = [Shard(name, k * cases // workers, (k + 1) * cases // workers - k * cases // workers)
              for name in TARGETS for k in range(workers)]
    merged = {name: FuzzResult(name) for name in TARGETS}
    with ProcessPoolExecutor(max_workers=workers) as pool:
        for shard, res in zip(shards, pool.map(_run_shard, shards), strict=True):
            m = merged[shard.target]
            m.cases += res.cases
            m.seconds += res.seconds  # CPU-side time summed over shards
            m.verdicts.update(res.verdicts)
            m.crashes += res.crashes
    return merged


def run(quick: bool = False) -> str:
    cases = QUICK_CASES if quick else CASES
    workers = max(1, min(os.cpu_count() or 1, 4))
    results = fuzz_all(cases, workers)
    rows = []
    for name, r in results.items():
        top = ", ".join(f"{v} {n:,}" for v, n in r.verdicts.most_common(4))
        rows.append(f"| {name} | {r.cases:,} | {len(r.crashes)} | {r.rate:,.0f} | {top} |")
    crashes = [f"- {name} case {c}: {err}" for name, r in results.items() for c, err, _ in r.crashes[:5]]
    return "\n".join([
        "## Agent parser fuzzing (bench_fuzz)",
        "",
        f"{cases:,} generated inputs per parser, mutations of real valid inputs (real keys, codec, the demo's "
        f"bundle): byte-level havoc (bit flips, boundary values, inserts, deletes, splices) and JSON-aware edits "
        f"(dropped, added and retyped members); seed {SEED}, {workers} processes. A crash is any exception "
        "other than the parser's documented refusal. `python -m bench.fuzz_parsers --target T --seed S "
        "--replay N` reproduces case N.",
        "",
        "| parser | cases | crashes | cases/s per process | most common verdicts |",
        "|---|---:|---:|---:|---|",
        *rows,
        "",
        *(["Crashes:", "", *crashes] if crashes else ["0 crashes in every parser."]),
        "",
        "Found and fixed while building this: integers too large for a float (`10**400`) in a "
        "signed command's params crashed `parse_finetune` (OverflowError), and in a bundle manifest's "
        "normalisation crashed the manifest parser (TypeError from numpy).",
    ])
