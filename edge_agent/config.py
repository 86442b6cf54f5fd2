"""The agent's configuration: `/etc/edge-agent/agent.toml` merged over its board profile.

The board profile supplies the hardware facts and defaults (power model, thermal limit,
int8 engine order, budgets); agent.toml supplies the device's identity, its broker and
coordinator, and any override of the profile's `[budget]`, `[thermal]`, `[training]` and
`[int8]` tables. Errors are `file:line: key: message` and exit with EXIT_CONFIG (78), which
the systemd unit does not restart on.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .hardware import profiles as board_profiles
from .tomlschema import (
    Field,
    Reporter,
    Schema,
    check_required,
    check_tables,
    merge_tables,
    number,
    read_toml,
)

DEFAULT_CONFIG_PATH = Path("/etc/edge-agent/agent.toml")
DEFAULT_STATE_DIR = Path("/var/lib/edge-agent")
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")  # safe inside an MQTT topic level

# Tables the agent owns; the profile tables below may be overridden here too.
AGENT_SCHEMA: Schema = {
    "device": {
        "id": Field(str, required=True, max_length=64),
        "fleet": Field(str, max_length=64),
        "state_dir": Field(str),
        "key_file": Field(str),
        "profile": Field(str, max_length=64),  # "auto" (default) or a profile name
        "sysfs_root": Field(str),  # "/" on a device; a fixture tree in tests and the demo
        "tags": Field(list, items=str),
    },
    "broker": {
        "host": Field(str, required=True, max_length=253),
        "port": Field(int, minimum=1, maximum=65535),
        "tls": Field(bool),
        "ca_file": Field(str),
        "cert_file": Field(str),
        "key_file": Field(str),
        "username": Field(str, max_length=128),
        "password_file": Field(str),
        "keepalive_s": Field(int, minimum=5, maximum=3600),
        "max_message_bytes": Field(int, minimum=4096, maximum=256 * 1024 * 1024),
    },
    "coordinator": {
        "public_key": Field(str, required=True, max_length=200),  # base64 Ed25519
    },
    "policy": {
        "accept_finetune": Field(bool),
        "min_battery_pct": number(0, 100),
        "max_jobs_per_day": Field(int, minimum=0, maximum=1000),
    },
    "data": {
        "dir": Field(str),
        "cache_mb": Field(int, minimum=1, maximum=1 << 20),
    },
    "service": {
        "state_interval_s": number(1, 86400),
        "memory_max_mb": Field(int, minimum=64, maximum=1 << 20),
        "cpu_quota_pct": Field(int, minimum=5, maximum=100 * 256),
    },
}
_OVERRIDABLE = ("budget", "thermal", "training", "int8")
SCHEMA: Schema = {**AGENT_SCHEMA, **{t: board_profiles.SCHEMA[t] for t in _OVERRIDABLE}}

DEFAULTS: dict[str, dict[str, Any]] = {
    "device": {"fleet": "default", "profile": "auto", "sysfs_root": "/",
               "state_dir": str(DEFAULT_STATE_DIR), "tags": []},
    "broker": {"port": 1883, "tls": False, "keepalive_s": 60, "max_message_bytes": 128 * 1024},
    "policy": {"accept_finetune": True, "min_battery_pct": 40.0, "max_jobs_per_day": 24},
    "data": {"cache_mb": 256},
    "service": {"state_interval_s": 60.0},
}


@dataclass
class AgentConfig:
    path: str
    data: dict[str, dict[str, Any]]  # agent tables + the profile's tables, merged
    profile: board_profiles.Profile | None

    def get(self, table: str, key: str, default: Any = None) -> Any:
        return self.data.get(table, {}).get(key, default)

    @property
    def device_id(self) -> str:
        return self.data["device"]["id"]

    @property
    def fleet(self) -> str:
        return self.data["device"]["fleet"]

    @property
    def state_dir(self) -> Path:
        return Path(self.data["device"]["state_dir"])

    @property
    def key_file(self) -> Path:
        return Path(self.data["device"].get("key_file") or self.state_dir / "device.key")


def default_device_id() -> str:
    """A topic-safe id from the hostname (the user can set any id in agent.toml)."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname())[:64].strip("-.") or "device"
    return name if _ID_RE.match(name) else "device"


