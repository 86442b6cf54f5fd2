"""The fine-tune job's adaptation below the cut: whether the device's images are far enough
from the bundle's to re-estimate the prefix's normalisation statistics on them
(int8/adapt_norm.py), and the adapted int8 prefix, cached per prefix and data.

`--adapt auto` (the default) adapts when the shift measured at the prefix's first
normalised layers is at least ADAPT_SHIFT; `bn` always adapts, `none` never does. The
adapted prefix is the device's own: its update to the fleet is the tail, trained on
features that the adaptation has brought back to the statistics the fleet's tail expects
(normalisation stays local, as in FedBN, Li et al. 2021).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic import atomic_write_bytes
from ..errors import UsageError

log = logging.getLogger(__name__)

ADAPT_CHOICES = ("auto", "bn", "none")
# Measured on camera digits (MobileNetV2 w0.5, 96x96): the bundle's own calibration images
# 0.05, a device's field camera 0.56, a strongly shifted camera (blur, gamma, tint) 0.69.
ADAPT_SHIFT = 0.25
ADAPTED_DIR = "adapted-prefixes"
ADAPT_FORMAT = 1  # bump when the adaptation's arithmetic changes: cached prefixes are remade
KEEP_ADAPTED = 4  # cached adapted prefixes kept (newest first); one per data set and version


@dataclass
class Adaptation:
    kind: str  # "bn" (statistics re-estimated, prefix re-quantised) | "none"
    requested: str
    reason: str
    shift: dict[str, Any] | None = None
    prefix: Path | None = None
    prefix_sha256: str | None = None
    cached: bool = False
    cpu_s: float = 0.0
    validation: dict[str, Any] | None = None  # auto's evidence: the bundle's tail through both prefixes

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "requested": self.requested, "reason": self.reason, "shift": self.shift,
                "prefix": str(self.prefix) if self.prefix else None, "prefix_sha256": self.prefix_sha256,
                "cached": self.cached, "cpu_s": round(self.cpu_s, 3), "validation": self.validation}


def parse_adapt(value: Any) -> str:
    if value not in ADAPT_CHOICES:
        raise UsageError(f"adapt: expected one of {', '.join(ADAPT_CHOICES)}, got {value!r:.40}")
    return str(value)


def cached_prefix(root: Path, view: Any, hashes: Sequence[str]) -> Path:
    """Where the prefix of `view` adapted to the images `hashes` is (or will be) cached."""
    from ..int8.bundle import BACKBONE_INT8

    key = hashlib.sha256()
    key.update(f"{ADAPT_FORMAT}:{view.sha256}:{view.manifest.files[BACKBONE_INT8].sha256}:".encode())
    for h in hashes:
        key.update(h.encode())
    return root / ADAPTED_DIR / f"{key.hexdigest()[:40]}.tflite"


def _prune(directory: Path, keep: Path) -> None:
    entries = sorted(directory.glob("*.tflite"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in [p for p in entries if p != keep][KEEP_ADAPTED - 1:]:
        old.unlink(missing_ok=True)


@dataclass(frozen=True)
class DeviceShift:
    """What `device_shift` found before the depth is planned: the shift, or why there is none."""

    report: Any  # adapt_norm.ShiftReport | None
    note: str = ""  # why adaptation is not possible ("" when it is)

    @property
    def far(self) -> bool:
        return self.report is not None and self.report.distance >= ADAPT_SHIFT


def device_shift(bundle: Any, images: np.ndarray, request: str) -> DeviceShift:
    """The shift of the device's images at the prefix's first normalised layers (the same for
    every depth: the prefixes share their start). The planner reads it: a device far from
    the bundle's data trains deeper (depth_plan.py)."""
    from ..int8.adapt_norm import measure_shift, normalised_layers

    if request == "none":
        return DeviceShift(None, "not asked (--adapt none)")
    try:
        from ..int8.onnx_import import import_onnx

        graph = import_onnx(bundle.onnx_bytes(), split=bundle.manifest.split_tensor)
    except ImportError as exc:  # 32-bit Raspberry Pi OS has no onnx wheel
        if request == "bn":
            raise UsageError(f"--adapt bn: needs the onnx package ({exc})") from None
        return DeviceShift(None, f"onnx is not installed ({exc.name})")
    if not normalised_layers(graph):
        if request == "bn":
            raise UsageError("--adapt bn: the bundle's int8 prefix has no BatchNorm to re-estimate")
        return DeviceShift(None, "the prefix has no BatchNorm")
    return DeviceShift(measure_shift(graph, images))


