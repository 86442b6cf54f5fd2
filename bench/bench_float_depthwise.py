"""The float depthwise convolution in C (kernels/float_depthwise.c, int8/native_float.py)
against the numpy code it replaces where the native library is built, side by side.

Shapes: every distinct depthwise layer of bench_depth's MobileNetV2 (width 0.5, 96x96, the
camera digits' bundle) at a training batch of 32 -- the late ones are the tail that
`--depth auto` trains (numpy_tail.py: forward, and backward with both gradients), the early
ones the float prefix's passes over a device's images (float_ops.py: AdaBN statistics,
calibration; forward only). Each row runs the project's own entry points, once with the
library and once on its numpy path.

Single thread (OpenBLAS limited with threadpoolctl), thread CPU time, median of several
interleaved repetitions (bench_kernels' timer). The forward outputs are compared bit for bit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import numpy as np

from bench.bench_kernels import Layer, _timeit_interleaved, mobilenet_layers
from bench.cpu import cpu_line

WIDTH, INPUT_SIZE, BATCH = 0.5, 96, 32
TAIL_FROM = 6  # maps of this side or less are in the tails bench_depth trains (depths 2-4)


@contextlib.contextmanager
def _numpy_path() -> Iterator[None]:
    from edge_agent.int8 import native_float

    library = native_float.native_library
    native_float.native_library = lambda: None
    try:
        yield
    finally:
        native_float.native_library = library


def _tail_calls(layer: Layer, seed: int) -> dict[str, Callable[[], object]]:
    """numpy_tail's forward, and its backward on that forward's cache (both gradients), on the
    path (C or numpy) in force when called."""
    from edge_agent.train import numpy_tail

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(BATCH, layer.h, layer.w, layer.cin)).astype(np.float32)
    w = rng.normal(size=(layer.cin, 1, 3, 3)).astype(np.float32)
    node = numpy_tail._Node("Convolution", "dw", {"kernel": (3, 3), "stride": (layer.stride,) * 2, "pad": (1, 1),
                                                  "groups": layer.cin})
    out, cache = numpy_tail._conv_fwd(node, [x, w], True)
    g = rng.normal(size=out.shape).astype(np.float32)
    return {"forward": lambda: numpy_tail._conv_fwd(node, [x, w], True)[0],
            "backward": lambda: numpy_tail._conv_bwd(node, [x, w], out, cache, g, [True, True])}


def _prefix_calls(layer: Layer, seed: int) -> dict[str, Callable[[], object]]:
    """float_ops.run_op on the TFLite-layout op the float prefix holds (SAME padding)."""
    from edge_agent.int8.float_ops import run_op

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(BATCH, layer.h, layer.w, layer.cin)).astype(np.float32)
    w = rng.normal(size=(1, 3, 3, layer.cin)).astype(np.float32)
    b = rng.normal(size=layer.cin).astype(np.float32)
    options = {"stride_h": layer.stride, "stride_w": layer.stride, "dilation_h": 1, "dilation_w": 1,
               "padding": "SAME", "depth_multiplier": 1, "activation": "RELU6"}
    return {"forward": lambda: run_op("DEPTHWISE_CONV_2D", [x], options, w, b)}


def _measure(calls: Callable[[], dict[str, Callable[[], object]]], repeats: int) -> tuple[dict[str, float], bool]:
    """Thread-CPU seconds per call of each named call, made once with the library and once
    without (`calls()` builds them on the path in force), and whether the forward outputs are
    identical."""
    native = calls()
    with _numpy_path():
        fallback = calls()
        want = np.asarray(fallback["forward"]())
    same = bool(np.array_equal(np.asarray(native["forward"]()), want))
    both = {f"C {k}": v for k, v in native.items()}

    def numpy_call(fn: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            with _numpy_path():
                return fn()
        return run

    both.update({f"numpy {k}": numpy_call(v) for k, v in fallback.items()})
    return _timeit_interleaved(both, repeats), same


def run(quick: bool = False) -> str:
    from threadpoolctl import threadpool_limits

    from edge_agent.int8 import native_float

    if native_float.native_library() is None:
        raise RuntimeError("the native library is not built here: nothing to compare")
    repeats = 3 if quick else 7
    layers = sorted({(ly.h, ly.cin, ly.stride): ly for ly in mobilenet_layers(WIDTH, INPUT_SIZE)
                     if ly.kind == "dw"}.values(), key=lambda ly: (-ly.h, ly.cin, ly.stride))
    rows, totals = [], {"tail": [0.0, 0.0], "prefix": [0.0, 0.0]}
    all_same = True
    with threadpool_limits(1):
        for i, layer in enumerate(layers):
            tail = layer.h <= TAIL_FROM
            make, where = (_tail_calls, "tail (numpy_tail)") if tail else (_prefix_calls, "float prefix (float_ops)")
            t, same = _measure(lambda make=make, layer=layer, i=i: make(layer, i), repeats)
            all_same &= same
            key = "tail" if tail else "prefix"
            cells = []
            for what in ("forward", "backward"):
                if f"C {what}" not in t:
                    cells.append("- | - | -")
                    continue
                c, n = t[f"C {what}"], t[f"numpy {what}"]
                totals[key][0] += c
                totals[key][1] += n
                cells.append(f"{n * 1e3:.2f} | {c * 1e3:.2f} | **{n / c:.1f}x**")
            rows.append(f"| {layer.label()} | {where} | {' | '.join(cells)} | {'yes' if same else 'NO'} |")
    lines = [
        "## Float depthwise convolution: C vs numpy (bench_float_depthwise)",
        "",
        f"{cpu_line()} bench_depth's MobileNetV2 w{WIDTH} @ {INPUT_SIZE}x{INPUT_SIZE}, every distinct depthwise "
        f"layer at batch {BATCH}; single thread, thread CPU time, median of {repeats} interleaved repetitions. "
        "numpy = the same entry point with the native library withheld (what runs where it is not built).",
        "",
        "| layer | where it runs | forward numpy ms | forward C ms | speed-up | backward numpy ms | backward C ms "
        "| speed-up | forward bit-identical |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
        *rows,
        "",
        f"Totals over these layers (one of each): the tail's forward + backward {totals['tail'][1] * 1e3:.1f} ms in "
        f"numpy vs {totals['tail'][0] * 1e3:.1f} ms in C (**{totals['tail'][1] / totals['tail'][0]:.1f}x**); the float "
        f"prefix's forward {totals['prefix'][1] * 1e3:.1f} vs {totals['prefix'][0] * 1e3:.1f} ms "
        f"(**{totals['prefix'][1] / totals['prefix'][0]:.1f}x**). Forward outputs identical to numpy's bit for bit: "
        f"{'every row' if all_same else '**not every row**'}. What it does to a whole fine-tuning job is "
        "bench_depth's energy column.",
        "",
        "How: `python -m bench.run --only bench_float_depthwise` (bench/bench_float_depthwise.py).",
    ]
    return "\n".join(lines) + "\n"
