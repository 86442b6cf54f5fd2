"""The systemd unit: verified and security-scored by systemd-analyze (no booted systemd)."""

from __future__ import annotations

import configparser
import re
import subprocess
import sys
from pathlib import Path

UNIT = Path(__file__).resolve().parents[2] / "packaging" / "systemd" / "edge-agent.service"
EXPOSURE_LIMIT = 2.5


def _unit_with_real_exec(tmp_path: Path) -> Path:
    """verify checks that ExecStart exists: point it at this venv's edge-agent."""
    exe = Path(sys.executable).parent / "edge-agent"
    assert exe.exists()
    copy = tmp_path / UNIT.name
    copy.write_text(UNIT.read_text().replace("/opt/edge-agent/venv/bin/edge-agent", str(exe)))
    return copy


def test_systemd_analyze_verify_is_clean(tmp_path: Path) -> None:
    out = subprocess.run(["systemd-analyze", "verify", str(_unit_with_real_exec(tmp_path))],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip() == "", out.stderr


def test_security_exposure_is_at_most_2_5(tmp_path: Path) -> None:
    out = subprocess.run(["systemd-analyze", "security", "--offline=true", "--no-pager",
                          str(_unit_with_real_exec(tmp_path))], capture_output=True, text=True, timeout=60)
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", out.stdout)
    assert match, out.stdout[-2000:] + out.stderr
    assert float(match.group(1)) <= EXPOSURE_LIMIT, out.stdout


def test_unit_keeps_what_the_agent_needs() -> None:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(re.sub(r"^(SystemCallFilter|DeviceAllow|Environment)=", r"\1_x=", UNIT.read_text(),
                              flags=re.M))
    service = parser["Service"]
    assert service["Type"] == "notify" and int(service["WatchdogSec"]) >= 10
    assert service["Restart"] == "on-failure"
    assert service["RestartPreventExitStatus"] == "78"  # EXIT_CONFIG in edge_agent.errors
    assert service["User"] == "edge-agent"
    assert {"i2c", "gpio", "video", "plugdev"} <= set(service["SupplementaryGroups"].split())
    assert "PrivateUsers" not in service  # would map the supplementary groups to nobody
    assert service["StateDirectory"] == "edge-agent" and service["ConfigurationDirectory"] == "edge-agent"
    assert service["IOSchedulingClass"] == "idle" and int(service["Nice"]) > 0
    assert service["CapabilityBoundingSet"] == "" and service["NoNewPrivileges"] == "yes"
    assert service["ProtectSystem"] == "strict"
