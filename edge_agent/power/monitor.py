"""PowerMonitor: the ordered power sources plus the battery gauge, read as one.

Every source is read at every sample (cheap: a few small sysfs reads per step) so that
counter-based sources stay aligned with the sampling instants and a fallback is accurate
from its first use; the first source with a valid reading wins and tags the sample.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from .battery import BatteryGauge, BatteryState, discover_battery
from .sources import CpuEstimateSource, PowerSample, PowerSource, discover_power_sources


class PowerMonitor:
    def __init__(
        self,
        sources: Sequence[PowerSource],
        *,
        battery: BatteryGauge | None = None,
        idle_w: float | None = None,
    ) -> None:
        self.sources = list(sources)
        self.battery_gauge = battery
        if idle_w is None:  # the CPU model's idle figure is the board profile's
            idle_w = next(
                (s.idle_w for s in self.sources if isinstance(s, CpuEstimateSource)), None
            )
        self.idle_w = idle_w

    @classmethod
    def discover(
        cls,
        root: str | os.PathLike[str] = "/",
        *,
        idle_w: float | None = None,
        load_w: float | None = None,
    ) -> PowerMonitor:
        """Everything found under `root`; idle_w/load_w come from the board profile."""
        return cls(
            discover_power_sources(root, idle_w=idle_w, load_w=load_w),
            battery=discover_battery(root),
            idle_w=idle_w,
        )

    def read(self, t: float) -> PowerSample | None:
        chosen: PowerSample | None = None
        for source in self.sources:
            try:
                sample = source.read(t)
            except Exception as exc:  # a source bug must not stop training; report it
                source.nodes.note(source.path, f"read raised {type(exc).__name__}: {exc}")
                sample = None
            if chosen is None and sample is not None:
                chosen = sample
        return chosen

    def battery(self) -> BatteryState | None:
        if self.battery_gauge is None:
            return None
        try:
            return self.battery_gauge.read()
        except Exception as exc:
            self.battery_gauge.nodes.note(
                self.battery_gauge.path, f"read raised {type(exc).__name__}: {exc}"
            )
            return None

    def describe(self) -> list[dict[str, object]]:
        """For `edge-agent probe`: sources in preference order, then the battery gauge."""
        rows = [dict(s.describe(), rank=i + 1) for i, s in enumerate(self.sources)]
        if self.battery_gauge is not None:
            rows.append(self.battery_gauge.describe())
        return rows

    def problems(self) -> dict[str, object]:
        readers = [(s.name, s.nodes) for s in self.sources]
        if self.battery_gauge is not None:
            readers.append((self.battery_gauge.name, self.battery_gauge.nodes))
        return {
            name: {"count": nodes.problem_count, "recent": list(nodes.recent_problems)}
            for name, nodes in readers
            if nodes.problem_count
        }
