"""The agent's configuration: `/etc/edge-agent/agent.toml` merged over its board profile.

The board profile supplies the hardware facts and defaults (power model, thermal limit,
int8 engine order, budgets); agent.toml supplies the device's name, its broker and
coordinator, and any override of the profile's `[budget]`, `[thermal]`, `[training]` and
`[int8]` tables. Errors are `file:line: key: message` and exit with EXIT_CONFIG (78), which
the systemd unit does not restart on.

The device id is not configured: it is the fingerprint of the device's Ed25519 public key
(edge_agent.keys.fingerprint), so nobody can claim another device's topics. `device.id` may
still be written down (init writes it, for the operator's eyes); if present it must match
the key, which catches a config copied onto the wrong device. `device.name` is free text
for humans (dashboards, logs).
"""

from __future__ import annotations

import base64
import binascii
import os
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
DEFAULT_TOPIC_PREFIX = "edgeft/v1"
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")  # safe inside an MQTT topic level
_PREFIX_RE = re.compile(r"^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$")

# Tables the agent owns; the profile tables below may be overridden here too.
AGENT_SCHEMA: Schema = {
    "device": {
        "id": Field(str, max_length=64),  # optional: derived from the key; checked if present
        "name": Field(str, max_length=64),  # for humans; defaults to the hostname
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
        "topic_prefix": Field(str, max_length=128),
        "reconnect_min_s": number(0.01, 3600),
        "reconnect_max_s": number(0.01, 86400),
    },
    "coordinator": {
        "public_key": Field(str, required=True, max_length=200),  # base64 Ed25519 (raw or DER)
    },
    "policy": {
        "accept_finetune": Field(bool),
        "min_battery_pct": number(0, 100),
        "max_jobs_per_day": Field(int, minimum=0, maximum=1000),
    },
    "data": {
        "dir": Field(str),
        "cache_mb": Field(int, minimum=1, maximum=1 << 20),
        # label names in the data that are not the model's: a `--label-map` spec (pairs
        # "0=brick,1=grass", a file, or "indices"), and whether unknown folders are skipped
        "label_map": Field(str),
        "skip_unknown": Field(bool),
    },
    "service": {
        "state_interval_s": number(1, 86400),
        "progress_interval_s": number(0.5, 86400),  # at most one training-progress message per interval
        "memory_max_mb": Field(int, minimum=64, maximum=1 << 20),
        "cpu_quota_pct": Field(int, minimum=5, maximum=100 * 256),
        "outbox_max_mb": Field(int, minimum=1, maximum=1 << 20),
        "upload_ack_timeout_s": number(0.1, 86400),
        "upload_retry_min_s": number(0.01, 86400),
        "upload_retry_max_s": number(0.01, 7 * 86400),
        "keep_job_records": Field(int, minimum=1, maximum=1_000_000),  # finished job records kept (jobs.py)
        "keep_job_days": number(1, 36500),
        "model_fetch_timeout_s": number(1, 7 * 86400),  # no progress for this long: the fetch fails
        # no answer to the hello for this long: a problem (log, STATUS=, run --check), hello re-sent (agent/link.py)
        "coordinator_silence_s": number(1, 7 * 86400),
    },
    # the local inference service (edge_agent/inference/, docs/deployment.md "Local inference")
    "serve": {
        "enabled": Field(bool),
        "socket": Field(str),  # HTTP on this Unix socket (default /run/edge-agent/inference.sock under systemd)
        "socket_group": Field(str, max_length=64),  # the application's group: may read and write the socket
        "port": Field(int, minimum=0, maximum=65535),  # also 127.0.0.1:port (0: off); needs token_file
        "token_file": Field(str),  # the bearer token TCP clients must send (Authorization: Bearer ...)
        "model": Field(str, max_length=64),  # which installed model to serve (default: the only one)
        "engine": Field(str, max_length=32),  # force an int8 engine (default: the device's selection)
        "top_k": Field(int, minimum=1, maximum=100),
        "max_body_mb": number(0.01, 256),
        "max_image_pixels": Field(int, minimum=64, maximum=100_000_000),
        "max_batch": Field(int, minimum=1, maximum=4096),
        "max_inflight": Field(int, minimum=1, maximum=1024),  # requests being served or queued; more get 429
        "read_timeout_s": number(0.1, 3600),  # a request body must arrive within this
        "samples_per_label": Field(int, minimum=1, maximum=10_000_000),
        "samples_max_mb": number(0.01, 1 << 20),
        "samples_max_age_days": number(0.001, 36500),
        "guard_tolerance": number(0, 1),  # a new model may be this much less accurate (fraction) and still swap in
        "personal": Field(bool),  # keep and serve a personal tail where it is better on held-out samples
        "finetune_after_samples": Field(int, minimum=0, maximum=10_000_000),  # 0: only on POST /v1/finetune
        "finetune_budget_wh": number(0.0001, 1000),
        "training_priority": Field(str, choices=("idle", "nice", "normal")),  # a fine-tune yields to requests
        "refresh_s": number(0.05, 3600),
        "prediction_memory_mb": number(0, 4096),  # recent predictions kept for corrections by id
    },
    # the panel and battery, for the surplus forecast (power/forecast.py, agent/solar.py); absent: no forecast
    "solar": {
        "latitude": number(-90, 90), "longitude": number(-180, 180), "altitude_m": number(-450, 9000),
        "panel_w": number(0.1, 100_000),  # rated W at 1000 W/m2
        "tilt_deg": number(0, 90), "azimuth_deg": number(0, 360),  # 180: facing south
        "efficiency": number(0.01, 1),  # controller + wiring: rated watts -> watts into the battery
        "battery_wh": number(0.1, 1_000_000),  # the battery's usable capacity
        "load_w": number(0, 10_000),  # the board's usual draw (idle + application); default: the profile's idle_w
        "train_w": number(0.01, 10_000),  # extra draw while training; default: profile load_w - idle_w
        "panel_sensor": Field(str, max_length=80),  # auto | battery | none | hwmon:<entry>[:<channel>]
        "forecast_interval_s": number(300, 86400),
    },
}
_OVERRIDABLE = ("budget", "thermal", "training", "int8")
SCHEMA: Schema = {**AGENT_SCHEMA, **{t: board_profiles.SCHEMA[t] for t in _OVERRIDABLE}}

