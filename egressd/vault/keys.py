"""The keys that open sealed vaults (docs/reference/behaviour.md §11): ``EGRESSD_VAULT_KEYS_DIR``.

Keys come from ``EGRESSD_VAULT_KEYS_DIR`` (:func:`load_keys`, or :class:`KeyStore`, which
follows the directory while egressd runs, at most one scan per second, and lets only the newest
key plus the last N=3 decrypt). :class:`KeyRing` is the immutable ``kid -> key`` map that
:func:`egressd.vault.sealed.open_sealed` decrypts with.

Key material never appears in a message, ``repr()`` or log line. Everything here is pure
except :func:`load_keys` (and :class:`KeyStore`, which calls it): the file I/O.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import NamedTuple

import structlog

__all__ = [
    "ACTIVE_KEYS",
    "KEY_BYTES",
    "KEY_SUFFIX",
    "KeyDirError",
    "KeyRing",
    "KeyStore",
    "decode_key",
    "load_keys",
    "valid_kid",
]

KEY_BYTES = 32
KEY_SUFFIX = ".key"

_KID = re.compile(r"[A-Za-z0-9._-]{1,64}")
# Standard alphabet, padded, no whitespace: what Go's base64.StdEncoding produces.
_STD_B64 = re.compile(r"(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?")
# A key file is 32 raw bytes or ~45 bytes of base64; anything much larger is not a key.
_MAX_KEY_FILE = 4096
_KEY_FILE_WHITESPACE = b" \t\r\n\v\f"

log = structlog.get_logger("egressd.vault")


class KeyDirError(Exception):
    """The key directory (or one of its ``<kid>.key`` files) is unusable: a startup error.

    The message names the directory or file and never contains key material.
    """


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


class KeyRing:
    """Immutable ``kid -> 32-byte AES-256 key`` map, ordered oldest -> newest.

    Every key in the ring decrypts (:class:`KeyStore` puts only the newest :data:`ACTIVE_KEYS`
    of the directory in it). :attr:`newest_kid` is the last kid of the order, the one new
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


class _KeyFile(NamedTuple):
    """One usable ``<kid>.key`` file as last read: ``identity`` is what the next scan compares."""

    identity: tuple[int, int, int, int, int]  # (dev, ino, size, mtime_ns, ctime_ns), symlinks followed
    mtime_ns: int
    key: bytes


class _Bad(NamedTuple):
    """A ``.key`` entry ignored at a rescan: what to compare next time and a content-free reason."""

    identity: tuple[int, int, int, int, int] | None
    reason: str


