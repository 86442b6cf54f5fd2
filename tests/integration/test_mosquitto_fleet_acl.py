"""The shipped fleet broker config (packaging/mosquitto/edge-agent-fleet.conf + acl) on a
real mosquitto, with certificates issued by packaging/mosquitto/make-certs.

Only the paths and the listener's port are rewritten, and the test checks that nothing
else changed, so it tests the shipped files rather than a copy that could drift; the ACL is
the shipped template rendered for the test's fleet by `make-certs acl`. The broker is started
by edge_agent.transport.broker.MosquittoBroker with this config.

"Never arrives" is proved without sleeps: MQTT keeps one publisher's messages in order, and
a broker routes a QoS 1 message before it acknowledges it, so once a sentinel published
after the forbidden messages has arrived, a forbidden message would have arrived first.
"""

from __future__ import annotations

import os
import socket
import ssl
import threading
import time
import uuid
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from edge_agent import certs, keys
from tests.integration.shipped_broker import SHIPPED_ACL, SHIPPED_CONF, FleetBroker, make_certs

pytestmark = pytest.mark.integration

AWS_CHUNK = 128 * 1024  # the largest chunk the agent sends (AWS IoT Core's limit)
TIMEOUT = 60.0  # bounds a hang only: every wait is for an event
# A device id is its Ed25519 key's fingerprint (edge_agent.keys), and its certificate's CN.
A, B = (keys.fingerprint(keys.generate_private_key()) for _ in range(2))
FLEET_NAME = f"f{uuid.uuid4().hex[:10]}"  # the fleet the ACL is rendered for
OTHER_FLEET = f"edgeft/v1/o{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def cert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("fleet-certs")
    for args in (["init"], ["server", "127.0.0.1"], ["coordinator"], ["device", A, B], ["acl", "--fleet", FLEET_NAME]):
        proc = make_certs(*args, "--dir", d)
        assert proc.returncode == 0, proc.stderr
    return d


