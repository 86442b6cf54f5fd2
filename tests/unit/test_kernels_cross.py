"""The native kernels' C test program, built for aarch64 and armv7 with Debian's cross
compilers and run under qemu user emulation -- plus the same program built for this host.

Inputs and expected outputs come from the numpy reference (reference_ops / quant_math),
written to a binary case file that kernels/test/test_kernels.c reads; the program runs
every case on every variant the (emulated) CPU supports and prints one line per variant.
Variants are compiled exactly as setup.py does, from kernels/variants.json (flag sets
tried in order), so a variant the cross compiler refuses would show up as missing.
qemu's `-cpu max` has NEON, the dot-product extension and i8mm, so neon_dot runs too, its
GEMMs and convolutions on the SMMLA kernels.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from edge_agent.hardware.cpu import KernelCheck, read_cpu
from edge_agent.hardware.sysfs import Problems, SysRoot
from edge_agent.int8 import quant_math as qm
from edge_agent.int8 import reference_ops as ops
from edge_agent.int8.engines.native import add_params, mean_params
from edge_agent.int8.graph import QGraph, QOp, QTensor

REPO = Path(__file__).resolve().parents[2]
KERNELS = REPO / "kernels"
SPEC = json.loads((KERNELS / "variants.json").read_text())

GEMM, CONV, DEPTHWISE, REQUANT, ADD, MEAN, QUANTIZE = 1, 2, 3, 4, 5, 6, 7


@dataclass
class Target:
    name: str
    cc: str
    runner: list[str]  # command prefix that executes a binary for the target
    expected_variants: tuple[str, ...]


TARGETS = {
    "aarch64": Target("aarch64", "aarch64-linux-gnu-gcc", ["qemu-aarch64", "-cpu", "max"],
                      ("neon_dot", "neon", "portable")),
    "armv7": Target("armv7", "arm-linux-gnueabihf-gcc", ["qemu-arm", "-cpu", "max"], ("armv7_neon", "portable")),
}


# ------------------------------------------------------------------------ case file writer

def _case(kind: int, params: list[int], arrays: list[np.ndarray | None]) -> bytes:
    out = [struct.pack("<II", kind, len(params)), struct.pack(f"<{len(params)}q", *params),
           struct.pack("<I", len(arrays))]
    for arr in arrays:
        data = b"" if arr is None else np.ascontiguousarray(arr).tobytes()
        out += [struct.pack("<Q", len(data)), data]
    return b"".join(out)


def _requant_params(rng: np.random.Generator, channels: int, acc_scale: float) -> tuple[np.ndarray, ...]:
    # Scales around 1/acc_scale keep outputs inside int8 (some saturate, which is tested too).
    real = rng.uniform(0.3, 3.0, channels) / acc_scale
    mult, shift = qm.quantize_multiplier(real)
    return mult.astype(np.int32), shift.astype(np.int32)


def gemm_case(rng: np.random.Generator, m: int, n: int, k: int, *, trans_a: bool, trans_b: bool,
              out_int32: bool) -> bytes:
    a = rng.integers(-128, 128, (m, k), dtype=np.int8)
    b = rng.integers(-128, 128, (n, k), dtype=np.int8)
    za, zb = (int(v) for v in rng.integers(-128, 128, 2))
    bias = rng.integers(-20000, 20000, n).astype(np.int32)
    acc = (a.astype(np.int64) - za) @ (b.astype(np.int64) - zb).T + bias
    # Stored transposed when asked: the kernel reads it through strides, as numpy views do.
    a_store, a_strides = (a.T.copy(), (1, m)) if trans_a else (a, (k, 1))
    b_store, b_strides = (b.T.copy(), (1, n)) if trans_b else (b, (k, 1))
    if out_int32:
        expected = acc.astype(np.int32)
        mult = shift = None
        zp, lo, hi = 0, -128, 127
    else:
        mult, shift = _requant_params(rng, n, 128.0 * np.sqrt(k) * 40)
        zp = int(rng.integers(-20, 21))
        lo, hi = sorted(int(v) for v in rng.integers(-128, 128, 2))
        expected = qm.requantize(acc, mult, shift, zp, lo, hi)
    params = [m, n, k, a_strides[0], a_strides[1], za, zb, zp, lo, hi, int(out_int32), b_strides[0], b_strides[1]]
    return _case(GEMM, params, [a_store, b_store, bias, mult, shift, expected])


def conv_case(rng: np.random.Generator, *, depthwise: bool, batch: int, hw: tuple[int, int], channels: int,
              out_channels: int, kernel: tuple[int, int], stride: tuple[int, int], dilation: tuple[int, int],
              padding: str, multiplier: int = 1, with_bias: bool = True) -> bytes | None:
    op = QOp("DEPTHWISE_CONV_2D" if depthwise else "CONV_2D", [], [],
             {"stride_h": stride[0], "stride_w": stride[1], "dilation_h": dilation[0],
              "dilation_w": dilation[1], "padding": padding})
    wp = ops.window_params(op, hw, kernel)
    if min(wp.out_hw) < 1:
        return None
    x = rng.integers(-128, 128, (batch, *hw, channels), dtype=np.int8)
    zx = int(rng.integers(-128, 128))
    if depthwise:
        out_channels = channels * multiplier
        w = rng.integers(-127, 128, (1, *kernel, out_channels), dtype=np.int8)
        acc = ops.depthwise_accumulate(x, w, wp, -zx, multiplier)
        w_store = w.reshape(-1, out_channels)
        fan_in = kernel[0] * kernel[1]
    else:
        w = rng.integers(-127, 128, (out_channels, *kernel, channels), dtype=np.int8)
        acc = ops.conv_accumulate(x, w, wp, -zx)
        w_store = w.reshape(out_channels, -1)
        fan_in = kernel[0] * kernel[1] * channels
    bias = rng.integers(-5000, 5000, out_channels).astype(np.int32) if with_bias else None
    if bias is not None:
        acc = acc + bias
    mult, shift = _requant_params(rng, out_channels, 128.0 * np.sqrt(fan_in) * 40)
    zp = int(rng.integers(-30, 31))
    lo, hi = (-128, 127) if rng.random() < 0.5 else (int(rng.integers(-128, 0)), int(rng.integers(0, 128)))
    expected = qm.requantize(acc, mult, shift, zp, lo, hi)
    params = [batch, hw[0], hw[1], channels, wp.out_hw[0], wp.out_hw[1], out_channels, kernel[0], kernel[1],
              stride[0], stride[1], dilation[0], dilation[1], wp.pad[0], wp.pad[1], multiplier, zx, zp, lo, hi]
    return _case(DEPTHWISE if depthwise else CONV, params, [x, w_store, bias, mult, shift, expected])


def requant_case(rng: np.random.Generator, n: int) -> bytes:
    edges = np.array([qm.INT32_MIN, qm.INT32_MIN + 1, -1, 0, 1, qm.INT32_MAX - 1, qm.INT32_MAX], dtype=np.int64)
    acc = np.concatenate([edges, rng.integers(qm.INT32_MIN, qm.INT32_MAX, n, endpoint=True)]).astype(np.int32)
    count = acc.size
    mult = rng.integers(0, 2**31, count).astype(np.int32)
    mult[: edges.size] = [0, 1 << 30, (1 << 31) - 1, 1 << 30, 1518500250, (1 << 31) - 1, 1 << 30]
    shift = rng.integers(-31, 31, count).astype(np.int32)
    zp, lo, hi = int(rng.integers(-128, 128)), -128, 127
    expected = qm.requantize(acc, mult, shift, zp, lo, hi)
    return _case(REQUANT, [count, zp, lo, hi], [acc, mult, shift, expected])


def add_graph(rng: np.random.Generator, shape: tuple[int, ...], activation: str) -> tuple[QGraph, QOp]:
    """One int8 ADD with random scales (ratios up to ~20x) and zero points."""
    def act(name: str, scale: float) -> QTensor:
        return QTensor(name, shape, "int8", np.array([scale], np.float32),
                       np.array([int(rng.integers(-128, 128))], np.int64))
    s1, s2 = (float(np.exp(rng.uniform(-5, -2))) for _ in range(2))
    tensors = {"a": act("a", s1), "b": act("b", s2), "y": act("y", float((s1 + s2) * rng.uniform(0.5, 2.0)))}
    op = QOp("ADD", ["a", "b"], ["y"], {"activation": activation})
    return QGraph(tensors, [op], ["a", "b"], ["y"], "add"), op


def add_case(rng: np.random.Generator, n: int) -> bytes:
    graph, op = add_graph(rng, (n,), str(rng.choice(["NONE", "RELU", "RELU6"])))
    x1, x2 = (rng.integers(-128, 128, n, dtype=np.int8) for _ in range(2))
    expected = ops.KERNELS["ADD"](graph, op, [x1, x2])
    p = add_params(graph, op)
    assert p is not None
    params = [n, p.zp1, p.mult1, p.shift1, p.zp2, p.mult2, p.shift2, p.out_mult, p.out_shift, p.out_zp,
              p.act_min, p.act_max]
    return _case(ADD, params, [x1, x2, expected])


def mean_graph(rng: np.random.Generator, shape: tuple[int, int, int, int]) -> tuple[QGraph, QOp]:
    """One MEAN over axes (1, 2), keep_dims, with a random scale ratio (either way round)."""
    s_in = float(np.exp(rng.uniform(-5, -2)))
    zp_in, zp_out = (np.array([int(v)], np.int64) for v in rng.integers(-128, 128, 2))
    tensors = {
        "x": QTensor("x", shape, "int8", np.array([s_in], np.float32), zp_in),
        "axes": QTensor("axes", (2,), "int32", data=np.array([1, 2], np.int32)),
        "y": QTensor("y", (shape[0], 1, 1, shape[3]), "int8",
                     np.array([s_in * rng.uniform(0.2, 3.0)], np.float32), zp_out),
    }
    op = QOp("MEAN", ["x", "axes"], ["y"], {"keep_dims": True})
    return QGraph(tensors, [op], ["x"], ["y"], "mean"), op


def mean_case(rng: np.random.Generator, shape: tuple[int, int, int, int]) -> bytes:
    graph, op = mean_graph(rng, shape)
    x = rng.integers(-128, 128, shape, dtype=np.int8)
    expected = ops.KERNELS["MEAN"](graph, op, [x, graph.tensor("axes").data])
    m, s = mean_params(graph, op, shape[1] * shape[2])
    params = [shape[0], shape[1] * shape[2], shape[3], ops.zp_of(graph.tensor("x")), m, s, ops.zp_of(graph.tensor("y"))]
    return _case(MEAN, params, [x, expected])


def quantize_case(rng: np.random.Generator, shape: tuple[int, int, int, int], specials: bool = False) -> bytes:
    """Float input edge: float32 division and round-half-away on the target's FPU (AArch64:
    the NEON loop for whole groups of 8, the scalar one for the rest). `specials` puts NaN,
    +-inf, values beyond 2^24 steps and the float just below a half at random places."""
    scale, zp = np.float32(rng.uniform(0.005, 0.05)), int(rng.integers(-128, 128))
    x = rng.normal(0, 40 * float(scale), shape).astype(np.float32)
    halves = (np.arange(x.size, dtype=np.float32) - x.size // 2 + np.float32(0.5)) * scale
    x.reshape(-1)[::3] = halves[::3]
    if specials:
        below_half = np.nextafter(np.float32(0.5), np.float32(0)) * scale
        values = np.array([np.nan, np.inf, -np.inf, 3e30, -3e30, 2.0**24 * scale, -below_half, below_half,
                           -0.0, 127.5 * scale, -128.5 * scale], np.float32)
        x.reshape(-1)[rng.choice(x.size, 4 * values.size, replace=False)] = np.tile(values, 4)
    expected = qm.quantize(x.transpose(0, 2, 3, 1), scale, zp)
    params = [shape[0], shape[1], shape[2] * shape[3], zp]
    return _case(QUANTIZE, params, [x, np.array([scale], np.float32), expected])


def write_cases(path: Path, seed: int = 0) -> int:
    """A compact case set for emulation: odd sizes, every stride/padding/dilation and depth
    multiplier combination at least once, transposed operands, int8 and int32 outputs."""
    rng = np.random.default_rng(seed)
    cases: list[bytes] = [requant_case(rng, 500), requant_case(rng, 13)]
    cases += [add_case(rng, n) for n in (1, 7, 8, 33, 300, 300, 300)]
    cases += [mean_case(rng, shape) for shape in ((1, 1, 1, 1), (2, 3, 3, 40), (1, 7, 5, 9), (3, 12, 12, 17))]
    cases += [quantize_case(rng, shape) for shape in ((1, 1, 1, 1), (2, 3, 5, 7))]
    cases += [quantize_case(rng, (1, 1, 1, 203), specials=True), quantize_case(rng, (2, 3, 9, 9), specials=True)]
    for m, n, k in ((1, 1, 1), (3, 5, 7), (17, 9, 33), (5, 13, 16), (8, 4, 64), (2, 19, 100), (31, 3, 5)):
        for trans_a, trans_b in ((False, False), (True, False), (False, True)):
            cases.append(gemm_case(rng, m, n, k, trans_a=trans_a, trans_b=trans_b, out_int32=bool(rng.random() < 0.4)))
    for depthwise in (False, True):
        for padding in ("SAME", "VALID"):
            for stride in ((1, 1), (2, 2), (1, 2), (3, 1)):
                for dilation in ((1, 1), (2, 1)):
                    hw = (int(rng.integers(3, 9)), int(rng.integers(3, 9)))
                    kernel = (3, 3) if rng.random() < 0.6 else (int(rng.integers(1, 4)), int(rng.integers(1, 4)))
                    case = conv_case(
                        rng, depthwise=depthwise, batch=int(rng.integers(1, 3)), hw=hw,
                        channels=int(rng.integers(1, 21)), out_channels=int(rng.integers(1, 21)), kernel=kernel,
                        stride=stride, dilation=dilation, padding=padding,
                        multiplier=int(rng.integers(1, 4)) if depthwise else 1, with_bias=bool(rng.random() < 0.8))
                    if case is not None:
                        cases.append(case)
    # 1x1 convolutions whose rows are read in place (channels a multiple of the K chunk).
    for channels in (16, 32, 24):
        cases.append(conv_case(rng, depthwise=False, batch=1, hw=(5, 7), channels=channels, out_channels=11,
                               kernel=(1, 1), stride=(1, 1), dilation=(1, 1), padding="SAME"))
    path.write_bytes(b"EAKT" + struct.pack("<I", len(cases)) + b"".join(cases))
    return len(cases)


# ------------------------------------------------------------------------ build and run

def build_test_program(cc: str, out: Path) -> list[str]:
    """Compile kernels/ + the C test for `cc`'s target, variant flags as in setup.py."""
    base = [cc, *SPEC["cflags"], f"-I{KERNELS}"]
    objects, defines, built = [], [], []
    for variant in SPEC["variants"]:
        obj = out.parent / f"{Path(variant['source']).stem}.o"
        for flags in variant["flag_sets"]:
            proc = subprocess.run([*base, *flags, "-c", str(KERNELS / variant["source"]), "-o", str(obj)],
                                  capture_output=True, text=True, check=False)
            if proc.returncode == 0:
                objects.append(str(obj))
                defines.append(f"-D{variant['define']}")
                built.append(variant["name"])
                break
    sources = [str(KERNELS / name) for name in SPEC["common"]] + [str(KERNELS / "test" / "test_kernels.c")]
    subprocess.run([*base, *defines, "-static", *sources, *objects, "-o", str(out)], check=True,
                   capture_output=True, text=True)
    return built


