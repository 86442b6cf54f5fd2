"""Simulated fleet data for tests, benchmarks and the demo (no hardware, no download).

`edge_agent.sim.digits` turns scikit-learn's bundled 8x8 digits into a fleet: a non-IID
split across devices (Dirichlet label skew) and a fixed per-device "camera" (rotation,
contrast, brightness, noise), so that federated code sees both label and feature skew.
Everything is deterministic given its seeds. scikit-learn is a demo/test extra, imported
only when the digits are loaded.
"""

from __future__ import annotations

from .digits import (
    CameraParams,
    DeviceData,
    Fleet,
    apply_camera,
    camera_params,
    load_digits_images,
    make_fleet,
    partition_non_iid,
)

__all__ = [
    "CameraParams",
    "DeviceData",
    "Fleet",
    "apply_camera",
    "camera_params",
    "load_digits_images",
    "make_fleet",
    "partition_non_iid",
]
