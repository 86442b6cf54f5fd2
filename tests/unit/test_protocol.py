"""The fleet protocol: topics, schemas, signatures, validity times, replay protection."""

from __future__ import annotations

import base64
import json
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edge_agent import keys
from edge_agent.atomic import write_checked
from edge_agent.errors import InputError
from edge_agent.protocol import (
    MAX_BINARY_BYTES,
    MAX_CONTROL_BYTES,
    Kind,
    Message,
    Reason,
    Rejection,
    ReplayWindow,
    SequenceCounter,
    Signer,
    Topics,
    TrustStore,
    Verifier,
    canonical_json,
    check_body,
)
from edge_agent.protocol.envelope import _signing_input

NOW = 1_800_000_000.0
UPLOAD = "ab" * 32


class Clock:
    def __init__(self, t: float = NOW) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def env(tmp_path):
    class Env:
        pass

    e = Env()
    e.clock = Clock()
    e.topics = Topics(fleet="farm", prefix="test/edgeft/v1")
    e.ckey, e.dkey, e.other = keys.generate_private_key(), keys.generate_private_key(), keys.generate_private_key()
    e.dev, e.other_dev = keys.fingerprint(e.dkey), keys.fingerprint(e.other)
    e.coord = Signer(key=e.ckey, topics=e.topics, sequence=SequenceCounter(path=tmp_path / "c.seq"), clock=e.clock)
    e.device = Signer(key=e.dkey, topics=e.topics, sequence=SequenceCounter(path=tmp_path / "d.seq"), clock=e.clock)
    e.intruder = Signer(key=e.other, topics=e.topics, sequence=SequenceCounter(path=tmp_path / "o.seq"), clock=e.clock)
    e.trust = TrustStore()
    e.trust.add(e.ckey.public_key(), role="coordinator")
    e.trust.add(e.dkey.public_key(), role="device")
    e.window_dir = tmp_path / "replay"
    e.verifier = Verifier(topics=e.topics, trust=e.trust, replay=ReplayWindow(directory=e.window_dir, clock=e.clock),
                          clock=e.clock)
    e.cmd_topic = e.topics.device(e.dev, "cmd")
    e.cmd = lambda ttl=60, **body: e.coord.control(e.cmd_topic, Kind.CMD, {"cmd_id": "c1", "action": "ping", **body},
                                                   ttl=ttl)
    return e


def resign(key, address: str, envelope: dict) -> bytes:
    """Sign an arbitrary envelope (for messages the Signer itself refuses to make)."""
    envelope = dict(envelope)
    envelope.pop("sig", None)
    envelope["sig"] = base64.b64encode(key.sign(_signing_input(address, b"J", canonical_json(envelope)))).decode()
    return canonical_json(envelope)


def rejected(result, reason: Reason) -> Rejection:
    assert isinstance(result, Rejection), f"expected {reason}, got {result}"
    assert result.reason == reason, str(result)
    return result


# ---- topics ----
def test_topic_layout_and_parsing(env):
    t = env.topics
    assert t.device(env.dev, "state") == f"test/edgeft/v1/farm/devices/{env.dev}/state"
    r = t.parse(t.device(env.dev, "update"))
    assert (r.channel, r.kinds, r.signer, r.device) == ("update", (Kind.UPDATE_CHUNK,), "device", env.dev)
    assert r.address == f"farm/devices/{env.dev}/update"
    m = t.parse(t.model_chunk("digits", "v3", 17))
    assert (m.kinds, m.model, m.version, m.index) == ((Kind.MODEL_CHUNK,), "digits", "v3", 17)
    assert t.parse(t.manifest("digits", "v3")).kinds == (Kind.MANIFEST,)
    assert t.parse(t.device(env.dev, "ack")).kinds == (Kind.ACK, Kind.REFUSAL)
    assert t.coordinator_subscriptions()[0] == "test/edgeft/v1/farm/devices/+/hello"
    for bad in ["test/edgeft/v1/farm/devices/x/other", "test/edgeft/v1/farm/devices/../cmd", "other/farm/devices/a/cmd",
                "test/edgeft/v1/farm/models/m/v/chunk/01", "test/edgeft/v1/farm/models/m/v/chunk/-1",
                "test/edgeft/v1/farm/devices/a/cmd/extra", "test/edgeft/v1/farm", ""]:
        assert t.parse(bad) is None, bad


