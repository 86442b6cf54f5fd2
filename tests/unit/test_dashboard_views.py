"""The dashboard over a registry filled directly: its views, its pages served by a real
uvicorn on loopback (read-only, GET only, security headers, the token), and the fleet
page's render time with 1,000 devices."""

from __future__ import annotations

import base64
import json
import statistics
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from edge_agent.coordinator.records import (
    JobStatus,
    ModelVersion,
    ParticipantStatus,
    RoundState,
    UpdateStatus,
)
from edge_agent.coordinator.registry import Registry
from edge_agent.coordinator.rounds import RoundPolicy
from edge_agent.dashboard import views
from edge_agent.dashboard.server import check_ui_options, start_ui
from edge_agent.errors import ConfigError, InputError, UsageError
from edge_agent.keys import fingerprint, generate_private_key, public_key_bytes

NOW = time.time()
HEAD = {"dense0_weight": np.zeros((2, 3), np.float32)}


@pytest.fixture(autouse=True)
def _fresh_now() -> None:
    """Records are stamped relative to NOW and the served pages judge them by the real clock:
    take NOW as each test starts, not at import (a long suite on one core reaches this file
    minutes after collecting it, and "online" devices would have gone stale)."""
    global NOW
    NOW = time.time()


def new_device(reg: Registry, name: str, *, battery: float | None, status: str = "idle", approved: bool = True,
               online: bool = True) -> str:
    key = generate_private_key()
    dev = fingerprint(key)
    reg.enrol_device(device_id=dev, public_key=base64.b64encode(public_key_bytes(key)).decode(), fleet="default",
                     board="Raspberry Pi 4 Model B", profile="rpi4", engine="native", approved=approved, now=NOW - 60)
    state = {"name": name, "status": status, "battery_pct": battery, "on_power": battery is None}
    if status == "busy":
        state.update(job_phase="training", job_pct=40.0)
    reg.record_state(dev, online=online, state=state, now=NOW - 5)
    return dev


def fill(reg: Registry) -> dict[str, str]:
    """Three devices, a model, a job with one aggregated round (one accepted update, one
    screened out, one refusal) and its new head-only version."""
    ids = {name: new_device(reg, name, battery=b, status=s) for name, b, s in
           (("pi-a", 81.0, "idle"), ("pi-b", 35.0, "busy"), ("pi-c", None, "idle"))}
    ids["pi-d"] = new_device(reg, "pi-d", battery=50.0, approved=False)
    reg.add_model_version(name="digits", version="1", head=HEAD, metrics={"archive_sha256": "ab" * 32,
                                                                          "archive_bytes": 123_456}, now=NOW - 500)
    reg.create_job(job_id="job1", model_name="digits", model_version="1", selector="all", rounds=2, min_devices=1,
                   deadline_s=60, params={"budget_wh": 0.5}, now=NOW - 400)
    reg.set_job_status("job1", JobStatus.RUNNING, now=NOW - 400)
    reg.open_round(job_id="job1", number=1, base_version="1", devices=[ids["pi-a"], ids["pi-b"], ids["pi-c"]],
                   deadline_at=NOW + 60, now=NOW - 300)
    for i, (name, status) in enumerate((("pi-a", UpdateStatus.PENDING), ("pi-b", UpdateStatus.PENDING))):
        reg.add_update(job_id="job1", device_id=ids[name], round=1, num_samples=100, wire_bytes=400 + i,
                       fp32_bytes=4000, sha256=f"{i}" * 64, deltas=HEAD, status=status, energy_wh=0.125,
                       metrics={"accuracy_before": 0.5, "accuracy_after": 0.75 + 0.1 * i}, now=NOW - 200)
    reg.set_participant("job1", 1, ids["pi-c"], ParticipantStatus.DROPPED, "refused:battery_low", now=NOW - 250)
    reg.begin_closing("job1", 1, now=NOW - 100)
    rel, sha = reg.write_head("digits", "job1-r1", HEAD)  # the round's new version, as RoundEngine makes it
    new = ModelVersion(name="digits", version="job1-r1", parent="1", created_at=NOW - 90, bundle_path=None,
                       head_path=rel, head_sha256=sha, head_only=True, metrics={"updates": 1, "samples": 100},
                       job_id="job1", round=1)
    reg.finish_round("job1", 1, state=RoundState.AGGREGATED, new_version=new, now=NOW - 90,
                     verdicts={ids["pi-a"]: (UpdateStatus.ACCEPTED, ""),
                               ids["pi-b"]: (UpdateStatus.REJECTED, "norm 9.1 above the median's 3x")})
    return ids


