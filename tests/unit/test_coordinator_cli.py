"""edge-coordinator's fleet commands against a real registry (no broker), the numpy-only
MXNet params format, and the bundles the coordinator registers and builds."""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path

import numpy as np
import pytest

from edge_agent import keys, mxparams
from edge_agent.config import public_key_text
from edge_agent.coordinator.artefacts import ModelArtefacts
from edge_agent.coordinator.cli import main
from edge_agent.coordinator.records import JobStatus
from edge_agent.coordinator.registry import Registry
from edge_agent.errors import InputError


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


# ---------------------------------------------------------------- mxparams
def test_params_round_trip_with_mxnet_both_ways(tmp_path):
    import mxnet as mx

    rng = np.random.default_rng(0)
    arrays = {"arg:w": rng.standard_normal((10, 32)).astype(np.float32), "arg:b": np.arange(10, dtype=np.float32),
              "aux:mean": rng.standard_normal(4), "aux:h": np.ones((2, 3, 4), np.float16),
              "arg:i": np.arange(-3, 3, dtype=np.int32), "arg:u": np.arange(5, dtype=np.uint8),
              "arg:s": np.array([7], np.int8), "arg:l": np.array([2**40], np.int64)}
    ours = mxparams.dump_params(arrays)
    loaded = mx.nd.load_frombuffer(ours)
    assert list(loaded) == list(arrays)
    for name, value in arrays.items():
        assert loaded[name].dtype == value.dtype
        np.testing.assert_array_equal(loaded[name].asnumpy(), value)
    mx.nd.save(str(tmp_path / "x.params"), {k: mx.nd.array(v, dtype=v.dtype) for k, v in arrays.items()})
    theirs = (tmp_path / "x.params").read_bytes()
    assert theirs == ours  # byte for byte what MXNet writes
    back = mxparams.load_params(theirs)
    assert {k: (v.dtype, v.shape) for k, v in back.items()} == {k: (v.dtype, v.shape) for k, v in arrays.items()}
    bare, prefixes = mxparams.split_names(back)
    assert prefixes["mean"] == "aux" and mxparams.join_names(bare, prefixes).keys() == arrays.keys()


def test_params_refuses_malformed_files_with_a_clear_error():
    good = mxparams.dump_params({"arg:w": np.ones((3, 4), np.float32), "arg:b": np.zeros(3, np.float32)})
    for cut in range(len(good)):  # every truncation is a format error, never a crash
        with pytest.raises(mxparams.ParamsFormatError):
            mxparams.load_params(good[:cut])
    with pytest.raises(mxparams.ParamsFormatError, match="trailing"):
        mxparams.load_params(good + b"\0")
    with pytest.raises(mxparams.ParamsFormatError, match="not an MXNet"):
        mxparams.load_params(b"\x13" + good[1:])
    huge = struct.pack("<QQQIiI2q", 0x112, 0, 1, 0xF993FAC9, 0, 2, 1 << 40, 1 << 40)
    with pytest.raises(mxparams.ParamsFormatError, match="more bytes than the file"):
        mxparams.load_params(huge + struct.pack("<iii", 1, 0, 0))  # no terabyte allocation
    sparse = struct.pack("<QQQIi", 0x112, 0, 1, 0xF993FAC9, 1)
    with pytest.raises(mxparams.ParamsFormatError, match="sparse"):
        mxparams.load_params(sparse)
    with pytest.raises(mxparams.ParamsFormatError, match="arrays is over"):
        mxparams.load_params(struct.pack("<QQQ", 0x112, 0, 10**9))
    with pytest.raises(InputError, match="dtype"):
        mxparams.dump_params({"x": np.array(["a"])})


# ---------------------------------------------------------------- a registry to drive
@pytest.fixture
def fleet_dir(tmp_path) -> tuple[Path, dict[str, str]]:
    """A registry with a model and three devices: online+approved, pending, approved but low battery."""
    state = tmp_path / "coord"
    ids = {}
    with Registry(state_dir=state) as reg:
        reg.add_model_version(name="digits", version="1", head={"w": np.zeros((2, 3), np.float32)})
        for name, approved, battery in (("good", True, 85), ("new", False, 90), ("weak", True, 12)):
            key = keys.generate_private_key()
            dev = reg.enrol_device(device_id=keys.fingerprint(key), public_key=public_key_text(key), fleet="farm",
                                   board="Raspberry Pi 4 Model B Rev 1.4", approved=approved)
            reg.record_state(dev.id, online=True, state={"battery_pct": battery, "on_power": False,
                                                         "status": "idle", "name": name})
            ids[name] = dev.id
    return state, ids


