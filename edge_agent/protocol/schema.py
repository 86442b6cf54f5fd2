"""Message kinds, rejection reasons, body schemas, size and validity limits."""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from collections.abc import Callable, Mapping
from enum import StrEnum
from typing import Any

from ..errors import InputError
from .engine_choice import MAX_SHARED_CHOICES

PROTOCOL_VERSION = 1
BINARY_MAGIC = b"EFB1"
MAX_CONTROL_BYTES = 16 * 1024
# Secure aggregation's messages carry a roster of k + 1 adverts, k shares, or the whole masked
# vector: up to 96 KiB each, under AWS IoT Core's 128 KiB with room for the envelope.
MAX_SECAGG_BYTES = 96 * 1024
MAX_BINARY_BYTES = 128 * 1024  # AWS IoT Core's message cap
MAX_BINARY_HEADER = 2048
MAX_BUNDLE_BYTES = 1 << 30
MAX_SEQ = (1 << 53) - 1  # exact in JSON/doubles everywhere
ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_DAY = 86400


def unb64(text: str) -> bytes:
    """Strict, canonical base64 decode; b"" for anything invalid. Canonical: the unused low
    bits of the last character must be zero, else two texts would carry one signature (a bit
    flip there decoded to the same bytes and the flipped message verified)."""
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return b""
    return data if base64.b64encode(data).decode("ascii") == text else b""


class Kind(StrEnum):
    HELLO = "hello"
    STATE = "state"
    CMD = "cmd"
    ACK = "ack"
    PROGRESS = "progress"
    REFUSAL = "refusal"
    UPDATE_CHUNK = "update_chunk"
    MANIFEST = "manifest"
    MODEL_CHUNK = "model_chunk"
    KEY_ROTATION = "key_rotation"
    # secure aggregation (SecAgg+; updates/secagg.py): device -> coordinator
    SECAGG_ADVERT = "secagg_advert"
    SECAGG_SHARES = "secagg_shares"
    SECAGG_MASKED = "secagg_masked"
    SECAGG_REVEAL = "secagg_reveal"
    # coordinator -> device
    SECAGG_ROSTER = "secagg_roster"
    SECAGG_INBOX = "secagg_inbox"
    SECAGG_UNMASK = "secagg_unmask"


class Reason(StrEnum):
    UNKNOWN_TOPIC = "unknown_topic"
    OVERSIZED = "oversized"
    MALFORMED = "malformed"
    UNSUPPORTED_VERSION = "unsupported_version"
    WRONG_KIND = "wrong_kind"
    BAD_SCHEMA = "bad_schema"
    UNKNOWN_KEY = "unknown_key"
    WRONG_SIGNER = "wrong_signer"
    BAD_SIGNATURE = "bad_signature"
    NOT_YET_VALID = "not_yet_valid"
    EXPIRED = "expired"
    TTL_TOO_LONG = "ttl_too_long"
    REPLAYED = "replayed"
    LOCAL_FAULT = "local_fault"  # the receiver could not record it (disk full...): resend later

    @property
    def retryable(self) -> bool:
        """Might a resend succeed later (key enrolled, clock fixed)? Default for update acks."""
        return self in _RETRYABLE


_RETRYABLE = {Reason.UNKNOWN_KEY, Reason.WRONG_SIGNER, Reason.BAD_SIGNATURE, Reason.NOT_YET_VALID,
              Reason.EXPIRED, Reason.REPLAYED, Reason.LOCAL_FAULT}


# ---- schemas: field -> (check, required); a check raises ValueError with a short why ----
def _id(v: Any) -> None:
    if not (isinstance(v, str) and ID_RE.fullmatch(v)):
        raise ValueError("must be 1-64 of [A-Za-z0-9._-], not starting with . _ -")


def _number(lo: float, hi: float, *, integer: bool = False) -> Callable[[Any], None]:
    """THE check of every numeric field (bodies and the entries of flat maps alike): the type
    (an int, or a float unless `integer`; never a bool), the range, finite. The range is
    compared first: `math.isfinite(10**400)` raises OverflowError, and untrusted bytes must
    only ever be refused."""
    what = "an integer" if integer else "a number"

    def check(v: Any) -> None:
        if isinstance(v, bool) or not isinstance(v, int if integer else int | float) \
                or not (lo <= v <= hi and math.isfinite(v)):
            raise ValueError(f"must be {what} in {lo}..{hi}")
    return check


