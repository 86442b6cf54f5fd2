"""The `native` engine: the project's own int8 kernels (kernels/, edge_agent.int8.native).

It runs the bundle's int8 .tflite as a QGraph through the reference graph walker, with
CONV_2D, DEPTHWISE_CONV_2D, FULLY_CONNECTED, same-shape ADD and the global-average-pool
MEAN replaced by the C kernels of the variant dispatched for this CPU (AVX2, NEON+SDOT, ...):
ADD and MEAN are cheap ops, but in int64 numpy MobileNet's residual ADDs and final MEAN
cost as much as a quarter of all its convolutions. Weights are packed once at prepare time;
a grouped CONV_2D is one native conv per group. Everything else (pools, PAD, PADV2, GATHER,
broadcasting ADD, ...) stays numpy (the reference kernels). That is the documented
fallback of MobileNetV3 / EfficientNet's elementwise ops too: HARD_SWISH and LOGISTIC are
256-entry table lookups, MUL a 256 x 256 one, and a SiLU pair (LOGISTIC + MUL) is fused
into one table (reference_ops_elementwise). Results are bit-identical to the reference, so
selection checks them in int8 units like tflite.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import native
from .. import quant_math as qm
from .. import reference_ops as ops
from .. import reference_ops_elementwise as elementwise
from ..engine import Availability, Int8Engine, Runner
from ..graph import QGraph, QOp
from ._common import check_batch, dequantize, nhwc_to_nchw
from .native_program import Program, record_shapes
from .reference import QGraphRunner

NATIVE_OPS = ("CONV_2D", "DEPTHWISE_CONV_2D", "FULLY_CONNECTED")


@dataclass
class _Prepared:
    filt: native.ConvFilter | native.PackedMatrix
    requant: native.Requant
    bias: np.ndarray | None
    input_zero_point: int
    plans: dict[tuple[int, ...], Any] = field(default_factory=dict)  # by input shape


def add_params(graph: QGraph, op: QOp) -> native.AddParams | None:
    """TFLite's int8 ADD Prepare, as reference_ops.add states it (left_shift 20,
    twice_max = 2 * max(s1, s2)); None when a multiplier is not below one, which the
    kernel's right-shift-only rule (MBQMSmallerThanOneExp) cannot express."""
    t1, t2, y = (graph.tensor(n) for n in (op.inputs[0], op.inputs[1], op.outputs[0]))
    s1, s2, so = (np.float64(ops.scale_of(t)[0]) for t in (t1, t2, y))
    twice_max = 2.0 * max(s1, s2)
    (m1, e1), (m2, e2), (mo, eo) = (
        (int(m), int(e)) for m, e in (qm.quantize_multiplier(r) for r in (s1 / twice_max, s2 / twice_max,
                                                                           twice_max / ((1 << 20) * so))))
    if max(e1, e2, eo) > 0:
        return None
    lo, hi = qm.activation_range(op.options.get("activation", "NONE"), ops.scale_of(y)[0], ops.zp_of(y))
    return native.AddParams(ops.zp_of(t1), m1, e1, ops.zp_of(t2), m2, e2, mo, eo, ops.zp_of(y), lo, hi)


def mean_params(graph: QGraph, op: QOp, n: int) -> tuple[int, int]:
    """MEAN's requantisation over n elements, as reference_ops.mean states TFLite 2.14's
    QuantizedMeanOrSum: (m, s) = QuantizeMultiplier(s_in / s_out);
    k = min(floor(log2 n), 32, 31 + s); (m', s') = ((m << k) / n, s - k)."""
    tx, ty = graph.tensor(op.inputs[0]), graph.tensor(op.outputs[0])
    m, s = (int(v) for v in qm.quantize_multiplier(np.float64(ops.scale_of(tx)[0]) / np.float64(ops.scale_of(ty)[0])))
    k = min(n.bit_length() - 1, 32, 31 + s)
    return (m << k) // n, s - k


