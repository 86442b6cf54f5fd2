"""A head symbol read as the affine layer it computes, when it is one: most bundles' heads
are a single dense layer on the backbone's features (MobileNet's classifier), which numpy
evaluates (and train/dense_head.py trains) without MXNet. In the int8 floor because engine
selection's agreement check, the inference path and the trainers all read heads this way.

Two dense symbol forms are recognised:
- `FullyConnected(Flatten*(x), W, b)` (flatten=True, a bias), as Gluon's `Dense` exports
  and as tail_import.py writes a bundle's Gemm / MatMul + bias;
- mxnet.contrib.onnx's Gemm: `broadcast_add(_linalg_gemm2(Flatten*(x), W, transpose_b=1,
  alpha=a), _mul_scalar(b, s))` -- what bundles built before issue 41 hold.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

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



def dense_head_logits(bundle: Any) -> Any:
    """A numpy logits function for the bundle's head if it is one dense layer, else None
    (the engine selection's top-1 check then needs no MXNet either)."""
    from .bundle import HEAD_SYMBOL, bundle_params

    symbol_json, params = bundle.read(HEAD_SYMBOL).decode("utf-8"), bundle_params(bundle)[0]
    form = dense_head_form(symbol_json, bundle.manifest.split_tensor)
    if form is None or form.weight not in params or form.bias not in params:
        return None
    weight, bias = np.asarray(params[form.weight], np.float32), np.asarray(params[form.bias], np.float32)

    return lambda features: _affine(form, weight, bias.reshape(-1), features)
