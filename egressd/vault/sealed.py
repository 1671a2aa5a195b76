"""The sealed vault carried in the binding input (BEHAVIOUR.md §11).

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

Keys come from ``EGRESSD_VAULT_KEYS_DIR`` (:func:`load_keys`, or :class:`KeyStore` which also
rescans the directory, at most once per interval, when a kid is unknown).

Every failure of the wrapper or of the sealed object is a :class:`SealError`: permanent,
HTTP 400, never 500. Its message is one line and never contains plaintext, ``ct`` or keys.
Everything here is pure except :func:`load_keys` (and :class:`KeyStore`, which calls it).
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
import stat
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple, NoReturn

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

__all__ = [
    "ALG",
    "KEY_BYTES",
    "KEY_SUFFIX",
    "MIN_SEALED_BYTES",
    "NONCE_BYTES",
    "SEALED_VERSION",
    "TAG_BYTES",
    "WRAPPER_MARKER",
    "WRAPPER_VERSION",
    "KeyDirError",
    "KeyRing",
    "KeyStore",
    "SealError",
    "Sealed",
    "Wrapper",
    "build_wrapper",
    "decode_key",
    "decode_vault_plaintext",
    "is_wrapper",
    "load_keys",
    "open_sealed",
    "parse_sealed",
    "parse_wrapper",
    "seal",
    "valid_kid",
]

WRAPPER_MARKER = "osbEgressInput"
WRAPPER_VERSION = 1
SEALED_VERSION = 1
ALG = "A256GCM"
KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
MIN_SEALED_BYTES = NONCE_BYTES + TAG_BYTES  # 28: an empty plaintext
KEY_SUFFIX = ".key"

_WRAPPER_KEYS = frozenset({WRAPPER_MARKER, "policy", "vault"})
_SEALED_KEYS = frozenset({"v", "kid", "alg", "ct"})
_KID = re.compile(r"[A-Za-z0-9._-]{1,64}")
# Standard alphabet, padded, no whitespace: what Go's base64.StdEncoding produces.
_STD_B64 = re.compile(r"(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?")
# A key file is 32 raw bytes or ~45 bytes of base64; anything much larger is not a key.
_MAX_KEY_FILE = 4096
_KEY_FILE_WHITESPACE = b" \t\r\n\v\f"


class SealError(ValueError):
    """The wrapper or its sealed vault is unusable: always HTTP 400 (permanent, never 500).

    ``reason`` (= ``str()``) is one line and never carries plaintext, ``ct`` or key material.
    """

    status = 400

    def __init__(self, reason: str) -> None:
        reason = " ".join(reason.split())
        super().__init__(reason)
        self.reason = reason


class KeyDirError(Exception):
    """The key directory (or one of its ``<kid>.key`` files) is unusable: a startup error.

    The message names the directory or file and never contains key material.
    """


def _fail(reason: str) -> NoReturn:
    raise SealError(reason) from None


def valid_kid(kid: object) -> bool:
    """``kid`` is a string of 1..64 characters from ``[A-Za-z0-9._-]``."""
    return isinstance(kid, str) and _KID.fullmatch(kid) is not None


def _b64decode_std(text: str) -> bytes | None:
    """Strict standard padded base64 -> bytes; None when ``text`` is not that."""
    if not text.isascii() or _STD_B64.fullmatch(text) is None:
        return None
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):  # pragma: no cover - excluded by the pattern
        return None


# --------------------------------------------------------------------------- keys


class KeyRing:
    """Immutable ``kid -> 32-byte AES-256 key`` map, ordered oldest -> newest.

    Every key in the ring decrypts (rotation keeps old kids decrypt-only for as long as their
    files stay in the directory). :attr:`newest_kid` is the last kid of the order, the one new
    seals should use; :func:`load_keys` orders by file modification time (then by kid, with
    digit runs compared numerically, so ``k10`` is newer than ``k9`` when the times are equal).
    """

    __slots__ = ("_keys", "_order")

    _keys: Mapping[str, bytes]
    _order: tuple[str, ...]

    def __init__(self, entries: Iterable[tuple[str, bytes]] = ()) -> None:
        """``entries`` = ``(kid, key)`` pairs, oldest first. Bad kid, bad length or duplicate -> ValueError."""
        keys: dict[str, bytes] = {}
        for kid, key in entries:
            if not valid_kid(kid):
                raise ValueError("invalid kid (expected 1-64 characters of [A-Za-z0-9._-])")
            if not isinstance(key, bytes | bytearray) or len(key) != KEY_BYTES:
                raise ValueError(f"key {kid!r} must be {KEY_BYTES} bytes")
            if kid in keys:
                raise ValueError(f"duplicate kid {kid!r}")
            keys[kid] = bytes(key)
        object.__setattr__(self, "_keys", MappingProxyType(keys))
        object.__setattr__(self, "_order", tuple(keys))

    @classmethod
    def empty(cls) -> KeyRing:
        return cls()

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("KeyRing is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("KeyRing is immutable")

    @property
    def kids(self) -> tuple[str, ...]:
        """All kids, oldest first."""
        return self._order

    @property
    def newest_kid(self) -> str | None:
        """The kid new seals should use (last in the order); None for an empty ring."""
        return self._order[-1] if self._order else None

    def key(self, kid: str) -> bytes | None:
        return self._keys.get(kid)

    def __contains__(self, kid: object) -> bool:
        return kid in self._keys

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[str]:
        return iter(self._order)

    def __repr__(self) -> str:  # never the key bytes
        return f"KeyRing(kids={list(self._order)!r})"


def decode_key(data: bytes) -> bytes:
    """A key file's content -> the 32-byte key.

    Exactly 32 bytes are taken raw; anything else must be, after trimming ASCII whitespace,
    standard padded base64 of exactly 32 bytes. Otherwise ValueError (message without content).
    """
    if len(data) == KEY_BYTES:
        return bytes(data)
    text = data.strip(_KEY_FILE_WHITESPACE)
    try:
        decoded = _b64decode_std(text.decode("ascii"))
    except UnicodeDecodeError:
        decoded = None
    if decoded is None:
        raise ValueError(
            f"expected {KEY_BYTES} raw bytes or standard base64 of {KEY_BYTES} bytes "
            f"(file has {len(data)} bytes)"
        )
    if len(decoded) != KEY_BYTES:
        raise ValueError(f"base64 decodes to {len(decoded)} bytes, expected {KEY_BYTES}")
    return decoded


def _read_key_file(path: Path) -> tuple[bytes, int]:
    """(content, mtime_ns). Symlinks are followed (Kubernetes secret volumes use them)."""
    try:
        # O_NONBLOCK: a FIFO named *.key must not hang the start-up.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise KeyDirError(f"vault key file {path}: cannot open: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise KeyDirError(f"vault key file {path}: not a regular file")
        if st.st_size > _MAX_KEY_FILE:
            raise KeyDirError(f"vault key file {path}: too large ({st.st_size} bytes) to be a key")
        chunks: list[bytes] = []
        total = 0
        while True:
            chunk = os.read(fd, _MAX_KEY_FILE + 1 - total)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > _MAX_KEY_FILE:
                raise KeyDirError(f"vault key file {path}: too large to be a key")
        return b"".join(chunks), st.st_mtime_ns
    except OSError as exc:
        raise KeyDirError(f"vault key file {path}: cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def _natural(kid: str) -> tuple[tuple[int, int, str], ...]:
    return tuple(
        (1, int(part), "") if part.isdigit() else (0, 0, part) for part in re.split(r"(\d+)", kid) if part
    )


def load_keys(directory: Path) -> KeyRing:
    """Load ``<directory>/<kid>.key`` files into a :class:`KeyRing` (``EGRESSD_VAULT_KEYS_DIR``).

    Other names are ignored. A ``.key`` entry with an invalid kid, that is not a readable
    regular file, or whose content is not a key (:func:`decode_key`) -> :class:`KeyDirError`
    naming the file; a missing or unreadable directory -> :class:`KeyDirError`. An empty
    directory gives an empty ring (every sealed vault then has an unknown kid).

    Order (hence :attr:`KeyRing.newest_kid`): file modification time, oldest first; ties by
    kid with digit runs compared as numbers. Rotation = drop a new ``<kid>.key`` in the
    directory (it becomes the newest), remove the old file once nothing sealed with it is live.
    """
    try:
        names = sorted(entry.name for entry in os.scandir(directory))
    except FileNotFoundError:
        raise KeyDirError(f"vault key directory {directory}: does not exist") from None
    except NotADirectoryError:
        raise KeyDirError(f"vault key directory {directory}: not a directory") from None
    except OSError as exc:
        raise KeyDirError(f"vault key directory {directory}: cannot list: {exc.strerror or exc}") from None
    found: list[tuple[int, tuple[tuple[int, int, str], ...], str, bytes]] = []
    for name in names:
        if not name.endswith(KEY_SUFFIX):
            continue
        path = directory / name
        kid = name[: -len(KEY_SUFFIX)]
        if not valid_kid(kid):
            raise KeyDirError(
                f"vault key file {path}: invalid kid (expected <kid>.key with kid of 1-64 [A-Za-z0-9._-])"
            )
        data, mtime_ns = _read_key_file(path)
        try:
            key = decode_key(data)
        except ValueError as exc:
            raise KeyDirError(f"vault key file {path}: {exc}") from None
        found.append((mtime_ns, _natural(kid), kid, key))
    found.sort(key=lambda item: (item[0], item[1], item[2]))
    return KeyRing((kid, key) for _, _, kid, key in found)


class KeyStore:
    """The fleet's key directory with on-demand rescans (§11 PROPOSED: rescan on unknown kid, ≤1/s).

    The constructor loads the directory (``None``: no keys, never rescanned) and raises
    :class:`KeyDirError` for the start-up. Later rescans that fail keep the previous ring and
    record the reason in :attr:`last_error`. A successful rescan replaces the ring, so a
    removed key file stops decrypting.
    """

    def __init__(
        self,
        directory: Path | None,
        *,
        rescan_interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.directory = directory
        self.rescan_interval = rescan_interval
        self._clock = clock
        self._ring = load_keys(directory) if directory is not None else KeyRing.empty()
        self._last_scan = clock()
        self.last_error: str | None = None

    @property
    def ring(self) -> KeyRing:
        return self._ring

    def lookup(self, kid: str) -> KeyRing:
        """The ring to open a vault sealed with ``kid``: rescans first when ``kid`` is unknown
        and the last scan is at least ``rescan_interval`` seconds old."""
        if kid in self._ring or self.directory is None:
            return self._ring
        now = self._clock()
        if now - self._last_scan < self.rescan_interval:
            return self._ring
        self._last_scan = now
        try:
            self._ring = load_keys(self.directory)
            self.last_error = None
        except KeyDirError as exc:
            self.last_error = str(exc)
        return self._ring


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
    v = obj["v"]
    if type(v) is not int:
        _fail("vault.v must be an integer")
    if v != SEALED_VERSION:
        _fail(f"vault.v: unsupported version (expected {SEALED_VERSION})")
    kid = obj["kid"]
    if not isinstance(kid, str):
        _fail("vault.kid must be a string")
    if not valid_kid(kid):
        _fail("vault.kid: invalid (expected 1-64 characters of [A-Za-z0-9._-])")
    alg = obj["alg"]
    if not isinstance(alg, str):
        _fail("vault.alg must be a string")
    if alg != ALG:
        _fail(f"vault.alg: unsupported algorithm (expected {ALG})")
    ct = obj["ct"]
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
    return Sealed(kid=kid, nonce=blob[:NONCE_BYTES], ciphertext=blob[NONCE_BYTES:])


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