def fuse_pads(graph: QGraph) -> QGraph:
    """A copy of `graph` where each spatial PAD feeding only a VALID CONV_2D /
    DEPTHWISE_CONV_2D is folded into it (option "native_pad" = (top, bottom, left, right)).

    Exact: PAD fills with its output zero point, which equals its input's (check_graph
    enforces it), and an input-zero-point tap contributes (zp - zp) * w = 0 -- just what the
    kernels do for a tap outside the image. Exported MobileNets put such a PAD before every
    stride-2 depthwise; folding it saves a full copy of the activation.
    """
    consumers: dict[str, list[int]] = {}
    for i, op in enumerate(graph.ops):
        for name in op.inputs:
            consumers.setdefault(name, []).append(i)
    fused: dict[int, QOp] = {}
    dropped: set[int] = set()
    for i, op in enumerate(graph.ops):
        if op.kind != "PAD" or op.outputs[0] in graph.outputs or len(consumers.get(op.outputs[0], [])) != 1:
            continue
        j = consumers[op.outputs[0]][0]
        conv = graph.ops[j]
        pads = np.asarray(graph.tensor(op.inputs[1]).data).reshape(-1, 2)
        src, dst = graph.tensor(op.inputs[0]), graph.tensor(op.outputs[0])
        if (conv.kind not in ("CONV_2D", "DEPTHWISE_CONV_2D") or conv.inputs[0] != op.outputs[0]
                or _grouped(graph, conv)  # kept simple: grouped convs take no folded pads
                or conv.options.get("padding") != "VALID" or "native_pad" in conv.options
                or pads.shape != (4, 2) or pads[0].any() or pads[3].any() or (pads < 0).any()
                or ops.zp_of(src) != ops.zp_of(dst)):
            continue
        options = {**conv.options, "native_pad": (int(pads[1, 0]), int(pads[1, 1]), int(pads[2, 0]), int(pads[2, 1]))}
        fused[j] = QOp(conv.kind, [op.inputs[0], *conv.inputs[1:]], list(conv.outputs), options, conv.name)
        dropped.add(i)
    if not dropped:
        return graph
    new_ops = [fused.get(i, op) for i, op in enumerate(graph.ops) if i not in dropped]
    return QGraph(dict(graph.tensors), new_ops, list(graph.inputs), list(graph.outputs), graph.name)


def _grouped(graph: QGraph, op: QOp) -> bool:
    """A grouped CONV_2D (ResNeXt, ShuffleNet v1): one native conv per group."""
    return op.kind == "CONV_2D" and graph.tensor(op.inputs[0]).shape[3] != graph.tensor(op.inputs[1]).shape[3]


