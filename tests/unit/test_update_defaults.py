"""Defaults that work: the update size adapts to the model, never exceeds plain fp32, says
how much of the delta's energy it kept; the coordinator shows that and refuses an update
trained on another label set."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest

from edge_agent.labels import label_set_digest
from edge_agent.protocol.schema import Kind, check_body
from edge_agent.updates import UNCOMPRESSED, CompressionPolicy, UpdateEncoder, decode_update
from edge_agent.updates.policy import DEFAULT_UPDATE_BYTES


def _head_delta(rng: np.random.Generator, classes: int = 10, features: int = 16) -> dict[str, np.ndarray]:
    """A fine-tuned head's change: most weights move a little, a few a lot (heavy tails)."""
    return {"fc_weight": (rng.standard_t(3, (classes, features)) * 0.01).astype(np.float32),
            "fc_bias": (rng.standard_t(3, classes) * 0.01).astype(np.float32)}


def _encode(delta: dict[str, np.ndarray], policy: CompressionPolicy | None = None, rnd: int = 0):
    enc = UpdateEncoder(model_name="m", device_id="d", policy=policy)
    return enc, enc.encode(delta, job_id="j", round=rnd, model_version="1")


def _kept(delta: dict[str, np.ndarray], sent: dict[str, np.ndarray]) -> float:
    total = sum(float(np.sum(v.astype(np.float64) ** 2)) for v in delta.values())
    lost = sum(float(np.sum((delta[k].astype(np.float64) - sent[k]) ** 2)) for k in delta)
    return 1.0 - lost / total


def test_a_170_value_heads_default_update_keeps_its_energy_and_moves_every_weight() -> None:
    delta = _head_delta(np.random.default_rng(0))
    assert sum(v.size for v in delta.values()) == 170
    _, update = _encode(delta)
    decoded = decode_update(update.payload).deltas
    assert update.k == 170  # dense: every weight moves, not the top 2
    assert _kept(delta, decoded) >= 0.99 and update.energy_kept == pytest.approx(_kept(delta, decoded), abs=1e-9)
    assert update.wire_bytes <= update.dense_bytes and update.ratio >= 1.0  # smaller than plain fp32
    # what the old default (top-1 %) did: 2 values, a sliver of the energy
    _, old = _encode(delta, CompressionPolicy(density=0.01))
    assert old.k == 2 and old.energy_kept < 0.5


def test_two_default_rounds_change_nearly_every_weight_of_the_global_head() -> None:
    rng = np.random.default_rng(1)
    base = {"fc_weight": rng.normal(0, 0.1, (10, 16)).astype(np.float32), "fc_bias": np.zeros(10, np.float32)}
    enc = UpdateEncoder(model_name="m", device_id="d")
    head = {k: v.copy() for k, v in base.items()}
    for rnd in range(2):
        update = enc.encode(_head_delta(rng), job_id="j", round=rnd, model_version=str(rnd + 1))
        enc.commit(update)
        for name, d in decode_update(update.payload).deltas.items():
            head[name] += d
    changed = sum(int(np.count_nonzero(head[k] != base[k])) for k in base)
    assert changed >= 160, changed


def test_an_explicit_budget_or_a_fixed_rate_is_never_bigger_than_plain_fp32() -> None:
    delta = _head_delta(np.random.default_rng(2))
    _, update = _encode(delta, CompressionPolicy(budget_bytes=1024))
    assert update.wire_bytes <= update.dense_bytes and update.energy_kept >= 0.99
    _, small = _encode(delta, CompressionPolicy(budget_bytes=300))
    assert small.wire_bytes <= 300 and 0.9 <= small.energy_kept <= 1.0
    _, exact = _encode(delta, UNCOMPRESSED)  # asked for exactly: given exactly
    assert exact.bits == 32 and exact.k == 170 and exact.energy_kept == 1.0
    _, dense_ish = _encode(delta, CompressionPolicy(density=0.9, bits=32))
    assert dense_ish.wire_bytes <= exact.wire_bytes  # top-k's index bytes never cost more than fp32


