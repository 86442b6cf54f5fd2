"""Float32 depthwise convolution in C, when the package's native library is built
(kernels/float_depthwise.c, in edge_agent/_kernels*.so with the int8 kernels): the numpy tail
trainer's forward and backward passes (train/numpy_tail.py) and the float prefix's passes
over a device's images (float_ops.py: normalisation statistics, calibration, shift).

numpy can only write a depthwise convolution as one shifted whole-array multiply-add per
kernel tap; the C loop is 3-6x faster on a MobileNetV2's maps (bench_float_depthwise), and
the numpy version had taken a third of a tail job's training time. Without the library (no
compiler at install time) `native_library()` is None and the callers compute the same in
numpy: the forward pass adds the taps in the same order, with no fused multiply-add, so it
gives numpy's bits; the backward pass sums in another order.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass

import numpy as np

from .native_lib import ConvParams, NativeUnavailableError, load_library

_log = logging.getLogger(__name__)


@functools.cache
def native_library() -> ctypes.CDLL | None:
    try:
        return load_library()
    except NativeUnavailableError as exc:
        _log.info("float depthwise convolutions run in numpy: %s", exc)
        return None


@dataclass(frozen=True)
class DepthwiseGeometry:
    """Kernel, stride, dilation, the padding before each axis and the output size (the
    padding after is what the output size implies)."""

    kernel: tuple[int, int]
    stride: tuple[int, int]
    pad_before: tuple[int, int]
    out: tuple[int, int]
    dilation: tuple[int, int] = (1, 1)

    def params(self, x: np.ndarray) -> ConvParams:
        n, h, w, c = x.shape
        return ConvParams(batch=n, in_h=h, in_w=w, in_c=c, out_h=self.out[0], out_w=self.out[1], out_c=c,
                          k_h=self.kernel[0], k_w=self.kernel[1], stride_h=self.stride[0], stride_w=self.stride[1],
                          dilation_h=self.dilation[0], dilation_w=self.dilation[1], pad_top=self.pad_before[0],
                          pad_left=self.pad_before[1], depth_multiplier=1)


def _ptr(a: np.ndarray | None) -> int | None:
    return None if a is None else a.ctypes.data


def _call(fn: ctypes._CFuncPtr, *args: object) -> None:
    if fn(*args) != 0:  # the callers checked the shapes: a refusal here is a bug
        raise ValueError(f"{fn.__name__}: invalid arguments")


def depthwise_forward(lib: ctypes.CDLL, x: np.ndarray, taps: np.ndarray, geometry: DepthwiseGeometry) -> np.ndarray:
    """NHWC x (n, h, w, c) with the filter as taps (kh * kw, c) -> (n, out_h, out_w, c), no bias."""
    x = np.ascontiguousarray(x, np.float32)
    taps = np.ascontiguousarray(taps, np.float32)
    out = np.empty((x.shape[0], *geometry.out, x.shape[3]), np.float32)
    p = geometry.params(x)
    _call(lib.ea_f32_depthwise_fwd, ctypes.byref(p), _ptr(x), _ptr(taps), _ptr(out))
    return out


def depthwise_backward(lib: ctypes.CDLL, x: np.ndarray, taps: np.ndarray, g: np.ndarray, geometry: DepthwiseGeometry,
                       need_x: bool, need_w: bool) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(d/dx, d/d taps (kh * kw, c)), each None where not needed."""
    if not (need_x or need_w):
        return None, None
    x = np.ascontiguousarray(x, np.float32)
    taps = np.ascontiguousarray(taps, np.float32)
    g = np.ascontiguousarray(g, np.float32)
    gx = np.empty(x.shape, np.float32) if need_x else None
    gw = np.empty(taps.shape, np.float32) if need_w else None
    p = geometry.params(x)
    _call(lib.ea_f32_depthwise_bwd, ctypes.byref(p), _ptr(x), _ptr(taps), _ptr(g), _ptr(gx), _ptr(gw))
    return gx, gw