def adapt_prefix(view: Any, images: np.ndarray, hashes: Sequence[str], request: str, cache_root: Path,
                 shift: DeviceShift) -> tuple[Any, Adaptation]:
    """The bundle view the job's features come from (`view` itself, or with the adapted int8
    prefix) and what was decided. `images`: the training images as the model takes them;
    `hashes`: theirs (the cache's key); `shift`: `device_shift`'s finding."""
    from ..int8.adapt_norm import adapted_view, quantised_prefix
    from ..int8.bundle import BACKBONE_INT8

    start = time.process_time()
    if shift.report is None:
        return view, Adaptation("none", request, shift.note)
    summary = shift.report.to_json()
    if request == "auto" and not shift.far:
        return view, Adaptation("none", request, f"the device's images are close to the bundle's (shift "
                                f"{shift.report.distance:.2f} < {ADAPT_SHIFT})", summary)
    path = cached_prefix(cache_root, view, hashes)
    cached = path.is_file()
    if not cached:
        from ..int8.onnx_import import import_onnx

        graph = import_onnx(view.onnx_bytes(), split=view.manifest.split_tensor)
        tflite = quantised_prefix(graph, images, method=str(view.manifest.extra.get("quantisation", "minmax")))
        atomic_write_bytes(path, tflite)
        _prune(path.parent, path)
    adapted = adapted_view(view, path)
    why = "asked for (--adapt bn)" if request == "bn" else f"shift {shift.report.distance:.2f} >= {ADAPT_SHIFT}"
    log.info("prefix adapted to the device's images: %s", why)
    return adapted, Adaptation("bn", request, why, summary, path, adapted.manifest.files[BACKBONE_INT8].sha256,
                               cached, time.process_time() - start)


def _loss_and_accuracy(runner: Any, logits: Any, x: np.ndarray, y: np.ndarray, batch: int = 64) -> tuple[float, float]:
    out = np.concatenate([np.asarray(logits(runner.run(x[i:i + batch])), np.float64).reshape(min(batch, len(x) - i), -1)
                          for i in range(0, len(x), batch)])
    from .dense_head import softmax_loss

    loss, _ = softmax_loss(out, y, np.ones(out.shape[1], np.float32))  # the trainer's own cross-entropy
    return loss, float((out.argmax(axis=1) == y).mean())


def judge_on_validation(adaptation: Adaptation, base: Any, adapted: Any, logits: Any, x: np.ndarray,
                        y: np.ndarray) -> bool:
    """Evidence for `--adapt auto`: the bundle's own tail on the validation split, through
    the bundle's prefix and through the adapted one. Adapting is kept only when it lowers the
    validation loss: statistics re-estimated on label-skewed data can move a layer for the
    classes the device sees, not for its camera (digits: 0.82 -> 0.72 on one device)."""
    if logits is None or not len(y):
        adaptation.reason += "; no numpy tail or no validation samples to judge it on"
        return True
    y = np.asarray(y, np.int64)
    (loss0, acc0), (loss1, acc1) = (_loss_and_accuracy(r, logits, x, y) for r in (base, adapted))
    adaptation.validation = {"loss": [round(loss0, 4), round(loss1, 4)], "accuracy": [round(acc0, 4), round(acc1, 4)],
                             "samples": int(len(y))}
    keep = loss1 < loss0
    adaptation.reason += (f"; validation loss {loss0:.3f} -> {loss1:.3f} ({'kept' if keep else 'not kept'}: "
                          f"accuracy {acc0:.3f} -> {acc1:.3f} on {len(y)} samples)")
    if not keep:
        adaptation.kind, adaptation.prefix, adaptation.prefix_sha256 = "none", None, None
    return keep


def choose_runner(adaptation: Adaptation, bundle: Any, adapted: Any, runner: Any, selection: Any, train: Any,
                  val: Any, logits: Any, threads: int) -> tuple[Any, Any]:
    """The view and the runner the job's features come from, once the prefix is adapted:
    the selected engine re-checked on the adapted prefix (int8/adapt_norm.prepare_adapted)
    and, under `--adapt auto`, kept only if the validation split says so; else the bundle's
    own prefix on `runner`, the one the selection prepared. The runner not kept is closed."""
    from ..int8.adapt_norm import prepare_adapted

    adapted_runner, why = prepare_adapted(adapted, selection, train.x, threads)
    if adapted_runner is None:  # the bundle's own prefix, as chosen
        adaptation.kind, adaptation.reason, adaptation.prefix, adaptation.prefix_sha256 = "none", why, None, None
        return bundle, runner
    if adaptation.requested == "auto" and not judge_on_validation(adaptation, runner, adapted_runner, logits,
                                                                   val.x, val.y):
        adapted_runner.close()
        return bundle, runner
    runner.close()
    return adapted, adapted_runner

