"""Retention against a real mosquitto: the serving coordinator publishes head-only versions
as patches only (the full archive on demand), and its automatic policy retracts the
retained messages of the versions it prunes, while the kept ones stay fetchable."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import numpy as np
import paho.mqtt.client as mqtt
import pytest

from edge_agent import keys
from edge_agent.coordinator.artefacts import ModelArtefacts
from edge_agent.coordinator.registry import Registry
from edge_agent.coordinator.retention import RetentionPolicy, RetractQueue
from edge_agent.coordinator.service import Coordinator, ServeOptions
from tests.integration.conftest import wait_for

pytestmark = pytest.mark.integration


def retained_versions(port: int, root: str) -> dict[str, int]:
    """publication id (version or version.head) -> retained messages a fresh subscriber gets."""
    sentinel = f"sentinel/{uuid.uuid4().hex}"
    seen: dict[str, int] = {}
    done = threading.Event()

    def on_message(client, userdata, msg):
        if msg.topic == sentinel:
            done.set()
        elif msg.retain and msg.payload:
            parts = msg.topic.split("/")
            i = parts.index("models")
            seen[parts[i + 2]] = seen.get(parts[i + 2], 0) + 1

    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"count-{uuid.uuid4().hex[:6]}")
    client.on_message = on_message
    client.connect("127.0.0.1", port)
    client.loop_start()
    try:
        client.subscribe([(f"{root}/models/#", 1), (sentinel, 1)])
        time.sleep(0.2)
        client.publish(sentinel, b"x", qos=1)
        assert done.wait(60), "the sentinel never came back"
    finally:
        client.loop_stop()
        client.disconnect()
    return seen


@pytest.fixture(scope="module")
def digits_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from edge_agent.sim import scenario as demo

    return demo.ensure_bundle(tmp_path_factory.getbasetemp() / "digits-bundle")


def test_pruned_versions_are_retracted_from_the_broker(mosquitto, topic_prefix: str, tmp_path: Path,
                                                       digits_bundle: Path) -> None:
    state = tmp_path / "coordinator"
    keys.save_private_key(state / "keys" / "coordinator.key", keys.generate_private_key())
    with Registry(state_dir=state) as reg:
        base = ModelArtefacts(reg).register_bundle(digits_bundle, name="digits", version="1")
        head = reg.load_head(base)
        for i in range(1, 6):
            reg.add_model_version(name="digits", version=f"v{i}", head={k: v + np.float32(i) for k, v in head.items()},
                                  parent="1" if i == 1 else f"v{i - 1}", bundle_path=base.bundle_path,
                                  head_only=True, now=base.created_at + i)
    options = ServeOptions(state_dir=state, port=mosquitto.port, fleet="farm", topic_prefix=topic_prefix, tick_s=0.05,
                           retention=RetentionPolicy(keep_versions=2, interval_s=3600), backoff_base=0.05)
    coord = Coordinator(options)
    try:
        coord.client.start()
        assert coord.client.wait_connected(60)
        versions = {m.version: m for m in coord.registry.list_models()}
        coord.publish(versions["1"])
        for i in range(1, 6):  # what a round's new version gets: its head patch only
            coord.publish(versions[f"v{i}"], full=False)
        coord.publish(versions["v2"], full=True)  # a device without the model needed v2 whole
        root = coord.topics.root
        before = retained_versions(mosquitto.port, root)
        assert set(before) == {"1", "v2", *(f"v{i}.head" for i in range(1, 6))}, before
        assert not any(ModelArtefacts(coord.registry).archive_path("digits", f"v{i}").exists() for i in range(1, 6))

        coord.retention._due = 0.0  # due now (the policy runs every hour)

        def pruned() -> bool:
            coord.tick()  # the serve loop's periodic step
            return not RetractQueue(coord.registry).pending() and \
                "pruned_at" in coord.registry.get_model("digits", "v3").metrics

        assert wait_for(pruned, 60)
        after = retained_versions(mosquitto.port, root)
        # kept: the registered bundle, the last 2 (v4, v5); pruned and retracted: v1..v3 (v2's full archive too)
        assert set(after) == {"1", "v4.head", "v5.head"}, after
        assert after["1"] == before["1"]
    finally:
        coord.close()
