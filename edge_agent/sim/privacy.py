"""A private federated job on a large simulated fleet, through the real coordinator
(RoundEngine, registry, update payloads, the dp_fedavg rule and the privacy accountant):
the simulation behind bench/bench_privacy.py.

The fleet: scikit-learn's 8x8 digits through each device's own camera (sim/digits.py), non-
IID. 449 digits are held out for the test set and SERVER_SAMPLES more are kept off the fleet;
the remaining ~1,050 are far fewer than 1,000 devices x a useful share, so each device draws
its `per_device` samples from that pool -- labels from its own Dirichlet(alpha) class mix,
images through its own camera (the same digit seen by two devices is two different images,
as two cameras would give). The head is the MLP of sim/poisoning.py (`hidden` units), trained
on every device by the project's numpy trainer.

Each round the engine selects `per_round` of the eligible devices (all are eligible here: q
= per_round / devices). A private device clips its delta to dp_clip before encoding
(updates/clip.py); the coordinator clips again and adds the noise (strategies/dp.py).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..coordinator.registry import Registry
from ..coordinator.rounds import RoundEngine, RoundPolicy
from ..updates.clip import clip_for_privacy
from ..updates.wire import UpdateHeader, encode_update
from .digits import apply_camera, camera_params, device_seed, load_digits_images
from .poisoning import (
    SERVER_SAMPLES,
    FleetData,
    Model,
    _split_server,
    _through_cameras,
    mlp_init,
    mlp_symbol,
    seeded_device_keys,
)


def digits_cameras(n_devices: int, *, per_device: int = 16, alpha: float = 0.5, seed: int = 0) -> FleetData:
    """`n_devices` non-IID digits cameras with `per_device` samples each (module doc)."""
    images, labels = load_digits_images()
    perm = np.random.default_rng([seed, 0x7E57]).permutation(len(labels))
    test_idx, srv_idx, pool = perm[:449], perm[449:449 + SERVER_SAMPLES], perm[449 + SERVER_SAMPLES:]
    by_class = [pool[labels[pool] == c] for c in range(10)]
    cams = [camera_params(device_seed(seed, d)) for d in range(n_devices)]
    xs, ys = [], []
    for d in range(n_devices):
        rng = np.random.default_rng([seed, d, 0xD1])
        mix = rng.dirichlet(np.full(10, alpha))
        ys_d = rng.choice(10, size=per_device, p=mix)
        idx = np.array([rng.choice(by_class[c]) for c in ys_d])
        xs.append(apply_camera(images[idx], cams[d]).reshape(per_device, -1))
        ys.append(labels[idx])
    flat = lambda idx: _through_cameras(images[idx], cams, apply_camera).reshape(len(idx), -1)  # noqa: E731
    return FleetData("digits", [str(i) for i in range(10)], xs, ys, flat(test_idx), labels[test_idx],
                     _split_server(flat(srv_idx), labels[srv_idx], 10))


LOCAL = {"epochs": 5, "lr": 0.3, "batch_size": 8}  # 10 SGD steps on a device's 16 samples


class SmallModel(Model):
    """poisoning.Model with `hidden` units and LOCAL training (a device's share is small)."""

    def __init__(self, features: int, classes: int, hidden: int) -> None:
        super().__init__(features, classes)
        self.hidden = hidden
        self.symbol = mlp_symbol(features, classes, hidden)

    def trainer(self, params: Mapping[str, np.ndarray], seed: int, distill: float = 0.0) -> Any:
        from ..train.dense_head import make_head_trainer
        from ..train.trainer import TrainConfig

        config = TrainConfig(optimizer="sgd", momentum=0.0, weight_decay=0.0, seed=seed, distill=distill, **LOCAL)
        return make_head_trainer(symbol_json=self.symbol, params=params, input_name="features",
                                 num_classes=self.classes, config=config, backend="numpy",
                                 input_shape=(self.features,))


@dataclass
class PrivateRun:
    accuracy: list[float] = field(default_factory=list)  # held-out accuracy after each round
    epsilon: list[float | None] = field(default_factory=list)  # the version's dp_epsilon
    lineage_epsilon: float | None = None
    status: str = ""
    reason: str = ""
    rounds: int = 0
    clipped_at_coordinator: int = 0
    median_norm: float = 0.0  # the devices' updates' median norm before clipping
    seconds: float = 0.0

    @property
    def final(self) -> float:
        return self.accuracy[-1] if self.accuracy else float("nan")


def simulate_private(data: FleetData, *, rounds: int, per_round: int, params: dict[str, Any], hidden: int = 16,
                     seed: int = 0, device_clips: bool = True) -> PrivateRun:
    """One job through the real engine; `params`: its job params (dp_* for a private job)."""
    start = time.perf_counter()
    n = len(data.xs)
    ids, pubs = seeded_device_keys(f"privacy-sim/{seed}", n)  # device order decides the sampling: reproducible
    index = {d: i for i, d in enumerate(ids)}
    model = SmallModel(data.features, len(data.labels), hidden)
    glob = mlp_init(data.features, len(data.labels), seed, hidden)
    state = tempfile.mkdtemp(prefix="sim-dp-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    clock = [1_700_000_000.0]
    noise = np.random.default_rng([seed, 0xD9])  # seeded here for a reproducible bench (production: CSPRNG)
    clip = params.get("dp_clip")
    try:
        reg = Registry(state_dir=state, clock=lambda: clock[0])
        engine = RoundEngine(registry=reg, policy=RoundPolicy(quarantine_after=1_000_000), clock=lambda: clock[0],
                             noise=lambda: noise)
        reg.add_model_version(name="sim", version="1", head=glob)
        for i in range(n):
            reg.enrol_device(device_id=ids[i], public_key=pubs[i], fleet="f", approved=True)
            reg.record_state(ids[i], online=True, state={"battery_pct": 90, "data_samples": len(data.ys[i])})
        job = engine.start_job(model_name="sim", model_version="1", rounds=rounds, min_devices=1, deadline_s=100,
                               params={"devices_per_round": per_round, **params},
                               job_id=f"privacy-sim-{seed}")  # it seeds the sampling: reproducible
        run, heads, norms = PrivateRun(), {"1": glob}, []
        opened = engine.tick().opened
        while opened:
            (plan,) = opened
            base = heads[plan.model_version]
            for did in plan.devices:
                i = index[did]
                delta = model.local_update(base, data.xs[i], data.ys[i], seed * 100_003 + plan.round * 1009 + i)
                norms.append(float(np.sqrt(sum(np.sum(np.square(v, dtype=np.float64)) for v in delta.values()))))
                if clip is not None and device_clips:
                    delta = clip_for_privacy(delta, float(clip))[0]
                header = UpdateHeader("sim", plan.model_version, plan.job_id, did, plan.round)
                engine.receive_update(encode_update(header, delta, density=1.0, bits=8), sender=did,
                                      num_samples=len(data.ys[i]))
            clock[0] += 1
            result = engine.tick()
            (out,) = result.closed
            opened = result.opened
            run.rounds += 1
            if out.new_version is not None:
                heads[out.new_version.version] = base = reg.load_head(out.new_version)
                m = out.new_version.metrics
                run.epsilon.append(m.get("dp_epsilon"))
                run.lineage_epsilon = m.get("dp_lineage_epsilon")
                run.clipped_at_coordinator += int(m.get("dp_clipped_at_coordinator") or 0)
            run.accuracy.append(model.accuracy(base, data.test_x, data.test_y))
            if not opened:
                opened = engine.tick().opened  # the budget stop ends the job here
        final = reg.get_job(job.id)
        run.status, run.reason = final.status.value, final.reason
        run.median_norm = float(np.median(norms)) if norms else 0.0
        reg.close()
        run.seconds = time.perf_counter() - start
        return run
    finally:
        shutil.rmtree(state, ignore_errors=True)
