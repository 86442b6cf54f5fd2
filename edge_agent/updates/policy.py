"""How hard to compress each round: adaptive (the default), a byte budget or a fixed rate,
plus a warm-up schedule.

The default adapts to the model: a budget of `DEFAULT_UPDATE_BYTES` on the wire, except
that a delta whose dense int8 encoding fits in `DENSE_FACTOR` times that budget is sent
whole (every value, 8 bits): a small head gains nothing from top-k, which would keep 2 of
its 170 values. A large tail is cut to the budget by top-k (budget.py). Whatever the mode,
the encoder never sends more than the plain fp32 delta would take (encoder.py).

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

DEFAULT_UPDATE_BYTES = 32 << 10  # the adaptive default's budget on the wire
DENSE_FACTOR = 2.0  # ... which a dense int8 update may exceed by this factor


@dataclass(frozen=True)
class RoundSettings:
    scope: str
    density: float  # fixed rate: fraction of values kept (unused with a budget)
    bits: int  # fixed rate: bit width (unused with a budget)
    budget_bytes: int | None  # wire bytes for this round's update, or None (fixed rate)
    bits_choices: tuple[int, ...]
    dense_factor: float = 0.0  # adaptive: send dense int8 if it fits this many budgets (0: never)


@dataclass(frozen=True, kw_only=True)
class CompressionPolicy:
    """Compression settings of a device's updates (validated at construction).

    With `budget_bytes` set, each update is the most accurate one that fits that many bytes
    on the wire (budget.py picks k and the bit width from `bits_choices`); with `density`
    set instead, top-k keeps that fraction of the values at `bits` (fixed rate); with
    neither (the default) the update size adapts to the model (see the module doc).
    `error_feedback` keeps what was not sent for the next round (strongly recommended:
    without it, top-k loses accuracy).
    """

    budget_bytes: int | None = None
    density: float | None = None
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
        if self.density is not None and not 0.0 < self.density <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {self.density}")
        if self.density is not None and self.budget_bytes is not None:
            raise ValueError("give a byte budget or a fixed density, not both")
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {self.bits}")
        if not self.bits_choices or any(b not in SUPPORTED_BITS for b in self.bits_choices):
            raise ValueError(f"bits_choices must be a non-empty subset of {SUPPORTED_BITS}")
        if self.scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {self.scope!r}")
        if self.density is None and self.scope != "global":
            raise ValueError("a byte budget (or the adaptive default) selects top-k globally: "
                             "scope must be 'global', or give a fixed density")
        if self.warmup_rounds < 0 or not self.warmup_factor >= 1.0:
            raise ValueError("warmup_rounds must be >= 0 and warmup_factor >= 1")
        if self.signature_bytes < 0:
            raise ValueError("signature_bytes must be >= 0")

    def warmup_multiplier(self, round_index: int) -> float:
        """How many times the steady budget/density round `round_index` gets (>= 1)."""
        if round_index >= self.warmup_rounds:
            return 1.0
        return float(self.warmup_factor ** (1.0 - max(round_index, 0) / self.warmup_rounds))

    @property
    def adaptive(self) -> bool:
        return self.budget_bytes is None and self.density is None

    def settings(self, round_index: int) -> RoundSettings:
        m = self.warmup_multiplier(round_index)
        base = DEFAULT_UPDATE_BYTES if self.adaptive else self.budget_bytes
        return RoundSettings(
            scope=self.scope,
            density=1.0 if self.density is None else min(1.0, self.density * m),
            bits=self.bits,
            budget_bytes=None if base is None else int(base * m),
            bits_choices=tuple(self.bits_choices),
            dense_factor=DENSE_FACTOR if self.adaptive else 0.0,
        )


UNCOMPRESSED = CompressionPolicy(density=1.0, bits=32, error_feedback=False)
