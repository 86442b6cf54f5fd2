"""What a job has spent, in the budget's energy scope and as the board measured it.

Two figures side by side (the governor's module doc says which the budget is charged with):

    scope "process"   the job's own CPU-seconds x watts per busy core (process_energy.py)
    scope "device"    the power source's whole-board figure (energy.py's EnergyMeter),
                      less what the local inference service spent meanwhile ("job" basis)

Both carry the energy of earlier runs of the same job (a resumed checkpoint's `state()`),
so a budget stays per job across reboots.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from ..errors import InputError
from .energy import EnergyMeter
from .monitor import PowerMonitor
from .process_energy import ProcessEnergy, process_cpu_seconds

ENERGY_KEYS = ("energy_j_total", "energy_j_job", "device_energy_j_total", "device_energy_j_job")


class JobEnergy:
    """The meter, the process's CPU energy, earlier runs' offsets and the inference reader."""

    def __init__(self, *, monitor: PowerMonitor, idle_w: float | None, start_t: float, energy_scope: str,
                 watts_per_cpu: float | None, cpu_seconds: Callable[[], float] | None,
                 inference_j: Callable[[], float | None] | None) -> None:
        self.monitor = monitor
        self.meter = EnergyMeter(idle_w=idle_w, start_t=start_t)
        self.process: ProcessEnergy | None = None
        self.scope_note = ""
        if energy_scope == "process":
            if watts_per_cpu is not None:
                self.process = ProcessEnergy(watts_per_cpu=watts_per_cpu, cpu_seconds=cpu_seconds or process_cpu_seconds)
            else:
                self.scope_note = ("energy scope 'process' needs the board profile's watts per core (load_w - "
                                   "idle_w); none known, so the device-wide figure is charged")
        self._offsets = dict.fromkeys(ENERGY_KEYS, 0.0)
        self._inference = inference_j
        self._inference_start = self._read_inference()

    @property
    def scope(self) -> str:
        """What the budget is charged with: "process" or "device"."""
        return "process" if self.process is not None else "device"

    def sample(self, t: float, *, hold_end: bool = False) -> None:
        """One reading of the board's sources and of the job's CPU counter, at `t`."""
        self.meter.add(self.monitor.read(t), hold_end=hold_end)
        if self.process is not None:
            self.process.sample(t)

    def total_j(self) -> float:
        """The budget's "total" energy in its scope, earlier runs of the job included."""
        if self.process is not None:
            return self._offsets["energy_j_total"] + self.process.total_j(self.meter.idle_w)
        return self._offsets["energy_j_total"] + self.meter.total_j

    def job_j(self) -> float:
        """The budget's "job" (above idle) energy in its scope, earlier runs included; in the
        device scope without what the inference service spent meanwhile."""
        if self.process is not None:
            return self._offsets["energy_j_job"] + self.process.job_j
        return max(0.0, self._offsets["energy_j_job"] + self.meter.job_j - self.inference_j())

    def used_j(self, basis: str) -> float:
        return self.job_j() if basis == "job" else self.total_j()

    def device_total_j(self) -> float:
        return self._offsets["device_energy_j_total"] + self.meter.total_j

    def device_job_j(self) -> float:
        return self._offsets["device_energy_j_job"] + self.meter.job_j

    def inference_j(self) -> float:
        """Inference energy spent since this run started (J); 0 without a reader."""
        now = self._read_inference()
        if now is None or self._inference_start is None:
            if now is not None and self._inference_start is None:
                self._inference_start = now  # the service started after the job did
            return 0.0
        return max(0.0, now - self._inference_start)

    def _read_inference(self) -> float | None:
        if self._inference is None:
            return None
        try:
            value = self._inference()
        except Exception:  # noqa: BLE001 - a reader that fails counts nothing, never stops the job
            return None
        return float(value) if value is not None and math.isfinite(value) else None

    def state(self) -> dict[str, float]:
        return {"energy_j_total": self.total_j(), "energy_j_job": self.job_j(),
                "device_energy_j_total": self.device_total_j(), "device_energy_j_job": self.device_job_j()}

    def restore(self, values: Mapping[str, float]) -> None:
        """Carry over an earlier run's energy (values checked by the caller: finite, >= 0)."""
        self._offsets = {k: float(values[k]) for k in ENERGY_KEYS}


def checked_state(state: Mapping[str, object], keys: tuple[str, ...]) -> dict[str, float]:
    """A stored governor state's numbers (untrusted: a checkpoint on disk), each finite and >= 0."""
    values: dict[str, float] = {}
    for key in keys:
        value = state.get(key, 0.0)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise InputError(f"governor state: {key} must be a finite number >= 0, got {value!r}")
        values[key] = float(value)
    return values