@pytest.fixture()
def filled(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    with Registry(state_dir=tmp_path / "coord") as reg:
        ids = fill(reg)
        (tmp_path / "coord" / "keys").mkdir()
        (tmp_path / "coord" / "keys" / "coordinator.key").write_text("SECRET-PRIVATE-KEY-MATERIAL\n")
    return tmp_path / "coord", ids


def test_views_show_states_rounds_and_models_from_the_registry(filled):
    state_dir, ids = filled
    with Registry(state_dir=state_dir, read_only=True) as reg:
        fleet = views.fleet(reg, policy=RoundPolicy(), now=NOW)
        states = {r["name"]: r["state"] for r in fleet["rows"]}
        assert states == {"pi-a": "idle", "pi-b": "training", "pi-c": "idle", "pi-d": "pending"}
        assert list(states) == ["pi-a", "pi-b", "pi-c", "pi-d"]  # by name unless told otherwise
        assert fleet["counts"] == {"devices": 4, "online": 4, "training": 1, "pending": 1}
        a = next(r for r in fleet["rows"] if r["name"] == "pi-a")
        # the update's energy was recorded at NOW - 200 s: yesterday's, when the test runs just after midnight
        today = 0.125 if views.start_of_day(NOW) <= NOW - 200 else None
        assert (a["battery"], a["power"], a["energy_today"], a["budget"]) == (81.0, "battery", today, 0.5)
        by_battery = views.fleet(reg, policy=RoundPolicy(), now=NOW, sort="battery", desc=True)["rows"]
        assert [r["name"] for r in by_battery] == ["pi-a", "pi-d", "pi-b", "pi-c"]  # no battery sorts last
        assert [r["name"] for r in views.fleet(reg, policy=RoundPolicy(), now=NOW, state="training")["rows"]] == ["pi-b"]
        assert [r["name"] for r in views.fleet(reg, policy=RoundPolicy(), now=NOW, q="PI-C")["rows"]] == ["pi-c"]

        rnd = views.rounds(reg)["jobs"][0]["rounds"][0]
        assert (len(rnd["selected"]), len(rnd["reported"]), rnd["dropouts"]) == (3, 2, {ids["pi-c"]: "refused:battery_low"})
        assert rnd["screened"] == {ids["pi-b"]: "norm 9.1 above the median's 3x"}
        assert rnd["acc_before"] == pytest.approx(0.5) and rnd["acc_after"] == pytest.approx(0.8)
        assert rnd["wire_bytes"] == 801 and rnd["compression"] == pytest.approx(8000 / 801, abs=0.01)

        models = {m["version"]: m for m in views.models(reg)}
        assert models["1"]["archive_bytes"] == 123_456 and models["job1-r1"]["parent"] == "1"
        assert (models["job1-r1"]["job"], models["job1-r1"]["round"]) == ("job1", 1)

        dev = views.device(reg, ids["pi-c"], policy=RoundPolicy(), now=NOW)
        assert [(p["job_id"], p["round"], p["reason"]) for p in dev["refusals"]] == [("job1", 1, "refused:battery_low")]
        with pytest.raises(InputError, match="no such|unknown|not"):
            views.device(reg, "nosuchdevice", policy=RoundPolicy(), now=NOW)


def test_battery_and_power_history_is_sampled_bounded_and_shown(tmp_path):
    with Registry(state_dir=tmp_path / "coord") as reg:
        dev = new_device(reg, "pi-h", battery=90.0)  # its first state: a sample at NOW - 5
        for dt, pct, watts in ((100, 80.0, 4.5), (110, 79.0, 4.4), (1900, 70.0, 5.2)):
            reg.record_state(dev, online=True, state={"battery_pct": pct, "power_w": watts}, now=NOW + dt)
        reg.record_state(dev, online=True, state={"job_phase": "training"}, now=NOW + 5000)  # no battery news

        def samples() -> list[tuple[float, float | None, float | None]]:
            return [(s["at"] - NOW, s["battery_pct"], s["power_w"]) for s in reg.device_history(dev, since=0)]

        # within a minute of the previous sample: skipped; a state without battery or power: none
        assert samples() == [(-5, 90.0, None), (100, 80.0, 4.5), (1900, 70.0, 5.2)]
        week = 7 * 86400
        reg.record_state(dev, online=True, state={"battery_pct": 60.0}, now=NOW + week + 150)
        assert samples() == [(1900, 70.0, 5.2), (week + 150, 60.0, 5.2)]  # older than a week: dropped
    with Registry(state_dir=tmp_path / "coord", read_only=True) as reg:
        page = views.device(reg, dev, policy=RoundPolicy(), now=NOW + week + 200)
        assert [s["battery_pct"] for s in page["samples"]] == [60.0]  # the last day only


@pytest.mark.sqlite_only("a registry found by --state-dir (test_registry_pg.py: read-only on PostgreSQL)")
def test_the_read_only_registry_cannot_write(filled):
    state_dir, ids = filled
    with Registry(state_dir=state_dir, read_only=True) as reg, pytest.raises(Exception, match="readonly|read-only"):
        reg.set_approved(ids["pi-d"], True)
    with pytest.raises(ConfigError):
        Registry(state_dir=state_dir.parent / "nothing-here", read_only=True)
    assert not (state_dir.parent / "nothing-here").exists()


def get(url: str, *, method: str = "GET", headers: dict[str, str] | None = None) -> tuple[int, dict, str]:
    req = urllib.request.Request(url, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read().decode()


def test_pages_are_served_read_only_with_security_headers_and_no_secrets(filled):
    state_dir, ids = filled
    ui = start_ui(state_dir, address="127.0.0.1:0")
    try:
        pages = {}
        for path in ("/", f"/device/{ids['pi-c']}", "/rounds", "/models", "/api/fleet.json", "/api/rounds.json"):
            status, headers, body = get(ui.url.rstrip("/") + path)
            assert status == 200, (path, body[:300])
            assert "script-src 'self'" in headers["content-security-policy"] and headers["x-content-type-options"] == "nosniff"
            assert "SECRET-PRIVATE-KEY" not in body and "PRIVATE KEY" not in body
            pages[path] = body
        assert "pi-b" in pages["/"] and 'data-state="training"' in pages["/"] and "<script>" not in pages["/"]
        assert "refused:battery_low" in pages[f"/device/{ids['pi-c']}"]
        assert "norm 9.1 above the median" in pages["/rounds"] and "job1-r1" in pages["/models"]
        assert json.loads(pages["/api/fleet.json"])["counts"]["devices"] == 4
        status, headers, js = get(ui.url + "static/plotly.min.js")
        assert status == 200 and "javascript" in headers["content-type"] and len(js) > 1_000_000
        for method in ("POST", "PUT", "DELETE", "PATCH"):  # read-only: no route accepts a write
            assert get(ui.url, method=method)[0] == 405
            assert get(ui.url + "api/fleet.json", method=method)[0] == 405
        assert get(ui.url + "device/..%2F..%2Fetc")[0] in (400, 404)
        # DNS rebinding: a page on another name resolved to 127.0.0.1 gets nothing
        assert get(ui.url, headers={"Host": f"evil.example:{ui.port}"})[0] == 421
        assert get(ui.url, headers={"Host": f"localhost:{ui.port}"})[0] == 200
    finally:
        ui.close()


def test_a_non_loopback_bind_needs_a_token_and_every_request_must_carry_it(filled, tmp_path):
    state_dir, _ = filled
    with pytest.raises(UsageError, match="needs --ui-token"):
        check_ui_options("0.0.0.0:0", None)
    for bad in ("nonsense", "127.0.0.1", "example.org:80", "127.0.0.1:99999"):
        with pytest.raises(UsageError):
            check_ui_options(bad, None)
    short = tmp_path / "short"
    short.write_text("abc\n")
    with pytest.raises(UsageError, match="at least 16"):
        check_ui_options("0.0.0.0:0", short)
    token = "t0ken-" + "x" * 26
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    ui = start_ui(state_dir, address="0.0.0.0:0", token_file=token_file)
    try:
        url = f"http://127.0.0.2:{ui.port}/"  # a loopback peer, but the bind is not loopback: token needed
        status, headers, body = get(url)
        assert status == 401 and "Basic" in headers["www-authenticate"]
        assert get(url, headers={"Authorization": "Bearer wrong-token-wrong-token"})[0] == 401
        status, _, body = get(url, headers={"Authorization": f"Bearer {token}"})
        assert status == 200 and "pi-a" in body and token not in body
        basic = base64.b64encode(f"operator:{token}".encode()).decode()
        assert get(url + "rounds", headers={"Authorization": f"Basic {basic}"})[0] == 200
        assert get(url, method="POST", headers={"Authorization": f"Bearer {token}"})[0] == 405
    finally:
        ui.close()


def _fleet_of(state_dir: Path, n: int) -> None:
    with Registry(state_dir=state_dir) as reg:
        key = generate_private_key()
        pub = base64.b64encode(public_key_bytes(key)).decode()
        # n rows written in one transaction (enrol_device checks each key: slow to do 1,000 times)
        with reg.db.tx() as db:
            for i in range(n):
                state = json.dumps({"name": f"pi-{i:04d}", "status": "idle", "battery_pct": i % 100, "on_power": False})
                db.execute("INSERT INTO devices (id, fleet, public_key, enrolled_at, approved, tags, board, profile, "
                           "engine, state, last_seen, online) VALUES (?, 'default', ?, ?, 1, '[]', 'Raspberry Pi 4', "
                           "'rpi4', 'native', ?, ?, 1)", (f"dev{i:05d}", f"{pub}#{i}", NOW, state, NOW - i))


@pytest.mark.sqlite_only("counts statements through sqlite3's trace callback")
def test_the_fleet_page_costs_the_same_queries_for_1000_devices_as_for_10(tmp_path):
    """The page's cost does not grow a query per device (its time depends on the machine, the
    statement count does not); the 1,000-device page is served whole, its time printed."""
    statements = {}
    for n in (10, 1000):
        _fleet_of(tmp_path / f"coord{n}", n)
        with Registry(state_dir=tmp_path / f"coord{n}") as reg:
            seen: list[str] = []
            reg.db.conn.set_trace_callback(seen.append)
            data = views.fleet(reg, policy=RoundPolicy(), now=NOW)
            reg.db.conn.set_trace_callback(None)
        assert len(data["rows"]) == n and data["counts"]["devices"] == n
        statements[n] = len(seen)
    assert statements[1000] == statements[10], statements
    ui = start_ui(tmp_path / "coord1000", address="127.0.0.1:0")
    try:
        took = []
        for _ in range(3):
            status, headers, body = get(ui.url)
            assert status == 200 and body.count("<tr data-device=") == 1000
            took.append(float(headers["server-timing"].split("dur=")[1]) / 1000)
        print(f"fleet page, 1,000 devices: server render median {statistics.median(took) * 1000:.0f} ms")
    finally:
        ui.close()