class NativeOps:
    """The native kernels of one QGraph's CONV_2D / DEPTHWISE_CONV_2D / FULLY_CONNECTED ops,
    as `reference.run_graph` kernel overrides (`kernel(graph, op, args) -> ndarray`)."""

    def __init__(self, kernels: native.NativeKernels, graph: QGraph, *, threads: int | None = None) -> None:
        self.kernels, self.threads = kernels, max(1, threads or 1)
        self._prepared: dict[int, _Prepared] = {}
        self._add: dict[int, native.AddParams | None] = {}
        self._mean: dict[tuple[int, int], tuple[int, int, int, int]] = {}
        self._groups: dict[int, list[_Prepared]] = {}
        for op in graph.ops:
            if op.kind in NATIVE_OPS and not _grouped(graph, op):
                self._prepared[id(op)] = self._prepare(graph, op)
            elif op.kind in NATIVE_OPS:
                self._groups[id(op)] = self._prepare_groups(graph, op)

    def _prepare(self, graph: QGraph, op: QOp) -> _Prepared:
        w = graph.tensor(op.inputs[1]).data
        bias = graph.tensor(op.inputs[2]).data if len(op.inputs) > 2 and op.inputs[2] else None
        if op.kind == "FULLY_CONNECTED":
            p = ops.fc_params(graph, op)
            filt: Any = self.kernels.pack(np.ascontiguousarray(w))
        elif op.kind == "CONV_2D":
            p = ops.conv_params(graph, op)
            filt = self.kernels.conv_filter(w)
        else:
            p = ops.conv_params(graph, op)
            filt = self.kernels.depthwise_filter(w, int(op.options.get("depth_multiplier", 1)))
        channels = int(np.asarray(p.multiplier).size)
        requant = native.Requant.make(p.multiplier, p.shift, p.output_zero_point, p.act_min, p.act_max,
                                      channels=channels)
        bias32 = None if bias is None else np.ascontiguousarray(bias, dtype=np.int32)
        return _Prepared(filt, requant, bias32, -p.input_offset)

    def _prepare_groups(self, graph: QGraph, op: QOp) -> list[_Prepared]:
        """A grouped CONV_2D as one ordinary conv per group: filter rows, requantisation and
        bias of the group's output channels (reference_ops_struct states the grouping)."""
        w = graph.tensor(op.inputs[1]).data
        bias = graph.tensor(op.inputs[2]).data if len(op.inputs) > 2 and op.inputs[2] else None
        groups = graph.tensor(op.inputs[0]).shape[3] // w.shape[3]
        per = w.shape[0] // groups
        p = ops.conv_params(graph, op)
        m, sh = np.broadcast_to(p.multiplier, (w.shape[0],)), np.broadcast_to(p.shift, (w.shape[0],))
        out = []
        for g in range(groups):
            rows = slice(g * per, (g + 1) * per)
            requant = native.Requant.make(m[rows], sh[rows], p.output_zero_point, p.act_min, p.act_max, channels=per)
            b = None if bias is None else np.ascontiguousarray(bias[rows], dtype=np.int32)
            out.append(_Prepared(self.kernels.conv_filter(np.ascontiguousarray(w[rows])), requant, b, -p.input_offset))
        return out

    def _grouped_conv(self, graph: QGraph, op: QOp, args: list) -> np.ndarray:
        if id(op) not in self._groups:
            self._groups[id(op)] = self._prepare_groups(graph, op)
        parts, x = self._groups[id(op)], args[0]
        cin = x.shape[3] // len(parts)
        return np.concatenate([self._run_conv(p, op, np.ascontiguousarray(x[..., g * cin:(g + 1) * cin]))
                               for g, p in enumerate(parts)], axis=-1)

    def _get(self, graph: QGraph, op: QOp) -> _Prepared:
        prepared = self._prepared.get(id(op))
        if prepared is None:  # an op this runner was not prepared with: pack it now, once
            prepared = self._prepared[id(op)] = self._prepare(graph, op)
        return prepared

    def _conv(self, graph: QGraph, op: QOp, args: list) -> np.ndarray:
        if _grouped(graph, op):  # one C conv per group
            return self._grouped_conv(graph, op, args)
        return self._run_conv(self._get(graph, op), op, np.ascontiguousarray(args[0]))

    def _run_conv(self, p: _Prepared, op: QOp, x: np.ndarray) -> np.ndarray:
        return self.conv_plan_for(p, op, x.shape)(x)

    def conv_plan_for(self, p: _Prepared, op: QOp, shape: tuple[int, ...]) -> native.ConvPlan:
        """The op's ConvPlan at this input shape, validated and bound once."""
        plan = p.plans.get(shape)
        if plan is None:
            o = op.options
            plan = p.plans[shape] = self.kernels.conv_plan(
                p.filt, p.requant, input_shape=shape, input_zero_point=p.input_zero_point, bias=p.bias,
                stride=(o["stride_h"], o["stride_w"]), dilation=(o.get("dilation_h", 1), o.get("dilation_w", 1)),
                padding=o["padding"], pads=o.get("native_pad"), threads=self.threads)
        return plan

    def gemm_plan_for(self, p: _Prepared, rows: int) -> native.GemmPlan:
        """A FULLY_CONNECTED's GemmPlan for `rows` rows of A."""
        plan = p.plans.get((rows, p.filt.k))
        if plan is None:
            plan = p.plans[(rows, p.filt.k)] = self.kernels.gemm_plan(
                p.filt, p.requant, rows=rows, bias=p.bias, a_zero_point=p.input_zero_point)
        return plan

    def add_params_for(self, graph: QGraph, op: QOp) -> native.AddParams | None:
        if id(op) not in self._add:
            self._add[id(op)] = add_params(graph, op)
        return self._add[id(op)]

    def mean_params_for(self, graph: QGraph, op: QOp, shape: tuple[int, ...]) -> tuple[int, int, int, int]:
        """(zp_in, m', s', zp_out) of a MEAN over H and W at input shape NHWC `shape`."""
        key = (id(op), shape[1] * shape[2])
        if key not in self._mean:
            tx, ty = graph.tensor(op.inputs[0]), graph.tensor(op.outputs[0])
            self._mean[key] = (*mean_params(graph, op, key[1]), ops.zp_of(tx), ops.zp_of(ty))
        m, s, zp_in, zp_out = self._mean[key]
        return zp_in, m, s, zp_out

    @staticmethod
    def grouped(graph: QGraph, op: QOp) -> bool:
        return _grouped(graph, op)

    conv_2d = depthwise_conv_2d = _conv

    def fully_connected(self, graph: QGraph, op: QOp, args: list) -> np.ndarray:
        p, x = self._get(graph, op), args[0]
        rows = np.ascontiguousarray(x).reshape(-1, p.filt.k)
        out = self.gemm_plan_for(p, rows.shape[0])(rows)
        if op.options.get("keep_num_dims", False):
            return out.reshape(*x.shape[:-1], p.filt.n)
        return out

    def add(self, graph: QGraph, op: QOp, args: list) -> np.ndarray:
        a, b = args[0], args[1]
        params = self.add_params_for(graph, op)
        if params is None or a.shape != b.shape:  # broadcasting or an unusual scale ratio
            return ops.KERNELS["ADD"](graph, op, args)
        return self.kernels.add(np.ascontiguousarray(a), np.ascontiguousarray(b), params)

    def mean(self, graph: QGraph, op: QOp, args: list) -> np.ndarray:
        """MEAN over H and W of NHWC (MobileNet's global average pool) natively; other axis
        sets are numpy."""
        x = args[0]
        axes = sorted({int(a) % x.ndim for a in np.asarray(args[1]).reshape(-1)}) if x.ndim else []
        if x.ndim != 4 or axes != [1, 2]:
            return ops.KERNELS["MEAN"](graph, op, args)
        zp_in, m, s, zp_out = self.mean_params_for(graph, op, x.shape)
        y = self.kernels.mean_hw(np.ascontiguousarray(x), input_zero_point=zp_in, multiplier=m, shift=s,
                                 output_zero_point=zp_out)
        return y if op.options.get("keep_dims", False) else y.reshape(x.shape[0], x.shape[3])

    def table(self) -> dict[str, Callable[[QGraph, QOp, list], np.ndarray]]:
        return {"CONV_2D": self.conv_2d, "DEPTHWISE_CONV_2D": self.depthwise_conv_2d,
                "FULLY_CONNECTED": self.fully_connected, "ADD": self.add, "MEAN": self.mean}


