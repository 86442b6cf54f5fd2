"""The device's own say on a command: each refusal has a reason code and a sentence."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge_agent.agent.policy import (
    REASONS,
    Conditions,
    DeviceLimits,
    check_finetune,
    effective_budget,
)
from edge_agent.protocol.finetune import BadParams, parse_finetune

NOW = 1_800_000_000.0


def _limits(tmp_path: Path, **kw: object) -> DeviceLimits:
    args = dict(accept_finetune=True, min_battery_pct=40.0, max_jobs_per_day=3, energy_wh=2.0, power_cap_w=5.0,
                deadline_s=3600.0, thermal_limit_c=80.0, data_dir=str(tmp_path))
    args.update(kw)
    return DeviceLimits(**args)  # type: ignore[arg-type]


def _body(**params: object) -> dict:
    return {"cmd_id": "c", "action": "finetune", "job": "j", "round": 2, "model": "digits", "version": "3",
            "params": params}


def _check(tmp_path: Path, body: dict, conditions: Conditions | None = None, *, active: list[str] | None = None,
           recent: int = 0, **limits: object):
    lim = _limits(tmp_path, **limits)
    return check_finetune(parse_finetune(body, deadline_s=lim.deadline_s, now=NOW), lim, conditions or Conditions(battery_pct=90),
                          active=active or [], accepted_last_day=recent, now=NOW)


def test_a_reasonable_command_is_accepted_and_resolved_against_the_device(tmp_path: Path) -> None:
    lim = _limits(tmp_path)
    req = parse_finetune(_body(epochs=5, budget_wh=1.5, update_bytes=4096, aggregator="fedavg"), deadline_s=lim.deadline_s, now=NOW)
    assert check_finetune(req, lim, Conditions(battery_pct=55), active=[], accepted_last_day=2, now=NOW).accept
    assert req.local_id == "j-r2" and req.train == {"epochs": 5, "update_bytes": 4096}  # aggregator: ignored
    assert req.deadline_at == NOW + 3600  # no deadline given: the device's own horizon
    assert effective_budget(req, lim) == {"budget_wh": 1.5, "power_cap_w": 5.0}
    later = parse_finetune(_body(deadline=NOW + 99_999), deadline_s=lim.deadline_s, now=NOW)
    assert later.deadline_at == NOW + 3600  # capped at the device's deadline_s


@pytest.mark.parametrize(("body", "conditions", "kw", "reason", "words"), [
    (_body(), None, {"accept_finetune": False}, "finetune_disabled", "accept_finetune = false"),
    (_body(), None, {"data_dir": None}, "no_data", "[data] dir is not set"),
    (_body(), None, {"active": ["other-r1"]}, "busy", "other-r1"),
    (_body(), None, {"recent": 3}, "daily_limit", "the limit is 3"),
    (_body(), Conditions(battery_pct=25, charging=False), {}, "battery_low", "25 % is below 40 %"),
    (_body(), Conditions(battery_pct=90, temp_c=81.0), {}, "too_hot", "81.0 C"),
    (_body(budget_wh=2.5), None, {}, "budget_exceeded", "2.5 Wh"),
    (_body(power_cap_w=9.0), None, {}, "power_cap_exceeded", "9 W"),
    (_body(deadline=NOW - 10), None, {}, "deadline_passed", "10 s ago"),
])
def test_each_refusal_has_its_reason(tmp_path: Path, body: dict, conditions: Conditions | None, kw: dict,
                                     reason: str, words: str) -> None:
    active, recent = kw.pop("active", None), kw.pop("recent", 0)
    verdict = _check(tmp_path, body, conditions, active=active, recent=recent, **kw)
    assert not verdict.accept and verdict.reason == reason and reason in REASONS
    assert words in verdict.detail


def test_charging_overrides_a_low_battery_and_unknown_battery_is_not_low(tmp_path: Path) -> None:
    assert _check(tmp_path, _body(), Conditions(battery_pct=10, charging=True)).accept
    assert _check(tmp_path, _body(), Conditions()).accept


@pytest.mark.parametrize(("body", "words"), [
    ({"cmd_id": "c", "action": "finetune", "job": "j", "model": "m", "version": "1"}, "needs round"),
    (_body(epochs=0), "params.epochs = 0 is outside"),
    (_body(epochs=2.5), "params.epochs must be an integer"),
    (_body(budget_wh=True), "params.budget_wh must be a number"),
    (_body(update_bytes=10), "params.update_bytes = 10 is outside"),
    (_body(lr="fast"), "params.lr must be a number"),
    ({**_body(), "version": "current"}, "version 'current' is reserved"),
])
def test_bad_parameters_are_refused_not_guessed(tmp_path: Path, body: dict, words: str) -> None:
    with pytest.raises(BadParams, match=words.replace(".", r"\.")):
        parse_finetune(body, deadline_s=_limits(tmp_path).deadline_s, now=NOW)
