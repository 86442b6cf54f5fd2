"""Install the agent as a systemd service from a pip install (`edge-agent install-service`).

The Debian package installs the unit itself; this is the same result for `pip install` into
a virtualenv. The unit is rendered from the ONE template, packaging/systemd/edge-agent.service
(found in the source tree, or in <prefix>/share/edge-agent/systemd/ for a wheel install),
with ExecStart pointed at this installation's `edge-agent` and SupplementaryGroups cut down
to the groups that exist (systemd refuses to start a unit naming a missing group).

Every change is a `Step`: a line `--dry-run` prints, and an action. Commands go through a
`Runner` (the project-defined seam tests replace); with `root` other than "/" the install is
offline into a tree (`useradd --root`, `systemctl --root`), which is how the tests install
into a temporary directory without touching this machine.
"""

from __future__ import annotations

import grp
import os
import pwd
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TextIO

from ..atomic import atomic_write_text
from ..errors import EXIT_FAILURE, EXIT_NOPERM, ConfigError, EdgeAgentError

UNIT_NAME = "edge-agent.service"
SERVICE_USER = "edge-agent"
CONFIG_DIR = "/etc/edge-agent"
STATE_DIR = "/var/lib/edge-agent"
DEFAULT_CONFIG = f"{CONFIG_DIR}/agent.toml"
DEFAULT_UNIT_DIR = "/etc/systemd/system"
# Where the Debian package puts the unit: install-service must not shadow it.
PACKAGED_UNIT_DIRS = ("/lib/systemd/system", "/usr/lib/systemd/system")
# StateDirectory=, ConfigurationDirectory=, CacheDirectory=, LogsDirectory= of the unit.
PURGE_DIRS = (CONFIG_DIR, STATE_DIR, "/var/cache/edge-agent", "/var/log/edge-agent")
# The unit runs with ProtectHome=yes: an interpreter or script under these is invisible to it.
PROTECTED_PREFIXES = ("/home", "/root", "/run/user")
MARKER = "# Written by `edge-agent install-service`; remove it with `edge-agent uninstall-service`."
TEMPLATE_ENV = "EDGE_AGENT_UNIT_TEMPLATE"




class NotRootError(EdgeAgentError):
    """Installing a system service needs root."""

    exit_code = EXIT_NOPERM


class ServiceError(EdgeAgentError):
    """A step of the installation failed, or would damage another installation."""

    exit_code = EXIT_FAILURE


@dataclass(frozen=True)
class CommandResult:
    returncode: int
    output: str


class Runner(Protocol):
    """Runs one external command (useradd, systemctl); tests substitute their own."""

    def run(self, argv: Sequence[str]) -> CommandResult: ...


class SubprocessRunner:
    def run(self, argv: Sequence[str]) -> CommandResult:
        try:
            proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=300, check=False)
        except FileNotFoundError:
            return CommandResult(127, f"{argv[0]}: command not found")
        return CommandResult(proc.returncode, (proc.stdout + proc.stderr).strip())


@dataclass(frozen=True)
class Step:
    text: str  # what --dry-run prints: a shell command, or what is written
    action: Callable[[], None]


@dataclass
class Plan:
    steps: list[Step] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # printed after the steps (next things to do)

    def run(self, *, dry_run: bool, out: TextIO) -> None:
        for step in self.steps:
            print(("would: " if dry_run else "") + step.text, file=out, flush=True)
            if not dry_run:
                step.action()
        for note in self.notes:
            print(note, file=out)


@dataclass(frozen=True)
class Target:
    """Where to install: the running system (root "/") or a tree (offline, for images and tests)."""

    root: Path = Path("/")
    unit_dir: str = DEFAULT_UNIT_DIR
    systemd: bool | None = None  # is systemd PID 1 on the running system? None: detect it

    @property
    def offline(self) -> bool:
        return self.root.resolve() != Path("/")

    def path(self, absolute: str) -> Path:
        return self.root / absolute.lstrip("/")

    @property
    def unit_path(self) -> Path:
        return self.path(self.unit_dir) / UNIT_NAME

    def systemctl(self, *args: str) -> list[str]:
        return ["systemctl", f"--root={self.root}", *args] if self.offline else ["systemctl", *args]

    def booted(self) -> bool:
        """systemd is PID 1 here (sd_booted): only then can units be reloaded and started."""
        if self.offline:
            return False
        return self.systemd if self.systemd is not None else Path("/run/systemd/system").is_dir()


