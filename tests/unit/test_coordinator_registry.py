"""The coordinator's SQLite registry on real files: schema, validation, de-duplication,
transactions, and a restart in the middle of a round."""

from __future__ import annotations

import base64
import sqlite3
from pathlib import Path

import numpy as np
import pytest

from edge_agent.atomic import CorruptFileError
from edge_agent.coordinator.records import (
    IllegalTransition,
    JobStatus,
    ModelVersion,
    NotFound,
    ParticipantStatus,
    RoundState,
    UpdateStatus,
)
from edge_agent.coordinator.registry import DB_NAME, MIGRATIONS, Registry
from edge_agent.errors import ConfigError, InputError
from edge_agent.keys import fingerprint, generate_private_key, public_key_bytes

SHA = "ab" * 32
HEAD = {"dense0_weight": np.arange(12, dtype=np.float32).reshape(3, 4), "dense0_bias": np.zeros(3, np.float32)}


def new_device() -> tuple[str, str]:
    key = generate_private_key()
    return fingerprint(key), base64.b64encode(public_key_bytes(key)).decode()


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def reg(tmp_path: Path) -> Registry:
    with Registry(state_dir=tmp_path, clock=Clock()) as r:
        yield r


def enrol(reg: Registry, n: int, **kw: object) -> list[str]:
    ids = []
    for _ in range(n):
        did, pub = new_device()
        reg.enrol_device(device_id=did, public_key=pub, fleet="farm", **kw)
        ids.append(did)
    return ids


def job_with_round(reg: Registry, devices: list[str], *, job_id: str = "job-1") -> None:
    reg.add_model_version(name="digits", version="1", head=HEAD, bundle_path="/bundles/digits-1")
    reg.create_job(job_id=job_id, model_name="digits", model_version="1", selector="all", rounds=2,
                   min_devices=1, deadline_s=60, params={"budget_wh": 1.5})
    reg.open_round(job_id=job_id, number=1, base_version="1", devices=devices, deadline_at=1_000_060.0)


@pytest.mark.sqlite_only("reads journal_mode, sqlite_master and query plans from the file")
def test_schema_is_versioned_wal_with_foreign_keys(tmp_path: Path) -> None:
    Registry(state_dir=tmp_path).close()
    db = sqlite3.connect(tmp_path / DB_NAME)
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert db.execute("SELECT version FROM schema_version").fetchall() == [(len(MIGRATIONS),)]
    tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"devices", "jobs", "rounds", "participants", "updates", "model_versions"} <= tables
    # the dashboard's per-device and per-time reads go through an index, not a table scan
    for query, index in (("SELECT * FROM participants WHERE device_id = 'x'", "participants_by_device"),
                         ("SELECT * FROM updates WHERE received_at >= 0", "updates_by_received")):
        plan = " ".join(str(r) for r in db.execute("EXPLAIN QUERY PLAN " + query))
        assert index in plan, plan
    db.close()
    with Registry(state_dir=tmp_path) as reg:  # reopening migrates nothing twice
        assert reg.schema_version == len(MIGRATIONS)
        assert reg.db.conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1


@pytest.mark.sqlite_only("edits the file with sqlite3 (test_registry_pg.py: the same on PostgreSQL)")
def test_newer_schema_is_refused(tmp_path: Path) -> None:
    Registry(state_dir=tmp_path).close()
    db = sqlite3.connect(tmp_path / DB_NAME)
    db.execute("UPDATE schema_version SET version = 99")
    db.commit()
    db.close()
    with pytest.raises(ConfigError, match="newer"):
        Registry(state_dir=tmp_path)


@pytest.mark.sqlite_only("reads the file with sqlite3 (test_registry_pg.py: the same on PostgreSQL)")
def test_migrations_apply_in_one_transaction(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import edge_agent.coordinator.registry_db as registry_module

    Registry(state_dir=tmp_path).close()
    broken = [*MIGRATIONS, ("ALTER TABLE devices ADD COLUMN note TEXT", "THIS IS NOT SQL")]
    monkeypatch.setattr(registry_module, "MIGRATIONS", broken)
    with pytest.raises(ConfigError, match="syntax error"):
        Registry(state_dir=tmp_path)
    db = sqlite3.connect(tmp_path / DB_NAME)  # nothing of the failed migration stuck
    assert db.execute("SELECT version FROM schema_version").fetchone()[0] == len(MIGRATIONS)
    assert "note" not in {r[1] for r in db.execute("PRAGMA table_info(devices)")}
    db.close()
    monkeypatch.setattr(registry_module, "MIGRATIONS", [*MIGRATIONS, ("ALTER TABLE devices ADD COLUMN note TEXT",)])
    with Registry(state_dir=tmp_path) as reg:
        assert reg.schema_version == len(MIGRATIONS) + 1
        assert "note" in {r[1] for r in reg.db.conn.execute("PRAGMA table_info(devices)")}


@pytest.mark.sqlite_only("a damaged SQLite file")
def test_a_file_that_is_not_a_database_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / DB_NAME).write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(ConfigError, match="not a usable registry"):
        Registry(state_dir=tmp_path)


