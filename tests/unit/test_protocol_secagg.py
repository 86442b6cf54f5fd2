"""Secure aggregation's message kinds at the protocol edge (protocol/schema.py SECAGG_SCHEMAS):
real messages of a real round are signed and verified on their own channels, and malformed,
oversized or misdirected ones are refused with a reason naming the field."""

from __future__ import annotations

import numpy as np
import pytest

from edge_agent import keys
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
from edge_agent.protocol.schema import (
    MAX_SECAGG_BYTES,
    SECAGG_CHUNK_BYTES,
    SECAGG_MAX_CHUNKS,
    SECAGG_MAX_LENGTH,
    SECAGG_SINGLE_BYTES,
    check_body,
    masked_chunk_sizes,
    masked_chunks,
)
from edge_agent.updates.secagg import RoundConfig, SecAggDevice, b64


@pytest.fixture
def env(tmp_path):
    class Env:
        pass

    e = Env()
    e.topics = Topics(fleet="farm", prefix="test/edgeft/v1")
    e.ckey = keys.generate_private_key()
    e.dkeys = [keys.generate_private_key() for _ in range(3)]
    e.ids = [keys.fingerprint(k) for k in e.dkeys]
    e.coord = Signer(key=e.ckey, topics=e.topics, sequence=SequenceCounter(path=tmp_path / "c.seq"))
    e.dev = Signer(key=e.dkeys[0], topics=e.topics, sequence=SequenceCounter(path=tmp_path / "d.seq"))
    trust = TrustStore()
    trust.add(e.ckey.public_key(), role="coordinator")
    for k in e.dkeys:
        trust.add(k.public_key(), role="device")
    e.verifier = Verifier(topics=e.topics, trust=trust, replay=None)
    e.config = RoundConfig(round_id="job-1/1", devices=tuple(sorted(e.ids)), degree=2, threshold=2,
                           graph_seed="ab" * 16, length=8, clip=1.0)
    return e


def test_a_real_round_s_messages_are_signed_and_verified_on_their_channels(env) -> None:
    devices = [SecAggDevice(device_key=k, config=env.config) for k in env.dkeys]
    advert = devices[0].advertise()
    up = env.topics.device(env.ids[0], "secagg")
    got = env.verifier.open(up, env.dev.control(up, Kind.SECAGG_ADVERT, {"job": "job-1", "round": 1, "advert": advert},
                                                ttl=600))
    assert isinstance(got, Message) and got.body["advert"] == advert
    masked = b64(b"SAM1" + np.arange(8, dtype="<u4").tobytes())
    got = env.verifier.open(up, env.dev.control(up, Kind.SECAGG_MASKED, {"job": "job-1", "round": 1, "masked": masked},
                                                ttl=600))
    assert isinstance(got, Message) and got.kind is Kind.SECAGG_MASKED
    down = env.topics.device(env.ids[0], "secagg_cmd")
    body = {"job": "job-1", "round": 1, "survivors": sorted(env.ids), "dropped": []}
    got = env.verifier.open(down, env.coord.control(down, Kind.SECAGG_UNMASK, body, ttl=600))
    assert isinstance(got, Message) and got.body == body


def test_a_device_cannot_send_the_coordinator_s_kinds_nor_another_device_s(env) -> None:
    up, down = env.topics.device(env.ids[0], "secagg"), env.topics.device(env.ids[0], "secagg_cmd")
    body = {"job": "job-1", "round": 1, "survivors": [env.ids[0]], "dropped": []}
    with pytest.raises(ValueError, match="cannot be sent on topic"):
        env.dev.control(up, Kind.SECAGG_UNMASK, body, ttl=60)
    forged = env.dev.control(down, Kind.SECAGG_UNMASK, body, ttl=60)  # on the coordinator's channel
    got = env.verifier.open(down, forged)
    assert isinstance(got, Rejection) and got.reason is Reason.WRONG_SIGNER
    other = env.topics.device(env.ids[1], "secagg")
    with pytest.raises(ValueError, match="cannot sign for device"):
        env.dev.control(other, Kind.SECAGG_MASKED, {"job": "j", "round": 1, "masked": "AAAAAAAA"}, ttl=60)


