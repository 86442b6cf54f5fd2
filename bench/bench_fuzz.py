"""Parser and handler fuzzing (bench/fuzz_parsers.py), 0 crashes: 10^6 generated messages per
device-side parser, and 10^5 signed messages per kind (hello, state, progress, refusal,
update) into the coordinator's verifier and handlers.

The cases of each target are split into shards run in parallel processes (one per core);
shard k runs cases [k*n/s, (k+1)*n/s) of the same deterministic stream, so the union is the
same whatever the core count. `--quick` runs 10^4 per target.
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from bench.fuzz_coordinator import COORDINATOR_KINDS
from bench.fuzz_core import FuzzResult, fuzz
from bench.fuzz_parsers import TARGETS
from bench.run import machine_description

CASES = 1_000_000
COORDINATOR_CASES = 100_000  # per message kind: each case signs, verifies and writes the registry
QUICK_CASES = 10_000
SEED = 2026
COORDINATOR_TARGETS = tuple(f"coordinator_{k}" for k in COORDINATOR_KINDS)


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


def fuzz_all(cases: dict[str, int], workers: int) -> dict[str, FuzzResult]:
    shards = [Shard(name, k * n // workers, (k + 1) * n // workers - k * n // workers)
              for name, n in cases.items() for k in range(workers)]
    merged = {name: FuzzResult(name) for name in cases}
    with ProcessPoolExecutor(max_workers=workers) as pool:
        for shard, res in zip(shards, pool.map(_run_shard, shards), strict=True):
            m = merged[shard.target]
            m.cases += res.cases
            m.seconds += res.seconds  # CPU-side time summed over shards
            m.verdicts.update(res.verdicts)
            m.crashes += res.crashes
    return merged


def _table(results: dict[str, FuzzResult], what: str) -> list[str]:
    rows = [f"| {what} | cases | crashes | cases/s per process | most common verdicts |", "|---|---:|---:|---:|---|"]
    for name, r in results.items():
        top = ", ".join(f"{v} {n:,}" for v, n in r.verdicts.most_common(4))
        rows.append(f"| {name} | {r.cases:,} | {len(r.crashes)} | {r.rate:,.0f} | {top} |")
    return rows


def run(quick: bool = False) -> str:
    agent = [name for name in TARGETS if name not in COORDINATOR_TARGETS]
    cases = {name: QUICK_CASES if quick else CASES for name in agent}
    cases.update({name: QUICK_CASES if quick else COORDINATOR_CASES for name in COORDINATOR_TARGETS})
    workers = max(1, min(os.cpu_count() or 1, 4))
    before = os.getloadavg()
    results = fuzz_all(cases, workers)
    after = os.getloadavg()
    crashes = [f"- {name} case {c}: {err}" for name, r in results.items() for c, err, _ in r.crashes[:5]]
    handled = {name: sum(n for v, n in r.verdicts.items() if v.startswith("handled"))
               for name, r in results.items() if name in COORDINATOR_TARGETS}
    return "\n".join([
        "## Parser and handler fuzzing (bench_fuzz)",
        "",
        f"Generated inputs, mutations of real valid inputs (real keys, codec, the demo's bundle): byte-level havoc "
        f"(bit flips, boundary values, inserts, deletes, splices) and JSON-aware edits (dropped, added and retyped "
        f"members, huge and out-of-range numbers); seed {SEED}, {workers} processes. A crash is any exception other "
        "than the target's documented refusal. `python -m bench.fuzz_parsers --target T --seed S --replay N` "
        "reproduces case N.",
        "",
        f"Machine: {machine_description()}. Load average (1 min, 5 min) {before[0]:.1f}, {before[1]:.1f} before and "
        f"{after[0]:.1f}, {after[1]:.1f} after, on {os.cpu_count()} cores shared with other jobs: the rates are "
        "throughput under that load, not speeds to compare across runs.",
        "",
        f"### Device-side parsers ({cases[agent[0]]:,} inputs each)",
        "",
        *_table({n: results[n] for n in agent}, "parser"),
        "",
        f"### Coordinator handlers ({cases[COORDINATOR_TARGETS[0]]:,} signed messages per kind)",
        "",
        "Each case is one device message as a stolen device key (or a buggy agent) could send it: mostly a "
        "mutated body signed with the approved device's real key, so it gets past the signature; also mutated "
        "envelopes, messages from a device pending approval, bytes damaged after signing and keys nobody "
        "enrolled. It goes through what the serve loop does: `pending.open` (the verifier), then the "
        "coordinator's handler (coordinator/service_messages.py) over a real registry with a job in progress. "
        "Here a crash is any exception out of either, or a log line carrying a traceback.",
        "",
        *_table({n: results[n] for n in COORDINATOR_TARGETS}, "message kind"),
        "",
        "Messages that passed the verifier and were handled: "
        + ", ".join(f"{n.removeprefix('coordinator_')} {k:,}" for n, k in handled.items()) + ".",
        "",
        *(["Crashes:", "", *crashes] if crashes else ["0 crashes in every target."]),
        "",
        "Found and fixed while building this: integers too large for a float (`10**400`) in a "
        "signed command's params crashed `parse_finetune` (OverflowError), and in a bundle manifest's "
        "normalisation crashed the manifest parser (TypeError from numpy). The coordinator handler "
        "fuzzer, 20,000 messages per kind on the code before issue 35 (09e8118), found 39 crashes: 17 in update "
        "chunks and 1 in progress reports (OverflowError from the schema's `math.isfinite` on a huge `energy_wh`, "
        "`energy_kept` or `pct`, raised out of `Verifier.open` with any key), and 21 in states (SQLite's INTEGER "
        "overflow on a `battery_pct`, `power_w` or `energy_wh` of 2**63 and more, from the registry's history "
        "insert); none in hellos and refusals.",
    ])
