"""A full remote-triggered round: `edge-coordinator serve` + three `edge-agent run` processes
+ `edge-coordinator train`, on a real mosquitto and on the embedded amqtt broker."""

from __future__ import annotations

import hashlib
import json
import urllib.request

import numpy as np
import pytest

from edge_agent.coordinator.artefacts import ModelArtefacts
from edge_agent.coordinator.records import JobStatus, RoundState, UpdateStatus
from edge_agent.int8.bundle import HEAD_PARAMS, unpack_bundle
from edge_agent.int8.bundle_patch import apply_patch
from edge_agent.mxparams import load_params, split_names
from edge_agent.protocol import Kind
from edge_agent.transport.broker import free_port
from edge_agent.transport.models import ModelDownload
from tests.conftest import reference_head
from tests.integration.agents import start_agents
from tests.integration.conftest import (
    online_devices,
    register_digits,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # real agents train: ~30 s each
TRAIN = ("train", "--model", "digits", "--devices", "all", "--rounds", "1", "--min-devices", "3", "--deadline", "600s",
         "--epochs", "1", "--batch-size", "16", "--budget-wh", "1", "--update-bytes", "1024", "--poll", "0.3")


def run_round(coordinator, agents_, tmp_path, archive):
    register_digits(coordinator, archive, tmp_path)
    assert wait_for(lambda: len(online_devices(coordinator)) == 3, 90), \
        coordinator.log_tail() + "\n".join(a.log_tail(1500) for a in agents_)
    done = coordinator.cli(*TRAIN, check=False, timeout=900)  # the round closes once all 3 report
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{coordinator.log_tail()}\n" + \
        "\n".join(a.log_tail(2000) for a in agents_)
    return done.stdout


def check_round(coordinator, agents_, stdout):
    """The job ran one aggregated round from 3 accepted updates, and the new head is exactly
    base + what the job's rule computes from the stored deltas by its dense reference
    (strategies/; the default for 3 devices without a server set: median_trust)."""
    assert "round 1/1 open" in stdout and "-> new version" in stdout, stdout
    with coordinator.registry() as reg:
        (job,) = reg.list_jobs()
        assert job.status is JobStatus.DONE, job
        assert job.params["aggregator"] == "median_trust", job.params
        (rnd,) = reg.list_rounds(job.id)
        assert rnd.state is RoundState.AGGREGATED and rnd.dropouts == {}
        updates = reg.list_updates(job.id, 1)
        assert sorted(u.device_id for u in updates) == sorted(a.id for a in agents_)
        assert all(u.status is UpdateStatus.ACCEPTED and u.num_samples > 0 and u.wire_bytes > 0 for u in updates)
        assert all(0 <= u.metrics["accuracy_after"] <= 1 for u in updates)  # the device's result rode along
        base, new = reg.get_model("digits", "1"), reg.get_model("digits", rnd.aggregated_version)
        assert new.head_only and new.parent == "1" and new.metrics["updates"] >= 1
        expected = reference_head(reg, job.id, 1)
        head = reg.load_head(new)
        for name, value in expected.items():
            np.testing.assert_allclose(head[name], value, rtol=1e-6, atol=1e-7)
        assert any(not np.array_equal(head[n], reg.load_head(base)[n]) for n in head)

        def engines():  # learnt from each device's state, published once its job is done
            devices = {d.id: d for d in reg.list_devices()}
            return all(devices[a.id].engine for a in agents_)

        assert wait_for(engines, 30), [d.state for d in reg.list_devices()]
    return job, new, head


def fetch_published(fleet, port, name, version, tmp_path):
    """A fresh device-side download of the retained, signed bundle of `version`."""
    side = fleet.device(port, name="fetcher")
    download = ModelDownload(directory=tmp_path / "fetched", name=name, version=version)
    side.client.subscribe(download.filter(fleet.topics))
    got = []

    def step():
        msg = side.channel.receive(0.05)
        if msg is not None and getattr(msg, "kind", None) in (Kind.MANIFEST, Kind.MODEL_CHUNK):
            path = download.add(msg)
            got.extend([path] if path else [])
        return bool(got)

    assert wait_for(step, 30, interval=0)
    return got[0], download.manifest


def test_full_round_with_three_agents_on_mosquitto(mosquitto, fleet, agents, serve, tmp_path, digits_bundle):
    bundle_dir, archive = digits_bundle
    metrics_port = free_port()
    coordinator = serve(mosquitto.port, extra=("--metrics-port", str(metrics_port))).start()
    agents_ = start_agents(agents, tmp_path, mosquitto.port, 3)
    stdout = run_round(coordinator, agents_, tmp_path, archive)
    job, new, head = check_round(coordinator, agents_, stdout)

    # the new version's head patch is published, retained and signed: a device that runs version 1
    # and was offline fetches it later (a few KiB); the full archive is built only on demand
    # (for a device that runs no version of the model), so it is neither on disk nor retained
    patch_path, patch_manifest = fetch_published(fleet, mosquitto.port, "digits", f"{new.version}.head", tmp_path)
    local = coordinator.state_dir / "bundles" / "digits" / f"{new.version}.tar.gz"
    assert not local.exists() and patch_manifest["meta"]["patch_of"] == new.version
    bundle = apply_patch(patch_path, bundle_dir, tmp_path / "patched")
    assert bundle.manifest.version == new.version and bundle.manifest.parent_version == "1"
    published_head, _ = split_names(load_params(bundle.read(HEAD_PARAMS)))
    for name, value in head.items():
        np.testing.assert_array_equal(published_head[name], value)
    with coordinator.registry() as reg:  # built on demand: the bytes the commands' sha256 pinned
        full = ModelArtefacts(reg).archive_for(new)
    assert hashlib.sha256(full.path.read_bytes()).hexdigest() == patch_manifest["meta"]["full_sha256"]
    assert patch_manifest["size"] * 5 < full.size
    assert unpack_bundle(full.path, tmp_path / "unpacked").sha256 == bundle.sha256

    # the operator's view
    devices = coordinator.cli("devices").stdout
    assert devices.count("90%") == 3 and "Raspberry Pi 4" in devices, devices
    status = coordinator.cli("status", job.id).stdout
    assert "3 accepted, 0 rejected, 0 dropout(s)" in status, status
    assert new.version in coordinator.cli("models").stdout
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    assert 'edge_coordinator_rounds_total{status="aggregated"} 1.0' in text
    assert 'edge_coordinator_updates_total{status="accepted"} 3.0' in text
    assert all(a.alive for a in agents_) and coordinator.alive

    # an agent that stops says so; the coordinator keeps what it last reported
    agents_[0].stop()

    def gone():
        rows = {d["id"]: d for d in json.loads(coordinator.cli("devices", "--json").stdout)}
        return not rows[agents_[0].id]["online"] and rows[agents_[0].id]["battery_pct"] == 90

    assert wait_for(gone, 60), coordinator.cli("devices").stdout


def test_the_same_round_on_the_embedded_broker(fleet, agents, serve, tmp_path, digits_bundle):
    _, archive = digits_bundle
    port = free_port()
    coordinator = serve(port, embedded=True).start()
    agents_ = start_agents(agents, tmp_path, port, 3)
    stdout = run_round(coordinator, agents_, tmp_path, archive)
    _, new, _ = check_round(coordinator, agents_, stdout)
    path, manifest = fetch_published(fleet, port, "digits", f"{new.version}.head", tmp_path)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == manifest["sha256"]
    assert coordinator.alive
