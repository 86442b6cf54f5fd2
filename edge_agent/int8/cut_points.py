"""Candidate split points of an ONNX model: the block boundaries a user (or a multi-cut
bundle) can cut at, with their shapes.

A valid cut is a single tensor every path from the input to the output goes through (the
backbone and the head then meet at exactly that tensor). Of those, the useful ones are
block boundaries: the output of a residual Add or a Concat (fire / dense / inception
blocks; followed through a trailing activation), a global pool, a flatten, the input of the
classifier, and the last tensor at each spatial resolution of a plain conv chain (MobileNet
v1, VGG). Shapes come from the graph's value_info after ONNX shape inference, so listing
works for models the importer would refuse further down.

Public API: `candidate_cuts(model) -> list[Cut]`, graph order (shallow to deep).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - typing only
    import onnx

# ops that keep a block's output a block output (activations, no-ops)
_PASS_THROUGH = {"Relu", "Clip", "HardSwish", "LeakyRelu"}
_IDENTITY = {"Identity", "Dropout"}
_POOLS = {"GlobalAveragePool", "GlobalMaxPool", "ReduceMean"}
_CLASSIFIERS = {"Gemm", "MatMul", "Conv"}
MAX_CUT_NODES = 20_000  # dominance is checked per candidate; bound the quadratic work


@dataclass(frozen=True)
class Cut:
    """One candidate split point.

    name: what `--split` takes (the producing node's name, else the tensor name);
    tensor: the ONNX tensor the backbone ends at; shape: its shape (NCHW or (N, C); None
    where shape inference could not tell); kind: add | concat | pool | flatten | stage |
    classifier-input; index: the producing node's position in the graph."""

    name: str
    tensor: str
    shape: tuple[int, ...] | None
    kind: str
    index: int

    def shape_text(self) -> str:
        return "x".join(str(v) for v in self.shape) if self.shape else "?"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "tensor": self.tensor, "shape": list(self.shape) if self.shape else None,
                "kind": self.kind, "index": self.index}


def _shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    from .onnx_lean import inferred_skeleton

    try:
        inferred = inferred_skeleton(model)
    except Exception:  # an odd model: list cuts without shapes rather than fail
        inferred = model
    out: dict[str, tuple[int, ...]] = {}
    g = inferred.graph
    for vi in [*g.input, *g.value_info, *g.output]:
        dims = vi.type.tensor_type.shape.dim
        if vi.type.tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in dims):
            out[vi.name] = tuple(int(d.dim_value) for d in dims)
    return out


def graph_maps(model: onnx.ModelProto) -> tuple[list[Any], dict[str, int], dict[str, list[int]], set[str]]:
    """(nodes, producer index of each tensor, consumer indices of each tensor, constant
    tensors) of the first MAX_CUT_NODES nodes."""
    nodes = list(model.graph.node)[:MAX_CUT_NODES]
    producer = {o: k for k, n in enumerate(nodes) for o in n.output if o}
    consumers: dict[str, list[int]] = {}
    for k, n in enumerate(nodes):
        for i in n.input:
            if i:
                consumers.setdefault(i, []).append(k)
    consts = {i.name for i in model.graph.initializer} | {o for n in nodes if n.op_type == "Constant" for o in n.output}
    return nodes, producer, consumers, consts


def _node_name(node: onnx.NodeProto) -> str:
    from .onnx_import import node_name

    return node_name(node)


