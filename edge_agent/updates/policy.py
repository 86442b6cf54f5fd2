"""How hard to compress each round: fixed rate or byte budget, plus a warm-up schedule.

Warm-up (Deep Gradient Compression, Lin et al. 2018): the model moves most in the first
rounds, where heavy sparsification hurts most, so early rounds send more. Round r < W
(W = `warmup_rounds`) gets its budget (or density) multiplied by
    factor ** (1 - r / W)
i.e. `warmup_factor` times the steady rate at round 0, decaying geometrically to 1x at
round W. Rounds are the coordinator's round numbers, counted from 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from .codec import SCOPES
from .quantize import SUPPORTED_BITS


@dataclass(frozen=True)
class RoundSettings:
    scope: str
    density: float  # fixed rate: fraction of values kept (unused with a budget)
    bits: int  # fixed rate: bit width (unused with a budget)
    budget_bytes: int | None  # wire bytes for this round's update, or None (fixed rate)
    bits_choices: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class CompressionPolicy:
    """Compression settings of a device's updates (validated at construction).

    With `budget_bytes` set, each update is the most accurate one that fits that many bytes
    on the wire (budget.py picks k and the bit width from `bits_choices`); otherwise top-k
    keeps `density` of the values at `bits`. `error_feedback` keeps what was not sent for
    the next round (strongly recommended: without it, top-k loses accuracy).
    """

    budget_bytes: int | None = None
    density: float = 0.01
    bits: int = 8
    bits_choices: tuple[int, ...] = SUPPORTED_BITS
    scope: str = "global"
    warmup_rounds: int = 0
    warmup_factor: float = 4.0
    error_feedback: bool = True
    signature_bytes: int = 0  # room kept in chunk 1 for the protocol's signature (Ed25519: 64)

    def __post_init__(self) -> None:
        if self.budget_bytes is not None and self.budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive, got {self.budget_bytes}")
        if not 0.0 < self.density <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {self.density}")
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {self.bits}")
        if not self.bits_choices or any(b not in SUPPORTED_BITS for b in self.bits_choices):
            raise ValueError(f"bits_choices must be a non-empty subset of {SUPPORTED_BITS}")
        if self.scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {self.scope!r}")
        if self.budget_bytes is not None and self.scope != "global":
            raise ValueError("a byte budget selects top-k globally: scope must be 'global'")
        if self.warmup_rounds < 0 or not self.warmup_factor >= 1.0:
            raise ValueError("warmup_rounds must be >= 0 and warmup_factor >= 1")
        if self.signature_bytes < 0:
            raise ValueError("signature_bytes must be >= 0")

    def warmup_multiplier(self, round_index: int) -> float:
        """How many times the steady budget/density round `round_index` gets (>= 1)."""
        if round_index >= self.warmup_rounds:
            return 1.0
        return float(self.warmup_factor ** (1.0 - max(round_index, 0) / self.warmup_rounds))

    def settings(self, round_index: int) -> RoundSettings:
        m = self.warmup_multiplier(round_index)
        budget = None if self.budget_bytes is None else int(self.budget_bytes * m)
        return RoundSettings(
            scope=self.scope,
            density=min(1.0, self.density * m),
            bits=self.bits,
            budget_bytes=budget,
            bits_choices=tuple(self.bits_choices),
        )


UNCOMPRESSED = CompressionPolicy(density=1.0, bits=32, error_feedback=False)
