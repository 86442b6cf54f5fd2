"""A second real data set: texture patches cut from the photographs scikit-learn ships.

`sklearn.datasets.load_sample_images()` holds two 427x640 colour photographs (a temple by a
lake, a dahlia). Eight regions of them are the classes: sky, tree, water, roof, wall
(temple), petal, centre, leaf (dahlia). Each region is split into a left and a right
half: base-model patches come from the left halves, device and held-out patches from the
right halves, so a fine-tune is judged on patches no training ever saw. Each device sees
through its own camera (gain, offset, colour cast, blur-free sensor noise), and holds a
non-IID share of the classes (Dirichlet over classes per device).

No download: the photographs are files inside the scikit-learn wheel.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

CLASSES = ["sky", "tree", "water", "roof", "wall", "petal", "centre", "leaf"]
# (photo, rows, cols) of each class's region in the 427x640 photographs
REGIONS = {
    "sky": (0, slice(0, 90), slice(330, 640)),
    "tree": (0, slice(200, 427), slice(560, 640)),
    "water": (0, slice(345, 427), slice(0, 300)),
    "roof": (0, slice(95, 150), slice(60, 330)),
    "wall": (0, slice(180, 300), slice(150, 330)),
    "petal": (1, slice(130, 330), slice(210, 420)),
    "centre": (1, slice(180, 290), slice(270, 380)),
    "leaf": (1, slice(0, 110), slice(0, 220)),
}


@functools.cache
def _photos() -> tuple[np.ndarray, ...]:
    from sklearn.datasets import load_sample_images

    return tuple(np.asarray(img, np.float32) / 255.0 for img in load_sample_images().images)


def patches(*, half: int, per_class: int, size: int, seed: int, classes: list[int] | None = None,
            counts: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Random size x size RGB patches (N, 3, size, size) in [0, 1] from one half (0 left, 1
    right) of each class region; `counts[c]` patches of class c (default `per_class` each)."""
    photos = _photos()
    rng = np.random.default_rng([seed, half, 0x7E])
    xs, ys = [], []
    for label, (which, rows, cols) in enumerate(REGIONS.values()):
        if classes is not None and label not in classes:
            continue
        region = photos[which][rows, cols]
        width = region.shape[1] // 2
        region = region[:, half * width:(half + 1) * width]
        if region.shape[0] < size or region.shape[1] < size:
            raise ValueError(f"region {CLASSES[label]} is smaller than {size}x{size}")
        n = per_class if counts is None else int(counts[label])
        for _ in range(n):
            r = rng.integers(0, region.shape[0] - size + 1)
            c = rng.integers(0, region.shape[1] - size + 1)
            xs.append(region[r:r + size, c:c + size].transpose(2, 0, 1))
            ys.append(label)
    if not xs:
        return np.empty((0, 3, size, size), np.float32), np.empty(0, np.int64)
    return np.stack(xs).astype(np.float32), np.asarray(ys, np.int64)


@dataclass(frozen=True)
class TextureCamera:
    gain: float
    offset: float
    cast: tuple[float, float, float]  # per-channel colour multipliers
    noise_std: float
    seed: int

    def apply(self, images: np.ndarray) -> np.ndarray:
        rng = np.random.default_rng([self.seed, 0x5E])
        cast = np.asarray(self.cast, np.float32).reshape(1, 3, 1, 1)
        out = (images - 0.5) * self.gain + 0.5 + self.offset
        out = out * cast + rng.normal(0.0, self.noise_std, size=images.shape)
        return np.clip(out, 0.0, 1.0).astype(np.float32)


def camera(seed: int) -> TextureCamera:
    rng = np.random.default_rng([seed, 0xCA])
    return TextureCamera(gain=float(rng.uniform(0.6, 1.2)), offset=float(rng.uniform(-0.12, 0.12)),
                         cast=tuple(float(v) for v in rng.uniform(0.8, 1.2, 3)),  # type: ignore[arg-type]
                         noise_std=float(rng.uniform(0.02, 0.08)), seed=seed)


@dataclass(frozen=True)
class TextureDevice:
    device_id: str
    camera: TextureCamera
    images: np.ndarray  # through its camera
    labels: np.ndarray
    heldout_images: np.ndarray  # other right-half patches of every class, through its camera
    heldout_labels: np.ndarray


@dataclass(frozen=True)
class TextureScenario:
    base_x: np.ndarray
    base_y: np.ndarray
    devices: list[TextureDevice]


def scenario(*, size: int = 32, n_devices: int = 3, per_device: int = 160, base_per_class: int = 60,
             heldout_per_class: int = 40, alpha: float = 1.0, seed: int = 0) -> TextureScenario:
    """Base data (left halves, the base camera) and `n_devices` devices (right halves, own
    camera, Dirichlet(alpha) class shares, each with its own held-out set)."""
    base_x, base_y = patches(half=0, per_class=base_per_class, size=size, seed=seed)
    rng = np.random.default_rng([seed, 0xD1])
    devices = []
    for d in range(n_devices):
        share = rng.dirichlet([alpha] * len(CLASSES))
        counts = np.maximum(2, np.round(share * per_device)).astype(np.int64)
        x, y = patches(half=1, per_class=0, size=size, seed=seed * 100 + d, counts=counts)
        hx, hy = patches(half=1, per_class=heldout_per_class, size=size, seed=seed * 100 + 50 + d)
        cam = camera(seed * 100 + d)
        devices.append(TextureDevice(f"tex-{d:02d}", cam, cam.apply(x), y, cam.apply(hx), hy))
    return TextureScenario(base_x, base_y, devices)
