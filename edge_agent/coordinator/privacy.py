"""User-level differential privacy for a job (DP-FedAvg, McMahan et al. 2018): its
parameters, the ledger of what each round spent, and the privacy accountant.

Job params (`train --dp-clip C --dp-noise SIGMA [--dp-epsilon EPS] [--dp-delta D]`):

    dp_clip     C > 0: every update's L2 norm is clipped to C, by the device before encoding
                and again by the coordinator after decoding (strategies/dp.py)
    dp_noise    sigma > 0, the noise multiplier: N(0, (sigma C)^2) is added to the round's
                clipped sum, once, at close (central DP)
    dp_delta    delta of the (epsilon, delta) guarantee, default 1e-5 (below 1/devices)
    dp_epsilon  the job's budget: a round whose epsilon would exceed it is not opened, the
                job ends DONE saying so (optional)

The unit protected is a device: its whole data set, any number of samples, in every round
it took part in (user-level DP).

Accounting. Each round is the sampled Gaussian mechanism, `PoissonSampledDpEvent(q,
GaussianDpEvent(sigma))`, with q = the devices the round selected / the devices eligible
when it opened (the rate the DP-FedAvg paper uses, q = expected devices per round / N).
Caveat: the coordinator's selection is a uniform sample of a fixed size from the eligible
devices, and who is eligible depends on battery, energy and being online -- it is not
Poisson sampling of the whole population, which the analysis assumes. This is what
DP-FedAvg deployments report; taking q over the *eligible* devices (not the enrolled fleet)
keeps it on the cautious side when few are eligible. A round whose q is 1 is the plain
Gaussian mechanism.

Rounds compose in Google's `dp-accounting` RDP accountant (integer Renyi orders 2..64 and a
few larger; exact for the sampled Gaussian at integer orders), converted to epsilon at the
job's delta. A round is charged when it opens (its devices are sent the model and train):
a round that then fails or that the gate refuses still counted, which is conservative.

    per version  epsilon of the job's rounds 1..N (the version of round N), in its metrics
                 (dp_epsilon, dp_delta, dp_noise, dp_clip, dp_q, dp_rounds)
    per job      epsilon of every round the job opened (`status`)
    lineage      the version's whole history: every job that trained a version it descends
                 from, each counted up to the newest of its rounds in that history, composed
                 in one accountant (sequential composition over the same devices) at the
                 version's delta (dp_lineage_epsilon). A job that was not private trained on
                 device data with no bound: the lineage's epsilon is then infinite (stored
                 as null, `status` says "not private").

The ledger is STATE_DIR/privacy/<job>.json (atomic), written before the round opens.
`dp-accounting` is imported lazily: the agent never loads it.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic import atomic_write_json, read_json_object
from ..errors import InputError

DEFAULT_DELTA = 1e-5
ORDERS = tuple(range(2, 65)) + (80, 96, 128, 256, 512)
MAX_LEDGER_BYTES = 16 << 20
PARAMS = ("dp_clip", "dp_noise", "dp_delta", "dp_epsilon")


@dataclass(frozen=True)
class DpParams:
    clip: float
    noise: float
    delta: float = DEFAULT_DELTA
    epsilon: float | None = None  # the budget

    @classmethod
    def of(cls, params: Mapping[str, Any]) -> DpParams | None:
        """The job's DP parameters; None when it is not private; InputError naming a bad one."""
        given = [k for k in PARAMS if params.get(k) is not None]
        if not given:
            return None
        if params.get("dp_clip") is None or params.get("dp_noise") is None:
            raise InputError(f"a private job needs both dp_clip and dp_noise (--dp-clip, --dp-noise); "
                             f"got only {', '.join(given)}")

        def number(name: str, lo: float, hi: float, *, open_lo: bool = True) -> float | None:
            value = params.get(name)
            if value is None:
                return None
            ok = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value) \
                and (lo < value if open_lo else lo <= value) and value <= hi
            if not ok:
                raise InputError(f"{name} must be a number in ({lo:g}, {hi:g}], got {value!r:.40}")
            return float(value)

        clip, noise = number("dp_clip", 0.0, 1e6), number("dp_noise", 0.0, 1e3)
        delta = number("dp_delta", 0.0, 0.1)
        eps = number("dp_epsilon", 0.0, 1e4)
        assert clip is not None and noise is not None
        return cls(clip, noise, DEFAULT_DELTA if delta is None else delta, eps)

    def to_metrics(self) -> dict[str, float]:
        return {"dp_clip": self.clip, "dp_noise": self.noise, "dp_delta": self.delta}


# ---------------------------------------------------------------- the accountant
def _accounting() -> Any:
    try:
        import dp_accounting
        from dp_accounting import rdp  # noqa: F401 - the submodule the accountant is in
    except ImportError:
        raise InputError("a private job needs Google's dp-accounting on the coordinator: "
                         "install this checkout with its [privacy] extra (pip install '/path/to/checkout[privacy]')") from None
    return dp_accounting


def _events(noise: float, rates: Iterable[float]) -> list[Any]:
    dpa = _accounting()

    counts: dict[float, int] = {}
    for q in rates:
        counts[float(q)] = counts.get(float(q), 0) + 1
    out = []
    for q, n in sorted(counts.items()):
        event = dpa.GaussianDpEvent(noise) if q >= 1.0 else dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(noise))
        out.append(dpa.SelfComposedDpEvent(event, n))
    return out


