"""kill -9 at chosen points of training and inside checkpoint writes: every resume loads the
newest completed checkpoint, no completed checkpoint is ever lost, and the job finishes
with the same result as an uninterrupted run with the same seed.

One helper process imports MXNet once (~3-10 s) and forks a fresh child per attempt, so
two dozen kills fit in well under a minute. Each child runs the real job (bundle, int8
engine, feature cache, head trainer -- numpy and MXNet Gluon in turn --, governor,
checkpoints) with resume=True and reports its progress events over a pipe. Every kill is
driven by the job's own progress, never by wall-clock delays, so the same kills land at the
same steps on any machine, under `taskset -c 0` or beside a CPU hog:

- "train":  after its N-th training step (N drawn from a seeded RNG) the child stops itself
            (SIGSTOP) and the helper SIGKILLs it there;
- "saved":  the same, right after its N-th completed checkpoint;
- "write":  at its N-th "saving" event (a write is about to start) the child lowers its file
            size limit below the checkpoint's size and restores SIGXFSZ's default action,
            so the kernel kills it inside the write (no handler, no cleanup: a kill -9 in
            the middle of the temp file), which the helper checks by the temp file left.

Events written before the kill are still in the pipe, so the helper knows exactly which
checkpoints had completed.

Stated tolerance: final validation accuracy within 0.02 of the uninterrupted run (in
practice it is identical: the head parameters match bit for bit).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from edge_agent.sim import scenario as demo

KILLS = 21  # seven of each kind
DEEP_KILLS = 9  # three of each at depth 2 (an MXNet tail with two convs: each attempt costs more)
ACCURACY_TOLERANCE = 0.02

HELPER = textwrap.dedent(r'''
    import json, os, random, re, resource, select, signal, sys, time, warnings
    warnings.simplefilter("ignore")
    import mxnet  # noqa: F401 - once, before forking
    from edge_agent.train.job import run_finetune
    import edge_agent.train.trainer, edge_agent.int8.selection, edge_agent.hardware.probe  # noqa: F401

    cfg = json.loads(sys.argv[1])
    rng = random.Random(cfg["seed"])
    HANG_S = 300.0  # bounds a hang only: every kill waits for the child's own progress
    TRIGGER = {"train": "train", "saved": "checkpoint", "write": "saving"}  # kill mode -> event counted

    def child(w, state_dir, mode, target):
        seen = {"train": 0, "checkpoint": 0, "saving": 0}

        def send(obj):
            os.write(w, (json.dumps(obj) + "\n").encode())

        def progress(ev):
            send({"phase": ev.phase, "step": ev.step, "detail": ev.detail})
            if ev.phase not in seen or (ev.phase == "train" and ev.detail):  # count real steps only
                return
            seen[ev.phase] += 1
            if mode is not None and ev.phase == TRIGGER[mode] and seen[ev.phase] == target:
                send({"phase": "armed", "step": ev.step})
                if mode == "write":  # the next file write is the checkpoint's temp file
                    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
                    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it by default
                    resource.setrlimit(resource.RLIMIT_FSIZE, (64, resource.RLIM_INFINITY))
                else:
                    os.kill(os.getpid(), signal.SIGSTOP)  # wait here for the helper's SIGKILL

        try:
            report = run_finetune(model=cfg["bundle"], data=cfg["data"], state_dir=state_dir,
                                  cache_dir=cfg["cache"], resume=True, epochs=cfg["epochs"], patience=100,
                                  batch_size=8, checkpoint_every=3, profile="raspberry-pi-4", trainer=cfg["trainer"],
                                  depth=cfg["depth"], progress=progress)
            send({"phase": "report", "report": {k: report[k] for k in ("accuracy", "steps", "stop_reason", "head",
                                                                        "checkpoint_problems", "depth")}})
            os._exit(0)
        except BaseException as exc:
            send({"phase": "error", "detail": f"{type(exc).__name__}: {exc}"})
            os._exit(1)

    def start(state_dir, mode=None, target=0):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            child(w, state_dir, mode, target)
        os.close(w)
        return pid, r

    def events(r, buf):
        """Complete JSON lines (eof=True once the child is gone); raises on a hang."""
        ready, _, _ = select.select([r], [], [], HANG_S)
        if not ready:
            raise SystemExit(f"no progress from the child in {HANG_S} s")
        chunk = os.read(r, 65536)
        if not chunk:
            return [], buf, True
        buf += chunk
        *lines, buf = buf.split(b"\n")
        return [json.loads(line) for line in lines if line], buf, False

    def read_all(r, buf, seen, until=None):
        """Read events into `seen` until one with phase `until` (True) or end of file (False)."""
        while True:
            evs, buf, eof = events(r, buf)
            seen.extend(evs)
            if until is not None and any(ev["phase"] == until for ev in evs):
                return buf, True
            if eof:
                return buf, False

    def run_to_end(state_dir):
        pid, r = start(state_dir)
        seen = []
        read_all(r, b"", seen)
        os.waitpid(pid, 0)
        os.close(r)
        reports = [ev["report"] for ev in seen if ev["phase"] == "report"]
        return (reports[0] if reports else None), [ev["detail"] for ev in seen if ev["phase"] == "error"]

    reference, ref_errors = run_to_end(cfg["reference_state"])  # also warms the engine and feature caches
    rounds, done_max, errors = [], 0, list(ref_errors)
    ckpt_dir = os.path.join(cfg["state"], "checkpoints")
    for k in range(cfg["kills"]):
        mode = ("train", "saved", "write")[k % 3]
        target = rng.randint(1, 6) if mode == "train" else rng.randint(1, 2)
        pid, r = start(cfg["state"], mode, target)
        seen = []
        buf, armed = read_all(r, b"", seen, until="armed")
        if armed and mode != "write":
            _, status = os.waitpid(pid, os.WUNTRACED)  # stopped exactly where it armed
            assert os.WIFSTOPPED(status), status
            os.kill(pid, signal.SIGKILL)
        read_all(r, buf, seen)  # whatever the child wrote before it died
        _, status = os.waitpid(pid, 0)
        os.close(r)
        leftovers = [n for n in os.listdir(ckpt_dir) if n.endswith(".tmp")] if os.path.isdir(ckpt_dir) else []
        resumed = None
        for ev in seen:
            m = re.search(r"resumed from \S+ at step (\d+)", ev.get("detail", ""))
            if ev["phase"] == "train" and m:
                resumed = int(m.group(1))
            if ev["phase"] == "error":
                errors.append(ev["detail"])
        done = [ev["step"] for ev in seen if ev["phase"] == "checkpoint"]
        rounds.append({"mode": mode, "target": target, "armed": armed, "resumed_from": resumed,
                       "done_before": done_max, "checkpoints_done": len(done), "mid_write": bool(leftovers),
                       "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                       "finished_before_kill": any(ev["phase"] == "report" for ev in seen),
                       "steps_trained": sum(ev["phase"] == "train" and not ev["detail"] for ev in seen)})
        done_max = max([done_max, *done])
    final, final_errors = run_to_end(cfg["state"])
    print(json.dumps({"reference": reference, "final": final, "rounds": rounds,
                      "errors": errors + final_errors}))
''')


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # the digits CNN with its two convs below the pool as training depths 1 and 2
    return demo.ensure_bundle(tmp_path_factory.getbasetemp() / "digits-bundle-depths", depths=2)


# both head trainers' checkpoints, and a deep tail (two convs with BatchNorm + the head, MXNet)
@pytest.mark.parametrize(("trainer", "depth"), [("numpy", 0), ("mxnet", 0), ("mxnet", 2)])
def test_kill_9_during_training_and_checkpoint_writes(bundle: Path, tmp_path: Path, trainer: str, depth: int) -> None:
    sc = demo.scenario()
    dev = sc.devices[2]
    data = demo.write_data(tmp_path / "data", dev.images, dev.labels, "npz")
    cfg = {"bundle": str(bundle), "data": str(data), "cache": str(tmp_path / "cache"), "seed": 1234,
           "state": str(tmp_path / "state"), "reference_state": str(tmp_path / "reference"),
           "kills": KILLS if depth == 0 else DEEP_KILLS, "epochs": 40 if depth == 0 else 12, "trainer": trainer,
           "depth": depth}
    kills = cfg["kills"]
    proc = subprocess.run([sys.executable, "-c", HELPER, json.dumps(cfg)], capture_output=True, text=True,
                          timeout=240, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    rounds, reference, final = out["rounds"], out["reference"], out["final"]
    assert out["errors"] == []
    assert [r["mode"] for r in rounds] == ["train", "saved", "write"] * (kills // 3)
    for r in rounds:  # every kill landed where it was aimed, while the job was running
        assert r["armed"] and not r["finished_before_kill"], r
        assert r["signal"] == (signal.SIGXFSZ if r["mode"] == "write" else signal.SIGKILL), r
        # a kill inside a write leaves its temp file; a kill between writes never does
        assert r["mid_write"] == (r["mode"] == "write"), r
        if r["mode"] == "saved":
            assert r["checkpoints_done"] >= r["target"], r
        if r["done_before"] > 0:
            # every resume loads the newest checkpoint completed before the kill: none was lost,
            # and a write cut in the middle is never mistaken for a checkpoint
            assert r["resumed_from"] == r["done_before"], r
        else:
            assert r["resumed_from"] is None, r
    assert sum(r["resumed_from"] is not None for r in rounds) >= kills - 1
    print(f"\n{len(rounds)} kills; {sum(r['mid_write'] for r in rounds)} inside a checkpoint write "
          f"(temp file left); resumed at steps {[r['resumed_from'] for r in rounds]}")
    assert final is not None and final["checkpoint_problems"] == []
    assert final["depth"]["depth"] == reference["depth"]["depth"] == depth  # every resume kept the depth
    assert final["stop_reason"] == reference["stop_reason"] and final["steps"] == reference["steps"]
    assert abs(final["accuracy"]["after"] - reference["accuracy"]["after"]) <= ACCURACY_TOLERANCE
    diffs = [max(abs(a - b) for a, b in zip(p["values"], final["head"]["params"][n]["values"], strict=True))
             for n, p in reference["head"]["params"].items()]
    print(f"final accuracy {final['accuracy']['after']} vs uninterrupted {reference['accuracy']['after']}; "
          f"max |param difference| {max(diffs):.3g}")
