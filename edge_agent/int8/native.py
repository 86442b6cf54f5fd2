"""ctypes binding of the project's native int8 kernels (kernels/*.c -> edge_agent/_kernels*.so).

The library holds one copy of every kernel per CPU variant that the build could compile
(portable C, AVX2, AVX-VNNI, AVX512-VNNI, NEON, NEON+SDOT). A variant is chosen at run time
by the library's own cpuid / hwcap check: the fastest one this CPU runs. The feature list
(the probe report's `cpu.flags`, else /proc/cpuinfo) only names what is missing in errors:
under qemu-user /proc/cpuinfo is the host's, and the C-level check is the truth on any
machine, so a wrong list can neither cost the NEON kernels nor cause a SIGILL.
`EDGE_AGENT_NATIVE_VARIANT=<name>` forces one (tests, comparisons); forcing one this CPU
cannot run is an error, not a crash.

Arrays are passed zero-copy (`ndarray.ctypes.data` plus strides): GEMM operands may be any
strided int8 view, so A.B, A^T.B and A.B^T need no copies. Wrong dtypes, shapes or
non-contiguous tensors where the kernel needs contiguity are ValueErrors naming the
argument. Kernel calls release the GIL (ctypes does), so `threads > 1` splits a
convolution's output rows across a thread pool.

Semantics are TFLite's integer rules (quant_math), bit for bit.
"""

from __future__ import annotations

import ctypes
import os
import threading
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from .native_lib import (  # noqa: F401 - the library's names are part of this module's API
    _ERRORS,
    ABI_VERSION,
    ENV_VARIANT,
    MAX_K,
    AddParams,
    ConvParams,
    GemmParams,
    NativeUnavailableError,
    Variant,
    build_info,
    cpu_features,
    library_path,
    load_library,
    select_variant,
    variants,
)
from .reference_ops import compute_padding

# ---------------------------------------------------------------------------------- checks

def _check_array(x: Any, what: str, dtype: type, ndim: int | None = None, *, contiguous: bool = False) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{what} must be a numpy array, got {type(x).__name__}")
    if x.dtype != dtype:
        raise ValueError(f"{what} must be {np.dtype(dtype).name}, got {x.dtype}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{what} must be {ndim}-D, got shape {x.shape}")
    if contiguous and not x.flags.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous (use np.ascontiguousarray); got strides {x.strides}")
    return x


def _per_channel(values: Any, n: int, what: str, low: int, high: int) -> np.ndarray:
    """A per-channel int32 parameter (a scalar broadcasts); zero-copy when already int32[n]."""
    if (isinstance(values, np.ndarray) and values.dtype == _INT32 and values.shape == (n,)
            and values.flags.c_contiguous and low <= -(2**31) and high >= 2**31 - 1):
        return values  # every int32 is in range: no reductions on the hot path
    arr = np.asarray(values)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{what} must be integers, got {arr.dtype}")
    if arr.ndim == 0:
        arr = np.full(n, int(arr), dtype=np.int64)
    if arr.shape != (n,):
        raise ValueError(f"{what} must have shape ({n},), got {arr.shape}")
    if arr.size and (int(arr.min()) < low or int(arr.max()) > high):
        raise ValueError(f"{what} must lie in [{low}, {high}], got [{int(arr.min())}, {int(arr.max())}]")
    return np.ascontiguousarray(arr, dtype=np.int32)


def _int8_param(value: int, what: str) -> int:
    if not -128 <= int(value) <= 127:
        raise ValueError(f"{what} must lie in [-128, 127], got {value}")
    return int(value)


_INT8, _INT32 = np.dtype(np.int8), np.dtype(np.int32)


def _ptr(a: np.ndarray | None) -> int | None:
    """The address of a's first element. ctypes.from_buffer is ~3x cheaper than
    ndarray.ctypes.data, which matters for MobileNet's many microsecond-sized layers; it
    needs a writable contiguous buffer, so other arrays take the slow path."""
    if a is None:
        return None
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(a))
    except (TypeError, ValueError, BufferError):
        return a.ctypes.data


def _out_array(out: np.ndarray | None, shape: tuple[int, ...], dtype: type, what: str = "out") -> np.ndarray:
    if out is None:
        return np.empty(shape, dtype=dtype)
    _check_array(out, what, dtype, len(shape), contiguous=True)
    if out.shape != shape:
        raise ValueError(f"{what} must have shape {shape}, got {out.shape}")
    return out


