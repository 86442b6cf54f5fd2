"""What the fleet commands print: tables and summaries read from the registry (no I/O
besides registry reads; every function returns text or JSON-ready data)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from ..errors import InputError
from ..keys import enrolment_code_of
from ..protocol.engine_choice import MAX_SHARED_CHOICES
from .records import Device, Job, ModelVersion, ParticipantStatus, RoundRecord, UpdateStatus
from .registry import Registry
from .registry_choices import StoredChoice
from .rounds import RoundPolicy
from .selection import refusal


def table(rows: Sequence[Sequence[Any]]) -> str:
    """Rows (the first is the header) as left-aligned columns."""
    text = [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in text) for i in range(len(text[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in text)


def ago(when: float | None, now: float) -> str:
    if when is None:
        return "never"
    s = max(0.0, now - when)
    return f"{s:.0f} s ago" if s < 120 else f"{s / 60:.0f} min ago" if s < 7200 else f"{s / 3600:.1f} h ago"


def _short(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def _battery(dev: Device) -> str:
    if dev.battery_pct is None:
        return "mains" if dev.on_power is not False else "?"
    return f"{dev.battery_pct:.0f}%" + (" chg" if dev.state.get("charging") else "")


def _activity(dev: Device) -> str:
    status = str(dev.state.get("status") or "?")
    phase = dev.state.get("job_phase") if status == "busy" else None
    pct = dev.state.get("job_pct")
    return f"{status} {phase}" + (f" {pct:.0f}%" if isinstance(pct, int | float) and phase == "training" else "") \
        if phase else status


def enrolment_code(dev: Device) -> str:
    """The code the device printed (`edge-agent init` / `run`), to compare before approving."""
    try:
        return enrolment_code_of(dev.public_key)
    except InputError:
        return "?"


def device_rows(devices: Sequence[Device], policy: RoundPolicy, now: float) -> list[list[str]]:
    rows = [["ID", "CODE", "NAME", "APPROVED", "ONLINE", "BATTERY", "BOARD", "ENGINE", "STATE", "JOBS LEFT",
             "LAST SEEN"]]
    for d in devices:
        rows.append([d.id, enrolment_code(d), _short(str(d.state.get("name") or "-"), 16), "yes" if d.approved else "PENDING",
                     "yes" if d.is_online(now, policy.online_within_s) else "no", _battery(d),
                     _short(d.board or d.profile or "?", 30), d.engine or "-", _activity(d), _jobs_left(d, now),
                     ago(d.last_seen, now)])
    return rows


def _jobs_left(dev: Device, now: float) -> str:
    """Today's job allowance the device reported ("-": an agent that does not say)."""
    left, limit = dev.state.get("jobs_left"), dev.state.get("jobs_limit")
    if not isinstance(left, int) or not isinstance(limit, int):
        return "-"
    return f"{left}/{limit}" + (" (refuses)" if refusal(dev.state, now) else "")


def refusal_lines(devices: Sequence[Device], now: float) -> list[str]:
    """One line per approved device whose last state says it would refuse a job, and why
    (round selection skips it: selection.refusal)."""
    out = []
    for d in devices:
        why = refusal(d.state, now) if d.approved else ""
        if why:
            out.append(f"  {d.id} ({_short(str(d.state.get('name') or '-'), 16)}): {why} -- not selected for rounds")
    return out


def devices_json(devices: Sequence[Device], policy: RoundPolicy, now: float) -> list[dict[str, Any]]:
    return [{"id": d.id, "code": enrolment_code(d), "name": d.state.get("name"), "fleet": d.fleet, "approved": d.approved,
             "online": d.is_online(now, policy.online_within_s), "battery_pct": d.battery_pct, "on_power": d.on_power,
             "energy_wh": d.energy_wh, "board": d.board, "profile": d.profile, "engine": d.engine,
             "tags": list(d.tags), "state": d.state, "last_seen": d.last_seen, "enrolled_at": d.enrolled_at,
             "quarantined": d.quarantined, "quarantine_reason": d.quarantine_reason, "strikes": d.strikes}
            for d in devices]


