"""The two ways `select_engine` avoids measuring every engine: a choice this device cached
(re-timed on a few batches when asked), and a choice a device of the same kind measured
(shared_choice.py: same outputs by fingerprint, about the same speed)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from ..atomic import atomic_write_json
from .agreement import check_batch_for, evidence_notes
from .engine import Int8Engine, Runner
from .engine_cost import (
    RECHECK_BATCHES,
    RECHECK_FACTOR,
    choice_margin_note,
    choose,
    measured,
    predict_job,
    recheck,
)
from .selection_cache import Candidate, Selection
from .selection_measure import PREDICT_IMAGES, Ask
from .shared_choice import FINGERPRINT_SAMPLES, SharedChoice, output_fingerprint

_log = logging.getLogger(__name__)


def _same_work(cpu_per_image: float, measured: float) -> bool:
    """A re-check slower by the clock but not by the CPU time it took: the engine does the same
    work per image as where it was measured, and only waited for a CPU that other processes
    hold (wall time is what load inflates; a slower or different machine costs CPU time too)."""
    return measured > 0 and 0 < cpu_per_image <= RECHECK_FACTOR * measured


@dataclass
class _Speed:
    """How the shared choice ran here: the runner to keep, on how many threads, its median
    batch time, and in words."""

    runner: Runner
    threads: int
    wall_s: float
    how: str


def adopt_shared(choice: SharedChoice, ask: Ask, *, keep_runner: bool) -> tuple[Selection, Runner | None] | str:
    """A device of this kind measured `choice`: take it if this device's engine gives the same
    outputs (the fingerprint) at about the same speed (_speed_here). Returns the selection, or
    why not (then every engine is measured)."""
    engine = ask.by_name.get(choice.engine)
    if engine is None:
        return f"{choice.engine} is not a candidate here"
    if not _still_available(engine, ask.probe):
        return f"{choice.engine} is not available here"
    runs = FINGERPRINT_SAMPLES + (RECHECK_BATCHES + 1) * len(ask.x)
    predicted = ask.wpc * (choice.per_image_cpu_s * runs + float(getattr(engine, "prepare_cpu_s_hint", 1.0)))
    runner: Runner | None = None
    speed: _Speed | str = ""
    with measured(ask.meter, "shared-recheck", predicted, clocks=ask.clocks) as ph:
        try:
            c0 = ask.clocks.cpu()
            runner = engine.prepare(ask.bundle, threads=choice.threads)
            prepare_cpu_s = ask.clocks.cpu() - c0
            if output_fingerprint(runner, ask.calibration) != choice.fingerprint:
                speed = "its outputs here differ from the measuring device's"
            else:
                speed = _speed_here(choice, engine, runner, ask)
        except Exception as exc:  # a shared choice that fails here is measured, not fatal
            speed = f"{type(exc).__name__}: {str(exc).strip()[:200]}"
    if not isinstance(speed, _Speed):
        if runner is not None:
            runner.close()
        return speed
    return _adopted(choice, ask, speed, prepare_cpu_s, ph.joules, ph.cpu_s, keep_runner=keep_runner)


def _speed_here(choice: SharedChoice, engine: Int8Engine, runner: Runner, ask: Ask) -> _Speed | str:
    """Re-time the choice on a few batches. Taken when within RECHECK_FACTOR of its measured
    batch time, or slower only by the clock (_same_work); a pool of several threads slower by
    the CPU too is spinning on cores other processes hold, so one thread is tried (as a cached
    choice is, _recheck). Returns the speed, or why the choice is not taken (the runner is
    then the caller's to close)."""
    x, measured_s, t = ask.x, choice.latency_ms / 1000.0, choice.threads
    good, now, cpu_batch = recheck(runner, x, measured_s, clocks=ask.clocks)
    cpu_now = cpu_batch / len(x)
    if good:
        return _Speed(runner, t, now, f"{now * 1e3:.1f} ms per batch ({choice.latency_ms:.1f} where measured)")
    if _same_work(cpu_now, choice.per_image_cpu_s):
        return _Speed(runner, t, now, f"{now * 1e3:.1f} ms per batch on a busy CPU ({choice.latency_ms:.1f} where "
                      f"measured), the same {cpu_now * 1e3:.2f} CPU-ms per image ({choice.per_image_cpu_s * 1e3:.2f})")
    why = (f"{now * 1e3:.1f} ms per batch here, {choice.latency_ms:.1f} where it was measured; "
           f"{cpu_now * 1e3:.2f} CPU-ms per image here, {choice.per_image_cpu_s * 1e3:.2f} there")
    if t == 1:
        return why
    one = engine.prepare(ask.bundle, threads=1)
    try:
        good1, now1, cpu1 = recheck(one, x, measured_s * t, clocks=ask.clocks)
    except Exception:  # the caller closes the first runner and measures every engine
        one.close()
        raise
    if not (good1 or _same_work(cpu1 / len(x), choice.per_image_cpu_s)):
        one.close()
        return f"{why}; on 1 thread {now1 * 1e3:.1f} ms per batch, {cpu1 / len(x) * 1e3:.2f} CPU-ms per image"
    runner.close()
    return _Speed(one, 1, now1, f"{now1 * 1e3:.1f} ms per batch on 1 thread: {t} threads took {now * 1e3:.1f} ms and "
                  f"{cpu_now * 1e3:.2f} CPU-ms per image (contention; {choice.latency_ms:.1f} ms where measured)")


def _adopted(choice: SharedChoice, ask: Ask, speed: _Speed, prepare_cpu_s: float, joules: float, cpu_s: float, *,
             keep_runner: bool) -> tuple[Selection, Runner | None]:
    """The selection a re-checked shared choice makes, cached like a measured one."""
    x, wpc, now = ask.x, ask.wpc, speed.wall_s
    row = Candidate(choice.engine, True, f"the fleet's choice for this kind of device, re-checked here: same outputs, "
                    f"{speed.how}", correct=True,
                    basis="fleet", threads=speed.threads, latency_ms=now * 1e3, images_per_s=len(x) / now,
                    per_image_s=now / len(x), per_image_cpu_s=choice.per_image_cpu_s,
                    per_image_j=choice.per_image_cpu_s * wpc, prepare_cpu_s=prepare_cpu_s,
                    prepare_j=prepare_cpu_s * wpc, chosen=True)
    row.predicted_j = {str(n): round(predict_job(row, n)[0], 3) for n in PREDICT_IMAGES}
    selection = Selection(choice.engine, [row], ask.key, len(x), images=ask.images, threads=speed.threads,
                          created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), energy_j=joules, source="fleet",
                          share=choice.to_json(), chosen_for={str(n): choice.engine for n in PREDICT_IMAGES})
    selection.notes.append(f"int8 engine {choice.engine} ({speed.threads} thread(s)) as measured by a device of this "
                           f"kind; re-checked here in {cpu_s:.2f} CPU-s instead of measuring every engine")
    if ask.path is not None:
        atomic_write_json(ask.path, selection.to_json())
        selection.cache_file = str(ask.path)
    if keep_runner:
        return selection, speed.runner
    speed.runner.close()
    return selection, None


