"""Native int8 kernels (kernels/*.c via edge_agent.int8.native) and the `native` engine.

Oracles: the int8 core's numpy reference (reference_ops accumulators + quant_math rules) and
tflite-runtime's own reference kernels (BuiltinRefOpResolver). Agreement must be exact.
Every variant this CPU can run is tested; a variant it cannot run (AVX-VNNI or AVX512-VNNI
on a CPU without them) is skipped -- qemu-user 7.2 does not emulate those instructions, so
no emulator can run them there; they are still compiled by the build (test_build_variants),
and run on every VNNI machine.
"""

from __future__ import annotations

import io
import os
import platform
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edge_agent.int8 import native
from edge_agent.int8 import quant_math as qm
from edge_agent.int8 import reference_ops as ops
from edge_agent.int8.engines import _common
from edge_agent.int8.engines._common import nchw_to_nhwc
from edge_agent.int8.engines.native import (
    NativeEngine,
    NativeOps,
    NativeRunner,
    add_params,
    fuse_pads,
)
from edge_agent.int8.graph import QOp
from tests.unit.test_kernels_cross import add_graph, mean_graph

ALL_VARIANTS = {v.name: v for v in native.variants()}
CPU_FLAGS = native.cpu_features() or frozenset()
HYP = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _kernels(name: str) -> native.NativeKernels:
    v = ALL_VARIANTS[name]
    if not v.runnable:
        lacking = " ".join(f for f in v.features if f not in CPU_FLAGS) or " ".join(v.features)
        pytest.skip(f"variant {name}: this CPU lacks {lacking}, and qemu-user 7.2 cannot execute VNNI either")
    return native.NativeKernels(name)


@pytest.fixture(params=sorted(ALL_VARIANTS))
def kernels(request: pytest.FixtureRequest) -> native.NativeKernels:
    return _kernels(request.param)


def _requant(rng: np.random.Generator, channels: int, acc_scale: float) -> tuple[np.ndarray, np.ndarray]:
    mult, shift = qm.quantize_multiplier(rng.uniform(0.3, 3.0, channels) / acc_scale)
    return mult, shift


def _window(kind: str, hw: tuple[int, int], kernel: tuple[int, int], stride: tuple[int, int],
            dilation: tuple[int, int], padding: str) -> ops.WindowParams:
    op = QOp(kind, [], [], {"stride_h": stride[0], "stride_w": stride[1], "dilation_h": dilation[0],
                            "dilation_w": dilation[1], "padding": padding})
    return ops.window_params(op, hw, kernel)


# ----------------------------------------------------------------------------- build, dispatch

def test_build_variants_and_dispatch() -> None:
    """The install compiled the variants this architecture has, and dispatch picks the first
    one (fastest) this CPU runs."""
    machine = platform.machine()
    expected = {"x86_64": {"avx2", "avx_vnni", "avx512_vnni"}, "aarch64": {"neon", "neon_dot"},
                "armv7l": {"armv7_neon"}}.get(machine, set())
    assert expected | {"portable"} <= set(ALL_VARIANTS), native.build_info()
    assert "gcc" in native.build_info() or "clang" in native.build_info()
    chosen = native.NativeKernels().variant
    first_runnable = next(v for v in native.variants() if v.runnable and set(v.features) <= CPU_FLAGS)
    assert chosen.name == first_runnable.name
    if "avx2" in CPU_FLAGS and "avx_vnni" not in CPU_FLAGS and "avx512_vnni" not in CPU_FLAGS:
        assert chosen.name == "avx2"


def test_the_kernels_check_not_the_feature_list_chooses_the_variant() -> None:
    # A feature list without SIMD flags (qemu-user shows the host's /proc/cpuinfo) does not
    # cost the SIMD kernels; one claiming VNNI on a CPU without it still never gets a variant
    # the library cannot execute.
    fastest = next(v.name for v in native.variants() if v.runnable)
    assert native.select_variant({"cpu": {"flags": ["fpu", "sse2"]}}).name == fastest
    claimed = {"cpu": {"flags": sorted(CPU_FLAGS | {"avx2", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
                                                    "avx512_vnni", "asimd", "asimddp", "neon"})}}
    picked = native.select_variant(claimed)
    assert picked.runnable
    assert picked.name == next(v.name for v in native.variants() if v.runnable)


