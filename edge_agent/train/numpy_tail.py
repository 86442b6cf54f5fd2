"""A small fp32 tail's MXNet symbol (the last blocks of a CNN + its head) run forward and
backward in numpy, so that dense_head.NumpyTailTrainer trains it without MXNet.

Training a MobileNetV2 tail over cached int8 activations is a few million MACs per sample;
on a device's few hundred samples MXNet's import alone (~2 CPU-s, ~130 MB) and its
per-operator overhead cost more than the arithmetic. `TailProgram` interprets the tail's
own symbol JSON for the ops such tails are made of -- `unsupported` says why a symbol is
refused, and it then trains with MXNet Gluon -- in float32, as MXNet 1.9 computes them:

- BatchNorm: batch statistics while training (biased variance), moving statistics updated
  by `momentum` -- and, as in MXNet, where its backward pass runs (a trained parameter at
  or below it) --, stored statistics when predicting or with use_global_stats;
- clip and ReLU pass the gradient where the input lies within bounds, max pooling to the
  first maximum of a window, average pooling counts padding.

Activations are NHWC inside, so a 1x1 convolution is one BLAS product over every pixel of
the batch, and a depthwise one runs in C where the native library is built (int8/native_float.py);
parameters keep MXNet's names and layouts. No randomness and a fixed reduction
order: the same inputs give the same bits.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import InputError
from ..int8 import native_float

ADD_OPS = ("elemwise_add", "_plus", "_Plus", "_add", "broadcast_add", "broadcast_plus")
SCALAR_OPS = {"_mul_scalar": "mul", "_plus_scalar": "add", "_minus_scalar": "sub", "_div_scalar": "div"}
PASS_OPS = ("Flatten", "flatten", "_copy", "identity")
OPS = ("Convolution", "BatchNorm", "Activation", "relu", "clip", "Pad", "Pooling", "FullyConnected", "_linalg_gemm2",
       *ADD_OPS, *SCALAR_OPS, *PASS_OPS)
AUX_SUFFIXES = ("running_mean", "running_var", "moving_mean", "moving_var")
Arrays = list[np.ndarray]
Grads = list[np.ndarray | None]  # one per input of an op: None where none is needed


class UnsupportedTail(InputError):
    """The symbol holds something this interpreter does not compute (MXNet Gluon trains it)."""


def _flag(value: Any, default: bool) -> bool:
    return default if value is None else str(value).strip().lower() in ("1", "true")


def _ints(value: Any, default: tuple[int, ...]) -> tuple[int, ...]:
    if value in (None, "", "()"):
        return default
    parsed = ast.literal_eval(str(value))
    return tuple(int(v) for v in (parsed if isinstance(parsed, tuple | list) else (parsed,)))


@dataclass
class _Node:
    op: str
    name: str
    attrs: dict[str, Any]
    inputs: list[int] = field(default_factory=list)


def _check(node: dict[str, Any]) -> str:
    """Why this op cannot be computed here ('' if it can)."""
    op, attrs = node.get("op"), node.get("attrs") or {}
    if op not in OPS:
        return f"op {op}"
    if any(ref[1] != 0 for ref in node.get("inputs", [])):
        return f"{op} {node.get('name')}: reads a secondary output"
    if op == "Convolution":
        if set(_ints(attrs.get("dilate"), (1, 1))) != {1} or attrs.get("layout", "None") not in ("None", "NCHW"):
            return f"Convolution {node['name']}: dilation or layout"
        if len(_ints(attrs.get("kernel"), ())) != 2:
            return f"Convolution {node['name']}: not 2-D"
    if op == "BatchNorm" and (int(attrs.get("axis", 1)) != 1 or _flag(attrs.get("output_mean_var"), False)):
        return f"BatchNorm {node['name']}: axis or output_mean_var"
    if op == "Activation" and attrs.get("act_type") not in ("relu", "sigmoid", "tanh"):
        return f"Activation {attrs.get('act_type')}"
    if op == "Pooling":
        if attrs.get("pool_type", "max") not in ("avg", "max") or attrs.get("pooling_convention", "valid") != "valid":
            return f"Pooling {node['name']}: type or convention"
        if _flag(attrs.get("global_pool"), False):
            return "" if attrs.get("pool_type", "max") == "avg" else f"Pooling {node['name']}: global max"
        if not _flag(attrs.get("count_include_pad"), True) or len(_ints(attrs.get("kernel"), ())) != 2:
            return f"Pooling {node['name']}: window"
    if op == "Pad":  # the ONNX importer puts a zero-width one before a max pool
        widths = _ints(attrs.get("pad_width"), ())
        if len(widths) != 8 or any(widths[:4]) or (any(widths) and attrs.get("mode", "constant") != "constant"):
            return f"Pad {node['name']}: {attrs.get('mode')} {widths}"
    if op == "FullyConnected" and not _flag(attrs.get("flatten"), True):
        return "FullyConnected flatten=False"
    return ""


def unsupported(symbol_json: str, input_name: str) -> list[str]:
    """Why the symbol cannot train here: [] when every op of it is supported."""
    try:
        graph = json.loads(symbol_json)
        nodes, heads = graph["nodes"], graph["heads"]
    except (ValueError, KeyError, TypeError) as exc:
        return [f"not MXNet symbol JSON ({exc})"]
    why = [w for w in (_check(n) for n in nodes if n.get("op") != "null") if w]
    if len(heads) != 1 or heads[0][1] != 0:
        why.append("not one output")
    if not any(n.get("op") == "null" and n.get("name") == input_name for n in nodes):
        why.append(f"no input {input_name!r}")
    return why


# ---------------------------------------------------------------- ops: forward(node, ins, train) -> (out, cache)
# and backward(node, ins, out, cache, g, need) -> one gradient (or None) per input. 4-D values are NHWC.

def _conv_geometry(node: _Node, x: np.ndarray, w: np.ndarray) -> tuple[int, ...]:
    (kh, kw), (sh, sw), (ph, pw), groups = (node.attrs[k] for k in ("kernel", "stride", "pad", "groups"))
    if x.ndim != 4 or w.ndim != 4 or x.shape[3] != w.shape[1] * groups or w.shape[0] % groups:
        raise UnsupportedTail(f"Convolution {node.name}: input {x.shape} and weight {w.shape} do not fit")
    ho, wo = (x.shape[1] + 2 * ph - kh) // sh + 1, (x.shape[2] + 2 * pw - kw) // sw + 1
    return kh, kw, sh, sw, ph, pw, groups, ho, wo


def _taps(kh: int, kw: int, sh: int, sw: int, ho: int, wo: int) -> list[tuple[slice, slice]]:
    """The (rows, columns) of the padded input that each kernel tap reads."""
    return [(slice(i, i + sh * (ho - 1) + 1, sh), slice(j, j + sw * (wo - 1) + 1, sw))
            for i in range(kh) for j in range(kw)]


def _pad(x: np.ndarray, ph: int, pw: int, value: float = 0.0) -> np.ndarray:
    return np.pad(x, ((0, 0), (ph, ph), (pw, pw), (0, 0)), constant_values=value) if ph or pw else x


def _depthwise_fwd(x: np.ndarray, w: np.ndarray, geometry: tuple[int, ...]) -> tuple[np.ndarray, Any]:
    """In C where the native library is built (int8/native_float.py), else one shifted
    multiply-add per tap, channels vectorised; the cache says which (the backward pass follows it)."""
    kh, kw, sh, sw, ph, pw, _, ho, wo = geometry
    lib = native_float.native_library()
    if lib is not None:
        shape = native_float.DepthwiseGeometry((kh, kw), (sh, sw), (ph, pw), (ho, wo))
        return native_float.depthwise_forward(lib, x, w.reshape(w.shape[0], kh * kw).T, shape), ("native", x, shape)
    xp = _pad(x, ph, pw)
    taps = _taps(kh, kw, sh, sw, ho, wo)
    wk = w.reshape(w.shape[0], kh * kw).T.copy()
    out = xp[:, taps[0][0], taps[0][1], :] * wk[0]
    for k, (a, b) in enumerate(taps[1:], 1):
        out += xp[:, a, b, :] * wk[k]
    return out, ("numpy", xp, None)


def _depthwise_bwd(x: np.ndarray, w: np.ndarray, cache: Any, g: np.ndarray, geometry: tuple[int, ...],
                   need: list[bool]) -> tuple[np.ndarray | None, np.ndarray | None]:
    kind, saved, shape = cache
    kh, kw, sh, sw, ph, pw, _, ho, wo = geometry
    if kind == "native":
        lib = native_float.native_library()
        assert lib is not None
        gx, gtaps = native_float.depthwise_backward(lib, saved, w.reshape(w.shape[0], kh * kw).T, g, shape,
                                                    need[0], need[1])
        return gx, None if gtaps is None else gtaps.T.reshape(w.shape)
    taps, xp, gw = _taps(kh, kw, sh, sw, ho, wo), saved, None
    if need[1]:
        gw = np.stack([np.einsum("nhwc,nhwc->c", xp[:, a, b, :], g) for a, b in taps], 1).reshape(w.shape)
    if not need[0]:
        return None, gw
    wk = w.reshape(w.shape[0], kh * kw).T
    gxp = np.zeros(xp.shape, np.float32)
    for k, (a, b) in enumerate(taps):
        gxp[:, a, b, :] += g * wk[k]
    return gxp[:, ph:ph + x.shape[1], pw:pw + x.shape[2], :], gw


def _conv_fwd(node: _Node, ins: Arrays, train: bool) -> tuple[np.ndarray, Any]:
    x, w = ins[0], ins[1]
    geometry = _conv_geometry(node, x, w)
    kh, kw, sh, sw, ph, pw, groups, ho, wo = geometry
    n, o, c = x.shape[0], w.shape[0], x.shape[3]
    if kh == kw == 1 and ph == pw == 0 and groups == 1:  # one matrix product over every pixel
        xs = np.ascontiguousarray(x[:, ::sh, ::sw, :]).reshape(-1, c)
        out, cache = xs @ w.reshape(o, c).T, xs
    elif groups == c == o:
        out, cache = _depthwise_fwd(x, w, geometry)
    else:  # im2col: (pixels, taps x channels)
        xp = _pad(x, ph, pw)
        taps = _taps(kh, kw, sh, sw, ho, wo)
        cols = np.stack([xp[:, a, b, :] for a, b in taps], axis=3).reshape(-1, kh * kw, groups, c // groups)
        wg = w.reshape(groups, o // groups, c // groups, kh * kw)
        if groups == 1:
            out = cols.reshape(len(cols), -1) @ wg[0].transpose(0, 2, 1).reshape(o, -1).T
        else:
            out = np.einsum("mkgc,gock->mgo", cols, wg, optimize=True).reshape(-1, o)
        cache = (xp, cols)
    out = out.reshape(n, ho, wo, o)
    if len(ins) > 2:
        out = out + ins[2]
    return out, cache


def _conv_bwd(node: _Node, ins: Arrays, out: np.ndarray, cache: Any, g: np.ndarray, need: list[bool]) -> Grads:
    x, w = ins[0], ins[1]
    geometry = _conv_geometry(node, x, w)
    kh, kw, sh, sw, ph, pw, groups, ho, wo = geometry
    o, c = w.shape[0], x.shape[3]
    g2 = g.reshape(-1, o)
    gx = gw = None
    if kh == kw == 1 and ph == pw == 0 and groups == 1:  # the branches _conv_fwd took
        if need[1]:
            gw = (g2.T @ cache).reshape(w.shape)
        if need[0]:
            gxs = (g2 @ w.reshape(o, c)).reshape(g.shape[:3] + (c,))
            if (sh, sw) == (1, 1):
                gx = gxs
            else:
                gx = np.zeros_like(x)
                gx[:, ::sh, ::sw, :] = gxs
    elif groups == c == o:
        gx, gw = _depthwise_bwd(x, w, cache, g, geometry, need)
    else:
        xp, cols = cache
        wg = w.reshape(groups, o // groups, c // groups, kh * kw)
        gg = g2.reshape(-1, groups, o // groups)
        if need[1] and groups == 1:
            gw = (g2.T @ cols.reshape(len(cols), -1)).reshape(o, kh * kw, c).transpose(0, 2, 1).reshape(w.shape)
        elif need[1]:
            gw = np.einsum("mgo,mkgc->gock", gg, cols, optimize=True).reshape(w.shape)
        if need[0]:
            if groups == 1:
                gcols = g2 @ wg[0].transpose(0, 2, 1).reshape(o, -1)
            else:
                gcols = np.einsum("mgo,gock->mkgc", gg, wg, optimize=True)
            gcols = gcols.reshape(g.shape[:3] + (kh * kw, c))
            gxp = np.zeros(xp.shape, np.float32)
            for k, (a, b) in enumerate(_taps(kh, kw, sh, sw, ho, wo)):
                gxp[:, a, b, :] += gcols[:, :, :, k, :]
            gx = gxp[:, ph:ph + x.shape[1], pw:pw + x.shape[2], :]
    grads = [gx, gw]
    if len(ins) > 2:
        grads.append(g2.sum(axis=0) if need[2] else None)
    return grads


def _bn_fwd(node: _Node, ins: Arrays, train: bool) -> tuple[np.ndarray, Any]:
    x, gamma, beta, mean, var = ins
    c = x.shape[-1]
    x2 = x.reshape(-1, c)
    gam = np.ones_like(gamma) if node.attrs["fix_gamma"] else gamma
    eps = node.attrs["eps"]
    if train and not node.attrs["global_stats"]:
        mean = x2.mean(axis=0)
        xhat = x2 - mean
        var = np.einsum("ij,ij->j", xhat, xhat) / np.float32(len(x2))  # biased, as MXNet's
        inv = np.float32(1) / np.sqrt(var + eps)
        xhat *= inv
        out = xhat * gam
        out += beta
        return out.reshape(x.shape), (xhat, inv, gam, mean, var)
    inv = np.float32(1) / np.sqrt(var + eps)
    scale = gam * inv
    out = x2 * scale
    out += beta - mean * scale
    return out.reshape(x.shape), (None, inv, gam, None, None)


def _bn_bwd(node: _Node, ins: Arrays, out: np.ndarray, cache: Any, g: np.ndarray, need: list[bool]) -> Grads:
    x = ins[0]
    xhat, inv, gam, _, _ = cache
    g2 = g.reshape(-1, x.shape[-1])
    gbeta = g2.sum(axis=0)
    gx = None
    if xhat is None:  # stored statistics: an affine map
        ggamma = np.einsum("ij,ij->j", g2, x.reshape(g2.shape) - ins[3]) * inv
        if need[0]:
            gx = g2 * (gam * inv)
    else:
        ggamma = np.einsum("ij,ij->j", g2, xhat)
        if need[0]:  # (gamma inv / m) (m g - sum g - xhat sum(g xhat))
            m = np.float32(len(g2))
            gx = g2 - gbeta / m
            gx -= xhat * (ggamma / m)
            gx *= gam * inv
    if node.attrs["fix_gamma"]:
        ggamma = np.zeros_like(ggamma)
    return [None if gx is None else gx.reshape(x.shape), ggamma if need[1] else None, gbeta if need[2] else None,
            None, None]


def _act_fwd(node: _Node, ins: Arrays, train: bool) -> tuple[np.ndarray, Any]:
    x, kind = ins[0], node.attrs.get("act_type", "relu")
    if kind == "relu":
        return np.maximum(x, np.float32(0)), None
    if kind == "sigmoid":
        return (np.float32(1) / (np.float32(1) + np.exp(-x))).astype(np.float32), None
    return np.tanh(x), None


def _act_bwd(node: _Node, ins: Arrays, out: np.ndarray, cache: Any, g: np.ndarray, need: list[bool]) -> Grads:
    kind = node.attrs.get("act_type", "relu")
    if kind == "relu":
        return [g * (out > 0)]
    if kind == "sigmoid":
        return [g * out * (np.float32(1) - out)]
    return [g * (np.float32(1) - out * out)]


def _clip_fwd(node: _Node, ins: Arrays, train: bool) -> tuple[np.ndarray, Any]:
    return np.clip(ins[0], node.attrs["a_min"], node.attrs["a_max"]), None


def _clip_bwd(node: _Node, ins: Arrays, out: np.ndarray, cache: Any, g: np.ndarray, need: list[bool]) -> Grads:
    return [g * (out == ins[0])]  # x inside [a_min, a_max], bounds included as in MXNet's clip


def _pool_fwd(node: _Node, ins: Arrays, train: bool) -> tuple[np.ndarray, Any]:
    x, a = ins[0], node.attrs
    if x.ndim != 4:
        raise UnsupportedTail(f"Pooling {node.name}: input {x.shape}")
    if a["global"]:  # average (_check)
        return x.mean(axis=(1, 2), keepdims=True), None
    (kh, kw), (sh, sw), (ph, pw) = a["kernel"], a["stride"], a["pad"]
    ho, wo = (x.shape[1] + 2 * ph - kh) // sh + 1, (x.shape[2] + 2 * pw - kw) // sw + 1
    xp = _pad(x, ph, pw, -np.inf if a["type"] == "max" else 0.0)
    windows = np.stack([xp[:, i, j, :] for i, j in _taps(kh, kw, sh, sw, ho, wo)])
    if a["type"] == "avg":  # count_include_pad, MXNet's default
        return windows.mean(axis=0), None
    idx = windows.argmax(axis=0)  # the first maximum, as MXNet routes the gradient
    return np.take_along_axis(windows, idx[None], 0)[0], idx


def _pool_bwd(node: _Node, ins: Arrays, out: np.ndarray, cache: Any, g: np.ndarray, need: list[bool]) -> Grads:
    x, a = ins[0], node.attrs
    if a["global"]:
        return [np.broadcast_to(g / np.float32(x.shape[1] * x.shape[2]), x.shape).copy()]
    (kh, kw), (sh, sw), (ph, pw) = a["kernel"], a["stride"], a["pad"]
    gxp = np.zeros((len(x), x.shape[1] + 2 * ph, x.shape[2] + 2 * pw, x.shape[3]), np.float32)
    for k, (i, j) in enumerate(_taps(kh, kw, sh, sw, g.shape[1], g.shape[2])):
        gxp[:, i, j, :] += g / np.float32(kh * kw) if a["type"] == "avg" else g * (cache == k)
    return [gxp[:, ph:ph + x.shape[1], pw:pw + x.shape[2], :]]


def _flatten(x: np.ndarray) -> np.ndarray:
    """MXNet's flatten of the NCHW tensor that this NHWC one stands for."""
    if x.ndim == 4 and x.shape[1] * x.shape[2] != 1:
        x = x.transpose(0, 3, 1, 2)
    return x.reshape(len(x), -1)