def _int(lo: int, hi: int) -> Callable[[Any], None]:
    return _number(lo, hi, integer=True)


def _num(lo: float, hi: float) -> Callable[[Any], None]:
    return _number(lo, hi)


def _text(n: int) -> Callable[[Any], None]:
    def check(v: Any) -> None:
        if not isinstance(v, str) or len(v) > n:
            raise ValueError(f"must be a string of at most {n} characters")
    return check


def _enum(*values: str) -> Callable[[Any], None]:
    def check(v: Any) -> None:
        if v not in values:
            raise ValueError(f"must be one of {', '.join(values)}")
    return check


def _hex64(v: Any) -> None:
    if not (isinstance(v, str) and _HEX64.fullmatch(v)):
        raise ValueError("must be 64 lower-case hex digits (sha256)")


def _bool(v: Any) -> None:
    if not isinstance(v, bool):
        raise ValueError("must be true or false")


def _b64key(v: Any) -> None:
    if not (isinstance(v, str) and len(v) == 44 and len(unb64(v)) == 32):
        raise ValueError("must be a base64 32-byte Ed25519 public key")


def _entries(n: int) -> Callable[[Any], None]:
    """A list of at most n entries: the bound checked before parsing. Each entry is parsed
    strictly by its reader (e.g. engine choices: protocol.engine_choice), which can drop one
    bad entry and keep the rest of the message."""
    def check(v: Any) -> None:
        if not isinstance(v, list) or len(v) > n:
            raise ValueError(f"must be a list of at most {n} entries")
    return check


def _either(*checks: Callable[[Any], None]) -> Callable[[Any], None]:
    def check(v: Any) -> None:
        errors = []
        for one in checks:
            try:
                return one(v)
            except ValueError as exc:
                errors.append(str(exc))
        raise ValueError(" or ".join(errors))
    return check


# Numbers in flat maps: a named entry below has its own range; any other number is an int or
# finite float within +-2**53 (exact in JSON doubles, and in a 64-bit SQLite INTEGER: a device
# once sent battery_pct = 2**64 and the registry's insert raised for every state it sent).
MAX_FLAT_NUMBER = MAX_SEQ
_ANY_NUMBER = _number(-MAX_FLAT_NUMBER, MAX_FLAT_NUMBER)
_COUNTER = _int(0, MAX_SEQ)
_WATTS, _WH, _CELSIUS, _FRACTION = _num(-1e5, 1e5), _num(0, 1e6), _num(-273.15, 1000), _num(0, 1)

# A device's daily job allowance in its state `info` (agent.policy.Allowance.to_facts): jobs
# left, the limit, when the next job frees up, and a standing refusal (reason id, short text).
# In `info`, not a new top-level field: an older coordinator's strict schema would refuse the
# whole state; this one checks these entries' types and bounds. Agents before it send none.
ALLOWANCE_CHECKS: dict[str, Callable[[Any], None]] = {
    "jobs_left": _int(0, 100_000), "jobs_limit": _int(0, 100_000), "jobs_reset_at": _int(0, 1 << 40),
    "refuse": _id, "refuse_detail": _text(200)}

# The local inference service's report in the same `info` (edge_agent.inference.server.facts):
# the served model and whether it is the fleet version or the device's personal one, both
# candidates' accuracy on the device's own held-out samples, and what serving cost.
INFERENCE_CHECKS: dict[str, Callable[[Any], None]] = {
    "served_model": _text(160), "served_kind": _enum("fleet", "personal"), "held_out": _int(0, 1 << 31),
    "fleet_accuracy": _num(0.0, 1.0), "personal_accuracy": _num(0.0, 1.0), "inference_wh": _num(0.0, 1e9),
    "inference_requests": _int(0, MAX_SEQ)}  # (2**53 - 1: every flat-map number fits a double exactly)

