"""Retention without a broker: the coordinator's prune plan (what it keeps and why), its dry
run and --apply, full archives built on demand, and the agent's job-record pruning, index
and per-job memory."""

from __future__ import annotations

import base64
import json
import logging
import time
from pathlib import Path

import numpy as np
import pytest

from edge_agent.agent.jobs import Job, JobState, JobStore
from edge_agent.coordinator.artefacts import ModelArtefacts
from edge_agent.coordinator.registry import Registry
from edge_agent.coordinator.retention import (
    RetentionPolicy,
    RetractQueue,
    apply,
    needs_full,
    plan,
    set_tag,
)
from edge_agent.keys import fingerprint, generate_private_key, public_key_bytes

DAY = 86400.0


@pytest.fixture(scope="module")
def digits_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from edge_agent.sim import scenario as demo

    return demo.ensure_bundle(tmp_path_factory.getbasetemp() / "digits-bundle")


def _device(reg: Registry, models: str | None) -> str:
    key = generate_private_key()
    dev = fingerprint(key)
    reg.enrol_device(device_id=dev, public_key=base64.b64encode(public_key_bytes(key)).decode(), fleet="f",
                     approved=True)
    reg.record_state(dev, online=True, state={"battery_pct": 90.0, "models": models})
    return dev


def _versions(reg: Registry, arts: ModelArtefacts, base, n: int) -> list[str]:
    """n head-only versions v1..vn after the registered "1", each with its patch built."""
    head = reg.load_head(base)
    parent, names = "1", []
    for i in range(1, n + 1):
        new = {k: v + np.float32(0.01 * i) for k, v in head.items()}
        mv = reg.add_model_version(name="digits", version=f"v{i}", head=new, parent=parent,
                                   bundle_path=base.bundle_path, head_only=True, now=base.created_at + i)
        assert arts.patch_for(mv) is not None
        parent = mv.version
        names.append(mv.version)
    return names


