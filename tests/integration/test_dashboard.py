"""The dashboard end to end: a real mosquitto, real `edge-agent run` processes, a real
`edge-coordinator serve --ui`, and the pages driven in a real headless Chromium (Debian's
chromium + chromium-driver, through Selenium). A round runs while its page is open and
shows up there without a reload; an agent stopping turns its fleet row offline, also
without a reload; a non-loopback bind refuses requests without the token. Screenshots of
every page are saved under the test's tmp dir and, if EDGE_AGENT_ARTEFACTS is set, there."""

from __future__ import annotations

import os
import shutil
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from edge_agent.coordinator.records import RoundState
from edge_agent.dashboard.server import start_ui
from edge_agent.transport.broker import free_port
from tests.integration.agents import SHORT_ROUND, logs, start_agents, wait_online
from tests.integration.conftest import register_digits

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # real agents train one round
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
WAIT_S = 300  # bounds a hang only: every wait below ends on what the page shows


@pytest.fixture
def browser():
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.fail("needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900",
                "--disable-gpu", "--no-first-run", "--disable-extensions"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(WAIT_S)
    yield driver
    driver.quit()


class Shots:
    """Screenshots as test artefacts: tmp dir, plus $EDGE_AGENT_ARTEFACTS if set."""

    def __init__(self, driver, tmp: Path) -> None:
        self.driver, self.dir = driver, tmp / "screenshots"
        self.dir.mkdir()
        extra = os.environ.get("EDGE_AGENT_ARTEFACTS")
        self.extra = Path(extra) / "dashboard" if extra else None

    def take(self, name: str) -> Path:
        path = self.dir / f"dashboard-{name}.png"
        assert self.driver.save_screenshot(str(path)), name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        if self.extra is not None:
            self.extra.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, self.extra / path.name)
        return path


def wait_page(driver, predicate, what: str) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, WAIT_S, poll_frequency=0.2).until(lambda d: predicate(d), message=what)


