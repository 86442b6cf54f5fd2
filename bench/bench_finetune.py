"""On-device fine-tuning: this project's int8-backbone + head fine-tune vs full fp32
fine-tuning of the whole network in MXNet, to the same validation accuracy, in one run.

Scenario (edge_agent.train.demo): the digits CNN trained on other devices' clean images is
the base model; each simulated device fine-tunes on its own share seen through its own
camera, stored as raw pixels in an NPZ, with the job's content-hash validation split.

- ours: `run_finetune` in a fresh process (the real job: engine choice, int8 features
  through the feature cache, MXNet head training under the governor), cold cache.
- baseline: a fresh process loads the same base network in fp32 and trains every layer
  with Gluon (Adam) on the same training split, checking validation accuracy after each
  epoch, until it reaches ours (or gives up after MAX_BASELINE_EPOCHS).

Energy uses one power model for both: the Raspberry Pi 4 profile's linear CPU model
(idle 2.7 W, 6.4 W with all 4 cores busy), so energy above idle = (6.4 - 2.7) W x process
CPU seconds / 4. CPU time and peak RSS come from wait4() on each child, so other load on
this shared machine does not leak in. "work" excludes the interpreter + MXNet import that
both processes pay; "process" includes it.
Budget adherence: the job with an energy budget small enough to stop it, measured by the
governor with this machine's own power source; |used - budget| / budget.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_BASELINE_EPOCHS = 60

OURS = textwrap.dedent(r'''
    import json, resource, sys, time, warnings
    warnings.simplefilter("ignore")
    import mxnet  # noqa: F401 - both sides pay the import; measured separately
    from edge_agent.train.job import run_finetune
    cfg = json.loads(sys.argv[1])
    t0 = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    report = run_finetune(**cfg)
    t1 = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"work_cpu_s": (t1.ru_utime + t1.ru_stime) - (t0.ru_utime + t0.ru_stime),
                      "work_wall_s": time.perf_counter() - start,
                      "accuracy": report["accuracy"], "steps": report["steps"], "stop": report["stop_reason"],
                      "energy": report["energy"], "engine": report["engine"]["name"]}))
''')

BASELINE = textwrap.dedent(r'''
    import json, resource, sys, time, warnings
    warnings.simplefilter("ignore")
    import mxnet as mx
    import numpy as np
    from mxnet import autograd, gluon
    from edge_agent.data import load_dataset, split_dataset
    from edge_agent.int8.bundle import load_bundle
    from edge_agent.models import digits_cnn
    cfg = json.loads(sys.argv[1])
    t0 = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    bundle = load_bundle(cfg["model"])
    data = load_dataset(cfg["data"], bundle.manifest.input, bundle.manifest.labels)
    train, val = split_dataset(data, cfg["val_fraction"])
    net = digits_cnn()
    net.load_parameters(cfg["params"])
    mx.random.seed(0)
    trainer = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": cfg["lr"], "wd": 1e-4}, kvstore=None)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    rng = np.random.default_rng(0)

    def accuracy():
        return float((net(mx.nd.array(val.x)).asnumpy().argmax(1) == val.y).mean())

    acc, epochs, steps = accuracy(), 0, 0
    while acc < cfg["target"] - 1e-9 and epochs < cfg["max_epochs"]:
        order = rng.permutation(len(train))
        for i in range(0, len(order), cfg["batch_size"]):
            idx = order[i:i + cfg["batch_size"]]
            with autograd.record():
                loss = loss_fn(net(mx.nd.array(train.x[idx])), mx.nd.array(train.y[idx].astype(np.float32)))
            loss.backward()
            trainer.step(len(idx))
            steps += 1
        epochs += 1
        acc = accuracy()
    t1 = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"work_cpu_s": (t1.ru_utime + t1.ru_stime) - (t0.ru_utime + t0.ru_stime),
                      "work_wall_s": time.perf_counter() - start, "accuracy": acc, "epochs": epochs,
                      "steps": steps, "reached": acc >= cfg["target"] - 1e-9}))
''')


def _child(code: str, cfg: dict) -> dict:
    """Run `code` in a fresh interpreter; its JSON line plus wait4() CPU, RSS and wall time."""
    import time

    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code, json.dumps(cfg)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    out, err = proc.stdout.read(), proc.stderr.read()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"child failed ({proc.returncode}): {err[-2000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    result.update(process_cpu_s=usage.ru_utime + usage.ru_stime, peak_rss_mb=usage.ru_maxrss / 1024.0,
                  process_wall_s=wall)
    return result


def _energy_wh(cpu_s: float, idle_w: float = 2.7, load_w: float = 6.4, cores: int = 4) -> float:
    return (load_w - idle_w) * cpu_s / cores / 3600.0


def run(quick: bool = False) -> str:
    from edge_agent.train import demo

    reps = 1 if quick else 3
    n_devices = 1 if quick else 3
    with tempfile.TemporaryDirectory(prefix="bench-finetune-") as tmp_name:
        tmp = Path(tmp_name)
        sc = demo.scenario()
        demo.build_bundle(tmp / "bundle", sc.base_x, sc.base_y, save_params=tmp / "base.params")
        rows, ratios = [], {"energy_process": [], "energy_work": [], "wall": [], "rss": []}
        for dev in sc.devices[:n_devices]:
            data = demo.write_data(tmp / dev.device_id, dev.images, dev.labels, "npz")
            ours_runs, base_runs = [], []
            for rep in range(reps):
                ours = _child(OURS, {"model": str(tmp / "bundle"), "data": str(data),
                                     "state_dir": str(tmp / f"st-{dev.device_id}-{rep}"),
                                     "cache_dir": str(tmp / f"cache-{dev.device_id}-{rep}"),
                                     "epochs": 30, "patience": 5, "val_fraction": 0.3,
                                     "profile": "raspberry-pi-4", "batch_size": 32})
                base = _child(BASELINE, {"model": str(tmp / "bundle"), "data": str(data), "val_fraction": 0.3,
                                         "params": str(tmp / "base.params"), "lr": 0.001, "batch_size": 32,
                                         "target": ours["accuracy"]["after"], "max_epochs": MAX_BASELINE_EPOCHS})
                ours_runs.append(ours)
                base_runs.append(base)
            med = {k: statistics.median(r[k] for r in ours_runs) for k in
                   ("process_cpu_s", "work_cpu_s", "peak_rss_mb", "process_wall_s", "work_wall_s")}
            bmed = {k: statistics.median(r[k] for r in base_runs) for k in
                    ("process_cpu_s", "work_cpu_s", "peak_rss_mb", "process_wall_s", "work_wall_s")}
            o, b = ours_runs[0], base_runs[0]
            rows.append((dev.device_id, o, b, med, bmed))
            ratios["energy_process"].append(bmed["process_cpu_s"] / med["process_cpu_s"])
            ratios["energy_work"].append(bmed["work_cpu_s"] / med["work_cpu_s"])
            ratios["wall"].append(bmed["process_wall_s"] / med["process_wall_s"])
            ratios["rss"].append(bmed["peak_rss_mb"] / med["peak_rss_mb"])
        budget = _child(OURS, {"model": str(tmp / "bundle"), "data": str(tmp / sc.devices[0].device_id / "data.npz"),
                               "state_dir": str(tmp / "st-budget"), "cache_dir": str(tmp / "cache-budget"),
                               "epochs": 400, "patience": 1000, "val_fraction": 0.3, "batch_size": 8,
                               "budget_wh": 0.003})
    lines = [
        "## Fine-tuning: int8 backbone + head vs full fp32 fine-tuning (bench_finetune)",
        "",
        "Digits scenario (edge_agent.train.demo): base digits CNN trained on other devices' clean images; each "
        "device fine-tunes on its own camera's data (NPZ of raw pixels), content-hash validation split 30 %. "
        "Ours = `run_finetune` (cold caches: engine choice, int8 features, head training under the governor); "
        "baseline = the same base network in fp32, every layer trained with Gluon Adam (lr 1e-3, batch 32), "
        "stopping as soon as its validation accuracy reaches ours. Each side in a fresh process; CPU time and "
        "peak RSS from wait4(). Energy = Raspberry Pi 4 CPU model (2.7 W idle, 6.4 W all 4 cores busy) applied "
        "to each process's CPU time: the same model for both. Median of "
        f"{reps} repetition(s).",
        "",
        "| device | acc before | ours after | baseline after (epochs) | energy ours / base, Wh (process) | "
        "energy ours / base, Wh (work, no import) | wall ours / base, s | peak RSS ours / base, MB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for device, o, b, med, bmed in rows:
        lines.append(
            f"| {device} | {o['accuracy']['before']:.3f} | {o['accuracy']['after']:.3f} | "
            f"{b['accuracy']:.3f} ({b['epochs']}{'' if b['reached'] else ', not reached'}) | "
            f"{_energy_wh(med['process_cpu_s']):.5f} / {_energy_wh(bmed['process_cpu_s']):.5f} | "
            f"{_energy_wh(med['work_cpu_s']):.5f} / {_energy_wh(bmed['work_cpu_s']):.5f} | "
            f"{med['process_wall_s']:.1f} / {bmed['process_wall_s']:.1f} | "
            f"{med['peak_rss_mb']:.0f} / {bmed['peak_rss_mb']:.0f} |")

    def gm(values: list[float]) -> float:
        return statistics.geometric_mean(values) if values else float("nan")

    used = budget["energy"]["wh"]
    lines += [
        "",
        f"Ratios baseline / ours (geometric mean over devices): energy {gm(ratios['energy_process']):.2f}x "
        f"per process, {gm(ratios['energy_work']):.2f}x for the training work alone (target >= 4x); wall time "
        f"{gm(ratios['wall']):.2f}x; peak RSS {gm(ratios['rss']):.2f}x (target >= 5x).",
        "",
        "Peak RSS on this model is dominated by what both processes load (Python, numpy, MXNet ~250-300 MB): "
        "the digits CNN's own activations are tiny, so this scenario cannot show the memory gap that a "
        "full backward pass through a large backbone (e.g. MobileNetV2 at camera resolution) has.",
        "",
        f"Budget adherence: job with `budget_wh=0.003` on this machine's source ({budget['energy']['source']}): "
        f"used {used:.5f} Wh, stop reason `{budget['stop']}`, |used - budget| / budget = "
        f"{abs(used - 0.003) / 0.003 * 100:.1f} % (target <= 5 %).",
        "",
        "Command: `python -m bench.run --only bench_finetune" + (" --quick" if quick else "") + "`.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(run(quick="--quick" in sys.argv))
