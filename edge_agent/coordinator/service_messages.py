"""What the serving coordinator does with each verified message a device sends: hello
(enrolment), state, progress (job phase, result metrics, a failed job as a dropout), refusal
(a policy "no" as a dropout; a refusal of our commands as replayed or under an unknown key
goes to `CommandRefusals`), and update chunks (to the `UpdateInbox`).

Separate from service.py so the ingress side (untrusted input, one handler per message
kind) reads on its own; the loop, the periodic tick, model publishing, dispatch and trust
stay there. Everything it works with is given to it: `DeviceMessages(...)` in
`Coordinator.__init__`.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import InputError
from ..protocol import Kind, Message, Reason, Rejection, Signer, Topics
from ..protocol.engine_choice import MAX_SHARED_CHOICES, SharedChoice
from ..protocol.facts import facts_from_state
from ..protocol.hello import hello_answer
from ..protocol.schema import SECAGG_UP
from ..transport import Channel, MqttClient
from .command_refusals import CommandRefusals
from .pending import PendingDevices
from .registry import Registry
from .rounds import RoundEngine
from .selection import allowance_state, capabilities_from_hello, forecast_state
from .update_inbox import UpdateInbox

if TYPE_CHECKING:
    from .device_trust import DeviceTrust

log = logging.getLogger("edge_agent.coordinator.service")  # the service's log: one place to watch

# Device state facts kept in the registry (agent/state.py's names); absent ones are cleared.
STATE_KEYS = ("battery_pct", "charging", "on_power", "energy_wh", "power_w", "temp_c", "engine", "models",
              "job", "job_state", "outbox", "profile", "name")
RESULT_METRICS = ("accuracy_before", "accuracy_after", "num_samples", "energy_wh", "steps", "engine", "depth",
                  "trainer", "stop_reason", "duration_s", "update_ratio", "update_wire_bytes", "update_k", "update_bits",
                  "label_counts", "label_predicted", "adapted", "shift", "adaptation")
# Refusals of the message, not of the job; except local_fault: that device cannot take the job
# now (disk full...), a dropout rather than a wait until the round's deadline.
_PROTOCOL_REASONS = frozenset(r.value for r in Reason) - {Reason.LOCAL_FAULT.value}
_CMD_ID = re.compile(r"(?P<job>[A-Za-z0-9][A-Za-z0-9._-]{0,47})-r(?P<round>[0-9]{1,10})")


class DeviceMessages:
    """`handle(message)` and the per-kind handlers behind it."""

    def __init__(self, *, registry: Registry, engine: RoundEngine, topics: Topics, signer: Signer,
                 client: MqttClient, channel: Channel, pending: PendingDevices, device_trust: DeviceTrust,
                 inbox: UpdateInbox, refusals: CommandRefusals, auto_approve: bool,
                 full_wanted: Callable[[str], None]) -> None:
        self.registry = registry
        self.engine = engine
        self.topics = topics
        self.signer = signer
        self.client = client
        self.channel = channel
        self.pending = pending
        self.device_trust = device_trust
        self.inbox = inbox
        self.refusals = refusals
        self.auto_approve = auto_approve
        self.full_wanted = full_wanted  # a device asks for a version's whole bundle ("name/version")
        self.names: dict[str, str] = {}  # device -> the name its hello gave (a long state detail cuts it)

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
                self.inbox.chunk(result)
            elif result.kind in SECAGG_UP:
                self._secagg(result, device)
        except InputError as exc:  # verified but unacceptable content (an id the registry refuses...)
            log.warning("%s from %s not recorded: %s", result.kind, device, exc)

    def _hello(self, msg: Message, device: str) -> None:
        info = msg.body.get("info") or {}
        text = {k: str(info.get(k) or "")[:128] for k in ("board", "profile", "name")}
        if text["name"]:
            self.names[device] = text["name"][:64]
        try:
            existing = self.registry.get_device(device)
        except InputError:
            existing = None
        printable = {k: v if v.isprintable() else "" for k, v in text.items()}
        dev = self.registry.enrol_device(device_id=device, public_key=msg.body["public_key"], fleet=self.topics.fleet,
                                         board=printable["board"], profile=printable["profile"],
                                         engine=existing.engine if existing else "", approved=self.auto_approve)
        if self.auto_approve and not dev.approved:
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
            if device in self.names:
                state["name"] = self.names[device]
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
            self.refusals.obeyed(device)
        b = msg.body
        phase, job, rnd = b["phase"], b.get("job"), b.get("round")
        update: dict[str, Any] = {"job_phase": phase[:64], "job_pct": b.get("pct")}
        if job:
            update["job"] = job
        self.registry.record_state(device, online=True, state=update)
        if phase == "model-downloading" and "fetching the full bundle" in str(b.get("detail", "")):
            self.full_wanted(str(b["detail"]).split(":", 1)[0])  # its head patch failed (agent models.py)
        if job is None or rnd is None:
            return
        metrics = b.get("metrics") or {}
        if phase in ("uploading", "done") and metrics and not self.registry.has_update(job, device, rnd):
            self.inbox.keep_result(job, device, rnd,
                                   {k: metrics[k] for k in RESULT_METRICS if k in metrics and _scalar(metrics[k])})
        if phase == "failed":
            self._dropout(job, rnd, device, f"failed: {str(b.get('detail', ''))[:400]}")

    def _refusal(self, msg: Message, device: str) -> None:
        reason, cmd = msg.body["reason"], msg.body.get("ref_cmd_id") or ""
        log.warning("device %s refused %s: %s: %s", device, cmd or "a message", reason, msg.body["detail"][:200])
        self.refusals.refused(device, reason, msg.body.get("ref_kind"), msg.body["detail"])
        match = _CMD_ID.fullmatch(cmd)
        if match is None or reason in _PROTOCOL_REASONS:  # a replayed or expired copy is not a "no"
            return
        self._dropout(match["job"], int(match["round"]), device, f"refused:{reason}")

    def _dropout(self, job: str, rnd: int, device: str, why: str) -> None:
        try:
            if self.engine.record_dropout(job, rnd, device, why):
                log.info("job %s round %d: device %s dropped out (%s)", job, rnd, device, why)
        except InputError:  # not a participant of that round (or no such job): nothing to record
            pass


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
