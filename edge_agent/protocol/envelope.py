"""Envelopes: sealing (sign) and opening (verify) control and binary messages."""

from __future__ import annotations

import base64
import hashlib
import json
import struct
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cryptography.exceptions import InvalidSignature

from ..keys import Ed25519PrivateKey, Ed25519PublicKey, fingerprint, public_key_from_bytes
from .replay import ReplayWindow, SequenceCounter
from .schema import (
    BINARY_KINDS,
    BINARY_MAGIC,
    ID_RE,
    MAX_BINARY_BYTES,
    MAX_BINARY_HEADER,
    MAX_BYTES,
    MAX_SEQ,
    MAX_TTL,
    PROTOCOL_VERSION,
    WINDOWED_KINDS,
    Kind,
    Reason,
    check_body,
    check_envelope,
    unb64,
)
from .topics import Route, Topics

DEFAULT_MAX_SKEW = 300.0
_DOMAIN = b"edgeft-sig-v1\0"
Clock = Callable[[], float]


class _Bad(Exception):
    def __init__(self, reason: Reason, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


@dataclass(frozen=True)
class Message:
    """A verified message: signature, time, replay and schema checks all passed."""

    kind: Kind
    route: Route
    sender: str
    seq: int
    issued_at: int
    expires_at: int
    body: dict[str, Any]
    data: bytes = b""

    @property
    def topic(self) -> str:
        return self.route.topic


@dataclass(frozen=True)
class Rejection:
    """Why a message was dropped; the claimed fields are unverified (for logs and replies)."""

    reason: Reason
    detail: str
    topic: str
    size: int
    sha256: str
    route: Route | None = None
    kind: str | None = None
    sender: str | None = None
    seq: int | None = None
    body: dict[str, Any] | None = field(default=None, repr=False)

    def __str__(self) -> str:
        who = f" from {self.sender}" if self.sender else ""
        return f"{self.reason}: {self.detail} ({self.kind or 'message'}{who} on {self.topic[:200]!r}, {self.size} bytes)"

    def refusal_body(self) -> dict[str, Any]:
        """Body of a `refusal` message reporting this rejection to the sender."""
        body: dict[str, Any] = {"reason": str(self.reason), "detail": self.detail[:512],
                                "ref_topic": self.topic[:256], "ref_sha256": self.sha256}
        if self.kind:
            body["ref_kind"] = self.kind
        if self.seq is not None:
            body["ref_seq"] = self.seq
        if self.body and self.kind == Kind.CMD and isinstance(self.body.get("cmd_id"), str) and ID_RE.fullmatch(self.body["cmd_id"]):
            body["ref_cmd_id"] = self.body["cmd_id"]
        return body


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def _signing_input(address: str, tag: bytes, content: bytes) -> bytes:
    return _DOMAIN + tag + address.encode() + b"\0" + content


def _no_dup_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("duplicate key")
    return out


def _strict_json(raw: bytes) -> dict[str, Any]:
    def no_constants(name: str) -> None:
        raise ValueError(f"{name} is not allowed")
    try:
        obj = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_dup_keys, parse_constant=no_constants)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise _Bad(Reason.MALFORMED, f"not strict UTF-8 JSON ({str(exc)[:120]})") from None
    if not isinstance(obj, dict):
        raise _Bad(Reason.MALFORMED, "not a JSON object")
    return obj


class TrustStore:
    """Public keys this side accepts, by key id (fingerprint), each with its role."""

    def __init__(self) -> None:
        self._keys: dict[str, tuple[Ed25519PublicKey, str]] = {}
        self._lock = threading.Lock()

    def add(self, key: Ed25519PublicKey, *, role: str) -> str:
        if role not in ("device", "coordinator"):
            raise ValueError(f"role must be 'device' or 'coordinator', not {role!r}")
        key_id = fingerprint(key)
        with self._lock:
            self._keys[key_id] = (key, role)
        return key_id

    def remove(self, key_id: str) -> None:
        with self._lock:
            self._keys.pop(key_id, None)

    def lookup(self, key_id: str) -> tuple[Ed25519PublicKey, str] | None:
        with self._lock:
            return self._keys.get(key_id)