def test_enrol_approve_state_and_reenrol_keeps_approval(reg: Registry) -> None:
    did, pub = new_device()
    dev = reg.enrol_device(device_id=did, public_key=pub, fleet="farm", board="Raspberry Pi 4 Model B",
                           engine="tflite", tags=["north", "solar"])
    assert (dev.approved, dev.online, dev.tags, dev.last_seen) == (False, False, ("north", "solar"), None)
    assert reg.approved_keys() == {}
    reg.set_approved(did)
    reg.record_state(did, online=True, state={"battery_pct": 80, "on_power": False}, now=5.0)
    dev = reg.record_state(did, online=True, state={"status": "idle"}, now=7.0)
    assert dev.state == {"battery_pct": 80, "on_power": False, "status": "idle"}  # merged
    assert (dev.battery_pct, dev.on_power, dev.last_seen, dev.is_online(10.0, 5.0)) == (80.0, False, 7.0, True)
    assert not dev.is_online(20.0, 5.0)
    dev = reg.enrol_device(device_id=did, public_key=pub, fleet="farm", board="Pi 5", engine="native")
    assert (dev.approved, dev.board, dev.engine, dev.tags) == (True, "Pi 5", "native", ("north", "solar"))
    assert reg.approved_keys() == {did: pub}


@pytest.mark.parametrize("change", [
    {"device_id": "dev-1"},  # not the key's fingerprint
    {"public_key": "not base64!"},
    {"public_key": base64.b64encode(b"x" * 31).decode()},
    {"fleet": "../etc"},
    {"board": "Pi\x00 4"},
    {"engine": "x" * 500},
    {"tags": ["ok", "bad tag"]},
    {"tags": "solar"},
])
def test_untrusted_device_fields_are_refused(reg: Registry, change: dict) -> None:
    did, pub = new_device()
    args = {"device_id": did, "public_key": pub, "fleet": "farm"} | change
    with pytest.raises(InputError):
        reg.enrol_device(**args)
    assert reg.list_devices() == []


@pytest.mark.parametrize("state", [{"battery_pct": float("nan")}, {"bad key": 1}, {"nested": {"a": 1}},
                                   {f"k{i}": i for i in range(65)}, {"s": "x" * 300}])
def test_untrusted_state_is_refused(reg: Registry, state: dict) -> None:
    (did,) = enrol(reg, 1)
    with pytest.raises(InputError):
        reg.record_state(did, online=True, state=state)
    assert reg.get_device(did).state == {}


def test_unknown_device_and_job(reg: Registry) -> None:
    with pytest.raises(NotFound):
        reg.get_device("aaaa")
    with pytest.raises(NotFound):
        reg.set_approved("aaaa")
    with pytest.raises(NotFound):  # a job needs a registered model version
        reg.create_job(job_id="j", model_name="m", model_version="1", selector="all", rounds=1, min_devices=1,
                       deadline_s=1)


@pytest.mark.parametrize("change", [{"selector": "tags:x"}, {"rounds": 0}, {"min_devices": 0},
                                    {"deadline_s": -1}, {"job_id": "j" * 49}, {"params": {"x": [1]}}])
def test_bad_jobs_are_refused(reg: Registry, change: dict) -> None:
    reg.add_model_version(name="m", version="1", head=HEAD)
    args = {"job_id": "j", "model_name": "m", "model_version": "1", "selector": "all", "rounds": 1,
            "min_devices": 1, "deadline_s": 10.0} | change
    with pytest.raises(InputError):
        reg.create_job(**args)
    assert reg.list_jobs() == []


