"""The simulated digits fleet: real data, deterministic non-IID split, per-device cameras."""

from __future__ import annotations

import numpy as np
import pytest

from edge_agent.sim import (
    CameraParams,
    apply_camera,
    camera_params,
    load_digits_images,
    make_fleet,
    partition_non_iid,
)


def test_digits_load_as_nchw_float_images():
    images, labels = load_digits_images()
    assert images.shape == (1797, 1, 8, 8) and images.dtype == np.float32
    assert images.min() == 0.0 and images.max() == 1.0
    assert labels.dtype == np.int64 and set(np.unique(labels)) == set(range(10))
    images[:] = 0.5  # a copy: the next caller still gets the original
    assert load_digits_images()[0].max() == 1.0


def _skew(parts, labels) -> float:
    """Mean over devices of the share of their most common class (1.0 = one class each)."""
    return float(np.mean([np.bincount(labels[p], minlength=10).max() / len(p) for p in parts]))


def test_partition_is_a_deterministic_partition_with_label_skew():
    _, labels = load_digits_images()
    parts = partition_non_iid(labels, 10, 0.3, seed=4)
    joined = np.concatenate(parts)
    assert len(joined) == len(labels) and set(joined.tolist()) == set(range(len(labels)))
    assert all(len(p) >= 1 and (np.diff(p) > 0).all() for p in parts)
    again = partition_non_iid(labels, 10, 0.3, seed=4)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    other = partition_non_iid(labels, 10, 0.3, seed=5)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other, strict=True))
    iid = partition_non_iid(labels, 10, 1000.0, seed=4)
    assert _skew(parts, labels) > 0.35 > 0.2 > _skew(iid, labels)


def test_every_device_gets_samples_even_under_extreme_skew():
    _, labels = load_digits_images()
    parts = partition_non_iid(labels, 60, 0.01, seed=0, min_per_device=5)
    assert len(parts) == 60 and min(len(p) for p in parts) >= 5
    assert sum(len(p) for p in parts) == len(labels)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((np.zeros(10, np.int64), 0, 0.5, 0), "n_devices"),
        ((np.zeros(10, np.int64), 2, 0.0, 0), "alpha"),
        ((np.zeros(10, np.int64), 2, float("nan"), 0), "alpha"),
        ((np.zeros(3, np.int64), 4, 0.5, 0), "cannot give 4 devices"),
        ((np.zeros((2, 2), np.int64), 1, 0.5, 0), "1-D integer"),
    ],
)
def test_partition_rejects_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        partition_non_iid(*args)


def test_camera_is_deterministic_per_device_and_stays_in_range():
    images, _ = load_digits_images()
    batch = images[:50]
    cam = camera_params(1234)
    assert cam == camera_params(1234) and cam != camera_params(1235)
    assert -15 <= cam.angle_deg <= 15 and 0.7 <= cam.contrast <= 1.3
    out = apply_camera(batch, cam)
    assert out.shape == batch.shape and out.dtype == np.float32
    assert out.min() >= 0.0 and out.max() <= 1.0
    np.testing.assert_array_equal(out, apply_camera(batch, cam))
    assert np.abs(out - apply_camera(batch, camera_params(99))).mean() > 0.01
    assert np.abs(out - batch).mean() > 0.01


def test_identity_camera_and_rotation_geometry():
    images, _ = load_digits_images()
    img = images[:3]
    identity = CameraParams(seed=0, angle_deg=0.0, contrast=1.0, brightness=0.0, noise_std=0.0)
    np.testing.assert_allclose(apply_camera(img, identity), img, atol=1e-6)
    quarter = CameraParams(seed=0, angle_deg=90.0, contrast=1.0, brightness=0.0, noise_std=0.0)
    np.testing.assert_allclose(
        apply_camera(img, quarter), np.rot90(img, k=-1, axes=(2, 3)), atol=1e-5
    )
    with pytest.raises(ValueError, match="N, C, H, W"):
        apply_camera(img[0], identity)


def test_fleet_is_deterministic_and_complete():
    fleet = make_fleet(n_devices=12, alpha=0.5, seed=3)
    assert [d.device_id for d in fleet.devices] == [f"dev-{i:02d}" for i in range(12)]
    n_train = sum(len(d.labels) for d in fleet.devices)
    assert n_train + len(fleet.test_labels) == 1797
    assert min(len(d.labels) for d in fleet.devices) >= 10
    assert set(fleet.test_device.tolist()) == set(range(12))
    all_idx = np.concatenate([d.indices for d in fleet.devices])
    assert len(set(all_idx.tolist())) == n_train
    again = make_fleet(n_devices=12, alpha=0.5, seed=3)
    np.testing.assert_array_equal(fleet.devices[5].images, again.devices[5].images)
    np.testing.assert_array_equal(fleet.test_images, again.test_images)
    original, labels = load_digits_images()
    dev = fleet.devices[0]
    np.testing.assert_array_equal(dev.labels, labels[dev.indices])
    np.testing.assert_array_equal(dev.images, apply_camera(original[dev.indices], dev.camera))
