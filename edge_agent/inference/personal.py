"""A local fine-tune that makes a personal model: `edge-agent finetune` on the device's
data set (where the service stores the application's samples) in a child process, at a
priority below inference, and its trained tail installed as a personal model on top of
the fleet version it started from (serving.py judges whether it is served).

    <state>/personal/<name>/<version>/<id>/head.params   the trained tail (copied, fsynced)
    <state>/personal/<name>/<version>/<id>/meta.json     depth, accuracy, samples: written last

Priority ("training_priority"): "idle" puts the child in SCHED_IDLE (Linux): it runs only on
CPU time no runnable normal-priority thread wants, so inference requests pre-empt it at
once -- the fine-tune yields to inference; "nice" is nice 19; "normal" leaves it alone.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..atomic import atomic_write_bytes, atomic_write_json, read_limited
from .serving import HEAD_FILE, MAX_PREFIX_BYTES, META_FILE, PREFIX_FILE

log = logging.getLogger(__name__)
PRIORITIES = ("idle", "nice", "normal")
KEEP_PERSONAL = 2  # per fleet version: the newest and the one before


def lower_priority(pid: int, priority: str) -> None:
    """Put process `pid` (and the threads it starts later) below normal-priority work."""
    if priority == "normal":
        return
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, pid, 19)
    if priority == "idle" and hasattr(os, "SCHED_IDLE"):
        with contextlib.suppress(OSError):
            os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))


class LocalFineTune:
    """One personal fine-tune at a time, polled by the service's background loop."""

    def __init__(self, *, state_dir: Path, personal_root: Path, data_dir: Path, priority: str = "idle",
                 budget_wh: float | None = None, extra_args: list[str] | None = None,
                 python: list[str] | None = None) -> None:
        if priority not in PRIORITIES:
            raise ValueError(f"training priority {priority!r}: one of {', '.join(PRIORITIES)}")
        self.state_dir, self.personal_root, self.data_dir = Path(state_dir), Path(personal_root), Path(data_dir)
        self.priority, self.budget_wh, self.extra_args = priority, budget_wh, list(extra_args or [])
        self.python = python or [sys.executable]
        self.proc: subprocess.Popen[bytes] | None = None
        self.job: dict[str, Any] = {}
        self.last: dict[str, Any] = {}  # the outcome of the previous run
        self.runs = 0

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, *, name: str, version: str, bundle_dir: Path, samples: int) -> dict[str, Any]:
        """Start a fine-tune of `bundle_dir` on the data set; the job's description."""
        if self.running:
            return {"status": "running", **self.job}
        ident = f"p{int(time.time() * 1000):x}"
        work = self.state_dir / "serve" / "finetune"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        report = work / "report.json"
        cmd = [*self.python, "-m", "edge_agent.cli", "finetune", "--model", str(bundle_dir), "--data",
               str(self.data_dir), "--state-dir", str(work / "job"), "--cache-dir", str(self.state_dir / "cache"),
               "--report", str(report), "--quiet", "--skip-unknown", "--power-root", "/",
               "--inference-energy", str(self.state_dir / "serve" / "inference-energy.json"), *self.extra_args]
        if self.budget_wh:
            cmd += ["--budget-wh", str(self.budget_wh)]
        log_file = open(work / "finetune.log", "wb")  # noqa: SIM115 - handed to the child
        try:
            self.proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        finally:
            log_file.close()
        lower_priority(self.proc.pid, self.priority)
        self.runs += 1
        self.job = {"id": ident, "name": name, "version": version, "bundle": str(bundle_dir), "samples": samples,
                    "report": str(report), "started": round(time.time(), 3), "pid": self.proc.pid,
                    "priority": self.priority}
        log.info("serve: local fine-tune %s of %s/%s on %d samples started (pid %d, priority %s)", ident, name,
                 version, samples, self.proc.pid, self.priority)
        return {"status": "started", **self.job}

    def poll(self) -> Path | None:
        """Collect a finished run: the new personal model's directory, or None."""
        if self.proc is None or self.proc.poll() is None:
            return None
        code, job, self.proc = self.proc.returncode, self.job, None
        self.job = {}
        try:
            report = json.loads(read_limited(job["report"], 64 << 20))
        except (OSError, ValueError) as exc:
            self.last = {**job, "status": "failed", "exit": code, "detail": f"no report ({exc})"[:300]}
            log.warning("serve: local fine-tune %s failed (exit %s): see %s", job["id"], code,
                        Path(job["report"]).parent / "finetune.log")
            return None
        head = (report.get("head") or {}).get("file")
        if code != 0 or not head or not Path(head).is_file():  # (a job that trained no step writes no head)
            why = (report.get("failure") or {}).get("message") or report.get("stop_reason")
            self.last = {**job, "status": "failed", "exit": code, "detail": str(why)[:300]}
            return None
        dest = self.personal_root / job["name"] / job["version"] / job["id"]
        atomic_write_bytes(dest / HEAD_FILE, Path(head).read_bytes())
        adapted = (report.get("adaptation") or {}).get("prefix")
        if adapted:  # the tail was trained over the prefix adapted to this camera: it is served over it too
            atomic_write_bytes(dest / PREFIX_FILE, read_limited(adapted, MAX_PREFIX_BYTES))
        meta = {"depth": int((report.get("depth") or {}).get("depth") or 0), "created": time.time(),
                "adapted_prefix": bool(adapted),
                "samples": job["samples"], "accuracy": report.get("accuracy"), "stop_reason": report.get("stop_reason"),
                "energy_wh": (report.get("energy") or {}).get("wh"), "engine": (report.get("engine") or {}).get("name")}
        atomic_write_json(dest / META_FILE, meta)  # last: the directory is complete
        self._prune(dest.parent)
        self.last = {**job, "status": "installed", "exit": code, "personal": str(dest), **meta}
        log.info("serve: local fine-tune %s done: depth %s, accuracy %s", job["id"], meta["depth"], meta["accuracy"])
        return dest

    def _prune(self, base: Path) -> None:
        entries = sorted((p for p in base.iterdir() if p.is_dir() and not p.name.startswith(".")),
                         key=lambda p: p.stat().st_mtime)
        for old in entries[:-KEEP_PERSONAL]:
            shutil.rmtree(old, ignore_errors=True)

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # the trainer checkpoints on SIGTERM
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
