"""Which devices take part in a round: pure functions over `Device` records.

`select_devices` returns the eligible ids and, for every device matching the selector but
left out, the reason (shown by `edge-coordinator train` while it waits, and recorded in a
round that could not start). A job that needs MXNet (`job_needs`: at the job's depth a tail
the agent's numpy trainers cannot train, or `--param trainer=mxnet`) skips devices whose
hello said `mxnet: false` -- 32-bit Raspberry Pi OS has no MXNet wheel; an agent too old to
say is not excluded. `sample_devices` picks a deterministic subset when a job asks for fewer
devices per round than are eligible (seeded by job and round, so a restarted coordinator
picks the same ones).

A device that says in its state it would refuse (`allowance_state`: its daily job limit is
used up until a given time, fine-tuning disabled, no data) is skipped with its own words,
e.g. "refuses jobs: daily limit 48/48, resets 03:00 UTC"; once that time has passed it is
eligible again even before its next state message. Agents that do not send an allowance
are selected as before.

A device that reports a solar forecast (its state's `forecast`, agent.toml [solar]; stored
under the registry state key "forecast" as one line of text, `flat_forecast`, and parsed back
here: an invalid one is ignored) is judged by it when the round has a deadline (`deadline_at`): no
training window that ends by the deadline -- for the round's budget_wh at its power_cap_w,
else the device's own default job -- makes it ineligible ("forecast: no surplus window before
the deadline (next at 09:00 UTC)"); a window makes it eligible even below min_battery_pct now
(it will charge first). Devices without a forecast keep the battery rule.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InputError
from ..power.forecast import STATE_VERSION, SurplusForecast, plan_training
from .records import Device, parse_selector


@dataclass(frozen=True)
class Selection:
    eligible: list[str]
    ineligible: dict[str, str]  # device id -> why not (only devices matching the selector)


# Hello `info` keys that describe what a device can run (edge_agent.doctor.capabilities).


def capabilities_from_hello(info: Mapping[str, Any]) -> dict[str, Any]:
    """The capability keys of a hello's info, type-checked (untrusted input); absent ones are
    left out, so an older agent's device keeps whatever was stored (nothing). Except
    `engine_choices` (the agent reads a finetune command's engine choices): always set, so a
    device whose agent went back to an older version is sent none again."""
    out: dict[str, Any] = {"engine_choices": info.get("engine_choices") is True,
                           "secagg": info.get("secagg") is True}  # (an older agent's: no secure jobs)
    if isinstance(info.get("mxnet"), bool):
        out["mxnet"] = info["mxnet"]
    for key in ("trainers", "native"):
        value = info.get(key)
        if isinstance(value, str) and value.isprintable():
            out[key] = value[:64]
    return out


ALLOWANCE_KEYS = ("jobs_left", "jobs_limit", "jobs_reset_at", "refuse", "refuse_detail")


def allowance_state(facts: Mapping[str, Any]) -> dict[str, Any]:
    """The allowance entries of a state's facts (schema-checked: protocol.schema.
    ALLOWANCE_CHECKS) as registry state keys; every key is present (None when not sent), so
    an older agent's state clears a stale allowance."""
    out = {k: facts.get(k) for k in ALLOWANCE_KEYS}
    out["refuse"] = out["refuse"] or None
    if not (isinstance(out["refuse_detail"], str) and out["refuse_detail"].isprintable()):
        out["refuse_detail"] = None
    return out


def refusal(state: Mapping[str, Any], now: float) -> str:
    """Why a device would refuse a job now by its last state ("" when it would not)."""
    reason, reset = state.get("refuse"), state.get("jobs_reset_at")
    if not reason:
        return ""
    if reason == "daily_limit" and isinstance(reset, int | float) and now >= reset:
        return ""  # its oldest counted job has left the 24-h window since it said so
    return f"refuses jobs: {state.get('refuse_detail') or reason}"


def head_needs_mxnet(head: Mapping[str, Any]) -> bool:
    """For a version registered without a bundle (its tensors are one head, no depths): a
    head the agent's numpy trainer cannot train -- anything but one weight matrix and at
    most one bias (several layers, BatchNorm, convolutions)."""
    shapes = [getattr(a, "ndim", 0) for a in head.values()]
    return not (shapes.count(2) == 1 and shapes.count(1) <= 1 and len(shapes) <= 2)