# --- what exists on the target ------------------------------------------------------------

def _db_entry(target: Target, db: str, name: str) -> list[str] | None:
    """A passwd/group line of `name` under an offline root (the running system uses NSS)."""
    try:
        lines = target.path(f"/etc/{db}").read_text().splitlines()
    except FileNotFoundError:
        return None
    return next((ln.split(":") for ln in lines if ln.split(":", 1)[0] == name), None)


def group_id(target: Target, name: str) -> int | None:
    if target.offline:
        entry = _db_entry(target, "group", name)
        return int(entry[2]) if entry and len(entry) > 2 else None
    try:
        return grp.getgrnam(name).gr_gid  # NSS, the same answer as `getent group`
    except KeyError:
        return None


def user_id(target: Target, name: str) -> int | None:
    if target.offline:
        entry = _db_entry(target, "passwd", name)
        return int(entry[2]) if entry and len(entry) > 2 else None
    try:
        return pwd.getpwnam(name).pw_uid
    except KeyError:
        return None


# --- the unit -------------------------------------------------------------------------------

def unit_template_path() -> Path:
    """The shipped unit: $EDGE_AGENT_UNIT_TEMPLATE, the source tree, or the installed share dir."""
    override = os.environ.get(TEMPLATE_ENV)
    candidates = [Path(override)] if override else []
    candidates += [Path(__file__).resolve().parents[2] / "packaging" / "systemd" / UNIT_NAME,
                   Path(sys.prefix) / "share" / "edge-agent" / "systemd" / UNIT_NAME]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise ServiceError(f"the unit template {UNIT_NAME} is not installed (looked in "
                       f"{', '.join(map(str, candidates))}); reinstall edge-agent")


def default_executable() -> Path:
    """This installation's `edge-agent` script: next to the running interpreter (a venv's bin/)."""
    sibling = Path(sys.executable).parent / "edge-agent"  # not resolved: a venv's python is a symlink
    if sibling.is_file() and os.access(sibling, os.X_OK):
        return sibling
    found = shutil.which("edge-agent")
    if found:
        return Path(found)
    raise ServiceError(f"no edge-agent script next to {sys.executable} or on PATH; pass --exec")


def _interpreter(script: Path) -> Path | None:
    try:
        with script.open("rb") as handle:
            first = handle.readline(512)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    words = first[2:].decode(errors="replace").split()
    return Path(words[0]) if words else None


def protect_home_conflicts(executable: Path) -> list[str]:
    """Paths the service needs that ProtectHome=yes hides: the script and its interpreter,
    symlinks followed (a venv's python usually links to the base interpreter)."""
    needed = [executable, executable.resolve()]
    interpreter = _interpreter(executable)
    if interpreter is not None:
        needed += [interpreter, interpreter.resolve()]
    hidden = []
    for path in needed:
        if any(path == Path(p) or Path(p) in path.parents for p in PROTECTED_PREFIXES):
            hidden.append(str(path))
    return list(dict.fromkeys(hidden))


def render_unit(template: str, *, executable: Path, config: str, groups_present: Callable[[str], bool]) -> str:
    """The template with ExecStart=<executable> run --config <config>, and only existing groups."""
    out = [MARKER, f"# Template: packaging/systemd/{UNIT_NAME} (edge-agent), rendered for this system."]
    exec_lines = 0
    for line in template.splitlines():
        key, _, value = line.partition("=")
        if key == "ExecStart":
            exec_lines += 1
            words = shlex.split(value)
            if "--config" in words:
                words[words.index("--config") + 1] = config
            line = "ExecStart=" + shlex.join([str(executable), *words[1:]])
        elif key == "SupplementaryGroups":
            kept = [g for g in value.split() if groups_present(g)]
            missing = [g for g in value.split() if g not in kept]
            if missing:
                out.append(f"# install-service: left out groups missing here: {' '.join(missing)}")
            line = f"SupplementaryGroups={' '.join(kept)}" if kept else "# SupplementaryGroups= (none exist)"
        out.append(line)
    if exec_lines != 1:
        raise ServiceError(f"the unit template has {exec_lines} ExecStart= lines, expected 1")
    return "\n".join(out) + "\n"


