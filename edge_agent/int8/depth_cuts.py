"""Training depths of a model: the cut points below the head split where a deeper trainable
tail can begin, and what each depth costs.

A bundle is split once for its head (the classifier's input, or the global pool); a
multi-depth bundle also records the block boundaries before that split, nearest first:

    depth 0   the head split itself (head only; the numpy fast path when it is one layer)
    depth 1   the input of the last conv before the head split when it is a 1x1 conv
              (MobileNetV2's 1280-channel "head conv"): last 1x1 conv + head
    depth k   the k-th residual / concat block boundary (in a plain chain without skips,
              the input of each conv, after its predecessor's activation or pool) before
              that: the last blocks + 1x1 conv + head

A boundary is a tensor every path from the input to the output goes through (the same
dominance test as `cut_points`), that is a block's output (Add / Concat, followed through
its activation) or a residual block's input (consumed by an Add and by a conv path), so the
blocks without a skip connection (stride 2, channel change) still count once each.
In a plain chain (MobileNet v1, a small VGG-style CNN) every conv starts a depth: a
separable block is then two depths (its pointwise conv, then both).

For each depth, `depth_costs` counts what a device's planner needs without running
anything: multiply-accumulates of the frozen prefix and of the trainable tail per sample,
the tail's parameters and the activations its backward pass keeps per sample, and the size
of the activation at the cut (what the cache stores per sample).

Public API: `depth_cuts(model, split_tensor, max_depths)`, `depth_costs(model, cut, split)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .cut_points import _dominates, _resolve, _shapes, graph_maps

if TYPE_CHECKING:  # pragma: no cover - typing only
    import onnx

MAX_DEPTHS = 8  # bundle file names depth1..depth8
_PASS_THROUGH = {"Relu", "Clip", "HardSwish", "LeakyRelu", "Identity", "Dropout"}
_WEIGHTED = {"Conv", "Gemm", "MatMul"}


@dataclass(frozen=True)
class DepthCut:
    """One trainable depth: `tensor` starts the tail; `kind` says what boundary it is
    (1x1-input | add | concat | block-input | stage); `index` is its producer's position."""

    tensor: str
    node: str
    kind: str
    index: int
    shape: tuple[int, ...] | None


def depth_cuts(model: onnx.ModelProto, split_tensor: str, max_depths: int = 4) -> list[DepthCut]:
    """The depths below `split_tensor`, nearest first (depth 1 first), at most `max_depths`."""
    from .onnx_import import node_name

    nodes, producer, consumers, consts = graph_maps(model)
    if split_tensor not in producer:
        return []
    split_at = producer[_resolve(split_tensor, producer, nodes)]
    outputs = {o.name for o in model.graph.output}
    graph_input = next((i.name for i in model.graph.input if i.name not in consts), None)
    shapes = _shapes(model)
    dims = {i.name: [int(d) for d in i.dims] for i in model.graph.initializer}

    def follow(t: str) -> str:
        while len(consumers.get(t, [])) == 1:
            nxt = nodes[consumers[t][0]]
            if nxt.op_type not in _PASS_THROUGH or not nxt.output:
                break
            t = nxt.output[0]
        return t

    plain = not any(nodes[k].op_type in ("Add", "Concat") for k in range(split_at))
    found: dict[str, str] = {}
    last_conv = next((k for k in range(split_at, -1, -1) if nodes[k].op_type == "Conv"), None)
    if last_conv is not None:
        weight = nodes[last_conv].input[1] if len(nodes[last_conv].input) > 1 else ""
        if len(dims.get(weight, [])) == 4 and dims[weight][2:] == [1, 1]:
            found[_resolve(nodes[last_conv].input[0], producer, nodes)] = "1x1-input"
    for k in range(split_at - 1, -1, -1):
        n = nodes[k]
        if not n.output:
            continue
        out = follow(n.output[0])
        if n.op_type == "Add" and not any(i in consts for i in n.input):
            found.setdefault(out, "add")
        elif n.op_type == "Concat":
            found.setdefault(out, "concat")
        users = [nodes[c] for c in consumers.get(out, [])]
        residual = any(u.op_type == "Add" and not any(i in consts for i in u.input) for u in users)
        if residual and len(users) > 1:  # an Add of a constant (hard-swish's x + 3) is no skip
            found.setdefault(out, "block-input")
        elif plain and n.op_type not in ("Conv", "BatchNormalization") and any(
                nodes[c].op_type == "Conv" for c in consumers.get(out, [])):
            found.setdefault(out, "stage")  # a plain chain (MobileNet v1, VGG-style): each conv's input
    cuts = []
    for tensor, kind in found.items():
        k = producer.get(tensor)
        shape = shapes.get(tensor)
        if k is None or k >= split_at or tensor in outputs or (shape is not None and len(shape) != 4):
            continue
        if not any(nodes[j].op_type in _WEIGHTED for j in range(k + 1, split_at + 1)):
            continue  # nothing to train between it and the head split (e.g. ResNet's last add)
        if not _dominates(tensor, nodes, producer, outputs, graph_input):
            continue
        node = nodes[k]
        cuts.append(DepthCut(tensor, node_name(node) if node.output[0] == tensor else tensor, kind, k, shape))
    cuts.sort(key=lambda c: -c.index)
    return cuts[:max(0, min(max_depths, MAX_DEPTHS))]


