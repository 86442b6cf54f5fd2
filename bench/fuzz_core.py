"""The fuzzer's machinery (bench/fuzz_parsers.py runs it): byte-level and JSON-aware
mutations of real inputs, the `Target` a parser under fuzz is wrapped in, and `fuzz`, which
feeds a target generated cases and records any exception outside its documented refusals.
The mutation stream is a pure function of (seed, case number).
"""

from __future__ import annotations

import copy
import json
import os
import random
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

INTERESTING = (0, 1, 0x7F, 0x80, 0xFF, 0x20, 0x22, 0x5C, 0x7B, 0x7D)
JSON_VALUES: tuple[Any, ...] = (
    None, True, False, 0, -1, 1, 2**31, 2**63, -(2**63), 10**400, 1e308, -1e308, 0.5, "", "x" * 300,
    "../../etc/passwd", "\u0000", "\ud800", [], {}, [[[[[[]]]]]], {"a": {"b": {"c": 1}}}, "NaN", "current",
)


def mutate_bytes(data: bytes, rng: random.Random, corpus: list[bytes]) -> bytes:
    """One to four byte-level mutations (AFL's havoc stages, simplified)."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(9)
        n = len(out)
        if op == 0 and n:  # flip 1..8 bits
            for _ in range(rng.randint(1, 8)):
                i = rng.randrange(n)
                out[i] ^= 1 << rng.randrange(8)
        elif op == 1 and n:  # interesting byte
            out[rng.randrange(n)] = rng.choice(INTERESTING)
        elif op == 2:  # insert random bytes
            i = rng.randint(0, n)
            out[i:i] = rng.randbytes(rng.randint(1, 64))
        elif op == 3 and n:  # delete a range
            i = rng.randrange(n)
            del out[i:i + rng.randint(1, 256)]
        elif op == 4 and n:  # truncate
            del out[rng.randrange(n):]
        elif op == 5 and n:  # duplicate a range
            i = rng.randrange(n)
            out[i:i] = out[i:i + rng.randint(1, 512)]
        elif op == 6 and corpus:  # splice with another seed
            other = rng.choice(corpus)
            i, j = rng.randint(0, n), rng.randint(0, len(other))
            out = out[:i] + other[j:]
        elif op == 7 and n >= 4:  # a 16/32-bit field set to a boundary
            i = rng.randrange(n - 3)
            value = rng.choice((0, 1, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF, n, n + 1))
            out[i:i + 4] = value.to_bytes(4, rng.choice(("little", "big")))
        elif op == 8:  # random bytes of a plausible length
            out = bytearray(rng.randbytes(rng.choice((0, 1, 5, 64, 1024, n))))
    return bytes(out)


def _value(rng: random.Random) -> Any:
    return copy.deepcopy(rng.choice(JSON_VALUES))  # a fresh copy: later mutations must not alias


def mutate_json(obj: Any, rng: random.Random) -> Any:
    """Structure-aware: change, drop or add one member somewhere in the document."""
    obj = copy.deepcopy(obj)
    for _ in range(rng.randint(1, 3)):
        holder, key = _random_slot(obj, rng)
        if holder is None:
            return _value(rng)
        choice = rng.randrange(4)
        if choice == 0:
            holder[key] = _value(rng)
        elif choice == 1 and isinstance(holder, dict):
            holder.pop(key, None)
        elif choice == 2 and isinstance(holder, dict):
            holder[rng.choice(("extra", "params", "seq", "body", "files", "x" * 70))] = _value(rng)
        else:
            value = holder[key]
            if isinstance(value, str) and value:
                holder[key] = value[: rng.randrange(len(value))] + rng.choice(("/", "\n", "Ω", "%", "."))
            elif isinstance(value, int | float) and not isinstance(value, bool):
                holder[key] = rng.choice((-value, value * 10**9, value + 1, value / 3 if abs(value) < 1e300 else 0.5))
            else:
                holder[key] = _value(rng)
    return obj


def _random_slot(obj: Any, rng: random.Random) -> tuple[Any, Any]:
    slots: list[tuple[Any, Any]] = []

    def walk(node: Any, depth: int) -> None:
        if depth > 6:
            return
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in items:
            slots.append((node, k))
            walk(v, depth + 1)

    walk(obj, 0)
    return rng.choice(slots) if slots else (None, None)


@dataclass
class FuzzResult:
    target: str
    cases: int = 0
    seconds: float = 0.0
    verdicts: Counter = field(default_factory=Counter)
    crashes: list[tuple[int, str, str]] = field(default_factory=list)  # case, error, input (hex, cut)

    @property
    def rate(self) -> float:
        return self.cases / self.seconds if self.seconds else 0.0


class Target:
    """One parser under fuzz: `case(rng)` makes an input, `judge(input)` returns a verdict
    label or raises for a crash (anything outside `refusals`)."""

    name = ""
    refusals: tuple[type[BaseException], ...] = ()

    def case(self, rng: random.Random) -> Any:
        raise NotImplementedError

    def judge(self, data: Any) -> str:
        raise NotImplementedError

    def refusal_verdict(self, exc: BaseException) -> str:
        return type(exc).__name__

    def close(self) -> None:
        pass


def scratch() -> Path:
    base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else None  # fsync-heavy targets
    return Path(tempfile.mkdtemp(prefix="edge-fuzz-", dir=base))


def case_rng(seed: int, index: int) -> random.Random:
    return random.Random(seed * 1_000_003 + index)


def fuzz(target: Target, cases: int, *, seed: int = 0, first: int = 0,
         progress: Callable[[FuzzResult], None] | None = None) -> FuzzResult:
    """Run `cases` generated inputs through `target`; crashes are recorded, never raised."""
    result = FuzzResult(target.name)
    start = time.perf_counter()
    for i in range(first, first + cases):
        data = target.case(case_rng(seed, i))
        try:
            verdict = target.judge(data)
        except target.refusals as exc:
            verdict = target.refusal_verdict(exc)
        except Exception as exc:  # the finding: anything undocumented
            verdict = "CRASH"
            shown = data if isinstance(data, bytes) else json.dumps(data, default=str).encode()
            result.crashes.append((i, f"{type(exc).__name__}: {str(exc)[:200]}", shown[:300].hex()))
        # verdict labels carry details after ':'; past 40 distinct labels count by kind only
        result.verdicts[verdict.split(":")[0] if len(result.verdicts) > 40 else verdict] += 1
        result.cases += 1
        if progress and result.cases % 10_000 == 0:
            result.seconds = time.perf_counter() - start
            progress(result)
    result.seconds = time.perf_counter() - start
    return result