def test_devices_lists_approval_online_battery_and_board(capsys, fleet_dir):
    state, ids = fleet_dir
    code, out, _ = run(capsys, "devices", "--state-dir", str(state))
    assert code == 0
    lines = {line.split()[0]: line for line in out.splitlines() if line.split() and line.split()[0] in ids.values()}
    assert "PENDING" in lines[ids["new"]] and "85%" in lines[ids["good"]] and "12%" in lines[ids["weak"]]
    assert "Raspberry Pi 4" in lines[ids["good"]] and "s ago" in lines[ids["good"]]
    assert f"approve {ids['new']}" in out
    code, out, _ = run(capsys, "devices", "--json", "--state-dir", str(state))
    rows = {d["id"]: d for d in json.loads(out)}
    assert rows[ids["good"]]["online"] is True and rows[ids["new"]]["approved"] is False


def test_approve_by_code_prefix_line_and_revoke(capsys, fleet_dir):
    state, ids = fleet_dir
    key = keys.generate_private_key()  # a device that has not connected yet
    with Registry(state_dir=state) as reg:
        pub = reg.get_device(ids["new"]).public_key
    code = keys.enrolment_code(keys.public_key_from_bytes(__import__("base64").b64decode(pub)))
    assert run(capsys, "approve", code, "--state-dir", str(state))[0] == 0
    with Registry(state_dir=state) as reg:
        assert reg.get_device(ids["new"]).approved
    assert run(capsys, "approve", ids["new"][:6], "--revoke", "--state-dir", str(state))[0] == 0
    with Registry(state_dir=state) as reg:
        assert not reg.get_device(ids["new"]).approved
    rc, _, err = run(capsys, "approve", "zzzzzz", "--state-dir", str(state))
    assert rc == 65 and "no enrolled device matches" in err
    line = (f"edge-agent-enrol/1 fleet=farm id={keys.fingerprint(key)} code={keys.enrolment_code(key)} "
            f"key={public_key_text(key)} name=pi profile=raspberry-pi-4")
    rc, out, _ = run(capsys, "approve", "--line", line, "--state-dir", str(state))
    assert rc == 0 and "approved" in out
    with Registry(state_dir=state) as reg:
        assert reg.get_device(keys.fingerprint(key)).approved  # pre-enrolled before it ever connected
    bad = line.replace(f"id={keys.fingerprint(key)}", "id=" + "a" * 24)
    rc, _, err = run(capsys, "approve", "--line", bad, "--state-dir", str(state))
    assert rc == 65 and "fingerprint" in err
    assert run(capsys, "approve", "--all-pending", "--state-dir", str(state))[0] == 0
    with Registry(state_dir=state) as reg:
        assert all(d.approved for d in reg.list_devices())


