"""State facts from a captured board tree, their compact text form, and a daemon that never
loads numpy or MXNet."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from edge_agent.agent.state import DeviceState, render_detail
from edge_agent.hardware.probe import probe
from edge_agent.protocol.facts import MAX_DETAIL, facts_from_state

BOARDS = Path(__file__).resolve().parents[1] / "fixtures" / "boards"
REPO = Path(__file__).resolve().parents[2]


def _tree(tmp_path: Path, capacity: str | None) -> Path:
    root = tmp_path / "board"
    shutil.copytree(BOARDS / "raspberry-pi-4", root)
    if capacity is not None:
        bat = root / "sys" / "class" / "power_supply" / "BAT0"
        bat.mkdir(parents=True)
        for name, value in (("type", "Battery"), ("status", "Charging"), ("capacity", capacity),
                            ("energy_now", "7200000")):
            (bat / name).write_text(value + "\n")
    return root


def test_facts_from_a_board_tree(tmp_path: Path) -> None:
    root = _tree(tmp_path, "64")
    now = [0.0]
    state = DeviceState(sysfs_root=str(root), probe_report=probe(root), idle_w=2.7, load_w=6.4, clock=lambda: now[0])
    facts = state.facts(name="pi", busy=True, job="j1", job_state="training", models={"digits": "3"},
                        engine="native", outbox=2)
    assert facts["battery_pct"] == 64 and facts["charging"] is True and facts["on_power"] is True
    assert facts["energy_wh"] == 7.2 and facts["power_w"] == 4.144 and facts["temp_c"] == 51.6
    assert facts["profile"] == "raspberry-pi-4" and facts["models"] == "digits@3" and facts["status"] == "busy"
    # cached for a moment, then read again
    (root / "sys" / "class" / "power_supply" / "BAT0" / "capacity").write_text("12\n")
    assert state.readings().battery_pct == 64
    now[0] = 10.0
    assert state.readings().battery_pct == 12
    assert state.readings(fresh=True).battery_pct == 12
    body = state.state_body(facts)
    assert body["status"] == "busy" and body["job"] == "j1" and len(body["detail"]) <= MAX_DETAIL
    back = facts_from_state(body)
    for key in ("battery_pct", "charging", "on_power", "power_w", "temp_c", "job", "job_state", "engine", "outbox"):
        assert back[key] == facts[key], key


def test_no_battery_means_mains_and_unknowns_are_left_out(tmp_path: Path) -> None:
    root = _tree(tmp_path, None)
    shutil.rmtree(root / "sys" / "class" / "thermal")
    state = DeviceState(sysfs_root=str(root), probe_report=probe(root))
    facts = state.facts(name="pi", busy=False, job=None, job_state=None, models={}, engine=None, outbox=0)
    assert facts["on_power"] is True and "battery_pct" not in facts and "temp_c" not in facts
    assert "job" not in facts and "models" not in facts


def test_detail_is_bounded_and_parsing_junk_is_harmless() -> None:
    facts = {"status": "idle", "battery_pct": 50.5, "models": ",".join(f"m{i}@{i}" for i in range(80))}
    text = render_detail(facts)
    assert len(text) <= MAX_DETAIL and text.startswith("status=idle battery_pct=50.5")
    assert facts_from_state({"status": "idle", "detail": "=x a= b=true c=1e3 d \x00=1 " * 30})["b"] is True


def test_the_daemon_never_imports_numpy_or_mxnet(tmp_path: Path) -> None:
    script = textwrap.dedent(f'''
        import sys
        from pathlib import Path
        from edge_agent import keys
        from edge_agent.config import load_config, public_key_text, render_config
        from edge_agent.agent.daemon import Daemon
        from edge_agent.agent import cli, lifecycle, models, policy, runner, state  # noqa: F401
        tmp = Path({str(tmp_path)!r})
        keys.save_private_key(tmp / "state" / "keys" / "device.key", keys.generate_private_key())
        (tmp / "agent.toml").write_text(render_config(
            device_name="pi", fleet="f", broker_host="127.0.0.1", broker_port=9, state_dir=tmp / "state",
            coordinator_public_key=public_key_text(keys.generate_private_key()),
            sysfs_root={str(BOARDS / "raspberry-pi-4")!r}))
        daemon = Daemon(load_config(tmp / "agent.toml"))
        for _ in range(3):
            daemon.iteration()  # no broker: receive times out, jobs and models are stepped
        daemon.facts()
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("numpy", "mxnet", "tflite_runtime", "onnx")))
    ''')
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"
