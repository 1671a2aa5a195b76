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


def test_after_silence_tls_is_checked_by_its_sni() -> None:
    assert after_silence(client_hello("a.cdn.test")) == ("tls", "a.cdn.test")
    assert after_silence(client_hello(None)) == ("tls", None)
    whole = client_hello("a.cdn.test")
    # A ClientHello not whole in the first read is refused, never relayed unchecked.
    assert after_silence(whole[:40]) == ("refuse", "no_sni")
    assert after_silence(whole[:3]) == ("refuse", "no_sni")


@pytest.mark.parametrize(
    "data", [b"GET / HTTP/1.1\r\nHost: b.io\r\n\r\n", b"G", b"GET", b"\r\nGET / HTTP/1.1\r\n", b"\r\n", b"HELLO"]
)
def test_after_silence_http_and_its_beginnings_are_refused(data: bytes) -> None:
    assert after_silence(data) == ("refuse", "host_not_allowed")


@pytest.mark.parametrize("data", [b"SSH-2.0-OpenSSH_9.6\r\n", b"\x00\x00\x00\x08\x04\xd2\x16\x2f", b"*1\r\n$4\r\nPING\r\n"])
def test_after_silence_other_protocols_pass(data: bytes) -> None:
    assert after_silence(data) is None
