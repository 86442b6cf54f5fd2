"""How deep a fine-tune trains: the device's choice among a bundle's depths.

A multi-depth bundle (int8/bundle.py, int8/depth_cuts.py) lists, per depth, per-sample
counts: the frozen int8 prefix's MACs, the trainable tail's MACs, parameters and the
activations its backward pass keeps, and the size of the activation at the cut. With the
job's data size, epochs and batch, and this device's measured rates, each depth gets a
predicted CPU time (so energy, on the profile's power model) and peak memory:

    cpu_s  = [what the job spent before planning: measuring the device's shift]
           + [engine selection, if this device has no cached choice for the depth's prefix:
              SELECTION_FIXED_S + prefix_macs x selection_s_per_mac]
           + [adapting the prefix to the device's camera (train/job_adapt.py), if it will:
              adapt_images x prefix_macs x adapt_s_per_mac]
           + images x prefix_macs x s_per_int8_mac              (features, once)
           + [MXNet import, if the tail trains in MXNet]
           + epochs x f x (train x 3 + val) x tail_macs x s_per_fp32_mac (forward + backward)
           + epochs x f x train x s_per_sample                  (framework overhead)

where f is the share of its epochs a job here ran before early stopping at that depth
(learnt per depth: a deeper tail on the same data stops at another epoch), and the two
training rates are the numpy trainer's (numpy_s_per_fp32_mac, numpy_s_per_sample) or
MXNet's, whichever trains the depth.
    rss_mb   = the process now + max(engine, engine residual + training)
    training = [MXNet] + images x cut_elements x 4 B (cached activations)
             + tail_params x 16 B (weights, gradients, Adam's two moments)
             + min(batch, train) x tail_activations x 12 B (forward outputs, their gradients, workspace)

where `engine` is what the int8 engine's phase adds at its peak (int8/engine_memory.py,
predicted from the depth's int8 prefix before anything is prepared): on a first job (no
cached choice for the depth's prefix) the engine selection -- the oracle's chunk of the
reference's and the fp32 model's activations, or the candidates it will prepare, each
skipped that would go over the cap -- else the cached engine's re-check and features; and
`engine residual` what it leaves when training starts (a selection's runtimes, less the
pixels freed before training; MXNet when mxnet-onednn was prepared). On the camera
MobileNetV2 bundle a first job's selection is ~2/3 of its peak (~195 of ~290 MB).

A tail trains in numpy -- without MXNet's import (~2 CPU-s, ~100 MB) -- when it is one dense
layer (dense_head.py) or every op of its symbol is one numpy_tail.py computes (the job
passes `numpy_tail(depth)`); otherwise, or with --trainer mxnet, in MXNet Gluon.

`auto` picks the deepest depth up to AUTO_MAX_DEPTH that fits the profile's training
memory cap (a first job's engine selection included) and the energy budget (each with a
margin for the prediction's error) -- or, on a device whose images are far from the bundle's (a
camera of its own: train/job_adapt.py), the deepest that fits, whatever its number; a
bundle without depths trains the head, and a device without MXNet only the depths numpy
trains. When no depth fits the memory cap, or a depth asked for by number does not, the
job is refused (OverMemoryCap) before anything is prepared: running it anyway would take
the board past what training may use. The energy budget only steers: with none that fits,
the head trains and the governor stops it. The rates start from conservative defaults and
are learned per device: after every job the measured CPU time of its phases updates `planner-rates.json` in the job's cache
directory (the training rates under the keys of the trainer that ran), and so do its
memory figures: the engine phase's measured growth as a scale of its prediction
(selection_mb_scale after a selection, engine_mb_scale after a cached engine's) and MXNet's
import (mxnet_mb).

Why deeper is the default direction: measured on the camera scenario (bench_finetune),
the last block(s) of MobileNetV2 trained over cached int8 activations gain 10-15 points of
held-out accuracy over the head alone for ~4x its CPU time, still a fraction of full
fine-tuning; AUTO_MAX_DEPTH keeps auto where that trade was measured. On a strongly
shifted camera (bench_depth's digits through blur, gamma and tint: base accuracy 0.38)
depth 2 / 3 / 4 reached 0.55 / 0.67 / 0.67 held-out (full fine-tuning 0.73): there the
deepest depth pays.
"""

