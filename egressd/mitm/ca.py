"""The MITM's certificate authority (docs/reference/configuration.md ``EGRESSD_MITM_CONFDIR``).

If ``<confdir>/mitmproxy-ca.pem`` (private key + certificate, mitmproxy's layout) exists it is
pinned: checked (parses, the key matches, it is a CA) and used as is. Otherwise one is
generated there once and kept, so sandbox images can bake its certificate in. The public
certificate is always written to ``<confdir>/mitmproxy-ca-cert.pem``. The directory is 0700
and the key file 0600: the key never leaves it.
"""

from __future__ import annotations

import datetime
import errno
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

CA_FILE: Final = "mitmproxy-ca.pem"
CERT_FILE: Final = "mitmproxy-ca-cert.pem"


class CaError(Exception):
    """One-line reason the CA cannot be used (never includes key material)."""


@dataclass(frozen=True, slots=True)
class CaInfo:
    pem: str  # the public certificate
    fingerprint: str  # SHA-256 of the DER certificate, lower-case hex
    pinned: bool  # loaded from an existing file (True) or generated now (False)
    confdir: Path


def fingerprint(cert: x509.Certificate) -> str:
    return hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()


def _write_private(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _generate() -> tuple[bytes, x509.Certificate]:
    # mitmproxy signs every leaf with the CA key and reuses that key for the leaves: ECDSA
    # P-256 makes each client handshake cheaper than RSA-2048 (measured in scripts/bench).
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, "egressd MITM CA"),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "egressd"),
        ]
    )
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=2))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )
    return key_pem, cert


def _load(data: bytes) -> x509.Certificate:
    try:
        key = serialization.load_pem_private_key(data, password=None)
        cert = x509.load_pem_x509_certificate(data)
    except (ValueError, TypeError) as exc:
        raise CaError(
            f"{CA_FILE}: not a PEM private key followed by a certificate ({type(exc).__name__})"
        ) from None
    pub = serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(serialization.Encoding.DER, pub) != cert.public_key().public_bytes(
        serialization.Encoding.DER, pub
    ):
        raise CaError(f"{CA_FILE}: the private key does not match the certificate")
    try:
        constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        raise CaError(f"{CA_FILE}: the certificate is not a CA (no basicConstraints)") from None
    if not constraints.ca:
        raise CaError(f"{CA_FILE}: the certificate is not a CA")
    return cert


def _tighten(path: Path, mode: int) -> None:
    if path.stat().st_mode & 0o777 == mode:
        return
    try:
        os.chmod(path, mode)
    except OSError as exc:
        if exc.errno not in (errno.EROFS, errno.EPERM):
            raise


def ensure_ca(confdir: Path) -> CaInfo:
    """Load the pinned CA from ``confdir`` or generate one there once."""
    try:
        confdir.mkdir(parents=True, exist_ok=True, mode=0o700)
        ca_path = confdir / CA_FILE
        pinned = ca_path.exists()
        if pinned:
            cert = _load(ca_path.read_bytes())
            # A pinned CA may sit on a read-only mount (a Kubernetes Secret): its permissions
            # are then the operator's, and only a missing or different public certificate (or
            # mitmproxy's dhparam file) needs a writable directory.
            _tighten(confdir, 0o700)
            _tighten(ca_path, 0o600)
        else:
            os.chmod(confdir, 0o700)
            key_pem, cert = _generate()
            _write_private(ca_path, key_pem + cert.public_bytes(serialization.Encoding.PEM), 0o600)
        pem = cert.public_bytes(serialization.Encoding.PEM)
        cert_path = confdir / CERT_FILE
        if not cert_path.exists() or cert_path.read_bytes() != pem:
            _write_private(cert_path, pem, 0o644)
    except OSError as exc:
        raise CaError(f"{confdir}: {exc.strerror or exc}") from None
    return CaInfo(pem.decode("ascii"), fingerprint(cert), pinned, confdir)
