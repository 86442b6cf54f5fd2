"""Test helpers for the int8 path: random QGraphs and a tflite-runtime wrapper.

`GraphBuilder` grows a QGraph op by op with random int8 weights and *calibrated* output
quantisation: it keeps a small random batch flowing through the graph (run by the numpy
reference) and sets each output's scale/zero point from the real-valued range it sees, so
activations neither vanish nor saturate. `jitter` perturbs the calibrated scales so tests
also exercise clamping. Importable by other engineers' tests (no pytest dependency).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from . import quant_math as qm
from . import reference_ops as ops
from .graph import QGraph, QOp, QTensor


def _q(scale: float, zp: int) -> tuple[np.ndarray, np.ndarray]:
    return np.array([scale], dtype=np.float32), np.array([zp], dtype=np.int64)


def _act(real: np.ndarray, activation: str) -> np.ndarray:
    if activation == "RELU":
        return np.maximum(real, 0.0)
    if activation == "RELU6":
        return np.clip(real, 0.0, 6.0)
    return real


class GraphBuilder:
    """Builds a random int8 QGraph; every method returns the new output tensor's name."""

    def __init__(
        self,
        rng: np.random.Generator,
        input_shape: Sequence[int],
        *,
        name: str = "random",
        input_scale: float | None = None,
        input_zero_point: int | None = None,
        calibration_batch: int = 2,
        jitter: float = 0.0,
    ) -> None:
        self.rng = rng
        self.jitter = jitter
        self.tensors: dict[str, QTensor] = {}
        self.ops: list[QOp] = []
        self.name = name
        scale = input_scale if input_scale is not None else float(rng.uniform(0.005, 0.05))
        zp = input_zero_point if input_zero_point is not None else int(rng.integers(-40, 41))
        self.input = self._activation("input", tuple(input_shape), scale, zp)
        shape = (calibration_batch, *input_shape[1:])
        self.values: dict[str, np.ndarray] = {self.input: self.random_input(shape)}

    # --- helpers -------------------------------------------------------------------------
    def random_input(self, shape: Sequence[int]) -> np.ndarray:
        return self.rng.integers(-128, 128, size=tuple(shape), dtype=np.int8)

    def _name(self, base: str) -> str:
        name, i = base, len(self.tensors)
        while name in self.tensors:
            name = f"{base}_{i}"
            i += 1
        return name

    def _activation(self, base: str, shape: tuple[int, ...], scale: float, zp: int) -> str:
        name = self._name(base)
        s, z = _q(scale, zp)
        self.tensors[name] = QTensor(name, tuple(int(d) for d in shape), "int8", s, z)
        return name

    def _const(self, base: str, data: np.ndarray, scale: np.ndarray | None = None, qdim: int = 0) -> str:
        name = self._name(base)
        zp = None if scale is None else np.zeros(np.asarray(scale).size, dtype=np.int64)
        scale = None if scale is None else np.asarray(scale, dtype=np.float32).reshape(-1)
        self.tensors[name] = QTensor(name, tuple(data.shape), str(data.dtype), scale, zp, qdim, data)
        return name

    def _calibrated(self, real: np.ndarray, activation: str) -> tuple[float, int]:
        real = _act(real, activation)
        lo, hi = float(np.min(real)), float(np.max(real))
        scale, zp = qm.asymmetric_params(lo, hi)
        if self.jitter:
            scale = float(np.float32(scale * self.rng.uniform(1 - self.jitter, 1 + self.jitter)))
        return scale, zp

    def _emit(self, kind: str, inputs: list[str], options: dict[str, Any], shape: Sequence[int],
              quant: tuple[float, int]) -> str:
        out = self._activation(kind.lower(), tuple(shape), *quant)
        op = QOp(kind, inputs, [out], options, name=f"{kind.lower()}_{len(self.ops)}")
        self.ops.append(op)
        graph = QGraph(self.tensors, self.ops, [self.input], [out], self.name)
        args = [None if not n else self.values.get(n, self.tensors[n].data) for n in inputs]
        self.values[out] = ops.KERNELS[kind](graph, op, args)
        return out

    def deq(self, name: str) -> np.ndarray:
        t = self.tensors[name]
        return qm.dequantize(self.values[name], ops.scale_of(t)[0], ops.zp_of(t)).astype(np.float64)

    def _weights(self, shape: tuple[int, ...], channels_axis: int, per_channel: bool, fan_in: int):
        q = self.rng.integers(-127, 128, size=shape, dtype=np.int8)
        n = shape[channels_axis] if per_channel else 1
        scales = (self.rng.uniform(0.3, 1.0, size=n) / (127.0 * np.sqrt(fan_in))).astype(np.float32)
        return q, scales

    def _bias(self, x: str, scales: np.ndarray, channels: int, fan_in: int) -> str:
        s_in = ops.scale_of(self.tensors[x])[0]
        bias_scales = (np.float64(s_in) * scales.astype(np.float64)).astype(np.float32)
        q = self.rng.integers(-1, 2, size=channels) * self.rng.integers(0, 3000 * int(np.sqrt(fan_in)) + 1, size=channels)
        return self._const("bias", q.astype(np.int32), bias_scales)

    # --- ops -------------------------------------------------------------------------------
    def conv(self, x: str, out_channels: int, kernel: int | tuple[int, int] = 3, *, stride: int | tuple[int, int] = 1,
             padding: str = "SAME", dilation: int | tuple[int, int] = 1, activation: str = "RELU6",
             per_channel: bool = True, bias: bool = True, groups: int = 1) -> str:
        kh, kw = (kernel, kernel) if isinstance(kernel, int) else kernel
        sh, sw = (stride, stride) if isinstance(stride, int) else stride
        dh, dw = (dilation, dilation) if isinstance(dilation, int) else dilation
        xs = self.tensors[x].shape
        cin = xs[3] // groups  # grouped: filters see xs[3] / groups channels each
        w, scales = self._weights((out_channels, kh, kw, cin), 0, per_channel, kh * kw * cin)
        inputs = [x, self._const("weights", w, scales, 0)]
        if bias:
            inputs.append(self._bias(x, scales, out_channels, kh * kw * cin))
        options = {"stride_h": sh, "stride_w": sw, "padding": padding, "dilation_h": dh, "dilation_w": dw,
                   "activation": activation}
        op = QOp("CONV_2D", inputs, [], options)
        wp = ops.window_params(op, xs[1:3], (kh, kw))
        accumulate = ops.conv_accumulate if groups == 1 else ops.struct.grouped_accumulate
        acc = accumulate(self.values[x], w, wp, -ops.zp_of(self.tensors[x]))
        return self._finish_linear("CONV_2D", inputs, options, acc, scales, (xs[0], *wp.out_hw, out_channels))

    def depthwise(self, x: str, kernel: int | tuple[int, int] = 3, *, multiplier: int = 1,
                  stride: int | tuple[int, int] = 1, padding: str = "SAME", dilation: int | tuple[int, int] = 1,
                  activation: str = "RELU6", per_channel: bool = True, bias: bool = True) -> str:
        kh, kw = (kernel, kernel) if isinstance(kernel, int) else kernel
        sh, sw = (stride, stride) if isinstance(stride, int) else stride
        dh, dw = (dilation, dilation) if isinstance(dilation, int) else dilation
        xs = self.tensors[x].shape
        channels = xs[3] * multiplier
        w, scales = self._weights((1, kh, kw, channels), 3, per_channel, kh * kw)
        inputs = [x, self._const("dw_weights", w, scales, 3)]
        if bias:
            inputs.append(self._bias(x, scales, channels, kh * kw))
        options = {"stride_h": sh, "stride_w": sw, "padding": padding, "dilation_h": dh, "dilation_w": dw,
                   "depth_multiplier": multiplier, "activation": activation}
        op = QOp("DEPTHWISE_CONV_2D", inputs, [], options)
        wp = ops.window_params(op, xs[1:3], (kh, kw))
        acc = ops.depthwise_accumulate(self.values[x], w, wp, -ops.zp_of(self.tensors[x]), multiplier)
        return self._finish_linear("DEPTHWISE_CONV_2D", inputs, options, acc, scales, (xs[0], *wp.out_hw, channels))

    def fc(self, x: str, units: int, *, activation: str = "NONE", keep_num_dims: bool = False,
           per_channel: bool = True, bias: bool = True) -> str:
        xs = self.tensors[x].shape
        w, scales = self._weights((units, xs[-1]), 0, per_channel, xs[-1])
        inputs = [x, self._const("fc_weights", w, scales, 0)]
        if bias:
            inputs.append(self._bias(x, scales, units, xs[-1]))
        options = {"activation": activation, "keep_num_dims": keep_num_dims}
        acc = ops.fc_accumulate(self.values[x], w, -ops.zp_of(self.tensors[x]))
        shape = (*xs[:-1], units) if keep_num_dims else (int(np.prod(xs)) // xs[-1], units)
        return self._finish_linear("FULLY_CONNECTED", inputs, options, acc, scales, shape)

    def _finish_linear(self, kind: str, inputs: list[str], options: dict[str, Any], acc: np.ndarray,
                       scales: np.ndarray, shape: tuple[int, ...]) -> str:
        bias = self.tensors[inputs[2]].data.astype(np.int64) if len(inputs) > 2 else 0
        s_in = np.float64(ops.scale_of(self.tensors[inputs[0]])[0])
        real = (acc + bias) * s_in * scales.astype(np.float64)
        return self._emit(kind, inputs, options, shape, self._calibrated(real, options["activation"]))

    def add(self, a: str, b: str, *, activation: str = "NONE") -> str:
        real = self.deq(a) + self.deq(b)
        shape = np.broadcast_shapes(self.tensors[a].shape, self.tensors[b].shape)
        return self._emit("ADD", [a, b], {"activation": activation}, shape, self._calibrated(real, activation))

    def pool(self, kind: str, x: str, kernel: int | tuple[int, int] = 2, *, stride: int | tuple[int, int] = 2,
             padding: str = "VALID", activation: str = "NONE") -> str:
        kh, kw = (kernel, kernel) if isinstance(kernel, int) else kernel
        sh, sw = (stride, stride) if isinstance(stride, int) else stride
        options = {"stride_h": sh, "stride_w": sw, "filter_h": kh, "filter_w": kw, "padding": padding,
                   "activation": activation}
        xs = self.tensors[x].shape
        wp = ops.window_params(QOp(kind, [x], [], options), xs[1:3], (kh, kw))
        return self._emit(kind, [x], options, (xs[0], *wp.out_hw, xs[3]), self._same(x))

    def _same(self, x: str) -> tuple[float, int]:
        t = self.tensors[x]
        return float(ops.scale_of(t)[0]), ops.zp_of(t)

    def mean(self, x: str, axes: Sequence[int] = (1, 2), *, keep_dims: bool = True, same_quant: bool = False) -> str:
        xs = self.tensors[x].shape
        axes_name = self._const("axes", np.asarray(axes, dtype=np.int32))
        resolved = ops.resolve_axes(np.asarray(axes), len(xs))
        shape = tuple(1 if i in resolved else d for i, d in enumerate(xs)) if keep_dims else \
            tuple(d for i, d in enumerate(xs) if i not in resolved)
        quant = self._same(x) if same_quant else self._calibrated(self.deq(x).mean(axis=resolved), "NONE")
        return self._emit("MEAN", [x, axes_name], {"keep_dims": keep_dims}, shape, quant)

    def reshape(self, x: str, new_shape: Sequence[int]) -> str:
        shape = list(new_shape)
        total = int(np.prod(self.tensors[x].shape))
        if -1 in shape:
            shape[shape.index(-1)] = total // -int(np.prod(shape))
        return self._emit("RESHAPE", [x], {"new_shape": list(new_shape)}, shape, self._same(x))

    def concat(self, xs: Sequence[str], *, axis: int = -1, activation: str = "NONE", same_quant: bool = False) -> str:
        shapes = [self.tensors[n].shape for n in xs]
        ax = axis % len(shapes[0])
        shape = tuple(sum(s[ax] for s in shapes) if i == ax else d for i, d in enumerate(shapes[0]))
        if same_quant:
            quant = self._same(xs[0])
        else:
            real = np.concatenate([self.deq(n).reshape(-1) for n in xs])
            quant = self._calibrated(real, activation)
        return self._emit("CONCATENATION", list(xs), {"axis": axis, "activation": activation}, shape, quant)

    def pad(self, x: str, paddings: Sequence[Sequence[int]]) -> str:
        pads = np.asarray(paddings, dtype=np.int32)
        shape = tuple(int(d + a + b) for d, (a, b) in zip(self.tensors[x].shape, pads, strict=True))
        return self._emit("PAD", [x, self._const("paddings", pads)], {}, shape, self._same(x))

    def padv2(self, x: str, paddings: Sequence[Sequence[int]], fill: int = -128) -> str:
        pads = np.asarray(paddings, dtype=np.int32)
        shape = tuple(int(d + a + b) for d, (a, b) in zip(self.tensors[x].shape, pads, strict=True))
        t = self.tensors[x]
        fill_name = self._const("fill", np.array([fill], np.int8), t.scale)
        self.tensors[fill_name].zero_point = np.array(t.zero_point, np.int64).copy()
        return self._emit("PADV2", [x, self._const("paddings", pads), fill_name], {}, shape, self._same(x))

    def gather(self, x: str, indices: Sequence[int], *, axis: int = 3) -> str:
        idx = np.asarray(indices, dtype=np.int32)
        shape = tuple(len(idx) if i == axis % len(self.tensors[x].shape) else d
                      for i, d in enumerate(self.tensors[x].shape))
        return self._emit("GATHER", [x, self._const("indices", idx)], {"axis": axis}, shape, self._same(x))

    def mul(self, a: str, b: str, *, activation: str = "NONE") -> str:
        """MUL of two tensors (b may be a constant made with `int8_constant`), broadcasting."""
        real = self.deq(a) * self.deq(b)
        shape = np.broadcast_shapes(self.tensors[a].shape, self.tensors[b].shape)
        return self._emit("MUL", [a, b], {"activation": activation}, shape, self._calibrated(real, activation))

    def int8_constant(self, shape: Sequence[int], *, scale: float | None = None) -> str:
        """A random int8 constant tensor with its own per-tensor quantisation."""
        s = scale if scale is not None else float(self.rng.uniform(0.002, 0.05))
        name = self._const("constant", self.rng.integers(-128, 128, size=tuple(shape), dtype=np.int8), np.array([s]))
        self.tensors[name].zero_point = np.array([int(self.rng.integers(-30, 31))], np.int64)
        self.values[name] = self.tensors[name].data
        return name

    def hard_swish(self, x: str) -> str:
        v = self.deq(x)
        real = v * np.clip(v + 3.0, 0.0, 6.0) / 6.0
        scale, zp = self._calibrated(real, "NONE")
        scale = max(scale, float(ops.scale_of(self.tensors[x])[0]) / 64)  # TFLite's limit is 1/128
        return self._emit("HARD_SWISH", [x], {}, self.tensors[x].shape, (scale, zp))

    def logistic(self, x: str) -> str:
        return self._emit("LOGISTIC", [x], {}, self.tensors[x].shape, (1.0 / 256.0, -128))

    def requantize(self, x: str, scale: float, zero_point: int) -> str:
        return self._emit("QUANTIZE", [x], {}, self.tensors[x].shape, (scale, zero_point))

    def build(self, outputs: str | Sequence[str]) -> QGraph:
        outs = [outputs] if isinstance(outputs, str) else list(outputs)
        used = {self.input, *outs, *(n for op in self.ops for n in [*op.inputs, *op.outputs])}
        tensors = {k: v for k, v in self.tensors.items() if k in used}
        return QGraph(tensors, list(self.ops), [self.input], outs, self.name)


def random_op_graph(kind: str, rng: np.random.Generator, **params: Any) -> QGraph:
    """A graph of one random `kind` op (any key of graph.OP_OPTIONS) on a random NHWC input.

    Drawn parameters (override any by keyword): h, w, c, batch, kernel, stride, padding,
    dilation, multiplier, out_channels, units, activation, per_channel, bias. QUANTIZE takes a
    float32 input, DEQUANTIZE gives a float32 output."""
    p = {"h": int(rng.integers(1, 10)), "w": int(rng.integers(1, 10)), "c": int(rng.integers(1, 7)), "batch": 1,
         "kernel": (int(rng.integers(1, 4)), int(rng.integers(1, 4))), "stride": (int(rng.integers(1, 3)),) * 2,
         "padding": "SAME", "dilation": (int(rng.integers(1, 3)),) * 2, "multiplier": int(rng.integers(1, 3)),
         "out_channels": int(rng.integers(1, 8)), "units": int(rng.integers(1, 8)),
         "activation": str(rng.choice(["NONE", "RELU", "RELU6"])), "per_channel": bool(rng.integers(0, 2)),
         "bias": True}
    p.update(params)
    if kind in ("QUANTIZE", "DEQUANTIZE"):
        shape = (p["batch"], p["h"], p["w"], p["c"])
        scale, zp = _q(float(rng.uniform(0.005, 0.1)), int(rng.integers(-128, 128)))
        float_t, int_t = QTensor("x_float", shape, "float32"), QTensor("x_int8", shape, "int8", scale, zp)
        src, dst = (float_t, int_t) if kind == "QUANTIZE" else (int_t, float_t)
        return QGraph({src.name: src, dst.name: dst}, [QOp(kind, [src.name], [dst.name], {}, name=kind.lower())],
                      [src.name], [dst.name], name=kind.lower())
    b = GraphBuilder(rng, (p["batch"], p["h"], p["w"], p["c"]), name=kind.lower(), jitter=0.2)
    x = b.input
    window = {"stride": p["stride"], "padding": p["padding"], "activation": p["activation"]}
    linear = {"per_channel": p["per_channel"], "bias": p["bias"]}
    if kind == "CONV_2D":
        y = b.conv(x, p["out_channels"], p["kernel"], dilation=p["dilation"], **window, **linear)
    elif kind == "DEPTHWISE_CONV_2D":
        y = b.depthwise(x, p["kernel"], multiplier=p["multiplier"], dilation=p["dilation"], **window, **linear)
    elif kind == "FULLY_CONNECTED":
        y = b.fc(x, p["units"], activation=p["activation"], **linear)
    elif kind == "ADD":
        y = b.add(x, b.requantize(x, float(rng.uniform(0.005, 0.1)), int(rng.integers(-60, 60))),
                  activation=p["activation"])
    elif kind in ("AVERAGE_POOL_2D", "MAX_POOL_2D"):
        y = b.pool(kind, x, p["kernel"], **window)
    elif kind == "MEAN":
        y = b.mean(x, (1, 2), keep_dims=bool(rng.integers(0, 2)))
    elif kind == "RESHAPE":
        y = b.reshape(x, [-1, p["w"] * p["c"]])
    elif kind == "CONCATENATION":
        y = b.concat([x, b.requantize(x, float(rng.uniform(0.005, 0.1)), int(rng.integers(-60, 60)))], axis=3)
    elif kind == "PAD":
        y = b.pad(x, [[0, 0], *rng.integers(0, 3, size=(2, 2)).tolist(), [0, 0]])
    elif kind == "PADV2":
        y = b.padv2(x, [[0, 0], *rng.integers(0, 3, size=(2, 2)).tolist(), [0, 0]], int(rng.integers(-128, 128)))
    elif kind == "GATHER":
        y = b.gather(x, rng.permutation(p["c"]).tolist(), axis=3)
    elif kind == "MUL":
        other = (b.int8_constant((1, 1, 1, p["c"])) if rng.integers(0, 2) else  # a broadcast (SE-like) operand
                 b.requantize(x, float(rng.uniform(0.005, 0.1)), int(rng.integers(-60, 60))))
        y = b.mul(x, other, activation=p["activation"])
    elif kind == "HARD_SWISH":
        y = b.hard_swish(x)
    elif kind == "LOGISTIC":
        y = b.logistic(x)
    else:
        raise ValueError(f"no random builder for op {kind!r}")
    return b.build(y)


def mobilenet_v2_graph(rng: np.random.Generator, *, input_hw: tuple[int, int] = (24, 24), batch: int = 1,
                       classes: int = 10, jitter: float = 0.0) -> QGraph:
    """A small MobileNetV2: stem conv s2, inverted-residual blocks (1x1 expand RELU6 ->
    3x3 depthwise RELU6 -> 1x1 linear project, ADD residual when shapes allow), 1x1 conv,
    global average pool (MEAN keep_dims + RESHAPE) and a classifier FC."""
    b = GraphBuilder(rng, (batch, *input_hw, 3), name="mobilenet_v2_tiny", jitter=jitter)
    x = b.conv(b.input, 8, 3, stride=2, activation="RELU6")
    channels = 8
    # (expansion, out channels, stride)
    for expansion, out_channels, stride in ((1, 8, 1), (4, 12, 2), (4, 12, 1), (4, 16, 2), (4, 16, 1)):
        h = x
        if expansion != 1:
            h = b.conv(h, channels * expansion, 1, activation="RELU6")
        h = b.depthwise(h, 3, stride=stride, activation="RELU6")
        h = b.conv(h, out_channels, 1, activation="NONE")
        if stride == 1 and out_channels == channels:
            h = b.add(x, h)
        x, channels = h, out_channels
    x = b.conv(x, 32, 1, activation="RELU6")
    x = b.mean(x, (1, 2), keep_dims=True)
    x = b.reshape(x, [-1, 32])
    return b.build(b.fc(x, classes))


def plain_cnn_graph(rng: np.random.Generator, *, input_hw: tuple[int, int] = (20, 20), batch: int = 1,
                    classes: int = 6, jitter: float = 0.0) -> QGraph:
    """A plain CNN using the remaining ops: conv/RELU, MAX_POOL, PAD + VALID conv, a
    two-branch CONCATENATION (requantised inputs), AVERAGE_POOL, MEAN and FC."""
    b = GraphBuilder(rng, (batch, *input_hw, 3), name="plain_cnn", jitter=jitter)
    x = b.conv(b.input, 12, 3, activation="RELU")
    x = b.pool("MAX_POOL_2D", x, 2, stride=2, padding="VALID")
    x = b.pad(x, [[0, 0], [1, 1], [1, 1], [0, 0]])
    left = b.conv(x, 8, 3, padding="VALID", activation="RELU6")
    right = b.conv(x, 8, 3, padding="VALID", dilation=1, activation="NONE")
    x = b.concat([left, right], axis=3)
    x = b.pool("AVERAGE_POOL_2D", x, 3, stride=2, padding="SAME")
    x = b.conv(x, 16, 3, stride=1, activation="RELU")
    x = b.mean(x, (1, 2), keep_dims=False)
    return b.build(b.fc(x, classes, activation="NONE"))


def run_tflite(model_bytes: bytes, x: np.ndarray | Mapping[str, np.ndarray], *, reference_kernels: bool,
               num_threads: int = 1) -> np.ndarray | dict[str, np.ndarray]:
    """Run a .tflite model with tflite-runtime (or ai_edge_litert).

    `reference_kernels=True` uses BuiltinRefOpResolver (TFLite's reference kernels, no
    delegate); False uses the default resolver (optimized kernels + XNNPACK delegate).
    Returns one array for a single-output model, else a dict by output tensor name.
    """
    try:
        from tflite_runtime.interpreter import Interpreter, OpResolverType
    except ImportError:  # pragma: no cover - the other distribution of the same API
        from ai_edge_litert.interpreter import Interpreter, OpResolverType
    resolver = OpResolverType.BUILTIN_REF if reference_kernels else OpResolverType.AUTO
    interp = Interpreter(model_content=bytes(model_bytes), experimental_op_resolver_type=resolver,
                         num_threads=num_threads)
    details = interp.get_input_details()
    feeds = dict(x) if isinstance(x, Mapping) else {details[0]["name"]: x}
    for d in details:
        arr = np.asarray(feeds[d["name"]])
        if tuple(arr.shape) != tuple(d["shape"]):
            interp.resize_tensor_input(d["index"], list(arr.shape))
    interp.allocate_tensors()
    for d in details:
        interp.set_tensor(d["index"], np.asarray(feeds[d["name"]], dtype=d["dtype"]))
    interp.invoke()
    outs = {d["name"]: interp.get_tensor(d["index"]).copy() for d in interp.get_output_details()}
    return next(iter(outs.values())) if len(outs) == 1 else outs
