"""The registry's model versions: a job's base and every version a round published, each
a row in `model_versions` plus its head parameters in a crash-safe array file

    <state_dir>/models/<name>/<version>/head.<sha256[:16]>.npz

written (`atomic.write_checked`) before the row that names it is committed. Its own object,
given the registry's database, because it is the one table the round logic only appends to (a
version is never changed, and `finish_round` inserts the round's new one through
`insert` inside its own transaction).
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic import read_checked, write_checked
from ..errors import InputError
from .records import (
    IllegalTransition,
    ModelVersion,
    NotFound,
    check_flat,
    check_id,
    check_text,
    dump_arrays,
    load_arrays,
)
from .registry_db import RegistryDb

MAX_ARRAY_FILE_BYTES = 1 << 30  # the most the registry reads back of any array file (heads, update payloads)


class ModelStore:
    """Model versions and their head files, in the registry's database (`db`)."""

    def __init__(self, db: RegistryDb) -> None:
        self.db = db

    def write_head(self, name: str, version: str, head: Mapping[str, np.ndarray]) -> tuple[str, str]:
        """Write head parameters crash-safe; returns (path relative to state_dir, sha256).
        The file name carries the digest, so a registered version's file is never replaced."""
        check_id(name, "model name")
        check_id(version, "model version")
        data = dump_arrays(head)
        sha = hashlib.sha256(data).hexdigest()
        path = self.db.state_dir / "models" / name / version / f"head.{sha[:16]}.npz"
        write_checked(path, data)
        return self.db.rel(path), sha

    def add_model_version(self, *, name: str, version: str, head: Mapping[str, np.ndarray],
                          parent: str | None = None, bundle_path: str | None = None, head_only: bool = False,
                          metrics: Mapping[str, Any] | None = None, now: float | None = None) -> ModelVersion:
        """Register a model version (a base bundle's head, or a published one). The head's
        arrays are stored as numpy; `bundle_path` names the bundle that holds the backbone."""
        rel, sha = self.write_head(name, version, head)
        mv = ModelVersion(name=name, version=version, parent=parent, created_at=self.db.now(now),
                          bundle_path=bundle_path, head_path=rel, head_sha256=sha, head_only=head_only,
                          metrics=check_flat(dict(metrics or {}), "metrics"))
        with self.db.tx() as db:
            return self.insert(db, mv)

    def insert(self, db: sqlite3.Connection, mv: ModelVersion) -> ModelVersion:
        """Insert a version inside the caller's transaction (finish_round commits its round's with it)."""
        if mv.parent is not None:
            check_id(mv.parent, "parent version")
        if mv.bundle_path is not None:
            check_text(mv.bundle_path, "bundle path", limit=4096)
        old = db.execute("SELECT * FROM model_versions WHERE name = ? AND version = ?", (mv.name, mv.version)).fetchone()
        if old is not None:
            if old["head_sha256"] == mv.head_sha256:  # re-aggregation after a crash: same result
                return ModelVersion.from_row(old)
            raise IllegalTransition(f"model {mv.name} version {mv.version} already exists with other parameters")
        try:
            db.execute("INSERT INTO model_versions (name, version, parent, created_at, bundle_path, head_path, "
                       "head_sha256, head_only, metrics, job_id, round) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                       (mv.name, mv.version, mv.parent, mv.created_at, mv.bundle_path, mv.head_path,
                        mv.head_sha256, int(mv.head_only), json.dumps(mv.metrics, sort_keys=True), mv.job_id, mv.round))
        except sqlite3.IntegrityError:  # (db.PgConnection raises PostgreSQL's as this one too)
            raise NotFound(f"model {mv.name}: parent version {mv.parent!r} is not registered") from None
        return mv

    def get_model(self, name: str, version: str) -> ModelVersion:
        with self.db.read() as db:
            return self.row(db, name, version)

    def row(self, db: sqlite3.Connection, name: str, version: str) -> ModelVersion:
        """A version inside the caller's transaction (NotFound if it is not registered)."""
        check_id(name, "model name")
        check_id(version, "model version")
        row = db.execute("SELECT * FROM model_versions WHERE name = ? AND version = ?", (name, version)).fetchone()
        if row is None:
            raise NotFound(f"model {name} version {version} is not registered")
        return ModelVersion.from_row(row)

    def list_models(self, name: str | None = None) -> list[ModelVersion]:
        with self.db.read() as db:
            rows = db.execute("SELECT * FROM model_versions WHERE name = COALESCE(?, name) ORDER BY name, "
                              "created_at, version", (name,))
            return [ModelVersion.from_row(r) for r in rows]

    def load_head(self, mv: ModelVersion) -> dict[str, np.ndarray]:
        """The version's head parameters (integrity-checked)."""
        return load_arrays(read_checked(self.db.abs(mv.head_path), MAX_ARRAY_FILE_BYTES), where=mv.head_path)

    # ---- server sets (server_set.py): content-addressed files, one per model at most
    def server_set_path(self, sha256: str) -> Path:
        if not isinstance(sha256, str) or len(sha256) != 64 or not all(ch in "0123456789abcdef" for ch in sha256):
            raise InputError(f"server set id {str(sha256)[:70]!r} is not a sha256")
        return self.db.state_dir / "server_sets" / f"{sha256[:16]}.npz"

    def store_server_set(self, data: bytes) -> str:
        """Write a packed server set (crash-safe); returns its sha256 (its id)."""
        sha = hashlib.sha256(data).hexdigest()
        path = self.server_set_path(sha)
        if not path.exists():
            write_checked(path, data)
        return sha

    def load_server_set(self, sha256: str) -> bytes:
        try:
            return read_checked(self.server_set_path(sha256), MAX_ARRAY_FILE_BYTES)
        except FileNotFoundError:
            raise NotFound(f"server set {sha256[:16]} is not stored in {self.db.state_dir}") from None

    def set_model_server_set(self, name: str, sha256: str, samples: int, *, now: float | None = None) -> None:
        check_id(name, "model name")
        self.server_set_path(sha256)
        with self.db.tx() as db:
            db.execute("DELETE FROM server_sets WHERE model_name = ?", (name,))
            db.execute("INSERT INTO server_sets (model_name, sha256, samples, created_at) VALUES (?, ?, ?, ?)",
                       (name, sha256, int(samples), self.db.now(now)))

    def model_server_set(self, name: str) -> tuple[str, int] | None:
        """(sha256, samples) of the model's server set, or None."""
        with self.db.read() as db:
            row = db.execute("SELECT sha256, samples FROM server_sets WHERE model_name = ?", (name,)).fetchone()
            return (str(row[0]), int(row[1])) if row else None