def test_a_large_delta_fits_the_byte_budget_and_a_mid_sized_head_goes_dense() -> None:
    rng = np.random.default_rng(3)
    large = {"w": (rng.standard_t(3, (400, 1000)) * 0.01).astype(np.float32)}
    _, update = _encode(large)
    assert update.wire_bytes <= DEFAULT_UPDATE_BYTES and update.k < 400_000
    assert 0.0 < update.energy_kept < 1.0
    _, tight = _encode(large, CompressionPolicy(budget_bytes=4096))
    assert tight.wire_bytes <= 4096 and tight.energy_kept < update.energy_kept
    mid = {"w": (rng.standard_t(3, (10, 1280)) * 0.01).astype(np.float32), "b": np.zeros(10, np.float32)}
    _, dense = _encode(mid)  # dense int8 (~12.9 KB) is within 2x the default budget: sent whole
    assert dense.k == 12_800  # every non-zero value (the bias did not move)
    assert dense.bits == 8 and dense.energy_kept > 0.99


def test_the_update_chunk_schema_bounds_the_new_fields() -> None:
    body = {"job": "j", "round": 1, "upload": "a" * 64, "index": 0, "count": 1, "size": 10,
            "energy_kept": 0.97, "labels_sha256": label_set_digest(["a", "b"])}
    check_body(Kind.UPDATE_CHUNK, body)
    for field, bad in (("energy_kept", 1.5), ("energy_kept", float("nan")), ("labels_sha256", "xyz")):
        with pytest.raises(ValueError, match=field):
            check_body(Kind.UPDATE_CHUNK, {**body, field: bad})


# ---------------------------------------------------------------- the coordinator's side
@pytest.fixture(scope="module")
def digits_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from edge_agent.sim import scenario as demo

    return demo.ensure_bundle(tmp_path_factory.getbasetemp() / "digits-bundle")


def test_status_shows_the_kept_fraction_and_another_label_set_is_refused(
        digits_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from edge_agent.coordinator import cli as coordinator_cli
    from edge_agent.coordinator.artefacts import ModelArtefacts
    from edge_agent.coordinator.registry import Registry
    from edge_agent.coordinator.rounds import RoundEngine
    from edge_agent.int8.bundle import load_bundle
    from edge_agent.keys import fingerprint, generate_private_key, public_key_bytes

    reg = Registry(state_dir=tmp_path)
    mv = ModelArtefacts(reg).register_bundle(digits_bundle, name="digits", version="1")
    head = reg.load_head(mv)
    ids = []
    for _ in range(2):
        key = generate_private_key()
        ids.append(fingerprint(key))
        reg.enrol_device(device_id=ids[-1], public_key=base64.b64encode(public_key_bytes(key)).decode(),
                         fleet="f", board="rpi4", engine="tflite", approved=True)
        reg.record_state(ids[-1], online=True, state={"battery_pct": 90.0, "on_power": True})
    engine = RoundEngine(registry=reg)
    job = engine.start_job(model_name="digits", model_version="1", rounds=1, min_devices=1, deadline_s=600)
    (plan,) = engine.tick().opened
    rng = np.random.default_rng(4)
    labels = load_bundle(digits_bundle).manifest.labels
    receipts, kept = [], []
    for device, trained_on in zip(plan.devices, (labels, ["brick", "grass"]), strict=True):
        delta = {k: (rng.standard_t(3, v.shape) * 0.01).astype(np.float32) for k, v in head.items()}
        update = UpdateEncoder(model_name="digits", device_id=device).encode(
            delta, job_id=job.id, round=plan.round, model_version="1")
        kept.append(update.energy_kept)
        receipts.append(engine.receive_update(update.payload, sender=device, num_samples=50,
                                              energy_kept=update.energy_kept,
                                              labels_sha256=label_set_digest(trained_on)))
    assert receipts[0].status == "accepted"
    assert (receipts[1].status, receipts[1].reason) == ("rejected", "wrong_labels")
    assert "another label set" in receipts[1].detail
    reg.close()
    assert coordinator_cli.main(["status", "--state-dir", str(tmp_path), job.id]) == 0
    out = capsys.readouterr().out
    assert kept[0] > 0.99 and f"kept {100 * kept[0]:.1f} % of the delta energy" in out, out
    assert "wrong_labels: update was trained on another label set" in out