@pytest.mark.parametrize("fleet,prefix", [("", "a"), ("a/b", "a"), ("ok", "a/+/b"), ("ok", "a//b"), ("ok", "#")])
def test_bad_fleet_or_prefix_is_refused(fleet, prefix):
    with pytest.raises(InputError):
        Topics(fleet=fleet, prefix=prefix)


def test_ids_with_wildcards_or_separators_cannot_make_topics(env):
    for bad in ["a/b", "+", "#", "", "x" * 65, ".hidden", "a b"]:
        with pytest.raises(InputError):
            env.topics.device(bad, "cmd")


# ---- round trips ----
def test_command_round_trip(env):
    msg = env.verifier.open(env.cmd_topic, env.cmd(job="j1", round=3, params={"epochs": 2, "lr": 0.01}))
    assert isinstance(msg, Message)
    assert msg.kind is Kind.CMD and msg.sender == env.coord.key_id and msg.route.device == env.dev
    assert msg.body == {"cmd_id": "c1", "action": "ping", "job": "j1", "round": 3, "params": {"epochs": 2, "lr": 0.01}}
    assert msg.expires_at - msg.issued_at == 60


def test_binary_update_chunk_round_trip(env):
    topic = env.topics.device(env.dev, "update")
    data = bytes(range(256)) * 100
    raw = env.device.binary(topic, Kind.UPDATE_CHUNK,
                            {"job": "j1", "round": 0, "upload": UPLOAD, "index": 1, "count": 3}, data, ttl=600)
    msg = env.verifier.open(topic, raw)
    assert isinstance(msg, Message) and msg.data == data and msg.body["size"] == len(data)
    assert env.verifier.open(topic, raw).kind is Kind.UPDATE_CHUNK  # idempotent kind: not replay-windowed


def test_hello_is_self_signed_and_needs_no_enrolment(env):
    topic = env.topics.device(env.other_dev, "hello")
    pub = base64.b64encode(keys.public_key_bytes(env.other)).decode()
    msg = env.verifier.open(topic, env.intruder.control(topic, Kind.HELLO, {"public_key": pub, "agent": "0.1"}, ttl=60))
    assert isinstance(msg, Message) and msg.sender == env.other_dev
    # Claiming someone else's key in the body: its fingerprint is not the sender's.
    forged = {"public_key": base64.b64encode(keys.public_key_bytes(env.dkey)).decode()}
    raw = env.intruder.control(topic, Kind.HELLO, forged, ttl=60)
    rejected(env.verifier.open(topic, raw), Reason.WRONG_SIGNER)


# ---- rejections, each with its reason ----
def test_tampered_body_fails_the_signature(env):
    envelope = json.loads(env.cmd())
    envelope["body"]["action"] = "finetune"
    r = rejected(env.verifier.open(env.cmd_topic, canonical_json(envelope)), Reason.BAD_SIGNATURE)
    assert r.sender == env.coord.key_id and r.kind == "cmd"


def test_a_command_for_one_device_cannot_be_replayed_to_another(env):
    raw = env.cmd()
    other_topic = env.topics.device(env.other_dev, "cmd")
    rejected(env.verifier.open(other_topic, raw), Reason.BAD_SIGNATURE)


def test_signature_by_another_key_under_the_coordinators_id(env):
    envelope = json.loads(env.cmd())
    rejected(env.verifier.open(env.cmd_topic, resign(env.other, f"farm/devices/{env.dev}/cmd", envelope)),
             Reason.BAD_SIGNATURE)


