"""`edge-agent init` and `edge-agent run --check` (python -m edge_agent.agent.cli, the same
subcommands the main CLI registers)."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest

from edge_agent import keys
from edge_agent.agent.cli import main
from edge_agent.config import load_config, public_key_text
from edge_agent.errors import EXIT_CONFIG, EXIT_USAGE, ConfigError

BOARD = Path(__file__).resolve().parents[1] / "fixtures" / "boards" / "raspberry-pi-4"


@pytest.fixture
def coordinator_pub(tmp_path: Path) -> Path:
    """The coordinator's public key, and a fleet CA with a device certificate in tmp_path/certs
    (the project's own make-certs code)."""
    from edge_agent import certs

    certs.create_ca(tmp_path / "certs")
    certs.issue(tmp_path / "certs", "pi-07")
    path = tmp_path / "coordinator.pub"
    keys.save_public_key(path, keys.generate_private_key())
    return path


def _init(tmp_path: Path, coordinator: str, *extra: str, tls: tuple[str, ...] | None = None) -> int:
    """init with TLS to the fleet CA of `coordinator_pub` (tmp_path/certs), unless `tls` says otherwise."""
    (tmp_path / "data").mkdir(exist_ok=True)
    if tls is None:
        tls = ("--tls", "--ca-file", str(tmp_path / "certs" / "ca.pem"))
    return main(["init", "--broker", "mqtt.example.net:8883", *tls, "--fleet", "farms", "--coordinator-key",
                 coordinator, "--state-dir", str(tmp_path / "state"), "--config", str(tmp_path / "agent.toml"),
                 "--sysfs-root", str(BOARD), "--name", "pi-07", "--data-dir", str(tmp_path / "data"), *extra])


def test_init_writes_key_and_config_and_prints_the_enrolment_line(tmp_path, coordinator_pub, capsys) -> None:
    assert _init(tmp_path, str(coordinator_pub)) == 0
    out = capsys.readouterr().out
    key_file = tmp_path / "state" / "keys" / "device.key"
    assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
    key = keys.load_private_key(key_file)
    line = out.strip().splitlines()[-1]
    fields = dict(part.split("=", 1) for part in line.split()[1:])
    assert line.startswith("edge-agent-enrol/1 ")
    assert fields["id"] == keys.fingerprint(key) and fields["code"] == keys.enrolment_code(key)
    assert fields["key"] == public_key_text(key) and fields["fleet"] == "farms"
    assert fields["profile"] == "raspberry-pi-4" and fields["name"] == "pi-07"
    config = load_config(tmp_path / "agent.toml")
    assert config.get("broker", "port") == 8883 and config.get("broker", "tls") is True
    assert config.configured_device_id == fields["id"] and config.profile.name == "raspberry-pi-4"
    assert public_key_text(config.coordinator_public_key) == public_key_text(keys.load_public_key(coordinator_pub))
    assert "# energy_wh = 3.0" in (tmp_path / "agent.toml").read_text()  # the profile's budget, commented

    # again: refuses to overwrite the config; with --force rewrites it and keeps the key (and id)
    assert _init(tmp_path, str(coordinator_pub)) == EXIT_USAGE
    assert "exists; pass --force" in capsys.readouterr().err
    assert _init(tmp_path, public_key_text(keys.load_public_key(coordinator_pub)), "--force") == 0
    assert f"id={fields['id']}" in capsys.readouterr().out


def test_init_refuses_bad_arguments_before_writing_anything(tmp_path, coordinator_pub, capsys) -> None:
    assert _init(tmp_path, "bm90IGEga2V5") == EXIT_USAGE
    assert "--coordinator-key" in capsys.readouterr().err
    (tmp_path / "a-file").write_text("")
    assert _init(tmp_path, str(coordinator_pub), "--config", str(tmp_path / "a-file" / "agent.toml")) == EXIT_USAGE
    assert "a-file is not a directory" in capsys.readouterr().err
    for bad in (["--fleet", "farms/north"], ["--broker", "host:99999"], ["--topic-prefix", "a/+/b"]):
        with pytest.raises(SystemExit) as info:
            _init(tmp_path, str(coordinator_pub), *bad)
        assert info.value.code == EXIT_USAGE
    assert not (tmp_path / "agent.toml").exists() and not (tmp_path / "state").exists()


def test_init_writes_the_tls_files_and_refuses_unusable_ones(tmp_path, coordinator_pub, capsys) -> None:
    certs = tmp_path / "certs"
    bad_cases = [
        (("--tls",), "--tls needs --ca-file"),
        (("--ca-file", str(tmp_path / "none.pem")), "--ca-file " + str(tmp_path / "none.pem") + ": no such file"),
        (("--ca-file", str(certs / "pi-07.key")), "not a PEM CA certificate"),
        (("--ca-file", str(certs / "ca.pem"), "--cert-file", str(certs / "pi-07.pem")), "go together"),
        (("--ca-file", str(certs / "ca.pem"), "--cert-file", str(certs / "pi-07.pem"),
          "--key-file", str(certs / "ca.key")), "not a PEM certificate and its unencrypted private key"),
    ]
    for tls, message in bad_cases:
        assert _init(tmp_path, str(coordinator_pub), tls=tls) == EXIT_USAGE, tls
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "agent.toml").exists() and not (tmp_path / "state").exists()

    # --ca-file alone implies TLS; with the client certificate the config is complete
    files = {"ca_file": certs / "ca.pem", "cert_file": certs / "pi-07.pem", "key_file": certs / "pi-07.key"}
    assert _init(tmp_path, str(coordinator_pub), tls=tuple(
        arg for key, path in files.items() for arg in (f"--{key.replace('_', '-')}", str(path)))) == 0
    config = load_config(tmp_path / "agent.toml")
    assert config.get("broker", "tls") is True and config.get("broker", "port") == 8883
    assert {key: config.get("broker", key) for key in files} == {k: str(v) for k, v in files.items()}
    assert main(["run", "--config", str(tmp_path / "agent.toml"), "--check"]) == 0
    assert "(TLS)" in capsys.readouterr().out