def js_errors(driver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def fetch(url: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_the_dashboard_shows_the_fleet_and_a_round_live_in_a_real_browser(mosquitto, agents, serve, tmp_path,
                                                                           digits_bundle, browser):
    from selenium.webdriver.common.by import By

    ui_port = free_port()
    coordinator = serve(mosquitto.port, extra=("--ui", f"127.0.0.1:{ui_port}")).start()
    url = f"http://127.0.0.1:{ui_port}/"
    agents_ = start_agents(agents, tmp_path, mosquitto.port, 2)
    register_digits(coordinator, digits_bundle[1], tmp_path)
    wait_online(coordinator, agents_)
    shots = Shots(browser, tmp_path)

    # the rounds page is open before the job starts: the round must appear on it by itself
    browser.get(url + "rounds")
    assert "No jobs yet" in browser.page_source
    browser.execute_script("window.__notReloaded = true;")
    done = coordinator.cli("train", "--model", "digits", "--devices", "all", "--deadline", "600s", "--rounds", "1",
                           "--min-devices", "2", *SHORT_ROUND, check=False, timeout=900)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{logs(coordinator, agents_)}"
    wait_page(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "tr[data-round][data-state=aggregated]"),
              "the aggregated round on the open rounds page")
    assert browser.execute_script("return window.__notReloaded === true;"), "the page was reloaded"
    with coordinator.registry() as reg:
        (job,) = reg.list_jobs()
        (rnd,) = reg.list_rounds(job.id)
        assert rnd.state is RoundState.AGGREGATED
        wire = sum(u.wire_bytes for u in reg.list_updates(job.id, 1))
        new_version = rnd.aggregated_version
    row = browser.find_element(By.CSS_SELECTOR, f"tr[data-round='{job.id}-r1']")
    cells = [c.text for c in row.find_elements(By.TAG_NAME, "td")]
    assert cells[2:4] == ["2", "2"], cells  # selected, reporting
    assert cells[4].startswith("0") and cells[5].startswith("0"), cells  # none dropped, none screened
    assert "→" in cells[6] and "%" in cells[6], cells  # local accuracy before -> after, from the agents
    assert cells[8].startswith(f"{wire} B" if wire < 1000 else f"{wire / 1e3:.1f} kB"), (cells, wire)
    assert cells[9].startswith("×") and cells[12] == new_version, cells
    wait_page(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".chart .main-svg"), "the plotly charts")
    shots.take("rounds")

    # the fleet: both agents, idle once their jobs are done, with board, engine and battery
    browser.get(url)
    for agent in agents_:
        wait_page(browser, lambda d, a=agent: d.find_elements(By.CSS_SELECTOR, f"tr[data-device='{a.id}'][data-state=idle]"),
                  f"{agent.id} idle in the fleet table")
    rows = browser.find_elements(By.CSS_SELECTOR, "#fleet tbody tr[data-device]")
    assert sorted(r.get_attribute("data-device") for r in rows) == sorted(a.id for a in agents_)
    first = browser.find_element(By.CSS_SELECTOR, f"tr[data-device='{agents_[0].id}']").text
    assert "agent0" in first and "90 %" in first and "Raspberry Pi 4" in first and "approved" in first, first
    assert browser.find_element(By.ID, "count-online").text == "2"
    shots.take("fleet")

    browser.get(url + "models")
    cells = [c.text for c in browser.find_elements(By.CSS_SELECTOR, f"tr[data-version='{new_version}'] td")]
    assert cells[1:5] == [new_version, "1", f"{job.id} r1", "head-only"], cells  # version, parent, lineage
    assert cells[8].startswith("2 / "), cells  # the two agents' updates
    shots.take("models")
    browser.get(url + f"device/{agents_[0].id}")
    assert f"{job.id}" in browser.find_element(By.ID, "joined").text
    wait_page(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".chart .main-svg")) >= 2, "the device's charts")
    battery = browser.find_element(By.ID, "battery-chart").get_attribute("data-title")
    assert "(0 samples)" not in battery and "samples)" in battery, battery  # its states, sampled over time
    plotted = browser.execute_script("var t = document.getElementById('battery-chart').data[0];"
                                     "return [t.x.length, t.x.every(Boolean), t.y.filter(v => v > 0).length];")
    assert plotted[0] >= 1 and plotted[1] and plotted[2] == plotted[0], plotted  # a time and a battery % each
    shots.take("device")

    # live: an agent stops (its goodbye says offline); its row turns offline without a reload
    browser.get(url)
    browser.execute_script("window.__notReloaded = true;")
    agents_[1].terminate()
    wait_page(browser, lambda d: d.find_elements(By.CSS_SELECTOR, f"tr[data-device='{agents_[1].id}'][data-state=offline]"),
              "the stopped agent offline on the open fleet page")
    assert browser.execute_script("return window.__notReloaded === true;"), "the page was reloaded"
    assert browser.find_element(By.ID, "count-online").text == "1"

    # a phone: the page fits the screen (the table scrolls inside its box)
    browser.set_window_size(390, 844)
    browser.get(url)
    assert browser.execute_script("return document.documentElement.scrollWidth <= window.innerWidth + 1;")
    shots.take("fleet-phone")
    assert js_errors(browser) == [], js_errors(browser)

    # nothing secret in any page; the UI never writes
    for path in ("", "rounds", "models", f"device/{agents_[0].id}"):
        status, body = fetch(url + path)
        assert status == 200 and "PRIVATE KEY" not in body
        assert (coordinator.state_dir / "keys" / "coordinator.key").read_text().strip()[-40:] not in body
    req = urllib.request.Request(url, method="POST", data=b"")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(req, timeout=60)
    assert refused.value.code == 405

    # a non-loopback bind: refused at startup without a token, and each request without it
    bad = coordinator.cli("serve", "--ui", "0.0.0.0:1", check=False, timeout=120)
    assert bad.returncode == 64 and "--ui-token" in bad.stderr, bad.stderr
    token = tmp_path / "ui-token"
    token.write_text("s3cret-token-" + "z" * 20 + "\n")
    exposed = start_ui(coordinator.state_dir, address="0.0.0.0:0", token_file=token)
    try:
        other = f"http://127.0.0.2:{exposed.port}/"
        assert fetch(other)[0] == 401
        status, body = fetch(other, {"Authorization": f"Bearer {token.read_text().strip()}"})
        assert status == 200 and agents_[0].id in body and "s3cret" not in body
    finally:
        exposed.close()
    assert coordinator.alive
