"""The fine-tune job's adaptation below the cut: whether the device's images are far enough
from the bundle's to re-estimate the prefix's normalisation statistics on them
(int8/adapt_norm.py: the first ADAPT_LAYERS normalised layers, where a camera shows), and
the adapted int8 prefix, cached per prefix and data.

`--adapt auto` (the default) adapts when the shift measured at the prefix's first
normalised layers is at least ADAPT_SHIFT; `bn` always adapts, `none` never does. The
adapted prefix is the device's own: its update to the fleet is the tail, trained on
features that the adaptation has brought back to the statistics the fleet's tail expects
(normalisation stays local, as in FedBN, Li et al. 2021).

No validation pass judges it. Jobs kept the adapted prefix only where the bundle's own,
untrained tail had a lower loss through it on the validation split; on bench_depth's eight
devices that agreed with what the trained tail then reached on held-out data on 3 of 8 (every
layer adapted, depth 4, 2 seeds) and rejected the strongly shifted textures camera, where
adapting is worth 9-13 points once the tail has trained (0.488 -> 0.575 every layer, 0.618
the first 4): an untrained tail is scored on features it was never fitted to, and training
fits it. A logistic-regression probe on the tail's embedding did no better (5 of 8). With the
first 4 layers adapted and no judgement, 7 of the 8 devices beat not adapting after
training, over 2 seeds as over 4 (the eighth, a field camera on textures, lost 4-5 points
and still beat full fine-tuning).

The prefix an earlier job adapted is remembered per bundle prefix (an EarlierAdaptation
beside the cached prefixes): while the device's shift stays within REUSE_SHIFT_TOLERANCE
of the one it was adapted at and its data has not grown or shrunk by REUSE_GROWTH, the
next job serves that prefix instead of re-estimating it on its new images (a digits job at
depth 4: 0.12-0.24 CPU-s for the adaptation instead of 0.70-0.79, of a job of ~3.5); after
REUSE_USES jobs it is adapted again.
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
ADAPT_FORMAT = 2  # bump when the adaptation's arithmetic changes: cached prefixes are remade (2: first layers only)
KEEP_ADAPTED = 4  # cached adapted prefixes kept (newest first); one per data set and version
# The shift measured on 70 % subsets of one device's images moves by up to 0.09 around the
# whole set's (textures, 32 images each); another camera moves it by 0.23 (tex-00 0.58,
# through the shifted camera 0.81).
REUSE_SHIFT_TOLERANCE = 0.1
REUSE_GROWTH = 1.5  # adapted again once the device's training images grow (or shrink) by this factor
REUSE_USES = 8  # and after this many jobs served it
MAX_REUSE_BYTES = 64 << 10
KEEP_REUSE_RECORDS = 32  # one per prefix a device trained through (versions x depths)
REUSE_SUFFIX = ".adapted.json"


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
    earlier: EarlierAdaptation | None = None  # an earlier job's adapted prefix this job serves

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "requested": self.requested, "reason": self.reason, "shift": self.shift,
                "prefix": str(self.prefix) if self.prefix else None, "prefix_sha256": self.prefix_sha256,
                "cached": self.cached, "cpu_s": round(self.cpu_s, 3), "remembered": self.earlier is not None}


@dataclass(frozen=True)
class EarlierAdaptation:
    """The prefix an earlier job adapted to this device's camera, for later jobs to serve."""

    shift: float  # the shift it was adapted at
    images: int  # the training images it was adapted on
    prefix: str  # the adapted prefix's file name under ADAPTED_DIR
    uses: int = 0  # jobs that served it since

    def to_json(self) -> dict[str, Any]:
        return {"shift": self.shift, "images": self.images, "prefix": self.prefix, "uses": self.uses}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> EarlierAdaptation:
        """Raises ValueError on anything but a record this module wrote."""
        shift, images, prefix, uses = (obj.get(k) for k in ("shift", "images", "prefix", "uses"))
        if not (isinstance(shift, (int, float)) and not isinstance(shift, bool) and isinstance(images, int)
                and isinstance(uses, int) and images >= 0 and uses >= 0):
            raise ValueError("fields missing or of the wrong type")
        if not (isinstance(prefix, str) and Path(prefix).name == prefix and prefix.endswith(".tflite")):
            raise ValueError(f"prefix {prefix!r:.60}: not a file name in the cache")
        return cls(float(shift), images, prefix, uses)

    def covers(self, shift: float, images: int) -> bool:
        """Still this device's camera and about its data, for a job at this shift on this many
        training images."""
        grown = images > self.images * REUSE_GROWTH or images * REUSE_GROWTH < self.images
        return abs(shift - self.shift) <= REUSE_SHIFT_TOLERANCE and not grown and self.uses < REUSE_USES


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


def reuse_path(root: Path, view: Any) -> Path:
    """Where the prefix an earlier job adapted for `view` on this device is recorded."""
    from ..int8.bundle import BACKBONE_INT8

    key = hashlib.sha256(f"{ADAPT_FORMAT}:{view.sha256}:{view.manifest.files[BACKBONE_INT8].sha256}".encode())
    return root / ADAPTED_DIR / f"{key.hexdigest()[:40]}{REUSE_SUFFIX}"


