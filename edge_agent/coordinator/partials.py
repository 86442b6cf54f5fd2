"""A rule's streaming state (strategies/base.py `Partial`) on disk, for serve workers.

Each worker of a `--workers-group` folds the updates it stores into its own partial and keeps
it in the shared state directory, crash-safe, together with the members it covers:

    <state_dir>/partials/<job>/r<round>/<worker>.partial     (atomic.write_checked: sha256-framed)

so the leader's close merges the workers' partials instead of decoding every stored payload,
and folds from its payload only what no partial covers yet (an update stored after its
worker last saved, or by a worker killed with -9). A member is in at most one file (an update
is stored once, by the worker that received it): `Partial.merge` refuses an overlap, so a
restarted worker that lost its file cannot make an update count twice. A partial whose
members' updates are no longer pending (rejected, or the file is stale) is never trusted
blindly: the close checks every member against the registry first.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path

import numpy as np

from ..atomic import CorruptFileError, read_checked, write_checked
from ..errors import InputError
from .strategies.base import Member, Partial
from .strategies.echoes import SKETCH_DIM
from .streaming import Layout

MAX_PARTIAL_BYTES = 1 << 30
SUFFIX = ".partial"


def layout_digest(layout: Layout) -> str:
    text = json.dumps([[n, list(layout.shapes[n])] for n in layout.names])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def partial_to_bytes(partial: Partial) -> bytes:
    arrays = {"vec": partial.vec, "tensor_weight": partial.tensor_weight}
    if partial.signs is not None:
        arrays |= {"neg": partial.signs.neg, "pos": partial.signs.pos}
    sketched = sorted(d for d, m in partial.members.items() if m.sketch is not None)
    if sketched:
        arrays["sketches"] = np.stack([partial.members[d].sketch for d in sketched]).astype(np.float32)
    meta = {"layout": layout_digest(partial.layout), "members": {d: m.to_json() for d, m in partial.members.items()},
            "sketched": sketched}
    buf = io.BytesIO()
    np.savez(buf, meta=np.frombuffer(json.dumps(meta, sort_keys=True).encode(), dtype=np.uint8), **arrays)
    return buf.getvalue()


def partial_from_bytes(data: bytes, layout: Layout, *, where: str = "partial") -> Partial:
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            if meta.get("layout") != layout_digest(layout):
                raise InputError(f"{where}: made for another model layout")
            out = Partial(layout, signs="neg" in z.files)
            vec, weights = z["vec"], z["tensor_weight"]
            if vec.shape != out.vec.shape or weights.shape != out.tensor_weight.shape:
                raise InputError(f"{where}: arrays of the wrong shape")
            out.vec, out.tensor_weight = vec.astype(np.float64), weights.astype(np.float64)
            if out.signs is not None:
                out.signs.neg, out.signs.pos = z["neg"].astype(np.int32), z["pos"].astype(np.int32)
            out.members = {str(d): Member.from_json(m) for d, m in meta["members"].items()}
            sketched = meta.get("sketched") or []
            if sketched:
                sketches = z["sketches"]
                if (sketches.ndim != 2 or len(sketches) != len(sketched) or not set(sketched) <= set(out.members)
                        or sketches.shape[1] != min(layout.size, SKETCH_DIM)):
                    raise InputError(f"{where}: sketches that do not match its members")
                for d, row in zip(sketched, sketches, strict=True):
                    out.members[str(d)].sketch = row.astype(np.float32)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"{where}: unreadable ({str(exc)[:200]})") from None
    return out


class PartialStore:
    """The workers' partial files of one state directory."""

    def __init__(self, state_dir: str | Path) -> None:
        self.root = Path(state_dir) / "partials"

    def _dir(self, job_id: str, number: int) -> Path:
        return self.root / job_id / f"r{number}"

    def save(self, job_id: str, number: int, worker: str, partial: Partial) -> None:
        write_checked(self._dir(job_id, number) / f"{worker}{SUFFIX}", partial_to_bytes(partial))

    def load_all(self, job_id: str, number: int, layout: Layout) -> tuple[dict[str, Partial], dict[str, str]]:
        """(worker -> partial, worker -> why unreadable) for a round."""
        d = self._dir(job_id, number)
        found: dict[str, Partial] = {}
        bad: dict[str, str] = {}
        if not d.is_dir():
            return found, bad
        for path in sorted(d.glob(f"*{SUFFIX}")):
            worker = path.name[:-len(SUFFIX)]
            try:
                found[worker] = partial_from_bytes(read_checked(path, MAX_PARTIAL_BYTES), layout, where=str(path))
            except (CorruptFileError, InputError, OSError) as exc:
                bad[worker] = str(exc)[:300]
        return found, bad

    def forget(self, job_id: str, number: int) -> None:
        d = self._dir(job_id, number)
        if d.is_dir():
            for path in d.iterdir():
                path.unlink(missing_ok=True)
            try:
                os.rmdir(d)
            except OSError:
                pass
