"""Federated FedAvg on the simulated digits fleet, with and without compressed updates.

Used by the experiment test (tests/unit/test_updates_experiment.py) and by
bench/bench_codec.py. The "trainable part" is a one-hidden-layer ReLU MLP head (or softmax
regression with hidden=0) on the 64 pixels, in pure numpy, trained on each device with
local SGD from the current global model. Each round every device sends its delta:
  - uncompressed (`policy=None`): the float32 delta itself (FedAvg baseline);
  - compressed: through the real path, UpdateEncoder (error feedback, warm-up, budget)
    -> chunks -> Reassembler -> decode_update(expected_table=...) on the coordinator.
The coordinator adds the sample-weighted mean of the decoded deltas to the global model.
Everything is deterministic given the config's seed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from edge_agent.sim.digits import Fleet, make_fleet
from edge_agent.updates import (
    CompressionPolicy,
    Reassembler,
    UpdateEncoder,
    decode_update,
    tensor_table,
)

Params = dict[str, np.ndarray]


@dataclass(frozen=True)
class FedConfig:
    n_devices: int = 10
    rounds: int = 20
    alpha: float = 0.5  # Dirichlet label skew (smaller: more non-IID)
    hidden: int = 256  # 0: softmax regression
    local_epochs: int = 1
    batch_size: int = 32
    lr: float = 0.1
    seed: int = 0


@dataclass
class FedResult:
    accuracy: list[float]  # test accuracy after each round
    dense_bytes: int = 0  # fp32 bytes of every delta sent
    wire_bytes: int = 0  # bytes of every chunk sent (dense_bytes when uncompressed)
    updates: int = 0  # device updates sent (rounds x devices)
    bits_used: dict[int, int] = field(default_factory=dict)  # bit width -> updates
    seconds: float = 0.0

    @property
    def final_accuracy(self) -> float:
        return self.accuracy[-1]

    @property
    def ratio(self) -> float:
        return self.dense_bytes / self.wire_bytes if self.wire_bytes else 1.0


def init_params(n_in: int, hidden: int, n_out: int, seed: int) -> Params:
    """He-initialised MLP (or zero-initialised softmax regression when hidden == 0)."""
    rng = np.random.default_rng([seed, 0x1417])
    if hidden == 0:
        return {
            "fc.weight": np.zeros((n_in, n_out), np.float32),
            "fc.bias": np.zeros(n_out, np.float32),
        }
    return {
        "fc1.weight": (rng.standard_normal((n_in, hidden)) * np.sqrt(2.0 / n_in)).astype(
            np.float32
        ),
        "fc1.bias": np.zeros(hidden, np.float32),
        "fc2.weight": (rng.standard_normal((hidden, n_out)) * np.sqrt(1.0 / hidden)).astype(
            np.float32
        ),
        "fc2.bias": np.zeros(n_out, np.float32),
    }


def _logits(p: Params, x: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    if "fc.weight" in p:
        return x @ p["fc.weight"] + p["fc.bias"], None
    h = np.maximum(x @ p["fc1.weight"] + p["fc1.bias"], 0.0)
    return h @ p["fc2.weight"] + p["fc2.bias"], h


def predict(p: Params, x: np.ndarray) -> np.ndarray:
    return np.argmax(_logits(p, x)[0], axis=1)


def accuracy(p: Params, x: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(predict(p, x) == y))


def _grads(p: Params, x: np.ndarray, y: np.ndarray) -> Params:
    """Gradients of the mean softmax cross-entropy."""
    z, h = _logits(p, x)
    z = z - z.max(axis=1, keepdims=True)
    prob = np.exp(z)
    prob /= prob.sum(axis=1, keepdims=True)
    prob[np.arange(len(y)), y] -= 1.0
    g = prob / len(y)
    if h is None:
        return {"fc.weight": x.T @ g, "fc.bias": g.sum(0)}
    gh = (g @ p["fc2.weight"].T) * (h > 0)
    return {
        "fc1.weight": x.T @ gh,
        "fc1.bias": gh.sum(0),
        "fc2.weight": h.T @ g,
        "fc2.bias": g.sum(0),
    }


def local_sgd(
    p: Params, x: np.ndarray, y: np.ndarray, cfg: FedConfig, rng: np.random.Generator
) -> Params:
    """Plain minibatch SGD from `p` for `cfg.local_epochs` epochs; returns new params."""
    p = {k: v.copy() for k, v in p.items()}
    for _ in range(cfg.local_epochs):
        order = rng.permutation(len(y))
        for start in range(0, len(y), cfg.batch_size):
            b = order[start : start + cfg.batch_size]
            for k, g in _grads(p, x[b], y[b]).items():
                p[k] -= (cfg.lr * g).astype(np.float32)
    return p


def run_fedavg(
    cfg: FedConfig, policy: CompressionPolicy | None = None, fleet: Fleet | None = None
) -> FedResult:
    """Run `cfg.rounds` rounds of FedAvg; compressed through the real wire path if `policy`."""
    start = time.perf_counter()
    fleet = fleet or make_fleet(cfg.n_devices, cfg.alpha, cfg.seed)
    xs = [d.images.reshape(len(d.labels), -1) for d in fleet.devices]
    ys = [d.labels for d in fleet.devices]
    x_test = fleet.test_images.reshape(len(fleet.test_labels), -1)
    weights = np.array([len(y) for y in ys], dtype=np.float64)
    weights /= weights.sum()
    glob = init_params(xs[0].shape[1], cfg.hidden, 10, cfg.seed)
    table = tensor_table(glob)
    encoders = [
        UpdateEncoder(model_name="digits-head", device_id=d.device_id, policy=policy)
        for d in fleet.devices
    ]
    coordinator = Reassembler()
    result = FedResult(accuracy=[])
    for rnd in range(cfg.rounds):
        agg = {k: np.zeros(v.shape, np.float64) for k, v in glob.items()}
        for dev, (x, y) in enumerate(zip(xs, ys, strict=True)):
            rng = np.random.default_rng([cfg.seed, rnd, dev])
            local = local_sgd(glob, x, y, cfg, rng)
            delta = {k: local[k] - glob[k] for k in glob}
            dense = 4 * sum(v.size for v in delta.values())
            result.dense_bytes += dense
            result.updates += 1
            if policy is None:
                received = delta
                result.wire_bytes += dense
            else:
                update = encoders[dev].encode(
                    delta, job_id="fedsim", round=rnd, model_version=f"r{rnd}"
                )
                chunks = update.chunks()
                result.wire_bytes += sum(len(c) for c in chunks)
                result.bits_used[update.bits] = result.bits_used.get(update.bits, 0) + 1
                done = None
                for c in reversed(
                    chunks
                ):  # out of order on purpose: MQTT gives no ordering across retries
                    done = coordinator.add(c) or done
                assert done is not None, "reassembly did not complete"
                received = decode_update(done.payload, expected_table=table).deltas
                encoders[dev].commit(update)
            for k in agg:
                agg[k] += weights[dev] * received[k]
        glob = {k: (glob[k] + agg[k]).astype(np.float32) for k in glob}
        result.accuracy.append(accuracy(glob, x_test, fleet.test_labels))
    result.seconds = time.perf_counter() - start
    return result
