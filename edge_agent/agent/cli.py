"""`edge-agent init` and `edge-agent run`: set a device up, then run the agent daemon.

Registered through edge_agent.cli's plugin list (`register(subparsers)`); also runnable as
`python -m edge_agent.agent.cli ...`. Only argparse and small modules are imported until a
command runs; the daemon itself never imports numpy or MXNet.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from ..errors import (
    EXIT_CODES,
    EXIT_OK,
    CliParser,
    ConfigError,
    InputError,
    UsageError,
    run_command,
)
from ..protocol.facts import parse_broker

INIT_DESCRIPTION = """\
Set this device up for a fleet: create its Ed25519 key (0600; kept if it already exists),
probe the hardware and match a board profile, write a commented agent.toml, and print the
enrolment line to give the coordinator.

The device id is the fingerprint of the key: it cannot be chosen, and a copied config on
another device is refused. The enrolment code (ABCD-EFGH-IJKL) is a short form of it that
an operator compares on the device's console before approving it."""

INIT_EPILOG = """\
examples:
  sudo edge-agent init --broker mqtt.example.net:8883 --fleet farms \\
      --ca-file /etc/edge-agent/ca.pem --cert-file /etc/edge-agent/device.pem \\
      --key-file /etc/edge-agent/device-tls.key \\
      --coordinator-key coordinator.pub --data-dir /srv/field-photos
  edge-agent init --broker 127.0.0.1 --fleet lab --coordinator-key MCowBQYDK2VwAyEA... \\
      --state-dir ./state --config ./agent.toml --sysfs-root tests/fixtures/boards/raspberry-pi-4

Then check and start it:
  edge-agent run --config /etc/edge-agent/agent.toml --check
  sudo systemctl enable --now edge-agent"""

RUN_DESCRIPTION = """\
Run the agent daemon: connect to the broker (TLS when configured; reconnects with jittered
exponential backoff), publish this device's state (retained), accept or refuse signed
commands by policy, run fine-tune jobs in a child process through a persisted state machine
(resumed after a restart), and send each compressed update from the on-disk outbox until the
coordinator acknowledges it. Under systemd it sends READY=1, STATUS= and WATCHDOG=1.

SIGTERM stops it cleanly: the training child checkpoints, the device reports "offline"; exit 0.
Ctrl-C does the same and exits 130 (interrupted). One daemon per state directory: a second
`run` on the same config exits 69."""

RUN_EPILOG = """\
examples:
  edge-agent run --config /etc/edge-agent/agent.toml --check     # validate, print, exit
  edge-agent run --config /etc/edge-agent/agent.toml

--check also prints what the running (or last) daemon knows of the coordinator hearing this
device (STATE_DIR/link.json): its hello answered, or not for [service] coordinator_silence_s
(default 300 s): then it exits 69 (a broker ACL for another fleet, or no serve on this fleet).

exit codes:
""" + "\n".join(f"  {code:>3}  {what}" for code, what in EXIT_CODES.items()) + """

test hooks: with EDGE_AGENT_TEST_HOOKS=1, the file STATE_DIR/debug/hang makes the main loop
block (no watchdog pings) while it exists, and STATE_DIR/debug/fail makes every iteration fail."""


SERVICE_USER = "edge-agent"  # the systemd unit's User= (packaging/systemd/edge-agent.service)


def _ident(text: str) -> str:
    """A fleet or device name: one MQTT topic level."""
    import re

    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", text):
        raise argparse.ArgumentTypeError(f"{text!r}: use letters, digits, '.', '_' or '-' (max 64; no '/', '+', '#')")
    return text


def _prefix(text: str) -> str:
    if not all(part and _ident(part) for part in text.split("/")) or len(text) > 128:
        raise argparse.ArgumentTypeError(f"{text!r}: '/'-separated levels of letters, digits, '.', '_', '-'")
    return text


