"""A solar fleet on a simulated clock, through the real coordinator (issue 38).

Devices (`make_devices`): a location (solar_weather.Sites: clusters of 5 within ~5 km, over
35-60 N, -10..25 E), a panel (30-60 W), a battery (80-180 Wh: 12 V, 7-15 Ah), the Raspberry Pi 4 profile's
power (firmware_configs/raspberry-pi-4.toml: idle 2.7 W is the board's load all day, 6.4 W
while training), a local job of 20 min at full load on the median device (x a per-device
speed factor, lognormal sd 0.35: slower boards, more data; 1.23 Wh above idle) and an
upload latency over a cellular link (lognormal, median 2 min, a heavy tail). Battery floor
35 %, resume 45 % (the real `power.Budget`'s default resume gap), the owner's policy
`min_battery_pct` 40 % (the real `agent.policy.DeviceLimits` default).

Each 10-minute step the battery integrates harvest - load - training, clipped to
[0, capacity], vectorised across the fleet. The agent's decisions:

  * accepting a job: the real `agent.policy.check_finetune` (battery below 40 % and not
    charging: refused, reported to the coordinator as `refused:battery_low`);
  * the governor's battery rule (`BudgetGovernor._blocking`, bound to sysfs readings, so its
    rule is applied here with the same Budget's constants): training pauses when the
    battery reaches the floor -- within the step, at the instant the floor is reached, as
    the real governor checks between training steps of seconds -- and resumes at 45 %; a
    job still paused at its deadline stops (StopReason.DEADLINE);
  * planning (async mode): solar_plan's `forecast_surplus` + `plan_training` (the agent's
    forecast API) choose the next surplus window; outside it the device's state says it
    refuses jobs (selection's `refuse` key), inside it says nothing, so the coordinator
    dispatches it as soon as a round opens.

A device whose battery reaches 0 browns out (offline, its job lost) and comes back at 5 %.
State reports are sparse (a real agent heartbeats; the sim reports only what changes a
selection: crossing the coordinator's min_battery_pct, on/offline, refusing or not), with
the policy's `online_within_s` set past the run so silence is not taken for offline.

Data: the digits cameras and textures of sim/poisoning.py, but each device draws `PER_DEVICE`
(60) samples with its own Dirichlet(1.0) label shares from the training pool -- with 1,000
devices the 1,048 training digits cannot be partitioned, so devices' draws overlap; each
device sees them through its own camera. Test and server sets are poisoning's.

Modes: "sync" -- today's rounds: devices_per_round of the eligible devices, deadline 1 h, the
round closes when all reported or at its deadline; "async" -- the buffered mode (job params
mode=async, buffer=K, max_staleness=S) with devices planning their windows.
"""

from __future__ import annotations

import base64
import functools
import heapq
import shutil
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..agent.policy import Conditions, DeviceLimits, check_finetune
from ..coordinator.registry import Registry
from ..coordinator.rounds import RoundEngine, RoundPolicy
from ..keys import fingerprint, generate_private_key, public_key_bytes
from ..power.budget import Budget
from ..protocol.finetune import FinetuneRequest
from ..updates.wire import UpdateHeader, encode_update
from .digits import apply_camera, camera_params, device_seed, load_digits_images
from .poisoning import (
    SERVER_SAMPLES,
    FleetData,
    Model,
    SimEvidence,
    _split_server,
    _through_cameras,
    hostile,
    mlp_init,
    texture_fleet,
)
from .solar_plan import SolarSite, forecast_surplus, plan_training
from .solar_weather import STEP_S, Sites, Weather, make_sites, make_weather

PER_DEVICE = 60
START = 1_711_929_600.0  # 2024-04-01 00:00 UTC
HOUR = 3600.0