def test_run_check_refuses_tls_without_a_ca_and_a_missing_data_dir(tmp_path, coordinator_pub, capsys) -> None:
    assert _init(tmp_path, str(coordinator_pub)) == 0
    config = tmp_path / "agent.toml"
    text = config.read_text()
    check = ["run", "--config", str(config), "--check"]
    assert main(check) == 0
    capsys.readouterr()

    no_ca = re.sub(r'(?m)^ca_file = .*$', "", text)
    assert "tls = true" in no_ca and "ca_file" not in no_ca
    config.write_text(no_ca)
    assert main(check) == EXIT_CONFIG
    assert "broker.tls: tls = true needs ca_file" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="needs ca_file"):  # the daemon loads the same way: it does not start
        load_config(config)

    config.write_text(text)
    (tmp_path / "data").rmdir()
    assert main(check) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert "data.dir" in err and str(tmp_path / "data") in err and "no such directory" in err


def test_run_check_reads_the_data_label_settings(tmp_path, coordinator_pub, capsys) -> None:
    assert _init(tmp_path, str(coordinator_pub)) == 0
    config = tmp_path / "agent.toml"
    text = config.read_text()
    assert "# label_map = " in text and "# skip_unknown = " in text  # init documents both
    check = ["run", "--config", str(config), "--check"]
    config.write_text(text.replace("[data]\n", '[data]\nlabel_map = "0=sky,1=tree"\nskip_unknown = true\n', 1))
    assert main(check) == 0
    assert load_config(config).get("data", "skip_unknown") is True
    config.write_text(text.replace("[data]\n", '[data]\nlabel_map = "sky"\n', 1))
    capsys.readouterr()
    assert main(check) == EXIT_CONFIG
    assert "data.label_map" in capsys.readouterr().err


def test_run_check(tmp_path, coordinator_pub, capsys) -> None:
    assert _init(tmp_path, str(coordinator_pub)) == 0
    device_id = re.search(r"device id:\s+(\S+)", capsys.readouterr().out).group(1)
    assert main(["run", "--config", str(tmp_path / "agent.toml"), "--check"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"ok: {tmp_path / 'agent.toml'}") and device_id in out and "raspberry-pi-4" in out
    (tmp_path / "state" / "keys" / "device.key").unlink()
    assert main(["run", "--config", str(tmp_path / "agent.toml"), "--check"]) == EXIT_CONFIG
    assert "key file not found" in capsys.readouterr().err


def test_help_teaches_with_examples(capsys) -> None:
    for command in ("init", "run"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "examples:" in capsys.readouterr().out


def test_init_hands_the_key_and_config_to_the_service_user(tmp_path, coordinator_pub, capsys) -> None:
    import pwd

    nobody = pwd.getpwnam("nobody")
    code = _init(tmp_path, str(coordinator_pub), "--service-user", "nobody")
    if os.geteuid() != 0:  # only root may give files away: refused, nothing written
        assert code == EXIT_USAGE and "needs root" in capsys.readouterr().err
        assert not (tmp_path / "agent.toml").exists()
        return
    assert code == 0 and "owned by nobody" in capsys.readouterr().out
    key = os.stat(tmp_path / "state" / "keys" / "device.key")
    assert (key.st_uid, key.st_gid, stat.S_IMODE(key.st_mode)) == (nobody.pw_uid, nobody.pw_gid, 0o600)
    assert os.stat(tmp_path / "state" / "keys").st_uid == nobody.pw_uid
    config = os.stat(tmp_path / "agent.toml")
    assert (config.st_uid, config.st_gid, stat.S_IMODE(config.st_mode)) == (0, nobody.pw_gid, 0o640)
    assert _init(tmp_path, str(coordinator_pub), "--force", "--service-user", "no-such-user-x") == EXIT_USAGE


def test_a_second_run_on_one_state_dir_exits_69_and_ctrl_c_exits_130(tmp_path, coordinator_pub) -> None:
    """Issue 35, items 9 and 10. A second `run` on the same config is refused (exit 69, naming
    the first one's pid) -- before: it ran beside the first, both writing one state dir and
    taking each other's broker session over. The first then stops cleanly on Ctrl-C with 130,
    the exit-code table's "interrupted" (before: 0). No broker is needed: the daemon starts,
    takes its lock and keeps trying to connect (port 9 refuses)."""
    import signal
    import subprocess
    import sys
    import time

    assert _init(tmp_path, str(coordinator_pub), tls=()) == 0
    config = tmp_path / "agent.toml"
    config.write_text(config.read_text().replace("port = 8883", "port = 9").replace("port = 1883", "port = 9"))
    argv = [sys.executable, "-m", "edge_agent.agent.cli", "run", "--config", str(config)]
    log = tmp_path / "first.log"
    with log.open("wb") as out:
        first = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120  # (bounds a hang only) its start-up line: it holds the lock
        while "enrolment code" not in log.read_text(errors="replace"):
            assert first.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")
            time.sleep(0.05)
        second = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert second.returncode == 69, (second.returncode, second.stderr[-2000:])
        assert f"another edge-agent run (pid {first.pid}) is using this state directory" in second.stderr
        assert "Traceback" not in second.stderr
        assert first.poll() is None  # the first is untouched
        first.send_signal(signal.SIGINT)
        assert first.wait(60) == 130, log.read_text(errors="replace")[-3000:]
        assert "stopping: checkpointing the training child" in log.read_text(errors="replace")  # a clean stop
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(10)
