"""Training that knows when to stop: the fleet's global accuracy per version, the best
version so far, and plateau detection (stop the job, or decay the server learning rate).

Where the global accuracy comes from: every device evaluates the version it is sent on its
own validation split *before* training on it (the agent's `accuracy_before`; the split is
chosen by content hash and never trained on). So round N's accepted updates measure round
N-1's version on data no round trained on; their sample-weighted mean is that version's
global held-out accuracy, one round late, at no extra cost and without the coordinator ever
holding device data. (A coordinator-side held-out set would need the backbone and labelled
data on the coordinator; the demo's report does that for its simulated fleet only.)

One round's measurement comes from the devices that round sampled (non-IID: an easy
device's 100 % or a hard one's 60 % moves it by points), so the rule and the best version
use its exponential moving average over versions (plateau_smoothing: the newest
measurement's weight; 1 = none). Versions change a little per round, so the average is
their accuracy with the sampling noise of one round divided down, lagging a few rounds.

The rule, checked once per measured version (`PlateauRule`, job params):
    plateau_patience    versions in a row without a gain of more than plateau_min_delta
                        over the best (None: no plateau detection; the best is still tracked)
    plateau_min_delta   accuracy gain that counts (a fraction: 0.002 = 0.2 points)
    on_plateau          stop: end the job; decay: multiply the server lr by plateau_decay and
                        go on (after plateau_max_decays decays the next plateau stops)
When the job stops at a plateau, the round's new version takes the best version's head
(its metrics say `restored`): what the fleet gets last is the best it had, not the drift.
`edge-coordinator models rollback` does the same by hand.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InputError
from .server_opt import LearningStore, ServerOpt, Tensors

ON_PLATEAU = ("stop", "decay")
MAX_HISTORY = 2000  # measured versions kept in the state (a job has at most that many rounds)


@dataclass(frozen=True)
class PlateauRule:
    patience: int | None = None
    min_delta: float = 0.002
    on_plateau: str = "stop"
    decay: float = 0.5
    max_decays: int = 3
    smoothing: float = 0.3

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> PlateauRule:
        """The job's rule (job params); raises InputError naming a bad one."""
        patience = params.get("plateau_patience")
        if patience is not None and (isinstance(patience, bool) or not isinstance(patience, int)
                                     or not 1 <= patience <= 10_000):
            raise InputError(f"plateau_patience must be an integer in [1, 10000], got {str(patience)[:40]!r}")
        on = params.get("on_plateau", "stop")
        if on not in ON_PLATEAU:
            raise InputError(f"on_plateau must be one of {', '.join(ON_PLATEAU)}, got {str(on)[:40]!r}")
        max_decays = params.get("plateau_max_decays", 3)
        if isinstance(max_decays, bool) or not isinstance(max_decays, int) or not 0 <= max_decays <= 100:
            raise InputError(f"plateau_max_decays must be an integer in [0, 100], got {str(max_decays)[:40]!r}")
        return cls(patience=patience, min_delta=_fraction(params, "plateau_min_delta", 0.002, 0.0, 0.5),
                   on_plateau=on, decay=_fraction(params, "plateau_decay", 0.5, 0.01, 0.99), max_decays=max_decays,
                   smoothing=_fraction(params, "plateau_smoothing", 0.3, 0.01, 1.0))


