"""A solar fleet on a simulated clock, through the real coordinator (issue 38): the run loop.

The fleet (solar_devices.py: devices, data; solar_weather.py: the truth) is the same in every
run; `simulate` runs one job over it in one mode:

  "sync"   today's rounds: `devices_per_round` of the eligible devices (selection: battery
           now), the round's deadline, the round closes when all reported or at its deadline;
  "async"  the buffered mode (job params mode=async, buffer=K, max_staleness=S), devices
           planning their training into forecast surplus windows (solar_plan.py: the agent's
           `forecast_surplus` + `plan_training`) and eligible only there.

Each 10-minute step, vectorised across the fleet: the battery integrates harvest - load -
training, clipped to [0, capacity]. The agent's decisions:

  * accepting a job: the real `agent.policy.check_finetune` (battery below 40 % and not
    charging: refused, reported to the coordinator as `refused:battery_low`);
  * the governor's battery rule (`BudgetGovernor._blocking`, bound to sysfs readings, so its
    rule is applied here with the same Budget's constants): training pauses when the
    battery reaches the floor -- within the step, at the instant the floor is reached, as
    the real governor checks between training steps of seconds -- and resumes at 45 %; a
    job still paused at its deadline stops (StopReason.DEADLINE);
  * planning (async): on the hour, a free device without a window plans one (windows start
    on the hour: now or a later forecast step); until its start the device's state says it
    refuses jobs (selection's `refuse` key); from its start it accepts until the next hour's
    plan (the window's end, at least an hour), so the coordinator dispatches it when a
    round opens in that hour. A job started late in that hour ends up to 40 min past the
    planned window; the governor's floor still applies.

A device whose battery reaches 0 browns out (offline, its job lost) and comes back at 5 %.
State reports are sparse (a real agent heartbeats; the sim reports only what changes a
selection: crossing the coordinator's min_battery_pct, on/offline, refusing or not), with
the policy's `online_within_s` set past the run so silence is not taken for offline.
Uploads arrive in time order; the coordinator ticks after each accepted one and once a step.
"""

from __future__ import annotations

import heapq
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..agent.policy import Conditions, check_finetune
from ..coordinator.records import NotFound
from ..coordinator.registry import Registry
from ..coordinator.rounds import RoundEngine, RoundPolicy
from ..power.forecast import SurplusForecast
from ..protocol.finetune import FinetuneRequest
from ..updates.wire import UpdateHeader, encode_update
from .poisoning import Model, SimEvidence, hostile, mlp_init
from .solar_devices import HOUR, SolarFleet, device_keys, latency_s
from .solar_plan import Planner, summarise
from .solar_run import SolarRun
from .solar_weather import STEP_S

