"""Server-side optimisers: what the coordinator does with a round's aggregated delta before
it becomes the new version (Reddi et al. 2021, "Adaptive Federated Optimization").

    fedavg    new = base + lr * delta                           (lr 1: plain FedAvg)
    fedavgm   m = momentum * m + delta;  new = base + lr * m    (server momentum)
    fedadam   m = b1 * m + (1 - b1) * delta;  v = b2 * v + (1 - b2) * delta^2
              new = base + lr * m / (sqrt(v) + tau)             (per-coordinate steps)

`delta` is the aggregate of the devices' updates (FedAvg's sample-weighted mean, or the
trimmed mean): the "pseudo-gradient". Momentum smooths the round-to-round noise of a
non-IID fleet (each round's devices pull in different directions); Adam's per-coordinate
scale suits heads whose weights move at very different rates. The plateau detector
(plateau.py) may scale `lr` down (`--on-plateau decay`).

A job's optimiser state (moments, the plateau detector's history) is written per round
under STATE_DIR/learning/<job>/r<N>.{npz,json} (crash-safe: atomic files, the json last,
written before the round's new version is committed). Closing round N reads the state of
the newest round before N, so a round re-closed after a crash computes the same version
and never applies its momentum twice. The last few rounds' files are kept.

Job parameters (validated at job start, passed to devices, which ignore them):
server_opt, server_lr, server_momentum, server_beta2, server_tau.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic import atomic_write_json, read_checked, read_json_object, write_checked
from ..errors import InputError

SERVER_OPTS = ("fedavg", "fedavgm", "fedadam")
# Default server learning rates: 1 keeps FedAvg and FedAvgM's step the devices' own size;
# Adam's step is lr per coordinate whatever the delta's scale, so its lr is an absolute step.
DEFAULT_LR = {"fedavg": 1.0, "fedavgm": 1.0, "fedadam": 0.01}
KEEP_ROUNDS = 3
MAX_STATE_BYTES = 64 << 20
_ROUND_FILE = re.compile(r"r([0-9]{1,10})\.json")
Tensors = dict[str, np.ndarray]


@dataclass(frozen=True)
class ServerOpt:
    name: str = "fedavg"
    lr: float = 1.0
    momentum: float = 0.9  # fedavgm's momentum, fedadam's beta1
    beta2: float = 0.99
    tau: float = 1e-3  # fedadam's adaptivity: larger is closer to (momentum) SGD

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> ServerOpt:
        """The job's options (job params); raises InputError naming a bad one."""
        name = params.get("server_opt", "fedavg")
        if name not in SERVER_OPTS:
            raise InputError(f"server_opt must be one of {', '.join(SERVER_OPTS)}, got {str(name)[:40]!r}")
        return cls(name=name, lr=_number(params, "server_lr", DEFAULT_LR[name], 1e-6, 100.0),
                   momentum=_number(params, "server_momentum", 0.9, 0.0, 0.999),
                   beta2=_number(params, "server_beta2", 0.99, 0.0, 0.99999),
                   tau=_number(params, "server_tau", 1e-3, 1e-9, 10.0))

    def step(self, delta: Mapping[str, np.ndarray], moments: Mapping[str, np.ndarray], *,
             lr_scale: float = 1.0) -> tuple[Tensors, Tensors]:
        """(the step to add to the base head, the new moments). `moments` holds "m/<name>"
        and "v/<name>" arrays from the previous round (empty at the first)."""
        lr = self.lr * lr_scale
        if self.name == "fedavg":
            return {k: (lr * d).astype(np.float32) for k, d in delta.items()}, {}
        out: Tensors = {}
        new: Tensors = {}
        for k, d in delta.items():
            d64 = np.asarray(d, np.float64)
            m = _moment(moments, f"m/{k}", d64)
            if self.name == "fedavgm":
                m = self.momentum * m + d64
                out[k] = (lr * m).astype(np.float32)
            else:
                v = _moment(moments, f"v/{k}", d64)
                m = self.momentum * m + (1 - self.momentum) * d64
                v = self.beta2 * v + (1 - self.beta2) * d64 * d64
                out[k] = (lr * m / (np.sqrt(v) + self.tau)).astype(np.float32)
                new[f"v/{k}"] = v
            new[f"m/{k}"] = m
        return out, new


def _number(params: Mapping[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = params.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not (math.isfinite(value) and lo <= value <= hi):
        raise InputError(f"{name} must be a number in [{lo:g}, {hi:g}], got {str(value)[:40]!r}")
    return float(value)


def _moment(moments: Mapping[str, np.ndarray], key: str, like: np.ndarray) -> np.ndarray:
    m = moments.get(key)
    return np.asarray(m, np.float64) if m is not None and m.shape == like.shape else np.zeros_like(like)


# ---------------------------------------------------------------- persisted per-job state
class LearningStore:
    """STATE_DIR/learning/<job>/r<N>.json (+ .npz moments): the state after round N."""

    def __init__(self, state_dir: str | Path) -> None:
        self.root = Path(state_dir) / "learning"

    def _dir(self, job_id: str) -> Path:
        return self.root / job_id

    def rounds(self, job_id: str) -> list[int]:
        d = self._dir(job_id)
        found = [_ROUND_FILE.fullmatch(p.name) for p in d.iterdir()] if d.is_dir() else []
        return sorted(int(m.group(1)) for m in found if m)

    def load(self, job_id: str, *, before: int | None = None) -> tuple[int, dict[str, Any], Tensors]:
        """(round, info, moments) of the newest state before round `before` (all rounds when
        None); (0, {}, {}) when there is none. A corrupt file is an InputError."""
        rounds = [r for r in self.rounds(job_id) if before is None or r < before]
        if not rounds:
            return 0, {}, {}
        n = rounds[-1]
        path = self._dir(job_id) / f"r{n}.json"
        info = read_json_object(path, 1 << 20, "learning state")
        moments: Tensors = {}
        if info.get("moments"):
            raw = read_checked(self._dir(job_id) / f"r{n}.npz", MAX_STATE_BYTES)
            try:
                with np.load(io.BytesIO(raw), allow_pickle=False) as z:
                    moments = {k: z[k] for k in z.files}
            except (OSError, ValueError) as exc:
                raise InputError(f"{path}: unreadable moments ({str(exc)[:200]})") from None
        return n, info, moments

    def save(self, job_id: str, number: int, info: Mapping[str, Any], moments: Mapping[str, np.ndarray]) -> None:
        """The state after round `number`: moments first, the json (the commit point) last."""
        d = self._dir(job_id)
        if moments:
            buf = io.BytesIO()
            np.savez(buf, **{k: np.asarray(v) for k, v in moments.items()})
            write_checked(d / f"r{number}.npz", buf.getvalue())
        atomic_write_json(d / f"r{number}.json", {**info, "round": number, "moments": bool(moments)})
        for old in self.rounds(job_id)[:-KEEP_ROUNDS]:
            for suffix in (".json", ".npz"):
                (d / f"r{old}{suffix}").unlink(missing_ok=True)
