"""The dashboard's charts keep honest scales, and its filters are labelled, in a real
headless Chromium (Debian's chromium + chromium-driver, through Selenium) over a registry
filled the way rounds fill it: an accuracy axis never goes past 100 % (plotly's autorange
padded 0.99 to 1.003), and a compression ratio of 3.85-3.86 is drawn from 0, not blown up
into a slope across an axis of 3.849-3.860."""

from __future__ import annotations

import base64
import time
from pathlib import Path

import numpy as np
import pytest

from edge_agent.coordinator.records import JobStatus, ModelVersion, RoundState, UpdateStatus
from edge_agent.coordinator.registry import Registry
from edge_agent.dashboard.server import start_ui
from edge_agent.keys import fingerprint, generate_private_key, public_key_bytes
from tests.integration.test_dashboard import browser, js_errors, wait_page  # noqa: F401 - the fixture

pytestmark = pytest.mark.integration
HEAD = {"dense0_weight": np.zeros((2, 3), np.float32)}


def three_close_rounds(state_dir: Path) -> None:
    """A job of three aggregated rounds, two devices each: local accuracy 97 % -> 99.5 %, and
    100 % in the last round (a small validation split), global 99 %, and compression 3.85,
    3.85, 3.86 (fp32 bytes / wire bytes)."""
    now = time.time()
    with Registry(state_dir=state_dir) as reg:
        devices = []
        for name in ("pi-a", "pi-b"):
            key = generate_private_key()
            devices.append(fingerprint(key))
            reg.enrol_device(device_id=devices[-1], public_key=base64.b64encode(public_key_bytes(key)).decode(),
                             fleet="farm", board="Raspberry Pi 4 Model B", approved=True, now=now - 600)
            reg.record_state(devices[-1], online=True, state={"name": name, "status": "idle"}, now=now - 5)
        reg.add_model_version(name="digits", version="1", head=HEAD, now=now - 500)
        reg.create_job(job_id="job1", model_name="digits", model_version="1", selector="all", rounds=3,
                       min_devices=2, deadline_s=60, params={}, now=now - 400)
        reg.set_job_status("job1", JobStatus.RUNNING, now=now - 400)
        base = "1"
        for r, fp32 in ((1, 3850), (2, 3852), (3, 3860)):
            t = now - 300 + 60 * r
            reg.open_round(job_id="job1", number=r, base_version=base, devices=devices, deadline_at=t + 60, now=t)
            for i, dev in enumerate(devices):
                reg.add_update(job_id="job1", device_id=dev, round=r, num_samples=100, wire_bytes=1000,
                               fp32_bytes=fp32, sha256=f"{r}{i}".ljust(64, "0"), deltas=HEAD,
                               status=UpdateStatus.PENDING, energy_wh=0.01,
                               metrics={"accuracy_before": 0.97, "accuracy_after": 1.0 if r == 3 else 0.995}, now=t + 10)
            reg.begin_closing("job1", r, now=t + 20)
            rel, sha = reg.write_head("digits", f"job1-r{r}", HEAD)
            new = ModelVersion(name="digits", version=f"job1-r{r}", parent=base, created_at=t + 21, bundle_path=None,
                               head_path=rel, head_sha256=sha, head_only=True, job_id="job1", round=r,
                               metrics={"updates": 2, "samples": 200, "global_acc": 0.99})
            reg.finish_round("job1", r, state=RoundState.AGGREGATED, new_version=new, now=t + 21,
                             verdicts={d: (UpdateStatus.ACCEPTED, "") for d in devices})
            base = new.version


def axis(driver, title: str, name: str) -> list[float]:  # noqa: ANN001
    return driver.execute_script(f"return document.querySelector('.chart[data-title=\"{title}\"]')._fullLayout.{name}.range;")


def test_chart_scales_are_honest_and_the_filters_are_labelled(tmp_path: Path, browser) -> None:  # noqa: ANN001, F811
    from selenium.webdriver.common.by import By

    three_close_rounds(tmp_path / "coord")
    ui = start_ui(tmp_path / "coord", address="127.0.0.1:0")
    try:
        browser.get(ui.url + "rounds")
        wait_page(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".chart .main-svg")) >= 3, "the charts")
        accuracy = axis(browser, "Accuracy", "yaxis")
        assert accuracy == [0, 1], accuracy  # every point (100 % included), and nothing above 100 %
        ratio = axis(browser, "Bytes up and compression", "yaxis2")
        assert ratio[0] <= 0 < 3.86 <= ratio[1], ratio  # from zero: 3.85 and 3.86 look as alike as they are
        assert axis(browser, "Bytes up and compression", "yaxis")[0] <= 0

        browser.get(ui.url)
        unlabelled = browser.execute_script(
            "return Array.from(document.querySelectorAll('#filters input:not([type=hidden]), #filters select'))"
            ".filter(e => e.labels.length !== 1 || !e.labels[0].textContent.trim()).map(e => e.name);")
        assert unlabelled == [], unlabelled
        count = browser.execute_script("return document.querySelectorAll('#filters input:not([type=hidden]), "
                                       "#filters select').length;")
        assert count == 2
        assert js_errors(browser) == [], js_errors(browser)
    finally:
        ui.close()