def use_cached(cached: Selection, ask: Ask, *, keep_runner: bool,
               recheck_cached: bool) -> tuple[Selection, Runner | None] | None:
    """The cached rows, re-chosen for this job's size; with `recheck_cached` the choice is
    re-timed on a few batches first (_recheck). None: select again."""
    images, cap = ask.images, ask.mem_cap_mb
    best = choose(cached.candidates, images, cap) or choose(cached.candidates, images)
    if best is None:
        return None
    engine = ask.by_name.get(best.name)
    if engine is None or not _still_available(engine, ask.probe):
        return None
    t = best.threads or cached.key.get("threads") or 1
    cached.images, cached.chosen, cached.threads = images, best.name, t
    cached.notes.extend(evidence_notes(best))
    note = choice_margin_note(cached.candidates, images, best.name, cap) or \
        choice_margin_note(cached.candidates, images, best.name)
    if note:
        cached.notes.append(note)
    for row in cached.candidates:
        row.chosen = row.name == best.name
    if not keep_runner and not recheck_cached:
        return cached, None
    try:
        runner = engine.prepare(ask.bundle, threads=t)
    except Exception as exc:  # it worked when cached; re-select rather than fail
        _log.warning("cached int8 engine %s failed to prepare (%s); selecting again", best.name, exc)
        return None
    if recheck_cached and best.latency_ms:
        runner = _recheck(cached, best, engine, runner, ask)
    if not keep_runner:
        runner.close()
        return cached, None
    return cached, runner


def _recheck(cached: Selection, best: Candidate, engine: Int8Engine, runner: Runner, ask: Ask) -> Runner:
    """Re-time the cached choice on a few batches: RECHECK_FACTOR slower on several threads
    falls back to one thread; on one thread the choice is kept (load slows every engine alike,
    and the cached features belong to this engine). Returns the runner to use."""
    t, measured_s = cached.threads or 1, (best.latency_ms or 0.0) / 1000.0
    x = check_batch_for(ask.bundle, cached.batch_size)
    good, now, _ = recheck(runner, x, measured_s, clocks=ask.clocks)
    if not good and t > 1:  # contention: a spinning pool on shared cores; try one thread
        one = engine.prepare(ask.bundle, threads=1)
        good1, now1, _ = recheck(one, x, measured_s * t, clocks=ask.clocks)
        if good1 or now1 < now:
            runner.close()
            runner, now, good = one, now1, True
            cached.threads = 1
            cached.notes.append(f"{best.name}: slower than measured with {t} threads (contention?): using 1 "
                                f"thread ({now1 * 1e3:.1f} ms/batch)")
        else:
            one.close()
    if not good:
        # one thread and still slow: the whole machine is busy, which slows every engine
        # alike; another selection would cost energy and change the features' engine
        cached.notes.append(f"{best.name}: {now * 1e3:.1f} ms/batch now, {best.latency_ms:.1f} when measured "
                            "(a busy machine); kept")
    return runner


def _still_available(engine: Int8Engine, probe: dict[str, Any]) -> bool:
    try:
        return bool(engine.availability(probe).available)
    except Exception:  # treat a failing probe as "gone": re-select
        return False
