"""The README's command examples work: every `edge-agent` / `edge-coordinator` line of its
```console blocks is checked against the real parsers (a flag that stops existing fails
here), and every one that can run offline is run, in README order, in a temp directory with
the fixtures it names (a trained digits ONNX model, calibration data, an image folder, a
coordinator key, a fleet CA). Output shown under a command in the README must appear in
what it prints. The lines that need a broker or a running daemon are listed in SKIP with
the integration tests that run them."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from edge_agent.cli import build_parser as agent_parser
from edge_agent.coordinator.cli import build_parser as coordinator_parser

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
PARSERS = {"edge-agent": agent_parser, "edge-coordinator": coordinator_parser}
MODULES = {"edge-agent": "edge_agent.cli", "edge-coordinator": "edge_agent.coordinator.cli"}

# Lines that need a broker or a long-running daemon: their flags are checked here, the
# commands themselves run in the integration tests named.
SKIP = {
    "edge-agent run --config /etc/edge-agent/agent.toml":
        "the agent daemon needs a broker: tests/integration/test_daemon_lifecycle.py, test_agent_commands.py",
    "edge-coordinator serve --embedded-broker":
        "the coordinator service runs until stopped: tests/integration/conftest.py (serve on a real "
        "mosquitto) and test_transport_amqtt.py (the embedded broker)",
    "edge-coordinator devices / approve / train / status / models / cancel":
        "a list of the fleet commands, each checked to exist here; run against a serving coordinator in "
        "tests/integration/test_fleet_cli.py",
}
# What the README elides with `...` and where it writes outside the temp directory.
ELIDED = {"edge-agent init": ["--config", "agent.toml", "--state-dir", "state",
                              "--sysfs-root", "tests/fixtures/boards/raspberry-pi-4"]}
PATHS = {"/etc/edge-agent/agent.toml": "agent.toml"}


@dataclass
class Example:
    line: str  # as the README shows it, continuation lines joined
    argv: list[str]
    output: list[str] = field(default_factory=list)  # lines shown under it in the README

    @property
    def key(self) -> str:
        return " ".join(self.argv)


def _examples() -> list[Example]:
    examples: list[Example] = []
    for block in re.findall(r"```console\n(.*?)```", README.read_text(), flags=re.S):
        current: Example | None = None
        lines = iter(block.splitlines())
        for raw in lines:
            if raw.startswith("$ "):
                text = raw[2:]
                while text.rstrip().endswith("\\"):
                    text = text.rstrip()[:-1] + " " + next(lines).strip()
                argv = shlex.split(text, comments=True)
                current = Example(line=text, argv=argv) if argv and argv[0] in PARSERS else None
                if current is not None:
                    examples.append(current)
            elif current is not None and raw.strip():
                current.output.append(raw.rstrip())
    return examples


EXAMPLES = _examples()


def test_the_readme_has_examples_of_both_commands() -> None:
    names = {e.argv[0] for e in EXAMPLES}
    assert names == {"edge-agent", "edge-coordinator"} and len(EXAMPLES) >= 10
    assert set(SKIP) <= {e.key for e in EXAMPLES}, "a SKIP entry no longer matches a README line"


def _check_flags(argv: list[str]) -> None:
    """Every subcommand and --flag of the example exists in the real parser."""
    parser = PARSERS[argv[0]]()
    words = argv[1:]
    if "/" in words:  # `devices / approve / ...`: a list of subcommands
        words = [w for w in words if w != "/"]
        subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        missing = [w for w in words if w not in subs.choices]
        assert not missing, f"no such command: {missing}"
        return
    for i, word in enumerate(words):
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if subs and not word.startswith("-"):
            assert word in subs[0].choices, f"{argv[0]}: no command {word!r}"
            parser = subs[0].choices[word]
            continue
        if word.startswith("--"):
            flag = word.split("=", 1)[0]
            assert flag in parser._option_string_actions, f"{parser.prog}: no flag {flag}"
        elif word == "..." and i == len(words) - 1:
            continue


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: e.key[:60])
def test_every_flag_in_the_readme_exists(example: Example) -> None:
    _check_flags(example.argv)


# ------------------------------------------------------------------ running them
def _fixtures(root: Path) -> None:
    """What the examples name: net.onnx, calib.npz, my-images/, coord.pub, ca.pem, tests/."""
    from PIL import Image

    from edge_agent import certs, keys
    from edge_agent.int8.onnx_export import export_onnx
    from edge_agent.sim import models

    x_train, y_train, _, _ = models.load_digits_split()
    net = models.digits_cnn()
    models.fit_classifier(net, x_train, y_train, epochs=2)
    (root / "net.onnx").write_bytes(export_onnx(net, (1, 1, 8, 8)))
    np.savez(root / "calib.npz", x=x_train[:64])
    for i, (image, label) in enumerate(zip(x_train[:120], y_train[:120], strict=True)):
        folder = root / "my-images" / str(int(label))
        folder.mkdir(parents=True, exist_ok=True)
        pixels = np.clip(image[0] * 255.0 / max(float(image.max()), 1e-6), 0, 255).astype(np.uint8)
        Image.fromarray(pixels, mode="L").save(folder / f"{i}.png")
    keys.save_public_key(root / "coord.pub", keys.generate_private_key())
    certs.create_ca(root)
    (root / "tests").symlink_to(REPO / "tests")


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Every runnable example, in README order (later ones use what earlier ones made)."""
    root = tmp_path_factory.mktemp("readme")
    _fixtures(root)
    env = {**os.environ, "EDGE_AGENT_STATE_DIR": str(root / "agent-state"), "XDG_STATE_HOME": str(root / "xdg"),
           "EDGE_COORDINATOR_STATE_DIR": str(root / "coordinator")}
    results = {}
    for example in EXAMPLES:
        if example.key in SKIP:
            continue
        argv = [PATHS.get(a, a) for a in example.argv]
        if argv[-1] == "...":
            argv = argv[:-1] + ELIDED[" ".join(argv[:2])]
        results[example.key] = subprocess.run([sys.executable, "-m", MODULES[argv[0]], *argv[1:]], cwd=root,
                                              env=env, capture_output=True, text=True, timeout=600)
    return results


RUNNABLE = [e for e in EXAMPLES if e.key not in SKIP]


@pytest.mark.parametrize("example", RUNNABLE, ids=lambda e: e.key[:60])
def test_the_readme_example_runs(example: Example, ran) -> None:
    proc = ran[example.key]
    assert proc.returncode == 0, f"$ {example.line}\nexit {proc.returncode}\n{proc.stderr[-2000:]}"
    assert "Traceback" not in proc.stderr
    shown = set(proc.stdout.splitlines())
    for line in example.output:  # what the README shows it printing
        assert line in shown, f"$ {example.line}\nREADME shows: {line!r}\nit printed:\n{proc.stdout}"
