"""Incremental, bounded decoding of HTTP content codings (gzip, deflate, br, zstd), so that a
compressed response body can be scanned for redaction strings as it streams
(docs/reference/behaviour.md §10). Pure: no I/O.

Bounded: every stage hands its output on in pieces of at most :data:`PIECE` bytes, and one
:meth:`Decoder.feed` may produce at most ``limit`` bytes in all; more is
:class:`DecodedTooLarge` (a decompression bomb: a small chunk that expands hugely must not be
held in memory, and the caller cannot make the upstream wait in the middle of a chunk).
Windows are bounded too: zstd frames asking for a window over 8 MiB are refused (RFC 9659's
limit for HTTP), brotli's is at most 16 MiB by its format, zlib's 32 KiB.
"""

from __future__ import annotations

import sys
import zlib
from collections.abc import Iterable, Iterator
from typing import Final, Protocol

import brotli

if sys.version_info >= (3, 14):  # pragma: no cover
    from compression import zstd
else:
    from backports import zstd

#: Output of one decompression step handed on at a time.
PIECE: Final = 64 * 1024
#: Default bound on what one input chunk may decode to.
DEFAULT_LIMIT: Final = 16 * 1024 * 1024
#: More codings than this on one body is not something a server does: refused.
MAX_CODINGS: Final = 3
_ZSTD_WINDOW_LOG_MAX: Final = 23  # 8 MiB

_ALIASES: Final = {"x-gzip": "gzip"}
SUPPORTED: Final = frozenset({"gzip", "deflate", "br", "zstd"})


class DecodeError(ValueError):
    """The body is not valid in its declared coding (corrupt or truncated)."""


class DecodedTooLarge(DecodeError):
    """One chunk decoded to more than the limit."""


def parse_codings(values: Iterable[str]) -> tuple[str, ...] | None:
    """The ``Content-Encoding`` header values as codings in the order they were applied
    (``identity`` dropped, names lower-cased); None when one is not supported."""
    out: list[str] = []
    for value in values:
        for item in value.split(","):
            name = item.strip().lower()
            if not name or name == "identity":
                continue
            name = _ALIASES.get(name, name)
            if name not in SUPPORTED:
                return None
            out.append(name)
    return tuple(out) if len(out) <= MAX_CODINGS else None


class _Stage(Protocol):
    def feed(self, data: bytes) -> Iterator[bytes]: ...

    def finish(self) -> None: ...


class _Zlib:
    """gzip (members may follow each other) and deflate (zlib-wrapped, or raw as some servers
    send it: told apart by the first two bytes, as browsers do)."""

    def __init__(self, gzip: bool) -> None:
        self._gzip = gzip
        self._d: zlib._Decompress | None = zlib.decompressobj(16 + zlib.MAX_WBITS) if gzip else None
        self._head = b""  # deflate: the first bytes, until the wrapper can be told
        self._started = False

    def _deflate_decoder(self) -> zlib._Decompress | None:
        if len(self._head) < 2:
            return None
        b0, b1 = self._head[0], self._head[1]
        wrapped = b0 & 0x0F == 8 and ((b0 << 8) | b1) % 31 == 0
        return zlib.decompressobj(zlib.MAX_WBITS if wrapped else -zlib.MAX_WBITS)

    def feed(self, data: bytes) -> Iterator[bytes]:
        if not data:
            return
        self._started = True
        if self._d is None:
            self._head += data
            self._d = self._deflate_decoder()
            if self._d is None:
                return
            data, self._head = self._head, b""
        yield from self._run(data)

    def _run(self, data: bytes) -> Iterator[bytes]:
        d = self._d
        assert d is not None
        try:
            while True:
                if d.eof:
                    rest = d.unused_data + data
                    if not (self._gzip and (rest.startswith(b"\x1f\x8b") or rest == b"\x1f")):
                        return  # after the end (padding, garbage): not part of the body, dropped
                    data, d = rest, zlib.decompressobj(16 + zlib.MAX_WBITS)  # the next member
                    self._d = d
                out = d.decompress(data, PIECE)
                data = d.unconsumed_tail
                if out:
                    yield out
                if not data and len(out) < PIECE and not (d.eof and d.unused_data):
                    return
        except zlib.error as exc:
            raise DecodeError(f"{'gzip' if self._gzip else 'deflate'}: corrupt") from exc

    def finish(self) -> None:
        if self._started and (self._d is None or not self._d.eof):
            raise DecodeError(f"{'gzip' if self._gzip else 'deflate'}: truncated")


class _Brotli:
    def __init__(self) -> None:
        self._d = brotli.Decompressor()
        self._started = False

    def feed(self, data: bytes) -> Iterator[bytes]:
        if not data:
            return
        self._started = True
        try:
            if self._d.is_finished():
                return  # bytes after the end: dropped
            out = self._d.process(data, output_buffer_limit=PIECE)
            while True:
                if out:
                    yield out
                if self._d.is_finished() or (self._d.can_accept_more_data() and len(out) < PIECE):
                    return
                out = self._d.process(b"", output_buffer_limit=PIECE)  # more output is waiting
        except brotli.error as exc:
            raise DecodeError("br: corrupt") from exc

    def finish(self) -> None:
        if self._started and not self._d.is_finished():
            raise DecodeError("br: truncated")


def _zstd_decompressor() -> zstd.ZstdDecompressor:
    return zstd.ZstdDecompressor(options={zstd.DecompressionParameter.window_log_max: _ZSTD_WINDOW_LOG_MAX})


class _Zstd:
    """zstd; several frames may follow each other."""

    def __init__(self) -> None:
        self._d = _zstd_decompressor()
        self._started = False

    def feed(self, data: bytes) -> Iterator[bytes]:
        if not data:
            return
        self._started = True
        try:
            while True:
                if self._d.eof:
                    data, self._d = self._d.unused_data + data, _zstd_decompressor()
                    if not data:
                        return
                out = self._d.decompress(data, PIECE)
                data = b""
                if out:
                    yield out
                if self._d.eof:
                    if not self._d.unused_data:
                        return
                elif self._d.needs_input:
                    return
        except (zstd.ZstdError, EOFError) as exc:
            raise DecodeError("zstd: corrupt") from exc

    def finish(self) -> None:
        if self._started and not self._d.eof:
            raise DecodeError("zstd: truncated")


def _stage(coding: str) -> _Stage:
    if coding in ("gzip", "deflate"):
        return _Zlib(gzip=coding == "gzip")
    if coding == "br":
        return _Brotli()
    return _Zstd()


class Decoder:
    """The codings of one body undone in reverse order, chunk by chunk, each chunk's output
    bounded by ``limit`` (every stage's, so a bomb inside a bomb is caught at the first)."""

    def __init__(self, codings: tuple[str, ...], limit: int = DEFAULT_LIMIT) -> None:
        if not codings or any(c not in SUPPORTED for c in codings):
            raise ValueError("codings: not a non-empty tuple of supported codings")
        self._stages = [_stage(c) for c in reversed(codings)]
        self._limit = limit

    def feed(self, chunk: bytes) -> list[bytes]:
        """The decoded pieces of ``chunk`` (possibly none)."""
        pieces = [chunk]
        for stage in self._stages:
            out: list[bytes] = []
            total = 0
            for piece in pieces:
                for part in stage.feed(piece):
                    total += len(part)
                    if total > self._limit:
                        raise DecodedTooLarge(f"one chunk decoded to more than {self._limit} bytes")
                    out.append(part)
            pieces = out
        return pieces

    def finish(self) -> None:
        """The body ended: every stage must have seen its coding's end (else truncated)."""
        for stage in self._stages:
            stage.finish()
