"""What every aggregation rule is made of (Flower's `Strategy` is the model learnt from).

A rule is one class with a streaming form that the round engine drives as updates arrive,

    partial = rule.start(evidence)          # when the round's first update is folded
    rule.accumulate(partial, contribution)  # one received update, decoded once
    merged = rule.merge(a, b)               # partials of several serve workers
    result = rule.finalize(partial, load)   # at close: the aggregate delta

and a pure dense reference, `rule.reference(updates)`, that property tests hold the
streaming form to (tests/unit/test_strategies.py). A rule's options and the coordinator's
own evidence for the round (`RoundEvidence`: the lineage's norm history, the server set's
update and class directions) are given at construction: a rule never reads the registry.

The streaming state (`Partial`) is the float64 sum of c_i d_i over the head's flat
coordinates, the per-tensor sum of the mean weights m_i behind it, one `Member` record per
update (what was folded with which coefficient), and per coordinate the update signs that
the coordinate-wise rules need. The aggregate is sum c_i d_i / sum m_i tensor by tensor: a
device that trained only some tensors (one depth of a multi-depth model) counts only for
those (HeteroFL's rule). Members of partials from different workers are disjoint (an update
is stored once), so merging is exact. `finalize` may change a member's coefficient (the
round's weight cap, a clip bound only known at close) by reading that member's stored
payload again: `Strategy.reads_at_close` says what a rule reads.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from ..streaming import Layout, SignCounts, Sparse

Load = Callable[[str], Sparse]  # a member's stored update, decoded again


@dataclass(frozen=True)
class Contribution:
    """One accepted update as a rule sees it."""

    device: str
    update: Sparse
    weight: float  # the sample count after the device's and the job's caps (FedAvg's weight)
    label_counts: tuple[int, ...] | None = None  # per class, what the device trained on (if reported)
    # per class, the round's base model's mean probability on those samples (if reported)
    label_predicted: tuple[float, ...] | None = None


@dataclass(frozen=True)
class ServerEvidence:
    """What the coordinator computed itself, from its labelled server set, at the round's base."""

    update: np.ndarray  # flat float64: the base trained on the server's root split, as devices train
    class_gradients: np.ndarray  # (classes, size) float64: the loss gradient of each class's root samples
    root_counts: np.ndarray  # root samples per class
    weight: float  # the server update's weight in the aggregate (its root samples)

    @property
    def norm(self) -> float:
        return float(np.linalg.norm(self.update))

    def reference(self, label_counts: Sequence[int] | None) -> np.ndarray:
        """The descent direction a device with these label counts should roughly follow: minus
        the root set's class gradients mixed in the device's label proportions (the root set's
        own proportions when it reported none)."""
        counts = np.asarray(self.root_counts if label_counts is None else label_counts, np.float64)
        if counts.shape != (self.class_gradients.shape[0],) or counts.sum() <= 0:
            counts = np.asarray(self.root_counts, np.float64)
        return -(counts / counts.sum()) @ self.class_gradients


@dataclass(frozen=True)
class RoundEvidence:
    layout: Layout
    history_norm: float | None = None  # median accepted norm of the model lineage's recent rounds
    server: ServerEvidence | None = None
    earlier_sketches: Mapping[str, np.ndarray] | None = None  # the previous round's trusted updates (echoes.py)
    claims: Mapping[str, Any] | None = None  # device -> claims.Standing: its consistency in the job's earlier rounds


@dataclass(frozen=True, kw_only=True)
class StrategyOptions:
    """The knobs of every rule (job params over the fleet policy; round_types.py checks them)."""

    samples_mult: float = 2.0  # no weight above this x the round's lower-median weight ...
    small_round: int = 3  # ... and 1x in rounds of at most this many updates (no majority)
    clip_mult: float = 2.0  # fedavg_clipped: norms clipped at this x the round's reference norm
    trim_fraction: float = 0.2
    krum_fraction: float = 0.2
    trust_kappa: float = 0.1  # cosine with the server's reference at which an update earns full trust (trust)
    median_kappa: float = 0.3  # ... with the round's median (median_trust: above its own pull on it, trust.py)
    band: tuple[float, float] = (0.5, 2.0)  # norms moved into [lo, hi] x the reference norm
    dp: Any = None  # dp_fedavg: the round's clip and noise (dp.GaussianSum); None for a job that is not private


