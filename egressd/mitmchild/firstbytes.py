"""What a redirected connection's first client bytes are, for the name check
(docs/reference/behaviour.md §18). Pure: bytes in, a classification out.

mitmproxy's own tests decide which layer a connection gets: TLS when the bytes start like a
TLS record (``16 03 00``–``16 03 03``), HTTP when they start with three letters and hold a space
in the first line. What they call neither is relayed as "no name" where no name is needed. But
servers are more lenient than those tests: OpenSSL reads a ClientHello whose record says
``03 04``, HTTP servers skip empty lines and whitespace before a request line and split it on
other whitespace, and serve ``GET /`` without a version. So bytes that are neither by
mitmproxy's tests are looked at again here, and refused when a server could read a name in
them:

* :func:`tls_shaped`: a first byte ``0x16`` (any record version) or an SSLv2-style hello.
* :func:`request_like`: a request line as a lenient server reads it.
* :func:`undecided`: too few bytes to tell yet (mitmproxy asks again when more arrive).
* :func:`after_silence`: the next client bytes of a connection admitted without a name after
  its client stalled (:mod:`egressd.mitmchild.silence`).
"""

from __future__ import annotations

import re
from typing import Final, Literal

from mitmproxy.net.tls import starts_like_tls_record
from mitmproxy.proxy.layers.tls import parse_client_hello

from egressd.mitmchild.intercept import sni_name
from egressd.mitmchild.names import as_name

__all__ = [
    "MAX_HELLO",
    "MAX_UNDECIDED",
    "after_silence",
    "looks_like_http",
    "refusal",
    "request_like",
    "tls_shaped",
    "undecided",
]

#: The longest first line a connection may send before it is decided.
MAX_UNDECIDED: Final = 8192
#: The longest ClientHello held back (after a silence) until it is whole.
MAX_HELLO: Final = 65536

#: What a lenient server skips before a request line, and splits its words on (Python's
#: str.split() on latin-1 text: the ASCII whitespace, the separators 0x1c-0x1f, 0x85, 0xa0).
_SKIP: Final = b" \t\r\n\x0b\x0c\x1c\x1d\x1e\x1f\x85\xa0"
_SEP: Final = rb"[ \t\x0b\x0c\x1c-\x1f\x85\xa0]"
_TOKEN: Final = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]"
#: A method and the start of a target (origin form, ``*``, absolute form), or a method, a
#: target and a version.
_REQUEST: Final = re.compile(
    _TOKEN + rb"+" + _SEP + rb"+(?:[/*]|[A-Za-z][A-Za-z0-9+.\-]*://|[^\s]+" + _SEP + rb"+HTTP/)",
    re.IGNORECASE,
)
#: One line that is not over yet and is text: it could still become a request line.
_OPEN_LINE: Final = re.compile(rb"[\x20-\x7e\t\x0b\x0c\x1c-\x1f\x85\xa0]*")

#: The reasons a connection is refused on its first bytes alone (the name check's own words).
REASON_NO_NAME_HTTP: Final = "host_not_allowed"
REASON_NO_SNI: Final = "no_sni"


def looks_like_http(data: bytes) -> bool:
    """mitmproxy's own test (next_layer): a verb, a space in the first line."""
    first = data.split(b"\n", 1)[0]
    return len(data) >= 3 and data[:3].isalpha() and b" " in first


def tls_shaped(data: bytes) -> bool:
    """A TLS record start whatever its version, or an SSLv2-compatible ClientHello (high bit
    set, message type 1): what a TLS server may read a ClientHello in."""
    if data[:1] == b"\x16":
        return True
    return len(data) >= 3 and data[0] & 0x80 != 0 and data[2] == 0x01


def request_like(data: bytes) -> bool:
    """Could a lenient HTTP server read a request line (so a ``Host``, or its default site) at
    the start of ``data``?"""
    first = data.lstrip(_SKIP).split(b"\n", 1)[0]
    return _REQUEST.match(first) is not None


def _open_line(data: bytes) -> bool:
    """Text with no line end yet (or nothing but skipped bytes): it could still become a
    request line."""
    rest = data.lstrip(_SKIP)
    return len(data) < MAX_UNDECIDED and b"\n" not in rest and _OPEN_LINE.fullmatch(rest) is not None


def undecided(data: bytes) -> bool:
    """Too few bytes to decide: shorter than a TLS record start or its header, or a line of
    text not over yet that is no request line so far."""
    if len(data) < 3:
        return True
    if data[:1] == b"\x16" and len(data) < 5:
        return True
    return not tls_shaped(data) and not request_like(data) and _open_line(data)


def refusal(data: bytes) -> str | None:
    """For bytes mitmproxy's tests call neither TLS nor HTTP (and no longer undecided): the
    reason to refuse them without a name check, or None when they carry no name (SSH, a
    database, a binary protocol)."""
    if tls_shaped(data):
        return REASON_NO_SNI
    if request_like(data) or not data.lstrip(_SKIP):
        return REASON_NO_NAME_HTTP
    return None


Check = (
    tuple[Literal["tls"], str | None]
    | tuple[Literal["hold"], bytes]
    | tuple[Literal["refuse"], str]
    | tuple[Literal["more"], bytes]
    | tuple[Literal["pass"], None]
)


def after_silence(head: bytes, data: bytes, *, holding: bool = False) -> Check:
    """What the client's next bytes ``data`` of a connection admitted without a name need.

    ``head``: its earlier bytes, held back (``holding``: a ClientHello not whole yet) or
    relayed (text that could still start a request line). ``("tls", name)``: name-check the
    whole ClientHello (``head + data``) by its SNI; ``("hold", bytes)``: a ClientHello not whole
    yet, keep it back; ``("refuse", reason)``; ``("more", head)``: relay them and look at the
    next bytes too; ``("pass", None)``: relay this and everything after it."""
    combined = head + data
    if holding or not head:
        if len(combined) < 3 and (combined[:1] == b"\x16" or combined[0] & 0x80):
            return ("hold", combined)  # too short to tell a TLS or SSLv2-style hello yet
        if combined[:1] == b"\x16":
            if len(combined) < 5:
                return ("hold", combined)
            if not starts_like_tls_record(combined):
                return ("refuse", REASON_NO_SNI)  # a record version mitmproxy cannot parse
            try:
                hello = parse_client_hello(combined)
            except ValueError:
                return ("refuse", REASON_NO_SNI)
            if hello is None:
                return ("hold", combined) if len(combined) < MAX_HELLO else ("refuse", REASON_NO_SNI)
            return ("tls", as_name(sni_name(hello.sni)))
        if tls_shaped(combined):
            return ("refuse", REASON_NO_SNI)
    if request_like(combined):
        return ("refuse", REASON_NO_NAME_HTTP)
    if _open_line(combined):
        return ("more", combined)
    return ("pass", None)
