"""`edge-agent install-service` and `edge-agent uninstall-service` (pip installs).

The lead's edge_agent/cli.py calls `register(subparsers)`; handlers return an exit code and
raise EdgeAgentError subclasses for one-line errors (77 without root, 78 for an install the
service could not run from). Only argparse is imported here; the logic is in service.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..errors import EXIT_OK

INSTALL_DESCRIPTION = """\
Install edge-agent as a systemd service from a pip install (the Debian package does this
by itself). In order:
  1. create the system user edge-agent (useradd --system, home /var/lib/edge-agent,
     shell /usr/sbin/nologin) unless it exists;
  2. create /etc/edge-agent (root:edge-agent 0750) and /var/lib/edge-agent
     (edge-agent:edge-agent 0750);
  3. write /etc/systemd/system/edge-agent.service from the shipped, hardened unit, with
     ExecStart= this installation's edge-agent and SupplementaryGroups= cut down to the
     groups that exist here (i2c gpio video plugdev on a Raspberry Pi);
  4. systemctl daemon-reload, then systemctl enable --now edge-agent.service. The
     service is only enabled, not started, while the config file does not exist yet.

The unit runs with ProtectHome=yes, so edge-agent must be installed outside /home and
/root (a virtualenv under /opt). Running it again updates the unit in place.
"""

INSTALL_EPILOG = """\
examples:
  sudo python3.11 -m venv /opt/edge-agent/venv
  sudo /opt/edge-agent/venv/bin/pip install ./mxedge_agent-0.1.0-*.whl   # or /path/to/checkout
  sudo /opt/edge-agent/venv/bin/edge-agent install-service --dry-run   # print each step
  sudo /opt/edge-agent/venv/bin/edge-agent install-service
  edge-agent install-service --print-unit          # the unit it would write
  sudo edge-agent install-service --root /mnt/sdcard-rootfs   # into an SD card image

exit codes: 0 ok, 1 a step failed, 64 bad command line, 77 not root, 78 edge-agent lives
where the service cannot reach it (under /home or /root).
"""

UNINSTALL_DESCRIPTION = """\
Stop and disable the service, and remove the unit that install-service wrote. The
configuration (/etc/edge-agent) and state (/var/lib/edge-agent: device key, outbox,
checkpoints) are kept unless --purge; the edge-agent user is always kept.
"""

UNINSTALL_EPILOG = """\
examples:
  sudo edge-agent uninstall-service --dry-run
  sudo edge-agent uninstall-service
  sudo edge-agent uninstall-service --purge     # also delete config, key and state

exit codes: 0 ok, 1 a step failed or the unit is not install-service's, 64 bad command
line, 77 not root.
"""


def _target_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dry-run", action="store_true", help="print each action without doing it")
    parser.add_argument("--root", default="/", metavar="DIR",
                        help="install into the system tree at DIR (an image or a test directory) "
                             "with useradd --root and systemctl --root; default /")
    parser.add_argument("--unit-dir", default="/etc/systemd/system", metavar="DIR",
                        help="directory for the unit, inside --root (default /etc/systemd/system)")
    parser.add_argument("--force", action="store_true",
                        help="replace or remove a unit that install-service did not write")


def register(subparsers: Any) -> None:
    """Add install-service and uninstall-service to the edge-agent subcommands."""
    p = subparsers.add_parser("install-service", help="install, enable and start the systemd service (pip installs)",
                              description=INSTALL_DESCRIPTION, epilog=INSTALL_EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    _target_options(p)
    p.add_argument("--exec", dest="executable", metavar="PATH",
                   help="the edge-agent script for ExecStart= (default: the one next to this Python)")
    p.add_argument("--config", default="/etc/edge-agent/agent.toml", metavar="FILE",
                   help="config file passed to `edge-agent run` (default /etc/edge-agent/agent.toml)")
    p.add_argument("--no-start", action="store_true", help="enable the service but do not start it")
    p.add_argument("--print-unit", action="store_true", help="print the unit it would write, change nothing")
    p.set_defaults(func=run_install)

    u = subparsers.add_parser("uninstall-service", help="stop, disable and remove the systemd service",
                              description=UNINSTALL_DESCRIPTION, epilog=UNINSTALL_EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    _target_options(u)
    u.add_argument("--purge", action="store_true",
                   help="also delete /etc/edge-agent, /var/lib/edge-agent and the cache and log dirs")
    u.set_defaults(func=run_uninstall)


def _target(args: argparse.Namespace) -> Any:
    from .service import Target

    return Target(root=Path(args.root), unit_dir=args.unit_dir)


def run_install(args: argparse.Namespace, *, runner: Any = None, euid: int | None = None) -> int:
    from . import service

    target = _target(args)
    executable = Path(args.executable) if args.executable else service.default_executable()
    if args.print_unit:
        sys.stdout.write(service.unit_for(target, executable=executable, config=args.config))
        return EXIT_OK
    service.install(target, runner, dry_run=args.dry_run, euid=euid, executable=executable,
                    config=args.config, start=not args.no_start, force=args.force)
    return EXIT_OK


def run_uninstall(args: argparse.Namespace, *, runner: Any = None, euid: int | None = None) -> int:
    from . import service

    service.uninstall(_target(args), runner, dry_run=args.dry_run, euid=euid, purge=args.purge,
                      force=args.force)
    return EXIT_OK