class Signer:
    """Seals outgoing messages: validates the body, stamps seq/iat/exp, signs."""

    def __init__(self, *, key: Ed25519PrivateKey, topics: Topics, sequence: SequenceCounter,
                 clock: Clock = time.time) -> None:
        self._key, self.topics, self.sequence, self._clock = key, topics, sequence, clock
        self.key_id = fingerprint(key)

    def _envelope(self, topic: str, kind: Kind, body: Mapping[str, Any], ttl: float) -> tuple[Route, dict[str, Any]]:
        route = self.topics.parse(topic)
        if route is None or kind not in route.kinds:
            raise ValueError(f"{kind} cannot be sent on topic {topic!r}")
        if route.signer in ("device", "self") and route.device != self.key_id:
            raise ValueError(f"key {self.key_id} cannot sign for device {route.device}")
        if route.key is not None and route.key != self.key_id:
            raise ValueError(f"key {self.key_id} cannot sign the rotation of key {route.key}")
        body = dict(body)
        check_body(kind, body)
        if not 0 < ttl <= MAX_TTL[kind]:
            raise ValueError(f"{kind}: ttl {ttl} s is outside 0..{MAX_TTL[kind]}")
        now = int(self._clock())
        return route, {"v": PROTOCOL_VERSION, "kind": str(kind), "from": self.key_id,
                       "seq": self.sequence.next(), "iat": now, "exp": now + int(ttl), "body": body}

    def control(self, topic: str, kind: Kind, body: Mapping[str, Any], *, ttl: float) -> bytes:
        if kind in BINARY_KINDS:
            raise ValueError(f"{kind} is a binary kind: use Signer.binary")
        route, env = self._envelope(topic, kind, body, ttl)
        env["sig"] = base64.b64encode(self._key.sign(_signing_input(route.address, b"J", canonical_json(env)))).decode()
        out = canonical_json(env)
        if len(out) > MAX_BYTES[kind]:
            raise ValueError(f"{kind} message of {len(out)} bytes is over the {MAX_BYTES[kind]}-byte limit")
        return out

    def binary(self, topic: str, kind: Kind, body: Mapping[str, Any], data: bytes, *, ttl: float) -> bytes:
        if kind not in BINARY_KINDS:
            raise ValueError(f"{kind} is a control kind: use Signer.control")
        route, env = self._envelope(topic, kind, {**body, "size": len(data)}, ttl)
        header = canonical_json(env)
        if len(header) > MAX_BINARY_HEADER or 6 + len(header) + 64 + len(data) > MAX_BINARY_BYTES:
            raise ValueError(f"{kind} of {len(data)} data bytes does not fit a {MAX_BINARY_BYTES}-byte message")
        sig = self._key.sign(_signing_input(route.address, b"B", header + hashlib.sha256(data).digest()))
        return BINARY_MAGIC + struct.pack(">H", len(header)) + header + sig + data


