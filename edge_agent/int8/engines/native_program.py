"""A QGraph as one native program: the whole int8 graph in one C call per batch.

`NativeOps` (native.py) runs each op as its own Python-level call through the reference
graph walker, ~15-25 us of interpreter and ctypes work per op: on MobileNetV2 0.35 at a
fine-tuning batch that is a fifth of the backbone's time, and the per-op thread hand-off
made 2 threads barely faster than 1. A `Program` lowers the graph, for one input shape, to
runs of `ea_op` structs that `ea_run_ops` (kernels/graph.c) executes back to back, each op
split across the library's own thread pool. Ops the C side has no kernel for (pools,
GATHER, table lookups, broadcasting ADD, grouped convolutions, ...) stay Python steps
between runs, exactly as the walker would run them, so every graph the walker runs runs
here, with the same results: each C op is the same kernel call the walker would make.

Shapes at the batch size come from one recording pass through the walker (its output is
returned, so no batch is wasted). Intermediate tensors live in buffers allocated once per
program and reused once their last reader has run, which keeps the working set in cache;
the graph's outputs are fresh arrays per call, owned by the caller.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import native
from .. import native_lib as lib
from .. import reference_ops as ops
from ..graph import QGraph, QOp

Kernel = Callable[[QGraph, QOp, list], np.ndarray]


def record_shapes(graph: QGraph, table: dict[str, Kernel], x: np.ndarray,
                  run: Callable[..., Any]) -> tuple[Any, dict[str, tuple[tuple[int, ...], np.dtype]]]:
    """Run the walker once with `table`, noting every op output's shape and dtype."""
    seen: dict[str, tuple[tuple[int, ...], np.dtype]] = {}

    def wrap(kernel: Kernel) -> Kernel:
        def recorded(g: QGraph, op: QOp, args: list) -> np.ndarray:
            out = kernel(g, op, args)
            seen[op.outputs[0]] = (tuple(np.shape(out)), np.asarray(out).dtype)
            return out
        return recorded

    full = {**ops.KERNELS, **table}
    out = run(graph, x, kernels={kind: wrap(k) for kind, k in full.items()})
    return out, seen


