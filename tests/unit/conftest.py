"""Fixtures several unit modules share: the demo's digits bundle and one camera device's data."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge_agent.sim import scenario as demo


@pytest.fixture(scope="session")
def digits_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's digits CNN bundle (built once per session; ensure_bundle reuses it)."""
    return demo.ensure_bundle(tmp_path_factory.getbasetemp() / "digits-bundle")


@pytest.fixture(scope="session")
def camera_device_npz(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo scenario's third device: its digits through its own camera, as an .npz."""
    dev = demo.scenario().devices[2]
    return demo.write_data(tmp_path_factory.mktemp("camera-device"), dev.images, dev.labels, "npz")
