"""Import MXNet for training without the optional integrations it drags in.

`import mxnet` also imports scikit-learn (for `mxnet.model`'s legacy estimator base class)
and SciPy (`mxnet.test_utils`, sparse-matrix conversion) whenever they are installed. A
training child uses neither, yet pays for them on every job: measured on this project's
venv, 191 -> 132 MB peak RSS and 2.8 -> 1.8 CPU-s for the import alone. Both imports are
optional inside MXNet (each sits in `try: ... except ImportError`), so while MXNet itself
is being imported they are reported missing; afterwards they import normally if anything
asks for them. A module already imported is left alone.

ONNX is *not* hidden: MXNet's exporter records `onnx = None` at import, which would break
a later export in the same process, and it costs only ~4 MB.

All training code imports MXNet through `mxnet()`, so the training child, the tests and
the fine-tune benchmark's fp32 baseline pay the same import.

When MXNet cannot load -- not installed (no wheel for 32-bit ARM) or its native library
cannot be opened (the arm64 wheel's Arm Performance Libraries, see edge_agent.doctor) --
`mxnet()` raises MXNetUnavailableError: one line that says why and what fixes it, exit
code 69, never a traceback. Nothing else in the agent needs MXNet: the numpy head trainer
and the native / reference int8 engines keep working.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
from types import ModuleType
from typing import Any

from ..errors import EXIT_UNAVAILABLE, EdgeAgentError

HIDDEN_DURING_IMPORT = ("sklearn", "scipy")
_lock = threading.Lock()
_failure = ""


class MXNetUnavailableError(EdgeAgentError):
    """MXNet is not installed or its native library does not load here."""

    exit_code = EXIT_UNAVAILABLE


def _explain(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, ModuleNotFoundError) and exc.name == "mxnet":
        return ("MXNet is not installed (no MXNet wheel exists for 32-bit ARM): a head deeper than one "
                "dense layer needs it; a one-dense-layer head trains with --trainer numpy")
    # A native library that does not open (OSError) is what `doctor --fix` repairs.
    hint = "run `edge-agent doctor --fix`" if isinstance(exc, OSError) else "run `edge-agent doctor`"
    return f"MXNet cannot load: {text[:300]}; {hint}"


class _Hide(importlib.abc.MetaPathFinder):
    def __init__(self, names: set[str]) -> None:
        self.names = names

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        if fullname.partition(".")[0] in self.names:
            raise ImportError(f"{fullname} hidden while MXNet imports (edge_agent.int8.mxnet_import)")
        return None


def mxnet() -> ModuleType:
    """The `mxnet` module, imported (once) with scikit-learn and SciPy hidden."""
    global _failure
    loaded = sys.modules.get("mxnet")
    if loaded is not None:
        return loaded
    with _lock:
        if _failure:  # a failed native load is not retried: it would fail the same way
            raise MXNetUnavailableError(_failure)
        hidden = {n for n in HIDDEN_DURING_IMPORT if n not in sys.modules}
        finder = _Hide(hidden)
        sys.meta_path.insert(0, finder)
        try:
            import mxnet as mx
        except (ImportError, OSError) as exc:
            _failure = _explain(exc)
            raise MXNetUnavailableError(_failure) from exc
        finally:
            sys.meta_path.remove(finder)
    return mx
