"""Head patches: a new bundle version as only the files that changed.

A federated round changes a bundle's head and nothing else: the int8 backbone, its ONNX
twin and the calibration batch are the same bytes as in the version the device already
runs. A patch archive is a `pack_bundle` archive that holds the new version's complete
manifest.json (every file's sha256 and size) but only the files whose bytes differ from
the base -- for a head-only version, manifest + head.params: ~1-50 KiB instead of the
whole bundle.

Applying one needs no trust beyond the full archive's: the patch archive itself is
verified like any download (coordinator-signed manifest, sha256 named in the signed
command); each missing file is copied from a verified local bundle only if its sha256 is
the one the new manifest names; and the result is verified by `load_bundle` before it
gets its final name (`unpack_bundle(complete=...)`).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..atomic import atomic_write_bytes, read_limited
from ..protocol.topics import PATCH_SUFFIX, patch_version  # noqa: F401 - re-exported: the patch's names
from .bundle import (
    MANIFEST,
    MAX_FILE_BYTES,
    MAX_MANIFEST_BYTES,
    Bundle,
    BundleError,
    _parse_manifest,
    load_bundle,
    pack_bundle,
    unpack_bundle,
)


def pack_patch(bundle_dir: str | os.PathLike[str], base_dir: str | os.PathLike[str],
               archive: str | os.PathLike[str]) -> tuple[Path, list[str]]:
    """Write `bundle_dir` as a patch on `base_dir`: the manifest plus the files whose bytes
    differ from the base's. Returns (archive, the files it carries). Reproducible bytes."""
    new, base = load_bundle(bundle_dir), load_bundle(base_dir)
    changed = sorted(f for f, entry in new.manifest.files.items()
                     if f not in base.manifest.files or base.manifest.files[f].sha256 != entry.sha256)
    pack_bundle(new.path, archive, only=changed)
    return Path(archive), changed


def apply_patch(archive: str | os.PathLike[str], base_dir: str | os.PathLike[str],
                dest: str | os.PathLike[str], *, overwrite: bool = False) -> Bundle:
    """Patch archive + a verified local bundle -> the new version at `dest`, verified.

    Raises BundleError when the base lacks a file the patch needs or holds other bytes for
    it (the caller then fetches the full archive), or for anything `unpack_bundle` refuses."""
    base = Path(base_dir)

    def complete(tmp: Path) -> None:
        where = f"{archive}: {MANIFEST}"
        try:
            raw = read_limited(tmp / MANIFEST, MAX_MANIFEST_BYTES)
            manifest = _parse_manifest(json.loads(raw.decode("utf-8")), where)
        except FileNotFoundError:
            raise BundleError(f"{where}: missing from the patch") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise BundleError(f"{where}: not valid JSON ({exc})") from None
        for fname, entry in manifest.files.items():
            if (tmp / fname).exists():
                continue
            try:
                data = read_limited(base / fname, MAX_FILE_BYTES)
            except FileNotFoundError:
                raise BundleError(f"patch {archive}: needs {fname}, which base {base} does not have") from None
            if hashlib.sha256(data).hexdigest() != entry.sha256:
                raise BundleError(f"patch {archive}: base {base} holds another {fname} than the new version's")
            atomic_write_bytes(tmp / fname, data)

    return unpack_bundle(archive, dest, overwrite=overwrite, complete=complete)
