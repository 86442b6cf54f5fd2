"""Board profiles: every shipped profile validates; broken ones get file:line errors."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from edge_agent.cli import main as cli_main
from edge_agent.errors import EXIT_CONFIG
from edge_agent.hardware.profiles import load_profiles, match_profile, profiles_dir

REQUIRED_BOARDS = {
    "raspberry-pi-4", "raspberry-pi-5", "raspberry-pi-5-hailo8l", "raspberry-pi-4-coral-usb",
    "raspberry-pi-zero-2w", "jetson-orin-nano", "x86-64-generic",
}


@pytest.fixture()
def profile_copy(tmp_path: Path) -> Path:
    """A private copy of the shipped profiles to break."""
    dest = tmp_path / "profiles"
    shutil.copytree(profiles_dir(), dest)
    return dest


def test_every_shipped_profile_is_valid() -> None:
    result = load_profiles()
    assert result.errors == []
    assert set(result.profiles) >= REQUIRED_BOARDS
    for profile in result.profiles.values():
        power = profile.data["power"]
        assert 0 < power["idle_w"] < power["load_w"], profile.name
        assert profile.data["int8"]["backends"][-1] == "reference", profile.name  # always a fallback
        assert profile.data["thermal"]["limit_c"] > 50
        assert profile.data["budget"]["battery_resume_pct"] > profile.data["budget"]["battery_floor_pct"]


def test_board_overrides_base_table_by_table() -> None:
    profiles = load_profiles().profiles
    pi4 = profiles["raspberry-pi-4"]
    assert pi4.data["power"] == {"idle_w": 2.7, "load_w": 6.4}
    assert pi4.data["budget"]["battery_floor_pct"] == 30.0  # inherited from base
    assert pi4.data["budget"]["energy_wh"] == 3.0  # overridden
    assert profiles["raspberry-pi-5"].data["power"] == {"idle_w": 2.8, "load_w": 9.7}


def test_shipped_profiles_cite_their_power_figures() -> None:
    for path in profiles_dir().glob("*.toml"):
        if path.stem == "base":
            continue
        text = path.read_text()
        power_section = text[text.index("[power]"):]
        assert "#" in power_section.split("idle_w")[0], f"{path.name}: cite the power figures in a comment"


def test_cli_check_passes_on_shipped_profiles(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["profiles", "check"]) == 0
    assert "profile(s) valid" in capsys.readouterr().out


def _break(directory: Path, name: str, old: str, new: str) -> Path:
    path = directory / name
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    return path


def _line(path: Path, needle: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if needle in line)


@pytest.mark.parametrize(("old", "new", "needle", "key", "message"), [
    ("idle_w = 2.7", "idle_w = -1", "idle_w = -1", "power.idle_w", "below the minimum"),
    ("idle_w = 2.7", 'idle_w = "low"', 'idle_w = "low"', "power.idle_w", "must be a number"),
    ("load_w = 6.4", "load_w = 2.0", "load_w = 2.0", "power.load_w", "must exceed idle_w"),
    ('backends = ["tflite"', 'backends = ["tensorrt", "tflite"', "tensorrt", "int8.backends",
     "unknown value 'tensorrt'"),
    ("limit_c = 78.0", "limit_c = 78.0\nlimit_f = 172", "limit_f", "thermal.limit_f", "unknown key"),
    ("threads = 4\nbatch_size", "threads = 0\nbatch_size", "threads = 0", "training.threads",
     "below the minimum"),
])
def test_broken_profile_reports_file_line_key(profile_copy: Path, capsys: pytest.CaptureFixture[str],
                                              old: str, new: str, needle: str, key: str,
                                              message: str) -> None:
    path = _break(profile_copy, "raspberry-pi-4.toml", old, new)
    result = load_profiles([path], directory=profile_copy)
    assert len(result.errors) == 1, result.errors
    error = result.errors[0]
    expected_line = _line(path, needle)
    assert error.startswith(f"{path}:{expected_line}: {key}: "), error
    assert message in error
    assert "raspberry-pi-4" not in result.profiles
    # The CLI prints the same line and exits with the configuration error code.
    assert cli_main(["profiles", "--dir", str(profile_copy), "check", str(path)]) == EXIT_CONFIG
    assert f"{path}:{expected_line}: {key}:" in capsys.readouterr().err


def test_toml_syntax_error_has_its_line(profile_copy: Path) -> None:
    path = _break(profile_copy, "raspberry-pi-5.toml", "idle_w = 2.8", "idle_w = = 2.8")
    (error,) = load_profiles([path], directory=profile_copy).errors
    assert error.startswith(f"{path}:{_line(path, 'idle_w = = 2.8')}: TOML syntax:")


def test_unreadable_huge_and_binary_files(profile_copy: Path) -> None:
    huge = profile_copy / "huge.toml"
    huge.write_text("# x\n" * 40_000)
    binary = profile_copy / "binary.toml"
    binary.write_bytes(b"\xff\xfe\x00junk")
    missing = profile_copy / "missing.toml"
    errors = load_profiles([huge, binary, missing], directory=profile_copy).errors
    assert any(e.startswith(f"{huge}:1:") and "over the" in e for e in errors)
    assert any(e.startswith(f"{binary}:1:") and "not UTF-8" in e for e in errors)
    assert any(e.startswith(f"{missing}:1: cannot read") for e in errors)


def test_duplicate_name_and_missing_match(profile_copy: Path) -> None:
    dup = profile_copy / "another-pi4.toml"
    dup.write_text((profile_copy / "raspberry-pi-4.toml").read_text())
    nomatch = profile_copy / "nomatch.toml"
    nomatch.write_text('[profile]\nname = "nomatch"\n')
    errors = load_profiles(directory=profile_copy).errors
    assert any("'raspberry-pi-4' is also defined" in e for e in errors)
    assert any(e.startswith(f"{nomatch}:") and "match.model" in e for e in errors)


def test_matching_prefers_the_more_specific_profile() -> None:
    profiles = load_profiles().profiles
    report = {"board": {"model": "Raspberry Pi 5 Model B Rev 1.1"}, "cpu": {"arch": "aarch64"},
              "accelerators": []}
    assert match_profile(report, profiles).profile.name == "raspberry-pi-5"
    report["accelerators"] = [{"kind": "hailo"}]
    match = match_profile(report, profiles)
    assert match.profile.name == "raspberry-pi-5-hailo8l" and "accelerator hailo present" in match.reason
    report["cpu"]["arch"] = "armv7l"  # Pi 5 profiles are 64-bit only
    assert match_profile(report, profiles).profile is None
