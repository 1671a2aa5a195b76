"""What a redirected connection's first bytes are, for the name check (docs/reference/behaviour.md
§18, egressd/mitmchild/firstbytes.py): undecided, HTTP, HTTP behind empty lines, and what the
first bytes of a connection admitted after its client stayed silent need. Pure."""

from __future__ import annotations

import ssl

import pytest

from egressd.mitmchild.firstbytes import (
    MAX_UNDECIDED,
    after_silence,
    disguised_http,
    looks_like_http,
    undecided,
)


def client_hello(sni: str | None) -> bytes:
    """A real ClientHello, as Python's TLS stack writes it."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    conn = ctx.wrap_bio(incoming, outgoing, server_hostname=sni)
    with pytest.raises(ssl.SSLWantReadError):
        conn.do_handshake()
    return outgoing.read()


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"", True),
        (b"G", True),
        (b"GET", True),
        (b"\r\n", True),
        (b"\r\n\r\nGE", True),
        (b"\x16\x03\x01", True),
        (b"GET /", False),
        (b"SSH-2.0-OpenSSH_9.6\r\n", False),
        (b"\x00\x01\x02\x03", False),
        (b"\r\n" * (MAX_UNDECIDED // 2), False),
    ],
)
def test_undecided(data: bytes, expected: bool) -> None:
    assert undecided(data) is expected


def test_a_request_line_behind_empty_lines_is_disguised_http() -> None:
    assert disguised_http(b"\r\nGET / HTTP/1.1\r\nHost: other.io\r\n\r\n")
    assert disguised_http(b"\n\nPOST /x HTTP/1.1\r\n")
    assert disguised_http(b"\r\n" * 10)  # nothing but empty lines, at the undecided limit
    assert not looks_like_http(b"\r\nGET / HTTP/1.1\r\n")  # what mitmproxy's own test misses
    assert not disguised_http(b"GET / HTTP/1.1\r\n")  # plain HTTP is parsed, not refused
    assert not disguised_http(b"SSH-2.0-x\r\n") and not disguised_http(b"\r\n\x00\x01")


def test_a_tab_after_the_method_is_a_request_line_too() -> None:
    # mitmproxy's test wants a space; servers that split on any whitespace read this as GET.
    assert not looks_like_http(b"GET\t/\tHTTP/1.1\r\nHost: b.io\r\n\r\n")
    assert disguised_http(b"GET\t/\tHTTP/1.1\r\nHost: b.io\r\n\r\n")
    assert not disguised_http(b"PING\r\n") and not disguised_http(b"EHLO\r\n")


def test_after_silence_tls_is_checked_by_its_sni() -> None:
    assert after_silence(b"", client_hello("a.cdn.test")) == ("tls", "a.cdn.test")
    assert after_silence(b"", client_hello(None)) == ("tls", None)
    whole = client_hello("a.cdn.test")
    # A ClientHello not whole in the first read is refused, never relayed unchecked.
    assert after_silence(b"", whole[:40]) == ("refuse", "no_sni")
    assert after_silence(b"", whole[:3]) == ("refuse", "no_sni")


@pytest.mark.parametrize(
    ("head", "data"),
    [
        (b"", b"GET / HTTP/1.1\r\nHost: b.io\r\n\r\n"),
        (b"", b"\r\nGET / HTTP/1.1\r\n"),
        (b"", b"GET\t/ HTTP/1.1\r\n"),
        (b"GET", b" / HTTP/1.1\r\nHost: b.io\r\n\r\n"),  # a method relayed alone, then the rest
        (b"\r\n", b"GET / HTTP/1.1\r\n"),
        (b"G", b"ET /"),
    ],
)
def test_after_silence_a_request_line_is_refused_however_it_is_split(head: bytes, data: bytes) -> None:
    assert after_silence(head, data) == ("refuse", "host_not_allowed")


@pytest.mark.parametrize(
    ("head", "data", "expected"),
    [
        (b"", b"ping", b"ping"),  # letters only: no request yet, relayed and watched
        (b"pi", b"ng", b"ping"),
        (b"", b"\r\n", b"\r\n"),
        (b"GET", b"", b"GET"),
    ],
)
def test_after_silence_letters_are_relayed_while_watched(head: bytes, data: bytes, expected: bytes) -> None:
    assert after_silence(head, data) == ("more", expected)


@pytest.mark.parametrize(
    ("head", "data"),
    [
        (b"", b"SSH-2.0-OpenSSH_9.6\r\n"),
        (b"", b"\x00\x00\x00\x08\x04\xd2\x16\x2f"),
        (b"", b"*1\r\n$4\r\nPING\r\n"),
        (b"ping", b"\r\n"),  # a line with no whitespace after its word: not a request line
        (b"", b"PING\r\n"),
        (b"A" * (MAX_UNDECIDED - 1), b"AA"),  # longer than any method
    ],
)
def test_after_silence_other_protocols_pass(head: bytes, data: bytes) -> None:
    assert after_silence(head, data) == ("pass", None)