def test_train_explains_what_is_wrong_before_queueing_anything(capsys, fleet_dir):
    state, ids = fleet_dir
    sd = ("--state-dir", str(state))
    rc, _, err = run(capsys, "train", "--model", "nope", *sd)
    assert rc == 65 and "unknown model 'nope'; registered: digits" in err
    rc, _, err = run(capsys, "train", "--model", "digits@7", *sd)
    assert rc == 65 and "has no version '7'" in err
    rc, _, err = run(capsys, "train", "--model", "digits", "--devices", "tag:", *sd)
    assert rc == 65 and "selector" in err
    rc, _, err = run(capsys, "train", "--model", "digits", "--devices", "tag:orchard", *sd)
    assert rc == 69 and "no enrolled device matches 'tag:orchard'" in err
    rc, _, err = run(capsys, "train", "--model", "digits", "--min-devices", "2", *sd)
    assert rc == 69 and "1 eligible device(s)" in err
    assert f"{ids['new']}: not approved" in err and f"{ids['weak']}: battery 12% < 30%" in err
    with Registry(state_dir=state) as reg:
        assert reg.list_jobs() == []  # nothing was queued
    rc, out, err = run(capsys, "train", "--model", "digits", "--min-devices", "2", "--wait-for-devices", "--detach",
                       "--rounds", "3", "--deadline", "15m", "--budget-wh", "0.5", "--epochs", "2",
                       "--param", "patience=4", "--param", "note=hi", *sd)
    assert rc == 0 and "no `edge-coordinator serve` is running" in err
    with Registry(state_dir=state) as reg:
        (job,) = reg.list_jobs()
    assert (job.rounds, job.min_devices, job.deadline_s, job.status) == (3, 2, 900.0, JobStatus.PENDING)
    assert job.params == {"budget_wh": 0.5, "epochs": 2, "patience": 4, "note": "hi", "aggregator": "median_trust",
                          "aggregator_default": "no server set, at most 100 devices per round"}
    assert job.id in out

    # tags select devices
    rc, out, _ = run(capsys, "tag", ids["good"][:8], "orchard", "north", *sd)
    assert rc == 0 and "tags north, orchard" in out
    assert run(capsys, "tag", ids["good"][:8], "north", "--remove", *sd)[0] == 0
    rc, _, err = run(capsys, "train", "--model", "digits", "--devices", "tag:north", *sd)
    assert rc == 69 and "no enrolled device matches 'tag:north'" in err
    rc, out, _ = run(capsys, "train", "--model", "digits", "--devices", "tag:orchard", "--detach", *sd)
    assert rc == 0 and "on tag:orchard" in out


def test_train_refuses_what_every_device_would_refuse_at_the_agents_own_limits(capsys, fleet_dir):
    """The job's settings go through the agent's parser (protocol.finetune.TRAIN_PARAMS): a value
    just inside a device limit is queued, one just outside is exit 64 naming the limit."""
    from edge_agent.errors import EXIT_USAGE
    from edge_agent.protocol.finetune import TRAIN_PARAMS

    state, _ = fleet_dir
    sd = ("--state-dir", str(state))
    for name, (kind, lo, hi) in TRAIN_PARAMS.items():
        flag = f"--{name.replace('_', '-')}"
        spell = (lambda v: str(int(v))) if kind is int else repr
        argv = [flag, spell(lo)] if flag in ("--epochs", "--batch-size", "--lr", "--update-bytes") else \
            ["--param", f"{name}={spell(lo)}"]
        rc, _, err = run(capsys, "train", "--model", "digits", "--detach", *argv, *sd)
        assert rc == 0, (name, err)
        bad = [argv[0], spell(hi * 2)] if argv[0] != "--param" else ["--param", f"{name}={spell(hi * 2)}"]
        rc, _, err = run(capsys, "train", "--model", "digits", "--detach", *bad, *sd)
        assert rc == EXIT_USAGE and f"params.{name}" in err and f"{hi:g}" in err, (name, err)
        assert err.count("\n") == 1
    rc, _, err = run(capsys, "train", "--model", "digits", "--budget-wh", "-1", *sd)
    assert rc == EXIT_USAGE and "params.budget_wh = -1.0 is outside" in err
    with Registry(state_dir=state) as reg:
        assert len(reg.list_jobs()) == len(TRAIN_PARAMS)  # only the good ones were queued


def test_status_models_and_cancel(capsys, fleet_dir):
    state, _ = fleet_dir
    sd = ("--state-dir", str(state))
    assert run(capsys, "train", "--model", "digits", "--detach", *sd)[0] == 0
    with Registry(state_dir=state) as reg:
        (job,) = reg.list_jobs()
    rc, out, _ = run(capsys, "status", *sd)
    assert rc == 0 and job.id in out and "pending" in out and "coordinator: not running" in out
    rc, out, _ = run(capsys, "status", job.id, "--json", *sd)
    assert json.loads(out)["status"] == "pending"
    rc, out, _ = run(capsys, "models", *sd)
    assert rc == 0 and "digits" in out and "bundle" in out
    rc, out, _ = run(capsys, "cancel", job.id, "--reason", "wrong model", *sd)
    assert rc == 0
    with Registry(state_dir=state) as reg:
        cancelled = reg.get_job(job.id)
    assert cancelled.status is JobStatus.CANCELLED and cancelled.reason == "wrong model"
    rc, _, err = run(capsys, "cancel", job.id, *sd)
    assert rc == 65 and "already cancelled" in err
    rc, _, err = run(capsys, "status", "job-nope", *sd)
    assert rc == 65 and "does not exist" in err
    rc, _, err = run(capsys, "devices", "--state-dir", str(state.parent / "elsewhere"), "--db", "sqlite")
    assert rc == 65 and "no coordinator registry here" in err


