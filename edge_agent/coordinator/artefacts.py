"""Model artefacts on the coordinator: registered base bundles and the bundles it publishes.

    <state_dir>/bundles/<name>/<version>.tar.gz     what devices download (sha256-pinned)

Registering a base bundle (`register_bundle`) stores its archive and its head parameters
(numpy, bare names, as the devices' delta tables name them) in the registry. A version
produced by a round has only a new head: `archive_for` builds its bundle from the root
bundle (the backbone files unchanged, byte for byte) plus the new `head.params`, with the
manifest naming the parent version and `extra.head_only = true`. The build is
deterministic (manifest timestamp = the version's registration time, reproducible tar.gz),
so a lost or corrupt archive is rebuilt with the same sha256 the devices were told.
`patch_for` packs such a version's head patch (int8.bundle_patch: the new manifest and
head.params only), published as `<version>.head` for devices that already run the backbone.

Full archives of head-only versions are built on demand only: a version's patch is built
from the root bundle and its head directly, and the full archive's sha256 (what a finetune
command pins) is recorded in `<version>.sha256` without keeping the archive
(`full_sha256`). `archive_for` builds it when a device needs the whole bundle; once
published, `drop_full` deletes it again (a rebuild gives the same bytes). Each version
then costs its head file, a ~2.4 KB patch and 65 bytes of sha256 on disk, not ~83 KB.

No MXNet here: head.params is read and written by mxparams (numpy only).
"""

from __future__ import annotations

import copy
import datetime as dt
import hashlib
import logging
import tarfile
import tempfile
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic import atomic_write_bytes, atomic_write_text, read_limited, sha256_file
from ..errors import ConfigError, InputError
from ..int8.bundle import (
    HEAD_PARAMS,
    MANIFEST,
    MAX_ARCHIVE_BYTES,
    MAX_MANIFEST_BYTES,
    Bundle,
    FileEntry,
    bundle_params,
    load_bundle,
    pack_bundle,
    params_files,
    parse_manifest,
    unpack_bundle,
)
from ..int8.bundle_files import archive_bytes
from ..int8.bundle_patch import PATCH_SUFFIX, patch_version
from ..int8.requantize import refresh_prefixes
from .records import ModelVersion, check_id
from .registry import Registry

log = logging.getLogger(__name__)
BUNDLES = "bundles"
CACHE_ENTRIES = 64  # artefacts described in memory (a bounded LRU: the coordinator's RSS stays flat)


@dataclass(frozen=True)
class Artefact:
    """A bundle archive ready to publish: what the finetune command's sha256 pins."""

    name: str
    version: str
    path: Path
    sha256: str
    size: int
    head_bytes: int  # size of its head.params: what a head-only transfer would cost


