"""A one-dense-layer head trained in numpy, step for step what Gluon does.

Most bundles' heads are a single affine layer on the backbone's features (MobileNet's
classifier). Training that with MXNet costs the training child MXNet's import -- measured
~1.9 CPU-s and ~130 MB, more than the int8 feature pass and the whole head training
together on a device's few hundred samples -- for a (K x D) matrix and a bias. So when the
head's MXNet symbol is recognisably one affine layer, `make_head_trainer` trains it here
with the same mathematics as `HeadTrainer` (Gluon `SoftmaxCrossEntropyLoss` with sample
weights, `Trainer.step(batch)` rescaling, MXNet 1.9's Adam and SGD-momentum updates with
weight decay on every parameter), in float32; tests check the two agree step by step. Any
other head -- several layers, BatchNorm, `train_last` over backbone layers -- trains with
MXNet Gluon.

Two symbol forms are recognised (everything else is refused here):
- `FullyConnected(Flatten*(x), W, b)` (flatten=True, a bias), as Gluon's `Dense` exports;
- the ONNX importer's Gemm: `broadcast_add(_linalg_gemm2(Flatten*(x), W, transpose_b=1,
  alpha=a), _mul_scalar(b, s))` -- what this project's bundles hold.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ConfigError, InputError
from .trainer import HeadTrainer, TrainConfig, TrainerCommon

BACKENDS = ("auto", "numpy", "mxnet")
ADAM_BETA1, ADAM_BETA2, ADAM_EPSILON = 0.9, 0.999, 1e-8  # MXNet 1.9 Adam defaults
_FLATTEN_OPS = ("Flatten", "flatten")


@dataclass(frozen=True)
class DenseForm:
    """out = flatten(x) @ weight.T * alpha + bias * bias_scale"""

    weight: str
    bias: str
    alpha: float = 1.0
    bias_scale: float = 1.0


def _flag(value: Any, default: bool) -> bool:
    return default if value is None else str(value).strip().lower() in ("1", "true")


def dense_head_form(symbol_json: str, input_name: str) -> DenseForm | None:
    """The affine layer a head symbol computes, or None if it is anything else."""
    try:
        graph = json.loads(symbol_json)
        nodes, heads = graph["nodes"], graph["heads"]
        if len(heads) != 1:
            return None

        def node(ref: list[int]) -> dict[str, Any]:
            return nodes[ref[0]]

        def through_flatten(ref: list[int]) -> dict[str, Any]:
            n = node(ref)
            while n["op"] in _FLATTEN_OPS:
                n = node(n["inputs"][0])
            return n

        def variable(ref: list[int]) -> str | None:
            n = node(ref)
            return n["name"] if n["op"] == "null" else None

        out = node(heads[0])
        attrs = out.get("attrs") or {}
        if out["op"] == "FullyConnected":
            if _flag(attrs.get("no_bias"), False) or not _flag(attrs.get("flatten"), True) or len(out["inputs"]) != 3:
                return None
            x, w, b = out["inputs"]
            if through_flatten(x) != _input(nodes, input_name) or not variable(w) or not variable(b):
                return None
            return DenseForm(variable(w), variable(b))  # type: ignore[arg-type]
        if out["op"] in ("broadcast_add", "elemwise_add", "_plus", "_Plus") and len(out["inputs"]) == 2:
            gemm, bias = (node(r) for r in out["inputs"])
            if gemm["op"] != "_linalg_gemm2":
                gemm, bias = bias, gemm
            g_attrs, b_attrs = gemm.get("attrs") or {}, bias.get("attrs") or {}
            if (gemm["op"] != "_linalg_gemm2" or _flag(g_attrs.get("transpose_a"), False)
                    or not _flag(g_attrs.get("transpose_b"), False) or len(gemm["inputs"]) != 2):
                return None
            x, w = gemm["inputs"]
            if through_flatten(x) != _input(nodes, input_name) or not variable(w):
                return None
            scale = 1.0
            if bias["op"] == "_mul_scalar":
                scale = float(b_attrs.get("scalar", 1.0))
                bias = node(bias["inputs"][0])
            if bias["op"] != "null":
                return None
            return DenseForm(variable(w), bias["name"], float(g_attrs.get("alpha", 1.0)), scale)  # type: ignore[arg-type]
    except (ValueError, KeyError, TypeError, IndexError):
        return None
    return None


def _input(nodes: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    return next((n for n in nodes if n["op"] == "null" and n["name"] == name), None)


def _affine(form: DenseForm, weight: np.ndarray, bias: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The head's logits: flatten(x) @ weight.T * alpha + bias * bias_scale, in float32."""
    x2 = np.ascontiguousarray(x, np.float32).reshape(len(x), -1)
    return (x2 @ weight.T) * np.float32(form.alpha) + bias * np.float32(form.bias_scale)


