"""The project's float graph (NHWC, TFLite op kinds) as an MXNet symbol (NCHW) + params.

mxnet-onednn used to re-import backbone.onnx through mxnet.contrib.onnx, which fails on
much of what exporters write (torch's Constant nodes, opset-18 ReduceMean axes inputs...).
Building the symbol from the FloatGraph instead means every graph the project's importer
takes (onnx_import.py and its op mixins) runs on MXNet too, with one mapping per op kind.

Layout: 4-D tensors are NCHW in MXNet (what its conv/pool kernels and oneDNN want), so
NHWC axes and weights are permuted here; a RESHAPE goes through NHWC so that flattening
keeps the float graph's (TFLite's) element order.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .float_graph import FloatGraph, FloatOp
from .float_ops import same_pads

_NHWC_TO_NCHW_AXIS = {0: 0, 1: 2, 2: 3, 3: 1}


class MxnetGraphError(ValueError):
    """A float-graph op with no MXNet mapping here (the message names the op)."""


def float_graph_to_mxnet(graph: FloatGraph, mx: Any) -> tuple[Any, dict[str, Any]]:
    """(symbol, {param name: NDArray}) computing `graph` on an NCHW input named graph.input;
    the output is in the model's layout (NCHW, or 2-D), as run_float(layout="model")."""
    b = _Builder(graph, mx)
    for index, op in enumerate(graph.ops):
        try:
            y = b.op(index, op)
        except MxnetGraphError:
            raise
        except Exception as exc:  # an MXNet attribute error for odd options: name the op
            raise MxnetGraphError(f"op {op.name!r} ({op.kind}): {type(exc).__name__}: {exc}") from None
        b.t[op.output] = b.activation(y, op.options)
    return b.t[graph.output], b.params


