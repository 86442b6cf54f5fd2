"""One exit-code table, enforced (edge_agent.errors): every subcommand of edge-agent and
edge-coordinator, found by walking the parsers themselves (a new command is covered without
editing this file), answers a bad flag or a bad flag value with exit 64 and one line on
stderr; the bad values the issue found are 64 through the real entry points too; a closed
output pipe is silent (141); and no user input produces a traceback."""

from __future__ import annotations

import argparse
import base64
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from edge_agent.cli import build_parser as agent_parser
from edge_agent.cli import main as agent_main
from edge_agent.coordinator.cli import build_parser as coordinator_parser
from edge_agent.coordinator.cli import main as coordinator_main
from edge_agent.errors import EXIT_BROKEN_PIPE, EXIT_USAGE

REPO = Path(__file__).resolve().parents[2]
MODULES = {"edge-agent": "edge_agent.cli", "edge-coordinator": "edge_agent.coordinator.cli"}
# A value no flag with a type or choices accepts: not a number, a duration, a host (space,
# '/', '#'), a name, an engine or KEY=VALUE.
BAD_VALUE = "bad value/#"


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[
        tuple[tuple[str, ...], argparse.ArgumentParser, bool]]:
    """(argv prefix, parser, has_subcommands) for the parser and every parser below it."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    yield path, parser, bool(subs)
    for action in subs:
        for name, sub in action.choices.items():
            yield from _commands(sub, (*path, name))


def _typed_options(parser: argparse.ArgumentParser) -> Iterator[str]:
    """Option strings whose value is checked at parse time (a type converter or choices)."""
    for action in parser._actions:
        if not action.option_strings or action.nargs == 0:
            continue
        if action.choices is not None or action.type not in (None, str, Path):
            yield action.option_strings[-1]


CLIS: list[tuple[str, Callable[[], argparse.ArgumentParser], Callable[[list[str]], int]]] = [
    ("edge-agent", agent_parser, agent_main), ("edge-coordinator", coordinator_parser, coordinator_main)]
LEAVES = [(prog, path, main) for prog, build, main in CLIS for path, _, subs in _commands(build())
          if path and not subs]
GROUPS = [(prog, path, main) for prog, build, main in CLIS for path, _, subs in _commands(build()) if path and subs]
TYPED = [(prog, path, option, main) for prog, build, main in CLIS for path, parser, subs in _commands(build())
         if path and not subs for option in _typed_options(parser)]


def test_the_walk_finds_every_command() -> None:
    names = {(prog, " ".join(path)) for prog, path, _ in LEAVES}
    for expected in [("edge-agent", c) for c in ("probe", "profiles check", "kernels", "finetune", "init", "run",
                                                 "install-service", "uninstall-service")] + \
                    [("edge-coordinator", c) for c in ("serve", "key", "devices", "approve", "tag", "train", "status",
                                                       "models", "cancel", "model create", "model inspect",
                                                       "model register")]:
        assert expected in names
    assert len(TYPED) >= 20  # the typed flags below are really exercised


def _usage_error(main: Callable[[list[str]], int], argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == EXIT_USAGE, (argv, info.value.code, err)
    assert err.count("\n") == 1 and ": error: " in err and "Traceback" not in err, (argv, err)
    return err


@pytest.mark.parametrize(("prog", "path", "main"), LEAVES, ids=lambda v: v if isinstance(v, str) else None)
def test_an_unknown_flag_is_a_one_line_usage_error(prog: str, path: tuple[str, ...], main, capsys) -> None:
    err = _usage_error(main, [*path, "--no-such-flag"], capsys)
    assert err.startswith(prog) and ("--no-such-flag" in err or "required" in err)


@pytest.mark.parametrize(("prog", "path", "main"), GROUPS, ids=lambda v: v if isinstance(v, str) else None)
def test_a_group_without_its_action_is_a_usage_error(prog: str, path: tuple[str, ...], main, capsys) -> None:
    _usage_error(main, list(path), capsys)
    _usage_error(main, [*path, "no-such-action"], capsys)


@pytest.mark.parametrize(("prog", "path", "option", "main"), TYPED,
                         ids=lambda v: v if isinstance(v, str) else None)
def test_a_bad_flag_value_is_a_one_line_usage_error(prog: str, path: tuple[str, ...], option: str, main,
                                                    capsys) -> None:
    err = _usage_error(main, [*path, option, BAD_VALUE], capsys)
    assert f"argument {option}" in err or f"/{option}:" in err  # argparse names "-k/--top-k" together


# ------------------------------------------------------------- through the real entry points
def _run(prog: str, *argv: str, cwd: Path, stdout: int | None = subprocess.PIPE) -> subprocess.CompletedProcess:
    env = {**os.environ, "EDGE_COORDINATOR_STATE_DIR": str(cwd / "coordinator"), "XDG_STATE_HOME": str(cwd)}
    return subprocess.run([sys.executable, "-m", MODULES[prog], *argv], cwd=cwd, env=env, stdout=stdout,
                          stderr=subprocess.PIPE, text=True, timeout=300)


BAD_VALUES = [
    # (command, the message must name) -- each was 2, 65, 69 or 78 before
    (("edge-coordinator", "train", "--model", "m", "--budget-wh", "-1"), "budget_wh"),
    (("edge-coordinator", "train", "--model", "m", "--epochs", "-1"), "params.epochs = -1 is outside 1..10000"),
    (("edge-coordinator", "train", "--model", "m", "--update-bytes", "10"), "params.update_bytes = 10 is outside 256.."),
    (("edge-coordinator", "train", "--model", "m", "--rounds", "0"), "--rounds"),
    (("edge-coordinator", "train", "--model", "m", "--param", "lr=nan"), "lr"),
    (("edge-agent", "finetune", "--model", "m", "--data", "d", "--budget-wh", "inf"), "--budget-wh"),
    (("edge-agent", "finetune", "--model", "m", "--data", "d", "--profile", "x86-64-generic", "--power-cap-w", "5"),
     "idle power of board profile x86-64-generic (6 W"),
    (("edge-agent", "kernels", "--model", "m", "--backends", "bogus"), "unknown engine 'bogus'"),
    (("edge-coordinator", "serve", "--tls", "--ca-file", "/nonexistent/ca.pem"), "/nonexistent/ca.pem: no such file"),
    (("edge-coordinator", "serve", "--ca-file", "NOT_PEM"), "not a PEM CA certificate"),
    (("edge-coordinator", "serve", "--password-file", "/nonexistent/pw"), "--password-file"),
    (("edge-agent", "profiles", "--dir", "/nonexistent", "list"), "--dir /nonexistent: no such directory"),
    (("edge-agent", "init", "--broker", "h", "--coordinator-key", "k", "--tls"), "--tls needs --ca-file"),
    (("edge-coordinator", "nonsense"), "invalid choice"),
]


@pytest.mark.parametrize(("argv", "message"), BAD_VALUES, ids=lambda v: " ".join(v[1:3]) if isinstance(v, tuple)
                         else None)
def test_bad_values_exit_64_in_one_line_through_the_entry_points(argv, message, tmp_path: Path) -> None:
    (tmp_path / "NOT_PEM").write_text("not a certificate\n")
    proc = _run(argv[0], *argv[1:], cwd=tmp_path)
    assert proc.returncode == EXIT_USAGE, (argv, proc.returncode, proc.stderr)
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert message in proc.stderr
    assert not (tmp_path / "coordinator" / "registry.sqlite").exists()  # nothing was queued


# ------------------------------------------------------------- a closed output pipe
def _closed_pipe_run(prog: str, *argv: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run with stdout a real pipe whose reader has already gone (`cmd | head` after head
    exited): every write fails with EPIPE, whatever the timing."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return _run(prog, *argv, cwd=cwd, stdout=write_end)
    finally:
        os.close(write_end)


def _registry_with_devices(root: Path, count: int) -> None:
    from edge_agent import keys
    from edge_agent.coordinator.registry import Registry

    with Registry(state_dir=root) as reg:
        for _ in range(count):
            key = keys.generate_private_key()
            reg.enrol_device(device_id=keys.fingerprint(key), fleet="lab",
                             public_key=base64.b64encode(keys.public_key_bytes(key)).decode())


@pytest.mark.parametrize("argv", [("edge-agent", "probe", "--json"), ("edge-agent", "profiles", "list"),
                                  ("edge-coordinator", "devices", "--json"), ("edge-coordinator", "devices")],
                         ids=" ".join)
def test_a_closed_pipe_is_silent_and_exits_141(argv, tmp_path: Path) -> None:
    _registry_with_devices(tmp_path / "coordinator", 3)
    proc = _closed_pipe_run(argv[0], *argv[1:], cwd=tmp_path)
    assert proc.returncode == EXIT_BROKEN_PIPE and proc.stderr == "", proc.stderr


def test_train_detach_into_a_closed_pipe_queues_the_job_and_exits_141(tmp_path: Path) -> None:
    import numpy as np

    from edge_agent import keys
    from edge_agent.config import public_key_text
    from edge_agent.coordinator.registry import Registry

    with Registry(state_dir=tmp_path / "coordinator") as reg:
        reg.add_model_version(name="digits", version="1", head={"w": np.zeros((2, 3), np.float32)})
        key = keys.generate_private_key()
        dev = reg.enrol_device(device_id=keys.fingerprint(key), public_key=public_key_text(key), fleet="lab",
                               approved=True)
        reg.record_state(dev.id, online=True, state={"battery_pct": 90, "on_power": True, "status": "idle"})
    proc = _closed_pipe_run("edge-coordinator", "train", "--model", "digits", "--detach", cwd=tmp_path)
    assert proc.returncode == EXIT_BROKEN_PIPE, proc.stderr
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr
    with Registry(state_dir=tmp_path / "coordinator") as reg:
        assert len(reg.list_jobs()) == 1  # the job was queued before the output was lost


def test_the_same_commands_print_when_the_reader_stays(tmp_path: Path) -> None:
    _registry_with_devices(tmp_path / "coordinator", 3)
    proc = _run("edge-coordinator", "devices", "--json", cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.count('"id"') == 3, proc.stderr


def test_an_unreadable_user_path_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    proc = _run("edge-coordinator", "key", "--state-dir", str(tmp_path / "file" / "sub"), cwd=tmp_path)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert str(tmp_path / "file") in proc.stderr and "Not a directory" in proc.stderr


def test_the_table_is_documented_in_the_readme() -> None:
    from edge_agent.errors import EXIT_CODES

    readme = (REPO / "README.md").read_text()
    table = readme[readme.index("## Exit codes"):]
    for code in EXIT_CODES:
        assert f"| {code} |" in table, code
