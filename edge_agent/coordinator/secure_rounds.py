"""Secure aggregation as a round mode (job param `secagg`; `train --secure-aggregation`): the
round engine's part that runs one `SecAggRound` (secagg.py) per open round of a secure job.

    the round opens as any other: selected devices get a finetune command (params secagg)
    advertise   each device trains, then sends `secagg_advert`; the phase closes when every
                selected device advertised or dropped out, or at the round's deadline
                (participants stay dispatched until the round is done: then those in the sum
                are reported, those who advertised and left dropped out, naming the phase)
    share       `secagg_roster` to each advertiser (the round's public config, U0, its own and
                its neighbours' adverts) -> `secagg_shares`
    mask        `secagg_inbox` (the shares addressed to it) -> `secagg_masked`
    unmask      `secagg_unmask` (U2 and U1 - U2 near it) -> `secagg_reveal`
    done        the unmasked SUM is kept; the round is due and RoundCloser turns it into the
                mean (or dp_fedavg's fixed-denominator mean of a noised sum) through the same
                learn / gate / commit steps as any round

Every phase after advertise has its own deadline (`secagg_phase_s`, default 120 s): a device
silent past it is a dropout of that phase (SecAggRound decides what the others then reveal).
A phase also closes as soon as everyone it waits for has answered, and the unmask phase as
soon as every secret the sum needs has its threshold of shares. Devices that have not answered
the current phase are sent its request again every RESEND_S (a restarted agent, a lost message;
in the mask phase, RESEND_S after its last chunk: a masked input over one message arrives in
chunks, kept on disk until all are here -- secure_chunks.py);
a device answers a repeated request with its stored answer, and a second answer is refused here.

State: `<state dir>/secagg/<job>-r<round>.json` (0600), written crash-safely after every
accepted message and every phase change -- a restarted serve resumes the round where it was --
under a flock, and read again when another process wrote it (serve workers sharing the state
dir: whichever takes a device's message).
It holds what SecAggRound holds (adverts, encrypted shares, the running masked sum, revealed
shares) and, once unmasked, the sum: never an individual update.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import logging
import math
import os
import secrets
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic import atomic_write_json, read_json_object
from ..errors import InputError
from ..protocol import Kind
from ..protocol.schema import SECAGG_MAX_CHUNKS, SECAGG_MAX_DEVICES, SECAGG_MAX_LENGTH
from ..updates.secagg import RoundConfig, SecAggError, default_degree, members_bitmap, unb64
from .privacy import DpParams
from .records import Job, ParticipantStatus, RoundRecord
from .secagg import MAX_STATE, SecAggRound
from .secure_chunks import PendingInputs
from .strategies.dp import GaussianSum

log = logging.getLogger("edge_agent.coordinator.rounds")

STATE_DIR = "secagg"
DEFAULT_PHASE_S = 120.0
DEFAULT_CLIP = 10.0  # a non-private secure job's L2 bound (the quantiser's range) without secagg_clip
RESEND_S = 5.0
# A private secure round is planned to survive this share of its selected devices leaving
# before their masked input: each device adds the noise share of the fewest inputs it may
# release with (dp_min_inputs), so any released sum carries at least the noise the privacy
# ledger charged for (a device that drops takes its share with it); fewer inputs: no release.
DP_DROPOUT_TOLERANCE = 0.2


def dp_min_inputs(selected: int, min_devices: int) -> int:
    """The fewest masked inputs a private secure round of `selected` devices releases."""
    return max(min(min_devices, selected), selected - math.ceil(DP_DROPOUT_TOLERANCE * selected))
MIN_DEVICES = 3  # two devices' sum reveals each one's update to the other


def is_secure(params: dict[str, Any]) -> bool:
    return params.get("secagg") is True


def check_secure_params(p: dict[str, Any], *, min_devices: int, asynchronous: bool, length: int | None,
                        fleet: int | None = None) -> None:
    """Refuse a secure job that cannot work (InputError naming why); set its rule: the plain
    mean, or dp_fedavg's fixed-denominator mean for a private job (privacy.py)."""
    if "secagg" in p and not isinstance(p["secagg"], bool):
        raise InputError(f"secagg must be true or false, got {p['secagg']!r:.40}")
    if not is_secure(p):
        for key in ("secagg_phase_s", "secagg_clip"):
            if key in p:
                raise InputError(f"{key} is an option of secure jobs (--secure-aggregation)")
        return
    if asynchronous:
        raise InputError("a secure job cannot be asynchronous: every device of a round masks against the same "
                         "round's neighbours (leave --async out)")
    dp = DpParams.of(p)
    allowed = ("dp_fedavg",) if dp is not None else ("fedavg",)
    if p.get("aggregator") not in (None, "", *allowed):
        raise InputError(f"a secure job aggregates with the plain mean ({'dp_fedavg' if dp else 'fedavg'}): the "
                         f"coordinator sees only the sum, so {p['aggregator']!r} (which needs each update) cannot run; "
                         "leave --aggregator out")
    if min_devices < MIN_DEVICES:
        raise InputError(f"a secure job needs --min-devices >= {MIN_DEVICES} (with two devices the sum reveals "
                         "each one's update to the other)")
    for key, lo, hi in (("secagg_phase_s", 1.0, 86400.0), ("secagg_clip", 1e-9, 1e6)):
        v = p.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | float) or not lo <= v <= hi):
            raise InputError(f"{key} must be a number in [{lo:g}, {hi:g}], got {v!r:.40}")
    if dp is not None and p.get("secagg_clip") is not None:
        raise InputError("a private secure job clips to --dp-clip: leave secagg_clip out")
    per_round = p.get("devices_per_round") or fleet or 0
    if per_round > SECAGG_MAX_DEVICES:  # (the roster lists them all, in one message)
        raise InputError(f"a secure round takes at most {SECAGG_MAX_DEVICES} devices, this one would select "
                         f"{per_round}: give --devices-per-round")
    if length is not None and length > SECAGG_MAX_LENGTH:
        raise InputError(f"a secure job's head has at most {SECAGG_MAX_LENGTH} parameters (its masked input, "
                         f"4 bytes each, travels in at most {SECAGG_MAX_CHUNKS} messages), this one has {length}")
    if not p.get("aggregator"):
        p["aggregator_default"] = "a secure job: the coordinator sees only the sum"
    p["aggregator"] = allowed[0]


