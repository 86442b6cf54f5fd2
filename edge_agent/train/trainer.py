"""The MXNet part: Gluon training of a model's head on cached backbone features.

The head is the bundle's own MXNet symbol (everything after the split tensor) with its
parameters; it is trained in fp32 on features the int8 backbone produced once. To train
the last N *backbone* layers as well, build the bundle with its split N layers earlier
(`create_bundle(split=...)`): those layers then belong to the head and the cache holds
the features of the layer before them. `train_last` freezes all but the head's last N
parameterised layers.

Everything that decides the result is reproducible from the checkpointed state: the batch
order of epoch e is `default_rng([seed, e]).permutation(n)`, and parameters, optimiser
state (moments and update counts) and the early-stopping record are saved as plain
arrays -- no pickles -- so a resumed run continues bit-for-bit where it stopped.

MXNet is imported only inside this module's functions and methods (through
`mxnet_import.mxnet()`): the daemon can import the package without loading it.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..errors import ConfigError, InputError
from ..protocol.finetune import MAX_DISTILL

OPTIMIZERS = ("adam", "sgd")
BN_MODES = ("frozen", "update")
TAIL_MODES = ("full", "bias")


def freeze_batchnorm(symbol_json: str) -> str:
    """The symbol with every BatchNorm using its stored statistics (use_global_stats): a
    tail trained on a small local set keeps the statistics the base model learnt, and its
    scale and shift still train."""
    try:
        graph = json.loads(symbol_json)
        nodes = graph["nodes"]
    except (ValueError, KeyError, TypeError) as exc:
        raise InputError(f"head symbol: not MXNet symbol JSON ({exc})") from None
    changed = False
    for node in nodes:
        if isinstance(node, dict) and node.get("op") == "BatchNorm":
            attrs = node.setdefault("attrs", {})
            attrs["use_global_stats"] = "True"
            changed = True
    return json.dumps(graph) if changed else symbol_json


DISTILL_TEMPERATURE = 1.0  # FedNTD's: the bundle's answers as they are


def not_true_teacher(teacher: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What not-true distillation pulls towards (dense_head.training_loss): per sample, the
    teacher's log-probabilities at DISTILL_TEMPERATURE over the classes but the true one (-inf
    at it), the same as probabilities, and 1.0 where the teacher answers right, else 0.0."""
    z = np.asarray(teacher, np.float64) / DISTILL_TEMPERATURE
    right = (z.argmax(axis=1) == y).astype(np.float64)
    z[np.arange(len(y)), y] = -np.inf
    z -= z.max(axis=1, keepdims=True)
    log_q = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return log_q, np.exp(log_q), right


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Hyper-parameters, validated at construction."""

    optimizer: str = "adam"
    lr: float = 0.01
    momentum: float = 0.9  # sgd only
    weight_decay: float = 1e-4
    batch_size: int = 32
    epochs: int = 20
    patience: int = 3  # epochs without a validation-loss improvement before stopping
    min_delta: float = 1e-4
    # ... or this share of the best loss, if larger: a gain under 1 % is within what a split of
    # tens of samples varies by, and distillation kept such gains coming for 10-16 more epochs
    # (bench_depth's auto job, camera digits: tail training -10 %, textures -6 %, same accuracy)
    min_rel_delta: float = 0.01
    balance: bool = False  # weight each class by 1 / its frequency
    seed: int = 0
    train_last: int | None = None  # train only the last N parameterised head layers
    bn: str = "update"  # BatchNorm in the head: "update" its statistics, or keep them "frozen" (use_global_stats)
    tail: str = "full"  # "bias": only 1-D parameters (biases, BN scale/shift) and the last layer train
    distill: float = 0.0  # weight of the pull towards the bundle's own answers (dense_head.training_loss)

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"optimizer: expected one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        for key, low in (("lr", 0.0), ("weight_decay", -1e-12), ("momentum", -1e-12), ("min_delta", -1e-12),
                         ("min_rel_delta", -1e-12)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= low:
                raise ConfigError(f"{key}: must be a finite number > {max(low, 0):g}, got {value!r}")
        for key, low in (("batch_size", 1), ("epochs", 1), ("patience", 1)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{key}: must be an integer >= {low}, got {value!r}")
        if self.train_last is not None and (not isinstance(self.train_last, int) or self.train_last < 1):
            raise ConfigError(f"train_last: must be an integer >= 1, got {self.train_last!r}")
        d = self.distill
        if isinstance(d, bool) or not isinstance(d, int | float) or not math.isfinite(d) or not 0 <= d <= MAX_DISTILL:
            raise ConfigError(f"distill: must be a number from 0 (off) to {MAX_DISTILL:g}, got {d!r}")
        if self.bn not in BN_MODES:
            raise ConfigError(f"bn: expected one of {', '.join(BN_MODES)}, got {self.bn!r}")
        if self.tail not in TAIL_MODES:
            raise ConfigError(f"tail: expected one of {', '.join(TAIL_MODES)}, got {self.tail!r}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def head_from_bundle(bundle: Any) -> tuple[str, dict[str, np.ndarray]]:
    """(symbol JSON, parameters by bare name) of a bundle's head, from its verified files.
    numpy only: no MXNet import."""
    from ..int8.bundle import HEAD_SYMBOL, bundle_params

    symbol_json = bundle.read(HEAD_SYMBOL).decode("utf-8")
    params, _ = bundle_params(bundle)  # every depth's: a deeper tail's job writes them all back
    return symbol_json, params


def linear_head(in_units: int, num_classes: int, *, input_name: str = "features", seed: int = 0
                ) -> tuple[str, dict[str, np.ndarray]]:
    """A flatten + dense head as (symbol JSON, parameters): a head for any Runner's features."""
    from ..int8.mxnet_import import mxnet

    mx = mxnet()

    data = mx.sym.var(input_name)
    out = mx.sym.FullyConnected(mx.sym.flatten(data), num_hidden=num_classes, name="fc")
    rng = np.random.default_rng(seed)
    limit = math.sqrt(6.0 / (in_units + num_classes))
    params = {"fc_weight": rng.uniform(-limit, limit, (num_classes, in_units)).astype(np.float32),
              "fc_bias": np.zeros(num_classes, np.float32)}
    return out.tojson(), params


