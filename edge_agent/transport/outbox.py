"""Persistent on-disk outbox: chunked updates wait here until the coordinator acks them.

paho's session lives in memory, so a reboot or a long outage would lose an update that
took hours of solar-powered training. An item is the list of opaque chunk payloads for
one (job, device, round) plus a little metadata; it is written whole (temp directory,
every file fsynced and checksummed, then one rename) before `put` returns, and it leaves
only when `ack` or `drop` is called. Its state, persisted at every step:

    pending       chunks [0, next_index) reached the broker in this attempt; due at `due_at`
    awaiting_ack  all chunks reached the broker; if no ack by `due_at`, send it all again

Disk use is bounded (`max_bytes`, `max_items`): `put` raises OutboxFullError rather than
evict anything already accepted. Layout: <dir>/items/<slug>/{meta,NNNNN.chunk}; <dir>/tmp
holds puts that a crash interrupted and is cleared on open.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from ..atomic import CorruptFileError, fsync_dir, read_checked, write_checked
from ..errors import InputError, TransientError
from ..protocol import MAX_BINARY_BYTES, validate_id

log = logging.getLogger(__name__)
MAX_META_BYTES = 64 * 1024
MAX_CHUNKS = 0xFFFF


class OutboxFullError(TransientError):
    """Accepting this item would exceed the outbox's disk or item budget."""


@dataclass(frozen=True, order=True)
class OutboxKey:
    """What the coordinator de-duplicates on."""

    job: str
    device: str
    round: int

    def __post_init__(self) -> None:
        validate_id(self.job, "job id")
        validate_id(self.device, "device id")
        if isinstance(self.round, bool) or not isinstance(self.round, int) or not 0 <= self.round < 1 << 32:
            raise InputError(f"round {self.round!r} must be an integer in 0..2**32-1")

    @property
    def slug(self) -> str:
        return hashlib.sha256(f"{self.job}\0{self.device}\0{self.round}".encode()).hexdigest()[:32]


@dataclass(frozen=True)
class OutboxItem:
    key: OutboxKey
    upload: str  # sha256 over the chunk list: names this exact upload on the wire
    count: int
    nbytes: int
    order: int
    created_at: float
    meta: dict[str, Any]
    state: str = "pending"
    next_index: int = 0
    attempts: int = 0
    due_at: float = 0.0
    last_error: str = ""


def upload_digest(chunks: Sequence[bytes]) -> str:
    """sha256 over the length-prefixed chunks: one id for one exact upload."""
    h = hashlib.sha256(len(chunks).to_bytes(4, "big"))
    for c in chunks:
        h.update(len(c).to_bytes(4, "big"))
        h.update(c)
    return h.hexdigest()


