"""The demo's simulated devices: a Raspberry Pi 4's sysfs tree with a small battery that
drains while the device trains, the held-out test set, and the global model's accuracy.

Each simulated device is a real `edge-agent run` process; only its hardware is simulated,
through files under its own sysfs root (the agent reads /proc and /sys there):

    proc/device-tree/model, compatible, proc/cpuinfo, proc/meminfo   -> board profile raspberry-pi-4
    sys/class/thermal/thermal_zone0                                   -> 48 °C
    sys/class/power_supply/battery/{capacity,energy_now,energy_full,power_now,status,...}

`BatterySimulator` watches for the device's training child process (`python -m
edge_agent.agent.child train ...` under the device's state directory) and, while it runs,
reports the load power on power_now and takes that energy out of the battery; idle, the
(simulated) solar panel carries the idle load. The agent's governor measures the job's
energy from power_now, the coordinator selects devices by capacity and energy_now.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic import atomic_write_text

IDLE_W, LOAD_W = 2.7, 5.2  # Raspberry Pi 4 B: idle, and one core busy training (under the 5.5 W cap)
BATTERY_WH = 0.5  # a deliberately tiny battery, so a few short rounds show on the gauge
_CPU = "".join(f"processor\t: {i}\nBogoMIPS\t: 108.00\nFeatures\t: fp asimd evtstrm crc32 cpuid\n"
               "CPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x0\nCPU part\t: 0xd08\n"
               "CPU revision\t: 3\n\n" for i in range(4)) + "Hardware\t: BCM2835\nModel\t\t: Raspberry Pi 4 Model B Rev 1.4\n"
_MEM = "MemTotal:        3881844 kB\nMemFree:         1940922 kB\nMemAvailable:    3105475 kB\n"


def write_sysfs(root: Path, *, battery_pct: float) -> Path:
    """A Raspberry Pi 4 B's probe-relevant files plus a discharging battery at `battery_pct`."""
    files = {
        "proc/device-tree/model": "Raspberry Pi 4 Model B Rev 1.4\0",
        "proc/device-tree/compatible": "raspberrypi,4-model-b\0brcm,bcm2711\0",
        "proc/cpuinfo": _CPU, "proc/meminfo": _MEM,
        "sys/devices/system/cpu/present": "0-3\n",
        "sys/class/thermal/thermal_zone0/type": "cpu-thermal\n",
        "sys/class/thermal/thermal_zone0/temp": "48000\n",
        "sys/class/power_supply/battery/type": "Battery\n",
        "sys/class/power_supply/battery/present": "1\n",
        "sys/class/power_supply/battery/energy_full": f"{int(BATTERY_WH * 1e6)}\n",
        "sys/class/power_supply/battery/voltage_now": "3700000\n",
    }
    for rel, text in files.items():
        atomic_write_text(root / rel, text)
    set_battery(root, energy_wh=BATTERY_WH * battery_pct / 100.0, watts=IDLE_W)
    return root


def set_battery(root: Path, *, energy_wh: float, watts: float, status: str = "Discharging") -> None:
    bat = root / "sys/class/power_supply/battery"
    pct = max(0.0, min(100.0, 100.0 * energy_wh / BATTERY_WH))
    for name, value in (("status", status), ("capacity", f"{pct:.0f}"), ("energy_now", f"{int(energy_wh * 1e6)}"),
                        ("power_now", f"{int(watts * 1e6)}")):
        atomic_write_text(bat / name, value + "\n")


def training_children(markers: list[str]) -> set[str]:
    """Which markers (device state directories) have a live `agent.child train` process."""
    found: set[str] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if b"edge_agent.agent.child" not in cmd or b"\0train\0" not in cmd:
            continue
        text = cmd.decode(errors="replace")
        found.update(m for m in markers if m in text)
    return found