def head_layers(symbol_json: str, param_names: set[str]) -> list[list[str]]:
    """Parameter names grouped by the op that uses them, in graph order."""
    try:
        nodes = json.loads(symbol_json)["nodes"]
    except (ValueError, KeyError, TypeError) as exc:
        raise InputError(f"head symbol: not MXNet symbol JSON ({exc})") from None
    layers: list[list[str]] = []
    for node in nodes:
        if node.get("op") == "null":
            continue
        names = [nodes[i[0]]["name"] for i in node.get("inputs", []) if nodes[i[0]].get("op") == "null"]
        names = [n for n in names if n in param_names]
        if names:
            layers.append(names)
    return layers


def select_trainable(symbol_json: str, weights: set[str], params: Mapping[str, np.ndarray],
                     config: TrainConfig) -> set[str]:
    """Which of the head's weights (its non-auxiliary parameters) train under `config`:
    all, the last `train_last` layers', or with tail="bias" the 1-D ones and the classifier's.
    Both head trainers use it, so they train the same tensors."""
    trainable = set(weights)
    layers = head_layers(symbol_json, trainable)
    if config.train_last is not None:
        trainable &= {n for layer in layers[-config.train_last:] for n in layer}
    if config.tail == "bias" and layers:  # TinyTL: biases need no stored input activations
        # the classifier: the last layer with a weight (an ONNX Gemm imports as a matrix
        # product and a separate bias add, so the last op alone may hold only the bias)
        weighted = [layer for layer in layers if any(np.ndim(params[n]) > 1 for n in layer)]
        trainable &= {n for n in trainable if np.ndim(params[n]) <= 1} | set(weighted[-1] if weighted else layers[-1])
    if not trainable:
        raise InputError("the head has no trainable parameters")
    return trainable


def class_weights(labels: np.ndarray, num_classes: int) -> np.ndarray:
    """n / (k * count_c) for the k classes present; 0 for absent ones."""
    counts = np.bincount(labels, minlength=num_classes).astype(np.float64)
    present = counts > 0
    weights = np.zeros(num_classes, np.float64)
    weights[present] = len(labels) / (present.sum() * counts[present])
    return weights.astype(np.float32)


