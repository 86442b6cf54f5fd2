"""Power sources and the budget governor.

How a trainer uses the governor (the trainer owns checkpoints and threads):

    monitor = PowerMonitor.discover("/", idle_w=profile.idle_w, load_w=profile.load_w)
    gov = BudgetGovernor(budget=Budget.from_config(cfg), sources=monitor,
                         thermal=ThermalMonitor("/"), clock=SystemClock())
    for batch in batches:
        decision = gov.before_step()
        if decision.paused:
            trainer.checkpoint()
            decision = gov.wait_until_resumable()
        if decision.stopped:
            trainer.checkpoint()
            break
        seconds = trainer.step(batch)
        trainer.set_threads(gov.after_step(seconds).threads)
    else:
        gov.finish(StopReason.DONE)
    print(gov.report())
"""

from .battery import BatteryGauge, BatteryState, discover_battery
from .budget import Budget, TimeWindow, parse_window
from .clock import Clock, ManualClock, SystemClock
from .decisions import (
    Action,
    Decision,
    PauseReason,
    ResumeCondition,
    StepAdvice,
    StopReason,
)
from .governor import BudgetGovernor
from .monitor import PowerMonitor
from .sources import PowerSample, PowerSource, discover_power_sources
from .thermal import ThermalMonitor, ThermalReading

__all__ = [
    "Action",
    "BatteryGauge",
    "BatteryState",
    "Budget",
    "BudgetGovernor",
    "Clock",
    "Decision",
    "ManualClock",
    "PauseReason",
    "PowerMonitor",
    "PowerSample",
    "PowerSource",
    "ResumeCondition",
    "StepAdvice",
    "StopReason",
    "SystemClock",
    "ThermalMonitor",
    "ThermalReading",
    "TimeWindow",
    "discover_battery",
    "discover_power_sources",
    "parse_window",
]
