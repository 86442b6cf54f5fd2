"""Model bundles through the daemon: fetched in signed chunks, verified, unpacked by a
child, activated with one rename; a bundle that does not verify never becomes a version."""

from __future__ import annotations

import hashlib
import random

import pytest

from edge_agent.protocol.facts import facts_from_state
from edge_agent.transport.models import publish_model
from tests.conftest import new_head_version
from tests.integration.conftest import online_agent, wait_for

pytestmark = pytest.mark.integration


def test_fetch_verify_activate_and_refuse_bad_bundles(mosquitto, fleet, agents, tmp_path, digits_bundle):
    _, archive = digits_bundle
    coord = fleet.coordinator(mosquitto.port)
    publish_model(coord.client, coord.signer, fleet.topics, name="digits", version="1", bundle=archive,
                  chunk_bytes=8 * 1024)
    junk = random.Random(2).randbytes(20_000)  # signed by the coordinator, but not a bundle archive
    publish_model(coord.client, coord.signer, fleet.topics, name="digits", version="2", bundle=junk)
    agent, watcher = online_agent(agents, fleet, coord, tmp_path, mosquitto.port)
    models = agent.state_dir / "models" / "digits"

    watcher.command(agent, {"cmd_id": "m1", "action": "fetch_model", "model": "digits", "version": "1",
                            "sha256": hashlib.sha256(archive).hexdigest()})
    assert wait_for(lambda: watcher.by_phase("model-installed"), 60), agent.log_tail()
    assert (models / "current").is_symlink() and (models / "current").resolve() == models / "1"
    assert (models / "1" / "manifest.json").is_file() and (models / "1" / "backbone_int8.tflite").is_file()
    assert wait_for(lambda: facts_from_state(watcher.states()[-1].body).get("models") == "digits@1", 20)

    watcher.command(agent, {"cmd_id": "m2", "action": "fetch_model", "model": "digits", "version": "2"})
    assert wait_for(lambda: watcher.by_phase("model-failed"), 60), agent.log_tail()
    assert "bundle rejected" in watcher.by_phase("model-failed")[-1].body["detail"]
    assert not (models / "2").exists() and (models / "current").resolve() == models / "1"
    assert not [p for p in models.iterdir() if p.name.startswith(".")]  # no half-unpacked directory left

    # a finetune naming other bytes than the coordinator published for that version fails, saying why
    watcher.command(agent, {"cmd_id": "j-r1", "action": "finetune", "job": "j", "round": 1, "model": "digits",
                            "version": "2", "sha256": "0" * 64, "params": {"epochs": 1}})
    assert wait_for(lambda: watcher.by_phase("failed"), 60), agent.log_tail()
    assert "the published bundle has sha256" in watcher.by_phase("failed")[-1].body["detail"]
    assert agent.alive


def test_a_head_patch_installs_the_next_version_and_a_bad_patch_falls_back_to_the_full_bundle(
        mosquitto, fleet, agents, tmp_path, digits_bundle):
    from edge_agent.int8.bundle import load_bundle, pack_bundle
    from edge_agent.int8.bundle_patch import pack_patch

    bundle_dir, archive = digits_bundle
    coord = fleet.coordinator(mosquitto.port)

    def publish(version: str, data: bytes) -> str:
        publish_model(coord.client, coord.signer, fleet.topics, name="digits", version=version, bundle=data,
                      chunk_bytes=8 * 1024)
        return hashlib.sha256(data).hexdigest()

    full = {"1": publish("1", archive)}
    built = {}
    for version, shift in (("3", 0.01), ("4", 0.02)):
        built[version] = new_head_version(bundle_dir, tmp_path / "built" / version, version=version, shift=shift)
        full[version] = publish(version, pack_bundle(built[version].path, tmp_path / f"{version}.tar.gz").read_bytes())
    patch, carried = pack_patch(built["3"].path, bundle_dir, tmp_path / "3.head.tar.gz")
    assert carried == ["head.params"]
    patch_sha = publish("3.head", patch.read_bytes())
    junk_sha = publish("4.head", random.Random(4).randbytes(3000))  # signed, but no patch at all

    agent, watcher = online_agent(agents, fleet, coord, tmp_path, mosquitto.port)
    models = agent.state_dir / "models" / "digits"

    def installed(version: str) -> list:
        return [m for m in watcher.by_phase("model-installed") if m.body["detail"].startswith(f"digits/{version}:")]

    # nothing installed yet: a head patch has nothing to apply to, so the whole bundle comes
    watcher.command(agent, {"cmd_id": "m1", "action": "fetch_model", "model": "digits", "version": "1",
                            "sha256": full["1"], "head_sha256": junk_sha})
    assert wait_for(lambda: installed("1"), 60), agent.log_tail()
    assert "head patch" not in installed("1")[-1].body["detail"]

    watcher.command(agent, {"cmd_id": "m3", "action": "fetch_model", "model": "digits", "version": "3",
                            "sha256": full["3"], "head_sha256": patch_sha})
    assert wait_for(lambda: installed("3"), 60), agent.log_tail()
    assert "from its head patch onto 1" in installed("3")[-1].body["detail"]
    assert load_bundle(models / "3").sha256 == built["3"].sha256  # the same version, byte for byte
    assert (models / "current").resolve() == models / "3"

    # a patch that downloads and verifies but does not apply: the full archive is fetched instead
    watcher.command(agent, {"cmd_id": "m4", "action": "fetch_model", "model": "digits", "version": "4",
                            "sha256": full["4"], "head_sha256": junk_sha})
    assert wait_for(lambda: installed("4"), 90), agent.log_tail()
    assert "head patch" not in installed("4")[-1].body["detail"]
    assert any("head patch unusable" in m.body["detail"] for m in watcher.by_phase("model-downloading"))
    assert load_bundle(models / "4").sha256 == built["4"].sha256
    assert not [p for p in models.iterdir() if p.name.startswith(".")] and agent.alive