class TrainerCommon:
    """What every head trainer shares: the batch order, evaluation, early stopping and its
    checkpointed record. Subclasses provide step / predict / params / set_params / state."""

    backend = ""

    def __init__(self, config: TrainConfig, num_classes: int, train_labels: np.ndarray | None) -> None:
        self.config = config
        self.num_classes = num_classes
        self.class_weight = (class_weights(train_labels, num_classes) if config.balance and train_labels is not None
                             else np.ones(num_classes, np.float32))
        self.best_loss = math.inf
        self.best_epoch = -1
        self.bad_epochs = 0
        self.best_params: dict[str, np.ndarray] | None = None

    def batch_order(self, n: int, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.config.seed, epoch]).permutation(n)

    def batches_per_epoch(self, n: int) -> int:
        return max(1, -(-n // self.config.batch_size))

    def batch_indices(self, n: int, epoch: int, batch: int) -> np.ndarray:
        bs = self.config.batch_size
        return self.batch_order(n, epoch)[batch * bs:(batch + 1) * bs]

    def step(self, x: np.ndarray, y: np.ndarray, teacher: np.ndarray | None = None) -> float:
        """One optimiser step on a batch; `teacher`: the bundle's own logits for it, which
        config.distill pulls towards. Returns the batch's mean loss."""
        raise NotImplementedError

    def gradients(self, x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def predict(self, x: np.ndarray, *, batch_size: int = 512) -> np.ndarray:
        raise NotImplementedError

    def params(self) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def set_params(self, params: Mapping[str, np.ndarray]) -> None:
        raise NotImplementedError

    def set_threads(self, threads: int) -> None:
        """CPU threads for the trainer's operators (the governor lowers it when hot or capped)."""

    def aux_names(self) -> set[str]:
        """Parameters that are running statistics, not weights (MXNet files mark them aux:)."""
        return set()

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        """(mean cross-entropy, accuracy) on a labelled set; (nan, nan) if it is empty."""
        if len(y) == 0:
            return math.nan, math.nan
        logits = self.predict(x).astype(np.float64)
        logits -= logits.max(axis=1, keepdims=True)
        log_p = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        loss = float(-log_p[np.arange(len(y)), y].mean())
        return loss, float((logits.argmax(axis=1) == y).mean())

    def end_epoch(self, epoch: int, val_loss: float) -> bool:
        """Record the epoch's validation loss; True when early stopping says stop."""
        if not math.isfinite(val_loss):  # no validation set: no early stopping
            return False
        margin = max(self.config.min_delta, self.config.min_rel_delta * abs(self.best_loss)
                     if math.isfinite(self.best_loss) else 0.0)
        if val_loss < self.best_loss - margin:
            self.best_loss, self.best_epoch, self.bad_epochs = val_loss, epoch, 0
            self.best_params = self.params()
            return False
        self.bad_epochs += 1
        return self.bad_epochs >= self.config.patience

    def restore_best(self) -> None:
        if self.best_params is not None:
            self.set_params(self.best_params)

    def _record_state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """The parts of state() every backend shares: parameters, best copy, stopping record."""
        arrays = {f"param/{k}": v for k, v in self.params().items()}
        if self.best_params is not None:
            arrays.update({f"best/{k}": v for k, v in self.best_params.items()})
        meta = {"backend": self.backend, "optimizer": self.config.optimizer,
                "best_loss": None if not math.isfinite(self.best_loss) else self.best_loss,
                "best_epoch": self.best_epoch, "bad_epochs": self.bad_epochs}
        return meta, arrays

    def _check_state(self, meta: Mapping[str, Any]) -> None:
        backend = meta.get("backend", "mxnet")  # checkpoints before there were two backends
        if backend != self.backend:
            raise InputError(f"checkpoint was written by the {backend!r} trainer, this job uses {self.backend!r} "
                             "(pass the same --trainer, or start afresh)")
        if meta.get("optimizer") != self.config.optimizer:
            raise InputError(f"checkpoint used optimizer {meta.get('optimizer')!r}, this job {self.config.optimizer!r}")

    def _load_record(self, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> None:
        self.set_params({k[6:]: v for k, v in arrays.items() if k.startswith("param/")})
        best = {k[5:]: v for k, v in arrays.items() if k.startswith("best/")}
        self.best_params = best or None
        best_loss = meta.get("best_loss")
        self.best_loss = math.inf if best_loss is None else float(best_loss)
        self.best_epoch = int(meta.get("best_epoch", -1))
        self.bad_epochs = int(meta.get("bad_epochs", 0))


class HeadTrainer(TrainerCommon):
    """Trains a head symbol on features with MXNet Gluon; all state exportable as arrays + JSON."""

    backend = "mxnet"

    def __init__(
        self,
        *,
        symbol_json: str,
        params: Mapping[str, np.ndarray],
        input_name: str,
        num_classes: int,
        config: TrainConfig,
        train_labels: np.ndarray | None = None,
        threads: int | None = None,
    ) -> None:
        from ..int8.mxnet_import import mxnet

        self.mx = mx = mxnet()
        gluon = mx.gluon
        super().__init__(config, num_classes, train_labels)
        if threads:
            self.set_threads(threads)
        if config.bn == "frozen":
            symbol_json = freeze_batchnorm(symbol_json)
        try:
            sym = mx.sym.load_json(symbol_json)
        except mx.base.MXNetError as exc:
            raise InputError(f"head symbol: cannot load ({str(exc).splitlines()[0][:200]})") from None
        with warnings.catch_warnings():  # "cannot decide type" for the input: it is float32
            warnings.simplefilter("ignore", UserWarning)
            self.block = gluon.SymbolBlock(sym, mx.sym.var(input_name))
        own = self.block.collect_params()
        missing = [name for name in own if name not in params]
        if missing:
            raise InputError(f"head parameters missing: {', '.join(missing[:8])}")
        for name, p in own.items():
            value = np.asarray(params[name], np.float32)
            if p.shape and tuple(p.shape) != value.shape and 0 not in p.shape:
                raise InputError(f"head parameter {name}: shape {value.shape}, symbol wants {p.shape}")
            p.shape = value.shape
            p._load_init(mx.nd.array(value), mx.cpu())  # noqa: SLF001 - SymbolBlock has no public setter
        self.param_names = list(own)
        weights = {name for name, p in own.items() if p.grad_req != "null"}
        self.layers = head_layers(symbol_json, weights)
        trainable = select_trainable(symbol_json, weights, params, config)
        for name in weights - trainable:
            own[name].grad_req = "null"
        self.trainable = [name for name in self.param_names if name in trainable]
        opt_params: dict[str, Any] = {"learning_rate": config.lr, "wd": config.weight_decay}
        if config.optimizer == "sgd":
            opt_params["momentum"] = config.momentum
        self._trainer = gluon.Trainer({n: own[n] for n in self.trainable}, config.optimizer, opt_params,
                                      kvstore=None)
        self._loss = gluon.loss.SoftmaxCrossEntropyLoss()

    # ------------------------------------------------------------------ training

    def set_threads(self, threads: int) -> None:
        """CPU threads for MXNet operators (the governor lowers it when hot or capped)."""
        import ctypes

        try:
            self.mx.base._LIB.MXSetNumOMPThreads(ctypes.c_int(max(1, int(threads))))  # noqa: SLF001
        except AttributeError:  # an MXNet build without the call: keep its default
            pass

    def step(self, x: np.ndarray, y: np.ndarray, teacher: np.ndarray | None = None) -> float:
        """One optimiser step on a batch; returns its mean (weighted) loss."""
        mx = self.mx
        data = mx.nd.array(np.ascontiguousarray(x, np.float32))
        label = mx.nd.array(y.astype(np.float32))
        weight = mx.nd.array(self.class_weight[y].reshape(-1, 1))
        distill, t = self.config.distill, DISTILL_TEMPERATURE
        with mx.autograd.record():
            out = self.block(data)
            loss = self._loss(out, label, weight)
            if teacher is not None and distill:  # dense_head.training_loss's, in Gluon
                loss = loss + distill * t * t * self._not_true_kl(out, y, teacher)
        loss.backward()
        self._trainer.step(len(y))
        value = float(loss.mean().asscalar())
        if not math.isfinite(value):
            raise FloatingPointError("training loss became non-finite; lower the learning rate")
        return value

    def _not_true_kl(self, out: Any, y: np.ndarray, teacher: np.ndarray) -> Any:
        """Per sample, KL(teacher || model) over the classes but the true one, on the samples
        the teacher answers right, else 0 (dense_head.training_loss)."""
        mx, t = self.mx, DISTILL_TEMPERATURE
        log_q, q, right = not_true_teacher(teacher, y)
        q_log_q = (q * np.where(np.isfinite(log_q), log_q, 0.0)).sum(axis=1)
        true = np.isneginf(log_q).astype(np.float32)
        log_p = mx.nd.log_softmax(out / t - mx.nd.array(true) * 1e9)  # the true class left out
        cross = (mx.nd.array(q.astype(np.float32)) * log_p).sum(axis=1)
        return (mx.nd.array(q_log_q.astype(np.float32)) - cross) * mx.nd.array(right)

    def gradients(self, x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
        """d(mean loss)/d(trained parameter) on a batch, at the current parameters (no step)."""
        mx = self.mx
        data = mx.nd.array(np.ascontiguousarray(x, np.float32))
        label = mx.nd.array(y.astype(np.float32))
        weight = mx.nd.array(self.class_weight[y].reshape(-1, 1))
        with mx.autograd.record(train_mode=False):
            loss = self._loss(self.block(data), label, weight)
        loss.backward()
        own = self.block.collect_params()
        return {n: own[n].grad().asnumpy() / len(y) for n in self.trainable}

    def predict(self, x: np.ndarray, *, batch_size: int = 512) -> np.ndarray:
        mx = self.mx
        outs = [self.block(mx.nd.array(np.ascontiguousarray(x[i:i + batch_size], np.float32))).asnumpy()
                for i in range(0, len(x), batch_size)]
        return np.concatenate(outs) if outs else np.empty((0, self.num_classes), np.float32)

    # ------------------------------------------------------------------ state

    def params(self) -> dict[str, np.ndarray]:
        return {name: p.data().asnumpy().copy() for name, p in self.block.collect_params().items()}

    def set_params(self, params: Mapping[str, np.ndarray]) -> None:
        for name, p in self.block.collect_params().items():
            value = np.asarray(params[name], np.float32)
            if tuple(value.shape) != tuple(p.shape):
                raise InputError(f"parameter {name}: shape {value.shape}, head has {p.shape}")
            p.set_data(self.mx.nd.array(value))

    def aux_names(self) -> set[str]:
        return {n for n, p in self.block.collect_params().items() if p.grad_req == "null"
                and n.endswith(("running_mean", "running_var", "moving_mean", "moving_var"))}

    def signature(self) -> str:
        """Names and shapes of the head's parameters: a checkpoint must match them."""
        return ";".join(f"{n}:{'x'.join(map(str, p.shape))}" for n, p in self.block.collect_params().items())

    def _updater(self) -> Any:
        return self._trainer._updaters[0]  # noqa: SLF001 - MXNet 1.9 (final) internals

    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """(JSON-able metadata, arrays): everything needed to continue exactly."""
        meta, arrays = self._record_state()
        updater = self._updater()
        opt = updater.optimizer
        layout: dict[str, int] = {}
        for index, state in updater.states.items():
            parts = state if isinstance(state, tuple | list) else (state,)
            layout[str(index)] = len([s for s in parts if s is not None])
            for j, part in enumerate(s for s in parts if s is not None):
                arrays[f"opt/{index}/{j}"] = part.asnumpy()
        meta.update({
            "opt_layout": layout,
            "opt_counts": {str(k): int(v) for k, v in opt._index_update_count.items()},  # noqa: SLF001
            "opt_num_update": int(opt.num_update),
            "signature": self.signature(),
        })
        return meta, arrays

    def load_state(self, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> None:
        """Inverse of `state()`; InputError if it does not fit this head and optimiser."""
        mx = self.mx
        if meta.get("signature") != self.signature():
            raise InputError("checkpoint is for a head with other parameters")
        self._check_state(meta)
        try:
            self._load_record(meta, arrays)
            updater = self._updater()
            opt = updater.optimizer
            updater.states.clear()
            updater.states_synced.clear()
            for index_text, count in dict(meta["opt_layout"]).items():
                index = int(index_text)
                parts = [mx.nd.array(arrays[f"opt/{index}/{j}"]) for j in range(int(count))]
                updater.states[index] = parts[0] if len(parts) == 1 else tuple(parts)
                updater.states_synced[index] = True
            counts = opt._index_update_count  # noqa: SLF001 - shared with _all_index_update_counts[0]
            counts.clear()
            counts.update({int(k): int(v) for k, v in dict(meta["opt_counts"]).items()})
            opt.num_update = int(meta["opt_num_update"])
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"checkpoint state does not fit this trainer ({type(exc).__name__}: {exc})") from None
