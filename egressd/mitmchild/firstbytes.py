"""What a redirected connection's first client bytes are, for the name check
(docs/reference/behaviour.md §18). Pure: bytes in, a classification out.

* :func:`undecided`: too few bytes to tell TLS or an HTTP request line from anything else.
* :func:`looks_like_http`: mitmproxy's own test (a verb, a space in the first line).
* :func:`disguised_http`: a request line mitmproxy's test misses: behind empty lines (HTTP/1.1
  servers skip them, RFC 9112 §2.2) or with a tab after the method (lenient servers split on
  it). Relayed as "neither TLS nor HTTP", its ``Host`` would never be checked: such a
  connection is refused.
* :func:`after_silence`: the next client bytes of a connection admitted without a name after
  its client stalled (:mod:`egressd.mitmchild.silence`): relayed while they cannot make a
  request line yet, refused once they would.
"""

from __future__ import annotations

import re
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
    return rest.isalpha()


def _request_line(rest: bytes) -> bool:
    """A method (letters) followed by whitespace: what a lenient HTTP server reads as a request
    line (mitmproxy's test wants a space; some servers split on tabs too)."""
    match = _METHOD.match(rest)
    return match is not None


_METHOD: Final = re.compile(rb"[A-Za-z]+[ \t\x0b\x0c]")


def disguised_http(data: bytes) -> bool:
    """A request line that mitmproxy's test misses: behind empty lines (or only empty lines so
    far), or with a tab after its method."""
    if looks_like_http(data):
        return False
    rest = data.lstrip(_BLANK)
    if rest != data and (not rest or rest.isalpha()):
        return True
    return _request_line(rest)


Check = (
    tuple[Literal["tls"], str | None]
    | tuple[Literal["refuse"], str]
    | tuple[Literal["more"], bytes]
    | tuple[Literal["pass"], None]
)


def after_silence(head: bytes, data: bytes) -> Check:
    """What the client's next bytes ``data`` of a connection admitted without a name need, after
    ``head`` (its earlier bytes, relayed while they could still start a request line):
    ``("tls", name)``: a name check of the ClientHello's SNI (None: no usable SNI);
    ``("refuse", reason)``; ``("more", head)``: relay them and look at the next bytes too
    (letters or empty lines only so far: no request yet, but one could follow); ``("pass",
    None)``: relay this and everything after it (neither TLS nor HTTP)."""
    combined = head + data
    if not head and starts_like_tls_record(combined):
        try:
            hello = parse_client_hello(combined)
        except ValueError:
            hello = None
        if hello is None:  # not whole in the first read, or not a ClientHello
            return ("refuse", REASON_NO_SNI)
        return ("tls", as_name(sni_name(hello.sni)))
    if not head and combined[:1] == b"\x16" and len(combined) < 5:
        return ("refuse", REASON_NO_SNI)
    rest = combined.lstrip(_BLANK)
    if _request_line(rest):
        return ("refuse", REASON_NO_NAME_HTTP)
    if (not rest or rest.isalpha()) and len(combined) < MAX_UNDECIDED:
        return ("more", combined)
    return ("pass", None)
