"""kill -9 at random moments during training and checkpoint writes: every resume loads a
good checkpoint, no completed checkpoint is ever lost, and the job finishes with the same
result as an uninterrupted run with the same seed.

One helper process imports MXNet once (~3-10 s) and forks a fresh child per attempt, so
two dozen kills fit in well under a minute. Each child runs the real job (bundle, int8
engine, feature cache, head trainer -- numpy and MXNet Gluon in turn --, governor,
checkpoints) with resume=True and reports its progress events over a pipe; the helper SIGKILLs it either at a random time or 0-3 ms after
it announced a checkpoint write, then starts the next one. Events written before the kill
are still in the pipe, so the helper knows exactly which checkpoints had completed.

Stated tolerance: final validation accuracy within 0.02 of the uninterrupted run (in
practice it is identical: the head parameters match bit for bit).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from edge_agent.train import demo

KILLS = 22
ACCURACY_TOLERANCE = 0.02

HELPER = textwrap.dedent(r'''
    import json, os, random, re, select, signal, sys, time, warnings
    warnings.simplefilter("ignore")
    import mxnet  # noqa: F401 - once, before forking
    from edge_agent.train.job import run_finetune
    import edge_agent.train.trainer, edge_agent.int8.selection, edge_agent.hardware.probe  # noqa: F401

    cfg = json.loads(sys.argv[1])
    rng = random.Random(cfg["seed"])

    def child(w, state_dir):
        def send(obj):
            os.write(w, (json.dumps(obj) + "\n").encode())
        try:
            report = run_finetune(model=cfg["bundle"], data=cfg["data"], state_dir=state_dir,
                                  cache_dir=cfg["cache"], resume=True, epochs=cfg["epochs"], patience=100,
                                  batch_size=8, checkpoint_every=3, profile="raspberry-pi-4", trainer=cfg["trainer"],
                                  progress=lambda ev: send({"phase": ev.phase, "step": ev.step, "detail": ev.detail}))
            send({"phase": "report", "report": {k: report[k] for k in ("accuracy", "steps", "stop_reason", "head",
                                                                        "checkpoint_problems")}})
            os._exit(0)
        except BaseException as exc:
            send({"phase": "error", "detail": f"{type(exc).__name__}: {exc}"})
            os._exit(1)

    def start(state_dir):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            child(w, state_dir)
        os.close(w)
        return pid, r

    def events(r, buf, timeout):
        """Complete JSON lines available within `timeout` seconds (b"" once the child is gone)."""
        out = []
        ready, _, _ = select.select([r], [], [], max(0.0, timeout))
        if ready:
            chunk = os.read(r, 65536)
            if not chunk:
                return out, buf, True
            buf += chunk
            *lines, buf = buf.split(b"\n")
            out = [json.loads(line) for line in lines if line]
        return out, buf, False

    def run_to_end(state_dir):
        pid, r = start(state_dir)
        buf, report, errors = b"", None, []
        while True:
            evs, buf, eof = events(r, buf, 5.0)
            for ev in evs:
                if ev["phase"] == "report":
                    report = ev["report"]
                elif ev["phase"] == "error":
                    errors.append(ev["detail"])
            if eof:
                break
        os.waitpid(pid, 0)
        os.close(r)
        return report, errors

    reference, ref_errors = run_to_end(cfg["reference_state"])  # also warms the engine and feature caches
    rounds, done_max, errors = [], 0, list(ref_errors)
    ckpt_dir = os.path.join(cfg["state"], "checkpoints")
    for k in range(cfg["kills"]):
        mode = "write" if k % 2 else "random"
        target = rng.randint(1, 3)
        delay = rng.uniform(0.0, 0.003) if mode == "write" else rng.uniform(0.05, 0.9)
        pid, r = start(cfg["state"])
        t0 = time.monotonic()
        kill_at = t0 + delay if mode == "random" else None
        buf, seen, resumed, saving, finished, eof = b"", [], None, 0, False, False
        while not eof:
            timeout = 5.0 if kill_at is None else kill_at - time.monotonic()
            if timeout <= 0:
                break
            evs, buf, eof = events(r, buf, timeout)
            for ev in evs:
                seen.append(ev)
                if ev["phase"] == "saving" and mode == "write" and kill_at is None:
                    saving += 1
                    if saving == target:
                        kill_at = time.monotonic() + delay
                if ev["phase"] == "report":
                    finished = True
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        while not eof:  # whatever the child wrote before it died
            evs, buf, eof = events(r, buf, 0.5)
            seen.extend(evs)
        os.close(r)
        leftovers = [n for n in os.listdir(ckpt_dir) if n.endswith(".tmp")] if os.path.isdir(ckpt_dir) else []
        for ev in seen:
            m = re.search(r"resumed from \S+ at step (\d+)", ev.get("detail", ""))
            if ev["phase"] == "train" and m:
                resumed = int(m.group(1))
            if ev["phase"] == "error":
                errors.append(ev["detail"])
            finished = finished or ev["phase"] == "report"
        done = [ev["step"] for ev in seen if ev["phase"] == "checkpoint"]
        rounds.append({"mode": mode, "alive_s": round(time.monotonic() - t0, 3), "resumed_from": resumed,
                       "done_before": done_max, "checkpoints_done": len(done), "mid_write": bool(leftovers),
                       "finished_before_kill": finished,
                       "trained": any(ev["phase"] in ("train", "saving", "checkpoint") for ev in seen)})
        done_max = max([done_max, *done])
    final, final_errors = run_to_end(cfg["state"])
    print(json.dumps({"reference": reference, "final": final, "rounds": rounds,
                      "errors": errors + final_errors}))
''')


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo.ensure_bundle(tmp_path_factory.getbasetemp() / "digits-bundle")


@pytest.mark.parametrize("trainer", ["numpy", "mxnet"])  # both head trainers' checkpoints
def test_kill_9_during_training_and_checkpoint_writes(bundle: Path, tmp_path: Path, trainer: str) -> None:
    sc = demo.scenario()
    dev = sc.devices[2]
    data = demo.write_data(tmp_path / "data", dev.images, dev.labels, "npz")
    cfg = {"bundle": str(bundle), "data": str(data), "cache": str(tmp_path / "cache"), "seed": 1234,
           "state": str(tmp_path / "state"), "reference_state": str(tmp_path / "reference"),
           "kills": KILLS, "epochs": 40, "trainer": trainer}
    proc = subprocess.run([sys.executable, "-c", HELPER, json.dumps(cfg)], capture_output=True, text=True,
                          timeout=240, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    rounds, reference, final = out["rounds"], out["reference"], out["final"]
    assert out["errors"] == []
    killed_alive = [r for r in rounds if not r["finished_before_kill"]]
    assert len(killed_alive) >= 20, rounds  # the job was really interrupted 20+ times
    mid_write = sum(r["mid_write"] for r in rounds)
    print(f"\n{len(killed_alive)} kills; {mid_write} landed inside a checkpoint write (temp file left); "
          f"{sum(r['resumed_from'] is not None for r in rounds)} resumes")
    assert mid_write >= 1
    for r in rounds:
        if r["done_before"] > 0 and r["trained"]:  # (a child killed while starting up never got there)
            # every resume loads a checkpoint at least as new as the newest one completed
            assert r["resumed_from"] is not None and r["resumed_from"] >= r["done_before"], r
    assert sum(r["resumed_from"] is not None for r in rounds) >= 10
    assert final is not None and final["checkpoint_problems"] == []
    assert final["stop_reason"] == reference["stop_reason"] and final["steps"] == reference["steps"]
    assert abs(final["accuracy"]["after"] - reference["accuracy"]["after"]) <= ACCURACY_TOLERANCE
    diffs = [max(abs(a - b) for a, b in zip(p["values"], final["head"]["params"][n]["values"], strict=True))
             for n, p in reference["head"]["params"].items()]
    print(f"final accuracy {final['accuracy']['after']} vs uninterrupted {reference['accuracy']['after']}; "
          f"max |param difference| {max(diffs):.3g}")
