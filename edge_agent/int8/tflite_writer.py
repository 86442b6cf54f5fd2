"""The project's own TFLite writer: QGraph -> fully-int8 .tflite flatbuffer, no TensorFlow.

Built with the `tflite` schema package and `flatbuffers`. Output: schema version 3, one
subgraph, buffer 0 the empty sentinel, one buffer per constant (16-byte aligned), operator
codes with both `deprecated_builtin_code` and `builtin_code`, per-channel quantisation with
`quantized_dimension`. The graph is validated first (`reference.check_graph`).

Rewrites that keep TFLite's int8 kernels equivalent to the reference (they add tensors/ops,
so `read_tflite(write_tflite(g))` runs identically to g but need not be identical):
- an omitted CONV_2D / DEPTHWISE_CONV_2D bias becomes an explicit zero bias (TFLite requires
  one); every bias is written with scale s_in * s_w, per tensor if the weights are;
- a per-channel FULLY_CONNECTED with keep_num_dims on rank > 2 input is written as
  RESHAPE -> FC -> RESHAPE (tflite-runtime 2.14's reference kernel mishandles it);
- a CONCATENATION input whose scale/zero point differ from the output's gets an int8->int8
  QUANTIZE (requantise) in front, because TFLite's int8 concat refuses mixed quantisation;
- `float_io=True` adds float32 QUANTIZE / DEQUANTIZE edges around int8 graph inputs/outputs.
"""

from __future__ import annotations

import importlib
from dataclasses import replace
from types import ModuleType
from typing import Any

import flatbuffers
import numpy as np

from .graph import QGraph, QOp, QTensor
from .reference import check_graph
from .reference_ops import bias_scales, same_quant

FILE_IDENTIFIER = b"TFL3"
SCHEMA_VERSION = 3


def _mod(name: str) -> ModuleType:
    # `import tflite.Model` would give the class (the package star-imports its modules).
    return importlib.import_module(f"tflite.{name}")


_TENSOR_TYPE = {"float32": 0, "int32": 2, "int8": 9}  # tflite.TensorType values
_ACTIVATION = {"NONE": 0, "RELU": 1, "RELU6": 3}  # tflite.ActivationFunctionType values
_PADDING = {"SAME": 0, "VALID": 1}  # tflite.Padding values

# op kind -> (BuiltinOperator code, BuiltinOptions union type, options module name)
OPS: dict[str, tuple[int, int, str]] = {
    "ADD": (0, 11, "AddOptions"),
    "AVERAGE_POOL_2D": (1, 5, "Pool2DOptions"),
    "CONCATENATION": (2, 10, "ConcatenationOptions"),
    "CONV_2D": (3, 1, "Conv2DOptions"),
    "DEPTHWISE_CONV_2D": (4, 2, "DepthwiseConv2DOptions"),
    "DEQUANTIZE": (6, 0, ""),
    "FULLY_CONNECTED": (9, 8, "FullyConnectedOptions"),
    "MAX_POOL_2D": (17, 5, "Pool2DOptions"),
    "RESHAPE": (22, 17, "ReshapeOptions"),
    "PAD": (34, 22, "PadOptions"),
    "GATHER": (36, 23, "GatherOptions"),
    "PADV2": (60, 43, "PadV2Options"),
    "MEAN": (40, 27, "ReducerOptions"),
    "QUANTIZE": (114, 0, ""),
    "LOGISTIC": (14, 0, ""),
    "MUL": (18, 21, "MulOptions"),
    "HARD_SWISH": (117, 0, ""),
}


def op_version(op: QOp, graph: QGraph) -> int:
    """The operator version TFLite's converter would record for this int8 op."""
    if op.kind == "CONV_2D" and graph.tensor(op.inputs[0]).shape[3] != graph.tensor(op.inputs[1]).shape[3]:
        return 6  # grouped convolution (op_version.cc)
    if op.kind in ("CONV_2D", "DEPTHWISE_CONV_2D"):
        return 3
    if op.kind == "FULLY_CONNECTED":
        if len(op.inputs) < 3 or not op.inputs[2]:
            return 6
        return 5 if op.options.get("keep_num_dims", False) else 4
    if op.kind in ("RESHAPE", "HARD_SWISH"):
        return 1
    if op.kind == "QUANTIZE":
        return 2 if graph.tensor(op.inputs[0]).dtype == "int8" else 1
    return 2


