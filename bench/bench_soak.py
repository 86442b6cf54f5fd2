"""The soak benchmark's BENCHMARKS.md section (bench/soak.py does the work).

`make bench` runs a short soak (40 rounds; `--quick`: 12) to show the slopes are measured
and nothing regressed badly; `make soak` runs the long one (EDGE_SOAK_ROUNDS=1000, or
whatever the environment says) and writes its section here in place of the short one.

    EDGE_SOAK_ROUNDS     rounds (default 40, quick 12)
    EDGE_SOAK_MINUTES    stop after this long whatever the count (default 600)
    EDGE_SOAK_OUT        working directory (default a temp directory)
"""

from __future__ import annotations

import os
import tempfile

from bench import soak


def run(quick: bool = False) -> str:
    rounds = int(os.environ.get("EDGE_SOAK_ROUNDS", "12" if quick else "40"))
    minutes = float(os.environ.get("EDGE_SOAK_MINUTES", "600"))
    # a short run shows retention only if it prunes within it: keep 6 versions, check every minute
    keep = ["--serve-arg=--keep-versions", "--serve-arg=6"] if rounds < 200 else []
    # fast-forward: a soak round takes seconds, a field round an hour, so received updates are
    # kept ~7 minutes (~100 soak rounds) instead of 30 days, or no row would ever be pruned
    keep += ["--serve-arg=--keep-update-days", "--serve-arg=0.005"]
    with tempfile.TemporaryDirectory(prefix="edge-soak-") as tmp:
        args = soak.parser().parse_args([
            "--rounds", str(rounds), "--minutes", str(minutes), "--sample-every", str(max(2, rounds // 50)),
            "--rounds-per-job", "25" if rounds >= 200 else "10", "--cancel-every", "5" if rounds >= 200 else "3",
            "--out", os.environ.get("EDGE_SOAK_OUT", tmp), "--serve-arg=--prune-every", "--serve-arg=60", *keep])
        text, _ = soak.soak(args)
    return text
