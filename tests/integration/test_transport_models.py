"""Model bundles: published retained and signed, downloaded in chunks, verified, resumable."""

from __future__ import annotations

import hashlib
import random

import pytest

from edge_agent.protocol import Kind, Message, Reason, Rejection
from edge_agent.transport.models import ModelDownload, publish_model, retract_model
from tests.integration.conftest import wait_for

pytestmark = pytest.mark.integration


def drain_into(side, download: ModelDownload, timeout: float = 10.0):
    """Feed verified messages to the download until it completes; returns (path, rejections)."""
    rejections: list[Rejection] = []
    done: list = []

    def step() -> bool:
        result = side.channel.receive(timeout=0.05)
        if isinstance(result, Rejection):
            rejections.append(result)
        elif isinstance(result, Message):
            path = download.add(result)
            if path is not None:
                done.append(path)
        return bool(done)

    wait_for(step, timeout, interval=0)
    return (done[0] if done else None), rejections


def test_a_device_downloads_verifies_and_installs_a_bundle(mosquitto, fleet, tmp_path):
    coord = fleet.coordinator(mosquitto.port)
    bundle = random.Random(5).randbytes(300_000)
    manifest = publish_model(coord.client, coord.signer, fleet.topics, name="digits", version="v2", bundle=bundle,
                             chunk_bytes=64 * 1024, meta={"arch": "mlp"})
    assert manifest["chunks"] == 5 and manifest["sha256"] == hashlib.sha256(bundle).hexdigest()

    # The device comes online later: the retained messages are waiting for it.
    dev = fleet.device(mosquitto.port)
    download = ModelDownload(directory=tmp_path / "models", name="digits", version="v2",
                             expected_sha256=manifest["sha256"])
    dev.client.subscribe(download.filter(fleet.topics))
    path, rejections = drain_into(dev, download)
    assert path == tmp_path / "models" / "digits" / "v2.bundle"
    assert path.read_bytes() == bundle and rejections == []
    assert not (tmp_path / "models" / ".partial" / "digits" / "v2").exists()


def test_a_forged_chunk_is_refused_and_the_download_resumes_after_a_restart(mosquitto, fleet, tmp_path):
    coord = fleet.coordinator(mosquitto.port)
    bundle = random.Random(6).randbytes(200_000)
    manifest = publish_model(coord.client, coord.signer, fleet.topics, name="kws", version="v1", bundle=bundle)
    # Someone overwrites the retained chunk 1 with a copy signed by their own key.
    intruder = fleet.device(mosquitto.port, name="intruder")
    topic = fleet.topics.model_chunk("kws", "v1", 1)
    forged = intruder.signer.binary(topic, Kind.MODEL_CHUNK, {"name": "kws", "version": "v1",
                                                              "sha256": manifest["sha256"], "index": 1,
                                                              "count": manifest["chunks"]}, b"\0" * 1000, ttl=60)
    assert intruder.client.publish_wait(topic, forged, retain=True)

    dev = fleet.device(mosquitto.port)
    download = ModelDownload(directory=tmp_path / "models", name="kws", version="v1")
    dev.client.subscribe(download.filter(fleet.topics))
    path, rejections = drain_into(dev, download, timeout=2.0)
    assert path is None
    assert [r.reason for r in rejections] == [Reason.UNKNOWN_KEY]
    partial = tmp_path / "models" / ".partial" / "kws" / "v1" / manifest["sha256"]
    assert sorted(p.name for p in partial.iterdir()) == ["00000.chunk", "00002.chunk", "00003.chunk"]

    # The coordinator republishes; the device has restarted meanwhile (a fresh download
    # object over the same directory) and only needs what it lacks.
    publish_model(coord.client, coord.signer, fleet.topics, name="kws", version="v1", bundle=bundle)
    again = ModelDownload(directory=tmp_path / "models", name="kws", version="v1",
                          expected_sha256=manifest["sha256"])
    path, rejections = drain_into(dev, again)
    assert path is not None and path.read_bytes() == bundle

    retract_model(coord.client, fleet.topics, name="kws", version="v1", chunks=manifest["chunks"])
    late = fleet.device(mosquitto.port, name="late")
    late.client.subscribe(download.filter(fleet.topics))
    assert late.client.get(timeout=0.5) is None  # nothing retained any more


def test_a_bundle_other_than_the_commanded_one_is_ignored(mosquitto, fleet, tmp_path):
    coord = fleet.coordinator(mosquitto.port)
    publish_model(coord.client, coord.signer, fleet.topics, name="m", version="v1", bundle=b"new weights" * 100)
    dev = fleet.device(mosquitto.port)
    download = ModelDownload(directory=tmp_path / "models", name="m", version="v1", expected_sha256="0" * 64)
    dev.client.subscribe(download.filter(fleet.topics))
    path, rejections = drain_into(dev, download, timeout=1.0)
    assert path is None and rejections == []
    assert not (tmp_path / "models" / "m").exists()
