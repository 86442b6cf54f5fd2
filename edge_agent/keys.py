"""Ed25519 keys: generation, PEM files (0600, crash-safe), fingerprints.

A device's id *is* the fingerprint of its public key, so nobody can claim another
device's topics without its private key, and the coordinator's registry needs no
separate id allocation. The enrolment code is a short, human-checkable form of the same
fingerprint that an operator compares on the device's label or console.
"""

from __future__ import annotations

import base64
import hashlib
import os
import stat
from pathlib import Path

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .atomic import atomic_write_bytes, read_limited
from .errors import ConfigError, InputError

PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
MAX_PEM_BYTES = 4096  # an Ed25519 PEM is ~120 bytes; anything bigger is not one
FINGERPRINT_CHARS = 24  # 120 bits of sha256, lower-case base32: topic- and filename-safe

__all__ = [
    "Ed25519PrivateKey",
    "Ed25519PublicKey",
    "enrolment_code",
    "enrolment_code_of",
    "fingerprint",
    "generate_private_key",
    "load_or_create_private_key",
    "load_private_key",
    "load_public_key",
    "public_key_bytes",
    "public_key_from_bytes",
    "save_private_key",
    "save_public_key",
]


class KeyFileError(ConfigError):
    """A key file is missing, unreadable, malformed, not Ed25519 or too widely readable."""


def generate_private_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def public_key_bytes(key: Ed25519PublicKey | Ed25519PrivateKey) -> bytes:
    """The raw 32-byte public key (what fingerprints and `hello` messages carry)."""
    if isinstance(key, Ed25519PrivateKey):
        key = key.public_key()
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def public_key_from_bytes(raw: bytes) -> Ed25519PublicKey:
    """Parse a raw public key; raises InputError on anything but 32 bytes."""
    if len(raw) != PUBLIC_KEY_BYTES:
        raise InputError(f"an Ed25519 public key is {PUBLIC_KEY_BYTES} bytes, got {len(raw)}")
    return Ed25519PublicKey.from_public_bytes(raw)


def fingerprint(key: Ed25519PublicKey | Ed25519PrivateKey) -> str:
    """Stable id of a key: lower-case base32 of sha256(raw public key), 24 characters.

    Used as the device id (a topic segment) and as the key id in signed messages.
    """
    digest = hashlib.sha256(b"edgeft-key-v1\0" + public_key_bytes(key)).digest()
    return base64.b32encode(digest[:15]).decode("ascii").lower()


def enrolment_code(key: Ed25519PublicKey | Ed25519PrivateKey) -> str:
    """The first 60 bits of the fingerprint as `ABCD-EFGH-IJKL`, for a human to compare."""
    fp = fingerprint(key).upper()
    return "-".join(fp[i : i + 4] for i in range(0, 12, 4))


def enrolment_code_of(public_key: str) -> str:
    """The enrolment code of a base64 raw public key, as the coordinator's registry stores
    it (the same code `edge-agent init` and `run` print on the device)."""
    try:
        raw = base64.b64decode(public_key, validate=True)
    except (ValueError, TypeError):
        raise InputError("a public key is base64 of 32 bytes") from None
    return enrolment_code(public_key_from_bytes(raw))


def save_private_key(path: str | os.PathLike[str], key: Ed25519PrivateKey, *, exclusive: bool = False) -> None:
    """Write the key as unencrypted PKCS#8 PEM, mode 0600 from the first byte on disk;
    `exclusive`: only if there is none yet (FileExistsError otherwise)."""
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    atomic_write_bytes(path, pem, mode=0o600, exclusive=exclusive)


def save_public_key(path: str | os.PathLike[str], key: Ed25519PublicKey | Ed25519PrivateKey) -> None:
    if isinstance(key, Ed25519PrivateKey):
        key = key.public_key()
    pem = key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    atomic_write_bytes(path, pem, mode=0o644)


def _read_pem(path: str | os.PathLike[str]) -> bytes:
    try:
        return read_limited(path, MAX_PEM_BYTES)
    except FileNotFoundError as exc:
        raise KeyFileError(f"{path}: key file not found") from exc
    except InputError as exc:
        raise KeyFileError(f"{path}: not a key file ({exc})") from exc
    except OSError as exc:
        raise KeyFileError(f"{path}: cannot read key file: {exc.strerror}") from exc


def load_private_key(path: str | os.PathLike[str], *, check_mode: bool = True) -> Ed25519PrivateKey:
    """Load a PEM private key; refuses group/other-readable files (like ssh) when `check_mode`."""
    data = _read_pem(path)
    if check_mode:
        mode = stat.S_IMODE(os.stat(path).st_mode)
        if mode & 0o077:
            raise KeyFileError(f"{path}: permissions {mode:04o} are too open for a private key (chmod 600)")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise KeyFileError(f"{path}: not an unencrypted PEM private key ({exc})") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyFileError(f"{path}: a {type(key).__name__}, expected an Ed25519 key")
    return key


def load_public_key(path: str | os.PathLike[str]) -> Ed25519PublicKey:
    data = _read_pem(path)
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise KeyFileError(f"{path}: not a PEM public key ({exc})") from exc
    if not isinstance(key, Ed25519PublicKey):
        raise KeyFileError(f"{path}: a {type(key).__name__}, expected an Ed25519 key")
    return key


def load_or_create_private_key(path: str | os.PathLike[str]) -> tuple[Ed25519PrivateKey, bool]:
    """Load the key at `path`, creating it first if absent. Returns (key, created). Two
    processes starting at once (`edge-coordinator serve` and `edge-coordinator key` on a fresh
    state dir) both find it absent; the first to create it wins and the other loads that one,
    so the key a process holds is always the one on disk (the deployment walk once gave
    devices one coordinator key while serve signed with another)."""
    if Path(path).exists():
        return load_private_key(path), False
    key = generate_private_key()
    try:
        save_private_key(path, key, exclusive=True)
    except FileExistsError:
        return load_private_key(path), False
    return key, True
