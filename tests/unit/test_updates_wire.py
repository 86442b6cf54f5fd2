"""Wire format and chunking: round trip, and every kind of bad input rejected clearly."""

from __future__ import annotations

import random
import struct
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edge_agent.updates.chunks import (
    CHUNK_OVERHEAD,
    Reassembler,
    chunk_count,
    parse_chunk,
    split_chunks,
    wire_size,
)
from edge_agent.updates.codec import TensorSpec, encode_delta, round_trip_bound, tensor_table
from edge_agent.updates.errors import (
    ChunkError,
    TensorTableMismatchError,
    UnsupportedVersionError,
    UpdateError,
    UpdateFormatError,
    UpdateTooLargeError,
)
from edge_agent.updates.wire import (
    FORMAT_VERSION,
    UpdateHeader,
    decode_update,
    pack_update,
    payload_digest,
    unpack_update,
)

HEADER = UpdateHeader("digits-head", "v7", "job-42", "dev-03", 12)


def _model(seed: int = 0, hidden: int = 300) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "fc1.weight": rng.standard_normal((64, hidden)).astype(np.float32),
        "fc1.bias": rng.standard_normal(hidden).astype(np.float32),
        "fc2.weight": rng.standard_normal((hidden, 10)).astype(np.float32),
        "fc2.bias": np.zeros(10, np.float32),
    }


def _payload(density: float = 0.3, bits: int = 8, seed: int = 0) -> tuple[bytes, dict]:
    delta = _model(seed)
    return pack_update(HEADER, encode_delta(delta, density=density, bits=bits)), delta


def test_header_and_values_round_trip():
    payload, delta = _payload(density=1.0, bits=32)
    dec = decode_update(payload, expected_table=tensor_table(delta))
    assert dec.header == HEADER and dec.header.key == ("job-42", "dev-03", 12)
    assert dec.table == tensor_table(delta)
    for name, arr in delta.items():
        np.testing.assert_array_equal(dec.deltas[name], arr)
    assert dec.digest == payload_digest(payload).hex() and dec.payload_bytes == len(payload)


def test_chunks_respect_size_and_reassemble_in_any_order_with_duplicates():
    payload, _ = _payload()
    chunks = split_chunks(payload, chunk_size=2048, signature=b"S" * 64)
    assert len(chunks) == chunk_count(len(payload), 2048, 64) > 3
    assert all(len(c) <= 2048 for c in chunks)
    assert sum(len(c) for c in chunks) == wire_size(len(payload), 2048, 64)
    shuffled = chunks[1:] + chunks[1:3]  # duplicates, as QoS 1 redelivers
    random.Random(1).shuffle(shuffled)
    r = Reassembler()
    results = [r.add(c) for c in shuffled]
    assert all(x is None for x in results) and r.pending == 1
    done = [r.add(chunks[0])]
    assert len(done) == 1
    out = done[0]
    assert out.payload == payload and out.digest == payload_digest(payload)
    assert out.signature == b"S" * 64 and out.chunks == len(chunks)
    assert r.pending == 0
    assert r.add(chunks[0]) is None and r.late_duplicates == 1  # late duplicate: ignored


def test_default_chunks_fit_strict_brokers():
    payload = bytes(range(256)) * 2000  # 512 KB
    chunks = split_chunks(payload)
    assert all(len(c) <= 64 * 1024 for c in chunks)
    assert max(len(c) for c in chunks) + 1024 < 128 * 1024  # AWS IoT Core, with topic room


def test_interleaved_updates_do_not_mix():
    p1, _ = _payload(seed=1)
    p2, _ = _payload(seed=2)
    c1, c2 = split_chunks(p1, chunk_size=2048), split_chunks(p2, chunk_size=2048)
    r = Reassembler()
    got = [x for pair in zip(c1, c2, strict=False) for x in (r.add(pair[0]), r.add(pair[1])) if x]
    got += [x for c in c1[len(c2) :] + c2[len(c1) :] if (x := r.add(c))]
    assert sorted(g.payload for g in got) == sorted([p1, p2])


