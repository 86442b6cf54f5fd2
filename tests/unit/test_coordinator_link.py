"""Being heard by the coordinator (agent/link.py) and the coordinator's answers that tell a
device so (protocol/hello.py): the resend schedule, a refusal's immediate resend, the
problem text and link.json, with an injected clock."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edge_agent import keys
from edge_agent.agent.link import LINK_FILE, REFUSAL_GAP_S, CoordinatorLink, read_link
from edge_agent.protocol import (
    Kind,
    Reason,
    Rejection,
    ReplayWindow,
    SequenceCounter,
    Signer,
    Topics,
    TrustStore,
    Verifier,
)
from edge_agent.protocol.hello import ANSWER_WITHIN_S, ask_for_hello, hello_answer


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def link(tmp_path: Path, clock: Clock, silence_s: float = 60.0) -> CoordinatorLink:
    return CoordinatorLink(path=tmp_path / LINK_FILE, fleet="farm", hello_topic="edgeft/v1/farm/devices/d/hello",
                           silence_s=silence_s, clock=clock, wall=lambda: 1.7e9 + clock.t)


def test_an_unanswered_hello_is_a_problem_after_the_silence_and_is_sent_again_less_and_less_often(tmp_path):
    clock = Clock()
    lk = link(tmp_path, clock)
    lk.hello_sent()
    assert not lk.hello_due() and lk.problem() is None and lk.status() == ""
    clock.t += 59.9
    assert not lk.hello_due() and lk.problem() is None
    clock.t += 0.1
    text = lk.problem()
    assert text and "has not answered this device's hello for 60 s" in text and "make-certs acl --fleet farm" in text
    assert "coordinator silent" in lk.status()
    assert read_link(tmp_path / LINK_FILE)["problem"] == text  # what `run --check` prints
    sent_at = []
    for _ in range(1000):  # the resend intervals double: 60, 120, 240 ... capped at an hour
        if lk.hello_due():
            lk.hello_sent()
            sent_at.append(clock.t)
        clock.t += 30.0
    gaps = [b - a for a, b in zip(sent_at, sent_at[1:], strict=False)]
    assert gaps[:5] == [120.0, 240.0, 480.0, 960.0, 1920.0] and max(gaps) == 3600.0, gaps
    lk.heard("cmd hello-7")
    assert lk.problem() is None and lk.status() == "" and not lk.hello_due()
    doc = read_link(tmp_path / LINK_FILE)
    assert doc["problem"] is None and doc["waiting_since"] is None and doc["acknowledged_at"] == 1.7e9 + clock.t


def test_a_refusal_as_unknown_sends_the_hello_again_once_per_burst(tmp_path):
    clock = Clock()
    lk = link(tmp_path, clock, silence_s=3600)
    lk.hello_sent()
    lk.heard("cmd hello-1")
    clock.t += 1.0
    lk.refused("unknown_key", "the coordinator does not know device d")
    assert lk.hello_due()  # at once, although the last hello went out a second ago
    lk.hello_sent()
    for _ in range(5):  # the same burst (one per state): no more hellos
        clock.t += 1.0
        lk.refused("unknown_key", "again")
        assert not lk.hello_due()
    clock.t += REFUSAL_GAP_S
    lk.refused("unknown_key", "still")
    assert lk.hello_due()
    lk.refused("bad_signature", "not about who we are")  # other reasons do not ask for a hello
    lk.hello_sent()
    clock.t += REFUSAL_GAP_S
    lk.refused("bad_signature", "x")
    assert not lk.hello_due()


def test_link_json_is_written_crash_safe_and_read_back_defensively(tmp_path):
    clock = Clock()
    lk = link(tmp_path, clock)
    lk.hello_sent()
    doc = json.loads((tmp_path / LINK_FILE).read_text())
    assert doc["hello_topic"] == "edgeft/v1/farm/devices/d/hello" and doc["hellos_sent"] == 1
    (tmp_path / LINK_FILE).write_bytes(b"\x00" * 64)  # what an SD card leaves after a power cut
    assert read_link(tmp_path / LINK_FILE) is None
    assert read_link(tmp_path / "absent.json") is None


def sides(tmp_path: Path) -> tuple[Signer, Topics, keys.Ed25519PrivateKey, Verifier]:
    topics = Topics(fleet="farm")
    coord = keys.generate_private_key()
    signer = Signer(key=coord, topics=topics, sequence=SequenceCounter(path=tmp_path / "seq"))
    trust = TrustStore()
    trust.add(coord.public_key(), role="coordinator")
    device_verifier = Verifier(topics=topics, trust=trust, replay=ReplayWindow(directory=tmp_path / "replay"))
    return signer, topics, coord, device_verifier


def test_the_coordinator_answers_a_fresh_hello_with_a_ping_and_a_retained_old_one_with_nothing(tmp_path):
    from edge_agent.config import public_key_text

    signer, topics, _, device_verifier = sides(tmp_path)
    dev = keys.generate_private_key()
    dev_id = keys.fingerprint(dev)
    dev_signer = Signer(key=dev, topics=topics, sequence=SequenceCounter(path=tmp_path / "dseq"))
    hello_topic = topics.device(dev_id, "hello")
    coord_trust = TrustStore()
    coord_view = Verifier(topics=topics, trust=coord_trust, replay=None)
    hello = coord_view.open(hello_topic, dev_signer.control(hello_topic, Kind.HELLO,
                                                           {"public_key": public_key_text(dev)}, ttl=86400))
    assert hello.kind is Kind.HELLO, hello
    topic, payload = hello_answer(signer, topics, hello)
    got = device_verifier.open(topic, payload)  # what the agent receives: a ping it can verify
    assert topic == topics.device(dev_id, "cmd") and got.kind is Kind.CMD
    assert got.body == {"cmd_id": f"hello-{hello.seq}", "action": "ping"}
    assert hello_answer(signer, topics, hello, now=hello.issued_at + ANSWER_WITHIN_S + 1) is None


def test_the_coordinator_asks_an_unknown_state_for_its_hello_and_nothing_else(tmp_path):
    signer, topics, _, device_verifier = sides(tmp_path)
    dev_id = keys.fingerprint(keys.generate_private_key())
    for channel, reason, wanted in (("state", Reason.UNKNOWN_KEY, True), ("progress", Reason.UNKNOWN_KEY, True),
                                    ("update", Reason.UNKNOWN_KEY, False), ("state", Reason.BAD_SIGNATURE, False),
                                    ("hello", Reason.UNKNOWN_KEY, False)):
        topic = topics.device(dev_id, channel)
        rej = Rejection(reason, "key is not enrolled", topic, 10, "0" * 64, route=topics.parse(topic),
                        kind="state", sender=dev_id, seq=5)
        reply = ask_for_hello(signer, topics, rej)
        assert (reply is not None) == wanted, (channel, reason)
        if reply:
            got = device_verifier.open(*reply)
            assert reply[0] == topics.device(dev_id, "ack") and got.kind is Kind.REFUSAL
            assert got.body["reason"] == "unknown_key" and "send the hello again" in got.body["detail"]


@pytest.mark.parametrize("silence", [0, -1])
def test_a_link_needs_a_positive_silence(tmp_path, silence):
    with pytest.raises(ValueError):
        link(tmp_path, Clock(), silence_s=silence)
