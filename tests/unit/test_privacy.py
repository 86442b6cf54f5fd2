"""User-level DP (DP-FedAvg: coordinator/privacy.py, strategies/dp.py, updates/clip.py):
the accountant's epsilon against independent computations, clipping on the device and at the
coordinator, the noise's scale, the budget stop, and a private job through the real engine
and registry (real non-IID digits deltas, real payloads)."""

# ruff: noqa: F811 - `fleet` and `h` are test_coordinator_rounds' fixtures, imported to be shared
from __future__ import annotations

import math

import numpy as np
import pytest

from edge_agent.coordinator.privacy import (
    ORDERS,
    DpParams,
    PrivacyLedger,
    csprng_noise,
    epsilon,
    predict,
    rounds_within,
)
from edge_agent.coordinator.records import JobStatus, RoundState, UpdateStatus
from edge_agent.coordinator.strategies import (
    Contribution,
    GaussianSum,
    RoundEvidence,
    StrategyOptions,
    make_strategy,
)
from edge_agent.coordinator.streaming import Layout, sparse_from_dense
from edge_agent.errors import InputError
from edge_agent.protocol.finetune import BadParams, parse_finetune
from edge_agent.updates import CompressionPolicy, UpdateEncoder, decode_update
from edge_agent.updates.clip import clip_for_privacy
from tests.unit.test_coordinator_rounds import (  # noqa: F401
    N_DEV,
    Harness,
    fleet,
    h,
    softmax_head,
)


# ---------------------------------------------------------------- the accountant
def _phi(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2))


@pytest.mark.parametrize(("sigma", "rounds", "delta"), [(1.0, 1, 1e-5), (2.0, 10, 1e-5), (5.0, 100, 1e-6)])
def test_epsilon_of_the_plain_gaussian_is_its_closed_form(sigma, rounds, delta):
    """q = 1: the Gaussian mechanism's RDP is alpha / (2 sigma^2) exactly; T rounds add up;
    converted with the RDP -> (eps, delta) bound of Canonne-Kamath-Steinke 2020 (Prop. 12),
    over the same orders. And the exact (eps, delta) curve of the composed Gaussian (Balle &
    Wang 2018: T rounds are one Gaussian with mu = sqrt(T) / sigma) must confirm it: at the
    accountant's epsilon the exact delta is at most the stated one."""
    got = epsilon([(sigma, [1.0] * rounds)], delta)
    want = min(max(0.0, rounds * a / (2 * sigma**2) + math.log1p(-1 / a) - math.log(delta * a) / (a - 1))
               for a in ORDERS)
    assert got == pytest.approx(want, rel=1e-9)
    mu = math.sqrt(rounds) / sigma
    exact_delta = _phi(-got / mu + mu / 2) - math.exp(got) * _phi(-got / mu - mu / 2)
    assert exact_delta <= delta
    assert exact_delta > delta / 100  # and the bound is not slack by orders of magnitude


@pytest.mark.parametrize(("q", "sigma", "rounds"), [(0.1, 1.0, 100), (0.01, 1.1, 1000), (0.1, 1.5, 50)])
def test_subsampled_epsilon_is_bounded_by_the_pld_accountant(q, sigma, rounds):
    """Poisson-subsampled Gaussian: the privacy-loss-distribution accountant (a second,
    tighter method of the same library) must give at most the RDP epsilon, and not far less."""
    import dp_accounting as dpa
    from dp_accounting import pld

    acc = pld.PLDAccountant(value_discretization_interval=1e-3)
    acc.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), rounds)
    tight = acc.get_epsilon(1e-5)
    got = epsilon([(sigma, [q] * rounds)], 1e-5)
    assert tight <= got <= 1.25 * tight


def test_rounds_at_different_rates_compose_and_the_budget_counts_rounds():
    dp = DpParams(clip=1.0, noise=1.0, delta=1e-5, epsilon=5.0)
    mixed = epsilon([(1.0, [0.1] * 30 + [0.2] * 10)], 1e-5)
    assert epsilon([(1.0, [0.1] * 30)], 1e-5) < mixed < epsilon([(1.0, [0.2] * 40)], 1e-5)
    n = rounds_within(dp, 0.1, 1000)
    assert predict(dp, 0.1, n) <= 5.0 < predict(dp, 0.1, n + 1)


