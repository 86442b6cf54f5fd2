"""The depth planner (train/depth_plan.py): which depth a job trains, and why.

Pure arithmetic over a real multi-depth bundle's per-depth costs (the digits CNN with
create_bundle(depths=2): depth 0 the dense head, 1 conv3 + head, 2 conv2 + conv3 + head)
and a head-only twin; no training. The oracles are the planner's own per-depth
predictions: a cap or budget placed between two depths' predictions must pick the
shallower one and say which limit held the deeper one back.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from edge_agent.errors import EXIT_CONFIG, UsageError
from edge_agent.int8.bundle_create import create_bundle
from edge_agent.protocol.finetune import BadParams, parse_finetune
from edge_agent.sim import models
from edge_agent.train import depth_plan as DP

LABELS = [str(i) for i in range(10)]
# a job big enough that the depths' costs differ clearly: 5000 images, 20 epochs
JOB = dict(images=5000, train=4000, val=1000, epochs=20, batch_size=32, dense_head=True, base_rss_mb=100.0)


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory):
    net = models.initialize(models.digits_cnn(), seed=0, randomize_bn=True)
    calib = np.random.default_rng(0).uniform(0, 1, (32, 1, 8, 8)).astype(np.float32)
    root = tmp_path_factory.mktemp("plan-bundles")
    common = dict(calibration=calib, labels=LABELS, name="digits", version="1", input_shape=(1, 8, 8))
    return create_bundle(net, root / "deep", depths=2, **common), create_bundle(net, root / "flat", **common)


@pytest.fixture
def deep(bundles):
    return bundles[0]


def plan(bundle, request="auto", *, mem_cap_mb=None, budget_wh=None, watts=1.0, has_mxnet=True, rates=None,
         **kw):
    args = {**JOB, **kw}
    return DP.plan_depth(bundle, request=request, mem_cap_mb=mem_cap_mb, budget_wh=budget_wh, watts_per_cpu=watts,
                         rates=rates or dict(DP.DEFAULT_RATES), has_mxnet=has_mxnet, **args)


def test_unconstrained_auto_takes_the_deepest_and_costs_grow_with_depth(deep):
    assert [d.depth for d in deep.manifest.depths] == [0, 1, 2]
    p = plan(deep)
    assert p.depth == 2 and p.requested == "auto" and p.reason.startswith("deepest that fits")
    assert all(o.fits for o in p.options)
    wh = [o.predicted_wh for o in p.options]
    rss = [o.predicted_rss_mb for o in p.options]
    assert wh[0] < wh[1] < wh[2] and rss[0] < rss[1] < rss[2]  # the premise of the cap / budget tests
    assert [o.needs_mxnet for o in p.options] == [False, True, True]  # the dense head trains in numpy
    assert [o.tail_params for o in p.options] == [d.costs["tail_params"] for d in deep.manifest.depths]
    out = p.to_json()
    assert out["depth"] == 2 and out["predicted_wh"] == wh[2] and out["predicted_peak_rss_mb"] == rss[2]
    assert [o["depth"] for o in out["options"]] == [0, 1, 2]
    json.dumps(out)  # the report's "depth" is JSON


def _needs(rss: float) -> float:
    """The cap a predicted peak needs: the process now + what the job adds, with the margin."""
    return JOB["base_rss_mb"] + (rss - JOB["base_rss_mb"]) * DP.MEMORY_MARGIN


def test_a_small_memory_cap_forces_a_shallower_depth_and_the_reason_names_it(deep):
    rss = [o.predicted_rss_mb for o in plan(deep).options]
    between = (_needs(rss[1]) + _needs(rss[2])) / 2
    p = plan(deep, mem_cap_mb=between)
    assert p.depth == 1
    assert "depth 2" in p.reason and f"{between:g} MB training cap" in p.reason and "margin" in p.reason
    assert not p.options[2].fits and p.options[2].over_cap and "training cap" in p.options[2].why_not
    assert p.chosen is not None and p.chosen.predicted_rss_mb <= between  # never over the cap
    tiny = plan(deep, mem_cap_mb=(_needs(rss[0]) + _needs(rss[1])) / 2)
    assert tiny.depth == 0 and "training cap" in tiny.reason
    # the margin: a cap the prediction fits only without it is refused, one with it to spare taken
    short = plan(deep, mem_cap_mb=(rss[2] + _needs(rss[2])) / 2)
    assert short.depth < 2 and short.options[2].over_cap
    assert plan(deep, mem_cap_mb=_needs(rss[2]) + 0.1).depth == 2
    # the cached activations count: more images need more memory at the same depth
    assert plan(deep, images=50_000).options[2].predicted_rss_mb > rss[2]


def test_a_job_no_depth_of_which_fits_the_memory_cap_is_refused_naming_it(deep):
    """Running the head anyway would take the board past what training may use: refused before
    anything is prepared (ConfigError: the child exits EXIT_CONFIG, the agent fails the job)."""
    rss = [o.predicted_rss_mb for o in plan(deep).options]
    cap = (rss[0] + JOB["base_rss_mb"]) / 2
    with pytest.raises(DP.OverMemoryCap, match=rf"no depth fits: depth 0 needs ~{rss[0]:.0f} MB .*{cap:g} MB "
                                               r"training cap; nothing was run: raise \[training\] memory_cap_mb"):
        plan(deep, mem_cap_mb=cap)
    assert DP.OverMemoryCap("x").exit_code == EXIT_CONFIG
    # a depth asked for by number is held to the cap too, and the error names one that fits
    with pytest.raises(DP.OverMemoryCap, match=r"depth 2 needs .* training cap; nothing was run: depth 1 fits"):
        plan(deep, 2, mem_cap_mb=(_needs(rss[1]) + _needs(rss[2])) / 2)
    assert plan(deep, 1, mem_cap_mb=(_needs(rss[1]) + _needs(rss[2])) / 2).depth == 1
    # an energy budget nothing fits still trains the head: the governor stops it (a zero-step
    # job fails, exit EXIT_TEMPFAIL) and a later window may have the energy
    wh = plan(deep).options[0].predicted_wh
    assert plan(deep, budget_wh=wh / 2).depth == 0


def test_a_small_energy_budget_forces_a_shallower_depth_with_the_margin(deep):
    wh = [o.predicted_wh for o in plan(deep).options]
    p = plan(deep, budget_wh=(wh[1] + wh[2]) / 2 * DP.ENERGY_MARGIN)
    assert p.depth == 1 and "depth 2" in p.reason and "Wh budget" in p.reason
    # the margin: a budget the prediction fits only without it is refused ...
    assert plan(deep, budget_wh=wh[2] * (1 + (DP.ENERGY_MARGIN - 1) / 2)).depth == 1
    # ... and one with the margin to spare is taken
    assert plan(deep, budget_wh=wh[2] * DP.ENERGY_MARGIN * 1.01).depth == 2
    assert plan(deep, budget_wh=wh[0] * DP.ENERGY_MARGIN * 1.01).depth == 0
    # without a power model (watts unknown) the budget cannot rule a depth out
    assert plan(deep, budget_wh=1e-12, watts=None).depth == 2


def test_without_mxnet_only_the_dense_head_trains(deep):
    p = plan(deep, has_mxnet=False)
    assert p.depth == 0 and "MXNet" in p.reason
    assert [o.fits for o in p.options] == [True, False, False]
    with pytest.raises(UsageError, match="MXNet"):
        plan(deep, 1, has_mxnet=False)
    # a head that is not one dense layer needs MXNet too: nothing fits
    none = plan(deep, has_mxnet=False, dense_head=False)
    assert none.depth == 0 and none.reason.startswith("no depth fits") and all(o.needs_mxnet for o in none.options)


def test_a_tail_numpy_trains_is_not_charged_mxnet_and_trains_without_it(deep):
    mx = plan(deep)
    np_ = plan(deep, numpy_tail=lambda depth: True)
    assert [o.needs_mxnet for o in np_.options] == [False, False, False]
    rates = DP.DEFAULT_RATES
    for a, b in zip(mx.options[1:], np_.options[1:], strict=True):
        assert a.predicted_rss_mb - b.predicted_rss_mb == pytest.approx(rates["mxnet_mb"], abs=0.1)
        assert a.predicted_cpu_s > b.predicted_cpu_s  # no import, and numpy's own training rates
    # numpy's learnt rates price numpy's depths, MXNet's price MXNet's
    slow = dict(rates, numpy_s_per_fp32_mac=rates["numpy_s_per_fp32_mac"] * 10)
    assert plan(deep, numpy_tail=lambda d: True, rates=slow).options[2].predicted_cpu_s > np_.options[2].predicted_cpu_s
    assert plan(deep, rates=slow).options[2].predicted_cpu_s == mx.options[2].predicted_cpu_s
    assert DP.rate_key("s_per_fp32_mac", "numpy") == "numpy_s_per_fp32_mac"
    assert DP.rate_key("s_per_sample", "mxnet") == "s_per_sample"
    # a device without MXNet trains the depths numpy computes, and only those
    assert plan(deep, has_mxnet=False, numpy_tail=lambda d: True).depth == 2
    p = plan(deep, has_mxnet=False, numpy_tail=lambda d: d == 1)
    assert p.depth == 1 and [o.fits for o in p.options] == [True, True, False]
    assert plan(deep, 1, has_mxnet=False, numpy_tail=lambda d: d == 1).depth == 1


def test_explicit_depths(deep, bundles):
    _, flat = bundles
    assert plan(deep, "head").depth == 0 and plan(deep, 0).depth == 0
    p = plan(deep, 2, budget_wh=1e-9)  # asked for: taken, with the planner's objection in the reason ...
    assert p.depth == 2 and p.reason.startswith("asked for") and "Wh budget" in p.reason
    with pytest.raises(DP.OverMemoryCap, match="training cap"):  # ... unless it would go over the memory cap
        plan(deep, 2, mem_cap_mb=1.0)
    assert plan(deep, 1).reason == "asked for"
    with pytest.raises(UsageError, match=r"depths are 0\.\.2"):
        plan(deep, 3)
    with pytest.raises(UsageError, match="head only"):
        plan(flat, 2)
    for request in ("auto", "head", 0):
        p = plan(flat, request)
        assert p.depth == 0 and p.options == [] and "only the head" in p.reason and p.to_json()["predicted_wh"] is None


@pytest.mark.parametrize("value, expected", [("auto", "auto"), ("head", "head"), (0, 0), (8, 8), ("0", 0),
                                             ("2", 2), ("8", 8)])
def test_parse_depth_accepts(value, expected):
    assert DP.parse_depth(value) == expected


@pytest.mark.parametrize("value", [True, False, -1, 9, "9", "-1", "+1", " 1", "1 ", "", "deep", "Auto", "100",
                                   1.0, None, [2], "\u00b2", "\u0663"])
def test_parse_depth_refuses_with_a_usage_error(value):
    with pytest.raises(UsageError, match="depth"):
        DP.parse_depth(value)


def test_learn_rates_blends_and_a_corrupt_rates_file_falls_back_to_the_defaults(deep, tmp_path: Path):
    cache = tmp_path / "cache"
    assert DP.load_rates(None) == DP.DEFAULT_RATES and DP.load_rates(cache) == DP.DEFAULT_RATES  # absent
    rates = DP.load_rates(cache)
    measured = {"s_per_int8_mac": rates["s_per_int8_mac"] * 4, "mxnet_import_s": float("nan"),
                "s_per_sample": -1.0, "not_a_rate": 1.0, "epoch_fraction": 0.25, "mxnet_mb": 7}
    new = DP.learn_rates(cache, rates, measured)
    w = DP.LEARN_WEIGHT  # in log space: LEARN_WEIGHT of the way to the measurement
    assert new["s_per_int8_mac"] == pytest.approx(rates["s_per_int8_mac"] * 4 ** w)
    assert new["epoch_fraction"] == pytest.approx(0.25 ** w)
    for key in ("mxnet_import_s", "s_per_sample", "mxnet_mb"):  # NaN, negative, not a float: ignored
        assert new[key] == rates[key]
    assert "not_a_rate" not in new
    assert DP.load_rates(cache) == new  # persisted
    again = DP.learn_rates(cache, new, {"s_per_int8_mac": new["s_per_int8_mac"]})
    assert again["s_per_int8_mac"] == pytest.approx(new["s_per_int8_mac"])  # a rate that holds stays
    # learnt rates change the plan: slower int8 predicts more, stopping early fewer epochs
    slower = plan(deep, rates={**DP.DEFAULT_RATES, "s_per_int8_mac": again["s_per_int8_mac"]})
    early = plan(deep, rates={**DP.DEFAULT_RATES, "epoch_fraction": again["epoch_fraction"]})
    base = plan(deep)
    assert slower.options[0].predicted_cpu_s > base.options[0].predicted_cpu_s
    assert early.options[2].predicted_cpu_s < base.options[2].predicted_cpu_s

    path = cache / DP.RATES_FILE
    for junk in (b"\x00garbage{", b"[1, 2]", json.dumps({"s_per_int8_mac": "fast", "s_per_sample": -3,
                                                         "mxnet_import_s": True, "mxnet_mb": 1e9}).encode(),
                 b"{" * 100_000):
        path.write_bytes(junk)
        assert DP.load_rates(cache) == DP.DEFAULT_RATES
    path.write_bytes(json.dumps({"s_per_sample": 1e-3, "mxnet_mb": "x"}).encode())  # the good keys are kept
    assert DP.load_rates(cache) == {**DP.DEFAULT_RATES, "s_per_sample": 1e-3}
    path.write_bytes(b"\x00garbage{")
    healed = DP.learn_rates(cache, DP.load_rates(cache), {"s_per_sample": 2e-3})  # a new job rewrites it
    assert DP.load_rates(cache) == healed and healed["s_per_sample"] == pytest.approx(3e-4 ** (1 - DP.LEARN_WEIGHT) * 2e-3 ** DP.LEARN_WEIGHT)


def test_early_stopping_is_learnt_per_depth_and_an_unseen_depth_uses_the_last_job(deep, tmp_path: Path):
    cache = tmp_path / "cache"
    # a job at depth 2 stopped after a quarter of its epochs, then one at depth 1 ran them all
    rates = DP.learn_rates(cache, DP.load_rates(cache), {"epoch_fraction": 0.25, DP.fraction_key(2): 0.25})
    rates = DP.learn_rates(cache, rates, {"epoch_fraction": 1.0, DP.fraction_key(1): 1.0})
    assert DP.load_rates(cache) == rates  # the per-depth keys are persisted and read back
    assert DP.epoch_fraction(rates, 2) == pytest.approx(0.25 ** DP.LEARN_WEIGHT)  # from the default 1.0
    w = DP.LEARN_WEIGHT  # depth 1's first job blends in from the fleet-wide share it found (0.25 ** w)
    assert DP.epoch_fraction(rates, 1) == pytest.approx(0.25 ** (w * (1 - w)))
    assert DP.epoch_fraction(rates, 0) == rates["epoch_fraction"]  # never ran: the last job's share
    learnt = plan(deep, rates=rates)
    assert learnt.options[2].predicted_cpu_s < learnt.options[1].predicted_cpu_s  # depth 2 stops much earlier
    assert DP.epoch_fraction(rates, 2) < DP.epoch_fraction(rates, 0) == DP.epoch_fraction(rates, 1)
    (cache / DP.RATES_FILE).write_text(json.dumps({DP.fraction_key(2): -1, DP.fraction_key(9): 0.5}))
    assert DP.load_rates(cache) == DP.DEFAULT_RATES  # a bad value and a depth outside 0..8 are dropped


def test_an_uncached_engine_choice_adds_the_selection_to_the_prediction(deep):
    cached = plan(deep, selection_cached=lambda depth: True)
    unknown = plan(deep)  # no way to tell: counted as cached
    only_deep = plan(deep, selection_cached=lambda depth: depth == 0)
    for k in range(3):
        assert cached.options[k].predicted_cpu_s == unknown.options[k].predicted_cpu_s
        extra = only_deep.options[k].predicted_cpu_s - cached.options[k].predicted_cpu_s
        assert extra == 0.0 if k == 0 else extra > 0.5  # choosing an engine costs seconds, not noise
    # the selection's cost can decide the depth: a budget depth 2 fits only with a cached choice
    wh = cached.options[2].predicted_wh * DP.ENERGY_MARGIN * 1.01
    assert plan(deep, budget_wh=wh, selection_cached=lambda depth: True).depth == 2
    assert plan(deep, budget_wh=wh, selection_cached=lambda depth: depth < 2).depth == 1


@pytest.mark.parametrize("params, expected", [({"depth": "auto"}, "auto"), ({"depth": "head"}, "head"),
                                              ({"depth": 0}, 0), ({"depth": 8}, 8)])
def test_the_agent_accepts_depth_bn_and_tail_job_parameters(tmp_path, params, expected):
    body = {"cmd_id": "c", "action": "finetune", "job": "j", "round": 2, "model": "digits", "version": "3",
            "params": {**params, "bn": "update", "tail": "bias"}}
    req = parse_finetune(body, now=1_800_000_000.0)
    assert req.train["depth"] == expected and req.train["bn"] == "update" and req.train["tail"] == "bias"


@pytest.mark.parametrize("params", [{"depth": 9}, {"depth": -1}, {"depth": True}, {"depth": "deep"},
                                    {"depth": 2.0}, {"bn": "frozen "}, {"bn": 1}, {"tail": "head"}])
def test_the_agent_refuses_bad_depth_bn_and_tail(tmp_path, params):
    body = {"cmd_id": "c", "action": "finetune", "job": "j", "round": 2, "model": "digits", "version": "3",
            "params": params}
    with pytest.raises(BadParams, match=next(iter(params))):
        parse_finetune(body, now=1_800_000_000.0)


def test_a_device_far_from_the_bundles_images_trains_as_deep_as_fits(deep, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(DP, "AUTO_MAX_DEPTH", 1)  # this bundle's deepest is 2: put the usual limit below it
    near = plan(deep)
    assert near.depth == 1 and "auto stops at depth 1" in near.reason
    far = plan(deep, shifted=True)
    assert far.depth == 2 and "far from the bundle's" in far.reason
    rss = [o.predicted_rss_mb for o in far.options]
    capped = plan(deep, shifted=True, mem_cap_mb=(_needs(rss[1]) + _needs(rss[2])) / 2)  # the cap still holds
    assert capped.depth == 1 and "training cap" in capped.reason
    assert plan(deep, request=1, shifted=True).depth == 1  # an explicit depth is what is asked


def test_what_the_job_spent_before_planning_is_in_every_depths_cost_and_a_cached_walk_is_not(deep):
    base = plan(deep)
    spent = plan(deep, spent_cpu_s=0.5)  # measuring the device's shift, before the plan
    assert [round(o.predicted_cpu_s - b.predicted_cpu_s, 3) for o, b in zip(spent.options, base.options, strict=True)] == [0.5] * 3
    walks = plan(deep, adapt_images=64)
    only_deepest = plan(deep, adapt_images=lambda depth: 64 if depth == 2 else 0)  # the others' verdicts are known
    assert [o.predicted_cpu_s for o in only_deepest.options[:2]] == [o.predicted_cpu_s for o in base.options[:2]]
    assert only_deepest.options[2].predicted_cpu_s == walks.options[2].predicted_cpu_s > base.options[2].predicted_cpu_s
