"""The digits fine-tune scenario, shared by the tests, the benchmark and the demo.

A base model (the project's digits CNN) is trained on *other* data -- clean digits, no
device camera -- and packed as a bundle (int8 backbone + MXNet head). Each simulated
device then holds its own share of the digits seen through its own camera (rotation,
contrast, brightness, noise: edge_agent.sim.digits), written to disk as an image folder,
a CSV or an NPZ of raw 0..255 pixels, exactly what `edge-agent finetune --data` reads.

`camera_scenario()` is the same fleet at camera resolution (digits upsampled to e.g. 96x96,
3 channels) for a MobileNetV2-style backbone; `ensure_mobilenet_bundle()` builds (once) its
base bundle plus the whole fp32 net, which bench/bench_finetune.py fine-tunes both ways.

Imports MXNet (through models / bundle creation) only inside the functions that train.
"""

from __future__ import annotations

import csv
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic import atomic_write_bytes, atomic_write_text

LABELS = [str(i) for i in range(10)]
PIXEL_SCALE = 1.0 / 255.0  # the bundle's normalisation: raw 0..255 pixels -> [0, 1]


@dataclass(frozen=True)
class Scenario:
    """Base training data (clean) and the fine-tuning devices (through their cameras)."""

    base_x: np.ndarray  # (n, 1, 8, 8) float32 in [0, 1]
    base_y: np.ndarray
    devices: list[Any]  # edge_agent.sim.digits.DeviceData


def scenario(*, n_devices: int = 3, base_devices: int = 3, alpha: float = 1.0, seed: int = 0,
             severity: float = 2.0) -> Scenario:
    """Split digits over `base_devices + n_devices`; the first `base_devices` shares, without
    any camera, train the base model; the others are the devices that fine-tune.

    Field cameras are `severity` times further off than the simulator's default ones
    (rotation, contrast and brightness offsets and noise scaled): at 1.0 the base model is
    already ~95 % right on some devices and there is little left to adapt to.
    """
    from dataclasses import replace

    from .digits import apply_camera, load_digits_images, make_fleet

    fleet = make_fleet(n_devices=base_devices + n_devices, alpha=alpha, seed=seed, min_per_device=40)
    images, labels = load_digits_images()
    base_idx = np.concatenate([d.indices for d in fleet.devices[:base_devices]])
    devices = []
    for dev in fleet.devices[base_devices:]:
        cam = field_camera(dev.camera, severity)
        devices.append(replace(dev, camera=cam, images=apply_camera(images[dev.indices], cam)))
    return Scenario(images[base_idx], labels[base_idx], devices)


def field_camera(camera: Any, severity: float) -> Any:
    """A simulator camera (edge_agent.sim.digits.CameraParams) `severity` times further off:
    rotation, contrast and brightness offsets and noise scaled."""
    from dataclasses import replace

    return replace(camera, angle_deg=camera.angle_deg * severity, contrast=1.0 + (camera.contrast - 1.0) * severity,
                   brightness=camera.brightness * severity, noise_std=camera.noise_std * severity)


def to_pixels(images: np.ndarray) -> np.ndarray:
    """[0, 1] float images -> uint8 raw pixels, what a camera would store."""
    return np.clip(np.rint(np.asarray(images) * 255.0), 0, 255).astype(np.uint8)


def build_bundle(dest: str | os.PathLike[str], x: np.ndarray, y: np.ndarray, *, epochs: int = 8,
                 seed: int = 0, name: str = "digits-cnn", version: str = "1", overwrite: bool = False,
                 save_params: str | os.PathLike[str] | None = None, depths: int = 0) -> Any:
    """Train the digits CNN on (x in [0, 1], y) and write it as a bundle at `dest`
    (and, with `save_params`, the fp32 Gluon parameters of the whole net there)."""
    from ..int8.bundle_create import create_bundle
    from .models import digits_cnn, fit_classifier

    net = digits_cnn()
    fit_classifier(net, x, y, epochs=epochs, seed=seed)
    if save_params is not None:
        Path(save_params).parent.mkdir(parents=True, exist_ok=True)  # a clean checkout has no build/ yet
        net.save_parameters(str(save_params))
    # stored data is raw pixels (0..255); the bundle normalises them to what the net saw
    calib = to_pixels(x[:256]).astype(np.float32) * np.float32(PIXEL_SCALE)
    return create_bundle(net, dest, calibration=calib, labels=LABELS, name=name, version=version,
                         input_shape=(1, 8, 8), scale=PIXEL_SCALE, overwrite=overwrite, depths=depths)