# ---------------------------------------------------------------- the devices' hardware
@functools.cache
def pi4_power() -> tuple[float, float]:
    """(idle_w, load_w) of the raspberry-pi-4 profile."""
    from ..hardware.profiles import load_profiles, profiles_dir

    prof = load_profiles([profiles_dir() / "raspberry-pi-4.toml"]).profiles["raspberry-pi-4"]
    return float(prof.get("power", "idle_w")), float(prof.get("power", "load_w"))


@dataclass(frozen=True)
class Devices:
    sites: Sites
    lat: np.ndarray
    lon: np.ndarray
    panel_w: np.ndarray
    battery_wh: np.ndarray  # capacity
    start_pct: np.ndarray
    load_w: float
    train_w: float
    job_s: np.ndarray  # a local job's duration at full load
    budget: Budget  # floor / resume
    limits: DeviceLimits  # the owner's policy (min_battery_pct)

    @property
    def n(self) -> int:
        return int(len(self.panel_w))

    @property
    def floor_wh(self) -> np.ndarray:
        return self.battery_wh * float(self.budget.battery_floor_pct) / 100  # type: ignore[arg-type]

    @property
    def resume_wh(self) -> np.ndarray:
        return self.battery_wh * float(self.budget.battery_resume_pct) / 100  # type: ignore[arg-type]

    def job_extra_wh(self) -> np.ndarray:
        return (self.train_w - self.load_w) * self.job_s / HOUR


def make_devices(n: int, *, seed: int = 0, job_min: float = 20.0) -> Devices:
    rng = np.random.default_rng([seed, 0xDE71])
    sites = make_sites(n, seed=seed)
    lat, lon = sites.device_latlon(seed)
    idle, load = pi4_power()
    return Devices(sites, lat, lon, rng.uniform(30, 60, n), rng.uniform(80, 180, n), rng.uniform(50, 90, n),
                   idle, load, job_min * 60 * np.exp(rng.normal(0, 0.35, n)),
                   Budget(battery_floor_pct=35.0), DeviceLimits(min_battery_pct=40.0, data_dir="/"))


def latency_s(rng: np.random.Generator) -> float:
    """Upload over a cellular link: lognormal, median 2 min; 5 % wait for a lost link (~40 min)."""
    base = 120.0 * float(np.exp(rng.normal(0, 0.8)))
    return base + (float(rng.exponential(2400.0)) if rng.random() < 0.05 else 0.0)


# ---------------------------------------------------------------- the data
def digits_overlapping(n: int, *, seed: int = 0, per_device: int = PER_DEVICE, alpha: float = 1.0) -> FleetData:
    """Digits for any number of devices: held-out test (449) and server (SERVER_SAMPLES) as
    poisoning.digits_fleet, each device `per_device` draws from the remaining pool with its
    own Dirichlet label shares (without replacement within a device; devices overlap)."""
    images, labels = load_digits_images()
    perm = np.random.default_rng([seed, 0x7E57]).permutation(len(labels))
    test_idx, srv_idx, pool = perm[:449], perm[449:449 + SERVER_SAMPLES], perm[449 + SERVER_SAMPLES:]
    by_class = [pool[labels[pool] == c] for c in range(10)]
    rng = np.random.default_rng([seed, 0xD161])
    cams = [camera_params(device_seed(seed, d)) for d in range(n)]
    xs, ys = [], []
    for d in range(n):
        share = rng.dirichlet([alpha] * 10)
        counts = rng.multinomial(per_device, share)
        idx = np.concatenate([rng.choice(by_class[c], size=min(k, len(by_class[c])), replace=False)
                              for c, k in enumerate(counts) if k])
        xs.append(apply_camera(images[idx], cams[d]).reshape(len(idx), -1))
        ys.append(labels[idx])
    flat = lambda idx: _through_cameras(images[idx], cams, apply_camera).reshape(len(idx), -1)  # noqa: E731
    return FleetData("digits", [str(i) for i in range(10)], xs, ys, flat(test_idx), labels[test_idx],
                     _split_server(flat(srv_idx), labels[srv_idx], 10))


