"""Federated fleets under attack, through the real coordinator (RoundEngine, registry, the
update codec's payloads): the simulation behind bench/bench_poisoning.py and its tests.

Two real data sets, each split into held-out test samples, a server set (labelled samples the
operator keeps on the coordinator, seen through the fleet's cameras) and non-IID device
shares (Dirichlet label skew, each device through its own camera):

    digits    scikit-learn's 8x8 digits (64 pixels), 10 classes
    textures  16x16 patches cut from the photographs scikit-learn ships, 8 classes, as 26
              texture statistics (colour, contrast, edge energy at three scales, grey-level
              histogram) normalised on the left halves' patches -- the "frozen backbone"

The trainable part is a 2-layer MLP head (features -> 64 -> classes) given as an MXNet
symbol, trained by the project's own numpy trainer (train/dense_head.py) on every device and
by the coordinator on its server set, with plain SGD (2 epochs, lr 0.2, batch 32).

Attacks (the first `attackers` devices; the rest honest):

    sign_flip       the device's honest delta, negated
    scale100        x100
    inflated        negated, and claiming 1e9 samples (FedAvg's weight)
    nan_inf         NaN, +Inf or 3e38 in every value (cycled by round)
    tiny_norm       x1e-6
    noise           all attackers send one random direction, at the honest median norm
    alie            "a little is enough" (Baruch et al. 2019): the honest mean minus z x
                    the honest coordinate-wise std, z from the paper (at least 1)
    ipm             inner-product manipulation (Xie et al. 2020): -0.5 x the honest mean
    silent          the reference: the attackers send nothing at all

The omniscient attacks (noise, alie, ipm) see every honest delta of the round.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import math
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ..coordinator.evidence import SplitData, TailEvidence, split_by_hash
from ..coordinator.registry import Registry
from ..coordinator.rounds import RoundEngine, RoundPolicy
from ..keys import fingerprint, public_key_bytes
from ..protocol.label_claims import LabelClaims
from ..updates.codec import encode_tensors
from ..updates.wire import UpdateHeader, encode_update, pack_update
from . import textures as tex
from .digits import apply_camera, camera_params, device_seed, load_digits_images, partition_non_iid

ATTACKS = ("sign_flip", "scale100", "inflated", "nan_inf", "tiny_norm", "noise", "alie", "ipm")
HIDDEN = 64
LOCAL = {"epochs": 2, "lr": 0.2, "batch_size": 32}
SERVER_SAMPLES = 300


@dataclass(frozen=True)
class FleetData:
    name: str
    labels: list[str]
    xs: list[np.ndarray]  # per device: features (n, d) float32
    ys: list[np.ndarray]
    test_x: np.ndarray
    test_y: np.ndarray
    server: SplitData

    @property
    def features(self) -> int:
        return int(self.test_x.shape[1])


def _split_server(x: np.ndarray, y: np.ndarray, classes: int) -> SplitData:
    digests = [__import__("hashlib").sha256(np.ascontiguousarray(s).tobytes()).digest() for s in x]
    root, gate = split_by_hash(digests)
    return SplitData(x[root], y[root], x[gate], y[gate], classes)


def _through_cameras(images: np.ndarray, cams: list[Any], apply: Any) -> np.ndarray:
    """Each image through one device's camera, round-robin (the fleet's input distribution)."""
    out = np.empty(images.shape, np.float32)
    which = np.arange(len(images)) % len(cams)
    for d, cam in enumerate(cams):
        sel = which == d
        if sel.any():
            out[sel] = apply(images[sel], cam)
    return out


def digits_fleet(n_devices: int, *, alpha: float = 1.0, seed: int = 0, sizes: list[float] | None = None,
                 per_device: int | None = None, server_samples: int = SERVER_SAMPLES) -> FleetData:
    """Digits: 449 test and `server_samples` server samples held out, the rest split over the
    devices (`sizes`: relative data sizes, e.g. [10, 1] for one device with 10x the other's;
    `per_device`: at most that many samples each, as the soak's small devices)."""
    images, labels = load_digits_images()
    perm = np.random.default_rng([seed, 0x7E57]).permutation(len(labels))
    test_idx, srv_idx, train_idx = perm[:449], perm[449:449 + server_samples], perm[449 + server_samples:]
    parts = _parts(labels[train_idx], n_devices, alpha, seed, sizes)
    if per_device is not None:
        parts = [p[np.random.default_rng([seed, d]).permutation(len(p))[:per_device]] for d, p in enumerate(parts)]
    cams = [camera_params(device_seed(seed, d)) for d in range(n_devices)]
    xs = [apply_camera(images[train_idx[p]], cams[d]).reshape(len(p), -1) for d, p in enumerate(parts)]
    ys = [labels[train_idx[p]] for p in parts]
    flat = lambda idx: _through_cameras(images[idx], cams, apply_camera).reshape(len(idx), -1)  # noqa: E731
    return FleetData("digits", [str(i) for i in range(10)], xs, ys, flat(test_idx), labels[test_idx],
                     _split_server(flat(srv_idx), labels[srv_idx], 10))


def _parts(labels: np.ndarray, n: int, alpha: float, seed: int, sizes: list[float] | None) -> list[np.ndarray]:
    parts = partition_non_iid(labels, n, alpha, seed, min_per_device=10)
    if sizes is None:
        return parts
    rng = np.random.default_rng([seed, 0x5125])
    scale = np.asarray(sizes, np.float64) / max(sizes)
    return [np.sort(rng.choice(p, size=max(10, int(round(len(p) * s))), replace=False)) for p, s in zip(parts, scale,
                                                                                                          strict=True)]


@functools.cache
def _texture_norm() -> tuple[np.ndarray, np.ndarray]:
    x, _ = tex.patches(half=0, per_class=100, size=16, seed=12345)
    f = _texture_stats(x)
    return f.mean(axis=0), f.std(axis=0) + 1e-6


def _texture_stats(img: np.ndarray) -> np.ndarray:
    n = len(img)
    grey = img.mean(axis=1)
    mean, std = img.mean(axis=(2, 3)), img.std(axis=(2, 3))
    feats = [mean, std, mean / (img.mean(axis=(1, 2, 3))[:, None] + 1e-3)]
    for k in (1, 2, 4):
        g = grey.reshape(n, 16 // k, k, 16 // k, k).mean(axis=(2, 4))
        dx, dy = np.abs(np.diff(g, axis=2)).mean(axis=(1, 2)), np.abs(np.diff(g, axis=1)).mean(axis=(1, 2))
        feats += [dx[:, None], dy[:, None], (dx / (dy + 1e-3))[:, None]]
    feats.append(np.stack([((grey >= a) & (grey < a + 0.125)).mean(axis=(1, 2)) for a in np.arange(0, 1, 0.125)], 1))
    return np.concatenate(feats, axis=1)


def texture_features(images: np.ndarray) -> np.ndarray:
    mean, std = _texture_norm()
    return ((_texture_stats(images) - mean) / std).astype(np.float32)


def texture_fleet(n_devices: int, *, alpha: float = 1.0, seed: int = 0, per_device: int = 160,
                  sizes: list[float] | None = None, server_samples: int = SERVER_SAMPLES) -> FleetData:
    """Textures: device patches from the right halves of the regions (Dirichlet class shares),
    test and server patches from the right halves too, through the fleet's cameras."""
    rng = np.random.default_rng([seed, 0xD1])
    rel = np.ones(n_devices) if sizes is None else np.asarray(sizes, np.float64) / max(sizes)
    cams = [tex.camera(seed * 100 + d) for d in range(n_devices)]
    xs, ys = [], []
    for d in range(n_devices):
        share = rng.dirichlet([alpha] * len(tex.CLASSES))
        counts = np.maximum(2, np.round(share * per_device * rel[d])).astype(np.int64)
        x, y = tex.patches(half=1, per_class=0, size=16, seed=seed * 100 + d, counts=counts)
        xs.append(texture_features(cams[d].apply(x)))
        ys.append(y)

    def pool(per_class: int, s: int) -> tuple[np.ndarray, np.ndarray]:
        x, y = tex.patches(half=1, per_class=per_class, size=16, seed=s)
        order = np.random.default_rng(s).permutation(len(y))
        feats = texture_features(_through_cameras(x[order], cams, lambda im, cam: cam.apply(im)))
        return feats, y[order]

    test_x, test_y = pool(60, seed * 100 + 77)
    srv_x, srv_y = pool(server_samples // len(tex.CLASSES), seed * 100 + 78)
    return FleetData("textures", list(tex.CLASSES), xs, ys, test_x, test_y,
                     _split_server(srv_x, srv_y, len(tex.CLASSES)))


FLEETS = {"digits": digits_fleet, "textures": texture_fleet}


# ---------------------------------------------------------------- the model
def mlp_symbol(features: int, classes: int, hidden: int = HIDDEN) -> str:
    """MXNet symbol JSON of features -> FullyConnected(hidden) -> relu -> FullyConnected(classes)."""
    def var(name: str) -> dict[str, Any]:
        return {"op": "null", "name": name, "inputs": []}

    nodes = [var("features"), var("fc1_weight"), var("fc1_bias"),
             {"op": "FullyConnected", "name": "fc1", "attrs": {"num_hidden": str(hidden)},
              "inputs": [[0, 0, 0], [1, 0, 0], [2, 0, 0]]},
             {"op": "Activation", "name": "relu1", "attrs": {"act_type": "relu"}, "inputs": [[3, 0, 0]]},
             var("fc2_weight"), var("fc2_bias"),
             {"op": "FullyConnected", "name": "fc2", "attrs": {"num_hidden": str(classes)},
              "inputs": [[4, 0, 0], [5, 0, 0], [6, 0, 0]]}]
    return json.dumps({"nodes": nodes, "arg_nodes": [0, 1, 2, 5, 6], "node_row_ptr": list(range(len(nodes) + 1)),
                       "heads": [[7, 0, 0]], "attrs": {"mxnet_version": ["int", 10901]}})


def mlp_init(features: int, classes: int, seed: int, hidden: int = HIDDEN) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([seed, 0x1417])
    return {"fc1_weight": (rng.standard_normal((hidden, features)) * math.sqrt(2.0 / features)).astype(np.float32),
            "fc1_bias": np.zeros(hidden, np.float32),
            "fc2_weight": (rng.standard_normal((classes, hidden)) * math.sqrt(1.0 / hidden)).astype(np.float32),
            "fc2_bias": np.zeros(classes, np.float32)}


def train_config(seed: int, distill: float = 0.0) -> Any:
    from ..train.trainer import TrainConfig

    return TrainConfig(optimizer="sgd", momentum=0.0, weight_decay=0.0, seed=seed, distill=distill, **LOCAL)


class Model:
    """The MLP head, trained and scored with the project's trainer."""

    def __init__(self, features: int, classes: int) -> None:
        self.features, self.classes = features, classes
        self.symbol = mlp_symbol(features, classes)

    def trainer(self, params: Mapping[str, np.ndarray], seed: int, distill: float = 0.0) -> Any:
        from ..train.dense_head import make_head_trainer

        return make_head_trainer(symbol_json=self.symbol, params=params, input_name="features",
                                 num_classes=self.classes, config=train_config(seed, distill), backend="numpy",
                                 input_shape=(self.features,))

    def local_update(self, params: Mapping[str, np.ndarray], x: np.ndarray, y: np.ndarray, seed: int,
                     distill: float = 0.0) -> dict[str, np.ndarray]:
        """A device's delta; `distill` > 0 pulls it towards `params`' own answers as a real
        device's job does (train/job.py: the teacher is the base's logits on the samples)."""
        t = self.trainer(params, seed, distill)
        teacher = t.predict(x) if distill else None
        for epoch in range(t.config.epochs):
            for b in range(t.batches_per_epoch(len(y))):
                idx = t.batch_indices(len(y), epoch, b)
                t.step(x[idx], y[idx], None if teacher is None else teacher[idx])
        new = t.params()
        return {k: (new[k] - params[k]).astype(np.float32) for k in params}

    def accuracy(self, params: Mapping[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
        return float((self.trainer(params, 0).predict(x).argmax(axis=1) == y).mean())

    def claims(self, params: Mapping[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> dict[str, str]:
        """The label claims a device training on (x, y) from `params` sends (agent/child.py)."""
        from ..train.dense_head import log_softmax

        return LabelClaims.of(np.exp(log_softmax(self.trainer(params, 0).predict(x))), y).metrics()


class SimEvidence:
    """The engine's evidence source for a simulated fleet: its server set's features and the
    MLP head (aggregation.EvidenceSource)."""

    def __init__(self, data: FleetData, model: Model, enabled: bool) -> None:
        self.data, self.model, self.enabled = data, model, enabled

    def has_server_set(self, model_name: str, params: Mapping[str, Any]) -> bool:
        return self.enabled

    def tail(self, job: Any, version: Any, head: Mapping[str, np.ndarray]) -> TailEvidence | None:
        from ..coordinator.streaming import Layout

        if not self.enabled:
            return None
        return TailEvidence(data=self.data.server, symbol_json=self.model.symbol, input_name="features",
                            layout=Layout(head), config=train_config(seed=7), backend="numpy")


# ---------------------------------------------------------------- attacks
def _flat(delta: Mapping[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(delta[k], np.float64).ravel() for k in sorted(delta)])


def _unflat(vec: np.ndarray, like: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    out, off = {}, 0
    for k in sorted(like):
        size = like[k].size
        out[k] = vec[off:off + size].reshape(like[k].shape).astype(np.float32)
        off += size
    return out


def alie_z(n: int, attackers: int) -> float:
    """Baruch et al.'s z_max for n devices, `attackers` of them hostile (at least 1)."""
    from scipy.stats import norm

    s = n // 2 + 1 - attackers
    return max(1.0, float(norm.ppf((n - s) / n)))


def hostile(kind: str, own: dict[str, np.ndarray], honest: list[dict[str, np.ndarray]], header: UpdateHeader,
            samples: int, rnd: int, n: int, attackers: int) -> tuple[bytes, int]:
    """The payload and sample count an attacker sends instead of its honest delta."""
    if kind == "nan_inf":
        value = (np.nan, np.inf, 3e38)[rnd % 3]
        bad = {k: np.full(v.shape, value, np.float32) for k, v in own.items()}
        return pack_update(header, encode_tensors(bad, {k: np.arange(v.size) for k, v in own.items()}, 32)), samples
    if kind in ("sign_flip", "scale100", "inflated", "tiny_norm"):
        scale = {"sign_flip": -1.0, "scale100": 100.0, "inflated": -1.0, "tiny_norm": 1e-6}[kind]
        delta = {k: (scale * v).astype(np.float32) for k, v in own.items()}
        return encode_update(header, delta, density=1.0, bits=8), (10**9 if kind == "inflated" else samples)
    flat = np.stack([_flat(d) for d in honest])
    if kind == "noise":
        v = np.random.default_rng([rnd, 0xB0B]).standard_normal(flat.shape[1])
        vec = v / np.linalg.norm(v) * float(np.median(np.linalg.norm(flat, axis=1)))
    elif kind == "alie":
        vec = flat.mean(axis=0) - alie_z(n, attackers) * flat.std(axis=0)
    elif kind == "ipm":
        vec = -0.5 * flat.mean(axis=0)
    else:
        raise ValueError(f"unknown attack {kind!r}")
    return encode_update(header, _unflat(vec, own), density=1.0, bits=8), samples


# ---------------------------------------------------------------- one job
@dataclass
class Run:
    accuracy: list[float] = field(default_factory=list)  # held-out accuracy after each round
    published: int = 0
    failed: int = 0
    reasons: list[str] = field(default_factory=list)
    longest_silence: int = 0  # most rounds in a row that published nothing
    rejected_honest: int = 0  # honest updates REJECTED
    uncounted_honest: int = 0  # honest updates accepted with no share of the aggregate
    uncounted_hostile: int = 0  # hostile updates rejected or accepted with no share of the aggregate
    aggregator: str = ""
    status: str = ""  # the job's, at the end
    reason: str = ""
    server_accuracy: list[float | None] = field(default_factory=list)  # each round's version, on the server set

    def at(self, rounds: int) -> float:
        return self.accuracy[min(rounds, len(self.accuracy)) - 1]


def seeded_device_keys(label: str, n: int) -> tuple[list[str], list[str]]:
    """The ids and public keys of `n` simulated devices, derived from `label`: the coordinator
    orders devices by id (and encodes, samples and sums in that order), so fresh random keys
    made two runs of one cell differ (bench_poisoning: digits, 3 devices, x100 with a server
    set, 68.4 or 73.1 % after round 1 by the draw). Simulation keys only: a real device
    generates its key."""
    keys = [Ed25519PrivateKey.from_private_bytes(hashlib.sha256(f"{label}/{i}".encode()).digest()) for i in range(n)]
    return [fingerprint(k) for k in keys], [base64.b64encode(public_key_bytes(k)).decode() for k in keys]


IDS, PUBS = seeded_device_keys("poisoning-sim", 16)


def simulate(data: FleetData, *, attack: str | None = None, attackers: int = 0, rounds: int = 30,
             server_set: bool = True, aggregator: str | None = None, seed: int = 0,
             policy: RoundPolicy | None = None, early_stop: dict[int, int] | None = None,
             params: dict[str, Any] | None = None, distill: float = 0.0) -> Run:
    """One federated job through the real engine. `early_stop`: device -> the round from
    which it sends half its update (a device stopped early by its budget); `params`: more
    job params (the plateau rule's, the server optimiser's); `distill`: every device's
    not-true distillation weight (`--distill`)."""
    n = len(data.xs)
    if n > len(IDS):
        raise ValueError(f"at most {len(IDS)} simulated devices")
    model = Model(data.features, len(data.labels))
    glob = mlp_init(data.features, len(data.labels), seed)
    state = tempfile.mkdtemp(prefix="sim-poison-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    clock = [1_700_000_000.0]
    try:
        reg = Registry(state_dir=state, clock=lambda: clock[0])
        engine = RoundEngine(registry=reg, policy=policy or RoundPolicy(), clock=lambda: clock[0],
                             evidence=SimEvidence(data, model, server_set))
        reg.add_model_version(name="sim", version="1", head=glob)
        for i in range(n):
            reg.enrol_device(device_id=IDS[i], public_key=PUBS[i], fleet="f", approved=True)
            reg.record_state(IDS[i], online=True, state={"battery_pct": 90, "data_samples": len(data.ys[i])})
        params = {**({"aggregator": aggregator} if aggregator else {}), **(params or {})}
        job = engine.start_job(model_name="sim", model_version="1", rounds=rounds, min_devices=1, deadline_s=100,
                               params=params)
        run, heads, silence = Run(aggregator=str(reg.get_job(job.id).params.get("aggregator"))), {"1": glob}, 0
        opened = engine.tick().opened
        for rnd in range(rounds):
            if not opened:
                break
            (plan,) = opened
            base = heads[plan.model_version]
            honest: dict[int, dict[str, np.ndarray]] = {}
            for did in plan.devices:
                i = IDS.index(did)
                x, y = data.xs[i], data.ys[i]
                delta = model.local_update(base, x, y, seed * 1000 + rnd * 16 + i, distill)
                if early_stop and i in early_stop and rnd >= early_stop[i]:
                    delta = {k: 0.5 * v for k, v in delta.items()}
                honest[i] = delta
            for did in plan.devices:
                i = IDS.index(did)
                if attack == "silent" and i < attackers:
                    continue
                header = UpdateHeader("sim", plan.model_version, plan.job_id, did, plan.round)
                if attack is not None and i < attackers:
                    payload, samples = hostile(attack, honest[i], list(honest.values()), header, len(data.ys[i]),
                                               rnd, n, attackers)
                else:
                    payload, samples = encode_update(header, honest[i], density=1.0, bits=8), len(data.ys[i])
                engine.receive_update(payload, sender=did, num_samples=samples,
                                      metrics=model.claims(base, data.xs[i], data.ys[i]))
            clock[0] += 1
            result = engine.tick()
            if not result.closed:  # someone stayed silent: the deadline closes the round
                clock[0] += 101
                for i in range(n):
                    reg.record_state(IDS[i], online=True, state={"battery_pct": 90, "data_samples": len(data.ys[i])})
                result = engine.tick()
            (out,) = result.closed
            opened = result.opened
            for u in reg.list_updates(job.id, out.round):
                i = IDS.index(u.device_id)
                if attack is not None and attack != "silent" and i < attackers:
                    run.uncounted_hostile += u.status.value == "rejected" or u.reason.startswith("counted for nothing")
                    continue
                if u.status.value == "rejected":
                    run.rejected_honest += 1
                elif u.reason.startswith("counted for nothing"):
                    run.uncounted_honest += 1
            if out.new_version is None:
                run.failed += 1
                silence += 1
                run.longest_silence = max(run.longest_silence, silence)
                run.reasons.append(out.reason)
            else:
                run.published += 1
                silence = 0
                heads[out.new_version.version] = reg.load_head(out.new_version)
                base = heads[out.new_version.version]
            run.accuracy.append(model.accuracy(base, data.test_x, data.test_y))
            run.server_accuracy.append(out.new_version.metrics.get("accuracy") if out.new_version else None)
        final = reg.get_job(job.id)
        run.status, run.reason = final.status.value, final.reason
        reg.close()
        return run
    finally:
        shutil.rmtree(state, ignore_errors=True)
