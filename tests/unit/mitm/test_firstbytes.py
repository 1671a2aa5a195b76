"""What a redirected connection's first bytes are, for the name check (docs/reference/behaviour.md
§18, egressd/mitmchild/firstbytes.py): undecided, TLS in any record version, a request line as a
lenient server reads it, and what the bytes of a connection admitted after its client stalled
need. Pure."""

from __future__ import annotations

import ssl

import pytest

from egressd.mitmchild.firstbytes import (
    MAX_UNDECIDED,
    after_silence,
    looks_like_http,
    refusal,
    request_like,
    tls_shaped,
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
        (b"ping", True),
        (b"\r\n", True),
        (b"\r\n\r\nGE", True),
        (b" GET", True),
        (b"SSH-2.0-OpenSSH_9.6p1 Ubuntu", True),  # a line not over yet
        (b"\x16\x03\x01", True),
        (b"GET /", False),  # a request line already
        (b"SSH-2.0-OpenSSH_9.6\r\n", False),
        (b"\x00\x01\x02\x03", False),
        (b"\r\n" * (MAX_UNDECIDED // 2), False),
        (b"A" * MAX_UNDECIDED, False),
    ],
)
def test_undecided(data: bytes, expected: bool) -> None:
    assert undecided(data) is expected


@pytest.mark.parametrize(
    "data",
    [
        b"\r\nGET / HTTP/1.1\r\nHost: other.io\r\n\r\n",  # empty lines first (RFC 9112 2.2)
        b" GET / HTTP/1.1\r\n",  # a leading space
        b"\r\n GET / HTTP/1.1\r\n",
        b"GET\t/\tHTTP/1.1\r\n",  # tabs
        b"GET\x1c/\x1cHTTP/1.1\r\n",  # separators str.split() splits on
        b"GET\x85/\x85HTTP/1.1\r\n",
        b"FOO x HTTP/1.1\r\n",  # any method, any target, a version
        b"GET /\r\n",  # HTTP/0.9
        b"M-SEARCH * HTTP/1.1\r\n",
        b"GET http://b.io/ HTTP/1.1\r\n",
    ],
)
def test_request_lines_a_lenient_server_reads_are_refused(data: bytes) -> None:
    assert request_like(data)
    assert refusal(data) == "host_not_allowed"


@pytest.mark.parametrize(
    "data",
    [
        b"SSH-2.0-OpenSSH_9.6p1 Ubuntu-3ubuntu13.5\r\n",  # a comment after the version
        b"SSH-2.0-x\r\n",
        b"PING\r\n",
        b"*1\r\n$4\r\nPING\r\n",
        b"\x00\x00\x00\x08\x04\xd2\x16\x2f",  # PostgreSQL's SSLRequest
    ],
)
def test_other_protocols_carry_no_name(data: bytes) -> None:
    assert not request_like(data) and refusal(data) is None


@pytest.mark.parametrize("data", [b"\x16\x03\x04\x00\x10", b"\x16\x03\xff\x00\x10", b"\x16\x02\x00\x00\x10"])
def test_tls_in_any_record_version_is_never_nameless(data: bytes) -> None:
    assert tls_shaped(data) and refusal(data) == "no_sni"


def test_an_sslv2_style_hello_is_tls_shaped() -> None:
    assert tls_shaped(b"\x80\x2e\x01\x03\x01") and refusal(b"\x80\x2e\x01\x03\x01") == "no_sni"


def test_looks_like_http_is_mitmproxys_test() -> None:
    assert looks_like_http(b"GET / HTTP/1.1\r\n")
    assert not looks_like_http(b"\r\nGET / HTTP/1.1\r\n")  # what it misses


# ---- after a silence ------------------------------------------------------------------------------


def test_after_silence_tls_is_checked_by_its_sni_and_held_until_whole() -> None:
    whole = client_hello("a.cdn.test")
    assert after_silence(b"", whole) == ("tls", "a.cdn.test")
    assert after_silence(b"", client_hello(None)) == ("tls", None)
    # Split over reads (a large hello spans TCP segments): held back until whole.
    assert after_silence(b"", whole[:40]) == ("hold", whole[:40])
    assert after_silence(whole[:40], whole[40:], holding=True) == ("tls", "a.cdn.test")
    assert after_silence(b"", whole[:2]) == ("hold", whole[:2])


@pytest.mark.parametrize("data", [b"\x16\x03\x04\x00\x10xxxx", b"\x80\x2e\x01\x03\x01"])
def test_after_silence_odd_tls_is_refused(data: bytes) -> None:
    assert after_silence(b"", data) == ("refuse", "no_sni")


@pytest.mark.parametrize(
    ("head", "data"),
    [
        (b"", b"GET / HTTP/1.1\r\nHost: b.io\r\n\r\n"),
        (b"", b"\r\nGET / HTTP/1.1\r\n"),
        (b"", b" GET / HTTP/1.1\r\n"),
        (b"", b"GET\t/\tHTTP/1.1\r\n"),
        (b"GET", b" / HTTP/1.1\r\nHost: b.io\r\n\r\n"),  # a method relayed alone, then the rest
        (b"\r\n", b"GET / HTTP/1.1\r\n"),
        (b"G", b"ET /"),
        (b"GET x", b" HTTP/1.1\r\n"),
    ],
)
def test_after_silence_a_request_line_is_refused_however_it_is_split(head: bytes, data: bytes) -> None:
    assert after_silence(head, data) == ("refuse", "host_not_allowed")


@pytest.mark.parametrize(
    ("head", "data", "expected"),
    [
        (b"", b"ping", b"ping"),  # text, no line end: no request yet, relayed and watched
        (b"pi", b"ng", b"ping"),
        (b"", b"\r\n", b"\r\n"),
        (b"GET", b"", b"GET"),
        (b"", b"GET x", b"GET x"),
    ],
)
def test_after_silence_an_open_line_is_relayed_while_watched(head: bytes, data: bytes, expected: bytes) -> None:
    assert after_silence(head, data) == ("more", expected)


@pytest.mark.parametrize(
    ("head", "data"),
    [
        (b"", b"SSH-2.0-OpenSSH_9.6p1 Ubuntu-3ubuntu13.5\r\n"),
        (b"", b"\x00\x00\x00\x08\x04\xd2\x16\x2f"),
        (b"", b"*1\r\n$4\r\nPING\r\n"),
        (b"ping", b"\r\n"),
        (b"", b"PING\r\n"),
        (b"A" * (MAX_UNDECIDED - 1), b"AA"),  # longer than any request line egressd waits for
    ],
)
def test_after_silence_other_protocols_pass(head: bytes, data: bytes) -> None:
    assert after_silence(head, data) == ("pass", None)
