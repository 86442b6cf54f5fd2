"""Measured child processes for bench_finetune: each side of the comparison runs in a fresh
interpreter, measured the same way.

`measure(role, cfg)` starts `python -m bench._procs <role> <json cfg>` and returns the
child's JSON result plus what the parent sees of it through wait4(): process CPU seconds,
peak RSS (ru_maxrss) and wall time. Inside the child, every role first does its imports --
the training child's (numpy + edge_agent.train.job: MXNet comes later, inside the job,
after the int8 features) or the fp32 baseline's (numpy + MXNet, through the same
`edge_agent.int8.mxnet_import` the trainer uses) -- then records its post-import point:

    base_hwm_mb   VmHWM after those imports
    peak_hwm_mb   the process's peak RSS: VmHWM at the end, or the job's own figure where
                  larger (engine selection resets the kernel's mark between its phases;
                  int8/engine_cost.py's PeakWatch folds each phase's peak in first)
    work_hwm_mb   peak_hwm_mb - base_hwm_mb
    work_cpu_s / work_wall_s   CPU and wall seconds after those imports

Roles:
- `ours`:     edge_agent.train.job.run_finetune(**cfg["job"]) -- the real job.
- `baseline`: the bundle's base network in fp32 (models.mobilenet_v2 + the saved whole-net
              parameters), every layer trainable, Gluon Adam, on the job's own train /
              validation split; validation accuracy after each epoch; stops as soon as it
              reaches cfg["target"] or after cfg["max_epochs"].
- `prepare`:  the scenario's base bundle (edge_agent.sim.scenario.ensure_mobilenet_bundle):
              built once per configuration, then reused.
- `warmup`:   run_finetune once to make the device's one-time int8 engine selection (timed
              on its own), so the measured `ours` runs reuse the cached decision, as every
              job after the first on a device does.
"""

from __future__ import annotations

