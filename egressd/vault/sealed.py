"""The sealed vault carried in the binding input (docs/reference/behaviour.md §11).

A binding input whose JSON object has the key ``osbEgressInput`` is a *wrapper*::

    {"osbEgressInput": 1, "policy": {...}, "vault": {"v": 1, "kid": "k3", "alg": "A256GCM",
                                                     "ct": "<base64(nonce || ciphertext || tag)>"}}

``ct`` is standard, padded base64 of a 12-byte nonce, the AES-256-GCM ciphertext and its
16-byte tag. The additional authenticated data is the UTF-8 ``sandbox.uid``, so a sealed
vault moved to another sandbox fails to open. The plaintext is the §6 create shape (JSON).

This module provides the pieces; the order of §11 (wrapper JSON -> policy -> AEAD open ->
§6 validation, all before any mutation) is the caller's:

* :func:`is_wrapper` / :func:`parse_wrapper` split a decoded input into policy and vault objects;
* :func:`parse_sealed` validates the vault object into a :class:`Sealed`;
* :func:`open_sealed` decrypts it with a :class:`KeyRing` (:func:`decode_vault_plaintext`
  turns the plaintext into a JSON value for §6);
* :func:`seal` / :func:`build_wrapper` are the producer side (``egressctl vault seal``).

The keys (``EGRESSD_VAULT_KEYS_DIR``, :class:`~egressd.vault.keys.KeyRing`,
:class:`~egressd.vault.keys.KeyStore`) are in :mod:`egressd.vault.keys`.

Every failure of the wrapper or of the sealed object is a :class:`SealError`: permanent,
HTTP 400, never 500. Its message is one line and never contains plaintext, ``ct`` or keys.
Everything here is pure.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, NoReturn

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from egressd.vault.keys import KEY_BYTES, KeyRing, _b64decode_std, valid_kid

__all__ = [
    "ALG",
    "MIN_SEALED_BYTES",
    "NONCE_BYTES",
    "SEALED_VERSION",
    "TAG_BYTES",
    "WRAPPER_MARKER",
    "WRAPPER_VERSION",
    "SealError",
    "Sealed",
    "Wrapper",
    "build_wrapper",
    "decode_vault_plaintext",
    "is_wrapper",
    "open_sealed",
    "parse_sealed",
    "parse_wrapper",
    "seal",
]

WRAPPER_MARKER = "osbEgressInput"
WRAPPER_VERSION = 1
SEALED_VERSION = 1
ALG = "A256GCM"
NONCE_BYTES = 12
TAG_BYTES = 16
MIN_SEALED_BYTES = NONCE_BYTES + TAG_BYTES  # 28: an empty plaintext

_WRAPPER_KEYS = frozenset({WRAPPER_MARKER, "policy", "vault"})
_SEALED_KEYS = frozenset({"v", "kid", "alg", "ct"})


class SealError(ValueError):
    """The wrapper or its sealed vault is unusable: always HTTP 400 (permanent, never 500).

    ``reason`` (= ``str()``) is one line and never carries plaintext, ``ct`` or key material.
    """

    status = 400

    def __init__(self, reason: str) -> None:
        reason = " ".join(reason.split())
        super().__init__(reason)
        self.reason = reason


def _fail(reason: str) -> NoReturn:
    raise SealError(reason) from None


# --------------------------------------------------------------------------- wrapper


class Wrapper(NamedTuple):
    """A decoded wrapper: the raw policy object (for §5), the raw vault object or None, and
    whether the ``vault`` key was present at all (``"vault": null`` and no key both remove
    the vault; callers that care can tell them apart)."""

    policy: object
    vault: object | None
    has_vault_key: bool


def is_wrapper(obj: object) -> bool:
    """A decoded binding input is a wrapper iff it is a JSON object with ``osbEgressInput``."""
    return isinstance(obj, dict) and WRAPPER_MARKER in obj


def parse_wrapper(obj: object) -> Wrapper:
    """Split a decoded wrapper. ``osbEgressInput`` must be the integer 1 (not ``true``, not
    ``1.0``), ``policy`` is required (its content is §5's business), ``vault`` is optional
    and may be null, any other key -> :class:`SealError`. Key names are not echoed."""
    if not isinstance(obj, dict):
        _fail("binding input wrapper must be a JSON object")
    marker = obj.get(WRAPPER_MARKER)
    if type(marker) is not int or marker != WRAPPER_VERSION:
        _fail(f"{WRAPPER_MARKER} must be {WRAPPER_VERSION}")
    if any(key not in _WRAPPER_KEYS for key in obj):
        _fail(f"unknown wrapper key (allowed: {WRAPPER_MARKER}, policy, vault)")
    if "policy" not in obj:
        _fail("wrapper policy is required")
    return Wrapper(obj["policy"], obj.get("vault"), "vault" in obj)


def build_wrapper(policy: object, vault: Mapping[str, Any] | None) -> dict[str, Any]:
    """The wrapper object; ``json.dumps`` of it is the ``binding.input`` string. ``vault`` None
    omits the key (vault removed, policy kept)."""
    doc: dict[str, Any] = {WRAPPER_MARKER: WRAPPER_VERSION, "policy": policy}
    if vault is not None:
        doc["vault"] = dict(vault)
    return doc


# --------------------------------------------------------------------------- sealed object


@dataclass(frozen=True, slots=True)
class Sealed:
    """A validated sealed vault object (``v`` = 1 and ``alg`` = A256GCM are implied)."""

    kid: str
    nonce: bytes = field(repr=False)
    #: ciphertext || 16-byte tag, as AESGCM.decrypt expects it.
    ciphertext: bytes = field(repr=False)


def parse_sealed(obj: object) -> Sealed:
    """Validate ``{"v":1,"kid":…,"alg":"A256GCM","ct":…}`` (exactly these keys, right types).

    ``ct`` must be standard padded base64 of at least 28 bytes. Failures -> :class:`SealError`.
    """
    if not isinstance(obj, dict):
        _fail("vault must be a JSON object (or null)")
    if any(key not in _SEALED_KEYS for key in obj):
        _fail("vault: unknown key (allowed: v, kid, alg, ct)")
    missing = sorted(_SEALED_KEYS.difference(obj))
    if missing:
        _fail(f"vault: missing {', '.join(missing)}")
    _check_version(obj["v"])
    kid = _sealed_kid(obj["kid"])
    _check_alg(obj["alg"])
    blob = _sealed_blob(obj["ct"])
    return Sealed(kid=kid, nonce=blob[:NONCE_BYTES], ciphertext=blob[NONCE_BYTES:])


def _check_version(v: object) -> None:
    if type(v) is not int:
        _fail("vault.v must be an integer")
    if v != SEALED_VERSION:
        _fail(f"vault.v: unsupported version (expected {SEALED_VERSION})")


def _sealed_kid(kid: object) -> str:
    if not isinstance(kid, str):
        _fail("vault.kid must be a string")
    if not valid_kid(kid):
        _fail("vault.kid: invalid (expected 1-64 characters of [A-Za-z0-9._-])")
    return kid


def _check_alg(alg: object) -> None:
    if not isinstance(alg, str):
        _fail("vault.alg must be a string")
    if alg != ALG:
        _fail(f"vault.alg: unsupported algorithm (expected {ALG})")


def _sealed_blob(ct: object) -> bytes:
    """``ct`` decoded: nonce || ciphertext || tag."""
    if not isinstance(ct, str):
        _fail("vault.ct must be a string")
    blob = _b64decode_std(ct)
    if blob is None:
        _fail("vault.ct: not standard padded base64")
    if len(blob) < MIN_SEALED_BYTES:
        _fail(
            f"vault.ct: too short ({len(blob)} bytes; at least {MIN_SEALED_BYTES} = "
            f"{NONCE_BYTES}-byte nonce + {TAG_BYTES}-byte tag)"
        )
    return blob


def _aad(uid: str) -> bytes:
    try:
        return uid.encode("utf-8")
    except UnicodeEncodeError:
        _fail("sandbox uid is not valid UTF-8")


def open_sealed(sealed: Sealed, uid: str, keys: KeyRing) -> bytes:
    """Decrypt with the kid's key and AAD = UTF-8 ``uid``; returns the plaintext bytes.

    Unknown kid, wrong key, another sandbox's uid, a corrupted ciphertext or tag ->
    :class:`SealError` (400). The plaintext is never part of any message.
    """
    key = keys.key(sealed.kid)
    if key is None:
        _fail(f"vault: unknown kid {sealed.kid!r}")
    try:
        return AESGCM(key).decrypt(sealed.nonce, sealed.ciphertext, _aad(uid))
    except InvalidTag:
        _fail(
            "vault: cannot be opened (authentication failed: wrong key, other sandbox uid, or corrupted ct)"
        )


def decode_vault_plaintext(plaintext: bytes) -> object:
    """Opened plaintext -> JSON value (the §6 create shape is validated by the caller)."""
    try:
        return json.loads(plaintext.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        _fail("vault: decrypted content is not UTF-8 JSON")


def seal(plaintext: bytes, uid: str, kid: str, key: bytes) -> dict[str, Any]:
    """Encrypt ``plaintext`` for the sandbox ``uid`` (random 12-byte nonce); returns the
    wrapper's ``vault`` object. Bad kid or key length -> :class:`SealError`."""
    if not valid_kid(kid):
        _fail("kid: invalid (expected 1-64 characters of [A-Za-z0-9._-])")
    if len(key) != KEY_BYTES:
        _fail(f"key must be {KEY_BYTES} bytes")
    nonce = os.urandom(NONCE_BYTES)
    ct = AESGCM(bytes(key)).encrypt(nonce, bytes(plaintext), _aad(uid))
    return {
        "v": SEALED_VERSION,
        "kid": kid,
        "alg": ALG,
        "ct": base64.b64encode(nonce + ct).decode("ascii"),
    }
