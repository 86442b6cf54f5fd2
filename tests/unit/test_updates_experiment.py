"""Federated experiment on real data: FedAvg over 10 non-IID devices for 20 rounds, with
updates sent uncompressed and compressed ~100x through the real wire path.

A small, fast version of bench/bench_codec.py's experiment (which measures the accuracy
gap precisely over several seeds); here the margins are loose enough to be deterministic
facts about this seed, tight enough to catch a codec that loses or corrupts updates.
"""

from __future__ import annotations

import numpy as np
import pytest

from bench.fedsim import FedConfig, accuracy, init_params, local_sgd, run_fedavg
from edge_agent.sim.digits import make_fleet
from edge_agent.updates import CompressionPolicy

CFG = FedConfig(n_devices=10, rounds=20, alpha=0.5, hidden=256, local_epochs=2, lr=0.3, seed=0)


@pytest.fixture(scope="module")
def fleet():
    return make_fleet(CFG.n_devices, CFG.alpha, CFG.seed)


@pytest.fixture(scope="module")
def baseline(fleet):
    return run_fedavg(CFG, None, fleet)


def test_uncompressed_fedavg_learns_the_digits(baseline):
    assert len(baseline.accuracy) == CFG.rounds == 20
    assert baseline.accuracy[0] < 0.8 < 0.88 < baseline.final_accuracy
    assert baseline.ratio == 1.0


def test_compressed_100x_matches_uncompressed_accuracy(fleet, baseline):
    per_update = baseline.dense_bytes // (CFG.rounds * CFG.n_devices)
    policy = CompressionPolicy(budget_bytes=per_update // 100)
    result = run_fedavg(CFG, policy, fleet)
    assert result.ratio >= 99.0  # counted on the wire: every chunk byte
    assert result.final_accuracy >= baseline.final_accuracy - 0.02
    # The curve follows the baseline's, not just its end point.
    assert np.mean(result.accuracy[-5:]) >= np.mean(baseline.accuracy[-5:]) - 0.02


def test_local_sgd_reduces_the_training_error(fleet):
    dev = fleet.devices[0]
    x = dev.images.reshape(len(dev.labels), -1)
    p0 = init_params(64, 32, 10, seed=1)
    p1 = local_sgd(
        p0, x, dev.labels, FedConfig(hidden=32, local_epochs=5, lr=0.3), np.random.default_rng(0)
    )
    assert accuracy(p1, x, dev.labels) > accuracy(p0, x, dev.labels) + 0.3
