"""The demo's per-round report: collected from the coordinator's registry, printed as a
table, saved as JSON and drawn as a PNG (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from ..coordinator.artefacts import ModelArtefacts
from ..coordinator.fleet_views import round_summary
from ..coordinator.registry import Registry


def _mean(values: list[Any]) -> float | None:
    nums = [float(v) for v in values if isinstance(v, int | float) and not isinstance(v, bool) and v == v]
    return round(statistics.fmean(nums), 4) if nums else None


def collect(reg: Registry, evaluator: Any, *, devices: dict[str, Any]) -> dict[str, Any]:
    """The last job's rounds with accuracy (local and global), bytes, compression, energy."""
    jobs = reg.list_jobs()
    if not jobs:
        raise RuntimeError("the coordinator has no job")
    job = jobs[-1]
    artefacts = ModelArtefacts(reg)
    base = reg.get_model(job.model_name, job.model_version)
    names = {d.id: str(d.state.get("name") or d.id) for d in reg.list_devices()}
    rounds = []
    ran_before: set[str] = set()  # devices that installed an earlier round's version of the model
    for rnd in reg.list_rounds(job.id):
        s = round_summary(reg, rnd)
        accepted = [s["device_metrics"][d] for d in s["accepted"]]
        sent = [p for p in rnd.participants.values() if p.dispatched_at is not None]
        base_mv = reg.get_model(job.model_name, rnd.base_version)
        art, patch = artefacts.archive_for(base_mv), artefacts.patch_for(base_mv)
        # a device that runs a version of the model fetches the head patch (the agent's ModelStore)
        patched = [p for p in sent if patch is not None and p.device_id in ran_before]
        ran_before.update(p.device_id for p in sent)
        new = reg.get_model(job.model_name, rnd.aggregated_version) if rnd.aggregated_version else None
        rounds.append({
            "round": rnd.number, "state": rnd.state.value, "version": rnd.aggregated_version,
            "devices": len(s["accepted"]), "selected": len(s["selected"]),
            "dropouts": {names.get(d, d): why for d, why in s["dropouts"].items()},
            "local_acc_before": _mean([m.get("accuracy_before") for m in accepted]),
            "local_acc_after": _mean([m.get("accuracy_after") for m in accepted]),
            "depths": sorted({int(m["depth"]) for m in accepted if isinstance(m.get("depth"), int)}),
            "global_acc": round(evaluator.accuracy(reg.load_head(new)), 4) if new else None,
            "server_acc": new.metrics.get("accuracy") if new and new.metrics.get("accuracy_source") == "server set"
            else None,
            "aggregator": new.metrics.get("aggregator") if new else None, "reason": rnd.reason,
            "bytes_up": s["wire_bytes"], "bytes_fp32": s["fp32_bytes"],
            "bytes_down": art.size * (len(sent) - len(patched)) + (patch.size * len(patched) if patch else 0),
            "full_bytes_down": art.size * len(sent), "head_patches": len(patched),
            "compression": s["compression"], "energy_wh": s["energy_wh"], "samples": s["samples"],
            "duration_s": round(rnd.ended_at - rnd.started_at, 1) if rnd.ended_at else None,
            "per_device": {names.get(d, d): m for d, m in s["device_metrics"].items()},
        })
    return {"job": job.id, "status": job.status.value, "model": f"{job.model_name}@{job.model_version}",
            "params": job.params, "global_acc_base": round(evaluator.accuracy(reg.load_head(base)), 4),
            "test_samples": int(len(evaluator.y)), "backbone_engine": evaluator.engine,
            "devices": devices, "rounds": rounds}


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _kb(n: int) -> str:
    return f"{n / 1024:.1f} KiB" if n >= 1024 else f"{n} B"


