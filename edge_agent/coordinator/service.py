"""`edge-coordinator serve`: the fleet service around the transport-free coordinator core.

One thread, one loop: take the next verified message (or a Rejection) from the broker and
handle it; every `tick_s` advance the rounds and send what they decided. Everything that
matters is in the registry before it is acknowledged, so a killed coordinator resumes
where it was (rounds.py); the broker holds messages for it meanwhile (a fixed client id
with clean_session=False).

    hello      -> enrol the device (pending approval, or approved with --auto-approve)
    state      -> record_state (online, battery, energy, busy with which job, engine)
    progress   -> the device's job phase (shown by `train`); a failed job is a dropout;
                  its result metrics (accuracy before/after...) ride along with its update
    refusal    -> a device's policy refusal of a finetune command is a dropout
    update     -> UpdateReceiver (each (job, device, round) once, duplicates recognised
                  through the registry) -> chunk reassembly -> RoundEngine.receive_update
                  -> signed ack (accepted / duplicate / rejected with a reason)
    tick       -> approvals into the trust store; RoundEngine.tick(); signed `finetune`
                  commands to every selected device, `cancel` to cancelled rounds' devices;
                  each version a round uses is published (retained, chunked, signed)
                  before its commands, and each new version as soon as it is aggregated

The per-message handlers (hello .. refusal) are service_messages.DeviceMessages, update
chunks and acks update_inbox.UpdateInbox, refusals of our own commands
command_refusals.CommandRefusals: objects made here with what each works with. This module
holds the loop, the tick, model publishing, dispatch, trust and the heartbeat.

Files in the state directory besides the registry: keys/coordinator.key (0600, made on
first start), coordinator.pub (its public key, base64: `edge-agent init
--coordinator-key`), keys/seq, replay/, bundles/, and serve.json (pid, broker, policy and
a heartbeat the CLI reads to tell whether a coordinator is serving this directory).
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..atomic import atomic_write_json
from ..errors import ConfigError, EdgeAgentError, InputError, TransientError, one_line
from ..heap import release_freed_memory
from ..keys import fingerprint
from ..protocol import (
    DEFAULT_PREFIX,
    MAX_BINARY_BYTES,
    Kind,
    Message,
    Rejection,
    ReplayWindow,
    SequenceCounter,
    Signer,
    Topics,
    TrustStore,
    Verifier,
)
from ..transport import (
    Admission,
    Channel,
    MqttClient,
)
from ..transport.models import publish_model, retract_model
from .artefacts import ModelArtefacts
from .command_refusals import CommandRefusals
from .db import DB_ENV, resolve
from .device_trust import DeviceTrust
from .line_budget import LineBudget
from .link_health import LinkHealth
from .pending import PendingDevices
from .records import ModelVersion
from .registry import Registry
from .retention import AutoPrune, needs_full
from .rounds import RoundEngine, RoundPlan
from .serve_options import ServeOptions
from .server_set import StoredServerSets
from .service_files import SERVE_FILE, coordinator_key, lock_state_dir
from .service_messages import DeviceMessages, _scalar
from .update_inbox import UpdateInbox
from .workers import (
    SharedChunks,
    SharedReplay,
    SharedSequence,
    WorkerStore,
    shared_filters,
)

log = logging.getLogger(__name__)
HEARTBEAT_S = 2.0
RESIGN_AFTER_S = 10.0  # a leader cut off from the broker this long lets a connected worker lead


# Per-device ingress budget (messages/s, burst), applied in the MQTT network thread: an honest
# device sends a few chunks per second (and ~1000 for a large update at once); one flooding
# device's excess is dropped there (counted, one summary log line per 10 s), so it cannot fill
# the inbox the other devices share or make the broker drop their messages.
DEVICE_INGRESS = (50.0, 2000)
# Commands of a round are signed and published DISPATCH_BATCH at a time, then their PUBACKs
# awaited together and recorded in one registry transaction: a 10,000-device round costs
# 20 round trips and 20 commits, not 10,000 of each (the loop was blocked ~54 ms per device).
DISPATCH_BATCH = 500


class Coordinator:
    """The serve loop. `run(stop)` until `stop` is set; `close()` releases everything."""

    def __init__(self, options: ServeOptions, *, metrics: Any = None) -> None:
        self.options = o = options
        self.state_dir = Path(o.state_dir).resolve()
        self.worker_id = o.worker_id or _worker_id() if o.workers_group else None
        # Workers of a group share the state dir (bundles, heads, stored payloads): one lock each.
        self._lock_fds = lock_state_dir(self.state_dir, worker=self.worker_id)
        self.shared: WorkerStore | None = None
        try:
            self.registry = Registry(state_dir=self.state_dir, db=o.db)
            if o.workers_group is not None:
                url = resolve(o.db)
                if url is None:
                    raise ConfigError("--workers-group needs a PostgreSQL registry (--db postgresql://... or "
                                      f"${DB_ENV}): SQLite is one process's")
                assert self.worker_id is not None
                self.shared = WorkerStore(url, group=o.workers_group, worker_id=self.worker_id)
        except BaseException:
            for fd in self._lock_fds:
                os.close(fd)
            raise
        self.metrics = metrics
        self.engine = RoundEngine(registry=self.registry, policy=o.policy, metrics=metrics,
                                  evidence=StoredServerSets(self.registry),
                                  worker=self.worker_id if self.shared is not None else None)
        self.artefacts = ModelArtefacts(self.registry)
        try:  # a lost key with devices enrolled is refused (exit 78), never silently re-made
            self.key, self.public_key = coordinator_key(self.state_dir, devices=len(self.registry.list_devices()))
        except BaseException:
            self.registry.close()
            for fd in self._lock_fds:
                os.close(fd)
            raise
        self.key_id = fingerprint(self.key)
        self.topics = Topics(fleet=o.fleet, prefix=o.topic_prefix)
        local_seq = SequenceCounter(path=self.state_dir / "keys" / "seq")
        sequence: Any = local_seq if self.shared is None else SharedSequence(self.shared, floor=local_seq.next())
        self.signer = Signer(key=self.key, topics=self.topics, sequence=sequence)
        self.trust = TrustStore()
        replay: Any = ReplayWindow(directory=self.state_dir / "replay") if self.shared is None else \
            SharedReplay(self.shared)
        self.verifier = Verifier(topics=self.topics, trust=self.trust, replay=replay)
        self.chunks = None if self.shared is None else SharedChunks(
            self.shared, is_known=lambda k: self.registry.has_update(k.job, k.device, k.round))
        subscriptions = self.topics.coordinator_subscriptions()
        client_id = o.client_id or _client_id(o.fleet, o.topic_prefix)
        if o.workers_group is not None:  # each worker its own session; the group shares the topics
            subscriptions = shared_filters(o.workers_group, subscriptions)
            client_id = f"{client_id}-{self.worker_id}"[:128]
        self.client = MqttClient(
            # A worker's session is clean: a dead worker's persistent session would keep
            # taking its share of the group's messages until it came back.
            host=o.host, port=o.port, client_id=client_id, clean_session=o.workers_group is not None,
            keepalive=o.keepalive, tls=o.tls, username=o.username, password=o.password,
            subscriptions=subscriptions, backoff_base=o.backoff_base,
            # Messages signed by an approved device may fill the whole inbox (junk is dropped
            # first). Then update chunks and states go before progress reports: a device resends
            # an unacknowledged chunk and republishes its state, but sends a dropout report once
            # (the 10,000-device round lost 327 of them to its own burst of chunks and states,
            # and could then only close at its deadline).
            backoff_cap=o.backoff_cap, inbox_size=20_000, priority_size=20_000, max_payload=MAX_BINARY_BYTES + 4096,
            admit=Admission(self.verifier, priority_channels=("progress",), resend_channels=("state", "update", "secagg"),
                            per_device=DEVICE_INGRESS))
        self.pending = PendingDevices(self.verifier, self.topics)  # shown, logged once, not trusted
        self.channel = Channel(client=self.client, signer=self.signer, verifier=self.pending,  # type: ignore[arg-type]
                               role="coordinator")
        self.link = LinkHealth(client=self.client, topics=self.topics, client_id=client_id, silence_s=o.silence_s,
                               heard=lambda: self.channel.accepted + sum(self.channel.rejected.values()))
        self.inbox = UpdateInbox(registry=self.registry, engine=self.engine, signer=self.signer, topics=self.topics,
                                 client=self.client, ack_interval=o.ack_interval, shared=self.shared, chunks=self.chunks)
        self._published: set[tuple[str, str]] = set()  # (name, version or patch id) published since connecting
        self.retention = AutoPrune(self.registry, o.retention, chunk_bytes=o.model_chunk_bytes)
        self._connects = 0
        self._rotations_sent = -1  # connection (count) on which the key rotations were last published
        self.problems: list[str] = []  # shown by `edge-coordinator status` (serve.json); kept in place
        self._next_beat = 0.0
        self.started_at = time.time()
        self.errors = 0  # every failed step since the start (serve.json)
        self.tick_failures = 0  # ticks failed in a row: their back-off
        self._failure_lines = LineBudget(per_minute=20)  # log lines for messages that failed
        self.device_trust = DeviceTrust(self.registry, self.trust, self.pending, self.client, self.topics,
                                        leading=lambda: self.leading, connected_before=lambda: self._connects > 0)
        self.device_trust.sync()
        self.pending.sync(self.registry)
        self.refusals = CommandRefusals(signer=self.signer, state_dir=self.state_dir,
                                        approved=lambda: len(self.device_trust), problems=self.problems)
        self.messages = DeviceMessages(registry=self.registry, engine=self.engine, topics=self.topics,
                                       signer=self.signer, client=self.client, channel=self.channel,
                                       pending=self.pending, device_trust=self.device_trust, inbox=self.inbox,
                                       refusals=self.refusals, auto_approve=o.auto_approve,
                                       full_wanted=self._full_wanted)

    def handle(self, result: Message | Rejection) -> None:
        """One verified message (or a refused one's reply): DeviceMessages.handle."""
        self.messages.handle(result)

    # ------------------------------------------------------------------ lifecycle
    def run(self, stop: threading.Event) -> int:
        self.client.start()
        log.info("coordinator %s: fleet %s on %s:%d (topics %s/...), state %s", self.key_id, self.topics.fleet,
                 self.options.host, self.options.port, self.topics.root, self.state_dir)
        log.info("registry: %s", self.registry.where)  # (redacted: never a password)
        log.info("coordinator public key (edge-agent init --coordinator-key): %s", self.public_key)
        next_tick = 0.0
        while not stop.is_set():
            try:
                result = self.channel.receive(timeout=0.05)  # (never raises for any bytes received)
            except Exception:  # a local fault in the transport: not a message's doing
                self.errors += 1
                log.exception("coordinator receive failed (%d errors so far)", self.errors)
                stop.wait(0.2)
                continue
            if result is not None:
                self.step_message(result)
            if time.monotonic() >= next_tick:
                next_tick = time.monotonic() + self.step_tick()
        return 0

    def step_message(self, result: Message | Rejection) -> None:
        """Handle one received message. A failure costs that message only: no wait (the next
        device's message is taken at once) and one rate-limited line without a traceback (a
        hostile device must not stall the loop, nor fill the log); the traceback at debug."""
        try:
            self.handle(result)
        except Exception as exc:
            self.errors += 1
            device = (result.route.device if result.route else None) or "?"
            shown, hidden = self._failure_lines.take()
            if shown:
                more = f" ({hidden} more failed messages not logged)" if hidden else ""
                log.error("%s from device %s not handled: %s%s", result.kind or "message", device, one_line(exc), more)
            log.debug("%s from device %s not handled", result.kind, device, exc_info=exc)

    def step_tick(self) -> float:
        """One tick; returns the seconds until the next. The next one comes tick_s after this
        one ENDS (a slow tick -- a round of 10,000 -- must leave time for messages). A failed
        tick (a local fault: disk full, database gone) backs off, doubling per failure in a
        row up to 5 s (or tick_s if longer), and only the ticks: messages are still taken
        meanwhile; the first good tick resets it."""
        try:
            self.tick()
        except Exception:
            self.errors += 1
            self.tick_failures += 1
            log.exception("coordinator tick failed (%d in a row)", self.tick_failures)
            tick_s = self.options.tick_s
            return min(max(5.0, tick_s), tick_s * 2 ** min(self.tick_failures, 16))
        self.tick_failures = 0
        return self.options.tick_s

    def close(self) -> None:
        try:
            self._heartbeat(stopped=True)
        except OSError:
            pass
        self.client.stop()
        if self.shared is not None:
            self._hand_back_sequence()
            self.shared.close()  # the leader lock goes with its connection
        self.registry.close()
        for fd in self._lock_fds:
            os.close(fd)

    def _hand_back_sequence(self) -> None:
        """keys/seq (SequenceCounter's lease) above the group's last number: a lone serve
        started here later (numbering from its own clock, not the database's) resumes above it."""
        from ..atomic import read_checked, write_checked

        assert self.shared is not None
        path = self.state_dir / "keys" / "seq"
        try:
            last = self.signer.sequence.next()
            try:
                last = max(last, int(read_checked(path, 64).decode()))
            except (OSError, ValueError, InputError):
                pass
            write_checked(path, str(last + 1).encode(), mode=0o600)
        except (OSError, TransientError) as exc:
            log.warning("worker %s: %s not written: %s", self.worker_id, path, exc)

    @property
    def leading(self) -> bool:
        """Runs the rounds, dispatch, retention and publishing: always a lone serve; in a
        workers group, the holder of the group's lock (workers.py)."""
        return self.shared is None or self.shared.leader

    # ------------------------------------------------------------------ the periodic step
    def tick(self) -> None:
        self.problems[:] = self.link.update(self.problems)  # its messages lost, or no device heard
        connects = self.client.stats["connects"]
        if connects != self._connects:  # a new connection: the broker may have lost retained models
            self._connects, self._published = connects, set()
        if self.shared is not None and not self._elect():
            self.device_trust.sync_when_due()  # every worker verifies every approved device's messages
            self.device_trust.unpeek()
            if time.monotonic() >= self._next_beat:
                self._heartbeat()
            return
        self.device_trust.sync_when_due()
        self.device_trust.unpeek()
        result = self.engine.tick()
        for device, job, number in result.gone:
            log.info("device %s stayed offline: a dropout of job %s round %d", device, job, number)
        for plan in result.cancelled:
            self._cancel(plan)
        for outcome in result.closed:
            log.info("job %s round %d %s%s: accepted %d, rejected %d, dropouts %d (%s)", outcome.job_id,
                     outcome.round, outcome.state, f" -> version {outcome.new_version.version}"
                     if outcome.new_version else "", len(outcome.accepted), len(outcome.rejected),
                     len(outcome.dropouts), outcome.reason or "ok")
            if outcome.new_version is not None and self.client.connected:
                self._publish_safely(outcome.new_version, full=False)  # the full archive: on demand
        for job_id, why in result.failed.items():
            log.error("job %s failed: %s", job_id, why)
        if result.secagg and self.client.connected:
            self._send_secagg(result.secagg)
        if result.closed:
            release_freed_memory()  # a round's arrays are gone: give their pages back (flat RSS)
        if self.client.connected and self._publish_rotations():  # devices move to our key before our commands
            for plan in self.engine.pending_dispatches():
                self._dispatch(plan)
            self._retain()
        if time.monotonic() >= self._next_beat:
            self._heartbeat()

    def _elect(self) -> bool:
        """A worker's turn at the group's lock. A new leader has published nothing yet (its
        dispatch publishes what rounds need), and reads the retained hello/state messages
        once per connection: a shared subscription is never sent retained messages."""
        assert self.shared is not None
        was = self.shared.leader
        if not self.client.connected:  # a leader must reach the devices: only a connected worker leads
            self._down_since = self._down_since or time.monotonic()
            if was and time.monotonic() - self._down_since >= RESIGN_AFTER_S:
                self.shared.resign()
            if not self.shared.leader:
                return False
        else:
            self._down_since = 0.0
        if not self.shared.elect():
            return False
        if not was:
            self._published = set()
        connects = self.client.stats["connects"]
        if self.client.connected and self._peeked != connects:
            self._peeked = connects
            for channel in ("hello", "state"):
                topic = f"{self.topics.root}/devices/+/{channel}"
                self.device_trust.peek(topic)
        if was:
            self.shared.prune()
        return True

    _peeked = -1
    _down_since = 0.0

    def _publish_rotations(self) -> bool:
        """Once per connection: each retired key's signed statement that our key is the one
        now (key_rotation.py), retained; False while the broker has not taken them all."""
        connects = self.client.stats["connects"]
        if self._rotations_sent == connects:
            return True
        from .key_rotation import rotation_messages

        messages = rotation_messages(self.state_dir, self.topics, self.signer.sequence, self.public_key)
        infos = [self.client.publish(topic, payload, retain=True) for topic, payload in messages]
        sent = self.client.wait_published(infos, timeout=10.0)
        if not all(sent):
            log.warning("key rotation not published yet (%d of %d taken by the broker); retried next tick",
                        sum(sent), len(messages))
            return False
        if messages:
            log.info("published the rotation of %d retired coordinator key(s) to this key (%s)", len(messages),
                     self.key_id)
        self._rotations_sent = connects
        return True

    def _retain(self) -> None:
        """Apply the retention policy when due; retract pruned versions' retained messages."""
        def retract(name: str, pid: str, chunks: int) -> None:
            retract_model(self.client, self.topics, name=name, version=pid, chunks=chunks, timeout=10.0)
            self._published.discard((name, pid))

        try:
            for vp in self.retention.step(retract):
                self.artefacts.forget(vp.name, vp.version)
        except EdgeAgentError as exc:  # the broker went away mid-retraction: the rest stay queued
            log.warning("retention: %s (retried later)", exc)

    def _full_wanted(self, ref: str) -> None:
        """A device asks for a version's whole bundle ("name/version"): build and publish it."""
        name, _, version = ref.partition("/")
        try:
            mv = self.registry.get_model(name, version)
        except InputError:  # not a version of ours
            return
        if (mv.name, mv.version) not in self._published and self.client.connected:
            self._publish_safely(mv, full=True)

    def _publish_safely(self, mv: ModelVersion, *, full: bool = True) -> bool:
        try:
            self.publish(mv, full=full)
            return True
        except EdgeAgentError as exc:  # broker gone (retried later) or an unusable bundle (logged)
            log.warning("model %s %s not published: %s", mv.name, mv.version, exc)
            return False

    def publish(self, mv: ModelVersion, *, full: bool = True) -> dict[str, Any]:
        """Publish a version (retained, signed chunks, then the manifest): its head patch, and
        its full bundle archive if `full` or it has no patch (built on demand, then deleted:
        a rebuild gives the same bytes). Returns the full archive's manifest, else the patch's."""
        patch = self.artefacts.patch_for(mv)
        manifest: dict[str, Any] | None = None
        size = 0
        if full or patch is None:
            art = self.artefacts.archive_for(mv)
            meta = {"parent": mv.parent or "", "head_only": mv.head_only, "head_bytes": art.head_bytes}
            manifest = publish_model(self.client, self.signer, self.topics, name=mv.name, version=mv.version,
                                     bundle=art.path.read_bytes(), chunk_bytes=self.options.model_chunk_bytes,
                                     meta=meta)
            size = art.size
            self._published.add((mv.name, mv.version))
            self.artefacts.drop_full(mv)
        if patch is not None:  # devices running the backbone already fetch only this
            patched = publish_model(self.client, self.signer, self.topics, name=mv.name, version=patch.version,
                                    bundle=patch.path.read_bytes(), chunk_bytes=self.options.model_chunk_bytes,
                                    meta={"patch_of": mv.version, "full_sha256": self.artefacts.full_sha256(mv)})
            manifest = manifest or patched
            self._published.add((mv.name, patch.version))
        log.info("published model %s %s: %s%s", mv.name, mv.version, f"{size} bytes" if size else "no full archive",
                 f", head patch {patch.size} bytes" if patch is not None else "")
        assert manifest is not None
        return manifest

    def _dispatch(self, plan: RoundPlan) -> None:
        mv = self.registry.get_model(plan.model_name, plan.model_version)
        try:
            patch = self.artefacts.patch_for(mv)
            sha = self.artefacts.full_sha256(mv)  # what the command pins, even if only the patch is sent
            full = patch is None or needs_full(self.registry, mv.name, list(plan.devices))
            if (full and (mv.name, mv.version) not in self._published) or \
                    (patch is not None and (mv.name, patch.version) not in self._published):
                self.publish(mv, full=full)
        except TransientError as exc:  # the broker did not take it: retried next tick
            log.warning("model %s %s not published yet: %s", mv.name, mv.version, exc)
            return
        except EdgeAgentError as exc:  # no usable bundle: these devices cannot train this round
            log.error("job %s round %d: model %s %s cannot be sent: %s", plan.job_id, plan.round, mv.name,
                      mv.version, exc)
            for device in plan.devices:
                self.engine.record_dispatch(plan.job_id, plan.round, device, ok=False, reason=str(exc)[:300])
            return
        now = time.time()
        params = {k: v for k, v in plan.params.items() if _scalar(v) and v is not None}
        params["deadline"] = int(plan.deadline_at)
        ttl = min(86400.0, max(60.0, plan.deadline_at - now))
        # the fleet's int8 engine choices (registry_choices.py), to the devices whose hello said
        # they read them: an older agent's strict schema would refuse the whole command
        choices = [c.choice.to_json() for c in self.registry.engine_choices()]
        for start in range(0, len(plan.devices), DISPATCH_BATCH):
            results: dict[str, str | None] = {}
            signed: list[tuple[str, str, bytes]] = []
            batch = plan.devices[start:start + DISPATCH_BATCH]
            readers = {d for d, state in self.registry.states_of(batch).items() if state.get("engine_choices") is True}
            for device in batch:
                body = {"cmd_id": plan.cmd_id, "action": "finetune", "job": plan.job_id, "round": plan.round,
                        "model": plan.model_name, "version": plan.model_version, "sha256": sha, "params": params,
                        **({"head_sha256": patch.sha256} if patch is not None else {})}
                if device in readers:
                    body["engine_choices"] = choices
                topic = self.topics.device(device, "cmd")
                try:
                    signed.append((device, topic, self._finetune_command(topic, body, ttl)))
                except ValueError as exc:  # a job parameter our own schema refuses: the device cannot be told
                    results[device] = str(exc)[:200]
            sent = self.channel.send_many([(t, payload) for _, t, payload in signed], timeout=10.0)
            results.update({device: None for (device, _, _), ok in zip(signed, sent, strict=True) if ok})
            moved = self.engine.record_dispatches(plan.job_id, plan.round, results)
            delivered = [d for d in moved if results[d] is None]
            if delivered:
                log.info("job %s round %d: finetune sent to %s", plan.job_id, plan.round,
                         delivered[0] if len(delivered) == 1 else f"{len(delivered)} devices")
            if not all(sent):
                return  # disconnected: the rest stay selected and are sent on a later tick

    def _finetune_command(self, topic: str, body: dict[str, Any], ttl: float) -> bytes:
        """The signed command; one over the size limit with engine choices goes with fewer
        (the device then measures its engine itself), never not at all."""
        while True:
            try:
                return self.signer.control(topic, Kind.CMD, body, ttl=ttl)
            except ValueError:
                if not body.get("engine_choices"):
                    raise
                body = {**body, "engine_choices": body["engine_choices"][:len(body["engine_choices"]) // 2]}

    def _send_secagg(self, messages: list[tuple[str, Any, dict[str, Any]]]) -> None:
        """Secure rounds' requests (roster, inbox, unmask) on each device's secagg_cmd topic;
        one not delivered is sent again by a later tick (secure_rounds.RESEND_S)."""
        signed = []
        for device, kind, body in messages:
            topic = self.topics.device(device, "secagg_cmd")
            try:
                signed.append((topic, self.signer.control(topic, kind, body, ttl=3600)))
            except ValueError as exc:  # over the size limit: that device cannot be told (logged, it drops out)
                log.error("job %s round %d: %s to %s not sent: %s", body["job"], body["round"], kind, device, exc)
        sent = self.channel.send_many(signed, timeout=10.0)
        if not all(sent):
            log.warning("%d of %d secure aggregation request(s) not delivered; sent again later",
                        len(sent) - sum(sent), len(sent))

    def _cancel(self, plan: RoundPlan) -> None:
        signed = []
        for device in plan.devices:
            body = {"cmd_id": f"{plan.cmd_id}-cancel", "action": "cancel", "job": plan.job_id, "round": plan.round}
            topic = self.topics.device(device, "cmd")
            signed.append((topic, self.signer.control(topic, Kind.CMD, body, ttl=3600)))
        sent = self.channel.send_many(signed, timeout=5.0)
        for device, ok in zip(plan.devices, sent, strict=True):
            if not ok:
                log.warning("cancel of job %s not delivered to %s", plan.job_id, device)
        log.info("job %s round %d cancelled; told %d device(s)", plan.job_id, plan.round, len(plan.devices))

    def _heartbeat(self, *, stopped: bool = False) -> None:
        o = self.options
        info: dict[str, Any] = {
            "pid": os.getpid(), "host": socket.gethostname(), "started_at": self.started_at, "heartbeat_at": time.time(),
            "broker": f"{o.host}:{o.port}", "fleet": o.fleet, "topic_prefix": o.topic_prefix,
            "connected": self.client.connected, "coordinator_key": self.public_key, "key_id": self.key_id,
            "auto_approve": o.auto_approve, "policy": asdict(o.policy), "errors": self.errors,
            "metrics_port": o.metrics_port, "problems": self.problems[:10], "link": self.link.summary()}
        if stopped:
            info["stopped_at"] = time.time()
        if self.shared is not None:  # each worker its own file; the leader's is also serve.json
            info.update(workers_group=self.shared.group, worker_id=self.worker_id, leader=self.shared.leader)
            atomic_write_json(self.state_dir / f"serve-{self.worker_id}.json", info)
            try:
                self.shared.beat(os.getpid())
            except TransientError as exc:
                log.warning("worker %s: heartbeat not recorded: %s", self.worker_id, exc)
        if self.shared is None or self.shared.leader:
            atomic_write_json(self.state_dir / SERVE_FILE, info)
        if self.metrics is not None:  # every worker: each has its own inbox
            self.metrics.observe_inbox(self.client.stats, self.client.pending)
        self._next_beat = time.monotonic() + HEARTBEAT_S


def _worker_id() -> str:
    """<host>-<pid>, as a topic-level-safe id: unique per process on a host."""
    import re

    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:40].strip("-") or "host"
    return f"{host}-{os.getpid()}"


def _client_id(fleet: str, prefix: str) -> str:
    """Fixed per fleet (the broker keeps the session across restarts); fleets under other
    topic prefixes on the same broker get their own."""
    if prefix == DEFAULT_PREFIX:
        return f"edge-coordinator-{fleet}"
    return f"edge-coordinator-{fleet}-{hashlib.sha256(prefix.encode()).hexdigest()[:8]}"
