"""A simulated fleet built from scikit-learn's bundled digits (1,797 8x8 images, no download).

Three pieces, each usable on its own and each deterministic given its seeds:

- `load_digits_images()`: images as float32 (N, 1, 8, 8) in [0, 1] (NCHW, as MXNet uses)
  and int64 labels 0..9.
- `partition_non_iid(labels, n_devices, alpha, seed)`: Dirichlet label skew, the usual
  federated-learning benchmark split (Hsu et al. 2019). Small `alpha` (0.1) gives devices
  that see two or three classes; large `alpha` (100) is close to IID. Every device gets at
  least `min_per_device` samples.
- `camera_params(device_seed)` + `apply_camera(images, params)`: a fixed per-device
  "camera" (small rotation, contrast, brightness, sensor noise), so devices also differ
  in their inputs, as field devices do.

`make_fleet()` combines them: a held-out test set (each test image seen through one of the
devices' cameras, round-robin, so it follows the fleet's input distribution) and one
`DeviceData` per device.

Example::

    fleet = make_fleet(n_devices=10, alpha=0.5, seed=0)
    for dev in fleet.devices:
        train_locally(dev.images, dev.labels)       # (n, 1, 8, 8) float32, (n,) int64
    evaluate(fleet.test_images, fleet.test_labels)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

N_CLASSES = 10
IMAGE_SHAPE = (1, 8, 8)


@functools.lru_cache(maxsize=1)
def _digits_cached() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits  # demo/test extra: imported only when used

    bunch = load_digits()
    images = (np.asarray(bunch.images, dtype=np.float32) / 16.0).reshape(-1, *IMAGE_SHAPE)
    labels = np.asarray(bunch.target, dtype=np.int64)
    images.setflags(write=False)
    labels.setflags(write=False)
    return images, labels


def load_digits_images() -> tuple[np.ndarray, np.ndarray]:
    """Return (images, labels): float32 (1797, 1, 8, 8) in [0, 1] and int64 (1797,).

    Fresh writable copies each call (the cached originals stay untouched).
    """
    images, labels = _digits_cached()
    return images.copy(), labels.copy()


def partition_non_iid(
    labels: np.ndarray,
    n_devices: int,
    alpha: float,
    seed: int,
    *,
    min_per_device: int = 1,
) -> list[np.ndarray]:
    """Split sample indices across `n_devices` with Dirichlet(`alpha`) label skew.

    For each class, the class's samples are shared out in proportions drawn from
    Dirichlet(alpha, ..., alpha). Devices left with fewer than `min_per_device` samples
    then take samples from the largest device, so every device has data.
    Returns one sorted int64 index array per device; together they are a partition of
    range(len(labels)). Deterministic for a given (labels, n_devices, alpha, seed).
    """
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"labels must be a 1-D integer array, got {labels.dtype} {labels.shape}")
    if not isinstance(n_devices, int | np.integer) or n_devices < 1:
        raise ValueError(f"n_devices must be a positive integer, got {n_devices!r}")
    if not (np.isfinite(alpha) and alpha > 0):
        raise ValueError(f"alpha must be a positive finite number, got {alpha!r}")
    if min_per_device < 1:
        raise ValueError(f"min_per_device must be >= 1, got {min_per_device}")
    if len(labels) < n_devices * min_per_device:
        raise ValueError(
            f"{len(labels)} samples cannot give {n_devices} devices {min_per_device} samples each"
        )
    rng = np.random.default_rng(seed)
    parts: list[list[np.ndarray]] = [[] for _ in range(n_devices)]
    for cls in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == cls))
        shares = rng.dirichlet(np.full(n_devices, float(alpha)))
        cuts = (np.cumsum(shares)[:-1] * len(idx)).astype(np.int64)
        for dev, piece in enumerate(np.split(idx, cuts)):
            parts[dev].append(piece)
    devices = [np.concatenate(p) if p else np.empty(0, np.int64) for p in parts]
    # Top up starved devices from the largest one (random picks, still deterministic).
    for dev in range(n_devices):
        need = min_per_device - len(devices[dev])
        while need > 0:
            donor = int(np.argmax([len(d) for d in devices]))
            take = min(need, len(devices[donor]) - min_per_device)
            pick = rng.choice(len(devices[donor]), size=take, replace=False)
            devices[dev] = np.concatenate([devices[dev], devices[donor][pick]])
            devices[donor] = np.delete(devices[donor], pick)
            need -= take
    return [np.sort(d).astype(np.int64) for d in devices]


@dataclass(frozen=True)
class CameraParams:
    """A device's fixed camera: applied as rotate -> contrast/brightness -> noise -> clip."""

    seed: int
    angle_deg: float  # rotation about the image centre, bilinear, zero outside
    contrast: float  # gain around mid-grey 0.5
    brightness: float  # offset added after the gain
    noise_std: float  # Gaussian sensor noise (fixed per device seed)


