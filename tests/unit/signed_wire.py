"""A coordinator and a device that trust each other, over no broker: the signers and the
verifier the protocol tests send messages through."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edge_agent import keys
from edge_agent.protocol import ReplayWindow, SequenceCounter, Signer, Topics, TrustStore, Verifier


@dataclass
class SignedWire:
    dev: str  # the device's id
    coord: Signer
    device: Signer
    verifier: Verifier


def signed_wire(tmp_path: Path, topics: Topics) -> SignedWire:
    ckey, dkey = keys.generate_private_key(), keys.generate_private_key()
    trust = TrustStore()
    trust.add(ckey.public_key(), role="coordinator")
    trust.add(dkey.public_key(), role="device")
    return SignedWire(keys.fingerprint(dkey),
                      Signer(key=ckey, topics=topics, sequence=SequenceCounter(path=tmp_path / "c.seq")),
                      Signer(key=dkey, topics=topics, sequence=SequenceCounter(path=tmp_path / "d.seq")),
                      Verifier(topics=topics, trust=trust, replay=ReplayWindow(directory=tmp_path / "replay")))
