"""Model heads as the round engine's parts read them: each version's head, its flat layout
and its label set's digest, read once and kept (a few versions at a time), and stored updates
decoded against a layout. One object shared by intake, aggregation and the close, given its
registry explicitly."""

from __future__ import annotations

import json
import tarfile
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..atomic import CorruptFileError
from ..updates.errors import UpdateError
from ..updates.wire import unpack_update
from .aggregate import check_tensor_table
from .records import ModelVersion, UpdateRecord, load_arrays
from .streaming import Layout, Sparse, decode_sparse, sparse_from_dense


class HeadCache:
    def __init__(self, registry: Any, *, max_update_bytes: int) -> None:
        self.registry, self.max_update_bytes = registry, max_update_bytes
        self._heads: dict[tuple[str, str], dict[str, np.ndarray]] = {}
        self._layouts: dict[tuple[str, str], Layout] = {}
        self._label_digests: dict[str, str | None] = {}
        self._labels: dict[str, list[str] | None] = {}

    def head(self, name: str, version: str) -> tuple[ModelVersion, dict[str, np.ndarray]]:
        mv = self.registry.get_model(name, version)
        if (name, version) not in self._heads:
            if len(self._heads) > 8:
                self._heads.clear()
            self._heads[(name, version)] = self.registry.load_head(mv)
        return mv, self._heads[(name, version)]

    def layout(self, name: str, version: str) -> Layout:
        if (name, version) not in self._layouts:
            if len(self._layouts) > 16:
                self._layouts.clear()
            self._layouts[(name, version)] = Layout(self.head(name, version)[1])
        return self._layouts[(name, version)]

    def labels(self, mv: ModelVersion) -> list[str] | None:
        """The bundle's label names (None: no bundle, or unreadable). Read once per bundle."""
        if mv.bundle_path is None:
            return None
        if mv.bundle_path not in self._labels:
            from ..int8.bundle import MANIFEST, MAX_MANIFEST_BYTES

            labels = None
            try:
                with tarfile.open(self.registry.state_dir / mv.bundle_path, mode="r:*") as tar:
                    member = tar.getmember(MANIFEST)
                    handle = tar.extractfile(member) if member.size <= MAX_MANIFEST_BYTES else None
                    raw = json.loads(handle.read()).get("labels") if handle is not None else None
                if isinstance(raw, list) and all(isinstance(x, str) for x in raw):
                    labels = raw
            except (OSError, KeyError, ValueError, tarfile.TarError):
                labels = None
            self._labels[mv.bundle_path] = labels
        return self._labels[mv.bundle_path]

    def labels_digest(self, mv: ModelVersion) -> str | None:
        """edge_agent.labels.label_set_digest of a version's bundle labels (None: no bundle, or
        unreadable: then updates are not checked against it)."""
        from ..labels import label_set_digest

        labels = self.labels(mv)
        return label_set_digest(labels) if labels is not None else None

    def sparse(self, rec: UpdateRecord, layout: Layout) -> Sparse:
        """A stored update, decoded (CorruptFileError / InputError if it cannot be)."""
        data = self.registry.load_payload(rec)
        try:
            if rec.delta_path is not None and rec.delta_path.endswith(".npz"):  # a pre-streaming row
                delta = load_arrays(data, where=rec.delta_path)
                check_tensor_table(delta, layout.shapes)
                return sparse_from_dense(delta, layout)
            _, encoded = unpack_update(data, max_bytes=self.max_update_bytes)
            check_tensor_table({e.spec.name: e.spec.shape for e in encoded}, layout.shapes, subset=True)
            return decode_sparse(encoded, layout)
        except UpdateError as exc:
            raise CorruptFileError(f"{rec.delta_path}: stored update does not decode ({exc})") from None

    def forget(self) -> None:
        for cache in (self._heads, self._layouts, self._label_digests, self._labels):
            cache.clear()


def flat_head(head: Mapping[str, np.ndarray], layout: Layout) -> np.ndarray:
    return np.concatenate([np.asarray(head[n], np.float64).ravel() for n in layout.names]) if layout.names \
        else np.zeros(0)