def job_needs(params: Mapping[str, Any], numpy_depths: Sequence[bool] | None) -> frozenset[str]:
    """What a device must be able to run for this job: {"mxnet"} or nothing.

    `numpy_depths[k]`: whether the model's depth k trains without MXNet (train.depth_plan.
    numpy_depths of its bundle; None when unknown: nothing is required). The job's depth
    decides -- a multi-depth model's deeper tensors do not matter to a `--depth head` job --
    with `auto` (the default) judged at depth 0, where a device's planner lands when no
    deeper depth fits it; `--param trainer=mxnet` needs MXNet at any depth."""
    if params.get("trainer") == "mxnet":
        return frozenset({"mxnet"})
    depth = params.get("depth", "auto")
    k = depth if isinstance(depth, int) and not isinstance(depth, bool) else 0
    if numpy_depths is None or not 0 <= k < len(numpy_depths) or numpy_depths[k]:
        return frozenset()  # (a depth the model lacks: every device refuses it with the reason)
    return frozenset({"mxnet"})


def select_devices(devices: Sequence[Device], selector: str, *, now: float, online_within_s: float,
                   min_battery_pct: float, budget_wh: float | None = None, allow_unknown_power: bool = True,
                   busy: frozenset[str] = frozenset(), job_id: str | None = None,
                   needs: frozenset[str] = frozenset(), deadline_at: float | None = None,
                   power_cap_w: float | None = None) -> Selection:
    """Who may take part in a round: matches the selector ("board:" matches the board or
    the board profile name), approved, online, not busy with another job (`busy`: devices
    in other active rounds; or a reported "busy" state naming another job than `job_id`),
    able to run it (`needs`, against the capabilities in its hello), enough battery (or on
    power) and enough energy for the budget -- or, for a device reporting a solar forecast
    and a round with a deadline (`deadline_at`, epoch s; `power_cap_w` the job's cap), a
    surplus window that ends by the deadline (module doc)."""
    kind, value = parse_selector(selector)
    eligible, ineligible = [], {}
    for dev in sorted(devices, key=lambda d: d.id):
        if (kind == "tag" and value not in dev.tags) or (kind == "board" and value not in (dev.board, dev.profile)):
            continue
        why = _ineligible(dev, now, online_within_s, min_battery_pct, budget_wh, allow_unknown_power, busy, job_id,
                          (deadline_at, power_cap_w))
        if not why and "mxnet" in needs and dev.state.get("mxnet") is False:
            why = "no MXNet on this device (32-bit ARM, or it does not load), and this job trains with MXNet"
        if not why and "secagg" in needs and dev.state.get("secagg") is not True:
            why = "its agent does not do secure aggregation (no secagg in its hello), and this job is secure"
        if why:
            ineligible[dev.id] = why
        else:
            eligible.append(dev.id)
    return Selection(eligible, ineligible)


def _ineligible(dev: Device, now: float, online_within_s: float, min_battery_pct: float,
                budget_wh: float | None, allow_unknown_power: bool, busy: frozenset[str], job_id: str | None,
                job_window: tuple[float | None, float | None] = (None, None)) -> str:
    if not dev.approved:
        return "not approved"
    if not dev.is_online(now, online_within_s):
        seen = "never seen" if dev.last_seen is None else f"last seen {now - dev.last_seen:.0f} s ago"
        return f"offline ({seen})"
    if dev.id in busy or (dev.state.get("status") == "busy" and dev.state.get("job") != job_id):
        return "busy with another job"
    why = refusal(dev.state, now)
    if why:
        return why
    if dev.on_power:
        return ""
    judged = forecast_verdict(dev.state.get("forecast"), now=now, deadline_at=job_window[0], budget_wh=budget_wh,
                              power_cap_w=job_window[1])
    if judged is not None:
        return judged
    if dev.battery_pct is not None and dev.battery_pct < min_battery_pct:
        return f"battery {dev.battery_pct:.0f}% < {min_battery_pct:.0f}%"
    if dev.battery_pct is None and (dev.on_power is False or not allow_unknown_power):
        return "battery level unknown"
    if budget_wh is not None and dev.energy_wh is not None and dev.energy_wh < budget_wh:
        return f"energy {dev.energy_wh:.2f} Wh < budget {budget_wh:.2f} Wh"
    return ""


