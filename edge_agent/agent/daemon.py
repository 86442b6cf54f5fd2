"""The agent daemon (`edge-agent run`): one small process, no MXNet (and no numpy unless
[serve] runs the local inference service in it: edge_agent/inference/).

Main loop, every iteration (at most TICK_S apart while idle):

    watchdog.alive() -> receive one verified message (or a Rejection) -> dispatch
    -> drive jobs (jobs.py table, lifecycle.py) -> finish model activations
    -> pump the outbox (a few chunks) -> publish hello / state when due (the hello again
       while the coordinator has not answered it, or says it does not know us: link.py)

Nothing that arrives can kill it: the Verifier turns any bytes into a Message or a
Rejection; a refused command is answered with a signed `refusal` (reason code + text) on
the device's progress topic; an exception in a step is logged and the loop goes on (only
a run of failing iterations — a local fault such as an unwritable state directory — ends
the process with exit code 1, for systemd to restart). SIGTERM/SIGINT: publish `offline`
(retained), stop the training child cleanly (it checkpoints), exit 0 (SIGINT, Ctrl-C: 130).

Commands (`cmd` body: cmd_id, action, job, round, model, version, sha256, head_sha256, params):
    finetune     job, round, model, version required; sha256 of the bundle archive when the
                 device may have to fetch it, head_sha256 of its head patch (a device that
                 runs a version with the same backbone fetches only that); params: budget_wh, power_cap_w, deadline
                 (epoch s), epochs, batch_size, lr, patience, checkpoint_every, seed,
                 update_bytes (unknown params are ignored)
    cancel       job (+ round)        fetch_model  model, version (+ sha256, head_sha256)
    ping         -> progress phase "pong" (a ping with cmd_id hello-<seq> answers our hello: link.py)
    probe        -> progress "probe" + fresh hello/state
Replies go to the progress topic: phase "accepted" / job states / "pong" / "probe", or a
`refusal` (reasons: policy.py's codes, or the protocol's: bad_signature, expired, ...).
A `key_rotation` (retained on coordinator/key/<trusted key id>, signed by the trusted key)
moves the device's trust to the coordinator's new key (coordinator_trust.py).

Test hook (only with EDGE_AGENT_TEST_HOOKS=1 in the environment): while the file
<state_dir>/debug/hang exists the main loop blocks without calling watchdog.alive(), as a
hung loop would, so a test can check that the watchdog pings stop; while the file
<state_dir>/debug/fail exists every iteration fails with an OSError, as a local fault (an
unwritable state directory) would, so a test can check the exit after a run of failures;
while <state_dir>/debug/enospc exists every replay-window write fails with ENOSPC, as on a
full disk, so a test can check that the command is answered with a `local_fault` refusal.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from .. import __version__
from ..config import AgentConfig, load_identity, public_key_text
from ..errors import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK, ConfigError, InputError
from ..keys import enrolment_code
from ..locks import hold_locks
from ..protocol import (
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
from ..protocol.schema import SECAGG_DOWN, clean_flat
from ..transport import Admission, Channel, MqttClient, Outbox, OutboxKey, TlsConfig, Uploader, Will
from .coordinator_trust import CoordinatorTrust
from .jobs import JobStore
from .lifecycle import DriverSettings, JobDriver
from .link import HELLO_ACK_PREFIX, LINK_FILE, CoordinatorLink
from .models import ModelStore
from .policy import DeviceLimits, Verdict
from .sdnotify import Watchdog
from .secure import SecureJobs
from .solar import SolarPlanner, SolarSettings, pvlib_missing
from .state import AGENT, DeviceState

log = logging.getLogger(__name__)
TICK_S = 0.25
MAX_MESSAGES_PER_ITERATION = 64
MAX_FAILING_ITERATIONS = 100
STATE_TTL = 7 * 86400
LOCK_FILE = "agent.lock"
HOOKS_ENV = "EDGE_AGENT_TEST_HOOKS"
HANG_FILE = "debug/hang"
FAIL_FILE = "debug/fail"
ENOSPC_FILE = "debug/enospc"  # test hook: while it exists, replay-window writes fail with ENOSPC
CHUNK_HEADROOM = 4096  # envelope header + signature + topic around an update chunk


class Daemon:
    def __init__(self, config: AgentConfig, *, watchdog: Watchdog | None = None) -> None:
        self.config = config
        self.key, self.device_id = load_identity(config)
        self.name = config.device_name
        sd = config.state_dir
        try:
            (sd / "keys").mkdir(mode=0o700, parents=True, exist_ok=True)
            for sub in ("jobs", "models", "checkpoints", "outbox", "replay", "residuals", "cache"):
                (sd / sub).mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a deployment problem a restart cannot fix
            raise ConfigError(f"{config.path}: device.state_dir: cannot create {sd}: {exc.strerror or exc}") from exc
        # One daemon per state directory (exit 69 for a second): two copies on one config wrote
        # one state dir and took each other's broker session over 1,147 times in 10 minutes.
        self._lock_fds = hold_locks(sd, [(LOCK_FILE, True)], lambda _, pid: (
            f"{sd}: another edge-agent run (pid {pid}) is using this state directory ({config.path}); "
            "stop it first (systemctl stop edge-agent) or give this one its own device.state_dir"))
        try:
            self._setup(config, sd, watchdog)
        except BaseException:
            self._release_lock()
            raise

    def _setup(self, config: AgentConfig, sd: Path, watchdog: Watchdog | None) -> None:
        self.topics = Topics(fleet=config.fleet, prefix=config.topic_prefix)
        self.signer = Signer(key=self.key, topics=self.topics, sequence=SequenceCounter(path=sd / "keys" / "seq"))
        # agent.toml's coordinator key, or the one a verified rotation moved this device to
        self.coordinator = CoordinatorTrust(state_dir=sd, configured=config.coordinator_public_key)
        self.trust = trust = TrustStore()
        trust.add(self.coordinator.key, role="coordinator")
        self.hooks = os.environ.get(HOOKS_ENV) == "1"
        # strict_missing: a lost window file means "only what is issued from now on", never "empty";
        # and so does a lost replay/ directory on a device that was enrolled before.
        self.window = window = ReplayWindow(directory=sd / "replay", strict_missing=True,
                                            known_senders=(self.coordinator.key_id,), enrolled=ever_enrolled(sd),
                                            fault_file=sd / ENOSPC_FILE if self.hooks else None)
        self.verifier = Verifier(topics=self.topics, trust=trust, replay=window)
        g = config.get
        max_message = int(g("broker", "max_message_bytes"))
        self.client = MqttClient(
            host=g("broker", "host"), port=int(g("broker", "port")), client_id=f"edge-agent-{self.device_id}",
            clean_session=False, keepalive=int(g("broker", "keepalive_s")), tls=self._tls(),
            username=g("broker", "username"), password=self._password(), will=self._will,
            subscriptions=[*self.topics.device_subscriptions(self.device_id),
                           self.topics.coordinator_key(self.coordinator.key_id)],  # (its rotation, if ever)
            admit=Admission(self.verifier, priority_channels=("cmd", "ack", "secagg_cmd")),  # signed commands jump junk
            backoff_base=float(g("broker", "reconnect_min_s")), backoff_cap=float(g("broker", "reconnect_max_s")),
            max_payload=max_message)
        self.channel = Channel(client=self.client, signer=self.signer, verifier=self.verifier, role="device")
        self.outbox = Outbox(directory=sd / "outbox", max_bytes=int(g("service", "outbox_max_mb")) << 20,
                             max_chunk_bytes=MAX_BINARY_BYTES)
        self.uploader = Uploader(client=self.client, outbox=self.outbox, signer=self.signer, topics=self.topics,
                                 ack_timeout=float(g("service", "upload_ack_timeout_s")),
                                 retry_base=float(g("service", "upload_retry_min_s")),
                                 retry_cap=float(g("service", "upload_retry_max_s")))
        from ..hardware.probe import probe

        root = g("device", "sysfs_root")
        self.probe_report = probe(root)
        profile = config.profile
        self.device = DeviceState(sysfs_root=root, probe_report=self.probe_report,
                                  idle_w=g("power", "idle_w"), load_w=g("power", "load_w"))
        self.planner = self._solar(config, sd, root)
        self.models = ModelStore(root=sd / "models", topics=self.topics, subscribe=self.client.subscribe,
                                 unsubscribe=self.client.unsubscribe,
                                 fetch_timeout=float(g("service", "model_fetch_timeout_s", 600.0)))
        self.models.on_change = self._model_changed
        settings = DriverSettings(
            device_id=self.device_id, state_dir=sd, limits=DeviceLimits.from_config(config), sysfs_root=root,
            profile=profile.name if profile else None, battery_floor_pct=g("budget", "battery_floor_pct"),
            battery_resume_pct=g("budget", "battery_resume_pct"), thermal_limit_c=g("thermal", "limit_c"),
            thermal_margin_c=float(g("thermal", "margin_c", 8.0)), cache_mb=int(g("data", "cache_mb")),
            label_map=g("data", "label_map"), skip_unknown=bool(g("data", "skip_unknown", False)),
            chunk_size=max(1024, min(64 * 1024, max_message - CHUNK_HEADROOM)),
            progress_interval_s=float(g("service", "progress_interval_s")),
            child_priority=str(g("serve", "training_priority")) if g("serve", "enabled") else "normal",
            inference_energy=str(sd / "serve" / "inference-energy.json") if g("serve", "enabled") else None)
        self.driver = JobDriver(settings=settings, store=JobStore(
            sd / "jobs", keep_records=int(g("service", "keep_job_records", 500)),
            keep_days=float(g("service", "keep_job_days", 30.0))), models=self.models,
                                outbox=self.outbox, readings=self.device.readings, publish=self.progress,
                                planner=self.planner)
        # a secure job's device side (secure.py): its round secrets in <state dir>/secagg/, 0600
        self.secure = SecureJobs(state_dir=sd, key=self.key, send=self._send_secagg,
                                 finish=self.driver.secure_finished, hooks=self.hooks)
        self.driver.secure = self.secure
        self._secure_at = 0.0
        self.inference = None  # the local inference service ([serve] enabled): threads of this process
        if g("serve", "enabled"):
            from ..inference.server import InferenceServer

            self.inference = InferenceServer.from_config(config, probe=self.probe_report)
        self.watchdog = watchdog or Watchdog()
        # Is the coordinator hearing us? (an ACL for another fleet drops everything silently)
        self.link = CoordinatorLink(path=sd / LINK_FILE, fleet=config.fleet,
                                    hello_topic=self.topics.device(self.device_id, "hello"),
                                    silence_s=float(g("service", "coordinator_silence_s", 300.0)))
        self.state_interval = float(g("service", "state_interval_s"))
        self._stop = threading.Event()
        self._connects = 0
        self._next_state = 0.0
        self._status = ""

    # ---- setup helpers ----
    def _solar(self, config: AgentConfig, sd: Path, root: str) -> SolarPlanner | None:
        """[solar]: the panel history and the forecast (none without the table)."""
        settings = SolarSettings.from_config(config)
        if settings is None:
            return None
        missing = pvlib_missing()
        if missing:
            raise ConfigError(f"{config.path}: [solar]: {missing}")
        return SolarPlanner(settings=settings, state_dir=sd, sysfs_root=root, battery=self.device.monitor.battery)

    def _tls(self) -> TlsConfig | None:
        g = self.config.get
        if not g("broker", "tls"):
            return None
        return TlsConfig(ca_certs=g("broker", "ca_file"), certfile=g("broker", "cert_file"),
                         keyfile=g("broker", "key_file"))

    def _password(self) -> str | None:
        path = self.config.get("broker", "password_file")
        if not path:
            return None
        try:
            return Path(path).read_text(encoding="utf-8")[:4096].strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{self.config.path}: broker.password_file: cannot read {path}: {exc}") from exc

    def _will(self) -> Will:
        topic = self.topics.device(self.device_id, "state")
        return Will(topic, self.signer.control(topic, Kind.STATE, {"status": "offline", "agent": AGENT},
                                               ttl=STATE_TTL))

    # ---- publishing ----
    def progress(self, phase: str, *, job: str | None = None, round: int | None = None, cmd_id: str | None = None,
                 pct: float | None = None, detail: str = "", metrics: dict[str, Any] | None = None) -> bool:
        body: dict[str, Any] = {"phase": phase, "detail": detail[:512]}
        for name, value in (("job", job), ("round", round), ("cmd_id", cmd_id), ("pct", pct)):
            if value is not None:
                body[name] = round_pct(value) if name == "pct" else value
        if metrics:
            # (a value outside the protocol's range for its name is dropped, not the report)
            body["metrics"] = clean_flat({k: (v[:256] if isinstance(v, str) else v) for k, v in metrics.items()})
        topic = self.topics.device(self.device_id, "progress")
        try:
            return self.channel.send(topic, Kind.PROGRESS, body, ttl=3600, timeout=5.0)
        except ValueError as exc:  # a body our own schema refuses: a bug, never worth dying for
            log.error("progress %s not sent: %s", phase, exc)
            return False

    def _send_secagg(self, kind: Kind, body: dict[str, Any]) -> bool:
        """A secure round's message (its state already saved: a lost one is sent again on the
        coordinator's repeated request, or after a restart)."""
        topic = self.topics.device(self.device_id, "secagg")
        try:
            return self.client.connected and self.channel.send(topic, kind, body, ttl=3600, timeout=5.0)
        except ValueError as exc:  # a body our own schema refuses (a head too large to mask): logged
            log.error("%s for job %s not sent: %s", kind, body.get("job"), exc)
            return False

    def refuse(self, msg: Message, verdict: Verdict) -> None:
        body = {"reason": verdict.reason, "detail": verdict.detail[:512], "ref_topic": msg.topic[:256],
                "ref_kind": str(msg.kind), "ref_seq": msg.seq, "ref_cmd_id": msg.body["cmd_id"]}
        log.warning("refused %s %s: %s: %s", msg.body.get("action"), msg.body["cmd_id"], verdict.reason, verdict.detail)
        topic = self.topics.device(self.device_id, "progress")
        self.channel.send(topic, Kind.REFUSAL, body, ttl=3600, timeout=5.0)

    def facts(self) -> dict[str, Any]:
        active = self.driver.active()
        job = active[0] if active else None
        facts = self.device.facts(name=self.name, busy=bool(active), job=job.params.get("job") if job else None,
                                  job_state=job.state.value if job else None, models=self.models.current(),
                                  engine=self.driver.engine, outbox=len(self.outbox))
        if self.inference is not None:
            facts.update(self.inference.facts())
        return facts

    def publish_state(self) -> None:
        facts = self.facts()
        topic = self.topics.device(self.device_id, "state")
        forecast = self.planner.state(self.driver.planned_window()) if self.planner is not None else None
        body = self.device.state_body(facts, self.driver.allowance().to_facts(),
                                      engine_choices=self.driver.shared_choices(), forecast=forecast)
        if self.channel.send(topic, Kind.STATE, body, ttl=STATE_TTL, retain=True, timeout=5.0):
            self._next_state = time.monotonic() + self.state_interval
            self.driver.changed = False

    def _update_status(self) -> None:
        """systemd's STATUS= line (`systemctl status edge-agent`), sent when it changes."""
        active = self.driver.active()
        silent = self.link.status() if self.client.connected else ""
        status = (f"busy: job {active[0].job_id} {active[0].state.value}" if active else "idle") + \
            ("" if self.client.connected else "; broker unreachable, retrying") + (f"; {silent}" if silent else "")
        if status != self._status:
            self._status = status
            self.watchdog.status(status)

    def publish_hello(self) -> None:
        topic = self.topics.device(self.device_id, "hello")
        body: dict[str, Any] = {"public_key": public_key_text(self.key), "agent": AGENT,
                                "info": self.device.hello_info(self.name)}
        if self.channel.send(topic, Kind.HELLO, body, ttl=365 * 86400, retain=True, timeout=5.0):
            self.link.hello_sent()  # the coordinator answers a fresh hello (link.py)

    def _model_changed(self, fetch: Any) -> None:
        self.driver.changed = True
        phase = {"installed": "model-installed", "failed": "model-failed"}.get(fetch.status, f"model-{fetch.status}")
        self.progress(phase, detail=f"{fetch.name}/{fetch.version}: {fetch.detail}"[:512])

    # ---- dispatch ----
    def handle(self, result: Message | Rejection) -> None:
        if isinstance(result, Rejection):
            self.channel.reply_to(result)  # a refused command is answered; junk elsewhere is not
            return
        if result.kind is Kind.ACK and result.body.get("reason") == "unknown_key":  # our update: sender unknown
            self.link.refused("unknown_key", str(result.body.get("detail", "")))
        elif result.kind in (Kind.CMD, Kind.ACK, *SECAGG_DOWN):  # signed by the coordinator, for us: it knows us
            self.link.heard(f"{result.kind} {result.body.get('cmd_id') or result.body.get('status', '')}")
        if result.kind is Kind.CMD and result.body["action"] == "ping" and \
                result.body["cmd_id"].startswith(HELLO_ACK_PREFIX):
            return  # the coordinator's answer to our hello: nothing to reply
        if result.kind is Kind.CMD:
            try:
                self.command(result)
            except OSError as exc:  # a local fault (disk full, read-only, permissions): a reason, no traceback
                log.error("command %s failed: %s: %s", result.body["cmd_id"], type(exc).__name__, exc)
                with contextlib.suppress(Exception):
                    self.refuse(result, Verdict.refuse("local_fault", f"{exc.strerror or exc} ({exc.filename or ''})"))
            except Exception as exc:  # a bug: say so rather than go silent
                log.exception("command %s failed", result.body["cmd_id"])
                with contextlib.suppress(Exception):
                    self.refuse(result, Verdict.refuse("internal_error", f"{type(exc).__name__}: {exc}"))
        elif result.kind is Kind.ACK:
            outcome = self.uploader.handle_ack(result)
            if outcome in ("acked", "dropped"):
                key = OutboxKey(result.body["job"], self.device_id, result.body["round"])
                self.driver.on_upload(key, outcome, f"{result.body.get('reason', '')}: {result.body.get('detail', '')}")
        elif result.kind in (Kind.MANIFEST, Kind.MODEL_CHUNK):
            self.models.add(result)
        elif result.kind is Kind.REFUSAL:
            log.warning("the coordinator refused our message: %s: %s", result.body["reason"], result.body["detail"])
            self.link.refused(result.body["reason"], result.body["detail"])
        elif result.kind is Kind.KEY_ROTATION:
            self.rotate_coordinator_key(result)
        elif result.kind in SECAGG_DOWN:
            self.secure.handle(result)

    def rotate_coordinator_key(self, msg: Message) -> None:
        """The coordinator's new key, signed by the one trusted now: trust it instead (persisted
        first), and follow its own rotation topic from now on."""
        old_id = self.coordinator.key_id
        new = self.coordinator.rotate(msg)
        if new is None:
            return
        self.trust.add(new, role="coordinator")
        self.trust.remove(old_id)
        self.client.subscribe(self.topics.coordinator_key(self.coordinator.key_id))
        self.client.unsubscribe(self.topics.coordinator_key(old_id))
        try:
            self.window.expect(self.coordinator.key_id)
        except OSError as exc:  # (disk full: its first command then re-synchronises the window)
            log.error("replay window for the new coordinator key not written: %s", exc.strerror or exc)

    def command(self, msg: Message) -> None:
        body, cmd_id = msg.body, msg.body["cmd_id"]
        action = body["action"]
        log.info("command %s: %s %s", cmd_id, action, {k: v for k, v in body.items() if k not in ("cmd_id", "action")})
        if action == "ping":
            self.progress("pong", cmd_id=cmd_id, detail=f"{AGENT} {self.name}")
        elif action == "probe":
            from ..hardware.probe import probe

            self.probe_report = probe(self.config.get("device", "sysfs_root"))
            self.device.set_probe(self.probe_report)
            self.progress("probe", cmd_id=cmd_id, detail=self.probe_report["profile"].get("reason", "")[:512],
                          metrics={k: v for k, v in self.facts().items() if k != "status"})
            self.publish_hello()
            self.publish_state()
        elif action == "fetch_model":
            if not body.get("model") or not body.get("version"):
                self.refuse(msg, Verdict.refuse("bad_params", "fetch_model needs model and version"))
                return
            try:
                fetch = self.models.fetch(body["model"], body["version"], body.get("sha256"),
                                          head_sha256=body.get("head_sha256"))
            except InputError as exc:
                self.refuse(msg, Verdict.refuse("bad_params", str(exc)))
                return
            self.progress("accepted", cmd_id=cmd_id, detail="already installed" if fetch is None else "fetching")
        elif action == "cancel":
            verdict = self.driver.cancel(body)
            if verdict.accept:
                self.progress("accepted", cmd_id=cmd_id, job=body.get("job"), detail="cancelling")
            else:
                self.refuse(msg, verdict)
        elif action == "finetune":
            verdict, job = self.driver.submit(body, cmd_id)
            if not verdict.accept:
                self.refuse(msg, verdict)
            elif verdict.reason == "duplicate" and job is not None:
                self.progress("accepted", cmd_id=cmd_id, job=body.get("job"), round=body.get("round"),
                              detail=verdict.detail)
        else:  # the schema knows an action this version does not handle
            self.refuse(msg, Verdict.refuse("bad_params", f"action {action!r} is not supported by {AGENT}"))

    # ---- the loop ----
    def _hang_hook(self) -> None:
        if self.hooks:
            hang = self.config.state_dir / HANG_FILE
            while hang.exists() and not self._stop.is_set():  # a stuck loop: no alive() while it lasts
                time.sleep(0.05)

    def iteration(self) -> None:
        if self.hooks and (self.config.state_dir / FAIL_FILE).exists():
            raise OSError(f"test hook: {self.config.state_dir / FAIL_FILE} exists")
        timeout = TICK_S
        for _ in range(MAX_MESSAGES_PER_ITERATION):  # a burst (model chunks) is taken in one go
            result = self.channel.receive(timeout=timeout)
            if result is None:
                break
            self.handle(result)
            timeout = 0.0
        self.driver.step()
        if time.monotonic() >= self._secure_at:  # secure rounds that ended without us (their files go)
            self._secure_at = time.monotonic() + 5.0
            self.secure.step()
        if self.planner is not None and self.planner.tick(time.time()):  # a new forecast: in the next state
            self.driver.changed = True
        self.models.poll(protect=self.driver.protected_models())
        if self.inference is not None and self.inference.changed:  # a swap: the state says what is served
            self.inference.changed = False
            self.driver.changed = True
        if self.client.connected:
            self.uploader.pump(max_chunks=8)
            for key, why in self.uploader.dropped:
                self.driver.on_upload(key, "dropped", why)
            self.uploader.dropped.clear()
            connects = self.client.stats["connects"]
            if connects != self._connects:  # (re)connected: say who we are and how we are
                self._connects = connects
                self.publish_hello()
                self.publish_state()
                self.secure.recover()  # secure rounds in progress: their last message again
            else:
                if self.link.hello_due():  # refused as unknown, or not answered: say it again
                    self.publish_hello()
                if self.driver.changed or time.monotonic() >= self._next_state:
                    self.publish_state()
        self._update_status()

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda num, frame: self.stop(num))
        log.info("edge-agent %s: device %s (%s), fleet %s, broker %s:%s", __version__, self.device_id, self.name,
                 self.config.fleet, self.config.get("broker", "host"), self.config.get("broker", "port"))
        log.info("enrolment code %s: the coordinator shows it for this device (`edge-coordinator devices`); "
                 "compare before approving", enrolment_code(self.key))
        for problem in self.outbox.dropped_corrupt:
            log.error("outbox: %s", problem)
        self.driver.recover()
        if self.inference is not None:
            self.inference.start()
        self.client.start()
        self.watchdog.start()
        self.watchdog.ready(f"device {self.device_id}: connecting to the broker")
        failing = 0
        while not self._stop.is_set():
            self.watchdog.alive()
            self._hang_hook()
            try:
                self.iteration()
                failing = 0
            except Exception:
                failing += 1
                log.exception("main loop iteration failed (%d in a row)", failing)
                if failing >= MAX_FAILING_ITERATIONS:
                    self.shutdown()
                    return EXIT_FAILURE
                self._stop.wait(min(5.0, 0.1 * failing))
        self.shutdown()
        # SIGTERM (systemd) is the normal stop: 0. Ctrl-C is an interruption: 130, as the
        # exit-code table says, so `edge-agent run && ...` does not go on as if it had ended.
        return EXIT_INTERRUPTED if self._stopped_by == signal.SIGINT else EXIT_OK

    def stop(self, signum: int | None = None) -> None:
        self._stopped_by = signum
        self._stop.set()

    _stopped_by: int | None = None

    def shutdown(self) -> None:
        log.info("stopping: checkpointing the training child, publishing offline")
        self.watchdog.status("stopping")
        with contextlib.suppress(Exception):
            self.driver.shutdown(timeout=45.0)
        with contextlib.suppress(Exception):
            self.models.stop()
        if self.inference is not None:
            with contextlib.suppress(Exception):
                self.inference.stop()
        with contextlib.suppress(Exception):
            if self.client.connected:
                topic = self.topics.device(self.device_id, "state")
                self.channel.send(topic, Kind.STATE, {"status": "offline", "agent": AGENT, "detail": "stopped"},
                                  ttl=STATE_TTL, retain=True, timeout=5.0)
        self.client.stop()
        self.watchdog.stop()
        self._release_lock()

    def _release_lock(self) -> None:
        for fd in self._lock_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._lock_fds = []


def ever_enrolled(state_dir: Path) -> bool:
    """Has this device been in service before? It has signed messages (keys/seq: its first
    hello, which enrolment needs, wrote it), or has job records or queued updates. Not the
    device key alone: `edge-agent init` makes it before the device was ever enrolled, and
    nothing can be sent to a device before its first hello (so there is nothing to replay)."""
    def has_entries(sub: str) -> bool:
        try:
            return any(True for _ in (state_dir / sub).iterdir())
        except OSError:
            return False

    return (state_dir / "keys" / "seq").exists() or has_entries("jobs") or has_entries("outbox")


def round_pct(value: float) -> float:
    return round(min(100.0, max(0.0, float(value))), 2)