def test_unknown_key_and_wrong_roles(env):
    rejected(env.verifier.open(env.cmd_topic, env.intruder.control(env.cmd_topic, Kind.CMD,
                                                                  {"cmd_id": "x", "action": "ping"}, ttl=60)),
             Reason.UNKNOWN_KEY)
    # An enrolled device key may not issue commands.
    rejected(env.verifier.open(env.cmd_topic, env.device.control(env.cmd_topic, Kind.CMD,
                                                                {"cmd_id": "x", "action": "ping"}, ttl=60)),
             Reason.WRONG_SIGNER)
    # A device may not publish on another device's topics, even with a valid signature.
    env.trust.add(env.other.public_key(), role="device")
    progress = env.device.control(env.topics.device(env.dev, "progress"), Kind.PROGRESS, {"phase": "x"}, ttl=60)
    r = rejected(env.verifier.open(env.topics.device(env.other_dev, "progress"), progress), Reason.WRONG_SIGNER)
    assert "may not publish" in r.detail


def test_expired_not_yet_valid_and_too_long_lived(env):
    raw = env.cmd(ttl=60)
    env.clock.t = NOW + 61
    r = rejected(env.verifier.open(env.cmd_topic, raw), Reason.EXPIRED)
    assert "expired 1 s ago" in r.detail
    env.clock.t = NOW
    fresh = env.cmd()
    env.clock.t = NOW - 301  # the receiver's clock is 5 min behind the sender's
    rejected(env.verifier.open(env.cmd_topic, fresh), Reason.NOT_YET_VALID)
    env.clock.t = NOW
    envelope = json.loads(env.cmd())
    envelope["exp"] = envelope["iat"] + 2 * 86400
    rejected(env.verifier.open(env.cmd_topic, resign(env.ckey, f"farm/devices/{env.dev}/cmd", envelope)),
             Reason.TTL_TOO_LONG)


def test_oversized_is_refused_before_parsing(env):
    junk = b"[" * (MAX_CONTROL_BYTES + 1)  # would be a RecursionError if parsed
    r = rejected(env.verifier.open(env.cmd_topic, junk), Reason.OVERSIZED)
    assert r.kind is None and r.size == MAX_CONTROL_BYTES + 1
    rejected(env.verifier.open(env.topics.device(env.dev, "update"), b"\0" * (MAX_BINARY_BYTES + 1)),
             Reason.OVERSIZED)


@pytest.mark.parametrize("payload", [
    b"", b"\xff\xfe", b"null", b"[1,2]", b'"text"', b"{", b'{"a":1,"a":2}', b'{"v":NaN}', b"[" * 5000 + b"]" * 5000,
    b'{"v":' + b"9" * 5000 + b"}",
])
def test_malformed_json_is_refused(env, payload):
    rejected(env.verifier.open(env.cmd_topic, payload), Reason.MALFORMED)