@pytest.mark.parametrize(("params", "why"), [
    ({"dp_clip": 1.0}, "needs both"), ({"dp_noise": 1.0}, "needs both"),
    ({"dp_clip": 0, "dp_noise": 1.0}, "dp_clip"), ({"dp_clip": -1.0, "dp_noise": 1.0}, "dp_clip"),
    ({"dp_clip": 1.0, "dp_noise": "x"}, "dp_noise"), ({"dp_clip": 1.0, "dp_noise": True}, "dp_noise"),
    ({"dp_clip": 1.0, "dp_noise": 1.0, "dp_delta": 0.5}, "dp_delta"),
    ({"dp_clip": 1.0, "dp_noise": 1.0, "dp_epsilon": float("inf")}, "dp_epsilon")])
def test_bad_dp_params_are_refused_naming_the_param(params, why):
    with pytest.raises(InputError, match=why):
        DpParams.of(params)


def test_a_job_without_dp_params_is_not_private_and_defaults_apply():
    assert DpParams.of({"aggregator": "fedavg"}) is None
    assert DpParams.of({"dp_clip": 2, "dp_noise": 1}) == DpParams(2.0, 1.0, 1e-5, None)


# ---------------------------------------------------------------- clipping and noise
def test_the_device_clips_what_it_sends_delta_plus_residual():
    rng = np.random.default_rng(0)
    delta = {"w": rng.normal(size=(20, 8)).astype(np.float32), "b": rng.normal(size=8).astype(np.float32)}
    residual = {"w": rng.normal(size=(20, 8)).astype(np.float32) * 0.5, "b": np.zeros(8, np.float32)}
    out, before = clip_for_privacy(delta, 1.5, residual)
    sent = {k: out[k] + residual[k] for k in out}
    assert before > 1.5
    assert math.sqrt(sum(float(np.sum(v.astype(np.float64) ** 2)) for v in sent.values())) == pytest.approx(1.5, rel=1e-5)
    short, norm = clip_for_privacy({k: v * 1e-3 for k, v in delta.items()}, 1.5)
    assert norm < 1.5 and np.allclose(short["w"], delta["w"] * 1e-3)
    # through the real encoder (top-k + int8 + error feedback): what travels is at most C (+ int8 rounding)
    enc = UpdateEncoder(model_name="m", device_id="d", policy=CompressionPolicy(), store=None, chunk_size=4096)
    for r in range(3):
        raw = {k: (v * (r + 1)).astype(np.float32) for k, v in delta.items()}
        update = enc.encode(clip_for_privacy(raw, 1.5, enc.residual)[0], job_id="j", round=r + 1, model_version="1")
        enc.commit(update)
        dec = decode_update(update.payload).deltas
        assert math.sqrt(sum(float(np.sum(np.square(t.astype(np.float64)))) for t in dec.values())) <= 1.5 * 1.05


def test_finetune_carries_dp_clip_to_the_device_and_bounds_it():
    body = {"job": "j", "round": 1, "model": "m", "version": "1"}
    assert parse_finetune({**body, "params": {"dp_clip": 0.5}}, now=0).train["dp_clip"] == 0.5
    with pytest.raises(BadParams, match="dp_clip"):
        parse_finetune({**body, "params": {"dp_clip": -1}}, now=0)
    with pytest.raises(BadParams, match="dp_clip"):
        parse_finetune({**body, "params": {"dp_clip": "big"}}, now=0)


def _rule(clip, noise, denominator, rng, size=200):
    layout = Layout({"x": np.zeros(size, np.float32)})
    options = StrategyOptions(dp=GaussianSum(clip, noise, denominator, rng))
    return layout, make_strategy("dp_fedavg", options, RoundEvidence(layout))


