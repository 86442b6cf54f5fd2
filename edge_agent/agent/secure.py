"""A secure job's device side (SecAgg+: updates/secagg.py; the coordinator's side:
coordinator/secure_rounds.py). The job trains as usual; instead of an update, the training
child leaves the dense delta (runner.SECAGG_DELTA), and this module takes the job on:

    begin      advertise fresh keys (`secagg_advert`)     the job is `uploading`
    roster     -> Shamir-share the seed and mask key      (`secagg_shares`)
    inbox      -> clip, noise (the round's share of the DP noise), quantise, mask
                                                           (`secagg_masked`)
    unmask     -> reveal the asked shares                 (`secagg_reveal`): the job is done

Each step's state is written before its message is sent -- `<state dir>/secagg/<job>.json`,
0600, crash-safely (atomic.py: temp, fsync, rename, fsync dir) -- holding the device's round
secrets (X25519 keys, self-mask seed, the shares it holds) and, until it is masked, the delta.
A daemon restarted mid-round loads it and sends its last message again (the coordinator
ignores a repeat), and answers a repeated request with the same answer, so it goes on rather
than drops out. Once it has revealed, the secrets are deleted and only its reveal is kept
(for a repeated unmask request) until the round's end; a round that ends without this device
(`expires_at`: the command's deadline plus four phases) fails the job and deletes the file.

Test hooks (EDGE_AGENT_TEST_HOOKS=1 only): while <state dir>/debug/secagg_drop holds a message
kind (e.g. `secagg_shares`), the device goes silent once it has sent that message, as a device
that lost its link would; while <state dir>/debug/secagg_inputs/ exists, each quantised input
is also written there (raw little-endian uint32, `<job>.u32`), for a test to check the sum.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..atomic import atomic_write_bytes, atomic_write_json, fsync_dir, read_json_object
from ..errors import InputError
from ..keys import Ed25519PrivateKey
from ..protocol import Kind, Message
from .jobs import Job

log = logging.getLogger(__name__)
STATE_DIR = "secagg"
MAX_STATE = 64 << 20
DEFAULT_PHASE_S = 120.0
DROP_FILE = "debug/secagg_drop"
INPUTS_DIR = "debug/secagg_inputs"
ANSWERS = {Kind.SECAGG_ROSTER: Kind.SECAGG_SHARES, Kind.SECAGG_INBOX: Kind.SECAGG_MASKED,
           Kind.SECAGG_UNMASK: Kind.SECAGG_REVEAL}
Send = Callable[[Kind, dict[str, Any]], bool]
Finish = Callable[[str, bool, str], None]  # (job id, ok, reason)


class SecureJobs:
    def __init__(self, *, state_dir: Path, key: Ed25519PrivateKey, send: Send, finish: Finish,
                 hooks: bool = False, clock: Callable[[], float] = time.time) -> None:
        self.dir = Path(state_dir) / STATE_DIR
        self.state_dir, self._key, self._send, self._finish = Path(state_dir), key, send, finish
        self.hooks, self.clock = hooks, clock

    def _path(self, job_id: str) -> Path:
        return self.dir / f"{job_id}.json"

    def _save(self, job_id: str, state: dict[str, Any]) -> None:
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        atomic_write_json(self._path(job_id), state, mode=0o600)

    def _load(self, job_id: str) -> dict[str, Any] | None:
        path = self._path(job_id)
        return read_json_object(path, MAX_STATE, "secure round state") if path.exists() else None

    def _delete(self, job_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(job_id).unlink()
            fsync_dir(self.dir)

    def discard(self, job_id: str) -> None:
        """The job ended another way (cancelled, failed): its round state and secrets go."""
        self._delete(job_id)

    def _emit(self, kind: Kind, body: dict[str, Any]) -> None:
        """Send an answer; a masked input too large for one message goes as its chunks, every
        one of them each time (the coordinator ignores the chunks it already has). The state
        keeps the whole input, so a resend is always the same bytes."""
        if kind is not Kind.SECAGG_MASKED:
            self._send(kind, body)
            return
        import hashlib

        from ..protocol.schema import masked_chunks

        data = base64.b64decode(body["masked"])
        parts = masked_chunks(data)
        if len(parts) == 1:  # the one-message form (an older coordinator knows no chunk fields)
            self._send(kind, body)
            return
        digest = hashlib.sha256(data).hexdigest()
        head = {k: v for k, v in body.items() if k != "masked"}
        for i, part in enumerate(parts):
            if not self._send(kind, {**head, "masked": base64.b64encode(part).decode(), "chunk": i,
                                     "chunks": len(parts), "sha256": digest}):
                break  # (not connected: the next repeated request sends them all again)

    # ---- the job's side
    def begin(self, job: Job, delta: bytes) -> None:
        """Take a trained secure job on: its delta (float64 bytes) kept, keys advertised. Again
        for a job already begun (a restart between saving and the job's `uploading`): a no-op."""
        from ..updates.secagg import SecAggDevice

        if self._load(job.job_id) is not None:
            return
        rid = f"{job.params['job']}/{job.round}"
        device = SecAggDevice(device_key=self._key, round_id=rid)
        advert = device.advertise()
        phase_s = float(job.params.get("secagg_phase_s") or DEFAULT_PHASE_S)
        sent = {"kind": str(Kind.SECAGG_ADVERT), "body": {"job": job.params["job"], "round": job.round,
                                                          "advert": advert}}
        self._save(job.job_id, {"job": job.params["job"], "round": job.round, "device": device.to_json(),
                                "delta": base64.b64encode(delta).decode(), "sent": sent,
                                "expires_at": float(job.params["deadline_at"]) + 4 * phase_s + 60.0})
        self._send(Kind.SECAGG_ADVERT, sent["body"])
        log.info("job %s: secure aggregation: keys advertised", job.job_id)

    def recover(self) -> None:
        """After a restart: every round in progress sends its last message again."""
        for path in sorted(self.dir.glob("*.json")) if self.dir.is_dir() else []:
            try:
                state = read_json_object(path, MAX_STATE, "secure round state")
                if not self._dropped(state) and not state.get("done"):  # (a lost reveal: asked for again)
                    self._emit(Kind(state["sent"]["kind"]), state["sent"]["body"])
            except (InputError, KeyError, TypeError, ValueError) as exc:
                log.error("%s: unusable (%s): removed; that round goes on without this device", path, exc)
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()

    def step(self) -> None:
        """Rounds that ended without this device: the job fails, the file goes."""
        now = self.clock()
        for path in sorted(self.dir.glob("*.json")) if self.dir.is_dir() else []:
            state: Any = None
            try:
                state = read_json_object(path, MAX_STATE, "secure round state")
                expired = now > float(state["expires_at"])
            except (InputError, KeyError, TypeError, ValueError):
                expired = True
            if expired:
                done = isinstance(state, dict) and state.get("done") is True
                self._delete(path.stem)
                if not done:
                    self._finish(path.stem, False, "secure round ended without this device (no unmask request "
                                                   "before its deadline)")

    # ---- the coordinator's requests
    def handle(self, msg: Message) -> None:
        """A verified roster, inbox or unmask request: answered (or answered again)."""
        job_id = f"{msg.body['job']}-r{msg.body['round']}"
        try:
            state = self._load(job_id)
        except InputError as exc:  # damaged (a torn SD card): this round goes on without this device
            log.error("job %s: %s; removed, the round goes on without this device", job_id, exc)
            self._delete(job_id)
            self._finish(job_id, False, f"secure round state unreadable: {exc}"[:300])
            return
        if state is None:
            log.info("job %s: %s for a secure round this device is not in (finished, or never began)", job_id,
                     msg.kind)
            return
        if self._dropped(state):
            return
        want = ANSWERS[msg.kind]
        if state["sent"]["kind"] == str(want):  # asked again (our answer was lost): the same answer
            self._emit(want, state["sent"]["body"])
            return
        if state.get("done"):
            return
        from ..updates.secagg import SecAggDevice, SecAggError

        try:
            device = SecAggDevice.from_json(state["device"], device_key=self._key)
            body = self._answer(job_id, state, device, msg)
        except SecAggError as exc:  # the coordinator's request refused: this device drops out of the round
            log.warning("job %s: secure aggregation: %s refused: %s", job_id, msg.kind, exc)
            return
        state["sent"] = {"kind": str(want), "body": body}
        if want is Kind.SECAGG_REVEAL:  # the round needs nothing more of this device: its secrets go
            state = {k: state[k] for k in ("job", "round", "sent", "expires_at")} | {"done": True}
        else:
            state["device"] = device.to_json()
        self._save(job_id, state)  # before it is sent: a restart sends this again, never a different one
        self._emit(want, body)
        if want is Kind.SECAGG_REVEAL:
            log.info("job %s: secure aggregation: shares revealed", job_id)
            self._finish(job_id, True, "secure aggregation: masked input sent and shares revealed")

    def _answer(self, job_id: str, state: dict[str, Any], device: Any, msg: Message) -> dict[str, Any]:
        from ..updates.secagg import RoundConfig

        b = msg.body
        head = {"job": b["job"], "round": b["round"]}
        if msg.kind is Kind.SECAGG_ROSTER:
            config = RoundConfig.from_json(b["config"])
            return {**head, **device.share_keys({"members": b["members"], "adverts": b["adverts"]}, config)}
        if msg.kind is Kind.SECAGG_INBOX:
            x = self._quantised(job_id, state, device)
            masked = device.masked_input({"shares": b["shares"]}, x)
            state.pop("delta", None)  # masked: the plain delta is no longer needed
            return {**head, "masked": base64.b64encode(masked).decode()}
        return {**head, **device.unmask({"survivors": b["survivors"], "dropped": b["dropped"]})}

    def _quantised(self, job_id: str, state: dict[str, Any], device: Any) -> Any:
        """The delta clipped to the round's C, plus this device's share of the noise, quantised."""
        import numpy as np

        from ..updates.secagg import SecAggError, clip_and_noise

        config = device.config
        delta = np.frombuffer(base64.b64decode(state["delta"]), dtype="<f8")
        if delta.size != config.length:
            raise SecAggError(f"the round masks {config.length} coordinates, this device's delta has {delta.size}")
        x = config.quantiser.quantise(clip_and_noise(delta, config.clip, config.noise_std))
        inputs = self.state_dir / INPUTS_DIR
        if self.hooks and inputs.is_dir():
            atomic_write_bytes(inputs / f"{job_id}.u32", x.astype("<u4").tobytes())
        return x

    def _dropped(self, state: dict[str, Any]) -> bool:
        """The test hook: silent once the message named in debug/secagg_drop was sent."""
        if not self.hooks:
            return False
        try:
            kind = (self.state_dir / DROP_FILE).read_text().strip()
        except OSError:
            return False
        return bool(kind) and state.get("sent", {}).get("kind") == kind