def remembered(root: Path, view: Any, shift: DeviceShift, images: int) -> EarlierAdaptation | None:
    """The prefix an earlier job adapted for `view` that still covers this job, if any. A
    record that cannot be read is ignored (the job adapts again and rewrites it)."""
    from ..atomic import read_json_object

    path = reuse_path(root, view)
    if shift.report is None or not path.is_file():
        return None
    try:
        earlier = EarlierAdaptation.from_json(read_json_object(path, MAX_REUSE_BYTES, "adapted prefix record"))
    except (InputError, ValueError) as exc:
        log.warning("%s: ignored, adapted again (%s)", path, exc)
        return None
    if not earlier.covers(shift.report.distance, images) or not (path.parent / earlier.prefix).is_file():
        return None  # another camera, other data, worn out, or pruned since
    return earlier


def will_walk(root: Path, view: Any, shift: DeviceShift, request: str, images: int, hashes: Sequence[str]) -> bool:
    """Whether this job will re-estimate the statistics of `view`'s prefix (the planner's
    cost): not when it does not adapt, serves an earlier job's prefix, or finds it cached."""
    if shift.report is None or (request == "auto" and not shift.far):
        return False
    if request == "auto" and remembered(root, view, shift, images) is not None:
        return False
    return not cached_prefix(root, view, hashes).is_file()


def remember(root: Path, view: Any, adaptation: Adaptation, images: int) -> None:
    """Record the prefix this auto job adapted and served, or count one more use of the
    earlier one it served; a record that cannot be written only costs the next job a pass."""
    from ..atomic import atomic_write_json

    if adaptation.requested != "auto" or adaptation.kind != "bn" or adaptation.prefix is None or not adaptation.shift:
        return
    earlier = adaptation.earlier
    record = (dataclasses.replace(earlier, uses=earlier.uses + 1) if earlier is not None else
              EarlierAdaptation(float(adaptation.shift["distance"]), images, adaptation.prefix.name))
    path = reuse_path(root, view)
    try:
        atomic_write_json(path, record.to_json())
    except OSError as exc:
        log.warning("adapted prefix not recorded: %s", exc)
        return
    _prune(path.parent, path, pattern=f"*{REUSE_SUFFIX}", keep_count=KEEP_REUSE_RECORDS)


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


def shift_text(distance: float) -> str:
    """Two decimals, or four where two would read as the threshold itself (0.2497 < 0.25)."""
    return f"{distance:.4f}" if round(distance, 2) == ADAPT_SHIFT else f"{distance:.2f}"


def adapt_prefix(view: Any, images: np.ndarray, hashes: Sequence[str], request: str, cache_root: Path,
                 shift: DeviceShift) -> tuple[Any, Adaptation]:
    """The bundle view the job's features come from (`view` itself, or with the adapted int8
    prefix) and what was decided. `images`: the training images as the model takes them;
    `hashes`: theirs (the cache's key); `shift`: `device_shift`'s finding."""
    from ..int8.adapt_norm import ADAPT_LAYERS, adapted_view, quantised_prefix
    from ..int8.bundle import BACKBONE_INT8

    start = time.process_time()
    if shift.report is None:
        return view, Adaptation("none", request, shift.note)
    summary = shift.report.to_json()
    if request == "auto" and not shift.far:
        return view, Adaptation("none", request, f"the device's images are close to the bundle's (shift "
                                f"{shift_text(shift.report.distance)} < {ADAPT_SHIFT})", summary)
    earlier = remembered(cache_root, view, shift, len(images)) if request == "auto" else None
    path = cache_root / ADAPTED_DIR / earlier.prefix if earlier is not None else (
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
    why = "asked for (--adapt bn)" if request == "bn" else f"shift {shift_text(shift.report.distance)} >= {ADAPT_SHIFT}"
    why += f"; the first {ADAPT_LAYERS} normalised layers' statistics re-estimated"
    if earlier is not None:
        why += f" by an earlier job (at shift {earlier.shift:.2f}, on {earlier.images} images), served again"
    log.info("prefix adapted to the device's images: %s", why)
    return adapted, Adaptation("bn", request, why, summary, path, adapted.manifest.files[BACKBONE_INT8].sha256,
                               cached, time.process_time() - start, earlier=earlier)


def choose_runner(adaptation: Adaptation, bundle: Any, adapted: Any, runner: Any, selection: Any,
                  images: np.ndarray, threads: int) -> tuple[Any, Any]:
    """The view and the runner the job's features come from, once the prefix is adapted:
    the selected engine re-checked on the adapted prefix (int8/adapt_norm.prepare_adapted,
    on a few of `images`); if it fails there, the bundle's own prefix on `runner`, the one
    the selection prepared. The runner not kept is closed."""
    from ..int8.adapt_norm import prepare_adapted

    adapted_runner, why = prepare_adapted(adapted, selection, images, threads)
    if adapted_runner is None:  # the bundle's own prefix, as chosen
        adaptation.kind, adaptation.reason, adaptation.prefix, adaptation.prefix_sha256 = "none", why, None, None
        return bundle, runner
    runner.close()
    return adapted, adapted_runner
