"""Ed25519 key files, fingerprints and enrolment codes."""

from __future__ import annotations

import os
import re
import stat

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from edge_agent import keys
from edge_agent.errors import ConfigError, InputError


def test_private_key_round_trip_is_0600_and_signs_the_same(tmp_path):
    key = keys.generate_private_key()
    path = tmp_path / "sub" / "device.key"
    keys.save_private_key(path, key)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    loaded = keys.load_private_key(path)
    assert keys.public_key_bytes(loaded) == keys.public_key_bytes(key)
    sig = loaded.sign(b"hello")
    key.public_key().verify(sig, b"hello")  # raises if the loaded key were different
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


def test_public_key_file_round_trip(tmp_path):
    key = keys.generate_private_key()
    keys.save_public_key(tmp_path / "k.pub", key)
    pub = keys.load_public_key(tmp_path / "k.pub")
    assert keys.fingerprint(pub) == keys.fingerprint(key)


def test_fingerprint_is_a_stable_topic_safe_id_and_differs_per_key():
    a, b = keys.generate_private_key(), keys.generate_private_key()
    fa = keys.fingerprint(a)
    assert fa == keys.fingerprint(a.public_key()) == keys.fingerprint(a)
    assert re.fullmatch(r"[a-z2-7]{24}", fa)
    assert fa != keys.fingerprint(b)
    raw = keys.public_key_bytes(a)
    assert keys.fingerprint(keys.public_key_from_bytes(raw)) == fa


def test_enrolment_code_is_the_fingerprint_prefix_grouped():
    key = keys.generate_private_key()
    code = keys.enrolment_code(key)
    assert re.fullmatch(r"[A-Z2-7]{4}-[A-Z2-7]{4}-[A-Z2-7]{4}", code)
    assert code.replace("-", "").lower() == keys.fingerprint(key)[:12]


def test_loose_permissions_are_refused_like_ssh(tmp_path):
    path = tmp_path / "k.key"
    keys.save_private_key(path, keys.generate_private_key())
    os.chmod(path, 0o644)
    with pytest.raises(keys.KeyFileError, match="too open"):
        keys.load_private_key(path)
    assert keys.load_private_key(path, check_mode=False)  # explicit opt-out still works


@pytest.mark.parametrize("content", [b"", b"not a pem", b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n"])
def test_garbage_key_files_give_a_config_error_naming_the_file(tmp_path, content):
    path = tmp_path / "bad.key"
    path.write_bytes(content)
    os.chmod(path, 0o600)
    with pytest.raises(ConfigError, match="bad.key"):
        keys.load_private_key(path)


def test_oversized_and_missing_key_files_are_refused_before_parsing(tmp_path):
    big = tmp_path / "big.key"
    big.write_bytes(b"A" * (keys.MAX_PEM_BYTES + 1))
    os.chmod(big, 0o600)
    with pytest.raises(keys.KeyFileError, match="not a key file"):
        keys.load_private_key(big)
    with pytest.raises(keys.KeyFileError, match="not found"):
        keys.load_private_key(tmp_path / "absent.key")


def test_non_ed25519_keys_are_refused(tmp_path):
    other = ec.generate_private_key(ec.SECP256R1())
    path = tmp_path / "ec.key"
    path.write_bytes(other.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                         serialization.NoEncryption()))
    os.chmod(path, 0o600)
    with pytest.raises(keys.KeyFileError, match="expected an Ed25519 key"):
        keys.load_private_key(path)
    pub = tmp_path / "ec.pub"
    pub.write_bytes(other.public_key().public_bytes(serialization.Encoding.PEM,
                                                    serialization.PublicFormat.SubjectPublicKeyInfo))
    with pytest.raises(keys.KeyFileError, match="expected an Ed25519 key"):
        keys.load_public_key(pub)


def test_load_or_create_creates_once(tmp_path):
    path = tmp_path / "id.key"
    first, created = keys.load_or_create_private_key(path)
    second, created_again = keys.load_or_create_private_key(path)
    assert created and not created_again
    assert keys.fingerprint(first) == keys.fingerprint(second)


def test_raw_public_key_of_wrong_length_is_an_input_error():
    with pytest.raises(InputError, match="32 bytes"):
        keys.public_key_from_bytes(b"\x01" * 31)


def test_two_processes_creating_the_key_at_once_end_with_the_one_on_disk(tmp_path, monkeypatch):
    """`edge-coordinator serve` and `edge-coordinator key` on a fresh state dir both find no
    key; whichever links its file in second loads the first's instead of replacing it (before,
    the last writer won on disk while the other process kept signing with its own key)."""
    path = tmp_path / "keys" / "coordinator.key"
    theirs = keys.generate_private_key()
    real_generate = keys.generate_private_key

    def generate_while_the_other_process_writes() -> object:
        mine = real_generate()
        keys.save_private_key(path, theirs)  # the other process, between our check and our write
        return mine

    monkeypatch.setattr(keys, "generate_private_key", generate_while_the_other_process_writes)
    got, created = keys.load_or_create_private_key(path)
    assert not created and keys.public_key_bytes(got) == keys.public_key_bytes(theirs)
    assert keys.public_key_bytes(keys.load_private_key(path)) == keys.public_key_bytes(theirs)
    assert [p.name for p in path.parent.iterdir()] == ["coordinator.key"]  # no temp file left behind
    with pytest.raises(FileExistsError):
        keys.save_private_key(path, real_generate(), exclusive=True)
    assert keys.public_key_bytes(keys.load_private_key(path)) == keys.public_key_bytes(theirs)


def test_a_filesystem_without_hard_links_still_creates_the_key_once(tmp_path, monkeypatch):
    import errno

    def no_links(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    path = tmp_path / "device.key"
    first, created = keys.load_or_create_private_key(path)
    assert created and stat.S_IMODE(path.stat().st_mode) == 0o600
    with pytest.raises(FileExistsError):
        keys.save_private_key(path, keys.generate_private_key(), exclusive=True)
    assert keys.fingerprint(keys.load_private_key(path)) == keys.fingerprint(first)
    assert [p.name for p in tmp_path.iterdir()] == ["device.key"]
