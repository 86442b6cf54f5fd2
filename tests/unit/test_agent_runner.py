"""The daemon <-> child contract: spec file, JSON-line events on a pipe, exit codes, results."""

from __future__ import annotations

import json
import sys
import textwrap
import time
from pathlib import Path

import pytest

from edge_agent.agent.runner import (
    EXIT_STOPPED,
    FAIL_CODES,
    ChildProcess,
    describe_exit,
    pack_chunks,
    read_result,
    unpack_chunks,
)
from edge_agent.errors import EXIT_CONFIG, EXIT_DATAERR, InputError

# A stand-in for the child at the contract's interface: argv, events fd, exit code.
SCRIPTED = textwrap.dedent(r'''
    import json, os, signal, sys, time
    args = sys.argv[1:]
    fd = int(args[args.index("--events-fd") + 1])
    spec = json.load(open(args[args.index("--spec") + 1]))
    def send(raw):
        os.write(fd, raw)
    if spec.get("mode") == "events":
        send(b'{"phase": "train", "step": 1, "total_steps": 4}\n')
        send(b'not json at all\n[1, 2]\n{"no_phase": 1}\n')
        send(b'{"phase": "train", "st')  # a line split across writes
        time.sleep(0.05)
        send(b'ep": 2, "total_steps": 4}\n{"phase": "error", "detail": "out of cheese"}\n')
        sys.exit(3)
    if spec.get("mode") == "sigterm":
        signal.signal(signal.SIGTERM, lambda *a: (send(b'{"phase": "saving", "detail": "stop"}\n'), sys.exit(3)))
        send(b'{"phase": "ready"}\n')
        while True:
            time.sleep(0.05)
''')


def _events_until_exit(child: ChildProcess, timeout: float = 20.0) -> tuple[list[dict], int]:
    events: list[dict] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events += child.events()
        code = child.poll()
        if code is not None:
            return events, code
        time.sleep(0.02)
    raise AssertionError(f"child did not exit; events so far {events}")


def _scripted(tmp_path: Path, mode: str) -> ChildProcess:
    script = tmp_path / "child.py"
    script.write_text(SCRIPTED)
    return ChildProcess(command="train", spec={"mode": mode}, job_dir=tmp_path, name="t",
                        python=[sys.executable, str(script)])


def test_events_are_parsed_line_by_line_and_junk_is_ignored(tmp_path: Path) -> None:
    child = _scripted(tmp_path, "events")
    child.start()
    assert json.loads((tmp_path / "spec.json").read_text()) == {"mode": "events"}  # written for the child
    events, code = _events_until_exit(child)
    assert code == EXIT_STOPPED
    assert [(e["phase"], e.get("step")) for e in events] == [("train", 1), ("train", 2), ("error", None)]
    assert child.last_error == "out of cheese"


def test_stop_asks_the_child_to_checkpoint_first(tmp_path: Path) -> None:
    child = _scripted(tmp_path, "sigterm")
    child.start()
    deadline = time.monotonic() + 20
    seen: list[dict] = []
    while not seen and time.monotonic() < deadline:
        seen = child.events()
        time.sleep(0.02)
    assert seen == [{"phase": "ready"}]
    assert child.stop(timeout=20) == EXIT_STOPPED
    assert describe_exit(-9) == "killed by SIGKILL" and describe_exit(65) == "exit code 65"


def test_the_real_activate_child_refuses_a_bad_archive(tmp_path: Path) -> None:
    archive = tmp_path / "bad.bundle"
    archive.write_bytes(b"\x1f\x8b" + b"not really gzip" * 100)
    dest = tmp_path / "models" / "m" / "1"
    child = ChildProcess(command="activate", spec={"archive": str(archive), "dest": str(dest)},
                         job_dir=tmp_path, name="activate")
    child.start()
    events, code = _events_until_exit(child, timeout=60)
    assert code == EXIT_DATAERR, events
    assert "not a readable bundle archive" in child.last_error
    assert not dest.exists()
    assert not dest.parent.exists() or not list(dest.parent.iterdir())  # no half-unpacked temp directory


def test_update_chunk_files_round_trip_and_refuse_damage(tmp_path: Path) -> None:
    chunks = [b"a" * 10, b"", b"\x00\xff" * 1000]
    assert unpack_chunks(pack_chunks(chunks)) == chunks
    blob = pack_chunks(chunks)
    for bad in (blob[:-1], blob + b"x", b"XXXX" + blob[4:], pack_chunks([])):
        with pytest.raises(InputError):
            unpack_chunks(bad)
    assert read_result(tmp_path) is None
    (tmp_path / "result.json").write_text("{not json")
    assert read_result(tmp_path) is None  # unreadable: the job runs again rather than trusting it
    (tmp_path / "result.json").write_text('{"status": "trained"}')
    assert read_result(tmp_path) == {"status": "trained"}


def test_the_real_train_child_refuses_a_job_no_depth_of_which_fits_the_memory_cap(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a board profile whose training cap is below what the job would add (64 MB: less
    than this interpreter holds), the child refuses before it prepares anything: EXIT_CONFIG,
    which the daemon takes as a failed job (runner.FAIL_CODES), with the planner's line."""
    import shutil

    from edge_agent.hardware.profiles import profiles_dir
    from edge_agent.sim import scenario as demo

    bundle = demo.ensure_bundle(tmp_path / "bundle", depths=2)
    dev = demo.scenario().devices[0]
    data = demo.write_data(tmp_path / "data", dev.images, dev.labels, "npz")
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    shutil.copy(profiles_dir() / "base.toml", profiles / "base.toml")
    (profiles / "tiny.toml").write_text('[profile]\nname = "tiny"\ndescription = "a 64 MB training cap"\n'
                                        '[match]\nmodel = ["none"]\n[training]\nmemory_cap_mb = 64\n')
    monkeypatch.setenv("EDGE_AGENT_PROFILES_DIR", str(profiles))
    monkeypatch.setenv("EDGE_AGENT_STATE_DIR", str(tmp_path / "machine-state"))
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    child = ChildProcess(command="train", spec={"job_dir": str(job_dir), "model_dir": str(bundle), "data": str(data),
                                                "profile": "tiny", "cache_dir": str(tmp_path / "cache")},
                         job_dir=job_dir, name="train")
    child.start()
    events, code = _events_until_exit(child, timeout=120)
    assert code == EXIT_CONFIG and code in FAIL_CODES, events
    assert "no depth fits" in child.last_error and "64 MB training cap" in child.last_error, child.last_error
    assert read_result(job_dir) is None  # no result: nothing trained, nothing to send
