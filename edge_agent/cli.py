"""`edge-agent`: the device-side command line.

Each feature module registers its own subcommand; this file only wires them together and
turns errors into one clear line and a documented exit code (see edge_agent.errors). It
imports nothing heavy: MXNet and tflite are loaded only by the commands that need them.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from . import __version__
from .errors import EXIT_CODES, EXIT_CONFIG, EXIT_OK, EXIT_USAGE, CliParser, UsageError, run_command

log = logging.getLogger("edge_agent")

# Feature modules that add subcommands: module path -> attribute with register(subparsers).
# A module that is missing or broken must not take the whole CLI down with it.
_PLUGINS = (
    "edge_agent.int8.cli",
    "edge_agent.train.cli",
    "edge_agent.inference.cli",
    "edge_agent.agent.service_cli",
    "edge_agent.agent.cli",
    "edge_agent.doctor",
)

EPILOG = "exit codes:\n" + "\n".join(f"  {code:>3}  {what}" for code, what in EXIT_CODES.items())


def _cmd_probe(args: argparse.Namespace) -> int:
    from .hardware.probe import probe, render

    if not Path(args.root).is_dir():
        raise UsageError(f"--root {args.root}: no such directory (a filesystem root: / or a captured board tree)")
    report = probe(args.root)
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        print(render(report))
    return EXIT_OK


def _profiles_dir(args: argparse.Namespace) -> Path | None:
    """--dir, which must be a directory: a typo must not check (or list) nothing and pass."""
    if args.dir is None:
        return None
    if not Path(args.dir).is_dir():
        raise UsageError(f"--dir {args.dir}: no such directory")
    return Path(args.dir)


def _cmd_profiles_check(args: argparse.Namespace) -> int:
    from .hardware.profiles import load_profiles, profiles_dir

    paths = [Path(p) for p in args.files] if args.files else None
    directory = _profiles_dir(args) or profiles_dir()
    result = load_profiles(paths, directory=directory)
    for error in result.errors:
        print(error, file=sys.stderr)
    if result.errors:
        print(f"{len(result.errors)} error(s)", file=sys.stderr)
        return EXIT_CONFIG
    names = ", ".join(sorted(result.profiles)) or "(base only)"
    print(f"ok: {len(result.profiles)} profile(s) valid: {names}")
    return EXIT_OK


def _cmd_profiles_list(args: argparse.Namespace) -> int:
    from .hardware.profiles import load_profiles

    result = load_profiles(directory=_profiles_dir(args))
    for name, profile in sorted(result.profiles.items()):
        power = profile.data.get("power", {})
        print(f"{name:28s} {power.get('idle_w', '?'):>5} W idle {power.get('load_w', '?'):>5} W load  "
              f"int8: {', '.join(profile.get('int8', 'backends', []))}")
    for error in result.errors:
        print(error, file=sys.stderr)
    return EXIT_CONFIG if result.errors else EXIT_OK


def _cmd_profiles_show(args: argparse.Namespace) -> int:
    from .hardware.profiles import load_profiles

    result = load_profiles(directory=_profiles_dir(args))
    profile = result.profiles.get(args.name)
    if profile is None:
        print(f"no profile named {args.name!r}; known: {', '.join(sorted(result.profiles))}", file=sys.stderr)
        return EXIT_USAGE
    print(json.dumps(profile.to_dict(), indent=2, sort_keys=True))
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(
        prog="edge-agent",
        description="Detects the device, picks int8 kernels, fine-tunes MXNet models within a "
                    "power budget and syncs compressed updates over MQTT.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"edge-agent {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser(
        "probe", help="report the board, CPU int8 features, accelerators, sensors and profile",
        description="Read /proc, /sys, /dev and /etc under ROOT and report what this device is and "
                    "can do. Nothing heavy is imported; nothing is written.",
        epilog="examples:\n  edge-agent probe\n  edge-agent probe --json > probe.json\n"
               "  edge-agent probe --root tests/fixtures/boards/raspberry-pi-4",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true", help="print the stable JSON report (schema edge-agent.probe/1)")
    p.add_argument("--root", default="/", help="filesystem root to probe (default /); e.g. a captured board tree")
    p.set_defaults(func=_cmd_probe)

    prof = sub.add_parser("profiles", help="list, show and check board profiles (firmware_configs/)")
    prof.add_argument("--dir", help="profiles directory (default: the shipped firmware_configs)")
    psub = prof.add_subparsers(dest="profiles_command", metavar="ACTION", required=True)
    c = psub.add_parser("check", help="validate profiles; errors as file:line: key: message",
                        description="Validate board profiles against the schema. Exit 78 on any error.")
    c.add_argument("files", nargs="*", help="profile files (default: every shipped profile)")
    c.set_defaults(func=_cmd_profiles_check)
    ls = psub.add_parser("list", help="one line per profile")
    ls.set_defaults(func=_cmd_profiles_list)
    show = psub.add_parser("show", help="a profile merged over base, as JSON")
    show.add_argument("name")
    show.set_defaults(func=_cmd_profiles_show)

    for module_name in _PLUGINS:
        _register(sub, module_name)
    return parser


def _register(sub: argparse._SubParsersAction, module_name: str) -> None:
    try:
        register: Callable[[argparse._SubParsersAction], None] = importlib.import_module(module_name).register
    except (ImportError, AttributeError) as exc:
        log.debug("subcommands from %s unavailable: %s", module_name, exc)
        return
    register(sub)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    return run_command("edge-agent", lambda: args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
