"""The agent's side of fleet-shared engine choices (issue 37): a command's `engine_choices`
go with the job to the training child and on to engine selection (`select_engine(shared=)`);
the child's result lists the choices this device measured in full (its selection cache),
which the state message reports -- only to a coordinator whose commands carry the field
(an older one would refuse the whole state). `edge-agent finetune --engine-choices FILE`
does the same by hand. select_engine's own behaviour is not tested here."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from edge_agent import keys
from edge_agent.agent import child as child_module
from edge_agent.agent.jobs import JobState
from edge_agent.agent.runner import RESULT_FILE, SPEC_FILE
from edge_agent.errors import EXIT_USAGE, UsageError
from edge_agent.protocol import Kind, check_body
from edge_agent.protocol.engine_choice import SharedChoice
from edge_agent.sim import scenario as demo
from tests.unit.test_agent_lifecycle import SCRIPTED, Rig

S = JobState
BOARDS = Path(__file__).resolve().parents[1] / "fixtures" / "boards"


def choice(i: int = 0, **change: Any) -> dict[str, Any]:
    return {"kind": f"{i:032x}", "engine": "native", "threads": 4, "batch_size": 32, "latency_ms": 12.5,
            "per_image_cpu_s": 0.0015, "fingerprint": f"{i:064x}", **change}


# The lifecycle's scripted child, whose result also lists what `measured.json` in its data
# directory says the device measured in full (what the real child reads from its cache).
_MEASURED = '"engine_choices": json.load(open(os.path.join(spec["data"], "measured.json")))}'
MEASURING = SCRIPTED.replace('"engine": "native", "steps": 4}', f'"engine": "native", "steps": 4, {_MEASURED}') \
    .replace('"steps": 1})', f'"steps": 1, {_MEASURED})')


@pytest.fixture
def rig(tmp_path: Path) -> Rig:
    assert MEASURING.count("measured.json") == 2
    r = Rig(tmp_path)
    (tmp_path / "child.py").write_text(MEASURING)
    return r


def measured(rig: Rig, value: Any) -> None:
    (rig.data / "measured.json").write_text(json.dumps(value))


def submit(rig: Rig, job: str = "j", **extra: Any) -> Any:
    body = {"cmd_id": f"{job}-r1", "action": "finetune", "job": job, "round": 1, "model": "digits", "version": "1",
            **extra}
    return rig.driver.submit(body, f"{job}-r1")


def test_a_commands_choices_reach_the_child_and_what_it_measured_reaches_the_state(rig: Rig) -> None:
    measured(rig, [choice(7), choice(8, engine="tflite")])
    assert rig.driver.shared_choices() == []  # nobody has said it reads them yet
    verdict, job = submit(rig, engine_choices=[choice(1), choice(2, threads=1)])
    assert verdict.accept and job is not None, verdict
    assert job.params["engine_choices"] == [choice(1), choice(2, threads=1)]  # kept with the job (a restart)
    rig.driver.changed = False
    rig.run_until(lambda: rig.job().state is S.UPLOADING)
    spec = json.loads((rig.driver.job_dir(job) / SPEC_FILE).read_text())
    assert spec["engine_choices"] == [choice(1), choice(2, threads=1)]
    assert rig.driver.shared_choices() == [choice(7), choice(8, engine="tflite")] and rig.driver.changed
    # a restarted daemon reports them again (from the job's record) to the coordinator that reads them
    again = rig.new_driver()
    assert again.shared_choices() == []
    again.recover()
    assert again.shared_choices() == [choice(7), choice(8, engine="tflite")]


def test_an_older_coordinator_sends_none_and_is_told_none(rig: Rig) -> None:
    measured(rig, [choice(7)])
    verdict, job = submit(rig)  # no `engine_choices` field
    assert verdict.accept and job is not None and "engine_choices" not in job.params
    rig.run_until(lambda: rig.job().state is S.UPLOADING)
    assert "engine_choices" not in json.loads((rig.driver.job_dir(job) / SPEC_FILE).read_text())
    assert rig.driver.measured == [choice(7)] and rig.driver.shared_choices() == []  # its schema would refuse them
    # the coordinator was upgraded (it heard none yet): even a command refused (busy) says it reads them
    verdict, _ = submit(rig, "k", engine_choices=[])
    assert verdict.reason == "busy" and rig.driver.shared_choices() == [choice(7)]


def test_bad_choices_in_a_command_are_refused_as_bad_params(rig: Rig) -> None:
    verdict, job = submit(rig, engine_choices=[choice(1), {**choice(2), "latency_ms": float("nan")}])
    assert job is None and verdict.reason == "bad_params", verdict
    assert verdict.detail == "engine_choices[1]: latency_ms must be a positive number"
    verdict, job = submit(rig, engine_choices=[choice(1), choice(1)])
    assert job is None and verdict.detail == "engine_choices: a kind appears twice"


def test_a_stopped_job_that_measured_reports_it_and_keeps_it_in_its_record(rig: Rig) -> None:
    measured(rig, [choice(7)])
    rig.set_mode("sensor-error")  # the governor stopped it after engine selection: nothing to upload
    submit(rig, engine_choices=[])
    rig.run_until(lambda: rig.job().state is S.FAILED)
    assert rig.driver.shared_choices() == [choice(7)]
    again = rig.new_driver()
    again.recover()
    assert again.shared_choices() == [choice(7)]


def test_a_result_the_child_left_before_a_restart_is_reported(rig: Rig) -> None:
    from edge_agent.agent.jobs import Job, transition
    from edge_agent.agent.runner import UPDATE_FILE, pack_chunks
    from edge_agent.atomic import atomic_write_json, write_checked

    job = Job(job_id="a-r1", round=1, model="digits@1", params={"job": "a", "deadline_at": time.time() + 99,
                                                                 "engine_choices": []})
    for state in (S.PREPARING, S.TRAINING):
        transition(job, state)
    rig.store.save(job)
    folder = rig.driver.job_dir(job)
    folder.mkdir(parents=True)
    write_checked(folder / UPDATE_FILE, pack_chunks([b"chunk"]))
    atomic_write_json(folder / RESULT_FILE, {"status": "trained", "stop_reason": "done", "steps": 4,
                                             "engine_choices": [choice(7)]})
    rig.driver = rig.new_driver()
    rig.driver.recover()
    rig.run_until(lambda: rig.job("a-r1").state is S.UPLOADING)
    assert rig.driver.shared_choices() == [choice(7)]


def test_a_damaged_measured_list_is_not_reported(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    measured(rig, [choice(7, threads=0)])
    submit(rig, engine_choices=[])
    with caplog.at_level(logging.WARNING):
        rig.run_until(lambda: rig.job().state is S.UPLOADING)
    assert rig.driver.shared_choices() == [] and "threads must be an integer in 1..256; not reported" in caplog.text


def test_the_daemons_state_carries_the_measured_choices_only_for_a_coordinator_that_reads_them(
        tmp_path: Path) -> None:
    from edge_agent.agent.daemon import Daemon
    from edge_agent.config import load_config, public_key_text, render_config

    keys.save_private_key(tmp_path / "state" / "keys" / "device.key", keys.generate_private_key())
    (tmp_path / "agent.toml").write_text(render_config(
        device_name="pi", fleet="f", broker_host="127.0.0.1", broker_port=9, state_dir=tmp_path / "state",
        coordinator_public_key=public_key_text(keys.generate_private_key()),
        sysfs_root=str(BOARDS / "raspberry-pi-4")))
    daemon = Daemon(load_config(tmp_path / "agent.toml"))
    sent: list[tuple[Kind, dict[str, Any]]] = []

    def send(topic: str, kind: Kind, body: dict[str, Any], **kw: Any) -> bool:
        check_body(kind, body)
        sent.append((kind, body))
        return True

    daemon.channel.send = send  # type: ignore[method-assign]
    daemon.driver.measured = [choice(7)]
    daemon.publish_state()
    daemon.driver.coordinator_reads_choices = True
    daemon.publish_state()
    assert [k for k, _ in sent] == [Kind.STATE, Kind.STATE]
    assert "engine_choices" not in sent[0][1] and sent[1][1]["engine_choices"] == [choice(7)]
    daemon.publish_hello()
    assert sent[-1][0] is Kind.HELLO and sent[-1][1]["info"]["engine_choices"] is True


# ---------------------------------------------------------------- the training child
class Events:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def send(self, obj: dict[str, Any]) -> None:
        self.sent.append(obj)

    def progress(self, event: Any) -> None:
        pass


def fake_report(stop_reason: str) -> dict[str, Any]:
    return {"stop_reason": stop_reason, "steps": 0, "engine": {"name": "native"}, "data": {"train": 10, "per_class": {}},
            "energy": {"wh": 0.0, "source": "cpu-model"}, "accuracy": {"before": 0.5, "after": 0.5},
            "duration_s_all_runs": 1.0, "resumed": False, "depth": {"depth": 0}, "trainer": "numpy", "power": {}}


def test_the_child_passes_the_choices_on_and_lists_what_the_cache_says_it_measured(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import edge_agent.train.job as job_module

    cache = tmp_path / "cache" / "int8-selection"
    cache.mkdir(parents=True)
    (cache / "a.json").write_text(json.dumps({"source": "measured", "share": choice(7)}))
    (cache / "b.json").write_text(json.dumps({"source": "fleet", "share": choice(8)}))  # adopted: not ours to pass on
    seen: dict[str, Any] = {}

    def run_finetune(**kw: Any) -> dict[str, Any]:
        seen.update(kw)
        return fake_report("battery-low")  # stopped: no update to encode (its choices are still reported)

    monkeypatch.setattr(job_module, "run_finetune", run_finetune)
    spec = {"job_dir": str(tmp_path / "job"), "model_dir": "m", "data": "d", "cache_dir": str(tmp_path / "cache"),
            "engine_choices": [choice(1), choice(2)]}
    (tmp_path / "job").mkdir()
    assert child_module.train(spec, Events()) == child_module.EXIT_STOPPED  # type: ignore[arg-type]
    assert seen["engine_choices"] == (SharedChoice.from_json(choice(1)), SharedChoice.from_json(choice(2)))
    result = json.loads((tmp_path / "job" / RESULT_FILE).read_text())
    assert result["status"] == "stopped" and result["engine_choices"] == [choice(7)]
    # choices the spec cannot give (a damaged file) cost a full selection, not the job
    spec["engine_choices"] = [choice(1), {"kind": "x"}]
    with caplog.at_level(logging.WARNING):
        assert child_module.train(spec, Events()) == child_module.EXIT_STOPPED  # type: ignore[arg-type]
    assert seen["engine_choices"] == () and "choosing the engine without them" in caplog.text
    del spec["engine_choices"]
    child_module.train(spec, Events())  # type: ignore[arg-type]
    assert seen["engine_choices"] == ()


# ---------------------------------------------------------------- the job and `edge-agent finetune`
@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo.ensure_bundle(tmp_path_factory.getbasetemp() / "digits-bundle")


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dev = demo.scenario().devices[0]
    return demo.write_data(tmp_path_factory.mktemp("data") / "d", dev.images[:40], dev.labels[:40], "npz")


class Chosen(Exception):
    pass


def test_the_job_starts_engine_selection_from_the_fleets_choices(bundle: Path, data: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import edge_agent.int8.selection as selection
    from edge_agent.train.job import run_finetune

    seen: dict[str, Any] = {}

    def select_engine(*args: Any, **kw: Any) -> Any:
        seen.update(kw)
        raise Chosen()

    monkeypatch.setattr(selection, "select_engine", select_engine)
    fleet = (SharedChoice.from_json(choice(1)), SharedChoice.from_json(choice(2)))
    for i, (given, passed) in enumerate(((fleet, fleet), ([], ()))):
        with pytest.raises(Chosen):
            run_finetune(model=bundle, data=data, state_dir=tmp_path / f"s{i}", cache_dir=tmp_path / "cache",
                         engine_choices=given, profile="raspberry-pi-4", power_root=str(BOARDS / "raspberry-pi-4"))
        assert seen["shared"] == passed and seen["state_dir"] == tmp_path / "cache"
    with pytest.raises(UsageError, match="engine_choices: expected SharedChoice records"):
        run_finetune(model=bundle, data=data, state_dir=tmp_path / "s9", engine_choices=[choice(1)])  # type: ignore[list-item]


def test_finetune_engine_choices_file(bundle: Path, data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    import edge_agent.train.job as job_module
    from edge_agent import cli

    seen: dict[str, Any] = {}

    def run_finetune(**kw: Any) -> dict[str, Any]:
        seen.update(kw)
        raise UsageError("stopped by the test")

    monkeypatch.setattr(job_module, "run_finetune", run_finetune)
    good = tmp_path / "choices.json"
    good.write_text(json.dumps([choice(1), choice(2, engine="tflite")]))
    argv = ["finetune", "--model", str(bundle), "--data", str(data), "--state-dir", str(tmp_path / "s"), "-q"]
    assert cli.main([*argv, "--engine-choices", str(good)]) != 0 and seen
    assert seen["engine_choices"] == (SharedChoice.from_json(choice(1)), SharedChoice.from_json(choice(2, engine="tflite")))
    seen.clear()
    cli.main(argv)
    assert seen["engine_choices"] == ()
    capsys.readouterr()
    for text, says in ((json.dumps([choice(1, batch_size=10**6)]), "batch_size must be an integer"),
                       ("{not json", "Expecting property name"), (json.dumps({"kind": "x"}), "not a list"),
                       ("x" * 70_000, "bytes")):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        with pytest.raises(SystemExit) as exit_:
            cli.main([*argv, "--engine-choices", str(bad)])
        err = capsys.readouterr().err
        assert exit_.value.code == EXIT_USAGE and "argument --engine-choices" in err and says in err, err


def test_the_finetune_help_explains_engine_choices() -> None:
    import subprocess

    out = subprocess.run([sys.executable, "-m", "edge_agent.cli", "finetune", "--help"], capture_output=True, text=True,
                         timeout=60, cwd=Path(__file__).resolve().parents[2]).stdout
    text = " ".join(out.split()).replace("- ", "-")  # (argparse wraps "re-checked" at its hyphen)
    assert "--engine-choices FILE a JSON list of int8 engine choices other devices measured" in text
    assert "`edge-coordinator devices --engine-choices` prints it" in text
    assert "is only re-checked here, not measured again" in text
