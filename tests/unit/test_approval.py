"""Approving devices: a pending device is shown with the name it announced, its online
state, when it was last heard from and its enrolment code; its messages are verified
against the key it enrolled with, logged once as pending approval and never recorded as
fact; `approve` / `tag` take an id, a unique id prefix, the enrolment code or a unique
name. Real registry, real signatures, the real coordinator's message handling (no broker:
messages go straight from a device's Signer into the coordinator's verifier)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from edge_agent import keys
from edge_agent.config import public_key_text
from edge_agent.coordinator.cli import main
from edge_agent.coordinator.pending import HEARD_EVERY_S, PendingDevices
from edge_agent.coordinator.registry import Registry
from edge_agent.coordinator.service import Coordinator, ServeOptions
from edge_agent.errors import InputError
from edge_agent.protocol import (
    Kind,
    Message,
    Reason,
    Rejection,
    SequenceCounter,
    Signer,
    Topics,
    TrustStore,
    Verifier,
)
from edge_agent.transport.uplink import rejection_ack

FLEET = "farm"


class Device:
    """A device's signing side: its key and the messages it would publish."""

    def __init__(self, tmp: Path, name: str, topics: Topics) -> None:
        self.key = keys.generate_private_key()
        self.id = keys.fingerprint(self.key)
        self.name, self.topics = name, topics
        (tmp / self.id).mkdir(parents=True)
        self.signer = Signer(key=self.key, topics=topics, sequence=SequenceCounter(path=tmp / self.id / "seq"))

    def msg(self, channel: str, kind: Kind, body: dict, *, clock: float | None = None) -> tuple[str, bytes]:
        topic = self.topics.device(self.id, channel)
        if clock is not None:  # a message issued then (a retained copy re-delivered later)
            self.signer._clock = lambda: clock
        try:
            return topic, self.signer.control(topic, kind, body, ttl=86400)
        finally:
            self.signer._clock = time.time

    def hello(self, **kw: float) -> tuple[str, bytes]:
        body = {"public_key": public_key_text(self.key), "agent": "test",
                "info": {"name": self.name, "board": "Test Board", "profile": "raspberry-pi-4"}}
        return self.msg("hello", Kind.HELLO, body, **kw)

    def state(self, status: str = "idle", **kw: float) -> tuple[str, bytes]:
        body = {"status": status, "agent": "test", "detail": f"status={status} battery_pct=77 name={self.name}"}
        return self.msg("state", Kind.STATE, body, **kw)


@pytest.fixture
def topics() -> Topics:
    return Topics(fleet=FLEET)


def enrol(reg: Registry, dev: Device, *, approved: bool = False, **state: object) -> None:
    reg.enrol_device(device_id=dev.id, public_key=public_key_text(dev.key), fleet=FLEET, approved=approved)
    if state:
        reg.record_state(dev.id, online=True, state=state)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_enrolment_code_of_a_stored_key_is_the_code_the_device_prints() -> None:
    key = keys.generate_private_key()
    code = keys.enrolment_code_of(public_key_text(key))
    assert code == keys.enrolment_code(key) and len(code) == 14
    assert code.replace("-", "").lower() == keys.fingerprint(key)[:12]  # a prefix of the device id
    for bad in ("", "not base64!", "AAAA"):
        with pytest.raises(InputError):
            keys.enrolment_code_of(bad)


def test_record_heard_never_moves_last_seen_back_and_online_follows_the_newest(tmp_path, topics) -> None:
    dev = Device(tmp_path / "dev", "pi", topics)
    with Registry(state_dir=tmp_path / "state") as reg:
        enrol(reg, dev)
        d = reg.record_heard(dev.id, at=1000.0, state={"name": "pi"})
        assert (d.last_seen, d.online, d.state["name"]) == (1000.0, True, "pi")
        d = reg.record_heard(dev.id, at=2000.0, online=False)  # its last will
        assert (d.last_seen, d.online) == (2000.0, False)
        d = reg.record_heard(dev.id, at=1500.0, online=True)  # an older retained hello, re-delivered
        assert (d.last_seen, d.online) == (2000.0, False)
        d = reg.record_heard(dev.id, at=3000.0)
        d = reg.record_heard(dev.id, at=2500.0, online=False)  # its will: signed when it connected
        assert (d.last_seen, d.online) == (3000.0, False)
        with pytest.raises(InputError):
            reg.record_heard("a" * 24, at=1.0)