# The entries of every flat map (hello info, state info, progress metrics, command params,
# manifest meta) by name: a name means the same thing, with the same type and range, in all of
# them (energy_wh in a state, in a result and in a probe reply). Agents drop a reading outside
# its range before sending (`clean_flat`): a broken sensor loses that fact, not the message.
FLAT_ENTRIES: dict[str, Callable[[Any], None]] = {
    # device facts (state info; a probe reply's metrics): agent/state.py
    "battery_pct": _num(0, 100), "charging": _bool, "on_power": _bool, "energy_wh": _WH, "power_w": _WATTS,
    "temp_c": _CELSIUS, "outbox": _COUNTER, **ALLOWANCE_CHECKS, **INFERENCE_CHECKS,
    # capabilities (hello info): doctor.capabilities; engine_choices: the agent reads a command's
    # `engine_choices` (an older agent's strict schema would refuse the whole command); secagg:
    # it runs secure aggregation (secure jobs select only such devices; also a command param)
    "mxnet": _bool, "engine_choices": _bool, "secagg": _bool,
    # job progress and results (progress metrics): agent/lifecycle.py, agent/child.py
    "step": _COUNTER, "epoch": _COUNTER, "steps": _COUNTER, "watts": _WATTS, "val_accuracy": _FRACTION,
    "accuracy_before": _FRACTION, "accuracy_after": _FRACTION, "num_samples": _int(0, 1_000_000_000),
    "duration_s": _num(0, 1e10), "depth": _either(_int(0, 64), _id), "resumed": _bool,
    "adapted": _bool, "shift": _num(0, 1e6), "adaptation": _text(256),
    "update_chunks": _int(0, 0xFFFF), "update_wire_bytes": _int(0, 1 << 40), "update_dense_bytes": _int(0, 1 << 40),
    "update_k": _COUNTER, "update_bits": _int(0, 64), "update_ratio": _num(0, 1e9), "update_energy_kept": _FRACTION,
    # (command parameters are bounded as any number here; the device's policy judges them and
    # refuses one out of its range as bad_params, naming it: agent/policy.py)
    # model manifest meta: transport/models.py
    "head_bytes": _int(0, MAX_BUNDLE_BYTES), "head_only": _bool,
}


def _flat_entry(key: Any, item: Any) -> None:
    _id(key)
    check = FLAT_ENTRIES.get(key)
    if check is not None:
        check(item)
    elif isinstance(item, str):
        _text(256)(item)
    elif isinstance(item, bool):
        pass
    elif isinstance(item, int | float):
        _ANY_NUMBER(item)
    else:
        raise ValueError("must be a string, finite number or boolean")


def _flat(v: Any) -> None:
    """A small flat mapping of id -> scalar (command parameters, metrics, metadata)."""
    if not isinstance(v, dict) or len(v) > 64:
        raise ValueError("must be an object of at most 64 entries")
    for key, item in v.items():
        try:
            _flat_entry(key, item)
        except ValueError as exc:
            shown = key if isinstance(key, str) and ID_RE.fullmatch(key) else repr(str(key)[:64])
            raise ValueError(f"entry {shown} {exc}") from None


