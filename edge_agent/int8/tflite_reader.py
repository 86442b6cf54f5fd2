"""Reads int8 .tflite flatbuffers (the ones `write_tflite` produces) back into a QGraph.

The bytes are untrusted (a bundle from the network, a file on an SD card). Order of checks:
size limit, identifier "TFL3", schema version, then every index, count and length before it
is used (vector lengths are bounded by the file size, so a corrupt length cannot make us
loop or allocate without end), then the graph's semantics via `reference.check_graph`.
Every failure, including whatever the flatbuffers accessors raise on garbage, becomes a
`TFLiteFormatError` (an InputError) that says what was being read and where.
"""

from __future__ import annotations

import importlib
import struct
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import InputError
from .graph import QGraph, QOp, QTensor, UnsupportedOpError
from .reference import GraphError, check_graph
from .tflite_writer import FILE_IDENTIFIER, OPS, SCHEMA_VERSION

DEFAULT_MAX_BYTES = 128 << 20

_TYPES = {0: "float32", 2: "int32", 9: "int8"}
_TYPE_NAMES = {0: "FLOAT32", 1: "FLOAT16", 2: "INT32", 3: "UINT8", 4: "INT64", 5: "STRING", 6: "BOOL",
               7: "INT16", 9: "INT8", 10: "FLOAT64"}
_KIND_OF_CODE = {code: kind for kind, (code, _, _) in OPS.items()}
_ACTIVATIONS = {0: "NONE", 1: "RELU", 3: "RELU6"}
_PADDINGS = {0: "SAME", 1: "VALID"}


class TFLiteFormatError(InputError):
    """A .tflite file that is truncated, corrupt, too large or outside what we support."""


def _mod(name: str) -> Any:
    return importlib.import_module(f"tflite.{name}")


def _op_name(code: int) -> str:
    try:
        return str(importlib.import_module("tflite.utils").opcode2name(code))
    except Exception:  # an unknown or corrupt code
        return f"builtin code {code}"