def test_prune_keeps_current_in_use_tagged_and_last_n_then_applies(digits_bundle: Path, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from edge_agent.coordinator import cli as coordinator_cli

    reg = Registry(state_dir=tmp_path)
    arts = ModelArtefacts(reg)
    base = arts.register_bundle(digits_bundle, name="digits", version="1")
    names = _versions(reg, arts, base, 8)
    _device(reg, "digits@v2,other@x")  # a device still runs v2
    set_tag(reg, "digits", "v3")
    policy = RetentionPolicy(keep_versions=2)
    before = plan(reg, policy)
    kept = {v: why for (_, v), why in before.kept.items()}
    assert set(kept) == {"1", "v2", "v3", "v7", "v8"}
    assert kept["1"] == ["registered bundle"] and "tagged" in kept["v3"] and "current" in kept["v8"]
    assert kept["v2"] == ["in use on 1 device(s)"] and kept["v7"] == ["last 2"]
    assert sorted(p.version for p in before.versions) == ["v1", "v4", "v5", "v6"]
    doomed = [path for p in before.versions for path, _ in p.files]
    assert doomed and all(path.exists() for path in doomed) and before.bytes > 0
    # no full archive was kept for any head-only version: only the patch and the sha256 it pins
    assert not any(arts.archive_path("digits", v).exists() for v in names)
    assert all(arts.archive_path("digits", v).with_suffix(".sha256").exists() for v in names)
    reg.close()

    # the dry run (the default) prints and deletes nothing
    assert coordinator_cli.main(["prune", "--state-dir", str(tmp_path), "--keep-versions", "2"]) == 0
    out = capsys.readouterr().out
    assert "would prune" in out and "prune  digits v4" in out and "keep   digits v2: in use" in out, out
    assert all(path.exists() for path in doomed)
    assert coordinator_cli.main(["prune", "--state-dir", str(tmp_path), "--keep-versions", "2", "--apply",
                                 "--json"]) == 0
    done = json.loads(capsys.readouterr().out)
    assert done["applied"] and done["freed"] == before.bytes
    assert sorted(v["version"] for v in done["versions"]) == ["v1", "v4", "v5", "v6"]
    assert not any(path.exists() for path in doomed)
    with Registry(state_dir=tmp_path) as reg:
        rows = {m.version: m for m in reg.list_models()}
        assert all("pruned_at" in rows[v].metrics for v in ("v1", "v4", "v5", "v6"))  # rows stay: the lineage
        assert not any("pruned_at" in rows[v].metrics for v in ("1", "v2", "v3", "v7", "v8"))
        queued = {(n, v) for n, v, _ in RetractQueue(reg).pending()}
        assert ("digits", "v4") in queued and ("digits", "v4.head") in queued and ("digits", "v8") not in queued
        again = plan(reg, policy)
        assert not again.versions and not again.updates  # nothing left to prune; kept ones still usable
        assert ModelArtefacts(reg).archive_for(rows["v7"]).path.is_file()


def test_full_archive_is_built_on_demand_with_the_sha256_commands_pinned(digits_bundle: Path,
                                                                       tmp_path: Path) -> None:
    reg = Registry(state_dir=tmp_path)
    arts = ModelArtefacts(reg)
    base = arts.register_bundle(digits_bundle, name="digits", version="1")
    (name,) = _versions(reg, arts, base, 1)
    mv = reg.get_model("digits", name)
    pinned = arts.full_sha256(mv)
    full = arts.archive_path("digits", name)
    assert not full.exists()  # known, not kept
    built = ModelArtefacts(reg).archive_for(mv)  # a device needs the whole bundle: built now, the same bytes
    assert built.sha256 == pinned and full.is_file()
    ModelArtefacts(reg).drop_full(mv)
    assert not full.exists() and arts.full_sha256(mv) == pinned
    patch = arts.patch_for(mv)
    assert patch is not None and patch.size * 5 < built.size
    # who needs the full archive: a device that runs no version of the model
    with_model, without = _device(reg, "digits@1"), _device(reg, None)
    assert not needs_full(reg, "digits", [with_model]) and needs_full(reg, "digits", [with_model, without])
    reg.close()


def test_update_payloads_of_ended_rounds_are_pruned_after_the_retention(digits_bundle: Path,
                                                                       tmp_path: Path) -> None:
    from edge_agent.coordinator.rounds import RoundEngine
    from edge_agent.updates import UpdateEncoder

    reg = Registry(state_dir=tmp_path)
    base = ModelArtefacts(reg).register_bundle(digits_bundle, name="digits", version="1")
    head = reg.load_head(base)
    dev = _device(reg, "digits@1")
    reg.record_state(dev, online=True, state={"on_power": True})
    engine = RoundEngine(registry=reg)
    job = engine.start_job(model_name="digits", model_version="1", rounds=1, min_devices=1, deadline_s=600)
    (opened,) = engine.tick().opened
    delta = {k: np.full(v.shape, 0.01, np.float32) for k, v in head.items()}
    update = UpdateEncoder(model_name="digits", device_id=dev).encode(delta, job_id=job.id, round=opened.round,
                                                                      model_version="1")
    assert engine.receive_update(update.payload, sender=dev, num_samples=20).status == "accepted"
    policy = RetentionPolicy(keep_update_days=1)
    assert not plan(reg, policy).updates  # the round is open: its payloads are never touched
    engine.tick()
    (rec,) = reg.list_updates(job.id)
    path = reg.state_dir / str(rec.delta_path)
    assert path.is_file() and reg.get_round(job.id, opened.round).state.value == "aggregated"
    assert not plan(reg, policy).updates  # ended, but within the retention
    later = plan(reg, policy, now=time.time() + 2 * DAY)
    assert [p for _, p, _ in later.updates] == [path]
    apply(reg, later)
    assert not path.exists() and reg.list_updates(job.id)[0].delta_path is None
    # the job has finished: its old rounds' participant rows go; the update row is the device's
    # newest accepted one, which screening compares new updates with: it stays
    assert reg.list_updates(job.id)[0].wire_bytes == rec.wire_bytes
    assert later.participant_rows == [(job.id, opened.round)] and not later.update_rows
    assert reg.get_round(job.id, opened.round).participants == {}
    reg.close()


def test_learning_state_of_old_finished_jobs_is_pruned_but_the_newest_jobs_keep_theirs(
        digits_bundle: Path, tmp_path: Path) -> None:
    from edge_agent.coordinator.plateau import job_learning
    from edge_agent.coordinator.retention import RECENT_JOBS
    from edge_agent.coordinator.rounds import RoundEngine
    from edge_agent.updates import UpdateEncoder

    reg = Registry(state_dir=tmp_path)
    ModelArtefacts(reg).register_bundle(digits_bundle, name="digits", version="1")
    dev = _device(reg, "digits@1")
    reg.record_state(dev, online=True, state={"on_power": True})
    engine = RoundEngine(registry=reg)
    jobs = []
    for _ in range(RECENT_JOBS + 1):
        base = reg.list_models()[-1]
        head = reg.load_head(base)
        job = engine.start_job(model_name="digits", model_version=base.version, rounds=1, min_devices=1,
                               deadline_s=600)
        (opened,) = engine.tick().opened
        delta = {k: np.full(v.shape, 0.01, np.float32) for k, v in head.items()}
        update = UpdateEncoder(model_name="digits", device_id=dev).encode(
            delta, job_id=job.id, round=opened.round, model_version=base.version)
        assert engine.receive_update(update.payload, sender=dev, num_samples=20).status == "accepted"
        engine.tick()
        assert reg.get_job(job.id).status.value == "done" and job_learning(tmp_path, job.id)
        jobs.append(job.id)
        time.sleep(0.01)  # distinct created_at: "newest" is well defined
    policy = RetentionPolicy(keep_update_days=1)
    assert not plan(reg, policy).learning  # within the retention
    later = plan(reg, policy, now=time.time() + 2 * DAY)
    assert [j for j, _, _ in later.learning] == jobs[:1]  # the newest RECENT_JOBS keep theirs
    assert all(size > 0 for _, _, size in later.learning)
    assert any("learning state of finished job" in line for line in later.lines())
    apply(reg, later)
    assert not (tmp_path / "learning" / jobs[0]).exists() and job_learning(tmp_path, jobs[0]) is None
    assert all(job_learning(tmp_path, j) for j in jobs[1:])
    assert not plan(reg, policy, now=time.time() + 2 * DAY).learning  # nothing left to prune
    reg.close()


# ---------------------------------------------------------------- the agent
def _finished(store: JobStore, job_id: str, created: float, state: JobState = JobState.CANCELLED) -> None:
    job = Job(job_id=job_id, round=1, model="digits@1", params={"job": job_id}, created=created)
    store.save(job)
    store.advance(job, state, "cancelled by the coordinator" if state is JobState.CANCELLED else "failed")


def test_agent_job_records_are_pruned_and_indexed(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs", keep_records=5, keep_days=7)
    old = time.time() - 3 * DAY
    for i in range(12):
        _finished(store, f"old{i:02d}", old + i)
    files = sorted(p.stem for p in (tmp_path / "jobs").glob("*.job"))
    assert files == [f"old{i:02d}" for i in range(7, 12)]  # the newest 5 finished records
    for i in range(8):
        _finished(store, f"new{i}", time.time(), JobState.FAILED if i % 2 else JobState.CANCELLED)
    # the records stay bounded however many jobs a day the policy allows ...
    assert sorted(p.stem for p in (tmp_path / "jobs").glob("*.job")) == [f"new{i}" for i in range(3, 8)]
    # ... and what the daily limit needs of the pruned ones under a day old stays in the ledger
    assert [(e.job_id, e.state) for e in sorted(store.pruned_today(), key=lambda e: e.job_id)] == [
        ("new0", JobState.CANCELLED), ("new1", JobState.FAILED), ("new2", JobState.CANCELLED)]
    assert {e.job_id for e in JobStore(tmp_path / "jobs").pruned_today()} == {"new0", "new1", "new2"}  # on disk
    assert not store.pruned_today(now=time.time() + DAY + 1)  # a day later they no longer count
    active = Job(job_id="live", round=1, model="digits@1", params={"job": "live"}, created=old - DAY)
    store.save(active)
    store.prune(now=time.time() + 30 * DAY)
    left = sorted(p.stem for p in (tmp_path / "jobs").glob("*.job"))
    assert left == ["live"]  # an unfinished job is never pruned, however old
    # the index answers without reading records: a record changed behind its back is not re-read
    fresh = JobStore(tmp_path / "jobs")
    assert [e.job_id for e in fresh.entries()] == ["live"] and fresh.entries()[0].state is JobState.ACCEPTED
    (tmp_path / "jobs" / "live.job").write_bytes(b"garbage")
    assert [e.job_id for e in fresh.entries()] == ["live"]
    assert [j.job_id for j in fresh.all()] == [] and fresh.quarantined  # a full scan sees and quarantines it


def test_driver_per_job_memory_is_bounded_and_a_cancel_logs_at_info(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    from edge_agent.agent.lifecycle import DriverSettings, JobDriver
    from edge_agent.agent.models import ModelStore
    from edge_agent.agent.policy import DeviceLimits
    from edge_agent.agent.state import Readings
    from edge_agent.protocol import Topics
    from edge_agent.transport.outbox import Outbox

    store = JobStore(tmp_path / "jobs", keep_records=10)
    outbox = Outbox(directory=tmp_path / "outbox", max_bytes=1 << 20)
    models = ModelStore(root=tmp_path / "models", topics=Topics(fleet="f"), subscribe=lambda t: None,
                        unsubscribe=lambda t: None)
    settings = DriverSettings(device_id="dev", state_dir=tmp_path, limits=DeviceLimits(max_jobs_per_day=1000))
    published: list[str] = []
    driver = JobDriver(settings=settings, store=store, models=models, outbox=outbox,
                       readings=lambda **kw: Readings(battery_pct=90.0, charging=True, temp_c=40.0),
                       publish=lambda phase, **kw: published.append(phase))
    caplog.set_level(logging.INFO)
    for i in range(60):
        job = Job(job_id=f"j{i}-r1", round=1, model="digits@1", params={"job": f"j{i}", "deadline_at": 2e9},
                  created=time.time())
        store.save(job)
        driver._track(job)
        driver._advance(job, JobState.PREPARING, "power ok")
        driver._fetching.add(job.job_id)
        driver._next_spawn[job.job_id] = 1.0
        driver._retry_at[job.job_id] = 1.0
        driver._advance(job, JobState.TRAINING, "starting")
        if i % 2:
            driver._advance(job, JobState.UPLOADING, "queued")
            outbox.put(driver.key(job), [b"chunk"])
        assert driver.cancel({"job": f"j{i}"}).accept
    assert not driver._last_progress and not driver._fetching and not driver._next_spawn and not driver._retry_at
    assert not driver.active() and len(outbox) == 0
    assert len(list((tmp_path / "jobs").glob("*.job"))) == 10  # keep_records, whatever their age
    assert len(store.pruned_today()) == 50  # the daily limit still knows of the other 50
    dropped = [r for r in caplog.records if "outbox: dropped" in r.getMessage()]
    assert len(dropped) == 30 and all(r.levelno == logging.INFO for r in dropped)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_the_daily_limit_counts_jobs_whose_records_were_pruned(tmp_path: Path) -> None:
    from edge_agent.agent.lifecycle import DriverSettings, JobDriver
    from edge_agent.agent.models import ModelStore
    from edge_agent.agent.policy import DeviceLimits
    from edge_agent.agent.state import Readings
    from edge_agent.protocol import Topics
    from edge_agent.transport.outbox import Outbox

    def driver_for(store: JobStore) -> JobDriver:
        models = ModelStore(root=tmp_path / "models", topics=Topics(fleet="f"), subscribe=lambda t: None,
                            unsubscribe=lambda t: None)
        settings = DriverSettings(device_id="dev", state_dir=tmp_path, limits=DeviceLimits(max_jobs_per_day=6))
        return JobDriver(settings=settings, store=store, models=models,
                         outbox=Outbox(directory=tmp_path / "outbox", max_bytes=1 << 20),
                         readings=lambda **kw: Readings(battery_pct=90.0, charging=True, temp_c=40.0),
                         publish=lambda phase, **kw: None)

    store = JobStore(tmp_path / "jobs", keep_records=2)
    for i in range(5):
        _finished(store, f"f{i}", time.time(), JobState.FAILED)
    assert len(list((tmp_path / "jobs").glob("*.job"))) == 2
    allowance = driver_for(store).allowance()
    assert (allowance.used, allowance.jobs_left) == (5, 1)
    # a restarted daemon reads the ledger: still 5 used today
    assert driver_for(JobStore(tmp_path / "jobs", keep_records=2)).allowance().used == 5


def test_model_store_forgets_finished_fetches(tmp_path: Path) -> None:
    from edge_agent.agent.models import MAX_FAILED_FETCHES, ModelStore
    from edge_agent.protocol import Topics

    subs: list[str] = []
    store = ModelStore(root=tmp_path / "models", topics=Topics(fleet="f"), subscribe=subs.append,
                       unsubscribe=subs.remove)
    for i in range(3 * MAX_FAILED_FETCHES):
        fetch = store.fetch("digits", f"v{i}", "0" * 64)
        assert fetch is not None
        store._fail(fetch, "the published bundle has another sha256")
    assert len(store.fetches) == MAX_FAILED_FETCHES and not subs  # the newest failures, for jobs waiting on them
    assert store.status("digits", f"v{3 * MAX_FAILED_FETCHES - 1}")[0] == "failed"
    assert store.status("digits", "v0") == ("absent", "")  # forgotten: a job asking again fetches again
