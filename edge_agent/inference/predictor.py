"""The predictor: raw NCHW pixels -> logits through a bundle at a depth, and what a caller
makes of them (top-k labels with softmax scores, accuracy).

`Predictor` is what train/infer.py's DepthPredictor was, now
used by every caller that predicts: `edge-agent predict`, the daemon's service, the local
guard's held-out evaluation and the benchmarks. `open_predictor` adds the engine choice the
fine-tune makes (engine selection, cached per backbone and device), so a served model runs
on the engine its tail was trained over.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .tail import build_tail

MAX_HEAD_FILE_BYTES = 256 << 20


def tail_params(bundle: Any, head_file: str | Path | None = None) -> dict[str, np.ndarray]:
    """The bundle's parameters by bare name (every depth's), or those of a trained head file."""
    from ..atomic import read_limited
    from ..int8.bundle import bundle_params
    from ..mxparams import load_params, split_names

    if head_file is None:
        return bundle_params(bundle)[0]
    return split_names(load_params(read_limited(head_file, MAX_HEAD_FILE_BYTES), where=str(head_file)))[0]


def adapted_or_own(view: Any, prefix: str | os.PathLike[str] | None) -> Any:
    """`view`, or with `prefix` (an int8 prefix adapted to the device's camera, a personal
    tail's: int8/adapt_norm.py) in place of its own."""
    if prefix is None:
        return view
    from ..int8.adapt_norm import adapted_view

    return adapted_view(view, Path(prefix))


class Predictor:
    """logits(raw NCHW pixels) through `bundle` at `depth` with `params` (by bare name,
    over the bundle's own). Thread-safe: one request at a time reaches the engine's runner
    (engines hold per-runner buffers)."""

    def __init__(self, bundle: Any, *, depth: int = 0, params: Mapping[str, np.ndarray] | None = None,
                 engine: str = "reference", threads: int = 1, runner: Any | None = None,
                 prefix: str | os.PathLike[str] | None = None) -> None:
        from ..int8.engines import load_engine

        self.view = adapted_or_own(bundle.at_depth(depth), prefix)
        self.depth = depth
        self.engine = engine
        self.spec = self.view.manifest.input
        self.labels = list(self.view.manifest.labels)
        values = {**tail_params(self.view), **(params or {})}
        self.tail = build_tail(self.view, values)
        self.runner = runner if runner is not None else load_engine(engine).prepare(self.view, threads=threads)
        self._lock = threading.Lock()

    @property
    def tail_kind(self) -> str:
        return self.tail.kind

    def logits(self, raw: np.ndarray, *, batch_size: int = 64) -> np.ndarray:
        x = self.spec.normalise(np.asarray(raw))
        out = []
        with self._lock:
            for i in range(0, len(x), batch_size):
                out.append(np.asarray(self.tail.logits(self.runner.run(x[i:i + batch_size])), np.float32)
                           .reshape(min(batch_size, len(x) - i), -1))
        return np.concatenate(out) if out else np.empty((0, len(self.labels)), np.float32)

    def accuracy(self, raw: np.ndarray, labels: np.ndarray) -> float:
        return float((self.logits(raw).argmax(axis=1) == np.asarray(labels)).mean()) if len(labels) else float("nan")

    def close(self) -> None:
        self.runner.close()


# the old name: benchmarks and the fleet simulation say DepthPredictor
DepthPredictor = Predictor


@dataclass(frozen=True)
class Ranked:
    """One sample's top-k: label names and softmax probabilities, best first."""

    labels: list[str]
    scores: list[float]

    def to_json(self) -> dict[str, Any]:
        return {"label": self.labels[0], "score": self.scores[0],
                "top": [{"label": name, "score": score} for name, score in zip(self.labels, self.scores, strict=True)]}


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.asarray(logits, np.float64) - np.max(logits, axis=1, keepdims=True)
    e = np.exp(shifted)
    return e / e.sum(axis=1, keepdims=True)


def top_k(logits: np.ndarray, labels: list[str], k: int) -> list[Ranked]:
    """Per row, the k most probable labels (ties: the lower index first) with their scores."""
    probs = softmax(logits)
    k = max(1, min(int(k), probs.shape[1]))
    order = np.argsort(-probs, axis=1, kind="stable")[:, :k]
    return [Ranked([labels[j] for j in row], [round(float(p[j]), 6) for j in row]) for row, p in zip(order, probs, strict=True)]


def engine_settings(probe: Mapping[str, Any]) -> dict[str, Any]:
    """The board profile's engine preference, int8 threads and batch size: the key the
    fine-tune's engine selection is cached under, so both find the same decision."""
    from ..int8.engines._common import thread_count
    from ..int8.selection import profile_settings

    profile = profile_settings(probe)
    return {"preference": profile.get("backends"), "threads": thread_count(profile.get("threads")),
            "batch_size": int(profile.get("batch_size", 32)), "watts_per_cpu": profile.get("watts_per_cpu"),
            "memory_cap_mb": profile.get("memory_cap_mb")}


def open_predictor(bundle: Any, *, depth: int = 0, params: Mapping[str, np.ndarray] | None = None,
                   engine: str | None = None, state_dir: str | os.PathLike[str] | None = None,
                   probe: Mapping[str, Any] | None = None, threads: int | None = None,
                   select_in_child: bool = True, prefix: str | os.PathLike[str] | None = None) -> Predictor:
    """A Predictor on the engine the device selected for this backbone (the selection cache
    in `state_dir`, shared with `finetune` and `kernels --bench`), or on `engine` when one is
    named. With no decision cached yet, the selection runs in a child process
    (`select_in_child`): trying every engine imports runtimes (MXNet's oneDNN engine among
    them) that a serving process must not keep; this process then prepares only the chosen
    engine. The selection's agreement check scores engines through the tail's own numpy
    logits where it has them. With `prefix` (an adapted int8 prefix), the engine chosen for
    the bundle's own prefix runs it once it agrees there with the reference
    (int8/adapt_norm.prepare_adapted)."""
    from ..int8.selection import cached_selection, default_probe, select_engine

    view = bundle.at_depth(depth)
    if engine:
        return Predictor(bundle, depth=depth, params=params, engine=engine, threads=threads or 1, prefix=prefix)
    probe = dict(probe) if probe is not None else default_probe()
    settings = engine_settings(probe)
    threads = threads or settings["threads"]
    key = {"probe": probe, "preference": settings["preference"], "batch_size": settings["batch_size"],
           "threads": threads, "state_dir": state_dir}
    if select_in_child and state_dir is not None and cached_selection(view, **key) is None:
        _select_in_child(bundle.path, depth, probe, Path(state_dir), threads)
    tail = build_tail(view, {**tail_params(view), **(params or {})})
    selection, runner = select_engine(
        view, probe=probe, preference=settings["preference"], batch_size=settings["batch_size"],
        threads=threads, state_dir=state_dir, keep_runner=prefix is None, images=SERVING_IMAGES,
        logits=lambda f: np.asarray(tail.logits(f)).reshape(len(f), -1), watts_per_cpu=settings["watts_per_cpu"],
        mem_cap_mb=settings["memory_cap_mb"])
    if prefix is not None:
        from ..int8.adapt_norm import prepare_adapted
        from ..int8.engine_cost import EngineUnavailableError

        adapted = adapted_or_own(view, prefix)
        adapted_runner, why = prepare_adapted(adapted, selection, adapted.calibration(), threads)
        if adapted_runner is None:
            raise EngineUnavailableError(f"{prefix}: {why}")
        runner = adapted_runner
    return Predictor(bundle, depth=depth, params=params, engine=selection.chosen or "reference", runner=runner,
                     prefix=prefix)


SERVING_IMAGES = 10000  # what the choice minimises: a served model answers many images


def _select_in_child(path: Path, depth: int, probe: Mapping[str, Any], state_dir: Path, threads: int) -> None:
    import json
    import subprocess
    import sys
    import tempfile

    from ..errors import EdgeAgentError

    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="probe-") as f:
        json.dump(probe, f)
        f.flush()
        done = subprocess.run([sys.executable, "-m", "edge_agent.inference.predictor", str(path), str(depth), f.name,
                               str(state_dir), str(threads)], capture_output=True, text=True)
    if done.returncode != 0:
        raise EdgeAgentError(f"{path}: engine selection failed: {(done.stderr or done.stdout).strip()[-400:]}")


if __name__ == "__main__":  # the selection child (open_predictor): BUNDLE DEPTH PROBE_JSON STATE_DIR THREADS
    import json
    import sys

    from ..int8.bundle import load_bundle

    _path, _depth, _probe, _state, _threads = sys.argv[1:6]
    open_predictor(load_bundle(_path), depth=int(_depth), probe=json.loads(Path(_probe).read_text()),
                   state_dir=_state, threads=int(_threads), select_in_child=False).close()
