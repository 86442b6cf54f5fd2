"""Thermal zones: /sys/class/thermal/thermal_zone*/temp in millidegrees Celsius.

The governor cares about the hottest zone. Zones that fail to read or report nonsense
(some drivers return -273150 or 0 when their sensor is off) are skipped, not trusted.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from ..hardware.sysfs import SysRoot
from ._nodes import NodeReader, plausible

THERMAL = "/sys/class/thermal"
MIN_PLAUSIBLE_C = -40.0
MAX_PLAUSIBLE_C = 150.0


@dataclass(frozen=True)
class ThermalReading:
    max_c: float
    zone: str  # "thermal_zone0 (cpu-thermal)"
    zones: dict[str, float] = field(default_factory=dict)


class ThermalMonitor:
    """The hottest plausible thermal zone under a root; `read()` never raises."""

    def __init__(
        self, root: str | os.PathLike[str] | SysRoot = "/", *, zones: list[str] | None = None
    ) -> None:
        self.nodes = NodeReader(root)
        if zones is None:
            zones = [z for z in self.nodes.listdir(THERMAL) if re.fullmatch(r"thermal_zone\d+", z)]
        self.zones = list(zones)
        self._types = {z: (self.nodes.text(f"{THERMAL}/{z}/type") or "?") for z in self.zones}

    def describe(self) -> dict[str, object]:
        return {"kind": "thermal", "zones": {z: self._types[z] for z in self.zones}}

    def read(self) -> ThermalReading | None:
        temps: dict[str, float] = {}
        for zone in self.zones:
            milli = self.nodes.int(f"{THERMAL}/{zone}/temp")
            if milli is None:
                continue
            celsius = milli / 1000.0
            if not plausible(celsius, MIN_PLAUSIBLE_C, MAX_PLAUSIBLE_C):
                self.nodes.note(f"{THERMAL}/{zone}/temp", f"implausible {celsius:g} C")
                continue
            temps[f"{zone} ({self._types[zone]})"] = celsius
        if not temps:
            return None
        hottest = max(temps, key=lambda k: temps[k])
        return ThermalReading(max_c=temps[hottest], zone=hottest, zones=temps)
