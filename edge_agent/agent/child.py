"""The daemon's child processes (`python -m edge_agent.agent.child ...`): the only places
the agent loads numpy and MXNet. The contract (arguments, events, results, exit codes) is
in runner.py.

    train     run edge_agent.train.job.run_finetune(resume=True) in the job directory, then
              delta = trained head - bundle head, encoded by edge_agent.updates (byte budget,
              error feedback): writes update.chunks, residual.pending, then result.json.
    activate  unpack a downloaded bundle archive into its version directory (verified file
              by file, temp dir + fsync + rename: edge_agent.int8.bundle.unpack_bundle), or
              a head patch onto a verified local version (int8.bundle_patch.apply_patch).

Train spec (JSON): job_dir, job, round, device_id, model_name, version, model_dir, data,
cache_dir, cache_max_mb, residual_file, sysfs_root, profile, budget_wh, power_cap_w,
battery_floor_pct, battery_resume_pct, thermal_limit_c, deadline_at, poll_s,
chunk_size, label_map, skip_unknown and the command's optional training keys (protocol.finetune.TRAIN_KEYS:
epochs, batch_size, lr, ..., update_bytes, depth, ..., trainer) and engine_choices (the
fleet's int8 engine choices, JSON). result.json says which trainer ran, and lists the engine
choices this device measured in full (`engine_choices`: what its state reports). A job that
trained no step (the budget, deadline or battery stopped it first; steps of a resumed
checkpoint count) sends nothing: its result says "failed" with the report's `failure`
message, and the daemon fails the job with it (issue 40). Activate spec: archive, dest
(+ base: a patch's base).

Encoding is deterministic, so a child killed between writing update.chunks and result.json
and run again writes the same bytes; the committed residual is only replaced by the
daemon, after it has queued the update (see lifecycle.py).

Test hook (only with EDGE_AGENT_TEST_HOOKS=1): when EDGE_AGENT_TEST_HOLD names a file
holding a step number N, `train` stops after its first checkpoint at step >= N, writes the
step to <file>.held and waits there while the file exists and the daemon lives, so a test
can kill the daemon mid-training on a machine of any speed.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..atomic import atomic_write_json, read_limited, write_checked
from ..errors import (
    EXIT_CONFIG,
    EXIT_DATAERR,
    EXIT_FAILURE,
    ConfigError,
    EdgeAgentError,
    InputError,
)
from ..int8.mxnet_import import MXNetUnavailableError
from ..protocol.finetune import TRAIN_KEYS
from ..protocol.label_claims import LabelClaims
from .runner import (
    EXIT_BUSY,
    EXIT_STOPPED,
    EXIT_TRAINED,
    RESIDUAL_FILE,
    RESULT_FILE,
    SECAGG_DELTA,
    UPDATE_FILE,
    pack_chunks,
)

log = logging.getLogger("edge_agent.agent.child")
FINISHED = ("done", "early-stopped", "budget-exhausted", "deadline")  # these produce an update
_PR_SET_PDEATHSIG = 1
# run_finetune's share of the command's training keys (update_bytes and a private job's
# dp_clip are the encoder's: _encode)
FINETUNE_KEYS = tuple(k for k in TRAIN_KEYS if k not in ("update_bytes", "dp_clip"))


class Events:
    """JSON lines to the daemon's pipe; a vanished daemon must not stop the work."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def send(self, obj: dict[str, Any]) -> None:
        clean = {k: v for k, v in obj.items() if not (isinstance(v, float) and not math.isfinite(v))}
        try:
            os.write(self.fd, (json.dumps(clean, default=str, allow_nan=False) + "\n").encode())
        except (OSError, ValueError):
            pass

    def progress(self, event: Any) -> None:
        self.send(event.to_json())