class Outbox:
    """Thread-safe; every state change is on disk before the method returns."""

    def __init__(self, *, directory: str | os.PathLike[str], max_bytes: int = 64 << 20, max_items: int = 256,
                 max_chunk_bytes: int = MAX_BINARY_BYTES, clock: Callable[[], float] = time.time) -> None:
        if max_bytes < 1 or max_items < 1 or max_chunk_bytes < 1:
            raise ValueError("max_bytes, max_items and max_chunk_bytes must be positive")
        self.directory = Path(directory)
        self.max_bytes, self.max_items, self.max_chunk_bytes = max_bytes, max_items, max_chunk_bytes
        self._clock = clock
        self._lock = threading.RLock()
        self._items: dict[OutboxKey, OutboxItem] = {}
        self.dropped_corrupt: list[str] = []  # what could not be recovered at open, for the agent to report
        self._items_dir, self._tmp_dir = self.directory / "items", self.directory / "tmp"
        self._items_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self._tmp_dir, ignore_errors=True)  # interrupted puts: never acknowledged to anyone
        self._tmp_dir.mkdir(parents=True, exist_ok=True)
        self._load()

    def _load(self) -> None:
        for entry in sorted(self._items_dir.iterdir()):
            if not entry.is_dir():
                continue  # not ours (an editor's backup, a stray file): leave it alone
            try:
                raw = json.loads(read_checked(entry / "meta", MAX_META_BYTES))
                raw["key"] = OutboxKey(**raw["key"])
                item = OutboxItem(**raw)
                if item.key.slug != entry.name:
                    raise InputError(f"meta names {item.key}, directory is {entry.name}")
            except (OSError, ValueError, TypeError, KeyError, InputError) as exc:
                self.dropped_corrupt.append(f"{entry.name}: {exc}")
                log.error("outbox: dropping unreadable item %s: %s", entry, exc)
                shutil.rmtree(entry, ignore_errors=True)
                continue
            self._items[item.key] = item

    def _write_meta(self, folder: Path, item: OutboxItem) -> None:
        write_checked(folder / "meta", json.dumps(asdict(item), sort_keys=True).encode())

    # ---- queries ----
    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(i.nbytes for i in self._items.values())

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: OutboxKey) -> OutboxItem | None:
        with self._lock:
            return self._items.get(key)

    def items(self) -> list[OutboxItem]:
        """All items, oldest first."""
        with self._lock:
            return sorted(self._items.values(), key=lambda i: i.order)

    def due(self, now: float | None = None) -> list[OutboxItem]:
        """Items to (re)send now, oldest first: pending ones past `due_at`, and timed-out acks."""
        now = self._clock() if now is None else now
        return [i for i in self.items() if i.due_at <= now]

    def chunk(self, key: OutboxKey, index: int) -> bytes:
        """One chunk, integrity-checked; raises CorruptFileError if the disk mangled it."""
        with self._lock:
            item = self._items.get(key)
            if item is None:
                raise KeyError(key)
            if not 0 <= index < item.count:
                raise IndexError(f"chunk {index} of {item.count}")
            return read_checked(self._items_dir / key.slug / f"{index:05d}.chunk", self.max_chunk_bytes)

    # ---- changes ----
    def put(self, key: OutboxKey, chunks: Sequence[bytes], *, meta: Mapping[str, Any] | None = None) -> OutboxItem:
        """Store an update durably. Idempotent per key: a second put returns the first item."""
        chunks = [bytes(c) for c in chunks]
        if not 1 <= len(chunks) <= MAX_CHUNKS:
            raise InputError(f"an update needs 1..{MAX_CHUNKS} chunks, got {len(chunks)}")
        for i, c in enumerate(chunks):
            if not 0 < len(c) <= self.max_chunk_bytes:
                raise InputError(f"chunk {i} is {len(c)} bytes; chunks must be 1..{self.max_chunk_bytes}")
        meta = dict(meta or {})
        if len(json.dumps(meta)) > MAX_META_BYTES // 2:
            raise InputError("outbox item metadata is too large")
        nbytes = sum(len(c) for c in chunks)
        upload = upload_digest(chunks)
        with self._lock:
            existing = self._items.get(key)
            if existing is not None:
                if existing.upload != upload:
                    log.warning("outbox: %s is already queued as upload %s; keeping it", key, existing.upload[:12])
                return existing
            if len(self._items) >= self.max_items:
                raise OutboxFullError(f"outbox holds {len(self._items)} items, the limit is {self.max_items}")
            if self.used_bytes + nbytes > self.max_bytes:
                raise OutboxFullError(f"outbox: {nbytes} more bytes would exceed {self.max_bytes} "
                                      f"({self.used_bytes} used by {len(self._items)} unacknowledged items)")
            order = max((i.order for i in self._items.values()), default=0) + 1
            item = OutboxItem(key, upload, len(chunks), nbytes, order, self._clock(), meta)
            tmp = Path(tempfile.mkdtemp(dir=self._tmp_dir))
            try:
                for i, c in enumerate(chunks):
                    write_checked(tmp / f"{i:05d}.chunk", c)
                self._write_meta(tmp, item)
                os.replace(tmp, self._items_dir / key.slug)
            except BaseException as exc:
                shutil.rmtree(tmp, ignore_errors=True)
                if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                    raise OutboxFullError(f"outbox: the disk is full ({self.directory})") from exc
                raise
            fsync_dir(self._items_dir)
            self._items[key] = item
            return item

    def _update(self, key: OutboxKey, **changes: Any) -> OutboxItem | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return None  # acked or dropped meanwhile
            item = replace(item, **changes)
            self._write_meta(self._items_dir / key.slug, item)
            self._items[key] = item
            return item

    def mark_progress(self, key: OutboxKey, next_index: int) -> OutboxItem | None:
        """Chunks [0, next_index) reached the broker (a restart resumes from there)."""
        return self._update(key, next_index=next_index, state="pending")

    def mark_sent(self, key: OutboxKey, *, ack_deadline: float) -> OutboxItem | None:
        """Every chunk reached the broker; resend all if no ack arrives by `ack_deadline`."""
        item = self.get(key)
        return self._update(key, state="awaiting_ack", next_index=item.count if item else 0, due_at=ack_deadline)

    def retry_later(self, key: OutboxKey, *, at: float, error: str = "", restart: bool = True) -> OutboxItem | None:
        """Try again at `at`; `restart` resends from chunk 0 (a new attempt)."""
        item = self.get(key)
        if item is None:
            return None
        return self._update(key, state="pending", due_at=at, last_error=error[:500],
                            next_index=0 if restart else item.next_index,
                            attempts=item.attempts + (1 if restart else 0))

    def _remove(self, key: OutboxKey) -> bool:
        with self._lock:
            if self._items.pop(key, None) is None:
                return False
            folder = self._items_dir / key.slug
            # Rename first so a crash mid-delete never leaves a half item that looks whole.
            doomed = self._tmp_dir / f"gone-{key.slug}"
            with contextlib.suppress(FileNotFoundError):
                os.replace(folder, doomed)
                fsync_dir(self._items_dir)
            shutil.rmtree(doomed, ignore_errors=True)
            return True

    def ack(self, key: OutboxKey) -> bool:
        """The coordinator has it: delete. Returns False if it was not queued."""
        return self._remove(key)

    def drop(self, key: OutboxKey, reason: str, *, expected: bool = False) -> bool:
        """Give up on an item (refused for good, or unreadable); the caller reports `reason`.
        `expected`: an ordinary outcome (the coordinator cancelled the job), logged at INFO."""
        removed = self._remove(key)
        if removed:
            log.log(logging.INFO if expected else logging.ERROR, "outbox: dropped %s: %s", key, reason)
        return removed


__all__ = ["CorruptFileError", "Outbox", "OutboxFullError", "OutboxItem", "OutboxKey", "upload_digest"]