def test_the_coordinator_clips_each_update_and_says_so_beyond_the_tolerance():
    zero = lambda: np.random.default_rng(0)  # noqa: E731
    layout, rule = _rule(1.0, 1e-9, 3.0, zero, size=4)
    ups = {"ok": [0.3, 0.0, 0.4, 0.0], "quantised": [0.0, 1.03, 0.0, 0.0], "long": [0.0, 0.0, 0.0, 10.0]}
    partial = rule.start()
    for d, v in ups.items():
        rule.accumulate(partial, Contribution(d, sparse_from_dense({"x": np.asarray(v, np.float32)}, layout), 5.0))
    agg = rule.finalize(partial, lambda d: None)
    np.testing.assert_allclose(agg.vec, np.array([0.3, 1.0, 0.4, 1.0]) / 3.0, atol=1e-6)
    assert set(agg.notes) == {"long"} and "clipped at the coordinator" in agg.notes["long"]
    assert agg.info["dp_clipped"] == 2 and agg.info["dp_clipped_at_coordinator"] == 1


def test_the_noise_has_std_sigma_c_over_the_denominator():
    """Many closes of one round's updates with the production (CSPRNG-seeded) noise: the
    aggregate's deviation from the clipped mean has std sigma C / D per coordinate, and is
    fresh each close."""
    layout, rule = _rule(0.5, 1.2, 8.0, csprng_noise, size=500)
    vec = np.linspace(-1, 1, 500).astype(np.float32)
    noises = []
    for _ in range(40):
        partial = rule.start()
        rule.accumulate(partial, Contribution("d", sparse_from_dense({"x": vec}, layout), 1.0))
        clipped = vec.astype(np.float64) * min(1.0, 0.5 / np.linalg.norm(vec.astype(np.float64)))
        noises.append(rule.finalize(partial, lambda d: None).vec - clipped / 8.0)
    noise = np.stack(noises)
    assert noise.std() == pytest.approx(1.2 * 0.5 / 8.0, rel=0.03)
    assert abs(noise.mean()) < 0.01 * 1.2 * 0.5 / 8.0 * 10
    assert not np.allclose(noise[0], noise[1])
    assert GaussianSum(0.5, 1.2, 8.0, csprng_noise).device_std(16) * 4 == pytest.approx(1.2 * 0.5)


# ---------------------------------------------------------------- through the engine
DP = {"dp_clip": 0.05, "dp_noise": 1.0, "devices_per_round": 3}


def _seeded(h: Harness, seed: int = 5) -> None:
    h.engine.aggregation.noise = lambda: np.random.default_rng(seed)


def _round(h: Harness, plan) -> tuple[object, list]:
    """Every selected device sends; the tick closes the round (and opens the next)."""
    h.engine.record_dispatches(plan.job_id, plan.round, dict.fromkeys(plan.devices))
    for did in plan.devices:
        assert h.send(h.fleet["ids"].index(did), plan) == "accepted"
    result = h.engine.tick()
    (out,) = result.closed
    return out, result.opened


def test_a_private_job_publishes_the_noised_clipped_mean_and_its_epsilon(h):
    h.setup(softmax_head())
    _seeded(h)
    job = h.engine.start_job(model_name="digits", model_version="1", rounds=2, min_devices=1, params=DP)
    assert h.reg.get_job(job.id).params["aggregator"] == "dp_fedavg"
    (plan,) = h.engine.tick().opened
    out, opened = _round(h, plan)
    assert out.state is RoundState.AGGREGATED
    ups = h.reg.list_updates(job.id, 1)
    assert all(u.status is UpdateStatus.ACCEPTED for u in ups)
    # the devices of this harness do not clip: the coordinator did, and each verdict says so
    assert all("clipped at the coordinator" in u.reason for u in ups)
    base = h.reg.load_head(h.reg.get_model("digits", "1"))
    layout = Layout(base)
    total = np.zeros(layout.size)
    for u in ups:
        d = h.reg.load_delta(u)
        vec = np.concatenate([np.asarray(d[k], np.float64).ravel() for k in layout.names])
        total += vec * min(1.0, 0.05 / np.linalg.norm(vec))
    noise = np.random.default_rng(5).normal(0.0, 0.05, layout.size)
    new = h.reg.load_head(out.new_version)
    got = np.concatenate([(new[k].astype(np.float64) - base[k]).ravel() for k in layout.names])
    np.testing.assert_allclose(got, (total + noise) / 3.0, atol=2e-6)
    m = out.new_version.metrics
    q = 3 / N_DEV
    assert m["dp_q"] == q and m["dp_rounds"] == 1 and m["dp_clip"] == 0.05 and m["dp_noise"] == 1.0
    assert m["dp_epsilon"] == pytest.approx(epsilon([(1.0, [q])], 1e-5), rel=1e-6)
    assert m["dp_lineage_epsilon"] == pytest.approx(m["dp_epsilon"], rel=1e-6)
    (plan,) = opened
    out2, _ = _round(h, plan)
    assert out2.new_version.metrics["dp_epsilon"] == pytest.approx(epsilon([(1.0, [q, q])], 1e-5), rel=1e-6)
    assert PrivacyLedger(h.reg.state_dir).rates(job.id) == [q, q]
    # a second private job on the lineage composes with the first
    job2 = h.engine.start_job(model_name="digits", model_version=out2.new_version.version, rounds=1, min_devices=1,
                              params={**DP, "dp_noise": 2.0})
    (plan,) = [p for p in h.engine.tick().opened if p.job_id == job2.id]
    out3, _ = _round(h, plan)
    want = epsilon([(1.0, [q, q]), (2.0, [q])], 1e-5)
    assert out3.new_version.metrics["dp_lineage_epsilon"] == pytest.approx(want, rel=1e-6)
    assert out3.new_version.metrics["dp_epsilon"] == pytest.approx(epsilon([(2.0, [q])], 1e-5), rel=1e-6)