@dataclass(frozen=True)
class PackedMatrix:
    """B ([N, K] int8) packed for one variant, with its per-row sums."""

    variant: str
    n: int
    k: int
    data: np.ndarray  # uint8 bytes in the variant's panel layout
    colsum: np.ndarray  # int32 [N]


@dataclass(frozen=True)
class ConvFilter:
    """A CONV_2D filter (OHWI) packed once, or a DEPTHWISE_CONV_2D filter (1HWC) as int16."""

    kind: str  # "conv" | "depthwise"
    kernel: tuple[int, int]
    in_channels: int
    out_channels: int
    packed: PackedMatrix | None = None  # conv
    taps: np.ndarray | None = None  # depthwise: int16 [kh * kw, out_channels]


@dataclass(frozen=True)
class Requant:
    """Per-output-channel requantisation: multiplier (Q31), shift, output zero point, clamp."""

    multiplier: np.ndarray  # int32 [C]
    shift: np.ndarray  # int32 [C]
    zero_point: int
    act_min: int = -128
    act_max: int = 127

    @classmethod
    def make(cls, multiplier: Any, shift: Any, zero_point: int, act_min: int = -128, act_max: int = 127,
             *, channels: int) -> Requant:
        m = _per_channel(multiplier, channels, "multiplier", 0, 2**31 - 1)
        s = _per_channel(shift, channels, "shift", -31, 30)
        zp = _int8_param(zero_point, "output zero point")
        lo, hi = _int8_param(act_min, "act_min"), _int8_param(act_max, "act_max")
        if lo > hi:
            raise ValueError(f"act_min {lo} > act_max {hi}")
        return cls(m, s, zp, lo, hi)


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _thread_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1), thread_name_prefix="ea-kernels")
        return _pool


