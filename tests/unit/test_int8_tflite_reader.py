"""The TFLite reader: round trips of the writer's models, and untrusted bytes (truncated,
bit-flipped, oversized, crafted with bad indices or unknown ops) rejected with an InputError
that says what and where."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from edge_agent.errors import InputError
from edge_agent.int8.graph import QGraph, QOp, QTensor
from edge_agent.int8.reference import check_graph, run_graph
from edge_agent.int8.testing import GraphBuilder, mobilenet_v2_graph, plain_cnn_graph, run_tflite
from edge_agent.int8.tflite_reader import TFLiteFormatError, read_tflite
from edge_agent.int8.tflite_writer import _Serializer, write_tflite


@pytest.fixture(scope="module")
def mobilenet() -> QGraph:
    return mobilenet_v2_graph(np.random.default_rng(11))


@pytest.fixture(scope="module")
def mobilenet_bytes(mobilenet) -> bytes:
    return write_tflite(mobilenet)


def test_round_trip_is_identical_for_a_graph_without_rewrites(mobilenet, mobilenet_bytes):
    back = read_tflite(mobilenet_bytes)
    assert back.inputs == mobilenet.inputs and back.outputs == mobilenet.outputs
    assert set(back.tensors) == set(mobilenet.tensors)
    for name, t in mobilenet.tensors.items():
        r = back.tensors[name]
        assert (r.shape, r.dtype) == (t.shape, t.dtype), name
        np.testing.assert_array_equal(r.scale, t.scale)
        np.testing.assert_array_equal(r.zero_point, t.zero_point)
        if t.data is None:
            assert r.data is None
        else:
            assert r.data.dtype == t.data.dtype
            np.testing.assert_array_equal(r.data, t.data)
            if t.per_channel:
                assert r.quantized_dim == t.quantized_dim
    assert [(o.kind, o.inputs, o.outputs, o.options) for o in back.ops] == \
        [(o.kind, o.inputs, o.outputs, o.options) for o in mobilenet.ops]
    assert write_tflite(back) == mobilenet_bytes


@pytest.mark.parametrize("float_io", [False, True])
def test_round_trip_runs_identically(float_io):
    rng = np.random.default_rng(12)
    graph = plain_cnn_graph(rng)  # concat inputs get requantised: more ops, same results
    model = write_tflite(graph, float_io=float_io)
    back = read_tflite(model)
    x = rng.integers(-128, 128, size=(3, 20, 20, 3), dtype=np.int8)
    if float_io:
        t = graph.tensors[graph.inputs[0]]
        xf = ((x.astype(np.float32) - t.zero_point[0]) * t.scale[0]).astype(np.float32)
        np.testing.assert_array_equal(run_graph(back, xf), run_tflite(model, xf, reference_kernels=True))
    else:
        np.testing.assert_array_equal(run_graph(back, x), run_graph(graph, x))
    assert len(back.ops) > len(graph.ops)


def test_reshape_with_a_shape_tensor_is_folded():
    """Converter-made models give RESHAPE its shape as a second, constant input."""
    b = GraphBuilder(np.random.default_rng(13), (1, 4, 4, 2))
    graph = b.build(b.reshape(b.input, [-1, 32]))
    graph.tensors["shape"] = QTensor("shape", (2,), "int32", data=np.array([-1, 32], dtype=np.int32))
    graph.ops[0] = QOp("RESHAPE", [graph.inputs[0], "shape"], graph.ops[0].outputs, {"new_shape": []})
    model = _Serializer(graph).build("converter style")
    back = read_tflite(model)
    assert back.ops[0].inputs == [graph.inputs[0]] and back.ops[0].options == {"new_shape": [-1, 32]}
    x = np.arange(-64, 64, dtype=np.int8).reshape(4, 4, 4, 2)
    np.testing.assert_array_equal(run_graph(back, x), run_tflite(model, x, reference_kernels=True))


def test_every_truncation_is_a_clear_error(mobilenet_bytes):
    size = len(mobilenet_bytes)
    cuts = sorted({*range(0, 64), *range(64, size, 41), *range(size - 64, size)})
    for cut in cuts:
        with pytest.raises(TFLiteFormatError) as info:
            read_tflite(mobilenet_bytes[:cut], where="bundle/backbone.tflite")
        message = str(info.value)
        assert message.startswith("bundle/backbone.tflite: "), message
        assert any(word in message for word in ("truncated", "corrupt", "not a TFLite", "out of range",
                                                "cannot fit", "holds", "does not", "not supported")), message


def test_random_corruption_never_escapes_as_another_exception(mobilenet_bytes):
    rng = np.random.default_rng(14)
    outcomes = {"rejected": 0, "accepted": 0}
    for _ in range(80):
        data = bytearray(mobilenet_bytes)
        for pos in rng.integers(0, len(data), size=int(rng.integers(1, 4))):
            data[pos] = int(rng.integers(0, 256))
        try:
            graph = read_tflite(bytes(data))
        except TFLiteFormatError:
            outcomes["rejected"] += 1
        else:  # a flip in weights or a name: still a well-formed graph
            check_graph(graph)
            outcomes["accepted"] += 1
    assert outcomes["rejected"] > 10 and outcomes["accepted"] > 10


def test_size_limit_is_checked_before_parsing():
    with pytest.raises(TFLiteFormatError, match="100 bytes is over the limit of 64"):
        read_tflite(b"\xff" * 100, max_bytes=64)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "truncated \\(0 bytes"),
        (b"\x00" * 200, "zero-filled"),
        (b"\x10\x00\x00\x00TFL2" + b"\x00" * 40, "identifier b'TFL2'"),
        (b"\xf0\xff\x00\x00TFL3" + b"\x00" * 40, "root table at byte 65520"),
        ("not bytes", "expected bytes"),
    ],
)
def test_header_errors(data, message):
    with pytest.raises(TFLiteFormatError, match=message) as info:
        read_tflite(data)
    assert isinstance(info.value, InputError)


class _BadBufferIndex(_Serializer):
    def _tensor(self, t, buffer):
        return super()._tensor(t, 999 if t.data is not None else buffer)


class _UnknownOp(_Serializer):
    def _opcode(self, kind, version):
        m = importlib.import_module("tflite.OperatorCode")
        m.Start(self.b)
        m.AddDeprecatedBuiltinCode(self.b, 25)  # SOFTMAX
        m.AddBuiltinCode(self.b, 25)
        m.AddVersion(self.b, 1)
        return m.End(self.b)


class _Uint8Tensors(_Serializer):
    def _type_code(self, t):
        return 3 if t.dtype == "int8" else super()._type_code(t)


class _ShortBuffer(_Serializer):
    def _buffer(self, data):
        return super()._buffer(None if data is None else data.reshape(-1)[:-1])


@pytest.mark.parametrize(
    ("serializer", "message"),
    [
        (_BadBufferIndex, r"tensor 1 'weights': buffer index 999 is out of range \(\d+ buffers\)"),
        (_UnknownOp, r"operator 0: op SOFTMAX is not supported"),
        (_Uint8Tensors, r"tensor 0 'input': type UINT8 is not supported"),
        (_ShortBuffer, r"tensor 1 'weights': buffer 1 holds 53 bytes; shape \[2, 3, 3, 3\] of int8 needs 54"),
    ],
)
def test_crafted_models_name_what_and_where(serializer, message):
    b = GraphBuilder(np.random.default_rng(15), (1, 5, 5, 3))
    graph = b.build(b.conv(b.input, 2, 3))
    model = serializer(graph).build("crafted")
    with pytest.raises(TFLiteFormatError, match=message):
        read_tflite(model, where="m.tflite")


def test_semantic_errors_in_a_file_are_input_errors():
    """A well-formed flatbuffer whose graph is inconsistent (a pool that changes scale)."""
    b = GraphBuilder(np.random.default_rng(16), (1, 4, 4, 2))
    graph = b.build(b.pool("AVERAGE_POOL_2D", b.input, 2))
    out = graph.tensors[graph.outputs[0]]
    graph.tensors[out.name] = QTensor(out.name, out.shape, "int8", out.scale * 3, out.zero_point)
    with pytest.raises(TFLiteFormatError, match="AVERAGE_POOL_2D.*share scale"):
        read_tflite(_Serializer(graph).build("x"), where="m.tflite")
