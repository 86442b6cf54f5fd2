"""Devices that enrolled (a self-signed hello) but are not approved yet.

Nothing a pending device says is recorded as fact, and an update from one is answered
`rejected, retry` (approval may come). But the operator deciding whether to approve it
wants to see it: the name it announced, whether it is online, when it was last heard from,
and the enrolment code to compare with the one the device printed. So a pending device's
message is verified against the key it enrolled with (instead of being dropped as from an
unknown key), its own issue time kept as "last seen", and the device is logged once as
pending approval rather than once per message as a drop.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import threading
import time

from ..errors import InputError
from ..keys import enrolment_code_of, public_key_from_bytes
from ..protocol import Kind, Message, Reason, Rejection, Topics, TrustStore, Verifier
from .registry import Registry

log = logging.getLogger(__name__)
HEARD_EVERY_S = 30.0  # a pending device's "last seen" moves at most this often (online changes: at once)


class PendingDevices:
    """The coordinator channel's verifier (`open`), and what it does with pending devices.

    `open` returns what the approved-keys verifier returns, except that a message refused
    only because its key is not approved, but signed by a pending device's enrolled key, is
    returned verified: the caller tells it apart (its sender is not approved) and passes it
    to `heard`."""

    def __init__(self, verifier: Verifier, topics: Topics) -> None:
        self.verifier = verifier
        self.trust = TrustStore()
        # No replay window: a pending device's message only ever moves "last seen" to its
        # own issue time, so a replayed copy changes nothing; and the approved-keys window
        # must still take the device's retained state once it is approved.
        self._pending = Verifier(topics=topics, trust=self.trust, replay=None, max_skew=verifier.max_skew)
        self._logged: set[str] = set()
        # device -> (issue time, online) last written: a pending device's chatter (or a flood
        # of its replayed messages) costs at most one registry write per HEARD_EVERY_S
        self._written: dict[str, tuple[float, bool]] = {}
        self._lock = threading.Lock()

    # ---- keys ----
    def add(self, device_id: str, public_key: str) -> None:
        try:
            self.trust.add(public_key_from_bytes(base64.b64decode(public_key, validate=True)), role="device")
        except (InputError, ValueError):
            log.error("device %s: stored public key is unusable", device_id)

    def approved(self, device_id: str) -> None:
        """It is approved now: its messages go to the approved-keys verifier."""
        self.trust.remove(device_id)
        with self._lock:
            self._logged.discard(device_id)
            self._written.pop(device_id, None)

    def sync(self, registry: Registry) -> None:
        """Every enrolled, unapproved device's key (at start: their retained messages follow)."""
        for dev in registry.list_devices():
            if not dev.approved:
                self.add(dev.id, dev.public_key)

    # ---- messages ----
    def open(self, topic: str, payload: bytes) -> Message | Rejection:
        result = self.verifier.open(topic, payload)
        if isinstance(result, Rejection) and result.reason == Reason.UNKNOWN_KEY and result.sender \
                and self.trust.lookup(result.sender) is not None:
            again = self._pending.open(topic, payload)
            if isinstance(again, Message):
                return again
        return result

    def announce(self, registry: Registry, device_id: str, *, name: str = "", board: str = "",
                 enrolled: bool = False) -> None:
        """Log, once per device and process, that it waits for approval, with its code."""
        with self._lock:
            if device_id in self._logged:
                return
            self._logged.add(device_id)
        try:
            code = enrolment_code_of(registry.get_device(device_id).public_key)
        except InputError:
            code = "?"
        log.info("device %s (%s, %s) %spending approval: compare its enrolment code %s with the one the "
                 "device printed, then `edge-coordinator approve %s`; until then nothing it sends is recorded",
                 device_id, name or "?", board or "?", "enrolled, " if enrolled else "is ", code, code)

    def heard(self, registry: Registry, msg: Message, *, now: float | None = None) -> Rejection | None:
        """A verified message from a pending device: keep only that it was heard (online, and
        when: its own issue time, never later than now). Returns the rejection to answer an
        update chunk with (`rejected, retry`), else None."""
        device = msg.route.device
        if device is None:
            return None
        offline = msg.kind is Kind.STATE and msg.body.get("status") == "offline"
        at = min(float(msg.issued_at), time.time() if now is None else now)
        with self._lock:
            last = self._written.get(device)
            fresh = last is None or last[1] == offline or at - last[0] >= HEARD_EVERY_S
            if fresh:
                self._written[device] = (at, not offline)
        if fresh:  # (an offline/online change is always written)
            try:
                dev = registry.record_heard(device, at=at, online=not offline)
            except InputError:  # not enrolled after all (deleted meanwhile): nothing to keep
                return None
            self.announce(registry, device, name=str(dev.state.get("name") or ""), board=dev.board)
        if msg.kind is not Kind.UPDATE_CHUNK:
            return None
        return Rejection(Reason.UNKNOWN_KEY, f"device {device} is pending approval", msg.topic, len(msg.data),
                         hashlib.sha256(msg.data).hexdigest(), route=msg.route, kind=str(msg.kind), sender=device,
                         seq=msg.seq, body=dict(msg.body))