def test_job_transitions_follow_the_table(reg: Registry) -> None:
    reg.add_model_version(name="m", version="1", head=HEAD)
    reg.create_job(job_id="j", model_name="m", model_version="1", selector="tag:north", rounds=1, min_devices=1,
                   deadline_s=10)
    assert reg.set_job_status("j", JobStatus.RUNNING).status is JobStatus.RUNNING
    assert reg.set_job_status("j", JobStatus.DONE, "ok").status is JobStatus.DONE
    with pytest.raises(IllegalTransition):
        reg.set_job_status("j", JobStatus.CANCELLED)
    assert reg.get_job("j").status is JobStatus.DONE
    assert [j.id for j in reg.list_jobs(status=(JobStatus.DONE,))] == ["j"]


def test_duplicate_update_returns_duplicate_and_keeps_the_first(reg: Registry) -> None:
    devs = enrol(reg, 2)
    job_with_round(reg, devs)
    delta = {"dense0_weight": np.ones((3, 4), np.float32), "dense0_bias": np.full(3, 0.5, np.float32)}
    common = {"job_id": "job-1", "device_id": devs[0], "round": 1, "wire_bytes": 100, "fp32_bytes": 60}
    assert reg.add_update(**common, num_samples=10, sha256=SHA, deltas=delta) == "inserted"
    assert reg.has_update("job-1", devs[0], 1) and not reg.has_update("job-1", devs[1], 1)
    other = {k: v * 7 for k, v in delta.items()}
    assert reg.add_update(**common, num_samples=99, sha256="cd" * 32, deltas=other) == "duplicate"
    (rec,) = reg.list_updates("job-1", 1)
    assert (rec.num_samples, rec.sha256, rec.status) == (10, SHA, UpdateStatus.PENDING)
    np.testing.assert_array_equal(reg.load_delta(rec)["dense0_weight"], delta["dense0_weight"])
    assert reg.get_round("job-1", 1).participants[devs[0]].status is ParticipantStatus.REPORTED
    assert len(list((reg.state_dir / "updates").rglob("*.npz"))) == 1  # the duplicate left no file


def test_update_for_closed_round_or_stranger_is_not_stored(reg: Registry) -> None:
    devs = enrol(reg, 3)
    job_with_round(reg, devs[:2])
    common = {"job_id": "job-1", "round": 1, "num_samples": 1, "wire_bytes": 1, "fp32_bytes": 4, "sha256": SHA,
              "deltas": HEAD}
    assert reg.add_update(device_id=devs[2], **common) == "not_participant"
    reg.begin_closing("job-1", 1)
    assert reg.add_update(device_id=devs[0], **common) == "round_not_open"
    assert reg.list_updates("job-1") == []
    rnd = reg.get_round("job-1", 1)
    assert rnd.state is RoundState.CLOSING
    assert rnd.dropouts == {devs[0]: "not_dispatched", devs[1]: "not_dispatched"}


def test_restart_mid_round_loses_nothing(tmp_path: Path) -> None:
    clock = Clock()
    reg = Registry(state_dir=tmp_path, clock=clock)
    devs = enrol(reg, 3)
    reg.set_approved(devs[0])
    job_with_round(reg, devs)
    reg.set_participant("job-1", 1, devs[0], ParticipantStatus.DISPATCHED)
    reg.set_participant("job-1", 1, devs[1], ParticipantStatus.DROPPED, "refused:battery_low")
    delta = {"dense0_weight": np.full((3, 4), 0.25, np.float32), "dense0_bias": np.ones(3, np.float32)}
    reg.add_update(job_id="job-1", device_id=devs[0], round=1, num_samples=42, wire_bytes=77, fp32_bytes=60,
                   sha256=SHA, deltas=delta, energy_wh=0.5, metrics={"loss": 0.1})
    reg.close()  # "crash": a new process opens the same state directory
    with Registry(state_dir=tmp_path, clock=clock) as again:
        rnd = again.get_round("job-1", 1)
        assert rnd.state is RoundState.OPEN and rnd.base_version == "1"
        assert {d: p.status for d, p in rnd.participants.items()} == {
            devs[0]: ParticipantStatus.REPORTED, devs[1]: ParticipantStatus.DROPPED,
            devs[2]: ParticipantStatus.SELECTED}
        assert rnd.dropouts == {devs[1]: "refused:battery_low"}
        assert [r.number for r in again.active_rounds()] == [1]
        (rec,) = again.list_updates("job-1", 1)
        assert (rec.num_samples, rec.energy_wh, rec.metrics) == (42, 0.5, {"loss": 0.1})
        np.testing.assert_array_equal(again.load_delta(rec)["dense0_bias"], delta["dense0_bias"])
        assert again.get_device(devs[0]).approved
        assert again.get_job("job-1").budget_wh == 1.5
        assert again.totals("job-1") == {"updates": 1, "wire_bytes": 77, "fp32_bytes": 60, "energy_wh": 0.5,
                                         "accepted": 0}
        # a resend after the restart is still a duplicate
        assert again.add_update(job_id="job-1", device_id=devs[0], round=1, num_samples=1, wire_bytes=1,
                                fp32_bytes=1, sha256=SHA, deltas=delta) == "duplicate"


