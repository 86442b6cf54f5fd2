"""The registry's record types, state machines and input validators (no SQL, no I/O).

Each lifecycle is an enum plus ONE transition table (DESIGN.md):

    job:          pending -> running -> done | failed ; pending|running -> cancelled | failed
    round:        open -> closing -> aggregated | failed ; open|closing -> cancelled | failed
    participant:  selected -> dispatched -> reported ; selected|dispatched -> dropped
    update:       pending (stored, not yet screened) -> accepted | rejected

A dropped participant is data, not an error: its reason ("no_update", "not_dispatched",
"refused:battery_low", "dispatch_failed", ...) is kept and listed by `RoundRecord.dropouts`.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
import re
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np

from ..atomic import CorruptFileError
from ..errors import InputError
from ..keys import fingerprint, public_key_from_bytes
from ..protocol.schema import ID_RE


class NotFound(InputError):
    """A device, job, round, update or model version that the registry does not hold."""


class IllegalTransition(InputError):
    """A state change that the transition table does not allow (e.g. cancelling a done job)."""


class JobStatus(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (JobStatus.DONE, JobStatus.FAILED, JobStatus.CANCELLED)


class RoundState(StrEnum):
    OPEN = "open"  # dispatched, collecting updates
    CLOSING = "closing"  # no more updates; screening and aggregating (resumed after a crash)
    AGGREGATED = "aggregated"
    FAILED = "failed"
    CANCELLED = "cancelled"


class ParticipantStatus(StrEnum):
    SELECTED = "selected"
    DISPATCHED = "dispatched"
    REPORTED = "reported"
    DROPPED = "dropped"


class UpdateStatus(StrEnum):
    PENDING = "pending"
    ACCEPTED = "accepted"
    REJECTED = "rejected"


J, R, P = JobStatus, RoundState, ParticipantStatus
JOB_TRANSITIONS: dict[JobStatus, frozenset[JobStatus]] = {
    J.PENDING: frozenset({J.RUNNING, J.CANCELLED, J.FAILED}),
    J.RUNNING: frozenset({J.DONE, J.FAILED, J.CANCELLED}),
    J.DONE: frozenset(), J.FAILED: frozenset(), J.CANCELLED: frozenset(),
}
ROUND_TRANSITIONS: dict[RoundState, frozenset[RoundState]] = {
    R.OPEN: frozenset({R.CLOSING, R.CANCELLED, R.FAILED}),
    R.CLOSING: frozenset({R.AGGREGATED, R.FAILED, R.CANCELLED}),
    R.AGGREGATED: frozenset(), R.FAILED: frozenset(), R.CANCELLED: frozenset(),
}
PARTICIPANT_TRANSITIONS: dict[ParticipantStatus, frozenset[ParticipantStatus]] = {
    P.SELECTED: frozenset({P.DISPATCHED, P.REPORTED, P.DROPPED}),  # an update may beat the dispatch ack
    P.DISPATCHED: frozenset({P.REPORTED, P.DROPPED}),
    P.REPORTED: frozenset(), P.DROPPED: frozenset(),
}

IN_FLIGHT = "in_flight"  # asynchronous rounds: a participant still training when its round closed
MAX_JOB_ID = 48  # version ids "<job>-r<round>" must stay within the 64 of ID_RE
MAX_TAGS = 32
MAX_FLAT_ENTRIES = 64
MAX_ROUNDS = 10_000
MAX_SAMPLES = 1_000_000_000
MAX_DEADLINE_S = 30 * 86400
_HEX64 = re.compile(r"[0-9a-f]{64}")
_PRINTABLE = re.compile(r"[^\x00-\x1f\x7f]*")
_SELECTOR = re.compile(r"all|(tag|board):(" + ID_RE.pattern + ")")


# ---------------------------------------------------------------- validators
def check_id(value: Any, what: str, *, limit: int = 64) -> str:
    if not isinstance(value, str) or not ID_RE.fullmatch(value) or len(value) > limit:
        shown = str(value)[:80] if isinstance(value, str) else type(value).__name__
        raise InputError(f"{what} {shown!r} must be 1-{limit} of [A-Za-z0-9._-], not starting with . _ -")
    return value


def check_text(value: Any, what: str, *, limit: int = 128) -> str:
    if not isinstance(value, str) or len(value) > limit or not _PRINTABLE.fullmatch(value):
        raise InputError(f"{what} must be printable text of at most {limit} characters")
    return value


def check_tags(tags: Sequence[str]) -> list[str]:
    if isinstance(tags, str) or len(tags) > MAX_TAGS:
        raise InputError(f"tags must be a list of at most {MAX_TAGS} tags")
    return sorted({check_id(t, "tag") for t in tags})


def check_time(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise InputError(f"{what} must be a finite, non-negative number of seconds, got {value!r}")
    return float(value)


def check_int(value: Any, what: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or not lo <= value <= hi:
        raise InputError(f"{what} must be an integer in {lo}..{hi}, got {value!r}")
    return int(value)


def check_flat(value: Any, what: str) -> dict[str, Any]:
    """A small flat JSON object: id keys, values None / bool / int / finite float / short text."""
    if not isinstance(value, dict) or len(value) > MAX_FLAT_ENTRIES:
        raise InputError(f"{what} must be an object of at most {MAX_FLAT_ENTRIES} entries")
    for key, item in value.items():
        check_id(key, f"{what} key")
        if isinstance(item, str):
            check_text(item, f"{what}.{key}", limit=256)
        elif isinstance(item, float) and not math.isfinite(item):
            raise InputError(f"{what}.{key} must be finite")
        elif item is not None and not isinstance(item, bool | int | float):
            raise InputError(f"{what}.{key} must be a string, number, boolean or null")
    return value


def check_public_key(device_id: str, public_key: Any) -> None:
    """The key must be base64 of 32 raw Ed25519 bytes and `device_id` its fingerprint."""
    check_id(device_id, "device id")
    try:
        raw = base64.b64decode(public_key, validate=True) if isinstance(public_key, str) else b""
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != 32 or len(public_key) != 44:
        raise InputError(f"device {device_id}: public key must be base64 of a 32-byte Ed25519 key")
    actual = fingerprint(public_key_from_bytes(raw))
    if actual != device_id:
        raise InputError(f"device id {device_id!r} is not its key's fingerprint ({actual})")


def parse_selector(text: Any) -> tuple[str, str]:
    """"all" | "tag:X" | "board:Y" -> (kind, value); InputError otherwise."""
    match = _SELECTOR.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise InputError(f"device selector {str(text)[:80]!r} must be all, tag:NAME or board:NAME")
    return ("all", "") if text == "all" else (match.group(1), match.group(2))


# ---------------------------------------------------------------- arrays on disk
def dump_arrays(arrays: Mapping[str, np.ndarray]) -> bytes:
    """Named numeric arrays -> .npz bytes (order kept; names may hold any characters)."""
    names = list(arrays)
    out: dict[str, np.ndarray] = {"names": np.array(names, dtype=np.str_)}
    for i, name in enumerate(names):
        arr = np.ascontiguousarray(arrays[name])
        if arr.dtype.kind not in "fiu":
            raise InputError(f"array {name!r}: dtype {arr.dtype} is not numeric")
        out[f"t{i}"] = arr
    buf = io.BytesIO()
    np.savez(buf, **out)
    return buf.getvalue()


def load_arrays(data: bytes, *, where: str) -> dict[str, np.ndarray]:
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            names = npz["names"]
            if names.ndim != 1 or names.dtype.kind != "U" or set(npz.files) != {"names"} | {
                    f"t{i}" for i in range(len(names))}:
                raise ValueError("unexpected layout")
            return {str(n): npz[f"t{i}"] for i, n in enumerate(names)}
    except (ValueError, KeyError, OSError, zipfile.BadZipFile, EOFError) as exc:
        raise CorruptFileError(f"{where}: not an array file written by the registry ({exc})") from None


# ---------------------------------------------------------------- records
@dataclass(frozen=True)
class Device:
    id: str
    fleet: str
    public_key: str  # base64 of the raw 32-byte Ed25519 key
    enrolled_at: float
    approved: bool
    tags: tuple[str, ...]
    board: str
    profile: str
    engine: str
    state: dict[str, Any]  # last reported state, merged: battery_pct, on_power, energy_wh, status...
    last_seen: float | None
    online: bool
    strikes: int = 0  # updates screened out recently (robust.py); an accepted one takes one off
    quarantined_at: float | None = None  # excluded from selection until released
    quarantine_reason: str = ""

    @classmethod
    def from_row(cls, row: Any) -> Device:
        keys = row.keys()
        return cls(row["id"], row["fleet"], row["public_key"], row["enrolled_at"], bool(row["approved"]),
                   tuple(json.loads(row["tags"])), row["board"], row["profile"], row["engine"],
                   json.loads(row["state"]), row["last_seen"], bool(row["online"]),
                   row["strikes"] if "strikes" in keys else 0,
                   row["quarantined_at"] if "quarantined_at" in keys else None,
                   row["quarantine_reason"] if "quarantine_reason" in keys else "")

    @property
    def quarantined(self) -> bool:
        return self.quarantined_at is not None

    def _num(self, key: str) -> float | None:
        v = self.state.get(key)
        return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None

    @property
    def battery_pct(self) -> float | None:
        return self._num("battery_pct")

    @property
    def energy_wh(self) -> float | None:
        """Energy the device says it has available (battery charge, solar forecast)."""
        return self._num("energy_wh")

    @property
    def on_power(self) -> bool | None:
        v = self.state.get("on_power")
        return v if isinstance(v, bool) else None

    def is_online(self, now: float, within_s: float) -> bool:
        return self.online and self.last_seen is not None and now - self.last_seen <= within_s


@dataclass(frozen=True)
class Job:
    id: str
    model_name: str
    model_version: str  # the version the first round starts from
    selector: str  # all | tag:X | board:Y
    params: dict[str, Any]  # budget_wh, aggregator, trim_fraction, devices_per_round, device params...
    rounds: int
    min_devices: int
    deadline_s: float  # per round
    status: JobStatus
    reason: str
    created_at: float
    updated_at: float
    waiting_since: float | None = None  # waiting for enough eligible devices since

    def validate(self) -> None:
        check_id(self.id, "job id", limit=MAX_JOB_ID)
        check_id(self.model_name, "model name")
        check_id(self.model_version, "model version")
        parse_selector(self.selector)
        check_flat(self.params, "job params")
        check_int(self.rounds, "rounds", 1, MAX_ROUNDS)
        check_int(self.min_devices, "min devices", 1, 1_000_000)
        if check_time(self.deadline_s, "deadline") <= 0 or self.deadline_s > MAX_DEADLINE_S:
            raise InputError(f"deadline must be in (0, {MAX_DEADLINE_S}] seconds, got {self.deadline_s}")

    @classmethod
    def from_row(cls, row: Any) -> Job:
        return cls(row["id"], row["model_name"], row["model_version"], row["selector"], json.loads(row["params"]),
                   row["rounds"], row["min_devices"], row["deadline_s"], JobStatus(row["status"]), row["reason"],
                   row["created_at"], row["updated_at"], row["waiting_since"])

    @property
    def budget_wh(self) -> float | None:
        v = self.params.get("budget_wh")
        return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


@dataclass(frozen=True)
class Participant:
    device_id: str
    status: ParticipantStatus
    reason: str
    dispatched_at: float | None
    origin: int | None = None  # asynchronous jobs: carried in from this round, still training its version

    @classmethod
    def from_row(cls, row: Any) -> Participant:
        return cls(row["device_id"], ParticipantStatus(row["status"]), row["reason"], row["dispatched_at"],
                   row["origin"])


@dataclass(frozen=True)
class RoundRecord:
    job_id: str
    number: int
    state: RoundState
    base_version: str
    started_at: float
    deadline_at: float
    ended_at: float | None
    aggregated_version: str | None
    reason: str
    participants: dict[str, Participant] = field(default_factory=dict)

    @classmethod
    def from_row(cls, row: Any, participants: list[Participant]) -> RoundRecord:
        return cls(row["job_id"], row["number"], RoundState(row["state"]), row["base_version"], row["started_at"],
                   row["deadline_at"], row["ended_at"], row["aggregated_version"], row["reason"],
                   {p.device_id: p for p in participants})

    @property
    def selected(self) -> list[str]:
        return sorted(self.participants)

    def with_status(self, *status: ParticipantStatus) -> list[str]:
        return sorted(d for d, p in self.participants.items() if p.status in status)

    @property
    def dropouts(self) -> dict[str, str]:
        """device id -> why it dropped out (no update by the deadline, refused, not dispatched...);
        an asynchronous job's devices still training when the round closed are not dropouts."""
        return {d: p.reason for d, p in sorted(self.participants.items())
                if p.status is ParticipantStatus.DROPPED and not p.reason.startswith(IN_FLIGHT)}

    @property
    def in_flight(self) -> list[str]:
        """An asynchronous round's devices still training when it closed (carried to the next)."""
        return sorted(d for d, p in self.participants.items()
                      if p.status is ParticipantStatus.DROPPED and p.reason.startswith(IN_FLIGHT))

    @property
    def carried_in(self) -> list[str]:
        """Devices this round took over from earlier ones, still training their older version."""
        return sorted(d for d, p in self.participants.items() if p.origin is not None)

    @property
    def settled(self) -> bool:
        """Every selected device has reported or dropped out: nothing more to wait for."""
        return all(p.status in (ParticipantStatus.REPORTED, ParticipantStatus.DROPPED)
                   for p in self.participants.values())


