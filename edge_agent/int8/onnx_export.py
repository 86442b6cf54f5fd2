"""Gluon HybridBlock -> ONNX bytes, through MXNet's own exporter (mxnet.onnx, MXNet 1.9.1).

MXNet's exporter takes a symbol + params, which `HybridBlock.export` writes once the block
is hybridised and has run a forward pass; both go to a private temporary directory.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InputError

_log = logging.getLogger(__name__)


class OnnxExportError(InputError):
    """MXNet could not export the block to ONNX."""


def export_onnx(block: Any, input_shape: Sequence[int]) -> bytes:
    """Export `block` (a Gluon HybridBlock: a backbone or a whole net) as ONNX bytes.

    `input_shape` is the NCHW shape the block takes (batch included, usually 1). The block
    is hybridised in place (a forward pass is needed to build the symbol). The opset is
    the installed onnx's newest (MXNet's exporter has no opset argument).
    """
    import mxnet as mx
    import mxnet.onnx as mx_onnx

    shape = tuple(int(v) for v in input_shape)
    if len(shape) != 4 or min(shape) <= 0:
        raise OnnxExportError(f"input_shape must be a positive NCHW shape, got {shape}")
    if not isinstance(block, mx.gluon.HybridBlock):
        raise OnnxExportError(f"need a Gluon HybridBlock, got {type(block).__name__}")
    block.hybridize()
    block(mx.nd.zeros(shape, dtype="float32"))  # builds the cached graph export() needs
    with tempfile.TemporaryDirectory(prefix="edge-agent-onnx-") as tmp:
        prefix = str(Path(tmp) / "model")
        block.export(prefix, epoch=0)
        target = Path(tmp) / "model.onnx"
        try:
            mx_onnx.export_model(f"{prefix}-symbol.json", f"{prefix}-0000.params",
                                 in_shapes=[shape], in_types=[np.float32],
                                 onnx_file_path=str(target))
        except Exception as exc:  # the exporter raises bare AttributeError etc. per op
            raise OnnxExportError(f"mxnet.onnx.export_model failed: {type(exc).__name__}: {exc}") from exc
        data = target.read_bytes()
    _log.debug("exported %s to ONNX: %d bytes", type(block).__name__, len(data))
    return data
