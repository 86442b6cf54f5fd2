"""Prometheus metrics: scraped from the real HTTP endpoint on 127.0.0.1."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from edge_agent.coordinator.metrics import CoordinatorMetrics, MetricsServer


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.fixture
def served() -> tuple[CoordinatorMetrics, MetricsServer]:
    metrics = CoordinatorMetrics()
    server = metrics.serve(port=0)
    try:
        yield metrics, server
    finally:
        server.close()


def test_scrape_reports_what_was_observed(served: tuple) -> None:
    metrics, server = served
    assert server.address == "127.0.0.1" and server.port > 0
    before = scrape(server.url)
    assert before[("edge_coordinator_rounds_total", (("status", "failed"),))] == 0  # exported from the start
    metrics.set_devices_online(7)
    metrics.round_finished("aggregated")
    metrics.round_finished("aggregated")
    metrics.round_finished("failed")
    metrics.observe_update(wire_bytes=1000, fp32_bytes=12000, energy_wh=0.75)
    metrics.observe_update(wire_bytes=500, fp32_bytes=1000, energy_wh=None, status="rejected")
    got = scrape(server.url)
    assert got[("edge_coordinator_devices_online", ())] == 7
    assert got[("edge_coordinator_rounds_total", (("status", "aggregated"),))] == 2
    assert got[("edge_coordinator_rounds_total", (("status", "failed"),))] == 1
    assert got[("edge_coordinator_updates_total", (("status", "rejected"),))] == 1
    assert got[("edge_coordinator_update_bytes_received_total", ())] == 1500
    assert got[("edge_coordinator_update_fp32_bytes_total", ())] == 13000
    assert got[("edge_coordinator_energy_wh_total", ())] == pytest.approx(0.75)
    assert got[("edge_coordinator_update_compression_ratio_count", ())] == 2
    assert got[("edge_coordinator_update_compression_ratio_sum", ())] == pytest.approx(14.0)
    # ratio 12 falls in the 16 bucket, ratio 2 already in the 2 bucket
    assert got[("edge_coordinator_update_compression_ratio_bucket", (("le", "2.0"),))] == 1
    assert got[("edge_coordinator_update_compression_ratio_bucket", (("le", "16.0"),))] == 2


def test_the_inbox_and_its_drops_by_reason(served: tuple) -> None:
    metrics, server = served
    assert scrape(server.url)[("edge_coordinator_mqtt_dropped_total", (("reason", "inbox_full_signed"),))] == 0
    metrics.observe_inbox({"dropped_resend_full": 40, "dropped_inbox_full": 5, "received": 900}, 1200)
    metrics.observe_inbox({"dropped_resend_full": 100, "dropped_inbox_full": 5, "dropped_priority_full": 2}, 7)
    got = scrape(server.url)
    assert got[("edge_coordinator_inbox_messages", ())] == 7
    assert got[("edge_coordinator_mqtt_dropped_total", (("reason", "inbox_full_resendable"),))] == 100
    assert got[("edge_coordinator_mqtt_dropped_total", (("reason", "inbox_full_unverified"),))] == 5
    assert got[("edge_coordinator_mqtt_dropped_total", (("reason", "inbox_full_signed"),))] == 2
    metrics.observe_inbox({"dropped_resend_full": 3}, 0)  # a new client (reconnected serve): counts from 0
    metrics.observe_inbox({"dropped_resend_full": 10}, 0)
    assert scrape(server.url)[("edge_coordinator_mqtt_dropped_total", (("reason", "inbox_full_resendable"),))] == 107


def test_registry_is_private_and_instances_do_not_collide() -> None:
    a, b = CoordinatorMetrics(), CoordinatorMetrics()
    a.set_devices_online(3)
    assert b.registry.get_sample_value("edge_coordinator_devices_online") == 0
    assert a.registry.get_sample_value("edge_coordinator_devices_online") == 3
    assert REGISTRY.get_sample_value("edge_coordinator_devices_online") is None


def test_server_stops_on_close() -> None:
    server = CoordinatorMetrics().serve(port=0)
    url = server.url
    scrape(url)
    server.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=2)


@pytest.mark.parametrize("kwargs", [{"port": -1}, {"port": 70000}, {"port": True},
                                    {"port": 0, "address": "localhost; rm -rf"}])
def test_bad_server_arguments(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        CoordinatorMetrics().serve(**kwargs)


def test_bad_observations_are_refused() -> None:
    m = CoordinatorMetrics()
    for call in (lambda: m.round_finished("exploded"), lambda: m.set_devices_online(-1),
                 lambda: m.observe_update(wire_bytes=-1, fp32_bytes=1),
                 lambda: m.observe_update(wire_bytes=1, fp32_bytes=1, status="maybe")):
        with pytest.raises(ValueError):
            call()
    m.observe_update(wire_bytes=1, fp32_bytes=4, energy_wh=float("nan"))  # a NaN energy is ignored
    assert m.registry.get_sample_value("edge_coordinator_energy_wh_total") == 0
