"""Model bundles through the daemon: fetched in signed chunks, verified, unpacked by a
child, activated with one rename; a bundle that does not verify never becomes a version."""

from __future__ import annotations

import hashlib
import random

import pytest

from edge_agent.agent.state import facts_from_state
from edge_agent.transport.models import publish_model
from tests.integration.conftest import Watcher, board_tree, enrol, wait_for

pytestmark = pytest.mark.integration


def test_fetch_verify_activate_and_refuse_bad_bundles(mosquitto, fleet, agents, tmp_path, digits_bundle):
    _, archive = digits_bundle
    coord = fleet.coordinator(mosquitto.port)
    publish_model(coord.client, coord.signer, fleet.topics, name="digits", version="1", bundle=archive,
                  chunk_bytes=8 * 1024)
    junk = random.Random(2).randbytes(20_000)  # signed by the coordinator, but not a bundle archive
    publish_model(coord.client, coord.signer, fleet.topics, name="digits", version="2", bundle=junk)
    data = tmp_path / "data"
    data.mkdir()
    agent = agents(tmp_path, mosquitto.port, sysfs_root=board_tree(tmp_path / "board"), data_dir=data)
    watcher = Watcher(fleet, coord)
    enrol(watcher, agent)
    watcher.start()
    agent.start()
    assert wait_for(lambda: watcher.states(), 30), agent.log_tail()
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