class BatterySimulator:
    """Drains each device's battery file while its training child runs (a background thread)."""

    def __init__(self, devices: dict[str, tuple[Path, Path, float]], *, interval: float = 0.25) -> None:
        # name -> (sysfs root, state dir, starting charge %)
        self.devices = {n: (root, str(state)) for n, (root, state, _) in devices.items()}
        self.energy = {n: BATTERY_WH * pct / 100.0 for n, (_, _, pct) in devices.items()}
        self.spent = dict.fromkeys(devices, 0.0)
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="battery-sim", daemon=True)

    def start(self) -> BatterySimulator:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def pct(self, name: str) -> float:
        return 100.0 * self.energy[name] / BATTERY_WH

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            dt, last = now - last, now
            busy = training_children([s for _, s in self.devices.values()])
            for name, (root, state) in self.devices.items():
                training = state in busy
                if training:
                    joules = LOAD_W * dt
                    self.energy[name] = max(0.0, self.energy[name] - joules / 3600.0)
                    self.spent[name] += joules / 3600.0
                try:
                    set_battery(root, energy_wh=self.energy[name], watts=LOAD_W if training else IDLE_W)
                except OSError:
                    pass  # the demo is tearing down


# ---------------------------------------------------------------- the global test set and accuracy
def held_out(n_devices: int, *, base_devices: int = 3, alpha: float = 1.0, seed: int = 0) -> tuple[Any, Any]:
    """Digits no device and no base training ever saw, each through one fine-tuning device's
    camera (round-robin): how the fleet's model does on the fleet's inputs."""
    from ..sim import scenario as demo
    from ..sim.digits import apply_camera, load_digits_images, make_fleet

    sc = demo.scenario(n_devices=n_devices, base_devices=base_devices, alpha=alpha, seed=seed)
    fleet = make_fleet(n_devices=base_devices + n_devices, alpha=alpha, seed=seed, min_per_device=40)
    used = np.concatenate([d.indices for d in fleet.devices])
    if not all(np.array_equal(a.indices, b.indices) for a, b in zip(sc.devices, fleet.devices[base_devices:],
                                                                   strict=True)):
        raise RuntimeError("the demo scenario's split changed: held-out digits cannot be identified")
    images, labels = load_digits_images()
    test = np.setdiff1d(np.arange(len(labels)), used)
    x = np.empty((len(test), *images.shape[1:]), np.float32)
    for i, dev in enumerate(sc.devices):
        sel = np.arange(len(test)) % n_devices == i
        x[sel] = apply_camera(images[test[sel]], dev.camera)
    return x, labels[test]


def server_and_test(x: np.ndarray, y: np.ndarray, n_devices: int) -> tuple[tuple[Any, Any], tuple[Any, Any]]:
    """The held-out digits split in two: the coordinator's labelled server set (what an
    operator would keep: samples from the field, labelled) and the test set the demo reports
    global accuracy on, which nothing trains or gates on. `held_out` put sample i through
    device i % n_devices's camera: each half takes every other such group of n_devices, so
    both see every camera."""
    server = (np.arange(len(y)) // n_devices) % 2 == 0
    return (x[server], y[server]), (x[~server], y[~server])


class GlobalEvaluator:
    """Accuracy of head versions on fixed test features from the bundle's int8 backbone."""

    def __init__(self, bundle_dir: Path, x: np.ndarray, y: np.ndarray, *, cache_dir: Path) -> None:
        from ..int8.bundle import load_bundle
        from ..int8.selection import select_engine
        from ..sim.scenario import to_pixels

        root = load_bundle(bundle_dir)
        # the deepest depth's prefix is frozen for every device at every depth: its features stay
        # valid while versions change the tensors after it, which its fp32 tail then applies
        self.bundle = root.at_depth(max(0, len(root.manifest.depths) - 1))
        self.depth = self.bundle.depth
        raw = to_pixels(x).astype(np.float32)  # what the devices store; the bundle normalises it
        normalised = self.bundle.manifest.input.normalise(raw)
        selection, runner = select_engine(self.bundle, keep_runner=True, state_dir=cache_dir, threads=1)
        try:
            self.features = np.concatenate([runner.run(normalised[i:i + 256]) for i in range(0, len(raw), 256)])
        finally:
            runner.close()
        self.engine = selection.chosen or "?"
        self.y = np.asarray(y)
        self.block = self.bundle.head_block()

    def accuracy(self, head: dict[str, np.ndarray]) -> float:
        import mxnet as mx

        params = self.block.collect_params()
        for name, value in head.items():
            if name in params:
                params[name].set_data(mx.nd.array(value, dtype=value.dtype))
        logits = self.block(mx.nd.array(self.features)).asnumpy()
        return float((logits.argmax(axis=1) == self.y).mean())