def test_a_pending_devices_messages_are_verified_with_its_key_and_only_mark_it_heard(tmp_path, topics) -> None:
    dev, forger = Device(tmp_path / "d", "pi", topics), Device(tmp_path / "f", "evil", topics)
    pending = PendingDevices(Verifier(topics=topics, trust=TrustStore(), replay=None), topics)
    with Registry(state_dir=tmp_path / "state") as reg:
        enrol(reg, dev)
        issued = time.time() - 30
        topic, payload = dev.state(clock=issued)
        first = pending.open(topic, payload)
        assert isinstance(first, Rejection) and first.reason == Reason.UNKNOWN_KEY  # not known as pending yet
        pending.add(dev.id, public_key_text(dev.key))
        msg = pending.open(topic, payload)
        assert isinstance(msg, Message) and msg.sender == dev.id
        assert pending.heard(reg, msg) is None
        d = reg.get_device(dev.id)
        assert d.online and abs(d.last_seen - int(issued)) < 1  # its own issue time, not the arrival
        assert "battery_pct" not in d.state and not d.approved  # nothing it says is taken as fact

        # another key on its topic, or its key tampered with, is still refused
        topic_f, payload_f = forger.msg("state", Kind.STATE, {"status": "idle"})
        forged = pending.open(topic, payload_f)
        assert isinstance(forged, Rejection) and forged.reason == Reason.WRONG_SIGNER
        assert isinstance(pending.open(topic, payload.replace(b'"idle"', b'"busy"')), Rejection)
        assert isinstance(pending.open(topic_f, payload_f), Rejection)  # the forger is not pending

        # its last will: offline; its update: answered `rejected, retry`, not stored
        assert pending.heard(reg, pending.open(*dev.state("offline"))) is None
        assert not reg.get_device(dev.id).online
        up_topic = topics.device(dev.id, "update")
        chunk = dev.signer.binary(up_topic, Kind.UPDATE_CHUNK, {"job": "job-1", "round": 1, "upload": "0" * 64,
                                                                 "index": 0, "count": 1, "size": 4}, b"data",
                                  ttl=600)
        reply = pending.heard(reg, pending.open(up_topic, chunk))
        assert isinstance(reply, Rejection) and "pending approval" in reply.detail
        signer = Signer(key=keys.generate_private_key(), topics=topics,
                        sequence=SequenceCounter(path=tmp_path / "coord-seq"))
        ack = rejection_ack(signer, topics, reply)
        assert ack is not None and ack[0] == topics.device(dev.id, "ack") and b'"retry":true' in ack[1]
        assert reg.totals()["updates"] == 0


def test_a_chattering_pending_device_costs_one_registry_write_per_interval(tmp_path, topics) -> None:
    """Each write is an fsync'ed transaction: a pending device's flood (or replays of one of
    its messages: there is no replay window here) must not turn into one write per message."""
    dev = Device(tmp_path / "d", "pi", topics)
    pending = PendingDevices(Verifier(topics=topics, trust=TrustStore(), replay=None), topics)
    with Registry(state_dir=tmp_path / "state") as reg:
        enrol(reg, dev)
        pending.add(dev.id, public_key_text(dev.key))
        t0 = time.time() - 1000
        writes = []
        real = reg.record_heard
        reg.record_heard = lambda *a, **kw: writes.append(kw["at"]) or real(*a, **kw)  # count, then write
        for i in range(50):  # 50 messages in 25 s, then one past the interval
            assert pending.heard(reg, pending.open(*dev.state(clock=t0 + i / 2))) is None
        assert len(writes) == 1, writes
        pending.heard(reg, pending.open(*dev.state(clock=t0 + HEARD_EVERY_S + 1)))
        assert len(writes) == 2 and reg.get_device(dev.id).last_seen >= int(t0 + HEARD_EVERY_S)
        pending.heard(reg, pending.open(*dev.state("offline", clock=t0 + HEARD_EVERY_S + 2)))
        assert len(writes) == 3 and not reg.get_device(dev.id).online  # going offline is written at once


