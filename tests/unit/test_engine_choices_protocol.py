"""Fleet-shared engine choices on the wire (issue 37): a finetune command's `engine_choices`
parsed strictly into the request (a bad list is bad_params, saying what), none from an
older coordinator; the schemas of the command and the state bound the list before any
entry is parsed; the agent's hello says it reads them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from edge_agent.protocol import (
    Kind,
    Message,
    Topics,
    check_body,
)
from edge_agent.protocol.engine_choice import MAX_SHARED_CHOICES, SharedChoice
from edge_agent.protocol.finetune import BadParams, parse_finetune
from tests.unit.signed_wire import signed_wire

NOW = 1_800_000_000.0
BODY = {"cmd_id": "j-r1", "action": "finetune", "job": "j", "round": 1, "model": "digits", "version": "1"}


def choice(i: int = 0, **change: Any) -> dict[str, Any]:
    return {"kind": f"{i:032x}", "engine": "native", "threads": 4, "batch_size": 32, "latency_ms": 12.5,
            "per_image_cpu_s": 0.0015, "fingerprint": f"{i:064x}", **change}


def test_a_command_without_choices_is_an_older_coordinators() -> None:
    req = parse_finetune(dict(BODY), now=NOW)
    assert req.engine_choices == () and req.relays_choices is False
    assert "engine_choices" not in req.to_params()  # so the device does not report to it


def test_a_commands_choices_are_parsed_and_kept_with_the_job() -> None:
    req = parse_finetune({**BODY, "engine_choices": [choice(1), choice(2, engine="tflite", threads=1)]}, now=NOW)
    assert [type(c) for c in req.engine_choices] == [SharedChoice, SharedChoice]
    assert [(c.kind, c.engine, c.threads) for c in req.engine_choices] == [(f"{1:032x}", "native", 4),
                                                                           (f"{2:032x}", "tflite", 1)]
    assert req.relays_choices is True
    assert req.to_params()["engine_choices"] == [choice(1), choice(2, engine="tflite", threads=1)]  # JSON again
    empty = parse_finetune({**BODY, "engine_choices": []}, now=NOW)  # a coordinator that heard none yet
    assert empty.engine_choices == () and empty.relays_choices and empty.to_params()["engine_choices"] == []


@pytest.mark.parametrize("value, says", [
    ({"kind": "x"}, "not a list"),
    ("[]", "not a list"),
    ([choice(i) for i in range(MAX_SHARED_CHOICES + 1)], f"at most {MAX_SHARED_CHOICES}"),
    ([choice(1), choice(1, engine="tflite")], "a kind appears twice"),
    ([choice(1), "native"], "engine_choices[1]: not an object"),
    ([choice(threads="4")], "threads must be an integer"),
    ([choice(threads=True)], "threads must be an integer"),
    ([choice(threads=4.0)], "threads must be an integer"),
    ([choice(threads=10**30)], "threads must be an integer"),
    ([choice(batch_size=0)], "batch_size must be an integer"),
    ([choice(latency_ms=float("nan"))], "latency_ms must be a positive number"),
    ([choice(latency_ms=float("inf"))], "latency_ms must be a positive number"),
    ([choice(latency_ms=10**400)], "latency_ms must be a positive number"),
    ([choice(latency_ms=-1.0)], "latency_ms must be a positive number"),
    ([choice(per_image_cpu_s=1e308)], "per_image_cpu_s must be a positive number"),
    ([choice(per_image_cpu_s=None)], "per_image_cpu_s must be a positive number"),
    ([choice(kind="F" * 32)], "bad kind"),
    ([choice(kind="0" * 33)], "bad kind"),
    ([choice(engine="native; rm -rf /")], "bad engine"),
    ([choice(engine="x" * 40)], "bad engine"),
    ([choice(fingerprint="ab" * 16)], "bad fingerprint"),
    ([choice(fingerprint=["ab" * 32])], "bad fingerprint"),
    ([{**choice(), "extra": 1}], "expected ["),
    ([{k: v for k, v in choice().items() if k != "engine"}], "expected ["),
])
def test_a_bad_choices_list_is_bad_params_naming_what(value: Any, says: str) -> None:
    with pytest.raises(BadParams) as err:
        parse_finetune({**BODY, "engine_choices": value}, now=NOW)
    assert str(err.value).startswith("engine_choices") and says in str(err.value), err.value


def test_the_schemas_bound_the_list_before_any_entry_is_parsed() -> None:
    full = [choice(i) for i in range(MAX_SHARED_CHOICES)]
    check_body(Kind.CMD, {**BODY, "engine_choices": full})
    state = {"status": "idle", "info": {"battery_pct": 80}}
    check_body(Kind.STATE, {**state, "engine_choices": full})
    # an entry its reader will refuse is the reader's to judge (the rest of a state is kept)
    check_body(Kind.STATE, {**state, "engine_choices": [choice(1), {**choice(2), "threads": "many"}, "native"]})
    for kind, body in ((Kind.CMD, BODY), (Kind.STATE, state)):
        for bad in (full + [choice(99)], {"0": choice()}, "native", None):
            with pytest.raises(ValueError, match="engine_choices must be a list of at most 16 entries"):
                check_body(kind, {**body, "engine_choices": bad})


def test_a_signed_command_and_state_with_choices_travel_and_verify(tmp_path: Path) -> None:
    topics = Topics(fleet="farm", prefix="test/h37")
    w = signed_wire(tmp_path, topics)
    dev, coord, device, verifier = w.dev, w.coord, w.device, w.verifier
    full = [choice(i, latency_ms=123456.123456, per_image_cpu_s=99999.123456789) for i in range(MAX_SHARED_CHOICES)]
    cmd_topic, state_topic = topics.device(dev, "cmd"), topics.device(dev, "state")
    cmd = verifier.open(cmd_topic, coord.control(cmd_topic, Kind.CMD, {**BODY, "engine_choices": full}, ttl=600))
    state = verifier.open(state_topic, device.control(state_topic, Kind.STATE, {
        "status": "idle", "info": {"battery_pct": 80}, "engine_choices": full}, ttl=600))
    assert isinstance(cmd, Message) and isinstance(state, Message), (cmd, state)
    assert parse_finetune(cmd.body).engine_choices == tuple(SharedChoice.from_json(c) for c in full)
    assert state.body["engine_choices"] == full


def test_the_agents_hello_says_it_reads_engine_choices() -> None:
    from edge_agent.agent.state import DeviceState
    from edge_agent.hardware.probe import probe

    root = Path(__file__).resolve().parents[1] / "fixtures/boards/raspberry-pi-4"
    state = DeviceState(sysfs_root=str(root), probe_report=probe(root))
    info = state.hello_info("pi")
    assert info["engine_choices"] is True
    check_body(Kind.HELLO, {"public_key": "A" * 43 + "=", "info": info})
    with pytest.raises(ValueError, match="engine_choices must be true or false"):
        check_body(Kind.HELLO, {"public_key": "A" * 43 + "=", "info": {**info, "engine_choices": "yes"}})
    # the state carries the device's measured choices only when given them (a coordinator that reads them)
    facts = {"status": "idle", "name": "pi"}
    assert "engine_choices" not in state.state_body(facts)
    body = state.state_body(facts, engine_choices=[choice(1)])
    assert body["engine_choices"] == [choice(1)]
    check_body(Kind.STATE, body)
