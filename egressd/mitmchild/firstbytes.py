"""What a redirected connection's first client bytes are, for the name check
(docs/reference/behaviour.md §18). Pure: bytes in, a classification out.

* :func:`undecided`: too few bytes to tell TLS or an HTTP request line from anything else.
* :func:`looks_like_http`: mitmproxy's own test (a verb, a space in the first line).
* :func:`disguised_http`: a request line behind empty lines. HTTP/1.1 servers skip empty lines
  before a request line (RFC 9112 §2.2), mitmproxy's test does not: relayed as "neither TLS nor
  HTTP", its ``Host`` would never be checked. Such a connection is refused.
* :func:`after_silence`: the first bytes of a connection admitted without a name after its
  client stayed silent (:mod:`egressd.mitmchild.silence`).
"""

from __future__ import annotations

from typing import Final, Literal

from mitmproxy.net.tls import starts_like_tls_record
from mitmproxy.proxy.layers.tls import parse_client_hello

from egressd.mitmchild.intercept import sni_name
from egressd.mitmchild.names import as_name

__all__ = ["MAX_UNDECIDED", "after_silence", "disguised_http", "looks_like_http", "undecided"]

#: The longest first line a connection may send before it is decided not to be HTTP.
MAX_UNDECIDED: Final = 8192
_BLANK: Final = b"\r\n"

#: The reasons a connection is refused on its first bytes alone (the name check's own words).
REASON_NO_NAME_HTTP: Final = "host_not_allowed"
REASON_NO_SNI: Final = "no_sni"


def looks_like_http(data: bytes) -> bool:
    """mitmproxy's own test (next_layer): a verb, a space in the first line."""
    first = data.split(b"\n", 1)[0]
    return len(data) >= 3 and data[:3].isalpha() and b" " in first


def undecided(data: bytes) -> bool:
    """Could more bytes still make ``data`` a TLS record or an HTTP request line? (Fewer than
    the three bytes a TLS record start needs, only empty lines so far, or letters with no line
    end yet.)"""
    if len(data) >= MAX_UNDECIDED:
        return False
    rest = data.lstrip(_BLANK)
    if len(data) < 3 or not rest:
        return True
    if data[:1] == b"\x16" and len(data) < 5:
        return True
    return b"\n" not in rest and b" " not in rest and rest.isalpha()


def _request_line_start(rest: bytes) -> bool:
    """``rest`` is a request line, or the start of one (letters, then a space or nothing yet)."""
    first = rest.split(b"\n", 1)[0]
    head = first.split(b" ", 1)[0]
    return head.isalpha() and (b" " in first or first == rest)


def disguised_http(data: bytes) -> bool:
    """A request line (or the start of one) behind one or more empty lines."""
    rest = data.lstrip(_BLANK)
    return rest != data and (not rest or _request_line_start(rest))


Check = tuple[Literal["tls"], str | None] | tuple[Literal["refuse"], str]


def after_silence(data: bytes) -> Check | None:
    """What the first client bytes of a connection admitted without a name need:
    ``("tls", name)``: a name check of its SNI (None: no usable SNI); ``("refuse", reason)``;
    None: relay them (neither TLS nor HTTP, nor the start of either)."""
    if starts_like_tls_record(data):
        try:
            hello = parse_client_hello(data)
        except ValueError:
            hello = None
        if hello is None:  # not whole in the first read, or not a ClientHello
            return ("refuse", REASON_NO_SNI)
        return ("tls", as_name(sni_name(hello.sni)))
    if data[:1] == b"\x16" and len(data) < 5:
        return ("refuse", REASON_NO_SNI)
    rest = data.lstrip(_BLANK)
    if not rest or _request_line_start(rest):
        return ("refuse", REASON_NO_NAME_HTTP)
    return None
