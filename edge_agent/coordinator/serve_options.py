"""What `edge-coordinator serve` runs with (broker, fleet, state, rounds, retention, a
workers group), checked when made: the Coordinator (service.py) takes one of these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError
from ..protocol import DEFAULT_PREFIX, Topics
from ..transport import TlsConfig
from .retention import RetentionPolicy
from .rounds import RoundPolicy
from .workers import GROUP_RE, check_group


@dataclass(frozen=True, kw_only=True)
class ServeOptions:
    state_dir: Path
    db: str | None = None  # a postgresql:// URL, "sqlite", or None: $EDGE_COORDINATOR_DB, else SQLite (db.resolve)
    host: str = "127.0.0.1"
    port: int = 1883
    fleet: str = "default"
    topic_prefix: str = DEFAULT_PREFIX
    tls: TlsConfig | None = None
    username: str | None = None
    password: str | None = None
    client_id: str | None = None  # default edge-coordinator-<fleet>: fixed, so the broker queues for us
    auto_approve: bool = False
    tick_s: float = 1.0
    policy: RoundPolicy = field(default_factory=RoundPolicy)
    metrics_port: int | None = None
    metrics_addr: str = "127.0.0.1"
    keepalive: int = 30
    backoff_base: float = 0.5
    backoff_cap: float = 30.0
    ack_interval: float = 5.0  # at most one ack per repeated upload per this many seconds
    model_chunk_bytes: int = 64 * 1024
    retention: RetentionPolicy = field(default_factory=RetentionPolicy)  # what is kept (retention.py)
    workers_group: str | None = None  # one of several workers on a PostgreSQL registry (workers.py)
    worker_id: str | None = None  # default <host>-<pid>; its MQTT client id and its lock in state_dir
    silence_s: float = 600.0  # connected this long without one device message: a `status` problem (link_health.py)

    def __post_init__(self) -> None:
        Topics(fleet=self.fleet, prefix=self.topic_prefix)  # validates both
        if self.workers_group is not None:
            check_group(self.workers_group)
        if self.worker_id is not None and not GROUP_RE.fullmatch(self.worker_id):
            raise ConfigError(f"--worker-id {self.worker_id[:80]!r}: 1-64 letters, digits, '_' or '-'")
        if not 0.05 <= self.tick_s <= 60:
            raise ValueError(f"tick_s must be in [0.05, 60], got {self.tick_s}")
        if not 0 < self.port < 65536:
            raise ValueError(f"bad broker port {self.port}")
