"""What the serving coordinator does with each verified message a device sends (a mixin of
`service.Coordinator`, which sets every attribute below in its __init__): hello (enrolment),
state, progress (job phase, result metrics, a failed job as a dropout), refusal (a policy
"no" as a dropout; many "replayed" refusals as a `status` problem: our sequence counter is
behind), and update chunks (reassembly -> RoundEngine.receive_update -> signed ack).

Separate from service.py so the ingress side (untrusted input, one handler per message
kind) reads on its own; the loop, the periodic tick, model publishing, dispatch and trust
stay there.
"""

from __future__ import annotations

import logging
import re
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import InputError
from ..protocol import Kind, Message, Reason, Rejection, Signer, Topics
from ..protocol.engine_choice import MAX_SHARED_CHOICES, SharedChoice
from ..protocol.facts import facts_from_state
from ..protocol.hello import hello_answer
from ..protocol.schema import SECAGG_UP
from ..transport import Channel, MqttClient, OutboxKey, UpdateReceiver, ack_message
from ..transport.uplink import CompletedUpload, expire
from .pending import PendingDevices
from .records import check_flat
from .registry import Registry
from .rounds import Receipt, RoundEngine
from .selection import allowance_state, capabilities_from_hello, forecast_state

if TYPE_CHECKING:
    from .device_trust import DeviceTrust
    from .serve_options import ServeOptions
    from .workers import SharedChunks, WorkerStore

log = logging.getLogger("edge_agent.coordinator.service")  # the service's log: one place to watch

# Device state facts kept in the registry (agent/state.py's names); absent ones are cleared.
STATE_KEYS = ("battery_pct", "charging", "on_power", "energy_wh", "power_w", "temp_c", "engine", "models",
              "job", "job_state", "outbox", "profile", "name")
RESULT_METRICS = ("accuracy_before", "accuracy_after", "num_samples", "energy_wh", "steps", "engine", "depth",
                  "trainer", "stop_reason", "duration_s", "update_ratio", "update_wire_bytes", "update_k", "update_bits",
                  "label_counts", "adapted", "shift", "adaptation")
# Refusals of the message, not of the job; except local_fault: that device cannot take the job
# now (disk full...), a dropout rather than a wait until the round's deadline.
_PROTOCOL_REASONS = frozenset(r.value for r in Reason) - {Reason.LOCAL_FAULT.value}
_WINDOW_HIGH = re.compile(r"\((?:[0-9]+) below (?P<high>[0-9]{1,16})\)")  # ReplayWindow's "older than" detail
REPLAYED_WINDOW_S = 900.0
# What an upload was told is re-sent to its repeats for this long (the receiver remembers
# completed uploads as long); later repeats get the registry's answer or are judged again.
RECEIPT_KEEP_S = 600.0
MAX_RECEIPTS = 10_000
_CMD_ID = re.compile(r"(?P<job>[A-Za-z0-9][A-Za-z0-9._-]{0,47})-r(?P<round>[0-9]{1,10})")