def _unflatten(g: np.ndarray, x: np.ndarray) -> np.ndarray:
    if x.ndim == 4 and x.shape[1] * x.shape[2] != 1:
        return g.reshape(x.shape[0], x.shape[3], x.shape[1], x.shape[2]).transpose(0, 2, 3, 1)
    return g.reshape(x.shape)


def _pad_fwd(node: _Node, ins: Arrays, train: bool) -> tuple[np.ndarray, Any]:
    (t, b, left, r), x = node.attrs["widths"][4:], ins[0]
    pads = ((0, 0), (t, b), (left, r), (0, 0))
    return (np.pad(x, pads, constant_values=node.attrs["value"]) if t or b or left or r else x), None


def _pad_bwd(node: _Node, ins: Arrays, out: np.ndarray, cache: Any, g: np.ndarray, need: list[bool]) -> Grads:
    t, left, x = node.attrs["widths"][4], node.attrs["widths"][6], ins[0]
    return [g[:, t:t + x.shape[1], left:left + x.shape[2], :]]


def _fc_fwd(node: _Node, ins: Arrays, train: bool) -> tuple[np.ndarray, Any]:
    x2 = _flatten(ins[0])
    out = x2 @ ins[1].T
    return (out + ins[2] if len(ins) > 2 else out), x2


