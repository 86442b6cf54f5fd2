"""Keeping a multi-depth bundle's int8 prefixes true to its parameters.

In a multi-depth bundle (bundle.py) head.params holds the fp32 parameters of the deepest
tail, and some of them are frozen inside the shallower depths' int8 prefixes. When a
federated round changes them (devices trained at depth k), the prefixes of the depths
above k -- and backbone.onnx's copies of those weights -- no longer match the model the
version describes. A coordinator building such a version calls `refresh_prefixes`: it
re-quantises exactly the prefixes whose frozen weights changed, from the fp32 backbone
with the new values (initialisers share the parameters' names: the tails were imported
from the same ONNX), on the bundle's stored calibration samples. A prefix left as it was
keeps its bytes, so a device's cached engine choice for it stays valid.

backbone.onnx itself stays the root's (megabytes a device need not fetch again every
round): head.params is the authority, and `Bundle.onnx_bytes()` gives the fp32 backbone
with its values (`patched_backbone`).

Needs onnx (the coordinator has it, and so does a device that checks engine agreement).
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import numpy as np

from .bundle import (
    BACKBONE_INT8,
    BACKBONE_ONNX,
    CALIBRATION,
    HEAD_SYMBOL,
    ORACLE,
    BundleError,
    Manifest,
    depth_file,
    symbol_variables,
)


def with_parameters(onnx_bytes: bytes, params: Mapping[str, np.ndarray]) -> tuple[bytes, set[str]]:
    """backbone.onnx with every initialiser named in `params` set to its value; returns the
    new bytes and the names whose values changed."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load_from_string(onnx_bytes)
    changed: set[str] = set()
    for init in model.graph.initializer:
        if init.name not in params:
            continue
        old = numpy_helper.to_array(init)
        new = np.asarray(params[init.name], dtype=old.dtype)
        if new.shape != old.shape:
            raise BundleError(f"parameter {init.name}: shape {new.shape}, the backbone's is {old.shape}")
        if not np.array_equal(new, old):
            init.CopyFrom(numpy_helper.from_array(new, init.name))
            changed.add(init.name)
    return (model.SerializeToString() if changed else onnx_bytes), changed


def refresh_prefixes(files: dict[str, bytes], manifest: Manifest, params: Mapping[str, np.ndarray]) -> list[str]:
    """Update `files` (the root bundle's, by name) for the version's `params` (bare names):
    every int8 prefix that freezes a weight changed since the root. Returns the names of
    the files rewritten (empty for a head-only bundle or a change in the head only)."""
    if not manifest.depths:
        return []
    onnx_bytes, changed = with_parameters(files[BACKBONE_ONNX], params)
    if not changed:
        return []
    from .bundle_create import CALIBRATION_BATCH, backbone_corrections
    from .onnx_import import import_onnx
    from .quantize import calibrate, quantize_graph
    from .tflite_reader import read_tflite
    from .tflite_writer import write_tflite

    rewritten = []
    calib = np.load(io.BytesIO(files[CALIBRATION]), allow_pickle=False)["x"]
    method = str(manifest.extra.get("quantisation", "minmax"))
    # corrected as the root was made (a root from before 2026-12-07 records nothing: uncorrected)
    corrections = None if manifest.extra.get("bias_correction") is True else {}
    for depth in manifest.depths:
        trained_here = symbol_variables(files[depth_file(depth.depth, HEAD_SYMBOL)])
        if not changed - trained_here:
            continue  # every changed weight is in this depth's fp32 tail: its prefix is as it was
        if corrections is None:  # measured on the whole backbone, as create_bundle does
            backbone = import_onnx(onnx_bytes, split=manifest.split_tensor)
            corrections = backbone_corrections(
                backbone, calib, calibrate(backbone, calib, method=method, batch_size=CALIBRATION_BATCH))
            del backbone
        graph = import_onnx(onnx_bytes, split=depth.tensor)
        tflite = write_tflite(quantize_graph(graph, calib, method=method, corrections=corrections))
        read_tflite(tflite)
        name = depth_file(depth.depth, BACKBONE_INT8)
        files[name] = tflite
        files.pop(depth_file(depth.depth, ORACLE), None)  # another prefix's answers: a device computes its own
        rewritten.append(name)
    return rewritten


def patched_backbone(bundle: Any) -> bytes:
    """A bundle's backbone.onnx with its head.params values: the fp32 model the bundle's
    parameters describe (a device's agreement check compares engines against it)."""
    from .bundle import bundle_params

    raw = bundle.read(BACKBONE_ONNX)
    if not bundle.manifest.depths:
        return raw
    return with_parameters(raw, bundle_params(bundle)[0])[0]