def die_with_parent(parent_pid: int) -> None:
    """SIGTERM this process when the daemon dies, even by SIGKILL (Linux prctl)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the daemon's stale-lock retry still copes
        pass
    if os.getppid() != parent_pid:  # it died before prctl took effect
        raise SystemExit(EXIT_FAILURE)


def _head_params(data: bytes) -> dict[str, Any]:
    from ..mxparams import load_params, split_names  # numpy only: this child needs no MXNet

    return split_names(load_params(data, where="trained head"))[0]


def _encode(spec: dict[str, Any], report: dict[str, Any], job_dir: Path) -> dict[str, Any]:
    import numpy as np

    from ..int8.bundle import load_bundle
    from ..labels import label_set_digest
    from ..train.trainer import head_from_bundle
    from ..updates import (
        CompressionPolicy,
        ResidualStore,
        TensorTableMismatchError,
        UpdateEncoder,
        compute_delta,
    )
    from ..updates.clip import clip_for_privacy

    bundle = load_bundle(spec["model_dir"])
    _, base = head_from_bundle(bundle)
    trained = _head_params(read_limited(report["head"]["file"], 256 << 20))
    delta = compute_delta({n: trained[n] for n in base if n in trained}, base)
    if spec.get("secagg"):  # a secure job: the dense delta, masked by the daemon (agent/secure.py)
        from ..updates.secagg import flat_by_name

        flat = flat_by_name({n: delta.get(n, np.zeros_like(base[n])) for n in base})
        write_checked(job_dir / SECAGG_DELTA, flat.astype("<f8").tobytes())
        return {"secagg": True, "length": int(flat.size), "labels_sha256": label_set_digest(bundle.manifest.labels)}
    # a job at one depth of a multi-depth model trains some tensors: send only those (the
    # coordinator takes a left-out tensor as a zero delta); at least one, to say "no change"
    moved = {n: d for n, d in delta.items() if np.any(d)}
    delta = moved or dict(list(delta.items())[:1])
    budget = spec.get("update_bytes")
    policy = CompressionPolicy(budget_bytes=int(budget)) if budget else CompressionPolicy()
    store = ResidualStore(spec["residual_file"])
    clip = spec.get("dp_clip")  # a private job: what is sent is clipped to this L2 norm (updates/clip.py)
    clipped_from = None

    def clipped(residual: Any) -> dict[str, Any]:
        nonlocal clipped_from
        if clip is None:
            return delta
        out, clipped_from = clip_for_privacy(delta, float(clip), residual if policy.error_feedback else None)
        return out

    try:
        encoder = UpdateEncoder(model_name=spec["model_name"], device_id=spec["device_id"], policy=policy,
                                store=store, chunk_size=int(spec["chunk_size"]))
        update = encoder.encode(clipped(encoder.residual), job_id=spec["job"], round=int(spec["round"]),
                                model_version=spec["version"])
    except (InputError, TensorTableMismatchError) as exc:  # corrupt residual or another head: start afresh
        log.warning("error-feedback residual %s unusable (%s); starting from zero", store.path, exc)
        encoder = UpdateEncoder(model_name=spec["model_name"], device_id=spec["device_id"], policy=policy,
                                store=None, chunk_size=int(spec["chunk_size"]))
        update = encoder.encode(clipped(None), job_id=spec["job"], round=int(spec["round"]),
                                model_version=spec["version"])
    chunks = update.chunks()
    write_checked(job_dir / UPDATE_FILE, pack_chunks(chunks))
    pending = job_dir / RESIDUAL_FILE
    if update.residual is not None:
        ResidualStore(pending).save(update.residual, model_name=spec["model_name"], round=int(spec["round"]))
    else:
        pending.unlink(missing_ok=True)
    return {"chunks": len(chunks), "wire_bytes": sum(map(len, chunks)), "dense_bytes": update.dense_bytes,
            "k": update.k, "bits": update.bits, "ratio": round(update.ratio, 2), "sha256": update.digest.hex(),
            "energy_kept": round(update.energy_kept, 6), "labels_sha256": label_set_digest(bundle.manifest.labels),
            **({} if clipped_from is None else {"dp_clip": float(clip), "norm_before_clip": round(clipped_from, 6)})}


def _hold_after_checkpoint(progress: Callable[[Any], None]) -> Callable[[Any], None]:
    """The EDGE_AGENT_TEST_HOLD hook (module doc) around the progress callback."""
    if os.environ.get("EDGE_AGENT_TEST_HOOKS") != "1" or not os.environ.get("EDGE_AGENT_TEST_HOLD"):
        return progress
    hold, parent = Path(os.environ["EDGE_AGENT_TEST_HOLD"]), os.getppid()

    def hooked(event: Any) -> None:
        progress(event)
        if event.phase != "checkpoint":
            return
        try:
            at = int(hold.read_text())
        except (OSError, ValueError):
            return
        if event.step >= at:
            atomic_write_json(hold.with_name(hold.name + ".held"), {"step": event.step})
            while hold.exists() and os.getppid() == parent:
                time.sleep(0.05)

    return hooked


def _fleet_choices(spec: dict[str, Any]) -> tuple[Any, ...]:
    """The command's engine choices (their JSON form in the spec), parsed; unusable ones cost
    a full engine selection, not the job."""
    from ..protocol.engine_choice import parse_choices

    try:
        return tuple(parse_choices(spec.get("engine_choices") or []))
    except InputError as exc:
        log.warning("%s; choosing the engine without them", exc)
        return ()


def _measured_choices(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The engine choices this device measured in full, from the selection cache the job
    used (train/job.py's state_dir), for the daemon's state message."""
    from ..int8.cli import default_state_dir
    from ..int8.shared_choice import shared_choices

    try:
        return [c.to_json() for c in shared_choices(spec.get("cache_dir") or default_state_dir())]
    except OSError as exc:
        log.warning("engine choices not read: %s", exc)
        return []


