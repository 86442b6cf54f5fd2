"""Native int8 kernels vs numpy fp32 (OpenBLAS) and tflite-runtime/XNNPACK, side by side.

Shapes: every layer of the MobileNetV2-style backbone (edge_agent.sim.models.mobilenet_v2,
width 0.35, 96x96 input) at a fine-tuning batch. Per distinct layer shape:
- native: the C kernel through its Python entry point (im2col, requantisation included);
- GEMM: the native int8 GEMM on the layer's (M, K, N) and numpy fp32 `matmul` (OpenBLAS)
  on the same shape -- the "same shapes" comparison of the targets;
- XNNPACK: a one-op int8 .tflite of the layer (the project's writer) in tflite-runtime with
  its default XNNPACK delegate.
Then the whole backbone (a random-weight int8 QGraph of the same network) on the native,
tflite/XNNPACK and numpy reference engines.

Everything runs single-threaded (OpenBLAS limited with threadpoolctl, TFLite num_threads=1),
timed in *thread CPU time* (time.thread_time): this machine is shared, and CPU time leaves
out the time the thread waits for a core, which wall time would charge to whichever engine
happened to be unlucky. Each figure is the median of several repetitions, interleaved.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from bench.cpu import core_clock, cpu_info, cpu_line, int8_peak_ops_per_cycle, port_rates

WIDTH, INPUT_SIZE = 0.35, 96


@dataclass(frozen=True)
class Layer:
    kind: str  # "conv" | "dw"
    h: int
    w: int
    cin: int
    cout: int
    kernel: int
    stride: int

    @property
    def out_hw(self) -> tuple[int, int]:
        return -(-self.h // self.stride), -(-self.w // self.stride)

    def gemm_shape(self, batch: int) -> tuple[int, int, int]:
        oh, ow = self.out_hw
        return batch * oh * ow, self.kernel * self.kernel * self.cin, self.cout

    def ops(self, batch: int) -> int:
        oh, ow = self.out_hw
        if self.kind == "dw":
            return 2 * batch * oh * ow * self.kernel * self.kernel * self.cout
        m, k, n = self.gemm_shape(batch)
        return 2 * m * k * n

    def label(self) -> str:
        what = "dw" if self.kind == "dw" else "conv"
        return f"{what} {self.kernel}x{self.kernel}/{self.stride} {self.h}x{self.w}x{self.cin}->{self.cout}"


def mobilenet_layers(width: float = WIDTH, input_size: int = INPUT_SIZE) -> list[Layer]:
    """The conv / depthwise layers of models.mobilenet_v2 (same settings and rounding)."""
    from edge_agent.sim.models import MOBILENET_V2_SETTINGS, make_divisible

    stem = make_divisible(32 * width)
    layers = [Layer("conv", input_size, input_size, 3, stem, 3, 2)]
    h, in_c = -(-input_size // 2), stem
    for expand, channels, repeats, stride in MOBILENET_V2_SETTINGS:
        out_c = make_divisible(channels * width)
        for i in range(repeats):
            s = stride if i == 0 else 1
            hidden = in_c * expand
            if expand != 1:
                layers.append(Layer("conv", h, h, in_c, hidden, 1, 1))
            layers.append(Layer("dw", h, h, hidden, hidden, 3, s))
            h = -(-h // s)
            layers.append(Layer("conv", h, h, hidden, out_c, 1, 1))
            in_c = out_c
    layers.append(Layer("conv", h, h, in_c, make_divisible(1280 * max(1.0, width)), 1, 1))
    return layers


def _timeit(fn: Callable[[], object], repeats: int, target_s: float = 0.02) -> float:
    """Median thread-CPU seconds per call over `repeats` runs of a loop lasting ~target_s."""
    fn()
    t0 = time.thread_time()
    fn()
    once = max(time.thread_time() - t0, 1e-6)
    inner = max(1, int(target_s / once))
    times = []
    for _ in range(repeats):
        t0 = time.thread_time()
        for _ in range(inner):
            fn()
        times.append((time.thread_time() - t0) / inner)
    return statistics.median(times)


def _timeit_interleaved(fns: dict[str, Callable[[], object]], repeats: int,
                        target_s: float = 0.05, clock: Callable[[], float] = time.thread_time,
                        settle_s: float = 0.0) -> dict[str, float]:
    """Like _timeit for several engines, alternating them every repetition so a change in
    the machine's load hits all of them alike. `clock`: thread CPU time unless a row runs
    threads of its own (then wall time). `settle_s`: a pause before each timed block, so the
    previous engine's pool threads, which spin for a while after a call, are asleep again."""
    inner = {}
    for name, fn in fns.items():
        fn()
        t0 = clock()
        fn()
        inner[name] = max(1, int(target_s / max(clock() - t0, 1e-6)))
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if settle_s:
                time.sleep(settle_s)
                fn()  # untimed: wakes this engine's own pool
            t0 = clock()
            for _ in range(inner[name]):
                fn()
            times[name].append((clock() - t0) / inner[name])
    return {name: statistics.median(ts) for name, ts in times.items()}


