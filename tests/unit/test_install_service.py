"""`edge-agent install-service` / `uninstall-service`, installed into a tree under tmp_path.

Offline installs run the real commands (`useradd --root`, `systemctl --root`) against the
tree, and the written unit goes through the real `systemd-analyze verify` and `security`.
The running system is never touched: the booted-systemd path is checked with --dry-run,
and the only fake is a Runner (the project's own seam) that fails a command on purpose.
"""

from __future__ import annotations

import argparse
import io
import os
import pwd
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from edge_agent.agent import service, service_cli
from edge_agent.agent.service import (
    MARKER,
    CommandResult,
    NotRootError,
    ServiceError,
    SubprocessRunner,
    Target,
)
from edge_agent.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "packaging" / "systemd" / "edge-agent.service"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A minimal system tree: root, and two of the unit's four groups (i2c, video)."""
    tree = tmp_path / "root"
    etc = tree / "etc"
    etc.mkdir(parents=True)
    (etc / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (etc / "group").write_text("root:x:0:\ni2c:x:998:\nvideo:x:44:\n")
    (etc / "shadow").write_text("root:*:19000:0:99999:7:::\n")
    (etc / "gshadow").write_text("root:*::\n")
    for name in ("shadow", "gshadow"):
        (etc / name).chmod(0o640)
    return tree


@pytest.fixture
def agent_script(tmp_path: Path) -> Path:
    """Stands in for a venv's edge-agent: an executable outside /home and /root."""
    script = tmp_path / "opt" / "venv" / "bin" / "edge-agent"
    script.parent.mkdir(parents=True)
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(0o755)
    return script


class FailingRunner:
    """Fails one command (by program name) and records every call."""

    def __init__(self, fail: str) -> None:
        self.fail, self.calls = fail, []

    def run(self, argv: Sequence[str]) -> CommandResult:
        self.calls.append(list(argv))
        if argv[0] == self.fail:
            return CommandResult(1, f"{self.fail}: simulated failure")
        return SubprocessRunner().run(argv)


def _snapshot(tree: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(tree)): (p.read_bytes() if p.is_file() else None) for p in sorted(tree.rglob("*"))}


def _passwd(tree: Path) -> dict[str, list[str]]:
    return {ln.split(":")[0]: ln.split(":") for ln in (tree / "etc" / "passwd").read_text().splitlines()}


def _install(root: Path, script: Path, **kw: object) -> str:
    out = io.StringIO()
    service.install(Target(root=root), SubprocessRunner(), out=out, executable=script, **kw)  # type: ignore[arg-type]
    return out.getvalue()


def test_dry_run_prints_each_action_and_changes_nothing(root: Path, agent_script: Path) -> None:
    before = _snapshot(root)
    out = io.StringIO()
    service.install(Target(root=root), FailingRunner(fail="any"), dry_run=True, out=out, euid=1000,
                    executable=agent_script)
    lines = [ln for ln in out.getvalue().splitlines() if ln.startswith("would: ")]
    assert lines == [
        f"would: useradd --root={root} --system --user-group --home-dir /var/lib/edge-agent "
        "--no-create-home --shell /usr/sbin/nologin edge-agent",
        "would: install -d -m 0750 -o root -g edge-agent /etc/edge-agent",
        "would: install -d -m 0750 -o edge-agent -g edge-agent /var/lib/edge-agent",
        f"would: write /etc/systemd/system/edge-agent.service (ExecStart={agent_script} ...; "
        "SupplementaryGroups=i2c video)",
        f"would: systemctl --root={root} enable edge-agent.service",
    ]
    assert _snapshot(root) == before  # not a byte written, although euid 1000 is not root


def test_install_into_a_tree_creates_user_dirs_and_an_enabled_verified_unit(root: Path, agent_script: Path) -> None:
    out = _install(root, agent_script)
    user = _passwd(root)["edge-agent"]
    assert user[5:] == ["/var/lib/edge-agent", "/usr/sbin/nologin"]
    uid, gid = int(user[2]), int(user[3])
    assert uid < 1000  # --system
    for path, owner, mode in (("etc/edge-agent", 0, 0o750), ("var/lib/edge-agent", uid, 0o750)):
        st = (root / path).stat()
        assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (owner, gid, mode), path

    unit = root / "etc/systemd/system/edge-agent.service"
    text = unit.read_text()
    assert unit.stat().st_mode & 0o777 == 0o644
    assert text.startswith(MARKER)
    assert f"\nExecStart={agent_script} run --config /etc/edge-agent/agent.toml\n" in text
    assert "\nSupplementaryGroups=i2c video\n" in text  # gpio and plugdev do not exist in this tree
    assert "left out groups missing here: gpio plugdev" in text
    wants = root / "etc/systemd/system/multi-user.target.wants/edge-agent.service"
    assert wants.is_symlink() and os.readlink(wants) == "/etc/systemd/system/edge-agent.service"
    assert "not started: /etc/edge-agent/agent.toml does not exist yet" in out

    verify = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert verify.returncode == 0 and verify.stderr.strip() == "", verify.stderr
    security = subprocess.run(["systemd-analyze", "security", "--offline=true", "--no-pager", str(unit)],
                              capture_output=True, text=True, timeout=60)
    score = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", security.stdout)
    assert score and float(score.group(1)) <= 2.5, security.stdout[-1500:]  # rendering kept the hardening
    with pytest.raises(KeyError):
        pwd.getpwnam("edge-agent")  # the offline install left this machine alone


