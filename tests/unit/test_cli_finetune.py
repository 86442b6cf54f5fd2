"""`edge-agent finetune`: argument checking, progress bar, JSON report, clear errors."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edge_agent import cli
from edge_agent.sim import scenario as demo
from edge_agent.train.cli import ProgressBar
from edge_agent.train.job import Progress


def test_finetune_is_a_registered_subcommand() -> None:
    assert "edge_agent.train.cli" in cli._PLUGINS


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo.ensure_bundle(tmp_path_factory.getbasetemp() / "digits-bundle")


@pytest.fixture(scope="module")
def device_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[np.ndarray, np.ndarray]:
    dev = demo.scenario().devices[1]
    return dev.images, dev.labels


def test_registering_the_command_loads_neither_numpy_nor_mxnet() -> None:
    code = ("import argparse, sys\n"
            "import edge_agent.train.cli as c\n"
            "p = argparse.ArgumentParser(); c.register(p.add_subparsers())\n"
            "import edge_agent.train.job, edge_agent.train.checkpoints, edge_agent.train.trainer\n"
            "print('mxnet' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "False"  # the daemon may import the job module: MXNet stays out


def test_register_alone_does_not_import_numpy() -> None:
    code = ("import argparse, sys\nimport edge_agent.train.cli as c\n"
            "p = argparse.ArgumentParser(); c.register(p.add_subparsers())\nprint('numpy' in sys.modules)\n")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_help_teaches_with_examples(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["finetune", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for needle in ("examples:", "--budget-wh", "--power-cap-w", "--battery-floor", "--resume",
                   "edge-agent finetune --model", "stop reason", "--label-map 0=brick,1=grass",
                   "--skip-unknown", "never read as indices", "too-small", ".tar.gz archive"):
        assert needle in text


@pytest.mark.parametrize("argv", [["--budget-wh", "-1"], ["--battery-floor", "140"], ["--epochs", "0"],
                                  ["--power-cap-w", "nan"]])
def test_bad_numbers_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["finetune", "--model", "m", "--data", "d", *argv])
    assert exc.value.code == 64 and "finetune: error: argument" in capsys.readouterr().err  # EX_USAGE


def test_finetune_writes_the_report_and_shows_progress(bundle: Path, device_data: tuple, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    data = demo.write_data(tmp_path / "d", *device_data, "npz")
    report_path = tmp_path / "report.json"
    code = cli.main(["finetune", "--model", str(bundle), "--data", str(data), "--state-dir", str(tmp_path / "s"),
                     "--budget-wh", "5", "--power-cap-w", "20", "--battery-floor", "20", "--epochs", "4",
                     "--profile", "raspberry-pi-4", "--report", str(report_path)])
    err = capsys.readouterr().err
    assert code == 0
    report = json.loads(report_path.read_text())
    assert {"accuracy", "energy", "duration_s", "peak_rss_mb", "steps", "stop_reason", "head", "data"} <= set(report)
    assert report["energy"]["budget_wh"] == 5 and report["config"]["budget"]["power_cap_w"] == 20
    assert report["config"]["budget"]["battery_floor_pct"] == 20
    assert "data: reading" in err and "done: " in err
    assert f"accuracy {report['accuracy']['before']} -> {report['accuracy']['after']}" in err


def test_finetune_prints_json_on_stdout_for_csv(bundle: Path, device_data: tuple, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    data = demo.write_data(tmp_path / "d", *device_data, "csv")
    code = cli.main(["finetune", "--model", str(bundle), "--data", str(data), "--state-dir", str(tmp_path / "s"),
                     "--epochs", "1", "--profile", "raspberry-pi-4", "-q"])
    out = capsys.readouterr()
    assert code == 0 and out.err == ""  # -q and nothing skipped: nothing to say
    assert json.loads(out.out)["data"]["format"] == "csv"
    with data.open("a") as f:  # a row with a label the model does not know, and a broken one
        f.write(",".join(["1"] * 64) + ",cat\n" + ",".join(["x"] * 64) + ",3\n")
    code = cli.main(["finetune", "--model", str(bundle), "--data", str(data), "--state-dir", str(tmp_path / "s2"),
                     "--epochs", "1", "--profile", "raspberry-pi-4", "-q", "--skip-unknown"])
    err = capsys.readouterr().err
    assert code == 0 and "data: skipped 2 (non-numeric: 1, unknown-label: 1)" in err
    assert "labels not in the model, skipped (--skip-unknown): 'cat'" in err and "data.csv:" in err


def test_bad_input_is_one_clear_line_and_exit_65(bundle: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    bad_csv = tmp_path / "bad.csv"
    bad_csv.write_text("a,b,label\n1,2,3\n")
    cases = [(["--model", str(bundle), "--data", str(empty)], "data folder is empty"),
             (["--model", str(bundle), "--data", str(bad_csv)], "2 feature columns, but the model takes 1x8x8"),
             (["--model", str(tmp_path), "--data", str(bad_csv)], "no manifest.json")]
    for i, (argv, message) in enumerate(cases):
        code = cli.main(["finetune", *argv, "--state-dir", str(tmp_path / f"s{i}"), "-q"])
        err = capsys.readouterr().err
        assert code == 65, err
        assert err.startswith("edge-agent: error: ") and message in err and "Traceback" not in err


def test_progress_bar_shows_step_loss_energy_power_and_temperature() -> None:
    stream = io.StringIO()
    bar = ProgressBar(stream, interval_s=0.0)
    bar(Progress(phase="train", step=30, total_steps=120, epoch=1, epochs=4, loss=0.4321, energy_wh=0.0123,
                 budget_wh=0.5, watts=5.2, temp_c=61.4))
    bar(Progress(phase="paused", step=31, total_steps=120, epoch=1, epochs=4, energy_wh=0.0124, budget_wh=0.5,
                 detail="pause(battery-low) until battery >= 40 %"))
    lines = stream.getvalue().splitlines()
    assert lines[0] == ("[######------------------] step 30/120 epoch 2/4 loss 0.4321 0.0123/0.5 Wh 5.2 W 61 C")
    assert "PAUSED: pause(battery-low)" in lines[1]


def test_ctrl_c_during_training_exits_130_not_0(bundle: Path, device_data: tuple, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 35, item 10: the job stops cleanly (checkpoint, report: "cancelled"), and the
    command says it was interrupted (130, the exit-code table's), so `finetune && deploy`
    does not go on with a cancelled head. Before: exit 0. Driven by the job's own progress:
    SIGINT at its third training step, on any machine."""
    import os
    import signal

    shown = ProgressBar.__call__

    def ctrl_c_at_step_3(self: ProgressBar, ev: Progress) -> None:
        shown(self, ev)
        if ev.phase == "train" and ev.step == 3:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(ProgressBar, "__call__", ctrl_c_at_step_3)
    data = demo.write_data(tmp_path / "d", *device_data, "npz")
    report_path = tmp_path / "report.json"
    code = cli.main(["finetune", "--model", str(bundle), "--data", str(data), "--state-dir", str(tmp_path / "s"),
                     "--epochs", "50", "--patience", "50", "--profile", "raspberry-pi-4", "--report", str(report_path)])
    err = capsys.readouterr().err
    assert code == 130, err
    report = json.loads(report_path.read_text())
    assert report["stop_reason"] == "cancelled" and report["steps"] == 3
    assert "cancelled: the checkpoint is kept" in err