@dataclass
class Member:
    weight: float  # arrival weight
    norm: float
    kept: int
    present: tuple[int, ...] | None  # the layout's tensors it carries (None: all)
    label_counts: tuple[int, ...] | None = None
    label_predicted: tuple[float, ...] | None = None
    coef: float = 0.0  # what its delta was folded with
    mean_weight: float = 0.0  # what it adds to its tensors' denominators
    trust: float | None = None  # the rule's trust in it (trust rules), for the record
    # its direction's sketch (echoes.py), for rules that compare updates with each other at close;
    # kept beside the JSON record (partials.py stores it as an array)
    sketch: np.ndarray | None = field(default=None, repr=False, compare=False)

    def to_json(self) -> dict[str, Any]:
        return {"weight": self.weight, "norm": self.norm, "kept": self.kept,
                "present": None if self.present is None else list(self.present),
                "label_counts": None if self.label_counts is None else list(self.label_counts),
                "label_predicted": None if self.label_predicted is None else list(self.label_predicted),
                "coef": self.coef, "mean_weight": self.mean_weight, "trust": self.trust}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Member:
        return cls(weight=float(d["weight"]), norm=float(d["norm"]), kept=int(d["kept"]),
                   present=None if d.get("present") is None else tuple(int(t) for t in d["present"]),
                   label_counts=None if d.get("label_counts") is None else tuple(int(c) for c in d["label_counts"]),
                   label_predicted=(None if d.get("label_predicted") is None
                                    else tuple(float(c) for c in d["label_predicted"])),
                   coef=float(d.get("coef", 0.0)), mean_weight=float(d.get("mean_weight", 0.0)),
                   trust=None if d.get("trust") is None else float(d["trust"]))


class Partial:
    """A rule's streaming state over one round (module doc). Mergeable; serialisable by
    coordinator/partials.py for serve workers."""

    def __init__(self, layout: Layout, *, signs: bool = False) -> None:
        self.layout = layout
        self.vec = np.zeros(layout.size, dtype=np.float64)
        self.tensor_weight = np.zeros(len(layout.names), dtype=np.float64)
        self.members: dict[str, Member] = {}
        self.signs = SignCounts(layout.size) if signs else None

    def add(self, device: str, sp: Sparse, member: Member) -> None:
        """Fold one update with member.coef / member.mean_weight (once per device)."""
        if device in self.members:
            return
        if member.coef:
            self.vec[sp.idx] += member.coef * sp.vals.astype(np.float64)
        self._tensors(member.present, member.mean_weight)
        if self.signs is not None:
            self.signs.add(sp)
        self.members[device] = member

    def _tensors(self, present: tuple[int, ...] | None, amount: float) -> None:
        if amount:
            if present is None:
                self.tensor_weight += amount
            else:
                self.tensor_weight[list(present)] += amount

    def readjust(self, changes: Mapping[str, tuple[float, float]], load: Load) -> int:
        """Give members new (coef, mean_weight): one decode per member whose coefficient moves.
        Rebuilt from every payload instead when most move (float64 cancellation). Returns the
        number of payloads decoded."""
        moved = {d: c for d, c in changes.items() if c[0] != self.members[d].coef}
        for d, (_, mean) in changes.items():
            m = self.members[d]
            self._tensors(m.present, mean - m.mean_weight)
            m.mean_weight = mean
        if len(moved) > max(4, len(self.members) // 2):
            for d, (coef, _) in moved.items():
                self.members[d].coef = coef
            return self.rebuild(load)
        for d, (coef, _) in moved.items():
            sp = load(d)
            self.vec[sp.idx] += (coef - self.members[d].coef) * sp.vals.astype(np.float64)
            self.members[d].coef = coef
        return len(moved)

    def rebuild(self, load: Load) -> int:
        self.vec[:] = 0.0
        n = 0
        for d, m in self.members.items():
            if m.coef:
                sp = load(d)
                self.vec[sp.idx] += m.coef * sp.vals.astype(np.float64)
                n += 1
        return n

    def merge(self, other: Partial) -> Partial:
        both = set(self.members) & set(other.members)
        if both:
            raise ValueError(f"partials overlap in {len(both)} update(s) (e.g. {sorted(both)[0]}): "
                             "an update would be counted twice")
        if self.layout.size != other.layout.size:
            raise ValueError("partials of different layouts")
        out = Partial(self.layout, signs=self.signs is not None and other.signs is not None)
        out.vec = self.vec + other.vec
        out.tensor_weight = self.tensor_weight + other.tensor_weight
        out.members = {**self.members, **other.members}
        if out.signs is not None:
            out.signs.neg = self.signs.neg + other.signs.neg  # type: ignore[union-attr]
            out.signs.pos = self.signs.pos + other.signs.pos  # type: ignore[union-attr]
        return out

    def mean(self, extra: tuple[np.ndarray, float] | None = None) -> np.ndarray:
        """sum c_i d_i / sum m_i per tensor (0 where nobody trained a tensor); `extra` = (a
        dense vector, its mean weight) added to every tensor (the server's own update)."""
        vec, denom = self.vec, self.tensor_weight
        if extra is not None:
            vec, denom = vec + extra[1] * extra[0], denom + extra[1]
        return per_tensor_divide(vec, denom, self.layout)


def per_tensor_divide(vec: np.ndarray, denom: np.ndarray, layout: Layout) -> np.ndarray:
    out = np.zeros_like(vec)
    for t, name in enumerate(layout.names):
        lo = layout.offsets[name]
        hi = lo + math.prod(layout.shapes[name])
        if denom[t] > 0:
            out[lo:hi] = vec[lo:hi] / denom[t]
    return out


@dataclass
class Aggregate:
    """A rule's result: the aggregate delta (flat float64), each update's share of it (its
    mean weight / the total: 0 for an update that counted for nothing), the updates it left
    out with why (they are rejected), what to record, and notes for accepted updates' verdicts."""

    vec: np.ndarray
    shares: dict[str, float]
    excluded: dict[str, str] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)  # device -> a note on its accepted update's verdict
    sketches: dict[str, np.ndarray] = field(default_factory=dict)  # trusted updates' sketches, for the next round
    # a second candidate the round's close may keep instead when its server set scores it higher
    # (trust: the server step standing in for distrusted data)
    alternative: Aggregate | None = None