def _gemm_1024(kernels, rng: np.random.Generator, repeats: int, peak: float, exact_peak: float,
               ports: dict[str, tuple[int, float]]) -> list[str]:
    """The square 1024^3 GEMM: the u8 x s8 path (weights in [-127, 127]), the int16 path (a B
    with -128), numpy fp32 (OpenBLAS, 1 thread)."""
    import os

    from edge_agent.int8 import native

    m = k = n = 1024
    a = rng.integers(-128, 128, (m, k), dtype=np.int8)
    b = rng.integers(-127, 128, (n, k), dtype=np.int8)
    rq = native.Requant.make(1 << 30, -12, 0, channels=n)
    out = np.empty((m, n), np.int8)
    plans = {"int8, the variant's choice": kernels.gemm_plan(kernels.pack(b), rq, rows=m)}
    for label, layout in (("int8 u8 x s8 path", "u8s8"), ("int8 int16 path", "int16")):
        os.environ["EDGE_AGENT_NATIVE_LAYOUT"] = layout
        try:
            plans[label] = kernels.gemm_plan(kernels.pack(b), rq, rows=m)
        finally:
            del os.environ["EDGE_AGENT_NATIVE_LAYOUT"]
    af, bf = a.astype(np.float32), b.T.astype(np.float32).copy()
    outf = np.empty((m, n), np.float32)
    fns = {name: (lambda p=plan: p(a, out)) for name, plan in plans.items()}
    fns["fp32 numpy (OpenBLAS)"] = lambda: np.matmul(af, bf, out=outf)
    times = _timeit_interleaved(fns, max(3, repeats), target_s=0.1)
    ops = 2 * m * n * k
    # the measured u8 x s8 peak: the widest u8 x s8 multiply this CPU has (vpdpbusd is exact;
    # without VNNI only vpmaddubsw, whose int16 pair sums saturate)
    peak_insn = next((i for i in ("vpdpbusd_zmm", "vpdpbusd_ymm", "vpmaddubsw") if i in ports), None)
    measured = 2 * ports[peak_insn][0] / ports[peak_insn][1] * 1e9 if peak_insn else math.nan  # ops/s, CPU time
    peak_desc = {"vpdpbusd_zmm": "vpdpbusd zmm's (AVX512-VNNI, exact u8 x s8, 64 MACs)",
                 "vpdpbusd_ymm": "vpdpbusd ymm's (VNNI, exact u8 x s8, 32 MACs)",
                 "vpmaddubsw": "vpmaddubsw's (no VNNI here; 32 u8 x s8 MACs into saturating int16 pair sums)",
                 None: "no instruction's (bench/int8_ports.c could not build or run here)"}[peak_insn]
    rows = [f"| {name} | {t * 1e3:.1f} | {ops / t / 1e9:.1f} | {ops / t / peak:.0%} | {ops / t / measured:.0%} | "
            f"{times['fp32 numpy (OpenBLAS)'] / t:.2f}x |" for name, t in times.items()]
    best = min(times[name] for name in plans)
    lines = ["### 1024 x 1024 x 1024 GEMM (int8 output, requantised)", "",
             f"Peaks: theoretical = the nominal figure above; measured = {peak_desc} own throughput in a "
             "register-only loop with every multiply port busy (bench/int8_ports.c), in the same "
             "thread-CPU-time units as the GEMMs.", "",
             "| path | ms (CPU) | GOP/s | of theoretical u8 x s8 peak | of measured u8 x s8 peak | vs numpy fp32 |",
             "|---|---:|---:|---:|---:|---:|", *rows, ""]
    if ports:
        lines += ["Multiply instructions and exact sequences alone, MACs per ns of thread CPU time "
                  "(bench/int8_ports.c: 14 independent chains per ymm instruction and 24 per zmm one, as many "
                  "as the registers hold, so that the ports, not the latency, set the rate; 7 exact pairs; "
                  "5 chains for the widenings; the tiles per k pair):", "",
                  "| instruction | MACs each | ns each | MACs / ns | vs vfmadd231ps ymm |", "|---|---:|---:|---:|---:|"]
        rate = {name: macs / ns for name, (macs, ns) in ports.items()}  # MACs per ns
        fma = rate["vfmadd231ps"]
        for name, (macs, ns) in ports.items():
            lines.append(f"| {name.replace('_', ' ')} | {macs} | {ns:.3f} | {rate[name]:.1f} | "
                         f"{rate[name] / fma:.2f}x |")
        lines.append("")
        if peak_insn == "vpmaddubsw":
            lines += ["An exact u8 x s8 step needs vpmaddubsw + vpmaddwd (vpmaddubsw's int16 pair sums must "
                      "be widened), or vpmaddwd alone on int16: where those share the one integer-multiply port "
                      "and FMA has two, exact int8 runs at the FMA rate by construction -- at most 50 % of the "
                      "u8 x s8 peak and ~1x numpy fp32 on large shapes.", ""]
            lines += _widening_text(rate)
        elif peak_insn:
            dp = rate[peak_insn]
            fma_wide = rate.get("vfmadd231ps_zmm", fma) if peak_insn == "vpdpbusd_zmm" else fma
            fma_name = "vfmadd231ps zmm" if fma_wide is not fma else "vfmadd231ps ymm"
            pair = rate.get("vpmaddubsw+vpmaddwd")
            text = (f"This CPU has VNNI: {peak_insn.replace('_', ' ')} does the exact u8 x s8 step in one "
                    f"instruction (four u8*s8 products summed into each int32 lane, no int16 intermediate) at "
                    f"{dp:.1f} MACs/ns = {dp / fma_wide:.2f}x {fma_name}'s fp32 rate ({fma_wide:.1f} MACs/ns)")
            if fma_wide is not fma:
                text += f" and {dp / fma:.2f}x vfmadd231ps ymm's"
            if pair:
                text += (f"; the AVX2 exact step (vpmaddubsw + vpmaddwd) manages {pair:.1f} MACs/ns "
                         f"({pair / fma:.2f}x vfmadd231ps ymm), {dp / pair:.1f}x less than {peak_insn.replace('_', ' ')}")
            if "vpdpwssd_zmm" in rate:
                text += (f"; the int16 path's vpdpwssd zmm gives {rate['vpdpwssd_zmm']:.1f} MACs/ns "
                         f"({rate['vpdpwssd_zmm'] / dp:.0%} of {peak_insn.replace('_', ' ')})")
            lines += [text + ". So exact int8 is not tied to the FMA rate here; the measured u8 x s8 peak "
                      f"above is {peak_insn.replace('_', ' ')}'s.", ""]
    frac = ops / best / measured
    verdict = "not measured" if math.isnan(frac) else "met" if frac >= 0.6 else "NOT met"
    lines.append(f"Best int8 path: {ops / best / peak:.0%} of the theoretical and {frac:.0%} of the measured "
                 f"u8 x s8 peak ({peak_insn.replace('_', ' ') if peak_insn else 'n/a'}; "
                 f"target >= 60 %: {verdict}), "
                 f"{times['fp32 numpy (OpenBLAS)'] / best:.2f}x numpy fp32.")
    return lines + [""]