def write_data(dest: str | os.PathLike[str], images: np.ndarray, labels: np.ndarray, fmt: str) -> Path:
    """Write images in [0, 1] as raw pixels in `fmt` ('images', 'csv' or 'npz'); returns
    what to pass as --data (a folder for images, the file otherwise)."""
    pixels = to_pixels(images)
    root = Path(dest)
    if fmt == "images":
        from PIL import Image

        for i, (img, label) in enumerate(zip(pixels, labels, strict=True)):
            buf = io.BytesIO()
            Image.fromarray(img[0], mode="L").save(buf, format="PNG")
            atomic_write_bytes(root / LABELS[int(label)] / f"{i:05d}.png", buf.getvalue())
        return root
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerow([f"p{i}" for i in range(pixels[0].size)] + ["label"])
        for img, label in zip(pixels, labels, strict=True):
            writer.writerow([*img.reshape(-1).tolist(), LABELS[int(label)]])
        atomic_write_text(root / "data.csv", out.getvalue())
        return root / "data.csv"
    if fmt == "npz":
        buf = io.BytesIO()
        np.savez(buf, x=pixels, y=np.asarray(labels, np.int64))
        atomic_write_bytes(root / "data.npz", buf.getvalue())
        return root / "data.npz"
    raise ValueError(f"unknown format {fmt!r}; use images, csv or npz")


def ensure_bundle(dest: str | os.PathLike[str], *, seed: int = 0, depths: int = 0) -> Path:
    """The scenario's base bundle at `dest`, built once (reused while it verifies and has
    the `depths` asked for)."""
    import fcntl

    from ..errors import InputError
    from ..int8.bundle import ORACLE, load_bundle

    target = Path(dest)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # parallel test workers build it once
        try:
            manifest = load_bundle(target).manifest
            if len(manifest.depths) != (depths + 1 if depths else 0):
                raise InputError("other depths")
            if ORACLE not in manifest.files:
                raise InputError("made before bundles carried the oracle's answers (per depth too)")
        except (InputError, OSError):
            sc = scenario(seed=seed)
            build_bundle(target, sc.base_x, sc.base_y, seed=seed, overwrite=True, depths=depths)
    return target


# ---------------------------------------------------------------- camera-sized scenario
#
# The same digits and devices at camera resolution, for a MobileNetV2-style backbone: each
# 8x8 digit is upsampled (bilinear) to `size` x `size`, the device's camera (rotation,
# contrast, brightness, sensor noise) is applied at that resolution, and the grey image is
# replicated to 3 channels. The base model (models.mobilenet_v2) is trained from scratch on
# the base devices' shares, each seen through its own camera.


CAMERA_BUNDLE_FORMAT = 5  # 3: oracle.npz (the oracle's answers) in the bundle; 4: per depth too;
# 5: each depth's prefix_activations in the manifest


def upsample(images: np.ndarray, size: int) -> np.ndarray:
    """(N, C, h, w) images -> (N, C, size, size) float32, bilinear (pixel centres aligned,
    edges clamped: what an image library's resize does)."""
    images = np.asarray(images, np.float32)
    if images.ndim != 4:
        raise ValueError(f"images must be (N, C, H, W), got shape {images.shape}")

    def matrix(n_in: int) -> np.ndarray:
        pos = np.clip((np.arange(size) + 0.5) * n_in / size - 0.5, 0.0, n_in - 1.0)
        lo = np.floor(pos).astype(np.int64)
        hi = np.minimum(lo + 1, n_in - 1)
        frac = (pos - lo).astype(np.float32)
        m = np.zeros((size, n_in), np.float32)
        m[np.arange(size), lo] += 1.0 - frac
        m[np.arange(size), hi] += frac
        return m

    rows, cols = matrix(images.shape[2]), matrix(images.shape[3])
    return np.einsum("yh,nchw,xw->ncyx", rows, images, cols, optimize=True).astype(np.float32)