def camera_params(device_seed: int) -> CameraParams:
    """The camera of the device with this seed: rotation within ±15°, contrast 0.7-1.3,
    brightness ±0.1, noise std 0-0.08."""
    rng = np.random.default_rng([int(device_seed), 0xCA])
    return CameraParams(
        seed=int(device_seed),
        angle_deg=float(rng.uniform(-15.0, 15.0)),
        contrast=float(rng.uniform(0.7, 1.3)),
        brightness=float(rng.uniform(-0.1, 0.1)),
        noise_std=float(rng.uniform(0.0, 0.08)),
    )


def _rotate(images: np.ndarray, angle_deg: float) -> np.ndarray:
    """Bilinear rotation of (N, C, H, W) images about their centre (pure numpy)."""
    n, c, h, w = images.shape
    theta = np.deg2rad(angle_deg)
    cy, cx = (h - 1) / 2.0, (w - 1) / 2.0
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float64)
    dy, dx = yy - cy, xx - cx
    # Inverse mapping: each output pixel samples the source at R(-theta) of its position.
    sx = np.cos(theta) * dx + np.sin(theta) * dy + cx
    sy = -np.sin(theta) * dx + np.cos(theta) * dy + cy
    x0, y0 = np.floor(sx).astype(np.int64), np.floor(sy).astype(np.int64)
    fx, fy = sx - x0, sy - y0
    padded = np.zeros((n, c, h + 2, w + 2), dtype=np.float64)
    padded[:, :, 1:-1, 1:-1] = images

    def tap(y: np.ndarray, x: np.ndarray) -> np.ndarray:
        # Coordinates outside the image read the zero border.
        return padded[:, :, np.clip(y + 1, 0, h + 1), np.clip(x + 1, 0, w + 1)]

    out = (
        tap(y0, x0) * (1 - fx) * (1 - fy)
        + tap(y0, x0 + 1) * fx * (1 - fy)
        + tap(y0 + 1, x0) * (1 - fx) * fy
        + tap(y0 + 1, x0 + 1) * fx * fy
    )
    return out


def apply_camera(images: np.ndarray, params: CameraParams) -> np.ndarray:
    """Images (N, C, H, W) in [0, 1] as seen by the camera `params`; float32 in [0, 1].

    The noise is drawn from the camera's seed, so the same images always give the same
    output (the sensor's fixed-pattern-like noise for that batch).
    """
    images = np.asarray(images)
    if images.ndim != 4:
        raise ValueError(f"images must be (N, C, H, W), got shape {images.shape}")
    out = _rotate(images.astype(np.float64), params.angle_deg)
    out = (out - 0.5) * params.contrast + 0.5 + params.brightness
    rng = np.random.default_rng([params.seed, 0x5E])
    out = out + rng.normal(0.0, params.noise_std, size=out.shape)
    return np.clip(out, 0.0, 1.0).astype(np.float32)


@dataclass(frozen=True)
class DeviceData:
    """One simulated device: its id, camera and local (transformed) training data."""

    device_id: str
    camera: CameraParams
    indices: np.ndarray  # into load_digits_images()
    images: np.ndarray  # (n, 1, 8, 8) float32 in [0, 1], through the device's camera
    labels: np.ndarray  # (n,) int64


@dataclass(frozen=True)
class Fleet:
    devices: list[DeviceData]
    test_images: np.ndarray  # held-out, each through one device's camera (round-robin)
    test_labels: np.ndarray
    test_device: np.ndarray  # which device's camera each test image went through


def device_seed(fleet_seed: int, device: int) -> int:
    """The camera seed of device number `device` in the fleet seeded `fleet_seed`."""
    return int(np.random.SeedSequence([int(fleet_seed), int(device)]).generate_state(1)[0])


def make_fleet(
    n_devices: int = 10,
    alpha: float = 0.5,
    seed: int = 0,
    *,
    test_fraction: float = 0.25,
    min_per_device: int = 10,
) -> Fleet:
    """Hold out `test_fraction` of the digits, split the rest non-IID over `n_devices`
    devices ("dev-00", "dev-01", ...), each with its own camera. Deterministic."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    images, labels = load_digits_images()
    perm = np.random.default_rng([int(seed), 0x7E57]).permutation(len(labels))
    n_test = int(round(len(labels) * test_fraction))
    test_idx, train_idx = np.sort(perm[:n_test]), np.sort(perm[n_test:])
    parts = partition_non_iid(
        labels[train_idx], n_devices, alpha, seed, min_per_device=min_per_device
    )
    cameras = [camera_params(device_seed(seed, d)) for d in range(n_devices)]
    devices = []
    for d, part in enumerate(parts):
        idx = train_idx[part]
        devices.append(
            DeviceData(
                device_id=f"dev-{d:02d}",
                camera=cameras[d],
                indices=idx,
                images=apply_camera(images[idx], cameras[d]),
                labels=labels[idx],
            )
        )
    test_device = np.arange(n_test) % n_devices
    test_images = np.empty((n_test, *IMAGE_SHAPE), dtype=np.float32)
    for d in range(n_devices):
        sel = test_device == d
        if sel.any():
            test_images[sel] = apply_camera(images[test_idx[sel]], cameras[d])
    return Fleet(
        devices=devices,
        test_images=test_images,
        test_labels=labels[test_idx],
        test_device=test_device,
    )