def fleet_data(name: str, n: int, *, seed: int = 0) -> FleetData:
    if name == "digits":
        return digits_overlapping(n, seed=seed)
    return texture_fleet(n, seed=seed, per_device=PER_DEVICE)


# ---------------------------------------------------------------- keys
@functools.lru_cache(maxsize=4)
def device_keys(n: int) -> tuple[list[str], list[str]]:
    keys = [generate_private_key() for _ in range(n)]
    return [fingerprint(k) for k in keys], [base64.b64encode(public_key_bytes(k)).decode() for k in keys]


# ---------------------------------------------------------------- a fleet and a run
@dataclass(frozen=True)
class SolarFleet:
    devices: Devices
    weather: Weather
    data: FleetData
    seed: int

    @property
    def n(self) -> int:
        return self.devices.n


def make_fleet(n: int, *, days: int = 14, data: str = "digits", seed: int = 0, start: float = START) -> SolarFleet:
    devices = make_devices(n, seed=seed)
    return SolarFleet(devices, make_weather(devices.sites, start, days, seed=seed), fleet_data(data, n, seed=seed), seed)


@dataclass
class SolarRun:
    mode: str
    params: dict[str, Any]
    times: list[float] = field(default_factory=list)  # hours since start, at each published version
    accuracy: list[float] = field(default_factory=list)
    energy_wh: list[float] = field(default_factory=list)  # fleet's training energy (above idle) so far
    base_accuracy: float = 0.0
    published: int = 0
    failed_rounds: int = 0
    updates_sent: int = 0
    accepted: int = 0
    rejected: dict[str, int] = field(default_factory=dict)  # reason -> count
    refused_battery: int = 0
    jobs_abandoned: int = 0  # stopped at a deadline or lost in a brown-out
    below_floor_training: int = 0  # devices that went below their floor because of training
    below_floor_load: int = 0  # devices below their floor from the board's load alone
    floor_pauses: int = 0  # training paused at the floor (the governor's rule)
    brownouts: int = 0  # devices whose battery reached 0 (load alone)
    train_energy_wh: float = 0.0
    forecast_harvest_err: list[tuple[float, float]] = field(default_factory=list)  # (forecast, truth) 24-h Wh
    forecast_window_err: list[tuple[float, float]] = field(default_factory=list)  # window surplus Wh
    wall_s: float = 0.0
    state_reports: int = 0
    notes: list[str] = field(default_factory=list)

    def smoothed(self, k: int = 5) -> np.ndarray:
        acc = np.asarray(self.accuracy, np.float64)
        if not len(acc):
            return acc
        c = np.cumsum(np.insert(acc, 0, 0.0))
        idx = np.arange(1, len(acc) + 1)
        lo = np.maximum(0, idx - k)
        return (c[idx] - c[lo]) / (idx - lo)

    def final(self, hours: float = 24.0) -> float:
        """Mean accuracy of the versions published in the last `hours` (the last one if none)."""
        if not self.times:
            return self.base_accuracy
        t = np.asarray(self.times)
        sel = t >= t[-1] - hours
        return float(np.mean(np.asarray(self.accuracy)[sel]))

    def time_to(self, target: float) -> float | None:
        """Hours until the smoothed accuracy first reaches `target`."""
        hit = np.nonzero(self.smoothed() >= target - 1e-9)[0]
        return float(self.times[hit[0]]) if len(hit) else None

    def energy_to(self, target: float) -> float | None:
        hit = np.nonzero(self.smoothed() >= target - 1e-9)[0]
        return float(self.energy_wh[hit[0]]) if len(hit) else None


@dataclass
class _Job:
    round: int
    base: str
    remaining_s: float
    deadline: float
    paused: bool = False