def _widening_text(rate: dict[str, float]) -> list[str]:
    """What the other exact AVX2 sequences and the two tiles of bench/int8_ports.c show."""
    ub, shift, shuf = rate["vpmaddubsw"], rate.get("vpmaddubsw+shift_widening"), rate.get("vpmaddubsw+shuffle_widening")
    hybrid, tile_int, tile_hybrid = (rate.get("4_pairs+6_fp32_FMAs"), rate.get("tile:_6_int16_rows"),
                                     rate.get("tile:_4_int16_+_2_fp32_rows"))
    if not (shift and shuf and hybrid and tile_int and tile_hybrid):
        return []
    return [f"Widening without the second multiply does not get past that: by shifts {shift / ub:.0%} of "
            f"vpmaddubsw's rate (three shifts for the one shift pipe), by vpxor + vpshufb + vpand {shuf / ub:.0%} "
            "(three more vector ALU operations per step). Only int8 rows on the multiply port beside fp32 FMA "
            "rows on the second FMA pipe (int8 products are exact in fp32 while sums stay below 2^24) pass "
            f"60 % in registers alone: {hybrid / ub:.0%}. In a GEMM tile, whose operands come from L1 (16 "
            "columns, 12 accumulators in hand-allocated registers, bench/int8_ports.c), that gain is gone: "
            f"6 int16 rows run at {tile_int:.1f} MACs/ns ({tile_int / ub:.0%} of vpmaddubsw's rate), 4 int16 + "
            f"2 fp32 rows at {tile_hybrid:.1f} ({tile_hybrid / ub:.0%}). So none of the exact AVX2 forms measured "
            "here reaches 60 % of vpmaddubsw's rate on this CPU; the target needs VNNI (vpdpbusd: the exact "
            "step in one instruction).", ""]