def print_table(report: dict[str, Any]) -> None:
    head = ["round", "devices", "depth", "local acc before", "local acc after", "server set", "global acc",
            "bytes up", "bytes down", "compression", "energy Wh"]
    rows = [["base", "-", "-", "-", "-", "-", _pct(report["global_acc_base"]), "-", "-", "-", "-"]]
    for r in report["rounds"]:
        rows.append([str(r["round"]), f"{r['devices']}/{r['selected']}",
                     ",".join(map(str, r.get("depths") or [])) or "-", _pct(r["local_acc_before"]),
                     _pct(r["local_acc_after"]), _pct(r.get("server_acc")), _pct(r["global_acc"]), _kb(r["bytes_up"]),
                     _kb(r["bytes_down"]),
                     f"x{r['compression']:.1f}" if r["compression"] else "-",
                     f"{r['energy_wh']:.4f}" if r["energy_wh"] is not None else "-"])
    widths = [max(len(x[i]) for x in [head, *rows]) for i in range(len(head))]
    line = "+".join("-" * (w + 2) for w in widths)
    rule = next((r["aggregator"] for r in report["rounds"] if r.get("aggregator")), None)
    print(f"\njob {report['job']} ({report['status']}): model {report['model']}, aggregator {rule or '-'}; "
          f"server set: the version's accuracy on the coordinator's labelled digits (what gates it); "
          f"global acc: on {report['test_samples']} other held-out digits nothing trains or gates on")
    print(line)
    for row in [head, *rows]:
        print(" | ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
        if row is head:
            print(line)
    print(line)
    for r in report["rounds"]:
        for dev, why in r["dropouts"].items():
            print(f"round {r['round']}: {dev} dropped out: {why}")
        if r.get("reason"):
            print(f"round {r['round']}: {r['reason']}")
    full = sum(r["full_bytes_down"] for r in report["rounds"])
    print("bytes down: the whole bundle to a device that has no version of the model yet, else the version's "
          f"patch (manifest, head.params and any int8 prefix re-quantised because weights inside it changed): {_kb(sum(r['bytes_down'] for r in report['rounds']))} in all, "
          f"{_kb(full)} with whole bundles")
    batt = ", ".join(f"{n} {d['battery']:.0f}%->{d['battery_end']:.0f}%" for n, d in report["devices"].items())
    print(f"batteries (simulated {report['battery_wh']} Wh packs, drained at {report['load_w']} W while a training "
          f"process runs, start-up included; the energy column is what the devices' governors metered for the "
          f"training itself): {batt}")


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = [r["round"] for r in report["rounds"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot([0, *rounds], [report["global_acc_base"], *[r["global_acc"] for r in report["rounds"]]], "o-",
              label="global (held-out digits)")
    left.plot(rounds, [r["local_acc_before"] for r in report["rounds"]], "s--", label="local, before training")
    left.plot(rounds, [r["local_acc_after"] for r in report["rounds"]], "^--", label="local, after training")
    left.set(xlabel="round", ylabel="accuracy", title="Accuracy per round", xticks=[0, *rounds])
    left.grid(alpha=0.3)
    left.legend(loc="center right", fontsize="small")
    width = 0.38
    right.bar([x - width / 2 for x in rounds], [r["bytes_up"] for r in report["rounds"]], width, label="bytes up")
    right.bar([x + width / 2 for x in rounds], [r["bytes_down"] for r in report["rounds"]], width,
              label="bytes down (bundle or head patch)")
    right.set(xlabel="round", ylabel="bytes", yscale="log", title="Traffic and energy per round", xticks=rounds)
    twin = right.twinx()
    twin.plot(rounds, [r["energy_wh"] or 0 for r in report["rounds"]], "ko-", label="energy (Wh)")
    twin.set_ylabel("energy reported by devices (Wh)")
    twin.set_ylim(bottom=0)
    lines, labels = right.get_legend_handles_labels()
    more, more_labels = twin.get_legend_handles_labels()
    right.legend(lines + more, labels + more_labels, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3,
                 fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