@dataclass
class SecureState:
    """One secure round as kept on disk: the SecAggRound, the current phase's deadline and,
    once unmasked, the sum (uint32 mod 2^32: the survivors' quantised updates added)."""

    round: SecAggRound
    deadline: float = 0.0  # the current phase's (after advertise)
    phase_s: float = DEFAULT_PHASE_S
    total: np.ndarray | None = None
    sent: dict[str, tuple[str, float]] = field(default_factory=dict)  # device -> (phase, when): not persisted

    def to_json(self) -> dict[str, Any]:
        return {"round": self.round.to_json(), "deadline": self.deadline, "phase_s": self.phase_s,
                "sum": None if self.total is None else base64.b64encode(self.total.astype("<u4").tobytes()).decode()}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SecureState:
        try:
            r = SecAggRound.from_json(d["round"])
            total = None if d["sum"] is None else np.frombuffer(
                unb64(d["sum"], 4 * r.config.length, "sum"), dtype="<u4").astype(np.uint32)
            return cls(r, float(d["deadline"]), float(d["phase_s"]), total)
        except (KeyError, TypeError, ValueError) as exc:
            raise SecAggError(f"secure round state: {exc!r}"[:300]) from None


Outgoing = tuple[str, Kind, dict[str, Any]]  # (device, kind, body) for its secagg_cmd topic


