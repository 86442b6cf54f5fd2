"""The hardware probe on fixture trees from real boards, on this machine, and on bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edge_agent.hardware.probe import hardware_fingerprint, probe, render

BOARDS = Path(__file__).resolve().parents[1] / "fixtures" / "boards"


def _probe(board: str) -> dict:
    return probe(BOARDS / board)


def _features(report: dict) -> dict[str, bool]:
    return report["cpu"]["int8_features"]


def test_raspberry_pi_4() -> None:
    r = _probe("raspberry-pi-4")
    assert r["board"]["model"] == "Raspberry Pi 4 Model B Rev 1.4"  # trailing NUL stripped
    assert r["board"]["model_source"] == "/proc/device-tree/model"
    assert r["board"]["compatible"] == ["raspberrypi,4-model-b", "brcm,bcm2711"]
    assert r["board"]["ram_mb"] == 3790 and r["board"]["swap_mb"] == 99
    assert r["cpu"]["arch"] == "aarch64" and r["cpu"]["count"] == 4
    assert r["cpu"]["parts"] == ["Cortex-A72 (0xd08)"]
    assert _features(r) == {"asimd": True, "asimddp": False, "i8mm": False, "bf16": False, "sve": False}
    assert r["cpu"]["soc"] == {"Revision": "c03114", "Model": "Raspberry Pi 4 Model B Rev 1.4"}
    assert r["accelerators"] == []
    (ina,) = r["power"]["hwmon"]
    assert ina["name"] == "ina219"
    assert ina["channels"] == [{"channel": 1, "voltage_v": 5.104, "current_a": 0.812, "power_w": 4.144}]
    assert r["thermal"] == [{"zone": "thermal_zone0", "type": "cpu-thermal", "temp_c": 51.634}]
    assert r["cpufreq"] == {"governor": "ondemand", "min_mhz": 600.0, "max_mhz": 1800.0, "cur_mhz": 1500.0}
    assert r["profile"]["name"] == "raspberry-pi-4"
    assert "Raspberry Pi 4 *" in r["profile"]["reason"]
    assert r["problems"] == []


def test_raspberry_pi_4_with_coral_usb() -> None:
    r = _probe("raspberry-pi-4-coral-usb")
    (coral,) = r["accelerators"]
    assert coral["kind"] == "coral-usb"
    assert coral["evidence"] == ["USB 18d1:9302 at /sys/bus/usb/devices/2-2"]
    assert coral["runtime_library"] == "libedgetpu.so.1"
    assert coral["runtime_loads"] is False  # never loads a library from a foreign root
    assert "libedgetpu.so.1 present" in coral["runtime_detail"]
    assert r["power"] == {"hwmon": [], "power_supply": [], "rapl": []}
    # The Coral-specific profile wins over the plain Pi 4 one, which also matched.
    assert r["profile"]["name"] == "raspberry-pi-4-coral-usb"
    assert r["profile"]["candidates"] == ["raspberry-pi-4-coral-usb", "raspberry-pi-4"]


def test_raspberry_pi_5() -> None:
    r = _probe("raspberry-pi-5")
    assert r["board"]["model"] == "Raspberry Pi 5 Model B Rev 1.0"
    assert r["cpu"]["parts"] == ["Cortex-A76 (0xd0b)"]
    assert _features(r)["asimddp"] is True and _features(r)["i8mm"] is False
    # rp1_adc and pwmfan are hwmon devices but not power sensors.
    assert r["power"]["hwmon"] == []
    assert r["profile"]["name"] == "raspberry-pi-5"


def test_raspberry_pi_5_with_hailo8l() -> None:
    r = _probe("raspberry-pi-5-hailo8l")
    (hailo,) = r["accelerators"]
    assert hailo["kind"] == "hailo"
    assert hailo["evidence"] == ["PCI 0x1e60:0x2864 at /sys/bus/pci/devices/0000:01:00.0",
                                 "device node /dev/hailo0"]
    assert hailo["runtime_loads"] is False and "not found" in hailo["runtime_detail"]
    (ina,) = r["power"]["hwmon"]
    assert ina["name"] == "ina260" and ina["channels"][0]["power_w"] == 9.01
    (battery,) = r["power"]["power_supply"]
    assert battery["type"] == "Battery" and battery["status"] == "Discharging"
    assert battery["capacity_pct"] == 76 and battery["voltage_v"] == 3.921
    assert r["profile"]["name"] == "raspberry-pi-5-hailo8l"


@pytest.mark.parametrize(("board", "arch", "features"), [
    ("raspberry-pi-zero-2w-32bit", "armv7l", {"neon": True, "vfpv4": True}),
    ("raspberry-pi-zero-2w-64bit", "aarch64",
     {"asimd": True, "asimddp": False, "i8mm": False, "bf16": False, "sve": False}),
])
def test_raspberry_pi_zero_2w(board: str, arch: str, features: dict[str, bool]) -> None:
    r = _probe(board)
    assert r["board"]["model"] == "Raspberry Pi Zero 2 W Rev 1.0"
    assert r["cpu"]["arch"] == arch
    assert r["cpu"]["parts"] == ["Cortex-A53 (0xd03)"]
    assert _features(r) == features
    assert r["board"]["ram_mb"] == 429
    assert r["profile"]["name"] == "raspberry-pi-zero-2w"


def test_jetson_orin_nano() -> None:
    r = _probe("jetson-orin-nano")
    assert r["board"]["model"] == "NVIDIA Jetson Orin Nano Developer Kit"
    assert r["board"]["jetson_release"].startswith("R36 (release), REVISION: 3.0")
    assert "nvidia,tegra234" in r["board"]["compatible"]
    assert r["cpu"]["count"] == 6 and r["cpu"]["parts"] == ["Cortex-A78AE (0xd42)"]
    assert r["cpu"]["model"] == "Cortex-A78AE"  # "ARMv8 Processor" replaced by the core name
    (gpu,) = r["accelerators"]
    assert gpu["kind"] == "jetson-gpu"
    assert "device-tree compatible nvidia,tegra234" in gpu["evidence"]
    assert "libcudart.so.12 present" in gpu["runtime_detail"]
    (ina,) = r["power"]["hwmon"]
    assert ina["name"] == "ina3221"
    vdd_in = ina["channels"][0]
    # INA3221 has no power node: the probe derives V x I and says so.
    assert vdd_in["label"] == "VDD_IN" and vdd_in["power_derived"] is True
    assert vdd_in["power_w"] == pytest.approx(5.032 * 1.024)
    assert [z["type"] for z in r["thermal"]][:2] == ["cpu-thermal", "gpu-thermal"]
    assert r["cpufreq"]["governor"] == "schedutil"
    assert r["profile"]["name"] == "jetson-orin-nano"


def test_x86_with_avx2() -> None:
    r = _probe("x86-avx2")
    assert r["board"]["model"] == "OptiPlex 7070" and r["board"]["vendor"] == "Dell Inc."
    assert r["board"]["model_source"] == "/sys/class/dmi/id/product_name"
    assert r["cpu"]["arch"] == "x86_64" and r["cpu"]["count"] == 6
    assert r["cpu"]["model"] == "Intel(R) Core(TM) i5-9500T CPU @ 2.20GHz"
    assert _features(r) == {"avx2": True, "fma": True, "avx512f": False, "avx512_vnni": False,
                            "avx_vnni": False, "amx_int8": False}
    rapl = {d["domain"]: d for d in r["power"]["rapl"]}
    assert rapl["intel-rapl:0"]["name"] == "package-0"
    assert rapl["intel-rapl:0"]["energy_j"] == pytest.approx(73119.348296)
    assert r["profile"]["name"] == "x86-64-generic"


def test_every_fixture_board_matches_a_profile_and_reads_cleanly() -> None:
    boards = sorted(p.name for p in BOARDS.iterdir() if p.is_dir())
    assert len(boards) >= 8
    for board in boards:
        r = _probe(board)
        assert r["profile"]["name"], board
        assert r["problems"] == [], (board, r["problems"])
        json.dumps(r)  # JSON-ready


def test_fingerprint_is_stable_and_tracks_int8_relevant_hardware() -> None:
    a, b = _probe("raspberry-pi-4"), _probe("raspberry-pi-4")
    assert hardware_fingerprint(a) == hardware_fingerprint(b) == a["fingerprint"]
    b["thermal"][0]["temp_c"] = 70.0  # a reading drifting must not invalidate caches
    assert hardware_fingerprint(b) == a["fingerprint"]
    assert _probe("raspberry-pi-4-coral-usb")["fingerprint"] != a["fingerprint"]
    assert _probe("raspberry-pi-5")["fingerprint"] != a["fingerprint"]


def test_this_machine_reports_its_real_features() -> None:
    r = probe("/")
    assert r["live"] is True
    assert r["cpu"]["arch"] == os.uname().machine
    assert r["cpu"]["count"] == os.cpu_count()
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith(("flags", "Features")):
            flags = set(line.split(":", 1)[1].split())
            break
    for name, present in r["cpu"]["int8_features"].items():
        assert present == (name in flags), name
    assert r["profile"]["name"] is not None
    assert "Profile:" in render(r)


# --- bad input -----------------------------------------------------------------------------

def _tree(tmp_path: Path, files: dict[str, bytes | str]) -> Path:
    for rel, content in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return tmp_path


def test_empty_root_reports_what_is_missing(tmp_path: Path) -> None:
    r = probe(tmp_path)
    assert r["board"]["model"] == "" and r["cpu"]["count"] == 0
    assert any(p.startswith("/proc/cpuinfo: missing") for p in r["problems"])
    assert any(p.startswith("/proc/meminfo: missing") for p in r["problems"])
    assert r["profile"]["name"] is None and "no profile matches" in r["profile"]["reason"]
    render(r)


def test_garbage_and_truncated_cpuinfo(tmp_path: Path) -> None:
    junk = os.urandom(4096).replace(b":", b"")
    r = probe(_tree(tmp_path / "junk", {"proc/cpuinfo": junk}))
    assert r["cpu"]["count"] == 0
    assert any("/proc/cpuinfo" in p for p in r["problems"])
    # Truncated in the middle of the second processor block: what was read is kept.
    full = (BOARDS / "raspberry-pi-5" / "proc/cpuinfo").read_text()
    cut = full[: full.index("processor\t: 1") + 40]
    r = probe(_tree(tmp_path / "cut", {"proc/cpuinfo": cut}))
    assert r["cpu"]["arch"] == "aarch64" and r["cpu"]["int8_features"]["asimddp"] is True
    assert r["cpu"]["count"] == 2


def test_binary_junk_in_model_string(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"proc/device-tree/model": b"Raspberry Pi 4 Model B\xff\xfe\x01\x02 Rev 1.5\x00"})
    r = probe(root)
    assert r["board"]["model"] == "Raspberry Pi 4 Model B Rev 1.5"
    assert any("non-text bytes removed" in p for p in r["problems"])


def test_hwmon_node_that_errors_on_read(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"sys/class/hwmon/hwmon0/name": "ina219\n",
                            "sys/class/hwmon/hwmon0/in1_input": "5000\n",
                            "sys/class/hwmon/hwmon0/curr1_input": "not-a-number\n"})
    # A real EIO: reading /proc/self/mem at offset 0 fails like a sensor on a flaky I2C bus.
    (root / "sys/class/hwmon/hwmon0/power1_input").symlink_to("/proc/self/mem")
    (root / "sys/class/hwmon/hwmon0/curr2_input").mkdir()
    r = probe(root)
    (ina,) = r["power"]["hwmon"]
    assert ina["channels"][0] == {"channel": 1, "voltage_v": 5.0}
    problems = "\n".join(r["problems"])
    assert "power1_input: read error: EIO" in problems
    assert "curr1_input: not an integer" in problems
    assert "curr2_input: is a directory" in problems


def test_implausible_and_unreadable_values(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"sys/class/thermal/thermal_zone0/temp": "999999999\n",
                            "sys/class/power_supply/BAT0/capacity": "250\n",
                            "proc/meminfo": "MemFree: 12 kB\n"})
    r = probe(root)
    assert r["thermal"][0]["temp_c"] is None
    assert "capacity_pct" not in r["power"]["power_supply"][0]
    problems = "\n".join(r["problems"])
    assert "implausible temperature" in problems and "out of range: 250" in problems
    assert "no MemTotal line" in problems


def test_huge_node_is_truncated_not_read_whole(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"proc/device-tree/model": "X" * 300_000})
    r = probe(root)
    assert len(r["board"]["model"]) == 200
    assert any("larger than" in p for p in r["problems"])


# --- the command line ----------------------------------------------------------------------

def _cli(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("edge-agent", path=str(Path(sys.executable).parent)) or "edge-agent"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=60)


def test_cli_json_for_a_fixture_matches_the_library() -> None:
    out = _cli("probe", "--json", "--root", str(BOARDS / "jetson-orin-nano"))
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["schema"] == "edge-agent.probe/1"
    assert report == json.loads(json.dumps(_probe("jetson-orin-nano")))


def test_cli_probe_of_this_machine_never_imports_mxnet_or_tflite() -> None:
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "edge_agent.cli", "probe"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "Profile:" in out.stdout
    imported = {line.split("|")[-1].strip().split(".")[0] for line in out.stderr.splitlines() if "|" in line}
    assert "edge_agent" in imported
    assert not imported & {"mxnet", "tflite_runtime", "tflite", "ai_edge_litert", "numpy", "onnx"}


def test_cpufreq_falls_back_to_the_hardware_limits(tmp_path: Path) -> None:
    base = "sys/devices/system/cpu/cpu0/cpufreq"
    root = _tree(tmp_path / "limits", {f"{base}/scaling_governor": "ondemand\n",
                                       f"{base}/cpuinfo_min_freq": "600000\n", f"{base}/cpuinfo_max_freq": "1800000\n"})
    r = probe(root)
    assert r["cpufreq"] == {"governor": "ondemand", "min_mhz": 600.0, "max_mhz": 1800.0, "cur_mhz": None}
    line = next(x for x in render(r).splitlines() if x.startswith("cpufreq:"))
    assert line == "cpufreq:      ondemand 600 MHz .. 1800 MHz" and "?" not in line
    # scaling_* (what the governor may use now) wins over the hardware limits where present
    both = _tree(tmp_path / "both", {f"{base}/scaling_governor": "powersave\n", f"{base}/scaling_max_freq": "1200000\n",
                                     f"{base}/cpuinfo_min_freq": "600000\n", f"{base}/cpuinfo_max_freq": "1800000\n"})
    assert probe(both)["cpufreq"]["max_mhz"] == 1200.0 and probe(both)["cpufreq"]["min_mhz"] == 600.0
    bare = _tree(tmp_path / "bare", {f"{base}/affected_cpus": "0\n"})
    line = next(x for x in render(probe(bare)).splitlines() if x.startswith("cpufreq:"))
    assert "?" not in line and "range unknown" in line
