"""Training depths below the head split (int8/depth_cuts.py, issue 15): which block
boundaries are found, in what order, and what each depth costs.

Oracles: the Gluon nets themselves for costs (multiply-accumulates from forward hooks on
every Conv2D / Dense, parameter counts from the blocks' own parameters, each grouped by
the Gluon block that computes it: a cut after unit i leaves units 0..i in the prefix and
the rest in the tail), and hand-counted sums for hand-built ONNX graphs. Graph structure
(which tensor is a block's output or input) is read from the exported graph in the tests,
not taken from the module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edge_agent.int8.cut_points import candidate_cuts
from edge_agent.int8.depth_cuts import MAX_DEPTHS, depth_costs, depth_cuts
from edge_agent.int8.onnx_export import export_onnx
from edge_agent.int8.onnx_import import load_onnx
from edge_agent.sim import models

SIZE = 32
CLASSES = 10


@dataclass
class Net:
    """An exported Gluon net with its head split and its units (the Gluon blocks a cut
    can fall after, in execution order): (key, MACs per sample, parameter count)."""

    model: onnx.ModelProto
    split: str
    fc_params: int
    units: list[tuple[str, int, int]]

    def unit_of(self, tensor: str) -> int:
        """The index of the unit whose output `tensor` is (named by the Gluon block)."""
        hits = [k for k, (key, _, _) in enumerate(self.units) if tensor == key or tensor.startswith(key + "_")]
        assert len(hits) == 1, (tensor, hits)
        return hits[0]

    @property
    def total_macs(self) -> int:
        return sum(m for _, m, _ in self.units)


def _leaves(block: Any) -> list[Any]:
    kids = list(block._children.values())  # noqa: SLF001 - Gluon has no public walk
    return [block] if not kids else [leaf for kid in kids for leaf in _leaves(kid)]


def _exported(net: Any, units: list[tuple[str, Any]], split: str) -> Net:
    """Count each unit's MACs with forward hooks (one sample) and parameters, export."""
    import mxnet as mx
    from mxnet.gluon import nn

    macs: dict[int, int] = {}

    def hook(block: Any, _inputs: Any, output: Any) -> None:
        # Conv2D weight (out, in/groups, kh, kw), Dense weight (units, in): every output
        # element costs prod(weight.shape[1:]) multiply-accumulates
        macs[id(block)] = int(np.prod(output.shape[1:])) * int(np.prod(block.weight.shape[1:]))

    weighted = [leaf for _, u in units for leaf in _leaves(u) if isinstance(leaf, nn.Conv2D | nn.Dense)]
    handles = [leaf.register_forward_hook(hook) for leaf in weighted]
    net(mx.nd.zeros((1, 3, SIZE, SIZE)))
    for h in handles:
        h.detach()
    assert len(macs) == len(weighted)  # every weighted layer ran once
    rows = []
    for key, unit in units:
        unit_macs = sum(macs.get(id(leaf), 0) for leaf in _leaves(unit))
        params = sum(int(np.prod(p.shape)) for p in unit.collect_params().values())
        rows.append((key, unit_macs, params))
    fc = units[-1][1]
    fc_params = sum(int(np.prod(p.shape)) for p in fc.collect_params().values())
    return Net(load_onnx(export_onnx(net, (1, 3, SIZE, SIZE))), split, fc_params, rows)


def _children(block: Any) -> list[Any]:
    return list(block._children.values())  # noqa: SLF001


@pytest.fixture(scope="module")
def mobilenet_v2() -> Net:
    net = models.initialize(models.mobilenet_v2(0.35, CLASSES, SIZE), seed=0, randomize_bn=True)
    units = [(c.name, c) for c in _children(net.features) + _children(net.output)]
    return _exported(net, units, "features_gap_fwd")


def _zoo(name: str) -> Any:
    import mxnet as mx
    from mxnet.gluon.model_zoo import vision

    net = vision.get_model(name, pretrained=False, classes=CLASSES)
    models.initialize(net, seed=0)
    net(mx.nd.zeros((1, 3, SIZE, SIZE)))  # deferred shapes known (the hooks count on a second pass)
    return net


@pytest.fixture(scope="module")
def mobilenet_v1() -> Net:
    net = _zoo("mobilenet0.25")
    units = [(c.name, c) for c in _children(net.features)] + [(net.output.name, net.output)]
    return _exported(net, units, "mobilenet0_pool0_fwd")


@pytest.fixture(scope="module")
def resnet18() -> Net:
    net = _zoo("resnet18_v1")
    units: list[tuple[str, Any]] = []
    for child in _children(net.features):
        if child.name.startswith("resnetv10_stage"):  # each BasicBlockV1 its own unit, named by its output
            units += [(f"{child.name}_activation{b}", blk) for b, blk in enumerate(_children(child))]
        else:
            units.append((child.name, child))
    return _exported(net, [*units, (net.output.name, net.output)], "resnetv10_pool1_fwd")


