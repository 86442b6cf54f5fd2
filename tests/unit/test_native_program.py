"""The whole graph in one native call (engines/native_program.py, kernels/graph.c): bit-exact
with the reference walker at every thread count, with Python steps in between, across
batch sizes, and never handing the caller a buffer a later batch overwrites."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from edge_agent.int8 import native
from edge_agent.int8.engines.native import NativeRunner
from edge_agent.int8.engines.reference import QGraphRunner
from edge_agent.int8.testing import GraphBuilder, mobilenet_v2_graph, plain_cnn_graph

RUNNABLE = [v.name for v in native.variants() if v.runnable]


def _mixed_graph(rng: np.random.Generator, batch: int):
    """C ops around ops with no C kernel (a max pool, a grouped conv), then MEAN, RESHAPE and
    FULLY_CONNECTED: runs of C ops alternate with Python steps."""
    b = GraphBuilder(rng, (batch, 12, 12, 8), name="mixed", calibration_batch=2)
    x = b.conv(b.input, 16, 3, activation="RELU6")
    y = b.pool("MAX_POOL_2D", x, 2, stride=2)
    y = b.depthwise(y, 3, activation="RELU6")
    z = b.conv(y, 16, 1, activation="NONE")
    y = b.add(y, z)
    g = b.conv(y, 16, 3, groups=2, activation="RELU")
    g = b.mean(g, (1, 2), keep_dims=True)
    g = b.reshape(g, [batch, 16])
    return b.build(b.fc(g, 10, activation="NONE"))


@pytest.mark.parametrize("variant", RUNNABLE)
@pytest.mark.parametrize(("threads", "layout"), [(1, ""), (2, ""), (3, ""), (2, "u8s8"), (1, "int16")])
def test_program_matches_the_reference(variant: str, threads: int, layout: str,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Every thread count; on x86 also with every weight in the u8 x s8 layout (the VNNI
    variants' data path, which AVX2 otherwise uses only up to K = 64) or in the int16 one."""
    monkeypatch.setenv("EDGE_AGENT_NATIVE_LAYOUT", layout)
    rng = np.random.default_rng(threads)
    kernels = native.NativeKernels(variant)
    for graph in (mobilenet_v2_graph(rng, batch=3, jitter=0.2), plain_cnn_graph(rng, batch=3, jitter=0.2),
                  _mixed_graph(rng, 3)):
        runner, ref = NativeRunner(graph, kernels=kernels, threads=threads), QGraphRunner(graph)
        for batch in (3, 1, 3, 5):  # first call of a shape records, later ones run the program
            x = rng.integers(-128, 128, (batch, *graph.tensor(graph.inputs[0]).shape[1:]), dtype=np.int8)
            np.testing.assert_array_equal(runner.run_int8(x), ref.run_int8(x))
        program = runner._programs[(3, *graph.tensor(graph.inputs[0]).shape[1:])]
        assert program.c_ops > 0
        if graph.name == "mixed":
            assert program.python_ops > 0  # the pool at least stays a Python step


def test_whole_mobilenet_is_one_c_run() -> None:
    """MobileNetV2's every op has a C kernel: one ea_run_ops call per batch."""
    graph = mobilenet_v2_graph(np.random.default_rng(0), batch=2)
    runner = NativeRunner(graph, threads=2)
    x = np.zeros((2, *graph.tensor(graph.inputs[0]).shape[1:]), np.int8)
    runner.run_int8(x)
    program = runner._programs[x.shape]
    assert program.python_ops == 0 and program.c_ops == len(runner.graph.ops)
    assert [kind for kind, _, _ in program._lowered] == ["c"]


def test_outputs_are_not_reused_between_batches() -> None:
    rng = np.random.default_rng(5)
    graph = plain_cnn_graph(rng, batch=2)
    runner = NativeRunner(graph, threads=2)
    shape = (2, *graph.tensor(graph.inputs[0]).shape[1:])
    x1, x2 = (rng.integers(-128, 128, shape, dtype=np.int8) for _ in range(2))
    runner.run_int8(x1)  # records
    y1 = runner.run_int8(x1)
    keep = y1.copy()
    y2 = runner.run_int8(x2)
    assert y1 is not y2 and not np.shares_memory(y1, y2)
    np.testing.assert_array_equal(y1, keep)


def test_concurrent_runs_agree() -> None:
    """Two Python threads running programs at once: one uses the pool, the other runs on its
    own thread (the pool serves one run at a time); both stay exact."""
    rng = np.random.default_rng(9)
    graph = mobilenet_v2_graph(rng, batch=2)
    ref = QGraphRunner(graph)
    shape = (2, *graph.tensor(graph.inputs[0]).shape[1:])
    xs = [rng.integers(-128, 128, shape, dtype=np.int8) for _ in range(4)]
    expected = [ref.run_int8(x) for x in xs]
    errors: list[str] = []

    def work(seed: int) -> None:
        runner = NativeRunner(graph, threads=2)
        for _ in range(5):
            for x, want in zip(xs, expected, strict=True):
                if not np.array_equal(runner.run_int8(x), want):
                    errors.append(f"thread {seed} differs")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
