"""What happens to a response body (egressd/mitmchild/respbody.py, docs/reference/behaviour.md §10), decided from
its headers: streamed when its length is unknown, when it is an event stream or larger than
the buffer; buffered otherwise; scanned whenever the flow has redaction strings, decoded first
when it is compressed (and forwarded decoded); refused when its coding cannot be decoded."""

from __future__ import annotations

import gzip

import pytest

from egressd.mitmchild.redact import compile_needles
from egressd.mitmchild.respbody import (
    NO_BODY,
    REASON_UNSUPPORTED_CODING,
    BodyFilter,
    ResponsePlan,
    narrow_accept_encoding,
    plan_response,
)

LIMIT = 1 << 20
SECRET = "sk-live-RESP-0001"


def plan(
    headers: dict[str, str],
    *,
    redact: bool = True,
    method: str = "GET",
    status: int = 200,
    response_version: str = "HTTP/1.1",
    request_version: str = "HTTP/1.1",
) -> ResponsePlan:
    lower = {k.lower(): v for k, v in headers.items()}
    return plan_response(
        method=method,
        status=status,
        get=lambda name: [lower[name]] if name in lower else [],
        response_version=response_version,
        request_version=request_version,
        redact=redact,
        buffer_limit=LIMIT,
    )


@pytest.mark.parametrize(
    ("headers", "kw", "want"),
    [
        # No vault: bodies of unknown length and event streams are streamed, nothing else changes.
        ({"Transfer-Encoding": "chunked"}, {"redact": False}, ResponsePlan(stream=True)),
        ({}, {"redact": False}, ResponsePlan(stream=True)),  # HTTP/1 until close, HTTP/2 no length
        ({"Content-Length": "10", "Content-Type": "text/event-stream"}, {"redact": False}, ResponsePlan(stream=True)),
        ({"Content-Length": "10"}, {"redact": False}, ResponsePlan()),
        ({"Content-Length": str(LIMIT + 1)}, {"redact": False}, ResponsePlan(stream=True)),
        # With redaction strings: a small known body is buffered and redacted whole.
        ({"Content-Length": "10"}, {}, ResponsePlan(redact=True)),
        # Streamed and redacted; a length it may no longer have is replaced by chunking.
        (
            {"Content-Length": str(LIMIT + 1)},
            {},
            ResponsePlan(stream=True, redact=True, drop_length=True, chunked=True),
        ),
        ({"Transfer-Encoding": "chunked", "Content-Type": "text/event-stream; charset=utf-8"}, {}, ResponsePlan(stream=True, redact=True)),
        ({}, {}, ResponsePlan(stream=True, redact=True)),
        # HTTP/1.0 client: delimited by the connection's end, never chunked.
        ({"Content-Length": str(LIMIT + 1)}, {"request_version": "HTTP/1.0"}, ResponsePlan(stream=True, redact=True, drop_length=True)),
        # HTTP/2 (either side): framing is the protocol's, no Transfer-Encoding.
        ({"Content-Length": str(LIMIT + 1)}, {"response_version": "HTTP/2.0", "request_version": "HTTP/2.0"}, ResponsePlan(stream=True, redact=True, drop_length=True)),
        ({"Content-Length": str(LIMIT + 1)}, {"request_version": "HTTP/2.0"}, ResponsePlan(stream=True, redact=True, drop_length=True)),
        # Compressed: always streamed through the decoder, length and coding dropped.
        (
            {"Content-Length": "10", "Content-Encoding": "gzip"},
            {},
            ResponsePlan(stream=True, redact=True, codings=("gzip",), drop_length=True, chunked=True),
        ),
        ({"Content-Encoding": "br", "Transfer-Encoding": "chunked"}, {}, ResponsePlan(stream=True, redact=True, codings=("br",))),
        ({"Content-Encoding": "compress"}, {}, ResponsePlan(refuse=REASON_UNSUPPORTED_CODING)),
        ({"Content-Encoding": "compress"}, {"redact": False}, ResponsePlan(stream=True)),  # not scanned: passed on
        # No body at all: nothing to plan.
        ({"Content-Encoding": "compress"}, {"method": "HEAD"}, NO_BODY),
        ({"Content-Length": "10"}, {"status": 304}, NO_BODY),
        ({}, {"status": 204}, NO_BODY),
        ({}, {"status": 101}, NO_BODY),
        # A malformed length is no length.
        ({"Content-Length": "ten"}, {}, ResponsePlan(stream=True, redact=True, drop_length=True, chunked=True)),
    ],
)
def test_plan(headers: dict[str, str], kw: dict[str, object], want: ResponsePlan) -> None:
    assert plan(headers, **kw) == want  # type: ignore[arg-type]


def test_filter_decodes_and_redacts_across_chunks_and_never_yields_an_empty_chunk() -> None:
    body = b"<<<" + f"Bearer {SECRET}".encode() + b">>>" + b"." * 200
    raw = gzip.compress(body)
    f = BodyFilter(compile_needles([SECRET, f"Bearer {SECRET}"]), ("gzip",))
    out: list[bytes] = []
    for i in range(len(raw)):
        got = f(raw[i : i + 1])
        assert b"" not in got  # an empty chunk would end an HTTP/1 chunked body
        out += got
    out += f(b"")
    assert b"".join(out) == b"<<<[REDACTED]>>>" + b"." * 200
    assert f.failed is None and f.ended
    assert f(b"more") == []  # after the end nothing is released


def test_filter_failure_stops_the_body() -> None:
    f = BodyFilter(compile_needles([SECRET]), ("gzip",), limit=1 << 20)
    assert f(gzip.compress(bytes(32 << 20))) == []
    assert f.failed is not None and "more than" in f.failed
    assert f(b"x") == [] and f(b"") == []
    truncated = BodyFilter(compile_needles([SECRET]), ("gzip",))
    truncated(gzip.compress(b"hello world" * 100)[:20])
    assert truncated(b"") == [] and truncated.failed == "gzip: truncated"


def test_filter_holds_back_only_a_possible_beginning() -> None:
    f = BodyFilter(compile_needles([SECRET]))
    assert f(b"data: one\n\n") == [b"data: one\n\n"]
    assert f(b"data: sk-li") == [b"data: "] and f.held == len("sk-li")
    assert f(b"ve-RESP-0001\n\n") == [b"[REDACTED]\n\n"]


@pytest.mark.parametrize(
    ("values", "want"),
    [
        (["gzip, deflate, br, zstd"], None),
        (["gzip, dcb, dcz"], "gzip"),
        (["br;q=1.0, compress;q=0.5, identity;q=0.1"], "br;q=1.0, identity;q=0.1"),
        (["*"], "identity"),
        (["exi"], "identity"),
        ([], None),
    ],
)
def test_accept_encoding_narrowed_to_what_the_scan_decodes(values: list[str], want: str | None) -> None:
    assert narrow_accept_encoding(values) == want
