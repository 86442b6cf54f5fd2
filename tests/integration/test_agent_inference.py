"""The daemon's local inference service end to end: a real `edge-agent run` with [serve],
a real mosquitto, models fetched the way the coordinator publishes them. The service picks
up each installed version without a restart, an application uses the socket (httpx), and
the device's state reports what it serves and how well it does on its own samples."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import httpx
import numpy as np
import pytest

from edge_agent.protocol.facts import facts_from_state
from edge_agent.transport.models import publish_model
from tests.conftest import new_head_version
from tests.integration.conftest import online_agent, wait_for

pytestmark = pytest.mark.integration


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


def test_the_daemon_serves_each_installed_version_and_reports_it(mosquitto, fleet, agents, tmp_path: Path,
                                                                  digits_bundle) -> None:
    from edge_agent.int8.bundle import pack_bundle
    from edge_agent.sim import scenario as demo

    bundle_dir, archive = digits_bundle
    coord = fleet.coordinator(mosquitto.port)
    publish_model(coord.client, coord.signer, fleet.topics, name="digits", version="1", bundle=archive,
                  chunk_bytes=16 * 1024)
    sock = tmp_path / "inference.sock"
    agent, watcher = online_agent(agents, fleet, coord, tmp_path, mosquitto.port, extra_toml=(
        f'\n[serve]\nenabled = true\nsocket = "{sock}"\nengine = "native"\nrefresh_s = 0.2\n'))

    def state() -> dict:
        return facts_from_state(watcher.states()[-1].body) if watcher.states() else {}

    watcher.command(agent, {"cmd_id": "m1", "action": "fetch_model", "model": "digits", "version": "1",
                            "sha256": hashlib.sha256(archive).hexdigest()})
    assert wait_for(lambda: state().get("served_model") == "digits/1", 90), agent.log_tail()
    assert state()["served_kind"] == "fleet"
    dev = demo.scenario().devices[0]
    x, y = demo.to_pixels(dev.images).astype(np.float32), [demo.LABELS[v] for v in dev.labels]
    client = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://edge", timeout=60)
    with client:
        out = client.post("/v1/predict", content=_npy(x[:3])).json()
        assert out["model"]["version"] == "digits/1" and len(out["predictions"]) == 3
        for i in range(30):  # a few fall in the held-out split: the device can judge models now
            assert client.post(f"/v1/samples?label={y[i]}", content=_npy(x[i])).status_code == 201
        assert wait_for(lambda: state().get("fleet_accuracy") is not None and state().get("held_out", 0) > 0, 60), \
            agent.log_tail()
        # a new fleet version, fetched as a round publishes it: served without a restart
        new_head_version(bundle_dir, tmp_path / "v2", version="2", shift=0.0)
        archive2 = pack_bundle(tmp_path / "v2", tmp_path / "v2.tar.gz").read_bytes()
        publish_model(coord.client, coord.signer, fleet.topics, name="digits", version="2", bundle=archive2,
                      chunk_bytes=16 * 1024)
        watcher.command(agent, {"cmd_id": "m2", "action": "fetch_model", "model": "digits", "version": "2",
                                "sha256": hashlib.sha256(archive2).hexdigest()})
        assert wait_for(lambda: state().get("served_model") == "digits/2", 90), agent.log_tail()
        assert client.post("/v1/predict", content=_npy(x[:1])).json()["model"]["version"] == "digits/2"
        info = client.get("/v1/model").json()
    assert info["previous"]["version"] == "digits/1" and info["samples"]["total"] == 30
    assert "libmxnet" not in Path(f"/proc/{agent.proc.pid}/maps").read_text()  # the daemon stays MXNet-free