def _stamp(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


class SecureRounds:
    def __init__(self, *, state_dir: Path, clock: Callable[[], float] = time.time,
                 noise: Callable[[], np.random.Generator] | None = None) -> None:
        self.dir = Path(state_dir) / STATE_DIR
        self.clock = clock
        self._noise = noise or (lambda: np.random.default_rng())  # only device_std is read from it
        self._open: dict[tuple[str, int], SecureState] = {}
        self._stamps: dict[tuple[str, int], tuple[int, int, int]] = {}  # what this process last read or wrote
        # (job, round, device) -> when its last chunk came: not asked again while its chunks arrive
        self._chunk_at: dict[tuple[str, int, str], float] = {}

    def path(self, job_id: str, number: int) -> Path:
        return self.dir / f"{job_id}-r{number}.json"

    def _save(self, job_id: str, number: int, st: SecureState) -> None:
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = self.path(job_id, number)
        atomic_write_json(path, st.to_json(), mode=0o600)
        self._stamps[(job_id, number)] = _stamp(path)

    def load(self, job_id: str, number: int) -> SecureState | None:
        """The round's state: kept in memory, read again when another process (a serve worker
        of the same state dir) wrote it since; None when it was never opened."""
        key, path = (job_id, number), self.path(job_id, number)
        st, stamp = self._open.get(key), _stamp(path)
        if stamp is not None and (st is None or stamp != self._stamps.get(key)):
            fresh = SecureState.from_json(read_json_object(path, MAX_STATE, "secure round state"))
            fresh.sent = st.sent if st is not None else {}
            self._open[key], self._stamps[key], st = fresh, stamp, fresh
        return st

    @contextlib.contextmanager
    def _locked(self, job_id: str, number: int) -> Iterator[None]:
        """One process at a time reads, changes and writes a round's state (flock: released by
        a crash too), so two serve workers never overwrite each other's accepted messages."""
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.dir / f"{job_id}-r{number}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def config(self, job: Job, rnd: RoundRecord, length: int) -> RoundConfig:
        """The round's public parameters: its selected devices, SecAgg+'s degree and threshold,
        a fresh public graph seed, the head's length, the clip and each device's noise share
        (for dp_min_inputs inputs: more noise than needed when none drops, never less)."""
        devices = tuple(sorted(rnd.participants))
        n = len(devices)
        degree = default_degree(n)
        dp = DpParams.of(job.params)
        clip = dp.clip if dp is not None else float(job.params.get("secagg_clip") or DEFAULT_CLIP)
        noise = (GaussianSum(dp.clip, dp.noise, float(n), self._noise).device_std(dp_min_inputs(n, job.min_devices))
                 if dp is not None else 0.0)
        return RoundConfig(round_id=f"{job.id}/{rnd.number}", devices=devices, degree=degree,
                           threshold=min(degree, n - 1) // 2 + 1, graph_seed=secrets.token_hex(16), length=length,
                           clip=clip, noise_std=noise)

    def open(self, job: Job, rnd: RoundRecord, length: int) -> SecureState:
        with self._locked(job.id, rnd.number):
            return self._open_locked(job, rnd, length)

    def _open_locked(self, job: Job, rnd: RoundRecord, length: int) -> SecureState:
        st = self.load(job.id, rnd.number)
        if st is None:
            st = SecureState(SecAggRound(self.config(job, rnd, length)),
                             phase_s=float(job.params.get("secagg_phase_s") or DEFAULT_PHASE_S))
            self._save(job.id, rnd.number, st)
            self._open[(job.id, rnd.number)] = st
        return st

    def pending(self, job_id: str, number: int) -> PendingInputs:
        """The round's masked inputs still arriving in chunks (secure_chunks.py)."""
        return PendingInputs(self.dir / f"{job_id}-r{number}.chunks")

    def forget(self, job_id: str, number: int) -> None:
        """The round ended: its partial masked inputs go (its state file stays, for the record)."""
        self.pending(job_id, number).clear()
        self._open.pop((job_id, number), None)
        for key in [k for k in self._chunk_at if k[:2] == (job_id, number)]:
            del self._chunk_at[key]
        self._stamps.pop((job_id, number), None)  # (its lock file stays: another process may hold it)

    def participants(self, job_id: str, number: int) -> list[tuple[str, ParticipantStatus, str]]:
        """A finished round's participant moves: its survivors reported (their masked input is in
        the sum), the devices that advertised but left it dropped out, naming the phase."""
        st = self.load(job_id, number)
        if st is None:
            return []
        r = st.round
        failed = f" (the secure round failed: {r.reason})"[:300] if r.phase == "failed" else ""
        out = []
        for d in r.adverts:
            if d in r.survivors and not failed:
                out.append((d, ParticipantStatus.REPORTED, "secure aggregation: its masked input is in the sum"))
            elif d in r.masked:
                out.append((d, ParticipantStatus.DROPPED, f"secagg: masked input sent{failed}"))
            elif d in r.shares:
                out.append((d, ParticipantStatus.DROPPED, f"secagg: no masked input after sharing its keys{failed}"))
            else:
                out.append((d, ParticipantStatus.DROPPED, f"secagg: no shares after advertising{failed}"))
        return out

    # ---- the devices' messages
    def receive(self, job_id: str, number: int, sender: str, kind: Kind, body: dict[str, Any]) -> bool:
        """One verified message into its round; True if it was taken (False: a repeat of what
        it already sent, or out of its phase -- logged, nothing changes). InputError when the
        round is not a secure round in progress or the content is refused."""
        with self._locked(job_id, number):
            return self._receive(job_id, number, sender, kind, body)

    def _receive(self, job_id: str, number: int, sender: str, kind: Kind, body: dict[str, Any]) -> bool:
        st = self.load(job_id, number)
        if st is None:
            raise InputError(f"no secure round {job_id} round {number}")
        r = st.round
        try:
            if kind is Kind.SECAGG_ADVERT:
                r.receive_advert(sender, body["advert"])
            elif kind is Kind.SECAGG_SHARES:
                r.receive_shares(sender, {"shares": body["shares"]})
            elif kind is Kind.SECAGG_MASKED:
                data, new = self._masked(job_id, number, r, sender, body)
                if data is None:  # more chunks to come: the round's state is unchanged
                    return new
                r.receive_masked(sender, data)
                self._save(job_id, number, st)
                self.pending(job_id, number).drop(sender)  # (after the save: a crash between keeps the sum)
                return True
            elif kind is Kind.SECAGG_REVEAL:
                r.receive_unmask(sender, {"b": body["b"], "sk": body["sk"]})
            else:
                raise InputError(f"{kind} is not a device's secure aggregation message")
        except SecAggError as exc:
            if "a second" in str(exc) or " in phase " in str(exc):  # a resend after a restart, or late
                log.debug("secure round %s/%d: %s", job_id, number, exc)
                return False
            raise
        self._save(job_id, number, st)
        return True

    def _masked(self, job_id: str, number: int, r: SecAggRound, sender: str,
                body: dict[str, Any]) -> tuple[bytes | None, bool]:
        """A `secagg_masked` message -> (the whole input, or None while chunks are missing;
        whether the message was new). A device's input counts only once all its chunks
        arrived and their SHA-256 matches."""
        data = base64.b64decode(body["masked"], validate=True)
        if "chunks" not in body:  # one message (the first protocol's form)
            return data, True
        if r.phase != "mask" or sender in r.masked:  # late, or a resend of an input already in the sum
            self.pending(job_id, number).drop(sender)
            r.receive_masked(sender, b"")  # (raises the phase's or the repeat's SecAggError)
        if sender not in r.u1:
            raise SecAggError(f"masked input from {sender}, which did not share keys")
        total = 4 + 4 * r.config.length
        self._chunk_at[(job_id, number, sender)] = self.clock()
        if body["chunks"] == 1:
            if hashlib.sha256(data).hexdigest() != body["sha256"]:
                raise InputError("secagg_masked.sha256 does not match the masked input")
            return data, True
        return self.pending(job_id, number).add(sender, total, body["chunk"], body["chunks"], body["sha256"], data)

    # ---- the periodic step
    def step(self, job: Job, rnd: RoundRecord, live: Iterable[str], length: int) -> tuple[bool, list[Outgoing]]:
        """Advance an open secure round: close its phase when everyone answered or its deadline
        passed; (due, messages to send). `live`: selected devices that neither reported nor
        dropped out). Due once done or failed."""
        with self._locked(job.id, rnd.number):
            return self._step(job, rnd, live, length)

    @staticmethod
    def _check_noise_floor(job: Job, r: SecAggRound) -> None:
        """A private round with fewer masked inputs than its devices' noise shares were planned
        for is never unmasked: that sum would carry less noise than the ledger charged for, and
        no party may see it (dp_min_inputs)."""
        if DpParams.of(job.params) is None:
            return
        floor = dp_min_inputs(len(r.config.devices), job.min_devices)
        if len(r.masked) < floor:
            raise SecAggError(f"{len(r.masked)} masked input(s) arrived, fewer than the {floor} each device's noise "
                              "share was planned for: not unmasked (the sum would carry less noise than the privacy "
                              "ledger charged)")

    def _step(self, job: Job, rnd: RoundRecord, live: Iterable[str], length: int) -> tuple[bool, list[Outgoing]]:
        st = self._open_locked(job, rnd, length)
        r, now, live = st.round, self.clock(), set(live)
        before = r.phase
        try:
            if r.phase == "advertise" and (not (live - set(r.adverts)) or now >= rnd.deadline_at):
                r.close_advertise()
            elif r.phase == "share" and (not self._waiting(r) or now >= st.deadline):
                r.close_share()
            elif r.phase == "mask" and (not self._waiting(r) or now >= st.deadline):
                self._check_noise_floor(job, r)
                r.close_mask()
            elif r.phase == "unmask" and (not self._waiting(r) or self._revealed(r) or now >= st.deadline):
                st.total = r.close_unmask()
        except SecAggError as exc:  # SecAggAborted set `failed` with why; anything else fails it too
            if r.phase != "failed":
                r.phase, r.reason = "failed", str(exc)[:500]
        if r.phase != before:
            st.deadline = now + st.phase_s
            st.sent.clear()
            self._save(job.id, rnd.number, st)
            log.info("job %s round %d: secure aggregation %s -> %s%s", job.id, rnd.number, before, r.phase,
                     f" ({r.reason})" if r.phase == "failed" else "")
        if r.phase in ("done", "failed"):
            return True, []
        out = []
        for device in sorted(self._waiting(r)):
            phase, when = st.sent.get(device, ("", float("-inf")))
            chunk_at = self._chunk_at.get((job.id, rnd.number, device), float("-inf"))
            if r.phase == "mask" and now - chunk_at < RESEND_S:
                continue  # still sending its chunks: not asked for them all again yet
            if phase != r.phase or now - when >= RESEND_S:
                out.append((device, *self.request(r, device)))
                st.sent[device] = (r.phase, now)
        return False, out

    @staticmethod
    def _waiting(r: SecAggRound) -> set[str]:
        """Who the current phase still waits for."""
        if r.phase == "share":
            return set(r.adverts) - set(r.shares)
        if r.phase == "mask":
            return set(r.u1) - set(r.masked)
        if r.phase == "unmask":
            return set(r.survivors) - set(r.answers)
        return set()

    @staticmethod
    def _revealed(r: SecAggRound) -> bool:
        """Every secret the sum needs has its threshold of shares (the rest need not answer)."""
        t = r.config.threshold
        return all(sum(j in a[kind] for a in r.answers.values()) >= t
                   for kind, owners in (("b", r.survivors), ("sk", r.dropped)) for j in owners)

    @staticmethod
    def request(r: SecAggRound, device: str) -> tuple[Kind, dict[str, Any]]:
        """The current phase's message to `device` (the same every time it is sent)."""
        job, _, number = r.config.round_id.rpartition("/")
        head = {"job": job, "round": int(number)}
        if r.phase == "share":
            near = sorted((device, *r.graph[device]))
            return Kind.SECAGG_ROSTER, {**head, "config": r.config.to_json(),
                                        "members": members_bitmap(r.adverts, r.config.devices),
                                        "adverts": [r.adverts[x] for x in near]}
        if r.phase == "mask":
            return Kind.SECAGG_INBOX, {**head, "shares": {s: r.shares[s][device] for s in r.u1
                                                          if device in r.shares.get(s, {})}}
        if r.phase == "unmask":
            return Kind.SECAGG_UNMASK, {**head, **r.unmask_request(device)}
        raise SecAggError(f"no request in phase {r.phase}")
