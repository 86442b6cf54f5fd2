"""`edge-coordinator train`'s options as job params: the devices' training options, the
server optimiser and plateau rule, the asynchronous mode and privacy -- each checked here with
the message a user can act on, and the whole checked against what every device would accept."""

from __future__ import annotations

import argparse
import time
from collections.abc import Mapping
from typing import Any

from ..errors import InputError, UsageError

DEVICE_OPTIONS = ("epochs", "batch_size", "lr", "update_bytes", "power_cap_w", "aggregator", "devices_per_round",
                  "depth", "bn", "tail", "augment", "distill")


def job_params(args: argparse.Namespace) -> dict[str, Any]:
    """The job's params from `train`'s options (`--param K=V` first, the named options over
    them); UsageError for what the coordinator or the devices would refuse."""
    params: dict[str, Any] = dict(args.param or [])
    for name in DEVICE_OPTIONS:
        value = getattr(args, name, None)
        if value is not None:
            params[name] = value
    params.update(_learning_params(args))
    params.update(_async_params(args))
    params.update(_privacy_params(args))
    params.update(_secure_params(args, params))
    check_job_params({**params, "budget_wh": args.budget_wh})
    return params


def check_job_params(params: dict[str, Any]) -> None:
    """Refuse now what every device would refuse as bad_params: the finetune command the
    rounds will send goes through the protocol schema and the agent's own parser (their
    limits, not a copy of them). Raises UsageError naming the parameter and its range."""
    from ..protocol.finetune import parse_finetune
    from ..protocol.schema import Kind, check_body

    sample = {k: v for k, v in params.items() if v is not None}
    sample.setdefault("deadline", int(time.time()) + 3600)  # the rounds add it; keep its type
    body = {"cmd_id": "check", "action": "finetune", "job": "job-check", "round": 1, "model": "model",
            "version": "1", "params": sample}
    try:
        check_body(Kind.CMD, body)
        parse_finetune(body)
    except ValueError as exc:  # BadParams too
        raise UsageError(f"devices would refuse this job (bad_params): {exc}") from None


def _privacy_params(args: argparse.Namespace) -> dict[str, Any]:
    """--dp-clip, --dp-noise, --dp-epsilon, --dp-delta as job params (privacy.py)."""
    from .privacy import DpParams

    out = {name: getattr(args, name) for name in ("dp_clip", "dp_noise", "dp_epsilon", "dp_delta")
           if getattr(args, name, None) is not None}
    try:
        DpParams.of(out)
    except InputError as exc:
        raise UsageError(str(exc).replace("dp_clip and dp_noise (--dp-clip, --dp-noise)", "--dp-clip and --dp-noise")
                         ) from None
    return out


def _secure_params(args: argparse.Namespace, params: Mapping[str, Any]) -> dict[str, Any]:
    """--secure-aggregation and --secagg-phase as job params (secure_rounds.py): refused now
    with --async, a robust --aggregator or fewer than 3 devices a round, as serve would."""
    from .secure_rounds import check_secure_params

    phase = getattr(args, "secagg_phase_s", None)
    if not getattr(args, "secure", False) and not params.get("secagg"):
        if phase is not None:
            raise UsageError("--secagg-phase is an option of --secure-aggregation jobs")
        return {}
    out: dict[str, Any] = {"secagg": True, **({"secagg_phase_s": float(phase)} if phase is not None else {})}
    trial = {**params, **out}
    if trial.get("dp_clip") is not None and trial.get("aggregator") in (None, ""):
        trial["aggregator"] = "dp_fedavg"
    try:
        check_secure_params(trial, min_devices=getattr(args, "min_devices", 3) or 3,
                            asynchronous=bool(getattr(args, "async_mode", False)), length=None)
    except InputError as exc:
        raise UsageError(str(exc)) from None
    return out


def privacy_forecast(params: Mapping[str, Any], rounds: int, fleet: int) -> str:
    """What `train` says of a private job before it runs: epsilon after its rounds at the
    sampling rate it will likely have (devices per round / the devices its selector matches)."""
    from .privacy import DpParams, predict, rounds_within, sampling_rate

    dp = DpParams.of(params)
    assert dp is not None
    q = sampling_rate(int(params.get("devices_per_round") or fleet), fleet)
    line = (f"private (DP-FedAvg): clip {dp.clip:g}, noise x{dp.noise:g}; at q = {q:.3g} (devices per round / "
            f"{fleet} matching) epsilon after {rounds} round(s) is {predict(dp, q, rounds):.3g} at delta {dp.delta:g}")
    if dp.epsilon is not None:
        fits = rounds_within(dp, q, rounds)
        line += (f"; budget {dp.epsilon:g}: " + ("every round fits" if fits >= rounds else
                 f"the job stops after about {fits} round(s)"))
    if q >= 1:
        line += " (every device in every round: no amplification by sampling; --devices-per-round helps)"
    return line


def _async_params(args: argparse.Namespace) -> dict[str, Any]:
    """--async, --buffer, --max-staleness as job params (async_rounds.py)."""
    buffer, staleness = getattr(args, "buffer", None), getattr(args, "max_staleness", None)
    concurrency = getattr(args, "max_concurrency", None)
    if not getattr(args, "async_mode", False):
        if buffer is not None or staleness is not None or concurrency is not None:
            raise UsageError("--buffer, --max-staleness and --max-concurrency are options of --async jobs")
        return {}
    return {"mode": "async", "buffer": buffer if buffer is not None else 2 * args.min_devices,
            "max_staleness": staleness if staleness is not None else 4,
            **({"max_concurrency": concurrency} if concurrency is not None else {})}


def _learning_params(args: argparse.Namespace) -> dict[str, Any]:
    """The server optimiser and plateau options as job params (server_opt.py, plateau.py)."""
    from .plateau import check_learning_params

    out: dict[str, Any] = {}
    for arg, name in (("server_opt", "server_opt"), ("server_lr", "server_lr"), ("momentum", "server_momentum"),
                      ("patience", "plateau_patience"), ("on_plateau", "on_plateau")):
        if getattr(args, arg, None) is not None:
            out[name] = getattr(args, arg)
    if getattr(args, "min_delta", None) is not None:
        out["plateau_min_delta"] = args.min_delta / 100.0  # points on the command line, a fraction inside
    if ("on_plateau" in out or "plateau_min_delta" in out) and "plateau_patience" not in out:
        raise UsageError("--on-plateau and --min-delta need --patience N (how many versions without improvement)")
    check_learning_params(out)
    return out
