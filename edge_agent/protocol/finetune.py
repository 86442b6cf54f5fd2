"""A `finetune` command's parameters as every side reads them: the device resolves them into
a `FinetuneRequest` (agent/policy.py then checks it against its own limits), and the
coordinator refuses a job at `train` that every device would refuse as bad_params -- with
the same parser, so the two can never disagree. Unknown parameters are ignored, not
refused: the coordinator passes its job parameters (aggregator, ...) through unchanged.

The command's `engine_choices` (the int8 engine choices the coordinator heard from devices
that measured them in full: protocol/engine_choice.py) are parsed strictly here; a bad list
is bad_params. An older coordinator sends none: an empty tuple, and `relays_choices` False.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from ..errors import InputError
from .engine_choice import SharedChoice, parse_choices

DAY_S = 86400.0
# A device's not-true distillation weight when a command sets none, and the most it accepts
# (train/dense_head.training_loss). Camera digits, depth 4, held-out: weight 1 -> 0.748,
# 3 -> 0.758, 6 -> 0.739 (seed 0, 0, 1 of bench_depth's auto job). A tail pulled that way
# moves its output biases less; the coordinator's label-claim check compares them with what the
# base predicted on the device's samples (protocol/label_claims.py), so that is no evidence
# against the device (with the round's mean proportions instead, it flagged honest devices).
DISTILL_DEFAULT = 3.0
# ... and in a coordinator's job that sets none: off. In bench_poisoning's simulated fleets (MLP
# head, 2-10 devices, 4 seeds, 30 rounds, no attacker) the fleets ended 0.0-5.3 points lower at
# weight 3 (14 of 16 by over half a point), -1.4 to +0.2 at weight 1: aggregation already
# restores what one device's data would make it forget. The demo's fleet gained in one run. A
# job opts in with `edge-coordinator train --distill W`.
FLEET_DISTILL_DEFAULT = 0.0
MAX_DISTILL = 100.0
MAX_UPDATE_BYTES = 64 << 20
# Training parameters a command may set: name -> (type, minimum, maximum).
TRAIN_PARAMS: dict[str, tuple[type, float, float]] = {
    "epochs": (int, 1, 10_000),
    "batch_size": (int, 1, 4096),
    "lr": (float, 1e-9, 10.0),
    "patience": (int, 1, 10_000),
    "checkpoint_every": (int, 1, 1_000_000),
    "seed": (int, 0, 2**31 - 1),
    "update_bytes": (int, 256, MAX_UPDATE_BYTES),
    "augment": (int, 0, 8),
    "distill": (float, 0.0, MAX_DISTILL),
}
# A private job's (coordinator/privacy.py): the L2 norm the device clips what it sends to
# (updates/clip.py). Set with --dp-clip, with --dp-noise: not a training setting of its own.
PRIVACY_PARAMS: dict[str, tuple[type, float, float]] = {"dp_clip": (float, 1e-9, 1e6)}
# secure aggregation (agent/secure.py): `secagg` true, and how long each of its phases may take
SECURE_PARAMS: dict[str, tuple[type, float, float]] = {"secagg_phase_s": (float, 1.0, 86400.0)}
# Training choices a command may set: name -> the values accepted (depth: also 0..8).
TRAIN_CHOICES: dict[str, tuple[str, ...]] = {"depth": ("auto", "head"), "bn": ("frozen", "update"),
                                              "tail": ("full", "bias"), "trainer": ("auto", "numpy", "mxnet")}
# Every training key a request carries to the training child (agent/lifecycle.py's spec):
# one list, so a parameter accepted here cannot be dropped on the way (trainer once was).
TRAIN_KEYS = (*TRAIN_PARAMS, *TRAIN_CHOICES, *PRIVACY_PARAMS)  # what the training child is given
# (secagg and SECURE_PARAMS are kept with the job for agent/secure.py; the child hears only `secagg`)



@dataclass(frozen=True)
class FinetuneRequest:
    """A `finetune` command, checked and resolved against the device's limits."""

    job: str
    round: int
    model: str
    version: str
    sha256: str | None
    head_sha256: str | None  # the version's head patch (int8.bundle_patch), when there is one
    budget_wh: float | None
    power_cap_w: float | None
    deadline_at: float
    train: dict[str, Any] = field(default_factory=dict)  # TRAIN_KEYS given by the command
    engine_choices: tuple[SharedChoice, ...] = ()  # the fleet's: the device uses the one of its kind
    relays_choices: bool = False  # the command had the field: its coordinator reads the choices states report

    @property
    def local_id(self) -> str:
        """The device's job record id: one per (job, round), like the coordinator's cmd_id."""
        return f"{self.job}-r{self.round}"

    def to_params(self) -> dict[str, Any]:
        """What the job record keeps (JSON-ready)."""
        return {"job": self.job, "version": self.version, "sha256": self.sha256, "head_sha256": self.head_sha256,
                "budget_wh": self.budget_wh,
                "power_cap_w": self.power_cap_w, "deadline_at": self.deadline_at, **self.train,
                **({"engine_choices": [c.to_json() for c in self.engine_choices]} if self.relays_choices else {})}


