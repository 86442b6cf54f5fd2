"""The serve loop under hostile input (issue 35, item 2): a message whose handling fails costs
that message only -- no wait before the next device's message, one rate-limited log line
without a traceback -- and a failing tick backs off the ticks, not the intake, until a good
tick resets it. The real Coordinator, registry and signatures; no broker (its receive is fed
from a script, and `stop.wait` records what the loop would have slept)."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from edge_agent import keys
from edge_agent.config import public_key_text
from edge_agent.coordinator.service import Coordinator, ServeOptions
from edge_agent.protocol import Kind, Message, SequenceCounter, Signer

FLEET = "farm"


class RecordingStop(threading.Event):
    """`wait` records how long the loop asked to sleep, and returns at once."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(float(timeout or 0.0))
        return self.is_set()


@pytest.fixture
def coord(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    c = Coordinator(ServeOptions(state_dir=tmp_path / "coord", fleet=FLEET))
    monkeypatch.setattr(c.client, "start", lambda: None)  # no broker: messages come from the script
    yield c
    c.close()


def device(coord: Coordinator, tmp: Path, name: str) -> tuple[str, Signer]:
    key = keys.generate_private_key()
    dev = keys.fingerprint(key)
    coord.registry.enrol_device(device_id=dev, public_key=public_key_text(key), fleet=FLEET, approved=True)
    coord.device_trust.sync()
    return dev, Signer(key=key, topics=coord.topics, sequence=SequenceCounter(path=tmp / f"{name}.seq"))


def state(coord: Coordinator, dev: str, signer: Signer, battery: int) -> Message:
    topic = coord.topics.device(dev, "state")
    result = coord.pending.open(topic, signer.control(topic, Kind.STATE, {"status": "idle", "info": {
        "battery_pct": battery, "on_power": False}}, ttl=600))
    assert isinstance(result, Message), result
    return result


def run_script(coord: Coordinator, script: list[Any], monkeypatch: pytest.MonkeyPatch) -> RecordingStop:
    stop = RecordingStop()
    queue = list(script)

    def receive(timeout: float | None = None) -> Any:
        if not queue:
            stop.set()
            return None
        return queue.pop(0)

    monkeypatch.setattr(coord.channel, "receive", receive)
    assert coord.run(stop) == 0
    return stop


def test_a_device_whose_messages_fail_costs_no_wait_and_no_traceback(coord, tmp_path, monkeypatch, caplog) -> None:
    """Before: each failure slept min(5, 0.2 * errors) with errors never reset: 100 such
    messages stalled the loop ~8 minutes (everyone's intake with it), each with a traceback."""
    hostile, hostile_signer = device(coord, tmp_path, "hostile")
    honest, honest_signer = device(coord, tmp_path, "honest")
    real = coord.registry.record_state

    def record_state(device_id: str, **kw: Any) -> Any:  # what the SQLite overflow did for this device
        if device_id == hostile:
            raise OverflowError("Python int too large to convert to SQLite INTEGER")
        return real(device_id, **kw)

    monkeypatch.setattr(coord.registry, "record_state", record_state)
    script = [state(coord, hostile, hostile_signer, 50) for _ in range(100)] + [state(coord, honest, honest_signer, 77)]
    caplog.set_level(logging.DEBUG, logger="edge_agent")
    stop = run_script(coord, script, monkeypatch)

    assert stop.waits == []  # not one sleep: the honest device's state came straight after
    assert coord.registry.get_device(honest).state["battery_pct"] == 77
    assert coord.errors == 100
    shown = [r for r in caplog.records if r.levelno >= logging.INFO and "not handled" in r.getMessage()]
    assert 1 <= len(shown) <= 20, len(shown)  # rate-limited
    assert hostile in shown[0].getMessage() and "OverflowError" in shown[0].getMessage()
    assert "in record_state" in shown[0].getMessage()  # where it failed, in the one line
    assert not [r for r in caplog.records if r.levelno >= logging.INFO and r.exc_info], "a traceback was logged"
    assert [r for r in caplog.records if r.levelno == logging.DEBUG and r.exc_info]  # kept for -v


def test_failing_ticks_back_off_the_ticks_not_the_intake_and_a_good_tick_resets(coord, tmp_path,
                                                                                 monkeypatch) -> None:
    honest, signer = device(coord, tmp_path, "honest")
    failures = {"left": 3}
    real_tick = coord.engine.tick

    def tick() -> Any:
        if failures["left"]:
            failures["left"] -= 1
            raise OSError(28, "No space left on device")
        return real_tick()

    monkeypatch.setattr(coord.engine, "tick", tick)
    delays = [coord.step_tick() for _ in range(3)]
    assert delays == sorted(delays) and delays[-1] > delays[0] >= coord.options.tick_s  # backing off
    assert coord.tick_failures == 3
    assert coord.step_tick() == coord.options.tick_s and coord.tick_failures == 0  # a good tick: reset
    failures["left"] = 1
    assert coord.step_tick() == delays[0]  # the back-off starts over

    failures["left"] = 10**6  # a tick that never recovers: messages are still taken, without sleeping
    stop = run_script(coord, [state(coord, honest, signer, 64)], monkeypatch)
    assert stop.waits == []
    assert coord.registry.get_device(honest).state["battery_pct"] == 64


def test_the_log_budget_counts_what_it_did_not_show() -> None:
    from edge_agent.coordinator.line_budget import LineBudget

    now = [1000.0]
    budget = LineBudget(per_minute=2, clock=lambda: now[0])
    assert [budget.take() for _ in range(5)] == [(True, 0), (True, 0), (False, 0), (False, 0), (False, 0)]
    now[0] += 61
    assert budget.take() == (True, 3)  # the next line says how many were not shown
    assert time.monotonic() > 0  # (the real clock is the default)