class DenseHeadTrainer(TrainerCommon):
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

    def step(self, x: np.ndarray, y: np.ndarray) -> float:
        """One optimiser step on a batch; returns its mean (weighted) loss."""
        f, cfg = self.form, self.config
        x2 = np.ascontiguousarray(x, np.float32).reshape(len(x), -1)
        if x2.shape[1] != self._w[f.weight].shape[1]:
            raise InputError(f"features have {x2.shape[1]} values, the head takes {self._w[f.weight].shape[1]}")
        logits = self._logits(x2)
        shifted = logits - logits.max(axis=1, keepdims=True)
        log_p = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        sample_w = self.class_weight[y].astype(np.float32)
        rows = np.arange(len(y))
        value = float((-log_p[rows, y] * sample_w).mean())
        if not math.isfinite(value):
            raise FloatingPointError("training loss became non-finite; lower the learning rate")
        # d(sum of weighted losses)/d logits, rescaled by 1/batch as Trainer.step(batch) does
        g = np.exp(log_p)
        g[rows, y] -= 1.0
        g *= (sample_w / np.float32(len(y)))[:, None]
        grads = {f.weight: (g.T @ x2) * np.float32(f.alpha), f.bias: g.sum(axis=0) * np.float32(f.bias_scale)}
        self._t += 1
        lr, wd = np.float32(cfg.lr), np.float32(cfg.weight_decay)
        for name, grad in grads.items():
            w, m = self._w[name], self._m[name]
            grad = grad.astype(np.float32) + wd * w
            if cfg.optimizer == "adam":
                v = self._v[name]
                m *= np.float32(ADAM_BETA1)
                m += np.float32(1 - ADAM_BETA1) * grad
                v *= np.float32(ADAM_BETA2)
                v += np.float32(1 - ADAM_BETA2) * grad * grad
                lr_t = np.float32(cfg.lr * math.sqrt(1 - ADAM_BETA2 ** self._t) / (1 - ADAM_BETA1 ** self._t))
                w -= lr_t * m / (np.sqrt(v) + np.float32(ADAM_EPSILON))
            else:  # MXNet sgd_mom_update: mom = momentum * mom - lr * (grad + wd * w); w += mom
                m *= np.float32(cfg.momentum)
                m -= lr * grad
                w += m
        return value

    def predict(self, x: np.ndarray, *, batch_size: int = 512) -> np.ndarray:
        outs = [self._logits(x[i:i + batch_size]) for i in range(0, len(x), batch_size)]
        return np.concatenate(outs) if outs else np.empty((0, self.num_classes), np.float32)

    def params(self) -> dict[str, np.ndarray]:
        return {n: v.copy() for n, v in self._w.items()}

    def set_params(self, params: Mapping[str, np.ndarray]) -> None:
        for name, current in self._w.items():
            value = np.asarray(params[name], np.float32)
            if value.shape != current.shape:
                raise InputError(f"parameter {name}: shape {value.shape}, head has {current.shape}")
            self._w[name] = value.copy()

    def signature(self) -> str:
        return ";".join(f"{n}:{'x'.join(map(str, v.shape))}" for n, v in self._w.items())

    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        meta, arrays = self._record_state()
        for name in self._w:
            arrays[f"opt/{name}/m"] = self._m[name].copy()
            arrays[f"opt/{name}/v"] = self._v[name].copy()
        meta.update({"opt_t": self._t, "signature": self.signature()})
        return meta, arrays

    def load_state(self, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> None:
        if meta.get("signature") != self.signature():
            raise InputError("checkpoint is for a head with other parameters")
        self._check_state(meta)
        try:
            self._load_record(meta, arrays)
            for name, w in self._w.items():
                m, v = (np.asarray(arrays[f"opt/{name}/{k}"], np.float32) for k in ("m", "v"))
                if m.shape != w.shape or v.shape != w.shape:
                    raise ValueError(f"optimiser state for {name} has shape {m.shape} / {v.shape}")
                self._m[name], self._v[name] = m.copy(), v.copy()
            self._t = int(meta["opt_t"])
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"checkpoint state does not fit this trainer ({type(exc).__name__}: {exc})") from None


def make_head_trainer(*, symbol_json: str, params: Mapping[str, np.ndarray], input_name: str, num_classes: int,
                      config: TrainConfig, train_labels: np.ndarray | None = None, threads: int | None = None,
                      backend: str = "auto") -> TrainerCommon:
    """The head's trainer: numpy for one affine layer (unless backend="mxnet"), else MXNet Gluon."""
    if backend not in BACKENDS:
        raise ConfigError(f"trainer: expected one of {', '.join(BACKENDS)}, got {backend!r}")
    form = dense_head_form(symbol_json, input_name) if backend != "mxnet" else None
    if form is not None:
        return DenseHeadTrainer(form=form, params=params, num_classes=num_classes, config=config,
                                train_labels=train_labels)
    if backend == "numpy":
        raise ConfigError("trainer 'numpy' trains only a one-dense-layer head; this head needs 'mxnet' (or 'auto')")
    return HeadTrainer(symbol_json=symbol_json, params=params, input_name=input_name, num_classes=num_classes,
                       config=config, train_labels=train_labels, threads=threads)


def dense_head_logits(bundle: Any) -> Any:
    """A numpy logits function for the bundle's head if it is one dense layer, else None
    (the engine selection's top-1 check then needs no MXNet either)."""
    from .trainer import head_from_bundle

    symbol_json, params = head_from_bundle(bundle)
    form = dense_head_form(symbol_json, bundle.manifest.split_tensor)
    if form is None or form.weight not in params or form.bias not in params:
        return None
    weight, bias = np.asarray(params[form.weight], np.float32), np.asarray(params[form.bias], np.float32)

    return lambda features: _affine(form, weight, bias.reshape(-1), features)
