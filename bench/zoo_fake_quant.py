"""Where a zoo network's int8 prefix loses top-1 agreement (issue 41): its float graph run
in numpy with chosen tensors fake-quantised, judged like bench_model_zoo_full (through a
linear probe fitted on fp32 features, and through the net's own trained classifier).

Weights are int8 per output channel (symmetric, max-abs, as quantize.py writes them) or
float; activations int8 per tensor on the bundle's calibration ranges (asymmetric) or
16-bit (symmetric, as TFLite's 16x8 scheme). Each line varies one thing:

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


def fake_quantised(graph: Any, ranges: dict[str, tuple[float, float]], *, wide_ops: int,
                   float_weights: Callable[[int], bool]) -> Callable[[np.ndarray], np.ndarray]:
    """The graph's features with the first `wide_ops` op outputs 16-bit, the rest int8, and
    op k's weights in float where `float_weights(k)`, else int8."""
    from edge_agent.int8.bias_correction import dequantised_weight
    from edge_agent.int8.bias_correction import int8_rounded as int8_activation
    from edge_agent.int8.float_graph import to_model_layout
    from edge_agent.int8.float_ops import run_op

    weights = {op.name: dequantised_weight(op) for op in graph.ops}

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
        cases = [("activations int8, weights int8", 0, lambda k: False),
                 ("activations 16-bit, weights int8", n, lambda k: False),
                 ("activations int8, weights float", 0, lambda k: True),
                 ("activations int8, the first 8 ops' weights float", 0, lambda k: k < 8),
                 ("activations 16-bit for the first 8 ops, weights int8", 8, lambda k: False)]
        print(f"{arch_id}: {n} ops; top-1 agreement with fp32 on {len(x_test)} held-out digits")
        for what, wide, float_weights in cases:
            got = features(fake_quantised(graph, ranges, wide_ops=wide, float_weights=float_weights), x_test)
            agree = ", ".join(f"{name} {100 * float((judge(got).argmax(axis=1) == want[name]).mean()):.2f} %"
                              for name, judge in judges.items())
            print(f"  {what}: {agree}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(Path(sys.argv[1]), sys.argv[2])
