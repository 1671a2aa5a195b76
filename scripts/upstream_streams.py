"""Streaming endpoints of the test upstream (scripts/fleet_upstream.py), for the MITM's response
path (docs/reference/behaviour.md §10): server-sent events with logged send times, bulk bodies of any size
with and without a length, an echo of a request header split across chunks (optionally
compressed), a hashing upload sink and a WebSocket echo. HTTP/1.1 through aiohttp; HTTP/2
through the ``h2`` library for connections whose SNI starts with ``h2.`` (ALPN ``h2``), with
the same endpoints (the WebSocket one excepted).

Endpoints (GET unless said otherwise; every duration in ms):

* ``/_stream/sse?n=5&gap=400&id=X[&echo=HEADER]``: ``text/event-stream``, one event every
  ``gap``, each ``data: {"i": k, "sent": <epoch s>[, "echo": <header value>]}``; one log line
  per event ``{"sse": X, "i": k, "sent": t}`` written as it is sent.
  ``ct`` replaces the content type, ``framing=close`` (HTTP/1.1) ends the body with the
  connection instead of chunking it.
* ``/_stream/bomb?size=N&ce=gzip|deflate|br|zstd[,...]&framing=length|chunked``: N zero bytes
  in that coding (or stack of codings), written in one piece (a decompression bomb).
* ``/_stream/bytes?size=N&framing=length|chunked|close[&chunk=65536]``: N bytes of a fixed
  pseudo-random pattern, ``X-Body-Sha256`` announces their hash.
* ``/_stream/echo?header=authorization&fmt=raw|pct|json|b64|basic&split=K[,K2]&gap=100
  &ce=identity|gzip|deflate|br|zstd&framing=...``: ``<<<`` + the header's value in that
  encoding + ``>>>`` padded to 300 bytes, compressed with ``ce``, sent in parts cut at the
  given byte offsets of the *uncompressed* text (``split=mid`` cuts in the middle of the value;
  compressed parts are flushed at the cut, so each part decodes to exactly its slice), ``gap``
  apart. ``fmt=basic``: the value after ``Basic `` base64-decoded. Any method.
* ``POST /_stream/upload``: the body is read as it comes and answered with
  ``{"bytes": n, "sha256": hex}``.
* ``GET /_stream/ws`` (HTTP/1.1 only): a WebSocket that first sends the ``Authorization``
  header of its upgrade request as a text message, then echoes every message back; each
  received message is logged ``{"ws": <text>}``.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import itertools
import json
import ssl
import time
import urllib.parse
import zlib
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import brotli
import h2.config
import h2.connection
import h2.events
from aiohttp import web

try:
    from compression import zstd  # type: ignore[import-not-found]
except ImportError:
    from backports import zstd

PATTERN_BLOCK = hashlib.shake_256(b"egressd stream pattern").digest(1 << 20)
_SHA_CACHE: dict[int, str] = {}
ECHO_PAD = 300

Log = Callable[[dict[str, object]], None]
Echo = Callable[[dict[str, str], bytes], dict[str, object]]


def pattern_sha256(size: int) -> str:
    """The SHA-256 of ``size`` bytes of the pattern (cached: a 1 GiB body hashes once)."""
    if size not in _SHA_CACHE:
        h = hashlib.sha256()
        whole, rest = divmod(size, len(PATTERN_BLOCK))
        for _ in range(whole):
            h.update(PATTERN_BLOCK)
        h.update(PATTERN_BLOCK[:rest])
        _SHA_CACHE[size] = h.hexdigest()
    return _SHA_CACHE[size]


def pattern_chunks(size: int, chunk: int) -> AsyncIterator[bytes]:
    async def gen() -> AsyncIterator[bytes]:
        sent = 0
        view = memoryview(PATTERN_BLOCK * 2)
        while sent < size:
            off = sent % len(PATTERN_BLOCK)
            n = min(chunk, size - sent, len(PATTERN_BLOCK))
            yield bytes(view[off : off + n])
            sent += n

    return gen()


def _q(query: Mapping[str, str], name: str, default: str) -> str:
    return query.get(name, default) or default


def _int(query: Mapping[str, str], name: str, default: int) -> int:
    try:
        return int(_q(query, name, str(default)))
    except ValueError:
        return default


# ---- the echo body: text, cut points, compressed parts ------------------------------------------


def _encoded(value: str, fmt: str) -> str:
    if fmt == "pct":
        return urllib.parse.quote(value, safe="")
    if fmt == "json":
        return json.dumps(value)[1:-1]
    if fmt == "b64":
        return base64.b64encode(value.encode()).decode()
    if fmt == "basic":
        token = value.split(" ", 1)[1] if " " in value else value
        return base64.b64decode(token).decode("utf-8", "replace")
    return value


def echo_text(value: str, fmt: str) -> tuple[bytes, int, int]:
    """The echo body and where the encoded value sits in it (start, end)."""
    inner = _encoded(value, fmt).encode()
    head = b"<<<"
    body = head + inner + b">>>"
    body += b"." * max(0, ECHO_PAD - len(body))
    return body, len(head), len(head) + len(inner)


def cut_points(spec: str, start: int, end: int, total: int) -> list[int]:
    points: list[int] = []
    for item in spec.split(","):
        item = item.strip()
        if item == "mid":
            points.append((start + end) // 2)
        elif item.isdigit():
            points.append(int(item))
    return sorted({p for p in points if 0 < p < total})


class _Flusher:
    """A compressor whose output up to each cut decodes to exactly the text before it."""

    def __init__(self, ce: str, level: int = 1) -> None:
        self.ce = ce
        if ce == "gzip":
            self.z: Any = zlib.compressobj(level, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
        elif ce == "deflate":
            self.z = zlib.compressobj(level, zlib.DEFLATED, zlib.MAX_WBITS)
        elif ce == "br":
            self.z = brotli.Compressor(quality=4)
        elif ce == "zstd":
            self.z = zstd.ZstdCompressor()

    def more(self, data: bytes) -> bytes:
        """Compressed output so far, without a flush (denser)."""
        if self.ce in ("gzip", "deflate"):
            return bytes(self.z.compress(data))
        if self.ce == "br":
            return bytes(self.z.process(data))
        if self.ce == "zstd":
            return bytes(self.z.compress(data))
        return data

    def part(self, data: bytes, last: bool) -> bytes:
        if self.ce in ("gzip", "deflate"):
            return bytes(self.z.compress(data) + self.z.flush(zlib.Z_FINISH if last else zlib.Z_SYNC_FLUSH))
        if self.ce == "br":
            return bytes(self.z.process(data) + (self.z.finish() if last else self.z.flush()))
        if self.ce == "zstd":
            mode = zstd.ZstdCompressor.FLUSH_FRAME if last else zstd.ZstdCompressor.FLUSH_BLOCK
            return bytes(self.z.compress(data, mode))
        return data


def echo_parts(value: str, query: Mapping[str, str]) -> tuple[list[bytes], str]:
    """The body parts (each to be sent on its own) and the Content-Encoding (or "")."""
    body, start, end = echo_text(value, _q(query, "fmt", "raw"))
    cuts = cut_points(_q(query, "split", ""), start, end, len(body))
    ce = _q(query, "ce", "identity")
    flusher = _Flusher(ce)
    bounds = [0, *cuts, len(body)]
    parts = [
        flusher.part(body[a:b], last=i == len(bounds) - 2)
        for i, (a, b) in enumerate(itertools.pairwise(bounds))
    ]
    return [p for p in parts if p], "" if ce == "identity" else ce


_BOMBS: dict[tuple[int, str], bytes] = {}


def bomb_body(size: int, ce: str) -> tuple[bytes, str]:
    """``size`` zero bytes in content coding ``ce`` (a decompression bomb; cached). ``ce`` may
    stack codings (``gzip,gzip``: the zeros gzipped, then that gzipped again, as the
    Content-Encoding lists them)."""
    if (size, ce) not in _BOMBS:
        codings = [x.strip() for x in ce.split(",") if x.strip()]
        flusher, zeros, out = _Flusher(codings[0], level=9), bytes(1 << 20), []
        whole, rest = divmod(size, len(zeros))
        for _ in range(whole):
            out.append(flusher.more(zeros))
        out.append(flusher.part(zeros[:rest], last=True))
        body = b"".join(out)
        for coding in codings[1:]:
            body = _Flusher(coding, level=9).part(body, last=True)
        _BOMBS[(size, ce)] = body
    return _BOMBS[(size, ce)], ", ".join(codings)


def sse_event(i: int, echo: str | None) -> tuple[bytes, float]:
    sent = time.time()
    data: dict[str, object] = {"i": i, "sent": sent}
    if echo is not None:
        data["echo"] = echo
    return f"id: {i}\ndata: {json.dumps(data)}\n\n".encode(), sent


# ---- HTTP/1.1 (aiohttp) -----------------------------------------------------------------------


class _Unframed(web.StreamResponse):
    """A body delimited by the end of the connection: no Content-Length, no chunking."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._length_check = False
        self.force_close()


