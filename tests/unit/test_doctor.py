"""`edge-agent doctor`: the DT_NEEDED reader, the ArmPL -> OpenBLAS + LAPACKE repair (on a
real shared library linked like the mxnet 1.9.1 aarch64 wheel's libmxnet.so), and the one
line a user sees when MXNet cannot load."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edge_agent import doctor

REPO = Path(__file__).resolve().parents[2]


def _armpl_linked_library(tmp: Path) -> Path:
    """libfake.so NEEDing the three ArmPL libraries, as libmxnet.so does (stub libraries)."""
    for name in ("armpl_lp64_mp", "amath", "astring"):
        (tmp / f"{name}.c").write_text(f"int {name}_marker(void) {{ return 1; }}\n")
        subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(tmp / f"lib{name}.so"), str(tmp / f"{name}.c")],
                       check=True)
    (tmp / "fake.c").write_text("int fake(void) { return 42; }\n")
    lib = tmp / "libfake.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(tmp / "fake.c"), f"-L{tmp}",
                    "-Wl,--no-as-needed", "-larmpl_lp64_mp", "-lamath", "-lastring", "-lgomp"], check=True)
    return lib


def test_needed_libraries_reads_the_dynamic_section(tmp_path: Path) -> None:
    lib = _armpl_linked_library(tmp_path)
    assert doctor.needed_libraries(lib)[:4] == ["libarmpl_lp64_mp.so", "libamath.so", "libastring.so", "libgomp.so.1"]
    (tmp_path / "junk.so").write_bytes(b"not an elf")
    with pytest.raises(doctor.RepairError, match="not a little-endian ELF"):
        doctor.needed_libraries(tmp_path / "junk.so")
    data = lib.read_bytes()
    for cut in (7, 70, len(data) // 3):  # truncated: an interrupted copy, a bad SD card
        (tmp_path / "cut.so").write_bytes(data[:cut])
        with pytest.raises(doctor.RepairError):
            doctor.needed_libraries(tmp_path / "cut.so")


def test_a_corrupt_mxnet_library_is_a_failed_check_not_a_traceback(tmp_path: Path) -> None:
    """The daemon's hello reads the same library (capabilities): it must not fail on it."""
    site = tmp_path / "site"
    (site / "mxnet").mkdir(parents=True)
    (site / "mxnet" / "__init__.py").write_text("")
    (site / "mxnet" / "libmxnet.so").write_bytes(b"\x7fELF\x02\x01\x01")
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{REPO}"}
    done = subprocess.run([sys.executable, "-m", "edge_agent.cli", "doctor", "--json"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 69 and "Traceback" not in done.stderr, done.stderr
    checks = {c["name"]: c for c in json.loads(done.stdout)}
    assert not checks["mxnet"]["ok"] and "reinstall mxnet" in checks["mxnet"]["detail"]
    probe = ("import json; from edge_agent import doctor; print(json.dumps([doctor.mxnet_installed(), "
             "doctor.capabilities()['mxnet']]))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    (ok, why), capable = json.loads(out.stdout)
    assert not ok and "not a readable ELF" in why and capable is False


def test_repair_rewrites_armpl_to_openblas_and_lapacke(tmp_path: Path) -> None:
    assert shutil.which("patchelf"), "patchelf missing: run .ci/run's apt-get line"
    lib = _armpl_linked_library(tmp_path)
    before = doctor.sha256_file(lib)
    record = doctor.repair_library(lib)
    after = doctor.needed_libraries(lib)
    assert "libopenblas.so.0" in after and "liblapacke.so.3" in after and "libgomp.so.1" in after
    assert not {"libarmpl_lp64_mp.so", "libamath.so", "libastring.so"} & set(after)
    assert record["original_sha256"] == before and record["repaired_sha256"] == doctor.sha256_file(lib) != before
    assert not list(tmp_path.glob("*.repair-tmp"))
    with pytest.raises(doctor.RepairError, match="nothing to repair"):
        doctor.repair_library(lib)  # idempotent: a second --fix changes nothing


def _stand_in_mxnet(tmp: Path) -> Path:
    """A `mxnet` package that loads a library the way mxnet/base.py does, with the arm64
    wheel's missing dependency: the dynamic linker's own OSError."""
    pkg = tmp / "site" / "mxnet"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("import ctypes\nctypes.CDLL('libarmpl_lp64_mp.so', ctypes.RTLD_LOCAL)\n")
    return tmp / "site"


def test_mxnet_that_cannot_load_is_one_line_and_exit_69(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(_stand_in_mxnet(tmp_path))}
    code = ("from edge_agent.errors import run_command\n"
            "from edge_agent.int8.mxnet_import import mxnet\n"
            "raise SystemExit(run_command('edge-agent', mxnet))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=120)
    assert done.returncode == 69, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "libarmpl_lp64_mp.so" in done.stderr and "edge-agent doctor --fix" in done.stderr


def test_doctor_reports_and_repairs_an_armpl_linked_mxnet(tmp_path: Path) -> None:
    """`doctor` on a venv whose mxnet NEEDs ArmPL: exit 69 with the fix; `--fix` rewrites it
    (with Debian's libopenblas0-pthread and liblapacke installed, as .ci/run does)."""
    site = tmp_path / "site"
    (site / "mxnet").mkdir(parents=True)
    (site / "mxnet" / "__init__.py").write_text("")
    lib = _armpl_linked_library(tmp_path)
    shutil.copyfile(lib, site / "mxnet" / "libmxnet.so")
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{REPO}"}
    done = subprocess.run([sys.executable, "-m", "edge_agent.cli", "doctor", "--json"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 69, done.stderr
    checks = {c["name"]: c for c in json.loads(done.stdout)}
    assert not checks["mxnet-repair"]["ok"] and "doctor --fix" in checks["mxnet-repair"]["fix"]
    fixed = subprocess.run([sys.executable, "-m", "edge_agent.cli", "doctor", "--fix", "--json"],
                           capture_output=True, text=True, env=env, timeout=120)
    checks = {c["name"]: c for c in json.loads(fixed.stdout)}
    assert checks["mxnet-repair"]["ok"], fixed.stdout  # CI installs libopenblas0-pthread liblapacke
    assert "libopenblas.so.0" in doctor.needed_libraries(site / "mxnet" / "libmxnet.so")
    record = json.loads((site / "mxnet" / doctor.REPAIR_RECORD).read_text())
    assert record["repaired_sha256"] == doctor.sha256_file(site / "mxnet" / "libmxnet.so")


def test_a_missing_mxnet_says_what_still_works() -> None:
    from edge_agent.int8.mxnet_import import _explain

    text = _explain(ModuleNotFoundError("No module named 'mxnet'", name="mxnet"))
    assert text.startswith("MXNet is not installed") and "--trainer numpy" in text
    assert "doctor --fix" in _explain(OSError("libarmpl_lp64_mp.so: cannot open shared object file"))
