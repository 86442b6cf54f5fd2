"""Strikes and quarantine: a device whose updates are refused for what no honest device sends
(non-finite values, values beyond any plausible delta) collects a strike each time, and one
accepted update takes one off; at `quarantine_after` strikes it is quarantined -- not selected
for rounds until an operator releases it (`edge-coordinator devices --release ID`). An update
that merely disagrees with the others is never a strike: it only counts less (strategies/)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger("edge_agent.coordinator.rounds")


class Strikes:
    def __init__(self, *, registry: Any, quarantine_after: int, clock: Callable[[], float]) -> None:
        self.registry, self.quarantine_after, self.clock = registry, quarantine_after, clock

    def apply(self, strikes: Mapping[str, str | None]) -> None:
        """device -> why it struck (or None: an accepted update, one strike off)."""
        if not strikes:
            return
        for dev in self.registry.apply_strikes(strikes, quarantine_after=self.quarantine_after, now=self.clock()):
            log.warning("device %s quarantined: %s; it is not selected for rounds until "
                        "`edge-coordinator devices --release %s`", dev.id, dev.quarantine_reason, dev.id)
