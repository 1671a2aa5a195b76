"""Redaction of credential strings from what an upstream sends back (docs/reference/behaviour.md §10).

Pure and I/O-free. One implementation for every place a redaction string may come back to a
sandbox: response header values and trailers, response bodies (buffered or streamed, after
content decoding) and WebSocket messages.

Semantics (the same for a whole text and for any split of it into chunks): every occurrence of
every redaction string is found on the original bytes, overlapping or nested occurrences are
merged into one span, and each span becomes one :data:`MARKER`. So ``Bearer <v>`` is one marker
(not ``Bearer [REDACTED]``), no part of a value survives an overlap, and the marker is never
rescanned.

Streaming (:class:`StreamRedactor`): a chunk's bytes are released as soon as no redaction string
can start in them and end beyond the data seen so far. Only the longest tail of the data that is
the beginning of some redaction string is held back (at most ``len(longest) - 1`` bytes), so an
event that ends in bytes no redaction string starts with (``"\\n\\n"`` of a server-sent event)
is released whole, at once: redaction adds no latency to a stream, and memory is that carry-over
window plus one chunk, never the body.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final

#: What every span of redaction strings becomes.
MARKER: Final = b"[REDACTED]"
#: How many distinct redaction sets keep their compiled form (one per vault revision in use).
_COMPILED_CACHE: Final = 256


@dataclass(frozen=True, slots=True)
class Needles:
    """A redaction set compiled for byte search: the strings as UTF-8, longest first; for each
    first byte the strings that start with it (the carry-over check); and the search plan: the
    strings that contain no other one (``roots``, searched in the data) and, for each root, the
    longer strings that contain it at a known offset (checked only where the root occurs:
    ``Bearer <v>`` costs no scan of its own beside ``<v>``)."""

    strings: tuple[bytes, ...] = field(repr=False)
    by_first: dict[int, tuple[bytes, ...]] = field(repr=False)
    longest: int
    roots: tuple[tuple[bytes, tuple[tuple[bytes, int], ...]], ...] = field(repr=False, default=())

    def __repr__(self) -> str:  # never the values
        return f"Needles(<{len(self.strings)} redacted>, longest={self.longest})"

    def __bool__(self) -> bool:
        return bool(self.strings)


@functools.lru_cache(maxsize=_COMPILED_CACHE)
def _compile(redactions: tuple[str, ...]) -> Needles:
    strings = sorted(
        {r.encode("utf-8", "surrogateescape") for r in redactions if r}, key=lambda b: (-len(b), b)
    )
    by_first: dict[int, list[bytes]] = {}
    for s in strings:
        by_first.setdefault(s[0], []).append(s)
    # Shortest first: a string's root is the first shorter string found inside it.
    roots: dict[bytes, list[tuple[bytes, int]]] = {}
    for s in sorted(strings, key=lambda b: (len(b), b)):
        inner = next((r for r in roots if r in s), None)
        if inner is None:
            roots[s] = []
        else:
            roots[inner].append((s, s.index(inner)))
    return Needles(
        strings=tuple(strings),
        by_first={k: tuple(v) for k, v in by_first.items()},
        longest=max((len(s) for s in strings), default=0),
        roots=tuple((r, tuple(d)) for r, d in roots.items()),
    )


def compile_needles(redactions: Iterable[str]) -> Needles:
    """The compiled form of a redaction set (cached: a snapshot's set is compiled once)."""
    return _compile(tuple(redactions))


def _matches(buf: bytes, needles: Needles, limit: int) -> list[tuple[int, int]]:
    """Every occurrence ``(start, end)`` in ``buf`` that starts before ``limit``, sorted. Only
    the roots are searched; a string containing a root can only occur around one of its
    occurrences (``buf`` holds at most the longest string past ``limit``: searched whole)."""
    spans: list[tuple[int, int]] = []
    for root, outer in needles.roots:
        i = buf.find(root)
        while i >= 0:
            if i < limit:
                spans.append((i, i + len(root)))
            for s, offset in outer:
                start = i - offset
                if 0 <= start < limit and buf.startswith(s, start):
                    spans.append((start, start + len(s)))
            i = buf.find(root, i + 1)
    spans.sort()
    return spans


def _hold_from(buf: bytes, needles: Needles) -> int:
    """The first position whose rest of ``buf`` is a proper beginning of some redaction string
    (a string that may still complete with the next chunk); ``len(buf)`` when there is none."""
    n = len(buf)
    tail = max(0, n - needles.longest + 1)
    hold = n
    for first, candidates in needles.by_first.items():
        p = buf.find(first, tail, hold)
        while p >= 0:
            rest = buf[p:]
            if any(len(s) > len(rest) and s.startswith(rest) for s in candidates):
                hold = p  # the earliest for this first byte; later bytes only look before it
                break
            p = buf.find(first, p + 1, hold)
    return hold


class StreamRedactor:
    """Redacts one byte stream chunk by chunk: ``feed`` each chunk, then ``finish`` once.

    The concatenation of every output equals :func:`redact_bytes` of the concatenated input,
    however the input was split (tests/unit/mitm/test_mitm_redact.py checks every split)."""

    __slots__ = ("_cover_end", "_needles", "_pending")

    def __init__(self, needles: Needles) -> None:
        self._needles = needles
        self._pending = b""  # held back: may be the beginning of a redaction string
        # How far (relative to the start of ``_pending``) the last marker's span reaches: bytes
        # before it are covered by a marker already written; a match starting before it extends
        # that span instead of writing another marker.
        self._cover_end = 0

    def feed(self, chunk: bytes) -> bytes:
        """The bytes that are now decided (possibly ``b""``)."""
        if not self._needles:
            return chunk
        if not chunk:
            return b""
        buf = self._pending + chunk if self._pending else chunk
        return self._release(buf, _hold_from(buf, self._needles))

    def finish(self) -> bytes:
        """Everything still held back (the stream ended: no string can complete any more)."""
        buf, self._pending = self._pending, b""
        if not buf:
            self._cover_end = 0
            return b""
        return self._release(buf, len(buf))

    @property
    def held(self) -> int:
        """Bytes held back right now (at most ``len(longest redaction string) - 1``)."""
        return len(self._pending)

    def _release(self, buf: bytes, hold: int) -> bytes:
        """Write out ``buf[:hold]`` (every match starting there is complete), keep the rest."""
        out: list[bytes] = []
        cover_end = self._cover_end
        plain = 0  # the first byte neither written nor covered by a marker
        for start, end in _matches(buf, self._needles, hold):
            if start < cover_end:  # overlaps the current span: one marker for both
                cover_end = max(cover_end, end)
                continue
            plain = max(plain, cover_end)
            if start > plain:
                out.append(buf[plain:start])
            out.append(MARKER)
            plain, cover_end = start, end
        plain = max(plain, cover_end)
        if plain < hold:
            out.append(buf[plain:hold])
        self._pending = buf[hold:]
        # The span may reach into the held-back bytes (they are covered, never written).
        self._cover_end = max(0, cover_end - hold)
        return b"".join(out)


def redact_bytes(data: bytes, needles: Needles) -> bytes:
    """``data`` with every span of redaction strings replaced by one :data:`MARKER`."""
    if not needles or not data:
        return data
    r = StreamRedactor(needles)
    return r.feed(data) + r.finish()


def redact_str(text: str, redactions: Sequence[str] | Needles) -> str:
    """:func:`redact_bytes` for a header value or any other text (UTF-8, lone surrogates kept
    as mitmproxy decodes header bytes)."""
    needles = redactions if isinstance(redactions, Needles) else compile_needles(redactions)
    if not needles or not text:
        return text
    raw = text.encode("utf-8", "surrogateescape")
    out = redact_bytes(raw, needles)
    return text if out == raw else out.decode("utf-8", "surrogateescape")