import compileall
import contextlib
import functools
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def vm_hwm_mb() -> float:
    """Peak resident set size of this process so far (VmHWM), MB."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError("no VmHWM in /proc/self/status")


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


@functools.cache
def compile_project() -> None:
    """The project's bytecode written once, as a device has it: pip compiles a wheel's modules
    when it installs them (the .deb's build-venv), so an installed agent never compiles at
    import. A child of a source tree without it (PYTHONDONTWRITEBYTECODE set, as on some CI
    and dev machines) compiled every module it imported, in every process: 0.1-0.45 CPU-s of
    a ~2.5 CPU-s fine-tune (textures, 3 runs each way), charged to the job, never to a device."""
    for package in ("edge_agent", "bench"):
        compileall.compile_dir(ROOT / package, quiet=2)


def measure(
    role: str, cfg: dict[str, Any], *, threads: int | None = None, timeout: float = 900.0
) -> dict[str, Any]:
    """Run `role` in a fresh interpreter; its JSON result plus wait4() CPU, RSS and wall time."""
    compile_project()
    env = dict(os.environ)
    if threads:  # the same thread count for MXNet / OpenMP on both sides
        env["OMP_NUM_THREADS"] = str(threads)
        env["MXNET_OMP_MAX_THREADS"] = str(threads)
    env.setdefault("PYTHONWARNINGS", "ignore")
    with tempfile.TemporaryFile("w+") as out_f, tempfile.TemporaryFile("w+") as err_f:
        start = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench._procs", role, json.dumps(cfg)],
            cwd=ROOT,
            env=env,
            stdout=out_f,
            stderr=err_f,
            text=True,
        )
        status, usage = wait_with_usage(proc, start + timeout, f"{role} child")
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out_f.seek(0)
        err_f.seek(0)
        out, err = out_f.read(), err_f.read()
    if proc.returncode != 0:
        raise RuntimeError(f"{role} child failed ({proc.returncode}): {err[-3000:]}")
    lines = [ln for ln in out.strip().splitlines() if ln.startswith("{")]
    if not lines:
        raise RuntimeError(f"{role} child printed no result: {out[-1000:]} {err[-2000:]}")
    result = json.loads(lines[-1])
    result.update(
        process_wall_s=wall,
        process_cpu_s=usage.ru_utime + usage.ru_stime,
        maxrss_mb=usage.ru_maxrss / 1024.0,
    )
    return result


def wait_with_usage(proc: subprocess.Popen, deadline: float, what: str) -> tuple[int, Any]:
    """(wait status, resource usage) of exactly this child (wait4: its CPU time and peak
    RSS, whatever else ran in the parent); killed and RuntimeError past `deadline`
    (time.perf_counter)."""
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            return status, usage
        if time.perf_counter() > deadline:
            proc.kill()
            os.wait4(proc.pid, 0)
            raise RuntimeError(f"{what} timed out")
        time.sleep(0.05)


# Runs argv and writes its wait4 ru_maxrss (KB) to the file named first. A child's ru_maxrss
# starts from its parent's high-water mark (Linux carries the forked image's into it at
# exec), so a child started from a large process (a test run with MXNet loaded: ~630 MB)
# would report at least that; started from this small interpreter (~10 MB) it reports its own.
_CLEAN_RSS = ("import os, subprocess, sys\n"
              "proc = subprocess.Popen(sys.argv[2:])\n"
              "_, status, usage = os.wait4(proc.pid, 0)\n"
              "open(sys.argv[1], 'w').write(str(usage.ru_maxrss))\n"
              "sys.exit(os.waitstatus_to_exitcode(status))\n")


def peak_rss_run(argv: list[str], *, timeout: float = 1800.0, cwd: Path = ROOT) -> tuple[int, str, str, float]:
    """Run `argv` as a child; (exit code, stdout, stderr, its peak RSS in MB from wait4's
    ru_maxrss: exactly this child's, whatever ran before it, or runs, in the parent)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    with tempfile.TemporaryFile("w+") as out_f, tempfile.TemporaryFile("w+") as err_f, \
            tempfile.NamedTemporaryFile("r") as rss_f:
        proc = subprocess.Popen([sys.executable, "-c", _CLEAN_RSS, rss_f.name, *argv], cwd=cwd, env=env,
                                stdout=out_f, stderr=err_f, text=True, start_new_session=True)
        try:
            status, _ = wait_with_usage(proc, time.perf_counter() + timeout, str(argv[:4]))
        except RuntimeError:  # timed out: the child too, not only the one waiting for it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            raise
        proc.returncode = os.waitstatus_to_exitcode(status)
        out_f.seek(0)
        err_f.seek(0)
        return proc.returncode, out_f.read(), err_f.read(), int(rss_f.read() or 0) / 1024.0


# ---------------------------------------------------------------- child side


def _ours(cfg: dict[str, Any]) -> dict[str, Any]:
    from edge_agent.train.job import run_finetune

    marks: dict[str, float] = {}

    def progress(event: Any) -> None:  # CPU time and VmHWM at phase boundaries
        now = _cpu_s()
        marks.setdefault(f"first_{event.phase}", now)
        marks[f"last_{event.phase}"] = now
        if event.phase == "features" or (event.phase == "train" and "hwm_before_train" not in marks):
            marks["hwm_before_train"] = vm_hwm_mb()  # last update: after the features, before MXNet

    c0 = _cpu_s()
    job = dict(cfg["job"])
    if "engine_choices" in job:  # as a finetune command carries them: JSON, parsed on arrival
        from edge_agent.protocol.engine_choice import parse_choices

        job["engine_choices"] = parse_choices(job["engine_choices"])
    report = run_finetune(**job, progress=progress)
    c1 = _cpu_s()
    feat_end = marks.get("last_features", c0)
    train_start = marks.get("first_train", feat_end)
    phases = {"features_cpu_s": feat_end - c0,  # bundle, data, probe, engine prepare, int8 features
              "mxnet_setup_cpu_s": train_start - feat_end,  # MXNet import, head set-up, first step
              "head_cpu_s": c1 - train_start,  # MXNet head training, checkpoints, report
              "features_hwm_mb": marks.get("hwm_before_train")}
    return {"phases": phases, "governor_wh": report["energy"]["wh"], "stop_detail": report["power"]["stop_detail"],
        "accuracy": report["accuracy"],
        "steps": report["steps"],
        "epochs": report["epochs_done"],
        "stop": report["stop_reason"],
        "engine": report["engine"],
        "trainer": report["trainer"],
        "energy": report["energy"],
        "feature_cache": report["feature_cache"],
        "profile": report["profile"]["name"],
        "train": report["data"]["train"],
        "validation": report["data"]["validation"],
        "depth": report["depth"],
        "adaptation": report.get("adaptation"),
        "head": {"file": (report.get("head") or {}).get("file")},  # None: a job that trained no step
    }


def _warmup(cfg: dict[str, Any]) -> dict[str, Any]:
    import edge_agent.int8.selection as selection

    real = selection.select_engine
    timing: dict[str, Any] = {}

    def timed(*args: Any, **kwargs: Any) -> Any:
        c0, t0 = _cpu_s(), time.perf_counter()
        try:
            chosen = real(*args, **kwargs)
        finally:
            timing.update(select_cpu_s=_cpu_s() - c0, select_wall_s=time.perf_counter() - t0)
        timing["candidates"] = [{k: getattr(c, k) for k in ("name", "available", "correct", "agreement", "max_diff",
                                                            "tolerance", "images_per_s", "error")}
                                for c in chosen[0].candidates]
        return chosen

    selection.select_engine = timed  # the job imports it from the module at run time
    result = _ours(cfg)
    result.update(timing)
    return result


def _baseline(cfg: dict[str, Any]) -> dict[str, Any]:
    import ctypes

    import numpy as np

    from edge_agent.int8.mxnet_import import mxnet

    mx = mxnet()
    autograd, gluon = mx.autograd, mx.gluon

    from edge_agent.data import load_dataset, split_dataset
    from edge_agent.int8.bundle import load_bundle
    from edge_agent.sim.models import mobilenet_v2

    if cfg.get("threads"):
        mx.base._LIB.MXSetNumOMPThreads(ctypes.c_int(int(cfg["threads"])))  # noqa: SLF001
    bundle = load_bundle(cfg["model"])
    spec = bundle.manifest.input
    data = load_dataset(cfg["data"], spec, bundle.manifest.labels)
    train, val = split_dataset(data, cfg["val_fraction"])  # the job's own content-hash split
    net = mobilenet_v2(
        cfg["width"], num_classes=len(bundle.manifest.labels), input_size=int(spec.shape[-1])
    )
    net.load_parameters(cfg["params"])
    mode = cfg.get("hybridize", "none")  # imperative Gluon: the least memory, same speed here
    if mode == "static":
        net.hybridize(static_alloc=True, static_shape=True)
    elif mode == "dynamic":
        net.hybridize()
    mx.random.seed(cfg.get("seed", 0))
    trainer = gluon.Trainer(
        net.collect_params(), "adam", {"learning_rate": cfg["lr"], "wd": cfg["wd"]}, kvstore=None
    )
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    bs = int(cfg["batch_size"])

    def accuracy() -> float:
        hits = 0
        for i in range(0, len(val), bs):
            out = net(mx.nd.array(val.x[i : i + bs])).asnumpy()
            hits += int((out.argmax(1) == val.y[i : i + bs]).sum())
        return hits / max(1, len(val))

    target = float(cfg["target"])
    acc, epochs, steps, history = float("nan"), 0, 0, []
    while epochs < int(cfg["max_epochs"]):
        order = np.random.default_rng([cfg.get("seed", 0), epochs]).permutation(len(train))
        for i in range(0, len(order), bs):
            idx = order[i : i + bs]
            with autograd.record():
                loss = loss_fn(
                    net(mx.nd.array(train.x[idx])), mx.nd.array(train.y[idx].astype(np.float32))
                )
            loss.backward()
            trainer.step(len(idx))
            steps += 1
        epochs += 1
        acc = accuracy()
        history.append(round(acc, 4))
        if acc >= target - 1e-9:
            break
    heldout = None
    if cfg.get("heldout"):  # raw pixels + labels, judged like ours (bench_depth)
        npz = np.load(cfg["heldout"])
        hx, hy, hits = spec.normalise(npz["x"]), npz["y"], 0
        for i in range(0, len(hx), bs):
            hits += int((net(mx.nd.array(hx[i : i + bs])).asnumpy().argmax(1) == hy[i : i + bs]).sum())
        heldout = hits / max(1, len(hy))
    return {
        "heldout_accuracy": heldout,
        "accuracy": acc,
        "epochs": epochs,
        "steps": steps,
        "reached": acc >= target - 1e-9,
        "history": history,
        "train": len(train),
        "validation": len(val),
    }


def _prepare(cfg: dict[str, Any]) -> dict[str, Any]:
    from edge_agent.sim.scenario import ensure_mobilenet_bundle

    bundle, params, built = ensure_mobilenet_bundle(cfg["dest"], **cfg["base"])
    return {"bundle": str(bundle), "params": str(params), "built": built}


ROLES = {"ours": _ours, "baseline": _baseline, "warmup": _warmup, "prepare": _prepare}
TRAINING_CHILD = ("ours", "warmup")


def main(argv: list[str]) -> int:
    role, cfg = argv[0], json.loads(argv[1])
    import warnings

    warnings.simplefilter("ignore")
    c_start, t_start = _cpu_s(), time.perf_counter()
    import numpy  # noqa: F401

    if role in TRAINING_CHILD:  # the real job imports MXNet itself, after its int8 features
        import edge_agent.train.job  # noqa: F401 - imports no MXNet at module level
    else:  # the same MXNet import the trainer does (scikit-learn / SciPy hidden)
        from edge_agent.int8.mxnet_import import mxnet

        mxnet()
    base_hwm = vm_hwm_mb()
    c0, t0 = _cpu_s(), time.perf_counter()
    result = ROLES[role](cfg)
    c1, t1 = _cpu_s(), time.perf_counter()
    peak = vm_hwm_mb()
    if "edge_agent.int8.engine_cost" in sys.modules:  # the job resets the kernel's mark between its phases
        from edge_agent.int8.engine_cost import process_peak_rss_mb

        peak = max(peak, process_peak_rss_mb())
    result.update(import_cpu_s=c0 - c_start, import_wall_s=t0 - t_start, work_cpu_s=c1 - c0, work_wall_s=t1 - t0,
                  base_hwm_mb=base_hwm, peak_hwm_mb=peak, work_hwm_mb=peak - base_hwm)
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
