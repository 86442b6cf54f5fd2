"""Prometheus metrics of the coordinator, on a private registry and a loopback HTTP port.

    edge_coordinator_devices                          gauge (devices enrolled: the fleet's size)
    edge_coordinator_devices_online                   gauge
    edge_coordinator_rounds_open                      gauge (rounds open or closing)
    edge_coordinator_rounds_total{status}             counter (aggregated, failed, cancelled)
    edge_coordinator_updates_total{status}            counter (accepted = stored, rejected)
    edge_coordinator_update_bytes_received_total      counter (bytes on the wire)
    edge_coordinator_update_fp32_bytes_total          counter (what the same deltas weigh dense)
    edge_coordinator_update_compression_ratio         histogram (fp32 bytes / wire bytes)
    edge_coordinator_energy_wh_total                  counter (energy devices reported spending)
    edge_coordinator_inbox_messages                   gauge (received from the broker, not yet handled)
    edge_coordinator_mqtt_dropped_total{reason}       counter (received and dropped before handling:
                                                      inbox_full_unverified, inbox_full_resendable,
                                                      inbox_full_signed, oversize, over_device_budget)

A private `CollectorRegistry` (never the global one) so that several coordinators, or
tests, in one process do not collide, and importing this module registers nothing. The
HTTP endpoint binds 127.0.0.1 unless told otherwise: expose it through a reverse proxy or
an explicit `--metrics-addr`, not by accident. Counters restart at zero with the process;
Prometheus' rate() handles that.
"""

from __future__ import annotations

import ipaddress
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

RATIO_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, math.inf)
ROUND_STATUSES = ("aggregated", "failed", "cancelled")
# MqttClient's drop counters -> the reason label. A full inbox drops junk first, then what
# devices resend (update chunks, states: a delay), signed one-shot reports last (a loss).
MQTT_DROPS = {"dropped_inbox_full": "inbox_full_unverified", "dropped_resend_full": "inbox_full_resendable",
              "dropped_priority_full": "inbox_full_signed", "dropped_oversize": "oversize",
              "dropped_admit": "over_device_budget"}
UPDATE_STATUSES = ("accepted", "rejected")
STALENESS_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64)