class LineBudget:
    """At most `per_minute` log lines a minute; `take()` says whether to log this one and how
    many were not logged since the last that was (to count them into it)."""

    def __init__(self, *, per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_minute, self._clock = per_minute, clock
        self._start, self._lines, self._hidden = -1e18, 0, 0

    def take(self) -> tuple[bool, int]:
        now = self._clock()
        if now - self._start >= 60.0:
            self._start, self._lines = now, 0
        if self._lines >= self.per_minute:
            self._hidden += 1
            return False, 0
        hidden, self._hidden = self._hidden, 0
        self._lines += 1
        return True, hidden


class DeviceMessages:
    """Mixin of Coordinator: `handle(message)` and the per-kind handlers behind it."""

    options: ServeOptions
    state_dir: Path
    registry: Registry
    engine: RoundEngine
    topics: Topics
    signer: Signer
    client: MqttClient
    channel: Channel
    pending: PendingDevices
    receiver: UpdateReceiver
    problems: list[str]
    device_trust: DeviceTrust
    _names: dict[str, str]
    _receipts: OrderedDict[tuple[OutboxKey, str], tuple[float, Receipt]]  # slot -> (when, receipt)
    _results: OrderedDict[tuple[str, str, int], dict[str, Any]]
    _replayed: dict[str, tuple[float, int]]
    _unknown_key: dict[str, float]
    _reject_lines: LineBudget
    shared: WorkerStore | None  # one of a workers group (workers.py); None: a lone serve
    chunks: SharedChunks | None

    def _new_receiver(self) -> UpdateReceiver:  # provided by Coordinator
        raise NotImplementedError

    def _full_wanted(self, ref: str) -> None:  # provided by Coordinator
        raise NotImplementedError

    # ------------------------------------------------------------------ messages
    def handle(self, result: Message | Rejection) -> None:
        if isinstance(result, Rejection):
            self.channel.reply_to(result)  # a refused update chunk gets a `rejected, retry` ack
            return
        device = result.route.device
        if device is None:
            return
        if result.kind is not Kind.HELLO and device not in self.device_trust:  # pending approval
            reply = self.pending.heard(self.registry, result)
            if reply is not None:
                self.channel.reply_to(reply)  # its update: `rejected, retry` (approval may come)
            return
        try:
            if result.kind is Kind.HELLO:
                self._hello(result, device)
            elif result.kind is Kind.STATE:
                self._state(result, device)
            elif result.kind is Kind.PROGRESS:
                self._progress(result, device)
            elif result.kind is Kind.REFUSAL:
                self._refusal(result, device)
            elif result.kind is Kind.UPDATE_CHUNK:
                self._chunk(result)
            elif result.kind in SECAGG_UP:
                self._secagg(result, device)
        except InputError as exc:  # verified but unacceptable content (an id the registry refuses...)
            log.warning("%s from %s not recorded: %s", result.kind, device, exc)

    def _hello(self, msg: Message, device: str) -> None:
        info = msg.body.get("info") or {}
        text = {k: str(info.get(k) or "")[:128] for k in ("board", "profile", "name")}
        if text["name"]:
            self._names[device] = text["name"][:64]
        try:
            existing = self.registry.get_device(device)
        except InputError:
            existing = None
        printable = {k: v if v.isprintable() else "" for k, v in text.items()}
        dev = self.registry.enrol_device(device_id=device, public_key=msg.body["public_key"], fleet=self.topics.fleet,
                                         board=printable["board"], profile=printable["profile"],
                                         engine=existing.engine if existing else "", approved=self.options.auto_approve)
        if self.options.auto_approve and not dev.approved:
            dev = self.registry.set_approved(device, True)
        heard = min(float(msg.issued_at), time.time())  # a retained hello may be old news
        name = printable["name"][:64]  # shown for pending devices too: their states are not taken
        state = {"name": name} if name else {}
        state.update(capabilities_from_hello(info))  # round selection reads them (selection.py)
        self.registry.record_heard(device, at=heard, state=state or None)
        if dev.approved:
            if existing is None:
                log.info("device %s (%s, %s) enrolled", device, printable["name"] or "?", printable["board"] or "?")
        else:
            self.pending.add(device, dev.public_key)
            self.pending.announce(self.registry, device, name=printable["name"], board=printable["board"],
                                  enrolled=existing is None)
        if dev.approved and device not in self.device_trust:
            self.device_trust.add(device, dev.public_key)
        answer = hello_answer(self.signer, self.topics, msg)  # "heard you" (protocol/hello.py)
        if answer is not None:
            self.client.publish(*answer)

    def _secagg(self, msg: Message, device: str) -> None:
        """A secure round's message (secure_rounds.py); refused ones are logged by `handle`
        (their reason names the phase or the field, never a value of an update)."""
        if self.engine.receive_secagg(msg.body["job"], msg.body["round"], device, msg.kind, msg.body):
            log.debug("job %s round %d: %s from %s", msg.body["job"], msg.body["round"], msg.kind, device)

    def _state(self, msg: Message, device: str) -> None:
        facts = facts_from_state(msg.body)
        status = msg.body["status"]
        state: dict[str, Any] = {"status": status}
        if status == "offline":  # its last will or its goodbye: keep what it last reported
            self.registry.record_state(device, online=False, state=state)  # a dropout if it stays away (tick)
            return
        for key in STATE_KEYS:
            value = facts.get(key)
            state[key] = value if _scalar(value) else None
        if not state.get("name"):  # cut from a long detail: the hello's, else keep the stored one
            if device in self._names:
                state["name"] = self._names[device]
            else:
                del state["name"]
        if status != "busy":
            state["job"] = None
        state.update(allowance_state(facts))  # selection skips a device that would refuse
        state.update(forecast_state(msg.body))  # a solar device's surplus forecast (selection.py)
        dev = self.registry.record_state(device, online=status != "offline", state=state)
        engine = state.get("engine")
        if isinstance(engine, str) and engine and engine != dev.engine and engine.isprintable():
            self.registry.enrol_device(device_id=device, public_key=dev.public_key, fleet=dev.fleet, board=dev.board,
                                       profile=dev.profile, engine=engine[:128])
        if "engine_choices" in msg.body and not dev.quarantined:  # (a quarantined device's word is not relayed)
            self._engine_choices(msg, device)

    def _engine_choices(self, msg: Message, device: str) -> None:
        """The int8 engine choices a device measured in full (its state's `engine_choices`,
        at most MAX_SHARED_CHOICES by the schema): each parsed strictly, a bad one left out
        with one warning per message, the rest kept (registry_choices.py)."""
        choices, bad = reported_choices(msg.body["engine_choices"])
        if bad:
            log.warning("state from %s: %d engine choice(s) ignored: %s", device, len(bad), "; ".join(bad[:3])[:600])
        if choices:
            self.registry.record_engine_choices(device, choices, at=min(float(msg.issued_at), time.time()))

    def _progress(self, msg: Message, device: str) -> None:
        if msg.body.get("cmd_id"):  # it takes our commands again
            if self._replayed.pop(device, None):
                self._check_replayed()
            if self._unknown_key.pop(device, None):
                self._check_unknown_key()
        b = msg.body
        phase, job, rnd = b["phase"], b.get("job"), b.get("round")
        update: dict[str, Any] = {"job_phase": phase[:64], "job_pct": b.get("pct")}
        if job:
            update["job"] = job
        self.registry.record_state(device, online=True, state=update)
        if phase == "model-downloading" and "fetching the full bundle" in str(b.get("detail", "")):
            self._full_wanted(str(b["detail"]).split(":", 1)[0])  # its head patch failed (agent models.py)
        if job is None or rnd is None:
            return
        metrics = b.get("metrics") or {}
        if phase in ("uploading", "done") and metrics and not self.registry.has_update(job, device, rnd):
            kept = {k: metrics[k] for k in RESULT_METRICS if k in metrics and _scalar(metrics[k])}
            shared = getattr(self, "shared", None)  # (hosts in the unit tests have no workers' store)
            if shared is not None:  # its update may reach another worker of the group
                shared.put_result(job, device, rnd, kept)
                return
            self._results[(job, device, rnd)] = kept
            while len(self._results) > 10_000:
                self._results.popitem(last=False)
        if phase == "failed":
            self._dropout(job, rnd, device, f"failed: {str(b.get('detail', ''))[:400]}")

    def _refusal(self, msg: Message, device: str) -> None:
        reason, cmd = msg.body["reason"], msg.body.get("ref_cmd_id") or ""
        log.warning("device %s refused %s: %s: %s", device, cmd or "a message", reason, msg.body["detail"][:200])
        high = _WINDOW_HIGH.search(msg.body["detail"])
        if reason == Reason.REPLAYED and msg.body.get("ref_kind") == Kind.CMD and \
                (high or "already accepted" in msg.body["detail"]):  # not a re-sync after a lost window
            self._replayed[device] = (time.time(), int(high["high"]) if high else 0)
            self._check_replayed()
        if reason == Reason.UNKNOWN_KEY and msg.body.get("ref_kind") == Kind.CMD:  # it does not know our key
            self._unknown_key[device] = time.time()
            self._check_unknown_key()
        match = _CMD_ID.fullmatch(cmd)
        if match is None or reason in _PROTOCOL_REASONS:  # a replayed or expired copy is not a "no"
            return
        self._dropout(match["job"], int(match["round"]), device, f"refused:{reason}")

    def _check_replayed(self) -> None:
        """Several devices (or every device) refusing our commands as replayed means our own
        counter is behind theirs (keys/seq lost or restored from a backup, or a clock set
        back): say so in `status`, with the fix (docs/fleet.md, "Lost sequence counter")."""
        now = time.time()
        recent = {d: v for d, v in self._replayed.items() if now - v[0] < REPLAYED_WINDOW_S}
        self._replayed = recent
        approved = len(self.device_trust)
        before = " ".join(self.problems)  # a problem already shown is not logged again
        self.problems = [p for p in self.problems if not p.startswith("replayed:")]
        if recent and (len(recent) >= 2 or len(recent) >= approved):
            high = max(v[1] for v in recent.values())
            floor = max(high, self.signer.sequence.next()) + 1
            problem = (f"replayed: {len(recent)} device(s) refuse this coordinator's commands as replayed: its "
                       f"sequence counter ({self.state_dir / 'keys' / 'seq'}) is behind theirs (lost, restored "
                       f"from a backup, or the clock was set back). Fix: stop serve, `echo {floor} > "
                       f"{self.state_dir / 'keys' / 'seq.floor'}`, start serve (docs/fleet.md, Lost sequence counter)")
            if problem.split(" Fix:")[0] not in before:
                log.error("%s", problem)
            self.problems.append(problem)

    def _check_unknown_key(self) -> None:
        """Devices refusing our commands as signed by a key they do not know: our key is not
        the one they were given (keys/coordinator.key replaced, or re-made after it was lost).
        Several devices, or every approved one, within REPLAYED_WINDOW_S: a fleet-wide problem
        in `status`, with the ways back."""
        now = time.time()
        self._unknown_key = {d: t for d, t in self._unknown_key.items() if now - t < REPLAYED_WINDOW_S}
        before = " ".join(self.problems)  # a problem already shown is not logged again
        self.problems = [p for p in self.problems if not p.startswith("unknown_key:")]
        n = len(self._unknown_key)
        if n and (n >= 2 or n >= len(self.device_trust)):
            problem = (f"unknown_key: {n} device(s) refuse this coordinator's commands as signed by a key they do not "
                       f"know: this coordinator's key ({self.signer.key_id}, {self.state_dir / 'keys' / 'coordinator.key'}"
                       ") is not the one they trust. Fix: restore the key they were given from a backup (then "
                       "`edge-coordinator key rotate` moves them to a new key they can verify), or re-enrol each device "
                       "with `edge-agent init --coordinator-key $(edge-coordinator key) --force` (docs/fleet.md, "
                       "Rotating the coordinator key)")
            if problem.split(" Fix:")[0] not in before:
                log.error("%s", problem)
            self.problems.append(problem)

    def _dropout(self, job: str, rnd: int, device: str, why: str) -> None:
        try:
            if self.engine.record_dropout(job, rnd, device, why):
                log.info("job %s round %d: device %s dropped out (%s)", job, rnd, device, why)
        except InputError:  # not a participant of that round (or no such job): nothing to record
            pass

    # ------------------------------------------------------------------ updates
    def _chunk(self, msg: Message) -> None:
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
            self._receipts[slot] = (now, receipt)
            self._receipts.move_to_end(slot)
            if receipt.status == "rejected":
                self._warn_rejected(got.key, receipt)
            expire(self._receipts, now, RECEIPT_KEEP_S, lambda v: v[0])
            while len(self._receipts) > MAX_RECEIPTS:
                self._receipts.popitem(last=False)
        elif got.status == "duplicate" and got.ack_due:
            kept = self._receipts.get(slot)
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
        result = (self._results.pop((key.job, key.device, key.round), {}) if self.shared is None  # read once
                  else self.shared.take_result(key.job, key.device, key.round))
        samples = upload.samples if upload.samples is not None else result.get("num_samples")
        energy = upload.energy_wh if upload.energy_wh is not None else result.get("energy_wh")
        metrics = {k: v for k, v in result.items() if k not in ("num_samples",)}
        try:
            metrics = check_flat(metrics, "metrics")
        except InputError:
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


def reported_choices(value: Any) -> tuple[list[SharedChoice], list[str]]:
    """A state's `engine_choices` entry by entry: the good ones (one per kind, the first) and
    why each other one was left out."""
    if not isinstance(value, list):
        return [], ["not a list"]
    good: dict[str, SharedChoice] = {}
    bad: list[str] = []
    for i, item in enumerate(value[:MAX_SHARED_CHOICES]):
        try:
            choice = SharedChoice.from_json(item, where=f"engine_choices[{i}]")
        except InputError as exc:
            bad.append(str(exc))
            continue
        if choice.kind in good:
            bad.append(f"engine_choices[{i}]: kind {choice.kind} appears twice")
        else:
            good[choice.kind] = choice
    if len(value) > MAX_SHARED_CHOICES:
        bad.append(f"{len(value) - MAX_SHARED_CHOICES} beyond the first {MAX_SHARED_CHOICES}")
    return list(good.values()), bad


def _scalar(value: Any) -> bool:
    if isinstance(value, str):
        return len(value) <= 256 and value.isprintable()
    return value is None or isinstance(value, bool | int) or (isinstance(value, float) and value == value
                                                              and abs(value) != float("inf"))
