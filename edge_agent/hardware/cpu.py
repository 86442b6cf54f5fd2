"""CPU identification and int8-relevant features from /proc/cpuinfo, checked against the
native kernels' own cpuid / auxv test.

ARM kernels list `Features` and `CPU part` per core; x86 kernels list `flags` and
`model name`. Both formats are parsed leniently: a truncated or garbage cpuinfo yields what
could be read plus a problem note, never an exception.

/proc/cpuinfo is not always this process's CPU: under qemu-user it is the host's (x86 flags
for an aarch64 process). The kernels library asks the CPU itself (getauxval(AT_HWCAP) on ARM,
cpuid + xgetbv on x86), so on a live probe its answer wins where the two disagree, and the
report keeps both (`kernel_check`).
"""

from __future__ import annotations

import ctypes
import importlib.machinery
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .sysfs import MAX_PROC_BYTES, SysRoot

# (implementer, part) -> core name, for the parts seen on Pi-class boards and Jetsons.
ARM_PARTS: dict[tuple[int, int], str] = {
    (0x41, 0xC07): "Cortex-A7",
    (0x41, 0xC08): "Cortex-A8",
    (0x41, 0xC09): "Cortex-A9",
    (0x41, 0xC0F): "Cortex-A15",
    (0x41, 0xD03): "Cortex-A53",
    (0x41, 0xD04): "Cortex-A35",
    (0x41, 0xD05): "Cortex-A55",
    (0x41, 0xD07): "Cortex-A57",
    (0x41, 0xD08): "Cortex-A72",
    (0x41, 0xD09): "Cortex-A73",
    (0x41, 0xD0A): "Cortex-A75",
    (0x41, 0xD0B): "Cortex-A76",
    (0x41, 0xD0C): "Neoverse-N1",
    (0x41, 0xD0D): "Cortex-A77",
    (0x41, 0xD41): "Cortex-A78",
    (0x41, 0xD42): "Cortex-A78AE",
    (0x41, 0xD44): "Cortex-X1",
    (0x41, 0xD46): "Cortex-A510",
    (0x41, 0xD47): "Cortex-A710",
    (0x41, 0xD4B): "Cortex-A78C",
    (0x4E, 0x004): "NVIDIA Carmel",
}

# The features that decide which int8 kernels can run (DESIGN.md, issue 2).
INT8_FEATURES: dict[str, tuple[str, ...]] = {
    "aarch64": ("asimd", "asimddp", "i8mm", "bf16", "sve"),
    "armv7l": ("neon", "vfpv4"),
    "x86_64": ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8"),
}


@dataclass
class CpuInfo:
    arch: str
    count: int
    model: str = ""  # x86 "model name" or ARM core name(s)
    parts: list[str] = field(default_factory=list)  # e.g. ["Cortex-A72 (0xd08)"]
    flags: list[str] = field(default_factory=list)  # every flag the kernel reported
    int8_features: dict[str, bool] = field(default_factory=dict)
    soc: dict[str, str] = field(default_factory=dict)  # ARM trailer: Hardware, Revision, Model
    # The kernels library's own check (live probe only): see KernelCheck.
    kernel_check: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def kernels_library_path() -> Path | None:
    """The native kernels library inside the package (edge_agent/_kernels*.so), if built."""
    package = Path(__file__).resolve().parent.parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = package / f"_kernels{suffix}"
        if candidate.is_file():
            return candidate
    return None


@dataclass
class KernelCheck:
    """What the kernels library's cpuid / auxv test says this process's CPU runs."""

    variants: dict[str, bool]  # variant name -> runnable
    confirmed: list[str]  # features some runnable variant needs: the CPU has them
    denied: list[str]  # features whose variant is not runnable although its other features are

    @classmethod
    def of(cls, found: list[tuple[str, set[str], bool]]) -> KernelCheck:
        """From (variant name, features it needs, runnable) as the library reports them."""
        confirmed = set().union(*(feats for _, feats, ok in found if ok))
        # A variant that does not run denies its one feature not confirmed elsewhere
        # (avx_vnni when avx2 runs); with two or more unconfirmed, which one is missing is unknown.
        denied: set[str] = set()
        for _, feats, ok in found:
            if not ok and len(feats - confirmed) == 1:
                denied |= feats - confirmed
        return cls({name: ok for name, _, ok in found}, sorted(confirmed), sorted(denied))


def kernel_check() -> KernelCheck | None:
    """Ask the kernels library (ctypes only: the probe must not import numpy); None when it
    is not built or cannot load here."""
    path = kernels_library_path()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
        lib.ea_variant_count.restype = ctypes.c_int
        lib.ea_variant_at.restype, lib.ea_variant_at.argtypes = ctypes.c_void_p, [ctypes.c_int]
        for name in ("ea_variant_name", "ea_variant_features"):
            getattr(lib, name).restype, getattr(lib, name).argtypes = ctypes.c_char_p, [ctypes.c_void_p]
        lib.ea_variant_runnable.restype, lib.ea_variant_runnable.argtypes = ctypes.c_int, [ctypes.c_void_p]
        found: list[tuple[str, set[str], bool]] = []
        for i in range(lib.ea_variant_count()):
            handle = lib.ea_variant_at(i)
            found.append((lib.ea_variant_name(handle).decode(), set(lib.ea_variant_features(handle).decode().split()),
                          bool(lib.ea_variant_runnable(handle))))
    except (OSError, AttributeError, UnicodeDecodeError):
        return None
    return KernelCheck.of(found)


