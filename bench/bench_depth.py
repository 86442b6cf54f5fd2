"""How deep to fine-tune (issue 15): every depth of a multi-depth bundle vs full fp32
fine-tuning, on two real data sets, judged on held-out data.

Data sets, both non-IID across 3 devices, each device with its own camera:
- camera digits: bench_finetune's scenario (edge_agent.sim.scenario.camera_scenario:
  scikit-learn's digits at 96x96x3, MobileNetV2 w0.5 pre-trained on three other devices);
  held-out = the 449 digits no device holds, through the fine-tuning device's camera.
- textures: patches of the two photographs scikit-learn ships (edge_agent.sim.textures:
  8 classes, 32x32 patches upsampled to 64x64), MobileNetV2 w0.5 pre-trained on the left
  halves; devices and their held-out sets draw other patches of the right halves.

- a fourth device on each: the first device's share seen through a strongly shifted camera
  of its own (sim/camera_shift.py: blur, gamma 1.8, colour tint, noise), held-out through
  the same camera; the base model's accuracy there is below 0.5.

Per device and seed (the job's batch order; the baseline's too), in fresh processes
measured the same way (bench/_procs.py): `run_finetune` at each depth -- head, last 1x1
conv, last 1 / 2 / 3 blocks (+ 1x1 + head), bias-only over 2 blocks, BatchNorm statistics
frozen over 1 block (the default updates them), `--depth auto` (its prefix's first 4
normalised layers adapted to the device's camera where the shift says so: train/job_adapt.py; its
tail pulled towards the bundle's own answers on the not-true classes, `--distill 3`, the
default, which every job here sets), auto
with `--adapt none`, auto with `--distill 0`, auto as the device's first job (no cached engine choice, default
planner rates), the same given the engine choice a device of its kind measured (what a
finetune command relays to every device but the first of its kind), auto with 2 augmented views
per image (crop + brightness, cached), and auto with the tail trained in MXNet Gluon
(`--trainer mxnet`; every other row trains its tail in numpy, train/numpy_tail.py, without
importing MXNet) -- and the baseline, every layer of the fp32 net trained with Gluon Adam for
BASELINE_EPOCHS. Held-out accuracy is computed in the parent from the
job's head.params (edge_agent.inference.predictor). Energy above idle: the raspberry-pi-4 profile's
CPU model on each process's own CPU seconds (as in bench_finetune; every process imports the
project byte-compiled, as an installed agent does: bench/_procs.compile_project); peak RSS: VmHWM;
update bytes: the job's delta through the default codec (what the agent would send).
Each depth's one-time engine selection (made on the first device), each device's learnt
planner rates and the prefixes it adapted (train/job_adapt.py: a later job serves the one
an earlier job adapted) come from warm-up jobs,
one per depth on that device's own data with another batch order (its earlier jobs), so the
measured jobs are those of a device in service.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from bench._procs import measure  # noqa: E402

PROFILE = "raspberry-pi-4"
WIDTH = 0.5
JOB = {"epochs": 30, "patience": 5, "batch_size": 32, "val_fraction": 0.3, "profile": PROFILE, "distill": 3.0}
BASELINE_EPOCHS, BASELINE_LR = 5, 1e-3
WARMUP_SEED = 1000  # the warm-up jobs' batch order differs from every measured seed's
VARIANTS = [("head", {"depth": "head"}), ("last 1x1", {"depth": 1}), ("last 1 block", {"depth": 2}),
            ("last 2 blocks", {"depth": 3}), ("last 3 blocks", {"depth": 4}),
            ("bias-only, 2 blocks", {"depth": 3, "tail": "bias"}), ("BN frozen, 1 block", {"depth": 2, "bn": "frozen"}),
            ("auto", {"depth": "auto"}), ("auto, prefix not adapted", {"depth": "auto", "adapt": "none"}),
            ("auto, no distillation", {"depth": "auto", "distill": 0.0}),
            ("auto, the device's first job", {"depth": "auto", "fresh": True}),
            ("auto, a first job with the fleet's engine choice", {"depth": "auto", "fresh": True, "fleet": True}),
            ("auto + 2 augmented views", {"depth": "auto", "augment": 2}),
            ("auto, tail in MXNet Gluon", {"depth": "auto", "trainer": "mxnet"})]
TARGETS = {"accuracy": 0.0, "energy": 4.0, "rss": 3.0}
FLEET_FIRST = "auto, a first job with the fleet's engine choice"
BASE_ROW = "the base model, not fine-tuned"


def _cache() -> Path:
    return Path(os.environ.get("EDGE_AGENT_BENCH_CACHE") or ROOT / "build" / "bench-cache")


def _cores() -> int:
    return len(os.sched_getaffinity(0))


def _write_npz(path: Path, images: np.ndarray, labels: list[str]) -> Path:
    import io

    from edge_agent.atomic import atomic_write_bytes
    from edge_agent.sim.scenario import to_pixels
    buf = io.BytesIO()
    np.savez(buf, x=to_pixels(images), y=np.asarray(labels))
    atomic_write_bytes(path, buf.getvalue())
    return path


def _shifted(tmp: Path, source: str, images: np.ndarray, labels: list[str],
             heldout: tuple[np.ndarray, np.ndarray]) -> dict[str, Any]:
    """A device holding `source`'s share seen through a strongly shifted camera of its own
    (sim/camera_shift.py: blur, gamma 1.8, tint, noise); its held-out set through the same
    camera (another noise draw)."""
    from edge_agent.sim.camera_shift import ShiftedCamera, shift_images
    from edge_agent.sim.scenario import to_pixels

    cam = ShiftedCamera()
    hx, hy = heldout
    name = f"{source}-shifted"
    return {"id": name, "data": _write_npz(tmp / f"{name}.npz", shift_images(images, cam), labels),
            "heldout": (to_pixels(shift_images(hx / 255.0, ShiftedCamera(seed=1))).astype(np.float32), hy)}


def _digits(tmp: Path, n_devices: int) -> dict[str, Any]:
    from edge_agent.sim import scenario as demo
    from edge_agent.sim.digits import apply_camera, load_digits_images, make_fleet

    bundle, params, _ = demo.ensure_mobilenet_bundle(_cache() / "digits-mobilenet-w0.5-s96-e3-d4", width=WIDTH,
                                                     size=96, epochs=3, depths=4)
    sc = demo.camera_scenario(size=96, seed=0)
    fleet = make_fleet(n_devices=6, alpha=1.0, seed=0, min_per_device=40)  # camera_scenario's own split
    images, labels = load_digits_images()
    held = np.setdiff1d(np.arange(len(labels)), np.concatenate([d.indices for d in fleet.devices]))
    devices = []
    for i, dev in enumerate(sc.devices[:n_devices]):
        cam = demo.field_camera(fleet.devices[3 + i].camera, 2.0)
        hx = np.repeat(apply_camera(demo.upsample(images[held], 96), cam), 3, axis=1)
        devices.append({"id": dev.device_id, "data": _write_npz(tmp / f"{dev.device_id}.npz", dev.images,
                                                                 [demo.LABELS[v] for v in dev.labels]),
                        "heldout": (demo.to_pixels(hx).astype(np.float32), labels[held])})
    devices.append(_shifted(tmp, sc.devices[0].device_id, sc.devices[0].images,
                            [demo.LABELS[v] for v in sc.devices[0].labels], devices[0]["heldout"]))
    return {"bundle": bundle, "params": params, "size": 96, "devices": devices,
            "what": "camera digits (96x96, 10 classes)"}


def _textures(tmp: Path, n_devices: int) -> dict[str, Any]:
    from edge_agent.int8.bundle import ORACLE, load_bundle
    from edge_agent.sim import scenario as demo
    from edge_agent.sim import textures

    size = 64
    sc = textures.scenario(size=32, n_devices=n_devices, seed=0)
    dest = _cache() / "textures-mobilenet-w0.5-s64-e8-d4"
    params = dest.with_name(dest.name + ".params")
    try:
        made = load_bundle(dest)
        if not made.has(ORACLE):  # made before multi-depth bundles carried the oracle's answers
            raise FileNotFoundError(dest / ORACLE)
        if "prefix_activations" not in made.manifest.depths[0].costs:  # or each prefix's activation count
            raise FileNotFoundError(f"{dest}: no prefix_activations")
        if not params.is_file():
            raise FileNotFoundError(params)
    except Exception:  # build once, reuse while it verifies
        demo.build_mobilenet_bundle(dest, demo.upsample(sc.base_x, size), sc.base_y, width=WIDTH, epochs=8,
                                    name="textures", overwrite=True, save_params=params, depths=4,
                                    labels=textures.CLASSES)
    devices = []
    for dev in sc.devices:
        devices.append({"id": dev.device_id,
                        "data": _write_npz(tmp / f"{dev.device_id}.npz", demo.upsample(dev.images, size),
                                           [textures.CLASSES[v] for v in dev.labels]),
                        "heldout": (demo.to_pixels(demo.upsample(dev.heldout_images, size)).astype(np.float32),
                                    dev.heldout_labels)})
    first = sc.devices[0]
    devices.append(_shifted(tmp, first.device_id, demo.upsample(first.images, size),
                            [textures.CLASSES[v] for v in first.labels], devices[0]["heldout"]))
    return {"bundle": dest, "params": params, "size": size, "devices": devices,
            "what": f"textures ({len(textures.CLASSES)} classes, 32x32 patches at 64x64)"}


def _update_bytes(bundle: Any, head_file: str) -> int:
    from edge_agent.inference.predictor import tail_params
    from edge_agent.updates import CompressionPolicy, UpdateEncoder, compute_delta

    base, trained = tail_params(bundle), tail_params(bundle, head_file)
    update = UpdateEncoder(model_name="m", device_id="d", policy=CompressionPolicy(), store=None,
                           chunk_size=64 << 10).encode(compute_delta(trained, base), job_id="j", round=1,
                                                       model_version="1")
    return sum(map(len, update.chunks()))


def _run_scenario(sc: dict[str, Any], tmp: Path, seeds: list[int], threads: int) -> list[dict[str, Any]]:
    from edge_agent.inference.predictor import DepthPredictor, tail_params
    from edge_agent.int8.bundle import load_bundle
    from edge_agent.int8.shared_choice import shared_choices
    from edge_agent.train.job_adapt import ADAPTED_DIR

    bundle = load_bundle(sc["bundle"])
    depths = sorted({v.get("depth") for _, v in VARIANTS if isinstance(v.get("depth"), int)} | {0})
    for i, dev in enumerate(sc["devices"]):  # each device's earlier jobs, on its own data
        warm = tmp / f"warm-cache-{dev['id']}"
        if i:  # the engine choice is the hardware's, not the data's: made once, by the first device
            shutil.copytree(tmp / f"warm-cache-{sc['devices'][0]['id']}" / "int8-selection", warm / "int8-selection")
        for depth in depths:
            measure("ours", {"job": {**JOB, "model": str(sc["bundle"]), "data": str(dev["data"]), "depth": depth,
                                     "seed": WARMUP_SEED, "state_dir": str(tmp / f"warm-{dev['id']}-{depth}"),
                                     "cache_dir": str(warm), "lr": 0.01 if depth == 0 else 0.001}}, threads=threads)
    rows = []
    first_warm = tmp / f"warm-cache-{sc['devices'][0]['id']}"
    for dev in sc["devices"]:
        hx, hy = dev["heldout"]
        base = DepthPredictor(bundle, engine="native", threads=threads)
        rows += [{"device": dev["id"], "seed": seed, "variant": BASE_ROW, "depth": None, "heldout": base.accuracy(hx, hy),
                  "cpu_s": None, "rss_mb": None, "update_bytes": None, "predicted_wh": None, "actual_wh": None,
                  "selection_wh": None, "reason": "", "predicted_cpu_s": None, "job_cpu_s": None} for seed in seeds]
        base.close()
        warm = tmp / f"warm-cache-{dev['id']}"
        for seed in seeds:
            for name, extra in VARIANTS:
                cache = tmp / f"cache-{dev['id']}-{seed}-{len(rows)}"
                extra = dict(extra)
                if extra.pop("fleet", False):  # the choice the first device measured, as a command relays it
                    extra["engine_choices"] = [c.to_json() for c in shared_choices(first_warm)]
                if not extra.pop("fresh", False):  # a device in service: its earlier jobs' choice, rates
                    shutil.copytree(warm / "int8-selection", cache / "int8-selection")  # and adapted prefixes
                    shutil.copy(warm / "planner-rates.json", cache / "planner-rates.json")
                    if (warm / ADAPTED_DIR).is_dir():
                        shutil.copytree(warm / ADAPTED_DIR, cache / ADAPTED_DIR)
                job = {**JOB, "model": str(sc["bundle"]), "data": str(dev["data"]), "seed": seed, **extra,
                       "state_dir": str(tmp / f"state-{len(rows)}"), "cache_dir": str(cache)}
                r = measure("ours", {"job": job}, threads=threads)
                depth = r["depth"]["depth"]
                adapted = r.get("adaptation") or {}
                pred = DepthPredictor(bundle, depth=depth, params=tail_params(bundle, r["head"]["file"]),
                                      engine=r["engine"]["name"], threads=threads, prefix=adapted.get("prefix"))
                acc = pred.accuracy(hx, hy)
                pred.close()
                rows.append({"device": dev["id"], "seed": seed, "variant": name, "depth": depth,
                             "heldout": acc, "cpu_s": r["process_cpu_s"], "rss_mb": r["peak_hwm_mb"],
                             "update_bytes": _update_bytes(bundle, r["head"]["file"]),
                             "predicted_wh": r["depth"]["predicted_wh"], "actual_wh": r["depth"]["actual_wh"],
                             "predicted_cpu_s": r["depth"]["predicted_cpu_s"],
                             "job_cpu_s": sum(v for k, v in r["depth"]["cpu_s"].items()
                                              if k.endswith("_s") and k != "selection_s"),
                             "selection_wh": r["engine"]["selection_wh"], "reason": r["depth"]["reason"],
                             "predicted_rss_mb": r["depth"].get("predicted_peak_rss_mb"),
                             "adapted": adapted.get("kind"), "adaptation": adapted.get("reason")})
            npz = tmp / f"heldout-{dev['id']}.npz"
            np.savez(npz, x=hx, y=hy)
            b = measure("baseline", {"model": str(sc["bundle"]), "params": str(sc["params"]), "data": str(dev["data"]),
                                     "val_fraction": JOB["val_fraction"], "width": WIDTH, "lr": BASELINE_LR, "wd": 1e-4,
                                     "batch_size": JOB["batch_size"], "target": 2.0, "max_epochs": BASELINE_EPOCHS,
                                     "threads": threads, "seed": seed, "heldout": str(npz)}, threads=threads)
            rows.append({"device": dev["id"], "seed": seed, "variant": f"full fp32 FT, {BASELINE_EPOCHS} epochs",
                         "depth": None, "heldout": b["heldout_accuracy"], "cpu_s": b["process_cpu_s"],
                         "rss_mb": b["peak_hwm_mb"], "update_bytes": None, "predicted_wh": None, "actual_wh": None,
                         "selection_wh": None, "reason": "", "predicted_cpu_s": None, "job_cpu_s": None})
    return rows


def _table(sc: dict[str, Any], rows: list[dict[str, Any]], wh: Any) -> tuple[list[str], dict[str, float]]:
    names = [BASE_ROW] + [n for n, _ in VARIANTS] + [f"full fp32 FT, {BASELINE_EPOCHS} epochs"]
    devices = [d["id"] for d in sc["devices"]]

    def mean(variant: str, key: str, device: str | None = None) -> float:
        vals = [r[key] for r in rows if r["variant"] == variant and (device is None or r["device"] == device)
                and r[key] is not None]
        return statistics.fmean(vals) if vals else float("nan")

    def median(variant: str, key: str) -> float:
        vals = [r[key] for r in rows if r["variant"] == variant and r[key] is not None]
        return statistics.median(vals) if vals else float("nan")

    lines = [f"### {sc['what']}", "",
             "| what is trained | depth | held-out accuracy per device | mean | energy above idle, mWh | "
             "peak RSS MB | update bytes |", "|---|---:|---|---:|---:|---:|---:|"]
    for name in names:
        depths = sorted({r["depth"] for r in rows if r["variant"] == name and r["depth"] is not None})
        per_dev = " / ".join(f"{mean(name, 'heldout', d):.3f}" for d in devices)
        ub = median(name, "update_bytes")
        cpu, rss = median(name, "cpu_s"), median(name, "rss_mb")
        lines.append(f"| {name} | {','.join(map(str, depths)) or '-'} | {per_dev} | {mean(name, 'heldout'):.3f} | "
                     f"{'-' if cpu != cpu else f'{wh(cpu) * 1000:.2f}'} | {'-' if rss != rss else f'{rss:.0f}'} | "
                     f"{'-' if ub != ub else f'{ub:,.0f}'} |")
    full = names[-1]
    first = "auto, the device's first job"
    ratios = {"accuracy": mean("auto", "heldout") - mean(full, "heldout"),
              "worst_device": min(mean("auto", "heldout", d) - mean(full, "heldout", d) for d in devices),
              "energy": median(full, "cpu_s") / median("auto", "cpu_s"),
              "rss": median(full, "rss_mb") / median("auto", "rss_mb"),
              "energy_first": median(full, "cpu_s") / median(first, "cpu_s"),
              "rss_first": median(full, "rss_mb") / median(first, "rss_mb"),
              "energy_first_fleet": median(full, "cpu_s") / median(FLEET_FIRST, "cpu_s")}
    shifted = [d for d in devices if d.endswith("-shifted")]
    adapted = sorted({f"{r['device']}: {r['adapted']}" for r in rows if r["variant"] == "auto" and r.get("adapted")})
    auto = [r for r in rows if r["variant"] == "auto"]
    errs = [abs(r["predicted_wh"] - (r["actual_wh"] - r["selection_wh"])) / (r["actual_wh"] - r["selection_wh"])
            for r in auto if r["predicted_wh"] and r["actual_wh"] and r["actual_wh"] > r["selection_wh"]]
    ratios["governor_error"] = statistics.median(errs) if errs else float("nan")
    own = [abs(r["predicted_cpu_s"] - r["job_cpu_s"]) / r["job_cpu_s"] for r in auto if r["job_cpu_s"]]
    ratios["prediction_error"] = statistics.median(own) if own else float("nan")

    def rss_error(variant: str) -> float:  # the worst run's |predicted - measured| / measured peak RSS
        errs = [abs(r["predicted_rss_mb"] - r["rss_mb"]) / r["rss_mb"] for r in rows
                if r["variant"] == variant and r.get("predicted_rss_mb") and r["rss_mb"]]
        return max(errs) if errs else float("nan")
    ratios["rss_error_first"], ratios["rss_error_later"] = rss_error(first), rss_error("auto")
    rss_met = max(ratios["rss_error_first"], ratios["rss_error_later"]) <= 0.25
    lines += ["", f"`--depth auto` chose depth {', '.join(sorted({str(r['depth']) for r in auto}))} "
              f"({auto[0]['reason'] if auto else '-'}). Against full fine-tuning: held-out accuracy "
              f"{ratios['accuracy'] * 100:+.1f} points (mean over devices and seeds; target >= 0: "
              f"**{'met' if ratios['accuracy'] >= 0 else 'not met'}**), energy {ratios['energy']:.1f}x less "
              f"(target >= 4x: **{'met' if ratios['energy'] >= TARGETS['energy'] else 'not met'}**), peak RSS "
              f"{ratios['rss']:.1f}x less (target >= 3x: **{'met' if ratios['rss'] >= TARGETS['rss'] else 'not met'}**). "
              f"On every device: the worst device's auto is {ratios['worst_device'] * 100:+.1f} points against full "
              f"fine-tuning (target >= 0: **{'met' if ratios['worst_device'] >= 0 else 'not met'}**). A device's first "
              f"job (no cached engine choice, default planner rates): energy {ratios['energy_first']:.1f}x less, peak "
              f"RSS {ratios['rss_first']:.1f}x less than full fine-tuning; given the engine choice a device of its "
              f"kind measured (every device but the first of its kind), energy {ratios['energy_first_fleet']:.1f}x "
              "less. The strongly shifted camera's device"
              f"{'s' if len(shifted) != 1 else ''} ({', '.join(shifted)}): base model "
              f"{mean(BASE_ROW, 'heldout', shifted[0]) if shifted else float('nan'):.3f}; the prefix adapted by auto on "
              f"{'; '.join(adapted) or '-'}. "
              f"The planner's prediction vs the job's own measured CPU time (the same power model turns both into Wh; "
              f"selection excluded: it was cached): median error {ratios['prediction_error'] * 100:.0f} % (target "
              f"<= 25 %: **{'met' if ratios['prediction_error'] <= 0.25 else 'not met'}**). Against the governor's "
              f"metered Wh the error is {ratios['governor_error'] * 100:.0f} %: its cpu-estimate source reads "
              "system-wide /proc/stat, so on this shared machine other processes' load is charged to the job too. "
              f"The planner's peak RSS prediction vs the job's measured peak (VmHWM), worst run: "
              f"{ratios['rss_error_first'] * 100:.0f} % on first jobs, {ratios['rss_error_later'] * 100:.0f} % on later "
              f"ones (target <= 25 %: **{'met' if rss_met else 'not met'}**).", ""]
    return lines, ratios


def run(quick: bool = False) -> str:
    from bench.bench_finetune import _profile_watts

    started = time.perf_counter()
    threads = _cores()
    idle_w, load_w = _profile_watts()

    def wh(cpu_s: float) -> float:
        return (load_w - idle_w) * cpu_s / threads / 3600.0

    seeds = [0] if quick else list(range(int(os.environ.get("EDGE_BENCH_DEPTH_SEEDS", "2"))))
    n_devices = 1 if quick else int(os.environ.get("EDGE_BENCH_DEPTH_DEVICES", "3"))
    out = ["## How deep to fine-tune: every depth vs full fp32 fine-tuning (bench_depth)", "",
           __doc__.split("\n\n", 1)[1].strip().replace("\n", " ").replace("- ", "\n- ") if __doc__ else "", "",
           f"{len(seeds)} seed(s) x {n_devices} device(s) + the shifted camera's per data set; energy and RSS are "
           f"medians over all runs "
           f"of a row; {threads} threads; job: Adam, lr 0.01 for the head and 0.001 for deeper tails (the "
           f"default), up to {JOB['epochs']} epochs, patience {JOB['patience']}, validation share "
           f"{JOB['val_fraction']:.0%}; baseline Adam lr {BASELINE_LR:g}, {BASELINE_EPOCHS} epochs.", ""]
    summary = {}
    for key, make in (("digits", _digits), ("textures", _textures)):
        with tempfile.TemporaryDirectory(prefix=f"bench-depth-{key}-") as tmp_name:
            tmp = Path(tmp_name)
            sc = make(tmp, n_devices)
            rows = _run_scenario(sc, tmp, seeds, threads)
            lines, ratios = _table(sc, rows, wh)
            out += lines
            summary[key] = ratios
            (ROOT / "build").mkdir(exist_ok=True)
            (ROOT / "build" / f"bench-depth-{key}.json").write_text(json.dumps(rows, indent=1, default=str))
    out.append(f"Command: `python -m bench.run --only bench_depth{' --quick' if quick else ''}` "
               f"({time.perf_counter() - started:.0f} s); per-run rows in build/bench-depth-*.json.")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(run(quick="--quick" in sys.argv))
