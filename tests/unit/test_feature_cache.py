"""Feature cache: computed once per (backbone, sample), bounded, LRU, corruption-proof."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from edge_agent.data import sample_hash
from edge_agent.int8.engine import Runner
from edge_agent.train.feature_cache import FeatureCache

BACKBONE_A = "a" * 64
BACKBONE_B = "b" * 64


class CountingRunner(Runner):
    """A numpy backbone behind the project's Runner interface that counts its samples."""

    def __init__(self, channels: int = 6) -> None:
        self.weights = np.random.default_rng(0).normal(size=(channels, 16)).astype(np.float32)
        self.samples = 0

    def run(self, batch: np.ndarray) -> np.ndarray:
        self.samples += len(batch)
        flat = batch.reshape(len(batch), -1)
        return np.maximum(flat @ self.weights.T, 0)[:, :, None, None]


def _data(n: int, seed: int = 0) -> tuple[np.ndarray, list[str]]:
    x = np.random.default_rng(seed).random((n, 1, 4, 4)).astype(np.float32)
    return x, [sample_hash(s) for s in x]


def test_features_are_computed_once_and_only_for_new_samples(tmp_path: Path) -> None:
    runner = CountingRunner()
    cache = FeatureCache(tmp_path, segment_samples=16)
    x, hashes = _data(40)
    f1, s1 = cache.features(BACKBONE_A, hashes, x, runner.run, batch_size=8, feature_shape=(6, 1, 1))
    assert runner.samples == 40 and s1.computed == 40 and s1.hits == 0 and s1.segments_written == 3
    np.testing.assert_allclose(f1, CountingRunner().run(x))
    x2, hashes2 = _data(10, seed=1)
    grown_x, grown_h = np.concatenate([x2, x]), hashes2 + hashes  # more data, other order
    f2, s2 = cache.features(BACKBONE_A, grown_h, grown_x, runner.run, batch_size=8, feature_shape=(6, 1, 1))
    assert runner.samples == 50 and s2.hits == 40 and s2.computed == 10
    np.testing.assert_array_equal(f2[10:], f1)
    # another backbone never sees these features
    _, s3 = cache.features(BACKBONE_B, hashes, x, runner.run, feature_shape=(6, 1, 1))
    assert s3.hits == 0 and runner.samples == 90


def test_a_corrupt_segment_is_dropped_and_recomputed(tmp_path: Path) -> None:
    runner = CountingRunner()
    cache = FeatureCache(tmp_path, segment_samples=10)
    x, hashes = _data(20)
    ref, _ = cache.features(BACKBONE_A, hashes, x, runner.run, batch_size=10)
    segs = sorted((tmp_path / BACKBONE_A).iterdir())
    segs[0].write_bytes(bytes(segs[0].stat().st_size))  # zero-filled after power loss
    got, stats = cache.features(BACKBONE_A, hashes, x, runner.run, batch_size=10)
    assert stats.corrupt_segments == 1 and stats.computed == 10 and stats.hits == 10
    np.testing.assert_array_equal(got, ref)


def test_segments_of_another_feature_shape_are_not_used(tmp_path: Path) -> None:
    cache = FeatureCache(tmp_path)
    x, hashes = _data(5)
    cache.features(BACKBONE_A, hashes, x, CountingRunner(6).run)
    runner = CountingRunner(3)
    _, stats = cache.features(BACKBONE_A, hashes, x, runner.run, feature_shape=(3, 1, 1))
    assert stats.corrupt_segments == 1 and runner.samples == 5


def test_size_is_bounded_with_least_recently_used_eviction(tmp_path: Path) -> None:
    runner = CountingRunner()
    probe_cache = FeatureCache(tmp_path / "probe", segment_samples=10)
    x, hashes = _data(10)
    probe_cache.features(BACKBONE_A, hashes, x, runner.run)
    seg_size = probe_cache.size_bytes()
    cache = FeatureCache(tmp_path / "c", max_bytes=int(seg_size * 2.5), segment_samples=10)
    sets = [_data(10, seed=s) for s in range(3)]
    cache.features(BACKBONE_A, sets[0][1], sets[0][0], runner.run)
    cache.features(BACKBONE_A, sets[1][1], sets[1][0], runner.run)
    old = sorted((tmp_path / "c" / BACKBONE_A).iterdir())
    os.utime(old[0], ns=(1, 1))  # set 0 used long ago, set 1 recently
    os.utime(old[1], ns=(2, 2))
    cache.features(BACKBONE_A, sets[1][1], sets[1][0], runner.run)  # touches set 1 again
    _, stats = cache.features(BACKBONE_A, sets[2][1], sets[2][0], runner.run)
    assert stats.evicted_segments == 1 and cache.size_bytes() <= cache.max_bytes
    before = runner.samples
    _, s1 = cache.features(BACKBONE_A, sets[1][1], sets[1][0], runner.run)
    assert s1.hits == 10 and runner.samples == before  # the recently used set survived
    _, s0 = cache.features(BACKBONE_A, sets[0][1], sets[0][0], runner.run)
    assert s0.hits == 0  # the least recently used one went


def test_a_killed_job_keeps_the_segments_it_flushed(tmp_path: Path) -> None:
    cache = FeatureCache(tmp_path, segment_samples=8)
    x, hashes = _data(32)
    calls = 0

    def dies_after_two_segments(batch: np.ndarray) -> np.ndarray:
        nonlocal calls
        calls += 1
        if calls > 2:
            raise KeyboardInterrupt
        return CountingRunner().run(batch)

    with pytest.raises(KeyboardInterrupt):
        cache.features(BACKBONE_A, hashes, x, dies_after_two_segments, batch_size=8)
    runner = CountingRunner()
    _, stats = cache.features(BACKBONE_A, hashes, x, runner.run, batch_size=8)
    assert stats.hits == 16 and runner.samples == 16


def test_bad_arguments(tmp_path: Path) -> None:
    cache = FeatureCache(tmp_path)
    x, hashes = _data(3)
    with pytest.raises(ValueError, match="lowercase hex"):
        cache.features("../../etc", hashes, x, CountingRunner().run)
    with pytest.raises(ValueError, match="2 hashes for 3"):
        cache.features(BACKBONE_A, hashes[:2], x, CountingRunner().run)
    with pytest.raises(ValueError, match="backbone returned"):
        cache.features(BACKBONE_A, hashes, x, lambda b: np.zeros((1, 6, 1, 1), np.float32))


def test_hashes_with_zero_bytes_survive_the_round_trip(tmp_path: Path) -> None:
    cache = FeatureCache(tmp_path)
    x, _ = _data(3)
    hashes = ["00" * 32, "ab" * 31 + "00", "00" + "cd" * 31]  # NUL bytes at either end
    cache.features(BACKBONE_A, hashes, x, CountingRunner().run)
    runner = CountingRunner()
    _, stats = cache.features(BACKBONE_A, hashes, x, runner.run)
    assert stats.hits == 3 and runner.samples == 0
