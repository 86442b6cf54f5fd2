"""The MQTT client wrapper against a real mosquitto: reconnects, last will, TLS, limits."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid

import pytest

from edge_agent import keys
from edge_agent.protocol import Kind, Message
from edge_agent.transport import MqttClient, TlsConfig
from edge_agent.transport.broker import MosquittoBroker, free_port, make_test_tls
from tests.integration.conftest import FAST, wait_for

pytestmark = pytest.mark.integration


def client(port: int, *subs: str, **kw) -> MqttClient:
    return MqttClient(host="127.0.0.1", port=port, client_id=f"c-{uuid.uuid4().hex[:8]}", subscriptions=subs,
                      **{**FAST, **kw})


def test_subscriptions_survive_a_broker_restart(mosquitto, topic_prefix):
    with client(mosquitto.port, f"{topic_prefix}/x/#") as sub, client(mosquitto.port) as pub:
        assert sub.wait_connected(60) and pub.wait_connected(60)
        assert pub.publish_wait(f"{topic_prefix}/x/1", b"before", timeout=60)
        assert sub.get(60).payload == b"before"
        mosquitto.restart()
        assert wait_for(lambda: sub.stats["connects"] == 2 and pub.stats["connects"] == 2, 60)
        # wait_connected: back, and the broker has confirmed the subscriptions again
        assert sub.wait_connected(60) and pub.wait_connected(60)
        assert pub.publish_wait(f"{topic_prefix}/x/2", b"after", timeout=60)
        got = sub.get(60)
        assert (got.topic, got.payload) == (f"{topic_prefix}/x/2", b"after")
    assert not sub.connected


def test_publishing_while_disconnected_is_refused_not_queued(tmp_path, topic_prefix):
    port = free_port()
    with client(port) as c:
        assert wait_for(lambda: c.stats["connect_failures"] >= 3, 60)  # backing off, not spinning
        assert c.stats["connect_failures"] < 200
        assert c.publish(f"{topic_prefix}/x", b"lost?") is None
        assert c.publish_wait(f"{topic_prefix}/x", b"lost?", timeout=0.2) is False
        with MosquittoBroker(workdir=tmp_path / "b", port=port), client(port, f"{topic_prefix}/#") as sub:
            assert c.wait_connected(60) and sub.wait_connected(60)
            assert c.publish_wait(f"{topic_prefix}/x", b"now", timeout=60)
            assert c.publish_wait(f"{topic_prefix}/x", b"sentinel", timeout=60)
            # one publisher's messages stay in order: nothing came between (no replayed "lost?")
            assert [sub.get(60).payload for _ in range(2)] == [b"now", b"sentinel"]
            assert c.stats["connects"] == 1


WILL_SCRIPT = textwrap.dedent("""
    import sys, time
    from edge_agent import keys
    from edge_agent.protocol import Kind, SequenceCounter, Signer, Topics
    from edge_agent.transport import MqttClient, Will
    key_path, seq_path, prefix, port = sys.argv[1:5]
    key = keys.load_private_key(key_path)
    topics = Topics(fleet="farm", prefix=prefix)
    signer = Signer(key=key, topics=topics, sequence=SequenceCounter(path=seq_path))
    state = topics.device(keys.fingerprint(key), "state")
    def will():
        return Will(state, signer.control(state, Kind.STATE, {"status": "offline"}, ttl=86400))
    c = MqttClient(host="127.0.0.1", port=int(port), client_id="dev-proc", will=will, keepalive=5)
    c.start()
    assert c.wait_connected(60)
    assert c.publish_wait(state, signer.control(state, Kind.STATE, {"status": "online"}, ttl=86400), retain=True, timeout=60)
    print("READY", flush=True)
    time.sleep(60)
