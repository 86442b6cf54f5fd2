"""Secure aggregation, the device's side (SecAgg+, Bell et al. 2020, "Secure Single-Server
Aggregation with (Poly)Logarithmic Overhead"); the coordinator's side is
coordinator/secagg.py. A library: dicts and bytes in, dicts and bytes out, no transport.

One round, four phases (each device is a `SecAggDevice`, a state machine that refuses a step
out of order):

    0 advertise   two fresh X25519 key pairs -- `c` to encrypt shares, `s` to agree pairwise
                  masks -- and a commitment to a fresh 16-byte self-mask seed b, all signed
                  with the device's Ed25519 key (its id is that key's fingerprint, so any
                  device can check an advertisement without a PKI beyond the ids)
    1 share keys  the coordinator's roster (the devices that advertised, U0) fixes the graph:
                  `neighbours()`, a k-regular graph drawn from a public seed (SecAgg+), or the
                  complete graph when k >= |U0| - 1. Each device Shamir-shares (threshold t)
                  b and its `s` private key among its neighbours, each neighbour's shares
                  encrypted to it (ChaCha20-Poly1305, key = HKDF of the `c` agreement; the
                  round, sender and recipient are the associated data)
    2 masked input  y = x + PRG(b) + sum_j (+/-) PRG(s_ij) mod 2^32 over the neighbours j that
                  shared keys (U1), + if id < j else -. x is the update quantised to integers
                  (`Quantiser`: fixed point of the device-clipped, optionally noised, vector;
                  dense, so every device masks the same index set)
    3 unmasking   given the devices whose masked input arrived (U2) and those that dropped
                  (U1 - U2), a device reveals, for each neighbour, the share of b if it survived
                  or the share of its `s` key if it dropped -- never both, and only once

PRG: ChaCha20 (cryptography) keyed by HKDF-SHA256 of the seed or the X25519 secret, salted
with the round id. Shamir: pycryptodome's `Crypto.Protocol.SecretSharing.Shamir` over
GF(2^128) (16-byte secrets: a 32-byte X25519 key is shared as two halves with the same
holders), imported lazily -- the idle agent never loads it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import math
import os
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ..errors import InputError
from ..keys import fingerprint, public_key_bytes, public_key_from_bytes

MODULUS_BITS = 32  # masked inputs live in Z_{2^32}
MAX_DEVICES = 10_000
MAX_LENGTH = 16_000_000  # coordinates per vector (64 MB masked): the limit before parsing
SHARE_BYTES = 16  # Shamir over GF(2^128)
SHARE_PLAIN = 3 * SHARE_BYTES  # b, s_sk[:16], s_sk[16:]
NONCE = 12
SHARE_CIPHER = NONCE + SHARE_PLAIN + 16  # + the Poly1305 tag
MASKED_MAGIC = b"SAM1"
_ID = re.compile(r"^[a-z2-7]{24}$")  # keys.fingerprint


class SecAggError(InputError):
    """A secure-aggregation message or step refused: what and why."""


# --- public round parameters ---------------------------------------------------------------

@dataclass(frozen=True)
class RoundConfig:
    """Everything public about one secure round, chosen by the coordinator and sent to every
    selected device: they all derive the graph, the shares' holders and the quantisation
    from it."""

    round_id: str  # e.g. "job-id/round": binds every key, share and mask to this round
    devices: tuple[str, ...]  # the selected devices, sorted
    degree: int  # k: neighbours per device (>= len(devices) - 1: the complete graph)
    threshold: int  # t: shares needed to reconstruct a secret
    graph_seed: str  # hex, public
    length: int  # coordinates in the vector
    clip: float  # L2 bound C the device clips its update to (the job's dp_clip)
    noise_std: float = 0.0  # each device's Gaussian noise std (distributed DP), 0 for none

    def __post_init__(self) -> None:
        n = len(self.devices)
        if not 2 <= n <= MAX_DEVICES or list(self.devices) != sorted(set(self.devices)):
            raise SecAggError(f"a secure round needs 2..{MAX_DEVICES} distinct devices, sorted; got {n}")
        for d in self.devices:
            if not _ID.match(d):
                raise SecAggError(f"bad device id {d[:40]!r}")
        if self.degree < 1 or (self.degree < n - 1 and self.degree % 2):
            raise SecAggError(f"degree must be even (a circulant graph) or >= devices - 1, got {self.degree}")
        if not 1 <= self.threshold <= min(self.degree, n - 1):
            raise SecAggError(f"threshold {self.threshold} must be in 1..min(degree, devices - 1)")
        if not 1 <= self.length <= MAX_LENGTH:
            raise SecAggError(f"length {self.length} out of 1..{MAX_LENGTH}")
        if not (math.isfinite(self.clip) and self.clip > 0 and math.isfinite(self.noise_std) and self.noise_std >= 0):
            raise SecAggError("clip must be positive and noise_std non-negative")
        if not re.fullmatch(r"[0-9a-f]{32,64}", self.graph_seed) or not 1 <= len(self.round_id) <= 200:
            raise SecAggError("graph_seed must be 32..64 hex digits and round_id 1..200 characters")

    @property
    def quantiser(self) -> Quantiser:
        return Quantiser(clip=self.clip, noise_std=self.noise_std, devices=len(self.devices))

    def to_json(self) -> dict[str, Any]:
        return {"round_id": self.round_id, "devices": list(self.devices), "degree": self.degree,
                "threshold": self.threshold, "graph_seed": self.graph_seed, "length": self.length,
                "clip": self.clip, "noise_std": self.noise_std}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RoundConfig:
        try:
            return cls(round_id=str(d["round_id"]), devices=tuple(str(x) for x in d["devices"]),
                       degree=int(d["degree"]), threshold=int(d["threshold"]), graph_seed=str(d["graph_seed"]),
                       length=int(d["length"]), clip=float(d["clip"]), noise_std=float(d.get("noise_std", 0.0)))
        except (KeyError, TypeError, ValueError) as e:
            raise SecAggError(f"bad round config: {e}") from None


def default_degree(n: int, c: float = 1.0) -> int:
    """SecAgg+'s k ~ 2 c log2(n), even, at least 4 (or n - 1, the complete graph, if smaller)."""
    k = max(4, 2 * math.ceil(c * math.log2(max(n, 2))))
    return n - 1 if k >= n - 1 else k


