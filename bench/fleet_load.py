"""Load-test a coordinator with a simulated fleet over a real mosquitto (edge_agent/sim/fleet_load.py).

    python -m bench.fleet_load --devices 1000 --params 1m --aggregator trimmed_mean [--dropout 0.05]
        [--slow-share 0.05 --slow-delay 0.5] [--non-iid 4] [--threads 1] [--nice 15] [--out DIR] [--json]
        [--state-interval 60] [--pre-enrol] [--connect-backlog 300] [--timeout 1800] [--profile-serve --out DIR]

Prints the figures (JSON with --json). Run heavy sizes under `nice` on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from pathlib import Path

from edge_agent.sim.fleet_load import HEADS, LoadConfig, LoadFailed, run_load


def base_bundle(cache: Path) -> Path:
    """The digits bundle (built once with MXNet, cached): the backbone the synthetic heads sit on."""
    from edge_agent.sim import scenario as demo

    return demo.ensure_bundle(cache / "digits-bundle")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=100)
    p.add_argument("--params", choices=sorted(HEADS), default="100k")
    p.add_argument("--aggregator", default="fedavg_clipped")
    p.add_argument("--dropout", type=float, default=0.05, help="share of devices whose job fails")
    p.add_argument("--slow-share", type=float, default=0.05, help="share of devices on a slow link")
    p.add_argument("--slow-delay", type=float, default=0.5, help="their delay before each chunk (s)")
    p.add_argument("--non-iid", type=int, default=4, help="clusters of update directions (1: IID)")
    p.add_argument("--density", type=float, default=0.02, help="top-k share of each update")
    p.add_argument("--threads", type=int, default=1, help="hub threads multiplexing the devices")
    p.add_argument("--connect-rate", type=float, default=500.0, help="new connections per second")
    p.add_argument("--train-s", type=float, default=2.0, help="simulated training time, uniform in [0, S]")
    p.add_argument("--deadline", type=float, default=900.0, help="the round's deadline (s)")
    p.add_argument("--nice", type=int, default=0, help="niceness of the broker and serve")
    p.add_argument("--state-interval", type=float, default=60.0, help="the devices' periodic state (s)")
    p.add_argument("--pre-enrol", action="store_true", help="enrol and approve the devices before serve starts")
    p.add_argument("--connect-backlog", type=int, default=0,
                   help="at most this many connected and not yet online (0: no gate, only --connect-rate)")
    p.add_argument("--timeout", type=float, default=1800.0, help="give up on a phase after this long (s)")
    p.add_argument("--tick", type=float, default=0.5, help="serve --tick (s)")
    p.add_argument("--stack-every", type=float, default=0.0,
                   help="during the round, serve dumps its stacks into its log every S s (counted in serve_stacks)")
    p.add_argument("--profile-serve", action="store_true", help="serve under cProfile (OUT/serve.prof; needs --out)")
    p.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "edge-fleet-load-cache"))
    p.add_argument("--out", default=None, help="working directory (default: a temporary one)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    cfg = LoadConfig(devices=a.devices, params=a.params, aggregator=a.aggregator, dropout=a.dropout,
                     slow_share=a.slow_share, slow_delay_s=a.slow_delay, non_iid=a.non_iid, density=a.density,
                     threads=a.threads, connect_rate=a.connect_rate, train_s=a.train_s, nice=a.nice,
                     deadline_s=a.deadline, state_interval_s=a.state_interval, profile_serve=a.profile_serve,
                     pre_enrol=a.pre_enrol, connect_backlog=a.connect_backlog, timeout_s=a.timeout,
                     tick_s=a.tick, stack_every_s=a.stack_every)
    if a.profile_serve and not a.out:
        p.error("--profile-serve needs --out (the profile is written there)")
    bundle = base_bundle(Path(a.cache))
    try:
        if a.out:
            res = run_load(cfg, Path(a.out), bundle)
        else:
            with tempfile.TemporaryDirectory(prefix="edge-fleet-load-") as tmp:
                res = run_load(cfg, Path(tmp), bundle)
    except LoadFailed as exc:  # what it got to is the finding
        res = exc.partial
        res.setdefault("new_version", None)
    if a.json:
        print(json.dumps(res, default=str))
    else:
        for k, v in res.items():
            print(f"{k}: {v}")
    return 0 if res["new_version"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