def _mac_bound_row(totals: dict[str, float], ports: dict[str, tuple[int, float]]) -> list[str]:
    """How far the GEMM total is from what this CPU's exact u8 x s8 multiply allows: every MAC
    at the measured rate of the best exact instruction sequence (vpdpbusd with VNNI, else
    vpmaddubsw + vpmaddwd), nothing else (no requantisation, loads or edges). That time also
    caps the ratio to numpy: where numpy / bound < 2, the 2x target cannot be met here."""
    insn = next((i for i in ("vpdpbusd_zmm", "vpdpbusd_ymm", "vpmaddubsw+vpmaddwd") if i in ports), None)
    if insn is None or not totals["gemm"]:
        return []
    macs_per_s = ports[insn][0] / ports[insn][1] * 1e9
    bound = totals["macs"] / macs_per_s
    need = 2 * bound / totals["numpy"]  # the fraction of the bound 2x numpy asks for
    return [f"| share of this CPU's exact-MAC bound the GEMM total reaches (every MAC at "
            f"{insn.replace('_', ' ')}'s measured {macs_per_s / 1e9:.1f} GMAC/s, nothing else counted); "
            f"2x numpy needs {need:.0%}{' (more than the bound: impossible here)' if need > 1 else ''} | "
            f"{bound / totals['gemm']:.0%} | - |"]


def _layer_models(layer: Layer, batch: int, rng: np.random.Generator):
    """A one-op QGraph of the layer (random weights, calibrated output scale) and its .tflite."""
    from edge_agent.int8.testing import GraphBuilder
    from edge_agent.int8.tflite_writer import write_tflite

    b = GraphBuilder(rng, (batch, layer.h, layer.w, layer.cin), name="layer", calibration_batch=1)
    if layer.kind == "dw":
        out = b.depthwise(b.input, layer.kernel, stride=layer.stride, activation="RELU6")
    else:
        out = b.conv(b.input, layer.cout, layer.kernel, stride=layer.stride, activation="RELU6")
    graph = b.build(out)
    return graph, write_tflite(graph)