def test_schema_violations_name_the_field(env):
    good = json.loads(env.cmd())
    address = f"farm/devices/{env.dev}/cmd"
    cases = [
        ({"v": 2}, Reason.UNSUPPORTED_VERSION, "version 2"),
        ({"kind": "ack"}, Reason.WRONG_KIND, "not carried on the cmd topic"),
        ({"kind": "teleport"}, Reason.WRONG_KIND, "unknown kind"),
        ({"extra": 1}, Reason.BAD_SCHEMA, "envelope fields"),
        ({"seq": True}, Reason.BAD_SCHEMA, "envelope.seq"),
        ({"seq": 0}, Reason.BAD_SCHEMA, "envelope.seq"),
        ({"body": {"cmd_id": "c", "action": "format_disk"}}, Reason.BAD_SCHEMA, "cmd.action"),
        ({"body": {"cmd_id": "c"}}, Reason.BAD_SCHEMA, "missing field 'action'"),
        ({"body": {"cmd_id": "c", "action": "ping", "shell": "rm"}}, Reason.BAD_SCHEMA, "unknown field 'shell'"),
        ({"body": {"cmd_id": "c/../x", "action": "ping"}}, Reason.BAD_SCHEMA, "cmd.cmd_id"),
        ({"body": {"cmd_id": "c", "action": "ping", "round": 1.5}}, Reason.BAD_SCHEMA, "cmd.round"),
        ({"body": {"cmd_id": "c", "action": "ping", "params": {"a": [1]}}}, Reason.BAD_SCHEMA, "cmd.params"),
        ({"body": []}, Reason.BAD_SCHEMA, "body must be an object"),
    ]
    for change, reason, words in cases:
        r = rejected(env.verifier.open(env.cmd_topic, resign(env.ckey, address, {**good, **change})), reason)
        assert words in r.detail, (change, r.detail)
    missing_sig = dict(good)
    del missing_sig["sig"]
    rejected(env.verifier.open(env.cmd_topic, canonical_json(missing_sig)), Reason.BAD_SCHEMA)


def test_binary_envelope_damage(env):
    topic = env.topics.device(env.dev, "update")
    raw = env.device.binary(topic, Kind.UPDATE_CHUNK,
                            {"job": "j", "round": 1, "upload": UPLOAD, "index": 0, "count": 1}, b"payload" * 50, ttl=60)
    (hlen,) = struct.unpack_from(">H", raw, 4)
    rejected(env.verifier.open(topic, b"XXXX" + raw[4:]), Reason.MALFORMED)
    rejected(env.verifier.open(topic, raw[:6] + raw[6:20]), Reason.MALFORMED)  # header cut short
    rejected(env.verifier.open(topic, raw[:4] + struct.pack(">H", 60000) + raw[6:]), Reason.MALFORMED)
    rejected(env.verifier.open(topic, raw[:-1]), Reason.BAD_SCHEMA)  # size in header != data carried
    flipped = bytearray(raw)
    flipped[-1] ^= 1
    rejected(env.verifier.open(topic, bytes(flipped)), Reason.BAD_SIGNATURE)
    # A model chunk re-published on another index's topic.
    mtopic = env.topics.model_chunk("m", "v1", 0)
    chunk = env.coord.binary(mtopic, Kind.MODEL_CHUNK, {"name": "m", "version": "v1", "sha256": UPLOAD,
                                                        "index": 0, "count": 2}, b"abc", ttl=60)
    assert isinstance(env.verifier.open(mtopic, chunk), Message)
    r = rejected(env.verifier.open(env.topics.model_chunk("m", "v1", 1), chunk), Reason.BAD_SCHEMA)
    assert "topic index 1" in r.detail


def test_model_manifest_must_match_its_topic(env):
    body = {"name": "m", "version": "v1", "sha256": UPLOAD, "size": 10, "chunks": 1, "chunk_size": 10}
    topic = env.topics.manifest("m", "v1")
    assert isinstance(env.verifier.open(topic, env.coord.control(topic, Kind.MANIFEST, body, ttl=60)), Message)
    wrong = env.topics.manifest("m", "v2")
    raw = resign(env.ckey, "farm/models/m/v2/manifest", json.loads(env.coord.control(topic, Kind.MANIFEST, body, ttl=60)))
    r = rejected(env.verifier.open(wrong, raw), Reason.BAD_SCHEMA)
    assert "topic m/v2" in r.detail


def test_unknown_topic(env):
    r = rejected(env.verifier.open("test/edgeft/v1/farm/elsewhere", env.cmd()), Reason.UNKNOWN_TOPIC)
    assert r.route is None