def test_env_var_forces_a_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native.ENV_VARIANT, "portable")
    assert native.NativeKernels().name == "portable"
    avail = NativeEngine().availability()
    assert avail.available and avail.detail["variant"] == "portable" and native.ENV_VARIANT in avail.reason
    monkeypatch.setenv(native.ENV_VARIANT, "sse9")
    with pytest.raises(native.NativeUnavailableError, match="'sse9' is not in this build"):
        native.NativeKernels()
    assert not NativeEngine().availability().available
    unrunnable = [v for v in native.variants() if not v.runnable]
    if unrunnable:  # forcing it is an error, never SIGILL
        monkeypatch.setenv(native.ENV_VARIANT, unrunnable[0].name)
        with pytest.raises(native.NativeUnavailableError, match="lacks"):
            native.NativeKernels()


# ----------------------------------------------------------------------------- requantisation

def test_requantize_matches_tflite_rules_on_edge_values(kernels: native.NativeKernels) -> None:
    rng = np.random.default_rng(3)
    edges = np.array([qm.INT32_MIN, qm.INT32_MIN + 1, -(2**30), -1, 0, 1, 2**30, qm.INT32_MAX], np.int64)
    acc = np.concatenate([np.repeat(edges, 62), rng.integers(qm.INT32_MIN, qm.INT32_MAX, 4000, endpoint=True)])
    n = acc.size
    mult = rng.integers(0, 2**31, n)
    mult[: 8 * 62] = np.tile([0, 1, 2**30, 2**30 + 1, 1518500250, 2**31 - 2, 2**31 - 1, 1 << 30], 62)
    shift = rng.integers(-31, 31, n)
    shift[:62] = np.arange(-31, 31)
    for zp, lo, hi in ((0, -128, 127), (-128, -128, 127), (17, -100, 90), (127, 0, 127)):
        rq = native.Requant.make(mult, shift, zp, lo, hi, channels=n)
        got = kernels.requantize(acc.astype(np.int32), rq)
        np.testing.assert_array_equal(got, qm.requantize(acc, mult, shift, zp, lo, hi))


# ----------------------------------------------------------------------------- GEMM

@pytest.mark.parametrize("name", sorted(ALL_VARIANTS))
@HYP
@given(m=st.integers(0, 37), n=st.integers(1, 41), k=st.integers(1, 70), layout=st.sampled_from(["AB", "AtB", "ABt"]),
       int32_out=st.booleans(), seed=st.integers(0, 2**31))
def test_gemm_matches_integer_matmul(name: str, m: int, n: int, k: int, layout: str, int32_out: bool,
                                     seed: int) -> None:
    kernels = _kernels(name)
    rng = np.random.default_rng(seed)
    a = rng.integers(-128, 128, (m, k), dtype=np.int8)
    b = rng.integers(-128, 128, (k, n), dtype=np.int8)  # op(B) is [K, N]
    za, zb = (int(v) for v in rng.integers(-128, 128, 2))
    bias = rng.integers(-50000, 50000, n).astype(np.int32)
    acc = (a.astype(np.int64) - za) @ (b.astype(np.int64) - zb) + bias
    # Transposed storage reached through views: no copies on the way into C.
    a_view = np.ascontiguousarray(a.T).T if layout == "AtB" else a
    b_view = np.ascontiguousarray(b.T) if layout == "ABt" else b  # [N, K] storage
    packed = kernels.pack(b_view if layout == "ABt" else b_view.T)
    if int32_out:
        got = kernels.gemm_s32(a_view, packed, bias=bias, a_zero_point=za, b_zero_point=zb)
        np.testing.assert_array_equal(got, acc)
        if layout == "AB":
            plain = kernels.matmul_s32(a, b, a_zero_point=za, b_zero_point=zb)
            np.testing.assert_array_equal(plain, acc - bias)
    else:
        mult, shift = _requant(rng, n, 128.0 * 128 * np.sqrt(k))
        zp, lo, hi = int(rng.integers(-20, 21)), -128, int(rng.integers(0, 128))
        rq = native.Requant.make(mult, shift, zp, lo, hi, channels=n)
        out = np.full((m, n), 99, np.int8)
        got = kernels.gemm_s8(a_view, packed, rq, bias=bias, a_zero_point=za, b_zero_point=zb, out=out)
        assert got is out  # written in place
        np.testing.assert_array_equal(got, qm.requantize(acc, mult, shift, zp, lo, hi))


@pytest.mark.parametrize(("m", "k", "n"), [(1000, 40, 37), (7, 3001, 20), (530, 8, 48)])
def test_gemm_across_row_blocks_and_long_k(kernels: native.NativeKernels, m: int, k: int, n: int) -> None:
    """Several row blocks of the driver (and one-row blocks for long K), both zero points."""
    rng = np.random.default_rng(m + k + n)
    a = rng.integers(-128, 128, (m, k), dtype=np.int8)
    b = rng.integers(-128, 128, (n, k), dtype=np.int8)
    acc = (a.astype(np.int64) + 7) @ (b.astype(np.int64) - 9).T
    packed = kernels.pack(b)
    np.testing.assert_array_equal(kernels.gemm_s32(a, packed, a_zero_point=-7, b_zero_point=9), acc)
    mult, shift = _requant(rng, n, 255.0 * 128 * np.sqrt(k))
    rq = native.Requant.make(mult, shift, -3, channels=n)
    got = kernels.gemm_s8(a, packed, rq, a_zero_point=-7, b_zero_point=9)
    np.testing.assert_array_equal(got, qm.requantize(acc, mult, shift, -3, -128, 127))


