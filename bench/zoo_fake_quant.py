"""Where a zoo network's int8 prefix loses top-1 agreement (issue 41): its float graph run
in numpy with chosen tensors fake-quantised, judged like bench_model_zoo_full (through a
linear probe fitted on fp32 features, and through the net's own trained classifier).

Weights are int8 per output channel (symmetric, max-abs, as quantize.py writes them; or
on the same grid rounded by GPTQ, Frantar et al. 2023: each weight rounded in turn and its
error pushed onto the weights not yet rounded, through the inverse of the layer's input
second moments on the calibration samples) or float; activations int8 per tensor on the
bundle's calibration ranges (asymmetric) or 16-bit (symmetric, as TFLite's 16x8 scheme).
Each line varies one thing, and gives the features' signal-to-noise ratio against fp32
(the median over the digits; less noisy than a top-1 decided by a few of 719):

    python -m bench.zoo_fake_quant build/zoo-full torch-mnasnet1_0-legacy

(the fixtures come from `make zoo-fixtures`). A diagnostic, not a benchmark: `make bench`
does not run it; the README's model-zoo notes quote what it printed.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

def int16_activation(v: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """`v` rounded to TFLite's 16x8 activations: symmetric, zero point 0 (the project has no
    16-bit quantisation of its own)."""
    from edge_agent.int8.quant_math import round_half_away

    scale = max(abs(lo), abs(hi)) / 32767 or 1e-8
    return (np.clip(round_half_away(v / scale), -32767, 32767) * scale).astype(np.float32)


GPTQ_DAMPING = 0.1  # of the mean diagonal: mnasnet1_0's features 24.7 dB at 0.1, 24.9 at 0.01 (noisier top-1)


def _gptq_rows(w: np.ndarray, scale: np.ndarray, h: np.ndarray) -> np.ndarray:
    """Rows of `w` (O, K) rounded to int8 steps `scale` (O,) column by column, each column's
    error spread over the later ones by the upper Cholesky factor of the damped inverse of
    `h`, the input second moments: (K, K) shared, or (O, K, K) per row (depthwise)."""
    from edge_agent.int8.quant_math import round_half_away

    n = h.shape[-1]
    damp = GPTQ_DAMPING * np.einsum("...ii->...", h) / n + 1e-12
    inverse = np.linalg.inv(h + np.asarray(damp)[..., None, None] * np.eye(n))
    u = np.swapaxes(np.linalg.cholesky(inverse), -1, -2)
    if u.ndim == 2:
        u = np.broadcast_to(u, (len(w), n, n))
    w, q = w.astype(np.float64), np.zeros_like(w, dtype=np.float64)
    for k in range(n):
        q[:, k] = np.clip(round_half_away(w[:, k] / scale), -127, 127) * scale
        w[:, k + 1:] -= ((w[:, k] - q[:, k]) / u[:, k, k])[:, None] * u[:, k, k + 1:]
    return q


def _gptq_weight(op: Any, x: np.ndarray) -> np.ndarray | None:
    """`op`'s weights on quantize.py's per-channel int8 grid, rounded by GPTQ on its input `x`
    (NHWC), in float; None for an op without weights or one GPTQ is not applied to here
    (grouped convolutions, depth multipliers)."""
    from edge_agent.int8.float_ops import _taps
    from edge_agent.int8.quant_math import symmetric_per_channel

    w, o = op.weight, op.options
    if op.kind == "FULLY_CONNECTED":
        cols = x.reshape(len(x), -1).astype(np.float64)
        return _gptq_rows(w, symmetric_per_channel(w, 0)[1], cols.T @ cols).astype(np.float32)
    grouped = op.kind == "CONV_2D" and x.shape[3] != w.shape[3]
    multiplied = op.kind == "DEPTHWISE_CONV_2D" and o["depth_multiplier"] != 1
    if op.kind not in ("CONV_2D", "DEPTHWISE_CONV_2D") or grouped or multiplied:
        return None
    _, taps = _taps(x, w.shape[1:3], (o["stride_h"], o["stride_w"]), (o["dilation_h"], o["dilation_w"]),
                    o["padding"], 0.0)
    patches = np.stack([v for _, _, v in taps], axis=-2).astype(np.float64)  # N, oh, ow, taps, C
    if op.kind == "CONV_2D":
        cols = patches.reshape(-1, patches.shape[-2] * patches.shape[-1])
        q = _gptq_rows(w.reshape(len(w), -1), symmetric_per_channel(w, 0)[1], cols.T @ cols)
        return q.reshape(w.shape).astype(np.float32)
    cols = patches.reshape(-1, *patches.shape[-2:])
    q = _gptq_rows(w.reshape(-1, w.shape[3]).T, symmetric_per_channel(w, 3)[1], np.einsum("ntc,nuc->ctu", cols, cols))
    return q.T.reshape(w.shape).astype(np.float32)


def _int8_weight(op: Any, rounded: dict[str, np.ndarray]) -> np.ndarray | None:
    """What `op` runs with on the simulated int8 path: its weights as `rounded` has them, else
    max-abs rounded to nearest (quantize.py); ADD / MUL constants int8 per tensor."""
    from edge_agent.int8.bias_correction import dequantised_weight, int8_constant

    if op.kind in ("ADD", "MUL"):
        return int8_constant(op.weight)
    return rounded[op.name] if op.name in rounded else dequantised_weight(op)


def gptq_weights(graph: Any, ranges: dict[str, tuple[float, float]], calibration: np.ndarray) -> dict[str, np.ndarray]:
    """Every CONV_2D (ungrouped), DEPTHWISE_CONV_2D and FULLY_CONNECTED op's weights rounded
    by GPTQ (`_gptq_weight`) on the int8 path's inputs over `calibration`: layers in order,
    each on the outputs of the rounded ones before it, through the path `fake_quantised` runs."""
    from edge_agent.int8.bias_correction import int8_rounded
    from edge_agent.int8.float_ops import run_op

    x = np.ascontiguousarray(calibration.transpose(0, 2, 3, 1))
    values, rounded = {graph.input: int8_rounded(x, *ranges[graph.input])}, {}
    for op in graph.ops:
        inputs = [values[n] for n in op.inputs]
        if (q := _gptq_weight(op, inputs[0])) is not None:
            rounded[op.name] = q
        y = run_op(op.kind, inputs, op.options, _int8_weight(op, rounded), op.bias)
        values[op.output] = int8_rounded(y, *ranges[op.output])
    return rounded


def fake_quantised(graph: Any, ranges: dict[str, tuple[float, float]], *, wide_ops: int,
                   float_weights: Callable[[int], bool],
                   rounded: dict[str, np.ndarray] | None = None) -> Callable[[np.ndarray], np.ndarray]:
    """The graph's features with the first `wide_ops` op outputs 16-bit, the rest int8, and
    op k's weights in float where `float_weights(k)`, else int8 (`_int8_weight`: `rounded`'s
    where given, else max-abs rounding to nearest)."""
    from edge_agent.int8.bias_correction import int8_rounded as int8_activation
    from edge_agent.int8.float_graph import to_model_layout
    from edge_agent.int8.float_ops import run_op

    weights = {op.name: _int8_weight(op, rounded or {}) for op in graph.ops}

    def run(x: np.ndarray) -> np.ndarray:
        values = {graph.input: int8_activation(np.ascontiguousarray(x.transpose(0, 2, 3, 1)), *ranges[graph.input])}
        for k, op in enumerate(graph.ops):
            w = op.weight if float_weights(k) else weights[op.name]
            y = run_op(op.kind, [values[n] for n in op.inputs], op.options, w, op.bias)
            values[op.output] = (int16_activation if k < wide_ops else int8_activation)(y, *ranges[op.output])
        return to_model_layout(values[graph.output])

    return run


def main(where: Path, arch_id: str) -> None:
    from edge_agent.int8.float_graph import run_float
    from edge_agent.int8.onnx_import import import_onnx
    from edge_agent.int8.quantize import calibrate, constrain_ranges
    from edge_agent.train.trainer import head_from_bundle
    from tests.fixtures.models import zoo

    arch = next(a for a in zoo.torch_archs(where) if a.id == arch_id)
    with tempfile.TemporaryDirectory(prefix="zoo-fake-quant-") as tmp:
        built = zoo.build(arch, Path(tmp) / "bundle")
        x_train, y_train, x_test, _ = zoo.digits(arch.size)
        source = Path(arch.name) if Path(arch.name).is_absolute() else zoo.HERE / arch.name
        graph = import_onnx(source, split=built.bundle.manifest.split_tensor)
        ranges = constrain_ranges(graph, calibrate(graph, x_train[:zoo.N_CALIB]))

        def features(run: Callable[[np.ndarray], np.ndarray], x: np.ndarray) -> np.ndarray:
            return np.concatenate([run(x[i:i + 64]) for i in range(0, len(x), 64)])

        def fp32(x: np.ndarray) -> np.ndarray:
            return run_float(graph, x)

        probe = zoo.fitted_head(features(fp32, x_train), y_train)
        own = zoo.own_classifier(built, *head_from_bundle(built.bundle))
        judges = {"probe": probe, **({"own classifier": own} if own else {})}
        reference = features(fp32, x_test)
        want = {name: judge(reference).argmax(axis=1) for name, judge in judges.items()}
        n = len(graph.ops)
        gptq = gptq_weights(graph, ranges, x_train[:zoo.N_CALIB])
        cases = [("activations int8, weights int8", 0, lambda k: False, None),
                 ("activations int8, weights int8 rounded by GPTQ", 0, lambda k: False, gptq),
                 ("activations 16-bit, weights int8", n, lambda k: False, None),
                 ("activations int8, weights float", 0, lambda k: True, None),
                 ("activations int8, the first 8 ops' weights float", 0, lambda k: k < 8, None),
                 ("activations 16-bit for the first 8 ops, weights int8", 8, lambda k: False, None)]
        print(f"{arch_id}: {n} ops; top-1 agreement with fp32 on {len(x_test)} held-out digits")
        for what, wide, float_weights, rounded in cases:
            got = features(fake_quantised(graph, ranges, wide_ops=wide, float_weights=float_weights, rounded=rounded),
                           x_test)
            agree = ", ".join(f"{name} {100 * float((judge(got).argmax(axis=1) == want[name]).mean()):.2f} %"
                              for name, judge in judges.items())
            flat_ref, flat_err = reference.reshape(len(reference), -1), (got - reference).reshape(len(got), -1)
            # per digit, the median: one efficientnet_b0 digit whose squeeze-excite gates run
            # 8x past the calibration range carries 99.8 % of that net's whole-set error
            snr = float(np.median(10 * np.log10(np.sum(flat_ref ** 2, axis=1) / np.maximum(
                np.sum(flat_err ** 2, axis=1), 1e-30))))
            print(f"  {what}: {agree}; features {snr:.2f} dB (median per digit)", flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(Path(sys.argv[1]), sys.argv[2])
