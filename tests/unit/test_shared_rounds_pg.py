"""SharedRoundEngine (coordinator/workers.py): two workers' engines on one PostgreSQL
registry and one state directory, each receiving some of a round's updates; the leader
dies right after the round stopped collecting, the other closes it. The new head equals a
lone RoundEngine's (SQLite) on the same updates, and no update is counted twice. Needs a
throw-away PostgreSQL (tests/pg_cluster.py): skipped without it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edge_agent.coordinator.records import RoundState, UpdateStatus
from edge_agent.coordinator.registry import Registry
from edge_agent.coordinator.rounds import RoundEngine, RoundPolicy
from edge_agent.coordinator.workers import SharedRoundEngine
from edge_agent.updates.codec import compute_delta
from edge_agent.updates.wire import UpdateHeader, encode_update
from tests.unit.test_coordinator_rounds import N_DEV, Clock, fleet, softmax_head, train_locally  # noqa: F401

PARAMS = [{"aggregator": "fedavg_clipped"}, {"aggregator": "trimmed_mean", "trim_fraction": 0.2}]


def setup(reg: Registry, fleet: dict, base: dict[str, np.ndarray]) -> None:  # noqa: F811
    reg.add_model_version(name="digits", version="1", head=base, bundle_path="/srv/bundles/digits-1")
    for did, pub in zip(fleet["ids"], fleet["pubs"], strict=True):
        reg.enrol_device(device_id=did, public_key=pub, fleet="farm", board="rpi4", engine="tflite", approved=True)
        reg.record_state(did, online=True, state={"battery_pct": 80.0, "on_power": False})


def payloads(fleet: dict, base: dict[str, np.ndarray], job: str) -> list[tuple[bytes, int]]:  # noqa: F811
    out = []
    for i in range(N_DEV):
        delta = compute_delta(train_locally(base, fleet["x"][i], fleet["y"][i]), base)
        header = UpdateHeader("digits", "1", job, fleet["ids"][i], 1)
        out.append((encode_update(header, delta, density=0.5, bits=8), len(fleet["y"][i])))
    return out


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: p["aggregator"])
def test_a_round_split_over_two_workers_closes_on_the_survivor_as_one_engine_would(
        params: dict, tmp_path: Path, pg_url: str, fleet: dict) -> None:  # noqa: F811
    base, clock = softmax_head(), Clock()
    shared_dir, lone_dir = tmp_path / "shared", tmp_path / "lone"
    reg_a = Registry(state_dir=shared_dir, db=pg_url, clock=clock)
    reg_b = Registry(state_dir=shared_dir, db=pg_url, clock=clock)
    lone_reg = Registry(state_dir=lone_dir, db="sqlite", clock=clock)
    try:
        setup(reg_a, fleet, base)
        setup(lone_reg, fleet, base)
        policy = RoundPolicy()
        a = SharedRoundEngine(registry=reg_a, policy=policy, clock=clock)
        b = SharedRoundEngine(registry=reg_b, policy=policy, clock=clock)
        lone = RoundEngine(registry=lone_reg, policy=policy, clock=clock)
        job = a.start_job(model_name="digits", model_version="1", min_devices=4, deadline_s=300, params=params)
        lone.start_job(model_name="digits", model_version="1", min_devices=4, deadline_s=300, params=params,
                       job_id=job.id)
        assert a.tick().opened and lone.tick().opened
        ups = payloads(fleet, base, job.id)
        for i, (payload, n) in enumerate(ups):
            worker = a if i % 2 else b  # the broker spreads the devices' messages
            sender = fleet["ids"][i]
            assert worker.receive_update(payload, sender=sender, num_samples=n).status == "accepted"
            assert (b if worker is a else a).receive_update(payload, sender=sender, num_samples=n).status == "duplicate"
            assert lone.receive_update(payload, sender=sender, num_samples=n).status == "accepted"
        assert not a._sums and not b._sums  # workers keep no running sums: the close reads the registry
        reg_a.begin_closing(job.id, 1)  # the leader (a) is killed right after it stopped the round
        reg_a.close()
        (out,) = b.tick().closed  # b leads now
        ref = lone.close_round(job.id, 1)
        assert out.state is RoundState.AGGREGATED and sorted(out.accepted) == sorted(ref.accepted)
        assert len(reg_b.list_updates(job.id, 1, UpdateStatus.ACCEPTED)) == N_DEV
        head, want = reg_b.load_head(out.new_version), lone_reg.load_head(ref.new_version)
        for name in want:
            np.testing.assert_allclose(head[name], want[name], rtol=1e-6, atol=1e-8)
    finally:
        for reg in (reg_a, reg_b, lone_reg):
            reg.close()