def neighbours(members: Sequence[str], degree: int, seed: str) -> dict[str, tuple[str, ...]]:
    """The round's graph over `members` (the devices that advertised): complete when degree >=
    len - 1, else a circulant k-regular graph on a permutation drawn from the public seed --
    each device linked to the k/2 next and k/2 previous on the shuffled ring. Sorted tuples."""
    ms = sorted(set(members))
    n = len(ms)
    if degree >= n - 1:
        return {m: tuple(x for x in ms if x != m) for m in ms}
    ring = sorted(ms, key=lambda m: hmac.new(bytes.fromhex(seed), m.encode(), hashlib.sha256).digest())
    half = degree // 2
    out: dict[str, set[str]] = {m: set() for m in ms}
    for i, m in enumerate(ring):
        for off in range(1, half + 1):
            out[m].add(ring[(i + off) % n])
            out[m].add(ring[(i - off) % n])
    return {m: tuple(sorted(v)) for m, v in out.items()}


def share_index(holder: str, holders: Sequence[str]) -> int:
    """The Shamir x-coordinate of `holder` among a device's neighbours (sorted): 1-based."""
    return list(holders).index(holder) + 1


# --- quantisation and PRG ------------------------------------------------------------------

@dataclass(frozen=True)
class Quantiser:
    """Fixed point in Z_{2^32}: x -> round(x * scale), each coordinate clamped to +/- R with
    R = clip + 6 noise_std (a clipped vector's coordinate is at most C; the noise's tail beyond
    6 sigma is ~1e-9 per coordinate), scale chosen so that `devices` such values sum without
    wrapping: devices * R * scale < 2^31. The sum decodes as a signed int32 / scale."""

    clip: float
    noise_std: float
    devices: int

    @property
    def bound(self) -> float:
        return self.clip + 6.0 * self.noise_std

    @property
    def scale(self) -> float:
        return math.floor((2**31 - 1) / (self.devices * self.bound))

    def quantise(self, x: np.ndarray) -> np.ndarray:
        x = np.clip(np.asarray(x, np.float64).ravel(), -self.bound, self.bound)
        return np.rint(x * self.scale).astype(np.int64).astype(np.uint32)

    def decode_sum(self, total: np.ndarray) -> np.ndarray:
        return np.asarray(total, np.uint32).view(np.int32).astype(np.float64) / self.scale


