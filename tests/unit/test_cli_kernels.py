"""`edge-agent kernels` and `edge-coordinator model create / inspect`, run as the user runs them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from edge_agent.cli import main as agent_main
from edge_agent.coordinator.cli import main as coordinator_main
from edge_agent.errors import EXIT_CONFIG, EXIT_DATAERR, EXIT_UNAVAILABLE, EXIT_USAGE
from edge_agent.int8 import bundle as B
from edge_agent.int8.engine import ENV_FORCE_BACKEND
from edge_agent.sim import models

PROBE = {"cpu": {"arch": "x86_64", "count": 2, "int8_features": {"avx2": True}}, "accelerators": [],
         "board": {"model": "test board"}, "profile": {"name": None}}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """An exported MXNet net, its ONNX, calibration data and a probe report, as files."""
    from edge_agent.int8.onnx_export import export_onnx

    root = tmp_path_factory.mktemp("cli")
    x_train, y_train, _, _ = models.load_digits_split()
    net = models.digits_cnn()
    models.fit_classifier(net, x_train, y_train, epochs=3)
    (root / "digits.onnx").write_bytes(export_onnx(net, (1, 1, 8, 8)))  # also hybridises for export
    net.export(str(root / "digits"))
    np.savez(root / "calib.npz", x=x_train[:64])
    (root / "labels.txt").write_text("\n".join(f"digit-{i}" for i in range(10)) + "\n")
    (root / "probe.json").write_text(json.dumps(PROBE))
    return root


@pytest.fixture(scope="module")
def bundle_dir(workdir) -> Path:
    rc = coordinator_main([
        "model", "create", "--onnx", str(workdir / "digits.onnx"), "--split", "features_gap_fwd",
        "--calib", str(workdir / "calib.npz"), "--labels", str(workdir / "labels.txt"),
        "--name", "digits", "--version", "3", "--parent-version", "2", "--scale", "0.0625",
        "--output", str(workdir / "digits-3"), "--archive", str(workdir / "digits-3.tar.gz")])
    assert rc == 0
    return workdir / "digits-3"


def _kernels(workdir, *args) -> int:
    return agent_main(["kernels", "--probe-report", str(workdir / "probe.json"),
                       "--state-dir", str(workdir / "state"), "--repeats", "2", "--batch-size", "16", *args])


def test_model_create_writes_bundle_and_archive(bundle_dir, workdir, capsys):
    bundle = B.load_bundle(bundle_dir)
    assert bundle.manifest.extra["bias_correction"] is False  # an option, off unless asked for
    assert bundle.manifest.labels[3] == "digit-3" and bundle.manifest.parent_version == "2"
    assert B.unpack_bundle(workdir / "digits-3.tar.gz", workdir / "unpacked").sha256 == bundle.sha256
    assert coordinator_main(["model", "inspect", str(workdir / "digits-3.tar.gz")]) == 0
    out = capsys.readouterr().out
    assert f"sha256 {bundle.sha256}; every file verified" in out
    assert "digits 3 (parent 2)" in out and "'features_gap_fwd'" in out and "backbone_int8.tflite" in out
    assert coordinator_main(["model", "inspect", str(bundle_dir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["manifest"]["split"]["feature_shape"] == [32, 1, 1]


def test_model_create_from_an_exported_mxnet_block(workdir, capsys):
    rc = coordinator_main([
        "model", "create", "--mxnet", str(workdir / "digits"), "--input-shape", "1,8,8",
        "--split", "features_gap_fwd", "--calib", str(workdir / "calib.npz"), "--labels", "a,b,c,d,e,f,g,h,i,j",
        "--name", "digits", "--version", "4", "--output", str(workdir / "from-mxnet"), "--bias-correction"])
    assert rc == 0, capsys.readouterr().err
    manifest = B.load_bundle(workdir / "from-mxnet").manifest
    assert manifest.source == "gluon" and manifest.extra["bias_correction"] is True


@pytest.mark.parametrize(("args", "message"), [
    (["--split", "nope"], "unknown split node 'nope'"),
    (["--split", "features_gap_fwd", "--calib", "CALIB_BAD"], "calib_bad.npz['x']: shape (8, 8, 8)"),
    (["--split", "features_gap_fwd", "--onnx", "TRUNCATED"], "truncated.onnx: not a valid ONNX protobuf"),
])
def test_model_create_bad_input_is_one_clear_line(workdir, capsys, args, message):
    np.savez(workdir / "calib_bad.npz", x=np.zeros((8, 8, 8), np.float32))
    data = (workdir / "digits.onnx").read_bytes()
    (workdir / "truncated.onnx").write_bytes(data[: len(data) // 2])
    args = [{"CALIB_BAD": str(workdir / "calib_bad.npz"), "TRUNCATED": str(workdir / "truncated.onnx")}.get(a, a)
            for a in args]
    base = {"--onnx": str(workdir / "digits.onnx"), "--calib": str(workdir / "calib.npz")}
    for flag in ("--onnx", "--calib"):
        if flag not in args:
            args += [flag, base[flag]]
    rc = coordinator_main(["model", "create", *args, "--labels", ",".join("0123456789"), "--name", "x", "--version", "1",
                           "--output", str(workdir / "never")])
    err = capsys.readouterr().err
    assert rc == EXIT_DATAERR and err.startswith("edge-coordinator: error: ") and message in err
    assert len(err.strip().splitlines()) == 1 and not (workdir / "never").exists()


def test_inspect_a_tampered_bundle_exits_65(bundle_dir, tmp_path, capsys):
    copy = Path(shutil.copytree(bundle_dir, tmp_path / "copy"))
    (copy / B.HEAD_SYMBOL).write_text("{}")
    assert coordinator_main(["model", "inspect", str(copy)]) == EXIT_DATAERR
    assert "head-symbol.json" in capsys.readouterr().err
    assert _kernels(tmp_path, "--model", str(copy)) == EXIT_DATAERR


def test_kernels_lists_candidates_then_benches_picks_and_caches(bundle_dir, workdir, capsys):
    args = ["--model", str(bundle_dir), "--backends", "edgetpu,tflite,mxnet-onednn,reference"]
    assert _kernels(workdir, *args) == 0
    out = capsys.readouterr().out
    assert "no Coral Edge TPU found by the hardware probe" in out
    assert "not benchmarked yet on this device (run with --bench)" in out
    assert _kernels(workdir, *args, "--bench") == 0
    out = capsys.readouterr().out
    assert "(measured now)" in out and "cache:" in out
    lines = {line.split()[1] if line.startswith("*") else line.split()[0]: line
             for line in out.splitlines() if line[2:].split(" ")[0] in ("edgetpu", "tflite", "mxnet-onednn", "reference")}
    # task-level agreement decides (top-1 vs fp32); the int8/float distance is a diagnostic line
    assert " ok " in lines["tflite"] and " ok " in lines["mxnet-onednn"] and "(ref " in lines["tflite"]
    assert "diagnostic: max" in out and "int8 units from the reference" in out and "output steps" in out
    assert "J@1,000" in out and "J@10,000" in out and "by size:  100 images:" in out
    assert sum(line.startswith("*") for line in lines.values()) == 1
    chosen = next(name for name, line in lines.items() if line.startswith("*"))
    # the archive is the same model (same sha256): the cached decision is found for it too
    assert _kernels(workdir, *args[2:], "--model", str(workdir / "digits-3.tar.gz")) == 0
    out = capsys.readouterr().out
    assert f"chosen:   {chosen} with " in out and "least predicted energy for 1,000 images, cached" in out
    assert _kernels(workdir, *args, "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["chosen"] == chosen and report["cached"] and len(report["candidates"]) == 4


def test_kernels_forced_engine(bundle_dir, workdir, capsys, monkeypatch):
    monkeypatch.setenv(ENV_FORCE_BACKEND, "reference")
    assert _kernels(workdir, "--model", str(bundle_dir), "--bench", "--backends", "tflite,reference") == 0
    out = capsys.readouterr().out
    assert "chosen:   reference with " in out and f"(forced by {ENV_FORCE_BACKEND}=reference)" in out
    assert "not tried: EDGE_AGENT_INT8_BACKEND=reference" in out
    monkeypatch.setenv(ENV_FORCE_BACKEND, "warp-drive")
    assert _kernels(workdir, "--model", str(bundle_dir), "--bench") == EXIT_CONFIG
    assert "unknown engine" in capsys.readouterr().err
    monkeypatch.setenv(ENV_FORCE_BACKEND, "edgetpu")
    assert _kernels(workdir, "--model", str(bundle_dir), "--bench") == EXIT_UNAVAILABLE
    assert "no Coral Edge TPU found" in capsys.readouterr().err


def test_kernels_usage_errors_and_help(workdir, capsys):
    for bad in (["--repeats", "0"], ["--batch-size", "-1"], ["--threads", "x"], ["--backends", "bogus"],
                ["--backends", "tflite,warp-drive"]):
        with pytest.raises(SystemExit) as info:
            _kernels(workdir, "--model", "x", *bad)
        assert info.value.code == EXIT_USAGE
        err = capsys.readouterr().err
        assert err.startswith("edge-agent kernels: error: argument " + bad[0]) and err.count("\n") == 1
    assert "known: edgetpu, tflite" in err
    with pytest.raises(SystemExit):
        agent_main(["kernels", "--help"])
    out = capsys.readouterr().out
    assert "examples:" in out and ENV_FORCE_BACKEND in out and "agrees with the fp32 model" in out
    prose = " ".join(out.split())  # the sample minimum, and what happens below it (the module's figures)
    from edge_agent.int8 import agreement, engine_cost

    cap = agreement.ROUNDING_SENSITIVITY_CAP
    assert f"needs at least {engine_cost.AGREEMENT_MIN_SAMPLES} calibration samples whose top-1 is decided" in prose
    assert f"(up to {engine_cost.AGREEMENT_MAX_SAMPLES})" in prose and "it is INCONCLUSIVE, never ok" in prose
    assert f"capped at {cap:g} int8 units / {agreement.FLOAT_TOLERANCE_STEPS * cap / 2:g} output steps" in prose
    with pytest.raises(SystemExit):
        coordinator_main(["model", "create", "--help"])
    assert "--calib" in capsys.readouterr().out


def test_a_tampered_archive_is_named_in_the_error_not_a_temp_path(bundle_dir, workdir, tmp_path, capsys):
    import io
    import tarfile

    archive = tmp_path / "tampered.tar.gz"
    with tarfile.open(workdir / "digits-3.tar.gz") as src, tarfile.open(archive, "w:gz") as out:
        for member in src:
            data = src.extractfile(member).read()
            if member.name == B.HEAD_SYMBOL:
                data = b"{}"
                member.size = len(data)
            out.addfile(member, io.BytesIO(data))
    assert coordinator_main(["model", "inspect", str(archive)]) == EXIT_DATAERR
    err = capsys.readouterr().err
    assert f"{archive}: member {B.HEAD_SYMBOL}" in err and ".tmp" not in err, err
    assert _kernels(workdir, "--model", str(archive)) == EXIT_DATAERR
    err = capsys.readouterr().err
    assert str(archive) in err and ".tmp" not in err and "edge-agent-kernels-" not in err, err


def test_an_existing_output_names_the_flag(bundle_dir, workdir, capsys):
    rc = coordinator_main(["model", "create", "--onnx", str(workdir / "digits.onnx"), "--split", "features_gap_fwd",
                           "--calib", str(workdir / "calib.npz"), "--labels", "0,1", "--name", "x", "--version", "1",
                           "--output", str(bundle_dir)])
    err = capsys.readouterr().err
    assert rc == EXIT_DATAERR and "already exists (--overwrite replaces it)" in err


def test_a_file_that_is_not_an_archive_is_one_line(workdir, tmp_path, capsys):
    junk = tmp_path / "model.tar.gz"
    junk.write_bytes(b"not a tar file at all\n" * 3)
    assert coordinator_main(["model", "inspect", str(junk)]) == EXIT_DATAERR
    err = capsys.readouterr().err
    assert err == f"edge-coordinator: error: {junk}: not a readable bundle archive (not a tar archive, plain or " \
                  "compressed)\n"
    assert _kernels(workdir, "--model", str(junk)) == EXIT_DATAERR
    assert capsys.readouterr().err.count("\n") == 1
