"""The job lifecycle table and its crash-safe store."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge_agent.agent.jobs import (
    MAX_REENTRIES,
    TRANSITIONS,
    IllegalTransition,
    Job,
    JobState,
    JobStore,
    transition,
)

S = JobState


def _job() -> Job:
    return Job(job_id="job-1", round=3, model="digits@2", params={"budget_wh": 0.5})


def test_table_covers_every_state_and_terminal_states_are_final() -> None:
    assert set(TRANSITIONS) == set(JobState)
    for state in JobState:
        assert (TRANSITIONS[state] == frozenset()) == state.terminal
        if not state.terminal:
            assert S.FAILED in TRANSITIONS[state] and S.CANCELLED in TRANSITIONS[state]


def test_the_happy_path_and_pause_resume() -> None:
    job = _job()
    for step in (S.WAITING_FOR_POWER, S.PREPARING, S.TRAINING, S.PAUSED, S.TRAINING, S.UPLOADING, S.DONE):
        transition(job, step, f"to {step.value}")
    assert job.state is S.DONE
    assert job.entries["training"] == 2
    assert [h[1] for h in job.history][-2:] == ["uploading", "done"]


@pytest.mark.parametrize(("path", "bad"), [
    ((), S.TRAINING),  # must prepare first
    ((S.PREPARING, S.TRAINING), S.DONE),  # must upload first
    ((S.PREPARING, S.TRAINING, S.UPLOADING, S.DONE), S.TRAINING),  # terminal
    ((S.CANCELLED,), S.PREPARING),
])
def test_illegal_transitions_raise(path: tuple[JobState, ...], bad: JobState) -> None:
    job = _job()
    for step in path:
        transition(job, step)
    with pytest.raises(IllegalTransition, match=f"-> {bad.value} is not allowed"):
        transition(job, bad)


def test_store_persists_every_step_and_survives_restart(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs")
    job = _job()
    store.save(job)
    store.advance(job, S.PREPARING)
    store.advance(job, S.TRAINING, "epoch 1")
    # A new daemon process reads the same truth from disk.
    again = JobStore(tmp_path / "jobs").load("job-1")
    assert again.state is S.TRAINING and again.reason == "epoch 1"
    assert again.params == {"budget_wh": 0.5} and again.entries == {"preparing": 1, "training": 1}
    assert [j.job_id for j in JobStore(tmp_path / "jobs").active()] == ["job-1"]


def test_a_reboot_loop_fails_the_job(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    job = _job()
    store.advance(job, S.PREPARING)
    store.advance(job, S.TRAINING)
    for _ in range(MAX_REENTRIES):  # each restart: paused by the brown-out, then training again
        store.advance(job, S.PAUSED, "restarted")
        store.advance(job, S.TRAINING, "resumed")
        if job.state is S.FAILED:
            break
    assert job.state is S.FAILED and "reboot loop" in job.reason
    assert store.load("job-1").state is S.FAILED


def test_corrupt_and_zero_filled_records_are_quarantined_not_fatal(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    good = _job()
    store.save(good)
    (tmp_path / "zeroed.job").write_bytes(b"\0" * 4096)  # what an SD card leaves after power loss
    bad = Job(job_id="job-2", round=1, model="m@1")
    store.save(bad)
    raw = bytearray((tmp_path / "job-2.job").read_bytes())
    raw[-3] ^= 0xFF
    (tmp_path / "job-2.job").write_bytes(bytes(raw))
    jobs = store.all()
    assert [j.job_id for j in jobs] == ["job-1"]
    assert sorted(q.split(":")[0] for q in store.quarantined) == ["job-2.job", "zeroed.job"]
    assert (tmp_path / "zeroed.corrupt").exists() and (tmp_path / "job-2.corrupt").exists()


def test_unsafe_job_ids_are_refused(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    for job_id in ("", "../etc/passwd", ".hidden"):
        with pytest.raises(Exception, match="unsafe job id"):
            store.save(Job(job_id=job_id, round=1, model="m@1"))


def test_governor_resumes_do_not_count_toward_the_reboot_loop_limit(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    job = _job()
    store.advance(job, S.PREPARING)
    store.advance(job, S.TRAINING)
    for _ in range(3 * MAX_REENTRIES):  # a long solar day: many battery pauses, no reboot
        store.advance(job, S.PAUSED, "battery-low")
        store.advance(job, S.TRAINING, "resumed by the governor", restart=False)
    assert job.state is S.TRAINING and job.entries["training"] == 1
    store.advance(job, S.PAUSED, "restarted")
    store.advance(job, S.TRAINING, "after a reboot")  # a real restart still counts
    assert store.load("job-1").entries["training"] == 2
