"""What the dashboard pages show, read from the registry (no HTTP, no HTML here).

Each function takes a (read-only) `Registry` and returns plain dicts for the templates and
the JSON endpoints. The figures are the CLI's own: `fleet_views.round_summary` for a round,
`fleet_views.devices_json` for a device, so `edge-coordinator status` and the page agree.
Nothing here returns key material: devices are shown by id, name and enrolment code only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..coordinator import fleet_views
from ..coordinator.artefacts import ModelArtefacts
from ..coordinator.records import IN_FLIGHT, Device, ModelVersion, NotFound, RoundState
from ..coordinator.registry import Registry
from ..coordinator.rounds import RoundPolicy
from ..protocol.topics import patch_version

# sortable fleet columns -> key on a row dict (None sorts last whichever the direction)
SORT_KEYS = ("name", "id", "state", "online", "battery", "board", "engine", "energy", "last_seen", "approved")
STATE_FILTERS = ("all", "online", "offline", "training", "pending")
DASH = "—"
HISTORY_WINDOW_S = 86400.0  # the device page's battery / power chart: the last day


def start_of_day(now: float) -> float:
    """Local midnight before `now` (the day an energy budget counts)."""
    t = time.localtime(now)
    return time.mktime((t.tm_year, t.tm_mon, t.tm_mday, 0, 0, 0, 0, 0, -1))


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) else None


def _power_source(dev: Device) -> str:
    if dev.state.get("charging"):
        return "charging"
    if dev.on_power is True:
        return "mains"
    if dev.on_power is False:
        return "battery"
    return DASH


def _budget_of_devices(reg: Registry) -> dict[str, float]:
    """Each device's energy budget: `budget_wh` of the newest job it was selected for."""
    budget_of_job = {j.id: _num(j.params.get("budget_wh")) for j in reg.list_jobs()}
    newest = reg.newest_job_of_devices()
    return {dev: b for dev, job in newest.items() if (b := budget_of_job.get(job)) is not None}


_codes: dict[str, str] = {}


def _enrolment_code(dev: Device) -> str:
    """fleet_views.enrolment_code, remembered per public key (a hash per row per refresh adds up)."""
    code = _codes.get(dev.public_key)
    if code is None:
        if len(_codes) > 100_000:
            _codes.clear()
        code = _codes[dev.public_key] = fleet_views.enrolment_code(dev)
    return code


def device_row(dev: Device, *, now: float, policy: RoundPolicy, used_today: float | None,
               budget: float | None) -> dict[str, Any]:
    online = dev.is_online(now, policy.online_within_s)
    status = str(dev.state.get("status") or "unknown")
    training = status == "busy" and dev.state.get("job_phase") not in (None, "done", "failed")
    return {
        "id": dev.id, "code": _enrolment_code(dev), "name": str(dev.state.get("name") or ""),
        "approved": dev.approved, "online": online, "state": "pending" if not dev.approved else
        ("offline" if not online else ("training" if training else status)),
        "activity": fleet_views._activity(dev), "last_seen": dev.last_seen,
        "last_seen_text": fleet_views.ago(dev.last_seen, now),
        "board": dev.board or dev.profile or DASH, "profile": dev.profile or DASH, "engine": dev.engine or DASH,
        "battery": dev.battery_pct, "power": _power_source(dev), "energy_today": used_today,
        "budget": budget, "job": dev.state.get("job"), "tags": list(dev.tags),
    }


def fleet(reg: Registry, *, policy: RoundPolicy, now: float, q: str = "", state: str = "all",
          sort: str = "name", desc: bool = False) -> dict[str, Any]:
    """The fleet table: every device (filtered by `q` and `state`, sorted), and the counts."""
    devices = reg.list_devices()
    used = reg.energy_by_device(since=start_of_day(now))
    budgets = _budget_of_devices(reg)
    rows = [device_row(d, now=now, policy=policy, used_today=used.get(d.id), budget=budgets.get(d.id))
            for d in devices]
    counts = {"devices": len(rows), "online": sum(r["online"] for r in rows),
              "training": sum(r["state"] == "training" for r in rows),
              "pending": sum(not r["approved"] for r in rows)}
    needle = q.strip().lower()[:64]
    if needle:
        rows = [r for r in rows if any(needle in str(r[k]).lower() for k in ("id", "name", "board", "engine", "code"))
                or any(needle in t.lower() for t in r["tags"])]
    if state == "online":
        rows = [r for r in rows if r["online"]]
    elif state in ("offline", "training", "pending"):
        rows = [r for r in rows if r["state"] == state]
    key = {"battery": "battery", "energy": "energy_today"}.get(sort, sort)
    present = [r for r in rows if r[key] is not None]
    present.sort(key=lambda r: (r[key], r["id"]), reverse=desc)
    rows = present + [r for r in rows if r[key] is None]
    return {"rows": rows, "counts": counts, "now": now}


