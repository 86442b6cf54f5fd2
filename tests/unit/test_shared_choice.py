"""Fleet-shared engine choices on the device: a full selection reports what it measured, a
device of the same kind re-checks it (same outputs, about the same speed) instead of
preparing, checking and timing every engine, and falls back to measuring when the check fails.

Real engines (tflite, native, the reference) on a real digits bundle; `Counting` wraps them at
the project's own Int8Engine interface to count what was prepared."""

from __future__ import annotations

import json

import pytest

from edge_agent.int8 import bundle_create as BC
from edge_agent.int8 import selection as sel
from edge_agent.int8.engine import Int8Engine
from edge_agent.int8.engines import load_engine
from edge_agent.int8.selection_cache import CACHE_DIR
from edge_agent.int8.shared_choice import SharedChoice, kind_of, shared_choices
from edge_agent.sim import models

PROBE = {"cpu": {"arch": "x86_64", "count": 2, "int8_features": {"avx2": True}}, "accelerators": [],
         "board": {"model": "test board"}}


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    x_train, y_train, _, _ = models.load_digits_split()
    net = models.digits_cnn()
    models.fit_classifier(net, x_train, y_train, epochs=3)
    return BC.create_bundle(net, tmp_path_factory.mktemp("shared") / "b", version="1", calibration=x_train[:64],
                            labels=[str(i) for i in range(10)], name="digits", input_shape=(1, 8, 8), scale=1 / 16)


class Counting(Int8Engine):
    """A real engine, counting its prepares."""

    def __init__(self, name: str) -> None:
        self.inner, self.name, self.prepared = load_engine(name), name, 0

    def availability(self, probe=None):
        return self.inner.availability(probe)

    def prepare(self, bundle, *, threads=None):
        self.prepared += 1
        return self.inner.prepare(bundle, threads=threads)


def engines() -> list[tuple[str, Counting]]:
    return [(n, Counting(n)) for n in ("tflite", "native", "reference")]


def select(bundle, state_dir, engines, **kw):
    return sel.select_engine(bundle, probe=PROBE, state_dir=state_dir, batch_size=16, threads=1, repeats=2,
                             env={}, engines=engines, **kw)


def test_a_full_selection_reports_its_choice_and_a_device_of_its_kind_only_rechecks_it(bundle, tmp_path):
    first, _ = select(bundle, tmp_path / "first", engines())
    (share,) = shared_choices(tmp_path / "first")
    assert share.engine == first.chosen and share.threads == first.threads and share.batch_size == 16
    assert (tmp_path / "first" / CACHE_DIR / f"{share.kind}.json").exists()  # the kind names the cache entry
    assert share.kind == kind_of(first.key)

    fresh = engines()
    second, runner = select(bundle, tmp_path / "second", fresh, shared=[share], keep_runner=True)
    assert second.chosen == first.chosen and second.source == "fleet" and not second.cached
    assert [e.prepared for _, e in fresh] == [int(n == share.engine) for n, _ in fresh]  # one prepare, no oracle
    assert any("as measured by a device of this kind" in n for n in second.notes)
    assert runner is not None and runner.run(bundle.calibration()[:2]).shape[0] == 2
    runner.close()
    # it is cached like a measured choice, but not passed on: only measurements are shared
    assert shared_choices(tmp_path / "second") == []
    again, _ = select(bundle, tmp_path / "second", engines())
    assert again.cached and again.chosen == share.engine and again.source == "fleet"


@pytest.mark.parametrize("tamper, why", [
    (dict(fingerprint="0" * 64), "outputs here differ"),
    (dict(latency_ms=1e-6, per_image_cpu_s=1e-12), "ms per batch here"),  # slower by the clock and the CPU
    (dict(engine="mxnet-onednn"), "not a candidate here"),
])
def test_a_choice_that_fails_its_recheck_is_measured_here(bundle, tmp_path, caplog, tamper, why):
    first, _ = select(bundle, tmp_path / "first", engines())
    (share,) = shared_choices(tmp_path / "first")
    bad = SharedChoice(**{**share.__dict__, **tamper})
    fresh = engines()
    with caplog.at_level("INFO", logger="edge_agent.int8.selection"):
        second, _ = select(bundle, tmp_path / "second", fresh, shared=[bad])
    assert second.source == "measured"
    assert sum(e.prepared for _, e in fresh) >= 2  # every engine measured again (the reference: oracle only)
    assert why in caplog.text
    # the job's report says why it paid for a full measurement
    assert any("not taken" in n and why in n and n.endswith("every engine measured") for n in second.notes), \
        second.notes
    (mine,) = shared_choices(tmp_path / "second")  # and this device's own measurement is what it reports
    assert mine.engine == second.chosen and mine.kind == share.kind and mine != bad


def test_a_recheck_slower_only_by_the_clock_is_a_busy_cpu_and_the_choice_is_taken(bundle, tmp_path):
    """Other processes holding the CPU inflate the re-check's wall time, not the CPU time the
    engine spends per image: the device of this kind takes the choice (a loaded CI machine
    measured the second device of a fleet in full for this)."""
    first, _ = select(bundle, tmp_path / "first", engines())
    (share,) = shared_choices(tmp_path / "first")
    slow_clock = SharedChoice(**{**share.__dict__, "latency_ms": 1e-6})  # its CPU time per image as measured
    fresh = engines()
    second, _ = select(bundle, tmp_path / "second", fresh, shared=[slow_clock])
    assert second.source == "fleet" and second.chosen == share.engine
    assert [e.prepared for _, e in fresh] == [int(n == share.engine) for n, _ in fresh]  # measured nothing else
    (row,) = second.candidates
    assert "busy CPU" in row.reason and "CPU-ms per image" in row.reason, row.reason


def test_a_choice_for_another_kind_is_ignored(bundle, tmp_path):
    first, _ = select(bundle, tmp_path / "first", engines())
    (share,) = shared_choices(tmp_path / "first")
    other = SharedChoice(**{**share.__dict__, "kind": "f" * 32})
    fresh = engines()
    second, _ = select(bundle, tmp_path / "second", fresh, shared=[other])
    assert second.source == "measured" and sum(e.prepared for _, e in fresh) >= 2
    assert any("none of the fleet's 1 int8 choice(s) was made on a device of this kind" in n for n in second.notes)


def test_a_damaged_cache_entry_is_not_shared(bundle, tmp_path):
    select(bundle, tmp_path, engines())
    (path,) = (tmp_path / CACHE_DIR).glob("*.json")
    obj = json.loads(path.read_text())
    obj["share"]["threads"] = "many"
    path.write_text(json.dumps(obj))
    assert shared_choices(tmp_path) == []
