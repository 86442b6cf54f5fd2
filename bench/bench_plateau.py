"""Training that knows when to stop (issue 20): a long federated job on the simulated
non-IID digits fleet, driven through the real RoundEngine (registry, update wire format,
screening, aggregation) with the server optimiser (server_opt.py) and plateau detection
(plateau.py) -- fedavg vs fedavgm vs fedadam, with and without `--patience`.

Each device holds its digits (through its own camera), keeps 20 % as a validation split it
never trains on, and each round: reports its validation accuracy of the version it was sent
(`accuracy_before`, what the real agent reports), trains a softmax-regression head from it
with local SGD, and sends the delta as a real update payload. The coordinator-side test set
(digits no device holds) is only used here, to judge the versions the job produced:
"best" is the best test accuracy of any version, "published" is the job's last version
(with plateau detection: the best version by the devices' own reports, restored).
"""

from __future__ import annotations

import base64
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edge_agent.coordinator.records import JobStatus, RoundState
from edge_agent.coordinator.registry import Registry
from edge_agent.coordinator.rounds import RoundEngine, RoundPolicy
from edge_agent.keys import fingerprint, generate_private_key, public_key_bytes
from edge_agent.sim.digits import make_fleet
from edge_agent.updates.codec import compute_delta
from edge_agent.updates.wire import UpdateHeader, encode_update

Head = dict[str, np.ndarray]


@dataclass(frozen=True)
class PlateauSim:
    rounds: int = 300
    n_devices: int = 10
    per_round: int = 10  # devices per round (devices_per_round); 10: the whole fleet, like the soak's
    alpha: float = 0.3  # Dirichlet label skew: non-IID
    local_epochs: int = 2
    lr: float = 0.5
    batch: int = 16
    seed: int = 0
    params: dict[str, Any] = field(default_factory=dict)  # job params: server_opt, plateau_patience...
    # An honest fleet, plain FedAvg: the plateau rule is what is measured here.
    policy: dict[str, Any] = field(default_factory=lambda: {"quarantine_after": 1_000_000, "aggregator": "fedavg"})


@dataclass
class SimResult:
    test_acc: list[float]  # the coordinator's test accuracy of each round's version
    reported: list[float | None]  # the devices' global accuracy of each round's base version
    rounds_run: int
    status: str
    reason: str
    published_acc: float
    seconds: float
    lr_decays: int = 0

    @property
    def best(self) -> tuple[float, int]:
        i = int(np.argmax(self.test_acc))
        return self.test_acc[i], i + 1


def _acc(head: Head, x: np.ndarray, y: np.ndarray) -> float:
    return float(((x @ head["dense0_weight"].T + head["dense0_bias"]).argmax(axis=1) == y).mean())