def rounds(reg: Registry) -> dict[str, Any]:
    """Every job with its rounds' figures, and the series the charts draw across rounds."""
    jobs = []
    series: dict[str, list[Any]] = {k: [] for k in ("label", "acc_before", "acc_after", "global_acc", "bytes_up",
                                                    "compression", "energy_wh", "reporting", "dropped")}
    for job in reversed(reg.list_jobs()):  # newest first
        out = []
        for rnd in reg.list_rounds(job.id):
            s = fleet_views.round_summary(reg, rnd)
            metrics = s["device_metrics"]
            before = _mean(m.get("accuracy_before") for m in metrics.values())
            after = _mean(m.get("accuracy_after") for m in metrics.values())
            new = _model(reg, job.model_name, s["new_version"])
            glob = _num(new.metrics.get("global_acc")) if new else None
            eps = _num(new.metrics.get("dp_epsilon")) if new else None  # a private job's epsilon at this version
            row = {**s, "acc_before": before, "acc_after": after, "global_acc": glob, "dp_epsilon": eps,
                   "screened": s["rejected"], "open": rnd.state in (RoundState.OPEN, RoundState.CLOSING)}
            out.append(row)
        jobs.append({"job": job, "rounds": out, "privacy": fleet_views.privacy_summary(reg, job)})
    for entry in reversed(jobs):  # the charts run oldest to newest
        for r in entry["rounds"]:
            series["label"].append(f"r{r['round']}" if len(jobs) == 1 else f"{entry['job'].id[:10]} r{r['round']}")
            series["acc_before"].append(r["acc_before"])
            series["acc_after"].append(r["acc_after"])
            series["global_acc"].append(r["global_acc"])
            series["bytes_up"].append(r["wire_bytes"])
            series["compression"].append(r["compression"])
            series["energy_wh"].append(r["energy_wh"])
            series["reporting"].append(len(r["reported"]))
            series["dropped"].append(len(r["dropouts"]))
    return {"jobs": jobs, "series": series}


def _mean(values: Any) -> float | None:
    nums = [v for v in (_num(x) for x in values) if v is not None]
    return sum(nums) / len(nums) if nums else None


def _model(reg: Registry, name: str, version: str | None) -> ModelVersion | None:
    if not version:
        return None
    try:
        return reg.get_model(name, version)
    except NotFound:  # a version named by a round but not (yet) visible
        return None


def _file_size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def models(reg: Registry) -> list[dict[str, Any]]:
    """Model versions with lineage and sizes: the archive and, for head-only versions, the
    head patch devices download (as built by the coordinator; "—" until it was published)."""
    out = []
    files = ModelArtefacts(reg)  # where the coordinator writes them (paths only: nothing is built)
    for mv in reg.list_models():
        archive = _num(mv.metrics.get("archive_bytes")) or _file_size(files.archive_path(mv.name, mv.version))
        patch = _file_size(files.archive_path(mv.name, patch_version(mv.version))) if mv.head_only else None
        out.append({"name": mv.name, "version": mv.version, "parent": mv.parent, "job": mv.job_id,
                    "round": mv.round, "created_at": mv.created_at, "kind": "head-only" if mv.head_only else "bundle",
                    "archive_bytes": archive, "patch_bytes": patch, "head_sha256": mv.head_sha256,
                    "archive_sha256": mv.metrics.get("archive_sha256"), "updates": mv.metrics.get("updates"),
                    "samples": mv.metrics.get("samples"), "aggregator": mv.metrics.get("aggregator")})
    return out


def device(reg: Registry, device_id: str, *, policy: RoundPolicy, now: float) -> dict[str, Any]:
    """One device: its row, every round it joined (status, reason, update), its refusals,
    the energy and accuracy it reported per round, and its battery / power over the last day."""
    dev = reg.get_device(device_id)  # NotFound (an InputError) for an unknown id
    used = reg.energy_by_device(since=start_of_day(now)).get(dev.id)
    row = device_row(dev, now=now, policy=policy, used_today=used, budget=_budget_of_devices(reg).get(dev.id))
    joined = reg.participations(dev.id)
    # an asynchronous round's device still training when it closed did not refuse anything
    refusals = [p for p in joined if p["status"] == "dropped" and not str(p["reason"]).startswith(IN_FLIGHT)]
    jobs = sorted({p["job_id"] for p in joined})
    history = [{"label": f"{p['job_id']} r{p['round']}", "energy_wh": p["energy_wh"],
                "acc_before": _num(p["metrics"].get("accuracy_before")),
                "acc_after": _num(p["metrics"].get("accuracy_after"))} for p in reversed(joined)]
    samples = [{"at": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h["at"])), "battery_pct": h["battery_pct"],
                "power_w": h["power_w"], "energy_wh": h["energy_wh"]}
               for h in reg.device_history(dev.id, since=now - HISTORY_WINDOW_S)]
    facts = {k: dev.state.get(k) for k in ("battery_pct", "charging", "on_power", "energy_wh", "power_w", "temp_c",
                                           "status", "job", "job_phase", "job_pct", "outbox",
                                           # the local inference service (protocol.schema INFERENCE_CHECKS)
                                           "served_model", "served_kind", "fleet_accuracy", "personal_accuracy",
                                           "held_out", "inference_wh")}
    return {"row": row, "joined": joined, "refusals": refusals, "jobs": jobs, "history": history, "samples": samples,
            "facts": {k: v for k, v in facts.items() if v is not None}, "fleet": dev.fleet,
            "enrolled_at": dev.enrolled_at}


def as_json(value: Any) -> Any:
    """Records and enums as JSON-ready values (the /api endpoints)."""
    if isinstance(value, Mapping):
        return {str(k): as_json(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return [as_json(v) for v in value]
    if hasattr(value, "__dataclass_fields__"):
        return {k: as_json(getattr(value, k)) for k in value.__dataclass_fields__}
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value if value is None or isinstance(value, str | int | float | bool) else str(value)
