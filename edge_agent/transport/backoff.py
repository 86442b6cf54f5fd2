"""Full-jitter exponential backoff (AWS Architecture Blog, "Exponential Backoff And Jitter").

A fleet that lost its broker reconnects all at once when it comes back; drawing each
delay uniformly from [0, min(cap, base * 2**attempt)] spreads the herd out.
"""

from __future__ import annotations

import random


def full_jitter(attempt: int, *, base: float, cap: float, rng: random.Random | None = None) -> float:
    """Delay before retry number `attempt` (0 = first retry)."""
    if base <= 0 or cap < base:
        raise ValueError(f"backoff needs 0 < base <= cap (base={base}, cap={cap})")
    ceiling = cap if attempt >= 62 else min(cap, base * (1 << max(attempt, 0)))
    return (rng or random).uniform(0.0, ceiling)
