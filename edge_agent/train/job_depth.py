"""The fine-tune job's depth decision (train/depth_plan.py does the arithmetic): the plan
at job start -- a resumed job keeps its checkpoint's depth -- and, at the end, this job's
measured CPU rates learnt into the device's record. A mixin of job._Job."""

from __future__ import annotations

import functools
import logging
import resource
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..heap import release_freed_memory
from .checkpoints import Checkpoint

if TYPE_CHECKING:
    from .depth_plan import EngineMemory

log = logging.getLogger(__name__)


def _rss_mb() -> float:
    """This process's resident memory now (MB), the planner's starting point."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _output_grid(bundle: Any) -> tuple[float, int] | None:
    """The int8 prefix output's (scale, zero_point): cached activations are stored as int8
    when the engine's output lies on it (train/feature_cache.py)."""
    try:
        graph = bundle.qgraph()
        out = graph.tensor(graph.outputs[0])
        if out.scale is None or out.zero_point is None or out.scale.size != 1:
            return None
        return float(out.scale.reshape(-1)[0]), int(out.zero_point.reshape(-1)[0])
    except Exception:  # the grid is an optimisation: never fail a job over it
        return None


class DepthPlanning:
    """_Job's depth planning and rate learning (uses its args, budget, plan, cpu, pos)."""

    args: dict[str, Any]
    budget: Any
    bundle: Any
    plan: Any
    cpu: dict[str, float]
    pos: dict[str, Any]
    trainer: Any
    rates: dict[str, float]
    selection_cached: bool
    selection_source: str
    stop_reason: str | None
    shift: Any  # job_adapt.DeviceShift
    shift_s: float  # the CPU seconds measuring it took (before the plan)
    memory: dict[str, Any]  # the job's measured memory figures (job.py), for the report and the scales
    plan_base_mb: float  # the process's RSS the plan started from
    engine_mb_raw: dict[int, float]  # depth -> the engine phase's prediction before this device's scale
    recheck_predicted: dict[int, bool]  # depth -> that prediction was a re-check of one engine

    emit: Any  # _Job.emit
    def _plan_depth(self, bundle: Any, checkpoint: Checkpoint | None, dataset: Any, train: Any, val: Any,
                    config: Any, prof: dict[str, Any], wpc: float | None, cache_root: Path,
                    probe_report: dict[str, Any], threads: int) -> Any:
        """The training depth (train/depth_plan.py); a resumed job keeps its checkpoint's."""
        from ..int8.bundle import HEAD_SYMBOL
        from ..int8.cli import default_state_dir
        from ..int8.head_form import dense_head_form
        from ..int8.selection import cached_selection
        from ..int8.selection_cache import selection_kind
        from ..int8.shared_choice import matching
        from .depth_plan import load_rates, plan_depth, trains_in_numpy

        request = self.args["depth"]
        if checkpoint is not None and isinstance(checkpoint.meta.get("depth"), int):
            request = checkpoint.meta["depth"]
        self.rates = load_rates(cache_root)
        symbol_json = bundle.read(HEAD_SYMBOL).decode("utf-8")  # the head's form only: no parameter file read
        dense = self.args["trainer"] != "mxnet" and dense_head_form(symbol_json, bundle.manifest.split_tensor) is not None

        def numpy_tail(depth: int) -> bool:  # unless the job asks for MXNet (the coordinator asks the same)
            return self.args["trainer"] != "mxnet" and trains_in_numpy(bundle, depth)

        @functools.cache
        def cached(depth: int) -> Any:
            if self.args["engine"]:  # a forced engine is never cached: it is measured every time
                return None
            return cached_selection(bundle.at_depth(depth), probe=probe_report, preference=prof["backends"],
                                    batch_size=config.batch_size, threads=threads,
                                    state_dir=Path(self.args["cache_dir"]) if self.args["cache_dir"]
                                    else default_state_dir())

        @functools.cache
        def fleet(depth: int) -> Any:  # the fleet's choice this device will re-check there, if any
            if self.args["engine"] or not self.args["engine_choices"] or cached(depth) is not None:
                return None
            kind = selection_kind(bundle.at_depth(depth), probe=probe_report, preference=prof["backends"],
                                  batch_size=config.batch_size, threads=threads)
            return matching(self.args["engine_choices"], kind)
        self.plan_base_mb = base = _rss_mb()
        self.engine_mb_raw: dict[int, float] = {}  # the unscaled predictions, to learn the scale from
        self.recheck_predicted: dict[int, bool] = {}  # depth -> predicted a re-check (else a selection)
        pixels_mb = dataset.x.nbytes / 2**20 if getattr(dataset, "x", None) is not None else 0.0

        from .job_adapt import will_walk

        @functools.cache
        def adapt_images(depth: int) -> int:  # images the prefix's statistics are re-estimated on there
            walks = will_walk(cache_root, bundle.at_depth(depth), self.shift, self.args["adapt"], len(train),
                              train.hashes)
            return self._adapt_images(len(train)) if walks else 0

        def engine_memory(depth: int) -> EngineMemory:
            engine = self._engine_memory(bundle.at_depth(depth), cached(depth), fleet(depth), prof=prof,
                                         probe_report=probe_report,
                                         batch_size=config.batch_size, threads=threads, images=len(dataset),
                                         base_mb=base, pixels_mb=pixels_mb)
            return self._with_adaptation(engine, bundle.at_depth(depth), adapt_images(depth))
        plan = plan_depth(bundle, request=request, images=len(dataset), train=len(train), val=len(val),
                          epochs=config.epochs, batch_size=config.batch_size, dense_head=dense,
                          mem_cap_mb=prof["memory_cap_mb"],
                          budget_wh=self.budget.budget_wh if self.budget.budget_basis == "job" else None,
                          watts_per_cpu=wpc, base_rss_mb=base, rates=self.rates, numpy_tail=numpy_tail,
                          shifted=self.shift.far, adapt_images=adapt_images, spent_cpu_s=self.shift_s,
                          selection_cached=lambda depth: cached(depth) is not None or fleet(depth) is not None,
                          engine_memory=engine_memory if bundle.manifest.depths else None)
        release_freed_memory()  # the graphs parsed to predict it (13 MB of a MobileNetV2's five depths)
        if bundle.manifest.depths:
            self.emit("data", detail=f"depth {plan.depth} ({plan.reason})")
        return plan

    @staticmethod
    def _with_adaptation(engine: EngineMemory, view: Any, images: int) -> EngineMemory:
        """The engine phase, or adapting the prefix on `images` images before it where that
        peaks higher (both are transient: the larger is the phase's peak); 0: no adapting."""
        from ..int8.adapt_norm import adapt_mb
        from .depth_plan import EngineMemory

        if not images:
            return engine
        need = adapt_mb(view, images)
        if need <= engine.peak_mb:
            return engine
        return EngineMemory(need, engine.residual_mb, engine.imports_mxnet,
                            what=f"adapting the int8 prefix to the camera, then {engine.what}")

    def _adapt_images(self, n_train: int) -> int:
        """How many images the prefix's adaptation will run on (0: it will not)."""
        from ..int8.adapt_norm import ADAPT_MAX_IMAGES

        will = self.shift.report is not None and (self.shift.far or self.args["adapt"] == "bn")
        return min(ADAPT_MAX_IMAGES, n_train) if will else 0

    def _engine_memory(self, view: Any, cached: Any, fleet: Any, *, prof: dict[str, Any],
                       probe_report: dict[str, Any], batch_size: int, threads: int, images: int, base_mb: float,
                       pixels_mb: float) -> EngineMemory:
        """What the int8 engine's phase adds at bundle view `view` (int8/engine_memory.py), at
        this device's learnt scale: the re-check and features of the cached choice or of the
        fleet's (`fleet`, a SharedChoice), else a selection."""
        from ..int8 import engines as registry
        from ..int8.engine_cost import choose
        from ..int8.engine_memory import (
            SELECTION_RESIDUAL_MB,
            cached_mb,
            prefix_shape,
            selection_mb,
        )
        from ..int8.engines._common import thread_count
        from ..int8.selection import availability_report
        from ..int8.selection_worth import selection_candidates
        from .depth_plan import EngineMemory, engine_cap_mb

        shape, threads = prefix_shape(view), thread_count(threads)  # as selection's
        cap = engine_cap_mb(prof["memory_cap_mb"], base_mb)  # as the job's selection runs under
        if cached is not None:
            best = choose(cached.candidates, images, cap) or choose(cached.candidates, images)
            engine = registry.load_engine(best.name if best is not None else str(cached.chosen))
            raw = cached_mb(shape, engine, batch_size, (best.threads if best is not None else None) or threads)
            self.engine_mb_raw[view.depth] = raw
            self.recheck_predicted[view.depth] = True
            return EngineMemory(raw * self.rates["engine_mb_scale"], float(engine.prepare_mb_hint) - pixels_mb,
                                what=f"the cached int8 engine {engine.name}")
        if fleet is not None and fleet.engine in registry.engine_names():
            # re-checked like a cached choice; should this device refuse it, the selection that
            # follows still runs under the engine cap (only this prediction is then short)
            engine = registry.load_engine(fleet.engine)
            raw = cached_mb(shape, engine, batch_size, fleet.threads or threads)
            self.engine_mb_raw[view.depth] = raw
            self.recheck_predicted[view.depth] = True
            return EngineMemory(raw * self.rates["engine_mb_scale"], float(engine.prepare_mb_hint) - pixels_mb,
                                what=f"the fleet's int8 engine {engine.name}, re-checked")
        forced = self.args["engine"]
        rows = availability_report([forced] if forced else prof["backends"], probe_report)
        engines = [(r.name, registry.load_engine(r.name)) for r in rows if r.available]
        if not forced:
            macs = view.manifest.depths[view.depth].costs.get("prefix_macs", 0) if view.manifest.depths else 0
            engines = selection_candidates(engines, job_cpu_s=images * macs * self.rates["s_per_int8_mac"])
        predicted = selection_mb(shape, engines, batch=batch_size, threads=threads, start_mb=base_mb, cap_mb=cap)
        self.engine_mb_raw[view.depth] = predicted.peak_mb
        self.recheck_predicted[view.depth] = False
        return EngineMemory(predicted.peak_mb * self.rates["selection_mb_scale"], SELECTION_RESIDUAL_MB - pixels_mb,
                            predicted.imports_mxnet, what="a first job's int8 engine selection")

    def _learn_rates(self, cache_root: Path, n_train: int, n_val: int) -> None:
        """This job's measured CPU rates into the planner's per-device record."""
        from .depth_plan import learn_rates

        costs = self.bundle.manifest.depths[self.plan.depth].costs if self.bundle.manifest.depths else {}
        measured: dict[str, float] = {}
        images = self.cpu.get("feature_images", 0)
        if images and costs.get("prefix_macs"):
            measured["s_per_int8_mac"] = self.cpu["features_s"] / (images * costs["prefix_macs"])
        samples = self.pos["step"] * self.trainer.config.batch_size
        if samples and costs.get("tail_macs") and self.pos["step"] > 5 and self.plan.depth > 0:
            from .depth_plan import rate_key

            per_sample = self.cpu.get("train_s", 0.0) / samples
            overhead = self.rates[rate_key("s_per_sample", self.trainer.backend)]
            measured[rate_key("s_per_fp32_mac", self.trainer.backend)] = (max(per_sample - overhead, 1e-9)
                                                                          / (3 * costs["tail_macs"]))
        adapted = getattr(self, "adaptation", None)
        if adapted is not None and adapted.kind == "bn" and not adapted.cached and costs.get("prefix_macs"):
            measured["adapt_s_per_mac"] = self.cpu["adapt_s"] / (self._adapt_images(n_train) * costs["prefix_macs"])
        if self.trainer.backend == "mxnet" and self.cpu.get("setup_s"):
            measured["mxnet_import_s"] = self.cpu["setup_s"]
        measured_all = not self.selection_cached and getattr(self, "selection_source", "measured") != "fleet"
        if measured_all and self.cpu.get("selection_s") and costs.get("prefix_macs"):
            from .depth_plan import SELECTION_FIXED_S

            spent = max(self.cpu["selection_s"] - SELECTION_FIXED_S, 0.05 * self.cpu["selection_s"])
            measured["selection_s_per_mac"] = spent / costs["prefix_macs"]
        if self.pos["epoch"] and self.stop_reason in ("done", "early-stopped"):
            from .depth_plan import fraction_key

            measured["epoch_fraction"] = measured[fraction_key(self.plan.depth)] = (
                self.pos["epoch"] / self.trainer.config.epochs)
        measured.update(self._measured_memory())
        if measured:
            try:
                self.rates = learn_rates(cache_root, self.rates, measured)
            except OSError as exc:  # a read-only cache: plan with the defaults next time
                log.warning("planner rates not saved: %s", exc)

    def _measured_memory(self) -> dict[str, float]:
        """This job's memory figures as the planner's scales: the engine phase's growth over
        its unscaled prediction (a measured selection, or the cached engine's re-check), and
        MXNet's import."""
        memory = getattr(self, "memory", None) or {}
        out: dict[str, float] = {}
        raw = getattr(self, "engine_mb_raw", {}).get(self.plan.depth)
        peak, base = memory.get("engine_peak_mb"), memory.get("base_mb")
        # the phase as predicted (a re-check of the cached or the fleet's choice, else a
        # selection) against the one that ran: a refused fleet choice is measured in full
        rechecked = self.selection_cached or getattr(self, "selection_source", "measured") == "fleet"
        predicted_recheck = getattr(self, "recheck_predicted", {}).get(self.plan.depth, self.selection_cached)
        if raw and peak is not None and base is not None and peak > base and rechecked == predicted_recheck:
            out["engine_mb_scale" if rechecked else "selection_mb_scale"] = (peak - base) / raw
        if memory.get("mxnet_mb", 0.0) > 0:
            out["mxnet_mb"] = float(memory["mxnet_mb"])
        return out
