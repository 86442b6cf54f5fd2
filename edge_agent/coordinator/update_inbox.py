"""Update chunks in, signed acks out: reassembly (alone, or shared by a workers group),
the check and store by the round engine, and the receipt each repeat of an upload is told.

A device's result metrics come in its progress report, before or beside its update: they
wait here (or in the group's store) until the update they describe is received.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from ..errors import InputError
from ..protocol import Message, Signer, Topics
from ..transport import MqttClient, OutboxKey, UpdateReceiver, ack_message
from ..transport.uplink import CompletedUpload, expire
from .line_budget import LineBudget
from .records import check_flat
from .registry import Registry
from .rounds import Receipt, RoundEngine

if TYPE_CHECKING:
    from .workers import SharedChunks, WorkerStore

log = logging.getLogger("edge_agent.coordinator.service")  # the service's log: one place to watch

# What an upload was told is re-sent to its repeats for this long (the receiver remembers
# completed uploads as long); later repeats get the registry's answer or are judged again.
RECEIPT_KEEP_S = 600.0
MAX_RECEIPTS = 10_000
MAX_WAITING_RESULTS = 10_000


class UpdateInbox:
    """`chunk(message)` for every verified update chunk; `keep_result` for the metrics a
    device reports of an update it sends."""

    def __init__(self, *, registry: Registry, engine: RoundEngine, signer: Signer, topics: Topics,
                 client: MqttClient, ack_interval: float, shared: WorkerStore | None = None,
                 chunks: SharedChunks | None = None) -> None:
        self.registry = registry
        self.engine = engine
        self.signer = signer
        self.topics = topics
        self.client = client
        self.ack_interval = ack_interval
        self.shared = shared  # one of a workers group (workers.py); None: a lone serve
        self.chunks = chunks  # the group's shared reassembly, with `shared`
        self.receiver = self._new_receiver()
        self.receipts: OrderedDict[tuple[OutboxKey, str], tuple[float, Receipt]] = OrderedDict()  # slot -> (when, receipt)
        self.results: OrderedDict[tuple[str, str, int], dict[str, Any]] = OrderedDict()
        self._reject_lines = LineBudget(per_minute=20)  # rejected-update log lines

    def _new_receiver(self) -> UpdateReceiver:
        return UpdateReceiver(ack_interval=self.ack_interval,
                              is_known=lambda k: self.registry.has_update(k.job, k.device, k.round))

    def keep_result(self, job: str, device: str, rnd: int, metrics: dict[str, Any]) -> None:
        """A device's result metrics of its update for (job, round): read once, when it comes."""
        if self.shared is not None:  # its update may reach another worker of the group
            self.shared.put_result(job, device, rnd, metrics)
            return
        self.results[(job, device, rnd)] = metrics
        while len(self.results) > MAX_WAITING_RESULTS:
            self.results.popitem(last=False)

    def chunk(self, msg: Message) -> None:
        shared = self.chunks is not None and msg.body["count"] > 1  # a group's workers share its chunks
        got = self.chunks.add(msg, self.receiver) if shared and self.chunks is not None else self.receiver.add(msg)
        slot = (got.key, got.upload)
        if got.status == "complete" and got.update is not None:
            try:
                receipt = self.receive(got.update)
            except Exception:
                # Not stored and not acked: forget it was complete, so the device's resend is taken.
                self.receiver = self._new_receiver()
                raise
            if shared and self.chunks is not None:
                self.chunks.done(got.key)
            now = time.monotonic()
            self.receipts[slot] = (now, receipt)
            self.receipts.move_to_end(slot)
            if receipt.status == "rejected":
                self._warn_rejected(got.key, receipt)
            expire(self.receipts, now, RECEIPT_KEEP_S, lambda v: v[0])
            while len(self.receipts) > MAX_RECEIPTS:
                self.receipts.popitem(last=False)
        elif got.status == "duplicate" and got.ack_due:
            kept = self.receipts.get(slot)
            receipt = kept[1] if kept is not None else None
            if receipt is None and self.registry.has_update(got.key.job, got.key.device, got.key.round):
                receipt = Receipt("duplicate")
            if receipt is None:
                return
            if receipt.status == "accepted":
                receipt = Receipt("duplicate")
        else:
            return
        self._ack(got.key, got.upload, receipt)

    def _warn_rejected(self, key: OutboxKey, receipt: Receipt) -> None:
        """Every rejected update at WARNING with its device and reason; at most 20 lines a
        minute (the rest are counted into the next line), so a hostile device cannot flood the log."""
        shown, hidden = self._reject_lines.take()
        if not shown:
            return
        more = f" ({hidden} more rejected updates not logged)" if hidden else ""
        log.warning("rejected update %s round %d from device %s: %s: %s%s", key.job, key.round, key.device,
                    receipt.reason, receipt.detail[:300], more)

    def receive(self, upload: CompletedUpload) -> Receipt:
        """Reassemble, check and store one complete upload; returns what to acknowledge."""
        from ..updates import Reassembler, UpdateError
        from ..updates.wire import unpack_update

        key = upload.key
        payload = None
        try:
            reassembler = Reassembler()
            for chunk in upload.chunks:
                done = reassembler.add(chunk)
                payload = done.payload if done is not None else payload
            if payload is None:
                return Receipt("rejected", "malformed", "the chunks do not make a complete update")
            header, _ = unpack_update(payload)
        except UpdateError as exc:
            return Receipt("rejected", "malformed", str(exc)[:512])
        if (header.job_id, header.device_id, header.round) != (key.job, key.device, key.round):
            return Receipt("rejected", "key_mismatch", f"payload is for {header.key}, chunks say "
                                                       f"{(key.job, key.device, key.round)}")
        result = (self.results.pop((key.job, key.device, key.round), {}) if self.shared is None  # read once
                  else self.shared.take_result(key.job, key.device, key.round))
        samples = upload.samples if upload.samples is not None else result.get("num_samples")
        energy = upload.energy_wh if upload.energy_wh is not None else result.get("energy_wh")
        metrics = {k: v for k, v in result.items() if k not in ("num_samples",)}
        try:
            metrics = check_flat(metrics, "metrics")
        except InputError:  # metrics that are not flat scalars are dropped, not the update
            metrics = {}
        receipt = self.engine.receive_update(payload, sender=key.device, num_samples=samples,
                                             wire_bytes=sum(len(c) for c in upload.chunks), energy_wh=energy,
                                             metrics=metrics, energy_kept=upload.energy_kept,
                                             labels_sha256=upload.labels_sha256)
        log.info("update %s round %d from %s: %s%s", key.job, key.round, key.device, receipt.status,
                 f" ({receipt.reason}: {receipt.detail[:200]})" if receipt.reason else "")
        return receipt

    def _ack(self, key: OutboxKey, upload: str, receipt: Receipt) -> None:
        topic, payload = ack_message(self.signer, self.topics, key, upload, receipt.status,
                                     reason=receipt.reason or None, detail=receipt.detail or None)
        if not self.client.publish_wait(topic, payload, timeout=10.0):
            log.warning("ack for %s not delivered to the broker; the device will send again", key)