def _run_program(runner: list[str], program: Path, cases: Path) -> tuple[int, dict[str, tuple[int, int]], str]:
    proc = subprocess.run([*runner, str(program), str(cases)], capture_output=True, text=True, timeout=240,
                          check=False)
    results: dict[str, tuple[int, int]] = {}
    for line in proc.stdout.splitlines():
        parts = line.split()
        if len(parts) == 6 and parts[0] == "variant" and parts[2] == "cases":
            results[parts[1]] = (int(parts[3]), int(parts[5]))
    return proc.returncode, results, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def case_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    path = tmp_path_factory.mktemp("cases") / "cases.bin"
    return path, write_cases(path)


@pytest.fixture(scope="module")
def host_program(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    program = tmp_path_factory.mktemp("host") / "test_kernels_host"
    return program, build_test_program("gcc", program)


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_cross_compiled_variants_agree_under_qemu(target: str, case_file: tuple[Path, int], tmp_path: Path) -> None:
    t = TARGETS[target]
    missing = [tool for tool in (t.cc, t.runner[0]) if shutil.which(tool) is None]
    # A missing tool is a missing install step, not missing hardware: fail, don't hide it.
    assert not missing, (f"{', '.join(missing)} not installed: run .ci/run's apt-get line (qemu-user "
                         "gcc-aarch64-linux-gnu gcc-arm-linux-gnueabihf libc6-dev-arm64-cross libc6-dev-armhf-cross)")
    program = tmp_path / f"test_kernels_{target}"
    built = build_test_program(t.cc, program)
    assert set(built) == ({"neon", "neon_dot"} if target == "aarch64" else {"neon"})
    rc, results, output = _run_program(t.runner, program, case_file[0])
    assert set(results) == set(t.expected_variants), output
    for variant, (cases, failures) in results.items():
        assert cases == case_file[1] and failures == 0, f"{target}/{variant}:\n{output}"
    assert rc == 0, output
    if target == "aarch64":  # qemu's -cpu max has i8mm: neon_dot's GEMMs ran on SMMLA (K step 8)
        assert "geometry neon_dot 4 4 8" in output and "geometry neon 4 4 16" in output, output


def test_neon_dot_without_i8mm_keeps_the_sdot_kernels(case_file: tuple[Path, int], tmp_path: Path) -> None:
    """The Raspberry Pi 5's Cortex-A76 has SDOT but no i8mm: neon_dot must pack for its SDOT
    kernels (K step 16), never the SMMLA ones, and agree on every case."""
    t = TARGETS["aarch64"]
    assert shutil.which(t.cc) and shutil.which(t.runner[0]), "run .ci/run's apt-get line"
    program = tmp_path / "test_kernels_aarch64"
    build_test_program(t.cc, program)
    rc, results, output = _run_program(["qemu-aarch64", "-cpu", "cortex-a76"], program, case_file[0])
    assert "geometry neon_dot 4 4 16" in output, output
    assert results.get("neon_dot") == (case_file[1], 0) and rc == 0, output


def test_host_build_of_the_c_test_agrees(case_file: tuple[Path, int], host_program: tuple[Path, list[str]]) -> None:
    """The same program natively: every x86 variant this CPU runs agrees; VNNI variants are
    compiled (the build must accept them) but only run where the CPU has VNNI -- qemu 7.2
    does not emulate AVX-VNNI / AVX512-VNNI, so there is no emulator for them here."""
    program, built = host_program
    rc, results, output = _run_program([], program, case_file[0])
    assert "portable" in results, output
    for variant, (cases, failures) in results.items():
        assert cases == case_file[1] and failures == 0, f"{variant}:\n{output}"
    assert rc == 0, output
    if "avx2" in built and "avx2" in Path("/proc/cpuinfo").read_text():
        assert "avx2" in results, output
    for name in built:  # each compiled variant either ran or says why not
        assert name in results or f"variant {name} skipped" in output, output


def test_case_file_detects_a_wrong_expected_output(tmp_path: Path, host_program: tuple[Path, list[str]]) -> None:
    """The harness can fail: corrupt one expected byte and the host program must report it."""
    rng = np.random.default_rng(1)
    case = gemm_case(rng, 4, 5, 6, trans_a=False, trans_b=False, out_int32=False)
    corrupted = bytearray(case)
    corrupted[-1] ^= 0x01  # last byte of the expected output
    path = tmp_path / "bad.bin"
    path.write_bytes(b"EAKT" + struct.pack("<I", 1) + bytes(corrupted))
    rc, results, output = _run_program([], host_program[0], path)
    assert rc == 1 and all(failures == 1 for _, failures in results.values()), output
    assert "FAIL variant=portable case=0 kind=1" in output


# ------------------------------------------------------- CPU features: kernels' check vs cpuinfo

def _kernel_check_under(runner: list[str], program: Path, tmp_path: Path) -> KernelCheck:
    """Which variants the emulated CPU runs, as the library's own auxv test says (no cases)."""
    empty = tmp_path / "none.bin"
    empty.write_bytes(b"EAKT" + struct.pack("<I", 0))
    proc = subprocess.run([*runner, str(program), str(empty)], capture_output=True, text=True, timeout=240,
                          check=True)
    features = {"portable": set(), "neon": {"asimd"}, "neon_dot": {"asimd", "asimddp"}}
    runs = {line.split()[1]: "skipped" not in line for line in proc.stdout.splitlines()
            if line.startswith("variant ")}
    return KernelCheck.of([(name, features[name], ok) for name, ok in runs.items()])


@pytest.mark.parametrize(("cpu", "dot"), [("max", True), ("cortex-a53", False)])
def test_kernels_auxv_check_beats_the_hosts_cpuinfo_under_qemu(cpu: str, dot: bool, tmp_path: Path) -> None:
    """Under qemu-user an aarch64 process reads the x86 host's /proc/cpuinfo. The probe must
    take the kernels' auxv answer (neon_dot on -cpu max, only neon on a Cortex-A53), keep
    both in the report, and say why."""
    t = TARGETS["aarch64"]
    assert shutil.which(t.cc) and shutil.which(t.runner[0]), "run .ci/run's apt-get line"
    program = tmp_path / "test_kernels_aarch64"
    build_test_program(t.cc, program)
    check = _kernel_check_under(["qemu-aarch64", "-cpu", cpu], program, tmp_path)
    assert check.variants == {"neon_dot": dot, "neon": True, "portable": True}

    root = tmp_path / "root"
    (root / "proc").mkdir(parents=True)
    (root / "proc/cpuinfo").write_text(X86_CPUINFO)  # what the emulated process sees
    sysroot = SysRoot(root, problems=Problems())
    info = read_cpu(sysroot, machine="aarch64", check=check)
    assert info.arch == "aarch64"
    assert info.int8_features["asimd"] is True and info.int8_features["asimddp"] is dot
    assert info.kernel_check["disagree"]["asimd"] == {"cpuinfo": False, "kernels": True}
    assert any("emulated" in p for p in sysroot.problems.items)
    # Without the check (a captured tree, not live) cpuinfo is all there is.
    assert read_cpu(SysRoot(root, problems=Problems()), check=None).arch == "x86_64"


X86_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx2 fma

"""
