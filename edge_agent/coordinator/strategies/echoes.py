"""Updates that echo each other share one vote.

Colluding devices send (nearly) the same direction -- the attacks the bench runs all do:
inner-product manipulation (IPM: minus a multiple of the honest mean they observe), ALIE
(mean - z x std) and "the same random direction" -- while honest devices that train on their
own data do not. Measured in the solar fleet (100 devices, digits, async K 12, 20 % IPM
attackers, 14 days): cosines between two attackers' updates in one round had a median of
0.93; between two honest updates the median was 0.04, the 99th percentile 0.62, and
the highest of 32,000 pairs was 0.93. A trust rule that weighs each update by its
agreement with a reference cannot see this: each colluder earns trust on its own, and
together they pull coherently while honest non-IID updates partly cancel.

So each trusted update's weight is divided by its echo count (in both trust rules: `trust`
and `median_trust`)

    e_i = 1 + sum over j != i of ramp(cos(d_i, d_j))
    ramp(c) = clip((c - 0.7) / (0.95 - 0.7), 0, 1)

-- k updates pointing the same way count as one, an honest update with no near-twin
keeps its full weight, and the ramp makes the rule continuous (a pair near the threshold
moves weights a little, not all at once). Honest devices holding identical data also echo,
and also share a vote: they carry one device's evidence. What it cannot stop: colluders
that add enough independent noise to look unrelated -- which also costs them the
agreement with the reference that earns them trust.

Colluders are few per round in an asynchronous job (a buffer of 12 with 20 % attackers holds
one or none a third of the time), so the previous round's trusted updates count too (their
sketches are kept beside the round's server evidence, `evidence/<job>/r<n>.echo.npz`), all but
the same device's own.

The cosines come from a count sketch of each update (Charikar, Chen, Farach-Colton 2002)
of SKETCH_DIM buckets, made once when the update is folded (a hash of each coordinate's
position picks its bucket and sign), so a round keeps 4 KiB per update instead of the
updates, and serve workers' partials carry them. The estimate's error is about
1/sqrt(SKETCH_DIM) = 0.03 in cosine; heads with at most SKETCH_DIM values use the
update itself (exact).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache

import numpy as np

SKETCH_DIM = 1024
ECHO_FROM = 0.7  # cosine from which two updates start sharing a vote ...
ECHO_FULL = 0.95  # ... and at which they share it fully

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(positions: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser of each position: a fixed hash, the same on every worker."""
    with np.errstate(over="ignore"):
        z = positions.astype(np.uint64) * _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


@lru_cache(maxsize=2)
def _table(size: int) -> tuple[np.ndarray, np.ndarray]:
    """Every position's bucket (intp, what bincount takes without a copy) and sign (float64)
    for heads of `size` values: hashed once per layout (16 bytes a position), not once per
    update (~50 ms for 1M positions)."""
    h = _mix(np.arange(size, dtype=np.int64))
    bucket = (h % np.uint64(SKETCH_DIM)).astype(np.intp)
    sign = np.where((h >> np.uint64(40)) & np.uint64(1), 1.0, -1.0)
    return bucket, sign


def sketch(idx: np.ndarray, vals: np.ndarray, size: int) -> np.ndarray:
    """The direction of the update with values `vals` at flat positions `idx` of a head of
    `size` values, as float32: the values themselves when size <= SKETCH_DIM, else their
    count sketch."""
    idx = np.asarray(idx, np.int64)
    if size <= SKETCH_DIM:
        out = np.zeros(size, np.float64)
        out[idx] = np.asarray(vals, np.float64)
        return out.astype(np.float32)
    bucket, sign = _table(int(size))
    if idx.size != size:  # positions are sorted and unique: all of them is the dense case, no gather
        bucket, sign = bucket[idx], sign[idx]
    weights = sign * np.asarray(vals, np.float64)
    return np.bincount(bucket, weights=weights, minlength=SKETCH_DIM).astype(np.float32)


def sketch_dense(vec: np.ndarray) -> np.ndarray:
    """`sketch` of a dense flat vector (its non-zero values)."""
    vec = np.asarray(vec, np.float64)
    idx = np.flatnonzero(vec)
    return sketch(idx, vec[idx], vec.size)


def echo_counts(sketches: Mapping[str, np.ndarray],
                earlier: Mapping[str, np.ndarray] | None = None) -> dict[str, float]:
    """Each update's echo count e_i (module doc) among the given ones (1.0: no near-twin),
    plus its echoes of `earlier`: the trusted updates of the job's previous round, except the
    same device's own (a device's data does not change between rounds; its neighbours' do):
    a colluder alone in its round still shares a vote with the colluders of the round before."""
    devices = list(sketches)
    if not devices:
        return {}
    past = [d for d in (earlier or {}) if np.shape(earlier[d]) == np.shape(sketches[devices[0]])]  # type: ignore[index]
    rows = [np.asarray(sketches[d], np.float64) for d in devices] + [np.asarray(earlier[d], np.float64)  # type: ignore[index]
                                                                       for d in past]
    s = np.stack(rows)
    norms = np.linalg.norm(s, axis=1)
    unit = s / np.where(norms > 0, norms, 1.0)[:, None]
    n = len(devices)
    cos = unit[:n] @ unit.T
    ramp = np.clip((cos - ECHO_FROM) / (ECHO_FULL - ECHO_FROM), 0.0, 1.0)
    ramp[:, norms == 0] = 0.0
    ramp[norms[:n] == 0, :] = 0.0
    names = devices + past
    for i, d in enumerate(devices):
        ramp[i, i] = 0.0
        for j in range(n, len(names)):
            if names[j] == d:
                ramp[i, j] = 0.0
    return {d: float(1.0 + e) for d, e in zip(devices, ramp.sum(axis=1), strict=True)}