def train(spec: dict[str, Any], events: Events) -> int:
    from ..train.job import run_finetune

    job_dir = Path(spec["job_dir"])
    extra = {k: spec[k] for k in FINETUNE_KEYS if spec.get(k) is not None}
    extra["engine_choices"] = _fleet_choices(spec)
    report = run_finetune(
        model=spec["model_dir"], data=spec["data"], state_dir=job_dir, cache_dir=spec.get("cache_dir"),
        budget_wh=spec.get("budget_wh"), power_cap_w=spec.get("power_cap_w"),
        battery_floor_pct=spec.get("battery_floor_pct"), battery_resume_pct=spec.get("battery_resume_pct"),
        thermal_limit_c=spec.get("thermal_limit_c"), deadline=spec.get("deadline_at"), resume=True,
        power_root=spec.get("sysfs_root", "/"), profile=spec.get("profile"),
        cache_max_mb=float(spec.get("cache_max_mb", 256)), poll_s=float(spec.get("poll_s", 30.0)),
        label_map=spec.get("label_map"), skip_unknown=bool(spec.get("skip_unknown", False)),
        inference_energy=spec.get("inference_energy"),
        progress=_hold_after_checkpoint(events.progress), **extra)
    summary = {"stop_reason": report["stop_reason"], "steps": report["steps"], "engine": report["engine"]["name"],
               "num_samples": int(report["data"]["train"]), "energy_wh": report["energy"]["wh"],
               "energy_source": report["energy"]["source"], "accuracy_before": report["accuracy"]["before"],
               "accuracy_after": report["accuracy"]["after"], "duration_s": report["duration_s_all_runs"],
               "resumed": report["resumed"], "depth": int(report["depth"]["depth"]), "trainer": report["trainer"],
               "stop_detail": str(report["power"].get("stop_detail") or "")[:300],
               "engine_choices": _measured_choices(spec)}
    adaptation = report.get("adaptation") or {}
    summary["adapted"] = adaptation.get("kind") == "bn"  # the prefix adapted to this camera (train/job_adapt.py)
    summary["adaptation"] = str(adaptation.get("reason") or "")[:250]
    if (adaptation.get("shift") or {}).get("distance") is not None:
        summary["shift"] = float(adaptation["shift"]["distance"])
    if report.get("label_claims"):  # the coordinator's trust rules compare the update with what they teach
        summary.update(LabelClaims.from_json(report["label_claims"]).metrics())
    failure = report.get("failure")
    if failure:  # trained no step (or the governor's error): the job fails, saying why
        summary["failure"] = str(failure.get("message") or "")[:400]
    if report["stop_reason"] not in FINISHED or not report["steps"]:  # nothing trained: nothing to send
        atomic_write_json(job_dir / RESULT_FILE, {"status": "failed" if failure else "stopped", **summary})
        return EXIT_STOPPED
    events.send({"phase": "encoding", "detail": "delta -> compressed update"})
    summary["update"] = _encode(spec, report, job_dir)
    atomic_write_json(job_dir / RESULT_FILE, {"status": "trained", **summary})  # last: the commit point
    return EXIT_TRAINED


def activate(spec: dict[str, Any], events: Events) -> int:
    from ..int8.bundle import load_bundle, unpack_bundle
    from ..int8.bundle_patch import apply_patch

    dest = Path(spec["dest"])
    if dest.exists():
        bundle = load_bundle(dest)
    elif spec.get("base"):
        bundle = apply_patch(spec["archive"], spec["base"], dest)
    else:
        bundle = unpack_bundle(spec["archive"], dest)
    m = bundle.manifest
    events.send({"phase": "activated", "detail": f"{m.name} {m.version}", "manifest_sha256": bundle.sha256,
                 "bundle_name": m.name, "bundle_version": m.version})
    return EXIT_TRAINED


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m edge_agent.agent.child",
                                     description="edge-agent's child process (started by the daemon).")
    parser.add_argument("command", choices=("train", "activate"))
    parser.add_argument("--spec", required=True)
    parser.add_argument("--events-fd", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s[child]: %(message)s")
    die_with_parent(args.parent_pid)
    events = Events(args.events_fd)
    try:
        spec = json.loads(read_limited(args.spec, 256 * 1024))
        return train(spec, events) if args.command == "train" else activate(spec, events)
    except EdgeAgentError as exc:
        busy = type(exc).__name__ == "JobStateError" and "another fine-tune job is running" in str(exc)
        events.send({"phase": "error", "detail": str(exc)[:500], "kind": type(exc).__name__})
        if busy:
            return EXIT_BUSY
        if isinstance(exc, ConfigError | MXNetUnavailableError):  # (no MXNet: trying again cannot help)
            return EXIT_CONFIG
        if isinstance(exc, InputError) or exc.exit_code == 64:  # bad data/bundle/checkpoint, unusable state
            return EXIT_DATAERR
        return EXIT_FAILURE  # anything else may pass: the daemon retries, within the re-entry limit
    except Exception as exc:  # a crash: the daemon respawns (and counts) it
        log.exception("child %s failed", args.command)
        events.send({"phase": "error", "detail": f"{type(exc).__name__}: {str(exc)[:400]}"})
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