class BadParams(ValueError):
    pass


def _number(params: dict[str, Any], name: str, kind: type, lo: float, hi: float) -> Any:
    value = params.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and not isinstance(value, int)):
        raise BadParams(f"params.{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    if not (lo <= value <= hi and math.isfinite(value)):  # compare first: a huge int would overflow isfinite
        raise BadParams(f"params.{name} = {value!r} is outside {lo:g}..{hi:g}")
    return kind(value)


def parse_finetune(body: dict[str, Any], *, deadline_s: float | None = None, now: float | None = None
                   ) -> FinetuneRequest:
    """Resolve a finetune body (already schema-checked by the protocol); raises BadParams.
    `deadline_s`: the device's own longest job ([budget] deadline_s), if it sets one."""
    now = time.time() if now is None else now
    missing = [f for f in ("job", "round", "model", "version") if f not in body]
    if missing:
        raise BadParams(f"finetune needs {', '.join(missing)}")
    if body["version"] == "current":
        raise BadParams("version 'current' is reserved: name the version to train from")
    params = dict(body.get("params") or {})
    train = {}
    for name, (kind, lo, hi) in (TRAIN_PARAMS | PRIVACY_PARAMS | SECURE_PARAMS).items():
        value = _number(params, name, kind, lo, hi)
        if value is not None:
            train[name] = value
    for name, choices in TRAIN_CHOICES.items():
        value = params.get(name)
        if value is None:
            continue
        a_depth = name == "depth" and isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 8
        if a_depth or (isinstance(value, str) and value in choices):
            train[name] = value
        else:
            more = " or a depth 0..8" if name == "depth" else ""
            raise BadParams(f"params.{name} must be one of {', '.join(choices)}{more}, got {value!r:.40}")
    if "secagg" in params:
        if not isinstance(params["secagg"], bool):
            raise BadParams(f"params.secagg must be true or false, got {params['secagg']!r:.40}")
        if params["secagg"]:
            train["secagg"] = True
    budget_wh = _number(params, "budget_wh", float, 1e-6, 1e6)
    power_cap_w = _number(params, "power_cap_w", float, 1e-3, 1e4)
    deadline = _number(params, "deadline", float, 0, 1 << 40)
    horizon = now + deadline_s if deadline_s else None
    deadline_at = min(d for d in (deadline, horizon, now + 30 * DAY_S) if d is not None)
    try:
        choices = tuple(parse_choices(body["engine_choices"])) if "engine_choices" in body else ()
    except InputError as exc:
        raise BadParams(str(exc)) from None
    return FinetuneRequest(job=body["job"], round=body["round"], model=body["model"], version=body["version"],
                           sha256=body.get("sha256"), head_sha256=body.get("head_sha256"), budget_wh=budget_wh, power_cap_w=power_cap_w,
                           deadline_at=deadline_at, train=train, engine_choices=choices,
                           relays_choices="engine_choices" in body)