BAD = [
    (Kind.SECAGG_ADVERT, {"advert": {"device": "a" * 24}}, "advert must be an object of exactly"),
    (Kind.SECAGG_ADVERT, {"advert": {"device": "A" * 24, "key": "", "c_pk": "", "s_pk": "", "commit": "", "sig": ""}},
     "device id"),
    (Kind.SECAGG_ADVERT, {"advert": {"device": "a" * 24, "key": "A" * 43 + "=", "c_pk": "A" * 40, "s_pk": "A" * 43
                                     + "=", "commit": "A" * 43 + "=", "sig": "A" * 86 + "=="}}, "c_pk must be base64"),
    (Kind.SECAGG_SHARES, {"shares": {"a" * 24: "A" * 100}}, "a share must be base64 of 76 bytes"),
    (Kind.SECAGG_SHARES, {"shares": {f"{c}" * 24: "A" * 102 + "==" for c in "abcdefghijklmnopqrstuvwxyz"} | {
        f"a{i:03d}".replace("0", "a").replace("1", "b").replace("8", "c").replace("9", "d") * 6: "A" * 102 + "=="
        for i in range(120)}}, "at most 128 entries"),
    (Kind.SECAGG_MASKED, {"masked": "A" * (4 * ((4 + 4 * SECAGG_MAX_LENGTH + 2) // 3) + 4)}, "masked must be base64"),
    (Kind.SECAGG_MASKED, {"masked": "not base64!"}, "masked must be base64"),
    (Kind.SECAGG_MASKED, {"masked": 12}, "masked must be base64"),
    (Kind.SECAGG_REVEAL, {"b": {"a" * 24: "A" * 43 + "="}, "sk": {}}, "a seed share must be base64 of 16"),
    (Kind.SECAGG_REVEAL, {"b": [], "sk": {}}, "must be an object"),
    (Kind.SECAGG_UNMASK, {"survivors": ["a" * 24, "a" * 24], "dropped": []}, "twice"),
    (Kind.SECAGG_UNMASK, {"survivors": ["a" * 24], "dropped": "b" * 24}, "must be a list"),
    (Kind.SECAGG_INBOX, {"shares": {"../x": "A" * 102 + "=="}}, "device id"),
    (Kind.SECAGG_ROSTER, {"config": {"round_id": "r"}, "members": "AA==", "adverts": []}, "config must be an object"),
    (Kind.SECAGG_ROSTER, {"config": {"round_id": "r", "devices": ["a" * 24], "degree": 1, "threshold": 1,
                                     "graph_seed": "ab" * 16, "length": 10**9, "clip": 1.0, "noise_std": 0.0},
                          "members": "AA==", "adverts": []}, "length must be an integer"),
    (Kind.SECAGG_ROSTER, {"config": {"round_id": "r", "devices": ["a" * 24], "degree": 1, "threshold": 1,
                                     "graph_seed": "ab" * 16, "length": 4, "clip": float("nan"), "noise_std": 0.0},
                          "members": "AA==", "adverts": []}, "clip must be a number"),
]


@pytest.mark.parametrize(("kind", "fields", "why"), BAD, ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(BAD)])
def test_malformed_bodies_are_refused_naming_the_field(kind: Kind, fields: dict, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        check_body(kind, {"job": "job-1", "round": 1, **fields})


def test_a_round_number_or_job_id_out_of_range_is_refused() -> None:
    for job, rnd in (("job-1", 0), ("job-1", 2**32), ("../x", 1), ("job-1", True)):
        with pytest.raises(ValueError):
            check_body(Kind.SECAGG_MASKED, {"job": job, "round": rnd, "masked": "AAAAAAAA"})


def test_an_oversized_secagg_message_is_refused_before_parsing(env) -> None:
    up = env.topics.device(env.ids[0], "secagg")
    got = env.verifier.open(up, b"{" + b" " * MAX_SECAGG_BYTES + b"}")
    assert isinstance(got, Rejection) and got.reason is Reason.OVERSIZED
    # the longest one-message masked input the schema takes fits one message, and the receiver takes it
    longest = b64(bytes(SECAGG_SINGLE_BYTES))
    sealed = env.dev.control(up, Kind.SECAGG_MASKED, {"job": "j" * 64, "round": 1, "masked": longest}, ttl=60)
    assert len(sealed) <= MAX_SECAGG_BYTES and isinstance(env.verifier.open(up, sealed), Message)
    # and so does the longest chunk, with the longest chunk fields
    chunk = {"job": "j" * 64, "round": (1 << 32) - 1, "masked": b64(bytes(SECAGG_CHUNK_BYTES)),
             "chunk": SECAGG_MAX_CHUNKS - 2, "chunks": SECAGG_MAX_CHUNKS, "sha256": "f" * 64}
    sealed = env.dev.control(up, Kind.SECAGG_MASKED, chunk, ttl=60)
    assert len(sealed) <= MAX_SECAGG_BYTES and isinstance(env.verifier.open(up, sealed), Message)
    with pytest.raises(ValueError, match="masked must be base64"):  # one byte more: refused by the signer too
        env.dev.control(up, Kind.SECAGG_MASKED, {"job": "j", "round": 1,
                                                 "masked": b64(bytes(SECAGG_SINGLE_BYTES + 1))}, ttl=60)


def test_a_masked_input_is_cut_into_chunks_that_fit_one_message_each() -> None:
    """One message up to the first protocol's 16,384 coordinates; above, 64 KiB chunks, the
    last shorter; the largest head's input is SECAGG_MAX_CHUNKS messages."""
    assert masked_chunk_sizes(SECAGG_SINGLE_BYTES) == [SECAGG_SINGLE_BYTES]
    assert masked_chunk_sizes(SECAGG_SINGLE_BYTES + 4) == [SECAGG_CHUNK_BYTES, 8]
    assert masked_chunk_sizes(4 + 4 * SECAGG_MAX_LENGTH) == [SECAGG_CHUNK_BYTES] * 64 + [4]
    assert SECAGG_MAX_CHUNKS == 65
    data = bytes(range(256)) * 700
    parts = masked_chunks(data)
    assert b"".join(parts) == data and [len(p) for p in parts] == masked_chunk_sizes(len(data))


def _chunk(**over) -> dict:
    return {"job": "j", "round": 1, "masked": b64(bytes(SECAGG_CHUNK_BYTES)), "chunk": 0, "chunks": 3,
            "sha256": "a" * 64, **over}


@pytest.mark.parametrize(("over", "why"), [
    ({"chunk": 3}, "chunk 3 is not below chunks 3"),
    ({"chunk": -1}, "secagg_masked.chunk must be"),
    ({"chunk": SECAGG_MAX_CHUNKS}, "secagg_masked.chunk must be"),
    ({"chunk": True}, "secagg_masked.chunk must be"),
    ({"chunks": 0}, "secagg_masked.chunks must be"),
    ({"chunks": SECAGG_MAX_CHUNKS + 1}, "secagg_masked.chunks must be"),
    ({"chunks": "3"}, "secagg_masked.chunks must be"),
    ({"sha256": "A" * 64}, "secagg_masked.sha256"),
    ({"sha256": "a" * 63}, "secagg_masked.sha256"),
    ({"sha256": None}, "secagg_masked.sha256"),
    ({"masked": b64(bytes(SECAGG_CHUNK_BYTES - 4))}, r"secagg_masked.masked: chunk 0 of 3 has 65532 bytes"),
    ({"chunk": 2, "masked": b64(bytes(SECAGG_CHUNK_BYTES + 4))}, r"secagg_masked.masked: chunk 2 of 3 has 65540"),
    ({"masked": b64(bytes(SECAGG_SINGLE_BYTES + 1))}, "secagg_masked.masked must be base64"),
])
def test_bad_chunk_fields_are_refused_naming_the_field(over: dict, why: str) -> None:
    check_body(Kind.SECAGG_MASKED, _chunk())
    check_body(Kind.SECAGG_MASKED, _chunk(chunk=2, masked=b64(b"x" * 12)))  # the last chunk: shorter
    with pytest.raises(ValueError, match=why):
        check_body(Kind.SECAGG_MASKED, _chunk(**over))


@pytest.mark.parametrize("missing", ["chunk", "chunks", "sha256"])
def test_chunk_fields_come_together(missing: str) -> None:
    body = _chunk()
    del body[missing]
    with pytest.raises(ValueError, match=f"secagg_masked.{missing} is missing"):
        check_body(Kind.SECAGG_MASKED, body)
    check_body(Kind.SECAGG_MASKED, {"job": "j", "round": 1, "masked": b64(b"SAM1" + bytes(8))})  # the first form
    check_body(Kind.SECAGG_MASKED, {"job": "j", "round": 1, "masked": b64(b"SAM1" + bytes(8)), "chunk": 0,
                                    "chunks": 1, "sha256": "b" * 64})  # chunk 0 of 1: any size up to one message


def test_a_finetune_command_s_secagg_params_are_parsed_strictly() -> None:
    from edge_agent.protocol.finetune import BadParams, parse_finetune

    body = {"cmd_id": "c", "action": "finetune", "job": "job-1", "round": 1, "model": "m", "version": "1"}
    req = parse_finetune({**body, "params": {"secagg": True, "secagg_phase_s": 30}})
    assert req.to_params()["secagg"] is True and req.to_params()["secagg_phase_s"] == 30.0
    assert "secagg" not in parse_finetune({**body, "params": {"secagg": False}}).to_params()
    for bad in ({"secagg": "yes"}, {"secagg": 1}, {"secagg_phase_s": 0.5}, {"secagg_phase_s": 10**400}):
        with pytest.raises(BadParams, match="secagg"):
            parse_finetune({**body, "params": bad})