def _fc_bwd(node: _Node, ins: Arrays, out: np.ndarray, cache: Any, g: np.ndarray, need: list[bool]) -> Grads:
    grads = [_unflatten(g @ ins[1], ins[0]) if need[0] else None, g.T @ cache if need[1] else None]
    if len(ins) > 2:
        grads.append(g.sum(axis=0) if need[2] else None)
    return grads


def _gemm_fwd(node: _Node, ins: Arrays, train: bool) -> tuple[np.ndarray, Any]:
    a, b = ins
    if a.ndim != 2 or b.ndim != 2:
        raise UnsupportedTail(f"_linalg_gemm2 {node.name}: {a.shape} x {b.shape}")
    at, bt = (a.T if node.attrs["ta"] else a), (b.T if node.attrs["tb"] else b)
    return (at @ bt) * node.attrs["alpha"], None


def _gemm_bwd(node: _Node, ins: Arrays, out: np.ndarray, cache: Any, g: np.ndarray, need: list[bool]) -> Grads:
    a, b = ins
    alpha, ta, tb = node.attrs["alpha"], node.attrs["ta"], node.attrs["tb"]
    at, bt = (a.T if ta else a), (b.T if tb else b)  # out = alpha op(a) op(b)
    ga = (lambda d: d.T if ta else d)((g @ bt.T) * alpha) if need[0] else None
    gb = (lambda d: d.T if tb else d)((at.T @ g) * alpha) if need[1] else None
    return [ga, gb]