def flat_by_name(tensors: Mapping[str, np.ndarray]) -> np.ndarray:
    """A head's tensors as one float64 vector in name order: the order every device masks in
    and the coordinator unflattens from (`unflat_by_name`), whatever order each side loaded."""
    return np.concatenate([np.asarray(tensors[n], np.float64).ravel() for n in sorted(tensors)]) if tensors \
        else np.zeros(0)


def unflat_by_name(vec: np.ndarray, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    out, at = {}, 0
    for n in sorted(shapes):
        size = math.prod(shapes[n])
        out[n] = np.asarray(vec[at:at + size]).reshape(shapes[n])
        at += size
    if at != len(vec):
        raise SecAggError(f"a vector of {len(vec)} coordinates for tensors of {at}")
    return out


def clip_and_noise(vec: np.ndarray, clip: float, noise_std: float, rng: np.random.Generator | None = None) -> np.ndarray:
    """The device's private form of its update: clipped to L2 norm `clip`, plus N(0, noise_std^2)
    per coordinate (its share of the round's distributed DP noise; `rng`: a CSPRNG-seeded one)."""
    v = np.asarray(vec, np.float64).ravel()
    norm = float(np.linalg.norm(v))
    if norm > clip:
        v = v * (clip / norm)
    if noise_std > 0:
        gen = rng if rng is not None else np.random.Generator(np.random.PCG64(int.from_bytes(os.urandom(16), "big")))
        v = v + gen.normal(0.0, noise_std, v.size)
    return v


def _hkdf(secret: bytes, salt: str, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=salt.encode(), info=info).derive(secret)


def prg(key: bytes, length: int) -> np.ndarray:
    """`length` uint32 words of ChaCha20 keystream under a 32-byte key (nonce 0: one use per key)."""
    enc = Cipher(algorithms.ChaCha20(key, b"\0" * 16), mode=None).encryptor()
    return np.frombuffer(enc.update(b"\0" * (4 * length)), dtype="<u4")


def self_mask_key(seed: bytes, round_id: str) -> bytes:
    return _hkdf(seed, round_id, b"edge-agent secagg self mask")


def pair_mask_key(secret: bytes, round_id: str, a: str, b: str) -> bytes:
    lo, hi = sorted((a, b))
    return _hkdf(secret, round_id, f"edge-agent secagg pair mask {lo} {hi}".encode())


def pair_sign(me: str, other: str) -> int:
    return 1 if me < other else -1


def seed_commitment(round_id: str, device: str, seed: bytes) -> bytes:
    return hashlib.sha256(b"edge-agent secagg b\0" + round_id.encode() + b"\0" + device.encode() + b"\0" + seed).digest()


def _share_aead_key(secret: bytes, round_id: str) -> bytes:
    return _hkdf(secret, round_id, b"edge-agent secagg share encryption")


def _aad(round_id: str, sender: str, recipient: str) -> bytes:
    return f"{round_id}\0{sender}\0{recipient}".encode()


def advert_payload(round_id: str, device: str, c_pk: bytes, s_pk: bytes, commit: bytes) -> bytes:
    return b"edge-agent secagg advert v1\0" + round_id.encode() + b"\0" + device.encode() + b"\0" + c_pk + s_pk + commit


# --- message validation --------------------------------------------------------------------

def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(value: Any, size: int, what: str) -> bytes:
    """Decode a base64 field of exactly `size` bytes (length checked before decoding)."""
    if not isinstance(value, str) or len(value) != 4 * math.ceil(size / 3):
        raise SecAggError(f"{what}: expected base64 of {size} bytes")
    try:
        raw = base64.b64decode(value, validate=True)
    except ValueError:
        raise SecAggError(f"{what}: not base64") from None
    if len(raw) != size:
        raise SecAggError(f"{what}: expected {size} bytes, got {len(raw)}")
    return raw


def members_bitmap(members: Collection[str], devices: Sequence[str]) -> str:
    """U0 as a bitmap over the round's selected devices (n/8 bytes rather than n ids)."""
    bits = np.array([d in members for d in devices], dtype=bool)
    return b64(np.packbits(bits).tobytes())


def members_from_bitmap(value: Any, devices: Sequence[str]) -> list[str]:
    raw = unb64(value, (len(devices) + 7) // 8, "roster members")
    bits = np.unpackbits(np.frombuffer(raw, np.uint8))[:len(devices)]
    return [d for d, b in zip(devices, bits, strict=True) if b]


def check_id(value: Any, what: str) -> str:
    if not isinstance(value, str) or not _ID.match(value):
        raise SecAggError(f"{what}: not a device id")
    return value


@dataclass(frozen=True)
class Advert:
    device: str
    signing_key: bytes  # Ed25519, raw: its fingerprint must be `device`
    c_pk: bytes
    s_pk: bytes
    commit: bytes  # sha256 commitment to the self-mask seed
    signature: bytes

    def to_json(self) -> dict[str, str]:
        return {"device": self.device, "key": b64(self.signing_key), "c_pk": b64(self.c_pk), "s_pk": b64(self.s_pk),
                "commit": b64(self.commit), "sig": b64(self.signature)}

    @classmethod
    def parse(cls, d: Any, round_id: str) -> Advert:
        """Validate an advertisement: sizes, the id is the signing key's fingerprint, the signature."""
        if not isinstance(d, Mapping) or set(d) != {"device", "key", "c_pk", "s_pk", "commit", "sig"}:
            raise SecAggError("advertisement: expected exactly device, key, c_pk, s_pk, commit, sig")
        a = cls(check_id(d["device"], "advertisement device"), unb64(d["key"], 32, "advertisement key"),
                unb64(d["c_pk"], 32, "advertisement c_pk"), unb64(d["s_pk"], 32, "advertisement s_pk"),
                unb64(d["commit"], 32, "advertisement commit"), unb64(d["sig"], 64, "advertisement sig"))
        pub = public_key_from_bytes(a.signing_key)
        if fingerprint(pub) != a.device:
            raise SecAggError(f"advertisement of {a.device}: the key is not that device's")
        try:
            pub.verify(a.signature, advert_payload(round_id, a.device, a.c_pk, a.s_pk, a.commit))
        except InvalidSignature:
            raise SecAggError(f"advertisement of {a.device}: bad signature") from None
        return a


# --- the device ------------------------------------------------------------------------------

class SecAggDevice:
    """One device's state through one secure round (module doc). Secrets live only here."""

    def __init__(self, *, device_key: Ed25519PrivateKey, config: RoundConfig | None = None,
                 round_id: str | None = None, random: Callable[[int], bytes] = os.urandom) -> None:
        """`config`, or only the `round_id` when the device advertises before it knows the
        round's public parameters (a fleet job: they come with the roster, `share_keys`)."""
        self.id = fingerprint(device_key)
        if config is not None:
            self._check_config(config)
        elif not round_id or len(round_id) > 200:
            raise SecAggError("a secure round's device needs its config or its round id (1..200 characters)")
        self.round_id = config.round_id if config is not None else str(round_id)
        self._config = config
        self._key = device_key
        self._random = random
        self._c = X25519PrivateKey.generate()
        self._s = X25519PrivateKey.generate()
        self._seed = random(SHARE_BYTES)
        self.phase = "advertise"
        self._nbrs: tuple[str, ...] = ()
        self._adverts: dict[str, Advert] = {}
        self._held: dict[str, bytes] = {}  # sender -> its 48 bytes of shares for me
        self._answer: tuple[tuple[str, ...], tuple[str, ...], dict[str, Any]] | None = None

    def _expect(self, phase: str) -> None:
        if self.phase != phase:
            raise SecAggError(f"{self.id}: {phase} asked in phase {self.phase}")

    def _check_config(self, config: RoundConfig) -> None:
        if self.id not in config.devices:
            raise SecAggError(f"{self.id} is not selected for round {config.round_id}")

    @property
    def config(self) -> RoundConfig:
        if self._config is None:
            raise SecAggError(f"{self.id}: the round's config is not known before its roster")
        return self._config

    def advertise(self) -> dict[str, str]:
        self._expect("advertise")
        c_pk, s_pk = (k.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
                      for k in (self._c, self._s))
        commit = seed_commitment(self.round_id, self.id, self._seed)
        sig = self._key.sign(advert_payload(self.round_id, self.id, c_pk, s_pk, commit))
        self.phase = "share"
        return Advert(self.id, public_key_bytes(self._key), c_pk, s_pk, commit, sig).to_json()

    def share_keys(self, roster: Mapping[str, Any], config: RoundConfig | None = None) -> dict[str, Any]:
        """roster {"members": bitmap of U0 over config.devices, "adverts": [this device's and its
        neighbours' advertisements]} -> {"shares": {neighbour: base64 ciphertext}}. `config`: the
        round's, for a device made with only the round id (it must be that round's)."""
        from Crypto.Protocol.SecretSharing import Shamir  # lazily: ~10 ms, only in a secure round

        self._expect("share")
        if config is not None:
            if config.round_id != self.round_id or (self._config is not None and config != self._config):
                raise SecAggError(f"roster: config of round {config.round_id[:80]!r}, this device is in {self.round_id!r}")
            self._check_config(config)
            self._config = config
        members = members_from_bitmap(roster.get("members") if isinstance(roster, Mapping) else None,
                                      self.config.devices)
        if self.id not in members:
            raise SecAggError("roster: this device is not among the members")
        nbrs = neighbours(members, self.config.degree, self.config.graph_seed)[self.id]
        if len(nbrs) < self.config.threshold:
            raise SecAggError(f"roster: {len(nbrs)} neighbours, below the threshold {self.config.threshold}")
        adverts = roster.get("adverts")
        if not isinstance(adverts, list) or len(adverts) != len(nbrs) + 1:
            raise SecAggError(f"roster: expected the advertisements of this device and its {len(nbrs)} neighbours")
        by_id = {a.device: a for a in (Advert.parse(a, self.config.round_id) for a in adverts)}
        if set(by_id) != {self.id, *nbrs}:
            raise SecAggError("roster: the advertisements are not this device's and its neighbours'")
        self._nbrs, self._adverts = nbrs, {n: by_id[n] for n in nbrs}
        t, n = self.config.threshold, len(nbrs)
        raw_s = self._s.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                      serialization.NoEncryption())
        parts = [Shamir.split(t, n, secret) for secret in (self._seed, raw_s[:16], raw_s[16:])]
        out = {}
        for i, nb in enumerate(nbrs):
            plain = b"".join(p[i][1] for p in parts)
            key = _share_aead_key(self._c.exchange(X25519PublicKey.from_public_bytes(self._adverts[nb].c_pk)),
                                  self.config.round_id)
            nonce = self._random(NONCE)
            ct = ChaCha20Poly1305(key).encrypt(nonce, plain, _aad(self.config.round_id, self.id, nb))
            out[nb] = b64(nonce + ct)
        self.phase = "mask"
        return {"shares": out}

    def masked_input(self, inbox: Mapping[str, Any], x: np.ndarray) -> bytes:
        """inbox {"shares": {sender: ciphertext}} (the neighbours that shared keys, U1) and the
        quantised update (uint32, `Quantiser.quantise`) -> the masked vector's bytes."""
        self._expect("mask")
        shares = inbox.get("shares") if isinstance(inbox, Mapping) else None
        if not isinstance(shares, Mapping) or not set(shares) <= set(self._nbrs):
            raise SecAggError("inbox: expected shares from this device's neighbours only")
        if len(shares) < self.config.threshold:
            raise SecAggError(f"inbox: {len(shares)} neighbours shared keys, below the threshold {self.config.threshold}")
        x = np.asarray(x)
        if x.dtype != np.uint32 or x.shape != (self.config.length,):
            raise SecAggError(f"masked input: expected {self.config.length} uint32, got {x.dtype} {x.shape}")
        held = {}
        for sender, value in shares.items():
            blob = unb64(value, SHARE_CIPHER, f"share from {sender}")
            key = _share_aead_key(self._c.exchange(X25519PublicKey.from_public_bytes(self._adverts[sender].c_pk)),
                                  self.config.round_id)
            try:
                held[sender] = ChaCha20Poly1305(key).decrypt(blob[:NONCE], blob[NONCE:],
                                                             _aad(self.config.round_id, sender, self.id))
            except InvalidTag:
                raise SecAggError(f"share from {sender}: does not decrypt (tampered or forged)") from None
        self._held = held
        y = x.astype(np.uint32, copy=True)
        y += prg(self_mask_key(self._seed, self.config.round_id), self.config.length)
        for other in sorted(held):
            secret = self._s.exchange(X25519PublicKey.from_public_bytes(self._adverts[other].s_pk))
            mask = prg(pair_mask_key(secret, self.config.round_id, self.id, other), self.config.length)
            if pair_sign(self.id, other) > 0:
                y += mask
            else:
                y -= mask
        self.phase = "unmask"
        return MASKED_MAGIC + y.astype("<u4").tobytes()

    def unmask(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """request {"survivors": [...], "dropped": [...]} (U2 and U1 - U2 among this device and its
        neighbours) -> {"b": {j: share},
        "sk": {j: share}}: for each neighbour that shared with this device, the share of its
        self-mask seed if it survived, of its mask key if it dropped. Answered once: the same
        request again gets the same answer, a different one is refused."""
        if not isinstance(request, Mapping):
            raise SecAggError("unmask request: expected a mapping")
        surv, drop = request.get("survivors"), request.get("dropped")
        if not (isinstance(surv, list) and isinstance(drop, list)) or len(surv) + len(drop) > len(self.config.devices):
            raise SecAggError("unmask request: expected survivors and dropped lists")
        s, d = tuple(sorted(map(str, surv))), tuple(sorted(map(str, drop)))
        if self._answer is not None:
            if (s, d) != self._answer[:2]:
                raise SecAggError("unmask request: already answered a different one (a device reveals once)")
            return self._answer[2]
        self._expect("unmask")
        if set(s) & set(d):
            raise SecAggError("unmask request: a device listed both as survivor and as dropped")
        if self.id not in s:
            raise SecAggError("unmask request: this device is not among the survivors")
        if len(set(s) & set(self._held)) + 1 < self.config.threshold:
            raise SecAggError(f"unmask request: {len(set(s) & set(self._held))} surviving neighbours, below the "
                              f"threshold {self.config.threshold}")
        if set(self._held) - set(s) - set(d):
            raise SecAggError("unmask request: a neighbour that shared keys is neither survivor nor dropped")
        out: dict[str, Any] = {"b": {}, "sk": {}}
        for sender, plain in sorted(self._held.items()):
            if sender in s:
                out["b"][sender] = b64(plain[:SHARE_BYTES])
            elif sender in d:
                out["sk"][sender] = b64(plain[SHARE_BYTES:])
        self._answer = (s, d, out)
        self.phase = "done"
        return out

    # --- persistence (the device's secrets: its state dir, 0600, written crash-safely) ----
    def to_json(self) -> dict[str, Any]:
        """Everything this device needs to go on after a restart: its private keys and seed
        included (the caller writes it 0600 and deletes it when the round ends)."""
        def raw(k: X25519PrivateKey) -> str:
            return b64(k.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                       serialization.NoEncryption()))
        return {"round_id": self.round_id, "config": None if self._config is None else self._config.to_json(),
                "phase": self.phase, "c": raw(self._c), "s": raw(self._s), "seed": b64(self._seed),
                "nbrs": list(self._nbrs), "adverts": {k: a.to_json() for k, a in self._adverts.items()},
                "held": {k: b64(v) for k, v in self._held.items()},
                "answer": None if self._answer is None else [list(self._answer[0]), list(self._answer[1]),
                                                             self._answer[2]]}

    @classmethod
    def from_json(cls, d: Mapping[str, Any], *, device_key: Ed25519PrivateKey,
                  random: Callable[[int], bytes] = os.urandom) -> SecAggDevice:
        """The device `to_json` saved (SecAggError for a damaged or foreign record)."""
        try:
            config = RoundConfig.from_json(d["config"]) if d["config"] is not None else None
            dev = cls(device_key=device_key, config=config, round_id=str(d["round_id"]), random=random)
            if dev.round_id != str(d["round_id"]) or d["phase"] not in ("advertise", "share", "mask", "unmask", "done"):
                raise SecAggError("round id or phase")
            dev.phase = str(d["phase"])
            dev._c = X25519PrivateKey.from_private_bytes(unb64(d["c"], 32, "c key"))
            dev._s = X25519PrivateKey.from_private_bytes(unb64(d["s"], 32, "s key"))
            dev._seed = unb64(d["seed"], SHARE_BYTES, "seed")
            dev._nbrs = tuple(check_id(x, "neighbour") for x in d["nbrs"])
            dev._adverts = {str(k): Advert.parse(v, dev.round_id) for k, v in d["adverts"].items()}
            dev._held = {check_id(k, "sender"): unb64(v, SHARE_PLAIN, "held share") for k, v in d["held"].items()}
            a = d["answer"]
            dev._answer = None if a is None else (tuple(map(str, a[0])), tuple(map(str, a[1])), dict(a[2]))
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
            raise SecAggError(f"secure round device state: {e!r}"[:300]) from None
        return dev
