"""`make demo`, shortened: the demo module run the way the Makefile runs it (2 devices, 2
rounds), and its report checked: every round aggregated from every device at the depth its
planner chose, the global model better than the base, round 2 delivered as patches, and a
PNG plot."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from edge_agent.train.job_adapt import ADAPT_SHIFT, shift_text
from tests.integration.conftest import REPO

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # ~60 s: base model, 2 agents, 2 rounds
DEVICES, ROUNDS = 2, 2


def test_the_shortened_demo_reports_every_round(tmp_path):
    out = tmp_path / "demo-out"
    # the deadline only bounds a hang: a round closes as soon as both devices have reported
    argv = [sys.executable, "-m", "edge_agent.demo", "--devices", str(DEVICES), "--rounds", str(ROUNDS),
            "--min-devices", str(DEVICES), "--epochs", "2", "--deadline", "600s", "--out", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=REPO, check=False)
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(out.glob("**/*.log")))
    assert done.returncode == 0, f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}\n{logs}"
    assert "global acc" in done.stdout and "demo-report.json" in done.stdout, done.stdout

    report = json.loads((out / "demo-report.json").read_text())
    assert report["status"] == "done" and report["model"] == "digits@1"
    assert sorted(report["devices"]) == ["pi-1", "pi-2"]
    rounds = report["rounds"]
    assert [r["round"] for r in rounds] == list(range(1, ROUNDS + 1))
    for r in rounds:  # every round: both devices selected, both updates accepted, a new version
        assert r["state"] == "aggregated" and r["version"], r
        assert (r["devices"], r["selected"], r["dropouts"]) == (DEVICES, DEVICES, {}), r
        assert sorted(r["per_device"]) == ["pi-1", "pi-2"] and r["bytes_up"] > 0, r
        assert 0 <= r["local_acc_before"] <= 1 and 0 <= r["local_acc_after"] <= 1 and r["global_acc"] is not None
    assert rounds[-1]["global_acc"] > report["global_acc_base"], (report["global_acc_base"], rounds)

    # the devices trained at the depth their planners chose (the bundle has depths 0..2)
    assert all(r["depths"] and set(r["depths"]) <= {0, 1, 2} for r in rounds), [r["depths"] for r in rounds]
    # round 1 sends each device the whole bundle; from round 2 on, only the new version's patch:
    # head.params for a head-only round, plus the deeper parameters and re-quantised prefixes
    first, later = rounds[0], rounds[1:]
    assert first["head_patches"] == 0 and first["bytes_down"] == first["full_bytes_down"] > 0
    for r, before in zip(later, rounds, strict=False):
        assert r["head_patches"] == DEVICES, r
        assert r["bytes_down"] < r["full_bytes_down"]
        if set(before["depths"]) == {0}:  # the version it installs changed only the head
            assert r["bytes_down"] * 10 < first["bytes_down"], (first["bytes_down"], r["bytes_down"])

    # pi-2 sees through a strongly shifted camera: every device's job measured its shift and
    # said whether it adapted its int8 prefix, and why (train/job_adapt.py)
    adaptation = report["adaptation"]
    assert adaptation["pi-2"]["camera"].startswith("strongly shifted") and adaptation["pi-1"]["camera"] == "its own"
    for name, ad in adaptation.items():
        assert ad["shift"] is not None and ad["shift"] >= 0 and isinstance(ad["adapted"], bool), (name, ad)
        assert ad["adapted"] == (ad["shift"] >= ADAPT_SHIFT), (name, ad)  # a far camera adapts (job_adapt.py)
        assert ("normalised layers' statistics re-estimated" in ad["adaptation"]) == ad["adapted"], (name, ad)
        assert f"{name} (camera: {ad['camera']}): shift {shift_text(ad['shift'])} from" in done.stdout
    assert adaptation["pi-2"]["shift"] >= ADAPT_SHIFT  # far from the base model's images

    png = out / "demo-plot.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert not (out / "devices" / "pi-1" / "state" / "checkpoints").exists() or not any(
        (out / "devices" / "pi-1" / "state" / "checkpoints").iterdir())  # every job finished and cleaned up


def test_the_demo_refuses_bad_sizes_with_a_usage_error(tmp_path):
    for args in (["--devices", "0"], ["--devices", "2", "--min-devices", "3"]):
        done = subprocess.run([sys.executable, "-m", "edge_agent.demo", *args, "--out", str(tmp_path)],
                              capture_output=True, text=True, timeout=120, cwd=REPO, check=False)
        assert done.returncode != 0 and "error:" in done.stderr and "Traceback" not in done.stderr, done.stderr
    helptext = subprocess.run([sys.executable, "-m", "edge_agent.demo", "--help"], capture_output=True,
                              text=True, timeout=120, cwd=REPO, check=False).stdout
    assert "--min-devices" in helptext and "--rounds" in helptext
