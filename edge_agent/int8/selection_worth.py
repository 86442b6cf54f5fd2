"""Which engines a fresh selection thinks worth preparing for a job: every cheap one, and
one expensive to prepare (mxnet-onednn's MXNet import) only when the job could pay for it.
`selection_measure` applies the rules while it measures; `selection_candidates` predicts
what they will leave for the depth planner's memory figure (engine_memory.selection_mb),
before anything is measured.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .engine_cost import Meter, SelectionStopped
from .selection_cache import Candidate

# An engine whose class says it costs at least this many CPU-seconds to prepare (its
# prepare_cpu_s_hint: mxnet-onednn, 6 s) is prepared last, and only when the job could pay for
# it: not when preparing it alone would cost more than the whole job on an engine already
# checked. Its prepare is taken at PREPARE_HINT_LOW x the hint (measured 2.9-3.3 CPU-s on an
# EPYC core, half its hint; a faster core may do better), the checked engine's job at the
# per-image CPU of its check runs (cold, so an over-estimate): both err towards preparing.
EXPENSIVE_PREPARE_S = 2.0
PREPARE_HINT_LOW = 0.25


def dominated(row: Candidate, hint_s: float, rows: list[Candidate], check_rate: Mapping[str, float],
              images: int) -> str | None:
    """Why an engine expensive to prepare need not be prepared for a job of `images` images
    (see EXPENSIVE_PREPARE_S), or None. CPU-seconds on both sides: the same watts multiply them."""
    if hint_s < EXPENSIVE_PREPARE_S:
        return None
    jobs = [((r.prepare_cpu_s or 0.0) + images * check_rate[r.name], r.name)
            for r in rows if r.correct and r.name in check_rate]
    if not jobs:
        return None
    best_s, best = min(jobs)
    low = hint_s * PREPARE_HINT_LOW
    if low <= best_s:
        return None
    return (f"its prepare alone (~{low:.2g} CPU-s or more) costs more than a {images:,}-image job on {best} "
            f"(~{best_s:.2g} CPU-s)")


def unaffordable(meter: Meter, name: str, hint_s: float, predicted_j: float) -> str | None:
    """Why an engine expensive to prepare is skipped because the job's budget cannot pay for
    it (the meter refuses its prepare), or None: a cheaper engine was checked already."""
    if hint_s < EXPENSIVE_PREPARE_S:
        return None
    try:
        meter.before(f"prepare:{name}", predicted_j)
    except SelectionStopped:
        return f"the job's energy budget cannot pay for its prepare (~{predicted_j:.3g} J predicted)"
    return None


def selection_candidates(engines: Sequence[tuple[str, Any]], *, job_cpu_s: float) -> list[tuple[str, Any]]:
    """Which of the available `engines` a fresh selection prepares, in its order: cheapest to
    prepare first; one expensive to prepare only when the job's int8 features (`job_cpu_s`
    on a cheap engine) cost more than its prepare, or no cheap one is there
    (`dominated`); the reference only when it is the only one."""

    def hint(engine: Any) -> float:
        return float(getattr(engine, "prepare_cpu_s_hint", 1.0))

    others = sorted(((n, e) for n, e in engines if n != "reference"), key=lambda ne: hint(ne[1]))
    if not others:
        return [(n, e) for n, e in engines if n == "reference"]
    cheap = [(n, e) for n, e in others if hint(e) < EXPENSIVE_PREPARE_S]
    return [(n, e) for n, e in others if (n, e) in cheap or not cheap or hint(e) * PREPARE_HINT_LOW <= job_cpu_s]
