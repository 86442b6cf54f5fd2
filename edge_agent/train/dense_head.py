"""The numpy trainers: a one-dense-layer head, and a deeper tail of the ops numpy_tail.py
computes -- step for step what Gluon does, without MXNet.

Most bundles' heads are a single affine layer on the backbone's features (MobileNet's
classifier). Training that with MXNet costs the training child MXNet's import -- measured
~1.9 CPU-s and ~130 MB, more than the int8 feature pass and the whole head training
together on a device's few hundred samples -- for a (K x D) matrix and a bias. A deeper
tail (the last blocks of MobileNetV2 + its 1x1 conv + head: a few million MACs per sample)
costs less to train than MXNet costs to load, too. So `make_head_trainer` trains in numpy
whenever it can, with the same mathematics as `HeadTrainer`: Gluon `SoftmaxCrossEntropyLoss`
with sample weights, `Trainer.step(batch)` rescaling, MXNet 1.9's Adam and SGD-momentum
updates with weight decay on every trained parameter, the same trainable set
(trainer.select_trainable: train_last, tail="bias"), in float32; tests check the two agree
step by step. Anything else trains with MXNet Gluon.

Two dense symbol forms are recognised (DenseHeadTrainer):
- `FullyConnected(Flatten*(x), W, b)` (flatten=True, a bias), as Gluon's `Dense` exports;
- the ONNX importer's Gemm: `broadcast_add(_linalg_gemm2(Flatten*(x), W, transpose_b=1,
  alpha=a), _mul_scalar(b, s))` -- what this project's bundles hold.
Any other head goes to NumpyTailTrainer when numpy_tail computes all of it on the job's
input shape (checked at construction, so an unfit tail never fails mid-training).

Both are deterministic, so a checkpointed run resumes bit for bit. The tail's products run
on one BLAS thread (BLAS_THREADS): the budget is energy, and at these sizes more threads
spend more CPU-seconds, not fewer.
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from ..errors import ConfigError, InputError
from ..int8.head_form import DenseForm, _affine, dense_head_form
from .numpy_tail import AUX_SUFFIXES, TailProgram, UnsupportedTail
from .trainer import (
    DISTILL_TEMPERATURE,
    HeadTrainer,
    TrainConfig,
    TrainerCommon,
    freeze_batchnorm,
    not_true_teacher,
    select_trainable,
)

BACKENDS = ("auto", "numpy", "mxnet")
ADAM_BETA1, ADAM_BETA2, ADAM_EPSILON = 0.9, 0.999, 1e-8  # MXNet 1.9 Adam defaults


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Per row, log of the softmax of (N, classes) logits, shifted by the row's maximum so
    that large logits cannot overflow."""
    shifted = logits - logits.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def softmax_loss(logits: np.ndarray, y: np.ndarray, class_weight: np.ndarray) -> tuple[float, np.ndarray]:
    """(mean weighted cross-entropy, its gradient d(sum of weighted losses)/d logits rescaled
    by 1/batch as Gluon's Trainer.step(batch) does)."""
    log_p = log_softmax(logits)
    sample_w = class_weight[y].astype(np.float32)
    rows = np.arange(len(y))
    value = float((-log_p[rows, y] * sample_w).mean())
    if not math.isfinite(value):
        raise FloatingPointError("training loss became non-finite; lower the learning rate")
    g = np.exp(log_p)
    g[rows, y] -= 1.0
    g *= (sample_w / np.float32(len(y)))[:, None]
    return value, g


