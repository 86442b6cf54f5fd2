"""The same transport against the embedded amqtt broker used by the demo."""

from __future__ import annotations

import random

import pytest

from edge_agent.protocol import Kind
from edge_agent.transport import Outbox, OutboxKey
from edge_agent.transport.broker import EmbeddedBroker, free_port
from edge_agent.transport.models import ModelDownload, publish_model
from tests.integration.conftest import CoordinatorLoop, DeviceLoop, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def amqtt_broker():
    broker = EmbeddedBroker(port=free_port())
    broker.start()
    yield broker
    broker.stop()


def test_upload_command_and_model_over_the_embedded_broker(amqtt_broker, fleet, tmp_path):
    coord = fleet.coordinator(amqtt_broker.port)
    dev = fleet.device(amqtt_broker.port, enrol=coord)
    server = CoordinatorLoop(fleet, coord).start()
    outbox = Outbox(directory=tmp_path / "outbox")
    key = OutboxKey("demo", dev.id, 0)
    chunks = [random.Random(i).randbytes(50_000) for i in range(4)]
    outbox.put(key, chunks)
    agent = DeviceLoop(fleet, dev, outbox).start()
    assert wait_for(lambda: outbox.get(key) is None, 60)
    assert len(server.log.completed) == 1 and server.log.completed[0].chunks == chunks

    cmd_topic = fleet.topics.device(dev.id, "cmd")
    raw = coord.signer.control(cmd_topic, Kind.CMD, {"cmd_id": "go", "action": "finetune", "job": "demo"}, ttl=600)
    assert coord.client.publish_wait(cmd_topic, raw, timeout=60)
    assert coord.client.publish_wait(cmd_topic, raw, timeout=60)  # replayed
    assert wait_for(lambda: len(agent.commands) == 1 and len(agent.rejections) == 1, 60)
    assert agent.rejections[0].reason == "replayed"
    agent.stop()

    bundle = random.Random(7).randbytes(150_000)
    manifest = publish_model(coord.client, coord.signer, fleet.topics, name="digits", version="v1", bundle=bundle)
    download = ModelDownload(directory=tmp_path / "models", name="digits", version="v1",
                             expected_sha256=manifest["sha256"])
    dev.client.subscribe(download.filter(fleet.topics))  # retained delivery from amqtt
    done = []

    def step() -> bool:
        msg = dev.channel.receive(0.05)
        if msg is not None and not hasattr(msg, "reason"):
            path = download.add(msg)
            done.extend([path] if path else [])
        return bool(done)

    assert wait_for(step, 60, interval=0)
    assert done[0].read_bytes() == bundle