@dataclass(frozen=True)
class UpdateRecord:
    job_id: str
    device_id: str
    round: int
    num_samples: int
    wire_bytes: int
    fp32_bytes: int
    sha256: str  # of the wire payload (what the device signed)
    received_at: float
    status: UpdateStatus
    reason: str
    delta_path: str | None  # relative to the state dir: the payload as received (.eaup; legacy: .npz)
    energy_wh: float | None
    metrics: dict[str, Any]
    norm: float | None = None  # L2 norm of the decoded delta (None: a legacy row)
    weight: float | None = None  # num_samples after the device / job caps at arrival
    kept: int | None = None  # non-zero entries of the decoded delta
    direction: float | None = None  # cosine with the job's previous published step (None: no such step)

    def validate(self) -> None:
        check_id(self.job_id, "job id", limit=MAX_JOB_ID)
        check_id(self.device_id, "device id")
        check_int(self.round, "round", 0, (1 << 32) - 1)
        check_int(self.num_samples, "num_samples", 0, MAX_SAMPLES)
        check_int(self.wire_bytes, "wire_bytes", 0, 1 << 40)
        check_int(self.fp32_bytes, "fp32_bytes", 0, 1 << 40)
        if not isinstance(self.sha256, str) or not _HEX64.fullmatch(self.sha256):
            raise InputError("update sha256 must be 64 lower-case hex digits")
        if self.energy_wh is not None:
            check_time(self.energy_wh, "energy_wh")

    @classmethod
    def from_row(cls, row: Any) -> UpdateRecord:
        return cls(row["job_id"], row["device_id"], row["round"], row["num_samples"], row["wire_bytes"],
                   row["fp32_bytes"], row["sha256"], row["received_at"], UpdateStatus(row["status"]), row["reason"],
                   row["delta_path"], row["energy_wh"], json.loads(row["metrics"]),
                   *((row["norm"], row["weight"], row["kept"], row["direction"]) if "norm" in row.keys() else ()))  # noqa: SIM118


@dataclass(frozen=True)
class ModelVersion:
    name: str
    version: str
    parent: str | None
    created_at: float
    bundle_path: str | None  # the bundle holding the backbone (inherited while it is unchanged)
    head_path: str  # head parameters (.npz), relative to the state dir
    head_sha256: str
    head_only: bool  # True: only the head changed since `parent`; publish just the head
    metrics: dict[str, Any] = field(default_factory=dict)
    job_id: str | None = None
    round: int | None = None

    @classmethod
    def from_row(cls, row: Any) -> ModelVersion:
        return cls(row["name"], row["version"], row["parent"], row["created_at"], row["bundle_path"],
                   row["head_path"], row["head_sha256"], bool(row["head_only"]), json.loads(row["metrics"]),
                   row["job_id"], row["round"])
