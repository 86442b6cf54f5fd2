"""The int8 engine interface: every way of running the frozen backbone in int8.

An engine says whether it can run here (and why not), and prepares a model into a runner.
Engines are discovered by a fixed preference list, each probed with its errors caught and
reported (tinygrad's `DEV=` pattern); `EDGE_AGENT_INT8_BACKEND=<name>` forces one.

Runners take the batch in the bundle's input layout (float32, NCHW as MXNet uses, already
normalised) and return float32 features (N, ...). Engines that execute the project's own
int8 model also expose `run_int8` on NHWC int8 input so agreement can be checked in int8
units against the reference.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # numpy only for annotations: the CLI and idle daemon must not load it
    import numpy as np

ENV_FORCE_BACKEND = "EDGE_AGENT_INT8_BACKEND"
# "1": run the forced engine even when it fails the agreement check (with a warning);
# without it a forced engine marked wrong is an error (exit 69). --force-engine sets it.
ENV_FORCE_WRONG = "EDGE_AGENT_INT8_FORCE"


@dataclass
class Availability:
    available: bool
    reason: str = ""  # why not, or what was found ("tflite-runtime 2.14.0, XNNPACK")
    detail: dict[str, Any] = field(default_factory=dict)  # e.g. {"variant": "avx2"}


class Runner(abc.ABC):
    """A model prepared on one engine."""

    @abc.abstractmethod
    def run(self, batch: np.ndarray) -> np.ndarray:
        """float32 batch in the bundle's input layout -> float32 features."""

    def run_int8(self, batch_nhwc: np.ndarray) -> np.ndarray:
        """int8 NHWC batch -> int8 output, for engines that run the project's int8 model."""
        raise NotImplementedError(f"{type(self).__name__} has no int8 entry point")

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release native resources."""


class Int8Engine(abc.ABC):
    """One int8 execution engine (tflite, edgetpu, mxnet-onednn, native, reference)."""

    name: str = ""
    # CPU-seconds prepare() costs on a server core beyond running the bundle's samples (a
    # runtime to import, a model to compile or quantise): what engine selection predicts and
    # checks against a job's energy budget before it prepares the engine
    prepare_cpu_s_hint: float = 1.0
    # The memory an engine adds to the process (engine_memory.py predicts selection's and a
    # job's peak from them before anything is prepared): MB for its runtime or library, which
    # availability() loads once; MB for each prepared model; and bytes per activation element
    # of the int8 prefix per sample of a batch it runs
    # (per thread when run_memory_per_thread: each thread its own scratch)
    runtime_mb_hint: float = 10.0
    prepare_mb_hint: float = 10.0
    run_bytes_per_activation: float = 1.0
    run_memory_per_thread: bool = False

    def memory_mb_hint(self, activations: int, batch: int, *, threads: int = 1, runtime_loaded: bool = False) -> float:
        """MB this engine adds prepared with `threads` threads and running batches of `batch`
        samples of a prefix whose activation tensors hold `activations` elements per sample
        (`runtime_loaded`: its availability was checked in this process already)."""
        per_run = batch * activations * self.run_bytes_per_activation / 2**20
        return ((0.0 if runtime_loaded else self.runtime_mb_hint) + self.prepare_mb_hint
                + per_run * (max(1, threads) if self.run_memory_per_thread else 1))

    @abc.abstractmethod
    def availability(self, probe: dict[str, Any] | None = None) -> Availability:
        """Can this engine run here? `probe` is the hardware probe's JSON report. Cheap: no
        heavy runtime is imported here (selection runs it for every engine before it can
        price them); what only a prepare can tell is prepare()'s to raise."""

    @abc.abstractmethod
    def prepare(self, model: Any, *, threads: int | None = None) -> Runner:
        """Prepare a model bundle (edge_agent.int8.bundle.Bundle) for running."""