@dataclass(frozen=True)
class DenseUpdate:
    """An update for the dense references: the full flat vector and which tensors it carries."""

    device: str
    vec: np.ndarray
    weight: float
    present: tuple[int, ...] | None = None
    label_counts: tuple[int, ...] | None = None
    label_predicted: tuple[float, ...] | None = None


class NothingToAggregate(ValueError):
    """The rule has nothing it can publish this round (the message says why)."""


class Strategy(ABC):
    """One aggregation rule (module doc)."""

    name: ClassVar[str]
    summary: ClassVar[str]  # one line for --help, `status` and the defaults table
    reads_at_close: ClassVar[str]  # "outliers": only members whose coefficient changes; "all": every update
    needs_server_set: ClassVar[bool] = False
    keeps_signs: ClassVar[bool] = False

    def __init__(self, options: StrategyOptions, evidence: RoundEvidence) -> None:
        self.options, self.evidence = options, evidence

    def start(self) -> Partial:
        return Partial(self.evidence.layout, signs=self.keeps_signs)

    def member(self, c: Contribution) -> Member:
        """The record (and coefficient) an update is folded with; rules override."""
        return Member(weight=c.weight, norm=c.update.norm, kept=c.update.kept, present=c.update.present,
                      label_counts=c.label_counts, label_predicted=c.label_predicted, coef=c.weight,
                      mean_weight=c.weight)

    def accumulate(self, partial: Partial, c: Contribution) -> None:
        partial.add(c.device, c.update, self.member(c))

    def merge(self, a: Partial, b: Partial) -> Partial:
        return a.merge(b)

    @abstractmethod
    def finalize(self, partial: Partial, load: Load) -> Aggregate: ...

    @abstractmethod
    def reference(self, updates: Sequence[DenseUpdate]) -> Aggregate: ...

    # ---- shared by the weighted rules
    def round_cap(self, weights: Sequence[float]) -> float:
        """No update weighs more than samples_mult x the round's lower-median weight (1x in
        small rounds): a liar cannot raise the lower median while it is a minority, and with
        two updates the lower median is the honest one's."""
        mult = 1.0 if len(weights) <= self.options.small_round else self.options.samples_mult
        return mult * lower_median(weights)


def lower_median(values: Sequence[float]) -> float:
    """The (n-1)//2-th smallest value: with two values the smaller one."""
    if not len(values):
        raise ValueError("lower_median of nothing")
    arr = np.asarray(values, dtype=np.float64)
    k = (len(arr) - 1) // 2
    return float(np.partition(arr, k)[k])


def present_mask(present: tuple[int, ...] | None, layout: Layout) -> np.ndarray:
    """Flat bool mask of the coordinates of the tensors an update carries."""
    if present is None:
        return np.ones(layout.size, dtype=bool)
    mask = np.zeros(layout.size, dtype=bool)
    for t in present:
        name = layout.names[t]
        lo = layout.offsets[name]
        mask[lo:lo + math.prod(layout.shapes[name])] = True
    return mask


def dense_mean(updates: Sequence[DenseUpdate], coefs: Sequence[float], means: Sequence[float], layout: Layout,
               extra: tuple[np.ndarray, float] | None = None) -> np.ndarray:
    """The dense form of Partial.mean: sum c_i d_i / sum m_i per tensor."""
    vec = np.zeros(layout.size, dtype=np.float64)
    denom = np.zeros(len(layout.names), dtype=np.float64)
    for u, c, m in zip(updates, coefs, means, strict=True):
        vec += c * np.asarray(u.vec, np.float64)
        tensors = range(len(layout.names)) if u.present is None else u.present
        for t in tensors:
            denom[t] += m
    if extra is not None:
        vec, denom = vec + extra[1] * extra[0], denom + extra[1]
    return per_tensor_divide(vec, denom, layout)


def shares(means: Mapping[str, float], extra: float = 0.0) -> dict[str, float]:
    total = sum(means.values()) + extra
    return {d: (m / total if total > 0 else 0.0) for d, m in means.items()}