def read_tflite(data: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES, where: str = "tflite model") -> QGraph:
    """Parse and validate `data`; raises TFLiteFormatError naming what and where."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TFLiteFormatError(f"{where}: expected bytes, got {type(data).__name__}")
    size = len(data)
    if size > max_bytes:
        raise TFLiteFormatError(f"{where}: {size} bytes is over the limit of {max_bytes}")
    if size < 8:
        raise TFLiteFormatError(f"{where}: truncated ({size} bytes; a flatbuffer header needs 8)")
    if bytes(data[4:8]) != FILE_IDENTIFIER:
        kind = "zero-filled" if not any(bytes(data[:64])) else f"identifier {bytes(data[4:8])!r}"
        raise TFLiteFormatError(f"{where}: not a TFLite model ({kind}, expected {FILE_IDENTIFIER!r})")
    (root,) = struct.unpack_from("<I", data, 0)
    if root + 4 > size:
        raise TFLiteFormatError(f"{where}: truncated (root table at byte {root}, file is {size} bytes)")
    return _Reader(bytes(data), where).graph()


class _Reader:
    def __init__(self, data: bytes, where: str) -> None:
        self.data = data
        self.where = where
        self.context = "model header"

    def fail(self, message: str) -> TFLiteFormatError:
        return TFLiteFormatError(f"{self.where}: {self.context}: {message}")

    def graph(self) -> QGraph:
        try:
            return self._graph()
        except TFLiteFormatError:
            raise
        except (UnsupportedOpError, GraphError) as exc:
            raise TFLiteFormatError(f"{self.where}: {exc}") from None
        except Exception as exc:  # garbage offsets make the accessors raise anything
            raise self.fail(f"corrupt or truncated flatbuffer ({type(exc).__name__}: {exc})") from None

    def count(self, n: int, what: str, elem_size: int = 4) -> int:
        """A vector length, refused if it cannot fit in the file (corrupt length)."""
        if n < 0 or n * elem_size > len(self.data):
            raise self.fail(f"{what} count {n} cannot fit in {len(self.data)} bytes")
        return n

    def ints(self, is_none: Callable[[], bool], as_numpy: Callable[[], Any], what: str) -> list[int]:
        if is_none():
            return []
        arr = as_numpy()
        if not isinstance(arr, np.ndarray):
            raise self.fail(f"{what} is not a vector")
        return [int(v) for v in arr.reshape(-1)]

    def _graph(self) -> QGraph:
        model = _mod("Model").Model.GetRootAs(self.data, 0)
        version = model.Version()
        if version != SCHEMA_VERSION:
            raise self.fail(f"schema version {version}, expected {SCHEMA_VERSION}")
        if self.count(model.SubgraphsLength(), "subgraph") != 1:
            raise self.fail(f"{model.SubgraphsLength()} subgraphs; only single-subgraph models are supported")
        n_buffers = self.count(model.BuffersLength(), "buffer")
        self._check_buffers(model, n_buffers)
        codes = self._opcodes(model)
        sub = model.Subgraphs(0)
        self.context = "subgraph 0"
        name = (sub.Name() or b"tflite").decode("utf-8", "replace")
        tensors, names = {}, []
        for i in range(self.count(sub.TensorsLength(), "tensor")):
            t = self._tensor(model, sub.Tensors(i), i, n_buffers, tensors)
            tensors[t.name] = t
            names.append(t.name)
        ops = [self._operator(sub.Operators(i), i, codes, names, tensors)
               for i in range(self.count(sub.OperatorsLength(), "operator"))]
        self.context = "subgraph 0 inputs/outputs"
        io = []
        for what, is_none, as_numpy in (("inputs", sub.InputsIsNone, sub.InputsAsNumpy),
                                        ("outputs", sub.OutputsIsNone, sub.OutputsAsNumpy)):
            idx = self.ints(is_none, as_numpy, what)
            if not idx or any(not 0 <= j < len(names) for j in idx):
                raise self.fail(f"{what} {idx} are not tensor indices in [0, {len(names)})")
            io.append([names[j] for j in idx])
        graph = QGraph(tensors, ops, io[0], io[1], name=name)
        check_graph(graph)
        return graph

    def _check_buffers(self, model: Any, n: int) -> None:
        """Touch every buffer table (the writer puts them at the end of the file, so this
        also catches a tail cut off); buffer 0 must be the empty sentinel."""
        for i in range(n):
            self.context = f"buffer {i}"
            b = model.Buffers(i)
            length = self.count(b.DataLength(), "data byte", 1) if not b.DataIsNone() else 0
            if i == 0 and length:
                raise self.fail("buffer 0 must be empty (it stands for 'no data')")

    def _opcodes(self, model: Any) -> list[tuple[int, int]]:
        codes = []
        for i in range(self.count(model.OperatorCodesLength(), "operator code")):
            self.context = f"operator code {i}"
            oc = model.OperatorCodes(i)
            # TFLite's rule: the larger of the deprecated int8 field and the int32 field.
            codes.append((max(int(oc.DeprecatedBuiltinCode()), int(oc.BuiltinCode())), int(oc.Version())))
        return codes

    def _tensor(self, model: Any, t: Any, i: int, n_buffers: int, seen: dict[str, QTensor]) -> QTensor:
        raw_name = t.Name()
        name = raw_name.decode("utf-8", "replace") if raw_name else f"tensor_{i}"
        self.context = f"tensor {i} {name!r}"
        if name in seen:  # TFLite does not require unique names; QGraph does
            name = f"{name}#{i}"
        ttype = t.Type()
        if ttype not in _TYPES:
            raise self.fail(f"type {_TYPE_NAMES.get(ttype, ttype)} is not supported (int8, int32, float32 only)")
        dtype = _TYPES[ttype]
        shape = tuple(self.ints(t.ShapeIsNone, t.ShapeAsNumpy, "shape"))
        if len(shape) > 8 or any(d < 1 for d in shape):
            raise self.fail(f"shape {list(shape)} is not a static shape of positive dimensions")
        scale = zero_point = None
        qdim = 0
        q = t.Quantization()
        if q is not None and not q.ScaleIsNone():
            scale = np.array(q.ScaleAsNumpy(), dtype=np.float32).reshape(-1)
            zero_point = (np.zeros(scale.size, dtype=np.int64) if q.ZeroPointIsNone()
                          else np.array(q.ZeroPointAsNumpy(), dtype=np.int64).reshape(-1))
            qdim = int(q.QuantizedDimension())
            if scale.size > 1 and not (0 <= qdim < len(shape) and shape[qdim] == scale.size):
                raise self.fail(f"{scale.size} per-channel scales do not match dimension {qdim} of {list(shape)}")
            if scale.size == 0:
                scale = zero_point = None
        buf = t.Buffer()
        if not 0 <= buf < n_buffers:
            raise self.fail(f"buffer index {buf} is out of range ({n_buffers} buffers)")
        return QTensor(name, shape, dtype, scale, zero_point, qdim, self._buffer(model, buf, dtype, shape))

    def _buffer(self, model: Any, index: int, dtype: str, shape: tuple[int, ...]) -> np.ndarray | None:
        if index == 0:
            return None
        b = model.Buffers(index)
        if b.Offset() > 1:  # data stored after the flatbuffer (models over 2 GB)
            raise self.fail(f"buffer {index} keeps its data outside the flatbuffer; not supported")
        if b.DataIsNone() or b.DataLength() == 0:
            return None
        self.count(b.DataLength(), f"buffer {index} byte", 1)
        raw = b.DataAsNumpy()
        expected = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if raw.size != expected:
            raise self.fail(f"buffer {index} holds {raw.size} bytes; shape {list(shape)} of {dtype} needs {expected}")
        return np.frombuffer(raw.tobytes(), dtype=np.dtype(dtype).newbyteorder("<")).astype(dtype).reshape(shape)

    def _operator(self, op: Any, i: int, codes: list[tuple[int, int]], names: list[str],
                  tensors: dict[str, QTensor]) -> QOp:
        self.context = f"operator {i}"
        index = op.OpcodeIndex()
        if not 0 <= index < len(codes):
            raise self.fail(f"operator code index {index} is out of range ({len(codes)} codes)")
        code, _version = codes[index]
        kind = _KIND_OF_CODE.get(code)
        if kind is None:
            raise self.fail(f"op {_op_name(code)} is not supported by the int8 path")
        self.context = f"operator {i} ({kind})"
        ins = self.ints(op.InputsIsNone, op.InputsAsNumpy, "inputs")
        outs = self.ints(op.OutputsIsNone, op.OutputsAsNumpy, "outputs")
        if len(outs) != 1 or not ins:
            raise self.fail(f"{len(ins)} inputs and {len(outs)} outputs")
        for j, k in enumerate(ins):
            optional = k == -1 and j == 2 and kind in ("CONV_2D", "DEPTHWISE_CONV_2D", "FULLY_CONNECTED")
            if not (0 <= k < len(names) or optional):
                raise self.fail(f"input {j} is tensor index {k}, out of range ({len(names)} tensors)")
        if not 0 <= outs[0] < len(names):
            raise self.fail(f"output is tensor index {outs[0]}, out of range ({len(names)} tensors)")
        inputs = [names[k] if k >= 0 else "" for k in ins]
        while len(inputs) > 2 and inputs[-1] == "":
            inputs.pop()
        output = names[outs[0]]
        options = self._options(op, kind)
        if kind == "RESHAPE" and len(inputs) == 2:  # shape given as a tensor: fold into options
            shape_t = tensors[inputs[1]]
            if shape_t.data is None or shape_t.dtype != "int32":
                raise self.fail("the shape input must be a constant int32 tensor")
            options["new_shape"] = [int(v) for v in shape_t.data.reshape(-1)]
            inputs = inputs[:1]
        if kind == "RESHAPE" and "new_shape" not in options:
            options["new_shape"] = list(tensors[output].shape)
        return QOp(kind, inputs, [output], options, name=output)

    def _options(self, op: Any, kind: str) -> dict[str, Any]:
        _, union_type, module = OPS[kind]
        if not module:
            return {}
        if op.BuiltinOptionsType() != union_type or op.BuiltinOptions() is None:
            if kind in ("PAD", "PADV2", "RESHAPE"):
                return {}
            raise self.fail("builtin options are missing or of the wrong type")
        table = op.BuiltinOptions()
        opts = getattr(_mod(module), module)()
        opts.Init(table.Bytes, table.Pos)
        act = lambda: self._enum(_ACTIVATIONS, opts.FusedActivationFunction(), "fused activation")  # noqa: E731
        pad = lambda: self._enum(_PADDINGS, opts.Padding(), "padding")  # noqa: E731
        if kind in ("CONV_2D", "DEPTHWISE_CONV_2D"):
            o = {"stride_h": opts.StrideH(), "stride_w": opts.StrideW(), "padding": pad(),
                 "dilation_h": opts.DilationHFactor(), "dilation_w": opts.DilationWFactor(), "activation": act()}
            if kind == "DEPTHWISE_CONV_2D":
                o["depth_multiplier"] = opts.DepthMultiplier()
            return o
        if kind in ("AVERAGE_POOL_2D", "MAX_POOL_2D"):
            return {"stride_h": opts.StrideH(), "stride_w": opts.StrideW(), "filter_h": opts.FilterHeight(),
                    "filter_w": opts.FilterWidth(), "padding": pad(), "activation": act()}
        if kind == "FULLY_CONNECTED":
            if opts.WeightsFormat() != 0:
                raise self.fail("shuffled FULLY_CONNECTED weights are not supported")
            return {"activation": act(), "keep_num_dims": bool(opts.KeepNumDims())}
        if kind in ("ADD", "MUL"):
            return {"activation": act()}
        if kind == "CONCATENATION":
            return {"axis": opts.Axis(), "activation": act()}
        if kind == "MEAN":
            return {"keep_dims": bool(opts.KeepDims())}
        if kind == "GATHER":
            if opts.BatchDims() != 0:
                raise self.fail("GATHER with batch_dims is not supported")
            return {"axis": opts.Axis()}
        if kind == "RESHAPE":
            if opts.NewShapeIsNone():
                return {}
            return {"new_shape": self.ints(opts.NewShapeIsNone, opts.NewShapeAsNumpy, "new_shape")}
        return {}

    def _enum(self, table: dict[int, str], value: int, what: str) -> str:
        if value not in table:
            raise self.fail(f"{what} {value} is not supported (supported: {', '.join(table.values())})")
        return table[value]