STEPS_PER_HOUR = int(HOUR // STEP_S)


def _state_dir() -> str:
    return tempfile.mkdtemp(prefix="sim-solar-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)


class _Timer:
    def __init__(self, on: bool) -> None:
        self.on, self.parts = on, {}  # type: ignore[var-annotated]

    def add(self, name: str, t0: float) -> float:
        t = time.perf_counter()
        self.parts[name] = self.parts.get(name, 0.0) + t - t0
        return t


def simulate(fleet: SolarFleet, *, mode: str = "sync", buffer: int = 10, max_staleness: int = 8,
             devices_per_round: int | None = None, min_devices: int = 3, round_deadline_s: float = HOUR,
             params: Mapping[str, Any] | None = None, attack: str | None = None, attackers: float = 0.0,
             days: int | None = None, forecasts: Mapping[tuple[int, int], SurplusForecast] | None = None) -> SolarRun:
    """One job over the fleet's days (or `days`): mode "sync" or "async" (buffer K,
    max_staleness S). `devices_per_round`: sync's default is 10 % of the fleet (at least
    `min_devices`); async's default is none (every eligible device not in flight).
    `params`: more job params (aggregator, server_opt, server_lr, server_momentum...).
    `attackers`: the share of devices sending `attack` (poisoning.hostile) instead of
    their update. `forecasts`: solar_plan.unit_forecasts of the fleet (computed here as
    needed when not given)."""
    wall = time.perf_counter()
    dev, weather, data = fleet.devices, fleet.weather, fleet.data
    n = dev.n
    steps = weather.steps if days is None else min(weather.steps, int(days * 86400 // STEP_S))
    per_round = devices_per_round or (max(min_devices, n // 10) if mode == "sync" else None)
    job_params: dict[str, Any] = {"devices_per_round": per_round} if per_round else {}
    if mode == "async":
        job_params.update(mode="async", buffer=buffer, max_staleness=max_staleness)
    job_params.update(params or {})
    run = SolarRun(mode, dict(job_params))
    ids, pubs = device_keys(n, fleet.seed)
    index = {d: i for i, d in enumerate(ids)}
    n_attack = int(round(attackers * n)) if attack else 0
    hostile_set = set(range(0, n, max(1, n // n_attack))[:n_attack]) if n_attack else set()
    model = Model(data.features, len(data.labels))
    glob = mlp_init(data.features, len(data.labels), fleet.seed)
    rng = np.random.default_rng([fleet.seed, 0x5017, sum(map(ord, mode))])
    clock = [weather.start]
    timer = _Timer(True)
    state = _state_dir()
    cap, floor_wh, resume_wh = dev.battery_wh, dev.floor_wh, dev.resume_wh
    battery = cap * dev.start_pct / 100
    extra_w = dev.train_w - dev.load_w
    planning = mode == "async"
    planner = Planner(dev, weather, steps, forecasts) if planning else None
    try:
        reg = Registry(state_dir=state, clock=lambda: clock[0])
        policy = RoundPolicy(online_within_s=400 * 86400.0, offline_grace_s=0.0)
        min_coord = policy.min_battery_pct
        engine = RoundEngine(registry=reg, policy=policy, clock=lambda: clock[0],
                             evidence=SimEvidence(data, model, True))
        reg.add_model_version(name="sim", version="1", head=glob)
        online = np.ones(n, bool)
        rep = [np.ones(n, bool), np.ones(n, bool), np.zeros(n, bool)]  # what was last reported

        def report(i: int, refuse: bool) -> None:
            pct = 100 * battery[i] / cap[i]
            rep[0][i], rep[1][i], rep[2][i] = online[i], pct >= min_coord, refuse
            run.state_reports += 1
            reg.record_state(ids[i], online=bool(online[i]),
                             state={"battery_pct": round(float(pct), 1), "on_power": False,
                                    "data_samples": len(data.ys[i]),
                                    "refuse": "outside_window" if refuse else None,
                                    "refuse_detail": "waiting for its solar surplus window" if refuse else None})

        # the devices' jobs and windows, as arrays
        active = np.zeros(n, bool)
        paused = np.zeros(n, bool)
        remaining = np.zeros(n)
        deadline = np.zeros(n)
        job_round = np.zeros(n, np.int64)
        job_base: list[str] = [""] * n
        win_start = np.full(n, np.inf)
        win_end = np.full(n, -np.inf)
        next_plan = np.zeros(n)
        for i in range(n):
            reg.enrol_device(device_id=ids[i], public_key=pubs[i], fleet="solar", approved=True)
            report(i, planning)
        job = engine.start_job(model_name="sim", model_version="1", rounds=10000, min_devices=min_devices,
                               deadline_s=round_deadline_s, params=job_params, job_id="solar-sim")
        run.params["aggregator"] = job.params.get("aggregator")
        heads: dict[str, dict[str, np.ndarray]] = {"1": glob}
        run.base_accuracy = model.accuracy(glob, data.test_x, data.test_y)
        # (time, seq, device, payload, samples, label claims)
        arrivals: list[tuple[float, int, int, bytes, int, dict[str, str]]] = []
        seq = 0
        honest_recent: deque[dict[str, np.ndarray]] = deque(maxlen=20)
        train_s_total = 0.0
        ever_below_training = np.zeros(n, bool)
        ever_below_load = np.zeros(n, bool)
        ever_brown = np.zeros(n, bool)
        lowest = battery / cap  # per device: its lowest charge over the run (fraction) and when (step)
        lowest_at = np.zeros(n, np.int64)
        net_now = np.zeros(n)

        def handle(result: Any) -> None:
            for out in result.closed:
                if out.new_version is None:
                    run.failed_rounds += 1
                    continue
                t = time.perf_counter()
                v = out.new_version.version
                heads[v] = reg.load_head(out.new_version)
                run.published += 1
                run.times.append((clock[0] - weather.start) / HOUR)
                run.accuracy.append(model.accuracy(heads[v], data.test_x, data.test_y))
                run.energy_wh.append(train_s_total * extra_w / HOUR)
                timer.add("evaluate", t)
            for plan in result.opened:  # the command reaches every online device (the transport's part)
                engine.record_dispatches(plan.job_id, plan.round, {
                    d: None if online[index[d]] else "offline" for d in plan.devices})
                for did in plan.devices:
                    if online[index[did]]:
                        dispatch(plan, index[did])

        def dispatch(plan: Any, i: int) -> None:
            pct = 100 * battery[i] / cap[i]
            req = FinetuneRequest(plan.job_id, plan.round, "sim", plan.model_version, None, None, None, None,
                                  plan.deadline_at)
            verdict = check_finetune(req, dev.limits, Conditions(battery_pct=pct, charging=bool(net_now[i] > 0)),
                                     active=[], accepted_last_day=0, now=clock[0])
            if active[i] or not verdict.accept:
                run.refused_battery += verdict.reason == "battery_low"
                engine.record_dropout(plan.job_id, plan.round, ids[i], f"refused:{verdict.reason or 'busy'}")
                return
            active[i], paused[i] = True, False
            remaining[i], deadline[i] = float(dev.job_s[i]), req.deadline_at
            job_round[i], job_base[i] = plan.round, plan.model_version
            win_start[i], win_end[i] = np.inf, -np.inf  # the window is used; the next is planned after this job

        def give_up(i: int, why: str) -> None:
            """The agent tells the coordinator its job stopped (a dropout of the round that
            dispatched it, or of the round carrying it: the engine's part)."""
            try:
                engine.record_dropout(job.id, int(job_round[i]), ids[i], why)
            except NotFound:
                pass

        def finish(i: int, t_done: float) -> None:
            nonlocal seq
            t = time.perf_counter()
            delta = model.local_update(heads[job_base[i]], data.xs[i], data.ys[i],
                                       fleet.seed * 100003 + i * 131 + int(job_round[i]))
            t = timer.add("train", t)
            header = UpdateHeader("sim", job_base[i], job.id, ids[i], int(job_round[i]))
            samples = len(data.ys[i])
            if i in hostile_set:
                honest = list(honest_recent) or [delta]
                payload, samples = hostile(attack, delta, honest, header, samples, int(job_round[i]), n,  # type: ignore[arg-type]
                                           n_attack)
            else:
                honest_recent.append(delta)
                payload = encode_update(header, delta, density=1.0, bits=8)
            claims = model.claims(heads[job_base[i]], data.xs[i], data.ys[i])
            timer.add("encode", t)
            seq += 1
            heapq.heappush(arrivals, (t_done + latency_s(rng), seq, i, payload, samples, claims))

        handle(engine.tick())
        for step in range(steps):
            t = time.perf_counter()
            t0 = weather.start + step * STEP_S
            t1 = t0 + STEP_S
            clock[0] = max(clock[0], t0)
            harvest = weather.panel_w(dev.panel_w, dev.sites.cluster, step)
            run.harvest_wh += float(harvest.sum()) * STEP_S / HOUR
            net = (harvest - dev.load_w) * STEP_S / HOUR  # Wh over the step without training
            net_now[:] = net
            # the governor: resume at 45 %, pause at the floor (also within the step)
            live = active & online
            paused[live & paused & (battery >= resume_wh)] = False
            hit = live & ~paused & (battery <= floor_wh + 1e-9)
            paused[hit] = True
            runs = live & ~paused
            want = np.where(runs, np.minimum(remaining, STEP_S), 0.0)
            need = extra_w * want / HOUR
            avail = battery + net - floor_wh
            frac = np.where(need <= avail, 1.0, np.clip(avail / np.maximum(need, 1e-12), 0.0, 1.0))
            trained = want * frac
            short = runs & (frac < 1.0)
            paused[short] = True
            run.floor_pauses += int(hit.sum() + short.sum())
            without = battery + net
            battery = np.clip(without - extra_w * trained / HOUR, 0.0, cap)
            without = np.clip(without, 0.0, cap)
            train_s_total += float(trained.sum())
            below = battery < floor_wh - 1e-6
            lower = battery / cap < lowest
            lowest[lower], lowest_at[lower] = battery[lower] / cap[lower], step
            ever_below_training |= below & (trained > 0) & (without >= floor_wh - 1e-6)
            ever_below_load |= below
            remaining -= trained
            done = active & (remaining <= 1e-6)
            late = active & ~done & (t1 >= deadline)
            run.jobs_abandoned += int(late.sum())
            active &= ~(done | late)
            for i in np.nonzero(late)[0]:
                give_up(int(i), "stopped: deadline (paused at the battery floor)")
            t = timer.add("battery", t)
            for i in np.nonzero(done)[0]:
                finish(int(i), t1)
            t = time.perf_counter()
            dead = online & (battery <= 1e-9)
            if dead.any():
                ever_brown |= dead
                online &= ~dead
                run.jobs_abandoned += int((active & dead).sum())
                for i in np.nonzero(active & dead)[0]:
                    give_up(int(i), "brown-out: the battery ran empty")
                active &= ~dead
                for i in np.nonzero(dead)[0]:
                    report(int(i), planning)
            online |= ~online & (battery >= 0.05 * cap)
            t = timer.add("battery", t)
            # the step's uploads, in time order
            while arrivals and arrivals[0][0] < t1:
                when, _, i, payload, samples, claims = heapq.heappop(arrivals)
                clock[0] = max(clock[0], when)
                run.updates_sent += 1
                receipt = engine.receive_update(payload, sender=ids[i], num_samples=samples,
                                                metrics=claims)
                t = timer.add("receive", t)
                if receipt.status == "rejected":
                    key = receipt.reason.split(":")[0]
                    run.rejected[key] = run.rejected.get(key, 0) + 1
                else:
                    run.accepted += 1
                    handle(engine.tick())
                t = timer.add("tick", t)
            clock[0] = max(clock[0], t1)
            # what the devices tell the coordinator
            refuse = np.zeros(n, bool)
            if planner is not None:
                on_hour = (step + 1) % STEPS_PER_HOUR == 0 and step + 1 < steps
                expired = win_end <= t1
                win_start[expired], win_end[expired] = np.inf, -np.inf
                if on_hour:
                    todo = online & ~active & ~np.isfinite(win_start) & (next_plan <= t1)
                    for i in np.nonzero(todo)[0]:
                        w = planner.plan(int(i), step + 1, float(battery[i]), float(floor_wh[i]))
                        if w is None:
                            next_plan[i] = t1 + 3 * HOUR
                        else:  # accepting from the window's start until the next refresh (on the hour)
                            win_start[i], win_end[i] = w.start, max(w.end, w.start + HOUR)
                            next_plan[i] = win_end[i]
                    t = timer.add("plan", t)
                refuse = active | ~((win_start <= t1) & (t1 < win_end))
            ok = 100 * battery / cap >= min_coord
            for i in np.nonzero((online != rep[0]) | (ok != rep[1]) | (refuse != rep[2]))[0]:
                report(int(i), bool(refuse[i]))
            t = timer.add("report", t)
            handle(engine.tick())
            timer.add("tick", t)
        run.train_energy_wh = train_s_total * extra_w / HOUR
        run.below_floor_training = int(ever_below_training.sum())
        run.below_floor_load = int(ever_below_load.sum())
        run.brownouts = int(ever_brown.sum())
        run.lowest_pct = (100 * lowest).tolist()
        run.lowest_at_h = (lowest_at * STEP_S / HOUR).tolist()
        if planner is not None:
            run.forecast, run.forecasts = summarise(planner.errors), planner.forecasts
        reg.close()
    finally:
        shutil.rmtree(state, ignore_errors=True)
    run.wall_s = time.perf_counter() - wall
    run.profile = {k: round(v, 2) for k, v in timer.parts.items()}
    return run
