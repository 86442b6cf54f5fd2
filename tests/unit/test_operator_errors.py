"""Small things an operator meets first (issue 35, item 14): a probe of a directory that
does not exist, a port already taken, and an install that prints no deprecation warnings.
Each as the operator sees it: the real command's exit code and its one line."""

from __future__ import annotations

import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from edge_agent import keys
from edge_agent.config import public_key_text, render_config
from edge_agent.errors import EXIT_CONFIG, EXIT_USAGE

REPO = Path(__file__).resolve().parents[2]
BOARD = REPO / "tests" / "fixtures" / "boards" / "raspberry-pi-4"


def run(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout, cwd=REPO)


def test_probe_of_a_root_that_does_not_exist_is_an_error_not_an_empty_board(tmp_path: Path) -> None:
    missing = tmp_path / "nonexistent"
    done = run("-m", "edge_agent.cli", "probe", "--root", str(missing))
    assert done.returncode == EXIT_USAGE and done.stdout == "", done
    assert done.stderr.strip() == f"edge-agent: error: --root {missing}: no such directory (a filesystem root: / or " \
                                  "a captured board tree)"
    assert run("-m", "edge_agent.cli", "probe", "--root", str(BOARD), "--json").returncode == 0


def test_an_agent_config_whose_sysfs_root_does_not_exist_is_a_config_error(tmp_path: Path) -> None:
    key = keys.generate_private_key()
    keys.save_private_key(tmp_path / "state" / "keys" / "device.key", key)
    config = tmp_path / "agent.toml"
    config.write_text(render_config(device_name="pi", fleet="farm", broker_host="127.0.0.1", broker_port=1883,
                                    coordinator_public_key=public_key_text(keys.generate_private_key()),
                                    state_dir=tmp_path / "state", sysfs_root=str(tmp_path / "nonexistent")))
    done = run("-m", "edge_agent.agent.cli", "run", "--config", str(config), "--check")
    assert done.returncode == EXIT_CONFIG, done
    assert "device.sysfs_root" in done.stderr and "no such directory" in done.stderr and "Traceback" not in done.stderr


@pytest.fixture
def taken_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield sock.getsockname()[1]


def test_a_metrics_port_in_use_names_the_flag_and_the_port(tmp_path: Path, taken_port: int) -> None:
    done = run("-m", "edge_agent.coordinator.cli", "serve", "--state-dir", str(tmp_path), "--broker", "127.0.0.1:1",
               "--metrics-port", str(taken_port))
    assert done.returncode == EXIT_CONFIG, done
    assert f"--metrics-port {taken_port}" in done.stderr and "Address already in use" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_an_embedded_broker_port_in_use_names_the_flag_and_the_port(tmp_path: Path, taken_port: int) -> None:
    done = run("-m", "edge_agent.coordinator.cli", "serve", "--state-dir", str(tmp_path), "--embedded-broker",
               "--broker", f"127.0.0.1:{taken_port}")
    assert done.returncode == EXIT_CONFIG, done
    assert f"--embedded-broker on --broker 127.0.0.1:{taken_port}" in done.stderr, done.stderr
    assert "Address already in use" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_the_project_metadata_needs_no_deprecated_form() -> None:
    """The install printed ~40 lines of `project.license` as a TOML table is deprecated."""
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), REPO / "pyproject.toml")
    # a ResourceWarning is another test's object collected meanwhile (random order: an unclosed
    # socket of an inference-service test), never the metadata's
    assert [str(w.message).splitlines()[0] for w in caught if not issubclass(w.category, ResourceWarning)] == []
    assert dist.metadata.license_expression == "Apache-2.0"


def test_a_starter_model_and_example_data_for_a_first_real_round(tmp_path: Path) -> None:
    """`model create --example` (item 13): a verified bundle a device can fine-tune, and each
    example device's own digits in a data folder `edge-agent init --data-dir` takes."""
    from edge_agent.data import load_dataset
    from edge_agent.int8.bundle import load_bundle

    done = run("-m", "edge_agent.coordinator.cli", "model", "create", "--example", "--output",
               str(tmp_path / "models" / "digits-1"), "--example-data", str(tmp_path / "example-data"), timeout=600)
    assert done.returncode == 0, done.stderr
    assert f"register it: edge-coordinator model register {tmp_path / 'models' / 'digits-1'} --name digits " \
           "--version 1" in done.stdout
    bundle = load_bundle(tmp_path / "models" / "digits-1")  # every file's sha256 verified
    assert (bundle.manifest.name, bundle.manifest.version) == ("digits", "1")
    assert bundle.manifest.labels == [str(i) for i in range(10)] and len(bundle.manifest.depths) == 3
    sizes = []
    for i in (1, 2, 3):
        folder = tmp_path / "example-data" / f"device-{i}"
        assert [p.name for p in folder.iterdir()] == ["digits.npz"]
        data = load_dataset(folder, bundle.manifest.input, bundle.manifest.labels)
        sizes.append(len(data.y))
        assert len(set(data.y.tolist())) >= 5  # a non-IID share, not one class
    assert min(sizes) >= 40, sizes
    for bad in (["--example", "--calib", "x.npz"], ["--onnx", "m.onnx", "--output", "o"]):
        refused = run("-m", "edge_agent.coordinator.cli", "model", "create", *bad, "--output", str(tmp_path / "o"))
        assert refused.returncode == EXIT_USAGE and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