DEFAULTS: dict[str, dict[str, Any]] = {
    "device": {"fleet": "default", "profile": "auto", "sysfs_root": "/",
               "state_dir": str(DEFAULT_STATE_DIR), "tags": []},
    "broker": {"port": 1883, "tls": False, "keepalive_s": 60, "max_message_bytes": 128 * 1024,
               "topic_prefix": DEFAULT_TOPIC_PREFIX, "reconnect_min_s": 1.0, "reconnect_max_s": 300.0},
    "policy": {"accept_finetune": True, "min_battery_pct": 40.0, "max_jobs_per_day": 48},
    "data": {"cache_mb": 256},
    "service": {"state_interval_s": 60.0, "progress_interval_s": 30.0, "outbox_max_mb": 64,
                "upload_ack_timeout_s": 120.0,
                "upload_retry_min_s": 5.0, "upload_retry_max_s": 3600.0,
                "keep_job_records": 500, "keep_job_days": 30.0, "model_fetch_timeout_s": 600.0,
                "coordinator_silence_s": 300.0},
    "serve": {"enabled": False, "port": 0, "top_k": 3, "max_body_mb": 8.0, "max_image_pixels": 4_000_000,
              "max_batch": 256, "max_inflight": 16, "read_timeout_s": 10.0, "samples_per_label": 1000,
              "samples_max_mb": 256.0, "guard_tolerance": 0.02, "personal": True, "finetune_after_samples": 0,
              "training_priority": "idle", "refresh_s": 2.0, "prediction_memory_mb": 16.0},
}


@dataclass
class AgentConfig:
    path: str
    data: dict[str, dict[str, Any]]  # agent tables + the profile's tables, merged
    profile: board_profiles.Profile | None

    def get(self, table: str, key: str, default: Any = None) -> Any:
        return self.data.get(table, {}).get(key, default)

    @property
    def configured_device_id(self) -> str | None:
        """`device.id` if written down (it must match the key's fingerprint), else None."""
        return self.data["device"].get("id")

    @property
    def device_name(self) -> str:
        return self.data["device"].get("name") or default_device_name()

    @property
    def fleet(self) -> str:
        return self.data["device"]["fleet"]

    @property
    def state_dir(self) -> Path:
        return Path(self.data["device"]["state_dir"])

    @property
    def key_file(self) -> Path:
        return Path(self.data["device"].get("key_file") or self.state_dir / "keys" / "device.key")

    @property
    def topic_prefix(self) -> str:
        return self.data["broker"]["topic_prefix"]

    @property
    def coordinator_public_key(self) -> Any:
        """The coordinator's Ed25519PublicKey (validated at load)."""
        return parse_public_key(self.data["coordinator"]["public_key"])


