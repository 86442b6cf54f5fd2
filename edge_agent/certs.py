"""X.509 certificates for the fleet broker's TLS listener (mosquitto, client certificates).

mosquitto's `use_identity_as_username true` makes a client's certificate CN its username,
and the ACL grants each device only `.../devices/<CN>/...`. So the CN of a device
certificate IS its device id, and the coordinator's CN is `coordinator`. Each worker of a
`serve --workers-group` has its own, `coordinator-<worker id>`: the CN is also the client
id, and two connections with one certificate replace each other at the broker.

Keys are EC P-256 (small and fast on a Pi Zero); private keys are written 0600 through the
crash-safe writer and never overwritten unless asked.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path

from .atomic import atomic_write_bytes
from .errors import ConfigError, InputError

_CN_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
COORDINATOR_CN = "coordinator"
WORKER_CN_PREFIX = "coordinator-"
# serve's --worker-id (workers.GROUP_RE), short enough that the CN stays within 64 characters
_WORKER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,51}$")


def worker_cn(worker_id: str) -> str:
    """The certificate CN (and MQTT user and client id) of serve worker `worker_id`."""
    if not _WORKER_RE.match(worker_id):
        raise InputError(f"worker id {worker_id[:80]!r}: 1-52 letters, digits, '_' or '-' (what `serve "
                         "--worker-id` takes), starting with a letter or digit")
    return WORKER_CN_PREFIX + worker_id


def is_coordinator_name(name: str) -> bool:
    """The coordinator's CN or a worker's: names the ACL gives every device's topics."""
    return name == COORDINATOR_CN or name.startswith(WORKER_CN_PREFIX)


@dataclass
class Issued:
    cert: Path
    key: Path


def _x509():
    # Imported lazily: the daemon never needs to issue certificates.
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    return x509, hashes, serialization, ec, ExtendedKeyUsageOID, NameOID


def _write_key(path: Path, key, *, overwrite: bool) -> None:  # noqa: ANN001 - cryptography type
    _, _, serialization, _, _, _ = _x509()
    if path.exists() and not overwrite:
        raise ConfigError(f"{path} exists; refusing to overwrite a private key (use --force)")
    atomic_write_bytes(path, key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
        mode=0o600)


def _load(ca_dir: Path):  # noqa: ANN202
    x509, _, serialization, _, _, _ = _x509()
    try:
        cert = x509.load_pem_x509_certificate((ca_dir / "ca.pem").read_bytes())
        key = serialization.load_pem_private_key((ca_dir / "ca.key").read_bytes(), password=None)
    except FileNotFoundError as exc:
        raise ConfigError(f"no CA in {ca_dir}: run `edge-coordinator certs init` first ({exc.filename})") from exc
    except ValueError as exc:
        raise InputError(f"CA files in {ca_dir} are not valid PEM: {exc}") from exc
    return cert, key


def create_ca(out_dir: str | Path, *, name: str = "edge-agent fleet CA", days: int = 3650,
              overwrite: bool = False) -> Issued:
    x509, hashes, serialization, ec, _, NameOID = _x509()
    out = Path(out_dir)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .sign(key, hashes.SHA256())
    )
    _write_key(out / "ca.key", key, overwrite=overwrite)
    atomic_write_bytes(out / "ca.pem", cert.public_bytes(serialization.Encoding.PEM))
    return Issued(out / "ca.pem", out / "ca.key")


def issue(ca_dir: str | Path, common_name: str, *, out_dir: str | Path | None = None, server: bool = False,
          hosts: list[str] | None = None, days: int = 825, overwrite: bool = False) -> Issued:
    """Issue a client certificate (CN = device id or `coordinator`) or a broker server
    certificate (`server=True`, SANs from `hosts`: DNS names or IP addresses)."""
    if not _CN_RE.match(common_name):
        raise InputError(f"certificate name {common_name!r}: use letters, digits, '.', '_' or '-' "
                         "(it becomes the MQTT username and a topic level)")
    x509, hashes, serialization, ec, ExtendedKeyUsageOID, NameOID = _x509()
    ca_dir = Path(ca_dir)
    out = Path(out_dir) if out_dir else ca_dir
    ca_cert, ca_key = _load(ca_dir)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(
            [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    )
    if server:
        names: list[x509.GeneralName] = []
        for host in hosts or [common_name]:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    stem = "server" if server else common_name
    _write_key(out / f"{stem}.key", key, overwrite=overwrite)
    atomic_write_bytes(out / f"{stem}.pem", cert.public_bytes(serialization.Encoding.PEM))
    return Issued(out / f"{stem}.pem", out / f"{stem}.key")
