"""Secure aggregation, the coordinator's side (SecAgg+; the protocol and the device's side:
updates/secagg.py). `SecAggRound` is one round's state machine: it routes the devices'
messages, keeps only the running sum of the masked inputs, and at the end reconstructs from
the survivors' shares exactly the masks that are left in that sum -- learning the sum of the
survivors' quantised updates and nothing about any one of them.

    advertise -> share -> mask -> unmask -> done        (or failed, with why)

    close_advertise  U0 = the devices whose signed advertisement verified; the roster for all
    close_share      U1 = those that sent every neighbour its encrypted shares; each member
                     of U1 gets the ciphertexts addressed to it (from U1 only)
    close_mask       U2 = those whose masked input arrived (the sum is kept, not the inputs);
                     the unmask request names U2 and U1 - U2, fixed from here on
    close_unmask     from the answers: every survivor's self-mask seed and every dropped
                     device's mask key, each from >= t shares, checked against its commitment
                     (the seed) or its advertised public key (the mask key); the masks removed

Refusals, naming why: fewer than t devices in U1 or U2, or fewer than t shares for any secret
the sum needs (SecAggAborted); a message out of phase, from an unselected device, of the wrong
size or shape, a bad signature, a second message from the same device (SecAggError).

The coordinator never holds both secrets of one device: U2 and U1 - U2 are disjoint and fixed
before the first share is asked for, and an answer is accepted only in exactly that pattern
(b-shares for survivors, key shares for the dropped). Honest-but-curious coordinator with
devices that follow the protocol; against an actively lying coordinator Bell et al. add a
consistency round (every survivor signs U2) -- not built here (docs/fleet.md).

The state is JSON (`to_json` / `from_json`; `save` / `load` write it crash-safely), so a
coordinator restarted between phases resumes the round.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from ..atomic import atomic_write_json, read_json_object
from ..updates.secagg import (
    MASKED_MAGIC,
    SHARE_BYTES,
    SHARE_CIPHER,
    Advert,
    RoundConfig,
    SecAggError,
    b64,
    members_bitmap,
    neighbours,
    pair_mask_key,
    pair_sign,
    prg,
    seed_commitment,
    self_mask_key,
    share_index,
    unb64,
)

log = logging.getLogger("edge_agent.coordinator.secagg")

PHASES = ("advertise", "share", "mask", "unmask", "done", "failed")
MAX_STATE = 1 << 30


class SecAggAborted(SecAggError):
    """The round cannot finish (too few devices or shares): the reason says which."""


class SecAggRound:
    def __init__(self, config: RoundConfig) -> None:
        self.config = config
        self.phase = "advertise"
        self.reason = ""
        self.adverts: dict[str, dict[str, str]] = {}  # U0: device -> its advertisement (json)
        self.shares: dict[str, dict[str, str]] = {}  # sender -> {recipient: ciphertext}
        self.u1: list[str] = []
        self.masked: list[str] = []  # whose masked input is in the sum
        self.total = np.zeros(config.length, np.uint32)
        self.survivors: list[str] = []  # U2, fixed at close_mask
        self.dropped: list[str] = []  # U1 - U2
        self.answers: dict[str, dict[str, dict[str, str]]] = {}  # responder -> {"b": {...}, "sk": {...}}
        self._graph: dict[str, tuple[str, ...]] | None = None

    # --- helpers ---------------------------------------------------------------------------
    def _expect(self, phase: str, sender: str) -> None:
        if self.phase != phase:
            raise SecAggError(f"{phase} message from {sender} in phase {self.phase}")
        if sender not in self.config.devices:
            raise SecAggError(f"{sender} is not selected for round {self.config.round_id}")

    @property
    def graph(self) -> dict[str, tuple[str, ...]]:
        if self._graph is None:
            self._graph = neighbours(list(self.adverts), self.config.degree, self.config.graph_seed)
        return self._graph

    def _fail(self, why: str) -> SecAggAborted:
        self.phase, self.reason = "failed", why
        log.warning("secure round %s failed: %s", self.config.round_id, why)
        return SecAggAborted(why)

    # --- phase 0 ---------------------------------------------------------------------------
    def receive_advert(self, sender: str, msg: Any) -> None:
        self._expect("advertise", sender)
        a = Advert.parse(msg, self.config.round_id)
        if a.device != sender:
            raise SecAggError(f"advertisement of {a.device} sent by {sender}")
        if sender in self.adverts:
            raise SecAggError(f"a second advertisement from {sender}")
        self.adverts[sender] = a.to_json()

    def close_advertise(self) -> dict[str, dict[str, Any]]:
        """-> each device in U0's roster: U0 as a bitmap, its own and its neighbours' advertisements."""
        if self.phase != "advertise":
            raise SecAggError(f"close_advertise in phase {self.phase}")
        if len(self.adverts) <= self.config.threshold:
            raise self._fail(f"{len(self.adverts)} devices advertised keys: a threshold of "
                             f"{self.config.threshold} needs more than that many")
        self.adverts = dict(sorted(self.adverts.items()))
        self._graph = None
        self.phase = "share"
        log.info("secure round %s: %d devices advertised", self.config.round_id, len(self.adverts))
        members = members_bitmap(self.adverts, self.config.devices)
        return {d: {"members": members, "adverts": [self.adverts[x] for x in sorted((d, *self.graph[d]))]}
                for d in self.adverts}

    # --- phase 1 ---------------------------------------------------------------------------
    def receive_shares(self, sender: str, msg: Any) -> None:
        self._expect("share", sender)
        if sender not in self.adverts:
            raise SecAggError(f"shares from {sender}, which did not advertise")
        if sender in self.shares:
            raise SecAggError(f"a second set of shares from {sender}")
        got = msg.get("shares") if isinstance(msg, Mapping) else None
        nbrs = self.graph[sender]
        if not isinstance(got, Mapping) or set(got) != set(nbrs):
            raise SecAggError(f"shares from {sender}: expected one for each of its {len(nbrs)} neighbours")
        for nb, ct in got.items():
            unb64(ct, SHARE_CIPHER, f"share from {sender} to {nb}")
        self.shares[sender] = dict(got)

    def close_share(self) -> dict[str, dict[str, Any]]:
        """-> each member of U1's inbox: the ciphertexts addressed to it by U1."""
        if self.phase != "share":
            raise SecAggError(f"close_share in phase {self.phase}")
        self.u1 = sorted(self.shares)
        if len(self.u1) <= self.config.threshold:
            raise self._fail(f"{len(self.u1)} devices shared keys, not more than the threshold {self.config.threshold}")
        inbox: dict[str, dict[str, Any]] = {d: {"shares": {}} for d in self.u1}
        for sender in self.u1:
            for nb, ct in self.shares[sender].items():
                if nb in inbox:
                    inbox[nb]["shares"][sender] = ct
        self.phase = "mask"
        log.info("secure round %s: %d devices shared keys", self.config.round_id, len(self.u1))
        return inbox

    # --- phase 2 ---------------------------------------------------------------------------
    def receive_masked(self, sender: str, data: bytes) -> None:
        self._expect("mask", sender)
        if sender not in self.u1:
            raise SecAggError(f"masked input from {sender}, which did not share keys")
        if sender in self.masked:
            raise SecAggError(f"a second masked input from {sender}")
        want = len(MASKED_MAGIC) + 4 * self.config.length
        if not isinstance(data, bytes | bytearray) or len(data) != want or data[:4] != MASKED_MAGIC:
            raise SecAggError(f"masked input from {sender}: expected {want} bytes starting {MASKED_MAGIC!r}")
        self.total += np.frombuffer(data, dtype="<u4", offset=len(MASKED_MAGIC))  # wraps mod 2^32
        self.masked.append(sender)

    def close_mask(self) -> dict[str, dict[str, list[str]]]:
        """-> each survivor's unmask request (U2 and U1 - U2 among it and its neighbours; both
        fixed from here on)."""
        if self.phase != "mask":
            raise SecAggError(f"close_mask in phase {self.phase}")
        self.survivors = sorted(self.masked)
        self.dropped = sorted(set(self.u1) - set(self.masked))
        if len(self.survivors) < self.config.threshold:
            raise self._fail(f"{len(self.survivors)} masked inputs arrived, below the threshold "
                             f"{self.config.threshold}")
        self.phase = "unmask"
        log.info("secure round %s: %d masked inputs, %d dropped after sharing", self.config.round_id,
                 len(self.survivors), len(self.dropped))
        return {d: self.unmask_request(d) for d in self.survivors}

    def unmask_request(self, device: str) -> dict[str, list[str]]:
        near = {device, *self.graph[device]}
        return {"survivors": [d for d in self.survivors if d in near], "dropped": [d for d in self.dropped if d in near]}

    # --- phase 3 ---------------------------------------------------------------------------
    def receive_unmask(self, sender: str, msg: Any) -> None:
        self._expect("unmask", sender)
        if sender not in self.survivors:
            raise SecAggError(f"unmask answer from {sender}, which is not a survivor")
        if sender in self.answers:
            raise SecAggError(f"a second unmask answer from {sender}")
        if not isinstance(msg, Mapping) or set(msg) != {"b", "sk"}:
            raise SecAggError(f"unmask answer from {sender}: expected exactly b and sk")
        # exactly the pattern asked for: b for surviving, sk for dropped neighbours that shared with it
        held = {s for s in self.u1 if sender in self.shares.get(s, {})}
        want_b, want_sk = held & set(self.survivors), held & set(self.dropped)
        b, sk = msg["b"], msg["sk"]
        if not (isinstance(b, Mapping) and isinstance(sk, Mapping)) or set(b) != want_b or set(sk) != want_sk:
            raise SecAggError(f"unmask answer from {sender}: expected seed shares of {len(want_b)} survivors and "
                              f"key shares of {len(want_sk)} dropped neighbours, exactly")
        for j, v in b.items():
            unb64(v, SHARE_BYTES, f"seed share of {j} from {sender}")
        for j, v in sk.items():
            unb64(v, 2 * SHARE_BYTES, f"key share of {j} from {sender}")
        self.answers[sender] = {"b": dict(b), "sk": dict(sk)}

    def close_unmask(self) -> np.ndarray:
        """-> the sum of the survivors' quantised inputs (uint32, mod 2^32)."""
        from Crypto.Protocol.SecretSharing import Shamir

        if self.phase != "unmask":
            raise SecAggError(f"close_unmask in phase {self.phase}")
        t, rid = self.config.threshold, self.config.round_id
        total = self.total.copy()
        for kind, owners in (("b", self.survivors), ("sk", self.dropped)):
            for j in owners:
                holders = self.graph[j]
                got = [(share_index(h, holders), base64.b64decode(a[kind][j]))
                       for h, a in sorted(self.answers.items()) if j in a[kind]]
                if len(got) < t:
                    what = "self-mask seed" if kind == "b" else "mask key"
                    raise self._fail(f"{len(got)} shares of the {what} of {j} arrived, below the threshold {t}")
                got = got[:t]
                if kind == "b":
                    seed = Shamir.combine(got)
                    if seed_commitment(rid, j, seed) != base64.b64decode(self.adverts[j]["commit"]):
                        raise self._fail(f"the self-mask seed of {j} does not match its commitment (a share is wrong)")
                    total -= prg(self_mask_key(seed, rid), self.config.length)
                else:
                    raw = Shamir.combine([(i, s[:16]) for i, s in got]) + Shamir.combine([(i, s[16:]) for i, s in got])
                    key = X25519PrivateKey.from_private_bytes(raw)
                    pub = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
                    if b64(pub) != self.adverts[j]["s_pk"]:
                        raise self._fail(f"the mask key of {j} does not match its advertisement (a share is wrong)")
                    for k in holders:
                        if k in self.survivors and j in self.shares.get(k, {}) and k in self.shares.get(j, {}):
                            peer = X25519PublicKey.from_public_bytes(base64.b64decode(self.adverts[k]["s_pk"]))
                            mask = prg(pair_mask_key(key.exchange(peer), rid, k, j), self.config.length)
                            if pair_sign(k, j) > 0:
                                total -= mask
                            else:
                                total += mask
        self.phase = "done"
        log.info("secure round %s: unmasked the sum of %d devices", rid, len(self.survivors))
        return total

    # --- persistence -----------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {"config": self.config.to_json(), "phase": self.phase, "reason": self.reason,
                "adverts": self.adverts, "shares": self.shares, "u1": self.u1, "masked": self.masked,
                "total": b64(self.total.astype("<u4").tobytes()), "survivors": self.survivors,
                "dropped": self.dropped, "answers": self.answers}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> SecAggRound:
        try:
            r = cls(RoundConfig.from_json(d["config"]))
            if d["phase"] not in PHASES:
                raise SecAggError(f"unknown phase {d['phase']!r}")
            r.phase, r.reason = str(d["phase"]), str(d["reason"])
            r.adverts = {k: Advert.parse(v, r.config.round_id).to_json() for k, v in d["adverts"].items()}
            r.shares = {str(k): dict(v) for k, v in d["shares"].items()}
            r.u1, r.masked = list(d["u1"]), list(d["masked"])
            r.total = np.frombuffer(unb64(d["total"], 4 * r.config.length, "total"), dtype="<u4").astype(np.uint32)
            r.survivors, r.dropped = list(d["survivors"]), list(d["dropped"])
            r.answers = {str(k): {"b": dict(v["b"]), "sk": dict(v["sk"])} for k, v in d["answers"].items()}
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise SecAggError(f"secure round state: {e!r}") from None
        return r

    def save(self, path: str | Path) -> None:
        atomic_write_json(path, self.to_json(), mode=0o600)

    @classmethod
    def load(cls, path: str | Path) -> SecAggRound:
        return cls.from_json(read_json_object(path, MAX_STATE, "secure round state"))
