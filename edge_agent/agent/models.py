"""Installed model bundles: download in chunks, verify, unpack in a child, activate atomically.

    <state>/models/<name>/<version>/     an unpacked, verified bundle (never modified)
    <state>/models/<name>/current        symlink -> <version>: flipped with one rename
    <state>/models/.incoming/            ModelDownload's verified chunks and assembled archives

A fetch subscribes to the version's retained topics; every chunk and the manifest are
coordinator-signed (checked by the Verifier), ModelDownload checks the assembled archive's
size and sha256 against the signed manifest and the sha256 the command named, and the
`activate` child (numpy-side) unpacks it into a temp directory, verifies every file
against the bundle manifest, fsyncs and renames it into place. Only then does `current`
move.

When the command names a head patch (`head_sha256`) and a version of the model is already
active, the fetch takes the patch instead (`<version>.head`: the new manifest and head, a
few KiB instead of the whole bundle) and the child rebuilds the version from it and the
active version's files (int8.bundle_patch; every file verified as above). A patch that
does not download, verify or apply falls back to the full archive.

Every fetch has a timeout (`fetch_timeout`, agent.toml [service] model_fetch_timeout_s): no
verified chunk or manifest for that long (nothing published, or a bundle signed by a key
other than the coordinator's, whose every message the Verifier refuses), or an activation
child running that long, fails the fetch with the reason, so no job waits on it forever.

The previous version stays on disk (and any version a job still uses); older ones are
pruned.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ..atomic import fsync_dir
from ..errors import InputError
from ..protocol import Kind, Message, Topics, validate_id
from ..protocol.topics import patch_version  # (not int8.bundle_patch: the daemon stays numpy-free)
from ..transport.models import ModelDownload
from .runner import ChildProcess, describe_exit

log = logging.getLogger(__name__)
CURRENT = "current"
INCOMING = ".incoming"
MAX_FAILED_FETCHES = 16
FETCH_TIMEOUT_S = 600.0


@dataclass
class Fetch:
    name: str
    version: str
    sha256: str | None
    download: ModelDownload
    base: Path | None = None  # fetching a head patch onto this installed version
    status: str = "downloading"  # downloading | activating | installed | failed
    detail: str = ""
    child: ChildProcess | None = None
    started: float = field(default_factory=time.monotonic)
    chunks: int = 0
    progress_at: float = field(default_factory=time.monotonic)  # the last verified message of it


class ModelStore:
    def __init__(self, *, root: Path, topics: Topics, subscribe: Callable[[str], None],
                 unsubscribe: Callable[[str], None], python: list[str] | None = None,
                 fetch_timeout: float = FETCH_TIMEOUT_S) -> None:
        if fetch_timeout <= 0:
            raise ValueError("fetch_timeout must be positive")
        self.fetch_timeout = fetch_timeout
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.topics, self._subscribe, self._unsubscribe, self._python = topics, subscribe, unsubscribe, python
        self.fetches: dict[tuple[str, str], Fetch] = {}
        self.on_change: Callable[[Fetch], None] = lambda fetch: None
        shutil.rmtree(self.root / ".staging", ignore_errors=True)

    def path(self, name: str, version: str) -> Path:
        if version == CURRENT:
            raise InputError(f"model version {CURRENT!r} is reserved (the active-version link)")
        return self.root / validate_id(name, "model") / validate_id(version, "version")

    def installed(self, name: str, version: str) -> bool:
        return (self.path(name, version) / "manifest.json").is_file()

    def current(self) -> dict[str, str]:
        """name -> active version, for the state message."""
        out = {}
        for entry in sorted(self.root.iterdir()) if self.root.is_dir() else []:
            link = entry / CURRENT
            if entry.name.startswith(".") or not link.is_symlink():
                continue
            target = os.readlink(link)
            if (entry / target / "manifest.json").is_file():
                out[entry.name] = target
        return out

    def status(self, name: str, version: str) -> tuple[str, str]:
        """("installed" | "downloading" | "activating" | "failed" | "absent", detail)."""
        fetch = self.fetches.get((name, version))
        if fetch is not None and fetch.status != "installed":
            return fetch.status, fetch.detail
        return ("installed", "") if self.installed(name, version) else ("absent", "")

    def fetch(self, name: str, version: str, sha256: str | None = None, *,
              head_sha256: str | None = None) -> Fetch | None:
        """Start (or keep going with) fetching a version; None if it is already installed.
        With `head_sha256` and a version of `name` active, only the head patch is fetched."""
        if self.installed(name, version):
            return None
        key = (name, version)
        fetch = self.fetches.get(key)
        if fetch is not None and fetch.status in ("downloading", "activating"):
            return fetch
        base = self._patch_base(name, version) if head_sha256 else None
        if base is not None:
            download = ModelDownload(directory=self.root / INCOMING, name=name, version=patch_version(version),
                                     expected_sha256=head_sha256)
        else:
            download = ModelDownload(directory=self.root / INCOMING, name=name, version=version,
                                     expected_sha256=sha256)
        fetch = self.fetches[key] = Fetch(name, version, sha256, download, base=base)
        self._subscribe(download.filter(self.topics))
        log.info("model %s/%s: fetching %s (sha256 %s)", name, version,
                 f"the head patch onto {base.name}" if base else "the bundle",
                 (download.expected or "from the signed manifest")[:12])
        return fetch

    def _patch_base(self, name: str, version: str) -> Path | None:
        """The active version of `name`, if a patch of `version` can be published (id length)."""
        active = self.current().get(name)
        try:
            validate_id(patch_version(version), "version")
        except InputError:
            return None
        return self.path(name, active) if active else None

    def _full_instead(self, fetch: Fetch, why: str) -> None:
        """A head patch that failed: fetch the whole archive (what the command's sha256 pins)."""
        with contextlib.suppress(ValueError):
            self._unsubscribe(fetch.download.filter(self.topics))
        log.warning("model %s/%s: head patch unusable (%s); fetching the full bundle", fetch.name, fetch.version, why)
        fetch.base = None
        fetch.download = ModelDownload(directory=self.root / INCOMING, name=fetch.name, version=fetch.version,
                                       expected_sha256=fetch.sha256)
        fetch.status, fetch.detail = "downloading", f"head patch unusable ({why[:200]}); fetching the full bundle"
        self._subscribe(fetch.download.filter(self.topics))
        self.on_change(fetch)

    def add(self, msg: Message) -> None:
        """A verified manifest or model chunk (of any version: only wanted ones are kept)."""
        if msg.kind not in (Kind.MANIFEST, Kind.MODEL_CHUNK):
            return
        key = (msg.body["name"], msg.body["version"])  # a version, or a version's head patch
        fetch = next((f for f in self.fetches.values() if (f.download.name, f.download.version) == key), None)
        if fetch is None or fetch.status != "downloading":
            return
        expected = fetch.download.expected
        if msg.kind is Kind.MANIFEST and expected and msg.body["sha256"] != expected:
            # The coordinator's signed manifest says this version is other bytes than the command did.
            self._fail(fetch, f"the published bundle has sha256 {msg.body['sha256'][:16]}..., the command "
                              f"asked for {expected[:16]}...")
            return
        try:
            archive = fetch.download.add(msg)
        except InputError as exc:  # signed but inconsistent: discard and wait for a new publication
            self._fail(fetch, f"bundle does not verify: {exc}")
            return
        except OSError as exc:
            self._fail(fetch, f"cannot store the download: {exc}")
            return
        fetch.chunks += msg.kind is Kind.MODEL_CHUNK
        fetch.progress_at = time.monotonic()
        if archive is not None:
            self._unsubscribe(fetch.download.filter(self.topics))
            self._activate(fetch, archive)

    def _activate(self, fetch: Fetch, archive: Path) -> None:
        dest = self.path(fetch.name, fetch.version)
        fetch.status, fetch.detail = "activating", f"verifying {archive.stat().st_size} bytes"
        staging = self.root / ".staging" / f"{fetch.name}-{fetch.version}"
        staging.mkdir(parents=True, exist_ok=True)
        spec = {"archive": str(archive), "dest": str(dest), **({"base": str(fetch.base)} if fetch.base else {})}
        fetch.child = ChildProcess(command="activate", spec=spec,
                                   job_dir=staging, name=f"model {fetch.name}/{fetch.version}", python=self._python)
        try:
            fetch.child.start()
        except OSError as exc:
            self._fail(fetch, f"cannot start the activation child: {exc}")
            return
        self.on_change(fetch)

    def poll(self, protect: Iterable[tuple[str, str]] = ()) -> None:
        """Finish activations whose child has exited, fail fetches that timed out.
        `protect`: versions jobs still use."""
        now = time.monotonic()
        for fetch in list(self.fetches.values()):
            child = fetch.child
            if fetch.status == "downloading" and now - fetch.progress_at > self.fetch_timeout:
                fetch.progress_at = now  # (a patch falling back to the full bundle gets its own time)
                self._fail(fetch, f"timed out: no verified part of {fetch.download.name}/{fetch.download.version} "
                                  f"for {self.fetch_timeout:.0f} s ({fetch.chunks} chunks so far; not published, "
                                  "or signed by a key other than the coordinator's)")
                continue
            if child is None:
                continue
            if now - child.started_at > self.fetch_timeout and child.poll() is None:
                child.stop(timeout=10)
                fetch.child = None
                self._fail(fetch, f"timed out: activation ran over {self.fetch_timeout:.0f} s")
                continue
            child.events()
            code = child.poll()
            if code is None:
                continue
            fetch.child = None
            shutil.rmtree(self.root / ".staging" / f"{fetch.name}-{fetch.version}", ignore_errors=True)
            if code != 0 or not self.installed(fetch.name, fetch.version):
                self._fail(fetch, f"bundle rejected ({describe_exit(code)}): {child.last_error or 'no detail'}")
                continue
            self._set_current(fetch.name, fetch.version)
            how = f" from its head patch onto {fetch.base.name}" if fetch.base else ""
            fetch.status, fetch.detail = "installed", f"activated {fetch.name} {fetch.version}{how}"
            with contextlib.suppress(OSError):
                fetch.download.target.unlink()
            self.prune(fetch.name, protect=set(protect))
            log.info("model %s/%s: installed and active", fetch.name, fetch.version)
            self.on_change(fetch)
            self.fetches.pop((fetch.name, fetch.version), None)  # installed: the disk says so from now on

    def _fail(self, fetch: Fetch, why: str) -> None:
        if fetch.base is not None:  # only the patch failed: the full archive may still do
            self._full_instead(fetch, why)
            return
        fetch.status, fetch.detail = "failed", why[:500]
        with contextlib.suppress(ValueError):
            self._unsubscribe(fetch.download.filter(self.topics))
        log.error("model %s/%s: %s", fetch.name, fetch.version, why)
        self.on_change(fetch)
        failed = [k for k, f in self.fetches.items() if f.status == "failed"]
        for key in failed[:-MAX_FAILED_FETCHES]:  # remembered for the jobs waiting on them; bounded
            del self.fetches[key]

    def _set_current(self, name: str, version: str) -> None:
        folder = self.root / name
        tmp = folder / f".{CURRENT}.tmp"
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        os.symlink(version, tmp)
        os.replace(tmp, folder / CURRENT)  # one rename: readers see the old or the new version
        fsync_dir(folder)

    def prune(self, name: str, *, protect: set[tuple[str, str]], keep: int = 2) -> None:
        """Keep the current version, the one before it (rollback), and any a job uses."""
        folder = self.root / name
        versions = [p for p in folder.iterdir() if p.is_dir() and not p.is_symlink() and not p.name.startswith(".")
                    and (p / "manifest.json").is_file()]
        versions.sort(key=lambda p: p.stat().st_mtime, reverse=True)
        current = os.readlink(folder / CURRENT) if (folder / CURRENT).is_symlink() else None
        others = [p for p in versions if p.name != current]
        for path in others[keep - 1:]:
            if (name, path.name) in protect:
                continue
            log.info("model %s/%s: pruned (keeping the current and previous versions)", name, path.name)
            shutil.rmtree(path, ignore_errors=True)

    def stop(self) -> None:
        for fetch in self.fetches.values():
            if fetch.child is not None:
                fetch.child.stop(timeout=10)
