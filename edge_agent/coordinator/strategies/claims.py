"""Does a device's update do what the device says it trained on? Evidence without a server set.

A device reports with every update its per-class training sample counts (`label_counts`) and
the mean class probabilities the version it was sent gave those samples before training
(`label_predicted`; protocol/label_claims.py). The cross-entropy's gradient on the output
layer's bias is the mean of (predicted - one-hot), so training moves the bias along p_i - q_i:
its label proportions minus what the version predicted on them. A sign-flipped update (or one
that unlearns the device's own classes) points the other way. Its consistency is

    c_i = cos(bias delta of update i, p_i - q_i)

and a device's standing is the mean of its c over every round of the job so far, this one
included, with one neutral round (c = 0) added so that one unlucky first round does not
decide. An update whose device's standing is below CLAIM_FLOOR counts for nothing: its
updates push down the classes it reports holding; and it takes no part in the round's
median, weight cap or reference norm. A device whose samples the version already predicts
as labelled (|p - q| under MIN_REFERENCE) carries no evidence that round.

A device that reports no predictions (an older agent) is compared with p_i - p_mean, the
mean of the round's reported proportions: that assumes the version predicts the fleet's mix
on every device, which is wrong exactly where it has learnt a device's data. In
test_fleet_restart, with the devices' training pulled towards the version's answers
(--distill), an honest device's c was -0.43 against p - p_mean (it counted for nothing) and
+0.51 against p - q; on bench_poisoning's honest textures fleets without a server set the
honest updates counted for nothing fell from 39 / 92 / 170 to 10 / 35 / 118 (2 / 5 / 10
devices, 4 seeds, 30 rounds), every attack cell still met.

The floor and the neutral round were chosen on that bench with p - p_mean (2 seeds, 5 and 10
devices): a flipped update's c sat at -0.5 to -0.95 in early rounds and drifted towards 0 as
the model fitted (its delta shrinks to noise), which is why the standing is the whole job's
mean and not a recent window; at -0.1 with no neutral round a textures fleet of 8 honest
devices lost 1.2 points; at -0.15 with one, it lost none, and every flip was still caught.
The median's cosine cannot tell these apart: late in a job a flipped update of a device
whose data disagrees with the fleet points with the median (cosine +0.1 to +0.4) while
honest ones sit at 0.05 to 0.5.

A device that lies about its claims only changes what it is compared with; this rule
catches updates that contradict their own claims, not an attacker that shapes both.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..streaming import Layout, Sparse

CLAIM_FLOOR = -0.15
NEUTRAL_ROUNDS = 1  # rounds of c = 0 every standing starts with
MIN_REFERENCE = 1e-3  # a reference shorter than this (L2 of proportions) says nothing: no judgement


@dataclass(frozen=True)
class Standing:
    """A device's consistency over the job's earlier rounds: the sum of its c and how many."""

    total: float
    rounds: int


def output_bias(layout: Layout, classes: int) -> slice | None:
    """The flat positions of the head's output bias: the last one-dimensional tensor named
    like a bias with one entry per class (None: the head has none, or it is not carried)."""
    names = [n for n in layout.names if layout.shapes[n] == (classes,) and "bias" in n.lower()]
    if not names:
        return None
    start = layout.offsets[names[-1]]
    return slice(start, start + classes)


def output_classes(layout: Layout) -> int | None:
    """How many classes the head's output has, from the layout alone: the size of its last
    one-dimensional tensor named like a bias (the output layer's, in a head's own order)."""
    sizes = [layout.shapes[n][0] for n in layout.names if len(layout.shapes[n]) == 1 and "bias" in n.lower()]
    return sizes[-1] if sizes and sizes[-1] >= 2 else None


def _proportions(counts: Sequence[int]) -> np.ndarray | None:
    c = np.asarray(counts, np.float64)
    total = c.sum()
    return c / total if total > 0 else None


def consistencies(bias_deltas: Mapping[str, np.ndarray], counts: Mapping[str, Sequence[int]],
                  predicted: Mapping[str, Sequence[float]] | None = None) -> dict[str, float]:
    """c_i for every device with a bias delta and label counts (module doc): against its own
    proportions minus what the round's base predicted on its samples when it reported that,
    else minus the round's mean proportions. A device whose reference is (nearly) zero --
    its samples already predicted as they are labelled, or proportions equal to the mean --
    or with no bias movement has none."""
    predicted = predicted or {}
    props = {d: p for d, c in counts.items() if d in bias_deltas and (p := _proportions(c)) is not None}
    mean = np.mean(list(props.values()), axis=0) if len(props) >= 2 else None
    out = {}
    for d, p in props.items():
        q = _predicted(predicted.get(d), len(p))
        if q is None and mean is None:
            continue
        ref, b = p - (mean if q is None else q), np.asarray(bias_deltas[d], np.float64)
        nr, nb = float(np.linalg.norm(ref)), float(np.linalg.norm(b))
        if nr > MIN_REFERENCE and nb > 0 and np.isfinite(nb):
            out[d] = float(b @ ref / (nr * nb))
    return out


def _predicted(q: Sequence[float] | None, classes: int) -> np.ndarray | None:
    if q is None or len(q) != classes:
        return None
    return np.asarray(q, np.float64)


def sparse_slice(sp: Sparse, where: slice) -> np.ndarray:
    """The dense values of `sp` at positions `where` (zero where it kept nothing)."""
    out = np.zeros(where.stop - where.start, np.float64)
    sel = (sp.idx >= where.start) & (sp.idx < where.stop)
    out[sp.idx[sel] - where.start] = sp.vals[sel]
    return out


def standings(now: Mapping[str, float], earlier: Mapping[str, Standing] | None) -> dict[str, float]:
    """Each judged device's mean consistency over the job, this round included."""
    earlier = earlier or {}
    out = {}
    for d, c in now.items():
        s = earlier.get(d, Standing(0.0, 0))
        out[d] = (s.total + c) / (s.rounds + 1 + NEUTRAL_ROUNDS)
    return out


def against_claims(standing: Mapping[str, float], devices: Collection[str]) -> set[str]:
    """The round's devices whose standing is below the floor -- never all of them: with every
    one below it, the best stays (measured on the bench: at 2 devices an honest device's
    standing fell to -0.2 once the model fitted its data, the flipper's sat at -0.7, and
    flagging both published nothing for 28 rounds in a row)."""
    below = {d for d, s in standing.items() if s < CLAIM_FLOOR}
    if below and below >= set(devices):
        below.discard(max(below, key=lambda d: (standing[d], d)))
    return below