def unit_for(target: Target, *, executable: Path, config: str = DEFAULT_CONFIG,
             template: Path | None = None) -> str:
    """The unit install-service would write on `target` (what --print-unit shows)."""
    return render_unit((template or unit_template_path()).read_text(), executable=executable, config=config,
                       groups_present=lambda g: group_id(target, g) is not None)


# --- plans ----------------------------------------------------------------------------------

def _require_root(euid: int | None, what: str) -> None:
    if (os.geteuid() if euid is None else euid) != 0:
        raise NotRootError(f"{what} needs root: run it with sudo (or try --dry-run to see each step)")


def _command(runner: Runner, argv: list[str], *, tolerate: bool = False) -> Step:
    def action() -> None:
        result = runner.run(argv)
        if result.returncode != 0 and not tolerate:
            raise ServiceError(f"`{shlex.join(argv)}` failed ({result.returncode}): {result.output[-500:]}")

    return Step(shlex.join(argv), action)


def _make_dir(target: Target, path: str, owner: str, group: str, mode: int) -> Step:
    def action() -> None:
        uid, gid = user_id(target, owner), group_id(target, group)
        if uid is None or gid is None:
            raise ServiceError(f"cannot own {path} by {owner}:{group}: no such user or group")
        where = target.path(path)
        where.mkdir(parents=True, exist_ok=True)
        os.chown(where, uid, gid)
        os.chmod(where, mode)

    return Step(f"install -d -m {mode:04o} -o {owner} -g {group} {path}", action)


def _remove_tree(target: Target, path: str) -> Step:
    return Step(f"rm -rf {path}", lambda: shutil.rmtree(target.path(path), ignore_errors=True))


def _packaged_unit(target: Target) -> Path | None:
    return next((target.path(d) / UNIT_NAME for d in PACKAGED_UNIT_DIRS
                 if (target.path(d) / UNIT_NAME).is_file()), None)


def plan_install(target: Target, runner: Runner, *, executable: Path | None = None,
                 config: str = DEFAULT_CONFIG, start: bool = True, force: bool = False,
                 template: Path | None = None) -> Plan:
    """Every step of installing the service on `target`; nothing is changed until Plan.run."""
    executable = executable or default_executable()
    hidden = protect_home_conflicts(executable)
    if hidden:
        raise ConfigError(
            f"the service runs with ProtectHome=yes and could not reach {', '.join(hidden)}: install "
            "edge-agent into a virtualenv outside /home and /root, e.g. `python3.11 -m venv "
            "/opt/edge-agent/venv && /opt/edge-agent/venv/bin/pip install ./mxedge_agent-*.whl`, then run "
            "`sudo /opt/edge-agent/venv/bin/edge-agent install-service`")
    packaged = _packaged_unit(target)
    if packaged and not force:
        raise ServiceError(f"{packaged} exists: edge-agent is installed from the Debian package, which "
                           "manages the service (`apt remove edge-agent` first, or --force to shadow it)")
    existing = target.unit_path
    if existing.is_file() and MARKER not in existing.read_text(errors="replace") and not force:
        raise ServiceError(f"{existing} was not written by install-service; refusing to replace it "
                           "(--force replaces it)")
    unit = unit_for(target, executable=executable, config=config, template=template)
    plan = Plan()
    if user_id(target, SERVICE_USER) is None:
        root_opt = [f"--root={target.root}"] if target.offline else []
        plan.steps.append(_command(runner, ["useradd", *root_opt, "--system", "--user-group", "--home-dir",
                                            STATE_DIR, "--no-create-home", "--shell", "/usr/sbin/nologin",
                                            SERVICE_USER]))
    # The agent reads its config but never writes it; its state is its own.
    plan.steps.append(_make_dir(target, CONFIG_DIR, "root", SERVICE_USER, 0o750))
    plan.steps.append(_make_dir(target, STATE_DIR, SERVICE_USER, SERVICE_USER, 0o750))
    kept = next((ln for ln in unit.splitlines() if ln.startswith("SupplementaryGroups=")), "no SupplementaryGroups")
    plan.steps.append(Step(f"write {target.unit_dir}/{UNIT_NAME} (ExecStart={executable} ...; {kept})",
                           lambda: atomic_write_text(existing, unit, mode=0o644)))
    has_config = target.path(config).is_file()
    if target.booted():
        plan.steps.append(_command(runner, target.systemctl("daemon-reload")))
        now = start and has_config
        plan.steps.append(_command(runner, target.systemctl("enable", *(["--now"] if now else []), UNIT_NAME)))
        if now:
            plan.notes.append("started: follow it with `journalctl -u edge-agent -f`")
    else:
        # No running systemd (an image, a container, a chroot): enabling is only symlinks.
        plan.steps.append(_command(runner, target.systemctl("enable", UNIT_NAME)))
        plan.notes.append("enabled; it starts at the next boot (systemd is not running here)")
    if not has_config:
        plan.notes.append(f"not started: {config} does not exist yet. Create it with `edge-agent init`, "
                          "then `sudo systemctl start edge-agent`")
    elif not start and target.booted():
        plan.notes.append("enabled, not started (--no-start): `sudo systemctl start edge-agent`")
    return plan