def camera_scenario(*, size: int = 96, n_devices: int = 3, base_devices: int = 3, alpha: float = 1.0,
                    seed: int = 0, severity: float = 2.0, base_cameras: bool = True) -> Scenario:
    """`scenario()` at camera resolution: images (n, 3, size, size) float32 in [0, 1].

    The same split and device cameras as `scenario()` (same arguments), but each camera is
    applied after upsampling, so rotation and sensor noise act on the full-resolution image
    as they would on a real sensor. With `base_cameras` (the default) the base model's data
    is the base devices' shares seen through *their own* cameras -- other devices' data, as
    a fleet's base model is trained on; without, their clean digits (as in `scenario()`).
    """
    from dataclasses import replace

    from .digits import apply_camera, load_digits_images, make_fleet

    fleet = make_fleet(n_devices=base_devices + n_devices, alpha=alpha, seed=seed, min_per_device=40)
    images, labels = load_digits_images()

    def seen(dev: Any) -> np.ndarray:
        return rgb(apply_camera(upsample(images[dev.indices], size), field_camera(dev.camera, severity)))

    def rgb(x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(np.repeat(x, 3, axis=1))

    base = fleet.devices[:base_devices]
    base_idx = np.concatenate([d.indices for d in base])
    base_x = np.concatenate([seen(d) for d in base]) if base_cameras else rgb(upsample(images[base_idx], size))
    devices = [replace(dev, camera=field_camera(dev.camera, severity), images=seen(dev))
               for dev in fleet.devices[base_devices:]]
    return Scenario(base_x, labels[base_idx], devices)


def train_mobilenet(x: np.ndarray, y: np.ndarray, *, width: float, epochs: int, batch_size: int = 32,
                    lr: float = 0.003, seed: int = 0, bn_samples: int = 128, num_classes: int = len(LABELS)) -> Any:
    """A MobileNetV2-style net (models.mobilenet_v2) trained from scratch on (x, y) with
    Adam; BatchNorm statistics refreshed on `bn_samples` samples at the end (one batch:
    `models.fit_classifier` refreshes on up to 2048, too much memory at camera size)."""
    import mxnet as mx
    from mxnet import autograd, gluon

    from .models import initialize, mobilenet_v2, refresh_batchnorm

    x = np.ascontiguousarray(x, np.float32)
    net = initialize(mobilenet_v2(width, num_classes=num_classes, input_size=int(x.shape[-1])), seed=seed)
    net.hybridize(static_alloc=True)
    rng = np.random.RandomState(seed)
    mx.random.seed(seed)
    trainer = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": lr, "wd": 1e-4}, kvstore=None)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    for _ in range(epochs):
        order = rng.permutation(len(x))
        for start in range(0, len(x), batch_size):
            idx = order[start:start + batch_size]
            with autograd.record():
                loss = loss_fn(net(mx.nd.array(x[idx])), mx.nd.array(y[idx].astype(np.float32)))
            loss.backward()
            trainer.step(len(idx))
    refresh_batchnorm(net, x[rng.permutation(len(x))[:bn_samples]])
    return net


def build_mobilenet_bundle(dest: str | os.PathLike[str], x: np.ndarray, y: np.ndarray, *, width: float,
                           epochs: int, seed: int = 0, lr: float = 0.003, calibration_samples: int = 128,
                           name: str = "digits-mobilenet", version: str = "1", overwrite: bool = False,
                           save_params: str | os.PathLike[str] | None = None, depths: int = 0,
                           labels: list[str] = LABELS) -> Any:
    """Train `train_mobilenet` on (x in [0, 1], y: camera-sized, 3 channels) and write it
    as a bundle at `dest` (and, with `save_params`, the whole fp32 Gluon net there)."""
    from ..int8.bundle_create import create_bundle

    net = train_mobilenet(x, y, width=width, epochs=epochs, seed=seed, lr=lr, num_classes=len(labels))
    if save_params is not None:
        Path(save_params).parent.mkdir(parents=True, exist_ok=True)
        net.save_parameters(str(save_params))
    spread = np.linspace(0, len(x) - 1, min(calibration_samples, len(x))).astype(np.int64)  # every camera
    calib = to_pixels(x[spread]).astype(np.float32) * np.float32(PIXEL_SCALE)
    return create_bundle(net, dest, calibration=calib, labels=labels, name=name, version=version,
                         input_shape=tuple(int(v) for v in x.shape[1:]), scale=PIXEL_SCALE, overwrite=overwrite,
                         depths=depths)


def ensure_mobilenet_bundle(dest: str | os.PathLike[str], *, width: float = 0.5, size: int = 96,
                            epochs: int = 3, seed: int = 0, depths: int = 0) -> tuple[Path, Path, bool]:
    """The camera scenario's base MobileNetV2 bundle at `dest` and its whole fp32 net at
    `<dest>.params`, built once per (width, size, epochs, seed) and reused while the bundle
    verifies (`<dest>.key.json` records the key; bump CAMERA_BUNDLE_FORMAT when the scenario
    or the training changes). Returns (bundle, params, built_now)."""
    import fcntl
    import json

    from ..errors import InputError
    from ..int8.bundle import load_bundle

    target = Path(dest)
    params = target.with_name(target.name + ".params")
    key_file = target.with_name(target.name + ".key.json")
    key = {"width": width, "size": size, "epochs": epochs, "seed": seed, "format": CAMERA_BUNDLE_FORMAT,
           **({"depths": depths} if depths else {})}
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if json.loads(key_file.read_text()) != key or not params.is_file():
                raise InputError("stale")
            load_bundle(target)
            return target, params, False
        except (InputError, OSError, ValueError):
            pass
        key_file.unlink(missing_ok=True)  # a build cut short must not pass for a finished one
        sc = camera_scenario(size=size, seed=seed)
        build_mobilenet_bundle(target, sc.base_x, sc.base_y, width=width, epochs=epochs, seed=seed,
                               overwrite=True, save_params=params, depths=depths)
        atomic_write_text(key_file, json.dumps(key))
    return target, params, True
