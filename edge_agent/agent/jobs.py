"""The fine-tune job lifecycle: an enum, ONE transition table, and a crash-safe store.

Every transition is persisted before the step it starts (Mender's rule), so a daemon that
restarts after a brown-out knows exactly where each job was. Each state also counts how
often it was entered: a job that re-enters TRAINING again and again is most likely what
is browning the device out, so past a limit it fails instead of looping forever.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from ..atomic import CorruptFileError, fsync_dir, read_checked, write_checked
from ..errors import InputError


class JobState(StrEnum):
    ACCEPTED = "accepted"
    WAITING_FOR_POWER = "waiting-for-power"
    PREPARING = "preparing"
    TRAINING = "training"
    PAUSED = "paused"
    UPLOADING = "uploading"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (JobState.DONE, JobState.FAILED, JobState.CANCELLED)


S = JobState
# The one table that says which step may follow which. Anything else is a bug, not a state.
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    S.ACCEPTED: frozenset({S.WAITING_FOR_POWER, S.PREPARING, S.CANCELLED, S.FAILED}),
    S.WAITING_FOR_POWER: frozenset({S.PREPARING, S.CANCELLED, S.FAILED}),
    S.PREPARING: frozenset({S.TRAINING, S.WAITING_FOR_POWER, S.CANCELLED, S.FAILED}),
    S.TRAINING: frozenset({S.PAUSED, S.UPLOADING, S.CANCELLED, S.FAILED}),
    S.PAUSED: frozenset({S.TRAINING, S.CANCELLED, S.FAILED}),
    S.UPLOADING: frozenset({S.DONE, S.CANCELLED, S.FAILED}),
    S.DONE: frozenset(),
    S.FAILED: frozenset(),
    S.CANCELLED: frozenset(),
}
# States re-entered on every restart; past this many entries the job fails.
MAX_REENTRIES = 6
_REENTRANT = (S.PREPARING, S.TRAINING)
MAX_JOB_BYTES = 256 * 1024
MAX_HISTORY = 200
DAY_S = 86400.0
KEEP_RECORDS = 500  # finished jobs kept: three weeks of hourly rounds, ~1 MB
KEEP_DAYS = 30.0


class IllegalTransition(RuntimeError):
    pass


@dataclass
class Job:
    job_id: str
    round: int
    model: str  # "name@version"
    params: dict[str, Any] = field(default_factory=dict)  # budget, epochs, ... from the command
    state: JobState = JobState.ACCEPTED
    reason: str = ""  # why it is in this state (pause reason, failure message, stop reason)
    entries: dict[str, int] = field(default_factory=dict)
    history: list[tuple[float, str, str]] = field(default_factory=list)
    created: float = field(default_factory=time.time)
    result: dict[str, Any] = field(default_factory=dict)  # the fine-tune report once trained

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["state"] = self.state.value
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Job:
        try:
            job = cls(
                job_id=str(data["job_id"]), round=int(data["round"]), model=str(data["model"]),
                params=dict(data.get("params", {})), state=JobState(data["state"]),
                reason=str(data.get("reason", "")),
                entries={str(k): int(v) for k, v in data.get("entries", {}).items()},
                history=[(float(t), str(s), str(r)) for t, s, r in data.get("history", [])],
                created=float(data.get("created", 0.0)), result=dict(data.get("result", {})),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"job record is malformed: {exc}") from exc
        return job


def transition(job: Job, new: JobState, reason: str = "", *, now: float | None = None) -> Job:
    """Apply one step of the table (pure: the caller persists)."""
    if new not in TRANSITIONS[job.state]:
        raise IllegalTransition(f"job {job.job_id}: {job.state.value} -> {new.value} is not allowed")
    job.entries[new.value] = job.entries.get(new.value, 0) + 1
    job.state = new
    job.reason = reason
    job.history.append((time.time() if now is None else now, new.value, reason[:500]))
    del job.history[:-MAX_HISTORY]
    return job


@dataclass(frozen=True)
class JobEntry:
    """What the store's index keeps of a job: enough for the daily-limit count, the active
    list and pruning, without reading the record again."""

    job_id: str
    created: float
    state: JobState
    updated: float  # when it last changed state (a finished job's age counts from here)


def _entry(job: Job) -> JobEntry:
    return JobEntry(job.job_id, job.created, job.state, job.history[-1][0] if job.history else job.created)


LEDGER_FILE = "pruned-today.json"


class JobStore:
    """One checksummed file per job under `<state_dir>/jobs/`; corrupt files are quarantined.

    An in-memory index (one scan of the directory, at first use) answers `entries()` for
    every command, so a finetune command costs the same after a year as on day one. Finished
    jobs are pruned as they finish: a record is kept while it is among the newest
    `keep_records` finished ones and younger than `keep_days`. What the daily job limit
    needs of a pruned job under a day old -- its id, creation time and final state -- stays
    in a small ledger (`pruned-today.json`, written before the record is deleted), so the
    records on disk and in memory are bounded by `keep_records` however many jobs a day the
    policy allows."""

    def __init__(self, directory: str | Path, *, keep_records: int = KEEP_RECORDS,
                 keep_days: float = KEEP_DAYS) -> None:
        if keep_records < 1 or not keep_days > 0:
            raise ValueError("keep_records must be >= 1 and keep_days > 0")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.keep_records, self.keep_days = keep_records, keep_days
        self.quarantined: list[str] = []
        self.pruned = 0
        self._index: dict[str, JobEntry] | None = None
        self._ledger: dict[str, JobEntry] | None = None  # pruned jobs under a day old

    def _path(self, job_id: str) -> Path:
        if not job_id or "/" in job_id or job_id.startswith("."):
            raise InputError(f"unsafe job id {job_id!r}")
        return self.directory / f"{job_id}.job"

    def save(self, job: Job) -> None:
        write_checked(self._path(job.job_id), json.dumps(job.to_json(), sort_keys=True).encode())
        if self._index is not None:
            self._index[job.job_id] = _entry(job)

    def advance(self, job: Job, new: JobState, reason: str = "", *, restart: bool = True) -> Job:
        """Transition and persist before returning, so the next step starts from disk truth.
        A job re-entering PREPARING/TRAINING too often (a reboot loop) fails instead;
        `restart=False` (the governor resuming after a pause) is recorded but not counted."""
        transition(job, new, reason)
        if not restart:
            job.entries[new.value] -= 1
        elif new in _REENTRANT and job.entries[new.value] > MAX_REENTRIES:
            transition(job, JobState.FAILED,
                       f"entered {new.value} {job.entries[new.value]} times: likely a brown-out "
                       "reboot loop; giving up")
        self.save(job)
        if job.state.terminal:
            self.prune()
        return job

    def load(self, job_id: str) -> Job:
        return Job.from_json(json.loads(read_checked(self._path(job_id), MAX_JOB_BYTES)))

    def all(self) -> list[Job]:
        """Every readable job (reads every record: for start-up and tools, not per command);
        unreadable ones are renamed *.corrupt and listed in quarantined."""
        jobs = []
        for path in sorted(self.directory.glob("*.job")):
            try:
                jobs.append(Job.from_json(json.loads(read_checked(path, MAX_JOB_BYTES))))
            except (CorruptFileError, InputError, ValueError, OSError) as exc:
                with contextlib.suppress(OSError):
                    path.rename(path.with_suffix(".corrupt"))
                self.quarantined.append(f"{path.name}: {exc}")
        jobs.sort(key=lambda j: j.created)
        self._index = {j.job_id: _entry(j) for j in jobs}
        return jobs

    def entries(self) -> list[JobEntry]:
        """Every job as the index knows it, oldest first (the directory is read once)."""
        if self._index is None:
            self.all()
        assert self._index is not None
        return sorted(self._index.values(), key=lambda e: e.created)

    def active(self) -> list[Job]:
        return [self.load(e.job_id) for e in self.entries() if not e.state.terminal]

    def pruned_today(self, *, now: float | None = None) -> list[JobEntry]:
        """Jobs whose records were pruned though created in the last 24 h (the daily limit's)."""
        now = time.time() if now is None else now
        return [e for e in self._read_ledger().values() if e.created >= now - DAY_S]

    def _read_ledger(self) -> dict[str, JobEntry]:
        if self._ledger is None:
            self._ledger = {}
            try:
                raw = json.loads(read_checked(self.directory / LEDGER_FILE, MAX_JOB_BYTES))
                for job_id, (created, state) in dict(raw).items():
                    self._ledger[str(job_id)] = JobEntry(str(job_id), float(created), JobState(state), float(created))
            except FileNotFoundError:
                pass
            except (CorruptFileError, InputError, ValueError, TypeError, OSError) as exc:
                # losing it only lets today's limit count fewer jobs: say so, start afresh
                self.quarantined.append(f"{LEDGER_FILE}: {exc}")
        return self._ledger

    def prune(self, *, now: float | None = None) -> list[str]:
        """Delete finished jobs' records past the retention (see the class); returns their ids."""
        now = time.time() if now is None else now
        finished = sorted((e for e in self.entries() if e.state.terminal), key=lambda e: e.updated, reverse=True)
        doomed = [e for i, e in enumerate(finished)
                  if i >= self.keep_records or e.updated < now - self.keep_days * DAY_S]
        ledger = {k: e for k, e in self._read_ledger().items() if e.created >= now - DAY_S}
        ledger.update({e.job_id: e for e in doomed if e.created >= now - DAY_S})
        if ledger != self._ledger:  # before any record goes: a crash never forgets a counted job
            write_checked(self.directory / LEDGER_FILE, json.dumps(
                {k: [e.created, e.state.value] for k, e in ledger.items()}, sort_keys=True).encode())
            self._ledger = ledger
        for e in doomed:
            with contextlib.suppress(FileNotFoundError):
                self._path(e.job_id).unlink()
            assert self._index is not None
            self._index.pop(e.job_id, None)
        if doomed:
            self.pruned += len(doomed)
            fsync_dir(self.directory)
        return [e.job_id for e in doomed]
