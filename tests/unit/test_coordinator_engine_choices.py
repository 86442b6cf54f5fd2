"""The coordinator's side of fleet-shared engine choices (issue 37): the latest choice per
device kind, durable in the registry (SQLite here; `make test-pg` runs this file on
PostgreSQL), written only when a report says something new and bounded to MAX_KINDS; taken
from approved devices' states entry by entry (a bad one ignored with one warning naming the
device); relayed in every finetune command to the devices whose hello said they read them;
shown by `edge-coordinator devices`."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edge_agent import keys
from edge_agent.config import public_key_text
from edge_agent.coordinator import registry_choices
from edge_agent.coordinator import registry_db as registry_module
from edge_agent.coordinator.cli import main
from edge_agent.coordinator.registry import MIGRATIONS, Registry
from edge_agent.coordinator.service import Coordinator
from edge_agent.errors import InputError
from edge_agent.protocol import Kind, Message, SequenceCounter, Signer
from edge_agent.protocol.engine_choice import MAX_SHARED_CHOICES, SharedChoice
from tests.unit.test_coordinator_loop import FLEET, device
from tests.unit.test_coordinator_loop import (
    coord as coord,  # the fixture: a Coordinator without a broker
)

T0 = 1_800_000_000.0


def choice(i: int = 0, **change: Any) -> SharedChoice:
    obj = {"kind": f"{i:032x}", "engine": "native", "threads": 4, "batch_size": 32, "latency_ms": 12.5,
           "per_image_cpu_s": 0.0015, "fingerprint": f"{i:064x}", **change}
    return SharedChoice.from_json(obj)


def enrol(reg: Registry, n: int) -> list[str]:
    ids = []
    for _ in range(n):
        key = keys.generate_private_key()
        ids.append(reg.enrol_device(device_id=keys.fingerprint(key), public_key=public_key_text(key), fleet=FLEET,
                                    approved=True).id)
    return ids


def stored(reg: Registry) -> list[tuple[str, str, str, float]]:
    return [(s.choice.kind, s.choice.engine, s.device_id, s.reported_at) for s in reg.engine_choices(limit=1000)]


# ---------------------------------------------------------------- the registry
def test_the_latest_choice_per_kind_is_kept_durably_with_who_measured_it_and_when(tmp_path: Path) -> None:
    with Registry(state_dir=tmp_path) as reg:
        a, b = enrol(reg, 2)
        assert reg.engine_choices() == []
        assert reg.record_engine_choices(a, [choice(1), choice(2, engine="tflite", threads=2)], at=T0) == 2
        assert reg.record_engine_choices(b, [choice(3, latency_ms=7.25)], at=T0 + 10) == 1
        newest = reg.engine_choices()
        assert [(s.choice.kind[-1], s.device_id, s.reported_at) for s in newest] == [
            ("3", b, T0 + 10), ("1", a, T0), ("2", a, T0)]  # newest first (a tie: by kind)
        assert newest[0].choice == choice(3, latency_ms=7.25) and newest[2].choice == choice(2, engine="tflite", threads=2)
        assert [s.choice.kind[-1] for s in reg.engine_choices(limit=1)] == ["3"]
    with Registry(state_dir=tmp_path) as reg:  # a restarted coordinator (or the CLI) reads the same
        assert [s.choice for s in reg.engine_choices()] == [c.choice for c in newest]


def test_a_report_is_written_only_when_it_says_something_new(tmp_path: Path) -> None:
    with Registry(state_dir=tmp_path) as reg:
        a, b = enrol(reg, 2)
        assert reg.record_engine_choices(a, [choice(1)], at=T0) == 1
        assert reg.record_engine_choices(a, [choice(1)], at=T0 + 60) == 0  # its next state: the same
        assert reg.record_engine_choices(b, [choice(1, latency_ms=12.9)], at=T0 + 120) == 0  # another device: noise
        assert stored(reg) == [(choice(1).kind, "native", a, T0)]
        assert reg.record_engine_choices(a, [choice(1, latency_ms=11.0)], at=T0 + 180) == 1  # its own re-measurement
        assert reg.record_engine_choices(b, [choice(1, engine="tflite")], at=T0 + 240) == 1  # another engine: latest wins
        assert stored(reg) == [(choice(1).kind, "tflite", b, T0 + 240)]
        assert reg.record_engine_choices(a, [choice(1)], at=T0 + 200) == 0  # older news (a retained state re-read)
        assert reg.record_engine_choices(b, [choice(1, engine="tflite")], at=T0 + 240 + registry_choices.REFRESH_S) == 1
        assert stored(reg)[0][3] == T0 + 240 + registry_choices.REFRESH_S  # refreshed: still a current kind
        assert reg.record_engine_choices(a, [], at=T0) == 0


def test_at_most_max_kinds_are_kept_the_oldest_dropped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry_choices, "MAX_KINDS", 5)
    with Registry(state_dir=tmp_path) as reg:
        (a,) = enrol(reg, 1)
        for i in range(8):
            reg.record_engine_choices(a, [choice(i)], at=T0 + i)
        assert [k[-1] for k, *_ in stored(reg)] == ["7", "6", "5", "4", "3"]
        reg.record_engine_choices(a, [choice(i) for i in range(10, 13)], at=T0 + 100)
        assert [k[-1] for k, *_ in stored(reg)] == ["a", "b", "c", "7", "6"]


def test_what_the_registry_takes_is_checked(tmp_path: Path) -> None:
    with Registry(state_dir=tmp_path) as reg:
        (a,) = enrol(reg, 1)
        with pytest.raises(InputError, match="at most 16"):
            reg.record_engine_choices(a, [choice(i) for i in range(MAX_SHARED_CHOICES + 1)], at=T0)
        with pytest.raises(InputError, match="SharedChoice"):
            reg.record_engine_choices(a, [choice(1).to_json()], at=T0)  # type: ignore[list-item]
        with pytest.raises(InputError, match="device id"):
            reg.record_engine_choices("a'; DROP TABLE devices; --", [choice(1)], at=T0)
        with pytest.raises(InputError, match="reported at"):
            reg.record_engine_choices(a, [choice(1)], at=float("nan"))
        assert reg.engine_choices() == []


def test_a_row_edited_into_nonsense_is_left_out_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with Registry(state_dir=tmp_path) as reg:
        (a,) = enrol(reg, 1)
        reg.record_engine_choices(a, [choice(1), choice(2)], at=T0)
        with reg.db.tx() as db:
            db.execute("UPDATE engine_choices SET engine = ? WHERE kind = ?", ("rm -rf /", choice(1).kind))
        with caplog.at_level(logging.WARNING):
            assert [s.choice for s in reg.engine_choices()] == [choice(2)]
        assert "bad engine 'rm -rf /'" in caplog.text


def test_a_schema_5_registry_migrates_with_its_devices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert len(MIGRATIONS) >= 6
    monkeypatch.setattr(registry_module, "MIGRATIONS", MIGRATIONS[:5])
    with Registry(state_dir=tmp_path) as old:
        (a,) = enrol(old, 1)
        assert old.schema_version == 5
    monkeypatch.setattr(registry_module, "MIGRATIONS", MIGRATIONS)
    with Registry(state_dir=tmp_path) as reg:
        assert reg.schema_version == len(MIGRATIONS) and reg.get_device(a).approved
        reg.record_engine_choices(a, [choice(1)], at=T0)
        assert stored(reg) == [(choice(1).kind, "native", a, T0)]


# ---------------------------------------------------------------- the serve loop
def open_state(coord: Coordinator, dev: str, signer: Signer, body: dict[str, Any]) -> Message:
    topic = coord.topics.device(dev, "state")
    result = coord.pending.open(topic, signer.control(topic, Kind.STATE, body, ttl=600))
    assert isinstance(result, Message), result
    return result


def test_a_states_choices_are_stored_and_a_bad_one_is_ignored_with_one_warning(
        coord: Coordinator, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    dev, signer = device(coord, tmp_path, "a")
    good = [choice(1).to_json(), choice(2, engine="tflite").to_json()]
    bad = [{**choice(3).to_json(), "threads": "many"}, choice(1, engine="reference").to_json(), "native"]
    with caplog.at_level(logging.WARNING, logger="edge_agent.coordinator.service"):
        coord.handle(open_state(coord, dev, signer, {"status": "idle", "info": {"battery_pct": 77},
                                                     "engine_choices": [good[0], bad[0], bad[1], good[1], bad[2]]}))
    assert {(s.choice.kind, s.choice.engine, s.device_id) for s in coord.registry.engine_choices()} == {
        (choice(1).kind, "native", dev), (choice(2).kind, "tflite", dev)}
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and dev in warnings[0].getMessage(), caplog.text
    assert "3 engine choice(s) ignored" in warnings[0].getMessage() and "threads must be" in warnings[0].getMessage()
    assert coord.registry.get_device(dev).battery_pct == 77  # the rest of the state is taken
    before = coord.registry.engine_choices()
    coord.handle(open_state(coord, dev, signer, {"status": "idle", "info": {"battery_pct": 70}}))  # says none
    assert coord.registry.engine_choices() == before  # kept: another device of the kind may need them


def test_a_quarantined_devices_choices_are_not_relayed(coord: Coordinator, tmp_path: Path) -> None:
    dev, signer = device(coord, tmp_path, "a")
    with coord.registry.db.tx() as db:
        db.execute("UPDATE devices SET quarantined_at = ?, quarantine_reason = 'screened out' WHERE id = ?",
                   (time.time(), dev))
    coord.handle(open_state(coord, dev, signer, {"status": "idle", "engine_choices": [choice(1).to_json()]}))
    assert coord.registry.engine_choices() == []


def test_a_hello_records_whether_the_agent_reads_engine_choices(coord: Coordinator, tmp_path: Path) -> None:
    for name, info in (("new", {"name": "new", "engine_choices": True}), ("old", {"name": "old"})):
        key = keys.generate_private_key()
        dev = keys.fingerprint(key)
        signer = Signer(key=key, topics=coord.topics, sequence=SequenceCounter(path=tmp_path / f"{name}.seq"))
        topic = coord.topics.device(dev, "hello")
        msg = coord.pending.open(topic, signer.control(topic, Kind.HELLO, {"public_key": public_key_text(key),
                                                                           "info": info}, ttl=600))
        assert isinstance(msg, Message), msg
        coord.handle(msg)
        assert coord.registry.get_device(dev).state["engine_choices"] is (name == "new")


def dispatch(coord: Coordinator, monkeypatch: pytest.MonkeyPatch, devices: list[str],
             params: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """One round's dispatch to `devices` (a job of its own); returns each device's signed command body."""
    if not coord.registry.list_models():
        coord.registry.add_model_version(name="digits", version="1", head={"w": np.zeros((2, 3), np.float32)})
    for job in coord.registry.list_jobs():
        coord.engine.cancel_job(job.id, reason="the next test job")
    for d in devices:
        coord.registry.record_state(d, online=True, state={"battery_pct": 90, "on_power": True})
    monkeypatch.setattr(coord.artefacts, "patch_for", lambda mv: None)
    monkeypatch.setattr(coord.artefacts, "full_sha256", lambda mv: "ab" * 32)
    coord._published.add(("digits", "1"))  # (no broker: nothing to publish)
    sent: dict[str, dict[str, Any]] = {}

    def send_many(messages: list[tuple[str, bytes]], timeout: float = 0.0) -> list[bool]:
        for topic, payload in messages:
            sent[coord.topics.parse(topic).device] = json.loads(payload)["body"]
        return [True] * len(messages)

    monkeypatch.setattr(coord.channel, "send_many", send_many)
    coord.engine.start_job(model_name="digits", model_version="1", rounds=1, min_devices=len(devices),
                           deadline_s=600, params=params or {})
    (plan,) = coord.engine.tick().opened
    coord._dispatch(plan)
    assert sorted(sent) == sorted(devices)
    return sent


def test_every_finetune_command_carries_the_stored_choices_to_devices_that_read_them(
        coord: Coordinator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reader, old, fresh = (device(coord, tmp_path, n)[0] for n in ("reader", "old", "fresh"))
    coord.registry.record_state(reader, online=True, state={"engine_choices": True})
    coord.registry.record_state(fresh, online=True, state={"engine_choices": True})
    for i in range(MAX_SHARED_CHOICES + 2):  # more kinds than a command carries
        coord.registry.record_engine_choices(old, [choice(i)], at=T0 + i)
    sent = dispatch(coord, monkeypatch, [reader, old, fresh])
    newest = [choice(i).to_json() for i in range(MAX_SHARED_CHOICES + 1, 1, -1)]
    assert sent[reader]["engine_choices"] == sent[fresh]["engine_choices"] == newest
    assert "engine_choices" not in sent[old]  # its hello did not say it reads them: it would refuse the command
    assert {k: sent[reader][k] for k in ("action", "job", "round", "model", "version")} == {
        "action": "finetune", "job": sent[old]["job"], "round": 1, "model": "digits", "version": "1"}


def test_a_command_with_nothing_stored_says_so_and_one_too_big_carries_fewer(
        coord: Coordinator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reader, _ = device(coord, tmp_path, "reader")
    coord.registry.record_state(reader, online=True, state={"engine_choices": True})
    sent = dispatch(coord, monkeypatch, [reader])
    assert sent[reader]["engine_choices"] == []  # heard none yet: the device still learns it may report
    for i in range(MAX_SHARED_CHOICES):
        coord.registry.record_engine_choices(reader, [choice(i)], at=T0 + i)
    big = {f"note{i}": "x" * 210 for i in range(60)}  # job params that leave room for only a few choices
    sent = dispatch(coord, monkeypatch, [reader], big)
    carried = sent[reader]["engine_choices"]
    assert 0 < len(carried) < MAX_SHARED_CHOICES, len(carried)
    assert carried == [choice(i).to_json() for i in range(15, 15 - len(carried), -1)]  # the newest
    assert sent[reader]["params"]["note59"] == "x" * 210


# ---------------------------------------------------------------- the CLI
def test_devices_shows_one_line_per_kind_and_prints_what_a_command_carries(tmp_path: Path, capsys,
                                                                          new_registry_db) -> None:
    state = tmp_path / "coord"
    with Registry(state_dir=state) as reg:
        a, b = enrol(reg, 2)
        reg.record_state(a, online=True, state={"name": "barn-pi"})
        reg.record_engine_choices(a, [choice(1, latency_ms=12.345)], at=time.time() - 300)
        reg.record_engine_choices(b, [choice(2, engine="tflite", threads=2, batch_size=16)], at=time.time() - 30)
    assert main(["devices", "--state-dir", str(state)]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("  kind ")]
    assert lines == [
        f"  kind {choice(2).kind[:8]}: tflite, 2 thread(s), 12.5 ms/batch of 16; measured by {b}, reported 30 s ago",
        f"  kind {choice(1).kind[:8]}: native, 4 thread(s), 12.3 ms/batch of 32; measured by {a} (barn-pi), "
        "reported 5 min ago"], out
    assert main(["devices", "--engine-choices", "--state-dir", str(state)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == [choice(2, engine="tflite", threads=2, batch_size=16).to_json(), choice(1, latency_ms=12.345).to_json()]
    empty = tmp_path / "empty"
    new_registry_db()  # (PostgreSQL: another database)
    with Registry(state_dir=empty) as reg:
        enrol(reg, 1)
    assert main(["devices", "--state-dir", str(empty)]) == 0
    assert "int8 engines the fleet shares" not in capsys.readouterr().out