def _fraction(params: Mapping[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = params.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not (math.isfinite(value) and lo <= value <= hi):
        raise InputError(f"{name} must be a number in [{lo:g}, {hi:g}], got {str(value)[:40]!r}")
    return float(value)


def global_accuracy(reports: Sequence[tuple[Mapping[str, Any], int]]) -> tuple[float | None, int]:
    """Sample-weighted mean of the devices' `accuracy_before` (metrics, samples); reports
    without a valid one (an older agent, no validation split) are left out."""
    total, weight = 0.0, 0
    for metrics, samples in reports:
        acc = metrics.get("accuracy_before")
        if isinstance(acc, bool) or not isinstance(acc, int | float) or not (math.isfinite(acc) and 0 <= acc <= 1):
            continue
        if isinstance(samples, int) and samples > 0:
            total += acc * samples
            weight += samples
    return (total / weight, weight) if weight else (None, 0)


def observe(rule: PlateauRule, info: Mapping[str, Any], version: str, accuracy: float, samples: int,
            measured_in: int) -> tuple[dict[str, Any], str]:
    """Add one measured version to the state; returns (new state, "continue"|"decay"|"stop")."""
    out = dict(info)
    prev = out.get("smoothed")
    smoothed = float(accuracy) if prev is None else rule.smoothing * accuracy + (1 - rule.smoothing) * float(prev)
    out["smoothed"] = smoothed
    history = [h for h in out.get("history", []) if h[0] != version][-MAX_HISTORY + 1:]
    history.append([version, measured_in, round(float(accuracy), 6), int(samples), round(smoothed, 6)])
    out["history"] = history
    best = out.get("best")
    if best is None or smoothed > best["accuracy"]:
        out["best"] = {"version": version, "accuracy": round(smoothed, 6), "round": measured_in}
    ref = out.get("reference")
    if ref is None or smoothed > ref + rule.min_delta:
        out["reference"], out["since_best"] = smoothed, 0
        return out, "continue"
    out["since_best"] = int(out.get("since_best", 0)) + 1
    if rule.patience is None or out["since_best"] < rule.patience:
        return out, "continue"
    decays = int(out.get("decays", 0))
    if rule.on_plateau == "decay" and decays < rule.max_decays:
        out["decays"], out["since_best"] = decays + 1, 0
        out["lr_scale"] = float(out.get("lr_scale", 1.0)) * rule.decay
        return out, "decay"
    return out, "stop"


def check_learning_params(params: Mapping[str, Any]) -> None:
    """Refuse a job's bad server optimiser or plateau options at job start (InputError)."""
    ServerOpt.from_params(params)
    PlateauRule.from_params(params)


@dataclass(frozen=True)
class LearnStep:
    step: Tensors  # what to add to the base head
    stop: str  # "" or why the job ends (a plateau)
    restore: str | None  # the version whose head the round's new version takes (the best)
    metrics: dict[str, Any]  # recorded with the new version


def learn(store: LearningStore, job_id: str, params: Mapping[str, Any], number: int, base_version: str,
          delta: Mapping[str, np.ndarray], reports: Sequence[tuple[Mapping[str, Any], int]],
          measured: tuple[float, int] | None = None) -> LearnStep:
    """Round `number` of a job closes with the aggregated `delta`: take the server
    optimiser's step and persist the state (before the caller commits the new version: a
    re-close recomputes). Without a server set, the plateau rule judges the base version by
    the devices' reports (smoothed) here. With one (`measured` = the base version's server-set
    accuracy and samples), each version is judged when the gate scores it (`published`); the
    job's start version is recorded here once, as the first reference."""
    opt, rule = ServerOpt.from_params(params), PlateauRule.from_params(params)
    _, info, moments = store.load(job_id, before=number)
    decision = "continue"
    metrics: dict[str, Any] = {"server_opt": opt.name}
    if measured is not None:
        if not info.get("history"):
            info, _ = observe(replace(rule, smoothing=1.0), info, base_version, measured[0], measured[1], number)
        metrics["base_server_acc"] = round(measured[0], 6)
    else:
        acc, samples = global_accuracy(reports)
        if acc is not None:
            info, decision = observe(rule, info, base_version, acc, samples, number)
            metrics["base_global_acc"] = round(acc, 6)
    lr_scale = float(info.get("lr_scale", 1.0))
    step, moments = opt.step(delta, moments, lr_scale=lr_scale)
    metrics["server_lr"] = round(opt.lr * lr_scale, 9)
    stop, restore, more = _decide(rule, info, decision, "device-reported accuracy (smoothed)")
    metrics |= more
    store.save(job_id, number, info, moments)
    return LearnStep(step, stop, restore, metrics)


def published(store: LearningStore, job_id: str, params: Mapping[str, Any], number: int, version: str,
              accuracy: float, samples: int) -> tuple[str, str | None, dict[str, Any]]:
    """The server set's score of the version round `number` is about to publish (the gate's):
    the plateau rule's observation and decision on it, added to the state `learn` saved for
    the round. Returns (why the job stops, or "", the version to publish instead -- the best
    -- or None, metrics for the version)."""
    rule = replace(PlateauRule.from_params(params), smoothing=1.0)  # the same samples every time
    _, info, moments = store.load(job_id, before=number + 1)
    info, decision = observe(rule, info, version, accuracy, samples, number)
    stop, restore, metrics = _decide(rule, info, decision, "server-set accuracy")
    store.save(job_id, number, info, moments)
    return stop, restore, metrics


def _decide(rule: PlateauRule, info: dict[str, Any], decision: str, what: str
            ) -> tuple[str, str | None, dict[str, Any]]:
    if decision == "stop":
        best = info["best"]
        stop = (f"plateau: {what} did not improve by more than {100 * rule.min_delta:g} points for "
                f"{rule.patience} version(s); best version {best['version']} ({100 * best['accuracy']:.2f} %, "
                f"measured in round {best['round']}), restored as this round's version")
        info["stopped"] = stop
        return stop, best["version"], {"restored": best["version"]}
    return "", None, ({"lr_decayed": True} if decision == "decay" else {})


def job_learning(state_dir: str | Path, job_id: str) -> dict[str, Any] | None:
    """What a job's report shows: the best version, the measured history, decays, the stop."""
    try:
        n, info, _ = LearningStore(state_dir).load(job_id)
    except InputError:
        return None
    if not n:
        return None
    return {"best": info.get("best"), "history": info.get("history", []), "lr_scale": info.get("lr_scale", 1.0),
            "decays": info.get("decays", 0), "stopped": info.get("stopped", ""), "round": n}


def rollback(reg: Any, name: str, version: str | None = None, *, best_of: str | None = None,
             now: float | None = None) -> Any:
    """Make `version` (or job `best_of`'s best version) the model's current version again: a
    new newest version with its head (`<version>-rbN`, parent `version`), so the next job
    trains from it and devices fetch it with their next command; history is not rewritten.
    Returns the new ModelVersion; InputError when there is nothing to roll back to."""
    if best_of is not None:
        learned = job_learning(reg.state_dir, best_of)
        job = reg.get_job(best_of)
        if job.model_name != name:
            raise InputError(f"job {best_of} trained {job.model_name}, not {name}")
        if not learned or not learned.get("best"):
            raise InputError(f"job {best_of} has no measured version (its devices reported no accuracy)")
        version = str(learned["best"]["version"])
    if version is None:
        raise InputError("name the version to roll back to, or --to-best JOB")
    source = reg.get_model(name, version)
    versions = reg.list_models(name)
    if versions and versions[-1].version == version:
        raise InputError(f"{name} {version} is already the current (newest) version")
    n = 1 + sum(1 for m in versions if m.version.startswith(f"{version[:56]}-rb"))
    new = f"{version[:56]}-rb{n}"
    return reg.add_model_version(name=name, version=new, head=reg.load_head(source), parent=version,
                                 bundle_path=source.bundle_path, head_only=True, now=now,
                                 metrics={"rollback_of": version, "replaced": versions[-1].version})
