"""A strongly shifted camera: what a cheap lens, a different sensor and a tinted housing do
to images a model was trained on -- blur, a gamma curve, a colour tint with an offset, and
sensor noise. Harsher than `scenario.field_camera` (rotation, contrast, brightness), and of
the kind that moves the network's low-level statistics: the case for adapting the frozen
prefix (int8/adapt_norm.py) rather than only the trained tail.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ShiftedCamera:
    blur_sigma: float = 1.5  # pixels of the image as the model takes it
    gamma: float = 1.8
    tint: tuple[float, ...] = (1.15, 0.85, 0.6)  # per-channel gain (channel c: tint[c % len])
    offset: float = 0.08
    noise_std: float = 0.06
    seed: int = 0


def shift_images(images: np.ndarray, camera: ShiftedCamera = ShiftedCamera()) -> np.ndarray:
    """(N, C, H, W) images in [0, 1] as `camera` sees them: float32 in [0, 1]; the noise is
    drawn from the camera's seed, so the same images always give the same result."""
    # scipy: scikit-learn's dependency, so the demo/test extra has it
    from scipy.ndimage import gaussian_filter

    x = np.asarray(images, np.float32)
    if x.ndim != 4:
        raise ValueError(f"images must be (N, C, H, W), got shape {x.shape}")
    x = gaussian_filter(x, sigma=(0, 0, camera.blur_sigma, camera.blur_sigma)) if camera.blur_sigma else x
    x = np.clip(x, 0.0, 1.0) ** camera.gamma
    gains = np.asarray([camera.tint[c % len(camera.tint)] for c in range(x.shape[1])], np.float32)
    x = x * gains.reshape(1, -1, 1, 1) + camera.offset
    x = x + np.random.default_rng([camera.seed, 0x5C]).normal(0.0, camera.noise_std, x.shape)
    return np.clip(x, 0.0, 1.0).astype(np.float32)
