"""Which devices' messages serve accepts: the approved devices' public keys in the verifier's
trust store, kept in step with the registry. Approvals and revocations come from the CLI
(read every TRUST_SYNC_S, or at once when the number approved changes) or from a hello that
auto-approves (added alone). A device approved while serve runs had its retained state
refused before: a short subscription to its state topic (a "peek") re-reads it.
"""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Callable
from typing import Any

from ..errors import InputError
from ..keys import public_key_from_bytes
from ..protocol import Topics, TrustStore
from .pending import PendingDevices
from .registry import Registry

log = logging.getLogger(__name__)

TRUST_SYNC_S = 2.0  # how often a tick re-reads all approved keys (an approve and a revoke in one interval)
PEEK_S = 5.0  # how long a peek stays subscribed: the broker re-delivers retained messages at once


class DeviceTrust:
    """The approved devices (`device in trust`, `len(trust)`). `leading()`: this serve runs
    the rounds (one worker of a group peeks for all); `connected_before()`: serve has had a
    broker connection (before the first, the connection's own subscriptions bring every
    retained state: no peek needed)."""

    def __init__(self, registry: Registry, store: TrustStore, pending: PendingDevices, client: Any,
                 topics: Topics, *, leading: Callable[[], bool], connected_before: Callable[[], bool]) -> None:
        self.registry, self.store, self.pending, self.client, self.topics = registry, store, pending, client, topics
        self.leading, self.connected_before = leading, connected_before
        self.keys: dict[str, str] = {}  # device -> its approved public key (base64), as trusted
        self._peeks: dict[str, float] = {}  # topic -> when to unsubscribe
        self._synced_at = time.monotonic()

    def __contains__(self, device: object) -> bool:
        return device in self.keys

    def __len__(self) -> int:
        return len(self.keys)

    def sync(self) -> None:
        """Approved devices' keys into the trust store, revoked ones out (shown as pending again)."""
        approved = self.registry.approved_keys()
        for device, key in approved.items():
            self.add(device, key)
        for device in [d for d in self.keys if d not in approved]:
            self.store.remove(device)
            self.pending.add(device, self.keys[device])
            del self.keys[device]
            log.info("device %s no longer approved: its messages are refused", device)
        self._synced_at = time.monotonic()

    def sync_when_due(self) -> None:
        """Approvals and revocations made with the CLI: at once when the number of approved
        devices changed, else every TRUST_SYNC_S (reading every approved key each tick cost
        0.1 s at 10,000 devices; a hello's approval is immediate anyway)."""
        if time.monotonic() >= self._synced_at + TRUST_SYNC_S or self.registry.approved_count() != len(self.keys):
            self.sync()

    def add(self, device: str, key: str) -> None:
        """One approved device's key into the trust store (a hello that auto-approves calls
        this alone: reading every approved key per hello made enrolment O(N^2))."""
        if self.keys.get(device) == key:
            return
        try:
            self.store.add(public_key_from_bytes(base64.b64decode(key, validate=True)), role="device")
        except (InputError, ValueError):
            log.error("device %s: stored public key is unusable", device)
            return
        known = device in self.keys
        self.keys[device] = key
        if known or not self.connected_before():
            return
        if self.leading():  # one worker of a group is enough
            self.peek(self.topics.device(device, "state"))  # its retained state was refused before
        self.pending.approved(device)
        log.info("device %s approved: messages from it are now accepted", device)

    def peek(self, topic: str) -> None:
        """Subscribe to `topic` for PEEK_S: the broker sends its retained messages again."""
        self.client.subscribe(topic)
        self._peeks[topic] = time.monotonic() + PEEK_S

    def unpeek(self) -> None:
        """End the peeks whose time is up."""
        now = time.monotonic()
        for topic in [t for t, until in self._peeks.items() if now >= until]:
            self.client.unsubscribe(topic)
            del self._peeks[topic]
