"""Serve workers of a group (coordinator/workers.py, partials.py): two engines on one
PostgreSQL registry and one state directory, each receiving some of a round's updates and
folding them into its own partial, saved to the shared state dir. One worker is killed
(its last folds never saved); the other closes the round by merging the partials and reading
only the payloads no partial covers. The new head equals a lone engine's (SQLite) on the same
updates, nothing is counted twice, and nothing is lost. Needs a throw-away PostgreSQL
(tests/pg_cluster.py): skipped without it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edge_agent.coordinator.partials import PartialStore
from edge_agent.coordinator.records import RoundState, UpdateStatus
from edge_agent.coordinator.registry import Registry
from edge_agent.coordinator.rounds import RoundEngine, RoundPolicy
from edge_agent.updates.codec import compute_delta
from edge_agent.updates.wire import UpdateHeader, encode_update
from tests.unit.test_coordinator_rounds import N_DEV, fleet, softmax_head, train_locally  # noqa: F401

PARAMS = [{"aggregator": "fedavg_clipped"}, {"aggregator": "trimmed_mean", "trim_fraction": 0.2},
          {"aggregator": "median_trust"}]


class Clock:
    """Time stands still: a worker saves its partial at its first fold and then at most once a
    second, so its later folds are not in its file when it dies."""

    t = 1_700_000_000.0

    def __call__(self) -> float:
        return self.t


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
        a = RoundEngine(registry=reg_a, policy=policy, clock=clock, worker="a")
        b = RoundEngine(registry=reg_b, policy=policy, clock=clock, worker="b")
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
        saved, _ = PartialStore(shared_dir).load_all(job.id, 1, a.heads.layout("digits", "1"))
        in_a = len(a.aggregation._partials[(job.id, 1)].members)
        assert len(saved["a"].members) == 1 < in_a  # a's later folds never reached its file ...
        reg_a.begin_closing(job.id, 1)  # ... for it is killed right after it stopped the round
        reg_a.close()
        (out,) = b.tick().closed  # b leads now
        ref = lone.close_round(job.id, 1)
        assert out.state is RoundState.AGGREGATED and sorted(out.accepted) == sorted(ref.accepted)
        assert len(reg_b.list_updates(job.id, 1, UpdateStatus.ACCEPTED)) == N_DEV
        b_had = N_DEV - in_a
        assert out.new_version.metrics["folded_at_close"] == N_DEV - b_had - len(saved["a"].members)
        head, want = reg_b.load_head(out.new_version), lone_reg.load_head(ref.new_version)
        for name in want:
            np.testing.assert_allclose(head[name], want[name], rtol=1e-6, atol=1e-8)
        assert not (shared_dir / "partials" / job.id / "r1").exists()  # forgotten with the round
    finally:
        for reg in (reg_a, reg_b, lone_reg):
            reg.close()