def _add_fwd(node: _Node, ins: Arrays, train: bool) -> tuple[np.ndarray, Any]:
    a, b = ins
    if a.shape != b.shape and a.ndim != b.ndim and 4 in (a.ndim, b.ndim):  # NHWC would broadcast wrongly
        raise UnsupportedTail(f"{node.op} {node.name}: broadcasts {a.shape} with {b.shape}")
    return a + b, None


def _unbroadcast(g: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if g.shape == shape:
        return g
    g = g.sum(axis=tuple(range(g.ndim - len(shape)))) if g.ndim > len(shape) else g
    axes = tuple(i for i, s in enumerate(shape) if s == 1 and g.shape[i] != 1)
    return g.sum(axis=axes, keepdims=True) if axes else g


def _add_bwd(node: _Node, ins: Arrays, out: np.ndarray, cache: Any, g: np.ndarray, need: list[bool]) -> Grads:
    return [_unbroadcast(g, x.shape) if n else None for x, n in zip(ins, need, strict=True)]


def _scalar_fwd(node: _Node, ins: Arrays, train: bool) -> tuple[np.ndarray, Any]:
    x, s, kind = ins[0], node.attrs["scalar"], node.attrs["kind"]
    return {"mul": x * s, "add": x + s, "sub": x - s, "div": x / s}[kind], None


def _scalar_bwd(node: _Node, ins: Arrays, out: np.ndarray, cache: Any, g: np.ndarray, need: list[bool]) -> Grads:
    s, kind = node.attrs["scalar"], node.attrs["kind"]
    return [g * s if kind == "mul" else g / s if kind == "div" else g]


def _pass_fwd(node: _Node, ins: Arrays, train: bool) -> tuple[np.ndarray, Any]:
    return (_flatten(ins[0]) if node.op in ("Flatten", "flatten") else ins[0]), None


def _pass_bwd(node: _Node, ins: Arrays, out: np.ndarray, cache: Any, g: np.ndarray, need: list[bool]) -> Grads:
    return [_unflatten(g, ins[0])]


_KERNELS: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "Convolution": (_conv_fwd, _conv_bwd), "BatchNorm": (_bn_fwd, _bn_bwd), "Activation": (_act_fwd, _act_bwd),
    "relu": (_act_fwd, _act_bwd), "clip": (_clip_fwd, _clip_bwd), "Pad": (_pad_fwd, _pad_bwd),
    "Pooling": (_pool_fwd, _pool_bwd), "FullyConnected": (_fc_fwd, _fc_bwd), "_linalg_gemm2": (_gemm_fwd, _gemm_bwd),
    **{op: (_add_fwd, _add_bwd) for op in ADD_OPS}, **{op: (_scalar_fwd, _scalar_bwd) for op in SCALAR_OPS},
    **{op: (_pass_fwd, _pass_bwd) for op in PASS_OPS},
}


