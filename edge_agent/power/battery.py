"""Battery state of charge from /sys/class/power_supply (capacity %, status).

Separate from the power sources because a board may measure its load with an INA219 on
the input rail and still have a fuel gauge that says how full the battery is.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..hardware.sysfs import SysRoot
from ._nodes import NodeReader
from .sources import POWER_SUPPLY, UWH_TO_J

STATUSES = frozenset({"Unknown", "Charging", "Discharging", "Not charging", "Full"})
CAPACITY_SLACK_PCT = 5  # gauges briefly report 101-105 % at the end of a charge


@dataclass(frozen=True)
class BatteryState:
    capacity_pct: float
    status: str | None  # one of STATUSES, or None if unreadable/unknown text
    energy_j: float | None  # energy_now, if the gauge has it
    source: str

    @property
    def charging(self) -> bool:
        return self.status in ("Charging", "Full")


class BatteryGauge:
    """Reads one power_supply battery; `read()` returns None when capacity is unusable."""

    def __init__(self, root: str | os.PathLike[str] | SysRoot, supply: str) -> None:
        self.nodes = NodeReader(root)
        self.path = supply
        self.name = f"battery:{os.path.basename(supply)}"

    def describe(self) -> dict[str, object]:
        return {
            "kind": "battery",
            "name": self.name,
            "path": self.path,
            "detail": "capacity (%), status, energy_now (uWh)",
        }

    def read(self) -> BatteryState | None:
        capacity = self.nodes.int(f"{self.path}/capacity")
        if capacity is None:
            return None
        if not 0 <= capacity <= 100 + CAPACITY_SLACK_PCT:
            self.nodes.note(f"{self.path}/capacity", f"implausible {capacity} %")
            return None
        status = self.nodes.text(f"{self.path}/status")
        if status is not None and status not in STATUSES:
            self.nodes.note(f"{self.path}/status", f"unknown status {status[:40]!r}")
            status = None
        energy = self.nodes.int(f"{self.path}/energy_now")
        return BatteryState(
            capacity_pct=float(min(capacity, 100)),
            status=status,
            energy_j=energy * UWH_TO_J if energy is not None and energy >= 0 else None,
            source=self.name,
        )


def discover_battery(root: str | os.PathLike[str] = "/") -> BatteryGauge | None:
    """The first system battery (type Battery, not a peripheral's) with a capacity node."""
    nodes = NodeReader(root)
    for entry in nodes.listdir(POWER_SUPPLY):
        supply = f"{POWER_SUPPLY}/{entry}"
        if nodes.text(f"{supply}/type") != "Battery" or nodes.text(f"{supply}/scope") == "Device":
            continue
        if nodes.exists(f"{supply}/capacity"):
            return BatteryGauge(root, supply)
    return None