def with_float_io(graph: QGraph) -> QGraph:
    """A copy of `graph` whose int8 inputs/outputs are fed/read through float32 edges."""
    tensors, ops = dict(graph.tensors), []
    inputs, outputs = [], []
    for name in graph.inputs:
        t = graph.tensor(name)
        if t.dtype != "int8":
            inputs.append(name)
            continue
        fname = _fresh(tensors, f"{name}/float")
        tensors[fname] = QTensor(fname, tuple(t.shape), "float32")
        ops.append(QOp("QUANTIZE", [fname], [name], {}, name=f"{name}/quantize"))
        inputs.append(fname)
    ops.extend(graph.ops)
    for name in graph.outputs:
        t = graph.tensor(name)
        if t.dtype != "int8":
            outputs.append(name)
            continue
        fname = _fresh(tensors, f"{name}/float")
        tensors[fname] = QTensor(fname, tuple(t.shape), "float32")
        ops.append(QOp("DEQUANTIZE", [name], [fname], {}, name=f"{name}/dequantize"))
        outputs.append(fname)
    return QGraph(tensors, ops, inputs, outputs, name=graph.name)


def _fresh(tensors: dict[str, QTensor], base: str) -> str:
    name, i = base, 1
    while name in tensors:
        name, i = f"{base}_{i}", i + 1
    return name


def _bias_for_every_conv(graph: QGraph) -> QGraph:
    """TFLite's int8 CONV_2D / DEPTHWISE_CONV_2D refuse to prepare without a bias: give an
    omitted one an explicit zero bias (the same arithmetic)."""
    tensors, ops = dict(graph.tensors), []
    for op in graph.ops:
        if op.kind in ("CONV_2D", "DEPTHWISE_CONV_2D") and (len(op.inputs) < 3 or not op.inputs[2]):
            w = graph.tensor(op.inputs[1])
            channels = w.shape[0] if op.kind == "CONV_2D" else w.shape[3]
            name = _fresh(tensors, f"{w.name}/zero_bias")
            tensors[name] = QTensor(name, (channels,), "int32", data=np.zeros(channels, dtype=np.int32))
            op = replace(op, inputs=[*op.inputs[:2], name])
        ops.append(op)
    return QGraph(tensors, ops, list(graph.inputs), list(graph.outputs), name=graph.name)


def _flatten_per_channel_fc(graph: QGraph) -> QGraph:
    """Per-channel FULLY_CONNECTED with keep_num_dims on rank > 2 input becomes RESHAPE ->
    FC -> RESHAPE: tflite-runtime 2.14's reference kernel for it takes output dim 0 as the
    batch and dim 1 as the depth, writing garbage (out of bounds) instead of the result."""
    tensors, ops = dict(graph.tensors), []
    for op in graph.ops:
        x, w, y = (graph.tensor(n) for n in (op.inputs[0], op.inputs[1], op.outputs[0])) if \
            op.kind == "FULLY_CONNECTED" else (None, None, None)
        if x is None or not (op.options.get("keep_num_dims") and w.per_channel and len(x.shape) > 2):
            ops.append(op)
            continue
        rows = int(np.prod(x.shape[:-1]))
        x2, y2 = _fresh(tensors, f"{x.name}/flat"), _fresh(tensors, f"{y.name}/flat")
        tensors[x2] = replace(x, name=x2, shape=(rows, x.shape[-1]))
        tensors[y2] = replace(y, name=y2, shape=(rows, y.shape[-1]))
        ops.append(QOp("RESHAPE", [x.name], [x2], {"new_shape": [-1, x.shape[-1]]}, name=f"{op.name}/flatten"))
        ops.append(replace(op, inputs=[x2, *op.inputs[1:]], outputs=[y2],
                           options={**op.options, "keep_num_dims": False}))
        ops.append(QOp("RESHAPE", [y2], [y.name], {"new_shape": [-1, *y.shape[1:]]}, name=f"{op.name}/unflatten"))
    return QGraph(tensors, ops, list(graph.inputs), list(graph.outputs), name=graph.name)


def _derive_bias_quant(graph: QGraph) -> QGraph:
    """Write every bias with the quantisation its op implies (see `bias_scales`): TFLite
    reads a tensor's legacy per-tensor scale only when it has exactly one, and its
    per-tensor FULLY_CONNECTED checks the bias scale against s_in * s_w."""
    tensors = dict(graph.tensors)
    for op in graph.ops:
        if op.kind in ("CONV_2D", "DEPTHWISE_CONV_2D", "FULLY_CONNECTED") and len(op.inputs) > 2 and op.inputs[2]:
            scales = bias_scales(graph, op)
            tensors[op.inputs[2]] = replace(graph.tensor(op.inputs[2]), scale=scales,
                                            zero_point=np.zeros(scales.size, dtype=np.int64), quantized_dim=0)
    return QGraph(tensors, list(graph.ops), list(graph.inputs), list(graph.outputs), name=graph.name)