def test_an_async_job_is_queued_with_its_buffer_and_staleness_and_status_says_so(capsys, fleet_dir):
    state, _ = fleet_dir
    sd = ("--state-dir", str(state))
    rc, _, err = run(capsys, "train", "--model", "digits", "--buffer", "4", "--detach", *sd)
    assert rc == 64 and "--buffer, --max-staleness and --max-concurrency are options of --async jobs" in err
    rc, out, _ = run(capsys, "train", "--model", "digits", "--async", "--buffer", "4", "--max-staleness", "2",
                     "--rounds", "20", "--detach", *sd)
    assert rc == 0 and "a version every 4 accepted update(s)" in out and "2 version(s) stale" in out
    rc, out, _ = run(capsys, "train", "--model", "digits", "--async", "--min-devices", "1", "--detach", *sd)
    assert rc == 0
    with Registry(state_dir=state) as reg:
        first, second = sorted(reg.list_jobs(), key=lambda j: j.rounds, reverse=True)
    assert (first.params["mode"], first.params["buffer"], first.params["max_staleness"]) == ("async", 4, 2)
    assert (second.params["buffer"], second.params["max_staleness"]) == (2, 4)  # the defaults: 2 x min, 4
    rc, out, _ = run(capsys, "status", first.id, *sd)
    assert rc == 0 and "asynchronous: a version every 4 accepted update(s)" in out
    with pytest.raises(SystemExit) as exit_:  # argparse's own range check
        run(capsys, "train", "--model", "digits", "--async", "--buffer", "0", "--detach", *sd)
    assert exit_.value.code == 64 and "argument --buffer: must be within 1..100000" in capsys.readouterr().err


def test_a_jobs_distillation_weight_goes_to_the_devices_and_a_bad_one_is_refused(capsys, fleet_dir):
    state, _ = fleet_dir
    sd = ("--state-dir", str(state))
    rc, _, _ = run(capsys, "train", "--model", "digits", "--distill", "0", "--detach", *sd)
    assert rc == 0
    with Registry(state_dir=state) as reg:
        assert [j.params.get("distill") for j in reg.list_jobs()].count(0.0) == 1  # "off" is sent, not dropped
    with pytest.raises(SystemExit) as exit_:
        run(capsys, "train", "--model", "digits", "--distill", "101", "--detach", *sd)
    assert exit_.value.code == 64 and "argument --distill: must be within 0..100" in capsys.readouterr().err


def test_key_is_created_once_private_and_printed(capsys, tmp_path):
    rc, out, _ = run(capsys, "key", "--state-dir", str(tmp_path / "c"))
    assert rc == 0
    key_file = tmp_path / "c" / "keys" / "coordinator.key"
    assert os.stat(key_file).st_mode & 0o777 == 0o600
    assert out.strip() == public_key_text(keys.load_private_key(key_file))
    assert (tmp_path / "c" / "coordinator.pub").read_text().strip() == out.strip()
    assert run(capsys, "key", "--state-dir", str(tmp_path / "c"))[1] == out


# ---------------------------------------------------------------- bundles: register, build, publishable
@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory) -> Path:
    from edge_agent.int8.bundle_create import create_bundle
    from edge_agent.sim import models

    x, y, _, _ = models.load_digits_split()
    net = models.digits_cnn()
    models.fit_classifier(net, x, y, epochs=1)
    dest = tmp_path_factory.mktemp("bundles") / "digits"
    create_bundle(net, dest, calibration=x[:64], labels=[str(i) for i in range(10)], name="digits-cnn", version="1",
                  input_shape=(1, 8, 8), scale=1 / 16)
    return dest


