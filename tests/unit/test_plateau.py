"""Training that knows when to stop (issue 20): the global accuracy from the devices'
reports, the plateau rule (stop restoring the best version, or decay the server lr), a
short federated job through the real RoundEngine that stops at its plateau, the job report
and `models rollback`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.bench_plateau import PlateauSim, simulate
from edge_agent.coordinator.cli import main
from edge_agent.coordinator.plateau import (
    PlateauRule,
    global_accuracy,
    job_learning,
    learn,
    observe,
    rollback,
)
from edge_agent.coordinator.records import JobStatus
from edge_agent.coordinator.registry import Registry
from edge_agent.coordinator.server_opt import LearningStore
from edge_agent.errors import InputError


def test_global_accuracy_is_sample_weighted_and_ignores_bad_reports() -> None:
    reports = [({"accuracy_before": 0.9}, 300), ({"accuracy_before": 0.6}, 100), ({}, 500),
               ({"accuracy_before": 1.7}, 100), ({"accuracy_before": float("nan")}, 100), ({"accuracy_before": True}, 9)]
    acc, n = global_accuracy(reports)
    assert n == 400 and acc == pytest.approx(0.825)
    assert global_accuracy([({}, 10)]) == (None, 0)  # older agents: nothing measured


def _feed(rule: PlateauRule, accs: list[float]) -> tuple[dict, list[str]]:
    info: dict = {}
    decisions = []
    for i, a in enumerate(accs):
        info, d = observe(rule, info, f"v{i}", a, 100, i + 1)
        decisions.append(d)
    return info, decisions


def test_patience_counts_versions_without_a_gain_over_min_delta() -> None:
    rule = PlateauRule(patience=3, min_delta=0.01, smoothing=1.0)
    info, decisions = _feed(rule, [0.5, 0.7, 0.8, 0.805, 0.809, 0.79])
    assert decisions == ["continue"] * 5 + ["stop"]  # 0.805 and 0.809 are not gains of > 1 point
    assert info["best"] == {"version": "v4", "accuracy": 0.809, "round": 5}  # the best is still the best
    _, later = _feed(rule, [0.5, 0.7, 0.8, 0.805, 0.83, 0.8, 0.8])
    assert "stop" not in later  # 0.83 reset the count
    assert "stop" not in _feed(PlateauRule(patience=None, smoothing=1.0), [0.9] + [0.5] * 50)[1]  # off: never


def test_decay_scales_the_server_lr_then_stops() -> None:
    rule = PlateauRule(patience=2, min_delta=0.0, on_plateau="decay", decay=0.5, max_decays=2, smoothing=1.0)
    info, decisions = _feed(rule, [0.8] + [0.7] * 6)
    assert decisions == ["continue", "continue", "decay", "continue", "decay", "continue", "stop"]
    assert info["lr_scale"] == 0.25 and info["decays"] == 2


def test_smoothing_keeps_one_lucky_round_from_becoming_the_best() -> None:
    rule = PlateauRule(patience=4, smoothing=0.3)
    info, _ = _feed(rule, [0.80, 0.81, 1.00, 0.80, 0.81, 0.82, 0.82, 0.82])
    assert info["best"]["accuracy"] < 0.9  # a sampled round of easy devices said 100 %
    assert info["history"][2][2] == 1.0 and info["history"][2][4] < 0.9  # raw and smoothed both kept


@pytest.mark.parametrize(("params", "words"), [
    ({"plateau_patience": 0}, "plateau_patience must be an integer"),
    ({"plateau_patience": 2.5}, "plateau_patience must be an integer"),
    ({"on_plateau": "halt"}, "on_plateau must be one of stop, decay"),
    ({"plateau_min_delta": -0.1}, "plateau_min_delta"),
    ({"plateau_smoothing": 0}, "plateau_smoothing"),
])
def test_bad_plateau_options_are_refused_with_their_name(params: dict, words: str) -> None:
    with pytest.raises(InputError, match=words):
        PlateauRule.from_params(params)


def test_learn_stops_restoring_the_best_and_a_reclose_is_the_same(tmp_path: Path) -> None:
    store = LearningStore(tmp_path)
    params = {"plateau_patience": 1, "plateau_smoothing": 1.0, "server_opt": "fedavgm"}
    delta = {"w": np.ones(3, np.float32)}
    first = learn(store, "job-x", params, 1, "1", delta, [({"accuracy_before": 0.5}, 10)])
    second = learn(store, "job-x", params, 2, "job-x-r1", delta, [({"accuracy_before": 0.9}, 10)])
    assert (first.stop, second.stop) == ("", "") and np.allclose(second.step["w"], 1.9)  # momentum
    third = learn(store, "job-x", params, 3, "job-x-r2", delta, [({"accuracy_before": 0.6}, 10)])
    assert third.restore == "job-x-r1" and "plateau" in third.stop and "job-x-r1 (90.00 %" in third.stop
    again = learn(store, "job-x", params, 3, "job-x-r2", delta, [({"accuracy_before": 0.6}, 10)])
    # round 3 re-closed after a crash: same step, same decision (its own state is not applied twice)
    assert (again.stop, again.restore, again.metrics) == (third.stop, third.restore, third.metrics)
    assert np.array_equal(again.step["w"], third.step["w"])
    report = job_learning(tmp_path, "job-x")
    assert report is not None and report["best"]["version"] == "job-x-r1" and len(report["history"]) == 3


def test_a_federated_job_stops_at_its_plateau_with_the_best_version_published(tmp_path: Path, capsys) -> None:
    sim = PlateauSim(rounds=80, n_devices=4, per_round=4, params={
        "server_opt": "fedavgm", "server_lr": 0.5, "server_momentum": 0.5, "plateau_patience": 3,
        "plateau_min_delta": 0.002, "plateau_smoothing": 0.5})
    result = simulate(sim, tmp_path)
    assert result.status == "done" and result.reason.startswith("plateau:"), result.reason
    assert result.rounds_run < sim.rounds
    with Registry(state_dir=tmp_path) as reg:
        (job,) = reg.list_jobs()
        assert job.status is JobStatus.DONE
        versions = reg.list_models("digits")
        last = versions[-1]
        best = job_learning(tmp_path, job.id)["best"]["version"]
        assert last.metrics["restored"] == best != last.version
        head_last, head_best = reg.load_head(last), reg.load_head(reg.get_model("digits", best))
        assert all(np.array_equal(head_last[k], head_best[k]) for k in head_best)
        assert last.metrics["server_opt"] == "fedavgm"
        # by hand: roll back to an earlier version, then to the best again
        early = versions[3].version
        mv = rollback(reg, "digits", early)
        assert (mv.version, mv.parent, reg.list_models("digits")[-1].version) == (f"{early}-rb1", early, mv.version)
        with pytest.raises(InputError, match="already the current"):
            rollback(reg, "digits", mv.version)
    assert main(["status", job.id, "--state-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"best version {best}: " in out and "models rollback digits --to-best" in out  # rb1 is newest now
    assert main(["models", "rollback", "digits", "--to-best", job.id, "--state-dir", str(tmp_path)]) == 0
    assert f"digits {best}-rb1 (the head of {best}) is now the current version" in capsys.readouterr().out
    assert main(["models", "rollback", "digits", "--state-dir", str(tmp_path)]) != 0  # neither VERSION nor --to-best


def test_train_refuses_plateau_options_without_patience_and_bad_values(tmp_path: Path, capsys) -> None:
    base = ["train", "--model", "digits", "--state-dir", str(tmp_path)]
    assert main([*base, "--on-plateau", "decay"]) == 64
    assert "--on-plateau and --min-delta need --patience N" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: out of range
        main([*base, "--patience", "0"])
    from edge_agent.coordinator.rounds import RoundEngine

    with Registry(state_dir=tmp_path) as reg, pytest.raises(InputError, match="server_opt must be one of"):
        RoundEngine(registry=reg).start_job(model_name="digits", model_version="1", params={"server_opt": "sgd"})


def test_with_a_server_set_the_plateau_rule_judges_each_version_on_it_and_publishes_the_best() -> None:
    """Each version is scored on the server set when the gate passes it, the plateau rule
    decides on those scores (no lag, no smoothing), and a job that stops publishes the best
    version's head: its server-set score is the best of the job's."""
    from edge_agent.sim.poisoning import digits_fleet, simulate

    patience = 2
    run = simulate(digits_fleet(3, seed=4), rounds=40, server_set=True, seed=4,
                   params={"plateau_patience": patience, "plateau_min_delta": 0.01})
    assert run.status == "done" and run.reason.startswith("plateau: server-set accuracy did not improve"), run.reason
    scores = [a for a in run.server_accuracy if a is not None]
    peak = max(range(len(scores)), key=scores.__getitem__)
    assert len(scores) < 40 and len(scores) - 1 - peak <= patience + 1  # stopped within its patience
    assert run.accuracy[-1] == run.accuracy[peak]  # the last version is the best one's head


@pytest.mark.parametrize(("current", "suggested"), [(0.69, False), (0.60, True)])
def test_status_names_what_the_best_accuracy_is_and_suggests_a_rollback_only_when_measurably_worse(
        tmp_path: Path, capsys, current: float, suggested: bool) -> None:
    """Issue 35 item 12: the job summary called the plateau rule's smoothed average "global
    accuracy" and suggested a rollback after every job. It now says the number is the devices'
    reports, smoothed (or the server set's), and suggests a rollback only when the model's
    current version scored measurably (2 standard errors, half a point) below the best."""
    with Registry(state_dir=tmp_path) as reg:
        head = {"w": np.zeros(2, np.float32)}
        reg.add_model_version(name="digits", version="1", head=head)
        job = reg.create_job(job_id="job-a", model_name="digits", model_version="1", selector="all", rounds=3,
                             min_devices=1, deadline_s=60, params={"aggregator": "fedavg"}, now=1.0)
        for v, parent in (("job-a-r1", "1"), ("job-a-r2", "job-a-r1")):
            reg.add_model_version(name="digits", version=v, head=head, parent=parent, head_only=True)
        # what learn() records: [version, measured in round, accuracy, samples, smoothed]
        history = [["1", 1, 0.5, 300, 0.5], ["job-a-r1", 2, 0.70, 300, 0.70], ["job-a-r2", 3, current, 300, current]]
        LearningStore(tmp_path).save(job.id, 3, {"history": history, "best": {"version": "job-a-r1", "accuracy": 0.70,
                                                                           "round": 2}}, {})
    assert main(["status", "job-a", "--state-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "best version job-a-r1: 70.00 % device-reported accuracy, smoothed over versions" in out
    assert "global accuracy" not in out
    assert ("models rollback digits --to-best job-a" in out) is suggested