def _response(framing: str, length: int | None, headers: dict[str, str]) -> web.StreamResponse:
    if framing == "close":
        return _Unframed(headers=headers)
    resp = web.StreamResponse(headers=headers)
    if framing == "length" and length is not None:
        resp.content_length = length
    else:
        resp.enable_chunked_encoding()
    return resp


class _Routes:
    """The HTTP/1.1 handlers (aiohttp)."""

    def __init__(self, log: Log) -> None:
        self.log = log

    async def sse(self, request: web.Request) -> web.StreamResponse:
        q = request.query
        n, gap, sid = _int(q, "n", 5), _int(q, "gap", 400), _q(q, "id", "sse")
        echo = request.headers.get(q["echo"]) if "echo" in q else None
        headers = {"Content-Type": _q(q, "ct", "text/event-stream"), "Cache-Control": "no-cache"}
        resp = _response(_q(q, "framing", "chunked"), None, headers)
        await resp.prepare(request)
        for i in range(n):
            if i:
                await asyncio.sleep(gap / 1000)
            event, sent = sse_event(i, echo)
            await resp.write(event)
            self.log({"sse": sid, "i": i, "sent": sent})
        await resp.write_eof()
        return resp

    async def bulk(self, request: web.Request) -> web.StreamResponse:
        q = request.query
        size, framing = _int(q, "size", 1 << 20), _q(q, "framing", "length")
        headers = {"Content-Type": "application/octet-stream", "X-Body-Sha256": pattern_sha256(size)}
        resp = _response(framing, size, headers)
        await resp.prepare(request)
        async for chunk in pattern_chunks(size, _int(q, "chunk", 65536)):
            await resp.write(chunk)
        await resp.write_eof()
        return resp

    async def echo(self, request: web.Request) -> web.StreamResponse:
        q = request.query
        value = request.headers.get(_q(q, "header", "authorization"), "")
        parts, ce = echo_parts(value, q)
        headers = {"Content-Type": "text/plain"} | ({"Content-Encoding": ce} if ce else {})
        resp = _response(_q(q, "framing", "chunked"), sum(map(len, parts)), headers)
        await resp.prepare(request)
        for i, part in enumerate(parts):
            if i:
                await asyncio.sleep(_int(q, "gap", 100) / 1000)
            await resp.write(part)
        await resp.write_eof()
        return resp

    async def bomb(self, request: web.Request) -> web.StreamResponse:
        q = request.query
        body, ce = bomb_body(_int(q, "size", 256 << 20), _q(q, "ce", "gzip"))
        resp = _response(
            _q(q, "framing", "length"),
            len(body),
            {"Content-Type": "application/octet-stream", "Content-Encoding": ce},
        )
        await resp.prepare(request)
        await resp.write(body)  # in one piece: each read of it decodes to as much as it can
        await resp.write_eof()
        return resp

    async def upload(self, request: web.Request) -> web.Response:
        h, n = hashlib.sha256(), 0
        async for chunk in request.content.iter_any():
            h.update(chunk)
            n += len(chunk)
        self.log({"upload": n, "sha256": h.hexdigest()})
        return web.json_response({"bytes": n, "sha256": h.hexdigest()})

    async def ws(self, request: web.Request) -> web.WebSocketResponse:
        sock = web.WebSocketResponse()
        await sock.prepare(request)
        await sock.send_str("auth=" + request.headers.get("Authorization", ""))
        async for msg in sock:
            if msg.type == web.WSMsgType.TEXT:
                self.log({"ws": msg.data})
                await sock.send_str("echo=" + msg.data)
            elif msg.type == web.WSMsgType.BINARY:
                await sock.send_bytes(msg.data)
        return sock