def _local_sgd(head: Head, x: np.ndarray, y: np.ndarray, sim: PlateauSim, rng: np.random.Generator) -> Head:
    w, b = head["dense0_weight"].astype(np.float64), head["dense0_bias"].astype(np.float64)
    onehot = np.eye(10)[y]
    for _ in range(sim.local_epochs):
        order = rng.permutation(len(y))
        for s in range(0, len(y), sim.batch):
            i = order[s:s + sim.batch]
            z = x[i] @ w.T + b
            p = np.exp(z - z.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            g = (p - onehot[i]) / len(i)
            w -= sim.lr * g.T @ x[i]
            b -= sim.lr * g.sum(axis=0)
    return {"dense0_weight": w.astype(np.float32), "dense0_bias": b.astype(np.float32)}


def simulate(sim: PlateauSim, state_dir: Path | None = None) -> SimResult:
    """One job of `sim.rounds` rounds through the real RoundEngine; deterministic."""
    start = time.perf_counter()
    fleet = make_fleet(n_devices=sim.n_devices, alpha=sim.alpha, seed=sim.seed)
    keys = [generate_private_key() for _ in range(sim.n_devices)]
    ids = [fingerprint(k) for k in keys]
    data = []
    for d in fleet.devices:
        x, y = d.images.reshape(len(d.labels), -1).astype(np.float64), d.labels
        val = np.random.default_rng([sim.seed, len(data)]).random(len(y)) < 0.2  # never trained on
        data.append((x[~val], y[~val], x[val], y[val]))
    x_test, y_test = fleet.test_images.reshape(len(fleet.test_labels), -1).astype(np.float64), fleet.test_labels
    now = [1_700_000_000.0]
    tmp = None
    if state_dir is None:  # tmpfs when there is one: the registry fsyncs every round
        tmp = tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
        state_dir = Path(tmp.name)
    reg = Registry(state_dir=state_dir, clock=lambda: now[0])
    try:
        engine = RoundEngine(registry=reg, policy=RoundPolicy(**sim.policy), clock=lambda: now[0])
        reg.add_model_version(name="digits", version="1", bundle_path=None,
                              head={"dense0_weight": np.zeros((10, 64), np.float32),
                                    "dense0_bias": np.zeros(10, np.float32)})
        for did, key in zip(ids, keys, strict=True):
            reg.enrol_device(device_id=did, public_key=base64.b64encode(public_key_bytes(key)).decode(),
                             fleet="sim", board="sim", approved=True)
        job = engine.start_job(model_name="digits", model_version="1", rounds=sim.rounds, min_devices=1,
                               deadline_s=60, params={"devices_per_round": sim.per_round, **sim.params})
        test_acc: list[float] = []
        reported: list[float | None] = []
        for did in ids:  # heard from: online (the simulated clock moves 5 s a round)
            reg.record_state(did, online=True, state={"on_power": True})
        opened = engine.tick().opened
        while opened:
            (plan,) = opened
            base = reg.load_head(reg.get_model("digits", plan.model_version))
            for did in plan.devices:
                engine.record_dispatch(plan.job_id, plan.round, did)
                i = ids.index(did)
                x, y, xv, yv = data[i]
                rng = np.random.default_rng([sim.seed, plan.round, i])
                delta = compute_delta(_local_sgd(base, x, y, sim, rng), base)
                header = UpdateHeader("digits", plan.model_version, plan.job_id, did, plan.round)
                receipt = engine.receive_update(encode_update(header, delta, density=1.0, bits=32), sender=did,
                                                num_samples=len(y), metrics={"accuracy_before": _acc(base, xv, yv)})
                if receipt.status != "accepted":
                    raise RuntimeError(f"update refused: {receipt}")
            now[0] += 5.0
            for did in ids:
                reg.record_state(did, online=True, state={"on_power": True})
            result = engine.tick()  # closes this round, opens the next
            (outcome,) = result.closed
            opened = result.opened
            if outcome.state is not RoundState.AGGREGATED:
                raise RuntimeError(f"round {outcome.round}: {outcome.reason}")
            mv = outcome.new_version
            assert mv is not None
            test_acc.append(_acc(reg.load_head(mv), x_test, y_test))
            reported.append(mv.metrics.get("base_global_acc"))
            if outcome.job_status is not JobStatus.RUNNING:
                assert not opened
        final = reg.get_job(job.id)
        last = reg.list_models("digits")[-1]
        decays = sum(bool(m.metrics.get("lr_decayed")) for m in reg.list_models("digits"))
        return SimResult(test_acc=test_acc, reported=reported, rounds_run=len(test_acc), status=final.status.value,
                         reason=final.reason, published_acc=_acc(reg.load_head(last), x_test, y_test),
                         seconds=time.perf_counter() - start, lr_decays=decays)
    finally:
        reg.close()
        if tmp is not None:
            tmp.cleanup()


OPTS: dict[str, dict[str, Any]] = {
    "fedavg": {"server_opt": "fedavg"},
    "fedavgm": {"server_opt": "fedavgm", "server_lr": 0.5, "server_momentum": 0.5},
    "fedadam": {"server_opt": "fedadam", "server_lr": 0.03},
}
PLATEAU = {"plateau_patience": 20, "plateau_min_delta": 0.002}


def run(quick: bool = False) -> str:
    rounds = 60 if quick else 300
    rows, notes = [], []
    worst_gap = 0.0
    for name, opt in OPTS.items():
        full_best = 0.0
        for plateau, extra in (("off", {}), ("stop", {**PLATEAU, "on_plateau": "stop"}),
                               ("decay", {**PLATEAU, "on_plateau": "decay", "plateau_max_decays": 2})):
            r = simulate(PlateauSim(rounds=rounds, params={**opt, **extra}))
            best, at = r.best
            gap = 100 * (best - r.published_acc)
            if plateau == "off":
                full_best = best
            else:
                worst_gap = max(worst_gap, gap)
                notes.append(f"{name} {plateau}: {r.rounds_run} of {rounds} rounds, published "
                             f"{100 * (full_best - r.published_acc):.2f} points below the best of all {rounds} rounds "
                             f"without plateau detection, {gap:.2f} below the best it saw"
                             + (" (within 0.5)" if gap <= 0.5 else " (NOT within 0.5)"))
            rows.append(f"| {name} | {plateau} | {r.rounds_run} | {100 * best:.2f} (r{at}) | "
                        f"{100 * r.published_acc:.2f} | {gap:.2f} | {r.lr_decays} | {r.seconds:.0f} s |")
    soak = _soak_with_server_set(quick)
    return "\n".join([
        "## Plateau detection and server optimisers (bench_plateau)",
        "",
        f"A {rounds}-round federated job on the simulated digits fleet (10 devices, Dirichlet alpha 0.3 label "
        "skew, all taking part in every round, softmax-regression head, 2 local epochs of SGD at lr 0.5), driven "
        "through the real RoundEngine (the plain fedavg rule, no server set, quarantine off: an honest fleet), "
        "registry and update wire format. Devices report their "
        "validation accuracy (20 % of their data, never trained on) of "
        "the version they were sent (`accuracy_before`); the plateau rule uses only that. The accuracies below "
        "are on the coordinator-side test set (the 450 digits no device holds: one digit is 0.22 points). Best: "
        "the best of all the versions the job produced; "
        "published: the job's last version (with plateau detection, the best version by the devices' reports, "
        f"restored). Plateau: `train --patience {PLATEAU['plateau_patience']} --min-delta "
        f"{100 * PLATEAU['plateau_min_delta']:g}` (points; the rule reads a moving average, weight 0.3, of the "
        "reported accuracy); decay (`--on-plateau decay`) halves the server lr, twice at most, then stops. "
        "fedavgm: server lr 0.5, momentum 0.5; fedadam: server lr 0.03 (beta1 0.9, beta2 0.99, tau 1e-3).",
        "",
        "| server opt | plateau | rounds run | best test acc % (round) | published acc % | gap (points) "
        "| lr decays | time |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"Worst gap between the published and the best version with plateau detection on: {worst_gap:.2f} points.",
        "",
        *[f"- {n}" for n in notes],
        "",
        "The plateau rule sees only the devices' reports; it stops when they stop improving by more than "
        "--min-delta, which can be while the test accuracy still creeps up (the cost is the second figure "
        "above). A larger --patience or a smaller --min-delta trades rounds for that last fraction of a point.",
        "",
        *soak,
    ])


def _soak_with_server_set(quick: bool) -> list[str]:
    """The soak's fleet (4 devices, a few dozen digits each: bench/soak.py) in one long job,
    with the model's server set: the gate holds every version within reach of the best, and
    the plateau rule, judging each version on the server set, stops within its patience."""
    from edge_agent.sim.poisoning import digits_fleet
    from edge_agent.sim.poisoning import simulate as fleet_job

    rounds, patience = (60, 5) if quick else (200, 10)
    rows, checks = [], []
    for seed in (0, 1):
        data = digits_fleet(4, seed=seed, per_device=40)
        for stop in (False, True):
            params = {"plateau_patience": patience, "plateau_min_delta": 0.005} if stop else {}
            r = fleet_job(data, rounds=rounds, server_set=True, seed=seed, params=params)
            peak = max(range(len(r.accuracy)), key=r.accuracy.__getitem__)
            scores = [a for a in r.server_accuracy if a is not None]
            score_peak = max(range(len(scores)), key=scores.__getitem__) if scores else 0
            drop = 100 * (r.accuracy[peak] - r.accuracy[-1])
            if stop:
                checks.append(len(scores) - 1 - score_peak <= patience and r.reason.startswith("plateau"))
            else:
                checks.append(drop <= 1.0)
            rows.append(f"| {seed} | {'--patience ' + str(patience) if stop else 'none'} | {len(r.accuracy)} | "
                        f"{100 * r.accuracy[peak]:.1f} (r{peak + 1}) | {100 * r.accuracy[-1]:.1f} | {drop:.1f} | "
                        f"{r.failed} | {(r.reason or r.status)[:90]} |")
    return ["### The soak's fleet with a server set", "",
            f"4 devices of 40 camera digits each (the soak's few dozen), one job of up to {rounds} rounds, the "
            "default rule with the model's 300-sample server set (trust; every version gated against the one it "
            "replaces), edge_agent/sim/poisoning.py's MLP head. Test accuracy on 449 held-out digits; peak = the best "
            "version's; drop = from the peak to the last version. With `--patience`, the plateau rule judges each "
            "version by its server-set score.", "",
            "| seed | plateau rule | rounds run | peak test acc % (round) | last % | drop (points) | rounds the gate "
            "stopped | job |", "|---|---|---:|---:|---:|---:|---:|---|", *rows, "",
            f"Targets: accuracy within 1 point of its peak to the end without a plateau rule, and a stop within "
            f"{patience} versions of the server-set peak with one: {sum(checks)} of {len(checks)} met.", ""]