def _pairs(net: Net, n: int = MAX_DEPTHS) -> list[tuple[str, str]]:
    return [(c.tensor, c.kind) for c in depth_cuts(net.model, net.split, n)]


def _nodes(model: onnx.ModelProto) -> tuple[list[Any], dict[str, int], dict[str, list[Any]]]:
    nodes = list(model.graph.node)
    producer = {o: k for k, n in enumerate(nodes) for o in n.output}
    consumers: dict[str, list[Any]] = {}
    for n in nodes:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    return nodes, producer, consumers


# ----------------------------------------------------------------- discovery on real nets


def test_mobilenet_v2_depths_are_the_last_1x1_input_then_block_boundaries(mobilenet_v2):
    got = _pairs(mobilenet_v2)
    assert got == [
        ("features_block16_project_bn_fwd", "1x1-input"),  # last 1x1 conv (1280 ch) + head
        ("features_block15__plus0", "add"),
        ("features_block14__plus0", "add"),
        ("features_block13_project_bn_fwd", "block-input"),  # a stage's first block: no skip
        ("features_block12__plus0", "add"),
        ("features_block11__plus0", "add"),
        ("features_block10_project_bn_fwd", "block-input"),
        ("features_block9__plus0", "add"),
    ]
    cuts = depth_cuts(mobilenet_v2.model, mobilenet_v2.split, MAX_DEPTHS)
    _, producer, _ = _nodes(mobilenet_v2.model)
    assert [c.index for c in cuts] == sorted((c.index for c in cuts), reverse=True)  # nearest first
    for c in cuts:
        assert producer[c.tensor] == c.index
        assert c.node == c.tensor and c.shape is not None and len(c.shape) == 4
    assert cuts[0].shape == (1, 112, 1, 1) and cuts[4].shape == (1, 32, 2, 2)
    # asking for fewer gives the nearest ones; more than MAX_DEPTHS is capped; none is none
    assert _pairs(mobilenet_v2, 2) == got[:2]
    assert len(depth_cuts(mobilenet_v2.model, mobilenet_v2.split, 50)) == MAX_DEPTHS
    assert depth_cuts(mobilenet_v2.model, mobilenet_v2.split, 0) == []
    assert depth_cuts(mobilenet_v2.model, "no_such_tensor", 4) == []


def test_mobilenet_v1_depths_are_each_conv_of_the_plain_chain(mobilenet_v1):
    got = _pairs(mobilenet_v1)
    # conv26 is the last (1x1) conv; before it the plain chain alternates dw conv{2j+1} and
    # pw conv{2j+2}: every conv's input is a depth, so a separable block is two of them
    assert got == [("mobilenet0_relu25_fwd", "1x1-input")] + [
        (f"mobilenet0_relu{j}_fwd", "stage") for j in range(24, 17, -1)]
    nodes, _, consumers = _nodes(mobilenet_v1.model)
    weights = {i.name: numpy_helper.to_array(i).shape for i in mobilenet_v1.model.graph.initializer}
    kinds = []
    for tensor, _kind in got:
        (conv,) = consumers[tensor]
        assert conv.op_type == "Conv"
        group = next((a.i for a in conv.attribute if a.name == "group"), 1)
        w = weights[conv.input[1]]
        kinds.append("dw" if group > 1 and w[1] == 1 and w[2:] == (3, 3) else "pw" if w[2:] == (1, 1) else "?")
    assert kinds == ["pw", "dw"] * 4, kinds  # nearest first: the last pointwise conv, then its depthwise


def test_resnet18_last_add_is_not_a_depth_and_block_inputs_alternate_with_adds(resnet18):
    got = _pairs(resnet18)
    expected = []
    for stage in (4, 3, 2, 1):
        if stage != 4:  # stage 4's last block output feeds only the pool: nothing to train in between
            expected.append((f"resnetv10_stage{stage}_activation1", "add"))
        expected.append((f"resnetv10_stage{stage}_activation0", "block-input"))
    expected.append(("resnetv10_pool0_fwd", "block-input"))  # the stem's output enters stage 1's first block
    assert got == expected
    # the last add is a valid cut (cut_points lists it) -- depth_cuts leaves it out on purpose
    last_add = "resnetv10_stage4_activation1"
    assert (last_add, "add") in [(c.tensor, c.kind) for c in candidate_cuts(resnet18.model)]
    assert last_add not in [t for t, _ in got]
    # no 1x1-input: the last conv before the pool is a 3x3
    assert all(kind != "1x1-input" for _, kind in got)


# ----------------------------------------------------------------- costs on real nets


