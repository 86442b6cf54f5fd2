"""The fine-tune job: local data -> int8 backbone features (cached) -> head training under
the power budget governor -> checkpoints -> a JSON report. How deep it trains is decided
in job_depth.py, what it writes at the end in job_report.py (mixins of _Job).

`run_finetune(...)` takes plain arguments and a progress callback and returns the report;
it is what `edge-agent finetune` runs in-process and what the agent daemon runs in a child
process. Everything it needs to continue lives in `state_dir`:

    state_dir/lock             flock: one job per state directory
    state_dir/job.json         status (running / done / stopped / refused), model, data, stop reason,
                               failure (why a job that trained no step failed: job_report.py)
    state_dir/checkpoints/     ckpt-<seq>.ckpt (the newest two; see checkpoints.py)
    state_dir/head.params      the trained head, MXNet ndarray format (as in a bundle)
    state_dir/report.json      the last report

Checkpoints are written once `checkpoint_every` steps went unsaved (within an epoch, or at
its end after the validation pass), after the last epoch, on every pause (before waiting)
and on every stop, so a brown-out loses at most `checkpoint_every` steps.
With `resume=True` the newest good checkpoint is loaded and the job continues exactly
where it stopped (same batches, same optimiser state, energy already used counted against
the budget). Without it, a state directory holding an unfinished job is an error, so a
checkpoint is never silently thrown away.

SIGTERM / SIGINT (when run in the main thread) stop the job cleanly at the next step
boundary: checkpoint, report, stop reason "cancelled".
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic import atomic_write_json
from ..blas import one_blas_thread
from ..errors import ConfigError, InputError, UsageError
from ..heap import new_objects_only, release_freed_memory
from ..protocol.engine_choice import SharedChoice
from ..protocol.finetune import DISTILL_DEFAULT
from ..protocol.label_claims import LabelClaims
from .checkpoints import Checkpoint, CheckpointStore
from .job_depth import DepthPlanning, _output_grid
from .job_report import JOB_FILE, REPORT_FILE, REPORT_SCHEMA, JobReport  # noqa: F401 - the file names, for callers
from .job_support import (
    JobStateError,
    Progress,
    ProgressCallback,
    _cancel_on_signals,
    _feature_key,
    _GovernorMeter,
    _locked,
    _profile_values,
    _read_job,
    _Stopped,
)

log = logging.getLogger(__name__)

HEAD_LR, TAIL_LR = 0.01, 0.001  # default learning rates: one dense layer, anything deeper
ENV_ENERGY_SCOPE = "EDGE_AGENT_ENERGY_SCOPE"  # "device": battery-wide accounting (a daemon's jobs too)


def run_finetune(
    *,
    model: str | os.PathLike[str],
    data: str | os.PathLike[str],
    state_dir: str | os.PathLike[str],
    cache_dir: str | os.PathLike[str] | None = None,
    budget_wh: float | None = None,
    budget_basis: str = "job",
    energy_scope: str | None = None,
    power_cap_w: float | None = None,
    battery_floor_pct: float | None = None,
    battery_resume_pct: float | None = None,
    thermal_limit_c: float | None = None,
    window: str | None = None,
    deadline: float | str | None = None,
    epochs: int = 20,
    batch_size: int | None = None,
    lr: float | None = None,
    optimizer: str = "adam",
    weight_decay: float = 1e-4,
    patience: int = 3,
    balance: bool = False,
    distill: float = DISTILL_DEFAULT,
    train_last: int | None = None,
    trainer: str = "auto",
    depth: str | int = "auto",
    bn: str = "update",
    tail: str = "full",
    adapt: str = "auto",
    augment: int = 0,
    augment_kinds: str | tuple[str, ...] = ("crop", "brightness"),
    val_fraction: float = 0.2,
    seed: int = 0,
    checkpoint_every: int = 50,
    resume: bool = False,
    engine: str | None = None,
    label_column: str = "label",
    label_map: dict[str, str] | str | None = None,
    skip_unknown: bool = False,
    power_root: str | os.PathLike[str] = "/",
    profile: str | None = None,
    threads: int | None = None,
    cache_max_mb: float = 256.0,
    poll_s: float = 30.0,
    inference_energy: str | os.PathLike[str] | None = None,
    engine_choices: Sequence[SharedChoice] = (),
    progress: ProgressCallback | None = None,
    clock: Any = None,
) -> dict[str, Any]:
    """Fine-tune the head of bundle `model` on the local data `data`; returns the report.

    Raises EdgeAgentError subclasses for anything the user must fix (bad data set, bad
    bundle, mismatched checkpoint, busy or unfinished state directory); a stop by the
    governor (budget, deadline, battery, cancel) is not an error: see "stop_reason". A job
    that ends having trained no step (a resumed checkpoint's steps count) has "status"
    "failed" and "failure" says why (job_report.py), unless it was cancelled.
    `clock` (edge_agent.power.Clock) is for tests; the default is the system clock. A
    clock with a `work_done()` method is called after every feature batch and training
    step, so a virtual clock can charge each step a fixed time whatever the CPU's speed;
    one with a `cpu_seconds()` method is the job's CPU-time counter (default: this process
    tree's, power/process_energy.py).
    `energy_scope`: what the budget is charged with: "process" (the job's own CPU-seconds x
    the board profile's watts per busy core; the default) or "device" (everything the board's
    power source measures: battery-wide); None reads $EDGE_AGENT_ENERGY_SCOPE, else "process".
    `model` is a bundle directory or its .tar.gz archive (unpacked, verified, for the run).
    `label_map`: a `--label-map` spec (edge_agent.labels.parse_label_map) or its parsed form;
    data labels matching no model label are an InputError unless `skip_unknown`.
    `depth`: how deep to train on a multi-depth bundle: "auto" (train/depth_plan.py: the
    deepest that fits the memory cap and the budget), "head" or a depth number; `bn`:
    BatchNorm in the tail updates its statistics from the local batches ("update", the
    default: a device's own camera shifts them) or keeps the base model's ("frozen");
    `tail`: train every tail parameter ("full") or only biases and BatchNorm scales plus
    the classifier ("bias"). `adapt`: re-estimate the int8 prefix's normalisation statistics
    on the device's images and re-quantise it ("bn"), never ("none"), or when the images are
    far from the bundle's ("auto"; train/job_adapt.py). `lr` defaults to 0.01 for a one-dense-layer head and 0.001 deeper (pre-trained
    conv layers want a smaller step: bench_depth). `augment`: K extra views of every
    training image (`augment_kinds` of crop, brightness, flip; train/augment.py), made
    before the int8 prefix and cached like the images themselves. `inference_energy`: the
    local inference service's energy file (edge_agent.power.inference_energy): what it spends
    while this job trains is accounted as inference, not charged to the job's budget.
    `engine_choices`: the fleet's int8 engine choices (a finetune command's, or `--engine-choices
    FILE`): engine selection starts from the one made on a device of this kind and only
    re-checks it (int8/shared_choice.py) instead of measuring every engine.
    """
    from ..labels import parse_label_map
    from ..power import Budget
    from .depth_plan import parse_depth

    if isinstance(label_map, str):
        label_map = parse_label_map(label_map)
    depth = parse_depth(depth)
    from .augment import MAX_VIEWS, parse_kinds
    from .job_adapt import parse_adapt

    adapt = parse_adapt(adapt)

    augment_kinds = parse_kinds(augment_kinds)
    if isinstance(augment, bool) or not isinstance(augment, int) or not 0 <= augment <= MAX_VIEWS:
        raise UsageError(f"augment: expected 0..{MAX_VIEWS} views per image, got {augment!r}")
    # validate everything cheap before touching the state directory
    if energy_scope is None:
        energy_scope = os.environ.get(ENV_ENERGY_SCOPE, "").strip() or "process"
    budget = Budget(budget_wh=budget_wh, budget_basis=budget_basis, energy_scope=energy_scope, power_cap_w=power_cap_w,
                    battery_floor_pct=battery_floor_pct, battery_resume_pct=battery_resume_pct,
                    thermal_limit_c=thermal_limit_c, window=window, deadline=deadline)
    if not isinstance(checkpoint_every, int) or checkpoint_every < 1:
        raise InputError(f"checkpoint_every must be an integer >= 1, got {checkpoint_every!r}")
    from .dense_head import BACKENDS

    if trainer not in BACKENDS:
        raise ConfigError(f"trainer: expected one of {', '.join(BACKENDS)}, got {trainer!r}")
    engine_choices = tuple(engine_choices)
    if not all(isinstance(c, SharedChoice) for c in engine_choices):
        raise UsageError("engine_choices: expected SharedChoice records (protocol.engine_choice.parse_choices)")
    state = Path(state_dir)
    with _locked(state):
        job = _Job(state=state, budget=budget, progress=progress, clock=clock, args=dict(
            model=str(model), data=str(data), cache_dir=str(cache_dir) if cache_dir else None,
            epochs=epochs, batch_size=batch_size, lr=lr, optimizer=optimizer, weight_decay=weight_decay,
            patience=patience, balance=balance, distill=distill, train_last=train_last, trainer=trainer, depth=depth, bn=bn, tail=tail,
            adapt=adapt, augment=augment, augment_kinds=augment_kinds,
            val_fraction=val_fraction, seed=seed,
            checkpoint_every=checkpoint_every, resume=resume, engine=engine, label_column=label_column,
            label_map=label_map, skip_unknown=skip_unknown, power_root=str(power_root), profile=profile,
            threads=threads, cache_max_mb=cache_max_mb, poll_s=poll_s,
            inference_energy=str(inference_energy) if inference_energy else None, engine_choices=engine_choices))
        # small matrix products, and OpenBLAS's idle threads spin between them (blas.py); the
        # phases' collections walk the job's own objects, not the imports' (heap.py)
        with one_blas_thread(), new_objects_only():
            return job.run()


def _inference_reader(path: str | None) -> Any:
    """The governor's view of the inference service's energy total (None: no service)."""
    if not path:
        return None
    from ..power.inference_energy import read_inference_j

    return lambda: read_inference_j(Path(path))


class _Job(DepthPlanning, JobReport):
    """One run of run_finetune (internal: the function is the API)."""

    def __init__(self, *, state: Path, budget: Any, progress: ProgressCallback | None, clock: Any,
                 args: dict[str, Any]) -> None:
        self.state, self.budget, self.args, self.clock = state, budget, args, clock
        self._progress = progress
        self.started = time.monotonic()
        self.last_loss: float | None = None
        self.last_val_acc: float | None = None
        self.last_watts: float | None = None
        self.saved_step = 0  # the newest checkpoint's step
        self.label_claims: LabelClaims | None = None  # set once the base has answered on the training split

    # ------------------------------------------------------------------ helpers

    def emit(self, phase: str, **fields: Any) -> None:
        if self._progress is None:
            return
        gov = getattr(self, "gov", None)
        energy_wh = 0.0
        temp = None
        if gov is not None:
            st = gov.state()
            energy_wh = (st["energy_j_job"] if self.budget.budget_basis == "job" else st["energy_j_total"]) / 3600.0
            temp = gov.temp_c if gov.temp_c is not None else gov.max_temp_c
        event = Progress(phase=phase, energy_wh=energy_wh, budget_wh=self.budget.budget_wh, watts=self.last_watts,
                         temp_c=temp, loss=self.last_loss, val_accuracy=self.last_val_acc, **fields)
        try:
            self._progress(event)
        except Exception:  # a broken UI must not kill training
            log.exception("progress callback failed")

    def run(self) -> dict[str, Any]:
        with contextlib.ExitStack() as stack:
            return self._run(stack)

    def _open_bundle(self, stack: contextlib.ExitStack) -> Any:
        """A bundle directory, or an archive unpacked (and verified) into a temp directory
        for the length of the run, as `kernels` and `inspect` accept it. The checkpoints
        key on the manifest's sha256, which the archive and its directory share."""
        import tempfile

        from ..int8.bundle import load_bundle, unpack_bundle

        model = Path(self.args["model"])
        if not model.is_file():
            return load_bundle(model)
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="edge-agent-finetune-"))
        return unpack_bundle(model, Path(tmp) / "bundle")

    def _run(self, stack: contextlib.ExitStack) -> dict[str, Any]:
        a = self.args
        from ..hardware.probe import probe
        from ..int8.bundle import BACKBONE_INT8

        probe_report = probe(a["power_root"])
        prof = _profile_values(a["profile"], probe_report)
        cap, idle = self.budget.power_cap_w, prof["idle_w"]
        if cap is not None and idle is not None and cap <= idle:  # before any bundle or data is read
            raise UsageError(f"--power-cap-w {cap:g}: at or below the idle power of board profile {prof['name']} "
                             f"({idle:g} W; `edge-agent profiles show {prof['name']}`); no duty cycle can meet it: "
                             "give a cap above it")
        bundle = self._open_bundle(stack)
        self.bundle, self.root_sha256 = bundle, bundle.sha256
        store = CheckpointStore(self.state / "checkpoints")
        previous = _read_job(self.state)
        checkpoint: Checkpoint | None = None
        if a["resume"]:
            checkpoint = store.load_latest(expect={"model": bundle.sha256})
        elif store.paths():
            if previous.get("status") != "done":
                raise JobStateError(
                    f"{self.state}: holds checkpoints of an unfinished job (status {previous.get('status', 'unknown')!r}); "
                    "pass --resume to continue it, or use another --state-dir")
            store.clear()
        atomic_write_json(self.state / JOB_FILE, {"status": "running", "model": a["model"],
                                                  "model_sha256": bundle.sha256, "data": a["data"], "pid": os.getpid()})
        self.emit("data", detail=f"reading {a['data']}")
        from ..data import load_dataset, split_dataset

        dataset = load_dataset(a["data"], bundle.manifest.input, bundle.manifest.labels, label_column=a["label_column"],
                               label_map=a["label_map"], skip_unknown=a["skip_unknown"])
        train, val = split_dataset(dataset, a["val_fraction"])
        for line in dataset.report.summary_lines():  # what was skipped and why, on every console
            self.emit("data", detail=line)
        if len(train) == 0:
            raise InputError(f"{a['data']}: all {len(dataset)} usable samples fell into the validation split")
        if a["augment"]:
            from .augment import augmented_views, concat

            views = augmented_views(train, a["augment"], kinds=a["augment_kinds"], seed=a["seed"])
            train, dataset = concat(train, views), concat(dataset, views)
            self.emit("data", detail=f"{len(views)} augmented views ({'+'.join(a['augment_kinds'])}) "
                                     f"join the {len(train) - len(views)} training images")

        batch_size = a["batch_size"] or prof["batch_size"] or 32
        threads = a["threads"] or prof["threads"] or os.cpu_count() or 1
        budget = self.budget
        if budget.thermal_limit_c is None and prof["thermal_limit_c"] is not None:
            from ..power import Budget

            budget = Budget(**{**budget.to_config(), "thermal_limit_c": prof["thermal_limit_c"]})
            self.budget = budget

        from .trainer import TrainConfig, head_from_bundle

        def train_config(lr: float) -> TrainConfig:
            return TrainConfig(optimizer=a["optimizer"], lr=lr, weight_decay=a["weight_decay"],
                               batch_size=batch_size, epochs=a["epochs"], patience=a["patience"],
                               balance=a["balance"], distill=a["distill"], seed=a["seed"], train_last=a["train_last"], bn=a["bn"],
                               tail=a["tail"])

        config = train_config(a["lr"] or HEAD_LR)  # validated before any planning
        cores = max(1, int((probe_report.get("cpu") or {}).get("count") or os.cpu_count() or 1))
        wpc = (prof["load_w"] - prof["idle_w"]) / cores if prof["load_w"] and prof["idle_w"] is not None else None
        cache_root = Path(a["cache_dir"]) if a["cache_dir"] else self.state / "cache"
        from .job_adapt import device_shift

        cpu_start = time.process_time()
        self.shift = device_shift(bundle, train.x, a["adapt"])  # the planner trains a shifted device deeper
        self.shift_s = shift_s = time.process_time() - cpu_start
        self.plan = self._plan_depth(bundle, checkpoint, dataset, train, val, config, prof, wpc, cache_root,
                                     probe_report, threads)
        bundle = self.bundle = bundle.at_depth(self.plan.depth)  # from here on, the bundle as seen at that depth
        symbol_json, base_params = head_from_bundle(bundle)  # numpy only: MXNet comes after the features
        from ..int8.head_form import dense_head_form

        if a["lr"] is None and (self.plan.depth > 0 or dense_head_form(symbol_json, bundle.manifest.split_tensor) is None):
            # pre-trained conv / BatchNorm weights, a depth's or a head split before them:
            # 0.01 undoes them (digits, conv + BN + dense head: 0.91 -> 0.80; 0.001: -> 0.94)
            config = train_config(TAIL_LR)
        self.base_params = base_params

        # The meter starts here: engine selection (or the re-check of a cached choice),
        # features and training are all charged to the budget.
        from ..int8.engine_cost import Clocks
        from ..power import BudgetGovernor, PowerMonitor, ThermalMonitor
        from ..power.process_energy import process_cpu_seconds

        monitor = PowerMonitor.discover(a["power_root"], idle_w=prof["idle_w"], load_w=prof["load_w"])
        gov_state = checkpoint.meta.get("governor") if checkpoint is not None else None
        cpu_seconds = getattr(self.clock, "cpu_seconds", None) or process_cpu_seconds  # a test's virtual counter
        self.gov = gov = BudgetGovernor(budget=budget, sources=monitor, thermal=ThermalMonitor(a["power_root"]),
                                        clock=self.clock, max_threads=threads, poll_s=a["poll_s"],
                                        resume_from=gov_state if isinstance(gov_state, dict) else None,
                                        inference_j=_inference_reader(a.get("inference_energy")),
                                        watts_per_cpu=wpc, cpu_seconds=cpu_seconds)

        # features for every usable sample, through the selected int8 engine and the cache
        from ..int8.cli import default_state_dir
        from ..int8.selection import select_engine
        from .feature_cache import FeatureCache
        from .job_adapt import adapt_prefix

        # the prefix adapted to the device's images: before the selection, paid from the budget like it
        cpu_start = time.process_time()
        served, self.adaptation = adapt_prefix(bundle, train.x, train.hashes, a["adapt"], cache_root, self.shift)
        self.shift = self.shift.without_backbone()  # not held through the features and training
        adapt_s = shift_s + time.process_time() - cpu_start
        if served is not bundle:
            self.emit("data", detail=f"prefix adapted to the device's images ({self.adaptation.reason})")
        env = dict(os.environ)
        if a["engine"]:
            env["EDGE_AGENT_INT8_BACKEND"] = a["engine"]
        used_before = gov.charge_overhead()
        cpu_start = time.process_time()
        from ..int8.engine_cost import PeakWatch, rss_mb
        from .depth_plan import engine_cap_mb

        engine_peak = stack.enter_context(PeakWatch())  # selection (or the cached engine's re-check) and features
        # one decision directory for `kernels --bench` and jobs: a user's benchmark is reused
        from ..int8.engine_cost import BudgetTooSmallError, SelectionStopped
        from .dense_head import numpy_head_logits

        try:
            selection, runner = select_engine(
                bundle, probe=probe_report, batch_size=batch_size, threads=threads,
                state_dir=Path(a["cache_dir"]) if a["cache_dir"] else default_state_dir(), env=env, keep_runner=True,
                preference=prof["backends"], images=len(dataset), meter=_GovernorMeter(self, gov),
                watts_per_cpu=wpc, recheck_cached=True,
                mem_cap_mb=engine_cap_mb(prof["memory_cap_mb"], getattr(self, "plan_base_mb", None) or rss_mb() or 0.0),
                clocks=Clocks(cpu=cpu_seconds), shared=a["engine_choices"],
                logits=numpy_head_logits(bundle))  # no MXNet for the top-1 check of a tail numpy computes
        except SelectionStopped as exc:  # the budget ran out choosing the engine: failed, unless it trained before
            resumed = None
            if checkpoint is not None and checkpoint.step > 0:  # what it trained before is kept and reported
                trainer = self._make_trainer(symbol_json, base_params, config, train.y, threads, checkpoint)
                trainer.load_state(checkpoint.meta["trainer"], checkpoint.arrays)
                resumed = (trainer, checkpoint)
            return self._stopped_in_selection(bundle, dataset, prof, str(exc), store=store, resumed=resumed)
        except BudgetTooSmallError as exc:  # refused before the selection was spent: nothing left running
            atomic_write_json(self.state / JOB_FILE, {"status": "refused", "stop_reason": "budget-too-small",
                                                      "detail": str(exc)[:500], "model": a["model"]})
            raise
        assert runner is not None
        selection_s = time.process_time() - cpu_start
        if served is not bundle:
            from .job_adapt import choose_runner

            cpu_start = time.process_time()
            served, runner = choose_runner(self.adaptation, bundle, served, runner, selection, train.x, threads)
            adapt_s += time.process_time() - cpu_start
        self.adaptation.cpu_s = adapt_s
        from .job_adapt import remember

        remember(cache_root, bundle, self.adaptation, len(train))  # what the next job on this camera takes
        self.selection_j = gov.charge_overhead() - used_before
        self.selection_cached = bool(selection.cached)
        self.selection_source = selection.source
        self.cpu = {"selection_s": selection_s, "adapt_s": adapt_s}
        cpu_start = time.process_time()
        cache = FeatureCache(cache_root / "features", max_bytes=int(a["cache_max_mb"] * (1 << 20)))
        stop_reason: str | None = None
        with _cancel_on_signals(gov.cancel):
            try:
                # keyed by backbone and engine: the head trains on the features of the engine
                # that will run under it (engines differ by a few output steps)
                features, cache_stats = cache.features(
                    _feature_key(served.manifest.files[BACKBONE_INT8].sha256, selection.chosen), dataset.hashes, dataset.x,
                    self._governed(runner.run), batch_size=batch_size,
                    feature_shape=tuple(bundle.manifest.feature_shape),
                    progress=lambda done, total: self.emit("features", detail=f"{done}/{total} new samples"),
                    quant=_output_grid(served))
            except _Stopped:
                features, cache_stats = None, None
            finally:
                runner.close()
                del runner
            # The pixels and the engine are no longer needed: free them before MXNet loads, so
            # the backbone's peak and MXNet's (~130 MB import) do not stack up in one process.
            dataset, train, val = dataset.without_pixels(), train.without_pixels(), val.without_pixels()
            release_freed_memory()  # glibc keeps freed pages (the oracle's ~60 MB on MobileNetV2) in its arenas
            self.cpu["features_s"] = time.process_time() - cpu_start
            # what the planner predicted the engine's phase would add, and what it did (MB)
            base = getattr(self, "plan_base_mb", None)
            self.memory = {"base_mb": None if base is None else round(base, 1),
                           "engine_peak_mb": None if engine_peak.peak_mb is None else round(engine_peak.peak_mb, 1)}
            engine_peak.close()
            mxnet_before, rss_before = "mxnet" in sys.modules, rss_mb()
            self.cpu["feature_images"] = cache_stats.computed if cache_stats is not None else 0
            cpu_start = time.process_time()
            trainer = self._make_trainer(symbol_json, base_params, config, train.y, threads, checkpoint)
            self.cpu["setup_s"] = time.process_time() - cpu_start
            if trainer.backend == "mxnet" and not mxnet_before and rss_before is not None:
                self.memory["mxnet_mb"] = (rss_mb() or rss_before) - rss_before  # its import: the planner's mxnet_mb
            cpu_start = time.process_time()
            index = {h: i for i, h in enumerate(dataset.hashes)}
            f_val = features[[index[h] for h in val.hashes]] if features is not None else None
            before = trainer.evaluate(f_val, val.y) if f_val is not None else (math.nan, math.nan)
            f_train = features[[index[h] for h in train.hashes]] if features is not None else None
            # the bundle's own answers, before any step (a resumed job's too): what distill pulls
            # towards, and what the update's label claims say it predicted (protocol/label_claims.py)
            base_logits = trainer.predict(f_train) if f_train is not None else None
            teacher = base_logits if config.distill else None
            if base_logits is not None:
                from .dense_head import log_softmax

                self.label_claims = LabelClaims.of(np.exp(log_softmax(base_logits)), train.y, trainer.class_weight)
            pos = {"epoch": 0, "batch": 0, "step": 0, "elapsed_s": 0.0}
            if checkpoint is not None:
                trainer.load_state(checkpoint.meta["trainer"], checkpoint.arrays)
                pos.update({k: checkpoint.meta["position"][k] for k in pos})
                if checkpoint.meta.get("before") is not None:
                    before = tuple(checkpoint.meta["before"])
                self.emit("train", step=pos["step"], detail=f"resumed from {checkpoint.path.name} at step {pos['step']}")
            self.pos, self.trainer, self.store, self.before = pos, trainer, store, before
            self.saved_step = int(pos["step"])  # a resumed checkpoint's
            if features is None:
                stop_reason = gov.stop_reason.value if gov.stop_reason else "cancelled"
                self.checkpoint("stop")
            else:
                stop_reason = self._train(f_train, train.y, f_val, val.y, teacher)
            self.cpu["train_s"] = time.process_time() - cpu_start
            self.stop_reason = stop_reason
        after = trainer.evaluate(f_val, val.y) if f_val is not None else (math.nan, math.nan)
        self._learn_rates(cache_root, len(train), len(val))
        return self._finish(bundle, dataset, selection, cache_stats, before, after, stop_reason, prof,
                            stopped_in="features" if features is None else "training")

    def _make_trainer(self, symbol_json: str, params: dict[str, np.ndarray], config: Any, train_labels: np.ndarray,
                      threads: int, checkpoint: Checkpoint | None) -> Any:
        # numpy unless the tail holds an op only MXNet computes
        from .dense_head import make_head_trainer

        manifest = self.bundle.manifest
        backend = self.args["trainer"]
        written = checkpoint.meta.get("trainer") if checkpoint is not None else None
        if backend == "auto" and isinstance(written, dict) and written.get("backend") == "mxnet":  # a job started before its tail trained in numpy
            backend = "mxnet"
        return make_head_trainer(symbol_json=symbol_json, params=params, input_name=manifest.split_tensor,
                                 num_classes=len(manifest.labels), config=config, train_labels=train_labels,
                                 threads=threads, backend=backend, input_shape=tuple(manifest.feature_shape))

    def _governed(self, compute: Callable[[np.ndarray], np.ndarray]) -> Callable[[np.ndarray], np.ndarray]:
        """The backbone, run under the governor like a training step (it costs energy too)."""
        def run(batch: np.ndarray) -> np.ndarray:
            decision = self.gov.before_step()
            if decision.paused:
                self.emit("paused", detail=str(decision))
                decision = self.gov.wait_until_resumable()
            if decision.stopped:
                raise _Stopped(str(decision))
            start = time.perf_counter()
            out = compute(batch)
            self._work_done()
            self.gov.after_step(time.perf_counter() - start)
            return out
        return run

    def _work_done(self) -> None:
        hook = getattr(self.clock, "work_done", None)  # a test clock (see run_finetune)
        if hook is not None:
            hook()

    def checkpoint(self, why: str) -> None:
        meta, arrays = self.trainer.state()
        pos = dict(self.pos, elapsed_s=self.pos["elapsed_s"] + (time.monotonic() - self.started))
        ckpt = Checkpoint(step=int(self.pos["step"]), arrays=arrays, meta={
            "model": self.root_sha256, "depth": int(self.bundle.depth), "trainer": meta, "position": pos, "why": why,
            "governor": self.gov.state(), "before": list(self.before) if all(map(math.isfinite, self.before)) else None,
            "energy_wh": self.gov.state()["energy_j_job"] / 3600.0,
        })
        self.emit("saving", step=int(self.pos["step"]), detail=why)  # a write is about to start
        self.store.save(ckpt)
        self.saved_step = int(self.pos["step"])
        self.emit("checkpoint", step=int(self.pos["step"]), detail=why)

    def _train(self, x: np.ndarray, y: np.ndarray, x_val: np.ndarray, y_val: np.ndarray,
               teacher: np.ndarray | None) -> str:
        """Train from the checkpointed position; `teacher`: the bundle's own logits per
        sample of `x`, for distillation (None: none)."""
        from ..power import StopReason

        gov, trainer, pos, a = self.gov, self.trainer, self.pos, self.args
        n = len(y)
        per_epoch = trainer.batches_per_epoch(n)
        epochs = trainer.config.epochs
        total = per_epoch * epochs
        while pos["epoch"] < epochs:
            while pos["batch"] < per_epoch:
                decision = gov.before_step()
                if decision.paused:
                    self.checkpoint(f"pause: {decision.reason.value if decision.reason else ''}")
                    self.emit("paused", step=pos["step"], total_steps=total, epoch=pos["epoch"], epochs=epochs,
                              detail=str(decision))
                    decision = gov.wait_until_resumable()
                    if decision.proceed:
                        self.emit("train", step=pos["step"], total_steps=total, detail="resumed")
                if decision.stopped:
                    self.checkpoint(f"stop: {decision.reason.value if decision.reason else ''}")
                    return decision.reason.value if decision.reason else StopReason.CANCELLED.value
                idx = trainer.batch_indices(n, pos["epoch"], pos["batch"])
                start = time.perf_counter()
                self.last_loss = trainer.step(x[idx], y[idx], None if teacher is None else teacher[idx])
                self._work_done()
                advice = gov.after_step(time.perf_counter() - start)
                self.last_watts = advice.step_w
                trainer.set_threads(advice.threads)
                pos["batch"] += 1
                pos["step"] += 1
                self.emit("train", step=pos["step"], total_steps=total, epoch=pos["epoch"], epochs=epochs)
                if pos["step"] - self.saved_step >= a["checkpoint_every"] and pos["batch"] < per_epoch:
                    self.checkpoint("interval")
            val_loss, self.last_val_acc = trainer.evaluate(x_val, y_val)
            stop = trainer.end_epoch(pos["epoch"], val_loss)
            pos["epoch"] += 1
            pos["batch"] = 0
            if stop:
                trainer.restore_best()
                gov.finish(StopReason.EARLY_STOPPED, f"validation loss did not improve for {trainer.config.patience} epochs")
                self.checkpoint("early-stopped")
                return StopReason.EARLY_STOPPED.value
            # an epoch's end is a checkpoint like any step (and after the last epoch): one at
            # every epoch's end made a small job's 24 epochs 24 checkpoints, a fifth of its CPU
            # time (camera MobileNetV2 tail, 92 steps) and 24 flash writes
            if pos["step"] - self.saved_step >= a["checkpoint_every"] or pos["epoch"] >= epochs:
                self.checkpoint("epoch")
        trainer.restore_best()
        gov.finish(StopReason.DONE)
        return StopReason.DONE.value