def _coordinator_key(value: str) -> str:
    """KEY_OR_FILE -> base64 raw public key, the form agent.toml keeps."""
    from ..config import parse_public_key, public_key_text

    path = Path(value)
    text = value
    if len(value) < 4096 and ("/" in value or value.endswith((".pem", ".pub"))) and path.is_file():
        text = path.read_text(encoding="utf-8", errors="replace")[:8192]
    try:
        return public_key_text(parse_public_key(text))
    except ValueError as exc:
        raise UsageError(f"--coordinator-key: {value[:80]!r}: {exc}") from None


def _service_owner(user: str | None) -> tuple[int, int] | None:
    """(uid, gid) to hand the key and config to: the service user, when run as root."""
    import pwd

    if os.geteuid() != 0:
        if user:
            raise UsageError(f"--service-user {user}: changing file owners needs root")
        return None
    try:
        entry = pwd.getpwnam(user or SERVICE_USER)
    except KeyError:
        if user:
            raise UsageError(f"--service-user {user}: no such user") from None
        return None  # no service installed yet: root keeps the files (install-service creates the user)
    return entry.pw_uid, entry.pw_gid


def _tls_files(args: argparse.Namespace) -> dict[str, str | None]:
    """--ca-file/--cert-file/--key-file, absolute and checked as the MQTT client will load
    them; any of them turns TLS on, and TLS needs a CA."""
    from ..config import TLS_CA_HINT, tls_file_problems

    files = {k: str(Path(v).absolute()) if v else None
             for k, v in (("ca_file", args.ca_file), ("cert_file", args.cert_file), ("key_file", args.key_file))}
    if any(files.values()):
        args.tls = True
    if args.tls and not files["ca_file"]:
        raise UsageError(f"--tls needs --ca-file: {TLS_CA_HINT}")
    if bool(files["cert_file"]) != bool(files["key_file"]):
        raise UsageError("--cert-file and --key-file go together (the device's client certificate)")
    for which, why in tls_file_problems(**files):
        raise UsageError(f"--{which.replace('_', '-')} {why}")
    return files


def _cmd_init(args: argparse.Namespace) -> int:
    from ..atomic import atomic_write_text
    from ..config import (
        DEFAULT_TOPIC_PREFIX,
        default_device_name,
        load_config,
        public_key_text,
        render_config,
    )
    from ..hardware.probe import probe
    from ..hardware.profiles import load_profiles
    from ..keys import enrolment_code, fingerprint, load_or_create_private_key

    tls_files = _tls_files(args)
    host, port = args.broker
    port = port or (8883 if args.tls else 1883)
    coordinator = _coordinator_key(args.coordinator_key)
    config_path, state_dir = Path(args.config), Path(args.state_dir).absolute()
    if config_path.exists() and not args.force:
        raise UsageError(f"{config_path} exists; pass --force to replace it (the device key is kept either way)")
    existing = next(p for p in config_path.absolute().parents if p.exists())  # parents are created
    if not existing.is_dir():  # found now, not after the key has been created
        raise UsageError(f"--config {config_path}: {existing} is not a directory")
    owner = _service_owner(args.service_user)  # (refused before anything is written)
    if not Path(args.sysfs_root).is_dir():
        raise UsageError(f"--sysfs-root {args.sysfs_root}: no such directory")
    report = probe(args.sysfs_root)
    matched = report["profile"]["name"]
    profile = load_profiles().profiles.get(matched) if matched else None
    key_file = state_dir / "keys" / "device.key"
    key_file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    key, created = load_or_create_private_key(key_file)
    device_id = fingerprint(key)
    text = render_config(
        device_name=args.name or default_device_name(), fleet=args.fleet, broker_host=host, broker_port=port,
        coordinator_public_key=coordinator, state_dir=state_dir, device_id=device_id,
        profile=matched or "auto", tls=args.tls, sysfs_root=str(Path(args.sysfs_root).absolute()),
        data_dir=str(Path(args.data_dir).absolute()) if args.data_dir else None,
        profile_budget=profile.data.get("budget") if profile else None,
        topic_prefix=args.topic_prefix or DEFAULT_TOPIC_PREFIX, **tls_files)
    atomic_write_text(config_path, text, mode=0o640)
    if owner is not None:  # the service runs as this user: it must read its key and config
        uid, gid = owner
        for path in (state_dir, key_file.parent, key_file):
            os.chown(path, uid, gid)
        os.chown(config_path, 0, gid)
    config = load_config(config_path)  # what init wrote must load: fail here, not at first start
    pub = public_key_text(key)
    code = enrolment_code(key)
    owned = f", owned by {args.service_user or SERVICE_USER}" if owner is not None else ""
    print(f"device key:     {key_file} ({'created' if created else 'existing, kept'}; mode 0600{owned})")
    print(f"config:         {config_path} (board profile: {matched or 'none matched: auto'})")
    print(f"device id:      {device_id}")
    print(f"enrolment code: {code}   <- compare on the coordinator before approving")
    print(f"public key:     {pub}")
    print("enrolment line for the coordinator:")
    print(f"edge-agent-enrol/1 fleet={config.fleet} id={device_id} code={code} key={pub} "
          f"name={config.device_name} profile={matched or 'none'}")
    return EXIT_OK


