"""Writing bundles to disk: atomic bundle directories (temp directory, fsync, rename,
fsync the parent) and the single-file .tar.gz archive a device downloads, packed
reproducibly and unpacked with every member checked before anything is trusted.

Split from bundle.py (the format, the manifest and loading), which re-exports these names.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import shutil
import tarfile
import tempfile
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ..atomic import atomic_write_bytes, fsync_dir, read_limited
from .bundle import (
    _DEPTH_FILE_RE,
    MANIFEST,
    MAX_ARCHIVE_BYTES,
    MAX_FILE_BYTES,
    MAX_MANIFEST_BYTES,
    OPTIONAL_FILES,
    REQUIRED_FILES,
    Bundle,
    BundleError,
    FileEntry,
    Manifest,
    load_bundle,
)

# ---------------------------------------------------------------- atomic directories


def _check_dest(dest: Path, overwrite: bool) -> None:
    """Fail before any work when `dest` exists (checked again at the rename)."""
    if not overwrite and (dest.exists() or dest.is_symlink()):
        raise BundleError(f"{dest}: already exists (--overwrite replaces it)")


def _tmp_dir_for(dest: Path) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    tmp.chmod(0o755)  # mkdtemp makes it 0700; the bundle is read by the service user too
    return tmp


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _commit_dir(tmp: Path, dest: Path, *, overwrite: bool) -> None:
    """Rename a fully written (and fsynced) temp directory to `dest`."""
    fsync_dir(tmp)
    _check_dest(dest, overwrite)
    if dest.exists() or dest.is_symlink():
        # A directory cannot be renamed over a non-empty one: move the old aside first. A crash
        # between the two renames leaves no `dest` but a complete `.old` next to it.
        old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
        os.rename(dest, old)
        os.rename(tmp, dest)
        fsync_dir(dest.parent)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, dest)
    fsync_dir(dest.parent)


@dataclass(frozen=True)
class StagedFile:
    """A bundle file already written and fsynced by `Staging`: write_bundle_dir moves it in."""

    path: Path
    entry: FileEntry


class Staging:
    """A directory beside a bundle being made, where its large files are written as soon as
    they exist, so their bytes are not held until the bundle is (`model create` on a
    resnet50: the fp32 backbone and four int8 prefixes, ~160 MB). Same filesystem as the
    bundle's temp directory, so they are renamed into it, not copied. Removed on exit."""

    def __init__(self, dest: Path) -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".staging", dir=dest.parent))

    def __enter__(self) -> Staging:
        return self

    def __exit__(self, *exc: object) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def put(self, fname: str, data: bytes | Iterable[bytes]) -> StagedFile:
        """`data` (bytes, or chunks written one at a time) as staged file `fname`, fsynced."""
        digest, size = hashlib.sha256(), 0
        path = self.dir / fname
        with open(path, "wb") as handle:
            for chunk in [data] if isinstance(data, bytes) else data:
                digest.update(chunk)
                handle.write(chunk)
                size += len(chunk)
            handle.flush()
            os.fsync(handle.fileno())
        path.chmod(0o644)  # as atomic_write_bytes leaves a bundle's files
        return StagedFile(path, FileEntry(digest.hexdigest(), size))


FileData = bytes | StagedFile  # a bundle file's bytes, or the file itself, staged