class Verifier:
    """Opens incoming messages: returns a `Message`, or a `Rejection` saying why not.

    Untrusted bytes never raise. A local failure to record an authentic message (the replay
    window cannot be written: disk full) is a `local_fault` Rejection, so the sender hears why.
    """

    def __init__(self, *, topics: Topics, trust: TrustStore, replay: ReplayWindow | None,
                 clock: Clock = time.time, max_skew: float = DEFAULT_MAX_SKEW,
                 max_bytes: Mapping[Kind, int] | None = None) -> None:
        if max_skew < 0:
            raise ValueError("max_skew must be >= 0")
        self.topics, self.trust, self.replay, self._clock, self.max_skew = topics, trust, replay, clock, max_skew
        self._limits = dict(MAX_BYTES)
        self._limits.update(max_bytes or {})

    def open(self, topic: str, payload: bytes) -> Message | Rejection:
        claimed: dict[str, Any] = {}
        route = self.topics.parse(topic)
        try:
            if route is None:
                raise _Bad(Reason.UNKNOWN_TOPIC, "not a topic of this fleet's protocol")
            return self._open(route, bytes(payload), claimed)
        except _Bad as bad:
            return Rejection(bad.reason, bad.detail, topic, len(payload), hashlib.sha256(payload).hexdigest(),
                             route=route, **claimed)

    def authentic(self, topic: str, payload: bytes) -> bool:
        """The cheap part of `open`, for a network thread sorting its inbox: size, topic,
        parse, schema, a valid signature by a key this side trusts, and the time limits;
        nothing is recorded (the replay window is `open`'s). Never raises for any bytes."""
        route = self.topics.parse(topic)
        if route is None:
            return False
        try:
            self._open(route, bytes(payload), {}, record=False)
        except _Bad:
            return False
        return True

    def _open(self, route: Route, payload: bytes, claimed: dict[str, Any], *, record: bool = True) -> Message:
        limit = max(self._limits[k] for k in route.kinds)
        if len(payload) > limit:
            raise _Bad(Reason.OVERSIZED, f"{len(payload)} bytes is over the {limit}-byte limit of this topic")
        binary = route.kinds[0] in BINARY_KINDS
        header = data = b""
        if binary:
            if len(payload) < 6 or payload[:4] != BINARY_MAGIC:
                raise _Bad(Reason.MALFORMED, f"not a binary envelope (magic {payload[:4]!r})")
            (hlen,) = struct.unpack_from(">H", payload, 4)
            if hlen > MAX_BINARY_HEADER or len(payload) < 6 + hlen + 64:
                raise _Bad(Reason.MALFORMED, f"header length {hlen} does not fit the {len(payload)}-byte message")
            header = payload[6 : 6 + hlen]
            sig, data = payload[6 + hlen : 6 + hlen + 64], payload[6 + hlen + 64 :]
            env = _strict_json(header)
        else:
            env = _strict_json(payload)
            sig = unb64(env.pop("sig")) if isinstance(env.get("sig"), str) else b""
        # Remember what it claims to be, for the log line and a refusal reply.
        for name, field_ in (("kind", "kind"), ("from", "sender")):
            if isinstance(env.get(name), str) and ID_RE.fullmatch(env[name]):
                claimed[field_] = env[name]
        if isinstance(env.get("seq"), int) and not isinstance(env["seq"], bool) and 0 <= env["seq"] <= MAX_SEQ:
            claimed["seq"] = env["seq"]
        if isinstance(env.get("body"), dict):
            claimed["body"] = env["body"]
        if env.get("v") != PROTOCOL_VERSION:
            raise _Bad(Reason.UNSUPPORTED_VERSION, f"protocol version {str(env.get('v'))[:20]}, this code speaks {PROTOCOL_VERSION}")
        if set(env) != {"v", "kind", "from", "seq", "iat", "exp", "body"}:
            raise _Bad(Reason.BAD_SCHEMA, f"envelope fields {sorted(env)[:10]} are not v,kind,from,seq,iat,exp,body(,sig)")
        try:
            kind = Kind(env["kind"])
        except ValueError:
            raise _Bad(Reason.WRONG_KIND, f"unknown kind {str(env['kind'])[:40]!r}") from None
        if kind not in route.kinds:
            raise _Bad(Reason.WRONG_KIND, f"{kind} is not carried on the {route.channel} topic")
        try:
            check_envelope(env)
            check_body(kind, env["body"])
        except ValueError as exc:
            raise _Bad(Reason.BAD_SCHEMA, str(exc)) from None
        if len(sig) != 64:
            raise _Bad(Reason.BAD_SCHEMA, "signature must be 64 bytes")
        body = env["body"]
        self._check_route(route, kind, env["from"], body, data)
        key = self._key_for(route, kind, env["from"], body)
        content = header + hashlib.sha256(data).digest() if binary else canonical_json(env)
        try:
            key.verify(sig, _signing_input(route.address, b"B" if binary else b"J", content))
        except InvalidSignature:
            raise _Bad(Reason.BAD_SIGNATURE, f"signature does not verify with key {env['from']}") from None
        now = self._clock()
        iat, exp = env["iat"], env["exp"]
        if iat > now + self.max_skew:
            raise _Bad(Reason.NOT_YET_VALID, f"issued {iat - now:.0f} s in the future (clock skew?)")
        if now > exp:
            raise _Bad(Reason.EXPIRED, f"expired {now - exp:.0f} s ago (at {exp}, local clock {now:.0f})")
        if exp - iat > MAX_TTL[kind] or exp < iat:
            raise _Bad(Reason.TTL_TOO_LONG, f"valid for {exp - iat} s; {kind} allows 0..{MAX_TTL[kind]}")
        if record and kind in WINDOWED_KINDS and self.replay is not None:
            try:
                why = self.replay.check_and_record(env["from"], env["seq"], iat)
            except OSError as exc:  # authentic, but not recorded: refuse it, and say why
                raise _Bad(Reason.LOCAL_FAULT, f"cannot record it in the replay window: "
                                               f"{exc.strerror or exc} ({exc.filename or ''})") from None
            if why:
                raise _Bad(Reason.REPLAYED, why)
        return Message(kind, route, env["from"], env["seq"], iat, exp, body, data)

    @staticmethod
    def _check_route(route: Route, kind: Kind, sender: str, body: dict[str, Any], data: bytes) -> None:
        if route.signer in ("device", "self") and sender != route.device:
            raise _Bad(Reason.WRONG_SIGNER, f"sender {sender} may not publish on device {route.device}'s topics")
        if route.key is not None and sender != route.key:  # a rotation away from key K is K's to sign
            raise _Bad(Reason.WRONG_SIGNER, f"rotation of key {route.key} signed by {sender}")
        if route.model is not None and (body["name"], body["version"]) != (route.model, route.version):
            raise _Bad(Reason.BAD_SCHEMA, f"body names {body['name']}/{body['version']}, topic {route.model}/{route.version}")
        if kind in BINARY_KINDS:
            if body["index"] >= body["count"] or route.index not in (None, body["index"]):
                raise _Bad(Reason.BAD_SCHEMA, f"chunk index {body['index']} of {body['count']} (topic index {route.index})")
            if body["size"] != len(data):
                raise _Bad(Reason.BAD_SCHEMA, f"header says {body['size']} data bytes, message carries {len(data)}")

    def _key_for(self, route: Route, kind: Kind, sender: str, body: dict[str, Any]) -> Ed25519PublicKey:
        if route.signer == "self":
            key = public_key_from_bytes(unb64(body["public_key"]))
            if fingerprint(key) != sender:
                raise _Bad(Reason.WRONG_SIGNER, f"hello key's fingerprint is {fingerprint(key)}, not {sender}")
            return key
        found = self.trust.lookup(sender)
        if found is None:
            raise _Bad(Reason.UNKNOWN_KEY, f"key {sender} is not enrolled")
        key, role = found
        if role != route.signer:
            raise _Bad(Reason.WRONG_SIGNER, f"{kind} must be signed by a {route.signer} key; {sender} is a {role} key")
        return key