from __future__ import annotations

import importlib.util
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..atomic import atomic_write_json, read_limited
from ..errors import ConfigError, UsageError
from ..int8.engine_memory import MEMORY_MARGIN

AUTO_MAX_DEPTH = 2
ENERGY_MARGIN = 1.25  # the plan must fit the budget with this much to spare
# and the training memory cap with MEMORY_MARGIN (selection's, engine_memory.py) of what the
# job is predicted to add above the process now: a first job once peaked at 208 MB under a
# 200 MB cap where 186 MB was predicted
RATES_FILE = "planner-rates.json"
LEARN_WEIGHT = 0.7
SELECTION_FIXED_S = 2.0  # preparing the candidate engines; the rest scales with the prefix's MACs
# Starting rates (CPU-seconds), ~1.5x what a loaded 2-core x86 machine measured
# (bench_depth), so a first job errs on the cautious side; a Pi learns its own in one job.
# Memory (MB) must stay within 25 % of a first job's peak (issue 40), so it starts closer:
# MXNet's import grew the RSS by 95-99 MB (x86, mxnet 1.9.1 with oneDNN; 140 put a first
# job at +24 %), and the engine figures start at int8/engine_memory.py's own.
DEFAULT_RATES = {"s_per_int8_mac": 2.5e-10, "s_per_fp32_mac": 3.5e-10, "s_per_sample": 3e-4,
                 "numpy_s_per_fp32_mac": 3.5e-10, "numpy_s_per_sample": 1e-4,
                 "mxnet_import_s": 2.0, "mxnet_mb": 110.0, "selection_s_per_mac": 1.5e-6, "epoch_fraction": 1.0,
                 "selection_mb_scale": 1.0, "engine_mb_scale": 1.0, "adapt_s_per_mac": 1.2e-9}


def rate_key(key: str, backend: str) -> str:
    """The rates file's key for a training rate (s_per_fp32_mac, s_per_sample) of `backend`."""
    return f"numpy_{key}" if backend == "numpy" else key


def fraction_key(depth: int) -> str:
    """The rates file's key for the share of its epochs a job at `depth` ran before stopping."""
    return f"epoch_fraction_d{depth}"


FRACTION_KEYS = tuple(fraction_key(d) for d in range(9))  # parse_depth's 0..8


class OverMemoryCap(ConfigError):
    """No depth (or not the one asked for) fits the board profile's training memory cap: the
    job is refused before it prepares anything (exit EXIT_CONFIG; the agent fails the job
    with this line, and the coordinator counts the device as a dropout with it)."""


def epoch_fraction(rates: dict[str, float], depth: int) -> float:
    """The learnt share at `depth`; before a job ran there, the last job's at any depth."""
    return min(1.0, rates.get(fraction_key(depth), rates["epoch_fraction"]))


@dataclass(frozen=True)
class EngineMemory:
    """What the job's int8 engine phase adds at a depth (train/job_depth.py predicts it with
    int8/engine_memory.py): its peak above the process now, what it leaves for training, and
    whether it imports MXNet (mxnet-onednn as a selection's candidate)."""

    peak_mb: float
    residual_mb: float = 0.0
    imports_mxnet: bool = False
    what: str = "the int8 engine"


@dataclass
class DepthOption:
    depth: int
    kind: str
    tail_params: int
    needs_mxnet: bool
    predicted_cpu_s: float
    predicted_wh: float | None
    predicted_rss_mb: float
    fits: bool = True
    why_not: str = ""
    predicted_engine_mb: float | None = None  # what the int8 engine's phase adds at its peak (module doc)
    over_cap: bool = False  # it does not fit the training memory cap (a job there is refused)


