"""The numpy tail's depthwise convolution in C, when the package's native library is built
(kernels/float_train.c, in edge_agent/_kernels*.so with the int8 kernels).

numpy can only write a depthwise convolution as one shifted whole-array multiply-add per
kernel tap; on the 3x3 maps of a MobileNetV2 tail that was a third of a tail job's training
time, and the C loop is ~5x faster (bench_depth). Without the library (no compiler at install
time) `native_library()` is None and numpy_tail computes the same in numpy: the forward pass
adds the taps in the same order, the backward pass sums in another order (float32 rounding).
"""

from __future__ import annotations

import ctypes
import functools
import logging

import numpy as np

from ..int8.native_lib import ConvParams, NativeUnavailableError, load_library

_log = logging.getLogger(__name__)


@functools.cache
def native_library() -> ctypes.CDLL | None:
    try:
        return load_library()
    except NativeUnavailableError as exc:
        _log.info("the tail's depthwise convolutions run in numpy: %s", exc)
        return None


def _params(x: np.ndarray, c: int, geometry: tuple[int, ...]) -> ConvParams:
    kh, kw, sh, sw, ph, pw, _, ho, wo = geometry
    return ConvParams(batch=x.shape[0], in_h=x.shape[1], in_w=x.shape[2], in_c=c, out_h=ho, out_w=wo, out_c=c,
                      k_h=kh, k_w=kw, stride_h=sh, stride_w=sw, dilation_h=1, dilation_w=1, pad_top=ph,
                      pad_left=pw, depth_multiplier=1)


def _ptr(a: np.ndarray | None) -> int | None:
    return None if a is None else a.ctypes.data


def _call(fn: ctypes._CFuncPtr, *args: object) -> None:
    if fn(*args) != 0:  # the caller checked the shapes: a refusal here is a bug
        raise ValueError(f"{fn.__name__}: invalid arguments")


def depthwise_forward(lib: ctypes.CDLL, x: np.ndarray, w: np.ndarray, geometry: tuple[int, ...]) -> np.ndarray:
    """NHWC x (n, h, w, c) with MXNet's (c, 1, kh, kw) filter -> (n, ho, wo, c)."""
    kh, kw, ho, wo, c = geometry[0], geometry[1], geometry[7], geometry[8], x.shape[3]
    x = np.ascontiguousarray(x, np.float32)
    taps = np.ascontiguousarray(w.reshape(c, kh * kw).T, np.float32)
    out = np.empty((x.shape[0], ho, wo, c), np.float32)
    p = _params(x, c, geometry)
    _call(lib.ea_f32_depthwise_fwd, ctypes.byref(p), _ptr(x), _ptr(taps), _ptr(out))
    return out


def depthwise_backward(lib: ctypes.CDLL, x: np.ndarray, w: np.ndarray, g: np.ndarray, geometry: tuple[int, ...],
                       need_x: bool, need_w: bool) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(d/dx, d/dw in MXNet's filter layout), each None where not needed."""
    kh, kw, c = geometry[0], geometry[1], x.shape[3]
    x = np.ascontiguousarray(x, np.float32)
    taps = np.ascontiguousarray(w.reshape(c, kh * kw).T, np.float32)
    g = np.ascontiguousarray(g, np.float32)
    gx = np.empty(x.shape, np.float32) if need_x else None
    gw = np.empty((kh * kw, c), np.float32) if need_w else None
    if gx is None and gw is None:
        return None, None
    p = _params(x, c, geometry)
    _call(lib.ea_f32_depthwise_bwd, ctypes.byref(p), _ptr(x), _ptr(taps), _ptr(g), _ptr(gx), _ptr(gw))
    return gx, None if gw is None else gw.T.reshape(w.shape)