def test_truncated_chunk_is_rejected():
    chunks = split_chunks(_payload()[0], chunk_size=4096)
    with pytest.raises(
        ChunkError, match=r"shorter than its header says \(4000 of 4096 bytes\): truncated"
    ):
        Reassembler().add(chunks[0][:4000])
    with pytest.raises(ChunkError, match="not an update chunk"):
        parse_chunk(chunks[0][:3])
    with pytest.raises(ChunkError, match="header alone needs"):
        parse_chunk(chunks[0][:20])


def test_every_bit_flip_in_a_chunk_is_caught():
    chunk = split_chunks(_payload()[0], chunk_size=1024)[1]
    rng = np.random.default_rng(0)
    for bit in rng.choice(len(chunk) * 8, size=300, replace=False):
        bad = bytearray(chunk)
        bad[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(ChunkError) as err:
            Reassembler().add(bytes(bad))
        assert "CRC32" in str(err.value) or "not an update chunk" in str(err.value)


def test_foreign_chunks_are_rejected():
    payload, _ = _payload()
    chunks = split_chunks(payload, chunk_size=2048)
    r = Reassembler()
    with pytest.raises(ChunkError, match="not an update chunk"):
        r.add(b'{"type": "heartbeat"}')
    # A well-formed chunk (valid CRC) claiming this update's digest with other counts.
    head = bytearray(chunks[1][:-4])
    struct.pack_into("<H", head, 40, 99)  # count
    forged = bytes(head) + struct.pack("<I", zlib.crc32(head))
    r.add(chunks[0])
    with pytest.raises(ChunkError, match="says 99 chunks .* earlier chunks said"):
        r.add(forged)
    # Same index, different contents.
    body = bytearray(chunks[0][:-4])
    body[-1] ^= 0xFF
    conflicting = bytes(body) + struct.pack("<I", zlib.crc32(body))
    with pytest.raises(ChunkError, match="twice with different contents"):
        r.add(conflicting)


def test_forged_chunk_with_valid_crc_fails_the_sha256():
    payload, _ = _payload()
    chunks = split_chunks(payload, chunk_size=2048)
    body = bytearray(chunks[-1][:-4])
    body[-1] ^= 0x01
    forged = bytes(body) + struct.pack("<I", zlib.crc32(body))
    r = Reassembler()
    for c in chunks[:-1]:
        assert r.add(c) is None
    with pytest.raises(ChunkError, match="does not match the sha256"):
        r.add(forged)
    assert r.pending == 0  # the damaged update is dropped; a clean resend reassembles
    assert r.add(chunks[0]) is None


def test_unknown_versions_are_refused():
    payload, _ = _payload()
    bumped = payload[:4] + bytes([FORMAT_VERSION + 1]) + payload[5:]
    with pytest.raises(UnsupportedVersionError, match="format version 2 is not supported"):
        decode_update(bumped)
    chunk = bytearray(split_chunks(payload)[0][:-4])
    chunk[4] = 9
    future = bytes(chunk) + struct.pack("<I", zlib.crc32(chunk))
    with pytest.raises(UnsupportedVersionError, match="chunk format version 9"):
        Reassembler().add(future)


def test_tensor_table_mismatch_is_refused_before_decoding():
    payload, delta = _payload()
    table = list(tensor_table(delta))
    wrong_shape = [TensorSpec("fc1.weight", (64, 256))] + table[1:]
    with pytest.raises(
        TensorTableMismatchError,
        match=r"'fc1.weight': shape \(64, 300\) in update, model has \(64, 256\)",
    ):
        decode_update(payload, expected_table=wrong_shape)
    with pytest.raises(TensorTableMismatchError, match="missing tensor 'head.scale'"):
        decode_update(payload, expected_table=table + [TensorSpec("head.scale", (1,))])
    with pytest.raises(TensorTableMismatchError, match="unexpected tensor 'fc2.bias'"):
        decode_update(payload, expected_table=table[:-1])
    f16 = table[:-1] + [TensorSpec("fc2.bias", (10,), "float16")]
    with pytest.raises(
        TensorTableMismatchError, match="dtype float32 in update, model has float16"
    ):
        decode_update(payload, expected_table=f16)


def test_every_truncation_of_a_payload_is_refused():
    payload, _ = _payload(density=0.05)
    for n in range(len(payload)):
        with pytest.raises(UpdateFormatError):
            unpack_update(payload[:n])
    with pytest.raises(UpdateFormatError, match="body is"):
        unpack_update(payload + b"\x00")


def test_bad_magic_and_flags():
    payload, _ = _payload()
    with pytest.raises(UpdateFormatError, match="not a model update"):
        decode_update(b"JUNK" + payload[4:])
    with pytest.raises(UpdateFormatError, match="no flags are defined"):
        decode_update(payload[:5] + b"\x01" + payload[6:])


def test_size_limits_apply_before_parsing_and_allocation():
    payload, _ = _payload()
    with pytest.raises(UpdateTooLargeError, match="over the limit of 1000"):
        decode_update(payload, max_bytes=1000)
    with pytest.raises(UpdateTooLargeError, match="chunk of"):
        parse_chunk(b"EAUC" + bytes(200_000))
    with pytest.raises(UpdateTooLargeError, match="payload of"):
        Reassembler(max_payload_bytes=1000).add(split_chunks(payload, chunk_size=512)[0])
    # A tiny payload declaring a 2**30-element tensor with nothing kept: no allocation.
    bomb = {"huge": np.zeros(0, np.float32)}
    enc = encode_delta(bomb, density=1.0)
    spec = TensorSpec("huge", (1 << 15, 1 << 15))
    bomb_payload = pack_update(HEADER, [type(enc[0])(spec, 0, 8, 0.0, 1, b"", b"")])
    assert len(bomb_payload) < 100
    with pytest.raises(UpdateTooLargeError, match="declares 1073741824 elements"):
        decode_update(bomb_payload)


def test_reassembler_bounds_pending_updates():
    r = Reassembler(max_pending=3)
    for seed in range(6):
        first = split_chunks(_payload(seed=seed)[0], chunk_size=2048)[0]
        assert r.add(first) is None
    assert r.pending == 3 and r.evicted == 3


def test_header_fields_are_validated_on_pack():
    enc = encode_delta(_model(), density=0.01)
    with pytest.raises(UpdateFormatError, match="device id"):
        pack_update(UpdateHeader("m", "1", "j", "", 0), enc)
    with pytest.raises(UpdateFormatError, match="job id"):
        pack_update(UpdateHeader("m", "1", "j" * 200, "d", 0), enc)
    with pytest.raises(UpdateFormatError, match="round"):
        pack_update(UpdateHeader("m", "1", "j", "d", -1), enc)
    with pytest.raises(ValueError, match="no room for data"):
        split_chunks(b"x", chunk_size=CHUNK_OVERHEAD)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_mutated_payloads_raise_update_errors_only(data):
    """Any damage to a payload is either refused with an UpdateError or decodes to finite
    tensors of the declared table: never another exception, never NaN. The control group --
    the same payload untouched -- must decode, to the sent values within the codec's bound,
    so a decoder that refused everything would fail here."""
    density = data.draw(st.sampled_from([0.01, 0.2, 1.0]))
    bits = data.draw(st.sampled_from([1, 4, 8, 32]))
    delta = _model(data.draw(st.integers(0, 3)))
    encoded = encode_delta(delta, density=density, bits=bits)
    payload = pack_update(HEADER, encoded)
    clean = decode_update(payload, expected_table=tensor_table(delta), max_elements=1 << 20)
    assert clean.header == HEADER and clean.table == tensor_table(delta)
    for enc in encoded:
        name = enc.spec.name
        err = np.abs(clean.deltas[name].astype(np.float64) - delta[name].astype(np.float64)).ravel()
        assert (err <= round_trip_bound(delta[name], enc)).all(), name
    raw = bytearray(payload)
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(raw) - 1))
        raw[pos] ^= data.draw(st.integers(1, 255))  # a byte that really changed
    try:
        dec = decode_update(bytes(raw), max_elements=1 << 20)
    except UpdateError:
        return
    assert {s.name: s.shape for s in dec.table} == {n: a.shape for n, a in dec.deltas.items()}
    for name, arr in dec.deltas.items():
        assert arr.dtype == np.float32 and np.isfinite(arr).all(), name


def test_reassembler_limits_are_validated():
    with pytest.raises(ValueError, match="limits must be positive"):
        Reassembler(max_pending=0)
