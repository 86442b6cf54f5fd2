"""The operators' assets: packaging/grafana/edge-fleet.json and packaging/prometheus/
edge-fleet-rules.yml. Every metric they name must be one the coordinator exports
(metrics.py), the rules must pass `promtool check rules` and their own `promtool test
rules` cases, and every dashboard query must be valid PromQL (checked by promtool as a
recording rule)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from edge_agent.coordinator.metrics import CoordinatorMetrics

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "packaging" / "grafana" / "edge-fleet.json"
RULES = REPO / "packaging" / "prometheus" / "edge-fleet-rules.yml"
RULE_TESTS = REPO / "packaging" / "prometheus" / "edge-fleet-rules.test.yml"
METRIC = re.compile(r"\bedge_coordinator_[a-z0-9_]+")
PROMTOOL = shutil.which("promtool")


def promtool() -> str:
    """Debian's promtool; missing software is a failure (.ci/run installs it), never a skip."""
    if PROMTOOL is None:
        pytest.fail("needs promtool: apt-get install prometheus (as .ci/run does)")
    return PROMTOOL


def exported_names() -> set[str]:
    m = CoordinatorMetrics()
    m.set_fleet(devices=3, rounds_open=1)
    m.set_devices_online(2)
    m.observe_update(wire_bytes=100, fp32_bytes=800, energy_wh=0.5)
    m.round_finished("aggregated")
    return {s.name for family in m.registry.collect() for s in family.samples}


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p["targets"]]


def test_every_metric_the_dashboard_and_rules_use_is_exported():
    exported = exported_names()
    used_by_dashboard = {n for e in dashboard_exprs() for n in METRIC.findall(e)}
    used_by_rules = set(METRIC.findall(RULES.read_text()))
    assert used_by_dashboard - exported == set() and used_by_rules - exported == set()
    # the figures: fleet size, online, rounds, bytes, energy, rejections
    for needed in ("edge_coordinator_devices", "edge_coordinator_devices_online", "edge_coordinator_rounds_total",
                   "edge_coordinator_update_bytes_received_total", "edge_coordinator_energy_wh_total",
                   "edge_coordinator_updates_total"):
        assert needed in used_by_dashboard, needed
    assert 'status="rejected"' in " ".join(dashboard_exprs())
    assert {"EdgeDevicesSilent", "EdgeRoundStalled", "EdgeUpdateRejectionSpike"} <= set(
        re.findall(r"alert: (\w+)", RULES.read_text()))


def test_the_dashboard_is_an_importable_grafana_dashboard():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
    assert [i["name"] for i in dash["__inputs"]] == ["DS_PROMETHEUS"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) >= 6
    for p in dash["panels"]:
        assert p["type"] in ("stat", "timeseries") and p["datasource"]["uid"] == "${DS_PROMETHEUS}"
        assert set(p["gridPos"]) == {"x", "y", "w", "h"} and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)) and all(t["expr"].strip() for t in p["targets"])


def test_promtool_accepts_the_rules_and_their_unit_tests_pass():
    check = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=120)
    assert check.returncode == 0 and "SUCCESS: 7 rules found" in check.stdout, check.stdout + check.stderr
    test = subprocess.run([promtool(), "test", "rules", str(RULE_TESTS)], capture_output=True, text=True, timeout=120,
                          cwd=RULE_TESTS.parent)
    assert test.returncode == 0 and "SUCCESS" in test.stdout, test.stdout + test.stderr


def test_every_dashboard_query_is_valid_promql(tmp_path):
    rules = ["groups:", "  - name: dashboard", "    rules:"]
    for i, expr in enumerate(dashboard_exprs()):
        rules += [f"      - record: dashboard:query{i}", f"        expr: {json.dumps(expr.replace('$instance', '.*'))}"]
    path = tmp_path / "dashboard-queries.yml"
    path.write_text("\n".join(rules) + "\n")
    check = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr
    broken = tmp_path / "broken.yml"  # the check does catch a bad query
    broken.write_text('groups:\n  - name: x\n    rules:\n      - record: x:y\n        expr: "sum(rate(x[5m]"\n')
    assert subprocess.run([promtool(), "check", "rules", str(broken)], capture_output=True, timeout=120).returncode != 0