def clean_flat(values: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of `values` a flat map may carry (FLAT_ENTRIES, 256-character strings),
    at most 64; the rest dropped. What a sender applies to its own readings, and a receiver to
    facts it parsed itself (protocol.facts.facts_from_state)."""
    out: dict[str, Any] = {}
    for key, item in values.items():
        if len(out) == 64:
            break
        try:
            _flat_entry(key, item)
        except ValueError:
            continue
        out[key] = item
    return out


# A device's solar surplus forecast in its state (power.forecast.SurplusForecast.to_state, sent
# with agent.toml [solar]): bounded here before anything reads it -- an object of at most 16
# entries, numbers or lists of at most 48 numbers or one small object (the planned window),
# under 2 KiB as JSON; its reader (SurplusForecast.from_state) then parses it strictly.
MAX_FORECAST_BYTES = 2048
_FORECAST_NUMBER = _num(-1e12, 1e12)


def _forecast(v: Any) -> None:
    if not isinstance(v, dict) or len(v) > 16:
        raise ValueError("must be an object of at most 16 entries")
    for key, item in v.items():
        _id(key)
        if isinstance(item, list):
            if len(item) > 48:
                raise ValueError(f"entry {key}: at most 48 numbers")
            for x in item:
                _FORECAST_NUMBER(x)
        elif isinstance(item, dict):
            if len(item) > 4:
                raise ValueError(f"entry {key}: an object of at most 4 entries")
            for k, x in item.items():
                _id(k)
                (_text(120) if isinstance(x, str) else _FORECAST_NUMBER)(x)
        else:
            _FORECAST_NUMBER(item)
    if len(json.dumps(v)) > MAX_FORECAST_BYTES:
        raise ValueError(f"must be at most {MAX_FORECAST_BYTES} bytes as JSON")


# ---- secure aggregation (SecAgg+): the protocol's messages (updates/secagg.py, coordinator/
# secagg.py). Sizes and shapes are checked here, before anything parses a key or a share; the
# state machines then check signatures, membership and phase. Not windowed: every step is
# idempotent (a device answers a repeated request with its stored answer; the coordinator
# refuses a second answer), and the round id binds every key, share and mask.
SECAGG_MAX_DEVICES = 2_000  # devices in a round: the roster's config lists them all (~54 KB)
SECAGG_MAX_NEIGHBOURS = 128  # k (2 ceil(log2 n) is 28 at 10,000 devices; a complete graph of 129)
# A masked input (4-byte magic + 4 bytes a coordinate) travels in one `secagg_masked` when it
# fits SECAGG_SINGLE_BYTES (the 16,384 coordinates of the first protocol: that message has no
# chunk fields, as an older coordinator expects), else in chunks of SECAGG_CHUNK_BYTES (the last
# shorter), each naming its index, the count and the SHA-256 of the whole input; each message
# stays under MAX_SECAGG_BYTES (87,388 base64 characters at most). The coordinator keeps a
# device's chunks on disk until all arrived (coordinator/secure_rounds.py).
SECAGG_MAX_LENGTH = 1 << 20  # coordinates of a secure job's head: 4 MiB masked, 65 messages
SECAGG_CHUNK_BYTES = 1 << 16
SECAGG_SINGLE_BYTES = 4 + 4 * 16_384
SECAGG_MAX_CHUNKS = -(-(4 + 4 * SECAGG_MAX_LENGTH) // SECAGG_CHUNK_BYTES)
_DEVICE_ID = re.compile(r"[a-z2-7]{24}")  # keys.fingerprint
_SECAGG_ADVERT_SIZES = {"device": 0, "key": 32, "c_pk": 32, "s_pk": 32, "commit": 32, "sig": 64}
_SHARE_CIPHER = 12 + 48 + 16  # nonce, three 16-byte Shamir shares, tag (updates.secagg.SHARE_CIPHER)


def _b64_of(size: int, what: str) -> Callable[[Any], None]:
    """Canonical base64 of exactly `size` bytes (the length compared before decoding)."""
    def check(v: Any) -> None:
        if not isinstance(v, str) or len(v) != 4 * ((size + 2) // 3) or len(unb64(v)) != size:
            raise ValueError(f"{what} must be base64 of {size} bytes")
    return check


def _device_id(v: Any) -> None:
    if not (isinstance(v, str) and _DEVICE_ID.fullmatch(v)):
        raise ValueError("must be a device id (24 base32 characters)")


def _id_map(n: int, value: Callable[[Any], None]) -> Callable[[Any], None]:
    """An object of at most n device id -> value."""
    def check(v: Any) -> None:
        if not isinstance(v, dict) or len(v) > n:
            raise ValueError(f"must be an object of at most {n} entries")
        for key, item in v.items():
            _device_id(key)
            value(item)
    return check


def _id_list(n: int) -> Callable[[Any], None]:
    def check(v: Any) -> None:
        if not isinstance(v, list) or len(v) > n:
            raise ValueError(f"must be a list of at most {n} device ids")
        for item in v:
            _device_id(item)
        if len(set(v)) != len(v):
            raise ValueError("lists a device twice")
    return check


def _advert(v: Any) -> None:
    if not isinstance(v, dict) or set(v) != set(_SECAGG_ADVERT_SIZES):
        raise ValueError(f"must be an object of exactly {', '.join(_SECAGG_ADVERT_SIZES)}")
    _device_id(v["device"])
    for name, size in _SECAGG_ADVERT_SIZES.items():
        if size:
            _b64_of(size, name)(v[name])


def _adverts(v: Any) -> None:
    if not isinstance(v, list) or not 1 <= len(v) <= SECAGG_MAX_NEIGHBOURS + 1:
        raise ValueError(f"must be a list of 1..{SECAGG_MAX_NEIGHBOURS + 1} advertisements")
    for item in v:
        _advert(item)


def _secagg_config(v: Any) -> None:
    """The round's public parameters (updates.secagg.RoundConfig): shape and bounds here, the
    device's RoundConfig checks the rest (sorted devices, threshold <= degree...)."""
    fields = {"round_id": _text(200), "devices": _id_list(SECAGG_MAX_DEVICES), "degree": _int(1, SECAGG_MAX_DEVICES),
              "threshold": _int(1, SECAGG_MAX_DEVICES), "graph_seed": _text(64), "length": _int(1, SECAGG_MAX_LENGTH),
              "clip": _num(1e-9, 1e6), "noise_std": _num(0, 1e6)}
    if not isinstance(v, dict) or set(v) != set(fields):
        raise ValueError(f"must be an object of exactly {', '.join(fields)}")
    for name, check in fields.items():
        try:
            check(v[name])
        except ValueError as exc:
            raise ValueError(f"{name} {exc}") from None


def _members(v: Any) -> None:
    if not isinstance(v, str) or len(v) > 4 * ((SECAGG_MAX_DEVICES // 8 + 3) // 3) or not unb64(v):
        raise ValueError("must be base64 of a bitmap over the round's devices")


def _masked(v: Any) -> None:
    """One message's part of a masked input; the exact length is the round's (secure_rounds.py)."""
    most = 4 * ((SECAGG_SINGLE_BYTES + 2) // 3)
    if not isinstance(v, str) or len(v) > most or len(v) % 4 or not 0 < len(unb64(v)) <= SECAGG_SINGLE_BYTES:
        raise ValueError(f"must be base64 of at most {SECAGG_SINGLE_BYTES} bytes")


def masked_chunk_sizes(total: int) -> list[int]:
    """The byte count of each message of a masked input of `total` bytes (module comment above)."""
    if total <= SECAGG_SINGLE_BYTES:
        return [total]
    full, rest = divmod(total, SECAGG_CHUNK_BYTES)
    return [SECAGG_CHUNK_BYTES] * full + ([rest] if rest else [])


def masked_chunks(data: bytes) -> list[bytes]:
    """A masked input cut into its messages' parts (masked_chunk_sizes)."""
    out, at = [], 0
    for size in masked_chunk_sizes(len(data)):
        out.append(data[at:at + size])
        at += size
    return out


def _masked_chunking(body: dict[str, Any]) -> None:
    """`chunk`, `chunks` and `sha256` come together, on a multi-message input only; every chunk
    but the last is exactly SECAGG_CHUNK_BYTES (the round's exact layout: secure_rounds.py)."""
    given = [k for k in ("chunk", "chunks", "sha256") if k in body]
    if not given:
        return
    if len(given) != 3:
        missing = next(k for k in ("chunk", "chunks", "sha256") if k not in body)
        raise ValueError(f"{Kind.SECAGG_MASKED}.{missing} is missing (chunk, chunks and sha256 come together)")
    if body["chunk"] >= body["chunks"]:
        raise ValueError(f"{Kind.SECAGG_MASKED}.chunk {body['chunk']} is not below chunks {body['chunks']}")
    size = len(unb64(body["masked"]))
    if body["chunks"] > 1 and (size > SECAGG_CHUNK_BYTES or (body["chunk"] < body["chunks"] - 1
                                                             and size != SECAGG_CHUNK_BYTES)):
        raise ValueError(f"{Kind.SECAGG_MASKED}.masked: chunk {body['chunk']} of {body['chunks']} has {size} "
                         f"bytes (every chunk but the last is {SECAGG_CHUNK_BYTES}, none more)")


_SECAGG_ROUND = {"job": (_id, True), "round": (_int(1, (1 << 32) - 1), True)}
_SHARE = _b64_of(_SHARE_CIPHER, "a share")
SECAGG_SCHEMAS: dict[Kind, dict[str, tuple[Callable[[Any], None], bool]]] = {
    Kind.SECAGG_ADVERT: {**_SECAGG_ROUND, "advert": (_advert, True)},
    Kind.SECAGG_SHARES: {**_SECAGG_ROUND, "shares": (_id_map(SECAGG_MAX_NEIGHBOURS, _SHARE), True)},
    Kind.SECAGG_MASKED: {**_SECAGG_ROUND, "masked": (_masked, True), "chunk": (_int(0, SECAGG_MAX_CHUNKS - 1), False),
                         "chunks": (_int(1, SECAGG_MAX_CHUNKS), False), "sha256": (_hex64, False)},
    Kind.SECAGG_REVEAL: {**_SECAGG_ROUND, "b": (_id_map(SECAGG_MAX_NEIGHBOURS, _b64_of(16, "a seed share")), True),
                         "sk": (_id_map(SECAGG_MAX_NEIGHBOURS, _b64_of(32, "a key share")), True)},
    Kind.SECAGG_ROSTER: {**_SECAGG_ROUND, "config": (_secagg_config, True), "members": (_members, True),
                         "adverts": (_adverts, True)},
    Kind.SECAGG_INBOX: {**_SECAGG_ROUND, "shares": (_id_map(SECAGG_MAX_NEIGHBOURS, _SHARE), True)},
    Kind.SECAGG_UNMASK: {**_SECAGG_ROUND, "survivors": (_id_list(SECAGG_MAX_NEIGHBOURS + 1), True),
                         "dropped": (_id_list(SECAGG_MAX_NEIGHBOURS), True)},
}
SECAGG_UP = (Kind.SECAGG_ADVERT, Kind.SECAGG_SHARES, Kind.SECAGG_MASKED, Kind.SECAGG_REVEAL)
SECAGG_DOWN = (Kind.SECAGG_ROSTER, Kind.SECAGG_INBOX, Kind.SECAGG_UNMASK)


_ROUND = _int(0, (1 << 32) - 1)
# Fleet-shared int8 engine choices (protocol/engine_choice.py): a device's state reports the
# ones it measured, a finetune command relays the ones the coordinator heard. Each side sends
# them only to a peer that said it reads them (the agent's hello `engine_choices: true`; a
# coordinator whose finetune commands carry the field), since an older peer's strict schema
# would refuse the whole message.
_ENGINE_CHOICES = _entries(MAX_SHARED_CHOICES)
_INDEX, _COUNT = _int(0, 0xFFFE), _int(1, 0xFFFF)
_SIZE = _int(0, MAX_BINARY_BYTES)
Schema = dict[str, tuple[Callable[[Any], None], bool]]
SCHEMAS: dict[Kind, Schema] = {
    Kind.HELLO: {"public_key": (_b64key, True), "agent": (_text(64), False), "info": (_flat, False)},
    Kind.STATE: {"status": (_enum("online", "offline", "idle", "busy"), True), "agent": (_text(64), False),
                 "job": (_id, False), "detail": (_text(256), False), "info": (_flat, False),
                 "engine_choices": (_ENGINE_CHOICES, False), "forecast": (_forecast, False)},
    Kind.CMD: {"cmd_id": (_id, True), "action": (_enum("finetune", "cancel", "fetch_model", "ping", "probe"), True),
               "job": (_id, False), "round": (_ROUND, False), "model": (_id, False), "version": (_id, False),
               "sha256": (_hex64, False), "head_sha256": (_hex64, False), "params": (_flat, False),
               "engine_choices": (_ENGINE_CHOICES, False)},
    Kind.ACK: {"job": (_id, True), "round": (_ROUND, True), "upload": (_hex64, True),
               "status": (_enum("accepted", "duplicate", "rejected"), True), "reason": (_id, False),
               "detail": (_text(512), False), "retry": (_bool, False)},
    Kind.PROGRESS: {"phase": (_id, True), "job": (_id, False), "round": (_ROUND, False), "cmd_id": (_id, False),
                    "pct": (_num(0, 100), False), "detail": (_text(512), False), "metrics": (_flat, False)},
    Kind.REFUSAL: {"reason": (_id, True), "detail": (_text(512), True), "ref_topic": (_text(256), False),
                   "ref_kind": (_id, False), "ref_seq": (_int(0, MAX_SEQ), False), "ref_sha256": (_hex64, False),
                   "ref_cmd_id": (_id, False)},
    Kind.MANIFEST: {"name": (_id, True), "version": (_id, True), "sha256": (_hex64, True),
                    "size": (_int(1, MAX_BUNDLE_BYTES), True), "chunks": (_COUNT, True),
                    "chunk_size": (_int(1, MAX_BINARY_BYTES), True), "meta": (_flat, False)},
    # samples, energy_wh, energy_kept and labels_sha256 ride on every chunk (signed with it):
    # FedAvg weights by the sample count, the coordinator reports the fleet's energy per
    # round and the share of each delta's energy (squared L2 norm) its update kept, and
    # refuses an update trained on another label set (edge_agent.labels.label_set_digest).
    Kind.UPDATE_CHUNK: {"job": (_id, True), "round": (_ROUND, True), "upload": (_hex64, True),
                        "index": (_INDEX, True), "count": (_COUNT, True), "size": (_SIZE, True),
                        "samples": (_int(1, 1_000_000_000), False), "energy_wh": (_num(0, 1e6), False),
                        "energy_kept": (_num(0, 1), False), "labels_sha256": (_hex64, False)},
    Kind.MODEL_CHUNK: {"name": (_id, True), "version": (_id, True), "sha256": (_hex64, True),
                       "index": (_INDEX, True), "count": (_COUNT, True), "size": (_SIZE, True)},
    # The coordinator's new public key, signed by an old one (coordinator/key_rotation.py): a
    # device that trusts the old key moves its trust to the new one (agent/coordinator_trust.py).
    Kind.KEY_ROTATION: {"public_key": (_b64key, True), "rotated_at": (_int(0, 1 << 40), True),
                        "detail": (_text(256), False)},
}
SCHEMAS.update(SECAGG_SCHEMAS)
BINARY_KINDS = frozenset({Kind.UPDATE_CHUNK, Kind.MODEL_CHUNK})
WINDOWED_KINDS = frozenset({Kind.CMD, Kind.ACK, Kind.PROGRESS, Kind.REFUSAL})
MAX_TTL: dict[Kind, int] = {Kind.HELLO: 365 * _DAY, Kind.STATE: 30 * _DAY, Kind.MANIFEST: 365 * _DAY,
                            Kind.MODEL_CHUNK: 365 * _DAY, Kind.UPDATE_CHUNK: _DAY, Kind.CMD: _DAY,
                            Kind.ACK: _DAY, Kind.PROGRESS: _DAY, Kind.REFUSAL: _DAY, Kind.KEY_ROTATION: 365 * _DAY,
                            **dict.fromkeys(SECAGG_SCHEMAS, _DAY)}
# the size limit of each kind (enforced before parsing, by the signer and the verifier)
MAX_BYTES: dict[Kind, int] = {k: MAX_BINARY_BYTES if k in BINARY_KINDS else
                              MAX_SECAGG_BYTES if k in SECAGG_SCHEMAS else MAX_CONTROL_BYTES for k in Kind}


def check_envelope(env: dict[str, Any]) -> None:
    """Validate the envelope's own fields (not the body); raises ValueError naming the field."""
    for name, check in (("from", _id), ("seq", _int(1, MAX_SEQ)), ("iat", _int(0, 1 << 40)),
                        ("exp", _int(0, 1 << 40))):
        try:
            check(env[name])
        except ValueError as exc:
            raise ValueError(f"envelope.{name} {exc}") from None


def check_body(kind: Kind, body: Any) -> None:
    """Validate a message body against its kind's schema; raises ValueError naming the field."""
    if not isinstance(body, dict):
        raise ValueError("body must be an object")
    schema = SCHEMAS[kind]
    for name in body:
        if name not in schema:
            raise ValueError(f"{kind}: unknown field {str(name)[:64]!r}")
    for name, (check, required) in schema.items():
        if name not in body:
            if required:
                raise ValueError(f"{kind}: missing field {name!r}")
            continue
        try:
            check(body[name])
        except ValueError as exc:
            raise ValueError(f"{kind}.{name} {exc}") from None
    if kind is Kind.SECAGG_MASKED:
        _masked_chunking(body)


def validate_id(value: str, what: str = "id") -> str:
    """Check a topic-safe id (device, job, model, fleet); returns it, raises InputError."""
    try:
        _id(value)
    except ValueError as exc:
        raise InputError(f"{what} {str(value)[:80]!r} {exc}") from None
    return value
