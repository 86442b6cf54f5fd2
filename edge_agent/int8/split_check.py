"""Would `model create` accept this split point? The checks create_bundle runs on a split
before any quantisation, run the same way (its own functions, its own error wrapping), so
`model nodes` can mark each candidate and the two never disagree:

1. the split resolves to a tensor that is not the model's output (`_resolve_split`);
2. the backbone up to it imports into a float graph (`import_onnx`; an UnsupportedOpError
   becomes the same BundleError text create prints: "backbone up to T: node N: op O ...");
3. every op of that float graph is one the int8 TFLite writer carries;
4. ONNX shape inference of the whole model passes (create's `onnx.utils.Extractor`);
5. the head after the split imports into MXNet, has parameters, and takes the backbone's
   output (`_head`; the class count is not checked: it depends on the labels given, not
   on the split). Skipped, and said so, where MXNet is not installed.

Quantisation itself (calibration data) is not run: it is what makes create slow, and it
refuses only what step 3 already refuses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import InputError
from .graph import UnsupportedOpError

if TYPE_CHECKING:  # pragma: no cover - typing only
    import onnx


@dataclass(frozen=True)
class SplitVerdict:
    """accepted: create would get past every split check; reason: why not (create's own
    message), else None; head_checked: False where MXNet was not there to check the head."""

    accepted: bool
    reason: str | None
    head_checked: bool = True

    def to_json(self) -> dict[str, Any]:
        return {"accepted": self.accepted, "reason": self.reason, "head_checked": self.head_checked}


class SplitChecker:
    """Checks split points of one model; the model-wide steps (shape inference, MXNet's
    availability) run once, then each split costs one float import and one head import."""

    def __init__(self, model: onnx.ModelProto, where: str) -> None:
        self.model, self.where = model, where
        self._extractor: Any = None
        self._extract_error: str | None = None
        self._mxnet: bool | None = None

    def _extract(self) -> Any:
        if self._extractor is None and self._extract_error is None:
            from .bundle_create import BundleError
            from .onnx_lean import LeanExtractor

            try:
                self._extractor = LeanExtractor(self.model)  # the shape inference create runs
            except Exception as exc:  # onnx InferenceError names the op and node
                self._extract_error = str(BundleError(
                    f"{self.where}: ONNX shape inference fails: {str(exc).strip()[:300]}"))
        return self._extractor

    def _has_mxnet(self) -> bool:
        if self._mxnet is None:
            try:
                import mxnet  # noqa: F401 - only whether it loads
                self._mxnet = True
            except Exception:  # ImportError, or the library failing to load
                self._mxnet = False
        return self._mxnet

    def check(self, split: str) -> SplitVerdict:
        from .bundle_create import BundleError, _head, _resolve_split
        from .onnx_import import import_onnx
        from .tflite_writer import OPS

        try:
            tensor, _ = _resolve_split(self.model, split, None, self.where)
            try:
                graph = import_onnx(self.model, split=tensor)
            except UnsupportedOpError as exc:  # create_bundle's own wrapping
                raise BundleError(f"{self.where}: backbone up to {tensor!r}: {exc}") from None
            for op in graph.ops:
                if op.kind not in OPS:
                    raise BundleError(f"{self.where}: cannot quantise the backbone: node {op.name!r}: op "
                                      f"{op.kind!r} is not carried by the int8 TFLite writer")
            extractor = self._extract()
            if extractor is None:
                raise BundleError(self._extract_error or "shape inference fails")
            if not self._has_mxnet():
                return SplitVerdict(True, None, head_checked=False)
            classes = _head_classes(self.model)
            labels = [str(i) for i in range(classes)] if classes else []
            try:
                _head(extractor, self.model, tensor, tuple(graph.output_shape), labels, self.where)
            except InputError as exc:
                if classes is None and "classes but" in str(exc):  # the labels' count: not the split's
                    return SplitVerdict(True, None)
                raise
        except (InputError, ValueError) as exc:
            return SplitVerdict(False, str(exc))
        except Exception as exc:  # create would fail here too; a listing never shows a traceback
            return SplitVerdict(False, f"{self.where}: {type(exc).__name__}: {str(exc)[:200]}")
        return SplitVerdict(True, None)


def _head_classes(model: onnx.ModelProto) -> int | None:
    """The model output's class count (product of its non-batch dims), if static."""
    dims = model.graph.output[0].type.tensor_type.shape.dim if model.graph.output else []
    values = [d.dim_value for d in list(dims)[1:]]
    if not dims or not all(values):
        return None
    n = 1
    for v in values:
        n *= int(v)
    return n


def check_split(model: onnx.ModelProto, split: str, where: str = "onnx model") -> SplitVerdict:
    """One split point: would `model create --split SPLIT` get past its split checks?"""
    return SplitChecker(model, where).check(split)