def _cmd_run(args: argparse.Namespace) -> int:
    from ..config import load_config, load_identity

    config = load_config(args.config)
    _, device_id = load_identity(config)
    if args.check:
        g = config.get
        data_dir = g("data", "dir")
        # (a .csv/.npz file is data too) the daemon starts (a disk may mount later), refusing jobs
        if data_dir and not Path(data_dir).exists():
            raise ConfigError(f"{config.path}: data.dir: {data_dir}: no such directory (fine-tune commands "
                              "would be refused as no_data)")
        if g("data", "label_map"):
            from ..labels import parse_label_map

            try:
                parse_label_map(g("data", "label_map"))
            except InputError as exc:
                raise ConfigError(f"{config.path}: data.label_map: {exc}") from None
        tls = "TLS" if g("broker", "tls") else "plain TCP"
        print(f"ok: {config.path}")
        print(f"  device   {device_id} ({config.device_name}), fleet {config.fleet}")
        print(f"  broker   {g('broker', 'host')}:{g('broker', 'port')} ({tls}), topics {config.topic_prefix}/{config.fleet}/...")
        print(f"  profile  {config.profile.name if config.profile else 'none (generic defaults)'}")
        print(f"  state    {config.state_dir}; key {config.key_file}")
        from ..keys import fingerprint
        from .coordinator_trust import ROTATION_FILE, CoordinatorTrust

        trusted = CoordinatorTrust(state_dir=config.state_dir, configured=config.coordinator_public_key)
        moved = trusted.key_id != fingerprint(config.coordinator_public_key)
        print(f"  coordinator key {trusted.key_id}" + (f" (rotated from agent.toml's: {config.state_dir / ROTATION_FILE})"
                                                        if moved else ""))
        print(f"  data     {g('data', 'dir') or 'not set: fine-tune commands are refused (no_data)'}")
        print(f"  budget   {_budget_line(config)}")
        print(f"  policy   accept_finetune={g('policy', 'accept_finetune')} min_battery_pct={g('policy', 'min_battery_pct')} "
              f"max_jobs_per_day={g('policy', 'max_jobs_per_day')}")
        return _check_link(config, device_id)
    from .daemon import Daemon

    return Daemon(config).run()