def _state_dir() -> str:
    return tempfile.mkdtemp(prefix="sim-solar-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)


def simulate(fleet: SolarFleet, *, mode: str = "sync", buffer: int = 10, max_staleness: int = 8,
             devices_per_round: int | None = None, min_devices: int = 3, round_deadline_s: float = HOUR,
             attack: str | None = None, attackers: float = 0.0, days: int | None = None) -> SolarRun:
    """One 14-day (or `days`) job over the fleet: mode "sync" (today's rounds) or "async"
    (buffer K, max_staleness S; devices plan their windows). `attackers`: the share of
    devices sending `attack` (poisoning.hostile) instead of their update."""
    wall = time.perf_counter()
    dev, weather, data = fleet.devices, fleet.weather, fleet.data
    n = dev.n
    steps = weather.steps if days is None else min(weather.steps, int(days * 86400 // STEP_S))
    # sync: 10 % of the fleet a round; async: every eligible device not in flight (its own rule)
    per_round = devices_per_round or (max(min_devices, n // 10) if mode == "sync" else None)
    params: dict[str, Any] = {"devices_per_round": per_round} if per_round else {}
    if mode == "async":
        params.update(mode="async", buffer=buffer, max_staleness=max_staleness)
    run = SolarRun(mode, dict(params))
    ids, pubs = device_keys(n)
    index = {d: i for i, d in enumerate(ids)}
    n_attack = int(round(attackers * n)) if attack else 0
    hostile_set = set(range(0, n, max(1, n // n_attack))[:n_attack]) if n_attack else set()
    model = Model(data.features, len(data.labels))
    glob = mlp_init(data.features, len(data.labels), fleet.seed)
    rng = np.random.default_rng([fleet.seed, 0x5017, hash(mode) & 0xFFFF])
    clock = [weather.start]
    state = _state_dir()
    cap, floor_wh, resume_wh = dev.battery_wh, dev.floor_wh, dev.resume_wh
    battery = cap * dev.start_pct / 100
    min_coord = RoundPolicy().min_battery_pct
    try:
        reg = Registry(state_dir=state, clock=lambda: clock[0])
        policy = RoundPolicy(online_within_s=400 * 86400.0, offline_grace_s=0.0)
        engine = RoundEngine(registry=reg, policy=policy, clock=lambda: clock[0],
                             evidence=SimEvidence(data, model, True))
        reg.add_model_version(name="sim", version="1", head=glob)
        online = np.ones(n, bool)

        rep = [np.ones(n, bool), np.ones(n, bool), np.zeros(n, bool)]  # what was last reported

        def report(i: int, *, refuse: bool = False) -> None:
            pct = 100 * battery[i] / cap[i]
            rep[0][i], rep[1][i], rep[2][i] = online[i], pct >= min_coord, refuse
            run.state_reports += 1
            reg.record_state(ids[i], online=bool(online[i]),
                             state={"battery_pct": round(float(pct), 1), "on_power": False,
                                    "data_samples": len(data.ys[i]),
                                    "refuse": "outside_window" if refuse else None,
                                    "refuse_detail": "waiting for its solar surplus window" if refuse else None})

        planning = mode == "async"
        window: list[tuple[float, float] | None] = [None] * n
        next_plan = np.zeros(n)
        for i in range(n):
            reg.enrol_device(device_id=ids[i], public_key=pubs[i], fleet="solar", approved=True)
            report(i, refuse=planning)
        job = engine.start_job(model_name="sim", model_version="1", rounds=10000, min_devices=min_devices,
                               deadline_s=round_deadline_s, params=params)
        heads: dict[str, dict[str, np.ndarray]] = {"1": glob}
        run.base_accuracy = model.accuracy(glob, data.test_x, data.test_y)
        jobs: dict[int, _Job] = {}
        arrivals: list[tuple[float, int, int, bytes, int]] = []  # (time, seq, device, payload, samples)
        seq = 0
        honest_recent: deque[dict[str, np.ndarray]] = deque(maxlen=20)
        train_s_total = 0.0
        ever_below_training = np.zeros(n, bool)
        ever_below_load = np.zeros(n, bool)
        ever_brown = np.zeros(n, bool)

        def handle(result: Any) -> None:
            for out in result.closed:
                if out.new_version is None:
                    run.failed_rounds += 1
                    continue
                v = out.new_version.version
                heads[v] = reg.load_head(out.new_version)
                run.published += 1
                run.times.append((clock[0] - weather.start) / HOUR)
                run.accuracy.append(model.accuracy(heads[v], data.test_x, data.test_y))
                run.energy_wh.append(train_s_total * (dev.train_w - dev.load_w) / HOUR)
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
            verdict = check_finetune(req, dev.limits, Conditions(battery_pct=pct, charging=False), active=[],
                                     accepted_last_day=0, now=clock[0])
            if i in jobs or not verdict.accept:
                run.refused_battery += verdict.reason == "battery_low"
                engine.record_dropout(plan.job_id, plan.round, ids[i], f"refused:{verdict.reason or 'busy'}")
                return
            jobs[i] = _Job(plan.round, plan.model_version, float(dev.job_s[i]), req.deadline_at)
            if planning:
                window[i] = None  # the window is used; the next is planned after this job

        def finish(i: int, j: _Job, t_done: float) -> None:
            nonlocal seq
            base = heads[j.base]
            delta = model.local_update(base, data.xs[i], data.ys[i], fleet.seed * 100003 + i * 131 + j.round)
            header = UpdateHeader("sim", j.base, job.id, ids[i], j.round)
            samples = len(data.ys[i])
            if i in hostile_set:
                honest = list(honest_recent) or [delta]
                payload, samples = hostile(attack, delta, honest, header, samples, j.round, n, n_attack)  # type: ignore[arg-type]
            else:
                honest_recent.append(delta)
                payload = encode_update(header, delta, density=1.0, bits=8)
            seq += 1
            heapq.heappush(arrivals, (t_done + latency_s(rng), seq, i, payload, samples))

        def plan_window(i: int, now: float, step: int) -> None:
            site = SolarSite(float(dev.lat[i]), float(dev.lon[i]), float(dev.sites.alt[dev.sites.cluster[i]]),
                             float(dev.panel_w[i]))
            hist_steps = range(max(0, step - 18), step)
            history = [(weather.start + s * STEP_S, float(truth_w(s)[i])) for s in hist_steps]
            fc = forecast_surplus(site, now=now, battery_wh=float(battery[i]), capacity_wh=float(cap[i]),
                                  floor_wh=float(resume_wh[i]), load_w=dev.load_w, history=history)
            win = plan_training(fc, energy_wh=float(dev.job_extra_wh()[i]), power_w=dev.train_w - dev.load_w,
                                not_before=now)
            s24 = min(steps, step + int(86400 // STEP_S))
            if s24 - step == int(86400 // STEP_S):  # 24 h of truth ahead
                truth = float(sum(truth_w(s)[i] for s in range(step, s24)) * STEP_S / HOUR)
                run.forecast_harvest_err.append((float(sum(fc.panel_w) * fc.step_s / HOUR), truth))
            if win is None:
                next_plan[i] = now + 3 * HOUR
                return
            window[i] = (win.start, win.end)
            next_plan[i] = win.end
            a, b = int((win.start - weather.start) // STEP_S), int((win.end - weather.start) // STEP_S)
            if b <= steps:
                h0 = int((win.start - fc.start) // fc.step_s)
                h1 = max(h0 + 1, int(np.ceil((win.end - fc.start) / fc.step_s)))
                pred = sum(fc.surplus_w()[h0:h1]) * fc.step_s / HOUR
                true = sum(float(truth_w(s)[i]) - dev.load_w for s in range(a, b)) * STEP_S / HOUR
                run.forecast_window_err.append((float(pred), float(true)))

        @functools.lru_cache(maxsize=64)
        def truth_w(step: int) -> np.ndarray:
            return weather.panel_w(dev.panel_w, dev.sites.cluster, step)

        handle(engine.tick())
        for step in range(steps):
            t0 = weather.start + step * STEP_S
            clock[0] = max(clock[0], t0)
            harvest = truth_w(step)
            net = (harvest - dev.load_w) * STEP_S / HOUR  # Wh over the step without training
            extra_w = dev.train_w - dev.load_w
            trained = np.zeros(n)
            for i, j in list(jobs.items()):
                if not online[i]:
                    continue
                if j.paused and battery[i] >= resume_wh[i]:
                    j.paused = False  # the governor's resume
                if not j.paused and battery[i] <= floor_wh[i] + 1e-9:
                    j.paused = True  # the governor's floor
                    run.floor_pauses += 1
                if j.paused:
                    continue
                want = min(j.remaining_s, STEP_S)
                avail = battery[i] + net[i] - floor_wh[i]
                need = extra_w * want / HOUR
                frac = 1.0 if need <= avail else max(0.0, avail / need)
                trained[i] = want * frac
                if frac < 1.0:
                    j.paused = True
                    run.floor_pauses += 1
            without = battery + net
            battery = np.clip(without - extra_w * trained / HOUR, 0.0, cap)
            without = np.clip(without, 0.0, cap)
            train_s_total += float(trained.sum())
            below = battery < floor_wh - 1e-6
            ever_below_training |= below & (trained > 0) & (without >= floor_wh - 1e-6)
            ever_below_load |= below
            for i, j in list(jobs.items()):
                j.remaining_s -= trained[i]
                if j.remaining_s <= 1e-6:
                    del jobs[i]
                    finish(i, j, t0 + STEP_S)
                elif t0 + STEP_S >= j.deadline:
                    del jobs[i]
                    run.jobs_abandoned += 1
            dead = online & (battery <= 1e-9)
            for i in np.nonzero(dead)[0]:
                ever_brown[i] = True
                online[i] = False
                if jobs.pop(int(i), None) is not None:
                    run.jobs_abandoned += 1
                report(int(i), refuse=planning)
            back = ~online & (battery >= 0.05 * cap)
            online |= back
            # the step's uploads, in time order
            t1 = t0 + STEP_S
            while arrivals and arrivals[0][0] < t1:
                when, _, i, payload, samples = heapq.heappop(arrivals)
                clock[0] = max(clock[0], when)
                run.updates_sent += 1
                counts = np.bincount(data.ys[i], minlength=len(data.labels))
                receipt = engine.receive_update(payload, sender=ids[i], num_samples=samples,
                                                metrics={"label_counts": ",".join(str(int(c)) for c in counts)})
                if receipt.status == "rejected":
                    key = receipt.reason.split(":")[0]
                    run.rejected[key] = run.rejected.get(key, 0) + 1
                else:
                    run.accepted += 1
                handle(engine.tick())
            clock[0] = max(clock[0], t1)
            # what the devices tell the coordinator
            busy = np.zeros(n, bool)
            busy[list(jobs)] = True
            refuse = np.zeros(n, bool)
            if planning:
                for i in np.nonzero(online & ~busy & (next_plan <= t1))[0]:
                    if window[i] is None:
                        plan_window(int(i), t1, min(step + 1, steps - 1))
                for i in range(n):
                    w = window[i]
                    if w is not None and t1 >= w[1]:
                        window[i] = None
                        w = None
                    refuse[i] = busy[i] or w is None or not (w[0] <= t1 < w[1])
            ok = 100 * battery / cap >= min_coord
            for i in np.nonzero((online != rep[0]) | (ok != rep[1]) | (refuse != rep[2]))[0]:
                report(int(i), refuse=bool(refuse[i]))
            handle(engine.tick())
        run.train_energy_wh = train_s_total * (dev.train_w - dev.load_w) / HOUR
        run.below_floor_training = int(ever_below_training.sum())
        run.below_floor_load = int(ever_below_load.sum())
        run.brownouts = int(ever_brown.sum())
        reg.close()
    finally:
        shutil.rmtree(state, ignore_errors=True)
    run.wall_s = time.perf_counter() - wall
    return run