class NativeRunner(QGraphRunner):
    """A QGraph on the native kernels; `variant` names the dispatched kernel variant.

    With `whole_graph` (the default) each input shape gets a native_program.Program: the
    graph in one C call per batch, on the library's thread pool. Without it, every op is
    its own call through the reference walker (kept for comparisons and as the recorder of
    a program's shapes)."""

    MAX_PROGRAMS = 8  # input shapes kept (a job's last batch is usually smaller)

    def __init__(self, graph: QGraph, *, kernels: native.NativeKernels | None = None,
                 threads: int | None = None, whole_graph: bool = True) -> None:
        self.native = kernels or native.NativeKernels()
        self.variant = self.native.name
        graph = elementwise.fuse_silu(fuse_pads(graph))  # SiLU pairs -> one table (reference_ops_elementwise)
        self._ops = NativeOps(self.native, graph, threads=threads)
        self._threads, self.whole_graph = max(1, threads or 1), whole_graph
        self._programs: dict[tuple[int, ...], Program] = {}
        super().__init__(graph, kernels={**self._ops.table(), **elementwise.NATIVE_KERNELS})

    def _invoke(self, x: np.ndarray) -> np.ndarray:
        if not self.whole_graph or not isinstance(x, np.ndarray) or x.dtype != np.int8:
            return super()._invoke(x)
        program = self._programs.get(x.shape)
        if program is None:  # first batch of this shape: the walker runs it and records shapes
            out, shapes = record_shapes(self.graph, self._kernels, x, self._run_graph)
            if len(self._programs) >= self.MAX_PROGRAMS:
                self._programs.pop(next(iter(self._programs)))
            self._programs[x.shape] = Program(self._ops, self.graph, self._kernels, x.shape, shapes,
                                              threads=self._threads)
            return out if isinstance(out, np.ndarray) else out[self._dst]
        return program(x)

    def run(self, batch: np.ndarray) -> np.ndarray:
        """As QGraphRunner.run, with the input's quantisation and NCHW -> NHWC in one C pass."""
        if self._in_q is None or np.ndim(batch) not in (2, 4):
            return super().run(batch)
        x = self.native.quantize_nchw(check_batch(batch, self._in_shape, "native"), *self._in_q)
        y = self._invoke(x)
        if self._out_q is not None:
            y = dequantize(y, *self._out_q)
        return nhwc_to_nchw(np.asarray(y, np.float32))

    def close(self) -> None:
        self._programs.clear()
        self._ops._prepared.clear()  # packed weights


class NativeEngine(Int8Engine):
    name = "native"
    # packing the weights (0.02-0.05 CPU-s for the camera MobileNetV2 on an EPYC core; a Pi core is 3-5x slower)
    prepare_cpu_s_hint = 0.1
    # the kernels' library (~4 MB, loaded by availability), the packed weights, and per thread
    # and batch sample a third of a byte per activation (its planner reuses buffers): a
    # runner running 32 camera MobileNetV2 samples held 9 MB with one thread, 22-27 with two
    runtime_mb_hint, prepare_mb_hint, run_bytes_per_activation = 4.0, 1.0, 0.33
    run_memory_per_thread = True

    def availability(self, probe: dict[str, Any] | None = None) -> Availability:
        try:
            kernels = native.NativeKernels(probe=probe)
            built = [v.name for v in native.variants()]
            info = native.build_info()
        except native.NativeUnavailableError as exc:
            return Availability(False, str(exc))
        v = kernels.variant
        needs = " ".join(v.features) or "any CPU"
        forced = os.environ.get(native.ENV_VARIANT, "").strip()
        how = f"forced by {native.ENV_VARIANT}" if forced else f"needs {needs}"
        return Availability(True, f"edge-agent int8 kernels, variant {v.name} ({how})", {
            "variant": v.name, "features": list(v.features), "tile": list(v.geometry),
            "variants_built": built, "build": info, "library": str(native.library_path())})

    def prepare(self, model: Any, *, threads: int | None = None) -> Runner:
        return NativeRunner(model.qgraph(), threads=threads or os.cpu_count() or 1)