def engine_choice_lines(stored: Sequence[StoredChoice], devices: Sequence[Device], now: float) -> list[str]:
    """One line per device kind: the int8 engine the fleet uses there (what finetune commands
    relay: the newest MAX_SHARED_CHOICES), and who measured it when."""
    names = {d.id: str(d.state.get("name") or "") for d in devices}
    lines = []
    for s in stored[:MAX_SHARED_CHOICES]:
        c, name = s.choice, names.get(s.device_id, "")
        lines.append(f"  kind {c.kind[:8]}: {c.engine}, {c.threads} thread(s), {c.latency_ms:.1f} ms/batch of "
                     f"{c.batch_size}; measured by {s.device_id}" + (f" ({_short(name, 16)})" if name else "")
                     + f", reported {ago(s.reported_at, now)}")
    if len(stored) > MAX_SHARED_CHOICES:
        lines.append(f"  ({len(stored) - MAX_SHARED_CHOICES} older kind(s) stored, not relayed)")
    return lines


def model_rows(models: Sequence[ModelVersion]) -> list[list[str]]:
    rows = [["MODEL", "VERSION", "PARENT", "KIND", "CREATED", "FROM", "UPDATES", "SAMPLES"]]
    for m in models:
        kind = "head-only" if m.head_only else "bundle"
        rows.append([m.name, m.version, m.parent or "-", kind,
                     time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.created_at)),
                     f"{m.job_id} r{m.round}" if m.job_id else "registered", str(m.metrics.get("updates", "-")),
                     str(m.metrics.get("samples", "-"))])
    return rows


def jobs_table(reg: Registry, jobs: Sequence[Job]) -> list[list[str]]:
    rows = [["JOB", "MODEL", "DEVICES", "STATUS", "ROUNDS", "CREATED", "REASON"]]
    for j in jobs:
        rounds = reg.list_rounds(j.id)
        done = sum(r.state.value in ("aggregated", "failed", "cancelled") for r in rounds)
        rows.append([j.id, f"{j.model_name}@{j.model_version}", j.selector, j.status.value, f"{done}/{j.rounds}",
                     time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(j.created_at)), _short(j.reason, 60)])
    return rows


def round_summary(reg: Registry, rnd: RoundRecord) -> dict[str, Any]:
    updates = reg.list_updates(rnd.job_id, rnd.number)
    ok = [u for u in updates if u.status is UpdateStatus.ACCEPTED]
    wire = sum(u.wire_bytes for u in updates)
    fp32 = sum(u.fp32_bytes for u in updates)
    energy = [u.energy_wh for u in updates if u.energy_wh is not None]
    # the share of each delta's energy (squared L2 norm) its update kept, as the device measured it
    kept = [float(u.metrics["energy_kept"]) for u in updates
            if u.status is not UpdateStatus.REJECTED and isinstance(u.metrics.get("energy_kept"), int | float)]
    return {
        "round": rnd.number, "state": rnd.state.value, "base_version": rnd.base_version,
        "new_version": rnd.aggregated_version, "reason": rnd.reason, "started_at": rnd.started_at,
        "ended_at": rnd.ended_at, "selected": rnd.selected,
        "reported": rnd.with_status(ParticipantStatus.REPORTED), "dropouts": rnd.dropouts,
        "accepted": [u.device_id for u in ok],
        "rejected": {u.device_id: u.reason for u in updates if u.status is UpdateStatus.REJECTED},
        "samples": sum(u.num_samples for u in ok), "wire_bytes": wire, "fp32_bytes": fp32,
        "compression": round(fp32 / wire, 2) if wire else None, "energy_wh": round(sum(energy), 6) if energy else None,
        "energy_kept": round(sum(kept) / len(kept), 6) if kept else None,
        "energy_kept_min": round(min(kept), 6) if kept else None,
        "device_metrics": {u.device_id: u.metrics for u in updates},
        "in_flight": rnd.in_flight, "carried_in": rnd.carried_in,
        "staleness": _mean([u.metrics.get("staleness") for u in ok]),
    }