def epsilon(runs: Sequence[tuple[float, Sequence[float]]], delta: float) -> float:
    """Epsilon at `delta` of every (noise multiplier, per-round sampling rates) composed."""
    acc = _accounting().rdp.RdpAccountant(orders=list(ORDERS))
    composed = False
    for noise, rates in runs:
        for event in _events(noise, rates):
            acc.compose(event)
            composed = True
    return float(acc.get_epsilon(delta)) if composed else 0.0


def job_epsilon(dp: DpParams, rates: Sequence[float]) -> float:
    return epsilon([(dp.noise, rates)], dp.delta)


def predict(dp: DpParams, q: float, rounds: int) -> float:
    """The epsilon a job reaches after `rounds` rounds at sampling rate q."""
    return job_epsilon(dp, [min(1.0, q)] * rounds)


def rounds_within(dp: DpParams, q: float, most: int) -> int:
    """How many rounds at rate q fit the budget (`most` when there is none or all fit)."""
    if dp.epsilon is None or predict(dp, q, most) <= dp.epsilon:
        return most
    lo, hi = 0, most  # predict(lo) <= budget < predict(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if predict(dp, q, mid) <= dp.epsilon else (lo, mid)
    return lo


def sampling_rate(selected: int, eligible: int) -> float:
    return 1.0 if eligible <= 0 else min(1.0, selected / eligible)


def csprng_noise() -> np.random.Generator:
    """A generator seeded with 128 bits from the OS CSPRNG, one per draw (production's noise)."""
    return np.random.default_rng(secrets.randbits(128))


NoiseSource = Callable[[], np.random.Generator]


# ---------------------------------------------------------------- the ledger
class PrivacyLedger:
    """Per job, what each opened round spent: {"rounds": {"N": {"q", "selected", "eligible"}}}."""

    def __init__(self, state_dir: str | Path) -> None:
        self.dir = Path(state_dir) / "privacy"

    def _path(self, job_id: str) -> Path:
        return self.dir / f"{job_id}.json"

    def rounds(self, job_id: str) -> dict[int, dict[str, Any]]:
        path = self._path(job_id)
        if not path.exists():
            return {}
        obj = read_json_object(path, MAX_LEDGER_BYTES, "privacy ledger")
        rounds = obj.get("rounds")
        if not isinstance(rounds, dict):
            raise InputError(f"{path}: privacy ledger without rounds")
        return {int(n): r for n, r in rounds.items()}

    def charge(self, job_id: str, number: int, *, selected: int, eligible: int) -> float:
        """Record round `number` (before it opens); returns its q."""
        rounds = self.rounds(job_id)
        q = sampling_rate(selected, eligible)
        rounds[number] = {"q": q, "selected": selected, "eligible": eligible}
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self._path(job_id), {"rounds": {str(n): r for n, r in sorted(rounds.items())}})
        return q

    def rates(self, job_id: str, upto: int | None = None) -> list[float]:
        return [float(r["q"]) for n, r in sorted(self.rounds(job_id).items()) if upto is None or n <= upto]

    def selected(self, job_id: str, number: int) -> int | None:
        r = self.rounds(job_id).get(number)
        return None if r is None else int(r["selected"])


def budget_refusal(dp: DpParams, spent: Sequence[float], q: float) -> str:
    """Why the next round (at rate q) may not open ("" when it may)."""
    if dp.epsilon is None:
        return ""
    before, after = job_epsilon(dp, spent), job_epsilon(dp, [*spent, q])
    if after <= dp.epsilon:
        return ""
    return (f"privacy budget spent: epsilon {before:.3g} of {dp.epsilon:g} (delta {dp.delta:g}) after "
            f"{len(spent)} round(s); one more round (q {q:.3g}) would reach {after:.3g}")


# ---------------------------------------------------------------- per version and lineage
def lineage_epsilon(registry: Any, ledger: PrivacyLedger, model_name: str, parent: str | None,
                    own: tuple[str, int], delta: float) -> float | None:
    """Epsilon of the version that job `own[0]` round `own[1]` makes from `parent` (module
    doc); None when a job that was not private trained a version of its history."""
    upto = {own[0]: own[1]}
    seen = set()
    version = parent
    while version is not None and version not in seen:
        seen.add(version)
        mv = registry.get_model(model_name, version)
        if mv.job_id is not None and mv.round is not None:
            upto[mv.job_id] = max(upto.get(mv.job_id, 0), mv.round)
        version = mv.parent
    runs = []
    for job_id, number in upto.items():
        dp = DpParams.of(registry.get_job(job_id).params)
        if dp is None:
            return None
        runs.append((dp.noise, ledger.rates(job_id, upto=number)))
    return epsilon(runs, delta)


def version_metrics(registry: Any, ledger: PrivacyLedger, dp: DpParams, job: Any, number: int,
                    parent: str | None) -> dict[str, Any]:
    rates = ledger.rates(job.id, upto=number)
    eps = job_epsilon(dp, rates)
    lineage = lineage_epsilon(registry, ledger, job.model_name, parent, (job.id, number), dp.delta)
    return {**dp.to_metrics(), "dp_epsilon": round(eps, 6), "dp_q": rates[-1] if rates else None,
            "dp_rounds": len(rates), "dp_lineage_epsilon": None if lineage is None else round(lineage, 6)}


def job_summary(ledger: PrivacyLedger, dp: DpParams, job_id: str, rounds_opened: int) -> dict[str, Any]:
    """The job's epsilon so far and its budget, for `status`."""
    rates = ledger.rates(job_id, upto=rounds_opened)
    return {"epsilon": job_epsilon(dp, rates), "delta": dp.delta, "budget": dp.epsilon, "rounds": len(rates),
            "clip": dp.clip, "noise": dp.noise}
