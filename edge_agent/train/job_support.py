"""The fine-tune job's supporting pieces (job.py holds the job itself): its progress event,
the state directory's lock and job file, SIGTERM / SIGINT as a clean cancel, the board
profile's figures, and the meter that charges engine selection to the job's budget."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..atomic import read_limited
from ..errors import EdgeAgentError, InputError
from .job_report import JOB_FILE

if TYPE_CHECKING:
    from .job import _Job


class JobStateError(EdgeAgentError):
    """The state directory is busy or holds an unfinished job that was not asked to resume."""

    exit_code = 64


def _feature_key(backbone_sha256: str, engine: str | None) -> str:
    """The feature cache's namespace: the backbone's hash, and the engine unless it is the
    reference (bit-exact: its features are the backbone's own)."""
    import hashlib

    if not engine or engine == "reference":
        return backbone_sha256
    return hashlib.sha256(f"{backbone_sha256}:{engine}".encode()).hexdigest()


# What a refusal adds to predicted + spent when it names a budget that will do: the next job
# measures its probe again, and the prediction moved by up to 7.7 % between two fresh first jobs
# under background load on one CI machine (1.559e-4 then 1.679e-4 Wh), so a budget covering the
# last figure exactly (or +5 %) could be refused once more at the same gate.
REFUSAL_HEADROOM = 0.25


def _round_up(wh: float) -> str:
    """`wh` rounded up to 3 significant digits: a figure a user types that still covers it."""
    import math

    if wh <= 0:
        return "0"
    step = 10.0 ** (math.floor(math.log10(wh)) - 2)
    return f"{math.ceil(wh / step - 1e-9) * step:.3g}"


class _GovernorMeter:
    """Engine selection's meter inside a job: every phase is metered by the budget governor
    and charged to the job; a budget too small for the predicted selection plus a batch
    stops the job before it is spent (BudgetTooSmallError), a phase that would overshoot it
    stops the selection (SelectionStopped)."""

    def __init__(self, job: _Job, gov: Any) -> None:
        self.job, self.gov = job, gov
        self._start = 0.0

    @property
    def refuses(self) -> bool:
        return self.job.budget.budget_j is not None

    def before(self, phase: str, predicted_j: float) -> None:
        from ..int8.engine_cost import BudgetTooSmallError, SelectionStopped

        used = self._start = self.gov.charge_overhead()
        budget_j = self.job.budget.budget_j
        if budget_j is None or used + predicted_j <= budget_j:
            return
        if phase in ("selection", "selection-probe"):
            what = ("pricing the int8 engine selection for this model on this device needs ~"
                    f"{predicted_j / 3600.0:.4g} Wh (predicted; the selection's own cost is known once it is priced)"
                    if phase == "selection-probe" else
                    f"choosing the int8 engine for this model on this device needs ~{predicted_j / 3600.0:.4g} Wh "
                    "(predicted, one batch of the job included)")
            enough_wh = (used + predicted_j) * (1 + REFUSAL_HEADROOM) / 3600.0
            raise BudgetTooSmallError(
                f"--budget-wh {self.job.budget.budget_wh:g} is too small for this job: {what}, and "
                f"{used / 3600.0:.4g} Wh is spent already; give --budget-wh {_round_up(enough_wh)} or more "
                f"(the prediction is measured again by the next job, and moves by up to ~10 % between runs), or run "
                f"`edge-agent kernels --model {self.job.args['model']} --bench` once (its choice is cached and reused)")
        raise SelectionStopped(f"the energy budget ran out while choosing the int8 engine ({phase}: "
                               f"~{predicted_j / 3600.0:.4g} Wh more; {used / 3600.0:.4g} of "
                               f"{self.job.budget.budget_wh:g} Wh used)")

    def after(self, phase: str, cpu_s: float) -> float:
        self.job._work_done()  # a virtual test clock charges the phase here
        return self.gov.charge_overhead() - self._start


class _Stopped(Exception):
    """Raised inside feature extraction when the governor says stop."""


@dataclass
class Progress:
    """One progress event for a UI or the daemon (JSON-ready via asdict)."""

    phase: str  # data | features | train | paused | saving | checkpoint | done
    step: int = 0
    total_steps: int = 0
    epoch: int = 0
    epochs: int = 0
    loss: float | None = None
    val_accuracy: float | None = None
    energy_wh: float = 0.0
    budget_wh: float | None = None
    watts: float | None = None
    temp_c: float | None = None
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


ProgressCallback = Callable[[Progress], None]


@contextlib.contextmanager
def _locked(state_dir: Path) -> Iterator[None]:
    state_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(state_dir / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise JobStateError(f"{state_dir}: another fine-tune job is running with this state directory") from None
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def _cancel_on_signals(cancel: Callable[[str], None]) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        previous[sig] = signal.signal(sig, lambda num, _frame: cancel(signal.Signals(num).name))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _read_job(state_dir: Path) -> dict[str, Any]:
    import json

    try:
        obj = json.loads(read_limited(state_dir / JOB_FILE, 1 << 20))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, EdgeAgentError):
        return {"status": "unreadable"}
    return obj if isinstance(obj, dict) else {"status": "unreadable"}


def _profile_values(profile: str | None, probe_report: dict[str, Any]) -> dict[str, Any]:
    """The board profile's power, thermal and training figures (named, else matched)."""
    from ..hardware.profiles import load_profiles

    name = profile or (probe_report.get("profile") or {}).get("name")
    profiles = load_profiles().profiles
    if profile and profile not in profiles:
        raise InputError(f"no board profile named {profile!r}; known: {', '.join(sorted(profiles))}")
    found = profiles.get(name) if name else None
    data = found.data if found is not None else {}
    return {"name": name, "idle_w": data.get("power", {}).get("idle_w"),
            "load_w": data.get("power", {}).get("load_w"),
            "thermal_limit_c": data.get("thermal", {}).get("limit_c"),
            "threads": data.get("training", {}).get("threads"),
            "batch_size": data.get("training", {}).get("batch_size"),
            "memory_cap_mb": data.get("training", {}).get("memory_cap_mb"),
            "backends": data.get("int8", {}).get("backends")}