def test_rendered_unit_differs_from_the_packaging_template_only_where_intended(root: Path, agent_script: Path) -> None:
    assert service.unit_template_path() == TEMPLATE  # one source of truth
    rendered = service.unit_for(Target(root=root), executable=agent_script, config="/srv/agent.toml")
    template_lines = TEMPLATE.read_text().splitlines()
    changed = [ln for ln in rendered.splitlines() if ln not in template_lines]
    assert changed == [
        MARKER,
        "# Template: packaging/systemd/edge-agent.service (edge-agent), rendered for this system.",
        f"ExecStart={agent_script} run --config /srv/agent.toml",
        "# install-service: left out groups missing here: gpio plugdev",
        "SupplementaryGroups=i2c video",
    ]
    dropped = [ln for ln in template_lines if ln not in rendered.splitlines()]
    assert [ln.split("=")[0] for ln in dropped] == ["ExecStart", "SupplementaryGroups"]


def test_no_group_left_comments_the_line_out(root: Path, agent_script: Path) -> None:
    (root / "etc/group").write_text("root:x:0:\n")
    rendered = service.unit_for(Target(root=root), executable=agent_script)
    assert "\nSupplementaryGroups=" not in rendered and "# SupplementaryGroups= (none exist)" in rendered


def test_installing_again_updates_the_unit_without_a_second_user(root: Path, agent_script: Path,
                                                                tmp_path: Path) -> None:
    _install(root, agent_script)
    (root / "etc/edge-agent/agent.toml").write_text("[device]\nid = 'pi-1'\n")
    out = _install(root, agent_script, config="/etc/edge-agent/agent.toml")
    assert "useradd" not in out
    assert "not started" not in out and "starts at the next boot" in out
    assert list(_passwd(root)) == ["root", "edge-agent"]
    assert (root / "etc/edge-agent/agent.toml").exists()  # an update never touches the config


def test_refuses_without_root_and_writes_nothing(root: Path, agent_script: Path) -> None:
    before = _snapshot(root)
    with pytest.raises(NotRootError, match="needs root") as info:
        service.install(Target(root=root), SubprocessRunner(), euid=1000, executable=agent_script,
                        out=io.StringIO())
    assert info.value.exit_code == 77
    with pytest.raises(NotRootError):
        service.uninstall(Target(root=root), SubprocessRunner(), euid=1000, out=io.StringIO())
    assert _snapshot(root) == before


def test_refuses_an_interpreter_that_protecthome_hides(root: Path, tmp_path: Path) -> None:
    script = tmp_path / "bin" / "edge-agent"
    script.parent.mkdir()
    script.write_text("#!/home/pi/venv/bin/python\n")
    script.chmod(0o755)
    with pytest.raises(ConfigError, match="ProtectHome=yes.*/home/pi/venv/bin/python") as info:
        service.install(Target(root=root), SubprocessRunner(), executable=script, out=io.StringIO())
    assert info.value.exit_code == 78
    assert not (root / "etc/systemd").exists()


def test_a_failed_command_stops_before_the_unit_is_written(root: Path, agent_script: Path) -> None:
    runner = FailingRunner(fail="useradd")
    with pytest.raises(ServiceError, match="useradd.*simulated failure"):
        service.install(Target(root=root), runner, executable=agent_script, out=io.StringIO())
    assert [c[0] for c in runner.calls] == ["useradd"]
    assert not (root / "etc/systemd/system/edge-agent.service").exists()


