"""What MXNet 1.9's ONNX importer (mxnet.contrib.onnx) needs beyond bundle_create's
`_mxnet_compatible`, and an import that names the node it fails on.

- `constants_as_initializers`: the importer has no `Constant` op (a KeyError naming the
  Constant's output); torch's legacy exporter writes Reshape targets that way (ShuffleNet).
- `axes_as_attributes`: opset 18 moved Reduce* axes from an attribute to an input; the
  importer passes that input on as MXNet's `axis` parameter and MXNet fails with "Invalid
  Parameter format for axis ... value='<Symbol val_5>'" (torch's dynamo exporter writes
  squeezenet's global mean that way). A constant axes input becomes the attribute again:
  the importer reads attributes whatever the opset says (opset 18's noop_with_empty_axes=0,
  the default, is dropped: MXNet refuses an argument it does not know).
- `slices_as_gathers`: the importer's Slice (opset >= 10) passes its constant bounds on as
  float parameters, which MXNet's slice_axis refuses ("expect int or None but value='24.0'").
  A Slice along one axis with constant bounds is a Gather of those indices (MXNet's `take`),
  its range clamped with the input's inferred shape (ShuffleNet v2's channel split).
- `import_naming_node`: mxnet.contrib.onnx.import_model, with any failure re-raised as an
  MXNetImportError that says which node (and op) the importer stopped at.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - typing only
    import onnx

REDUCE_OPS = ("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL2")


class MXNetImportError(ValueError):
    """MXNet's ONNX importer failed on a node: the message names the node and its op."""

    def __init__(self, node: str, op: str, why: str) -> None:
        super().__init__(f"node {node!r} (op {op}): {why}")
        self.node, self.op = node, op


def constants_as_initializers(model: onnx.ModelProto) -> None:
    """Each `Constant` node (with a tensor `value`) becomes an initializer of its output."""
    from onnx import helper, numpy_helper

    keep = []
    for node in model.graph.node:
        value = next((a for a in node.attribute if a.name == "value"), None)
        if node.op_type == "Constant" and value is not None:
            tensor = numpy_helper.from_array(numpy_helper.to_array(helper.get_attribute_value(value)), node.output[0])
            model.graph.initializer.append(tensor)
        else:
            keep.append(node)
    if len(keep) != len(model.graph.node):
        del model.graph.node[:]
        model.graph.node.extend(keep)


def axes_as_attributes(model: onnx.ModelProto) -> None:
    """Reduce* nodes whose axes input is a constant initializer get it as an attribute."""
    from onnx import helper, numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type in REDUCE_OPS and len(node.input) > 1 and node.input[1] in inits \
                and not any(a.name == "axes" for a in node.attribute):
            axes = [int(v) for v in numpy_helper.to_array(inits[node.input[1]]).reshape(-1)]
            del node.input[1:]
            node.attribute.append(helper.make_attribute("axes", axes))
            noop = [a for a in node.attribute if a.name == "noop_with_empty_axes"]
            if noop and not noop[0].i:  # its default (0), and an argument MXNet does not know
                node.attribute.remove(noop[0])


def slices_as_gathers(model: onnx.ModelProto) -> None:
    """Single-axis Slices with initializer bounds (and a statically known input shape)
    become Gathers of the selected indices."""
    import numpy as np
    from onnx import helper, numpy_helper

    from .onnx_lean import inferred_skeleton

    inits = {i.name: i for i in model.graph.initializer}

    def const(node: onnx.NodeProto, k: int) -> Any:
        if k >= len(node.input) or not node.input[k]:
            return None
        return numpy_helper.to_array(inits[node.input[k]]).reshape(-1) if node.input[k] in inits else False

    slices = [n for n in model.graph.node if n.op_type == "Slice" and len(n.input) >= 3]
    if not slices:
        return
    try:
        inferred = inferred_skeleton(model)
    except Exception:  # shapes unknown: the Slices stay (and MXNet says which one fails)
        return
    shapes = {}
    for vi in [*inferred.graph.input, *inferred.graph.value_info]:
        dims = vi.type.tensor_type.shape.dim
        if all(d.HasField("dim_value") for d in dims):
            shapes[vi.name] = [int(d.dim_value) for d in dims]
    for node in slices:
        starts, ends, axes, steps = (const(node, k) for k in range(1, 5))
        shape = shapes.get(node.input[0])
        if any(v is False for v in (starts, ends, axes, steps)) or shape is None or len(starts) != 1:
            continue
        axis = int(axes[0]) % len(shape) if axes is not None else 0
        step = int(steps[0]) if steps is not None else 1
        indices = np.arange(shape[axis])[slice(int(starts[0]), int(ends[0]), step)].astype(np.int64)
        name = f"{node.output[0]}__indices"
        model.graph.initializer.append(numpy_helper.from_array(indices, name))
        gather = helper.make_node("Gather", [node.input[0], name], list(node.output), name=node.name, axis=axis)
        node.CopyFrom(gather)


def import_naming_node(model: onnx.ModelProto) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """mxnet.contrib.onnx.import_model on an in-memory model; a failure names its node.

    The same conversion as MXNet 1.9.1's GraphProto.from_onnx (its own per-op translators),
    except that parameters are collected once from the final symbol: MXNet collects them
    after every node from the symbol so far, copying each parameter once per later node
    (99,000 copies for a ShuffleNet head; 2 s of the 2.2 s an import took). The result is
    the same: the arguments of the output symbol that are initializers."""
    from mxnet import ndarray as nd
    from mxnet import symbol
    from mxnet.contrib.onnx.onnx2mx.import_onnx import GraphProto

    graph = GraphProto()
    graph.opset_version = max(o.version for o in model.opset_import)
    g = model.graph
    node = None
    try:
        graph.model_metadata = graph.get_graph_metadata(g)
        for init in g.initializer:
            graph._params[init.name] = graph._parse_array(init)  # noqa: SLF001 - the importer's own state
        for i in g.input:
            shape = {"shape": graph._params[i.name].shape} if i.name in graph._params else {}  # noqa: SLF001
            graph._nodes[i.name] = symbol.Variable(name=i.name, **shape)  # noqa: SLF001
        for node in g.node:
            inputs = [graph._nodes[i] for i in node.input]  # noqa: SLF001
            sym = graph._convert_operator(node.name.strip() or None, node.op_type,  # noqa: SLF001
                                          graph._parse_attr(node.attribute), inputs)  # noqa: SLF001
            for k, out in zip(list(node.output), range(len(sym.list_outputs())), strict=False):
                graph._nodes[k] = sym[out]  # noqa: SLF001
        node = None
        outs = [graph._nodes[o.name] for o in g.output]  # noqa: SLF001
    except Exception as exc:  # the importer raises bare KeyError / AttributeError / MXNetError per op
        if node is None:
            raise
        why = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"
        name = node.name or (node.output[0] if node.output else node.op_type)
        raise MXNetImportError(name, node.op_type, why) from None
    out = symbol.Group(outs) if len(outs) > 1 else outs[0]
    params = graph._params  # noqa: SLF001
    args = {a: nd.array(params[a]) for a in out.list_arguments() if a in params}
    aux = {a: nd.array(params[a]) for a in out.list_auxiliary_states() if a in params}
    return out, args, aux