@pytest.mark.parametrize("name", sorted(ALL_VARIANTS))
@pytest.mark.parametrize("with_min", [False, True])
@pytest.mark.parametrize("layout", ["u8s8", "int16", ""])
def test_gemm_u8s8_layout_and_its_saturation_edge(name: str, with_min: bool, layout: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The u8 x s8 layout on x86 -- forced at every K here, or left to the variant's choice by
    K: AVX2 (vpmaddubsw on |a| and sign(a) * b) takes it only for weights without -128, a B
    with -128 the int16 one; VNNI (vpdpbusd on b + 128 and a) takes it for any B. All exact,
    including the extreme pair sums (a = -128 against b = +-127: 2 * 128 * 127 per int16
    lane), b = -128 against a = -128, and every K tail; past K 64 AVX2's 4-row tiles."""
    monkeypatch.setenv("EDGE_AGENT_NATIVE_LAYOUT", layout)
    kernels = _kernels(name)
    rng = np.random.default_rng(3)
    for m, n, k in ((37, 24, 64), (5, 17, 7), (16, 33, 130), (3, 8, 4), (19, 40, 132)):
        a = rng.integers(-128, 128, (m, k), dtype=np.int8)
        b = rng.integers(-127, 128, (n, k), dtype=np.int8)
        a[0], b[0], b[1] = -128, -127, 127  # the saturation edge, both signs
        a[1, ::2] = -128
        if with_min:
            b[2 % n, k // 2] = -128
        za, zb = (int(v) for v in rng.integers(-128, 128, 2))
        got = kernels.gemm_s32(a, kernels.pack(b), a_zero_point=za, b_zero_point=zb)
        want = (a.astype(np.int64) - za) @ (b.astype(np.int64) - zb).T
        np.testing.assert_array_equal(got, want.astype(np.int32))



@pytest.mark.parametrize("name", sorted(ALL_VARIANTS))
@pytest.mark.parametrize("shifts", ["fast", "long", "left"])
def test_gemm_symmetric_weights_int8_epilogues(name: str, shifts: str) -> None:
    """What real layers run: symmetric weights (zb = 0, no -128), so x86 takes the
    u8 x s8 tiles with the fast epilogue (2x, rounding half and zero point folded into the
    64-bit products) for full 16- and 8-column strips and the per-row one elsewhere, the last
    shorter strip included. Per-channel shifts include 0 (no rounding divide) and the longest
    right shift the fast path takes (`fast`, 23); past it (`long`, 29), a bias too close to
    2^31 for the driver's accumulator bound, and channels with scale > 1 (`left`, a left
    shift) must route the call to the general epilogue. Zero points include both extremes,
    clamps vary; K past 64 runs AVX2's 4-row tiles, a last partial one included. Every output
    is exact."""
    kernels = _kernels(name)
    rng = np.random.default_rng({"fast": 11, "long": 13, "left": 12}[shifts])
    for m, n, k in ((64, 48, 8), (37, 32, 27), (13, 50, 16), (40, 16, 112), (50, 24, 8), (30, 8, 48), (23, 40, 100)):
        a = rng.integers(-128, 128, (m, k), dtype=np.int8)
        b = rng.integers(-127, 128, (n, k), dtype=np.int8)
        za = int(rng.integers(-128, 128))
        bias = rng.integers(-2**20, 2**20, n).astype(np.int32)
        b[0], b[0, 0], bias[0] = 0, 1, 0  # column 0: |acc| <= 255, in range at shift 0, both signs
        if k >= 65:
            bias[2] = 2**31 - 2**22  # no wrap, but past the driver's |acc| bound (K * 255^2)
        acc = (a.astype(np.int64) - za) @ b.astype(np.int64).T + bias
        scale = rng.uniform(0.5, 2.0, n) / np.abs(acc).max(axis=0).clip(1) * 127
        scale[0] = 0.75  # shift 0: no rounding divide
        scale[1 % n] = 2.0 ** -30 if shifts == "long" else 2.0 ** -24  # right shift 29 / 23
        if k >= 65:  # h + 2^(right - 1) would pass 2^31 for the rows with the larger sums
            scale[2] = 0.9999 * 2.0 ** -23
        if shifts == "left":
            scale[n // 2] = 3.0  # scale > 1: left shift 2
        mult, shift = qm.quantize_multiplier(scale)
        assert (shift > 0).any() == (shifts == "left") and (shift == 0).any()
        for zp, lo, hi in ((0, -128, 127), (-5, -128, 127), (12, 0, 100), (-128, -128, 127), (127, -128, 127)):
            rq = native.Requant.make(mult, shift, zp, lo, hi, channels=n)
            got = kernels.gemm_s8(a, kernels.pack(b), rq, bias=bias, a_zero_point=za)
            np.testing.assert_array_equal(got, qm.requantize(acc, mult, shift, zp, lo, hi))


def test_backward_shapes_without_copies(kernels: native.NativeKernels) -> None:
    """dW = X^T . dY and dX = dY . W^T on views of the forward tensors."""
    rng = np.random.default_rng(5)
    x = rng.integers(-128, 128, (33, 19), dtype=np.int8)
    dy = rng.integers(-128, 128, (33, 7), dtype=np.int8)
    w = rng.integers(-127, 128, (7, 19), dtype=np.int8)
    dw = kernels.matmul_s32(x.T, dy, a_zero_point=-3, b_zero_point=5)
    np.testing.assert_array_equal(dw, (x.T.astype(np.int64) + 3) @ (dy.astype(np.int64) - 5))
    dx = kernels.matmul_s32(dy, w, b_zero_point=0)
    np.testing.assert_array_equal(dx, dy.astype(np.int64) @ w.astype(np.int64))
    every_other = x[::2, ::3]  # arbitrary strides work too
    got = kernels.matmul_s32(every_other, w[:, ::3].T)
    np.testing.assert_array_equal(got, every_other.astype(np.int64) @ w[:, ::3].T.astype(np.int64))


# ----------------------------------------------------------------------------- convolutions

@pytest.mark.parametrize("name", sorted(ALL_VARIANTS))
@HYP
@given(batch=st.integers(1, 2), h=st.integers(1, 11), w=st.integers(1, 11), c=st.integers(1, 21),
       oc=st.integers(1, 21), kh=st.integers(1, 4), kw=st.integers(1, 4), sh=st.integers(1, 3), sw=st.integers(1, 3),
       dh=st.integers(1, 2), dw=st.integers(1, 2), padding=st.sampled_from(["SAME", "VALID"]),
       threads=st.sampled_from([1, 2]), with_bias=st.booleans(), seed=st.integers(0, 2**31))
def test_conv2d_matches_reference(name: str, batch: int, h: int, w: int, c: int, oc: int, kh: int, kw: int,
                                  sh: int, sw: int, dh: int, dw: int, padding: str, threads: int,
                                  with_bias: bool, seed: int) -> None:
    kernels = _kernels(name)
    wp = _window("CONV_2D", (h, w), (kh, kw), (sh, sw), (dh, dw), padding)
    if min(wp.out_hw) < 1:
        return
    rng = np.random.default_rng(seed)
    x = rng.integers(-128, 128, (batch, h, w, c), dtype=np.int8)
    filt = rng.integers(-127, 128, (oc, kh, kw, c), dtype=np.int8)
    zx = int(rng.integers(-128, 128))
    bias = rng.integers(-20000, 20000, oc).astype(np.int32) if with_bias else None
    acc = ops.conv_accumulate(x, filt, wp, -zx) + (0 if bias is None else bias)
    mult, shift = _requant(rng, oc, 128.0 * 128 * np.sqrt(kh * kw * c))
    zp = int(rng.integers(-30, 31))
    rq = native.Requant.make(mult, shift, zp, -128, 127, channels=oc)
    got = kernels.conv2d(x, kernels.conv_filter(filt), rq, input_zero_point=zx, bias=bias, stride=(sh, sw),
                         dilation=(dh, dw), padding=padding, threads=threads)
    np.testing.assert_array_equal(got, qm.requantize(acc, mult, shift, zp, -128, 127))


@pytest.mark.parametrize("name", sorted(ALL_VARIANTS))
@HYP
@given(batch=st.integers(1, 2), h=st.integers(1, 12), w=st.integers(1, 12), c=st.integers(1, 40),
       mult_d=st.integers(1, 3), kh=st.integers(1, 4), kw=st.integers(1, 4), sh=st.integers(1, 3),
       sw=st.integers(1, 3), dh=st.integers(1, 2), dw=st.integers(1, 2), padding=st.sampled_from(["SAME", "VALID"]),
       act=st.sampled_from([(-128, 127), (-128, 0), (-20, 100)]), seed=st.integers(0, 2**31))
def test_depthwise_matches_reference(name: str, batch: int, h: int, w: int, c: int, mult_d: int, kh: int, kw: int,
                                     sh: int, sw: int, dh: int, dw: int, padding: str, act: tuple[int, int],
                                     seed: int) -> None:
    kernels = _kernels(name)
    wp = _window("DEPTHWISE_CONV_2D", (h, w), (kh, kw), (sh, sw), (dh, dw), padding)
    if min(wp.out_hw) < 1:
        return
    rng = np.random.default_rng(seed)
    oc = c * mult_d
    x = rng.integers(-128, 128, (batch, h, w, c), dtype=np.int8)
    filt = rng.integers(-127, 128, (1, kh, kw, oc), dtype=np.int8)
    zx = int(rng.integers(-128, 128))
    bias = rng.integers(-5000, 5000, oc).astype(np.int32)
    acc = ops.depthwise_accumulate(x, filt, wp, -zx, mult_d) + bias
    mult, shift = _requant(rng, oc, 128.0 * 128 * np.sqrt(kh * kw))
    rq = native.Requant.make(mult, shift, 5, act[0], act[1], channels=oc)
    got = kernels.depthwise_conv2d(x, kernels.depthwise_filter(filt, mult_d), rq, input_zero_point=zx, bias=bias,
                                   stride=(sh, sw), dilation=(dh, dw), padding=padding, threads=2)
    np.testing.assert_array_equal(got, qm.requantize(acc, mult, shift, 5, act[0], act[1]))


@pytest.mark.parametrize("name", sorted(ALL_VARIANTS))
@HYP
@given(c=st.integers(41, 200), w=st.integers(1, 70), s=st.integers(1, 2), dm=st.sampled_from([1, 2]),
       shifts=st.sampled_from([(-12, -2), (-31, 3), (-23, -23), (-24, -24), (0, 0)]), seed=st.integers(0, 2**31))
def test_depthwise_wide_rows_matches_reference(name: str, c: int, w: int, s: int, dm: int, shifts: tuple[int, int],
                                               seed: int) -> None:
    """3x3 depthwise over many channels and long interior runs (the 512-bit kernel's 64-channel
    blocks, channel tails and packed pixels), weights including -128, left and large right shifts."""
    kernels = _kernels(name)
    wp = _window("DEPTHWISE_CONV_2D", (3, w), (3, 3), (s, s), (1, 1), "SAME")
    rng = np.random.default_rng(seed)
    oc = c * dm
    x = rng.integers(-128, 128, (2, 3, w, c), dtype=np.int8)
    filt = rng.integers(-128, 128, (1, 3, 3, oc), dtype=np.int8)
    zx = int(rng.integers(-128, 128))
    bias = rng.integers(-2**20, 2**20, oc).astype(np.int32)
    acc = ops.depthwise_accumulate(x, filt, wp, -zx, dm) + bias
    mult = rng.integers(2**30, 2**31, oc).astype(np.int32)
    shift = rng.integers(shifts[0], shifts[1] + 1, oc).astype(np.int32)
    zp = int(rng.integers(-128, 128))
    rq = native.Requant.make(mult, shift, zp, -128, 127, channels=oc)
    got = kernels.depthwise_conv2d(x, kernels.depthwise_filter(filt, dm), rq, input_zero_point=zx, bias=bias,
                                   stride=(s, s), padding="SAME", threads=1)
    np.testing.assert_array_equal(got, qm.requantize(acc, mult, shift, zp, -128, 127))


@pytest.mark.parametrize("name", sorted(ALL_VARIANTS))
@HYP
@given(n=st.integers(1, 300), act=st.sampled_from(["NONE", "RELU", "RELU6"]), seed=st.integers(0, 2**31))
def test_add_matches_reference(name: str, n: int, act: str, seed: int) -> None:
    kernels = _kernels(name)
    rng = np.random.default_rng(seed)
    graph, op = add_graph(rng, (1, n), act)
    a, b = (rng.integers(-128, 128, (1, n), dtype=np.int8) for _ in range(2))
    params = add_params(graph, op)
    assert params is not None
    np.testing.assert_array_equal(kernels.add(a, b, params), ops.KERNELS["ADD"](graph, op, [a, b]))


@HYP
@given(n=st.integers(1, 3), h=st.integers(1, 13), w=st.integers(1, 13), c=st.integers(1, 70), keep=st.booleans(),
       seed=st.integers(0, 2**31))
def test_mean_over_hw_matches_reference(n: int, h: int, w: int, c: int, keep: bool, seed: int) -> None:
    rng = np.random.default_rng(seed)
    graph, op = mean_graph(rng, (n, h, w, c))
    op.options["keep_dims"] = keep
    x = rng.integers(-128, 128, (n, h, w, c), dtype=np.int8)
    args = [x, graph.tensor("axes").data]
    got = NativeOps(native.NativeKernels(), graph).table()["MEAN"](graph, op, args)
    np.testing.assert_array_equal(got, ops.KERNELS["MEAN"](graph, op, args))


def test_quantize_nchw_matches_reference_rounding() -> None:
    kernels = native.NativeKernels()
    rng = np.random.default_rng(9)
    scale, zp = np.float32(0.0173), -7
    x = rng.normal(0, 1.5, (3, 4, 5, 6)).astype(np.float32)
    ties = (np.arange(-300, 300, dtype=np.float32) + np.float32(0.5)) * scale  # near-exact halves
    x.reshape(-1)[: ties.size] = ties[: x.size]
    x.reshape(-1)[-4:] = [np.inf, -np.inf, 3e38, -3e38]
    with np.errstate(over="ignore", invalid="ignore"):  # the reference divides inf and 3e38 too
        expected = qm.quantize(nchw_to_nhwc(x), scale, zp)
    np.testing.assert_array_equal(kernels.quantize_nchw(x, scale, zp), expected)
    flat = rng.normal(0, 3, (5, 17)).astype(np.float32)
    np.testing.assert_array_equal(kernels.quantize_nchw(flat, 0.02, 100), qm.quantize(flat, 0.02, 100))
    # camera-sized planes (past the C side's 4,096-pixel blocks, a ragged last block), one channel
    for shape in ((2, 3, 97, 95), (2, 1, 70, 70)):
        big = rng.normal(0, 2, shape).astype(np.float32)
        big.reshape(-1)[::997] = np.nan
        expected = qm.quantize(nchw_to_nhwc(big), scale, zp)
        np.testing.assert_array_equal(kernels.quantize_nchw(big, scale, zp), expected)


@pytest.mark.parametrize("with_native", [True, False])
def test_engines_input_quantisation_is_the_reference_with_or_without_the_library(
        with_native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """engines/_common.quantize_to_nhwc (tflite's input): the C pass where the library loads,
    numpy where it does not; both equal quant_math.quantize after the layout change."""
    if with_native:
        assert _common._native_kernels() is not None  # noqa: SLF001 - the C pass is the one under test
    else:
        monkeypatch.setattr(_common, "_native_kernels", lambda: None)
    rng = np.random.default_rng(4)
    for shape in ((2, 3, 9, 7), (4, 10)):
        x = rng.normal(0, 2, shape).astype(np.float32)
        x.reshape(-1)[::13] = np.nan
        want = qm.quantize(nchw_to_nhwc(x), 0.03, -9)
        np.testing.assert_array_equal(_common.quantize_to_nhwc(x, 0.03, -9), want)


@pytest.mark.parametrize("name", sorted(ALL_VARIANTS))
def test_pad_folded_into_valid_convolutions_agrees_with_tflite(name: str) -> None:
    """Exported MobileNets pad explicitly before stride-2 VALID depthwise convolutions."""
    from edge_agent.int8.testing import GraphBuilder

    rng = np.random.default_rng(12)
    b = GraphBuilder(rng, (2, 9, 10, 6), jitter=0.2)
    x = b.pad(b.input, [[0, 0], [0, 1], [1, 2], [0, 0]])
    x = b.depthwise(x, 3, stride=2, padding="VALID", multiplier=2)
    x = b.pad(x, [[0, 0], [1, 1], [1, 1], [0, 0]])
    x = b.conv(x, 5, 3, stride=1, padding="VALID")
    shared = b.pad(x, [[0, 0], [1, 0], [0, 0], [0, 0]])  # two consumers: stays a PAD
    graph = b.build(b.concat([b.conv(shared, 4, 1, padding="VALID"), b.add(shared, shared)], axis=3))
    fused = fuse_pads(graph)
    assert [op.kind for op in fused.ops].count("PAD") == 1
    assert [op.options.get("native_pad") for op in fused.ops if op.kind != "PAD"][:2] == [(0, 1, 1, 2), (1, 1, 1, 1)]
    got, expected = _tflite_and_native(graph, b.random_input((2, 9, 10, 6)), name)
    np.testing.assert_array_equal(got, expected)


# ----------------------------------------------------------------------------- bad input

def test_clear_errors_on_bad_arrays(kernels: native.NativeKernels) -> None:
    rng = np.random.default_rng(0)
    filt = kernels.conv_filter(rng.integers(-127, 128, (4, 3, 3, 5), dtype=np.int8))
    rq = native.Requant.make(1 << 30, -8, 0, channels=4)
    x = rng.integers(-128, 128, (1, 6, 6, 5), dtype=np.int8)
    with pytest.raises(ValueError, match="input must be int8, got int16"):
        kernels.conv2d(x.astype(np.int16), filt, rq, input_zero_point=0)
    with pytest.raises(ValueError, match="C-contiguous"):
        kernels.conv2d(x[:, ::2], filt, rq, input_zero_point=0)
    with pytest.raises(ValueError, match="input has 4 channels, the filter expects 5"):
        kernels.conv2d(x[..., :4].copy(), filt, rq, input_zero_point=0)
    with pytest.raises(ValueError, match="input zero point must lie in"):
        kernels.conv2d(x, filt, rq, input_zero_point=200)
    with pytest.raises(ValueError, match="shift must lie in"):
        native.Requant.make(1 << 30, 31, 0, channels=4)
    with pytest.raises(ValueError, match="multiplier must have shape"):
        native.Requant.make(np.ones(3, np.int64), 0, 0, channels=4)
    with pytest.raises(ValueError, match="does not fit"):
        kernels.conv2d(rng.integers(-128, 128, (1, 2, 2, 5), dtype=np.int8), filt, rq, input_zero_point=0,
                       padding="VALID")
    packed = kernels.pack(rng.integers(-128, 128, (4, 9), dtype=np.int8))
    with pytest.raises(ValueError, match=r"a is \[2, 8\] but b was packed with K = 9|shape \(2, 9\)"):
        kernels.gemm_s32(rng.integers(-128, 128, (2, 8), dtype=np.int8), packed)
    with pytest.raises(ValueError, match="out must have shape"):
        kernels.gemm_s32(rng.integers(-128, 128, (2, 9), dtype=np.int8), packed, out=np.empty((2, 5), np.int32))
    with pytest.raises(TypeError, match="numpy array"):
        kernels.pack([[1, 2]])  # type: ignore[arg-type]
    other = next((v for v in ALL_VARIANTS.values() if v.runnable and v.name != kernels.name), None)
    if other is not None:
        with pytest.raises(ValueError, match="packed for variant"):
            native.NativeKernels(other.name).gemm_s32(rng.integers(-128, 128, (2, 9), dtype=np.int8), packed)


# ----------------------------------------------------------------------------- engine and tflite

def _tflite_and_native(graph, x: np.ndarray, variant: str) -> tuple[np.ndarray, np.ndarray]:
    from edge_agent.int8.testing import run_tflite
    from edge_agent.int8.tflite_reader import read_tflite
    from edge_agent.int8.tflite_writer import write_tflite

    model = write_tflite(graph)
    expected = run_tflite(model, x, reference_kernels=True)
    runner = NativeRunner(read_tflite(model), kernels=_kernels(variant), threads=2)
    return runner.run_int8(x), expected


@pytest.mark.parametrize("name", sorted(ALL_VARIANTS))
@settings(max_examples=25, deadline=None)
@given(kind=st.sampled_from(["conv", "depthwise", "fc"]), h=st.integers(2, 9), w=st.integers(2, 9),
       c=st.integers(1, 12), units=st.integers(1, 13), kernel=st.integers(1, 3), stride=st.integers(1, 3),
       dilation=st.integers(1, 2), padding=st.sampled_from(["SAME", "VALID"]), multiplier=st.integers(1, 3),
       activation=st.sampled_from(["NONE", "RELU", "RELU6"]), per_channel=st.booleans(), seed=st.integers(0, 2**31))
def test_single_ops_agree_with_tflite_runtime(name: str, kind: str, h: int, w: int, c: int, units: int,
                                              kernel: int, stride: int, dilation: int, padding: str,
                                              multiplier: int, activation: str, per_channel: bool,
                                              seed: int) -> None:
    from edge_agent.int8.testing import GraphBuilder

    if padding == "VALID" and (kernel - 1) * dilation + 1 > min(h, w):
        return
    rng = np.random.default_rng(seed)
    b = GraphBuilder(rng, (2, h, w, c), jitter=0.3)
    if kind == "conv":
        out = b.conv(b.input, units, kernel, stride=stride, padding=padding, dilation=dilation,
                     activation=activation, per_channel=per_channel)
    elif kind == "depthwise":
        out = b.depthwise(b.input, kernel, multiplier=multiplier, stride=stride, padding=padding,
                          dilation=dilation, activation=activation, per_channel=per_channel)
    else:
        out = b.fc(b.reshape(b.input, [2, h * w * c]), units, activation=activation, per_channel=per_channel)
    got, expected = _tflite_and_native(b.build(out), b.random_input((2, h, w, c)), name)
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("name", sorted(ALL_VARIANTS))
def test_whole_networks_agree_with_tflite_runtime(name: str) -> None:
    from edge_agent.int8.testing import mobilenet_v2_graph, plain_cnn_graph

    rng = np.random.default_rng(11)
    for graph in (mobilenet_v2_graph(rng, batch=3, jitter=0.2), plain_cnn_graph(rng, batch=3, jitter=0.2)):
        x = rng.integers(-128, 128, graph.tensor(graph.inputs[0]).shape, dtype=np.int8)
        got, expected = _tflite_and_native(graph, x, name)
        np.testing.assert_array_equal(got, expected)


def _bundle(tmp_path: Path):
    """A real bundle around a random int8 MobileNet (no MXNet needed for the native path)."""
    from edge_agent.int8 import bundle as B
    from edge_agent.int8.testing import mobilenet_v2_graph
    from edge_agent.int8.tflite_writer import write_tflite

    graph = mobilenet_v2_graph(np.random.default_rng(2), batch=1, jitter=0.1)
    calib = io.BytesIO()
    np.savez(calib, x=np.random.default_rng(3).standard_normal((4, 3, 24, 24)).astype(np.float32))
    files = {B.BACKBONE_ONNX: b"unused by this test", B.BACKBONE_INT8: write_tflite(graph),
             B.HEAD_SYMBOL: b"{}", B.HEAD_PARAMS: b"", B.CALIBRATION: calib.getvalue()}
    manifest = B.Manifest(name="native-test", version="1", input=B.InputSpec(shape=(3, 24, 24)), labels=["a", "b"],
                          split_tensor="features", feature_shape=(10,), files={})
    return B.write_bundle_dir(tmp_path / "bundle", files, manifest)


def test_engine_prepares_a_bundle_and_matches_the_reference(tmp_path: Path) -> None:
    from edge_agent.int8.engines.reference import ReferenceEngine

    avail = NativeEngine().availability()
    assert avail.available, avail.reason
    assert avail.detail["variant"] == native.NativeKernels().name and avail.detail["variant"] in avail.reason
    bundle = _bundle(tmp_path)
    runner = NativeEngine().prepare(bundle, threads=2)
    reference = ReferenceEngine().prepare(bundle)
    x8 = np.random.default_rng(4).integers(-128, 128, (5, 24, 24, 3), dtype=np.int8)
    np.testing.assert_array_equal(runner.run_int8(x8), reference.run_int8(x8))
    xf = bundle.calibration()
    np.testing.assert_array_equal(runner.run(xf), reference.run(xf))
    runner.close()


def test_native_ops_fall_back_for_broadcasting_add() -> None:
    """ADD with broadcasting is not a native kernel: the numpy reference handles it."""
    rng = np.random.default_rng(8)
    graph, op = add_graph(rng, (2, 3, 4), "NONE")
    a = rng.integers(-128, 128, (2, 3, 4), dtype=np.int8)
    b = rng.integers(-128, 128, (1, 3, 1), dtype=np.int8)
    table = NativeOps(native.NativeKernels(), graph).table()
    np.testing.assert_array_equal(table["ADD"](graph, op, [a, b]), ops.KERNELS["ADD"](graph, op, [a, b]))


def test_install_without_a_compiler_still_installs(tmp_path: Path) -> None:
    """setup.py never fails the install: with a C compiler that fails, the wheel builds
    without the library, and the engine then reports itself unavailable with the reason."""
    repo = Path(__file__).resolve().parents[2]
    src = tmp_path / "src"  # a copy: the build must not touch the working tree's build/ or .so
    shutil.copytree(repo, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.so", "*.o", "__pycache__", ".hypothesis", ".pytest_cache",
        ".ruff_cache", "*.egg-info", "demo-out", "BENCHMARKS.md"))
    env = {**os.environ, "CC": "/bin/false"}
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                            "-v", "-w", str(tmp_path / "dist")], capture_output=True, text=True, env=env,
                           timeout=300, check=False)
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
    assert "edge-agent kernels: not built" in build.stdout + build.stderr
    wheel = next((tmp_path / "dist").glob("mxedge_agent-*.whl"))
    assert not [n for n in zipfile.ZipFile(wheel).namelist() if "_kernels" in n]
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(tmp_path / "site"),
                    str(wheel)], check=True, timeout=300)
    probe = ("from edge_agent.int8.engines.native import NativeEngine; a = NativeEngine().availability(); "
             "print(a.available, a.reason)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(tmp_path / "site")}, timeout=120, check=True)
    assert out.stdout.startswith("False native kernels not built"), out.stdout + out.stderr