def test_a_private_job_stops_done_when_its_budget_is_spent(h):
    h.setup(softmax_head())
    dp = DpParams(0.05, 2.0, 1e-5, 3.0)
    fits = rounds_within(dp, 0.5, 50)
    assert 2 <= fits < 10
    job = h.engine.start_job(model_name="digits", model_version="1", rounds=50, min_devices=1,
                             params={**DP, "dp_noise": 2.0, "dp_epsilon": 3.0})
    plans = h.engine.tick().opened
    published = 0
    while plans:
        out, plans = _round(h, plans[0])
        published += out.new_version is not None
        plans = plans or h.engine.tick().opened
    final = h.reg.get_job(job.id)
    assert final.status is JobStatus.DONE
    assert "privacy budget spent" in final.reason and "3" in final.reason
    assert published == fits == len(h.reg.list_rounds(job.id))
    assert PrivacyLedger(h.reg.state_dir).rates(job.id) == [0.5] * fits


def test_start_job_refuses_what_a_private_job_cannot_be(h):
    h.setup(softmax_head())
    start = lambda **p: h.engine.start_job(model_name="digits", model_version="1", rounds=5,  # noqa: E731
                                           params={**DP, **p})
    with pytest.raises(InputError, match="first round alone"):
        start(dp_noise=0.3, dp_epsilon=0.5)
    with pytest.raises(InputError, match="dp_fedavg"):
        start(aggregator="trimmed_mean")
    with pytest.raises(InputError, match="needs a private job"):
        start(aggregator="dp_fedavg", dp_clip=None, dp_noise=None)
    with pytest.raises(InputError, match="asynchronous"):
        start(mode="async", buffer=2, max_staleness=2)
    with pytest.raises(InputError, match="needs both"):
        start(dp_noise=None)


def test_status_and_the_dashboard_show_epsilon_per_version_and_for_the_job(h):
    from edge_agent.coordinator import fleet_views
    from edge_agent.dashboard import views

    h.setup(softmax_head())
    job = h.engine.start_job(model_name="digits", model_version="1", rounds=2, min_devices=1,
                             params={**DP, "dp_epsilon": 50.0})
    (plan,) = h.engine.tick().opened
    out, opened = _round(h, plan)
    _round(h, opened[0])
    q = 3 / N_DEV
    one, two = epsilon([(1.0, [q])], 1e-5), epsilon([(1.0, [q, q])], 1e-5)
    text = fleet_views.job_detail(h.reg, job.id)
    assert f"epsilon {two:.3g} of its budget 50 at delta 1e-05 over 2 round(s)" in text
    assert f"-> {job.id}-r1 (epsilon {one:.3g})" in text and f"-> {job.id}-r2 (epsilon {two:.3g})" in text
    assert f"lineage: epsilon {two:.3g}" in text
    assert fleet_views.job_json(h.reg, job.id)["privacy"]["epsilon"] == pytest.approx(two)
    (entry,) = views.rounds(h.reg)["jobs"]
    assert [r["dp_epsilon"] for r in entry["rounds"]] == pytest.approx([one, two], rel=1e-5)
    assert entry["privacy"]["budget"] == 50.0


