"""Inference energy: what serving requests costs, for the power budget.

The service measures each request's CPU time in the thread that ran it (inference is
CPU-bound: the int8 engine and the numpy tail) and prices it at the board profile's watts
per busy CPU, as engine selection prices the engines. The running total is written to
`<state>/serve/inference-energy.json` (atomic) every few seconds; a fine-tune's governor
reads it (power.governor: `inference_j`), so the energy the device spent answering
requests while a job trained is accounted as inference, not charged to the job's budget.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from ..atomic import atomic_write_json, read_limited

ENERGY_FILE = "serve/inference-energy.json"
DEFAULT_WATTS_PER_CPU = 2.0  # int8.engine_cost's default: one busy core of a Pi-class board


class InferenceEnergy:
    """A thread-safe running total of inference CPU-seconds and joules."""

    def __init__(self, *, watts_per_cpu: float | None = None, path: Path | None = None) -> None:
        self.watts_per_cpu = float(watts_per_cpu or DEFAULT_WATTS_PER_CPU)
        self.path = path
        self.cpu_s = 0.0
        self.requests = 0
        self._lock = threading.Lock()
        self._written = -1.0
        if path is not None:  # a restart continues the total: readers see it only grow
            previous = read_inference_j(path, with_cpu=True)
            if previous is not None:
                self.cpu_s, self.requests = previous

    @property
    def joules(self) -> float:
        return self.cpu_s * self.watts_per_cpu

    def add(self, cpu_s: float) -> None:
        with self._lock:
            self.cpu_s += max(0.0, float(cpu_s))
            self.requests += 1

    def to_json(self) -> dict[str, Any]:
        return {"cpu_s": round(self.cpu_s, 6), "joules": round(self.joules, 6), "wh": round(self.joules / 3600.0, 9),
                "requests": self.requests, "watts_per_cpu": self.watts_per_cpu, "at": round(time.time(), 3)}

    def flush(self) -> None:
        """Write the total if it changed (atomic: a reader never sees half of it)."""
        if self.path is None or self._written == self.cpu_s:
            return
        cpu = self.cpu_s
        atomic_write_json(self.path, self.to_json())
        self._written = cpu


def read_inference_j(path: Path, *, with_cpu: bool = False) -> Any:
    """The joules in an energy file (or (cpu_s, requests) with `with_cpu`); None if absent or unreadable."""
    try:
        obj = json.loads(read_limited(path, 64 << 10))
        if with_cpu:
            return float(obj["cpu_s"]), int(obj["requests"])
        return float(obj["joules"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