@pytest.fixture
def coordinator(tmp_path):
    coord = Coordinator(ServeOptions(state_dir=tmp_path / "coord", fleet=FLEET))
    yield coord
    coord.close()


def test_the_coordinator_shows_a_pending_device_and_logs_it_once(tmp_path, topics, coordinator, capsys,
                                                                  caplog) -> None:
    dev = Device(tmp_path / "dev", "barn-pi-1", topics)
    state = str(coordinator.state_dir)
    caplog.set_level(logging.INFO)
    for topic, payload in (dev.hello(), dev.state(), dev.state(), dev.hello(), dev.state()):
        result = coordinator.pending.open(topic, payload)
        assert isinstance(result, Message), result  # the channel logs a Rejection as a drop: none
        coordinator.handle(result)
    lines = [r.getMessage() for r in caplog.records]
    assert sum("pending approval" in line for line in lines) == 1, lines
    assert not [line for line in lines if "unknown_key" in line or "dropped" in line], lines
    assert keys.enrolment_code(dev.key) in next(line for line in lines if "pending approval" in line)

    code, out, _ = run(capsys, "devices", "--state-dir", state)
    assert code == 0
    header, row = out.splitlines()[0], next(line for line in out.splitlines() if line.startswith(dev.id))
    assert header.split()[:5] == ["ID", "CODE", "NAME", "APPROVED", "ONLINE"]
    assert row.split()[1:5] == [keys.enrolment_code(dev.key), "barn-pi-1", "PENDING", "yes"], row
    assert row.endswith("s ago"), row
    assert "battery_pct" not in coordinator.registry.get_device(dev.id).state

    # approved by the name it announced: from the next sync on, its state is taken
    code, out, _ = run(capsys, "approve", "barn-pi-1", "--state-dir", state)
    assert code == 0 and f"approved {dev.id}" in out and keys.enrolment_code(dev.key) in out
    coordinator.tick()
    result = coordinator.pending.open(*dev.state())
    coordinator.handle(result)
    assert coordinator.registry.get_device(dev.id).state["battery_pct"] == 77


def test_approve_and_tag_take_an_id_prefix_code_or_unique_name(tmp_path, topics, capsys) -> None:
    state = tmp_path / "state"
    a, b, c = (Device(tmp_path / n, n, topics) for n in ("pi-a", "pi-b", "pi-c"))
    with Registry(state_dir=state) as reg:
        enrol(reg, a, name="barn")
        enrol(reg, b, name="field")
        enrol(reg, c, name="field")  # two devices announced the same name
    s = ("--state-dir", str(state))

    assert run(capsys, "approve", "barn", *s)[0] == 0
    assert run(capsys, "tag", "barn", "north", *s)[1].startswith(f"{a.id}: tags north")
    assert run(capsys, "approve", keys.enrolment_code(b.key).lower(), *s)[0] == 0  # code, any case
    assert run(capsys, "tag", c.id[:8], "south", *s)[0] == 0
    with Registry(state_dir=state) as reg:
        assert reg.get_device(a.id).approved and reg.get_device(b.id).approved
        assert not reg.get_device(c.id).approved
        assert reg.get_device(a.id).tags == ("north",) and reg.get_device(c.id).tags == ("south",)

    # ambiguous: exit 64, one line listing every match, nothing changed
    for cmd in (("approve", "field"), ("tag", "field", "x")):
        code, out, err = run(capsys, *cmd, *s)
        assert code == 64 and out == "", (code, out, err)
        assert "matches 2 devices" in err and b.id in err and c.id in err and len(err.strip().splitlines()) == 1
    with Registry(state_dir=state) as reg:
        assert not reg.get_device(c.id).approved and "x" not in reg.get_device(b.id).tags
    code, _, err = run(capsys, "approve", "nobody", *s)
    assert code == 65 and "no enrolled device matches 'nobody'" in err