@dataclass
class DepthPlan:
    depth: int
    requested: str
    reason: str
    options: list[DepthOption] = field(default_factory=list)

    @property
    def chosen(self) -> DepthOption | None:
        return next((o for o in self.options if o.depth == self.depth), None)

    def to_json(self) -> dict[str, Any]:
        chosen = self.chosen
        return {"depth": self.depth, "requested": self.requested, "reason": self.reason,
                "predicted_wh": chosen.predicted_wh if chosen else None,
                "predicted_cpu_s": chosen.predicted_cpu_s if chosen else None,
                "predicted_peak_rss_mb": chosen.predicted_rss_mb if chosen else None,
                "options": [asdict(o) for o in self.options]}


def parse_depth(value: Any) -> str | int:
    """`--depth` / the job parameter: 'auto', 'head' or a depth number 0..8."""
    if isinstance(value, bool):
        raise UsageError(f"depth: expected auto, head or a number 0..8, got {value!r}")
    if isinstance(value, int):
        depth = value
    elif isinstance(value, str) and value in ("auto", "head"):
        return value
    elif isinstance(value, str) and value.isascii() and value.isdigit() and len(value) < 3:  # not "²" or "٣"
        depth = int(value)
    else:
        raise UsageError(f"depth: expected auto, head or a number 0..8, got {value!r:.40}")
    if not 0 <= depth <= 8:
        raise UsageError(f"depth: {depth} is outside 0..8")
    return depth


def load_rates(cache_dir: Path | None) -> dict[str, float]:
    rates = dict(DEFAULT_RATES)
    if cache_dir is None:
        return rates
    try:
        stored = json.loads(read_limited(cache_dir / RATES_FILE, 64 << 10))
    except (OSError, ValueError, Exception):  # absent or damaged: the defaults
        return rates
    if isinstance(stored, dict):
        for key in (*DEFAULT_RATES, *FRACTION_KEYS):
            value = stored.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < 1e6:
                rates[key] = float(value)
    return rates


def learn_rates(cache_dir: Path, rates: dict[str, float], measured: dict[str, float]) -> dict[str, float]:
    """Blend one job's measured rates in, in log space (rates span orders of magnitude):
    LEARN_WEIGHT on the new measurement, so a first job moves a default most of the way
    and one noisy job does not rule."""
    new = dict(rates)
    for key, value in measured.items():
        start = rates.get(key, rates["epoch_fraction"] if key in FRACTION_KEYS else None)
        if start is not None and isinstance(value, float) and math.isfinite(value) and value > 0:
            new[key] = math.exp((1 - LEARN_WEIGHT) * math.log(start) + LEARN_WEIGHT * math.log(value))
    cache_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(cache_dir / RATES_FILE, new)
    return new


def trains_in_numpy(bundle: Any, depth: int) -> bool:
    """Whether depth `depth`'s tail trains without MXNet (module doc): a one-dense-layer head
    at depth 0, or at any depth a symbol whose every op numpy_tail.py computes. The agent's
    planner and the coordinator's round selection (which keeps a job that needs MXNet away
    from a device without it) both ask this, so they cannot disagree."""
    from ..int8.bundle import HEAD_SYMBOL, depth_file
    from ..int8.head_form import dense_head_form
    from .numpy_tail import unsupported

    text = bundle.read(depth_file(depth, HEAD_SYMBOL)).decode("utf-8")
    tensor = bundle.manifest.depths[depth].tensor if bundle.manifest.depths else bundle.manifest.split_tensor
    return (depth == 0 and dense_head_form(text, tensor) is not None) or not unsupported(text, tensor)


def numpy_depths(bundle: Any) -> tuple[bool, ...]:
    """`trains_in_numpy` for every depth of the bundle (a head-only bundle: depth 0 alone)."""
    return tuple(trains_in_numpy(bundle, k) for k in range(max(1, len(bundle.manifest.depths))))