def _macs(node: Any, shapes: dict[str, tuple[int, ...]], dims: dict[str, list[int]]) -> int:
    """Multiply-accumulates per sample of one weighted node (0 where a shape is unknown)."""
    out = shapes.get(node.output[0]) if node.output else None
    weight = dims.get(node.input[1]) if len(node.input) > 1 else None
    if out is None or weight is None:
        return 0
    per_sample = 1
    for v in out[1:]:
        per_sample *= int(v)
    if node.op_type == "Conv":  # each output element: Cin/groups x kh x kw
        fan_in = 1
        for v in weight[1:]:
            fan_in *= int(v)
        return per_sample * fan_in
    if node.op_type == "Gemm":  # weight (in, out), or (out, in) with transB
        return per_sample * int(weight[1] if _trans_b(node) else weight[0])
    return per_sample * int(weight[-2] if len(weight) > 1 else 1)  # MatMul: (..., in, out)


def _trans_b(node: Any) -> bool:
    return any(a.name == "transB" and a.i for a in node.attribute)


def depth_costs(model: onnx.ModelProto, cut_tensor: str) -> dict[str, int]:
    """Per-sample counts for training from `cut_tensor` to the outputs (see module doc):
    prefix_macs, tail_macs, tail_params, tail_activations, cut_elements."""
    import onnx

    nodes, producer, _, consts = graph_maps(model)
    shapes = _shapes(model)
    dims = {i.name: [int(d) for d in i.dims] for i in model.graph.initializer}
    # parameters are float tensors with a shape: Clip's scalar bounds and the integer shape /
    # axes / pads inputs of Reshape, Pad, Slice... are configuration, nothing to train or store
    floats = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE, onnx.TensorProto.BFLOAT16}
    weights = {i.name for i in model.graph.initializer if i.dims and i.data_type in floats}
    cut_at = producer.get(cut_tensor, -1)
    prefix_macs = tail_macs = tail_acts = 0
    tail_params: set[str] = set()
    for k, n in enumerate(nodes):
        macs = _macs(n, shapes, dims) if n.op_type in _WEIGHTED else 0
        if k <= cut_at:
            prefix_macs += macs
            continue
        tail_macs += macs
        tail_params.update(i for i in n.input if i in weights)
        for o in n.output:
            s = shapes.get(o)
            if s is not None:
                size = 1
                for v in s[1:]:
                    size *= int(v)
                tail_acts += size
    cut_shape = shapes.get(cut_tensor)
    cut_elems = 1
    for v in (cut_shape or (1, 0))[1:]:
        cut_elems *= int(v)
    params = 0
    for name in tail_params:
        size = 1
        for v in dims[name]:
            size *= v
        params += size
    return {"prefix_macs": int(prefix_macs), "tail_macs": int(tail_macs), "tail_params": int(params),
            "tail_activations": int(tail_acts), "cut_elements": int(cut_elems)}