@pytest.mark.parametrize("which", ["mobilenet_v2", "mobilenet_v1", "resnet18"])
def test_costs_partition_the_net_and_match_the_gluon_blocks(request, which):
    net: Net = request.getfixturevalue(which)
    cuts = depth_cuts(net.model, net.split, MAX_DEPTHS)
    tensors = [net.split, *[c.tensor for c in cuts]]
    costs = [depth_costs(net.model, t) for t in tensors]
    shapes = {net.split: None, **{c.tensor: c.shape for c in cuts}}
    for tensor, cost in zip(tensors, costs, strict=True):
        assert set(cost) == {"prefix_macs", "tail_macs", "tail_params", "tail_activations", "cut_elements"}
        assert all(isinstance(v, int) and v >= 0 for v in cost.values())
        # a partition: every multiply-accumulate of the Gluon net is on exactly one side
        assert cost["prefix_macs"] + cost["tail_macs"] == net.total_macs, tensor
        # and the sides are the Gluon blocks before / after the cut
        unit = net.unit_of(tensor)
        assert cost["prefix_macs"] == sum(m for _, m, _ in net.units[:unit + 1]), tensor
        assert cost["tail_params"] == sum(p for _, _, p in net.units[unit + 1:]), tensor
        if shapes[tensor] is not None:
            assert cost["cut_elements"] == int(np.prod(shapes[tensor][1:]))
    head = costs[0]
    assert head["tail_params"] == net.fc_params  # the head split: the classifier alone
    assert head["tail_macs"] == CLASSES * (net.fc_params // CLASSES - 1)  # weight (10, C): 10*C
    # deeper: more to train, more to keep for backward, less to run frozen
    for shallow, deep in zip(costs, costs[1:], strict=False):
        assert deep["tail_params"] > shallow["tail_params"]
        assert deep["tail_macs"] > shallow["tail_macs"] and deep["prefix_macs"] < shallow["prefix_macs"]
        assert deep["tail_activations"] > shallow["tail_activations"]


# ----------------------------------------------------------------- hand-built graphs


def _w(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 0.3, shape).astype(np.float32)


def _model(nodes: list[Any], inits: dict[str, np.ndarray], *, x=(1, 4, 8, 8)) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "hand", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, CLASSES])],
        initializer=[numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def _conv(x: str, w: str, y: str, *, pad: int = 1, bias: str | None = None) -> Any:
    return helper.make_node("Conv", [x, w, *([bias] if bias else [])], [y], pads=[pad] * 4)


def _tail(x: str) -> list[Any]:
    """x (1, 4, 8, 8) -> 3x3 conv + relu -> 1x1 conv (8 ch, bias) + relu -> pool -> fc."""
    return [_conv(x, "w3", "c3"), helper.make_node("Relu", ["c3"], ["t3"]),
            _conv("t3", "w4", "c4", pad=0, bias="b4"), helper.make_node("Relu", ["c4"], ["r4"]),
            helper.make_node("GlobalAveragePool", ["r4"], ["p"]),
            helper.make_node("Reshape", ["p", "shape"], ["f"]),  # int64 shape constant: not a parameter
            helper.make_node("Gemm", ["f", "wf", "bf"], ["y"])]  # weight (in, out): no transB


def _tail_inits() -> dict[str, np.ndarray]:
    return {"w3": _w(4, 4, 3, 3, seed=3), "w4": _w(8, 4, 1, 1, seed=4), "b4": _w(8, seed=5),
            "shape": np.array([1, 8], np.int64), "wf": _w(8, CLASSES, seed=6), "bf": _w(CLASSES, seed=7)}


def _residual(skip_from: str) -> onnx.ModelProto:
    """Two residual adds; the second's skip comes from `skip_from`: "a1" chains them, "t0"
    is a long skip around the first block, so a1 is no longer on every path."""
    nodes = [_conv("x", "w0", "c0"), helper.make_node("Relu", ["c0"], ["t0"]),
             _conv("t0", "w1", "c1"), helper.make_node("Add", ["c1", "t0"], ["a1"]),
             _conv("a1", "w2", "c2"), helper.make_node("Add", ["c2", skip_from], ["a2"]), *_tail("a2")]
    return _model(nodes, {"w0": _w(4, 4, 3, 3), "w1": _w(4, 4, 3, 3, seed=1), "w2": _w(4, 4, 3, 3, seed=2),
                          **_tail_inits()})


def test_a_boundary_bypassed_by_a_skip_connection_is_not_a_depth():
    chained = [(c.tensor, c.kind) for c in depth_cuts(_residual("a1"), "p", 8)]
    assert chained == [("t3", "1x1-input"), ("a2", "add"), ("a1", "add"), ("t0", "block-input")]
    # the long skip t0 -> a2 goes around a1: a tail from a1 would need t0 as well
    bypassed = [(c.tensor, c.kind) for c in depth_cuts(_residual("t0"), "p", 8)]
    assert bypassed == [("t3", "1x1-input"), ("a2", "add"), ("t0", "block-input")]


def test_hand_counted_costs():
    model = _residual("t0")
    conv3x3 = (4 * 8 * 8) * (4 * 3 * 3)  # per sample: outputs x (Cin x kh x kw)
    conv1x1, fc = (8 * 8 * 8) * 4, CLASSES * 8
    total = 4 * conv3x3 + conv1x1 + fc
    assert depth_costs(model, "p") == {"prefix_macs": total - fc, "tail_macs": fc,
                                       "tail_params": 8 * CLASSES + CLASSES,  # wf + bf, not the Reshape shape
                                       "tail_activations": 8 + CLASSES, "cut_elements": 8}
    assert depth_costs(model, "t3") == {
        "prefix_macs": 4 * conv3x3, "tail_macs": conv1x1 + fc,
        "tail_params": 8 * 4 + 8 + 8 * CLASSES + CLASSES,
        "tail_activations": 2 * 8 * 8 * 8 + 8 + 8 + CLASSES,  # conv, relu, pool, reshape, gemm outputs
        "cut_elements": 4 * 8 * 8}
    t0 = depth_costs(model, "t0")
    assert (t0["prefix_macs"], t0["tail_macs"]) == (conv3x3, total - conv3x3)
    assert t0["tail_params"] == 3 * 4 * 4 * 9 + 8 * 4 + 8 + 8 * CLASSES + CLASSES


def test_an_add_of_a_constant_does_not_make_a_block_input():
    # hard-swish written out, x * clip(x + 3, 0, 6) / 6 (older exporters, hand-written
    # MobileNetV3s): its input feeds an Add and a Mul, but it is no residual block's input
    nodes = [_conv("x", "w0", "c0"), helper.make_node("Add", ["c0", "three"], ["h0"]),
             helper.make_node("Clip", ["h0", "zero", "six"], ["h1"]), helper.make_node("Mul", ["c0", "h1"], ["h2"]),
             helper.make_node("Div", ["h2", "six"], ["hs"]),
             _conv("hs", "w1", "c1"), helper.make_node("Add", ["c1", "hs"], ["a1"]), *_tail("a1")]
    consts = {"three": np.array(3, np.float32), "zero": np.array(0, np.float32), "six": np.array(6, np.float32)}
    model = _model(nodes, {"w0": _w(4, 4, 3, 3), "w1": _w(4, 4, 3, 3, seed=1), **consts, **_tail_inits()})
    got = [(c.tensor, c.kind) for c in depth_cuts(model, "p", 8)]
    assert got == [("t3", "1x1-input"), ("a1", "add"), ("hs", "block-input")]
    # from hs the tail adds the block's conv to a1's tail
    assert depth_costs(model, "hs")["tail_params"] == 4 * 4 * 9 + depth_costs(model, "a1")["tail_params"]


def test_concat_block_output_is_a_depth_and_its_inner_tensors_are_not():
    # a fire block: squeeze 1x1 -> (expand 1x1 | expand 3x3) -> concat, then a 3x3 conv
    nodes = [_conv("x", "w0", "c0"), helper.make_node("Relu", ["c0"], ["s"]),
             _conv("s", "e1", "x1", pad=0), _conv("s", "e3", "x3"),
             helper.make_node("Concat", ["x1", "x3"], ["cat"], axis=1), helper.make_node("Relu", ["cat"], ["fire"]),
             _conv("fire", "w5", "c5"), helper.make_node("Relu", ["c5"], ["r5"]),
             helper.make_node("GlobalAveragePool", ["r5"], ["p"]), helper.make_node("Flatten", ["p"], ["f"]),
             helper.make_node("Gemm", ["f", "wf", "bf"], ["y"], transB=1)]
    model = _model(nodes, {"w0": _w(2, 4, 3, 3), "e1": _w(2, 2, 1, 1, seed=1), "e3": _w(2, 2, 3, 3, seed=2),
                           "w5": _w(4, 4, 3, 3, seed=3), "wf": _w(CLASSES, 4, seed=4), "bf": _w(CLASSES, seed=5)})
    cuts = depth_cuts(model, "p", 8)
    assert [(c.tensor, c.kind, c.shape) for c in cuts] == [("fire", "concat", (1, 4, 8, 8))]  # through its relu
    cost = depth_costs(model, "fire")
    assert cost["tail_macs"] == (4 * 8 * 8) * (4 * 9) + CLASSES * 4  # transB: weight (out, in)
    assert cost["prefix_macs"] == (2 * 64) * (4 * 9) + (2 * 64) * 2 + (2 * 64) * (2 * 9)
    assert cost["tail_params"] == 4 * 4 * 9 + 4 * CLASSES + CLASSES