def _check_link(config: Any, device_id: str) -> int:
    """What the daemon last knew of being heard by the coordinator (STATE_DIR/link.json):
    exit 69 while it reports a problem under this config's fleet and topics."""
    import time

    from ..errors import EXIT_UNAVAILABLE
    from ..protocol import Topics
    from .link import LINK_FILE, read_link

    doc = read_link(config.state_dir / LINK_FILE)
    if doc is None:
        print("  link     not run yet (after `edge-agent run` starts, this says whether the coordinator answers)")
        return EXIT_OK
    topic = Topics(fleet=config.fleet, prefix=config.topic_prefix).device(device_id, "hello")
    when = doc.get("updated_at")
    age = f"as of {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(when))}" if isinstance(when, int | float) else ""
    if doc.get("hello_topic") != topic:
        print(f"  link     last run used {str(doc.get('hello_topic'))[:200]} (another fleet or prefix): restart the "
              "agent to use this config")
        return EXIT_OK
    if doc.get("problem"):
        print(f"  link     PROBLEM ({age}): {str(doc['problem'])[:1000]}")
        return EXIT_UNAVAILABLE
    acked = doc.get("acknowledged_at")
    if doc.get("waiting_since") is None and isinstance(acked, int | float):
        print(f"  link     the coordinator answered this device's hello at "
              f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(acked))}")
    else:
        print(f"  link     hello sent, no answer from the coordinator yet ({age})")
    return EXIT_OK


def _budget_line(config: Any) -> str:
    b = config.data.get("budget", {})
    return ", ".join(f"{k}={v}" for k, v in sorted(b.items())) or "none"


