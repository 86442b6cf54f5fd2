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
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
from types import ModuleType
from typing import Any

HIDDEN_DURING_IMPORT = ("sklearn", "scipy")
_lock = threading.Lock()


class _Hide(importlib.abc.MetaPathFinder):
    def __init__(self, names: set[str]) -> None:
        self.names = names

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        if fullname.partition(".")[0] in self.names:
            raise ImportError(f"{fullname} hidden while MXNet imports (edge_agent.train.mxnet_import)")
        return None


def mxnet() -> ModuleType:
    """The `mxnet` module, imported (once) with scikit-learn and SciPy hidden."""
    loaded = sys.modules.get("mxnet")
    if loaded is not None:
        return loaded
    with _lock:
        hidden = {n for n in HIDDEN_DURING_IMPORT if n not in sys.modules}
        finder = _Hide(hidden)
        sys.meta_path.insert(0, finder)
        try:
            import mxnet as mx
        finally:
            sys.meta_path.remove(finder)
    return mx
