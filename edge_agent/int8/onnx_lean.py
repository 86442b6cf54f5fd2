"""ONNX shape inference without a second copy of the weights.

`onnx.shape_inference.infer_shapes` returns a new ModelProto: every initialiser copied. For
a 94 MB resnet50 that is 94 MB more for each caller that only wants the value_info
(cut_points' shapes, onnx.utils.Extractor's boundary tensors), and `model create` held two
such copies beside the model (issue 41: create must peak at 2x the file + a fixed allowance).

Inference reads an initialiser's *values* only where an op's output shape depends on them
(Reshape's shape, Slice's starts, Resize's scales, ReduceMean's axes...): small tensors.
So inference runs on a skeleton: the model with every initialiser larger than
SHAPE_ONLY_BYTES replaced by its name, type and dims, and no data.

Only the ONNX paths import this module (inside their functions), so it may import onnx at
its top: 32-bit ARM, which has no onnx wheel, never loads it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import onnx
import onnx.utils

SHAPE_ONLY_BYTES = 4096  # initialisers above this go to inference as shape and type only


def _copy_fields(src: Any, dst: Any, skip: str) -> None:
    """Every set field of message `src` but `skip`, into `dst`."""
    for field, value in src.ListFields():
        if field.name == skip:
            continue
        if hasattr(value, "extend"):  # a repeated field
            getattr(dst, field.name).extend(value)
        elif hasattr(value, "CopyFrom"):  # a message
            getattr(dst, field.name).CopyFrom(value)
        else:
            setattr(dst, field.name, value)


def _add_lean(initializers: Any, init: Any) -> None:
    """`init` appended to repeated field `initializers`, without its data when it is large."""
    if init.ByteSize() <= SHAPE_ONLY_BYTES:
        initializers.add().CopyFrom(init)
        return
    lean = initializers.add()
    lean.name, lean.data_type = init.name, init.data_type
    lean.dims.extend(init.dims)


def _skeleton(model: Any) -> Any:
    """`model` with its large initialisers' data left out (see the module doc)."""
    skeleton = onnx.ModelProto()
    _copy_fields(model, skeleton, "graph")
    _copy_fields(model.graph, skeleton.graph, "initializer")
    for init in model.graph.initializer:
        _add_lean(skeleton.graph.initializer, init)
    return skeleton


def inferred_skeleton(model: Any, **options: Any) -> Any:
    """onnx.shape_inference.infer_shapes(model, **options) on the skeleton: the value_info
    (and inputs, outputs, nodes) of full inference, without the large initialisers' data."""
    return onnx.shape_inference.infer_shapes(_skeleton(model), **options)


class LeanExtractor(onnx.utils.Extractor):
    """onnx.utils.Extractor(model), but its graph (nodes, inputs, outputs, value_info) is the
    inferred skeleton's, its initialisers are `model`'s own, and each sub-model it extracts
    copies them once (onnx's make_graph + make_model copy them twice: a resnet50 backbone's
    extraction peaked 2 x 94 MB above the model)."""

    def __init__(self, model: Any) -> None:  # not onnx's: no inference on the full model, no copy
        inferred = inferred_skeleton(model)
        self.model, self.graph = inferred, inferred.graph
        self.wmap = {t.name: t for t in model.graph.initializer}
        self.vimap = {v.name: v for v in inferred.graph.value_info}

    def _make_model(self, nodes: Any, inputs: Any, outputs: Any, initializer: Any, value_info: Any,
                    local_functions: Any) -> Any:
        """What onnx.utils.Extractor._make_model builds, field for field, in one copy."""
        out = onnx.ModelProto()
        out.ir_version = self.model.ir_version
        graph = out.graph
        graph.node.extend(nodes)
        graph.name = "Extracted from {" + self.graph.name + "}"
        graph.input.extend(inputs)
        graph.output.extend(outputs)
        graph.initializer.extend(initializer)
        graph.value_info.extend(value_info)
        out.opset_import.extend(self.model.opset_import)
        out.functions.extend(local_functions)
        out.producer_name = "onnx.utils.extract_model"
        return out

    def _without_initialisers(self, input_names: list[str], output_names: list[str]) -> tuple[Any, list[Any]]:
        """(extract_model's sub-model without its initialisers, those initialisers: the model's own)."""
        nodes = self._collect_reachable_nodes(input_names, output_names)
        initializer, value_info = self._collect_reachable_tensors(nodes)
        return self._make_model(nodes, self._collect_new_inputs(input_names), self._collect_new_outputs(output_names),
                                [], value_info, self._collect_referred_local_functions(nodes)), initializer

    def extract_serialized(self, input_names: list[str], output_names: list[str]) -> Iterator[bytes]:
        """The serialisation of extract_model(input_names, output_names), in chunks, without
        the sub-model or its serialisation ever whole in memory (resnet50's backbone: 2 x 94 MB).

        The first chunk is the sub-model without initialisers, then one ModelProto per
        initialiser that holds only it: a protobuf parser merges an embedded message met twice
        and appends a repeated field's elements, so the concatenation parses to the same model
        (its bytes differ from SerializeToString's only in where the initialisers sit)."""
        model, initializer = self._without_initialisers(input_names, output_names)
        yield model.SerializeToString()
        for tensor in initializer:
            one = onnx.ModelProto()
            one.graph.initializer.add().CopyFrom(tensor)
            yield one.SerializeToString()

    def extract_skeleton(self, input_names: list[str], output_names: list[str]) -> Any:
        """extract_model(input_names, output_names) with its large initialisers' data left
        out: the caller reads them from `self.wmap` (the model's own), not from a copy."""
        model, initializer = self._without_initialisers(input_names, output_names)
        for init in initializer:
            _add_lean(model.graph.initializer, init)
        return model