class _Builder:
    def __init__(self, graph: FloatGraph, mx: Any) -> None:
        self.g, self.mx, self.sym = graph, mx, mx.sym
        self.t: dict[str, Any] = {graph.input: mx.sym.var(graph.input)}
        self.params: dict[str, Any] = {}

    def const(self, name: str, value: np.ndarray) -> Any:
        self.params[name] = self.mx.nd.array(np.ascontiguousarray(value, np.float32))
        return self.sym.var(name, shape=value.shape)

    def rank4(self, tensor: str) -> bool:
        return len(self.g.shapes[tensor]) == 4

    def activation(self, y: Any, o: dict[str, Any]) -> Any:
        act = o.get("activation", "NONE")
        if act == "RELU":
            y = self.sym.relu(y)
        elif act == "RELU6":
            y = self.sym.clip(y, 0.0, 6.0)
        elif act != "NONE":
            raise MxnetGraphError(f"activation {act!r} has no MXNet mapping here")
        return self.sym.minimum(y, float(o["clip_max"])) if "clip_max" in o else y

    def _pads(self, x: str, k: tuple[int, int], s: tuple[int, int], d: tuple[int, int],
              padding: str) -> tuple[int, int, int, int]:
        if padding != "SAME":
            return (0, 0, 0, 0)
        _, h, w, _ = self.g.shapes[x]
        (t, bot), (left, r) = same_pads(h, k[0], s[0], d[0]), same_pads(w, k[1], s[1], d[1])
        return t, bot, left, r

    def _padded(self, x: Any, pads: tuple[int, int, int, int], value: float = 0.0) -> tuple[Any, tuple[int, int]]:
        """Symmetric pads go to the conv/pool; asymmetric ones (TFLite SAME's extra
        bottom/right cell) become an explicit pad first."""
        t, bot, left, r = pads
        if t == bot and left == r:
            return x, (t, left)
        return self.sym.pad(x, mode="constant", constant_value=value,
                            pad_width=(0, 0, 0, 0, t, bot, left, r)), (0, 0)

    def op(self, i: int, op: FloatOp) -> Any:  # noqa: C901 - one branch per op kind
        sym, o, kind = self.sym, op.options, op.kind
        xs = [self.t[n] for n in op.inputs]
        x = xs[0]
        if kind in ("CONV_2D", "DEPTHWISE_CONV_2D"):
            k, s, d = op.weight.shape[1:3], (o["stride_h"], o["stride_w"]), (o["dilation_h"], o["dilation_w"])
            cin = self.g.shapes[op.inputs[0]][3]
            if kind == "CONV_2D":
                w, groups = op.weight.transpose(0, 3, 1, 2), cin // op.weight.shape[3]
            else:  # 1HW(C*M) -> (C*M)1HW, one group per input channel
                w, groups = op.weight[0].transpose(2, 0, 1)[:, None], cin
            x, pad = self._padded(x, self._pads(op.inputs[0], k, s, d, o["padding"]))
            return sym.Convolution(x, weight=self.const(f"op{i}_weight", w), bias=self.const(f"op{i}_bias", op.bias),
                                   kernel=tuple(k), stride=s, dilate=d, pad=pad, num_filter=w.shape[0],
                                   num_group=groups, name=f"op{i}_conv")
        if kind == "FULLY_CONNECTED":
            if self.rank4(op.inputs[0]):  # flatten in NHWC order, as the weights expect
                x = sym.transpose(x, axes=(0, 2, 3, 1))
            return sym.FullyConnected(x, weight=self.const(f"op{i}_weight", op.weight),
                                      bias=self.const(f"op{i}_bias", op.bias), num_hidden=op.weight.shape[0],
                                      flatten=True, name=f"op{i}_fc")
        if kind in ("ADD", "MUL"):
            if op.weight is not None:
                rhs = np.asarray(op.weight, np.float32)
                if self.rank4(op.inputs[0]):
                    rhs = rhs.reshape((1,) * (4 - rhs.ndim) + rhs.shape).transpose(0, 3, 1, 2)
                other = self.const(f"op{i}_const", rhs)
            else:
                other = xs[1]
            return sym.broadcast_add(x, other) if kind == "ADD" else sym.broadcast_mul(x, other)
        if kind == "HARD_SWISH":
            return x * sym.clip(x + 3.0, 0.0, 6.0) / 6.0
        if kind == "LOGISTIC":
            return sym.sigmoid(x)
        if kind in ("MAX_POOL_2D", "AVERAGE_POOL_2D"):
            k, s = (o["filter_h"], o["filter_w"]), (o["stride_h"], o["stride_w"])
            pads = self._pads(op.inputs[0], k, s, (1, 1), o["padding"])
            if kind == "AVERAGE_POOL_2D" and (pads[0] != pads[1] or pads[2] != pads[3]):
                raise MxnetGraphError(f"op {op.name!r}: average pool with asymmetric SAME padding")
            x, pad = self._padded(x, pads, -3.0e38)
            return sym.Pooling(x, kernel=k, stride=s, pad=pad, pool_type="max" if kind == "MAX_POOL_2D" else "avg",
                               count_include_pad=False, pooling_convention="valid")
        if kind == "MEAN":
            axes = tuple(_NHWC_TO_NCHW_AXIS[a] for a in o["axes"]) if self.rank4(op.inputs[0]) else tuple(o["axes"])
            return sym.mean(x, axis=axes, keepdims=bool(o["keep_dims"]))
        if kind == "RESHAPE":
            if self.rank4(op.inputs[0]):
                x = sym.transpose(x, axes=(0, 2, 3, 1))
            y = sym.reshape(x, shape=(0, *[int(v) for v in o["new_shape"][1:]]))
            return sym.transpose(y, axes=(0, 3, 1, 2)) if self.rank4(op.output) else y
        if kind == "CONCATENATION":
            axis = _NHWC_TO_NCHW_AXIS[o["axis"] % 4] if self.rank4(op.inputs[0]) else o["axis"]
            return sym.concat(*xs, dim=axis)
        if kind in ("PAD", "PADV2"):
            p = [tuple(int(v) for v in pair) for pair in o["paddings"]]
            if len(p) != 4 or p[0] != (0, 0) or p[3] != (0, 0):
                raise MxnetGraphError(f"op {op.name!r}: {kind} of the batch or channel axis")
            width = (0, 0, 0, 0, *p[1], *p[2])
            if kind == "PAD":
                return sym.pad(x, mode="constant", constant_value=0.0, pad_width=width)
            low = sym.min(x)  # PADV2 fills below every value: the tensor's minimum does
            return sym.broadcast_add(sym.pad(sym.broadcast_sub(x, low), mode="constant", pad_width=width), low)
        if kind == "GATHER":
            axis = _NHWC_TO_NCHW_AXIS[o["axis"] % 4] if self.rank4(op.inputs[0]) else o["axis"]
            idx = self.const(f"op{i}_indices", np.asarray(o["indices"], np.float32))
            return sym.take(x, idx, axis=axis)
        raise MxnetGraphError(f"op {op.name!r}: {kind} has no MXNet mapping here")