def _parsed_attrs(op: str, attrs: dict[str, Any]) -> dict[str, Any]:
    """The attributes the kernels read, parsed once, with MXNet's defaults."""
    f32 = np.float32
    if op == "Convolution":
        return {"kernel": _ints(attrs.get("kernel"), (1, 1)), "stride": _ints(attrs.get("stride"), (1, 1)), "pad": _ints(attrs.get("pad"), (0, 0)),
                "groups": int(attrs.get("num_group", 1))}
    if op == "BatchNorm":
        return {"eps": f32(attrs.get("eps", 1e-3)), "momentum": f32(attrs.get("momentum", 0.9)),
                "fix_gamma": _flag(attrs.get("fix_gamma"), True),
                "global_stats": _flag(attrs.get("use_global_stats"), False)}
    if op == "clip":
        return {"a_min": f32(attrs["a_min"]), "a_max": f32(attrs["a_max"])}
    if op == "Pooling":
        glob = _flag(attrs.get("global_pool"), False)
        return {"global": glob, "type": attrs.get("pool_type", "max"), "kernel": _ints(attrs.get("kernel"), (1, 1)),
                "stride": _ints(attrs.get("stride"), (1, 1)), "pad": _ints(attrs.get("pad"), (0, 0))}
    if op == "_linalg_gemm2":
        return {"alpha": f32(attrs.get("alpha", 1.0)), "ta": _flag(attrs.get("transpose_a"), False),
                "tb": _flag(attrs.get("transpose_b"), False)}
    if op in SCALAR_OPS:
        return {"scalar": f32(attrs.get("scalar", 0.0)), "kind": SCALAR_OPS[op]}
    if op in ("Activation", "relu"):
        return {"act_type": attrs.get("act_type", "relu")}
    if op == "Pad":
        return {"widths": _ints(attrs.get("pad_width"), (0,) * 8), "value": f32(attrs.get("constant_value", 0.0))}
    return dict(attrs)


