"""Retention: what the coordinator keeps of its model versions and received updates.

A fleet that trains every hour makes 8,760 versions a year. Each keeps a head file
(`models/<name>/<version>/head.*.npz`), a head patch (`bundles/<name>/<version>.head.tar.gz`),
maybe a full archive, and retained messages on the broker (manifest + chunks of each);
each round also stores its devices' update payloads (`updates/<job>/r<n>/...`). Retention
keeps the versions that matter and prunes the rest:

    kept  current   the newest version of each model, the versions active jobs start from
                    or train now (an open round's base, a running job's latest, the versions
                    an asynchronous job's devices in flight still train)
          in use    every version a device reports running (its state's `models`)
          tagged    registered bundles (the roots head-only versions are built on) and the
                    versions listed in `<state>/retention/tags.json` (`prune --tag`)
          last N    the newest `keep_versions` versions of each model
    pruned          every other version: its head file, patch, archive and sha256 side
                    file are deleted, its retained messages are retracted from the broker,
                    and its registry row is marked `pruned_at` (the row stays: it is the
                    lineage other rows name, a few hundred bytes)
    updates         the payload files of rounds that ended more than `keep_update_days`
                    ago (at once for updates the screening rejected) are deleted and their
                    row's file reference cleared; once the job has finished, those rounds'
                    update and participant rows go too, except each device's newest 10
                    accepted updates (the screening's history). Job, round and version rows
                    stay. An open or closing round's files are never touched (rounds.py
                    rebuilds its sums from them after a restart).
    learning        a finished job's server-optimiser state (`learning/<job>/`: moments,
                    the plateau history its report shows) once its last round ended more
                    than `keep_update_days` ago -- except the newest RECENT_JOBS jobs',
                    which `models rollback --to-best JOB` reads

`plan()` decides and is side-effect free (`edge-coordinator prune` prints it: a dry run
by default); `apply()` carries a plan out: it queues the retractions first (durable, in
`retention/retract.json`, so a crash never forgets a retained message), then deletes the
files, then marks the rows. The serving coordinator empties that queue whenever it is
connected (`RetractQueue.drain`), so `prune --apply` from the CLI works while `serve`
runs. Defaults are sized for a year unattended (RetentionPolicy).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..atomic import atomic_write_json, read_limited
from ..errors import InputError
from ..protocol.topics import patch_version
from .records import ModelVersion, check_id
from .registry import Registry

log = logging.getLogger(__name__)
DIR = "retention"
RETRACT_FILE = "retract.json"
TAGS_FILE = "tags.json"
DAY_S = 86400.0
MAX_QUEUE = 100_000
KEEP_DEVICE_UPDATES = 10  # each device's newest accepted update rows (the screening's history)
RECENT_JOBS = 5  # finished jobs whose best version stays (for `models rollback --to-best JOB`)
ENDED = ("aggregated", "failed", "cancelled")


@dataclass(frozen=True, kw_only=True)
class RetentionPolicy:
    """Defaults for a year unattended: with hourly rounds, a day of versions on disk and on
    the broker (~24 x (head + 2.4 KB patch)), a month of received updates (~30 x 24 x the
    devices' compressed updates), and a check every 10 minutes."""

    keep_versions: int = 24  # newest versions of each model kept, whatever else
    keep_update_days: float = 30.0  # received update payloads of rounds ended within this
    interval_s: float = 600.0  # serve: apply at most this often (0: never automatically)

    def __post_init__(self) -> None:
        if not 1 <= self.keep_versions <= 1_000_000:
            raise ValueError(f"keep_versions must be 1..1000000, got {self.keep_versions}")
        if not 0 <= self.keep_update_days <= 36500:
            raise ValueError(f"keep_update_days must be 0..36500, got {self.keep_update_days}")
        if not 0 <= self.interval_s <= 30 * DAY_S:
            raise ValueError(f"interval_s must be 0..30 days, got {self.interval_s}")


@dataclass
class VersionPrune:
    name: str
    version: str
    files: list[tuple[Path, int]]  # what is deleted, and its size
    retract: list[tuple[str, int]]  # (publication id: version or version.head, chunk count)


@dataclass
class PrunePlan:
    kept: dict[tuple[str, str], list[str]] = field(default_factory=dict)  # (name, version) -> why
    versions: list[VersionPrune] = field(default_factory=list)
    updates: list[tuple[int, Path, int]] = field(default_factory=list)  # (row id, file, size)
    update_rows: list[int] = field(default_factory=list)  # rows of finished jobs' old rounds
    participant_rows: list[tuple[str, int]] = field(default_factory=list)  # (job, round)
    learning: list[tuple[str, Path, int]] = field(default_factory=list)  # (job, learning/<job>, size)

    @property
    def bytes(self) -> int:
        return (sum(s for v in self.versions for _, s in v.files) + sum(s for _, _, s in self.updates)
                + sum(s for _, _, s in self.learning))

    def summary(self) -> str:
        return (f"{len(self.versions)} version(s) and {len(self.updates)} update file(s), "
                f"{self.bytes} bytes, {len(self.update_rows)} update row(s), {len(self.participant_rows)} "
                f"round(s)' participant rows, {len(self.learning)} finished job(s)' learning state; "
                f"{len(self.kept)} version(s) kept")

    def lines(self) -> list[str]:
        """What `prune` prints: every kept version with why, every deletion with its size."""
        out = [f"keep   {n} {v}: {', '.join(why)}" for (n, v), why in sorted(self.kept.items(), key=_order)]
        for vp in self.versions:
            size = sum(s for _, s in vp.files)
            out.append(f"prune  {vp.name} {vp.version}: {len(vp.files)} file(s), {size} bytes; retract "
                       + (", ".join(f"{pid} ({c} chunk(s))" for pid, c in vp.retract) or "nothing"))
        for _, path, size in self.updates:
            out.append(f"prune  update {path.name}: {size} bytes")
        if self.update_rows or self.participant_rows:
            out.append(f"prune  {len(self.update_rows)} update row(s) and the participant rows of "
                       f"{len(self.participant_rows)} round(s) of finished jobs")
        for job_id, _, size in self.learning:
            out.append(f"prune  learning state of finished job {job_id}: {size} bytes")
        return out

    def to_json(self) -> dict[str, Any]:
        return {"kept": [{"name": n, "version": v, "why": why} for (n, v), why in sorted(self.kept.items(), key=_order)],
                "versions": [{"name": p.name, "version": p.version, "bytes": sum(s for _, s in p.files),
                              "files": [str(f) for f, _ in p.files], "retract": [pid for pid, _ in p.retract]}
                             for p in self.versions],
                "updates": [{"file": str(p), "bytes": s} for _, p, s in self.updates], "bytes": self.bytes,
                "update_rows": len(self.update_rows), "participant_rows": len(self.participant_rows),
                "learning": [{"job": j, "bytes": s} for j, _, s in self.learning]}


def _order(item: Any) -> Any:
    (name, version), _ = item
    return name, version


# ---------------------------------------------------------------- tags (kept whatever their age)
def _dir(registry: Registry) -> Path:
    return registry.state_dir / DIR


def read_tags(registry: Registry) -> set[tuple[str, str]]:
    path = _dir(registry) / TAGS_FILE
    try:
        raw = json.loads(read_limited(path, 1 << 20))
        return {(str(n), str(v)) for n, v in (t.split("@", 1) for t in raw.get("tags", []) if "@" in t)}
    except FileNotFoundError:
        return set()
    except (OSError, InputError, ValueError, AttributeError) as exc:
        raise InputError(f"{path}: unreadable tag list ({exc}); fix or delete it") from None


def set_tag(registry: Registry, name: str, version: str, *, tagged: bool = True) -> set[tuple[str, str]]:
    """Tag (or untag) a registered version so retention always keeps it."""
    registry.get_model(name, version)  # NotFound for a version that does not exist
    with _locked(registry):
        tags = read_tags(registry)
        (tags.add if tagged else tags.discard)((name, version))
        atomic_write_json(_dir(registry) / TAGS_FILE, {"tags": sorted(f"{n}@{v}" for n, v in tags)})
    return tags


@contextlib.contextmanager
def _locked(registry: Registry) -> Iterator[None]:
    folder = _dir(registry)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


# ---------------------------------------------------------------- deciding
def in_use(registry: Registry) -> dict[tuple[str, str], list[str]]:
    """(name, version) -> the devices whose last state says they run it."""
    out: dict[tuple[str, str], list[str]] = {}
    for dev in registry.list_devices():
        text = dev.state.get("models")
        for item in str(text).split(",") if isinstance(text, str) else ():
            name, sep, version = item.strip().partition("@")
            if sep and name and version:
                out.setdefault((name, version), []).append(dev.id)
    return out


def current(registry: Registry) -> set[tuple[str, str]]:
    """The versions active jobs start from or train now: the start, the open round's base,
    the latest version (not every version a long job made on the way)."""
    found: set[tuple[str, str]] = set()
    with registry.db.read() as db:
        for row in db.execute("SELECT id, model_name, model_version FROM jobs WHERE status IN ('pending', 'running')"):
            found.add((row["model_name"], row["model_version"]))
            for r in db.execute("SELECT base_version, aggregated_version FROM rounds WHERE job_id = ? AND "
                                "(state IN ('open', 'closing') OR number = (SELECT MAX(number) FROM rounds "
                                "WHERE job_id = ? AND aggregated_version IS NOT NULL))", (row["id"], row["id"])):
                found.update((row["model_name"], v) for v in (r["base_version"], r["aggregated_version"]) if v)
            # an asynchronous job's devices in flight still train their origin round's version:
            # their updates decode against it when they arrive (async_rounds.py)
            for r in db.execute("SELECT DISTINCT o.base_version FROM participants p JOIN rounds r ON r.job_id = "
                                "p.job_id AND r.number = p.round JOIN rounds o ON o.job_id = p.job_id AND o.number = "
                                "p.origin WHERE p.job_id = ? AND p.origin IS NOT NULL AND p.status = 'dispatched' AND "
                                "r.state IN ('open', 'closing')", (row["id"],)):
                found.add((row["model_name"], r["base_version"]))
    return found


def best_versions(registry: Registry, recent: int = RECENT_JOBS) -> dict[tuple[str, str], str]:
    """(name, version) -> job, for the best version (plateau.py) of every active job (a stop
    restores it) and of the newest `recent` jobs (`models rollback --to-best JOB`)."""
    from .plateau import job_learning

    with registry.db.read() as db:
        jobs = db.execute("SELECT id, model_name, status FROM jobs ORDER BY created_at DESC").fetchall()
    out: dict[tuple[str, str], str] = {}
    for i, job in enumerate(jobs):
        if i >= recent and job["status"] not in ("pending", "running"):
            continue
        try:
            best = (job_learning(registry.state_dir, job["id"]) or {}).get("best") or {}
        except Exception as exc:  # an unreadable learning file must not stop retention: keep everything of it
            log.warning("retention: job %s: learning state unreadable (%s)", job["id"], exc)
            continue
        if isinstance(best, dict) and isinstance(best.get("version"), str):
            out.setdefault((job["model_name"], best["version"]), job["id"])
    return out


def plan(registry: Registry, policy: RetentionPolicy, *, now: float | None = None,
         chunk_bytes: int = 64 * 1024) -> PrunePlan:
    """What retention would keep and delete now (reads only)."""
    now = time.time() if now is None else now
    result = PrunePlan()
    models = registry.list_models()
    by_name: dict[str, list[ModelVersion]] = {}
    for mv in models:
        by_name.setdefault(mv.name, []).append(mv)
    using, active, tags, best = in_use(registry), current(registry), read_tags(registry), best_versions(registry)
    for name, versions in by_name.items():
        versions.sort(key=lambda m: (m.created_at, m.version))
        live = [m for m in versions if "pruned_at" not in m.metrics]
        newest = {m.version for m in live[-policy.keep_versions:]}
        for mv in live:
            key = (name, mv.version)
            why = [w for w, hit in (("current", mv is live[-1] or key in active),
                                    (f"in use on {len(using.get(key, []))} device(s)", key in using),
                                    ("tagged", key in tags), ("registered bundle", not mv.head_only),
                                    (f"best of job {best.get(key)}", key in best),
                                    (f"last {policy.keep_versions}", mv.version in newest)) if hit]
            if why:
                result.kept[key] = why
            else:
                result.versions.append(_version_files(registry, mv, chunk_bytes))
    result.updates = _update_files(registry, now - policy.keep_update_days * DAY_S)
    result.update_rows, result.participant_rows = _old_rows(registry, now - policy.keep_update_days * DAY_S)
    result.learning = _old_learning(registry, now - policy.keep_update_days * DAY_S)
    return result


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def _version_files(registry: Registry, mv: ModelVersion, chunk_bytes: int) -> VersionPrune:
    from .artefacts import ModelArtefacts

    arts = ModelArtefacts(registry)
    full = arts.archive_path(mv.name, mv.version)
    patch = arts.archive_path(mv.name, patch_version(mv.version)) if len(patch_version(mv.version)) <= 64 else None
    candidates = [registry.db.abs(mv.head_path), full, full.with_suffix(".sha256")]
    if patch is not None:
        candidates.append(patch)
    files = [(p, s) for p in candidates if (s := _size(p)) is not None]
    # the full archive may have been built, published and deleted (archives are built on
    # demand): retract as many chunks as the root bundle's archive would need, plus one
    root = _size(registry.db.abs(mv.bundle_path)) if mv.bundle_path else None
    full_bytes = _size(full) or (int(root * 1.1) if root else chunk_bytes)
    retract = [(mv.version, max(1, math.ceil(full_bytes / chunk_bytes)) + 1)]
    if patch is not None:
        retract.append((patch_version(mv.version), max(1, math.ceil((_size(patch) or chunk_bytes) / chunk_bytes))))
    return VersionPrune(mv.name, mv.version, files, retract)


def _old_rows(registry: Registry, before: float) -> tuple[list[int], list[tuple[str, int]]]:
    """Update and participant rows of finished jobs' rounds that ended before `before` --
    except each device's newest accepted updates, which screening compares new ones with
    (aggregate/rounds: the last 10). Jobs, rounds and version rows stay: the lineage."""
    old = (f"r.state IN ({', '.join('?' * len(ENDED))}) AND COALESCE(r.ended_at, r.started_at) < ? AND "
           "j.status NOT IN ('pending', 'running')")
    with registry.db.read() as db:
        updates = [int(row[0]) for row in db.execute(
            "SELECT u.id FROM updates u JOIN rounds r ON r.job_id = u.job_id AND r.number = u.round "
            f"JOIN jobs j ON j.id = u.job_id WHERE {old} AND u.id NOT IN (SELECT id FROM (SELECT id, ROW_NUMBER() "
            "OVER (PARTITION BY device_id ORDER BY received_at DESC, id DESC) AS n FROM updates "
            f"WHERE status = 'accepted') AS ranked WHERE n <= {KEEP_DEVICE_UPDATES}) ORDER BY u.id", (*ENDED, before))]
        rounds = [(str(row[0]), int(row[1])) for row in db.execute(
            f"SELECT r.job_id, r.number FROM rounds r JOIN jobs j ON j.id = r.job_id WHERE {old} AND EXISTS "
            "(SELECT 1 FROM participants p WHERE p.job_id = r.job_id AND p.round = r.number) "
            "ORDER BY r.started_at", (*ENDED, before))]
    return updates, rounds


def _old_learning(registry: Registry, before: float, recent: int = RECENT_JOBS) -> list[tuple[str, Path, int]]:
    """learning/<job> directories of finished jobs whose last round ended before `before`,
    except the newest `recent` jobs' (their best version stays reachable by rollback)."""
    root = registry.state_dir / "learning"
    if not root.is_dir():
        return []
    with registry.db.read() as db:
        rows = db.execute(
            "SELECT j.id, j.status, MAX(COALESCE(r.ended_at, r.started_at, j.updated_at)) AS last, "
            "ROW_NUMBER() OVER (ORDER BY j.created_at DESC, j.id DESC) AS n FROM jobs j "
            "LEFT JOIN rounds r ON r.job_id = j.id GROUP BY j.id").fetchall()
    out = []
    for row in rows:
        path = root / str(row["id"])
        if (row["n"] > recent and row["status"] not in ("pending", "running")
                and (row["last"] or 0.0) < before and path.is_dir()):
            out.append((str(row["id"]), path, sum(_size(p) or 0 for p in path.iterdir())))
    return out


def _update_files(registry: Registry, before: float) -> list[tuple[int, Path, int]]:
    """Payload files of ended rounds: rejected ones at once, the others once `before` passed."""
    out = []
    with registry.db.read() as db:
        rows = db.execute(
            "SELECT u.id, u.delta_path FROM updates u JOIN rounds r ON r.job_id = u.job_id AND r.number = u.round "
            f"WHERE u.delta_path IS NOT NULL AND r.state IN ({', '.join('?' * len(ENDED))}) "
            "AND (u.status = 'rejected' OR COALESCE(r.ended_at, r.started_at) < ?) ORDER BY u.id",
            (*ENDED, before)).fetchall()
    for row in rows:
        path = registry.db.abs(row["delta_path"])
        out.append((int(row["id"]), path, _size(path) or 0))
    return out


# ---------------------------------------------------------------- doing
def apply(registry: Registry, result: PrunePlan, *, now: float | None = None) -> int:
    """Carry out a plan: queue retractions, delete files, mark rows. Returns bytes freed."""
    now = time.time() if now is None else now
    queue = RetractQueue(registry)
    queue.add([(vp.name, pid, chunks) for vp in result.versions for pid, chunks in vp.retract])
    freed = 0
    for vp in result.versions:
        for path, size in vp.files:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                freed += size
        with contextlib.suppress(OSError):  # the version's own folder, once empty
            (registry.state_dir / "models" / vp.name / vp.version).rmdir()
    for _, path, size in result.updates:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            freed += size
        with contextlib.suppress(OSError):
            path.parent.rmdir()
            path.parent.parent.rmdir()
    for _, path, size in result.learning:
        for child in list(path.iterdir()) if path.is_dir() else []:
            with contextlib.suppress(FileNotFoundError):
                child.unlink()
        with contextlib.suppress(OSError):
            path.rmdir()
            freed += size
    with registry.db.tx() as db:
        for vp in result.versions:
            row = db.execute("SELECT metrics FROM model_versions WHERE name = ? AND version = ?",
                             (vp.name, vp.version)).fetchone()
            if row is not None:
                metrics = {**json.loads(row["metrics"]), "pruned_at": round(now, 3)}
                db.execute("UPDATE model_versions SET metrics = ? WHERE name = ? AND version = ?",
                           (json.dumps(metrics, sort_keys=True), vp.name, vp.version))
        db.executemany("UPDATE updates SET delta_path = NULL WHERE id = ?", [(i,) for i, _, _ in result.updates])
        db.executemany("DELETE FROM updates WHERE id = ?", [(i,) for i in result.update_rows])
        db.executemany("DELETE FROM participants WHERE job_id = ? AND round = ?", result.participant_rows)
    if result.versions or result.updates or result.update_rows or result.participant_rows or result.learning:
        log.info("retention: pruned %s (%d bytes freed)", result.summary(), freed)
    return freed


class RetractQueue:
    """Retained publications still to be cleared from the broker (a crash-safe JSON list)."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.path = _dir(registry) / RETRACT_FILE

    def _read(self) -> list[tuple[str, str, int]]:
        try:
            raw = json.loads(read_limited(self.path, 64 << 20))
            return [(check_id(str(n), "model name"), str(v), int(c)) for n, v, c in raw.get("pending", [])]
        except FileNotFoundError:
            return []
        except (OSError, InputError, ValueError, TypeError, AttributeError) as exc:
            log.error("%s: unreadable retraction queue (%s); starting a new one", self.path, exc)
            return []

    def pending(self) -> list[tuple[str, str, int]]:
        with _locked(self.registry):
            return self._read()

    def add(self, items: list[tuple[str, str, int]]) -> None:
        if not items:
            return
        with _locked(self.registry):
            queued = self._read()
            have = {(n, v) for n, v, _ in queued}
            queued += [i for i in items if (i[0], i[1]) not in have]
            atomic_write_json(self.path, {"pending": [list(i) for i in queued[-MAX_QUEUE:]]})

    def drain(self, retract: Callable[[str, str, int], None], *, limit: int = 50) -> int:
        """Retract up to `limit` queued publications (`retract(name, pid, chunks)` raises on a
        broker failure: the rest stay queued). Returns how many were cleared."""
        done: list[tuple[str, str, int]] = []
        try:
            for item in self.pending()[:limit]:
                retract(*item)
                done.append(item)
        finally:
            if done:
                with _locked(self.registry):
                    left = [i for i in self._read() if i not in done]
                    atomic_write_json(self.path, {"pending": [list(i) for i in left]})
        return len(done)


def truncate_wal(registry: Registry) -> None:
    """Fold SQLite's write-ahead log into the database and cut the file back to zero: every
    state message is a write, and the WAL otherwise stays at its high-water mark (~4 MB).
    Nothing to do on PostgreSQL (its server recycles its own WAL)."""
    import sqlite3

    if registry.dialect != "sqlite":
        return
    try:
        with registry.db.lock:
            registry.db.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    except sqlite3.Error as exc:  # a reader holding a snapshot: the next run does it
        log.debug("wal checkpoint: %s", exc)


def needs_full(registry: Registry, name: str, devices: list[str]) -> bool:
    """Whether any of `devices` runs no version of `name` (so a head patch cannot reach it)."""
    for device in devices:
        try:
            text = registry.get_device(device).state.get("models")
        except InputError:
            return True
        if not isinstance(text, str) or not any(item.strip().startswith(f"{name}@") for item in text.split(",")):
            return True
    return False


class AutoPrune:
    """The serving coordinator's retention: `step()` every tick applies the policy when it is
    due (at most every `interval_s`) and retracts what is queued while the broker is there."""

    def __init__(self, registry: Registry, policy: RetentionPolicy, *, chunk_bytes: int = 64 * 1024,
                 first_after_s: float = 60.0) -> None:
        self.registry, self.policy, self.chunk_bytes = registry, policy, chunk_bytes
        self.queue = RetractQueue(registry)
        self._due = time.monotonic() + min(first_after_s, policy.interval_s)
        self._queued = self.queue.path.exists()  # (the CLI's prune --apply adds to it too: seen at the next run)

    def step(self, retract: Callable[[str, str, int], None]) -> list[VersionPrune]:
        pruned: list[VersionPrune] = []
        if self.policy.interval_s > 0 and time.monotonic() >= self._due:
            self._due = time.monotonic() + self.policy.interval_s
            result = plan(self.registry, self.policy, chunk_bytes=self.chunk_bytes)
            if result.versions or result.updates or result.update_rows or result.participant_rows or result.learning:
                apply(self.registry, result)
                pruned = result.versions
            truncate_wal(self.registry)
            self._queued = self.queue.path.exists()
        if self._queued:
            self.queue.drain(retract)
            self._queued = bool(self.queue.pending())
        return pruned


# ---------------------------------------------------------------- serve's options (and prune's)
def add_retention_args(p: Any, *, serve: bool = False) -> None:
    d = RetentionPolicy()
    p.add_argument("--keep-versions", type=int, default=d.keep_versions, metavar="N",
                   help=f"newest versions of each model always kept (default {d.keep_versions})")
    p.add_argument("--keep-update-days", type=float, default=d.keep_update_days, metavar="DAYS",
                   help=f"keep received update payloads of rounds ended within this (default {d.keep_update_days:g})")
    if serve:
        p.add_argument("--prune-every", type=float, default=d.interval_s, metavar="S",
                       help=f"apply the retention policy every S seconds (default {d.interval_s:g}; 0: never)")


def policy_from_args(args: Any) -> RetentionPolicy:
    from ..errors import UsageError

    try:
        return RetentionPolicy(keep_versions=args.keep_versions, keep_update_days=args.keep_update_days,
                               interval_s=getattr(args, "prune_every", RetentionPolicy().interval_s))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
