"""Server sets on a real bundle (issue 34): attached with the commands an operator uses, run
through the bundle's int8 backbone by the coordinator, they decide a round -- the trust rule
gives a flipped update no weight, the gate scores the new version, `status` says where each
number comes from -- and bad server sets are refused with a reason."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest

from edge_agent.coordinator import cli as coordinator_cli
from edge_agent.coordinator.registry import Registry
from edge_agent.coordinator.rounds import RoundEngine
from edge_agent.coordinator.server_set import (
    StoredServerSets,
    pack_server_set,
    packed_for,
    read_server_set,
)
from edge_agent.int8.bundle import load_bundle
from edge_agent.keys import fingerprint, generate_private_key, public_key_bytes
from edge_agent.sim import scenario as demo
from edge_agent.sim.digits import apply_camera, load_digits_images
from edge_agent.updates.wire import UpdateHeader, encode_update


@pytest.fixture(scope="module")
def digits_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo.ensure_bundle(tmp_path_factory.getbasetemp() / "digits-bundle")


@pytest.fixture(scope="module")
def camera_digits() -> tuple[np.ndarray, np.ndarray]:
    """Digits through one field camera (the base model was trained without any)."""
    images, labels = load_digits_images()
    sc = demo.scenario(n_devices=3)
    return apply_camera(images, sc.devices[0].camera), labels


def _write(path: Path, images: np.ndarray, labels: np.ndarray) -> Path:
    return demo.write_data(path, images, labels, "npz")


def test_register_attaches_a_server_set_and_status_shows_it(digits_bundle: Path, camera_digits, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    x, y = camera_digits
    server = _write(tmp_path / "server", x[:300], y[:300])
    state = ["--state-dir", str(tmp_path / "coord")]
    assert coordinator_cli.main(["model", "register", str(digits_bundle), "--name", "digits", "--version", "1",
                                 "--validation", str(server), *state]) == 0
    out = capsys.readouterr().out
    per_class = ", ".join(str(int(c)) for c in np.bincount(y[:300], minlength=10))
    assert f"server set of digits: 300 samples; per class {per_class}" in out
    assert coordinator_cli.main(["model", "server-set", "digits", *state]) == 0
    assert "300 samples" in capsys.readouterr().out


def test_a_flipped_update_counts_for_nothing_and_the_version_is_scored_on_the_server_set(
        digits_bundle: Path, camera_digits, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Three devices train the real bundle's head on their own camera digits (the numpy
    trainer on the int8 backbone's features, as the agent does); one sends its delta
    negated. With the model's server set the job's default rule is trust: the flip earns no
    trust, the version is gated and scored on the server set, and `status` names that."""
    from edge_agent.coordinator.artefacts import ModelArtefacts
    from edge_agent.coordinator.server_set import attach
    from edge_agent.train.dense_head import make_head_trainer
    from edge_agent.train.trainer import TrainConfig, head_from_bundle

    x, y = camera_digits
    reg = Registry(state_dir=tmp_path / "coord")
    mv = ModelArtefacts(reg).register_bundle(digits_bundle, name="digits", version="1")
    sha, n, _ = attach(reg, mv, _write(tmp_path / "server", x[:300], y[:300]))
    reg.set_model_server_set("digits", sha, n)
    source = StoredServerSets(reg)
    engine = RoundEngine(registry=reg, evidence=source)
    keys = [generate_private_key() for _ in range(3)]
    ids = [fingerprint(k) for k in keys]
    shares = [np.arange(300 + 150 * i, 450 + 150 * i) for i in range(3)]
    for did, k, share in zip(ids, keys, shares, strict=True):
        reg.enrol_device(device_id=did, public_key=base64.b64encode(public_key_bytes(k)).decode(), fleet="f",
                         approved=True)
        reg.record_state(did, online=True, state={"battery_pct": 90.0, "data_samples": len(share)})
    job = engine.start_job(model_name="digits", model_version="1", rounds=1, min_devices=3, deadline_s=600,
                           params={"epochs": 3})
    assert (job.params["aggregator"], job.params["aggregator_default"]) == ("trust", "the model has a server set")
    (plan,) = engine.tick().opened

    bundle = load_bundle(digits_bundle)
    runner = source._engine().prepare(bundle, threads=1)
    symbol, base = head_from_bundle(bundle)
    for i, (did, share) in enumerate(zip(ids, shares, strict=True)):
        feats = runner.run(bundle.manifest.input.normalise(demo.to_pixels(x[share]).astype(np.float32)))
        trainer = make_head_trainer(symbol_json=symbol, params=base, input_name=bundle.manifest.split_tensor,
                                    num_classes=10, config=TrainConfig(epochs=3, seed=i))
        for epoch in range(3):
            for b in range(trainer.batches_per_epoch(len(share))):
                idx = trainer.batch_indices(len(share), epoch, b)
                trainer.step(feats[idx], y[share][idx])
        delta = {k: (trainer.params()[k] - base[k]) * (-1.0 if i == 0 else 1.0) for k in trainer.params()}
        counts = ",".join(str(int(c)) for c in np.bincount(y[share], minlength=10))
        payload = encode_update(UpdateHeader("digits", "1", job.id, did, 1), delta, density=1.0, bits=8)
        assert engine.receive_update(payload, sender=did, num_samples=len(share),
                                     metrics={"label_counts": counts}).status == "accepted"
    runner.close()
    (out,) = engine.tick().closed
    assert out.new_version is not None, out.reason
    m = out.new_version.metrics
    assert m["aggregator"] == "trust" and m["accuracy_source"] == "server set" and m["zero_trust"] == 1
    assert 150 <= m["accuracy_samples"] <= 210 and m["accuracy"] > m["base_server_acc"]  # ~60 % of 300
    # the flip's withheld weight made a second candidate (the server step standing in for it):
    # both were scored on the gate split, and the record says which went on
    (first, second), (first_loss, second_loss) = m["candidates_correct"], m["candidates_loss"]
    stands_in = second >= first and second_loss < first_loss
    assert m.get("server_stands_in", False) == stands_in
    reasons = {u.device_id: u.reason for u in reg.list_updates(job.id, 1)}
    assert reasons[ids[0]].startswith("counted for nothing")
    # the two honest devices hold neighbouring shares of one distribution: their updates may
    # echo each other (strategies/echoes.py), and then both say so, symmetrically
    honest = [reasons[ids[1]], reasons[ids[2]]]
    assert honest == ["", ""] or all(r.startswith("shares one vote with the") for r in honest), honest
    reg.close()
    assert coordinator_cli.main(["status", job.id, "--state-dir", str(tmp_path / "coord")]) == 0
    text = capsys.readouterr().out
    assert "aggregator trust (the default: the model has a server set)" in text
    assert f"% on the server set, {m['accuracy_samples']} samples" in text
    assert ("the server's step standing in for distrusted data" in text) == stands_in


