"""Edge TPU engine: tflite-runtime with the libedgetpu delegate, for a Coral USB / PCIe.

Available only when the hardware probe found a Coral and libedgetpu.so.1 loads as a
delegate. The Edge TPU runs a model compiled by `edgetpu_compiler` (a custom op wrapping the
compiled graph), so a bundle must carry backbone_int8_edgetpu.tflite; without one, prepare
says so and selection falls back to the next engine.
"""

from __future__ import annotations

import ctypes
from typing import Any

from ..engine import Availability, Int8Engine, Runner
from ._common import EngineError, interpreter_module
from .tflite import TfliteRunner

LIBRARY = "libedgetpu.so.1"
PLUGIN_FUNCTIONS = ("tflite_plugin_create_delegate", "tflite_plugin_destroy_delegate")
CORAL_KINDS = ("coral-usb", "coral-pcie", "coral-m2", "coral-devboard")


def check_delegate_library(library: str) -> None:
    """Raise EngineError unless `library` opens and exports the TFLite external-delegate
    entry points. Checked before tflite-runtime's load_delegate sees it: its Delegate fails
    half-built on such a library, and its __del__ then prints an AttributeError ('_library')
    traceback on stderr -- on every Coral board whose runtime is missing."""
    try:
        lib = ctypes.CDLL(library)
    except OSError as exc:
        raise EngineError(f"{library} does not load: {str(exc).strip()[:200]}") from None
    missing = [name for name in PLUGIN_FUNCTIONS if not hasattr(lib, name)]
    if missing:
        raise EngineError(f"{library} does not load as a TFLite delegate: it has no {', '.join(missing)}")


def corals(probe: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The Coral devices in a probe report (tolerant of a malformed report)."""
    accelerators = (probe or {}).get("accelerators") or []
    if not isinstance(accelerators, list):
        return []
    return [a for a in accelerators if isinstance(a, dict) and str(a.get("kind", "")).startswith("coral")]


class EdgeTpuEngine(Int8Engine):
    name = "edgetpu"
    # tflite-runtime and libedgetpu (availability loads the delegate); activations live on the
    # accelerator (not measured here)
    runtime_mb_hint, prepare_mb_hint, run_bytes_per_activation = 15.0, 5.0, 0.02

    def __init__(self, *, library: str = LIBRARY) -> None:
        self.library = library

    def _delegate(self) -> Any:
        check_delegate_library(self.library)
        module, _ = interpreter_module()
        return module.load_delegate(self.library)

    def availability(self, probe: dict[str, Any] | None = None) -> Availability:
        if probe is None:
            return Availability(False, "no hardware probe report: cannot tell whether a Coral is attached")
        found = corals(probe)
        if not found:
            return Availability(False, "no Coral Edge TPU found by the hardware probe")
        kinds = ", ".join(sorted({str(a.get("kind")) for a in found}))
        try:
            self._delegate()
        except EngineError as exc:
            return Availability(False, f"{kinds} found, but {exc}")
        except Exception as exc:  # ValueError from load_delegate, AttributeError for a non-delegate .so
            return Availability(False, f"{kinds} found, but {self.library} does not load: {str(exc).strip()[:200]}")
        return Availability(True, f"{kinds} with {self.library}", {"devices": kinds})

    def prepare(self, model: Any, *, threads: int | None = None) -> Runner:
        from ..bundle import BACKBONE_EDGETPU

        if not model.has(BACKBONE_EDGETPU):
            raise EngineError(f"{model.path}: bundle has no Edge TPU-compiled model ({BACKBONE_EDGETPU}); "
                              "compile backbone_int8.tflite with edgetpu_compiler and pass it to "
                              "`edge-coordinator model create --edgetpu-model`")
        try:
            delegate = self._delegate()
        except EngineError:
            raise
        except Exception as exc:  # as in availability()
            raise EngineError(f"{self.library} does not load: {str(exc).strip()[:200]}") from None
        # The compiled model holds an edgetpu-custom-op the project's reader does not parse: it
        # is trusted through the bundle's sha256 (and its TFL3 identifier, checked at creation).
        return TfliteRunner(model.read(BACKBONE_EDGETPU), threads=threads, delegates=[delegate],
                            where=str(model.path / BACKBONE_EDGETPU), check=False)