def test_two_processes_see_each_others_commits(tmp_path: Path) -> None:
    with Registry(state_dir=tmp_path) as serve, Registry(state_dir=tmp_path) as cli:
        (did,) = enrol(serve, 1)
        assert cli.get_device(did).id == did
        cli.set_approved(did)
        assert serve.get_device(did).approved


def test_finish_round_is_one_transaction(reg: Registry) -> None:
    devs = enrol(reg, 2)
    job_with_round(reg, devs)
    reg.add_update(job_id="job-1", device_id=devs[0], round=1, num_samples=3, wire_bytes=1, fp32_bytes=4,
                   sha256=SHA, deltas=HEAD)
    reg.begin_closing("job-1", 1)
    rel, sha = reg.write_head("digits", "job-1-r1", HEAD)
    orphan = ModelVersion(name="digits", version="job-1-r1", parent="no-such-parent", created_at=1.0,
                          bundle_path=None, head_path=rel, head_sha256=sha, head_only=True)
    with pytest.raises(NotFound, match="parent"):
        reg.finish_round("job-1", 1, state=RoundState.AGGREGATED, new_version=orphan,
                         verdicts={devs[0]: (UpdateStatus.ACCEPTED, "")})
    # nothing of the failed transaction is visible: verdicts, round state, model row
    assert reg.list_updates("job-1")[0].status is UpdateStatus.PENDING
    assert reg.get_round("job-1", 1).state is RoundState.CLOSING
    assert [m.version for m in reg.list_models("digits")] == ["1"]
    good = ModelVersion(name="digits", version="job-1-r1", parent="1", created_at=1.0, bundle_path="/b",
                        head_path=rel, head_sha256=sha, head_only=True, job_id="job-1", round=1)
    rnd = reg.finish_round("job-1", 1, state=RoundState.AGGREGATED, new_version=good,
                           verdicts={devs[0]: (UpdateStatus.ACCEPTED, "")})
    assert (rnd.state, rnd.aggregated_version, rnd.ended_at) == (RoundState.AGGREGATED, "job-1-r1", 1_000_000.0)
    assert reg.list_updates("job-1", status=UpdateStatus.ACCEPTED)[0].device_id == devs[0]
    mv = reg.get_model("digits", "job-1-r1")
    assert (mv.parent, mv.head_only, mv.round) == ("1", True, 1)
    np.testing.assert_array_equal(reg.load_head(mv)["dense0_weight"], HEAD["dense0_weight"])
    with pytest.raises(IllegalTransition):  # a finished round stays finished
        reg.finish_round("job-1", 1, state=RoundState.FAILED)


def test_corrupt_delta_file_is_detected(reg: Registry) -> None:
    devs = enrol(reg, 1)
    job_with_round(reg, devs)
    reg.add_update(job_id="job-1", device_id=devs[0], round=1, num_samples=3, wire_bytes=1, fp32_bytes=4,
                   sha256=SHA, deltas=HEAD)
    (rec,) = reg.list_updates("job-1")
    path = reg.state_dir / rec.delta_path
    path.write_bytes(b"\0" * path.stat().st_size)  # what an SD card leaves after power loss
    with pytest.raises(CorruptFileError, match="zero-filled"):
        reg.load_delta(rec)


def test_stored_paths_cannot_leave_the_state_dir(reg: Registry) -> None:
    reg.add_model_version(name="m", version="1", head=HEAD)
    mv = reg.get_model("m", "1")
    evil = ModelVersion(**{**mv.__dict__, "head_path": "../../etc/passwd"})
    with pytest.raises(ConfigError, match="leaves the state directory"):
        reg.load_head(evil)


def test_model_versions_are_immutable(reg: Registry) -> None:
    reg.add_model_version(name="m", version="1", head=HEAD)
    assert reg.add_model_version(name="m", version="1", head=HEAD).version == "1"  # same content: idempotent
    with pytest.raises(IllegalTransition):
        reg.add_model_version(name="m", version="1", head={k: v + 1 for k, v in HEAD.items()})
    np.testing.assert_array_equal(reg.load_head(reg.get_model("m", "1"))["dense0_weight"], HEAD["dense0_weight"])
