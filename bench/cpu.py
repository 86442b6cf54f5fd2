"""What this CPU can do, as the benches report it: its model, clock and int8-relevant
flags (/proc/cpuinfo), the nominal int8 peak of its widest multiply-accumulate, and the
rates bench/int8_ports.c measures per instruction (with the core's real clock).
"""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_info() -> tuple[str, float, set[str]]:
    """(model name, the clock /proc/cpuinfo reports in MHz, the CPU's feature flags)."""
    model, mhz, flags = platform.processor() or "unknown CPU", 0.0, set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and model.startswith("unknown"):
                model = value.strip()
            elif key == "cpu MHz" and not mhz:
                mhz = float(value)
            elif key in ("flags", "Features") and not flags:
                flags = set(value.split())
    except (OSError, ValueError):
        pass
    return model, mhz, flags


def int8_peak_ops_per_cycle(flags: set[str]) -> tuple[int, int, str]:
    """(theoretical int8 ops/cycle of the widest u8 x s8 instruction, ops/cycle the exact path
    the kernels use can reach, what was assumed) for one core with 2 vector multiply pipes."""
    if "avx512_vnni" in flags:
        return 2 * 64 * 2, 2 * 64 * 2, ("nominal, not measured: assumes 2 x vpdpbusd zmm (64 exact u8*s8 MACs) "
                                        "per cycle at the core's clock, i.e. two full-width 512-bit VNNI pipes "
                                        "(a core that splits zmm into two 256-bit halves gets half); kernels: "
                                        "vpdpbusd zmm")
    if "avx_vnni" in flags:
        return 2 * 32 * 2, 2 * 32 * 2, ("nominal, not measured: assumes 2 x vpdpbusd ymm (32 exact u8*s8 MACs) "
                                        "per cycle at the core's clock; kernels: the same")
    if "avx2" in flags:
        return 2 * 32 * 2, 2 * 16 * 2, ("nominal, not measured: assumes 2 x vpmaddubsw ymm (32 u8*s8 MACs, "
                                        "saturating) per cycle at the core's clock; exact "
                                        "kernels need vpmaddubsw + vpmaddwd per 32 MACs (or vpmaddwd per 16), "
                                        "i.e. half of it")
    if "asimddp" in flags:
        return 2 * 16 * 2, 2 * 16 * 2, "2 x SDOT (16 MACs) per cycle"
    return 2 * 8 * 2, 2 * 4 * 2, "2 x NEON smull/smlal (8 MACs) per cycle"


INT8_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "amx_int8",
              "asimd", "asimddp", "i8mm", "sve")


def cpu_line() -> str:
    """The CPU as this run saw it: model, clock, and which int8-relevant flags it has."""
    model, mhz, flags = cpu_info()
    have = [f for f in INT8_FLAGS if f in flags]
    lacks = [f for f in INT8_FLAGS if f not in flags and (f.startswith("a") or f in ("fma", "i8mm", "sve"))]
    return (f"CPU: {model}, {mhz:.0f} MHz reported, {len(os.sched_getaffinity(0))} usable cores; "
            f"int8 flags: {' '.join(have) or 'none'} (absent: {' '.join(lacks) or 'none'}).")


# bench/int8_ports.c needs ~2-30 CPU-s depending on the core. A wall-clock limit measured the
# machine's load instead (26 CPU-s took 225 s wall on a loaded 2-core machine, and the old 120 s
# limit threw the whole benchmark away): the program gets a CPU-time limit, and the wall limit
# is only a last resort against a program that hangs.
PORTS_CPU_LIMIT_S = 120
PORTS_WALL_LIMIT_S = 1800


def port_rates() -> tuple[dict[str, tuple[int, float]], str]:
    """(instruction -> (MACs each, ns each), what went wrong) from bench/int8_ports.c (x86-64
    with AVX2): "cycle" -> (0, ns per cycle) is the core's measured clock; the VNNI rows
    (vpdpbusd_ymm, vpdpbusd_zmm, vpdpwssd_zmm, and vfmadd231ps_zmm on AVX-512) only where the
    CPU has them. Never raises: rows measured before a failure are kept, and the second item
    says what failed ("" when nothing did)."""
    import resource
    import shutil
    import signal
    import subprocess
    import tempfile

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or platform.machine() not in ("x86_64", "AMD64"):
        return {}, "bench/int8_ports.c needs x86-64 and a C compiler"

    def cpu_limit() -> None:  # in the child, before exec
        resource.setrlimit(resource.RLIMIT_CPU, (PORTS_CPU_LIMIT_S, PORTS_CPU_LIMIT_S + 10))

    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "ports"
        src = Path(__file__).with_name("int8_ports.c")
        build = [cc, "-O2", "-mavx2", "-mfma", str(src), "-o", str(exe)]
        # a toolchain that cannot build the VNNI target functions ({vex} needs binutils >= 2.36)
        # still gets the AVX2 rows
        if (subprocess.run(build, capture_output=True).returncode
                and subprocess.run([*build, "-DPORTS_NO_VNNI"], capture_output=True).returncode):
            return {}, "bench/int8_ports.c does not build here"
        problem = ""
        try:
            proc = subprocess.run([str(exe)], capture_output=True, text=True, timeout=PORTS_WALL_LIMIT_S,
                                  preexec_fn=cpu_limit)
            out = proc.stdout
            if proc.returncode < 0:
                problem = (f"bench/int8_ports.c went over its {PORTS_CPU_LIMIT_S} CPU-s limit"
                           if -proc.returncode == signal.SIGXCPU else
                           f"bench/int8_ports.c died of signal {-proc.returncode}")
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            problem = f"bench/int8_ports.c ran past {PORTS_WALL_LIMIT_S} s of wall time"
        except OSError as exc:
            return {}, f"bench/int8_ports.c did not run: {exc}"
    rates = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3:
            rates[parts[0]] = (int(parts[1]), float(parts[2]))
    if "vfmadd231ps" not in rates:
        return {}, problem or "bench/int8_ports.c printed no rates"
    return rates, problem + ("; the rows it measured before are kept" if problem else "")


def core_clock(ports: dict[str, tuple[int, float]], reported_mhz: float) -> tuple[float, str]:
    """(MHz the peaks are computed at, how it was found): the clock bench/int8_ports.c measured
    while it ran (dependent adds, one per cycle), else /proc/cpuinfo's figure, which is the base
    clock or a momentary one (2,600 MHz reported on a core measured at 3.49 GHz)."""
    cycle_ns = ports.get("cycle", (0, 0.0))[1]
    if cycle_ns > 0:
        return 1e3 / cycle_ns, (f"measured: one dependent add per cycle in bench/int8_ports.c; /proc/cpuinfo "
                                f"reports {reported_mhz:.0f} MHz")
    return reported_mhz, "as /proc/cpuinfo reports it (not measured: bench/int8_ports.c did not run)"
