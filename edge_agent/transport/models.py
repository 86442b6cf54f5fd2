"""Model bundles over MQTT: the coordinator publishes, devices download in chunks.

A bundle is published as retained, coordinator-signed `model_chunk` messages on
`models/<name>/<version>/chunk/<i>` and then a retained signed `manifest` (name, version,
size, sha256, chunk count), so any number of devices fetch it from the broker without
the coordinator being online. A device's `ModelDownload` keeps verified chunks on disk
(a reboot resumes), assembles the bundle streaming into a temp file while hashing it,
checks size and sha256 against the signed manifest and against the sha256 its signed
command named, and only then renames it into place.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

from ..atomic import CorruptFileError, fsync_dir, read_checked, write_checked
from ..errors import InputError, TransientError
from ..protocol import MAX_BUNDLE_BYTES, Kind, Message, Signer, Topics, validate_id
from .mqtt import MqttClient

log = logging.getLogger(__name__)
DEFAULT_CHUNK_BYTES = 64 * 1024
MODEL_TTL = 365 * 86400


class BundleMismatchError(InputError):
    """A bundle does not match its signed manifest or the sha256 its command named."""


def publish_model(client: MqttClient, signer: Signer, topics: Topics, *, name: str, version: str, bundle: bytes,
                  chunk_bytes: int = DEFAULT_CHUNK_BYTES, meta: dict[str, str | int | float | bool] | None = None,
                  ttl: float = MODEL_TTL, timeout: float = 30.0) -> dict[str, object]:
    """Publish a bundle (chunks first, manifest last), all retained; returns the manifest body."""
    if not 0 < len(bundle) <= MAX_BUNDLE_BYTES:
        raise InputError(f"bundle of {len(bundle)} bytes is outside 1..{MAX_BUNDLE_BYTES}")
    if not 1 <= chunk_bytes <= 100 * 1024:
        raise ValueError("chunk_bytes must be 1..102400 (messages stay under 128 KiB)")
    sha = hashlib.sha256(bundle).hexdigest()
    count = -(-len(bundle) // chunk_bytes)
    for i in range(count):
        topic = topics.model_chunk(name, version, i)
        payload = signer.binary(topic, Kind.MODEL_CHUNK, {"name": name, "version": version, "sha256": sha,
                                                          "index": i, "count": count},
                                bundle[i * chunk_bytes : (i + 1) * chunk_bytes], ttl=ttl)
        if not client.publish_wait(topic, payload, retain=True, timeout=timeout):
            raise TransientError(f"model {name}/{version}: chunk {i + 1}/{count} not acknowledged by the broker")
    manifest = {"name": name, "version": version, "sha256": sha, "size": len(bundle), "chunks": count,
                "chunk_size": chunk_bytes, **({"meta": dict(meta)} if meta else {})}
    topic = topics.manifest(name, version)
    if not client.publish_wait(topic, signer.control(topic, Kind.MANIFEST, manifest, ttl=ttl), retain=True,
                               timeout=timeout):
        raise TransientError(f"model {name}/{version}: manifest not acknowledged by the broker")
    return manifest


def retract_model(client: MqttClient, topics: Topics, *, name: str, version: str, chunks: int,
                  timeout: float = 30.0) -> None:
    """Clear the retained manifest and chunks of a version (an empty retained message)."""
    for topic in [topics.manifest(name, version)] + [topics.model_chunk(name, version, i) for i in range(chunks)]:
        if not client.publish_wait(topic, b"", retain=True, timeout=timeout):
            raise TransientError(f"model {name}/{version}: could not clear {topic}")


class ModelDownload:
    """Collects one model version from verified messages; `add()` returns the path when done."""

    def __init__(self, *, directory: str | os.PathLike[str], name: str, version: str,
                 expected_sha256: str | None = None, max_bytes: int = MAX_BUNDLE_BYTES) -> None:
        self.name, self.version = validate_id(name, "model"), validate_id(version, "version")
        if expected_sha256 is not None and (len(expected_sha256) != 64 or expected_sha256.strip("0123456789abcdef")):
            raise ValueError("expected_sha256 must be 64 lower-case hex digits")
        self.expected, self.max_bytes = expected_sha256, max_bytes
        self.directory = Path(directory)
        self.target = self.directory / name / f"{version}.bundle"
        self._partial = self.directory / ".partial" / name / version
        self.manifest: dict[str, object] | None = None

    def filter(self, topics: Topics) -> str:
        """The subscription that delivers this version's manifest and chunks."""
        return topics.model_filter(self.name, self.version)

    def _chunk_dir(self, sha: str) -> Path:
        return self._partial / sha

    def add(self, msg: Message) -> Path | None:
        """Take a verified manifest or chunk of this version; the bundle path once complete.

        Raises BundleMismatchError (an InputError) if the assembled bundle does not match its
        manifest; the partial chunks are then discarded so the next delivery starts clean.
        """
        b = msg.body
        if msg.kind not in (Kind.MANIFEST, Kind.MODEL_CHUNK) or (b["name"], b["version"]) != (self.name, self.version):
            return None
        if self.expected and b["sha256"] != self.expected:
            log.warning("model %s/%s: ignoring %s for sha256 %s, expected %s", self.name, self.version,
                        msg.kind, b["sha256"][:12], self.expected[:12])
            return None
        if msg.kind is Kind.MANIFEST:
            if b["size"] > self.max_bytes:
                raise BundleMismatchError(f"model {self.name}/{self.version}: {b['size']} bytes is over {self.max_bytes}")
            self.manifest = dict(b)
        else:
            folder = self._chunk_dir(b["sha256"])
            path = folder / f"{b['index']:05d}.chunk"
            if not path.exists():
                write_checked(path, msg.data)
        return self._try_finish()

    def _try_finish(self) -> Path | None:
        m = self.manifest
        if m is None:
            return None
        sha, count, size = str(m["sha256"]), int(m["chunks"]), int(m["size"])  # type: ignore[call-overload]
        folder = self._chunk_dir(sha)
        if not all((folder / f"{i:05d}.chunk").exists() for i in range(count)):
            return None
        self.target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.target.name}.", suffix=".tmp", dir=self.target.parent)
        digest, total = hashlib.sha256(), 0
        try:
            with os.fdopen(fd, "wb") as out:
                for i in range(count):
                    data = read_checked(folder / f"{i:05d}.chunk", 128 * 1024)
                    digest.update(data)
                    total += len(data)
                    if total > size:
                        break
                    out.write(data)
                out.flush()
                os.fsync(out.fileno())
            if total != size or digest.hexdigest() != sha:
                shutil.rmtree(folder, ignore_errors=True)  # signed but inconsistent: fetch again from scratch
                raise BundleMismatchError(f"model {self.name}/{self.version}: assembled {total} bytes with sha256 "
                                          f"{digest.hexdigest()[:12]}, manifest says {size} bytes, {sha[:12]}")
            os.replace(tmp, self.target)
            fsync_dir(self.target.parent)
        except CorruptFileError:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        shutil.rmtree(self._partial, ignore_errors=True)
        log.info("model %s/%s: %d bytes verified (sha256 %s) at %s", self.name, self.version, size, sha[:12], self.target)
        return self.target