def _cmd_forecast(args: argparse.Namespace) -> int:
    """The [solar] forecast the daemon would report, computed here (pvlib in this process)."""
    from ..config import load_config
    from ..power import discover_battery
    from .solar import HISTORY_FILE, SolarPlanner, SolarSettings, compute_request, pvlib_missing

    config = load_config(args.config)
    settings = SolarSettings.from_config(config)
    if settings is None:
        raise ConfigError(f"{config.path}: no [solar] table: nothing to forecast (docs/solar-deployment.md)")
    missing = pvlib_missing()
    if missing:
        raise ConfigError(missing)
    root = config.get("device", "sysfs_root")
    gauge = discover_battery(root)
    planner = SolarPlanner(settings=settings, state_dir=config.state_dir, sysfs_root=root,
                           battery=gauge.read if gauge else lambda: None, compute=compute_request)
    fc = planner.refresh(time.time() if args.at is None else args.at)
    if fc is None:
        raise InputError("no battery reading: the forecast starts from the battery's charge")
    if args.json:
        print(json.dumps(fc.to_state(), indent=2))
        return EXIT_OK
    print(f"solar forecast for {settings.site.latitude:g}, {settings.site.longitude:g} "
          f"({settings.site.panel_w:g} W panel, tilt {settings.site.tilt_deg:g}, azimuth {settings.site.azimuth_deg:g})")
    print(f"  panel    {planner.meter.describe()}; {len(planner.history.samples)} samples in "
          f"{config.state_dir / HISTORY_FILE}")
    print(f"  index    {fc.clear_sky_index:.2f} (measured / clear-sky; 1.00 without history)")
    print(f"  battery  {fc.battery_wh:.1f} of {fc.capacity_wh:g} Wh, floor {fc.floor_wh:.1f} Wh; board draw "
          f"{fc.load_w:g} W, training +{settings.train_w:g} W")
    print("  hour (UTC)   clear-sky W  expected W  surplus W  battery Wh")
    for i, (clear, panel, surplus, charge) in enumerate(zip(fc.clear_sky_w, fc.panel_w, fc.surplus_w(),
                                                             fc.battery_trajectory(), strict=True)):
        at = time.strftime("%m-%d %H:%M", time.gmtime(fc.start + i * fc.step_s))
        print(f"  {at}  {clear:11.1f}  {panel:10.1f}  {surplus:9.1f}  {charge:10.1f}")
    window = fc.window
    print(f"  window   {window.describe() if window else 'none in the next 24 h'} for the default job "
          f"({settings.train_wh:g} Wh at {settings.train_w:g} W)")
    return EXIT_OK


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `init`, `run` and `forecast` to the edge-agent command line."""
    p = subparsers.add_parser("init", help="create the device key and agent.toml; print the enrolment line",
                              description=INIT_DESCRIPTION, epilog=INIT_EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--broker", required=True, type=parse_broker, metavar="HOST[:PORT]",
                   help="MQTT broker (port default 1883, or 8883 with --tls)")
    p.add_argument("--fleet", default="default", type=_ident, help="fleet name: a topic level (default 'default')")
    p.add_argument("--coordinator-key", required=True, metavar="KEY_OR_FILE",
                   help="the coordinator's Ed25519 public key: base64, or a PEM/base64 file")
    p.add_argument("--state-dir", default="/var/lib/edge-agent", metavar="DIR",
                   help="keys, jobs, models, checkpoints, outbox (default /var/lib/edge-agent)")
    p.add_argument("--config", default="/etc/edge-agent/agent.toml", metavar="PATH",
                   help="where to write agent.toml (default /etc/edge-agent/agent.toml)")
    p.add_argument("--sysfs-root", default="/", metavar="DIR",
                   help="probe the hardware under DIR (default /; a captured board tree for tests)")
    p.add_argument("--name", type=_ident, help="a display name (default: the hostname)")
    p.add_argument("--data-dir", metavar="DIR", help="the local training data (image folder, .csv or .npz)")
    p.add_argument("--tls", action="store_true", help="connect with TLS (needs --ca-file)")
    p.add_argument("--ca-file", metavar="PEM",
                   help="CA that signed the broker's certificate (the fleet CA; implies --tls)")
    p.add_argument("--cert-file", metavar="PEM", help="this device's client certificate (mutual TLS)")
    p.add_argument("--key-file", metavar="PEM", help="the client certificate's unencrypted private key")
    p.add_argument("--topic-prefix", type=_prefix, help="MQTT topic prefix (default edgeft/v1)")
    p.add_argument("--force", action="store_true", help="replace an existing agent.toml (the key is kept)")
    p.add_argument("--service-user", metavar="USER",
                   help=f"when run as root, give the key and state dir to USER and the config to its group "
                        f"(default: {SERVICE_USER!r} if that user exists)")
    p.set_defaults(func=_cmd_init)

    r = subparsers.add_parser("run", help="run the agent daemon (the systemd service's command)",
                              description=RUN_DESCRIPTION, epilog=RUN_EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("--config", default="/etc/edge-agent/agent.toml", metavar="PATH",
                   help="agent.toml (default /etc/edge-agent/agent.toml)")
    r.add_argument("--check", action="store_true",
                   help="validate the config and key, print a summary and whether the coordinator answers, exit")
    r.set_defaults(func=_cmd_run)

    f = subparsers.add_parser(
        "forecast", help="the 24-h solar surplus forecast and training window ([solar])",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The surplus forecast the daemon reports with a [solar] table in agent.toml: the panel's\n"
                    "harvest hour by hour (pvlib's clear-sky model on the tilted panel x the clear-sky index\n"
                    "learnt from the measured panel power), the load, the projected battery, and the window\n"
                    "a fine-tune of the default size would be planned into (never below the battery floor).\n"
                    "Needs pvlib (the package's [solar] extra).",
        epilog="examples:\n"
               "  edge-agent forecast --config /etc/edge-agent/agent.toml\n"
               "  edge-agent forecast --json                  # what the state message carries\n"
               "  edge-agent forecast --at $(date -d 'tomorrow 06:00' +%s)\n\n"
               "How to read it: docs/solar-deployment.md, section 4.")
    f.add_argument("--config", default="/etc/edge-agent/agent.toml", metavar="PATH",
                   help="agent.toml (default /etc/edge-agent/agent.toml)")
    f.add_argument("--json", action="store_true", help="print what the state message carries")
    f.add_argument("--at", type=float, metavar="EPOCH", help="forecast from this time (default: now)")
    f.set_defaults(func=_cmd_forecast)


def main(argv: list[str] | None = None) -> int:
    """`python -m edge_agent.agent.cli {init,run} ...` (the same as `edge-agent init|run`)."""
    parser = CliParser(prog="edge-agent", description="edge-agent device set-up and daemon")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    register(parser.add_subparsers(dest="command", metavar="COMMAND", required=True))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_command("edge-agent", lambda: args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
