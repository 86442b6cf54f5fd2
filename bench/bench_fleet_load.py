"""Coordinator under a simulated fleet over real MQTT (issue 18): edge_agent/sim/fleet_load.py.

Rows: 100 and 1,000 simulated devices x heads of 100k and 1M parameters x FedAvg (clipped)
and trimmed mean; `--quick`: 100 devices only. 10,000 devices only with
EDGE_FLEET_LOAD_10K=1 (long: connecting and enrolling 10,000 devices is most of it).
Each row is one round in a fresh broker + serve + simulated fleet (5 % dropouts, 5 % slow
links). Broker and serve run at EDGE_FLEET_LOAD_NICE (default 15): the machine is shared.
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path
from typing import Any

from bench.fleet_load import base_bundle
from edge_agent.sim.fleet_load import LoadConfig, run_load

AGGREGATORS = ("fedavg_clipped", "trimmed_mean")


def _row(r: dict[str, Any]) -> str:
    c, s = r["config"], r["sim"]

    def f(x: float, fmt: str) -> str:
        return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)

    ratio = r["disk_mb"] / r["received_mb"] if r["received_mb"] else float("nan")
    return (f"| {c['devices']:,} | {c['params']} | {c['aggregator']} | {s['connected']:,} in {r['connect_s']:.1f} s "
            f"| {r['accepted']:,} / {s['dropped_out']} | {f(r['updates_per_s'], '.0f')} "
            f"| {f(r['last_update_to_version_s'], '.2f')} s | {r['rss_mb']:.0f} MB | {r['disk_mb']:.1f} MB "
            f"| {r['received_mb']:.1f} MB | {f(ratio, '.2f')}x | {r['round_state']}, {r['closed_by']} |")


def run(quick: bool = False) -> str:
    sizes = [100] if quick else [100, 1000]
    if os.environ.get("EDGE_FLEET_LOAD_10K") == "1":
        sizes.append(10_000)
    nice = int(os.environ.get("EDGE_FLEET_LOAD_NICE", "15"))
    cache = Path(tempfile.gettempdir()) / "edge-fleet-load-cache"
    bundle = base_bundle(cache)
    rows, failures = [], []
    for n in sizes:
        for params in ("100k", "1m"):
            for agg in AGGREGATORS:
                # a lost dropout report makes a round wait for its deadline: keep it bounded
                cfg = LoadConfig(devices=n, params=params, aggregator=agg, nice=nice, deadline_s=120.0 + 0.2 * n,
                                 connect_rate=1000.0 if n > 1000 else 500.0)
                with tempfile.TemporaryDirectory(prefix="bench-fleet-load-") as tmp:
                    try:
                        rows.append(run_load(cfg, Path(tmp), bundle))
                    except Exception as exc:  # one size failing must not hide the others
                        failures.append(f"{n} x {params} x {agg}: {str(exc)[:300]}")
    lines = [
        "## Coordinator under a simulated fleet (real MQTT)",
        "",
        "One round per row: a real mosquitto (`max_queued_messages 0`), a real `edge-coordinator serve "
        "--auto-approve` and N simulated devices in one process (edge_agent/sim: own Ed25519 keys, one paho "
        "connection each multiplexed on an epoll thread, signed hello/state/progress, the `finetune` command "
        "verified, a top-k 2 % int8 update of the head's shape in signed chunks with acks, 5 % dropouts that "
        "report a failed job, 5 % slow links at 0.5 s a chunk, 4 non-IID update clusters). Connected = MQTT "
        "sessions up (then hello, state, auto-approval). Updates/s = updates stored over the span from the first "
        "to the last (bounded below by the simulated training spread of 0-2 s). Last update -> version = the new "
        "version's created_at minus the last update's received_at. RSS = serve's VmHWM. Disk = what the round "
        "added under serve's state dir. Broker and serve at nice "
        f"{nice}.",
        "",
        "| devices | head | aggregator | connected | accepted / dropouts | updates/s | last update -> version "
        "| serve peak RSS | disk / round | compressed received | disk / received | round, closed by |",
        "|---:|---|---|---|---|---:|---:|---:|---:|---:|---:|---|",
        *(_row(r) for r in rows),
    ]
    if failures:
        lines += ["", "Failed:", *(f"- {f}" for f in failures)]
    if 10_000 not in sizes:
        lines += ["", "10,000 devices: set EDGE_FLEET_LOAD_10K=1 (long)."]
    lines += ["", "Reproduce one row: `python -m bench.fleet_load --devices 1000 --params 1m --aggregator "
                  "trimmed_mean --nice 15`."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import sys

    print(run(quick="--quick" in sys.argv))