def training_loss(logits: np.ndarray, y: np.ndarray, class_weight: np.ndarray, teacher: np.ndarray | None,
                  distill: float) -> tuple[float, np.ndarray]:
    """softmax_loss, plus -- given the bundle's own logits for the batch (`teacher`) and a
    weight `distill` > 0 -- not-true distillation (FedNTD, Lee et al. 2022): on each sample
    the bundle's tail answers right, KL(teacher || model) over the classes other than the
    true one, at temperature DISTILL_TEMPERATURE. A device's data is label-skewed; the pull
    keeps what the bundle knew of the classes it seldom sees, and leaves the true class (and
    the samples the bundle gets wrong: its camera's) free to learn. Camera digits, depth 4,
    2 seeds: held-out accuracy 0.694 -> 0.745 (weight 3; distilling every class and sample,
    LwF, raised the device the bundle knew best and cost the two it knew worst 8-12 points).
    Returns (mean loss, d loss / d logits rescaled by 1/batch)."""
    value, g = softmax_loss(logits, y, class_weight)
    if teacher is None or not distill:
        return value, g
    t = DISTILL_TEMPERATURE
    log_q, q, right = not_true_teacher(teacher, y)
    other = np.isfinite(log_q)
    zs = np.asarray(logits, np.float64) / t
    zs[~other] = -np.inf  # the true class takes no part
    log_p = log_softmax(zs)
    kl = (q * (np.where(other, log_q, 0.0) - np.where(other, log_p, 0.0))).sum(axis=1)
    value += float(distill) * t * t * float((kl * right).mean())
    g_kd = (np.exp(log_p) - q) * right[:, None] * (float(distill) * t / len(y))  # d(weight T^2 KL)/d logits
    return value, (g + g_kd).astype(np.float32)


def optimizer_update(cfg: TrainConfig, t: int, weights: Mapping[str, np.ndarray], m: Mapping[str, np.ndarray],
                     v: Mapping[str, np.ndarray], grads: Mapping[str, np.ndarray]) -> None:
    """MXNet 1.9's update of each parameter in `grads`, in place, at update count t (every
    trained parameter moves on every step, so one count serves all): Adam, or SGD with
    momentum, weight decay added to the (already batch-rescaled) gradient."""
    lr, wd = np.float32(cfg.lr), np.float32(cfg.weight_decay)
    for name, grad in grads.items():
        w, mean = weights[name], m[name]
        g = np.multiply(w, wd)  # in place from here: a deep tail's update is otherwise mostly allocation
        g += grad
        tmp = np.empty_like(g)
        if cfg.optimizer == "adam":
            var = v[name]
            mean *= np.float32(ADAM_BETA1)
            mean += np.multiply(g, np.float32(1 - ADAM_BETA1), out=tmp)
            var *= np.float32(ADAM_BETA2)
            np.multiply(g, np.float32(1 - ADAM_BETA2), out=tmp)
            tmp *= g
            var += tmp
            lr_t = np.float32(cfg.lr * math.sqrt(1 - ADAM_BETA2 ** t) / (1 - ADAM_BETA1 ** t))
            np.sqrt(var, out=tmp)
            tmp += np.float32(ADAM_EPSILON)
            np.multiply(mean, lr_t, out=g)
            g /= tmp
            w -= g
        else:  # MXNet sgd_mom_update: mom = momentum * mom - lr * (grad + wd * w); w += mom
            mean *= np.float32(cfg.momentum)
            mean -= np.multiply(g, lr, out=tmp)
            w += mean


class NumpyOptimiserState:
    """Checkpoint state shared by the numpy trainers: weights `_w`, Adam mean (SGD momentum)
    `_m` and variance `_v` per trained name (restored in place), the update count `_t`.
    `STATE_TAG` marks whose checkpoint it is (a numpy tail's is not an MXNet tail's)."""

    STATE_TAG: dict[str, str] = {}
    _w: dict[str, np.ndarray]
    _m: dict[str, np.ndarray]
    _v: dict[str, np.ndarray]
    _t: int
    _record_state: Any  # TrainerCommon's
    _check_state: Any
    _load_record: Any

    def _optimised(self) -> Iterable[str]:
        return self._w

    def params(self) -> dict[str, np.ndarray]:
        return {n: v.copy() for n, v in self._w.items()}

    def signature(self) -> str:
        """Names and shapes of the parameters, in HeadTrainer's order and format."""
        return ";".join(f"{n}:{'x'.join(map(str, v.shape))}" for n, v in self._w.items())

    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        meta, arrays = self._record_state()
        for name in self._optimised():
            arrays[f"opt/{name}/m"] = self._m[name].copy()
            arrays[f"opt/{name}/v"] = self._v[name].copy()
        meta.update({"opt_t": self._t, "signature": self.signature(), **self.STATE_TAG})
        return meta, arrays

    def load_state(self, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> None:
        if meta.get("signature") != self.signature() or any(meta.get(k) != v for k, v in self.STATE_TAG.items()):
            raise InputError("checkpoint is for a head with other parameters")
        self._check_state(meta)
        try:
            self._load_record(meta, arrays)
            for name in self._optimised():
                m, v = (np.asarray(arrays[f"opt/{name}/{k}"], np.float32) for k in ("m", "v"))
                if m.shape != self._w[name].shape or v.shape != self._w[name].shape:
                    raise ValueError(f"optimiser state for {name} has shape {m.shape} / {v.shape}")
                self._m[name][...], self._v[name][...] = m, v
            self._t = int(meta["opt_t"])
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"checkpoint state does not fit this trainer ({type(exc).__name__}: {exc})") from None