def plan_uninstall(target: Target, runner: Runner, *, purge: bool = False, force: bool = False) -> Plan:
    """Stop, disable and remove the unit install-service wrote; --purge also removes config and
    state. The edge-agent user is kept: files it owns may remain elsewhere (Debian does the same)."""
    plan = Plan()
    unit = target.unit_path
    if unit.is_file():
        if MARKER not in unit.read_text(errors="replace") and not force:
            raise ServiceError(f"{unit} was not written by install-service; refusing to remove it "
                               "(--force removes it)")
        if target.booted():
            plan.steps.append(_command(runner, target.systemctl("disable", "--now", UNIT_NAME)))
        else:
            plan.steps.append(_command(runner, target.systemctl("disable", UNIT_NAME)))
        plan.steps.append(Step(f"rm -f {target.unit_dir}/{UNIT_NAME}", lambda: unit.unlink(missing_ok=True)))
        if target.booted():
            plan.steps.append(_command(runner, target.systemctl("daemon-reload")))
            plan.steps.append(_command(runner, target.systemctl("reset-failed", UNIT_NAME), tolerate=True))
    else:
        packaged = _packaged_unit(target)
        plan.notes.append(f"{target.unit_dir}/{UNIT_NAME} is not installed" +
                          (f"; {packaged} belongs to the Debian package: `apt remove edge-agent`" if packaged else ""))
    if purge:
        plan.steps += [_remove_tree(target, d) for d in PURGE_DIRS]
        plan.notes.append(f"the {SERVICE_USER} user is kept; remove it with `userdel {SERVICE_USER}`")
    else:
        plan.notes.append(f"kept {CONFIG_DIR} and {STATE_DIR} (--purge removes them)")
    return plan


def install(target: Target, runner: Runner | None = None, *, dry_run: bool = False, out: TextIO = sys.stdout,
            euid: int | None = None, executable: Path | None = None, config: str = DEFAULT_CONFIG,
            start: bool = True, force: bool = False, template: Path | None = None) -> Plan:
    """Plan and (unless dry_run) carry out the installation; returns the plan."""
    if not dry_run:
        _require_root(euid, "install-service")
    plan = plan_install(target, runner or SubprocessRunner(), executable=executable, config=config,
                        start=start, force=force, template=template)
    plan.run(dry_run=dry_run, out=out)
    return plan


def uninstall(target: Target, runner: Runner | None = None, *, dry_run: bool = False, out: TextIO = sys.stdout,
              euid: int | None = None, purge: bool = False, force: bool = False) -> Plan:
    if not dry_run:
        _require_root(euid, "uninstall-service")
    plan = plan_uninstall(target, runner or SubprocessRunner(), purge=purge, force=force)
    plan.run(dry_run=dry_run, out=out)
    return plan