def _parse_blocks(text: str) -> tuple[list[dict[str, str]], dict[str, str]]:
    """Split cpuinfo into per-processor blocks and trailing global lines (ARM Hardware/Model)."""
    blocks: list[dict[str, str]] = []
    extra: dict[str, str] = {}
    current: dict[str, str] | None = None
    for raw in text.splitlines():
        if ":" not in raw:
            if current is not None and not raw.strip():
                blocks.append(current)
                current = None
            continue
        key, _, value = raw.partition(":")
        key, value = key.strip(), value.strip()
        if key == "processor":
            if current is not None:
                blocks.append(current)
            current = {"processor": value}
        elif current is not None:
            current.setdefault(key, value)
        else:
            extra.setdefault(key, value)
    if current is not None:
        blocks.append(current)
    return blocks, extra


def _arch_from(blocks: list[dict[str, str]], fallback: str) -> str:
    for block in blocks:
        if "flags" in block or "vendor_id" in block:
            return "x86_64"
        arch = block.get("CPU architecture", "")
        if arch.startswith("8"):
            # A 32-bit userland on an ARMv8 core still shows "8"; its Features say which.
            feats = block.get("Features", "").split()
            return "aarch64" if "asimd" in feats or "fp" in feats else "armv7l"
        if arch.startswith("7"):
            return "armv7l"
    return fallback


def _int_or_none(text: str | None) -> int | None:
    if not text:
        return None
    try:
        return int(text, 0)
    except ValueError:
        return None


def _family(arch: str) -> str:
    return "x86" if arch in ("x86_64", "i386", "i686") else "arm" if arch.startswith(("arm", "aarch")) else arch


def read_cpu(sysroot: SysRoot, *, machine: str | None = None,
             check: KernelCheck | None = None) -> CpuInfo:
    """Identify the CPU under `sysroot`. `machine` is the fallback arch (uname -m on `/`);
    `check` is the kernels library's own answer, asked for by default when `machine` is given
    (a live probe); it wins over cpuinfo where the two disagree."""
    if check is None and machine is not None:
        check = kernel_check()
    text = sysroot.read_text("/proc/cpuinfo", limit=MAX_PROC_BYTES, quiet_missing=False) or ""
    blocks, extra = _parse_blocks(text)
    arch = _arch_from(blocks, machine or "unknown")
    if machine and blocks and _family(arch) != _family(machine):
        # qemu-user: the kernel's cpuinfo describes the host, not this process's CPU.
        sysroot.problems.add("/proc/cpuinfo", f"describes an {arch} CPU but this process runs on {machine} "
                                              "(emulated?): using the kernels' cpuid/auxv check")
        arch = machine
    if text and not blocks:
        sysroot.problems.add("/proc/cpuinfo", "no processor entries could be parsed")

    flags: list[str] = []
    for block in blocks:
        found = block.get("flags") or block.get("Features")
        if found:
            flags = found.split()
            break

    parts: list[str] = []
    for block in blocks:
        impl = _int_or_none(block.get("CPU implementer"))
        part = _int_or_none(block.get("CPU part"))
        if impl is None or part is None:
            continue
        label = f"{ARM_PARTS.get((impl, part), f'unknown core (implementer {impl:#x})')} ({part:#05x})"
        if label not in parts:
            parts.append(label)

    model = ""
    for block in blocks:
        if block.get("model name"):
            model = block["model name"]
            break
    if parts and (not model or model.startswith("ARMv")):
        model = " + ".join(p.split(" (")[0] for p in parts)

    count = len(blocks)
    present = sysroot.read_text("/sys/devices/system/cpu/present")
    if present:  # "0-3": trust the kernel's count over a truncated cpuinfo
        try:
            count = max(count, sum(
                int(r.split("-")[1]) - int(r.split("-")[0]) + 1 if "-" in r else 1
                for r in present.split(",")
            ))
        except (ValueError, IndexError):
            sysroot.problems.add("/sys/devices/system/cpu/present", f"unparseable {present[:20]!r}")

    wanted = INT8_FEATURES.get(arch, ())
    int8_features = {name: name in flags for name in wanted}
    kernel: dict = {}
    if check is not None:
        disagree = {}
        for name in wanted:
            says = True if name in check.confirmed else False if name in check.denied else None
            if says is not None and says != int8_features[name]:
                disagree[name] = {"cpuinfo": int8_features[name], "kernels": says}
                int8_features[name] = says  # the C-level check is the truth on any machine
        kernel = {"variants": check.variants, "confirmed": check.confirmed, "denied": check.denied,
                  "disagree": disagree}
    return CpuInfo(
        arch=arch,
        count=count,
        model=model,
        parts=parts,
        flags=flags,
        int8_features=int8_features,
        # The serial number is left out on purpose: it identifies the device in reports.
        soc={k: v for k, v in extra.items() if k in ("Hardware", "Revision", "Model")},
        kernel_check=kernel,
    )