def write_bundle_dir(dest: Path, files: Mapping[str, FileData], manifest: Manifest, *, overwrite: bool = False,
                     derived: Callable[[Bundle], dict[str, bytes]] | None = None) -> Bundle:
    """Write `files` and the manifest (hashes filled in here) atomically as directory `dest`.
    A staged file is moved in (its staging directory must be on dest's filesystem: beside it).
    `derived(bundle)`: files computed from the verified bundle before it gets its name (the
    oracle's answers), added to it and to its manifest."""
    tmp = _tmp_dir_for(dest)
    try:
        _write_files(tmp, files, manifest)
        bundle = load_bundle(tmp)  # verify what is on disk before it gets the final name
        extra = derived(bundle) if derived is not None else {}
        if extra:
            _write_files(tmp, {**files, **extra}, manifest, only=extra)
            load_bundle(tmp)
        _commit_dir(tmp, dest, overwrite=overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return load_bundle(dest)


def _write_files(tmp: Path, files: Mapping[str, FileData], manifest: Manifest, *,
                 only: Mapping[str, FileData] | None = None) -> None:
    """`only` (default all of `files`) into `tmp`, then the manifest naming every file's hash."""
    manifest.files = {n: d.entry if isinstance(d, StagedFile) else FileEntry(hashlib.sha256(d).hexdigest(), len(d))
                      for n, d in files.items()}
    for fname, data in (files if only is None else only).items():
        if isinstance(data, StagedFile):
            os.replace(data.path, tmp / fname)  # fsynced when staged; the directory is, at the commit
        else:
            atomic_write_bytes(tmp / fname, data)
    atomic_write_bytes(tmp / MANIFEST, manifest.to_bytes())


# ---------------------------------------------------------------- single-file archive


def pack_bundle(bundle_dir: str | os.PathLike[str], archive: str | os.PathLike[str], *,
                only: list[str] | None = None) -> Path:
    """Verify a bundle and write it as one reproducible tar.gz (atomically). `only`: the
    files to include besides the manifest (a head patch: bundle_patch), default all."""
    bundle = load_bundle(bundle_dir)
    names = sorted(bundle.manifest.files if only is None else only)
    atomic_write_bytes(archive, archive_bytes(read_limited(bundle.path / MANIFEST, MAX_MANIFEST_BYTES),
                                              [(f, bundle.read(f)) for f in names]))
    return Path(archive)


def archive_bytes(manifest: bytes, files: list[tuple[str, bytes]]) -> bytes:
    """The reproducible tar.gz of a manifest and files (in the order given: pack_bundle sorts
    them): what pack_bundle writes, from bytes in memory (the coordinator builds versions so,
    without writing and re-reading a bundle directory)."""
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        for fname, data in [(MANIFEST, manifest), *files]:
            info = tarfile.TarInfo(fname)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def unpack_bundle(archive: str | os.PathLike[str], dest: str | os.PathLike[str], *,
                  overwrite: bool = False, max_bytes: int = MAX_ARCHIVE_BYTES,
                  complete: Callable[[Path], None] | None = None) -> Bundle:
    """Extract an archive made by `pack_bundle` into `dest`, verified before it appears there.

    Only flat regular files with known names, each once, are accepted (no paths, links or
    devices), with sizes limited before anything is read. `complete(tmp_dir)` may add files
    the archive lacks before the verification (a head patch: see bundle_patch)."""
    src, target = Path(archive), Path(dest)
    size = src.stat().st_size
    if size > max_bytes:
        raise BundleError(f"{src}: {size} bytes is over the archive limit of {max_bytes}")
    allowed = {MANIFEST, *REQUIRED_FILES, *OPTIONAL_FILES}
    _check_dest(target, overwrite)
    tmp = _tmp_dir_for(target)
    try:
        total = 0
        try:
            with tarfile.open(src, mode="r:*") as tar:
                for member in tar:  # known names (depth files too), each once
                    where = f"{src}: member {member.name!r:.80}"
                    if not member.isreg():
                        raise BundleError(f"{where}: not a regular file (links and devices are refused)")
                    if "/" in member.name or "\\" in member.name or (
                            member.name not in allowed and not _DEPTH_FILE_RE.match(member.name)):
                        raise BundleError(f"{where}: unexpected name (paths and unknown files are refused)")
                    if (tmp / member.name).exists():
                        raise BundleError(f"{where}: appears twice")
                    total += member.size
                    if member.size > MAX_FILE_BYTES or total > max_bytes:
                        raise BundleError(f"{where}: too large ({member.size} bytes; {total} in total)")
                    handle = tar.extractfile(member)
                    data = handle.read(member.size + 1) if handle else b""
                    if len(data) != member.size:
                        raise BundleError(f"{where}: truncated ({len(data)} of {member.size} bytes)")
                    (tmp / member.name).write_bytes(data)  # fsynced below, once verified
        except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
            why = ("not a tar archive, plain or compressed" if "could not be opened" in str(exc)
                   else " ".join(str(exc).split())[:200])  # tarfile's own text spans lines
            raise BundleError(f"{src}: not a readable bundle archive ({why})") from None
        if complete is not None:
            complete(tmp)
        try:
            load_bundle(tmp)
            for path in tmp.iterdir():  # durable before the rename publishes them; a refused
                _fsync_file(path)  # archive costs no fsync (an SD card pays ms for each)
        except BundleError as exc:  # name the user's archive, not our temp directory
            raise type(exc)(str(exc).replace(f"{tmp}/", f"{src}: member ").replace(str(tmp), str(src))) from None
        _commit_dir(tmp, target, overwrite=overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return load_bundle(target)
