"""Reading an untrusted ONNX model: the size limit first, then the protobuf parse and
onnx.checker, external data inlined from the model's own directory, an IR version and opset
the pinned onnx reads, constant shape subgraphs folded (onnx_fold.py). Each failure is an
OnnxImportError that says where.

Split from onnx_import.py, which converts what this returns into the float graph.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from ..atomic import FileTooLargeError, read_limited
from ..errors import InputError
from ..heap import release_freed_memory
from .onnx_fold import fold_shapes

if TYPE_CHECKING:  # pragma: no cover - typing only
    import onnx

MAX_ONNX_BYTES = 256 * 1024 * 1024


class OnnxImportError(InputError):
    """An ONNX file or graph the importer refuses (corrupt, truncated, malformed)."""


def load_onnx(source: bytes | str | os.PathLike[str], *, max_bytes: int = MAX_ONNX_BYTES) -> onnx.ModelProto:
    """Parse and check an ONNX model from bytes or a path; size limit enforced first.

    Made readable by the pinned onnx where that is lossless: external-data initializers
    are read from files in the model's own directory and inlined (the bundle is then
    self-contained), an ir_version newer than the checker's is lowered when nothing in the
    model needs it (see `_lower_ir_version`), and an opset outside MIN_OPSET..MAX_OPSET is
    converted with onnx.version_converter (older ones are raised to MIN_OPSET). Shape
    subgraphs that are constant at the model's fixed input size are folded (onnx_fold.py)."""
    import onnx

    if isinstance(source, bytes | bytearray | memoryview):
        where, data, base = "onnx model", bytes(source), None
        if len(data) > max_bytes:
            raise FileTooLargeError(f"{where}: {len(data)} bytes is over the limit of {max_bytes}")
    else:
        where, base = os.fspath(source), Path(os.fspath(source)).parent
        try:
            data = read_limited(source, max_bytes)
        except OSError as exc:
            raise OnnxImportError(f"{where}: cannot read: {exc.strerror or exc}") from None
    if not data:
        raise OnnxImportError(f"{where}: empty file")
    try:
        model = onnx.load_from_string(data)
    except Exception as exc:  # protobuf raises DecodeError, or others on odd input
        raise OnnxImportError(f"{where}: not a valid ONNX protobuf (truncated or corrupt): {exc}") from None
    del data  # not held beside the model while the checker makes its two copies
    _inline_external_data(model, base, where, max_bytes)
    _lower_ir_version(model, where)
    try:
        onnx.checker.check_model(model)
    except Exception as exc:  # onnx.checker.ValidationError and C++ errors
        text = str(exc).strip()
        first = text.splitlines()[0] if text else type(exc).__name__
        ctx = re.search(r"Name: (\S*) OpType: (\S+)", text)  # the checker's context: which node
        if ctx:
            first = f"node {ctx.group(1)!r} (op {ctx.group(2)}): {first}"
        raise OnnxImportError(f"{where}: invalid ONNX model (truncated or corrupt?): {first}") from None
    model = fold_shapes(_convert_opset(model, where))
    release_freed_memory()  # the file's bytes and the checker's copies (2 x the file, kept by malloc)
    return model


# Default-domain opsets taken as they are: the handlers read both spellings where an op
# changed in that range (Clip's min/max, ReduceMean's axes, Pad's pads as attribute or
# input); opsets 19-20 (MXNet's exporter writes 20) changed none of their semantics.
MIN_OPSET, MAX_OPSET = 11, 20
_IR10_TYPES = {21, 22}  # UINT4, INT4: what ir_version 10 added that an importer could meet


def _lower_ir_version(model: onnx.ModelProto, where: str) -> None:
    """torch 2.x's dynamo exporter writes ir_version 10, which onnx 1.15's checker refuses.
    IR 10 only added 4-bit types and function overloads (and UINT4/INT4 tensors), so a
    model using neither is a valid IR 9 model: relabel it; otherwise say what needs 10."""
    import onnx

    if model.ir_version <= onnx.IR_VERSION:
        return
    if model.ir_version > 10:
        raise OnnxImportError(f"{where}: ir_version {model.ir_version} is newer than this onnx "
                              f"({onnx.__version__}) can read (up to {onnx.IR_VERSION}, or 10 lowered)")
    types = {t.data_type for t in model.graph.initializer}
    types |= {vi.type.tensor_type.elem_type for vi in [*model.graph.input, *model.graph.output,
                                                        *model.graph.value_info]}
    if types & _IR10_TYPES or any(getattr(f, "overload", "") for f in model.functions):
        raise OnnxImportError(f"{where}: ir_version 10 with 4-bit tensors or function overloads "
                              f"(onnx {onnx.__version__} reads up to ir_version {onnx.IR_VERSION})")
    model.ir_version = onnx.IR_VERSION


def _convert_opset(model: onnx.ModelProto, where: str) -> onnx.ModelProto:
    """Opsets MIN_OPSET..MAX_OPSET as they are; others through onnx.version_converter."""
    from onnx import version_converter

    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset is None or MIN_OPSET <= opset <= MAX_OPSET:
        return model
    target = MIN_OPSET if opset < MIN_OPSET else MAX_OPSET
    try:
        return version_converter.convert_version(model, target)
    except Exception as exc:  # the converter raises C++ errors per unconvertible op
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise OnnxImportError(f"{where}: opset {opset} could not be converted to {target} "
                              f"(supported: {MIN_OPSET}-{MAX_OPSET}): {first}") from None


def _inline_external_data(model: onnx.ModelProto, base: Path | None, where: str, max_bytes: int) -> None:
    """Read external-data initializers into the model. Only files inside the model's own
    directory (no absolute paths, no `..` or symlink escapes), all of them together within
    `max_bytes`; a missing file, short read or escaping path is an OnnxImportError."""
    import onnx

    external = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    if not external:
        return
    if base is None:
        raise OnnxImportError(f"{where}: initializer {external[0].name!r} uses external data; "
                              "give the model as a file next to its data files")
    root = base.resolve()
    total = 0
    for tensor in external:
        info = {e.key: e.value for e in tensor.external_data}
        loc = info.get("location", "")
        target = (root / loc).resolve()
        if not loc or Path(loc).is_absolute() or not target.is_relative_to(root):
            raise OnnxImportError(f"{where}: initializer {tensor.name!r}: external data location "
                                  f"{loc!r} is not a file inside {root}")
        try:
            offset, length = int(info.get("offset", 0)), int(info["length"]) if "length" in info else None
        except ValueError:
            raise OnnxImportError(f"{where}: initializer {tensor.name!r}: bad external data offset/length") from None
        try:
            size = target.stat().st_size
            length = size - offset if length is None else length
            if offset < 0 or length < 0 or offset + length > size:
                raise OnnxImportError(f"{where}: initializer {tensor.name!r}: {loc} has {size} bytes, "
                                      f"not {offset}+{length}")
            total += length
            if total > max_bytes:
                raise FileTooLargeError(f"{where}: external data over the limit of {max_bytes} bytes")
            with open(target, "rb") as f:
                f.seek(offset)
                raw = f.read(length)
        except OSError as exc:
            raise OnnxImportError(f"{where}: initializer {tensor.name!r}: cannot read external data "
                                  f"{loc!r}: {exc.strerror or exc}") from None
        tensor.raw_data = raw
        del tensor.external_data[:]
        tensor.data_location = onnx.TensorProto.DEFAULT
