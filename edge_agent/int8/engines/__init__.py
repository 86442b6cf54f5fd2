"""The int8 engines, found by a fixed preference list and imported lazily.

`ENGINES` lists (name, "module:Class") in default preference order; `load_engine` imports
one and turns any import failure into an engine that reports itself unavailable with the
reason, so one broken engine (a missing wheel, a bad native library) never hides the others.
Board profiles reorder or restrict the list (`int8.backends = [...]`); `register_engine`
adds one (the native kernels engine, a vendor NPU) without touching this file's callers.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from ..engine import Availability, Int8Engine, Runner


@dataclass(frozen=True)
class EngineSpec:
    name: str
    target: str  # "package.module:ClassName"


ENGINES: list[EngineSpec] = [
    EngineSpec("edgetpu", "edge_agent.int8.engines.edgetpu:EdgeTpuEngine"),
    EngineSpec("tflite", "edge_agent.int8.engines.tflite:TfliteEngine"),
    EngineSpec("native", "edge_agent.int8.engines.native:NativeEngine"),
    EngineSpec("mxnet-onednn", "edge_agent.int8.engines.mxnet_onednn:MxnetOnednnEngine"),
    EngineSpec("reference", "edge_agent.int8.engines.reference:ReferenceEngine"),
]


def engine_names() -> list[str]:
    return [spec.name for spec in ENGINES]


def register_engine(name: str, target: str, *, before: str | None = None) -> None:
    """Add (or move) an engine; `before` places it ahead of another in the default order."""
    ENGINES[:] = [s for s in ENGINES if s.name != name]
    index = next((i for i, s in enumerate(ENGINES) if s.name == before), len(ENGINES))
    ENGINES.insert(index, EngineSpec(name, target))


class BrokenEngine(Int8Engine):
    """Stands in for an engine whose module did not import."""

    def __init__(self, name: str, reason: str) -> None:
        self.name, self.reason = name, reason

    def availability(self, probe: dict[str, Any] | None = None) -> Availability:
        return Availability(False, self.reason)

    def prepare(self, model: Any, *, threads: int | None = None) -> Runner:
        raise RuntimeError(f"engine {self.name!r} is unavailable: {self.reason}")


def load_engine(name: str) -> Int8Engine:
    """Instantiate the engine called `name`; KeyError for a name not in ENGINES."""
    spec = next((s for s in ENGINES if s.name == name), None)
    if spec is None:
        raise KeyError(f"unknown int8 engine {name!r}; known: {', '.join(engine_names())}")
    module_name, _, class_name = spec.target.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
        engine = cls()
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            return BrokenEngine(name, f"not built into this edge-agent ({module_name} is missing)")
        return BrokenEngine(name, f"import failed: {exc}")
    except Exception as exc:  # an engine that fails to import must not break the others
        return BrokenEngine(name, f"import failed: {type(exc).__name__}: {str(exc)[:200]}")
    engine.name = name
    return engine


def candidates(preference: list[str] | None = None) -> list[str]:
    """Engine names to try: the profile's preference list (unknown names kept, so selection
    can report them) or every registered engine in default order."""
    if preference is None:
        return engine_names()
    seen: list[str] = []
    for name in preference:
        if name not in seen:
            seen.append(name)
    return seen