@pytest.fixture(scope="module")
def broker(cert_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    b = FleetBroker(workdir=tmp_path_factory.mktemp("mosquitto"), cert_dir=cert_dir)
    b.start()
    yield b
    b.stop()


class Peer:
    """A paho 2.x client that records what it receives and how its connection went."""

    def __init__(self, broker: FleetBroker, name: str, *, cert_dir: Path | None, ca: Path | None = None,
                 tls: bool = True, client_id: str | None = None, clean_session: bool = True) -> None:
        self.name, self.broker = name, broker
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id or f"{name}-{uuid.uuid4().hex[:8]}",
                                  protocol=mqtt.MQTTv311, clean_session=clean_session)
        if tls:
            ca = ca or broker.cert_dir / "ca.pem"
            if cert_dir is None:
                self.client.tls_set(ca_certs=str(ca), cert_reqs=ssl.CERT_REQUIRED)
            else:
                self.client.tls_set(ca_certs=str(ca), certfile=str(cert_dir / f"{name}.pem"),
                                    keyfile=str(cert_dir / f"{name}.key"))
        self.messages: list[tuple[str, bytes]] = []
        self.cond = threading.Condition()
        self.connected, self.disconnected = threading.Event(), threading.Event()
        self.granted: dict[int, list[int]] = {}
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = lambda *a: self.disconnected.set()
        self.client.on_message = self._on_message
        self.client.on_subscribe = self._on_subscribe

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:  # noqa: ANN001
        if not reason_code.is_failure:
            self.connected.set()
        else:
            self.disconnected.set()

    def _on_message(self, client, userdata, msg) -> None:  # noqa: ANN001
        with self.cond:
            self.messages.append((msg.topic, msg.payload))
            self.cond.notify_all()

    def _on_subscribe(self, client, userdata, mid, reason_codes, properties) -> None:  # noqa: ANN001
        with self.cond:
            self.granted[mid] = [rc.value for rc in reason_codes]
            self.cond.notify_all()

    def start(self) -> bool:
        """Connect; False when the broker refuses (TLS handshake or CONNACK) or drops us."""
        try:
            self.client.connect("127.0.0.1", self.broker.port, keepalive=30)
        except (ssl.SSLError, OSError):
            return False
        self.client.loop_start()
        deadline = time.monotonic() + TIMEOUT
        while not (self.connected.is_set() or self.disconnected.is_set()):
            assert time.monotonic() < deadline, f"{self.name}: neither connected nor refused"
            self.connected.wait(0.05)
        return self.connected.is_set() and not self.disconnected.is_set()

    def subscribe(self, *filters: str) -> list[int]:
        result, mid = self.client.subscribe([(f, 1) for f in filters])
        assert result == mqtt.MQTT_ERR_SUCCESS
        with self.cond:
            assert self.cond.wait_for(lambda: mid in self.granted, TIMEOUT)
            return self.granted[mid]

    def publish(self, topic: str, payload: bytes) -> None:
        info = self.client.publish(topic, payload, qos=1)
        info.wait_for_publish(TIMEOUT)
        assert info.is_published(), f"{self.name}: no PUBACK for {topic}"

    def wait_for(self, topic: str, payload: bytes) -> list[tuple[str, bytes]]:
        """Block until (topic, payload) arrives; return everything received up to it."""
        with self.cond:
            assert self.cond.wait_for(lambda: (topic, payload) in self.messages, TIMEOUT), \
                f"{self.name} never got {topic}: {self.messages}"
            return list(self.messages[: self.messages.index((topic, payload)) + 1])

    def stop(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@pytest.fixture
def peers(broker: FleetBroker, cert_dir: Path):
    made: list[Peer] = []

    def make(name: str, **kw: object) -> Peer:
        peer = Peer(broker, name, **{"cert_dir": cert_dir, **kw})  # type: ignore[arg-type]
        made.append(peer)
        return peer

    yield make
    for peer in made:
        peer.stop()


@pytest.fixture
def fleet() -> str:
    return f"edgeft/v1/{FLEET_NAME}"  # the ACL pins every certificate to this one fleet


def connected(make, name: str) -> Peer:  # noqa: ANN001
    peer = make(name)
    assert peer.start(), f"{name} could not connect: {peer.broker.log_tail(1500)}"
    return peer


def test_the_broker_runs_the_shipped_config(broker: FleetBroker) -> None:
    generated = broker.config_path.read_text().splitlines()
    shipped = SHIPPED_CONF.read_text().splitlines()
    changed = [ln for ln in shipped if ln not in generated]
    assert sorted(changed) == sorted(["listener 8883", "cafile /etc/mosquitto/edge-agent/ca.pem",
                                      "certfile /etc/mosquitto/edge-agent/server.pem",
                                      "keyfile /etc/mosquitto/edge-agent/server.key",
                                      "acl_file /etc/mosquitto/edge-agent/acl"])
    assert f"acl_file {broker.cert_dir}/acl" in generated
    # The rendered ACL is the shipped template with only the fleet filled in.
    template, rendered = SHIPPED_ACL.read_text(), (broker.cert_dir / "acl").read_text()
    assert "edgeft/v1/@FLEET@" in template and "@FLEET@" not in rendered
    assert rendered == template.replace("edgeft/v1/@FLEET@", f"edgeft/v1/{FLEET_NAME}")
    assert "+/devices" not in rendered and "v1/#" not in rendered  # no wildcard for the fleet


def test_coordinator_reaches_every_device_and_devices_their_own_topics(peers, fleet: str) -> None:  # noqa: ANN001
    coord, a, b = (connected(peers, n) for n in ("coordinator", A, B))
    assert coord.subscribe(f"{fleet}/devices/+/+") == [1]
    for dev in (a, b):
        assert dev.subscribe(f"{fleet}/devices/{dev.name}/cmd", f"{fleet}/devices/{dev.name}/ack",
                             f"{fleet}/models/#") == [1, 1, 1]
    for dev in (a, b):
        for kind in ("hello", "state", "progress", "update"):
            dev.publish(f"{fleet}/devices/{dev.name}/{kind}", f"{dev.name} {kind}".encode())
    got = coord.wait_for(f"{fleet}/devices/{B}/update", f"{B} update".encode())
    assert {t for t, _ in got} == {f"{fleet}/devices/{d}/{k}" for d in (A, B)
                                   for k in ("hello", "state", "progress", "update")}

    manifest = f"{fleet}/models/digits/3/manifest"
    for dev in (a, b):
        coord.publish(f"{fleet}/devices/{dev.name}/cmd", b"finetune " + dev.name.encode())
        coord.publish(f"{fleet}/devices/{dev.name}/ack", b"ack " + dev.name.encode())
    coord.publish(manifest, b"model v3")
    for dev in (a, b):
        assert dev.wait_for(manifest, b"model v3") == [
            (f"{fleet}/devices/{dev.name}/cmd", b"finetune " + dev.name.encode()),
            (f"{fleet}/devices/{dev.name}/ack", b"ack " + dev.name.encode()),
            (manifest, b"model v3")]


def test_a_device_cannot_read_another_devices_topics(peers, fleet: str) -> None:  # noqa: ANN001
    coord, a, b = (connected(peers, n) for n in ("coordinator", A, B))
    assert coord.subscribe(f"{fleet}/devices/+/+") == [1]
    assert b.subscribe(f"{fleet}/devices/{B}/cmd") == [1]
    # mosquitto 2.0 grants the subscriptions themselves and checks each message against the
    # ACL as it delivers it; what matters is what arrives.
    assert a.subscribe(f"{fleet}/devices/{B}/#", f"{fleet}/devices/{B}/cmd", f"{fleet}/#", "#",
                       f"{fleet}/devices/{A}/cmd") == [1] * 5
    coord.publish(f"{fleet}/devices/{B}/cmd", b"secret command for b")
    coord.publish(f"{fleet}/devices/{B}/ack", b"ack for b")
    b.publish(f"{fleet}/devices/{B}/state", b"b's state")
    b.publish(f"{fleet}/devices/{B}/update", b"b's update")
    b.wait_for(f"{fleet}/devices/{B}/cmd", b"secret command for b")
    coord.wait_for(f"{fleet}/devices/{B}/update", b"b's update")
    coord.publish(f"{fleet}/devices/{A}/cmd", b"sentinel")
    seen = a.wait_for(f"{fleet}/devices/{A}/cmd", b"sentinel")
    assert {topic for topic, _ in seen} == {f"{fleet}/devices/{A}/cmd"}, seen


def test_a_device_cannot_publish_on_another_devices_or_the_coordinators_topics(peers, fleet: str) -> None:  # noqa: ANN001
    coord, a, b = (connected(peers, n) for n in ("coordinator", A, B))
    assert coord.subscribe(f"{fleet}/#") == [1]
    assert b.subscribe(f"{fleet}/devices/{B}/cmd", f"{fleet}/devices/{B}/ack", f"{fleet}/models/#") == [1, 1, 1]
    forged = [f"{fleet}/devices/{B}/{k}" for k in ("cmd", "ack", "hello", "state", "progress", "update")]
    forged += [f"{fleet}/devices/{A}/cmd", f"{fleet}/devices/{A}/ack",  # commands, even to itself
               f"{fleet}/models/digits/4/manifest", f"{fleet}/devices/{A}/other", f"{fleet}/x"]
    for topic in forged:
        a.publish(topic, b"forged by a")  # acknowledged (MQTT 3.1.1) but dropped
    a.publish(f"{fleet}/devices/{A}/state", b"sentinel")
    seen = coord.wait_for(f"{fleet}/devices/{A}/state", b"sentinel")
    assert seen == [(f"{fleet}/devices/{A}/state", b"sentinel")]
    coord.publish(f"{fleet}/devices/{B}/cmd", b"sentinel")
    assert b.wait_for(f"{fleet}/devices/{B}/cmd", b"sentinel") == [(f"{fleet}/devices/{B}/cmd", b"sentinel")]


def test_a_client_without_a_fleet_certificate_cannot_connect(peers, broker: FleetBroker,  # noqa: ANN001
                                                             tmp_path: Path) -> None:
    assert not peers("no-cert", cert_dir=None).start()  # TLS, but no client certificate
    assert not peers("plain", tls=False).start()  # no TLS at all, anonymous
    other = tmp_path / "other-ca"  # a certificate that names a real device, from another CA
    certs.create_ca(other)
    certs.issue(other, A)
    assert not peers(A, cert_dir=other, ca=broker.cert_dir / "ca.pem").start()
    assert connected(peers, A).connected.is_set()  # while the real device A gets in


def test_a_message_over_the_size_limit_is_refused(peers, fleet: str) -> None:  # noqa: ANN001
    coord, a, b = (connected(peers, n) for n in ("coordinator", A, B))
    assert coord.subscribe(f"{fleet}/devices/+/update") == [1]
    topic = f"{fleet}/devices/{A}/update"
    chunk = os.urandom(AWS_CHUNK)
    a.publish(topic, chunk)  # the agent's largest chunk fits
    coord.wait_for(topic, chunk)
    a.client.publish(topic, os.urandom(140 * 1024), qos=1)  # over max_packet_size: dropped with the client
    assert a.disconnected.wait(TIMEOUT)
    b.publish(f"{fleet}/devices/{B}/update", b"sentinel")
    seen = coord.wait_for(f"{fleet}/devices/{B}/update", b"sentinel")
    assert [len(p) for t, p in seen if t == topic] == [AWS_CHUNK]


def test_make_certs_refuses_names_the_acl_cannot_confine(cert_dir: Path) -> None:
    proc = make_certs("device", "coordinator", "--dir", cert_dir)
    assert proc.returncode == 65 and "coordinator's name" in proc.stderr
    proc = make_certs("device", f"{A}/#", "--dir", cert_dir)
    assert proc.returncode == 65 and "letters, digits" in proc.stderr
    proc = make_certs("device", A, "--dir", cert_dir)  # keys are never overwritten silently
    assert proc.returncode == 78 and "--force" in proc.stderr
    helptext = make_certs("--help").stdout
    assert "examples" in helptext and "make-certs device --dir fleet-certs" in helptext


def test_a_device_cannot_take_the_coordinators_or_another_devices_client_id(peers, broker: FleetBroker,  # noqa: ANN001
                                                                             fleet: str) -> None:
    coord = connected(peers, "coordinator")
    assert coord.subscribe(f"{fleet}/devices/+/+") == [1]
    b = connected(peers, B)
    # Device A asks for the coordinator's id (and a persistent session), then for B's id with
    # a last will that would announce B "offline".
    as_coord = peers(A, client_id="coordinator", clean_session=False)
    assert as_coord.start()
    as_b = peers(A, client_id=B)
    as_b.client.will_set(f"{fleet}/devices/{B}/state", b"forged offline will of b", qos=1, retain=True)
    assert as_b.start()
    assert as_coord.disconnected.wait(TIMEOUT)  # both are A: the second A replaced the first
    as_b.client.socket().shutdown(socket.SHUT_RDWR)  # an unclean end: the broker sends the will (if allowed)
    assert as_b.disconnected.wait(TIMEOUT)
    b.publish(f"{fleet}/devices/{B}/state", b"sentinel")
    seen = coord.wait_for(f"{fleet}/devices/{B}/state", b"sentinel")
    assert (f"{fleet}/devices/{B}/state", b"forged offline will of b") not in seen, seen
    assert not coord.disconnected.is_set() and not b.disconnected.is_set()
    log = broker.log_tail(200_000)
    assert f"Client {A} already connected, closing old connection." in log  # the takeover that happened
    assert "Client coordinator already connected" not in log and f"Client {B} already connected" not in log
    assert f"as {A} (" in log and "as coordinator (" in log


def test_a_device_cannot_reach_another_fleets_topics(peers, broker: FleetBroker, fleet: str) -> None:  # noqa: ANN001
    coord, a = (connected(peers, n) for n in ("coordinator", A))
    assert coord.subscribe(f"{fleet}/devices/+/+") == [1]
    assert a.subscribe(f"{fleet}/devices/{A}/cmd", f"{OTHER_FLEET}/devices/{A}/cmd", f"{OTHER_FLEET}/models/#") == [1] * 3
    for kind in ("hello", "state", "progress", "update"):
        a.publish(f"{OTHER_FLEET}/devices/{A}/{kind}", b"cross-fleet")  # acknowledged, then dropped
    coord.publish(f"{OTHER_FLEET}/devices/{A}/cmd", b"cross-fleet command")  # the coordinator is pinned too
    coord.publish(f"{OTHER_FLEET}/models/digits/1/manifest", b"cross-fleet model")
    coord.publish(f"{fleet}/devices/{A}/cmd", b"sentinel")
    assert a.wait_for(f"{fleet}/devices/{A}/cmd", b"sentinel") == [(f"{fleet}/devices/{A}/cmd", b"sentinel")]
    a.publish(f"{fleet}/devices/{A}/state", b"sentinel")
    seen = coord.wait_for(f"{fleet}/devices/{A}/state", b"sentinel")
    assert not [t for t, _ in seen if t.startswith(OTHER_FLEET)], seen
    log = broker.log_tail(200_000)
    denied = [line for line in log.splitlines() if "Denied PUBLISH from " in line]
    for who, topic in [(A, f"{OTHER_FLEET}/devices/{A}/{k}") for k in ("hello", "state", "progress", "update")] + \
            [("coordinator", f"{OTHER_FLEET}/devices/{A}/cmd"), ("coordinator", f"{OTHER_FLEET}/models/digits/1/manifest")]:
        assert any(f"Denied PUBLISH from {who} (" in line and f"'{topic}'" in line for line in denied), (who, topic)


def test_make_certs_acl_refuses_a_fleet_that_is_no_topic_level(tmp_path: Path) -> None:
    for bad in ("+", "a/b", "#", ""):
        proc = make_certs("acl", "--fleet", bad, "--dir", tmp_path)
        assert proc.returncode == 65, (bad, proc.stderr)
    assert not (tmp_path / "acl").exists()


def test_the_coordinators_queue_holds_a_devices_burst_and_other_devices_messages(peers, fleet: str) -> None:  # noqa: ANN001
    """The coordinator away (persistent session) while one device sends 1500 chunks: the
    broker keeps them all and another device's message after them (the old queue limit,
    1000 messages, dropped the rest: what the coordinator would then have missed)."""
    away = peers("coordinator", clean_session=False)
    assert away.start() and away.subscribe(f"{fleet}/devices/+/update") == [1]
    away.stop()
    assert away.disconnected.wait(TIMEOUT)
    a, b = (connected(peers, n) for n in (A, B))
    topic = f"{fleet}/devices/{A}/update"
    for i in range(1500):
        a.client.publish(topic, b"chunk %d" % i, qos=1)
    a.publish(topic, b"last chunk")
    b.publish(f"{fleet}/devices/{B}/update", b"b after the burst")
    back = peers("coordinator", clean_session=False)
    assert back.start()
    seen = back.wait_for(f"{fleet}/devices/{B}/update", b"b after the burst")
    with back.cond:
        assert back.cond.wait_for(lambda: (topic, b"last chunk") in back.messages, TIMEOUT)
        from_a = [p for t, p in back.messages if t == topic]
    assert len(from_a) == 1501 and seen[-1] == (f"{fleet}/devices/{B}/update", b"b after the burst")


def test_serve_workers_have_their_own_certificates_and_do_not_replace_each_other(tmp_path: Path) -> None:
    """Two `serve --workers-group` workers on the shipped config: with one certificate each
    (make-certs worker, and their lines in the ACL) both stay connected and both get the
    coordinator's grant; sharing the coordinator's certificate, the second connection
    replaces the first (the CN is the client id), which is why each needs its own."""
    d = tmp_path / "certs"
    for args in (["init"], ["server", "127.0.0.1"], ["coordinator"], ["worker", "w1", "w2"], ["device", A],
                 ["acl", "--fleet", FLEET_NAME, "--workers", "w1", "w2"]):
        proc = make_certs(*args, "--dir", d)
        assert proc.returncode == 0, (args, proc.stderr)
    assert certs_cn(d / "coordinator-w1.pem") == "coordinator-w1"
    acl = (d / "acl").read_text()
    for user in ("coordinator", "coordinator-w1", "coordinator-w2"):
        assert f"user {user}\ntopic readwrite edgeft/v1/{FLEET_NAME}/#\n" in acl, acl
    broker = FleetBroker(workdir=tmp_path / "mosquitto", cert_dir=d)
    broker.start()
    made: list[Peer] = []
    try:
        fleet = f"edgeft/v1/{FLEET_NAME}"

        def peer(name: str) -> Peer:
            made.append(Peer(broker, name, cert_dir=d))
            assert made[-1].start(), broker.log_tail(1500)
            return made[-1]

        w1, w2, dev = peer("coordinator-w1"), peer("coordinator-w2"), peer(A)
        for w in (w1, w2):  # the group's shared subscription, and each worker's own loopback topic
            assert w.subscribe(f"$share/g/{fleet}/devices/+/+", f"{fleet}/probe/{w.name}") == [1, 1]
            w.publish(f"{fleet}/probe/{w.name}", b"loop " + w.name.encode())
            w.wait_for(f"{fleet}/probe/{w.name}", b"loop " + w.name.encode())
        assert dev.subscribe(f"{fleet}/devices/{A}/cmd") == [1]
        w2.publish(f"{fleet}/devices/{A}/cmd", b"a command from w2")
        dev.wait_for(f"{fleet}/devices/{A}/cmd", b"a command from w2")
        for i in range(6):  # the broker spreads the group's messages over the connected workers
            dev.publish(f"{fleet}/devices/{A}/state", b"state %d" % i)
        states = lambda: sorted(p for w in (w1, w2) for t, p in list(w.messages) if t.endswith("/state"))  # noqa: E731
        assert wait_until(lambda: len(states()) == 6), states()
        assert states() == [b"state %d" % i for i in range(6)]  # each exactly once, to one worker or the other
        assert not w1.disconnected.is_set() and not w2.disconnected.is_set()
        log = broker.log_tail(200_000)
        assert "as coordinator-w1 (" in log and "as coordinator-w2 (" in log
        assert "already connected" not in log, log[-2000:]

        # The failure the workers' certificates avoid: one certificate, two connections.
        first, second = Peer(broker, "coordinator", cert_dir=d), Peer(broker, "coordinator", cert_dir=d)
        made += [first, second]
        assert first.start() and second.start()
        assert first.disconnected.wait(TIMEOUT)
        assert "Client coordinator already connected, closing old connection." in broker.log_tail(200_000)
    finally:
        for p in made:
            p.stop()
        broker.stop()


def certs_cn(pem: Path) -> str:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    cert = x509.load_pem_x509_certificate(pem.read_bytes())
    return cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value


def wait_until(predicate, timeout: float = TIMEOUT) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_make_certs_acl_never_overwrites_silently_and_takes_force(tmp_path: Path) -> None:
    first = make_certs("acl", "--fleet", "farm", "--dir", tmp_path)
    assert first.returncode == 0, first.stderr
    rendered = (tmp_path / "acl").read_text()
    again = make_certs("acl", "--fleet", "farm", "--dir", tmp_path)  # the same ACL again: nothing to refuse
    assert again.returncode == 0 and "unchanged" in again.stdout, again.stderr
    other = make_certs("acl", "--fleet", "farm1", "--dir", tmp_path)
    assert other.returncode == 78, other.stderr
    assert "--force" in other.stderr and "edgeft/v1/farm/#" in other.stderr and "edgeft/v1/farm1/#" in other.stderr
    assert (tmp_path / "acl").read_text() == rendered  # untouched
    forced = make_certs("acl", "--fleet", "farm1", "--force", "--dir", tmp_path)
    assert forced.returncode == 0, forced.stderr
    assert "edgeft/v1/farm1/#" in (tmp_path / "acl").read_text()
    bad = make_certs("acl", "--fleet", "farm", "--no-such-flag", "--dir", tmp_path)
    assert bad.returncode == 64 and "--no-such-flag" in bad.stderr and len(bad.stderr.splitlines()) == 1, bad.stderr
    worker = make_certs("acl", "--fleet", "farm", "--workers", "w/1", "--out", "-")
    assert worker.returncode == 65 and "worker id" in worker.stderr, worker.stderr
    taken = make_certs("device", "coordinator-w1", "--dir", tmp_path)
    assert taken.returncode == 65 and "coordinator's name" in taken.stderr, taken.stderr


def test_devices_read_the_coordinators_key_rotations_and_cannot_forge_one(peers, fleet: str) -> None:  # noqa: ANN001
    """Issue 35, item 3: `key rotate` publishes the new key, signed by the old one, on
    coordinator/key/<old key id>; every device must be able to read it (and none write it)."""
    coord, a, b = (connected(peers, n) for n in ("coordinator", A, B))
    rotation = f"{fleet}/coordinator/key/oldkeyid"
    assert a.subscribe(rotation) == [1]
    assert coord.subscribe(f"{fleet}/coordinator/#") == [1]
    b.publish(rotation, b"forged by b")  # acknowledged (MQTT 3.1.1) but dropped
    coord.publish(rotation, b"new key")
    assert a.wait_for(rotation, b"new key") == [(rotation, b"new key")]
    assert coord.wait_for(rotation, b"new key") == [(rotation, b"new key")]
