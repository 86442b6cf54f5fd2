"""Which board this is: model string, memory, and where the model string came from."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .sysfs import SysRoot

# In order: the device tree (ARM boards), then DMI (x86), then cpuinfo's Model line.
_MODEL_SOURCES = (
    "/proc/device-tree/model",
    "/sys/firmware/devicetree/base/model",
    "/sys/class/dmi/id/product_name",
)
_MAX_MODEL_CHARS = 200


@dataclass
class BoardInfo:
    model: str
    model_source: str  # the node it came from, or "" when unknown
    compatible: list[str]
    vendor: str
    jetson_release: str  # first line of /etc/nv_tegra_release, "" if not a Jetson
    ram_mb: int | None
    swap_mb: int | None

    def to_dict(self) -> dict:
        return asdict(self)


def _meminfo(sysroot: SysRoot) -> tuple[int | None, int | None]:
    text = sysroot.read_text("/proc/meminfo", quiet_missing=False)
    if not text:
        return None, None
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[key.strip()] = int(parts[0])  # kB
    ram = values.get("MemTotal")
    swap = values.get("SwapTotal")
    if ram is None:
        sysroot.problems.add("/proc/meminfo", "no MemTotal line")
    return (ram // 1024 if ram is not None else None, swap // 1024 if swap is not None else None)


def read_board(sysroot: SysRoot, *, cpuinfo_model: str = "") -> BoardInfo:
    model, source = "", ""
    for node in _MODEL_SOURCES:
        text = sysroot.read_text(node)
        if text:
            model, source = text[:_MAX_MODEL_CHARS], node
            break
    if not model and cpuinfo_model:
        model, source = cpuinfo_model[:_MAX_MODEL_CHARS], "/proc/cpuinfo"

    compatible: list[str] = []
    for node in ("/proc/device-tree/compatible", "/sys/firmware/devicetree/base/compatible"):
        raw = sysroot.read_bytes(node)
        if raw:
            # A NUL-separated string list; keep printable entries only.
            compatible = [c.decode("ascii", "replace") for c in raw.split(b"\x00") if c]
            compatible = [c for c in compatible if c.isprintable()][:16]
            break

    vendor = sysroot.read_text("/sys/class/dmi/id/sys_vendor") or ""
    jetson = sysroot.read_text("/etc/nv_tegra_release") or ""
    jetson = jetson.splitlines()[0].lstrip("# ").strip() if jetson else ""
    if jetson and not model:
        model, source = "NVIDIA Jetson (model unknown)", "/etc/nv_tegra_release"
    ram, swap = _meminfo(sysroot)
    return BoardInfo(
        model=model,
        model_source=source,
        compatible=compatible,
        vendor=vendor[:_MAX_MODEL_CHARS],
        jetson_release=jetson[:_MAX_MODEL_CHARS],
        ram_mb=ram,
        swap_mb=swap,
    )