def test_does_not_shadow_the_debian_package_or_replace_a_foreign_unit(root: Path, agent_script: Path) -> None:
    packaged = root / "lib/systemd/system/edge-agent.service"
    packaged.parent.mkdir(parents=True)
    packaged.write_text(TEMPLATE.read_text())
    with pytest.raises(ServiceError, match="Debian package"):
        _install(root, agent_script)
    packaged.unlink()
    foreign = root / "etc/systemd/system/edge-agent.service"
    foreign.parent.mkdir(parents=True)
    foreign.write_text("[Service]\nExecStart=/bin/true\n")
    with pytest.raises(ServiceError, match="not written by install-service"):
        _install(root, agent_script)
    with pytest.raises(ServiceError, match="not written by install-service"):
        service.uninstall(Target(root=root), SubprocessRunner(), out=io.StringIO())
    _install(root, agent_script, force=True)
    assert foreign.read_text().startswith(MARKER)


def test_uninstall_keeps_config_and_state_and_purge_removes_them(root: Path, agent_script: Path) -> None:
    _install(root, agent_script)
    (root / "etc/edge-agent/agent.toml").write_text("[device]\nid = 'pi-1'\n")
    (root / "var/lib/edge-agent/device.key").write_text("secret")
    out = io.StringIO()
    service.uninstall(Target(root=root), SubprocessRunner(), out=out)
    assert not (root / "etc/systemd/system/edge-agent.service").exists()
    assert not (root / "etc/systemd/system/multi-user.target.wants/edge-agent.service").is_symlink()
    assert (root / "etc/edge-agent/agent.toml").exists() and (root / "var/lib/edge-agent/device.key").exists()
    assert "kept /etc/edge-agent and /var/lib/edge-agent" in out.getvalue()

    out = io.StringIO()
    service.uninstall(Target(root=root), SubprocessRunner(), purge=True, out=out)
    assert not (root / "etc/edge-agent").exists() and not (root / "var/lib/edge-agent").exists()
    assert "edge-agent" in _passwd(root)  # the user stays (files it owns may remain)
    assert "is not installed" in out.getvalue()


def test_on_a_booted_system_it_reloads_and_starts_only_once_configured(tmp_path: Path, agent_script: Path) -> None:
    target = Target(root=Path("/"), systemd=True)
    config = tmp_path / "agent.toml"

    def steps(**kw: object) -> list[str]:
        out = io.StringIO()
        service.install(target, FailingRunner(fail="any"), dry_run=True, out=out, executable=agent_script,
                        config=str(config), **kw)  # type: ignore[arg-type]
        return out.getvalue().splitlines()

    without = steps()
    assert without[-3:-1] == ["would: systemctl daemon-reload", "would: systemctl enable edge-agent.service"]
    assert any("not started" in ln for ln in without)
    config.write_text("")
    assert "would: systemctl enable --now edge-agent.service" in steps()
    assert "would: systemctl enable edge-agent.service" in steps(start=False)

    out = io.StringIO()
    unit = tmp_path / "units" / "edge-agent.service"
    unit.parent.mkdir()
    unit.write_text(MARKER + "\n")
    service.uninstall(Target(root=Path("/"), unit_dir=str(unit.parent), systemd=True), FailingRunner(fail="any"),
                      dry_run=True, purge=True, out=out)
    assert out.getvalue().splitlines()[:4] == [
        "would: systemctl disable --now edge-agent.service", f"would: rm -f {unit}",
        "would: systemctl daemon-reload", "would: systemctl reset-failed edge-agent.service"]
    assert unit.exists()


def test_default_executable_is_this_installations_script() -> None:
    assert service.default_executable() == Path(sys.executable).parent / "edge-agent"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edge-agent")
    service_cli.register(parser.add_subparsers(dest="command"))
    return parser


def test_cli_installs_into_root_and_prints_the_unit(root: Path, agent_script: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    parser = _parser()
    args = parser.parse_args(["install-service", "--root", str(root), "--exec", str(agent_script), "--print-unit"])
    assert args.func(args) == 0
    assert f"ExecStart={agent_script} run --config" in capsys.readouterr().out
    assert not (root / "etc/systemd").exists()
    args = parser.parse_args(["install-service", "--root", str(root), "--exec", str(agent_script)])
    assert args.func(args) == 0
    assert (root / "etc/systemd/system/edge-agent.service").is_file()
    args = parser.parse_args(["uninstall-service", "--root", str(root), "--purge"])
    assert args.func(args) == 0
    assert not (root / "etc/systemd/system/edge-agent.service").exists() and not (root / "etc/edge-agent").exists()
    with pytest.raises(NotRootError):
        args = parser.parse_args(["uninstall-service", "--root", str(root)])
        service_cli.run_uninstall(args, euid=1000)


def test_help_teaches_with_examples(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("install-service", "uninstall-service"):
        with pytest.raises(SystemExit):
            _parser().parse_args([command, "--help"])
        text = capsys.readouterr().out
        assert "examples:" in text and f"sudo edge-agent {command}" in text.replace(
            "/opt/edge-agent/venv/bin/", "") and "--dry-run" in text
