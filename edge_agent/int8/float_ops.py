"""The float graph's numpy kernels (NHWC, float32) with TFLite's padding rules; depthwise
convolutions in C where the native library is built (native_float.py: numpy's bits).

They run the float graph for calibration (quantize.py) and for checks against MXNet's own
forward; the padding arithmetic is the int8 reference's, so both graphs agree on shapes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import native_float
from .reference_ops import compute_padding


def same_pads(size: int, k: int, stride: int, dilation: int) -> tuple[int, int]:
    """TFLite SAME padding (before, after) for one spatial axis: the extra cell goes after."""
    out, before = compute_padding(size, k, stride, dilation, "SAME")
    total = max((out - 1) * stride + (k - 1) * dilation + 1 - size, 0)
    return before, total - before


def out_size(size: int, k: int, stride: int, dilation: int, padding: str) -> int:
    return compute_padding(size, k, stride, dilation, padding)[0]


def _window(x: np.ndarray, k: tuple[int, int], s: tuple[int, int], d: tuple[int, int],
            padding: str) -> tuple[tuple[int, int], tuple[tuple[int, int], tuple[int, int]]]:
    """The output's (oh, ow) and the (before, after) padding of each spatial axis of x (N, H, W, C)."""
    _, h, w, _ = x.shape
    out = out_size(h, k[0], s[0], d[0], padding), out_size(w, k[1], s[1], d[1], padding)
    if padding != "SAME":
        return out, ((0, 0), (0, 0))
    return out, (same_pads(h, k[0], s[0], d[0]), same_pads(w, k[1], s[1], d[1]))


def _taps(x: np.ndarray, k: tuple[int, int], s: tuple[int, int], d: tuple[int, int],
          padding: str, fill: float) -> tuple[np.ndarray, list[tuple[int, int, np.ndarray]]]:
    """Pad x (N, H, W, C) and yield every kernel tap's strided view (oh, ow)."""
    (oh, ow), (ph, pw) = _window(x, k, s, d, padding)
    if padding == "SAME":
        x = np.pad(x, ((0, 0), ph, pw, (0, 0)), constant_values=fill)
    taps = []
    for i in range(k[0]):
        for j in range(k[1]):
            r, c = i * d[0], j * d[1]
            taps.append((i, j, x[:, r: r + (oh - 1) * s[0] + 1: s[0], c: c + (ow - 1) * s[1] + 1: s[1], :]))
    return x, taps


def _activation(y: np.ndarray, act: str) -> np.ndarray:
    if act == "RELU":
        return np.maximum(y, 0.0)
    if act == "RELU6":
        return np.clip(y, 0.0, 6.0)
    return y


def apply_activation(y: np.ndarray, act: str) -> np.ndarray:
    """A fused activation ("NONE", "RELU", "RELU6") applied to an op's pre-activation output."""
    return _activation(y, act)


def _depthwise_native(lib: Any, x: np.ndarray, o: dict[str, Any], w: np.ndarray) -> np.ndarray:
    """The depthwise convolution in C (native_float.py): the taps added in run_op's order."""
    _, kh, kw, c = w.shape
    s, d = (o["stride_h"], o["stride_w"]), (o["dilation_h"], o["dilation_w"])
    out, (ph, pw) = _window(x, (kh, kw), s, d, o["padding"])
    geometry = native_float.DepthwiseGeometry((kh, kw), s, (ph[0], pw[0]), out, d)
    return native_float.depthwise_forward(lib, x, w.reshape(kh * kw, c), geometry)


def run_op(kind: str, xs: list[np.ndarray], o: dict[str, Any], w: np.ndarray | None,
           b: np.ndarray | None) -> np.ndarray:
    """One float op on NHWC inputs."""
    x = xs[0]
    if kind == "DEPTHWISE_CONV_2D" and o["depth_multiplier"] == 1 and (lib := native_float.native_library()) is not None:
        y = _depthwise_native(lib, x, o, w)
        y += b
    elif kind in ("CONV_2D", "DEPTHWISE_CONV_2D"):
        k, s, d = w.shape[1:3], (o["stride_h"], o["stride_w"]), (o["dilation_h"], o["dilation_w"])
        _, taps = _taps(x, k, s, d, o["padding"], 0.0)
        y = np.zeros(taps[0][2].shape[:3] + (w.shape[0] if kind == "CONV_2D" else w.shape[3],), np.float32)
        groups, cin = x.shape[3] // w.shape[3], w.shape[3]
        per = w.shape[0] // max(groups, 1)
        for i, j, view in taps:
            if kind == "CONV_2D" and groups > 1:  # grouped: output block g sees input block g
                for g in range(groups):
                    y[..., g * per:(g + 1) * per] += view[..., g * cin:(g + 1) * cin] @ w[g * per:(g + 1) * per, i, j, :].T
            elif kind == "CONV_2D":
                y += view @ w[:, i, j, :].T
            elif o["depth_multiplier"] > 1:
                y += np.repeat(view, o["depth_multiplier"], axis=3) * w[0, i, j, :]
            else:  # depthwise: no copy of the tap (np.repeat by 1 made one: half the fp32 oracle's time)
                y += view * w[0, i, j, :]
        y += b
    elif kind == "FULLY_CONNECTED":
        y = x.reshape(len(x), -1) @ w.T + b
    elif kind in ("ADD", "MUL"):  # w: a constant second operand (broadcast NHWC), if any
        rhs = xs[1] if w is None else w
        y = x + rhs if kind == "ADD" else x * rhs
    elif kind == "HARD_SWISH":
        y = x * np.clip(x + 3.0, 0.0, 6.0) / 6.0
    elif kind == "LOGISTIC":
        y = 1.0 / (1.0 + np.exp(-x.astype(np.float64)))
    elif kind in ("MAX_POOL_2D", "AVERAGE_POOL_2D"):
        k, s = (o["filter_h"], o["filter_w"]), (o["stride_h"], o["stride_w"])
        if kind == "MAX_POOL_2D":
            _, taps = _taps(x, k, s, (1, 1), o["padding"], -np.inf)
            y = np.max(np.stack([v for _, _, v in taps]), axis=0)
        else:  # average over the cells inside the input only (TFLite's rule)
            _, taps = _taps(x, k, s, (1, 1), o["padding"], 0.0)
            _, ones = _taps(np.ones(x.shape[:3] + (1,), np.float32), k, s, (1, 1), o["padding"], 0.0)
            y = sum(v for _, _, v in taps) / sum(v for _, _, v in ones)
    elif kind == "MEAN":
        y = x.mean(axis=tuple(o["axes"]), keepdims=bool(o["keep_dims"]))
    elif kind == "RESHAPE":
        y = x.reshape(len(x), *o["new_shape"][1:])
    elif kind == "CONCATENATION":
        y = np.concatenate(xs, axis=o["axis"])
    elif kind == "PAD":
        y = np.pad(x, o["paddings"])
    elif kind == "PADV2":  # fill below every value (int8: -128); the batch minimum keeps the
        y = np.pad(x, o["paddings"], constant_values=x.min())  # observed range, same max pool
    elif kind == "GATHER":
        y = np.take(x, o["indices"], axis=o["axis"])
    else:
        raise ValueError(f"float executor has no op {kind!r}")
    y = _activation(y.astype(np.float32, copy=False), o.get("activation", "NONE"))
    # clip_max: an upper clamp the int8 graph gets from its output range (HardSigmoid's 1)
    return np.minimum(y, np.float32(o["clip_max"])) if "clip_max" in o else y