def test_model_create_leaves_the_server_set_beside_the_bundle_for_register(
        digits_bundle: Path, camera_digits, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """What `model create --validation` writes (normalised, beside the bundle, never inside
    it) is what `model register` takes without being told."""
    import shutil

    x, y = camera_digits
    bundle_dir = tmp_path / "digits-1"
    shutil.copytree(digits_bundle, bundle_dir)
    data = read_server_set(_write(tmp_path / "server", x[:100], y[:100]), load_bundle(bundle_dir))
    packed_for(bundle_dir).write_bytes(pack_server_set(data))
    assert coordinator_cli.main(["model", "register", str(bundle_dir), "--state-dir", str(tmp_path / "c")]) == 0
    assert "(prepared by model create)" in capsys.readouterr().out
    assert not (bundle_dir / "server-set.npz").exists() and packed_for(bundle_dir).name == "digits-1.server-set.npz"


@pytest.mark.parametrize(("count", "labels", "message"), [
    (10, None, "10 usable sample(s); a server set needs at least 30"),
    (60, np.zeros(60, np.int64), "every usable sample has the same label"),
    (60, np.full(60, 11, np.int64), "11"),
])
def test_bad_server_sets_are_refused_with_a_reason(digits_bundle: Path, camera_digits, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str], count: int,
                                                   labels: np.ndarray | None, message: str) -> None:
    x, y = camera_digits
    bad = _write(tmp_path / "bad", x[:count], y[:count] if labels is None else labels)
    state = ["--state-dir", str(tmp_path / "coord")]
    assert coordinator_cli.main(["model", "register", str(digits_bundle), "--name", "digits", "--version", "1",
                                 *state]) == 0
    capsys.readouterr()
    assert coordinator_cli.main(["model", "server-set", "digits", str(bad), *state]) == 65
    assert message in capsys.readouterr().err
    with Registry(state_dir=tmp_path / "coord") as reg:
        assert reg.model_server_set("digits") is None  # nothing half-attached
