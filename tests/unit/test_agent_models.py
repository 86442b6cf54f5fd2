"""The installed-model directory: `current` flips with one rename, the previous version is
kept for rollback (and any version a job still uses), older ones are pruned."""

from __future__ import annotations

import os
import time
from pathlib import Path

from edge_agent.agent.models import ModelStore
from edge_agent.protocol import Topics


def _store(tmp_path: Path) -> tuple[ModelStore, list[str]]:
    subs: list[str] = []
    store = ModelStore(root=tmp_path / "models", topics=Topics(fleet="f"), subscribe=subs.append,
                       unsubscribe=subs.remove)
    return store, subs


def _install(store: ModelStore, version: str, age: float) -> None:
    path = store.path("digits", version)
    path.mkdir(parents=True)
    (path / "manifest.json").write_text("{}")
    os.utime(path, (time.time() - age, time.time() - age))


def test_current_prune_and_protected_versions(tmp_path: Path) -> None:
    store, _ = _store(tmp_path)
    for i, version in enumerate(("1", "2", "3", "4")):
        _install(store, version, age=100 - i)
    store._set_current("digits", "4")  # noqa: SLF001 - what a finished activation does
    assert store.current() == {"digits": "4"}
    store.prune("digits", protect={("digits", "1")})
    left = sorted(p.name for p in (tmp_path / "models" / "digits").iterdir() if not p.name.startswith("."))
    assert left == ["1", "3", "4", "current"]  # current, the previous one, and the one a job uses
    store._set_current("digits", "3")  # noqa: SLF001 - a rollback is the same one rename
    assert os.readlink(tmp_path / "models" / "digits" / "current") == "3"
    assert not list((tmp_path / "models" / "digits").glob(".current*"))


def test_fetch_subscribes_once_and_knows_what_is_installed(tmp_path: Path) -> None:
    store, subs = _store(tmp_path)
    _install(store, "1", age=0)
    assert store.fetch("digits", "1") is None and store.status("digits", "1") == ("installed", "")
    first = store.fetch("digits", "2", "a" * 64)
    assert first is not None and store.fetch("digits", "2") is first  # joined, not restarted
    assert subs == ["edgeft/v1/f/models/digits/2/#"]
    assert store.status("digits", "2")[0] == "downloading" and store.status("digits", "9") == ("absent", "")