def _mean(values: list[Any]) -> float | None:
    nums = [float(v) for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
    return round(sum(nums) / len(nums), 3) if nums else None


def job_json(reg: Registry, job_id: str) -> dict[str, Any]:
    j = reg.get_job(job_id)
    return {"id": j.id, "model": j.model_name, "version": j.model_version, "selector": j.selector,
            "status": j.status.value, "reason": j.reason, "rounds": j.rounds, "min_devices": j.min_devices,
            "deadline_s": j.deadline_s, "params": j.params, "created_at": j.created_at,
            "round_results": [round_summary(reg, r) for r in reg.list_rounds(job_id)],
            "learning": _learning_json(reg, job_id), "privacy": privacy_summary(reg, j)}


def _learning_json(reg: Registry, job_id: str) -> dict[str, Any] | None:
    from .plateau import job_learning

    return job_learning(reg.state_dir, job_id)


def job_detail(reg: Registry, job_id: str) -> str:
    j = reg.get_job(job_id)
    why = j.params.get("aggregator_default")
    lines = [f"job {j.id}: {j.status.value}" + (f" ({j.reason})" if j.reason else ""),
             f"  model {j.model_name} {j.model_version} on {j.selector}; {j.rounds} round(s), >= {j.min_devices} "
             f"device(s), {j.deadline_s:.0f} s per round; params {j.params}",
             f"  aggregator {j.params.get('aggregator', '?')}" + (f" (the default: {why})" if why else "")
             + ("; server set " + str(j.params["server_set"])[:16] if j.params.get("server_set") else "")]
    if j.params.get("mode") == "async":
        lines.append(f"  asynchronous: a version every {j.params.get('buffer')} accepted update(s), updates at most "
                     f"{j.params.get('max_staleness')} version(s) stale (weighed 1/sqrt(1+s)); rounds count versions")
    lines += _learning_lines(reg, j)
    lines += _privacy_lines(reg, j)
    for rnd in reg.list_rounds(job_id):
        s = round_summary(reg, rnd)
        took = f"{rnd.ended_at - rnd.started_at:.0f} s" if rnd.ended_at else "running"
        lines.append(f"  round {rnd.number} [{rnd.state.value}, {took}] from {rnd.base_version}"
                     + (f" -> {rnd.aggregated_version}{_version_accuracy(reg, j, rnd.aggregated_version)}"
                        if rnd.aggregated_version else "")
                     + (f": {rnd.reason}" if rnd.reason else ""))
        ratio = f", compression x{s['compression']:.1f}" if s["compression"] else ""
        if s["energy_kept"] is not None:
            ratio += (f", kept {100 * s['energy_kept']:.1f} % of the delta energy"
                      + (f" (min {100 * s['energy_kept_min']:.1f} %)" if s["energy_kept_min"] < s["energy_kept"] else ""))
        energy = f", {s['energy_wh']:.4f} Wh" if s["energy_wh"] is not None else ""
        flight = ""
        if s["carried_in"] or s["in_flight"]:
            flight = (f"; {len(s['carried_in'])} still training older versions joined, {len(s['in_flight'])} "
                      "carried on" + (f", mean staleness {s['staleness']:g}" if s["staleness"] is not None else ""))
        lines.append(f"    {len(s['selected'])} selected, {len(s['accepted'])} accepted, {len(s['rejected'])} "
                     f"rejected, {len(s['dropouts'])} dropout(s){flight}; {s['wire_bytes']} bytes up{ratio}{energy}")
        for dev, why in s["dropouts"].items():
            lines.append(f"    dropout {dev}: {why}")
        for dev, why in s["rejected"].items():
            lines.append(f"    rejected {dev}: {why}")
    return "\n".join(lines)


def _version_accuracy(reg: Registry, job: Job, version: str) -> str:
    m = reg.get_model(job.model_name, version).metrics
    eps = f" (epsilon {m['dp_epsilon']:.3g})" if isinstance(m.get("dp_epsilon"), int | float) else ""
    if m.get("accuracy_source") == "server set" and isinstance(m.get("accuracy"), int | float):
        scaled = f", step x{m['step_scale']:g}" if m.get("step_scale", 1.0) != 1.0 else ""
        stood = ", the server's step standing in for distrusted data" if m.get("server_stands_in") else ""
        return (f" ({100 * m['accuracy']:.2f} % on the server set, {m.get('accuracy_samples')} samples{scaled}{stood})"
                f"{eps}")
    return eps


def privacy_summary(reg: Registry, job: Job) -> dict[str, Any] | None:
    """A private job's epsilon so far (every round it opened), its budget, and the newest
    version's lineage epsilon (privacy.py); None for a job that is not private."""
    from .privacy import DpParams, PrivacyLedger, job_summary

    try:
        dp = DpParams.of(job.params)
        if dp is None:
            return None
        rounds = reg.list_rounds(job.id, participants=False)
        out = job_summary(PrivacyLedger(reg.state_dir), dp, job.id, len(rounds))
    except InputError:  # a ledger that no longer reads, or no dp-accounting here
        return None
    newest = next((r.aggregated_version for r in reversed(rounds) if r.aggregated_version), None)
    out["lineage_epsilon"] = reg.get_model(job.model_name, newest).metrics.get("dp_lineage_epsilon") if newest else None
    return out


def _privacy_lines(reg: Registry, job: Job) -> list[str]:
    p = privacy_summary(reg, job)
    if p is None:
        return []
    budget = f" of its budget {p['budget']:g}" if p["budget"] is not None else ""
    lineage = p["lineage_epsilon"]
    return [f"  private (DP-FedAvg, clip {p['clip']:g}, noise x{p['noise']:g}): epsilon {p['epsilon']:.3g}{budget} "
            f"at delta {p['delta']:g} over {p['rounds']} round(s); the newest version's lineage: "
            + (f"epsilon {lineage:.3g}" if isinstance(lineage, int | float) else
               "not private (a job without DP trained it)" if p["rounds"] and lineage is None else "no version yet")]


def _learning_lines(reg: Registry, job: Job) -> list[str]:
    """The best version the job measured (plateau.py), named for what its number is, and a
    rollback suggestion only when the newest measured version is measurably worse."""
    from .plateau import job_learning

    learned = job_learning(reg.state_dir, job.id)
    best = (learned or {}).get("best")
    if not learned or not best:
        return []
    history = learned["history"]  # [version, measured in round, accuracy, samples, smoothed]
    server = any(m.metrics.get("accuracy_source") == "server set" for m in reg.list_models(job.model_name)
                 if m.job_id == job.id)
    what = ("accuracy on the coordinator's server set" if server else
            "device-reported accuracy, smoothed over versions (the plateau rule's moving average of the devices' "
            "validation splits)")
    out = [f"  best version {best['version']}: {100 * best['accuracy']:.2f} % {what}, measured in round "
           f"{best['round']}; {len(history)} version(s) measured"
           + (f"; server lr decayed {learned['decays']}x" if learned["decays"] else "")]
    current = _current_measured(reg, job.model_name, history)
    if current is not None and current[0] != best["version"] and _measurably_worse(best["accuracy"], current):
        out.append(f"  the model's current version ({current[0]}) scored {100 * current[2]:.2f} % on {current[3]} "
                   f"samples, measurably below the best: edge-coordinator models rollback {job.model_name} "
                   f"--to-best {job.id}")
    return out


def _current_measured(reg: Registry, model: str, history: list[Any]) -> list[Any] | None:
    """The history entry of what the model's newest version is (itself, or the version it
    restores or rolls back to); None when that was never measured."""
    by_version = {h[0]: h for h in history}
    newest = reg.list_models(model)
    if not newest:
        return None
    m = newest[-1]
    for name in (m.version, m.metrics.get("restored"), m.metrics.get("rollback_of")):
        if isinstance(name, str) and name in by_version:
            return by_version[name]
    return None


def _measurably_worse(best: float, last: list[Any]) -> bool:
    """More than two standard errors (and half a point) below the best, on the samples measured."""
    acc, samples = float(last[2]), max(1, int(last[3]))
    se = (max(acc * (1 - acc), 1e-4) / samples) ** 0.5
    return best - acc > max(0.005, 2 * se)


def progress_line(reg: Registry, job_id: str, now: float) -> tuple[str, Job]:
    """One line saying where a job is: its current round's counts and its devices' phases."""
    j = reg.get_job(job_id)
    rounds = reg.list_rounds(job_id)
    if not rounds:
        waiting = f": {j.reason}" if j.reason else ""
        return f"[{j.status.value}] waiting to start round 1/{j.rounds}{waiting}", j
    rnd = rounds[-1]
    counts = Counter(p.status.value for p in rnd.participants.values())
    text = (f"[{j.status.value}] round {rnd.number}/{j.rounds} {rnd.state.value}: {len(rnd.participants)} selected, "
            f"{counts['dispatched'] + counts['reported'] + counts['dropped']} dispatched, {counts['reported']} "
            f"reported, {counts['dropped']} dropped")
    if rnd.state.value == "open":
        phases = Counter()
        devices = {d.id: d for d in reg.list_devices()}
        for dev_id, part in rnd.participants.items():
            dev = devices.get(dev_id)
            if part.status is ParticipantStatus.DISPATCHED and dev is not None and dev.state.get("job") == job_id:
                phases[str(dev.state.get("job_phase") or "sent")] += 1
        if phases:
            text += " (" + ", ".join(f"{n} {p}" for p, n in sorted(phases.items())) + ")"
        text += f"; deadline {time.strftime('%H:%M:%S', time.localtime(rnd.deadline_at))}"
    elif rnd.aggregated_version:
        text += f" -> new version {rnd.aggregated_version}"
    elif rnd.reason:
        text += f": {rnd.reason}"
    return text, j