""")


def test_a_killed_device_leaves_a_signed_retained_offline_state(mosquitto, fleet, tmp_path):
    dev_key = keys.generate_private_key()
    keys.save_private_key(tmp_path / "dev.key", dev_key)
    coord = fleet.coordinator(mosquitto.port)
    coord.trust.add(dev_key.public_key(), role="device")
    proc = subprocess.Popen([sys.executable, "-c", WILL_SCRIPT, str(tmp_path / "dev.key"), str(tmp_path / "dev.seq"),
                             fleet.topics.prefix, str(mosquitto.port)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "READY"
        online = coord.channel.receive(60)
        assert isinstance(online, Message) and online.body["status"] == "online"
        proc.kill()  # power cut: no DISCONNECT, so the broker publishes the will
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    offline = coord.channel.receive(60)
    assert isinstance(offline, Message), offline
    assert offline.kind is Kind.STATE and offline.body["status"] == "offline" and offline.sender == keys.fingerprint(dev_key)
    # Retained: a coordinator that starts later learns the device is offline.
    late = fleet.coordinator(mosquitto.port)
    late.trust.add(dev_key.public_key(), role="device")
    again = late.channel.receive(60)
    assert isinstance(again, Message) and again.body["status"] == "offline"


def test_tls_needs_the_right_ca(tmp_path, topic_prefix):
    tls = make_test_tls(tmp_path / "tls")
    with MosquittoBroker(workdir=tmp_path / "b", tls=tls) as broker:
        with client(broker.port, f"{topic_prefix}/#", tls=TlsConfig(ca_certs=tls.cafile)) as good:
            assert good.wait_connected(60)
            assert good.publish_wait(f"{topic_prefix}/t", b"secret", timeout=60)
            assert good.get(60).payload == b"secret"
        with client(broker.port, tls=TlsConfig()) as untrusting, client(broker.port) as plain:
            # refused, twice each: the handshake fails / the broker drops the plain connection
            assert wait_for(lambda: untrusting.stats["connect_failures"] >= 2 and plain.stats["disconnects"] >= 2, 60)
            assert not untrusting.connected and untrusting.stats["connects"] == 0
            assert not plain.connected and plain.stats["connects"] == 0


def test_oversized_messages_and_a_full_inbox_are_counted_not_fatal(mosquitto, topic_prefix):
    with client(mosquitto.port, f"{topic_prefix}/#", max_payload=1000, inbox_size=2) as sub, \
            client(mosquitto.port) as pub:
        assert sub.wait_connected(60) and pub.wait_connected(60)
        assert pub.publish_wait(f"{topic_prefix}/big", b"x" * 2000, timeout=60)
        for i in range(5):
            assert pub.publish_wait(f"{topic_prefix}/small", str(i).encode(), timeout=60)
        assert wait_for(lambda: sub.stats["dropped_inbox_full"] == 3 and sub.stats["dropped_oversize"] == 1, 60)
        assert [sub.get(60).payload for _ in range(2)] == [b"3", b"4"]  # the oldest went, not the newest
        assert pub.publish_wait(f"{topic_prefix}/small", b"still here", timeout=60)
        assert sub.get(60).payload == b"still here" and sub.connected


def test_a_full_inbox_drops_junk_then_resendable_then_one_shot_messages(mosquitto, topic_prefix):
    """Lanes by what a loss costs: junk first, then what its sender resends (update chunks,
    states), a one-shot report (a dropout) last; a message less important than all that waits
    is itself dropped. get() still returns arrival order across lanes."""
    def admit(topic: str, payload: bytes) -> str:
        return topic.rsplit("/", 1)[1]

    with client(mosquitto.port, f"{topic_prefix}/#", inbox_size=4, admit=admit) as sub, \
            client(mosquitto.port) as pub:
        assert sub.wait_connected(60) and pub.wait_connected(60)
        sent = ["p1/priority", "r1/resend", "r2/resend", "b1/bulk", "r3/resend", "b2/bulk",
                "p2/priority", "p3/priority", "p4/priority", "p5/priority"]
        for i, name in enumerate(sent, 1):
            body, lane = name.split("/")
            assert pub.publish_wait(f"{topic_prefix}/{lane}", body.encode(), timeout=60)
            assert wait_for(lambda i=i: sub.stats["received"] >= i, 60)  # in order, one at a time
        assert (sub.stats["dropped_inbox_full"], sub.stats["dropped_resend_full"],
                sub.stats["dropped_priority_full"]) == (2, 3, 1)  # b1, b2 | r1, r2, r3 | p1 (only p's left)
        assert [sub.get(60).payload for _ in range(4)] == [b"p2", b"p3", b"p4", b"p5"]
        for body, lane in (("r4", "resend"), ("p6", "priority"), ("b3", "bulk")):
            assert pub.publish_wait(f"{topic_prefix}/{lane}", body.encode(), timeout=60)
        assert [sub.get(60).payload for _ in range(3)] == [b"r4", b"p6", b"b3"]
        assert sub.pending == 0


def test_constructor_arguments_are_validated():
    for bad in [{"port": 0}, {"client_id": ""}, {"keepalive": 1}, {"backoff_base": 0}, {"inbox_size": 0}]:
        with pytest.raises(ValueError):
            MqttClient(**{"host": "127.0.0.1", "port": 1883, "client_id": "x", **bad})
    with pytest.raises(ValueError):
        MqttClient(host="127.0.0.1", port=1883, client_id="x", subscriptions=[""])


def test_paho_running_once_more_after_our_disconnect_is_not_an_error(caplog):
    """paho's network thread may call its loop once after the socket closed: it logs "Client
    is not connected" at ERROR. While the wrapper winds a session down that is expected, and
    a clean SIGTERM must log no error (test_pg_workers saw one in CI); at any other time it stays an ERROR."""
    import logging

    c = client(1)  # never started: paho's socket is None, as in that race
    with caplog.at_level(logging.DEBUG, logger="edge_agent.transport.mqtt.paho"):
        c._winding_down.set()  # noqa: SLF001 - the wrapper's own state during a disconnect
        c._client._loop(0)  # noqa: SLF001 - what paho's thread runs
        c._winding_down.clear()  # noqa: SLF001
        c._client._loop(0)  # noqa: SLF001
    levels = [r.levelname for r in caplog.records if r.getMessage().startswith("Client is not connected")]
    assert levels == ["DEBUG", "ERROR"]