@dataclass
class MetricsServer:
    """A running metrics endpoint; `close()` stops it."""

    address: str
    port: int
    _server: Any
    _thread: threading.Thread

    @property
    def url(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


class CoordinatorMetrics:
    def __init__(self, *, namespace: str = "edge_coordinator", registry: CollectorRegistry | None = None) -> None:
        if not namespace.replace("_", "").isalnum() or not namespace[0].isalpha():
            raise ValueError(f"namespace must be [A-Za-z][A-Za-z0-9_]*, got {namespace!r}")
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        common: dict[str, Any] = {"namespace": namespace, "registry": self.registry}
        self.devices_online = Gauge("devices_online", "Approved and unapproved devices heard from recently", **common)
        self.devices = Gauge("devices", "Devices enrolled (approved or pending): the fleet's size", **common)
        self.rounds_open = Gauge("rounds_open", "Rounds open or closing", **common)
        self.rounds = Counter("rounds", "Rounds finished, by final status", ["status"], **common)
        self.updates = Counter("updates", "Updates received, by status at receipt", ["status"], **common)
        self.bytes_received = Counter("update_bytes_received", "Update payload bytes received", **common)
        self.fp32_bytes = Counter("update_fp32_bytes", "Dense float32 size of the received updates", **common)
        self.compression_ratio = Histogram("update_compression_ratio", "fp32 bytes / wire bytes per update",
                                           buckets=RATIO_BUCKETS, **common)
        self.staleness = Histogram("update_staleness", "Versions published since an asynchronous job's accepted "
                                   "update's base (0: current)", buckets=STALENESS_BUCKETS, **common)
        self.stale_refused = Counter("updates_stale", "Asynchronous updates refused as more than max_staleness "
                                     "versions old", **common)
        self.energy_wh = Counter("energy_wh", "Energy devices reported spending on fine-tuning (Wh)", **common)
        self.inbox = Gauge("inbox_messages", "Messages received from the broker and not yet handled", **common)
        self.mqtt_dropped = Counter("mqtt_dropped", "Messages received and dropped before handling, by why",
                                    ["reason"], **common)
        self._drops_seen: dict[str, int] = {}
        for reason in MQTT_DROPS.values():
            self.mqtt_dropped.labels(reason=reason)
        for status in ROUND_STATUSES:  # exported at 0 from the start, so rate() works at once
            self.rounds.labels(status=status)
        for status in UPDATE_STATUSES:
            self.updates.labels(status=status)

    def set_devices_online(self, count: int) -> None:
        if count < 0:
            raise ValueError(f"devices online cannot be negative ({count})")
        self.devices_online.set(count)

    def set_fleet(self, *, devices: int, rounds_open: int) -> None:
        if devices < 0 or rounds_open < 0:
            raise ValueError(f"counts cannot be negative ({devices}, {rounds_open})")
        self.devices.set(devices)
        self.rounds_open.set(rounds_open)

    def round_finished(self, status: str) -> None:
        if status not in ROUND_STATUSES:
            raise ValueError(f"round status must be one of {ROUND_STATUSES}, got {status!r}")
        self.rounds.labels(status=status).inc()

    def observe_update(self, *, wire_bytes: int, fp32_bytes: int, energy_wh: float | None = None,
                       status: str = "accepted") -> None:
        """Count one stored update (its bytes, compression ratio and reported energy)."""
        if status not in UPDATE_STATUSES:
            raise ValueError(f"update status must be one of {UPDATE_STATUSES}, got {status!r}")
        if wire_bytes < 0 or fp32_bytes < 0:
            raise ValueError("byte counts cannot be negative")
        self.updates.labels(status=status).inc()
        self.bytes_received.inc(wire_bytes)
        self.fp32_bytes.inc(fp32_bytes)
        if wire_bytes > 0 and fp32_bytes > 0:
            self.compression_ratio.observe(fp32_bytes / wire_bytes)
        if energy_wh is not None and math.isfinite(energy_wh) and energy_wh > 0:
            self.energy_wh.inc(energy_wh)

    def observe_staleness(self, staleness: int | None) -> None:
        """An asynchronous update: accepted `staleness` versions behind, or (None) refused as stale."""
        if staleness is None:
            self.stale_refused.inc()
        elif staleness < 0:
            raise ValueError(f"staleness cannot be negative ({staleness})")
        else:
            self.staleness.observe(staleness)

    def observe_inbox(self, stats: Mapping[str, int], pending: int) -> None:
        """The MQTT client's inbox: its length now, and what it dropped since the last call
        (`stats`: MqttClient.stats, cumulative; a smaller count is a new client: its base)."""
        self.inbox.set(max(0, int(pending)))
        for stat, reason in MQTT_DROPS.items():
            count = int(stats.get(stat, 0))
            if count > self._drops_seen.get(stat, 0):
                self.mqtt_dropped.labels(reason=reason).inc(count - self._drops_seen.get(stat, 0))
            self._drops_seen[stat] = count

    def serve(self, *, port: int, address: str = "127.0.0.1") -> MetricsServer:
        """Serve /metrics on `address`:`port` (0: any free port) in a daemon thread."""
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an integer in 0..65535, got {port!r}")
        try:
            ipaddress.ip_address(address)
        except ValueError:
            raise ValueError(f"address must be an IP address (e.g. 127.0.0.1), got {address!r}") from None
        started = start_http_server(port, addr=address, registry=self.registry)
        if started is None:  # prometheus-client < 0.20 returns nothing: no way to stop it
            raise RuntimeError("prometheus-client >= 0.20 is needed (start_http_server must return the server)")
        server, thread = started
        return MetricsServer(address, int(server.server_address[1]), server, thread)
