"""Model bundles: published retained and signed, downloaded in chunks, verified, resumable."""

from __future__ import annotations

import hashlib
import random
import uuid

import pytest

from edge_agent.protocol import Kind, Message, Reason, Rejection, Topics
from edge_agent.transport.models import ModelDownload, publish_model, retract_model
from tests.integration.conftest import wait_for

pytestmark = pytest.mark.integration


def drain_into(side, download: ModelDownload, topics: Topics, timeout: float = 60.0):
    """Feed verified messages to the download until everything the broker holds for it has
    been read; returns (path or None, rejections).

    "Everything" without a fixed wait: the device itself publishes a sentinel under the
    download's filter after subscribing. The broker queues the retained messages when it
    handles the SUBSCRIBE, and one client's packets are handled in order, so the sentinel
    comes back after all of them (and after anything published and acknowledged before).
    The timeout only bounds a hang."""
    sentinel = f"{topics.model_filter(download.name, download.version)[:-1]}sentinel-{uuid.uuid4().hex[:8]}"
    assert side.client.publish_wait(sentinel, b"sentinel", timeout=60)
    rejections: list[Rejection] = []
    done: list = []
    seen_sentinel: list[bool] = []

    def step() -> bool:
        result = side.channel.receive(timeout=0.05)
        if isinstance(result, Rejection):
            if result.topic == sentinel:
                seen_sentinel.append(True)
            else:
                rejections.append(result)
        elif isinstance(result, Message):
            path = download.add(result)
            if path is not None:
                done.append(path)
        return bool(seen_sentinel)

    assert wait_for(step, timeout, interval=0), "the sentinel never came back"
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
    path, rejections = drain_into(dev, download, fleet.topics)
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
    assert intruder.client.publish_wait(topic, forged, retain=True, timeout=60)

    dev = fleet.device(mosquitto.port)
    download = ModelDownload(directory=tmp_path / "models", name="kws", version="v1")
    dev.client.subscribe(download.filter(fleet.topics))
    path, rejections = drain_into(dev, download, fleet.topics)
    assert path is None
    assert [r.reason for r in rejections] == [Reason.UNKNOWN_KEY]
    partial = tmp_path / "models" / ".partial" / "kws" / "v1" / manifest["sha256"]
    assert sorted(p.name for p in partial.iterdir()) == ["00000.chunk", "00002.chunk", "00003.chunk"]

    # The coordinator republishes; the device has restarted meanwhile (a fresh download
    # object over the same directory) and only needs what it lacks.
    publish_model(coord.client, coord.signer, fleet.topics, name="kws", version="v1", bundle=bundle)
    again = ModelDownload(directory=tmp_path / "models", name="kws", version="v1",
                          expected_sha256=manifest["sha256"])
    path, rejections = drain_into(dev, again, fleet.topics)
    assert path is not None and path.read_bytes() == bundle

    retract_model(coord.client, fleet.topics, name="kws", version="v1", chunks=manifest["chunks"])
    late = fleet.device(mosquitto.port, name="late")
    late.client.subscribe(download.filter(fleet.topics))
    path, rejections = drain_into(late, ModelDownload(directory=tmp_path / "late", name="kws", version="v1"),
                                  fleet.topics)
    assert path is None and rejections == []  # nothing retained any more: the sentinel comes first
    assert late.client.stats["received"] == 1


def test_a_bundle_other_than_the_commanded_one_is_ignored(mosquitto, fleet, tmp_path):
    coord = fleet.coordinator(mosquitto.port)
    publish_model(coord.client, coord.signer, fleet.topics, name="m", version="v1", bundle=b"new weights" * 100)
    dev = fleet.device(mosquitto.port)
    download = ModelDownload(directory=tmp_path / "models", name="m", version="v1", expected_sha256="0" * 64)
    dev.client.subscribe(download.filter(fleet.topics))
    path, rejections = drain_into(dev, download, fleet.topics)
    assert path is None and rejections == []
    assert not (tmp_path / "models" / "m").exists()
