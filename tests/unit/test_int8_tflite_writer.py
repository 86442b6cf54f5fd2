"""The TFLite writer: schema structure read back with the `tflite` schema classes, the
rewrites it makes so TFLite's int8 kernels accept the graph, and clear errors for graphs it
cannot express. Numerical agreement of written models is in test_int8_reference."""

from __future__ import annotations

import importlib
from dataclasses import replace

import numpy as np
import pytest

from edge_agent.int8.graph import QOp, UnsupportedOpError
from edge_agent.int8.reference import GraphError, run_graph
from edge_agent.int8.testing import GraphBuilder, mobilenet_v2_graph, plain_cnn_graph, run_tflite
from edge_agent.int8.tflite_writer import OPS, write_tflite

Model = importlib.import_module("tflite.Model").Model


def parse(model: bytes):
    assert Model.ModelBufferHasIdentifier(model, 0)
    return Model.GetRootAs(model, 0)


def tensors_by_name(sub) -> dict[str, object]:
    return {sub.Tensors(i).Name().decode(): sub.Tensors(i) for i in range(sub.TensorsLength())}


def opcode_names(m, sub) -> list[str]:
    kinds = {code: kind for kind, (code, _, _) in OPS.items()}
    return [kinds[m.OperatorCodes(sub.Operators(i).OpcodeIndex()).BuiltinCode()] for i in range(sub.OperatorsLength())]


def test_model_structure_schema_v3():
    graph = mobilenet_v2_graph(np.random.default_rng(0))
    data = write_tflite(graph, description="unit test")
    m = parse(data)
    assert data[4:8] == b"TFL3"
    assert m.Version() == 3 and m.Description() == b"unit test" and m.SubgraphsLength() == 1
    assert m.Buffers(0).DataLength() == 0  # the empty sentinel
    for i in range(m.OperatorCodesLength()):
        oc = m.OperatorCodes(i)
        assert oc.BuiltinCode() == oc.DeprecatedBuiltinCode() > 0 or oc.BuiltinCode() == 0  # ADD is 0
        assert oc.Version() >= 1
    sub = m.Subgraphs(0)
    assert opcode_names(m, sub) == [op.kind for op in graph.ops]
    by_name = tensors_by_name(sub)
    assert set(by_name) == set(graph.tensors)
    assert by_name[graph.inputs[0]].Type() == 9  # INT8 in, INT8 out
    assert by_name[graph.outputs[0]].Type() == 9
    for i in range(m.BuffersLength()):  # constants are 16-byte aligned in the file
        buf = m.Buffers(i)
        if buf.DataLength():
            assert buf._tab.Vector(buf._tab.Offset(4)) % 16 == 0
    assert write_tflite(graph, description="unit test") == data  # deterministic


def test_per_channel_quantisation_fields():
    graph = mobilenet_v2_graph(np.random.default_rng(1))
    sub = parse(write_tflite(graph)).Subgraphs(0)
    by_name = tensors_by_name(sub)
    conv = next(op for op in graph.ops if op.kind == "CONV_2D")
    dw = next(op for op in graph.ops if op.kind == "DEPTHWISE_CONV_2D")
    for op, dim in ((conv, 0), (dw, 3)):
        w = graph.tensors[op.inputs[1]]
        q = by_name[w.name].Quantization()
        assert q.QuantizedDimension() == dim
        np.testing.assert_array_equal(q.ScaleAsNumpy(), w.scale)
        assert q.ScaleLength() == w.shape[dim] and not q.ZeroPointAsNumpy().any()
        bias = by_name[op.inputs[2]]
        assert bias.Type() == 2  # INT32
        s_in = np.float64(graph.tensors[op.inputs[0]].scale[0])
        np.testing.assert_array_equal(bias.Quantization().ScaleAsNumpy(),
                                      (s_in * w.scale.astype(np.float64)).astype(np.float32))
    x = by_name[graph.inputs[0]].Quantization()
    assert x.ScaleLength() == 1 and x.ZeroPointAsNumpy()[0] == graph.tensors[graph.inputs[0]].zero_point[0]


def test_omitted_conv_bias_becomes_zero_bias_and_per_tensor_bias_scale():
    b = GraphBuilder(np.random.default_rng(2), (1, 6, 6, 3))
    y = b.depthwise(b.conv(b.input, 4, 3, bias=False, per_channel=False), 3, bias=False)
    graph = b.build(y)
    sub = parse(write_tflite(graph)).Subgraphs(0)
    for i in range(2):
        op = sub.Operators(i)
        assert op.InputsLength() == 3
        bias = sub.Tensors(op.Inputs(2))
        assert bias.Type() == 2
    assert sub.Tensors(sub.Operators(0).Inputs(2)).Quantization().ScaleLength() == 1  # per-tensor weights


def test_per_channel_fc_with_keep_num_dims_is_flattened():
    b = GraphBuilder(np.random.default_rng(3), (1, 3, 4, 5))
    graph = b.build(b.fc(b.input, 6, keep_num_dims=True, per_channel=True))
    model = write_tflite(graph)
    m = parse(model)
    assert opcode_names(m, m.Subgraphs(0)) == ["RESHAPE", "FULLY_CONNECTED", "RESHAPE"]
    x = np.random.default_rng(0).integers(-128, 128, size=(2, 3, 4, 5), dtype=np.int8)
    ours = run_graph(graph, x)
    assert ours.shape == (2, 3, 4, 6)
    np.testing.assert_array_equal(ours, run_tflite(model, x, reference_kernels=True))


