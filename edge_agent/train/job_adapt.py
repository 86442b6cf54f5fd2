"""The fine-tune job's adaptation below the cut: whether the device's images are far enough
from the bundle's to re-estimate the prefix's normalisation statistics on them
(int8/adapt_norm.py), and the adapted int8 prefix, cached per prefix and data.

`--adapt auto` (the default) adapts when the shift measured at the prefix's first
normalised layers is at least ADAPT_SHIFT, and keeps the adapted prefix only where the
validation split says so; `bn` always adapts, `none` never does. The adapted prefix is the
device's own: its update to the fleet is the tail, trained on features that the adaptation
has brought back to the statistics the fleet's tail expects (normalisation stays local, as
in FedBN, Li et al. 2021).

auto's verdict is remembered per prefix (a Verdict beside the cached prefixes): while the
device's shift stays within VERDICT_SHIFT_TOLERANCE of the one judged and its data has not
grown by VERDICT_GROWTH, the next job takes the verdict instead of re-estimating every
layer and judging again -- a rejected adaptation is not paid for on every job (textures:
0.56 of a job's 2.3 CPU-s), a kept one serves the prefix it kept -- and after VERDICT_USES
jobs the device judges again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic import atomic_write_bytes
from ..errors import InputError, UsageError

log = logging.getLogger(__name__)

ADAPT_CHOICES = ("auto", "bn", "none")
# Measured on camera digits (MobileNetV2 w0.5, 96x96): the bundle's own calibration images
# 0.05, a device's field camera 0.56, a strongly shifted camera (blur, gamma, tint) 0.69.
ADAPT_SHIFT = 0.25
ADAPTED_DIR = "adapted-prefixes"
ADAPT_FORMAT = 1  # bump when the adaptation's arithmetic changes: cached prefixes are remade
KEEP_ADAPTED = 4  # cached adapted prefixes kept (newest first); one per data set and version
# The shift measured on 70 % subsets of one device's images moves by up to 0.09 around the
# whole set's (textures, 32 images each); another camera moves it by 0.23 (tex-00 0.58,
# through the shifted camera 0.81).
VERDICT_SHIFT_TOLERANCE = 0.1
VERDICT_GROWTH = 1.5  # re-judged once the device's training images grow (or shrink) by this factor
VERDICT_USES = 8  # and after this many jobs took it
MAX_VERDICT_BYTES = 64 << 10
KEEP_VERDICTS = 32  # one per prefix a device trained through (versions x depths)


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
    verdict: Verdict | None = None  # an earlier job's verdict this job took
    judged: bool = False  # this job judged it on its validation split

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "requested": self.requested, "reason": self.reason, "shift": self.shift,
                "prefix": str(self.prefix) if self.prefix else None, "prefix_sha256": self.prefix_sha256,
                "cached": self.cached, "cpu_s": round(self.cpu_s, 3), "validation": self.validation,
                "remembered": self.verdict is not None}


@dataclass(frozen=True)
class Verdict:
    """What validation decided about adapting one prefix on this device, for later jobs."""

    shift: float  # the shift it was judged at
    kept: bool
    images: int  # the training images it was judged on
    prefix: str | None  # the adapted prefix's file name under ADAPTED_DIR, when kept
    validation: dict[str, Any]
    uses: int = 0  # jobs that took it since

    def to_json(self) -> dict[str, Any]:
        return {"shift": self.shift, "kept": self.kept, "images": self.images, "prefix": self.prefix,
                "validation": self.validation, "uses": self.uses}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Verdict:
        """Raises ValueError on anything but a verdict this module wrote."""
        shift, kept, images, prefix, validation, uses = (obj.get(k) for k in (
            "shift", "kept", "images", "prefix", "validation", "uses"))
        if not (isinstance(shift, (int, float)) and isinstance(kept, bool) and isinstance(images, int)
                and isinstance(uses, int) and isinstance(validation, dict) and images >= 0 and uses >= 0):
            raise ValueError("fields missing or of the wrong type")
        loss = validation.get("loss")
        if not (isinstance(loss, list) and len(loss) == 2 and all(isinstance(v, (int, float)) for v in loss)):
            raise ValueError("validation: no pair of losses")
        if prefix is not None and (not isinstance(prefix, str) or Path(prefix).name != prefix
                                   or not prefix.endswith(".tflite")):
            raise ValueError(f"prefix {prefix!r:.60}: not a file name in the cache")
        return cls(float(shift), kept, images, prefix, validation, uses)

    def covers(self, shift: float, images: int) -> bool:
        """Still the evidence for a job at this shift on this many training images."""
        grown = images > self.images * VERDICT_GROWTH or images * VERDICT_GROWTH < self.images
        return abs(shift - self.shift) <= VERDICT_SHIFT_TOLERANCE and not grown and self.uses < VERDICT_USES


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


def verdict_path(root: Path, view: Any) -> Path:
    """Where auto's verdict on adapting `view`'s prefix on this device is remembered."""
    from ..int8.bundle import BACKBONE_INT8

    key = hashlib.sha256(f"{ADAPT_FORMAT}:{view.sha256}:{view.manifest.files[BACKBONE_INT8].sha256}".encode())
    return root / ADAPTED_DIR / f"{key.hexdigest()[:40]}.verdict.json"


def remembered(root: Path, view: Any, shift: DeviceShift, images: int) -> Verdict | None:
    """The earlier verdict on adapting `view` that still covers this job, if any. A verdict
    file that cannot be read is ignored (the job judges again and rewrites it)."""
    from ..atomic import read_json_object

    path = verdict_path(root, view)
    if shift.report is None or not path.is_file():
        return None
    try:
        verdict = Verdict.from_json(read_json_object(path, MAX_VERDICT_BYTES, "adaptation verdict"))
    except (InputError, ValueError) as exc:
        log.warning("%s: ignored, judged again (%s)", path, exc)
        return None
    if not verdict.covers(shift.report.distance, images):
        return None
    if verdict.kept and not (path.parent / str(verdict.prefix)).is_file():  # pruned since
        return None
    return verdict


def will_walk(root: Path, view: Any, shift: DeviceShift, request: str, images: int, hashes: Sequence[str]) -> bool:
    """Whether this job will re-estimate the statistics of `view`'s prefix (the planner's
    cost): not when it does not adapt, takes an earlier verdict, or finds the prefix cached."""
    if shift.report is None or (request == "auto" and not shift.far):
        return False
    if request == "auto" and remembered(root, view, shift, images) is not None:
        return False
    return not cached_prefix(root, view, hashes).is_file()


def remember(root: Path, view: Any, adaptation: Adaptation, images: int) -> None:
    """Record this job's verdict on adapting `view` (a judged auto job), or count one more
    use of the verdict it took; a cache that cannot be written only costs the next job a
    judgement."""
    from ..atomic import atomic_write_json

    earlier, kept = adaptation.verdict, adaptation.kind == "bn"
    if adaptation.judged and adaptation.validation is not None and adaptation.shift is not None:
        if earlier is not None and earlier.kept and kept:  # its prefix judged again, and kept again
            verdict = dataclasses.replace(earlier, uses=earlier.uses + 1, validation=adaptation.validation)
        else:
            verdict = Verdict(float(adaptation.shift["distance"]), kept, images,
                              adaptation.prefix.name if kept and adaptation.prefix is not None else None,
                              adaptation.validation)
    elif earlier is not None:
        verdict = dataclasses.replace(earlier, uses=earlier.uses + 1)
    else:
        return
    path = verdict_path(root, view)
    try:
        atomic_write_json(path, verdict.to_json())
    except OSError as exc:
        log.warning("adaptation verdict not saved: %s", exc)
        return
    _prune(path.parent, path, pattern="*.verdict.json", keep_count=KEEP_VERDICTS)


def _prune(directory: Path, keep: Path, *, pattern: str = "*.tflite", keep_count: int = KEEP_ADAPTED) -> None:
    entries = sorted(directory.glob(pattern), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in [p for p in entries if p != keep][keep_count - 1:]:
        old.unlink(missing_ok=True)


@dataclass(frozen=True)
class DeviceShift:
    """What `device_shift` found before the depth is planned: the shift, or why there is none."""

    report: Any  # adapt_norm.ShiftReport | None
    note: str = ""  # why adaptation is not possible ("" when it is)
    # the parsed fp32 backbone the shift was measured on (onnx.ModelProto, the same for every
    # depth view), for adapt_prefix to cut its depth's prefix from instead of reading and
    # checking the file again (textures: the adapt step's 0.60 -> 0.53-0.58 CPU-s); the job drops it
    # once the prefix is adapted
    backbone: Any = dataclasses.field(default=None, repr=False, compare=False)

    def without_backbone(self) -> DeviceShift:
        return dataclasses.replace(self, backbone=None)

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
        from ..int8.onnx_load import load_onnx

        backbone = load_onnx(bundle.onnx_bytes())
        graph = import_onnx(backbone, split=bundle.manifest.split_tensor)
    except ImportError as exc:  # 32-bit Raspberry Pi OS has no onnx wheel
        if request == "bn":
            raise UsageError(f"--adapt bn: needs the onnx package ({exc})") from None
        return DeviceShift(None, f"onnx is not installed ({exc.name})")
    if not normalised_layers(graph):
        if request == "bn":
            raise UsageError("--adapt bn: the bundle's int8 prefix has no BatchNorm to re-estimate")
        return DeviceShift(None, "the prefix has no BatchNorm")
    return DeviceShift(measure_shift(graph, images), backbone=backbone)


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
    verdict = remembered(cache_root, view, shift, len(images)) if request == "auto" else None
    if verdict is not None and not verdict.kept:
        return view, Adaptation("none", request, (
            f"validation rejected adapting on an earlier job (shift {verdict.shift:.2f}, loss "
            f"{verdict.validation['loss'][0]:.3f} -> {verdict.validation['loss'][1]:.3f}); shift now "
            f"{shift.report.distance:.2f}: "
            "not adapted, not judged again"), summary, validation=verdict.validation, verdict=verdict)
    path = cache_root / ADAPTED_DIR / verdict.prefix if verdict is not None and verdict.prefix else (
        cached_prefix(cache_root, view, hashes))
    cached = path.is_file()
    if not cached:
        from ..int8.onnx_import import import_onnx

        # every depth view's backbone is the bundle's (its file with head.params' values)
        graph = import_onnx(shift.backbone if shift.backbone is not None else view.onnx_bytes(),
                            split=view.manifest.split_tensor)
        tflite = quantised_prefix(graph, images, method=str(view.manifest.extra.get("quantisation", "minmax")))
        atomic_write_bytes(path, tflite)
        _prune(path.parent, path)
    adapted = adapted_view(view, path)
    why = "asked for (--adapt bn)" if request == "bn" else f"shift {shift.report.distance:.2f} >= {ADAPT_SHIFT}"
    if verdict is not None:
        why += f"; the prefix an earlier job adapted and kept (at shift {verdict.shift:.2f})"
    log.info("prefix adapted to the device's images: %s", why)
    return adapted, Adaptation("bn", request, why, summary, path, adapted.manifest.files[BACKBONE_INT8].sha256,
                               cached, time.process_time() - start, verdict=verdict)


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
    adaptation.judged = True
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
    and, under `--adapt auto`, kept only if the validation split says so (or an earlier job's
    verdict, `remembered`); else the bundle's
    own prefix on `runner`, the one the selection prepared. The runner not kept is closed."""
    from ..int8.adapt_norm import prepare_adapted

    adapted_runner, why = prepare_adapted(adapted, selection, train.x, threads)
    if adapted_runner is None:  # the bundle's own prefix, as chosen
        adaptation.kind, adaptation.reason, adaptation.prefix, adaptation.prefix_sha256 = "none", why, None, None
        return bundle, runner
    judge = adaptation.requested == "auto" and adaptation.verdict is None  # an earlier verdict is taken as it is
    if judge and not judge_on_validation(adaptation, runner, adapted_runner, logits, val.x, val.y):
        adapted_runner.close()
        return bundle, runner
    runner.close()
    return adapted, adapted_runner