class ModelArtefacts:
    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.root = registry.state_dir / BUNDLES
        self._cache: OrderedDict[tuple[str, str], Artefact] = OrderedDict()
        self._roots: dict[Path, tuple[str, Bundle]] = {}  # root archive -> (its sha256, unpacked once)

    def archive_path(self, name: str, version: str) -> Path:
        return self.root / check_id(name, "model name") / f"{check_id(version, 'model version')}.tar.gz"

    def _abs(self, rel: str) -> Path:
        path = (self.registry.state_dir / rel).resolve()
        if not path.is_relative_to(self.registry.state_dir):
            raise ConfigError(f"stored bundle path {rel!r} leaves the state directory")
        return path

    # ---- registering a base bundle ----
    def register_bundle(self, source: str | Path, *, name: str | None = None, version: str | None = None,
                        parent: str | None = None) -> ModelVersion:
        """Register a bundle (directory or .tar.gz) as a model version devices can train."""
        src = Path(source)
        if not src.exists():
            raise InputError(f"{src}: no such bundle directory or archive")
        with tempfile.TemporaryDirectory(prefix="edge-coordinator-register-") as tmp:
            bundle = unpack_bundle(src, Path(tmp) / "bundle") if src.is_file() else load_bundle(src)
            name = check_id(name or bundle.manifest.name, "model name")
            version = check_id(version or bundle.manifest.version, "model version")
            if version.endswith(PATCH_SUFFIX):
                raise InputError(f"model version {version!r}: the suffix {PATCH_SUFFIX!r} is reserved for head patches")
            head, _ = bundle_params(bundle)
            if not head:
                raise InputError(f"{src}: the head has no parameters to train")
            target = self.archive_path(name, version)
            if target.exists():  # a re-run of the same registration, or a clash
                try:
                    existing = self.registry.get_model(name, version)
                except InputError:
                    existing = None
                if existing is not None:
                    raise InputError(f"model {name} version {version} is already registered "
                                     f"({existing.bundle_path}); pick another --version")
            pack_bundle(bundle.path, target)
        sha = sha256_file(target)
        mv = self.registry.add_model_version(
            name=name, version=version, head=head, parent=parent,
            bundle_path=target.relative_to(self.registry.state_dir).as_posix(), head_only=False,
            metrics={"archive_sha256": sha, "archive_bytes": target.stat().st_size,
                     "bundle_sha256": bundle.sha256, "bundle_name": bundle.manifest.name[:64]})
        log.info("registered model %s %s from %s (archive sha256 %s)", name, version, src, sha[:12])
        return mv

    # ---- archives for publishing ----
    def archive_for(self, mv: ModelVersion) -> Artefact:
        """The archive of a version: the registered one, or built (once) for a round's head."""
        key = (mv.name, mv.version)
        cached = self._cached(key)
        if cached is not None:
            return cached
        if mv.bundle_path is None:
            raise InputError(f"model {mv.name} {mv.version} has no bundle (registered without one)")
        root = self._abs(mv.bundle_path)
        if not mv.head_only:
            art = self._describe(mv, root)
        else:
            target = self.archive_path(mv.name, mv.version)
            expected = self._expected_sha(mv)
            if target.exists() and expected is not None and sha256_file(target) != expected:
                log.warning("archive %s does not match its first build; rebuilding it", target)
                target.unlink()
            if not target.exists():  # the build is deterministic: the same bytes as the first time
                self._build(mv, root, target)
            art = self._describe(mv, target)
        self._remember(key, art)
        return art

    def _cached(self, key: tuple[str, str]) -> Artefact | None:
        art = self._cache.get(key)
        if art is None or not art.path.exists():
            return None
        self._cache.move_to_end(key)
        return art

    def _remember(self, key: tuple[str, str], art: Artefact) -> None:
        self._cache[key] = art
        self._cache.move_to_end(key)
        while len(self._cache) > CACHE_ENTRIES:
            self._cache.popitem(last=False)

    def forget(self, name: str, version: str) -> None:
        """Drop what is remembered of a version (retention pruned it)."""
        for key in ((name, version), (name, patch_version(version))):
            self._cache.pop(key, None)

    def full_sha256(self, mv: ModelVersion) -> str:
        """The sha256 of a version's full archive, building it only if it was never built
        (then the archive is deleted again: only its sha256 side file stays)."""
        if not mv.head_only:
            return self.archive_for(mv).sha256
        expected = self._expected_sha(mv)
        if expected is not None:
            return expected
        target = self.archive_path(mv.name, mv.version)
        kept = target.exists()
        sha = self.archive_for(mv).sha256
        if not kept:
            self.drop_full(mv)
        return sha

    def drop_full(self, mv: ModelVersion) -> None:
        """Delete a head-only version's built full archive (its sha256 side file stays)."""
        if mv.head_only:
            self.archive_path(mv.name, mv.version).unlink(missing_ok=True)
            self._cache.pop((mv.name, mv.version), None)

    def patch_for(self, mv: ModelVersion) -> Artefact | None:
        """A head-only version's patch on its root bundle, built once; None for a registered
        bundle (nothing to patch it onto) or a version id too long to suffix. Built in memory
        from the cached root (`_root`): the version's files are never written as a bundle
        directory, only the patch archive and its full archive's sha256."""
        if not mv.head_only or mv.bundle_path is None or len(patch_version(mv.version)) > 64:
            return None
        key = (mv.name, patch_version(mv.version))
        cached = self._cached(key)
        if cached is not None:
            return cached
        target = self.archive_path(*key)
        root = self._root(self._abs(mv.bundle_path))
        manifest, files = self._version_files(mv, root)
        carried = sorted(f for f, entry in manifest.files.items()
                         if f not in root.manifest.files or root.manifest.files[f].sha256 != entry.sha256)
        raw = manifest.to_bytes()
        atomic_write_bytes(target, archive_bytes(raw, [(f, files[f]) for f in carried]))  # reproducible
        if self._expected_sha(mv) is None:  # what commands pin; the full archive itself is not kept
            full = archive_bytes(raw, [(f, files[f]) for f in sorted(files)])
            atomic_write_text(self.archive_path(mv.name, mv.version).with_suffix(".sha256"),
                              hashlib.sha256(full).hexdigest() + "\n")
        art = Artefact(mv.name, key[1], target, sha256_file(target), target.stat().st_size,
                       manifest.files[HEAD_PARAMS].size)
        log.info("head patch %s for model %s %s: %d bytes (%s)", target.name, mv.name, mv.version, art.size,
                 ", ".join(carried))
        self._remember(key, art)
        return art

    def _expected_sha(self, mv: ModelVersion) -> str | None:
        side = self.archive_path(mv.name, mv.version).with_suffix(".sha256")
        try:
            return read_limited(side, 128).decode().strip() or None
        except (OSError, InputError, UnicodeDecodeError):
            return None

    def _describe(self, mv: ModelVersion, path: Path) -> Artefact:
        if not path.is_file():
            raise ConfigError(f"model {mv.name} {mv.version}: bundle archive {path} is missing")
        size = path.stat().st_size
        if size > MAX_ARCHIVE_BYTES:
            raise InputError(f"{path}: {size} bytes is over the archive limit")
        return Artefact(mv.name, mv.version, path, sha256_file(path), size, _manifest_of(path).files[HEAD_PARAMS].size)

    def _build(self, mv: ModelVersion, root_archive: Path, target: Path) -> None:
        """Root bundle + this version's head -> a reproducible archive (in memory, then one
        atomic write)."""
        manifest, files = self._version_files(mv, self._root(root_archive))
        data = archive_bytes(manifest.to_bytes(), [(f, files[f]) for f in sorted(files)])
        atomic_write_bytes(target, data)
        atomic_write_text(target.with_suffix(".sha256"), hashlib.sha256(data).hexdigest() + "\n")
        log.info("built bundle %s for model %s %s (head only; backbone of %s)", target.name, mv.name, mv.version,
                 root_archive.name)

    def _root(self, root_archive: Path) -> Bundle:
        """The root bundle, unpacked (verified) once under <state_dir>/cache/roots/ and kept:
        every version of the model is built on it."""
        sha = sha256_file(root_archive)
        if self._roots.get(root_archive) is not None and self._roots[root_archive][0] == sha:
            return self._roots[root_archive][1]
        dest = self.registry.state_dir / "cache" / "roots" / sha[:16]
        try:
            bundle = load_bundle(dest)
        except (InputError, OSError):
            bundle = unpack_bundle(root_archive, dest, overwrite=True)
        if len(self._roots) > 8:
            self._roots.clear()
        self._roots[root_archive] = (sha, bundle)
        return bundle

    def _version_files(self, mv: ModelVersion, base: Bundle) -> tuple[Any, dict[str, bytes]]:
        """(manifest with its file entries filled in, files) of the version: the root's files
        with this head -- exactly what `write_bundle_dir` would write, checked the same way."""
        head = self.registry.load_head(mv)
        files = {f: base.read(f) for f in base.manifest.files}
        base_params, prefixes = bundle_params(base)
        if set(base_params) != set(head):
            raise InputError(f"model {mv.name} {mv.version}: head tensors {sorted(head)[:8]} do not match "
                             f"the bundle's {sorted(base_params)[:8]}")
        typed = {n: np.asarray(head[n]).astype(base_params[n].dtype, copy=False) for n in base_params}
        # per depth file: a version that changed only the head differs from its root in head.params
        files.update(params_files(typed, prefixes, base.manifest, files))
        # a multi-depth bundle trained below a prefix's cut: that int8 prefix is rebuilt
        rebuilt = refresh_prefixes(files, base.manifest, typed)
        if rebuilt:
            log.info("model %s %s: re-quantised %s (weights inside them changed)", mv.name, mv.version,
                     ", ".join(rebuilt))
        manifest = copy.deepcopy(base.manifest)  # the cached root's stays as it is
        manifest.version, manifest.parent_version = mv.version, mv.parent
        manifest.created = dt.datetime.fromtimestamp(mv.created_at, dt.UTC).isoformat(timespec="seconds")
        manifest.extra = {**manifest.extra, "head_only": not rebuilt, "root_bundle": base.sha256,
                          **({"requantised": rebuilt} if rebuilt else {}),
                          **({"job": mv.job_id, "round": mv.round} if mv.job_id else {})}
        manifest.files = {n: FileEntry(hashlib.sha256(d).hexdigest(), len(d)) for n, d in files.items()}
        parse_manifest(manifest.to_bytes(), where=f"model {mv.name} {mv.version}")  # what a device will parse
        return manifest, files


def _manifest_of(archive: Path) -> Any:
    """An archive's manifest, read without unpacking the rest."""
    try:
        with tarfile.open(archive, mode="r:gz") as tar:
            member = tar.getmember(MANIFEST)
            handle = tar.extractfile(member) if member.isfile() and member.size <= MAX_MANIFEST_BYTES else None
            if handle is None:
                raise InputError(f"{archive}: no readable {MANIFEST}")
            return parse_manifest(handle.read(), where=f"{archive}: {MANIFEST}")
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise InputError(f"{archive}: not a bundle archive ({exc})") from None