# ---- replay protection ----
def test_replayed_and_too_old_commands_are_refused(env):
    first = env.cmd()
    assert isinstance(env.verifier.open(env.cmd_topic, first), Message)
    r = rejected(env.verifier.open(env.cmd_topic, first), Reason.REPLAYED)
    assert "already accepted" in r.detail
    later = [env.cmd() for _ in range(3)]
    for raw in reversed(later):  # out of order within the window: each accepted once
        assert isinstance(env.verifier.open(env.cmd_topic, raw), Message)
    window = ReplayWindow(directory=env.window_dir / "small", size=4, clock=env.clock)
    v = Verifier(topics=env.topics, trust=env.trust, replay=window, clock=env.clock)
    old = env.cmd()
    for _ in range(5):
        assert isinstance(v.open(env.cmd_topic, env.cmd()), Message)
    assert "older than the window" in rejected(v.open(env.cmd_topic, old), Reason.REPLAYED).detail


def test_replay_window_survives_a_restart(env):
    raw = env.cmd()
    assert isinstance(env.verifier.open(env.cmd_topic, raw), Message)
    restarted = Verifier(topics=env.topics, trust=env.trust,
                         replay=ReplayWindow(directory=env.window_dir, clock=env.clock), clock=env.clock)
    rejected(restarted.open(env.cmd_topic, raw), Reason.REPLAYED)
    assert isinstance(restarted.open(env.cmd_topic, env.cmd()), Message)


def test_corrupt_window_file_only_trusts_messages_issued_after_the_reset(env):
    before = env.cmd()
    assert isinstance(env.verifier.open(env.cmd_topic, env.cmd()), Message)
    path = env.window_dir / f"{env.coord.key_id}.replay"
    path.write_bytes(b"\0" * path.stat().st_size)  # what an SD card leaves after a power cut
    env.clock.t = NOW + 10
    restarted = Verifier(topics=env.topics, trust=env.trust,
                         replay=ReplayWindow(directory=env.window_dir, clock=env.clock), clock=env.clock)
    r = rejected(restarted.open(env.cmd_topic, before), Reason.REPLAYED)
    assert "window was reset" in r.detail
    assert isinstance(restarted.open(env.cmd_topic, env.cmd()), Message)


def test_sequence_numbers_increase_across_restarts_and_clock_jumps(tmp_path):
    clock = Clock()
    path = tmp_path / "s.seq"
    counter = SequenceCounter(path=path, lease=1000, clock=clock)
    first = [counter.next() for _ in range(5)]
    assert first == sorted(first) and len(set(first)) == 5
    assert first[0] >= int(NOW) * 10**6  # floored at wall-clock microseconds
    mtime = path.stat().st_mtime_ns
    counter.next()
    assert path.stat().st_mtime_ns == mtime  # inside the lease: no write
    clock.t = NOW - 86400  # the clock went back a day (no RTC, before NTP)
    again = SequenceCounter(path=path, lease=1000, clock=clock).next()
    assert again > first[-1]
    write_checked(path, b"garbage")  # unreadable state: the clock floor still keeps us ahead
    clock.t = NOW + 5
    assert SequenceCounter(path=path, clock=clock).next() > again


# ---- refusals and outgoing checks ----
def test_refusal_body_is_a_valid_refusal_message(env):
    raw = env.cmd()
    env.clock.t = NOW + 3600
    r = rejected(env.verifier.open(env.cmd_topic, raw), Reason.EXPIRED)
    body = r.refusal_body()
    check_body(Kind.REFUSAL, body)
    assert body["reason"] == "expired" and body["ref_cmd_id"] == "c1" and body["ref_kind"] == "cmd"
    progress = env.topics.device(env.dev, "progress")
    assert isinstance(env.verifier.open(progress, env.device.control(progress, Kind.REFUSAL, body, ttl=60)), Message)