def _numpy_dw(x: np.ndarray, w: np.ndarray, stride: int) -> Callable[[], np.ndarray]:
    """fp32 depthwise 3x3 in numpy: nine strided multiply-adds (no BLAS applies)."""
    n, h, wd, c = x.shape
    oh, ow = -(-h // stride), -(-wd // stride)
    xp = np.zeros((n, h + 2, wd + 2, c), np.float32)
    xp[:, 1:-1, 1:-1] = x
    out = np.empty((n, oh, ow, c), np.float32)
    tmp = np.empty_like(out)

    def run() -> np.ndarray:
        out.fill(0)
        for ky in range(3):
            for kx in range(3):
                view = xp[:, ky:ky + (oh - 1) * stride + 1:stride, kx:kx + (ow - 1) * stride + 1:stride]
                np.multiply(view, w[ky, kx], out=tmp)
                np.add(out, tmp, out=out)
        return out

    return run


def _whole_backbone(batch: int, repeats: int, rng: np.random.Generator) -> list[str]:
    from edge_agent.int8.engines._common import EngineError
    from edge_agent.int8.engines.native import NativeRunner
    from edge_agent.int8.engines.reference import QGraphRunner
    from edge_agent.int8.engines.tflite import TfliteRunner
    from edge_agent.int8.testing import GraphBuilder
    from edge_agent.int8.tflite_writer import write_tflite

    layers = mobilenet_layers()
    b = GraphBuilder(rng, (batch, INPUT_SIZE, INPUT_SIZE, 3), name="mobilenet_v2_035_96", calibration_batch=2)
    x = b.input
    it = iter(layers)
    stem = next(it)
    x = b.conv(x, stem.cout, 3, stride=2, activation="RELU6")
    pending = list(it)
    i = 0
    while i < len(pending) - 1:  # rebuild the blocks: [expand] -> dw -> project (+ residual)
        block_in, c_in = x, b.tensors[x].shape[3]
        layer = pending[i]
        if layer.kind == "conv" and pending[i + 1].kind == "dw":
            x = b.conv(x, layer.cout, 1, activation="RELU6")
            i += 1
        dw, proj = pending[i], pending[i + 1]
        x = b.depthwise(x, 3, stride=dw.stride, activation="RELU6")
        x = b.conv(x, proj.cout, 1, activation="NONE")
        if dw.stride == 1 and proj.cout == c_in:
            x = b.add(block_in, x)
        i += 2
    x = b.conv(x, pending[-1].cout, 1, activation="RELU6")
    x = b.mean(x, (1, 2), keep_dims=True)
    graph = b.build(x)
    model = write_tflite(graph)
    xin = rng.integers(-128, 128, (batch, INPUT_SIZE, INPUT_SIZE, 3), dtype=np.int8)
    reference = QGraphRunner(graph)
    ref = reference.run_int8(xin)
    # One group per thread count, each timed interleaved, the next group's runners created
    # only after the previous group is closed: XNNPACK's pool threads spin after each call and
    # would take a core from whichever row runs next.
    wall: dict[str, float] = {}
    cpu: dict[str, float] = {}
    rows = []
    for threads in (1, 2):
        runners: dict[str, object] = {f"native, {threads} thread(s)": NativeRunner(graph, threads=threads)}
        try:
            runners[f"tflite/XNNPACK, {threads} thread(s)"] = TfliteRunner(model, threads=threads, where="backbone")
        except EngineError as exc:
            runners[f"tflite/XNNPACK, {threads} thread(s)"] = str(exc)
        if threads == 1:
            runners["native per op (walker), 1 thread"] = NativeRunner(graph, threads=1, whole_graph=False)
        fast = {name: (lambda r=runner: r.run_int8(xin)) for name, runner in runners.items()  # type: ignore[union-attr]
                if not isinstance(runner, str)}
        # 2 threads: each block after a pause, so neither engine's pool still spins on a core
        # while the other is timed (XNNPACK's threads spin after each invoke)
        settle = 0.05 if threads > 1 else 0.0
        wall.update(_timeit_interleaved(fast, max(3, repeats), clock=time.perf_counter, settle_s=settle))
        # 1 thread: thread CPU time; 2 threads: the process's CPU time (all its threads)
        cpu.update(_timeit_interleaved(fast, max(1, repeats), clock=time.thread_time if threads == 1
                                       else time.process_time, settle_s=settle))
        for name, runner in runners.items():
            if isinstance(runner, str):
                rows.append(f"| {name} | unavailable: {runner} | | | |")
                continue
            out = runner.run_int8(xin)  # type: ignore[union-attr]
            diff = int(np.abs(out.astype(np.int32) - ref.astype(np.int32)).max())
            rows.append(f"| {name} | {wall[name] * 1e3:.2f} | {cpu[name] * 1e3:.2f} | {batch / wall[name]:.0f} | {diff} |")
            runner.close()  # type: ignore[union-attr]
        del runners, fast
    t_ref = _timeit(lambda: reference.run_int8(xin), 1, 0.05)
    rows.append(f"| numpy reference, 1 thread | - | {t_ref * 1e3:.1f} | {batch / t_ref:.0f} | 0 |")
    verdicts = []
    for threads in (1, 2):
        nat, xnn = f"native, {threads} thread(s)", f"tflite/XNNPACK, {threads} thread(s)"
        if xnn in wall:
            basis, ratio = ("CPU", cpu[xnn] / cpu[nat]) if threads == 1 else ("wall", wall[xnn] / wall[nat])
            other = wall[xnn] / wall[nat] if threads == 1 else cpu[xnn] / cpu[nat]
            verdicts.append(f"{threads} thread(s): XNNPACK / native {basis} time {ratio:.2f}x "
                            f"({'native >= XNNPACK' if ratio >= 1 else 'native SLOWER'}; "
                            f"{'wall' if threads == 1 else 'CPU'} {other:.2f}x)")
    return [
        f"### Whole backbone (MobileNetV2 {WIDTH} @ {INPUT_SIZE}x{INPUT_SIZE}, {len(graph.ops)} ops, batch {batch})",
        "",
        "One process; the 1-thread rows are timed interleaved, then the 2-thread rows (XNNPACK's "
        "pool threads keep spinning after a call and would slow whichever row ran next), each "
        "2-thread block after a 50 ms pause and one untimed call, so the other engine's pool is "
        "asleep. Medians of "
        "wall time, and of CPU time: the thread's at 1 thread (what the machine's other load cannot "
        "inflate; the 1-thread verdict), the whole process's at 2 threads. `native` runs the whole "
        "graph in one C call per batch (kernels/graph.c, its own thread pool); `per op` is the "
        "previous path, one Python call per op.",
        "",
        "| engine | ms / batch (wall) | ms / batch (CPU) | images/s (wall) | max abs diff vs reference (int8 units) |",
        "|---|---:|---:|---:|---:|",
        *rows,
        "",
        "Native vs XNNPACK: " + "; ".join(verdicts) + ".",
        "",
        "XNNPACK requantises in fp32, so it may differ from TFLite's integer reference by 1 unit; "
        "native is bit-exact.",
    ]


def run(quick: bool = False) -> str:
    from threadpoolctl import threadpool_limits

    from edge_agent.int8 import native
    from edge_agent.int8.engines.native import NativeOps
    from edge_agent.int8.engines.tflite import TfliteRunner

    batch = 2 if quick else 8
    repeats = 3 if quick else 7
    rng = np.random.default_rng(0)
    kernels = native.NativeKernels()
    model, reported_mhz, flags = cpu_info()
    ports, ports_problem = port_rates()  # first: the peaks need the clock it measures
    mhz, clock_how = core_clock(ports, reported_mhz)
    ports.pop("cycle", None)
    peak_cycle, exact_cycle, assumption = int8_peak_ops_per_cycle(flags)
    peak = peak_cycle * mhz * 1e6 if mhz else math.nan
    distinct: dict[Layer, int] = {}
    for layer in mobilenet_layers():
        distinct[layer] = distinct.get(layer, 0) + 1

    conv_rows, dw_rows = [], []
    totals = {k: 0.0 for k in ("ops", "macs", "conv_ops", "native", "gemm", "numpy", "xnn", "conv_native", "conv_xnn",
                               "dw_ops", "dw_native", "dw_numpy", "dw_xnn")}
    with threadpool_limits(1):
        for layer, count in distinct.items():
            graph, tfl = _layer_models(layer, batch, rng)
            op = graph.ops[0]
            x = rng.integers(-128, 128, (batch, layer.h, layer.w, layer.cin), dtype=np.int8)
            args = [x, *(graph.tensor(n).data for n in op.inputs[1:])]
            native_op = NativeOps(kernels, graph).table()[op.kind]
            xnn = TfliteRunner(tfl, threads=1, where=layer.label())
            ops = layer.ops(batch)
            t_native = _timeit(lambda f=native_op, g=graph, o=op, a=args: f(g, o, a), repeats)
            t_xnn = _timeit(lambda r=xnn, xx=x: r.run_int8(xx), repeats)
            if layer.kind == "dw":
                w = rng.standard_normal((3, 3, layer.cout)).astype(np.float32)
                t_np = _timeit(_numpy_dw(x.astype(np.float32), w, layer.stride), repeats)
                dw_rows.append(f"| {layer.label()} | {count} | {ops / 1e6:.1f} | {ops / t_native / 1e9:.1f} | "
                               f"{ops / t_np / 1e9:.1f} | {ops / t_xnn / 1e9:.1f} | {t_xnn / t_native:.2f} |")
                for key, val in (("dw_ops", ops), ("dw_native", t_native), ("dw_numpy", t_np), ("dw_xnn", t_xnn)):
                    totals[key] += count * val
            else:
                m, k, n = layer.gemm_shape(batch)
                a8 = rng.integers(-128, 128, (m, k), dtype=np.int8)
                packed = kernels.pack(rng.integers(-127, 128, (n, k), dtype=np.int8))
                rq = native.Requant.make(1 << 30, -8, 0, channels=n)
                out8 = np.empty((m, n), np.int8)
                af, bf = a8.astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
                outf = np.empty((m, n), np.float32)
                plan = kernels.gemm_plan(packed, rq, rows=m)
                t_gemm = _timeit(lambda p=plan, a=a8, o=out8: p(a, o), repeats)
                t_np = _timeit(lambda a=af, b=bf, o=outf: np.matmul(a, b, out=o), repeats)
                conv_rows.append(
                    f"| {layer.label()} | {count} | {m}x{k}x{n} | {ops / t_gemm / 1e9:.1f} | {ops / t_np / 1e9:.1f} | "
                    f"**{t_np / t_gemm:.2f}** | {ops / t_native / 1e9:.1f} | {ops / t_xnn / 1e9:.1f} | "
                    f"**{t_xnn / t_native:.2f}** | {ops / t_native / peak:.0%} |")
                totals["macs"] += count * m * k * n
                for key, val in (("conv_ops", ops), ("gemm", t_gemm), ("numpy", t_np), ("conv_native", t_native),
                                 ("conv_xnn", t_xnn)):
                    totals[key] += count * val
            xnn.close()
        backbone = _whole_backbone(batch, repeats, rng)
        big = _gemm_1024(kernels, rng, repeats, peak, exact_cycle * mhz * 1e6 if mhz else math.nan, ports)

    co, do = totals["conv_ops"], totals["dw_ops"]
    all_native = totals["conv_native"] + totals["dw_native"]
    all_xnn = totals["conv_xnn"] + totals["dw_xnn"]
    v = kernels.variant
    gemm_ratio = totals["numpy"] / totals["gemm"]
    xnn_ratio = all_xnn / all_native
    lines = [
        "## Native int8 kernels (kernels/, `native` engine)",
        "",
        f"Variant dispatched: **{v.name}** (tile {v.geometry[0]}x{v.geometry[1]}, K step {v.geometry[2]}; "
        f"built: {', '.join(x.name for x in native.variants())}). {cpu_line()} "
        f"Batch {batch}, MobileNetV2 {WIDTH} @ {INPUT_SIZE}x{INPUT_SIZE}; repeated blocks share a row "
        f"(`n` = how many layers have that shape). Single thread, thread CPU time, median of {repeats}.",
        "",
        f"Theoretical int8 peak of one core at {mhz:.0f} MHz ({clock_how}): {peak_cycle} int8 ops/cycle = "
        f"{peak / 1e9:.0f} GOP/s ({assumption}); the exact u8 x s8 path the kernels use "
        f"tops out at {exact_cycle} ops/cycle = {exact_cycle * mhz * 1e6 / 1e9:.0f} GOP/s.",
        "",
        *([f"**Instruction rates incomplete:** {ports_problem}.", ""] if ports_problem else []),
        "### Targets (totals over all layers, each shape weighted by its count)",
        "",
        "| target | measured | met |",
        "|---|---:|:---:|",
        f"| int8 GEMM >= 2x numpy fp32 matmul on the same shapes | {gemm_ratio:.2f}x | {'yes' if gemm_ratio >= 2 else 'no'} |",
        f"| native conv + depthwise >= 50% of XNNPACK int8 throughput | {xnn_ratio:.0%} | {'yes' if xnn_ratio >= 0.5 else 'no'} |",
        f"| fraction of the theoretical int8 peak (native conv layers) | {co / totals['conv_native'] / peak:.0%} | - |",
        *_mac_bound_row(totals, ports),
        "",
        f"Sum over the backbone's conv + depthwise layers, one op per call: native {all_native * 1e3:.2f} ms, "
        f"XNNPACK {all_xnn * 1e3:.2f} ms per batch of {batch}.",
        "",
        "### Convolutions (1x1 and the 3x3 stem) as GEMM",
        "",
        "GOP/s = 2*M*K*N / time. GEMM: native `gemm_s8` vs numpy fp32 `matmul` on M x K x N "
        "(the stem's GEMM excludes im2col for both). conv: the native CONV_2D kernel vs the same "
        "layer in XNNPACK (both with im2col / requantisation).",
        "",
        "| layer | n | M x K x N | int8 GEMM | fp32 numpy | GEMM / numpy | int8 conv | XNNPACK | conv / XNNPACK | of peak |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
        *conv_rows,
        f"| **total** | | | {co / totals['gemm'] / 1e9:.1f} | {co / totals['numpy'] / 1e9:.1f} | "
        f"**{gemm_ratio:.2f}** | {co / totals['conv_native'] / 1e9:.1f} | {co / totals['conv_xnn'] / 1e9:.1f} | "
        f"**{totals['conv_xnn'] / totals['conv_native']:.2f}** | {co / totals['conv_native'] / peak:.0%} |",
        "",
        "### Depthwise 3x3",
        "",
        "numpy fp32 here is nine strided multiply-adds (no BLAS routine exists for depthwise).",
        "",
        "| layer | n | MOP | int8 native GOP/s | fp32 numpy GOP/s | XNNPACK GOP/s | native / XNNPACK |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *dw_rows,
        f"| **total** | | {do / 1e6:.1f} | {do / totals['dw_native'] / 1e9:.1f} | {do / totals['dw_numpy'] / 1e9:.1f} | "
        f"{do / totals['dw_xnn'] / 1e9:.1f} | **{totals['dw_xnn'] / totals['dw_native']:.2f}** |",
        "",
        *big,
        *backbone,
        "",
        "How: `python -m bench.run --only bench_kernels` (bench/bench_kernels.py). Native figures include "
        "the Python call (ctypes, argument checks); XNNPACK's include `invoke()` on a one-op model.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(run(quick=True))