class Program:
    """`graph` lowered for input shape `x_shape` on the kernels of `native_ops` (a NativeOps)."""

    def __init__(self, native_ops: Any, graph: QGraph, table: dict[str, Kernel], x_shape: tuple[int, ...],
                 shapes: dict[str, tuple[tuple[int, ...], np.dtype]], *, threads: int) -> None:
        self._ops, self.graph, self.threads = native_ops, graph, max(1, int(threads))
        self._kernels: native.NativeKernels = native_ops.kernels
        self._lib = self._kernels._lib
        self._table = {**ops.KERNELS, **table}
        (self._src,), (self._dst,) = graph.inputs, graph.outputs
        self.input_shape = tuple(x_shape)
        self._shapes = {self._src: (self.input_shape, np.dtype(np.int8)), **shapes}
        self._keep: list[Any] = []  # plans and arrays whose memory the C structs point at
        self._slots: dict[str, int] = {}
        self._lower()

    # ---- lowering ---------------------------------------------------------------------------
    def _slot(self, name: str) -> int:
        if name not in self._slots:
            self._slots[name] = len(self._slots)
        return self._slots[name]

    def _activation(self, name: str) -> bool:
        return bool(name) and not self.graph.tensor(name).is_constant and name in self._shapes

    def _c_op(self, op: QOp) -> lib.OpStruct | None:
        """The ea_op for `op`, or None when it stays a Python step."""
        g, o = self.graph, lib.OpStruct()
        if not op.inputs or not self._activation(op.inputs[0]) or op.outputs[0] not in self._shapes:
            return None
        in_shape = self._shapes[op.inputs[0]][0]
        out_shape, out_dtype = self._shapes[op.outputs[0]]
        if out_dtype != np.int8 or self._shapes[op.inputs[0]][1] != np.int8:
            return None
        kind = op.kind
        if kind in ("CONV_2D", "DEPTHWISE_CONV_2D") and len(in_shape) == 4 and not self._ops.grouped(g, op):
            plan = self._ops.conv_plan_for(self._ops._get(g, op), op, in_shape)
            self._keep.append(plan)
            o.kind = lib.OP_CONV if kind == "CONV_2D" else lib.OP_DEPTHWISE
            o.conv = plan.params
            o.w, o.colsum, o.bias, o.mult, o.shift = plan.pointers
        elif kind == "FULLY_CONNECTED":
            p = self._ops._get(g, op)
            rows = int(np.prod(in_shape)) // p.filt.k
            if rows * p.filt.k != int(np.prod(in_shape)) or int(np.prod(out_shape)) != rows * p.filt.n:
                return None
            plan = self._ops.gemm_plan_for(p, rows)
            self._keep.append(plan)
            o.kind, o.gemm = lib.OP_GEMM, plan.params
            o.gemm.a_stride_m, o.gemm.a_stride_k = p.filt.k, 1
            o.w, o.colsum, o.bias, o.mult, o.shift = plan.pointers
        elif kind == "ADD":
            if len(op.inputs) < 2 or not self._activation(op.inputs[1]):
                return None
            params = self._ops.add_params_for(g, op)
            if params is None or self._shapes[op.inputs[1]] != self._shapes[op.inputs[0]] or in_shape != out_shape:
                return None
            o.kind, o.add, o.in1 = lib.OP_ADD, params, self._slot(op.inputs[1])
            o.n[0] = int(np.prod(in_shape))
        elif kind == "MEAN":
            axes_t = g.tensor(op.inputs[1]) if len(op.inputs) > 1 and op.inputs[1] else None
            if axes_t is None or axes_t.data is None or len(in_shape) != 4:
                return None
            if sorted({int(a) % 4 for a in np.asarray(axes_t.data).reshape(-1)}) != [1, 2]:
                return None
            o.kind = lib.OP_MEAN
            o.n[0], o.n[1], o.n[2] = in_shape[0], in_shape[1] * in_shape[2], in_shape[3]
            o.q[0], o.q[1], o.q[2], o.q[3] = self._ops.mean_params_for(g, op, in_shape)  # zp_in, m, s, zp_out
        elif kind == "RESHAPE":
            if int(np.prod(in_shape)) != int(np.prod(out_shape)):
                return None
            o.kind, o.n[0] = lib.OP_COPY, int(np.prod(in_shape))
        else:
            return None
        o.in0, o.out = self._slot(op.inputs[0]), self._slot(op.outputs[0])
        return o

    def _lower(self) -> None:
        g = self.graph
        last_use: dict[str, int] = {}
        for i, op in enumerate(g.ops):
            for name in op.inputs:
                if name:
                    last_use[name] = i
        # steps: ("c", [OpStruct...], [names set per call]) | ("py", op)
        self._steps: list[tuple[str, Any]] = []
        self._arena: dict[str, np.ndarray] = {}  # tensor name -> its view of a reused buffer
        arena_bufs: dict[str, np.ndarray] = {}  # tensor name -> the byte buffer behind it
        free: list[np.ndarray] = []  # released byte buffers
        c_made: set[str] = set()
        run: list[lib.OpStruct] = []
        for i, op in enumerate(g.ops):
            o = self._c_op(op)
            name = op.outputs[0]
            if o is None:
                if run:
                    self._steps.append(("c", run))
                    run = []
                self._steps.append(("py", op))
            else:
                run.append(o)
                c_made.add(name)
                if name not in g.outputs:
                    shape, dtype = self._shapes[name]
                    nbytes = max(1, int(np.prod(shape)) * dtype.itemsize)
                    fits = [b for b in free if b.nbytes >= nbytes]
                    buf = min(fits, key=lambda b: b.nbytes) if fits else np.empty(nbytes, np.uint8)
                    if fits:
                        free = [b for b in free if b is not buf]
                    self._arena[name] = buf[:nbytes].view(dtype).reshape(shape)
                    arena_bufs[name] = buf
            for src in {n for n in op.inputs if n}:  # after this op, dead inputs free their buffer
                if last_use.get(src) == i and src in arena_bufs:
                    free.append(arena_bufs[src])
        if run:
            self._steps.append(("c", run))
        self._c_made = c_made
        self._slot_array = (ctypes.c_void_p * max(1, len(self._slots)))()
        for name, arr in self._arena.items():
            self._slot_array[self._slots[name]] = arr.ctypes.data
        # per C run: the ctypes op array, and the tensors whose slot must be set per call
        lowered = []
        for kind, item in self._steps:
            if kind == "py":
                lowered.append((kind, item, None))
                continue
            arr = (lib.OpStruct * len(item))(*item)
            made_here = {n for n, s in self._slots.items() if any(o.out == s for o in item)}
            dynamic = sorted({n for n, s in self._slots.items()
                              if n not in self._arena and any(s in (o.in0, o.in1, o.out) for o in item)})
            outputs = [n for n in dynamic if n in made_here]
            inputs = [n for n in dynamic if n not in made_here]
            lowered.append((kind, arr, (inputs, outputs)))
        self._lowered = lowered
        self.c_ops = sum(len(item) for kind, item in self._steps if kind == "c")
        self.python_ops = sum(1 for kind, _ in self._steps if kind == "py")

    # ---- running ----------------------------------------------------------------------------
    def _value(self, name: str, values: dict[str, np.ndarray]) -> Any:
        if not name:
            return None
        if name in values:
            return values[name]
        if name in self._arena:
            return self._arena[name]
        return self.graph.tensor(name).data

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if x.shape != self.input_shape or x.dtype != np.int8:
            raise ValueError(f"program built for int8 {self.input_shape}, got {x.dtype} {x.shape}")
        values: dict[str, np.ndarray] = {self._src: np.ascontiguousarray(x)}
        slots, v = self._slot_array, self._kernels._v
        for kind, item, io in self._lowered:
            if kind == "py":
                op: QOp = item
                args = [self._value(n, values) for n in op.inputs]
                out = self._table[op.kind](self.graph, op, args)
                if not isinstance(out, np.ndarray) or not out.flags.owndata or not out.flags.c_contiguous:
                    out = np.array(out)  # never a view into a buffer a later op overwrites
                values[op.outputs[0]] = out
                continue
            inputs, outputs = io
            for name in inputs:
                arr = values.get(name)
                if arr is None or not arr.flags.c_contiguous or arr.dtype != np.int8:
                    arr = values[name] = np.ascontiguousarray(self._value(name, values), np.int8)
                slots[self._slots[name]] = arr.ctypes.data
            for name in outputs:
                shape, dtype = self._shapes[name]
                arr = values[name] = np.empty(shape, dtype)
                slots[self._slots[name]] = arr.ctypes.data
            rc = self._lib.ea_run_ops(v, item, len(item), slots, self.threads)
            if rc != 0:
                raise RuntimeError(f"ea_run_ops ({self._kernels.name}): {lib._ERRORS.get(rc, f'error {rc}')}")
        out = self._value(self._dst, values)
        return out if self._dst in values else np.array(out)
