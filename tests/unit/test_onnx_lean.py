"""onnx_lean: shape inference and sub-model extraction without a copy of the weights give
what onnx's own give (the committed torchvision fixtures: both exporters, ShuffleNet's
Shape arithmetic, an external-data model)."""

from __future__ import annotations

import json

import onnx
import onnx.utils
import pytest

from edge_agent.int8.onnx_import import load_onnx
from edge_agent.int8.onnx_lean import SHAPE_ONLY_BYTES, LeanExtractor, inferred_skeleton
from tests.fixtures.models import zoo

FIXTURES = {r["file"]: r["split"] for r in json.loads((zoo.HERE / "fixtures.json").read_text())["models"]}
CASES = ["resnet18.dynamo.onnx", "mobilenet_v3_small.dynamo.onnx", "shufflenet_v2_x0_5.legacy.onnx",
         "squeezenet1_1.legacy.onnx"]


def _by_name(infos) -> dict[str, bytes]:
    return {v.name: v.SerializeToString() for v in infos}


@pytest.mark.parametrize("name", CASES)
def test_the_skeletons_inference_is_onnxs(name: str) -> None:
    model = load_onnx(zoo.HERE / name)
    full, lean = onnx.shape_inference.infer_shapes(model), inferred_skeleton(model)
    assert _by_name(lean.graph.value_info) == _by_name(full.graph.value_info)
    assert _by_name(lean.graph.output) == _by_name(full.graph.output)
    # and it really left the weights out
    big = [t for t in model.graph.initializer if t.ByteSize() > SHAPE_ONLY_BYTES]
    assert big and lean.ByteSize() < model.ByteSize() - sum(t.ByteSize() for t in big) // 2


@pytest.mark.parametrize("name", CASES)
def test_the_lean_extractor_extracts_what_onnxs_does(name: str) -> None:
    model = load_onnx(zoo.HERE / name)
    inp = model.graph.input[0].name
    split, outputs = FIXTURES[name], [o.name for o in model.graph.output]
    split_tensor = next(n.output[0] for n in model.graph.node if n.name == split)
    stock, lean = onnx.utils.Extractor(model), LeanExtractor(model)
    for ins, outs in (([inp], [split_tensor]), ([split_tensor], outputs)):
        want, got = stock.extract_model(ins, outs), lean.extract_model(ins, outs)
        assert got.SerializeToString() == want.SerializeToString(), (ins, outs)


@pytest.mark.parametrize("name", CASES)
def test_a_sub_model_written_in_chunks_parses_to_the_extracted_one(name: str) -> None:
    model = load_onnx(zoo.HERE / name)
    inp = model.graph.input[0].name
    split_tensor = next(n.output[0] for n in model.graph.node if n.name == FIXTURES[name])
    lean = LeanExtractor(model)
    chunks = list(lean.extract_serialized([inp], [split_tensor]))
    want = lean.extract_model([inp], [split_tensor])
    inits = want.graph.initializer
    assert len(chunks) == 1 + len(inits) and len(chunks[0]) < want.ByteSize() - sum(t.ByteSize() for t in inits)
    assert all(len(c) <= t.ByteSize() + 16 for c, t in zip(chunks[1:], inits, strict=True))  # one tensor each
    assert onnx.load_from_string(b"".join(chunks)) == want


@pytest.mark.parametrize("name", CASES)
def test_a_skeleton_sub_model_leaves_out_only_the_large_initialisers_data(name: str) -> None:
    model = load_onnx(zoo.HERE / name)
    outputs = [o.name for o in model.graph.output]
    split_tensor = next(n.output[0] for n in model.graph.node if n.name == FIXTURES[name])
    lean = LeanExtractor(model)
    full, skeleton = lean.extract_model([split_tensor], outputs), lean.extract_skeleton([split_tensor], outputs)
    assert [(t.name, list(t.dims), t.data_type) for t in skeleton.graph.initializer] == \
           [(t.name, list(t.dims), t.data_type) for t in full.graph.initializer]
    for got, want in zip(skeleton.graph.initializer, full.graph.initializer, strict=True):
        small = want.ByteSize() <= SHAPE_ONLY_BYTES
        assert (got == want) if small else (not got.raw_data and got.ByteSize() < 200), got.name
    assert skeleton.graph.node == full.graph.node and skeleton.graph.value_info == full.graph.value_info