def _requantise_concat_inputs(graph: QGraph) -> QGraph:
    """Insert int8->int8 QUANTIZE ops in front of concat inputs with foreign quantisation."""
    tensors, ops = dict(graph.tensors), []
    for op in graph.ops:
        if op.kind != "CONCATENATION":
            ops.append(op)
            continue
        y = graph.tensor(op.outputs[0])
        new_inputs = []
        for name in op.inputs:
            t = graph.tensor(name)
            if same_quant(t, y):
                new_inputs.append(name)
                continue
            rq = _fresh(tensors, f"{name}/requant")
            tensors[rq] = QTensor(rq, tuple(t.shape), "int8", np.array(y.scale, dtype=np.float32).reshape(1)[:1],
                                  np.array(y.zero_point, dtype=np.int64).reshape(1)[:1])
            ops.append(QOp("QUANTIZE", [name], [rq], {}, name=f"{op.name or y.name}/requant_{len(new_inputs)}"))
            new_inputs.append(rq)
        ops.append(replace(op, inputs=new_inputs))
    return QGraph(tensors, ops, list(graph.inputs), list(graph.outputs), name=graph.name)


def write_tflite(graph: QGraph, *, description: str = "edge-agent", float_io: bool = False) -> bytes:
    """Serialise `graph` as a .tflite flatbuffer (identifier TFL3, schema version 3).

    Raises UnsupportedOpError (naming node and op) or reference.GraphError if the graph
    cannot be expressed. `float_io=True` adds float32 QUANTIZE/DEQUANTIZE edges.
    """
    check_graph(graph)
    if float_io:
        graph = with_float_io(graph)
    graph = _derive_bias_quant(_bias_for_every_conv(_flatten_per_channel_fc(graph)))
    graph = _requantise_concat_inputs(graph)
    return _Serializer(graph).build(description)