def _identity(st: os.stat_result) -> tuple[int, int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


#: How many keys decrypt: the newest (the one new seals use) plus the last N=3 (§11).
ACTIVE_KEYS = 1 + 3


class _KeyFileProblem(Exception):
    """A ``<kid>.key`` file is unusable: ``short`` is a content-free category for the runtime
    warning, ``detail`` the start-up error's text (never key material)."""

    def __init__(self, short: str, detail: str) -> None:
        super().__init__(detail)
        self.short = short
        self.detail = detail


def _read_key(path: Path) -> _KeyFile:
    """Read and decode one key file. Symlinks are followed (Kubernetes secret volumes use them)."""
    try:
        # O_NONBLOCK: a FIFO named *.key must not hang the start-up (or a rescan).
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise _KeyFileProblem("cannot open", f"cannot open: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _KeyFileProblem("not a regular file", "not a regular file")
        if st.st_size > _MAX_KEY_FILE:
            raise _KeyFileProblem("too large", f"too large ({st.st_size} bytes) to be a key")
        chunks: list[bytes] = []
        total = 0
        while True:
            chunk = os.read(fd, _MAX_KEY_FILE + 1 - total)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > _MAX_KEY_FILE:
                raise _KeyFileProblem("too large", "too large to be a key")
    except OSError as exc:
        raise _KeyFileProblem("cannot read", f"cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    try:
        key = decode_key(b"".join(chunks))
    except ValueError as exc:
        raise _KeyFileProblem(
            f"not a key (expected {KEY_BYTES} raw bytes or base64 of {KEY_BYTES})", str(exc)
        ) from None
    return _KeyFile(_identity(st), st.st_mtime_ns, key)


def _natural(kid: str) -> tuple[tuple[int, int, str], ...]:
    return tuple(
        (1, int(part), "") if part.isdigit() else (0, 0, part) for part in re.split(r"(\d+)", kid) if part
    )


def _newest_last(files: Mapping[str, _KeyFile]) -> list[tuple[str, _KeyFile]]:
    """Oldest first: modification time, then kid with digit runs as numbers, then the kid."""
    return sorted(files.items(), key=lambda item: (item[1].mtime_ns, _natural(item[0]), item[0]))


def _load_files(directory: Path) -> dict[str, _KeyFile]:
    """Every ``<kid>.key`` of ``directory``, strictly: anything unusable -> :class:`KeyDirError`."""
    try:
        names = sorted(entry.name for entry in os.scandir(directory))
    except FileNotFoundError:
        raise KeyDirError(f"vault key directory {directory}: does not exist") from None
    except NotADirectoryError:
        raise KeyDirError(f"vault key directory {directory}: not a directory") from None
    except OSError as exc:
        raise KeyDirError(f"vault key directory {directory}: cannot list: {exc.strerror or exc}") from None
    files: dict[str, _KeyFile] = {}
    for name in names:
        if not name.endswith(KEY_SUFFIX):
            continue
        path = directory / name
        kid = name[: -len(KEY_SUFFIX)]
        if not valid_kid(kid):
            raise KeyDirError(
                f"vault key file {path}: invalid kid (expected <kid>.key with kid of 1-64 [A-Za-z0-9._-])"
            )
        try:
            files[kid] = _read_key(path)
        except _KeyFileProblem as exc:
            raise KeyDirError(f"vault key file {path}: {exc.detail}") from None
    return files


def load_keys(directory: Path) -> KeyRing:
    """Load every ``<directory>/<kid>.key`` file into a :class:`KeyRing` (``EGRESSD_VAULT_KEYS_DIR``).

    Other names are ignored. A ``.key`` entry with an invalid kid, that is not a readable
    regular file, or whose content is not a key (:func:`decode_key`) -> :class:`KeyDirError`
    naming the file; a missing or unreadable directory -> :class:`KeyDirError`. An empty
    directory gives an empty ring (every sealed vault then has an unknown kid).

    Order (hence :attr:`KeyRing.newest_kid`): file modification time, oldest first; ties by
    kid with digit runs compared as numbers, then by the kid string. This is the whole
    directory; the daemon's :class:`KeyStore` only lets the newest :data:`ACTIVE_KEYS` decrypt.
    """
    return KeyRing((kid, f.key) for kid, f in _newest_last(_load_files(directory)))


class KeyStore:
    """The fleet's key directory, kept in step with the files while egressd runs (§11).

    * **Start-up** (the constructor) is strict: a missing directory or any unusable
      ``<kid>.key`` raises :class:`KeyDirError` (``None``: no keys, never scanned).
    * **Rescans** happen in :meth:`refresh`, which every :meth:`lookup` calls (so every AEAD
      open checks) but which does the file I/O at most once per ``rescan_interval`` whatever
      the kids asked for, so a flood of unknown kids costs at most one scan per interval. A
      scan ``stat``\\ s every ``*.key`` entry (following symlinks: Kubernetes secret volumes)
      and re-reads only entries whose (device, inode, size, mtime, ctime) changed; the ring is
      rebuilt from what is present *now*, so a removed file stops decrypting at the first
      open after the next scan (at most ``rescan_interval`` late).
    * **Which keys decrypt**: only the newest :data:`ACTIVE_KEYS` (= the newest plus the last
      N=3) of the usable files. "Newest" = file modification time (nanoseconds, symlinks
      followed), ties broken by kid with digit runs compared as numbers (``k10`` after
      ``k9``), then by the plain kid string: deterministic. Older present files are refused
      exactly like an unknown kid.
    * **A file that becomes unusable while running** (bad length or base64, not a regular
      file, unreadable, bad kid name) is ignored, i.e. it does not decrypt and does not count
      towards the window, with one ``vault.key_ignored`` warning naming only the kid (again
      only when that file changes). A directory that disappears empties the ring (its keys
      were removed); any other listing error keeps the previous ring, warns, and is retried
      at the next interval (a transient EMFILE must not turn valid vaults into permanent 400s).

    :meth:`refresh` may run in a worker thread (:meth:`refresh_async`): the ring is replaced by
    one assignment, and a scan already running makes a concurrent call return at once.
    """

    def __init__(
        self,
        directory: Path | None,
        *,
        rescan_interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        active: int = ACTIVE_KEYS,
    ) -> None:
        self.directory = directory
        self.rescan_interval = rescan_interval
        self.active = active
        self._clock = clock
        self._lock = threading.Lock()
        self._files: dict[str, _KeyFile] = {}
        self._bad: dict[str, _Bad] = {}
        #: Number of directory scans after the start-up load (tests count them).
        self.scans = 0
        #: Reason of the last failed directory listing, None when the last scan listed it.
        self.last_error: str | None = None
        if directory is None:
            self._ring = KeyRing.empty()
        else:
            self._files = _load_files(directory)
            self._ring = self._window()
        self._last_scan = clock()

    @property
    def ring(self) -> KeyRing:
        """The keys that decrypt now (at most :attr:`active`, oldest first)."""
        return self._ring

    @property
    def ignored(self) -> Mapping[str, str]:
        """``kid -> reason`` of the ``.key`` files the last scan ignored (reasons carry no content)."""
        return MappingProxyType({kid: bad.reason for kid, bad in self._bad.items()})

    def due(self) -> bool:
        """A rescan would run now (cheap: no I/O)."""
        return self.directory is not None and self._clock() - self._last_scan >= self.rescan_interval

    def lookup(self, kid: str) -> KeyRing:
        """The ring to open a vault sealed with ``kid``, rescanned first when one is due.

        Every open goes through here, known kid or not: a removed or retired key must stop
        decrypting even while only known kids are asked for.
        """
        self.refresh()
        return self._ring

    async def refresh_async(self) -> None:
        """:meth:`refresh` in a worker thread when one is due: keeps the event loop (DNS) free
        of the directory's file I/O, which on a slow volume could take a while."""
        if self.due():
            await asyncio.to_thread(self.refresh)

    def refresh(self) -> bool:
        """Rescan the directory if the last scan is at least ``rescan_interval`` old; True when
        a scan ran. Never raises for the directory's content (see the class docs)."""
        if self.directory is None or not self._lock.acquire(blocking=False):
            return False
        try:
            now = self._clock()
            if now - self._last_scan < self.rescan_interval:
                return False
            # Stamped before the I/O: a scan that fails still counts against the rate limit.
            self._last_scan = now
            self.scans += 1
            self._scan(self.directory)
            return True
        finally:
            self._lock.release()

    def _scan(self, directory: Path) -> None:
        try:
            names = sorted(entry.name for entry in os.scandir(directory))
        except (FileNotFoundError, NotADirectoryError):
            names = []  # the directory itself was removed: so were its keys
            self.last_error = f"vault key directory {directory}: does not exist"
        except OSError as exc:
            self.last_error = f"vault key directory {directory}: cannot list: {exc.strerror or exc}"
            log.warning("vault.keys_unlisted", error=self.last_error[:300])
            return
        else:
            self.last_error = None
        files: dict[str, _KeyFile] = {}
        bad: dict[str, _Bad] = {}
        for name in names:
            if not name.endswith(KEY_SUFFIX):
                continue
            kid = name[: -len(KEY_SUFFIX)]
            outcome = self._check(directory / name, kid)
            if outcome is None:
                continue
            if isinstance(outcome, _KeyFile):
                files[kid] = outcome
                continue
            if self._bad.get(kid) != outcome:
                # Once per change of the file, and only the kid: never content or lengths.
                log.warning(
                    "vault.key_ignored", kid=kid if valid_kid(kid) else ascii(kid)[:80], reason=outcome.reason
                )
            bad[kid] = outcome
        before = self._ring.kids
        self._files, self._bad = files, bad
        self._ring = self._window()
        if self._ring.kids != before:
            log.info(
                "vault.keys_changed",
                active=list(self._ring.kids),
                retired=sorted(set(files) - set(self._ring.kids)),
            )

    def _check(self, path: Path, kid: str) -> _KeyFile | _Bad | None:
        """The entry's state; None = absent (removed since the listing, or a dangling symlink)."""
        if not valid_kid(kid):
            return _Bad(None, "invalid kid name")
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None  # not a warning: a rotation that removes the file races the listing
        except OSError:
            return _Bad(None, "cannot stat")
        ident = _identity(st)
        known = self._files.get(kid)
        if known is not None and known.identity == ident:
            return known  # unchanged: not read again
        previous = self._bad.get(kid)
        if previous is not None and previous.identity == ident:
            return previous
        try:
            return _read_key(path)
        except _KeyFileProblem as exc:
            return _Bad(ident, exc.short)

    def _window(self) -> KeyRing:
        ordered = _newest_last(self._files)
        newest = ordered[-self.active :] if self.active > 0 else []
        return KeyRing((kid, f.key) for kid, f in newest)
