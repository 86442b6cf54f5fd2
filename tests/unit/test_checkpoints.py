"""Checkpoints: crash-safe, checksummed, previous one kept, corrupt ones detected."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from edge_agent.train.checkpoints import Checkpoint, CheckpointMismatchError, CheckpointStore


def _ckpt(step: int, model: str = "m1") -> Checkpoint:
    rng = np.random.default_rng(step)
    return Checkpoint(step=step, meta={"model": model, "position": {"epoch": step // 10}},
                      arrays={"param/w": rng.random((3, 4)).astype(np.float32), "opt/0/0": np.full(4, step, np.float32)})


def test_roundtrip_and_only_the_newest_two_are_kept(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    assert store.load_latest() is None
    for step in (10, 20, 30):
        store.save(_ckpt(step))
    assert [p.name for p in store.paths()] == ["ckpt-00000003.ckpt", "ckpt-00000002.ckpt"]
    got = store.load_latest(expect={"model": "m1"})
    assert got is not None and got.step == 30 and got.meta["position"] == {"epoch": 3}
    np.testing.assert_array_equal(got.arrays["param/w"], _ckpt(30).arrays["param/w"])


@pytest.mark.parametrize("damage", ["zero-fill", "truncate", "flip", "empty"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path: Path, damage: str) -> None:
    store = CheckpointStore(tmp_path)
    store.save(_ckpt(10))
    newest = store.save(_ckpt(20))
    data = newest.read_bytes()
    if damage == "zero-fill":  # what an SD card leaves after power loss
        newest.write_bytes(bytes(len(data)))
    elif damage == "truncate":
        newest.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        newest.write_bytes(data[:-5] + bytes([data[-5] ^ 1]) + data[-4:])
    else:
        newest.write_bytes(b"")
    got = store.load_latest()
    assert got is not None and got.step == 10
    assert len(store.problems) == 1
    assert (tmp_path / "ckpt-00000002.ckpt.corrupt").exists()  # kept as evidence, not loaded again
    # the next save does not push the good fallback out in favour of the corrupt file
    store.save(_ckpt(15))
    assert [p.name for p in store.paths()] == ["ckpt-00000003.ckpt", "ckpt-00000001.ckpt"]
    assert store.load_latest().step == 15


def test_all_corrupt_means_no_checkpoint(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    path = store.save(_ckpt(5))
    path.write_bytes(b"\0" * 100)
    assert store.load_latest() is None and "zero-filled" in store.problems[0]


def test_checkpoint_from_another_model_is_an_error_and_kept(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    path = store.save(_ckpt(5, model="other"))
    with pytest.raises(CheckpointMismatchError, match="model 'other'"):
        store.load_latest(expect={"model": "m1"})
    assert path.exists() and store.load_latest(expect={"model": "other"}).step == 5


def test_stale_temp_files_from_a_killed_write_are_removed(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.save(_ckpt(1))
    stale = tmp_path / ".ckpt-00000002.ckpt.abc123.tmp"
    stale.write_bytes(b"half a checkpoint")
    unrelated = tmp_path / "notes.txt"
    unrelated.write_text("keep me")
    store = CheckpointStore(tmp_path)
    assert not stale.exists() and unrelated.exists()
    assert store.load_latest().step == 1


def test_payloads_that_verify_but_are_not_checkpoints_are_rejected(tmp_path: Path) -> None:
    from edge_agent.atomic import write_checked

    store = CheckpointStore(tmp_path)
    store.save(_ckpt(1))
    write_checked(tmp_path / "ckpt-00000009.ckpt", b"valid frame, not an npz")
    assert store.load_latest().step == 1
    nan = _ckpt(2)
    nan.arrays["param/w"][0, 0] = np.nan
    write_checked(tmp_path / "ckpt-00000010.ckpt", nan.to_bytes())
    assert store.load_latest().step == 1 and len(store.problems) == 2


def test_writes_are_atomic_files_with_a_frame(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    path = store.save(_ckpt(3))
    assert path.read_bytes()[:4] == b"EAC1"
    assert oct(os.stat(path).st_mode & 0o777) == "0o644"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
