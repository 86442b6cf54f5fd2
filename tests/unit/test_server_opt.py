"""Server optimisers (issue 20): FedAvg / FedAvgM / FedAdam steps as Reddi et al. 2021 write
them, validated job options, and per-job state that survives a crash and is never applied
twice when a round is re-closed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edge_agent.coordinator.server_opt import KEEP_ROUNDS, LearningStore, ServerOpt
from edge_agent.errors import InputError


def _delta(v: float) -> dict[str, np.ndarray]:
    return {"w": np.full((2, 3), v, np.float32), "b": np.array([v, -v], np.float32)}


def test_fedavg_is_the_aggregate_times_the_server_lr() -> None:
    step, moments = ServerOpt().step(_delta(0.5), {})
    assert moments == {} and np.allclose(step["w"], 0.5)
    half, _ = ServerOpt(lr=2.0).step(_delta(0.5), {}, lr_scale=0.25)
    assert np.allclose(half["w"], 0.25) and half["w"].dtype == np.float32


def test_fedavgm_accumulates_momentum_across_rounds() -> None:
    opt = ServerOpt(name="fedavgm", lr=1.0, momentum=0.9)
    s1, m1 = opt.step(_delta(1.0), {})
    s2, m2 = opt.step(_delta(1.0), m1)
    assert np.allclose(s1["w"], 1.0) and np.allclose(s2["w"], 1.9)  # m = 0.9 * 1 + 1
    s3, _ = opt.step(_delta(0.0), m2)
    assert np.allclose(s3["w"], 0.9 * 1.9)  # keeps moving with no new delta


def test_fedadam_takes_per_coordinate_steps_of_about_lr() -> None:
    opt = ServerOpt(name="fedadam", lr=0.01, momentum=0.9, beta2=0.99, tau=1e-3)
    delta = {"w": np.array([1e-4, 1.0, -100.0], np.float32)}
    step, moments = opt.step(delta, {})
    # m = 0.1 d, v = 0.01 d^2: step = lr * 0.1 d / (0.1 |d| + tau) -- the sign of d, about lr
    expected = 0.01 * 0.1 * delta["w"] / (0.1 * np.abs(delta["w"]) + 1e-3)
    assert np.allclose(step["w"], expected, rtol=1e-5)
    assert abs(step["w"][1]) > 0.0099 and abs(step["w"][2]) < 0.0101  # scale-free for large deltas
    assert set(moments) == {"m/w", "v/w"}


@pytest.mark.parametrize(("params", "words"), [
    ({"server_opt": "sgd"}, "server_opt must be one of fedavg, fedavgm, fedadam"),
    ({"server_lr": 0}, "server_lr must be a number"),
    ({"server_lr": True}, "server_lr must be a number"),
    ({"server_momentum": 1.0}, "server_momentum must be a number in [0, 0.999]"),
    ({"server_tau": float("nan")}, "server_tau"),
])
def test_bad_options_are_refused_with_their_name(params: dict, words: str) -> None:
    with pytest.raises(InputError, match=words.replace("[", r"\[").replace("]", r"\]")):
        ServerOpt.from_params(params)
    assert ServerOpt.from_params({"server_opt": "fedadam"}).lr == 0.01  # its own default lr


def test_state_is_kept_per_round_and_a_reclose_reads_the_previous_one(tmp_path: Path) -> None:
    store = LearningStore(tmp_path)
    assert store.load("job-a", before=1) == (0, {}, {})
    opt = ServerOpt(name="fedavgm")
    _, m1 = opt.step(_delta(1.0), {})
    store.save("job-a", 1, {"lr_scale": 1.0}, m1)
    n, info, moments = store.load("job-a", before=2)
    assert n == 1 and info["round"] == 1 and np.array_equal(moments["m/w"], m1["m/w"])
    _, m2 = opt.step(_delta(1.0), moments)
    store.save("job-a", 2, {"lr_scale": 1.0}, m2)
    # round 2 closed again after a crash: it reads round 1's state, not its own
    again = store.load("job-a", before=2)
    assert again[0] == 1 and np.allclose(again[2]["m/w"], 1.0)
    for n in range(3, 10):
        store.save("job-a", n, {}, m2)
    assert store.rounds("job-a") == list(range(10 - KEEP_ROUNDS, 10))
    assert sorted(p.name for p in (tmp_path / "learning" / "job-a").iterdir()) == sorted(
        f"r{n}{s}" for n in range(10 - KEEP_ROUNDS, 10) for s in (".json", ".npz"))


def test_a_corrupt_state_file_is_a_clear_error(tmp_path: Path) -> None:
    store = LearningStore(tmp_path)
    store.save("job-b", 1, {}, ServerOpt(name="fedavgm").step(_delta(1.0), {})[1])
    npz = tmp_path / "learning" / "job-b" / "r1.npz"
    npz.write_bytes(npz.read_bytes()[:-7])
    with pytest.raises(InputError):
        store.load("job-b")
    (tmp_path / "learning" / "job-b" / "r1.json").write_text("[1, 2")
    with pytest.raises(InputError, match="not a readable learning state"):
        store.load("job-b")