def test_register_then_build_a_head_only_version_deterministically(capsys, tmp_path, bundle_dir):
    import mxnet as mx

    from edge_agent.int8.bundle import HEAD_PARAMS, load_bundle, unpack_bundle
    from edge_agent.int8.bundle_patch import apply_patch

    state = tmp_path / "coord"
    rc, out, _ = run(capsys, "model", "register", str(bundle_dir), "--name", "digits", "--version", "1",
                     "--state-dir", str(state))
    assert rc == 0 and "output_fc_weight" in out
    rc, _, err = run(capsys, "model", "register", str(bundle_dir), "--name", "digits", "--version", "1",
                     "--state-dir", str(state))
    assert rc == 65 and "already registered" in err
    with Registry(state_dir=state) as reg:
        base = reg.get_model("digits", "1")
        head = reg.load_head(base)
        assert set(head) == {"output_fc_weight", "output_fc_bias"}
        new_head = {n: (a + 0.5).astype(a.dtype) for n, a in head.items()}
        mv = reg.add_model_version(name="digits", version="job-1-r1", head=new_head, parent="1",
                                   bundle_path=base.bundle_path, head_only=True)
        art = ModelArtefacts(reg).archive_for(mv)
        built = unpack_bundle(art.path, tmp_path / "out")
        original = load_bundle(bundle_dir)
        assert built.manifest.version == "job-1-r1" and built.manifest.parent_version == "1"
        assert built.manifest.extra["head_only"] is True
        for name in original.manifest.files:  # the backbone (and all but the head) unchanged, byte for byte
            if name != HEAD_PARAMS:
                assert built.read(name) == original.read(name), name
        params = mx.nd.load_frombuffer(built.read(HEAD_PARAMS))
        for name, value in new_head.items():
            np.testing.assert_array_equal(params[f"arg:{name}"].asnumpy(), value)
        assert art.head_bytes == len(built.read(HEAD_PARAMS)) < art.size
        first = art.sha256
        art.path.unlink()  # lost: rebuilt with the same bytes (devices were told this sha256)
        time.sleep(1.1)
        again = ModelArtefacts(reg).archive_for(mv)
        assert again.sha256 == first
        art.path.write_bytes(b"garbage")  # damaged: detected and rebuilt
        assert ModelArtefacts(reg).archive_for(mv).sha256 == first
        # its head patch: the new manifest + head.params, applied onto version 1 it is this version
        patch = ModelArtefacts(reg).patch_for(mv)
        assert patch is not None and patch.version == "job-1-r1.head" and patch.size * 5 < art.size
        assert ModelArtefacts(reg).patch_for(base) is None  # a registered bundle: nothing to patch onto
        installed = apply_patch(patch.path, bundle_dir, tmp_path / "device" / "job-1-r1")
        assert installed.sha256 == built.sha256
    rc, _, err = run(capsys, "model", "register", str(bundle_dir), "--name", "digits", "--version", "2.head",
                     "--state-dir", str(state))
    assert rc == 65 and "reserved for head patches" in err


def test_serve_exits_130_on_ctrl_c_and_0_on_sigterm(tmp_path):
    """Issue 35, item 10 (the other long-running commands' Ctrl-C): serve stops cleanly either
    way; Ctrl-C is an interruption (130, as the exit-code table says), SIGTERM (systemd) a
    normal stop (0). Before: 0 for both. No broker: serve keeps trying port 9 meanwhile."""
    import signal
    import subprocess
    import sys

    from edge_agent.coordinator.service_files import read_serve_file, serving

    for sig, expected in ((signal.SIGINT, 130), (signal.SIGTERM, 0)):
        state = tmp_path / sig.name
        proc = subprocess.Popen([sys.executable, "-m", "edge_agent.coordinator.cli", "serve", "--state-dir",
                                 str(state), "--broker", "127.0.0.1:9", "--fleet", "farm"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 120  # (bounds a hang only) its heartbeat: the loop runs
            while not serving(read_serve_file(state)):
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()[-2000:]
                time.sleep(0.05)
            proc.send_signal(sig)
            assert proc.wait(60) == expected, sig
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
            proc.stderr.close()