class _Serializer:
    def __init__(self, graph: QGraph) -> None:
        self.graph = graph
        self.b = flatbuffers.Builder(1 << 16)
        self.index: dict[str, int] = {}
        order: list[str] = []
        for name in [*graph.inputs, *(n for op in graph.ops for n in [*op.inputs, *op.outputs])]:
            if name and name not in self.index:
                self.index[name] = len(order)
                order.append(name)
        self.order = order

    def build(self, description: str) -> bytes:
        b, g = self.b, self.graph
        buffer_of, buffers = {}, [self._buffer(None)]
        for name in self.order:
            t = g.tensor(name)
            if t.data is not None:
                buffer_of[name] = len(buffers)
                buffers.append(self._buffer(np.ascontiguousarray(t.data, dtype=np.dtype(t.dtype))))
        tensors = [self._tensor(g.tensor(n), buffer_of.get(n, 0)) for n in self.order]
        kinds = sorted({(op.kind, op_version(op, g)) for op in g.ops})
        code_index = {k: i for i, k in enumerate(kinds)}
        operators = [self._operator(op, code_index[(op.kind, op_version(op, g))]) for op in g.ops]
        m = _mod("SubGraph")
        tensors_vec = self._offsets(m.StartTensorsVector, tensors)
        inputs_vec = self._ints([self.index[n] for n in g.inputs])
        outputs_vec = self._ints([self.index[n] for n in g.outputs])
        ops_vec = self._offsets(m.StartOperatorsVector, operators)
        name = b.CreateString(g.name)
        m.Start(b)
        m.AddTensors(b, tensors_vec)
        m.AddInputs(b, inputs_vec)
        m.AddOutputs(b, outputs_vec)
        m.AddOperators(b, ops_vec)
        m.AddName(b, name)
        subgraph = m.End(b)
        codes = [self._opcode(kind, version) for kind, version in kinds]
        mm = _mod("Model")
        codes_vec = self._offsets(mm.StartOperatorCodesVector, codes)
        subgraphs_vec = self._offsets(mm.StartSubgraphsVector, [subgraph])
        buffers_vec = self._offsets(mm.StartBuffersVector, buffers)
        desc = b.CreateString(description)
        mm.Start(b)
        mm.AddVersion(b, SCHEMA_VERSION)
        mm.AddOperatorCodes(b, codes_vec)
        mm.AddSubgraphs(b, subgraphs_vec)
        mm.AddDescription(b, desc)
        mm.AddBuffers(b, buffers_vec)
        b.Finish(mm.End(b), file_identifier=FILE_IDENTIFIER)
        return bytes(b.Output())

    def _offsets(self, start: Any, items: list[int]) -> int:
        start(self.b, len(items))
        for item in reversed(items):
            self.b.PrependUOffsetTRelative(item)
        return self.b.EndVector()

    def _ints(self, values: list[int]) -> int:
        return self.b.CreateNumpyVector(np.asarray(values, dtype=np.int32))

    def _buffer(self, data: np.ndarray | None) -> int:
        b, m = self.b, _mod("Buffer")
        vec = None
        if data is not None:
            raw = data.astype(data.dtype.newbyteorder("<"), copy=False).tobytes()
            b.StartVector(1, len(raw), 16)  # aligned so the runtime can use the data in place
            b.head -= len(raw)
            b.Bytes[b.head : b.head + len(raw)] = raw
            vec = b.EndVector()
        m.Start(b)
        if vec is not None:
            m.AddData(b, vec)
        return m.End(b)

    def _tensor(self, t: QTensor, buffer: int) -> int:
        b, m = self.b, _mod("Tensor")
        quant = self._quantization(t) if t.scale is not None else None
        name = b.CreateString(t.name)
        shape = self._ints(list(t.shape))
        m.Start(b)
        m.AddShape(b, shape)
        m.AddType(b, self._type_code(t))
        m.AddBuffer(b, buffer)
        m.AddName(b, name)
        if quant is not None:
            m.AddQuantization(b, quant)
        return m.End(b)

    def _type_code(self, t: QTensor) -> int:
        return _TENSOR_TYPE[t.dtype]

    def _quantization(self, t: QTensor) -> int:
        b, m = self.b, _mod("QuantizationParameters")
        scale = b.CreateNumpyVector(np.asarray(t.scale, dtype=np.float32).reshape(-1))
        zp = b.CreateNumpyVector(np.asarray(t.zero_point, dtype=np.int64).reshape(-1))
        m.Start(b)
        m.AddScale(b, scale)
        m.AddZeroPoint(b, zp)
        m.AddQuantizedDimension(b, int(t.quantized_dim) if t.per_channel else 0)
        return m.End(b)

    def _opcode(self, kind: str, version: int) -> int:
        b, m = self.b, _mod("OperatorCode")
        code = OPS[kind][0]
        m.Start(b)
        m.AddDeprecatedBuiltinCode(b, min(code, 127))  # 127 = PLACEHOLDER_FOR_GREATER_OP_CODES
        m.AddBuiltinCode(b, code)
        m.AddVersion(b, version)
        return m.End(b)

    def _operator(self, op: QOp, opcode_index: int) -> int:
        b, m = self.b, _mod("Operator")
        _, options_type, _ = OPS[op.kind]
        options = self._options(op)
        inputs = self._ints([self.index[n] if n else -1 for n in op.inputs])
        outputs = self._ints([self.index[n] for n in op.outputs])
        m.Start(b)
        m.AddOpcodeIndex(b, opcode_index)
        m.AddInputs(b, inputs)
        m.AddOutputs(b, outputs)
        if options is not None:
            m.AddBuiltinOptionsType(b, options_type)
            m.AddBuiltinOptions(b, options)
        return m.End(b)

    def _options(self, op: QOp) -> int | None:
        b, o, kind = self.b, op.options, op.kind
        name = OPS[kind][2]
        if not name:
            return None
        m = _mod(name)
        act = _ACTIVATION[o.get("activation", "NONE")]
        new_shape = self._ints([int(d) for d in o["new_shape"]]) if kind == "RESHAPE" else None
        m.Start(b)
        if kind in ("CONV_2D", "DEPTHWISE_CONV_2D"):
            m.AddPadding(b, _PADDING[o["padding"]])
            m.AddStrideW(b, int(o["stride_w"]))
            m.AddStrideH(b, int(o["stride_h"]))
            m.AddDilationWFactor(b, int(o.get("dilation_w", 1)))
            m.AddDilationHFactor(b, int(o.get("dilation_h", 1)))
            m.AddFusedActivationFunction(b, act)
            if kind == "DEPTHWISE_CONV_2D":
                m.AddDepthMultiplier(b, int(o["depth_multiplier"]))
        elif kind in ("AVERAGE_POOL_2D", "MAX_POOL_2D"):
            m.AddPadding(b, _PADDING[o["padding"]])
            m.AddStrideW(b, int(o["stride_w"]))
            m.AddStrideH(b, int(o["stride_h"]))
            m.AddFilterWidth(b, int(o["filter_w"]))
            m.AddFilterHeight(b, int(o["filter_h"]))
            m.AddFusedActivationFunction(b, act)
        elif kind == "FULLY_CONNECTED":
            m.AddFusedActivationFunction(b, act)
            m.AddKeepNumDims(b, bool(o.get("keep_num_dims", False)))
        elif kind in ("ADD", "MUL"):
            m.AddFusedActivationFunction(b, act)
        elif kind == "CONCATENATION":
            m.AddAxis(b, int(o.get("axis", -1)))
            m.AddFusedActivationFunction(b, act)
        elif kind == "MEAN":
            m.AddKeepDims(b, bool(o.get("keep_dims", False)))
        elif kind == "RESHAPE":
            m.AddNewShape(b, new_shape)
        elif kind == "GATHER":
            m.AddAxis(b, int(o.get("axis", 0)))
        return m.End(b)