class DenseHeadTrainer(NumpyOptimiserState, TrainerCommon):
    """`HeadTrainer`'s interface and numbers for a one-affine-layer head, numpy only."""

    backend = "numpy"

    def __init__(self, *, form: DenseForm, params: Mapping[str, np.ndarray], num_classes: int,
                 config: TrainConfig, train_labels: np.ndarray | None = None) -> None:
        super().__init__(config, num_classes, train_labels)
        self.form = form
        missing = [n for n in (form.weight, form.bias) if n not in params]
        if missing:
            raise InputError(f"head parameters missing: {', '.join(missing)}")
        weight = np.array(params[form.weight], np.float32)
        bias = np.array(params[form.bias], np.float32).reshape(-1)
        if weight.ndim != 2 or weight.shape[0] != num_classes or bias.shape != (num_classes,):
            raise InputError(f"head parameters {form.weight} {weight.shape} / {form.bias} {bias.shape} do not make "
                             f"a {num_classes}-class dense layer")
        self._w = {form.weight: weight, form.bias: bias}
        self._m = {n: np.zeros_like(v) for n, v in self._w.items()}  # Adam mean / SGD momentum
        self._v = {n: np.zeros_like(v) for n, v in self._w.items()}  # Adam variance
        self._t = 0  # updates so far (MXNet counts per parameter; here they always move together)

    def _logits(self, x: np.ndarray) -> np.ndarray:
        return _affine(self.form, self._w[self.form.weight], self._w[self.form.bias], x)

    def _loss_grads(self, x: np.ndarray, y: np.ndarray, teacher: np.ndarray | None = None
                    ) -> tuple[float, dict[str, np.ndarray]]:
        f = self.form
        x2 = np.ascontiguousarray(x, np.float32).reshape(len(x), -1)
        if x2.shape[1] != self._w[f.weight].shape[1]:
            raise InputError(f"features have {x2.shape[1]} values, the head takes {self._w[f.weight].shape[1]}")
        value, g = training_loss(self._logits(x2), y, self.class_weight, teacher, self.config.distill)
        return value, {f.weight: (g.T @ x2) * np.float32(f.alpha), f.bias: g.sum(axis=0) * np.float32(f.bias_scale)}

    def step(self, x: np.ndarray, y: np.ndarray, teacher: np.ndarray | None = None) -> float:
        """One optimiser step on a batch; returns its mean (weighted) loss."""
        value, grads = self._loss_grads(x, y, teacher)
        self._t += 1
        optimizer_update(self.config, self._t, self._w, self._m, self._v, grads)
        return value

    def gradients(self, x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
        """d(mean loss)/d(trained parameter) on a batch, at the current parameters (no step)."""
        return self._loss_grads(x, y)[1]

    def predict(self, x: np.ndarray, *, batch_size: int = 512) -> np.ndarray:
        outs = [self._logits(x[i:i + batch_size]) for i in range(0, len(x), batch_size)]
        return np.concatenate(outs) if outs else np.empty((0, self.num_classes), np.float32)

    def set_params(self, params: Mapping[str, np.ndarray]) -> None:
        for name, current in self._w.items():
            value = np.asarray(params[name], np.float32)
            if value.shape != current.shape:
                raise InputError(f"parameter {name}: shape {value.shape}, head has {current.shape}")
            self._w[name] = value.copy()


# A tail step's products are a few tens of MMACs: OpenBLAS's threads then cost more CPU
# (energy) in hand-offs and spin-waits than they save -- measured on the loaded 2-core
# bench machine, 27 CPU-ms per depth-2 step on 2 threads, 18 on one.
BLAS_THREADS = 1


@functools.lru_cache(maxsize=4)  # once per process and count: reading /proc/self/maps costs ~3 ms a trainer
def blas_threads(n: int) -> bool:
    """Set the thread count of the OpenBLAS numpy uses (its wheels bundle one); False if
    none is found. Results do not depend on it: OpenBLAS splits a product by rows and
    columns, never along its sums."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "openblas" in line.lower() and "/" in line}
    except OSError:
        return False
    done = False
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for symbol in ("openblas_set_num_threads64_", "openblas_set_num_threads"):
            setter = getattr(lib, symbol, None)
            if setter is not None:
                setter(ctypes.c_int(n))
                done = True
                break
    return done


class NumpyTailTrainer(NumpyOptimiserState, TrainerCommon):
    """`HeadTrainer`'s interface and numbers for a tail numpy_tail computes. The trained
    tensors (and their gradients and optimiser moments) are views of one flat buffer: the
    update is a dozen passes over one array, not a dozen per tensor."""

    backend = "numpy"

    def __init__(self, *, symbol_json: str, params: Mapping[str, np.ndarray], input_name: str, num_classes: int,
                 config: TrainConfig, train_labels: np.ndarray | None = None,
                 input_shape: tuple[int, ...] | None = None) -> None:
        super().__init__(config, num_classes, train_labels)
        if config.bn == "frozen":
            symbol_json = freeze_batchnorm(symbol_json)
        self.program = prog = TailProgram(symbol_json, input_name)
        names = prog.arg_names + prog.aux_names
        missing = [n for n in names if n not in params]
        if missing:
            raise InputError(f"head parameters missing: {', '.join(missing[:8])}")
        trainable = select_trainable(symbol_json, set(prog.arg_names), params, config)
        prog.set_trainable(trainable)
        self.trainable = [n for n in names if n in trainable]
        sizes = [int(np.size(params[n])) for n in self.trainable]
        self._flat = {k: np.zeros(sum(sizes), np.float32) for k in ("w", "g", "m", "v")}
        self._views: dict[str, dict[str, np.ndarray]] = {k: {} for k in self._flat}
        offset = 0
        for name, size in zip(self.trainable, sizes, strict=True):
            for k, flat in self._flat.items():
                self._views[k][name] = flat[offset:offset + size].reshape(np.shape(params[name]))
            offset += size
        self._w = {n: self._views["w"][n] if n in trainable else np.array(params[n], np.float32) for n in names}
        self.set_params(params)
        self._m, self._v = self._views["m"], self._views["v"]  # Adam mean (SGD momentum) / Adam variance
        self._t = 0
        blas_threads(BLAS_THREADS)
        if input_shape is not None:  # shapes are checked now, so an unfit tail goes to MXNet at once
            out = self.predict(np.zeros((2, *input_shape), np.float32))
            if out.shape[1] != num_classes:
                raise UnsupportedTail(f"the tail gives {out.shape[1]} outputs, the model has {num_classes} classes")

    def gradients(self, x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
        """d(mean loss)/d(trained parameter) on a batch, at the current parameters (no step,
        moving statistics untouched)."""
        logits, values, caches = self.program.forward(self._w, x, train=True)
        _, g = softmax_loss(logits, y, self.class_weight)
        return self.program.backward(values, caches, g.astype(np.float32))

    def step(self, x: np.ndarray, y: np.ndarray, teacher: np.ndarray | None = None) -> float:
        """One optimiser step on a batch; returns its mean (weighted) loss."""
        logits, values, caches = self.program.forward(self._w, x, train=True)
        value, g = training_loss(logits, y, self.class_weight, teacher, self.config.distill)
        grads = self.program.backward(values, caches, g.astype(np.float32))
        self.program.update_statistics(self._w, caches)
        flat_g = self._flat["g"]
        flat_g[:] = 0
        for name, grad in grads.items():
            self._views["g"][name][...] = grad
        self._t += 1
        flat = self._flat
        optimizer_update(self.config, self._t, {"": flat["w"]}, {"": flat["m"]}, {"": flat["v"]}, {"": flat_g})
        return value

    def predict(self, x: np.ndarray, *, batch_size: int = 512) -> np.ndarray:
        outs = [self.program.forward(self._w, x[i:i + batch_size], train=False)[0]
                for i in range(0, len(x), batch_size)]
        return np.concatenate(outs) if outs else np.empty((0, self.num_classes), np.float32)

    def set_threads(self, threads: int) -> None:
        """The governor's thread advice: the tail already runs on one BLAS thread (module doc),
        the least it can be lowered to."""

    def set_params(self, params: Mapping[str, np.ndarray]) -> None:
        for name, current in self._w.items():
            value = np.asarray(params[name], np.float32)
            if value.shape != current.shape:
                raise InputError(f"parameter {name}: shape {value.shape}, head has {current.shape}")
            if name in self.program.trainable:
                current[...] = value  # a view of the flat buffer
            else:
                self._w[name] = value.copy()

    def aux_names(self) -> set[str]:
        return {n for n in self.program.aux_names if n.endswith(AUX_SUFFIXES)}

    STATE_TAG = {"tail": "numpy"}

    def _optimised(self) -> Iterable[str]:
        return self.trainable


def make_head_trainer(*, symbol_json: str, params: Mapping[str, np.ndarray], input_name: str, num_classes: int,
                      config: TrainConfig, train_labels: np.ndarray | None = None, threads: int | None = None,
                      backend: str = "auto", input_shape: tuple[int, ...] | None = None) -> TrainerCommon:
    """The head's trainer. numpy unless backend="mxnet": one affine layer here; given the
    input's shape (per sample), a tail of the ops numpy_tail computes, checked on that shape
    at construction so that no unfit tail fails mid-training; anything else MXNet Gluon."""
    if backend not in BACKENDS:
        raise ConfigError(f"trainer: expected one of {', '.join(BACKENDS)}, got {backend!r}")
    form = dense_head_form(symbol_json, input_name) if backend != "mxnet" else None
    if form is not None:
        return DenseHeadTrainer(form=form, params=params, num_classes=num_classes, config=config,
                                train_labels=train_labels)
    why = "no input shape to check a deeper tail on"
    if backend != "mxnet" and input_shape is not None:
        try:
            trainer = NumpyTailTrainer(symbol_json=symbol_json, params=params, input_name=input_name,
                                       num_classes=num_classes, config=config, train_labels=train_labels,
                                       input_shape=input_shape)
        except UnsupportedTail as exc:
            why = str(exc)
        else:
            if threads:
                trainer.set_threads(threads)
            return trainer
    if backend == "numpy":
        raise ConfigError(f"trainer 'numpy' trains a one-dense-layer head, or a tail of the ops numpy_tail "
                          f"computes ({why}); this head needs 'mxnet' (or 'auto')")
    return HeadTrainer(symbol_json=symbol_json, params=params, input_name=input_name, num_classes=num_classes,
                       config=config, train_labels=train_labels, threads=threads)


def numpy_head_logits(bundle: Any) -> Any:
    """A numpy logits function for the bundle's head at its depth -- one dense layer, or a
    tail of the ops numpy_tail computes (predicting: BatchNorm on its stored statistics) --
    else None (MXNet computes it). The engine selection's top-1 check then needs no MXNet,
    which a 32-bit device does not have."""
    from .trainer import head_from_bundle

    symbol_json, params = head_from_bundle(bundle)
    form = dense_head_form(symbol_json, bundle.manifest.split_tensor)
    if form is not None:
        if form.weight not in params or form.bias not in params:
            return None
        weight, bias = np.asarray(params[form.weight], np.float32), np.asarray(params[form.bias], np.float32)
        return lambda features: _affine(form, weight, bias.reshape(-1), features)
    try:
        program = TailProgram(symbol_json, bundle.manifest.split_tensor)
    except UnsupportedTail:
        return None
    weights = {name: np.asarray(params[name], np.float32) for name in (*program.arg_names, *program.aux_names)
               if name in params}
    if len(weights) != len(program.arg_names) + len(program.aux_names):
        return None
    return lambda features: program.forward(weights, features, train=False)[0]