def archive_numpy_depths(archive: str | Path) -> tuple[bool, ...]:
    """`numpy_depths` of a bundle archive (unpacked and verified in a temporary directory)."""
    import tempfile

    from ..int8.bundle_files import unpack_bundle

    with tempfile.TemporaryDirectory(prefix="edge-agent-depths-") as tmp:
        return numpy_depths(unpack_bundle(archive, Path(tmp) / "bundle"))


def mxnet_available() -> bool:
    return importlib.util.find_spec("mxnet") is not None


def job_rss_mb(base_mb: float, training_mb: float, engine: EngineMemory | None) -> tuple[float, str]:
    """A job's peak RSS (module doc): the engine's phase or training, whichever is higher; and
    a note on the engine's share (for the reason a depth does not fit)."""
    if engine is None:
        return base_mb + training_mb, ""
    rss = max(base_mb + engine.peak_mb, base_mb + engine.residual_mb + training_mb)
    return rss, f" with {engine.what} (~{engine.peak_mb:.0f} MB above the process's {base_mb:.0f} MB)"


def engine_cap_mb(cap_mb: float | None, base_mb: float) -> float | None:
    """The cap the job's engine phase (selection's candidates, the oracle's chunks) works
    under: the room above the process that keeps the planner's margin on the whole job. The
    planner predicts selection under the same cap, so what it predicts is what runs."""
    return None if cap_mb is None else round(base_mb + max(cap_mb - base_mb, 0.0) / MEMORY_MARGIN, 1)


def _raise_cap_hint() -> str:
    return ("raise [training] memory_cap_mb in the board profile if the board has the memory, or build the "
            "bundle with a smaller input or an earlier split")