class TailProgram:
    """A supported symbol as a list of numpy kernels; gradients only where a trained
    parameter needs them."""

    def __init__(self, symbol_json: str, input_name: str) -> None:
        why = unsupported(symbol_json, input_name)
        if why:
            raise UnsupportedTail("the numpy tail trainer cannot compute: " + "; ".join(why[:4]))
        graph = json.loads(symbol_json)
        self.nodes = [_Node(n["op"], n["name"], _parsed_attrs(n["op"], n.get("attrs") or {}),
                            [ref[0] for ref in n.get("inputs", [])]) for n in graph["nodes"]]
        self.head = graph["heads"][0][0]
        self.input_name = input_name
        aux = {self.nodes[n.inputs[i]].name for n in self.nodes if n.op == "BatchNorm" for i in (3, 4)}
        variables = [n.name for n in self.nodes if n.op == "null" and n.name != input_name]
        # SymbolBlock's order: arguments, then auxiliary states
        self.arg_names = [v for v in variables if v not in aux]
        self.aux_names = [v for v in variables if v in aux]
        self.set_trainable(set(self.arg_names))

    def set_trainable(self, names: set[str]) -> None:
        self.trainable = names
        self.needs: list[bool] = []
        for n in self.nodes:
            self.needs.append(n.name in names if n.op == "null" else any(self.needs[i] for i in n.inputs))

    def forward(self, w: Mapping[str, np.ndarray], x: np.ndarray, train: bool
                ) -> tuple[np.ndarray, list[Any], list[Any]]:
        """(logits, every node's value, the kernels' caches). x is the NCHW batch."""
        x = np.ascontiguousarray(x.transpose(0, 2, 3, 1) if x.ndim == 4 else x, np.float32)
        values: list[Any] = [None] * len(self.nodes)
        caches: list[Any] = [None] * len(self.nodes)
        for i, n in enumerate(self.nodes):
            if n.op == "null":
                values[i] = x if n.name == self.input_name else w[n.name]
                continue
            values[i], caches[i] = _KERNELS[n.op][0](n, [values[j] for j in n.inputs], train)
        out = values[self.head]
        if out.ndim != 2:
            raise UnsupportedTail(f"the tail's output has shape {out.shape}, not (batch, classes)")
        return out, values, caches

    def backward(self, values: list[Any], caches: list[Any], g_out: np.ndarray) -> dict[str, np.ndarray]:
        """d(loss)/d(trained parameter), given d(loss)/d(logits)."""
        grads: dict[int, np.ndarray] = {self.head: g_out}
        for i in range(len(self.nodes) - 1, -1, -1):
            n = self.nodes[i]
            if n.op == "null" or i not in grads or not self.needs[i]:
                continue
            need = [self.needs[j] for j in n.inputs]
            ins = [values[j] for j in n.inputs]
            for j, gj in zip(n.inputs, _KERNELS[n.op][1](n, ins, values[i], caches[i], grads.pop(i), need),
                             strict=True):
                if gj is not None:
                    grads[j] = grads[j] + gj if j in grads else gj
        return {self.nodes[i].name: g.astype(np.float32, copy=False) for i, g in grads.items()
                if self.nodes[i].op == "null" and self.nodes[i].name in self.trainable}

    def update_statistics(self, w: dict[str, np.ndarray], caches: list[Any]) -> None:
        """The moving averages of a training step's batch statistics -- as MXNet 1.9 does it,
        in the backward pass, so only where a BatchNorm's backward runs."""
        for i, n in enumerate(self.nodes):
            if n.op != "BatchNorm" or n.attrs["global_stats"] or not self.needs[i] or caches[i][3] is None:
                continue
            mom = n.attrs["momentum"]
            for ref, batch in ((n.inputs[3], caches[i][3]), (n.inputs[4], caches[i][4])):
                name = self.nodes[ref].name
                w[name] = w[name] * mom + batch * (np.float32(1) - mom)  # not trained: not a flat view
