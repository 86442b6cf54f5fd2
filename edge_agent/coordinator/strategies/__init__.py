"""Aggregation rules, one class each, chosen from one table (`STRATEGIES`), never by name
switches elsewhere. base.py has the streaming interface every rule implements.

The default rule follows what the coordinator knows (`default_strategy`; docs/fleet.md has the
measurements behind it, from bench/bench_poisoning.py):

    server set | devices per round | default      | why
    -----------+-------------------+--------------+---------------------------------------------
    yes        | any               | trust        | the coordinator's own evidence judges each update;
               |                   |              | robust with 2 devices and beyond a minority of attackers
    no         | <= 100            | median_trust | agreement with the round's median decides how much an
               |                   |              | update counts; nothing is ejected for disagreeing; a
               |                   |              | device whose updates push down the classes it reports
               |                   |              | holding counts for nothing (claims.py)
    no         | > 100             | trimmed_mean | the median's every-update reads at close cost too much;
               |                   |              | a 20 % trim holds against a minority at that size

A private job (--dp-clip/--dp-noise, coordinator/privacy.py) always aggregates with dp_fedavg.
"""

from __future__ import annotations

from .base import (
    Aggregate,
    Contribution,
    DenseUpdate,
    NothingToAggregate,
    Partial,
    RoundEvidence,
    ServerEvidence,
    Strategy,
    StrategyOptions,
)
from .coordinatewise import Median, TrimmedMean
from .dp import DpFedAvg, GaussianSum
from .fedavg import ClippedFedAvg, FedAvg
from .krum import MultiKrum, krum_select
from .trust import MedianTrust, TrustScored

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (TrustScored, MedianTrust, FedAvg, ClippedFedAvg, Median, TrimmedMean, MultiKrum,
                              DpFedAvg)}
AGGREGATORS = tuple(STRATEGIES)
LARGE_ROUND = 100  # above this many devices per round, no server set: trimmed_mean


def default_strategy(devices_per_round: int, has_server_set: bool) -> tuple[str, str]:
    """(rule name, why) for a job that names none."""
    if has_server_set:
        return "trust", "the model has a server set"
    if devices_per_round > LARGE_ROUND:
        return "trimmed_mean", f"no server set, more than {LARGE_ROUND} devices per round"
    return "median_trust", f"no server set, at most {LARGE_ROUND} devices per round"


def make_strategy(name: str, options: StrategyOptions, evidence: RoundEvidence) -> Strategy:
    try:
        cls = STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown aggregator {name!r} (one of {', '.join(AGGREGATORS)})") from None
    return cls(options, evidence)


__all__ = ["AGGREGATORS", "Aggregate", "Contribution", "DenseUpdate", "GaussianSum", "LARGE_ROUND", "NothingToAggregate",
           "Partial", "RoundEvidence", "STRATEGIES", "ServerEvidence", "Strategy", "StrategyOptions",
           "default_strategy", "krum_select", "make_strategy"]
