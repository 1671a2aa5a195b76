"""The addon's response side on real mitmproxy flow objects (docs/reference/behaviour.md §10): which bodies
it streams, what it does to their framing headers, buffered bodies and WebSocket messages
redacted, refusals of bodies it cannot scan, and the Accept-Encoding it leaves the request."""

from __future__ import annotations

import gzip
from typing import Any

import pytest
from mitmproxy import http, websocket
from mitmproxy.flow import Error
from mitmproxy.websocket import WebSocketMessage
from wsproto.frame_protocol import Opcode

from egressd.mitmchild import responses as addon_module
from egressd.mitmchild.respbody import BodyFilter
from egressd.mitmchild.responses import Responses
from tests.unit.mitm.test_mitm_addon import SECRET, flow, run


def decrypted(**headers: str) -> tuple[Responses, http.HTTPFlow]:
    f = flow()
    run(f)  # the vault's snapshot is on the flow now, as after requestheaders
    addon = Responses()
    f.response = http.Response.make(200, b"", headers)
    f.response.headers.pop("content-length", None)
    for name, value in headers.items():
        f.response.headers[name] = value
    return addon, f


def events(capsys: pytest.CaptureFixture[str]) -> str:
    return capsys.readouterr().out


def test_an_event_stream_is_streamed_through_the_redactor() -> None:
    addon, f = decrypted(**{"Content-Type": "text/event-stream", "Transfer-Encoding": "chunked"})
    addon.responseheaders(f)
    assert f.response is not None
    body = f.response.stream
    assert isinstance(body, BodyFilter)
    out = body(b"data: " + SECRET[:5].encode()) + body(SECRET[5:].encode() + b"\n\n") + body(b"")
    assert b"".join(out) == b"data: [REDACTED]\n\n"
    assert f.response.headers["transfer-encoding"] == "chunked"


def test_a_small_body_stays_buffered_and_is_redacted_whole_with_its_length() -> None:
    addon, f = decrypted(**{"Content-Length": "60"})
    addon.responseheaders(f)
    assert f.response is not None and not f.response.stream
    f.response.raw_content = b'{"auth": "Bearer ' + SECRET.encode() + b'", "ok": 1}'
    addon.response(f)
    assert f.response.raw_content == b'{"auth": "[REDACTED]", "ok": 1}'
    assert f.response.headers["content-length"] == str(len(f.response.raw_content))


def test_a_large_known_length_is_streamed_and_chunked_instead() -> None:
    addon, f = decrypted(**{"Content-Length": str(64 << 20)})
    addon.responseheaders(f)
    assert f.response is not None and isinstance(f.response.stream, BodyFilter)
    assert "content-length" not in f.response.headers
    assert f.response.headers["transfer-encoding"] == "chunked"


def test_a_compressed_body_is_decoded_and_forwarded_decoded() -> None:
    addon, f = decrypted(**{"Content-Encoding": "gzip", "Content-Length": "99"})
    addon.responseheaders(f)
    assert f.response is not None
    assert "content-encoding" not in f.response.headers and "content-length" not in f.response.headers
    body = f.response.stream
    assert isinstance(body, BodyFilter)
    raw = gzip.compress(b"x=" + SECRET.encode())
    assert b"".join(body(raw[:7]) + body(raw[7:]) + body(b"")) == b"x=[REDACTED]"


def test_a_body_it_cannot_decode_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    addon, f = decrypted(**{"Content-Encoding": "compress"})
    events(capsys)
    addon.responseheaders(f)
    assert f.error is not None and f.error.msg == Error.KILLED_MESSAGE
    out = events(capsys)
    assert '"mitm.response_refused"' in out and "content-encoding" in out


def test_an_aborted_stream_is_logged_as_a_refusal(capsys: pytest.CaptureFixture[str]) -> None:
    addon, f = decrypted(**{"Content-Encoding": "gzip", "Transfer-Encoding": "chunked"})
    addon.responseheaders(f)
    assert f.response is not None and isinstance(f.response.stream, BodyFilter)
    f.response.stream(b"not gzip at all")
    events(capsys)
    f.error = Error("response body refused by egressd")
    addon.error(f)
    out = events(capsys)
    assert '"mitm.response_refused"' in out and "gzip: corrupt" in out
    f.error = None
    addon.response(f)  # at the end: killed rather than ended cleanly
    assert f.error is not None and f.error.msg == Error.KILLED_MESSAGE


def test_the_reason_phrase_and_headers_are_redacted() -> None:
    addon, f = decrypted(**{"X-Echo": f"Bearer {SECRET}", "Content-Length": "0"})
    assert f.response is not None
    f.response.reason = f"bad key {SECRET}"
    addon.responseheaders(f)
    assert f.response.reason == "bad key [REDACTED]"
    assert f.response.headers["x-echo"] == "[REDACTED]"


def test_without_a_vault_unknown_lengths_still_stream_untouched() -> None:
    f = flow()
    f.response = http.Response.make(200, b"", {"Transfer-Encoding": "chunked", "X-Echo": SECRET})
    addon = Responses()
    addon.responseheaders(f)
    assert f.response.stream is True
    assert f.response.headers["x-echo"] == SECRET  # no vault on this flow: nothing to redact


def test_body_redaction_off_streams_without_the_filter() -> None:
    addon, f = decrypted(**{"Transfer-Encoding": "chunked", "Content-Encoding": "gzip"})
    addon.body_redaction = False
    addon.responseheaders(f)
    assert f.response is not None and f.response.stream is True
    assert f.response.headers["content-encoding"] == "gzip"


def _ws_flow() -> tuple[Responses, http.HTTPFlow]:
    addon, f = decrypted(**{"Content-Length": "0"})
    f.websocket = websocket.WebSocketData()
    return addon, f


@pytest.mark.parametrize("from_client", [False, True])
def test_websocket_messages_are_redacted_both_ways_and_not_kept(from_client: bool) -> None:
    addon, f = _ws_flow()
    assert f.websocket is not None
    for i in range(5):
        text = f"{i}: token {SECRET} end".encode()
        f.websocket.messages.append(WebSocketMessage(Opcode.TEXT, from_client, text))
        addon.websocket_message(f)
        assert len(f.websocket.messages) == 1  # the connection's history is not kept
        assert f.websocket.messages[-1].content == f"{i}: token [REDACTED] end".encode()
        assert f.websocket.messages[-1].text == f"{i}: token [REDACTED] end"


def test_accept_encoding_is_narrowed_for_a_flow_that_will_be_scanned() -> None:
    f = flow()
    f.request.headers["accept-encoding"] = "gzip, dcb, br"
    run(f)
    assert f.request.headers["accept-encoding"] == "gzip, br"


def test_buffer_limit_follows_stream_large_bodies() -> None:
    assert addon_module.DEFAULT_BUFFER_LIMIT == 1 << 20
    a: Any = Responses()
    assert a.buffer_limit == 1 << 20 and a.body_redaction is True
