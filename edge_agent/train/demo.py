"""The digits fine-tune scenario, shared by the tests, the benchmark and the demo.

A base model (the project's digits CNN) is trained on *other* data -- clean digits, no
device camera -- and packed as a bundle (int8 backbone + MXNet head). Each simulated
device then holds its own share of the digits seen through its own camera (rotation,
contrast, brightness, noise: edge_agent.sim.digits), written to disk as an image folder,
a CSV or an NPZ of raw 0..255 pixels, exactly what `edge-agent finetune --data` reads.

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

    from ..sim.digits import apply_camera, load_digits_images, make_fleet

    fleet = make_fleet(n_devices=base_devices + n_devices, alpha=alpha, seed=seed, min_per_device=40)
    images, labels = load_digits_images()
    base_idx = np.concatenate([d.indices for d in fleet.devices[:base_devices]])
    devices = []
    for dev in fleet.devices[base_devices:]:
        cam = dev.camera
        cam = replace(cam, angle_deg=cam.angle_deg * severity, contrast=1.0 + (cam.contrast - 1.0) * severity,
                      brightness=cam.brightness * severity, noise_std=cam.noise_std * severity)
        devices.append(replace(dev, camera=cam, images=apply_camera(images[dev.indices], cam)))
    return Scenario(images[base_idx], labels[base_idx], devices)


def to_pixels(images: np.ndarray) -> np.ndarray:
    """[0, 1] float images -> uint8 raw pixels, what a camera would store."""
    return np.clip(np.rint(np.asarray(images) * 255.0), 0, 255).astype(np.uint8)


def build_bundle(dest: str | os.PathLike[str], x: np.ndarray, y: np.ndarray, *, epochs: int = 8,
                 seed: int = 0, name: str = "digits-cnn", version: str = "1", overwrite: bool = False,
                 save_params: str | os.PathLike[str] | None = None) -> Any:
    """Train the digits CNN on (x in [0, 1], y) and write it as a bundle at `dest`
    (and, with `save_params`, the fp32 Gluon parameters of the whole net there)."""
    from ..int8.bundle import create_bundle
    from ..models import digits_cnn, fit_classifier

    net = digits_cnn()
    fit_classifier(net, x, y, epochs=epochs, seed=seed)
    if save_params is not None:
        net.save_parameters(str(save_params))
    # stored data is raw pixels (0..255); the bundle normalises them to what the net saw
    calib = to_pixels(x[:256]).astype(np.float32) * np.float32(PIXEL_SCALE)
    return create_bundle(net, dest, calibration=calib, labels=LABELS, name=name, version=version,
                         input_shape=(1, 8, 8), scale=PIXEL_SCALE, overwrite=overwrite)


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


def ensure_bundle(dest: str | os.PathLike[str], *, seed: int = 0) -> Path:
    """The scenario's base bundle at `dest`, built once (reused while it verifies)."""
    import fcntl

    from ..errors import InputError
    from ..int8.bundle import load_bundle

    target = Path(dest)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # parallel test workers build it once
        try:
            load_bundle(target)
        except (InputError, OSError):
            sc = scenario(seed=seed)
            build_bundle(target, sc.base_x, sc.base_y, seed=seed, overwrite=True)
    return target