def candidate_cuts(model: onnx.ModelProto) -> list[Cut]:
    """Block boundaries of `model` that are valid cuts, in graph order (see module doc)."""
    g = model.graph
    nodes, producer, consumers, consts = graph_maps(model)
    outputs = {o.name for o in g.output}
    shapes = _shapes(model)

    def follow(t: str) -> str:
        """Through single-consumer activations / no-ops: the block's real output."""
        while len(consumers.get(t, [])) == 1 and t not in outputs:
            nxt = nodes[consumers[t][0]]
            if nxt.op_type not in _PASS_THROUGH or not nxt.output:
                break
            t = nxt.output[0]
        return t

    def spatial(t: str) -> tuple[int, ...] | None:
        s = shapes.get(t)
        return s[2:] if s is not None and len(s) == 4 else None

    found: dict[str, str] = {}  # tensor -> kind, first kind wins except classifier-input
    for n in nodes:
        if not n.output or n.op_type in _IDENTITY:
            continue
        kind = None
        if n.op_type == "Add" and not any(i in consts for i in n.input):
            kind = "add"
        elif n.op_type == "Concat":
            kind = "concat"
        elif n.op_type in _POOLS:
            kind = "pool"
        elif n.op_type in {"Flatten", "Reshape"} and len(shapes.get(n.output[0], ())) == 2:
            kind = "flatten"
        elif n.op_type != "Constant" and spatial(n.output[0]) is not None:
            # a plain chain's stage end: the next op changes the spatial size
            t = follow(n.output[0])
            nxt = [nodes[c] for c in consumers.get(t, [])]
            if nxt and any(spatial(o.output[0]) not in (None, spatial(t)) for o in nxt if o.output):
                kind = "stage"
        if kind:
            found.setdefault(follow(n.output[0]), kind)
    # the classifier's input: the last Gemm/MatMul/Conv with a constant weight
    last = next((n for n in reversed(nodes) if n.op_type in _CLASSIFIERS and len(n.input) > 1
                 and n.input[1] in consts), None)
    if last is not None:
        t = _resolve(last.input[0], producer, nodes)
        found[t] = "classifier-input"
    classifier = nodes.index(last) if last is not None else len(nodes)
    graph_input = next((i.name for i in g.input if i.name not in consts), None)
    cuts = []
    for tensor, kind in found.items():
        k = producer.get(tensor)
        if k is None or k >= classifier or tensor in outputs or not _dominates(tensor, nodes, producer, outputs, graph_input):
            continue
        node = nodes[k]
        name = _node_name(node) if node.output[0] == tensor else tensor
        cuts.append(Cut(name, tensor, shapes.get(tensor), kind, k))
    return sorted(cuts, key=lambda c: c.index)


def _resolve(t: str, producer: dict[str, int], nodes: list[Any]) -> str:
    """Back through Identity / Dropout: the tensor a no-op chain repeats."""
    while t in producer and nodes[producer[t]].op_type in _IDENTITY and nodes[producer[t]].input:
        t = nodes[producer[t]].input[0]
    return t


def _dominates(cut: str, nodes: list[Any], producer: dict[str, int], outputs: set[str],
               graph_input: str | None) -> bool:
    """Every path from the input to the outputs passes through `cut`: the head (the
    outputs' ancestors that are not the cut's) reads nothing of the backbone but `cut`."""
    backbone: set[int] = set()
    stack = [producer[cut]]
    while stack:
        k = stack.pop()
        if k in backbone:
            continue
        backbone.add(k)
        stack.extend(producer[i] for i in nodes[k].input if i in producer)
    seen: set[int] = set()
    stack = [producer[o] for o in outputs if o in producer]
    while stack:
        k = stack.pop()
        if k in seen or k in backbone:
            continue
        seen.add(k)
        for i in nodes[k].input:
            if not i or i == cut:
                continue
            if i == graph_input or (i in producer and producer[i] in backbone):
                return False
            if i in producer:
                stack.append(producer[i])
    return bool(seen)


def describe(cuts: list[Cut], limit: int = 8) -> str:
    """A few useful cuts for an error message: the deepest ones (near the head)."""
    if not cuts:
        return "no single-tensor block boundary found"
    picked = cuts[-limit:]
    more = f" (and {len(cuts) - len(picked)} earlier)" if len(cuts) > len(picked) else ""
    return ", ".join(f"{c.name} [{c.kind} {c.shape_text()}]" for c in picked) + more