# ---------------------------------------------------------------- the CLI
def test_train_queues_a_private_job_and_predicts_its_epsilon(capsys, tmp_path):
    from edge_agent.config import public_key_text
    from edge_agent.coordinator.cli import main
    from edge_agent.coordinator.registry import Registry
    from edge_agent.errors import EXIT_USAGE
    from edge_agent.keys import fingerprint, generate_private_key

    state = tmp_path / "coord"
    with Registry(state_dir=state) as reg:
        reg.add_model_version(name="digits", version="1", head={"w": np.zeros((2, 3), np.float32)})
        for _ in range(10):
            key = generate_private_key()
            reg.enrol_device(device_id=fingerprint(key), public_key=public_key_text(key), fleet="farm", approved=True)
            reg.record_state(fingerprint(key), online=True, state={"battery_pct": 90, "status": "idle"})
    sd = ("--state-dir", str(state))

    def run(*argv):
        code = main(["train", "--model", "digits", "--detach", *argv, *sd])
        got = capsys.readouterr()
        return code, got.out, got.err

    rc, out, err = run("--rounds", "20", "--devices-per-round", "2", "--dp-clip", "0.5", "--dp-noise", "1.1",
                       "--dp-epsilon", "4")
    assert rc == 0, err
    dp = DpParams(0.5, 1.1, 1e-5, 4.0)
    assert f"epsilon after 20 round(s) is {predict(dp, 0.2, 20):.3g} at delta 1e-05" in out
    assert f"stops after about {rounds_within(dp, 0.2, 20)} round(s)" in out and "aggregator: dp_fedavg" in out
    with Registry(state_dir=state) as reg:
        (job,) = reg.list_jobs()
    assert job.params | {} == {"devices_per_round": 2, "dp_clip": 0.5, "dp_noise": 1.1, "dp_epsilon": 4.0,
                               "aggregator": "dp_fedavg"}
    rc, out, _ = run("--dp-clip", "1", "--dp-noise", "2")
    assert rc == 0 and "no amplification by sampling" in out
    rc, _, err = run("--dp-clip", "1")
    assert rc == EXIT_USAGE and "--dp-clip and --dp-noise" in err
    rc, _, err = run("--dp-clip", "1", "--dp-noise", "0.5", "--dp-epsilon", "0.1")
    assert rc == 65 and "spent by the first round alone" in err
    rc, _, err = run("--dp-clip", "1", "--dp-noise", "1", "--aggregator", "trimmed_mean")
    assert rc == 65 and "aggregates with dp_fedavg" in err
    with pytest.raises(SystemExit) as exit_:
        run("--dp-clip", "-1", "--dp-noise", "1")
    assert exit_.value.code == EXIT_USAGE and "--dp-clip: must be within" in capsys.readouterr().err
    with Registry(state_dir=state) as reg:
        assert len(reg.list_jobs()) == 2
    assert main(["status", job.id, *sd]) == 0
    assert "private (DP-FedAvg, clip 0.5, noise x1.1): epsilon 0 of its budget 4" in capsys.readouterr().out


def test_the_private_fleet_simulation_gives_the_same_result_twice() -> None:
    """bench_privacy's fleet drew fresh device keys and a fresh job id each run, and the
    coordinator orders devices by their key's id and seeds its sampling with the job's: two
    runs of one configuration sampled other devices."""
    from edge_agent.sim.privacy import digits_cameras, simulate_private

    data = digits_cameras(12, per_device=16)
    dp = {"dp_clip": 1.0, "dp_noise": 1.0, "dp_delta": 1e-5, "dp_epsilon": 8.0}
    runs = [simulate_private(data, rounds=3, per_round=4, params=dp, hidden=8, seed=1) for _ in range(2)]
    assert runs[0].rounds == 3 and runs[0].accuracy == runs[1].accuracy and runs[0].epsilon == runs[1].epsilon
