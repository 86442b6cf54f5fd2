"""The fleet protocol, imported by both the agent and the coordinator (`edge_agent.protocol`).

Topics (`<prefix>` defaults to `edgeft/v1`; tests use a unique prefix each):

    <prefix>/<fleet>/devices/<id>/hello      device -> coord   retained, self-signed public key
    <prefix>/<fleet>/devices/<id>/state      device -> coord   retained; the last will is "offline"
    <prefix>/<fleet>/devices/<id>/cmd        coord  -> device  commands
    <prefix>/<fleet>/devices/<id>/ack        coord  -> device  update acks, refusals
    <prefix>/<fleet>/devices/<id>/progress   device -> coord   job progress, refusals
    <prefix>/<fleet>/devices/<id>/update     device -> coord   update chunks (binary)
    <prefix>/<fleet>/devices/<id>/secagg     device -> coord   secure aggregation: advert, shares,
                                                               masked input, reveal
    <prefix>/<fleet>/devices/<id>/secagg_cmd coord  -> device  secure aggregation: roster, inbox, unmask
    <prefix>/<fleet>/models/<name>/<version>/manifest      coord -> fleet  retained
    <prefix>/<fleet>/models/<name>/<version>/chunk/<i>     coord -> fleet  retained (binary)
    <prefix>/<fleet>/coordinator/key/<old key id>          coord -> fleet  retained: the new
                                          coordinator key, signed by the old one (key rotation)

Control messages are canonical JSON: {"v","kind","from","seq","iat","exp","body","sig"}.
Binary messages (chunks) are `EFB1 | u16 header length | header JSON | signature | data`,
the header being the same envelope without "sig". Every message is Ed25519-signed over
a domain tag, `<fleet>/<topic below the fleet>` (so a command for device A cannot be
replayed onto device B's topic) and the envelope; binary ones over sha256(data) too.

Checks, in order, each failing with a `Reason` (data, publishable back): topic, size
limit of the topic's kinds (before parsing), strict parse, schema, topic/body agreement,
key lookup and signer role, signature, validity time, replay window. Kinds with side
effects (cmd, ack, progress, refusal) go through a persisted sliding window of sequence
numbers per sender; retained and idempotent kinds (hello, state, manifests, chunks) are
bound by content instead (updates are de-duplicated by (job, device, round)).

Modules: schema (kinds, reasons, body schemas, limits), topics, envelope (Signer,
Verifier, TrustStore), replay (SequenceCounter, ReplayWindow). No numpy: the idle
daemon imports this.
"""

from __future__ import annotations

from .envelope import (
    DEFAULT_MAX_SKEW,
    Message,
    Rejection,
    Signer,
    TrustStore,
    Verifier,
    canonical_json,
)
from .replay import ReplayWindow, SequenceCounter
from .schema import (
    BINARY_KINDS,
    BINARY_MAGIC,
    MAX_BINARY_BYTES,
    MAX_BUNDLE_BYTES,
    MAX_CONTROL_BYTES,
    MAX_TTL,
    PROTOCOL_VERSION,
    SCHEMAS,
    WINDOWED_KINDS,
    Kind,
    Reason,
    check_body,
    validate_id,
)
from .topics import DEFAULT_PREFIX, Route, Topics

__all__ = [
    "BINARY_KINDS", "BINARY_MAGIC", "DEFAULT_MAX_SKEW", "DEFAULT_PREFIX", "MAX_BINARY_BYTES",
    "MAX_BUNDLE_BYTES", "MAX_CONTROL_BYTES", "MAX_TTL", "PROTOCOL_VERSION", "SCHEMAS",
    "WINDOWED_KINDS", "Kind", "Message", "Reason", "Rejection", "ReplayWindow", "Route",
    "SequenceCounter", "Signer", "TrustStore", "Verifier", "Topics", "canonical_json",
    "check_body", "validate_id",
]