def forecast_state(body: Mapping[str, Any]) -> dict[str, Any]:
    """The registry state key for a state message's `forecast`: always present, None when
    not sent or invalid, so a device that stops forecasting stops being judged by an old
    one. The registry keeps a device's state flat (short texts and numbers), so the forecast
    is kept as one line of text (`flat_forecast`). For the state handler (service_messages)."""
    value = body.get("forecast")
    if not isinstance(value, Mapping):
        return {"forecast": None}
    try:
        return {"forecast": flat_forecast(SurplusForecast.from_state(value))}
    except InputError:
        return {"forecast": None}  # (untrusted: a bad forecast is ignored, never a reason)


FLAT_TAG = "f1"
FLAT_LIMIT = 256  # the registry's limit on a state text (records.check_flat)


def flat_forecast(forecast: SurplusForecast) -> str | None:
    """`forecast` as one line of at most FLAT_LIMIT characters: a tag, start, step, load,
    battery, capacity, floor, index, training W and Wh (0: unknown), then the hourly surplus
    (W, one decimal, or whole watts if that does not fit). None if even that does not fit."""
    head = (int(round(forecast.start)), int(round(forecast.step_s)), forecast.load_w, forecast.battery_wh,
            forecast.capacity_wh, forecast.floor_wh, forecast.clear_sky_index, forecast.train_w or 0,
            forecast.train_wh or 0)
    for digits in (1, 0):
        text = " ".join([FLAT_TAG, *(format(v, ".6g") for v in head),
                         ",".join(f"{v:.{digits}f}" for v in forecast.surplus_w())])
        if len(text) <= FLAT_LIMIT:
            return text
    return None


def parse_flat_forecast(text: str) -> SurplusForecast:
    """`flat_forecast`'s line back (InputError naming what is wrong: a registry row is data too)."""
    parts = text.split(" ") if isinstance(text, str) and len(text) <= FLAT_LIMIT else []
    if len(parts) != 11 or parts[0] != FLAT_TAG:
        raise InputError(f"stored forecast: not a {FLAT_TAG} line")
    try:
        start, step, load, battery, capacity, floor, index, train_w, train_wh = (float(v) for v in parts[1:10])
        surplus = [float(v) for v in parts[10].split(",")]
    except ValueError:
        raise InputError("stored forecast: a number does not parse") from None
    body: dict[str, Any] = {"v": STATE_VERSION, "start": int(start), "step_s": int(step), "surplus_w": surplus,
                            "load_w": load, "index": index, "battery_wh": battery, "capacity_wh": capacity,
                            "floor_wh": floor}
    if train_w > 0:
        body["train_w"] = train_w
    if train_wh > 0:
        body["train_wh"] = train_wh
    return SurplusForecast.from_state(body)


def forecast_verdict(reported: Any, *, now: float, deadline_at: float | None, budget_wh: float | None,
                     power_cap_w: float | None) -> str | None:
    """None: the forecast does not decide (none, invalid, stale, or no deadline): the battery
    rule applies. "": a window ends by the deadline (eligible). Text: why not."""
    if deadline_at is None or reported is None:
        return None
    try:  # as the registry stores it (a line), or as a state message carries it
        forecast = (parse_flat_forecast(reported) if isinstance(reported, str)
                    else SurplusForecast.from_state(reported))
    except InputError:
        return None  # (untrusted: a bad forecast is ignored, never a reason)
    if now >= forecast.end or forecast.train_w is None:
        return None  # stale, or no idea what the device's training draws
    power = min(forecast.train_w, power_cap_w) if power_cap_w else forecast.train_w
    energy = budget_wh if budget_wh is not None else forecast.train_wh
    if energy is None:
        return None
    try:
        window = plan_training(forecast, energy_wh=energy, power_w=power, not_before=now, deadline=deadline_at)
        if window is not None:
            return ""
        later = plan_training(forecast, energy_wh=energy, power_w=power, not_before=now)
    except InputError:
        return None
    nxt = f"next at {time.strftime('%H:%M', time.gmtime(later.start))} UTC" if later else "none in its forecast"
    return f"forecast: no surplus window before the deadline ({nxt})"


def sample_devices(eligible: Sequence[str], k: int | None, *, seed: str) -> list[str]:
    """A deterministic random subset of k devices (all when k is None or >= len)."""
    if k is None or k >= len(eligible):
        return list(eligible)
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(seed.encode()).digest()[:8], "little"))
    return sorted(rng.choice(list(eligible), size=k, replace=False).tolist())
