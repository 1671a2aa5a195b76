"""``egressctl ca``: the MITM CA certificate as served by ``GET /v1/mitm/ca``. Pure.

The fingerprint is recomputed here from the PEM (SHA-256 of the DER bytes, lowercase hex)
rather than trusted from the response header: whoever bakes the certificate into sandbox
images gets a value they can compare with ``openssl x509 -fingerprint -sha256``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re

from egressd.cli.client import EXIT_FAILURE, CliError

__all__ = ["CA_PATH", "FINGERPRINT_HEADER", "certificate_der", "fingerprint", "normalise_fingerprint"]

CA_PATH = "/v1/mitm/ca"
FINGERPRINT_HEADER = "X-Egressd-Mitm-Ca-Fingerprint"

_PEM_BLOCK = re.compile(
    r"-----BEGIN CERTIFICATE-----\s*(?P<body>[A-Za-z0-9+/=\s]+?)\s*-----END CERTIFICATE-----"
)


def certificate_der(pem: str) -> bytes:
    """DER bytes of the first ``CERTIFICATE`` block; :class:`CliError` (exit 1) if there is none."""
    match = _PEM_BLOCK.search(pem)
    if match is None:
        raise CliError(f"GET {CA_PATH}: the answer holds no PEM certificate", EXIT_FAILURE)
    try:
        der = base64.b64decode("".join(match.group("body").split()), validate=True)
    except (binascii.Error, ValueError):
        raise CliError(f"GET {CA_PATH}: the PEM certificate is not valid base64", EXIT_FAILURE) from None
    # A DER certificate is a SEQUENCE (0x30): anything else is not a certificate at all.
    if not der or der[0] != 0x30:
        raise CliError(f"GET {CA_PATH}: the PEM block is not a DER certificate", EXIT_FAILURE)
    return der


def fingerprint(der: bytes) -> str:
    """SHA-256 of the DER certificate, lowercase hex without separators."""
    return hashlib.sha256(der).hexdigest()


def normalise_fingerprint(text: str) -> str:
    """``AB:CD:..`` or ``abcd..`` -> ``abcd..`` (for comparing with the daemon's header)."""
    return text.strip().replace(":", "").lower()