class NativeKernels:
    """The kernels of one variant (chosen by `select_variant` unless named)."""

    def __init__(self, variant: str | None = None, *, probe: Mapping[str, Any] | None = None) -> None:
        self._lib = load_library()
        self.variant = select_variant(probe, name=variant)
        self._v = ctypes.c_void_p(self.variant.handle)

    @property
    def name(self) -> str:
        return self.variant.name

    def _call(self, fn: Any, *args: Any) -> None:
        rc = fn(self._v, *args)
        if rc != 0:
            raise RuntimeError(f"{fn.__name__} ({self.name}): {_ERRORS.get(rc, f'error {rc}')}")

    # ---- GEMM ----------------------------------------------------------------------------
    def pack(self, b: np.ndarray) -> PackedMatrix:
        """Pack B ([N, K] int8, any strides: pass `w.T` for a [K, N] matrix) for this variant."""
        _check_array(b, "b", np.int8, 2)
        n, k = b.shape
        if n < 1 or not 1 <= k <= MAX_K:
            raise ValueError(f"b must be [N >= 1, 1 <= K <= {MAX_K}], got shape {b.shape}")
        data = np.empty(self._lib.ea_packed_b_size(self._v, n, k), dtype=np.uint8)
        colsum = np.empty(n, dtype=np.int32)
        self._call(self._lib.ea_pack_b, n, k, b.ctypes.data, b.strides[0], b.strides[1], data.ctypes.data,
                   colsum.ctypes.data)
        return PackedMatrix(self.name, n, k, data, colsum)

    def gemm_plan(self, b: PackedMatrix, requant: Requant | None, *, rows: int, bias: Any = None,
                  a_zero_point: int = 0, b_zero_point: int = 0) -> GemmPlan:
        """A GEMM against packed B for A of `rows` rows, validated once (int32 output when
        `requant` is None). Call it with A ([rows, K], any strides)."""
        return GemmPlan(self, b, requant, int(rows), bias, a_zero_point, b_zero_point)

    def _gemm(self, a: np.ndarray, b: PackedMatrix, bias: Any, a_zp: int, b_zp: int,
              requant: Requant | None, out: np.ndarray | None) -> np.ndarray:
        _check_array(a, "a", np.int8, 2)
        return self.gemm_plan(b, requant, rows=a.shape[0], bias=bias, a_zero_point=a_zp, b_zero_point=b_zp)(a, out)

    def gemm_s8(self, a: np.ndarray, b: PackedMatrix, requant: Requant, *, bias: Any = None,
                a_zero_point: int = 0, b_zero_point: int = 0, out: np.ndarray | None = None) -> np.ndarray:
        """int8 [M, N] = requant((A - a_zp) . (B - b_zp)^T + bias), per output column."""
        return self._gemm(a, b, bias, a_zero_point, b_zero_point, requant, out)

    def gemm_s32(self, a: np.ndarray, b: PackedMatrix, *, bias: Any = None, a_zero_point: int = 0,
                 b_zero_point: int = 0, out: np.ndarray | None = None) -> np.ndarray:
        """int32 [M, N] = (A - a_zp) . (B - b_zp)^T + bias: the accumulator backward passes need."""
        return self._gemm(a, b, bias, a_zero_point, b_zero_point, None, out)

    def matmul_s32(self, a: np.ndarray, b: np.ndarray, *, a_zero_point: int = 0, b_zero_point: int = 0) -> np.ndarray:
        """(A - a_zp) @ (B - b_zp) in int32 for A [M, K], B [K, N] given as any int8 views:
        `matmul_s32(x.T, dy)` is A^T.B and `matmul_s32(dy, w.T)` is A.B^T, without copies."""
        _check_array(b, "b", np.int8, 2)
        return self.gemm_s32(a, self.pack(b.T), a_zero_point=a_zero_point, b_zero_point=b_zero_point)

    # ---- convolutions -------------------------------------------------------------------
    def conv_filter(self, w: np.ndarray) -> ConvFilter:
        """Pack a CONV_2D filter (OHWI int8) once."""
        _check_array(w, "filter", np.int8, 4)
        oc, kh, kw, ic = w.shape
        packed = self.pack(np.ascontiguousarray(w).reshape(oc, kh * kw * ic))
        return ConvFilter("conv", (kh, kw), ic, oc, packed=packed)

    @staticmethod
    def depthwise_filter(w: np.ndarray, depth_multiplier: int = 1) -> ConvFilter:
        """A DEPTHWISE_CONV_2D filter (1HWC int8) as int16 taps [kh * kw, C]."""
        _check_array(w, "filter", np.int8, 4)
        if w.shape[0] != 1 or depth_multiplier < 1 or w.shape[3] % depth_multiplier:
            raise ValueError(f"depthwise filter must be [1, kh, kw, C * {depth_multiplier}], got {w.shape}")
        _, kh, kw, oc = w.shape
        taps = np.ascontiguousarray(w.reshape(kh * kw, oc), dtype=np.int16)
        return ConvFilter("depthwise", (kh, kw), oc // depth_multiplier, oc, taps=taps)

    def conv_plan(self, f: ConvFilter, requant: Requant, *, input_shape: Sequence[int], input_zero_point: int,
                  bias: Any = None, stride: Sequence[int] = (1, 1), dilation: Sequence[int] = (1, 1),
                  padding: str = "SAME", pads: Sequence[int] | None = None,
                  threads: int | None = None) -> ConvPlan:
        """A CONV_2D / DEPTHWISE_CONV_2D for one input shape, validated once and then callable
        with just the input (the engine keeps one per op and batch size). `pads` (top, bottom,
        left, right) replaces `padding`: explicit padding with the input zero point, which is
        what a PAD followed by a VALID convolution computes."""
        return ConvPlan(self, f, requant, tuple(int(d) for d in input_shape), input_zero_point, bias,
                        tuple(stride), tuple(dilation), padding, threads,
                        None if pads is None else tuple(int(p) for p in pads))

    def conv2d(self, x: np.ndarray, f: ConvFilter, requant: Requant, *, input_zero_point: int, bias: Any = None,
               stride: Sequence[int] = (1, 1), dilation: Sequence[int] = (1, 1), padding: str = "SAME",
               out: np.ndarray | None = None, threads: int | None = None) -> np.ndarray:
        """CONV_2D on NHWC int8 (TFLite's ConvPerChannel) with a filter from `conv_filter`."""
        if f.kind != "conv":
            raise ValueError("conv2d needs a filter from conv_filter()")
        _check_array(x, "input", np.int8, 4, contiguous=True)
        return self.conv_plan(f, requant, input_shape=x.shape, input_zero_point=input_zero_point, bias=bias,
                              stride=stride, dilation=dilation, padding=padding, threads=threads)(x, out)

    def depthwise_conv2d(self, x: np.ndarray, f: ConvFilter, requant: Requant, *, input_zero_point: int,
                         bias: Any = None, stride: Sequence[int] = (1, 1), dilation: Sequence[int] = (1, 1),
                         padding: str = "SAME", out: np.ndarray | None = None,
                         threads: int | None = None) -> np.ndarray:
        """DEPTHWISE_CONV_2D on NHWC int8 (TFLite's DepthwiseConvPerChannel)."""
        if f.kind != "depthwise":
            raise ValueError("depthwise_conv2d needs a filter from depthwise_filter()")
        _check_array(x, "input", np.int8, 4, contiguous=True)
        return self.conv_plan(f, requant, input_shape=x.shape, input_zero_point=input_zero_point, bias=bias,
                              stride=stride, dilation=dilation, padding=padding, threads=threads)(x, out)

    def add(self, x1: np.ndarray, x2: np.ndarray, params: AddParams, out: np.ndarray | None = None) -> np.ndarray:
        """Elementwise int8 ADD of two same-shape tensors (TFLite's AddElementwise)."""
        if not isinstance(x1, np.ndarray) or x1.dtype != _INT8 or not x1.flags.c_contiguous:
            _check_array(x1, "x1", np.int8, contiguous=True)
        if not isinstance(x2, np.ndarray) or x2.dtype != _INT8 or not x2.flags.c_contiguous:
            _check_array(x2, "x2", np.int8, contiguous=True)
        if x1.shape != x2.shape:
            raise ValueError(f"add needs equal shapes (no broadcasting), got {x1.shape} and {x2.shape}")
        y = np.empty(x1.shape, _INT8) if out is None else _out_array(out, x1.shape, np.int8)
        self._call(self._lib.ea_add, x1.size, _ptr(x1), _ptr(x2), ctypes.byref(params), _ptr(y))
        return y

    def mean_hw(self, x: np.ndarray, *, input_zero_point: int, multiplier: int, shift: int,
                output_zero_point: int) -> np.ndarray:
        """MEAN over axes (1, 2) of NHWC int8 (keep_dims shape): TFLite's QuantizedMeanOrSum with
        the multiplier/shift already divided by H*W (see NativeOps.mean)."""
        if not isinstance(x, np.ndarray) or x.dtype != _INT8 or x.ndim != 4 or not x.flags.c_contiguous:
            _check_array(x, "input", np.int8, 4, contiguous=True)
        n, h, w, c = x.shape
        if h * w < 1 or c < 1:
            raise ValueError(f"mean over an empty window: input shape {x.shape}")
        if not 0 <= int(multiplier) <= 2**31 - 1 or not -31 <= int(shift) <= 30:
            raise ValueError(f"multiplier {multiplier} / shift {shift} out of range")
        y = np.empty((n, 1, 1, c), _INT8)
        rc = self._lib.ea_mean_hw(n, h * w, c, _ptr(x), _int8_param(input_zero_point, "input zero point"),
                                  int(multiplier), int(shift), _int8_param(output_zero_point, "output zero point"),
                                  _ptr(y))
        if rc != 0:
            raise RuntimeError(f"ea_mean_hw: {_ERRORS.get(rc, f'error {rc}')}")
        return y

    def quantize_nchw(self, x: np.ndarray, scale: float, zero_point: int) -> np.ndarray:
        """float32 NCHW (or [N, C]) -> int8 NHWC (or [N, C]): quant_math.quantize plus the
        layout change, in one pass."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim not in (2, 4) or x.size == 0:
            raise ValueError(f"quantize_nchw takes a non-empty [N, C] or [N, C, H, W] array, got shape {x.shape}")
        n, c = x.shape[:2]
        hw = int(np.prod(x.shape[2:])) if x.ndim == 4 else 1
        out_shape = (n, *x.shape[2:], c) if x.ndim == 4 else (n, c)
        y = np.empty(out_shape, _INT8)
        rc = self._lib.ea_quantize_nchw(n, c, hw, _ptr(x), float(np.float32(scale)),
                                        _int8_param(zero_point, "zero point"), _ptr(y))
        if rc != 0:
            raise RuntimeError(f"ea_quantize_nchw: {_ERRORS.get(rc, f'error {rc}')} (scale {scale})")
        return y

    def requantize(self, acc: np.ndarray, requant: Requant) -> np.ndarray:
        """The epilogue alone: int32 values -> int8, with per-element multiplier/shift."""
        _check_array(acc, "acc", np.int32, contiguous=True)
        if requant.multiplier.size != acc.size:
            raise ValueError(f"requantisation has {requant.multiplier.size} entries for {acc.size} values")
        out = np.empty(acc.shape, dtype=np.int8)
        self._call(self._lib.ea_requantize, acc.size, acc.ctypes.data, requant.multiplier.ctypes.data,
                   requant.shift.ctypes.data, requant.zero_point, requant.act_min, requant.act_max,
                   out.ctypes.data)
        return out


class ConvPlan:
    """One convolution bound to its filter, parameters and input shape: calling it costs a
    shape check and one C call. Build it with NativeKernels.conv_plan."""

    def __init__(self, kernels: NativeKernels, f: ConvFilter, requant: Requant, input_shape: tuple[int, ...],
                 input_zero_point: int, bias: Any, stride: tuple[int, ...], dilation: tuple[int, ...],
                 padding: str, threads: int | None, pads: tuple[int, ...] | None = None) -> None:
        if len(input_shape) != 4:
            raise ValueError(f"input must be 4-D NHWC, got shape {input_shape}")
        batch, h, w, c = input_shape
        if min(input_shape) < 1:
            raise ValueError(f"input shape {input_shape} has an empty dimension")
        if c != f.in_channels:
            raise ValueError(f"input has {c} channels, the filter expects {f.in_channels}")
        if requant.multiplier.shape != (f.out_channels,):
            raise ValueError(f"requantisation has {requant.multiplier.size} channels, filter has {f.out_channels}")
        if len(stride) != 2 or len(dilation) != 2 or min(*stride, *dilation) < 1:
            raise ValueError(f"stride {stride} and dilation {dilation} must be two integers >= 1")
        (kh, kw), (sh, sw), (dh, dw) = f.kernel, stride, dilation
        if pads is None:
            oh, pad_top = compute_padding(h, kh, sh, dh, padding)
            ow, pad_left = compute_padding(w, kw, sw, dw, padding)
        else:
            if len(pads) != 4 or min(pads) < 0:
                raise ValueError(f"pads must be (top, bottom, left, right) >= 0, got {pads}")
            pad_top, pad_left = pads[0], pads[2]
            oh, _ = compute_padding(h + pads[0] + pads[1], kh, sh, dh, "VALID")
            ow, _ = compute_padding(w + pads[2] + pads[3], kw, sw, dw, "VALID")
        if oh < 1 or ow < 1:
            raise ValueError(f"a {kh}x{kw} filter (dilation {dh}x{dw}) does not fit a {h}x{w} input with {padding}")
        if f.kind == "conv":
            if f.packed.variant != kernels.name:
                raise ValueError(f"filter was packed for variant {f.packed.variant!r}, not {kernels.name!r}")
            self._fn = kernels._lib.ea_conv2d
            weights: tuple[Any, ...] = (_ptr(f.packed.data), _ptr(f.packed.colsum))
        else:
            self._fn = kernels._lib.ea_depthwise_conv2d
            weights = (_ptr(f.taps),)
        self._bias = None if bias is None else _per_channel(bias, f.out_channels, "bias", -(2**31), 2**31 - 1)
        self.params = ConvParams(batch, h, w, c, oh, ow, f.out_channels, kh, kw, sh, sw, dh, dw, pad_top, pad_left,
                                 f.out_channels // f.in_channels, _int8_param(input_zero_point, "input zero point"),
                                 requant.zero_point, requant.act_min, requant.act_max)
        self.input_shape = tuple(input_shape)
        self.output_shape = (batch, oh, ow, f.out_channels)
        self._keep = (f, requant, self._bias)  # the C call reads their memory
        self._head = (kernels._v, ctypes.byref(self.params))
        self._tail = (*weights, _ptr(self._bias), _ptr(requant.multiplier), _ptr(requant.shift))
        self.pointers = self._tail  # (weights[, colsum], bias, mult, shift) for an ea_op
        if len(self.pointers) == 4:
            self.pointers = (self._tail[0], None, *self._tail[1:])
        self._rows = batch * oh * ow
        self._parts = max(1, min(threads or 1, self._rows // 64))  # below ~64 rows a split costs more
        self._kernels = kernels

    def __call__(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        if not isinstance(x, np.ndarray) or x.dtype != _INT8 or x.shape != self.input_shape \
                or not x.flags.c_contiguous:
            _check_array(x, "input", np.int8, 4, contiguous=True)
            raise ValueError(f"input must have shape {self.input_shape}, got {x.shape}")
        y = np.empty(self.output_shape, _INT8) if out is None else _out_array(out, self.output_shape, np.int8)
        args = (*self._head, _ptr(x), *self._tail, _ptr(y))
        if self._parts == 1:
            rc = self._fn(*args, 0, self._rows)
            if rc != 0:
                raise RuntimeError(f"{self._fn.__name__} ({self._kernels.name}): {_ERRORS.get(rc, f'error {rc}')}")
        else:
            bounds = [self._rows * i // self._parts for i in range(self._parts + 1)]
            futures = [_thread_pool().submit(self._kernels._call, self._fn, *args[1:], lo, hi)
                       for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]
            for fut in futures:
                fut.result()
        return y


class GemmPlan:
    """A GEMM bound to packed B, requantisation and the row count of A, prepared in C once
    (ea_gemm_plan_new: validation and the per-column epilogue constants), so a call costs
    the shape checks, two addresses and one ctypes call with five arguments."""

    def __init__(self, kernels: NativeKernels, b: PackedMatrix, requant: Requant | None, rows: int, bias: Any,
                 a_zp: int, b_zp: int) -> None:
        if b.variant != kernels.name:
            raise ValueError(f"b was packed for variant {b.variant!r}, not {kernels.name!r}")
        if rows < 0:
            raise ValueError(f"rows must be >= 0, got {rows}")
        if requant is not None and requant.multiplier.shape != (b.n,):
            raise ValueError(f"requantisation has {requant.multiplier.size} channels, b has {b.n} columns")
        self.rows, self.k, self.n = rows, b.k, b.n
        self.int32 = requant is None
        self.dtype = _INT32 if self.int32 else _INT8
        self._bias = None if bias is None else _per_channel(bias, b.n, "bias", -(2**31), 2**31 - 1)
        self.params = GemmParams(rows, b.n, b.k, 0, 0, b.n, _int8_param(a_zp, "a zero point"),
                                 _int8_param(b_zp, "b zero point"), 0 if self.int32 else requant.zero_point,
                                 -128 if self.int32 else requant.act_min, 127 if self.int32 else requant.act_max,
                                 int(self.int32))
        self._keep = (b, requant, self._bias)
        self._kernels = kernels
        self._b = (_ptr(b.data), _ptr(b.colsum), _ptr(self._bias),
                   None if self.int32 else _ptr(requant.multiplier), None if self.int32 else _ptr(requant.shift))
        self.pointers = self._b  # (packed B, colsum, bias, mult, shift) for an ea_op
        self._out_shape = (rows, b.n)
        handle = ctypes.c_void_p()
        lib = kernels._lib
        rc = lib.ea_gemm_plan_new(kernels._v, ctypes.byref(self.params), *self._b, ctypes.byref(handle))
        if rc != 0:
            raise RuntimeError(f"ea_gemm_plan_new ({kernels.name}): {_ERRORS.get(rc, f'error {rc}')}")
        self._plan = handle.value
        self._run = lib.ea_gemm_plan_run
        # the plan reads b, requant and bias (self._keep) until it is freed
        weakref.finalize(self, lib.ea_gemm_plan_free, handle.value)

    def __call__(self, a: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        # identity checks first (the common case); the general ones only when those fail
        if (a.__class__ is not np.ndarray or a.dtype is not _INT8 or a.shape != (self.rows, self.k)) and (
                not isinstance(a, np.ndarray) or a.dtype != _INT8 or a.shape != (self.rows, self.k)):
            _check_array(a, "a", np.int8, 2)
            raise ValueError(f"a must have shape ({self.rows}, {self.k}), got {a.shape}")
        if out is None:
            c = np.empty(self._out_shape, self.dtype)
        elif out.__class__ is np.ndarray and out.dtype is self.dtype and out.shape == self._out_shape:
            c = out  # its contiguity and writability: checked by from_buffer below
        else:
            c = _out_array(out, self._out_shape, self.dtype)
        if self.rows == 0:
            return c
        # The addresses are looked up on every call: caching them per array (weak references)
        # saved ~0.7 us each but trusted a live array's buffer, which ndarray.resize can move
        # and `strides` / `writeable` can change between calls.
        try:
            pc = ctypes.addressof(ctypes.c_char.from_buffer(c))
        except (TypeError, ValueError, BufferError):
            _out_array(c, self._out_shape, self.dtype)  # names what is wrong
            raise ValueError("out must be a writable C-contiguous array") from None
        try:  # a writable C-contiguous A: rows of k bytes, whatever strides its size-1 axes report
            pa, sm, sk = ctypes.addressof(ctypes.c_char.from_buffer(a)), self.k, 1
        except (TypeError, ValueError, BufferError):  # any other int8 view: byte strides are element strides
            (sm, sk), pa = a.strides, a.ctypes.data
        rc = self._run(self._plan, pa, sm, sk, pc)
        if rc != 0:
            raise RuntimeError(f"ea_gemm_plan_run ({self._kernels.name}): {_ERRORS.get(rc, f'error {rc}')}")
        return c