def plan_depth(bundle: Any, *, request: str | int, images: int, train: int, val: int, epochs: int,
               batch_size: int, dense_head: bool, mem_cap_mb: float | None, budget_wh: float | None,
               watts_per_cpu: float | None, base_rss_mb: float, rates: dict[str, float],
               has_mxnet: bool | None = None, selection_cached: Any = None,
               numpy_tail: Callable[[int], bool] | None = None,
               engine_memory: Callable[[int], EngineMemory] | None = None, shifted: bool = False,
               adapt_images: int | Callable[[int], int] = 0, spent_cpu_s: float = 0.0) -> DepthPlan:
    """Choose the training depth (module doc); `shifted`: the device's images are far from
    the bundle's (train/job_adapt.py): auto goes past AUTO_MAX_DEPTH; `adapt_images`: the
    prefix will be adapted on that many images (or `adapt_images(depth)` there); `spent_cpu_s`:
    what the job spent before planning (measuring the device's shift), part of every option's; `dense_head`: depth 0 trains in numpy;
    `numpy_tail(depth) -> bool`: that depth's tail trains in numpy (numpy_tail.py);
    `selection_cached(depth) -> bool`: this device has an engine choice for that prefix;
    `engine_memory(depth)`: what the int8 engine's phase adds there (none: not counted)."""
    depths = list(bundle.manifest.depths)
    has_mxnet = mxnet_available() if has_mxnet is None else has_mxnet
    request_text = str(request)
    if not depths:
        if request not in ("auto", "head", 0):
            raise UsageError(f"depth {request}: this bundle records no deeper depths (head only); build it with "
                             "`edge-coordinator model create --depths N`")
        return DepthPlan(0, request_text, "the bundle records only the head")
    options = []
    for d in depths:
        costs = d.costs
        mx = not ((d.depth == 0 and dense_head) or (numpy_tail is not None and numpy_tail(d.depth)))
        backend = "mxnet" if mx else "numpy"
        cpu = spent_cpu_s if selection_cached is None or selection_cached(d.depth) else spent_cpu_s + (
            SELECTION_FIXED_S + costs.get("prefix_macs", 0) * rates["selection_s_per_mac"])
        cpu += images * costs.get("prefix_macs", 0) * rates["s_per_int8_mac"]
        adapting = adapt_images(d.depth) if callable(adapt_images) else adapt_images
        cpu += adapting * costs.get("prefix_macs", 0) * rates["adapt_s_per_mac"]
        cpu += (rates["mxnet_import_s"] if mx else 0.0)
        run_epochs = epochs * epoch_fraction(rates, d.depth)
        cpu += run_epochs * (3 * train + val) * costs.get("tail_macs", 0) * rates[rate_key("s_per_fp32_mac", backend)]
        cpu += run_epochs * train * rates[rate_key("s_per_sample", backend)]
        engine = engine_memory(d.depth) if engine_memory is not None else None
        training = ((rates["mxnet_mb"] if mx or (engine is not None and engine.imports_mxnet) else 0.0)
                    + (images * costs.get("cut_elements", 0) * 4 + costs.get("tail_params", 0) * 16
                       + min(batch_size, max(train, 1)) * costs.get("tail_activations", 0) * 12) / 2**20)
        rss, engine_note = job_rss_mb(base_rss_mb, training, engine)
        wh = cpu * watts_per_cpu / 3600.0 if watts_per_cpu is not None else None
        opt = DepthOption(d.depth, d.kind, int(costs.get("tail_params", 0)), mx, round(cpu, 3),
                          None if wh is None else round(wh, 7), round(rss, 1),
                          predicted_engine_mb=None if engine is None else round(engine.peak_mb, 1))
        if mx and not has_mxnet:
            opt.fits, opt.why_not = False, "needs MXNet, which this device does not have"
        elif mem_cap_mb is not None and base_rss_mb + (rss - base_rss_mb) * MEMORY_MARGIN > mem_cap_mb:
            opt.fits, opt.why_not = False, (f"needs ~{rss:.0f} MB{engine_note} (+{MEMORY_MARGIN - 1:.0%} of what it "
                                            f"adds, margin), over the profile's {mem_cap_mb:g} MB training cap")
            opt.over_cap = True
        elif budget_wh is not None and wh is not None and wh * ENERGY_MARGIN > budget_wh:
            opt.fits, opt.why_not = False, (f"needs ~{wh:.4g} Wh (+{ENERGY_MARGIN - 1:.0%} margin), over the "
                                            f"{budget_wh:g} Wh budget")
        options.append(opt)
    last = len(depths) - 1
    if request == "head":
        request = 0
    if isinstance(request, int):
        if request > last:
            raise UsageError(f"depth {request}: this bundle's depths are 0..{last}")
        opt = options[request]
        if opt.needs_mxnet and not has_mxnet:
            raise UsageError(f"depth {request}: {opt.why_not}")
        if opt.over_cap:
            fitting = [o.depth for o in options if not o.over_cap]
            raise OverMemoryCap(f"depth {request} {opt.why_not}; nothing was run: "
                                + (f"depth {fitting[-1]} fits (or --depth auto)" if fitting else _raise_cap_hint()))
        reason = "asked for" + (f" (planner: {opt.why_not})" if not opt.fits else "")
        return DepthPlan(request, request_text, reason, options)
    deepest = last if shifted else AUTO_MAX_DEPTH
    fitting = [o for o in options if o.fits and o.depth <= deepest]
    if not fitting:
        if options[0].over_cap:  # running anyway would take the board past what training may use
            raise OverMemoryCap(f"no depth fits: depth 0 {options[0].why_not}; nothing was run: {_raise_cap_hint()}")
        return DepthPlan(0, request_text, "no depth fits: " + options[0].why_not, options)
    best = fitting[-1]
    held = [f"depth {o.depth}: {o.why_not}" for o in options if o.depth > best.depth and not o.fits]
    limit = "" if held else (f"; auto stops at depth {AUTO_MAX_DEPTH}" if last > deepest else "")
    if shifted:
        limit += "; the device's images are far from the bundle's: as deep as fits"
    reason = (f"deepest that fits ({best.kind}, {best.tail_params} trainable parameters)"
              + (f"; {held[0]}" if held else limit))
    return DepthPlan(best.depth, request_text, reason, options)