def test_concat_inputs_with_foreign_quantisation_get_requantised():
    graph = plain_cnn_graph(np.random.default_rng(4))
    concat = next(op for op in graph.ops if op.kind == "CONCATENATION")
    out = graph.tensors[concat.outputs[0]]
    foreign = sum(graph.tensors[n].scale[0] != out.scale[0] for n in concat.inputs)
    assert foreign >= 1
    m = parse(write_tflite(graph))
    kinds = opcode_names(m, m.Subgraphs(0))
    assert kinds.count("QUANTIZE") == foreign
    assert kinds.index("QUANTIZE") < kinds.index("CONCATENATION")


def test_float_io_edges():
    graph = mobilenet_v2_graph(np.random.default_rng(5))
    m = parse(write_tflite(graph, float_io=True))
    sub = m.Subgraphs(0)
    kinds = opcode_names(m, sub)
    assert kinds[0] == "QUANTIZE" and kinds[-1] == "DEQUANTIZE"
    assert sub.Tensors(sub.Inputs(0)).Type() == 0 and sub.Tensors(sub.Outputs(0)).Type() == 0  # FLOAT32


def small_graph():
    b = GraphBuilder(np.random.default_rng(6), (1, 8, 8, 3))
    x = b.conv(b.input, 4, 3, stride=2)
    y = b.pool("MAX_POOL_2D", x, 2, stride=2)
    return b.build(b.fc(b.reshape(y, [-1, 16]), 5)), x, y


def test_unsupported_op_names_node_and_op():
    graph, x, _ = small_graph()
    graph.ops.append(QOp("SOFTMAX", [graph.outputs[0]], ["probs"], {}, name="head/softmax"))
    with pytest.raises(UnsupportedOpError, match=r"node 'head/softmax': op 'SOFTMAX' is not supported"):
        write_tflite(graph)


@pytest.mark.parametrize(
    ("activation", "kind"), [("TANH", "CONV_2D"), ("RELU", "CONCATENATION")],
)
def test_unsupported_fused_activation(activation, kind):
    graph, x, _ = small_graph()
    if kind == "CONCATENATION":
        graph.tensors["cat"] = replace(graph.tensors[x], name="cat", shape=(1, 4, 4, 8))
        graph.ops.append(QOp("CONCATENATION", [x, x], ["cat"], {"axis": 3, "activation": activation}, name="cat_op"))
    else:
        graph.ops[0].options["activation"] = activation
    with pytest.raises(UnsupportedOpError, match=rf"op '{kind}'.*{activation}"):
        write_tflite(graph)


def _mutations():
    def wrong_shape(g, x, y):
        g.tensors[x] = replace(g.tensors[x], shape=(1, 5, 4, 4))

    def pool_changes_scale(g, x, y):
        g.tensors[y] = replace(g.tensors[y], scale=g.tensors[y].scale * 2)

    def asymmetric_weights(g, x, y):
        w = g.ops[0].inputs[1]
        g.tensors[w] = replace(g.tensors[w], zero_point=g.tensors[w].zero_point + 1)

    def bias_wrong_length(g, x, y):
        bias = g.ops[0].inputs[2]
        g.tensors[bias] = replace(g.tensors[bias], shape=(3,), data=g.tensors[bias].data[:3])

    def missing_stride(g, x, y):
        del g.ops[0].options["stride_h"]

    def used_before_defined(g, x, y):
        g.ops.reverse()

    def activation_per_channel(g, x, y):
        g.tensors[x] = replace(g.tensors[x], scale=np.ones(4, np.float32), zero_point=np.zeros(4, np.int64))

    def float_into_conv(g, x, y):
        i = g.inputs[0]
        g.tensors[i] = replace(g.tensors[i], dtype="float32")

    def wrong_bias_scale(g, x, y):
        bias = g.ops[0].inputs[2]
        g.tensors[bias] = replace(g.tensors[bias], scale=g.tensors[bias].scale * 1.5)

    return [
        (wrong_shape, "declared \\[1, 5, 4, 4\\] but the op produces \\[1, 4, 4, 4\\]"),
        (pool_changes_scale, "MAX_POOL_2D.*share scale and zero point"),
        (asymmetric_weights, "must be symmetric"),
        (bias_wrong_length, "must be a constant int32 tensor of shape \\[4\\]"),
        (missing_stride, "missing option 'stride_h'"),
        (used_before_defined, "used before any op produces it"),
        (activation_per_channel, "must be quantised per tensor"),
        (float_into_conv, "expects int8 -> int8, got float32"),
        (wrong_bias_scale, "input scale x weight scale"),
    ]


@pytest.mark.parametrize(("mutate", "message"), _mutations(), ids=lambda v: getattr(v, "__name__", ""))
def test_invalid_graphs_are_refused_with_node_and_reason(mutate, message):
    graph, x, y = small_graph()
    write_tflite(graph)  # valid before the mutation
    mutate(graph, x, y)
    with pytest.raises(GraphError, match=message) as info:
        write_tflite(graph)
    assert "graph 'random'" in str(info.value)


def test_scales_tflite_would_refuse_or_abort_on_are_refused():
    b = GraphBuilder(np.random.default_rng(7), (1, 4, 4, 2))
    y = b.add(b.input, b.input)
    graph = b.build(y)
    graph.tensors[y] = replace(graph.tensors[y], scale=graph.tensors[y].scale / 2**21)
    with pytest.raises(GraphError, match=r"ADD\): output scale is over 2\*\*19 times smaller"):
        write_tflite(graph)
    graph, x, _ = small_graph()  # the conv has a fused RELU6: round(6 / scale) must fit int32
    graph.tensors[x] = replace(graph.tensors[x], scale=np.array([1e-10], np.float32))
    graph.tensors[graph.ops[1].outputs[0]] = replace(graph.tensors[graph.ops[1].outputs[0]],
                                                     scale=np.array([1e-10], np.float32))
    with pytest.raises(GraphError, match="too small for a fused RELU6"):
        write_tflite(graph)
