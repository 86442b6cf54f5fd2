"""Which model the device serves, and the switch between models without failing a request.

    <state>/models/<name>/current            the fleet version (agent/models.py flips it)
    <state>/personal/<name>/<version>/<id>/  a personal tail trained here on top of that
                                             version: head.params + meta.json (written last)

`ModelSlot` holds the served model and the one before it. A request takes the served model
once (`slot.use()`) and is answered entirely by it -- the response names its version -- so
a swap, one reference assignment, never fails or mixes a request. A model replaced while
requests still use it is closed when the last of them is done.

`ModelManager.refresh()` is the local guard. Candidates are the installed fleet version and
the newest personal tail on top of it; each is scored on the device's own held-out samples
(the validation split of the data set, samples.SampleStore):

- a personal model is served only where it is strictly better than the fleet version;
- a new model (a new fleet version, a new personal tail) replaces the served one unless it
  is worse beyond `tolerance` on the held-out samples -- then the served one stays (rolled
  back: the event says so) and the new one is remembered as refused until the held-out set
  changes;
- with no held-out sample yet there is nothing to judge by: the newest fleet version wins.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic import read_limited
from .predictor import Predictor

log = logging.getLogger(__name__)
FLEET, PERSONAL = "fleet", "personal"
META_FILE, HEAD_FILE = "meta.json", "head.params"
PREFIX_FILE = "prefix.tflite"  # a personal tail's int8 prefix adapted to the device's camera (int8/adapt_norm.py)
MAX_PREFIX_BYTES = 64 << 20
MAX_EVENTS = 50


@dataclass
class ServedModel:
    """One loaded model: its identity and its predictor."""

    version: str  # what responses name: "<name>/<version>" or "<name>/<version>+<personal id>"
    kind: str  # FLEET | PERSONAL
    name: str
    base_version: str
    predictor: Predictor
    depth: int = 0
    source: str = ""  # the bundle or personal directory it came from
    accuracy: float | None = None  # on the held-out samples, when last judged
    judged_on: int = 0
    loaded_at: float = field(default_factory=time.time)
    _users: int = 0
    _retired: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def describe(self) -> dict[str, Any]:
        return {"version": self.version, "kind": self.kind, "name": self.name, "base_version": self.base_version,
                "depth": self.depth, "engine": self.predictor.engine, "tail": self.predictor.tail_kind,
                "held_out_accuracy": None if self.accuracy is None else round(self.accuracy, 4),
                "held_out_samples": self.judged_on}

    def _enter(self) -> None:
        with self._lock:
            self._users += 1

    def _leave(self) -> None:
        with self._lock:
            self._users -= 1
            close = self._retired and self._users == 0
        if close:
            self.predictor.close()

    def retire(self) -> None:
        """Close it as soon as no request uses it."""
        with self._lock:
            self._retired = True
            close = self._users == 0
        if close:
            self.predictor.close()


class ModelSlot:
    """The served model and the previous one; swaps are one assignment."""

    def __init__(self) -> None:
        self.current: ServedModel | None = None
        self.previous: ServedModel | None = None
        self._swap = threading.Lock()

    @contextlib.contextmanager
    def use(self) -> Iterator[ServedModel]:
        while True:
            model = self.current
            if model is None:
                raise LookupError("no model is loaded yet")
            model._enter()
            if not model._retired:  # (a retired one was swapped out between the read and _enter)
                break
            model._leave()
        try:
            yield model
        finally:
            model._leave()

    def swap(self, new: ServedModel) -> ServedModel | None:
        """Serve `new`; the one it replaces becomes previous. Returns the model no longer
        held (the previous before), for the caller to retire unless it still wants it."""
        with self._swap:
            old, older = self.current, self.previous
            if old is new:
                return None
            self.current = new
            if old is not None:
                self.previous = old
            return older if older is not None and older is not new and older is not old else None


@dataclass(frozen=True)
class Personal:
    path: Path
    ident: str
    depth: int
    meta: dict[str, Any]


def newest_personal(root: Path, name: str, version: str) -> Personal | None:
    """The newest complete personal tail on top of `name`/`version` (meta.json present)."""
    base = root / name / version
    best: Personal | None = None
    for entry in sorted(base.iterdir()) if base.is_dir() else []:
        if entry.name.startswith(".") or not (entry / META_FILE).is_file() or not (entry / HEAD_FILE).is_file():
            continue
        try:
            meta = json.loads(read_limited(entry / META_FILE, 64 << 10))
            depth = int(meta.get("depth", 0))
        except (OSError, ValueError, TypeError) as exc:
            log.warning("personal model %s unreadable: %s", entry, exc)
            continue
        candidate = Personal(entry, entry.name, depth, meta)
        if best is None or (float(meta.get("created", 0)), entry.name) > (float(best.meta.get("created", 0)), best.ident):
            best = candidate
    return best


# (bundle, depth, params, adapted prefix or None) -> Predictor
Loader = Callable[[Any, int, dict[str, np.ndarray] | None, Path | None], Predictor]
HeldOut = Callable[[], tuple[np.ndarray, np.ndarray]]


class ModelManager:
    """Loads candidates, judges them on held-out samples, swaps the slot (module doc)."""

    def __init__(self, *, models_root: Path, personal_root: Path, name: str | None, loader: Loader,
                 held_out: HeldOut, held_out_version: Callable[[], int] = lambda: 0, tolerance: float = 0.02,
                 personal: bool = True) -> None:
        self.models_root, self.personal_root = Path(models_root), Path(personal_root)
        self.name, self.loader, self.held_out, self.held_out_version = name, loader, held_out, held_out_version
        self.tolerance, self.personal = float(tolerance), personal
        self.slot = ModelSlot()
        self.fleet: ServedModel | None = None  # the fleet candidate most recently loaded
        self.personal_model: ServedModel | None = None
        self.events: list[dict[str, Any]] = []
        self._seen: tuple[Any, ...] = ()
        self._lock = threading.Lock()
        self.last_error = ""

    # ---- what is installed ----
    def model_name(self) -> str | None:
        if self.name:
            return self.name
        names = sorted(p.name for p in self.models_root.iterdir()
                       if not p.name.startswith(".") and (p / "current").is_symlink()) if self.models_root.is_dir() else []
        return names[0] if len(names) == 1 else None

    def installed(self) -> tuple[str, str, Path] | None:
        name = self.model_name()
        if name is None:
            return None
        link = self.models_root / name / "current"
        try:
            version = os.readlink(link)
        except OSError:
            return None
        path = self.models_root / name / version
        return (name, version, path) if (path / "manifest.json").is_file() else None

    # ---- judging ----
    def _score(self, model: ServedModel, x: np.ndarray, y: np.ndarray) -> None:
        model.accuracy = model.predictor.accuracy(x, y) if len(y) else None
        model.judged_on = len(y)

    def _event(self, what: str, **info: Any) -> None:
        entry = {"at": round(time.time(), 3), "event": what, **info}
        log.info("serve: %s %s", what, info)
        self.events = [*self.events[-(MAX_EVENTS - 1):], entry]

    def refresh(self) -> bool:
        """Look for new candidates and re-judge when anything changed; True if it swapped."""
        with self._lock:
            try:
                return self._refresh()
            except Exception as exc:  # a broken candidate must never take the served model down
                self.last_error = f"{type(exc).__name__}: {exc}"[:500]
                log.exception("serve: refreshing the served model failed")
                return False

    def _refresh(self) -> bool:
        from ..int8.bundle import load_bundle

        found = self.installed()
        if found is None:
            return False
        name, version, path = found
        personal = newest_personal(self.personal_root, name, version) if self.personal else None
        key = (name, version, personal.ident if personal else None, self.held_out_version())
        if key == self._seen:
            return False
        self._seen = key
        fleet_changed = self.fleet is None or (self.fleet.name, self.fleet.base_version) != (name, version)
        if fleet_changed:
            bundle = load_bundle(path)
            old = (self.fleet, self.personal_model)
            self.fleet = ServedModel(f"{name}/{version}", FLEET, name, version, self.loader(bundle, 0, None, None),
                                     source=str(path))
            self.personal_model = None
            for model in old:
                self._drop(model)
        if personal and (self.personal_model is None or self.personal_model.source != str(personal.path)):
            from .predictor import tail_params

            bundle = load_bundle(path)
            params = tail_params(bundle.at_depth(personal.depth), personal.path / HEAD_FILE)
            prefix = personal.path / PREFIX_FILE if personal.meta.get("adapted_prefix") else None
            old_personal = self.personal_model
            self.personal_model = ServedModel(f"{name}/{version}+{personal.ident}", PERSONAL, name, version,
                                              self.loader(bundle, personal.depth, params, prefix), depth=personal.depth,
                                              source=str(personal.path))
            self._drop(old_personal)
        x, y = self.held_out()
        assert self.fleet is not None
        current, previous = self.slot.current, self.slot.previous
        for model in {id(m): m for m in (self.fleet, self.personal_model, current, previous) if m}.values():
            self._score(model, x, y)
        best = self.fleet
        if self.personal_model is not None and _better(self.personal_model, self.fleet):
            best = self.personal_model
        chosen = best
        if current is not None and best is not current and self._worse(best, current):
            chosen = current  # the new one is worse on this device's own samples: keep serving this
            self._event("kept", version=current.version, refused=best.version, accuracy=current.accuracy,
                        refused_accuracy=best.accuracy, held_out=len(y), tolerance=self.tolerance)
        if previous is not None and previous is not chosen and self._worse(chosen, previous):
            self._event("rolled-back", version=previous.version, from_version=chosen.version,
                        accuracy=previous.accuracy, from_accuracy=chosen.accuracy, held_out=len(y))
            chosen = previous
        if chosen is current:
            return False
        self._drop(self.slot.swap(chosen))
        self._event("serving" if current is None else "swapped", version=chosen.version,
                    previous=current.version if current else None, accuracy=chosen.accuracy,
                    previous_accuracy=current.accuracy if current else None, held_out=len(y))
        return True

    def _drop(self, model: ServedModel | None) -> None:
        """Close `model` once unused, unless it is served, kept as previous or a candidate."""
        if model is not None and all(model is not m for m in (self.slot.current, self.slot.previous,
                                                                self.fleet, self.personal_model)):
            model.retire()

    def _worse(self, a: ServedModel, b: ServedModel) -> bool:
        """a is worse than b beyond the tolerance, both judged on the same held-out samples."""
        return a.accuracy is not None and b.accuracy is not None and a.accuracy < b.accuracy - self.tolerance

    def describe(self) -> dict[str, Any]:
        current = self.slot.current
        return {"served": current.describe() if current else None,
                "previous": self.slot.previous.describe() if self.slot.previous else None,
                "fleet": self.fleet.describe() if self.fleet else None,
                "personal": self.personal_model.describe() if self.personal_model else None,
                "tolerance": self.tolerance, "events": list(self.events[-10:]), "error": self.last_error or None}


def _better(a: ServedModel, b: ServedModel) -> bool:
    return a.accuracy is not None and b.accuracy is not None and a.accuracy > b.accuracy
