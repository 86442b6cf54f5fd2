"""Accelerator discovery: the evidence seen for each, and whether its runtime loads.

Evidence comes only from files (USB ids, device nodes, PCI vendor ids, the device tree),
so fixture trees captured from real boards exercise it. Loading the runtime library is only
attempted when probing the live root `/`; under another root the probe reports whether the
library file exists there instead.
"""

from __future__ import annotations

import ctypes
from dataclasses import asdict, dataclass, field

from .sysfs import SysRoot

# USB (vendor, product) -> kind. The Coral USB enumerates as Global Unichip 1a6e:089a until
# its firmware is loaded by libedgetpu, then as Google 18d1:9302.
USB_IDS: dict[tuple[str, str], tuple[str, str]] = {
    ("1a6e", "089a"): ("coral-usb", "Coral USB Accelerator (firmware not yet loaded)"),
    ("18d1", "9302"): ("coral-usb", "Coral USB Accelerator"),
    ("03e7", "2485"): ("intel-ncs2", "Intel Neural Compute Stick 2"),
}
PCI_VENDORS: dict[str, tuple[str, str]] = {
    "0x1e60": ("hailo", "Hailo-8/8L AI accelerator"),
    "0x1ac1": ("coral-pcie", "Coral PCIe/M.2 Accelerator"),
}
DEV_GLOBS: tuple[tuple[str, str, str], ...] = (
    ("/dev/apex_*", "coral-pcie", "Coral PCIe/M.2 Accelerator"),
    ("/dev/hailo*", "hailo", "Hailo-8/8L AI accelerator"),
    ("/dev/rknpu*", "rockchip-npu", "Rockchip NPU"),
    ("/dev/nvidia[0-9]*", "nvidia-gpu", "NVIDIA GPU"),
    ("/dev/nvhost-*", "jetson-gpu", "NVIDIA Jetson integrated GPU"),
)
RUNTIME_LIBS: dict[str, str] = {
    "coral-usb": "libedgetpu.so.1",
    "coral-pcie": "libedgetpu.so.1",
    "hailo": "libhailort.so",
    "nvidia-gpu": "libcudart.so",
    "jetson-gpu": "libcudart.so",
    "rockchip-npu": "librknnrt.so",
    "intel-ncs2": "libopenvino.so",
}
_LIB_DIRS = (
    "/usr/lib", "/usr/lib/aarch64-linux-gnu", "/usr/lib/arm-linux-gnueabihf",
    "/usr/lib/x86_64-linux-gnu", "/usr/local/lib", "/lib", "/usr/local/cuda/lib64",
    "/usr/local/cuda/targets/aarch64-linux/lib",
)


@dataclass
class Accelerator:
    kind: str
    description: str
    evidence: list[str] = field(default_factory=list)
    runtime_library: str = ""
    runtime_loads: bool = False
    runtime_detail: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def _check_runtime(sysroot: SysRoot, library: str, live: bool) -> tuple[bool, str]:
    if live:
        try:
            ctypes.CDLL(library)
            return True, f"{library} loaded"
        except OSError as exc:
            return False, f"{library} does not load: {str(exc)[:160]}"
    for directory in _LIB_DIRS:
        for name in sysroot.listdir(directory):
            if name == library or name.startswith(library + "."):
                return False, f"{directory}/{name} present (not loaded: probing a foreign root)"
    return False, f"{library} not found under the probe root"


def find_accelerators(sysroot: SysRoot, *, compatible: list[str], live: bool) -> list[Accelerator]:
    found: dict[str, Accelerator] = {}

    def add(kind: str, description: str, evidence: str) -> None:
        acc = found.setdefault(kind, Accelerator(kind=kind, description=description))
        if evidence not in acc.evidence:
            acc.evidence.append(evidence)

    for dev in sysroot.listdir("/sys/bus/usb/devices"):
        base = f"/sys/bus/usb/devices/{dev}"
        vendor = (sysroot.read_text(f"{base}/idVendor") or "").lower()
        product = (sysroot.read_text(f"{base}/idProduct") or "").lower()
        if (vendor, product) in USB_IDS:
            kind, desc = USB_IDS[(vendor, product)]
            add(kind, desc, f"USB {vendor}:{product} at {base}")

    for dev in sysroot.listdir("/sys/bus/pci/devices"):
        base = f"/sys/bus/pci/devices/{dev}"
        vendor = (sysroot.read_text(f"{base}/vendor") or "").lower()
        if vendor in PCI_VENDORS:
            kind, desc = PCI_VENDORS[vendor]
            device = sysroot.read_text(f"{base}/device") or "?"
            add(kind, desc, f"PCI {vendor}:{device} at {base}")

    for pattern, kind, desc in DEV_GLOBS:
        for path in sysroot.glob(pattern):
            add(kind, desc, f"device node {path}")

    if any(c.startswith("nvidia,tegra") for c in compatible):
        tegra = next(c for c in compatible if c.startswith("nvidia,tegra"))
        add("jetson-gpu", "NVIDIA Jetson integrated GPU", f"device-tree compatible {tegra}")

    for acc in found.values():
        acc.runtime_library = RUNTIME_LIBS.get(acc.kind, "")
        if acc.runtime_library:
            acc.runtime_loads, acc.runtime_detail = _check_runtime(sysroot, acc.runtime_library, live)
    return sorted(found.values(), key=lambda a: a.kind)
