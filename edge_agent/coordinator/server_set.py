"""Server sets: a small labelled data set the coordinator keeps with a model (`model create
--validation DIR|NPZ`, `model server-set NAME DIR|NPZ`) or a job (`train --validation`), so
that it decides with evidence of its own (evidence.py, gate.py, strategies/trust.py).

Read with the agent's own loader (data.py: image folders, CSV, NPZ; labels by name, every
problem sample skipped and counted), normalised with the bundle's input spec, and stored
content-addressed (`<state_dir>/server_sets/<sha256[:16]>.npz`, crash-safe). Each sample's
side -- the gate split (60 %) that scores versions, or the root split that trains the
server's own update -- follows from its content hash alone.

`StoredServerSets` is the engine's evidence source for real bundles: the root bundle's int8
prefix (the native engine where it is built, else the reference one) turns the server set's
images into features at the deepest training depth the job may use -- frozen for every
version the job can publish -- once per (server set, bundle, depth), and the bundle's tail
at that depth is what the server trains and scores.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InputError
from .evidence import SplitData, TailEvidence, split_by_hash
from .records import Job, ModelVersion
from .streaming import Layout

log = logging.getLogger(__name__)
MAX_SERVER_SAMPLES = 20_000
MAX_PACKED_BYTES = 1 << 30
SIDE_SUFFIX = ".server-set.npz"
MIN_SERVER_SAMPLES = 30
FEATURE_BATCH = 64


def read_server_set(path: str | Path, bundle: Any, *, label_map: Any = None) -> Any:
    """The labelled samples at `path` for `bundle`'s input and labels (data.LocalDataset);
    InputError when too few are usable or they cover a single class."""
    from ..data import load_dataset

    data = load_dataset(path, bundle.manifest.input, bundle.manifest.labels, label_map=label_map,
                        max_samples=MAX_SERVER_SAMPLES)
    if len(data) < MIN_SERVER_SAMPLES:
        raise InputError(f"{path}: {len(data)} usable sample(s); a server set needs at least {MIN_SERVER_SAMPLES} "
                         "(200+ resolve half a point of accuracy)")
    if len(set(data.y.tolist())) < 2:
        raise InputError(f"{path}: every usable sample has the same label; a server set needs several classes")
    return data


def pack_server_set(data: Any) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, x=np.ascontiguousarray(data.x, np.float32), y=np.asarray(data.y, np.int64),
             hashes=np.array(data.hashes, dtype="S64"), labels=np.array(data.labels))
    return buf.getvalue()


def unpack_server_set(raw: bytes, *, where: str) -> tuple[np.ndarray, np.ndarray, list[bytes], list[str]]:
    """(x, y, content hashes, label names) of a stored server set, validated."""
    try:
        with np.load(io.BytesIO(raw), allow_pickle=False) as z:
            x, y, hashes, labels = z["x"], z["y"], list(z["hashes"]), [str(v) for v in z["labels"]]
    except (OSError, ValueError, KeyError) as exc:
        raise InputError(f"{where}: not a server set ({str(exc)[:200]})") from None
    n = len(y)
    if x.ndim != 4 or len(x) != n or len(hashes) != n or y.ndim != 1 or not labels:
        raise InputError(f"{where}: arrays of inconsistent shapes")
    if n and (int(y.min()) < 0 or int(y.max()) >= len(labels)) or not np.isfinite(x).all():
        raise InputError(f"{where}: labels out of range or non-finite samples")
    return x, y, [bytes.fromhex(h.decode()) for h in hashes], labels


def is_packed(path: Path) -> bool:
    """A server set `model create --validation` already normalised for its bundle."""
    if path.suffix != ".npz" or not path.is_file():
        return False
    try:
        with np.load(path, allow_pickle=False) as z:
            return {"x", "y", "hashes", "labels"} <= set(z.files)
    except (OSError, ValueError):
        return False


def packed_for(bundle_dir: Path) -> Path:
    """Where `model create --validation` leaves a bundle's server set: beside the bundle, never
    inside it (devices download the bundle; the server set stays on the coordinator)."""
    return bundle_dir.with_name(bundle_dir.name + SIDE_SUFFIX)


def attach(registry: Any, version: ModelVersion, path: str | Path, *, label_map: Any = None) -> tuple[str, int, str]:
    """Read the server set at `path` for `version`'s bundle and store it: (id, samples,
    a one-line summary of what was read and skipped)."""
    path = Path(path)
    if is_packed(path):
        raw = path.read_bytes()[:MAX_PACKED_BYTES + 1]
        if len(raw) > MAX_PACKED_BYTES:
            raise InputError(f"{path}: larger than {MAX_PACKED_BYTES >> 20} MiB")
        x, y, _, labels = unpack_server_set(raw, where=str(path))
        bundle = StoredServerSets(registry)._bundle(version)
        if labels != list(bundle.manifest.labels) or tuple(x.shape[1:]) != tuple(bundle.manifest.input.shape):
            raise InputError(f"{path}: made for another model (labels or input shape differ)")
        summary = f"{len(y)} samples (prepared by model create)"
    else:
        bundle = StoredServerSets(registry)._bundle(version)
        data = read_server_set(path, bundle, label_map=label_map)
        raw = pack_server_set(data)
        skipped = data.report.skipped_total
        summary = f"{len(data)} samples" + (f", {skipped} skipped" if skipped else "")
        y = data.y
    sha = registry.store_server_set(raw)
    counts = np.bincount(np.asarray(y), minlength=len(bundle.manifest.labels))
    return sha, int(len(y)), f"{summary}; per class {', '.join(str(int(c)) for c in counts)}"


def server_train_config(params: Mapping[str, Any]) -> Any:
    """How devices train for this job (the agent's defaults, overridden by job params). Not
    their `--distill` pull: a server step trained with it left bench_poisoning's distilled
    fleets with a server set lower still (weight 3, digits 10 devices: -1.7 -> -4.3 points
    after 30 rounds; textures 3 devices: -0.7 -> -5.5), since the server update takes part in
    the aggregate and stands in for distrusted data."""
    from ..train.trainer import TrainConfig

    keys = {"epochs": int, "batch_size": int, "lr": float, "seed": int}
    given = {k: cast(params[k]) for k, cast in keys.items() if isinstance(params.get(k), int | float)
             and not isinstance(params.get(k), bool)}
    for k in ("bn", "tail"):
        if isinstance(params.get(k), str):
            given[k] = params[k]
    return TrainConfig(**given)


def server_depth(params: Mapping[str, Any], depths: int) -> int:
    """The depth the server trains and scores at: the job's depth, the head for "head", and
    for "auto" (or none) the deepest the bundle records -- what devices may train."""
    depth = params.get("depth")
    if isinstance(depth, int) and not isinstance(depth, bool):
        return max(0, min(depth, max(depths - 1, 0)))
    if depth == "head":
        return 0
    return max(depths - 1, 0)


class StoredServerSets:
    """The round engine's evidence source (aggregation.EvidenceSource) over the registry."""

    def __init__(self, registry: Any, *, engine: str | None = None) -> None:
        self.registry, self.engine = registry, engine
        self._sets: dict[str, tuple[np.ndarray, np.ndarray, list[bytes], list[str]]] = {}
        self._bundles: dict[str, Any] = {}
        self._features: dict[tuple[str, str, int], SplitData] = {}

    def set_id(self, model_name: str, params: Mapping[str, Any]) -> str | None:
        named = params.get("server_set")
        if isinstance(named, str) and named:
            return named
        found = self.registry.model_server_set(model_name)
        return found[0] if found else None

    def has_server_set(self, model_name: str, params: Mapping[str, Any]) -> bool:
        return self.set_id(model_name, params) is not None

    def _set(self, sha: str) -> tuple[np.ndarray, np.ndarray, list[bytes], list[str]]:
        if sha not in self._sets:
            if len(self._sets) > 4:
                self._sets.clear()
            self._sets[sha] = unpack_server_set(self.registry.load_server_set(sha), where=f"server set {sha[:16]}")
        return self._sets[sha]

    def _bundle(self, mv: ModelVersion) -> Any:
        from ..int8.bundle import load_bundle, unpack_bundle

        if mv.bundle_path is None:
            raise InputError(f"{mv.name} {mv.version} has no bundle: a server set needs the backbone")
        if mv.bundle_path not in self._bundles:
            archive = self.registry.state_dir / mv.bundle_path
            dest = self.registry.state_dir / "evidence" / "bundles" / Path(mv.bundle_path).name.replace(".", "_")
            self._bundles[mv.bundle_path] = load_bundle(dest) if dest.exists() else unpack_bundle(archive, dest)
        return self._bundles[mv.bundle_path]

    def _engine(self) -> Any:
        from ..int8.engines import load_engine

        for name in ((self.engine,) if self.engine else ("native", "reference")):
            engine = load_engine(name)
            if engine.availability().available:
                return engine
        raise InputError("no int8 engine is available to run the server set through the backbone")

    def split(self, sha: str, bundle: Any, depth: int) -> SplitData:
        key = (sha, bundle.sha256, depth)
        if key not in self._features:
            x, y, hashes, labels = self._set(sha)
            if labels != list(bundle.manifest.labels):
                raise InputError(f"server set {sha[:16]} was made for labels {labels[:5]}..., "
                                 f"the bundle has {list(bundle.manifest.labels)[:5]}...")
            view = bundle.at_depth(depth)
            runner = self._engine().prepare(view, threads=1)
            try:
                feats = np.concatenate([runner.run(x[i:i + FEATURE_BATCH]) for i in range(0, len(x), FEATURE_BATCH)])
            finally:
                runner.close()
            root, gate = split_by_hash(hashes)
            if len(self._features) > 8:
                self._features.clear()
            self._features[key] = SplitData(feats[root], y[root], feats[gate], y[gate], len(labels))
        return self._features[key]

    def tail(self, job: Job, version: ModelVersion, head: Mapping[str, np.ndarray]) -> TailEvidence | None:
        from ..train.trainer import head_from_bundle

        sha = self.set_id(job.model_name, job.params)
        if sha is None:
            return None
        bundle = self._bundle(version)
        depth = server_depth(job.params, len(bundle.manifest.depths))
        view = bundle.at_depth(depth) if bundle.manifest.depths else bundle
        symbol_json, _ = head_from_bundle(view)
        return TailEvidence(data=self.split(sha, bundle, depth), symbol_json=symbol_json,
                            input_name=view.manifest.split_tensor, layout=Layout(head),
                            config=server_train_config(job.params))