def _check_semantics(report: Reporter, merged: dict[str, Any]) -> None:
    for table, key in (("device", "id"), ("device", "fleet")):
        value = merged.get(table, {}).get(key)
        if isinstance(value, str) and not _ID_RE.match(value):
            report.error(table, key, "use letters, digits, '.', '_' or '-' (max 64; no '/', '+', '#')")
    broker = merged.get("broker", {})
    if broker.get("tls") is False and (broker.get("cert_file") or broker.get("ca_file")):
        report.error("broker", "tls", "certificate files are set but tls = false")
    if bool(broker.get("cert_file")) != bool(broker.get("key_file")):
        report.error("broker", "cert_file", "cert_file and key_file go together (client certificate)")
    budget = merged.get("budget", {})
    if {"battery_floor_pct", "battery_resume_pct"} <= budget.keys() and \
            budget["battery_resume_pct"] <= budget["battery_floor_pct"]:
        report.error("budget", "battery_resume_pct",
                     f"must exceed battery_floor_pct ({budget['battery_floor_pct']})")


def load_config(path: str | Path = DEFAULT_CONFIG_PATH, *, probe_report: dict[str, Any] | None = None,
                profiles_directory: Path | None = None) -> AgentConfig:
    """Load, validate and merge agent.toml over its board profile; raise ConfigError listing
    every problem as `file:line: key: message`."""
    path = Path(path)
    data, text, errors = read_toml(path)
    if data is None:
        raise ConfigError("\n".join(errors))
    report = Reporter(path, text)
    check_tables(report, data, SCHEMA)
    merged_agent = merge_tables(DEFAULTS, data)
    check_required(report, merged_agent, AGENT_SCHEMA)
    if report.errors:
        raise ConfigError("\n".join(report.errors))
    _check_semantics(report, merged_agent)
    if report.errors:
        raise ConfigError("\n".join(report.errors))

    loaded = board_profiles.load_profiles(directory=profiles_directory)
    wanted = merged_agent["device"]["profile"]
    profile: board_profiles.Profile | None
    if wanted == "auto":
        if probe_report is None:
            from .hardware.probe import probe

            probe_report = probe(merged_agent["device"]["sysfs_root"], profiles_directory=profiles_directory)
        profile = board_profiles.match_profile(probe_report, loaded.profiles).profile
    else:
        profile = loaded.profiles.get(wanted)
        if profile is None:
            report.error("device", "profile", f"no profile named {wanted!r} "
                         f"(known: {', '.join(sorted(loaded.profiles))})")
            raise ConfigError("\n".join(report.errors + loaded.errors))
    base = profile.data if profile else {}
    merged = merge_tables(base, merged_agent)
    return AgentConfig(path=str(path), data=merged, profile=profile)


def render_config(*, device_id: str, fleet: str, broker_host: str, broker_port: int,
                  coordinator_public_key: str, state_dir: Path, profile: str = "auto",
                  tls: bool = False, sysfs_root: str = "/") -> str:
    """A commented agent.toml for `edge-agent init`."""
    return f"""# edge-agent configuration. Overrides the board profile's [budget], [thermal],
# [training] and [int8] tables when you add them here. Check it with:
#   edge-agent run --config THIS_FILE --check
[device]
id = "{device_id}"
fleet = "{fleet}"
profile = "{profile}"          # "auto" matches firmware_configs/ against the probe
state_dir = "{state_dir}"
sysfs_root = "{sysfs_root}"

[broker]
host = "{broker_host}"
port = {broker_port}
tls = {"true" if tls else "false"}
# ca_file = "/etc/edge-agent/ca.pem"
# cert_file = "/etc/edge-agent/device.pem"
# key_file = "/etc/edge-agent/device-tls.key"

[coordinator]
# The coordinator's Ed25519 public key: commands not signed by it are refused.
public_key = "{coordinator_public_key}"

[policy]
accept_finetune = true
min_battery_pct = 40

# [budget]
# energy_wh = 2.0
# power_cap_w = 5.0
# battery_floor_pct = 30
# battery_resume_pct = 45
"""