def test_signer_refuses_what_receivers_would_refuse(env):
    with pytest.raises(ValueError, match="cannot be sent"):
        env.coord.control(env.topics.device(env.dev, "ack"), Kind.CMD, {"cmd_id": "c", "action": "ping"}, ttl=60)
    with pytest.raises(ValueError, match="cannot sign for device"):
        env.coord.control(env.topics.device(env.dev, "progress"), Kind.PROGRESS, {"phase": "x"}, ttl=60)
    with pytest.raises(ValueError, match="ttl"):
        env.cmd(ttl=2 * 86400)
    with pytest.raises(ValueError, match="cmd.action"):
        env.coord.control(env.cmd_topic, Kind.CMD, {"cmd_id": "c", "action": "nope"}, ttl=60)
    with pytest.raises(ValueError, match="binary kind"):
        env.device.control(env.topics.device(env.dev, "update"), Kind.UPDATE_CHUNK, {}, ttl=60)
    with pytest.raises(ValueError, match="does not fit"):
        env.device.binary(env.topics.device(env.dev, "update"), Kind.UPDATE_CHUNK,
                          {"job": "j", "round": 1, "upload": UPLOAD, "index": 0, "count": 1},
                          b"x" * MAX_BINARY_BYTES, ttl=60)


# ---- fuzz: nothing raises, everything junk is a Rejection ----
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(channel=st.sampled_from(["hello", "state", "cmd", "ack", "progress", "update"]),
       payload=st.one_of(st.binary(max_size=2048),
                         st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                                      lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                                      max_leaves=20).map(lambda o: json.dumps(o).encode())))
def test_random_payloads_on_every_topic_are_rejections(env, channel, payload):
    result = env.verifier.open(env.topics.device(env.dev, channel), payload)
    assert isinstance(result, Rejection)
    assert result.reason in set(Reason)
    str(result)  # the log line renders


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(position=st.integers(min_value=0), bit=st.integers(min_value=0, max_value=7))
def test_any_single_bit_flip_in_a_signed_message_is_refused(env, position, bit):
    raw = bytearray(env.cmd())
    raw[position % len(raw)] ^= 1 << bit
    assert isinstance(env.verifier.open(env.cmd_topic, bytes(raw)), Rejection)


def test_a_non_canonical_signature_text_is_refused(env):
    """Found by the bit-flip property test: the last base64 character of a 64-byte signature
    carries 2 unused bits; flipping one decoded to the same signature and the message verified."""
    raw = env.cmd()
    envelope = json.loads(raw)
    sig = envelope["sig"]
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    last = sig.rstrip("=")[-1]
    envelope["sig"] = sig.rstrip("=")[:-1] + alphabet[alphabet.index(last) ^ 1] + "=" * (len(sig) - len(sig.rstrip("=")))
    assert base64.b64decode(envelope["sig"]) == base64.b64decode(sig)  # same bytes, other text
    rejected(env.verifier.open(env.cmd_topic, canonical_json(envelope)), Reason.BAD_SCHEMA)


def test_admission_sorts_signed_messages_into_their_lanes(env):
    """The coordinator's inbox lanes: a trusted signature on a priority channel -> "priority",
    on a resend channel -> "resend" (dropped before one-shot reports when the inbox is full);
    a message signed by an untrusted key, or on another channel -> "bulk"."""
    from edge_agent.transport import Admission

    topic = env.topics.device(env.dev, "progress")
    signed = env.device.control(topic, Kind.PROGRESS, {"phase": "x"}, ttl=60)
    unknown_topic = env.topics.device(env.other_dev, "progress")  # a device key nobody trusts
    unknown = env.intruder.control(unknown_topic, Kind.PROGRESS, {"phase": "x"}, ttl=60)
    assert Admission(env.verifier, priority_channels=("progress",))(topic, signed) == "priority"
    assert Admission(env.verifier, priority_channels=(), resend_channels=("progress",))(topic, signed) == "resend"
    assert Admission(env.verifier, priority_channels=(), resend_channels=("progress",))(unknown_topic, unknown) == "bulk"
    assert Admission(env.verifier, priority_channels=("state",), resend_channels=("update",))(topic, signed) == "bulk"
