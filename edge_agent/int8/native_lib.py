"""The native int8 kernels' shared library (kernels/*.c -> edge_agent/_kernels*.so): its
ABI (ctypes mirrors of the C parameter structs), loading it once with a reason when it
cannot be used, and the CPU variants it holds, one of which is chosen per process (see
native.py for the whole story and the kernel calls).
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import EXIT_UNAVAILABLE, EdgeAgentError
from ..hardware.cpu import kernels_library_path

ENV_VARIANT = "EDGE_AGENT_NATIVE_VARIANT"
ABI_VERSION = 7
MAX_K = 1 << 15  # the library's limit: int32 sums of (a - za)(b - zb) stay exact below it

_ERRORS = {-1: "invalid argument", -2: "out of memory"}


class NativeUnavailableError(EdgeAgentError):
    """The native kernels cannot run here (not built, wrong ABI, variant not runnable)."""

    exit_code = EXIT_UNAVAILABLE


class ConvParams(ctypes.Structure):
    """Mirror of ea_conv_params (kernels/ea_kernels.h)."""

    _fields_ = [(name, ctypes.c_int32) for name in (
        "batch", "in_h", "in_w", "in_c", "out_h", "out_w", "out_c", "k_h", "k_w",
        "stride_h", "stride_w", "dilation_h", "dilation_w", "pad_top", "pad_left",
        "depth_multiplier", "in_zp", "out_zp", "act_min", "act_max")]


class GemmParams(ctypes.Structure):
    """Mirror of ea_gemm_params (kernels/ea_kernels.h)."""

    _fields_ = [*((name, ctypes.c_int64) for name in ("m", "n", "k", "a_stride_m", "a_stride_k", "c_stride_m")),
                *((name, ctypes.c_int32) for name in ("a_zp", "b_zp", "out_zp", "act_min", "act_max", "out_int32"))]


class AddParams(ctypes.Structure):
    """Mirror of ea_add_params: TFLite int8 ADD (left_shift 20), all shifts <= 0."""

    _fields_ = [(name, ctypes.c_int32) for name in (
        "zp1", "mult1", "shift1", "zp2", "mult2", "shift2", "out_mult", "out_shift", "out_zp",
        "act_min", "act_max")]


OP_CONV, OP_DEPTHWISE, OP_GEMM, OP_ADD, OP_MEAN, OP_QUANTIZE, OP_COPY = range(1, 8)


class OpStruct(ctypes.Structure):
    """Mirror of ea_op: one op of a whole-graph run (ea_run_ops, kernels/graph.c)."""

    _fields_ = [("kind", ctypes.c_int32), ("in0", ctypes.c_int32), ("in1", ctypes.c_int32), ("out", ctypes.c_int32),
                ("conv", ConvParams), ("gemm", GemmParams), ("add", AddParams), ("n", ctypes.c_int64 * 3),
                ("q", ctypes.c_int32 * 4), ("scale", ctypes.c_float),
                *((name, ctypes.c_void_p) for name in ("w", "colsum", "bias", "mult", "shift"))]


@dataclass(frozen=True)
class Variant:
    """One compiled kernel variant."""

    name: str
    features: tuple[str, ...]  # /proc/cpuinfo names the variant needs
    runnable: bool  # the library's own cpuid / hwcap check on this CPU
    geometry: tuple[int, int, int]  # GEMM micro-tile rows, columns, K chunk
    handle: int


def library_path() -> Path | None:
    """The built library inside the package, if the install compiled it."""
    return kernels_library_path()


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_lib_error = ""


def _declare(lib: ctypes.CDLL) -> None:
    vp, i32, i64, sz = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_size_t
    sigs: dict[str, tuple[Any, list[Any]]] = {
        "ea_abi_version": (ctypes.c_int, []),
        "ea_build_info": (ctypes.c_char_p, []),
        "ea_variant_count": (ctypes.c_int, []),
        "ea_variant_at": (vp, [ctypes.c_int]),
        "ea_variant_name": (ctypes.c_char_p, [vp]),
        "ea_variant_features": (ctypes.c_char_p, [vp]),
        "ea_variant_runnable": (ctypes.c_int, [vp]),
        "ea_variant_geometry": (None, [vp, vp]),
        "ea_packed_b_size": (sz, [vp, i64, i64]),
        "ea_pack_b": (ctypes.c_int, [vp, i64, i64, vp, i64, i64, vp, vp]),
        "ea_gemm": (ctypes.c_int, [vp, ctypes.POINTER(GemmParams), vp, vp, vp, vp, vp, vp, vp]),
        "ea_gemm_plan_new": (ctypes.c_int, [vp, ctypes.POINTER(GemmParams), vp, vp, vp, vp, vp, vp]),
        "ea_gemm_plan_run": (ctypes.c_int, [vp, vp, i64, i64, vp]),
        "ea_gemm_plan_free": (None, [vp]),
        "ea_conv2d": (ctypes.c_int, [vp, ctypes.POINTER(ConvParams), vp, vp, vp, vp, vp, vp, vp, i64, i64]),
        "ea_depthwise_conv2d": (ctypes.c_int, [vp, ctypes.POINTER(ConvParams), vp, vp, vp, vp, vp, vp, i64, i64]),
        "ea_requantize": (ctypes.c_int, [vp, i64, vp, vp, vp, i32, i32, i32, vp]),
        "ea_add": (ctypes.c_int, [vp, i64, vp, vp, ctypes.POINTER(AddParams), vp]),
        "ea_mean_hw": (ctypes.c_int, [i64, i64, i64, vp, i32, i32, i32, i32, vp]),
        "ea_quantize_nchw": (ctypes.c_int, [i64, i64, i64, vp, ctypes.c_float, i32, vp]),
        "ea_run_ops": (ctypes.c_int, [vp, vp, i32, vp, i32]),
        "ea_pool_size": (ctypes.c_int, []),
        "ea_op_size": (ctypes.c_int, []),
        "ea_f32_depthwise_fwd": (ctypes.c_int, [ctypes.POINTER(ConvParams), vp, vp, vp]),
        "ea_f32_depthwise_bwd": (ctypes.c_int, [ctypes.POINTER(ConvParams), vp, vp, vp, vp, vp]),
    }
    for name, (restype, argtypes) in sigs.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes


def load_library() -> ctypes.CDLL:
    """Load (once) and check the library; NativeUnavailableError says why it cannot be used."""
    global _lib, _lib_error
    with _lock:
        if _lib is not None:
            return _lib
        if not _lib_error:
            path = library_path()
            if path is None:
                _lib_error = ("native kernels not built: edge_agent/_kernels*.so is missing (no C compiler at "
                              "install time, or the build failed; reinstall with `pip install -v` to see why)")
            else:
                try:
                    lib = ctypes.CDLL(str(path))
                    _declare(lib)
                    abi = lib.ea_abi_version()
                    if abi != ABI_VERSION:
                        raise OSError(f"ABI version {abi}, expected {ABI_VERSION}: rebuild the package")
                    if lib.ea_op_size() != ctypes.sizeof(OpStruct):
                        raise OSError(f"ea_op is {lib.ea_op_size()} bytes, the binding's mirror "
                                      f"{ctypes.sizeof(OpStruct)}: rebuild the package")
                    _lib = lib
                    return lib
                except (OSError, AttributeError) as exc:
                    _lib_error = f"native kernels at {path} cannot be loaded: {exc}"
        raise NativeUnavailableError(_lib_error)


def build_info() -> str:
    """Compiler and the variants the compiler refused, as recorded at build time."""
    return load_library().ea_build_info().decode("utf-8", "replace")


def variants() -> list[Variant]:
    """Every variant compiled into the library, fastest first."""
    lib = load_library()
    out = []
    for i in range(lib.ea_variant_count()):
        handle = lib.ea_variant_at(i)
        geometry = (ctypes.c_int32 * 3)()
        lib.ea_variant_geometry(handle, geometry)
        out.append(Variant(
            name=lib.ea_variant_name(handle).decode(),
            features=tuple(lib.ea_variant_features(handle).decode().split()),
            runnable=bool(lib.ea_variant_runnable(handle)),
            geometry=(geometry[0], geometry[1], geometry[2]),
            handle=int(handle),
        ))
    return out


def cpu_features(probe: Mapping[str, Any] | None = None) -> frozenset[str] | None:
    """The CPU's feature flags: the probe report's `cpu.flags`, else /proc/cpuinfo; None if unknown."""
    if probe:
        flags = (probe.get("cpu") or {}).get("flags")
        if isinstance(flags, list) and flags:
            return frozenset(str(f) for f in flags)
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return None


def select_variant(probe: Mapping[str, Any] | None = None, *, name: str | None = None) -> Variant:
    """The variant to run: `name`, else $EDGE_AGENT_NATIVE_VARIANT, else the fastest one the
    library's cpuid/hwcap check says this CPU runs. The feature list (probe or /proc/cpuinfo)
    never overrides that check; it only names the missing features in the error."""
    available = variants()

    def missing(v: Variant) -> list[str]:
        if v.runnable:
            return []
        features = cpu_features(probe)
        lacking = [f for f in v.features if features is not None and f not in features]
        return lacking or [f"{' '.join(v.features)} (cpuid/hwcap)"]

    forced = name or os.environ.get(ENV_VARIANT, "").strip() or None
    if forced:
        match = next((v for v in available if v.name == forced), None)
        if match is None:
            built = ", ".join(v.name for v in available)
            raise NativeUnavailableError(f"native variant {forced!r} is not in this build (built: {built})")
        lacking = missing(match)
        if lacking:
            raise NativeUnavailableError(f"native variant {forced!r} needs CPU features this CPU lacks: {', '.join(lacking)}")
        return match
    for v in available:
        if not missing(v):
            return v
    raise NativeUnavailableError("no native variant can run on this CPU")  # portable always can