def add_routes(app: web.Application, log: Log) -> None:
    routes = _Routes(log)
    app.router.add_get("/_stream/sse", routes.sse)
    app.router.add_get("/_stream/bytes", routes.bulk)
    app.router.add_route("*", "/_stream/echo", routes.echo)
    app.router.add_get("/_stream/bomb", routes.bomb)
    app.router.add_post("/_stream/upload", routes.upload)
    app.router.add_get("/_stream/ws", routes.ws)


# ---- HTTP/2 (h2) ----------------------------------------------------------------------------------


@dataclass
class _H2Request:
    headers: dict[str, str]
    body: hashlib._Hash
    size: int = 0


class H2Server(asyncio.Protocol):
    """The same endpoints over HTTP/2: each DATA frame the handlers write is sent as written
    (a part of the echo is one frame, flushed before the next), with flow control honoured."""

    def __init__(self, log: Log, fallback: Echo) -> None:
        self.conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=False, header_encoding="utf-8")
        )
        self.log, self.fallback = log, fallback
        self.transport: asyncio.Transport | None = None
        self.requests: dict[int, _H2Request] = {}
        self.window = asyncio.Event()
        self.tasks: set[asyncio.Task[None]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.conn.initiate_connection()
        self._flush()

    def _flush(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(self.conn.data_to_send())

    def data_received(self, data: bytes) -> None:
        try:
            events = self.conn.receive_data(data)
        except h2.exceptions.ProtocolError:
            self._flush()
            if self.transport is not None:
                self.transport.close()
            return
        for ev in events:
            self._event(ev)
        self._flush()

    def _event(self, ev: h2.events.Event) -> None:
        if isinstance(ev, h2.events.RequestReceived) and ev.stream_id is not None:
            headers = {str(k): str(v) for k, v in (ev.headers or [])}
            self.requests[ev.stream_id] = _H2Request(headers, hashlib.sha256())
        elif isinstance(ev, h2.events.DataReceived) and ev.stream_id is not None:
            req = self.requests.get(ev.stream_id)
            if req is not None and ev.data:
                req.body.update(ev.data)
                req.size += len(ev.data)
            self.conn.acknowledge_received_data(ev.flow_controlled_length or 0, ev.stream_id)
        elif isinstance(ev, h2.events.StreamEnded) and ev.stream_id in self.requests:
            task = asyncio.ensure_future(self._serve(ev.stream_id, self.requests.pop(ev.stream_id)))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        elif isinstance(ev, (h2.events.WindowUpdated, h2.events.RemoteSettingsChanged)):
            self.window.set()

    def connection_lost(self, exc: Exception | None) -> None:
        for task in self.tasks:
            task.cancel()
        self.window.set()

    async def _send(self, sid: int, data: bytes) -> None:
        """``data`` as DATA frames, as soon as the peer's window allows."""
        while data:
            room = min(self.conn.local_flow_control_window(sid), self.conn.max_outbound_frame_size)
            if room <= 0:
                self.window.clear()
                await self.window.wait()
                if self.transport is None or self.transport.is_closing():
                    return
                continue
            piece, data = data[:room], data[room:]
            self.conn.send_data(sid, piece)
            self._flush()

    def _end(self, sid: int) -> None:
        self.conn.end_stream(sid)
        self._flush()

    def _head(self, sid: int, status: int, headers: dict[str, str]) -> None:
        self.conn.send_headers(sid, [(":status", str(status)), *headers.items()])
        self._flush()

    async def _serve(self, sid: int, req: _H2Request) -> None:
        path = req.headers.get(":path", "/")
        url = urllib.parse.urlsplit(path)
        q = dict(urllib.parse.parse_qsl(url.query))
        try:
            if url.path == "/_stream/sse":
                await self._sse(sid, req, q)
                return
            if url.path == "/_stream/bytes":
                await self._bulk(sid, q)
                return
            if url.path == "/_stream/echo":
                await self._echo(sid, req, q)
                return
            if url.path == "/_stream/upload":
                body = json.dumps({"bytes": req.size, "sha256": req.body.hexdigest()}).encode()
            else:
                body = json.dumps(self.fallback(req.headers, b"")).encode()
            self._head(sid, 200, {"content-type": "application/json", "content-length": str(len(body))})
            await self._send(sid, body)
            self._end(sid)
        except (h2.exceptions.ProtocolError, h2.exceptions.StreamClosedError):
            return

    async def _sse(self, sid: int, req: _H2Request, q: Mapping[str, str]) -> None:
        n, gap, ident = _int(q, "n", 5), _int(q, "gap", 400), _q(q, "id", "sse")
        echo = req.headers.get(q["echo"].lower()) if "echo" in q else None
        self._head(sid, 200, {"content-type": _q(q, "ct", "text/event-stream"), "cache-control": "no-cache"})
        for i in range(n):
            if i:
                await asyncio.sleep(gap / 1000)
            event, sent = sse_event(i, echo)
            await self._send(sid, event)
            self.log({"sse": ident, "i": i, "sent": sent, "h2": True})
        self._end(sid)

    async def _bulk(self, sid: int, q: Mapping[str, str]) -> None:
        size = _int(q, "size", 1 << 20)
        headers = {"content-type": "application/octet-stream", "x-body-sha256": pattern_sha256(size)}
        if _q(q, "framing", "length") == "length":
            headers["content-length"] = str(size)
        self._head(sid, 200, headers)
        async for chunk in pattern_chunks(size, _int(q, "chunk", 16384)):
            await self._send(sid, chunk)
        self._end(sid)

    async def _echo(self, sid: int, req: _H2Request, q: Mapping[str, str]) -> None:
        value = req.headers.get(_q(q, "header", "authorization").lower(), "")
        parts, ce = echo_parts(value, q)
        headers = {"content-type": "text/plain"} | ({"content-encoding": ce} if ce else {})
        if _q(q, "framing", "chunked") == "length":
            headers["content-length"] = str(sum(map(len, parts)))
        self._head(sid, 200, headers)
        for i, part in enumerate(parts):
            if i:
                await asyncio.sleep(_int(q, "gap", 100) / 1000)
            await self._send(sid, part)  # one DATA frame per part (parts are small)
        self._end(sid)


def h2_context(certfile: str, keyfile: str) -> ssl.SSLContext:
    """A server context with the same leaf that offers ALPN ``h2`` first."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(certfile, keyfile)
    ctx.set_alpn_protocols(["h2", "http/1.1"])
    return ctx


def sni_switch(h2ctx: ssl.SSLContext) -> Callable[[ssl.SSLObject, str | None, ssl.SSLContext], None]:
    """``sni_callback``: connections whose SNI starts with ``h2.`` get the HTTP/2 context."""

    def callback(obj: ssl.SSLObject, name: str | None, _ctx: ssl.SSLContext) -> None:
        if name and name.lower().startswith("h2."):
            obj.context = h2ctx

    return callback


class AlpnDispatch(asyncio.Protocol):
    """Hands a TLS connection to the HTTP/2 server when ALPN chose ``h2``, else to aiohttp."""

    def __init__(self, http1: Callable[[], asyncio.Protocol], http2: Callable[[], asyncio.Protocol]) -> None:
        self._http1, self._http2 = http1, http2
        self.inner: asyncio.Protocol | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        ssl_obj = transport.get_extra_info("ssl_object")
        alpn = ssl_obj.selected_alpn_protocol() if ssl_obj is not None else None
        self.inner = self._http2() if alpn == "h2" else self._http1()
        transport.set_protocol(self.inner)
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:  # only before the hand-over
        assert self.inner is not None
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.inner is not None:
            self.inner.connection_lost(exc)


def write_log(path: Path | None) -> Log:
    def log(record: dict[str, object]) -> None:
        if path is not None:
            with path.open("a") as fh:
                fh.write(json.dumps(record) + "\n")

    return log
