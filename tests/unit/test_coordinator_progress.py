"""Device progress messages at the coordinator (service_messages.DeviceMessages._progress)
over a real registry: a device's result metrics are untrusted, partial input."""

from __future__ import annotations

import base64
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace

from edge_agent.coordinator.registry import Registry
from edge_agent.coordinator.service_messages import DeviceMessages
from edge_agent.keys import fingerprint, generate_private_key, public_key_bytes


def _handler(reg: Registry) -> SimpleNamespace:
    dropouts: list[tuple] = []
    return SimpleNamespace(registry=reg, _replayed={}, _results=OrderedDict(), _check_replayed=lambda: None,
                           _full_wanted=lambda name: None, dropouts=dropouts,
                           _dropout=lambda *a: dropouts.append(a))


def test_a_progress_report_with_only_some_result_metrics_keeps_those_and_raises_nothing(tmp_path: Path) -> None:
    """Before: a metrics dict without one of RESULT_METRICS raised KeyError in the serving
    loop (a missing key reads as None, which counts as a scalar), and each error backed the
    loop off further -- one device could slow the whole coordinator."""
    key = generate_private_key()
    device = fingerprint(key)
    with Registry(state_dir=tmp_path) as reg:
        reg.enrol_device(device_id=device, public_key=base64.b64encode(public_key_bytes(key)).decode(), fleet="f")
        h = _handler(reg)
        body = {"phase": "uploading", "job": "job-1", "round": 2,
                "metrics": {"num_samples": 40, "energy_wh": 0.01, "engine": "x" * 300, "not_a_metric": 1}}
        DeviceMessages._progress(h, SimpleNamespace(body=body), device)  # type: ignore[arg-type]
        assert h._results[("job-1", device, 2)] == {"num_samples": 40, "energy_wh": 0.01}  # too long: dropped
        DeviceMessages._progress(h, SimpleNamespace(body={"phase": "failed", "job": "job-1", "round": 3,
                                                          "detail": "battery low"}), device)  # type: ignore[arg-type]
        assert h.dropouts == [("job-1", 3, device, "failed: battery low")]
        assert reg.get_device(device).state.get("job_phase") == "failed"