def default_device_name() -> str:
    """A topic-safe display name from the hostname (set any name in agent.toml)."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname())[:64].strip("-.") or "device"
    return name if _ID_RE.match(name) else "device"


def parse_public_key(text: str) -> Any:
    """An Ed25519 public key from base64 (raw 32 bytes or DER SubjectPublicKeyInfo) or PEM
    text; raises ValueError saying what is wrong."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    text = text.strip()
    try:
        if text.startswith("-----BEGIN"):
            key = serialization.load_pem_public_key(text.encode())
        else:
            raw = base64.b64decode(text, validate=True)
            if len(raw) == 32:
                return Ed25519PublicKey.from_public_bytes(raw)
            key = serialization.load_der_public_key(raw)
    except (binascii.Error, ValueError, UnsupportedAlgorithm) as exc:
        raise ValueError(f"not a base64 or PEM Ed25519 public key ({str(exc)[:80]})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError(f"a {type(key).__name__}, expected an Ed25519 key")
    return key


def public_key_text(key: Any) -> str:
    """The form agent.toml and `hello` messages use: base64 of the raw 32-byte key."""
    from .keys import public_key_bytes

    return base64.b64encode(public_key_bytes(key)).decode("ascii")


def load_identity(config: AgentConfig) -> tuple[Any, str]:
    """(private key, device id): the id is the key's fingerprint. A `device.id` in the file
    that disagrees (a config copied from another device) is a configuration error."""
    from .keys import fingerprint, load_private_key

    key = load_private_key(config.key_file)
    device_id = fingerprint(key)
    configured = config.configured_device_id
    if configured is not None and configured != device_id:
        raise ConfigError(f"{config.path}: device.id: {configured!r} is not the fingerprint of "
                          f"{config.key_file} ({device_id}); remove the line or fix key_file")
    return key, device_id


TLS_CA_HINT = ("the CA that signed the broker's certificate: the fleet CA (packaging/mosquitto/make-certs), "
               "or /etc/ssl/certs/ca-certificates.crt for a broker with a public certificate")


def tls_file_problems(ca_file: str | None, cert_file: str | None, key_file: str | None) -> list[tuple[str, str]]:
    """(which, why) for TLS files that cannot be used: missing, unreadable, not PEM, or a
    certificate and key that do not match. Loaded as the MQTT client will load them, so a bad
    file fails at `--check` or start-up, not as an endless reconnect loop."""
    import ssl

    problems = []
    for which, path in (("ca_file", ca_file), ("cert_file", cert_file), ("key_file", key_file)):
        if path and not Path(path).is_file():
            problems.append((which, f"{path}: no such file"))
        elif path and not os.access(path, os.R_OK):
            problems.append((which, f"{path}: not readable by this user"))
    if problems:
        return problems
    if ca_file:
        try:
            ssl.create_default_context(cafile=ca_file)
        except (ssl.SSLError, OSError, ValueError) as exc:
            problems.append(("ca_file", f"{ca_file}: not a PEM CA certificate ({_ssl_reason(exc)})"))
    if cert_file and key_file:
        try:  # a key that needs a passphrase fails here instead of prompting on a terminal
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(cert_file, key_file, password=lambda: b"")
        except (ssl.SSLError, OSError, ValueError) as exc:
            problems.append(("cert_file", f"{cert_file} with {key_file}: not a PEM certificate and its "
                                          f"unencrypted private key ({_ssl_reason(exc)})"))
    return problems


def _ssl_reason(exc: BaseException) -> str:
    return str(getattr(exc, "reason", None) or getattr(exc, "strerror", None) or exc)[:80]


def _check_semantics(report: Reporter, merged: dict[str, Any]) -> None:
    for table, key in (("device", "id"), ("device", "fleet"), ("device", "name")):
        value = merged.get(table, {}).get(key)
        if isinstance(value, str) and not _ID_RE.match(value):
            report.error(table, key, "use letters, digits, '.', '_' or '-' (max 64; no '/', '+', '#')")
    root = merged.get("device", {}).get("sysfs_root")
    if isinstance(root, str) and not Path(root).is_dir():
        report.error("device", "sysfs_root", f"{root}: no such directory (\"/\" on a device)")
    broker = merged.get("broker", {})
    if not _PREFIX_RE.match(broker.get("topic_prefix", "")):
        report.error("broker", "topic_prefix", "'/'-separated segments of letters, digits, '.', '_', '-'")
    if broker.get("reconnect_min_s", 0) > broker.get("reconnect_max_s", 0):
        report.error("broker", "reconnect_min_s", f"must not exceed reconnect_max_s ({broker.get('reconnect_max_s')})")
    if broker.get("tls") is False and (broker.get("cert_file") or broker.get("ca_file")):
        report.error("broker", "tls", "certificate files are set but tls = false")
    if bool(broker.get("cert_file")) != bool(broker.get("key_file")):
        report.error("broker", "cert_file", "cert_file and key_file go together (client certificate)")
    if broker.get("tls") and not broker.get("ca_file"):
        report.error("broker", "tls", f"tls = true needs ca_file: {TLS_CA_HINT}")
    for name, why in tls_file_problems(broker.get("ca_file"), broker.get("cert_file"), broker.get("key_file")):
        report.error("broker", name, why)
    if broker.get("password_file") and not Path(broker["password_file"]).is_file():
        report.error("broker", "password_file", f"{broker['password_file']}: no such file")
    service = merged.get("service", {})
    if service.get("upload_retry_min_s", 0) > service.get("upload_retry_max_s", 0):
        report.error("service", "upload_retry_min_s", "must not exceed upload_retry_max_s")
    coordinator_key = merged.get("coordinator", {}).get("public_key")
    if isinstance(coordinator_key, str):
        try:
            parse_public_key(coordinator_key)
        except ValueError as exc:
            report.error("coordinator", "public_key", str(exc))
    serve = merged.get("serve", {})
    if serve.get("port") and not serve.get("token_file"):
        report.error("serve", "port", "a TCP port needs token_file: the bearer token every TCP client must send")
    if serve.get("token_file") and not Path(serve["token_file"]).is_file():
        report.error("serve", "token_file", f"{serve['token_file']}: no such file")
    if serve.get("socket_group"):
        import grp

        try:
            grp.getgrnam(serve["socket_group"])
        except KeyError:
            report.error("serve", "socket_group", f"no group named {serve['socket_group']!r} on this system")
    solar = merged.get("solar")
    if solar is not None:
        for key in ("latitude", "longitude", "battery_wh"):
            if key not in solar:
                report.error("solar", key, f"solar.{key} is required when [solar] is present")
        sensor = solar.get("panel_sensor")
        if isinstance(sensor, str):
            from .power.panel_history import check_sensor

            try:
                check_sensor(sensor)
            except ConfigError as exc:
                report.error("solar", "panel_sensor", str(exc).split(": ", 1)[-1])
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


def _toml_str(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_config(*, device_name: str, fleet: str, broker_host: str, broker_port: int,
                  coordinator_public_key: str, state_dir: Path, device_id: str | None = None,
                  profile: str = "auto", tls: bool = False, sysfs_root: str = "/",
                  data_dir: str | None = None, profile_budget: dict[str, Any] | None = None,
                  topic_prefix: str = DEFAULT_TOPIC_PREFIX, ca_file: str | None = None,
                  cert_file: str | None = None, key_file: str | None = None) -> str:
    """A commented agent.toml for `edge-agent init`."""
    id_line = (f'id = {_toml_str(device_id)}      # the key\'s fingerprint: checked at start, never chosen'
               if device_id else "# id = (the fingerprint of the device key; derived, not chosen)")
    budget = "\n".join(f"# {k} = {v}" for k, v in sorted((profile_budget or {}).items())) or \
        "# energy_wh = 2.0\n# power_cap_w = 5.0\n# battery_floor_pct = 30\n# battery_resume_pct = 45"
    data_line = f"dir = {_toml_str(data_dir)}" if data_dir else '# dir = "/var/lib/edge-agent/data"'
    tls_lines = "\n".join(
        f"{key} = {_toml_str(value)}" if value else f"# {key} = {_toml_str(example)}"
        for key, value, example in (("ca_file", ca_file, "/etc/edge-agent/ca.pem"),
                                    ("cert_file", cert_file, "/etc/edge-agent/device.pem"),
                                    ("key_file", key_file, "/etc/edge-agent/device-tls.key")))
    return f"""# edge-agent configuration. Overrides the board profile's [budget], [thermal],
# [training] and [int8] tables when you add them here. Check it with:
#   edge-agent run --config THIS_FILE --check
[device]
{id_line}
name = {_toml_str(device_name)}
fleet = {_toml_str(fleet)}
profile = {_toml_str(profile)}          # "auto" matches firmware_configs/ against the probe
state_dir = {_toml_str(str(state_dir))}
sysfs_root = {_toml_str(sysfs_root)}

[broker]
host = {_toml_str(broker_host)}
port = {broker_port}
tls = {"true" if tls else "false"}
topic_prefix = {_toml_str(topic_prefix)}
{tls_lines}

[coordinator]
# The coordinator's Ed25519 public key: commands not signed by it are refused.
public_key = {_toml_str(coordinator_public_key)}

[policy]
accept_finetune = true
min_battery_pct = 40    # refuse a fine-tune below this battery level (unless charging)
max_jobs_per_day = 48  # jobs accepted in any 24 h (cancelled ones do not count); 2x an hourly schedule

[data]
# The local training data: an image folder per label, a .csv or an .npz. Folder names
# (and CSV/NPZ label values) must be the model's labels; otherwise map them, or skip them:
{data_line}
# label_map = "0=brick,1=grass"   # or a .json/.toml/text file, or "indices"
# skip_unknown = true             # skip (and report) folders that match no model label

# [budget]    # this board profile's values; a command may ask for less, never more
{budget}
"""
