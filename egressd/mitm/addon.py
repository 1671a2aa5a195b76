"""The egressd addon, loaded by the supervised ``mitmdump`` (``-s``): credential injection (§10)
and selective interception (§16).

Thin shell around :mod:`egressd.mitm.inject` (the decision), :mod:`egressd.mitm.intercept`
(which connections are opened at all) and :mod:`egressd.mitm.lookup` (the vault of the flow's
client IP, and whether the connection's original destination was learned for the request
host). Everything it decides is logged as one JSON line on stdout
(names, binding, revision, host, method, header names; never values), which the daemon's
supervisor re-emits through its own logger.

Fail closed: a failed lookup refuses the request before anything reaches the upstream (503
when the body is complete, killed when it is streamed or chunked); an unexpected error in a
hook kills the flow instead of letting mitmproxy carry on with an undecided request. A
connection is relayed unopened only on a positive answer (no vault, no binding for its SNI,
an ignored host); when the connection-time lookup fails it is opened, so that the request
path above refuses its requests.
"""

from __future__ import annotations

import gc
import ipaddress
import json
import re
import sys
import time
from collections.abc import Callable
from typing import Any

from mitmproxy import ctx, http, tls
from mitmproxy.addonmanager import Loader
from mitmproxy.addons.next_layer import stack_match
from mitmproxy.proxy import layer, layers
from mitmproxy.proxy.layers import modes
from mitmproxy.utils import human

from egressd.addr import unmap_ip
from egressd.mitm.active import READY_EVENT
from egressd.mitm.inject import (
    LOOKUP_FAILED,
    InjectionDecision,
    Request,
    decide,
    find_binding,
    normalise_authority,
    one_authority,
    substitute_body,
)
from egressd.mitm.intercept import (
    CONNECTION_EVENT,
    REASON_LOOKUP_FAILED,
    Decision,
    Verdict,
    http_by_vault,
    http_early,
    tls_by_vault,
    tls_early,
)
from egressd.mitm.lookup import ActiveClient, LookupFailed, View
from egressd.mitm.redact import Needles, compile_needles, redact_bytes, redact_str
from egressd.mitm.respbody import BodyFilter, ResponsePlan, narrow_accept_encoding, plan_response
from egressd.mitm.seqmap import SeqReader
from egressd.vault.store import VaultSnapshot

_META = "egressd"
#: A response the MITM would not pass on (a body it cannot scan, a decompression bomb): its
#: request was already counted (injected / pass), so this is no request outcome of its own.
RESPONSE_REFUSED_EVENT = "mitm.response_refused"
#: A response body with a known length up to this is buffered (mitmproxy's ``stream_large_bodies``).
DEFAULT_BUFFER_LIMIT = 1 << 20
_REDACT_BUFFERED = _META + ".redact"  # a buffered body, redacted whole in the ``response`` hook


def emit(event: str, **fields: Any) -> None:
    """One JSON line for the supervisor (stdout is a pipe it reads)."""
    sys.stdout.write(json.dumps({"event": event, **fields}, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def _ip_of(addr: tuple[str, int] | tuple[str, int, int, int] | None) -> str | None:
    if not addr:
        return None
    try:
        return str(unmap_ip(ipaddress.ip_address(addr[0])))
    except ValueError:
        return None


def _address(addr: tuple[str, int] | tuple[str, int, int, int] | None) -> tuple[str, int] | None:
    ip = _ip_of(addr)
    return None if ip is None or addr is None else (ip, int(addr[1]))


def _peer_ip(flow: http.HTTPFlow) -> str | None:
    return _ip_of(flow.client_conn.peername)


def _listen_port(client: object, shared: int | None) -> int | None:
    """The per-subject port the client connection came in on (host-uid subjects, docs/behaviour.md
    §17), or None on the shared listener (port ``shared``): there the peer address names the
    subject, here the port does. Read from the listener's mode (``transparent@<port>``): in
    transparent mode mitmproxy overwrites the client's ``sockname`` with the original
    destination."""
    mode = getattr(client, "proxy_mode", None)
    port = getattr(mode, "custom_listen_port", None)
    if not isinstance(port, int) or port == shared:
        return None
    return port


def _original_destination(flow: http.HTTPFlow) -> tuple[str, int] | None:
    addr = flow.server_conn.address
    if not addr:
        return None
    try:
        return str(unmap_ip(ipaddress.ip_address(addr[0]))), int(addr[1])
    except ValueError:
        return None


def _headers(pairs: list[tuple[str, str]]) -> http.Headers:
    out = http.Headers()
    for name, value in pairs:
        out.add(name, value)  # str in, encoded the way mitmproxy decoded it
    return out


def _body_pending(req: http.Request) -> bool:
    """True when the body is not fully known at ``requestheaders`` time and may be streamed."""
    if "transfer-encoding" in req.headers:
        return True
    length = req.headers.get("content-length")
    return length is not None and length.strip() not in ("", "0")


def _forward_on_one_authority(req: http.Request) -> None:
    """Put the one authority :func:`one_authority` accepted on the wire once: HTTP/1 in
    origin-form with ``Host`` (inserted from the absolute form when it was missing), HTTP/2
    with ``:authority`` and no ``Host`` beside it (RFC 9113 §8.3.1; mitmproxy adds ``Host``
    from ``:authority`` when it speaks HTTP/1 upstream). Only raw fields are set: mitmproxy's
    ``host``/``port`` setters would rewrite ``Host`` from the destination address."""
    if req.is_http2 or req.is_http3:
        if req.data.authority and "host" in req.headers:
            del req.headers["host"]
    elif req.data.authority:
        if "host" not in req.headers:
            # The raw bytes, round-tripped: ``req.authority`` would be IDNA-decoded to Unicode.
            req.headers.insert(0, "Host", req.data.authority.decode("utf-8", "surrogateescape"))
        req.data.authority = b""


def _destination_unchanged(flow: http.HTTPFlow) -> bool:
    """Transparent mode: the request goes to ``(request.host, request.port)``, which mitmproxy
    set from the connection's original destination (``server_conn.address``), the address
    the lookup's destination check is about. Nothing may have moved it."""
    addr = flow.server_conn.address
    if not addr:
        return False
    return (flow.request.host, flow.request.port) == (addr[0], addr[1])


def _decision_request(req: http.Request, authority: str, port: int, sni: str | None) -> Request:
    """What :func:`decide` sees of the request at ``requestheaders`` time (no body yet)."""
    return Request(
        scheme=req.scheme,
        host=authority,
        port=port,
        method=req.method,
        path=req.path,
        headers=tuple(req.headers.items(multi=True)),
        body=None,
        content_type=req.headers.get("content-type"),
        content_encoding=req.headers.get("content-encoding"),
        sni=sni,
        transfer_encoding=req.headers.get("transfer-encoding"),
    )


def _sequence_reader(path: str) -> SeqReader | None:
    """The map egressd bumps on every narrowing; without it every lookup is a pull (closed)."""
    if not path:
        return None
    try:
        return SeqReader(path)
    except OSError as exc:
        emit("mitm.error", hook="configure", error=f"vault push: {type(exc).__name__}")
        return None


class EgressInjector:
    def __init__(self) -> None:
        self.client: ActiveClient | None = None
        self.shared_port: int | None = None  # the shared listener's port (``listen_port``)
        self.ignore: tuple[re.Pattern[str], ...] = ()
        self.body_redaction = True  # egressd_body_redaction (EGRESSD_MITM_BODY_REDACTION)
        self.buffer_limit = DEFAULT_BUFFER_LIMIT  # mitmproxy's stream_large_bodies

    def load(self, loader: Loader) -> None:
        loader.add_option("egressd_active_socket", str, "", "egressd's private _active unix socket")
        loader.add_option("egressd_body_redaction", bool, True, "redact response bodies and WebSocket messages")
        loader.add_option("egressd_lookup_timeout_ms", int, 250, "milliseconds per _active lookup")
        loader.add_option("egressd_vault_push", str, "", "egressd's narrowing sequence map (empty: pull always)")

    def configure(self, updated: set[str]) -> None:
        if "egressd_body_redaction" in updated:
            self.body_redaction = ctx.options.egressd_body_redaction
        if "stream_large_bodies" in updated:
            self.buffer_limit = human.parse_size(ctx.options.stream_large_bodies) or DEFAULT_BUFFER_LIMIT
        if "listen_port" in updated:
            self.shared_port = ctx.options.listen_port
        if updated & {"egressd_active_socket", "egressd_lookup_timeout_ms", "egressd_vault_push"}:
            self.client = ActiveClient(
                ctx.options.egressd_active_socket,
                ctx.options.egressd_lookup_timeout_ms / 1000,
                seq=_sequence_reader(ctx.options.egressd_vault_push),
            )
        if "ignore_hosts" in updated:
            # mitmproxy's own option (its next_layer tries it on address:port, Host, SNI:port);
            # kept here for the bare SNI (intercept.ignored).
            self.ignore = tuple(re.compile(p, re.IGNORECASE) for p in ctx.options.ignore_hosts)

    def running(self) -> None:
        # Start-up objects live forever: keep them out of full collections, which otherwise
        # pause every flow for 60-130 ms every couple of seconds under load (measured).
        gc.collect()
        gc.freeze()
        server = ctx.master.addons.get("proxyserver")
        if server is not None and server.listen_addrs():
            emit(READY_EVENT, listen=[list(a)[:2] for a in server.listen_addrs()])

    async def done(self) -> None:
        if self.client is not None:
            await self.client.close()

    # ---- connection side: open it or relay it (docs/behaviour.md §16) -------------------------------

    async def tls_clienthello(self, data: tls.ClientHelloData) -> None:
        try:
            await self._tls_clienthello(data)
        except Exception as exc:
            # Left opened, not relayed: every request on it is decided (and refused when the
            # vault cannot be read) by the request hooks below.
            emit("mitm.error", hook="tls_clienthello", error=type(exc).__name__)

    async def _tls_clienthello(self, data: tls.ClientHelloData) -> None:
        context = data.context
        client_ip = _ip_of(context.client.peername)
        dest = _address(context.server.address)
        sni = data.client_hello.sni
        verdict = tls_early(sni, dest[1] if dest else None, self.ignore)
        started = time.perf_counter()
        if verdict is None:
            verdict = await self._vault_verdict(
                context.client, client_ip, lambda snap: tls_by_vault(snap, sni), "decrypt"
            )
        self._connection("tls", verdict, started, client=client_ip, sni=(sni or "")[:255] or None, dest=dest)
        if not verdict.opens:
            # mitmproxy relays the ClientHello and everything after it to the original
            # destination, the address the kernel's input chain judged (transparent mode).
            data.ignore_connection = True

    async def next_layer(self, nextlayer: layer.NextLayer) -> None:
        """Plain HTTP straight on the redirected connection (not inside TLS): relayed as TCP
        for a subject without an http binding. mitmproxy's NextLayer chose the layer already."""
        try:
            await self._next_layer(nextlayer)
        except Exception as exc:
            # The HTTP layer stays: its requests are decided by the request hooks.
            emit("mitm.error", hook="next_layer", error=type(exc).__name__)

    async def _next_layer(self, nextlayer: layer.NextLayer) -> None:
        context = nextlayer.context
        chosen = nextlayer.layer
        # The layer NextLayer built for the redirected connection itself has just joined the
        # stack behind the mode layer; HTTP inside decrypted TLS sits deeper and is not ours.
        if (
            not isinstance(chosen, layers.HttpLayer)
            or not stack_match(context, [modes.TransparentProxy, layers.HttpLayer])
            or context.layers[-1] is not chosen
        ):
            return
        client_ip = _ip_of(context.client.peername)
        dest = _address(context.server.address)
        started = time.perf_counter()
        verdict = http_early(dest[1] if dest else None)
        if verdict is None:
            verdict = await self._vault_verdict(context.client, client_ip, http_by_vault, "parse")
        self._connection("http", verdict, started, client=client_ip, sni=None, dest=dest)
        if not verdict.opens:
            context.layers.remove(chosen)  # the relay replaces it (a layer joins on creation)
            nextlayer.layer = layers.TCPLayer(context, ignore=True)

    async def _vault_verdict(
        self,
        conn: object,
        client_ip: str | None,
        decide: Callable[[VaultSnapshot | None], Verdict],
        opened: Decision,
    ) -> Verdict:
        """Decide with the client's vault; a failed lookup opens the connection (fail closed:
        its requests then meet the same failure and are refused before the upstream)."""
        try:
            view = await self._lookup(conn, client_ip, None, None)
        except LookupFailed:
            return Verdict(opened, REASON_LOOKUP_FAILED)
        return decide(view.snapshot)

    async def _lookup(self, conn: object, client_ip: str | None, host: str | None, dst: str | None) -> View:
        """The vault of the connection's client: by its listener port on a host-uid subject's
        port (docs/behaviour.md §17), else by its peer address."""
        assert self.client is not None
        listen = _listen_port(conn, self.shared_port)
        if listen is None:
            return await self.client.lookup(client_ip, host, dst)
        return await self.client.lookup(client_ip, host, dst, listen_port=listen)

    @staticmethod
    def _connection(
        protocol: str,
        verdict: Verdict,
        started: float,
        *,
        client: str | None,
        sni: str | None,
        dest: tuple[str, int] | None,
    ) -> None:
        emit(
            CONNECTION_EVENT,
            protocol=protocol,
            decision=verdict.decision,
            reason=verdict.reason,
            binding=verdict.binding,
            client=client,
            sni=sni,
            dst=dest[0] if dest else None,
            port=dest[1] if dest else None,
            lookup_ms=round((time.perf_counter() - started) * 1000, 3),
        )

    # ---- request side ----------------------------------------------------------------------

    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        try:
            await self._requestheaders(flow)
        except Exception as exc:  # fail closed: never forward an undecided request
            emit("mitm.error", hook="requestheaders", error=type(exc).__name__)
            flow.kill()

    async def _requestheaders(self, flow: http.HTTPFlow) -> None:
        req = flow.request
        client_ip = _peer_ip(flow)
        dest = _original_destination(flow)
        dst = dest[0] if dest else None
        sni = flow.client_conn.sni if req.scheme == "https" else None
        port = dest[1] if dest else req.port
        authority = self._one_authority(flow, client_ip, dst, sni, port)
        if authority is None:
            return
        norm = normalise_authority(authority) if authority else None
        host = norm[0] if norm else None
        started = time.perf_counter()
        assert self.client is not None
        try:
            view = await self._lookup(flow.client_conn, client_ip, host, dst)
        except LookupFailed as exc:
            self._refuse(flow, LOOKUP_FAILED, client=client_ip, why=str(exc))
            return
        if view.snapshot is None:
            return  # no vault: plain pass-through
        flow.metadata[_META] = view.snapshot
        if self.body_redaction and view.snapshot.redactions:
            # Its response will be scanned: ask only for codings the scan can undo.
            narrowed = narrow_accept_encoding(req.headers.get_all("accept-encoding"))
            if narrowed is not None:
                req.headers["accept-encoding"] = narrowed
        request = _decision_request(req, authority, port, sni)
        decision = decide(view.snapshot, request, destination_ok=view.destination_ok)
        fields = {
            "client": client_ip,
            "host": host,
            "dst": dst,
            "method": req.method,
            "revision": view.snapshot.revision,
            "binding": decision.binding,
            "lookup_ms": round((time.perf_counter() - started) * 1000, 3),
        }
        if decision.kind == "refuse":
            self._refuse(flow, decision, **fields)
            return
        if decision.kind == "pass":
            emit("mitm.pass", reason=decision.reason, **fields)
            return
        if decision.new_path is not None:
            req.path = decision.new_path
        req.headers = _headers(decision.rewrite_headers(request.headers))
        flow.metadata[_META + ".binding"] = decision.binding
        emit(
            "mitm.injected",
            headers=list(decision.injected_names),
            substituted=list(decision.substituted),
            **fields,
        )

    def _one_authority(
        self, flow: http.HTTPFlow, client_ip: str | None, dst: str | None, sni: str | None, port: int
    ) -> str | None:
        """The request's one authority ("" when it names none), now the only one on the wire;
        None when the flow was refused or killed instead."""
        req = flow.request
        # One authority (docs/behaviour.md §14.8), for every flow, vault or not, before the lookup:
        # mitmproxy forwards the HTTP/1 absolute-form authority and both ``:authority`` and
        # ``Host`` as they came, while the decision would run on one of them.
        one = one_authority(req.authority, req.headers.get_all("host"), sni, port, req.path)
        if one.refusal is not None:
            self._refuse(flow, one.refusal, client=client_ip, dst=dst, method=req.method)
            return None
        _forward_on_one_authority(req)
        if not _destination_unchanged(flow):
            emit("mitm.error", hook="requestheaders", error="destination changed")
            flow.kill()
            return None
        return one.value or ""

    def _refuse(self, flow: http.HTTPFlow, outcome: InjectionDecision, **fields: Any) -> None:
        # A chunked body may start streaming upstream while it is read: kill, never wait.
        streamed = bool(flow.request.stream) or (
            _body_pending(flow.request) and "content-length" not in flow.request.headers
        )
        emit("mitm.refused", status=outcome.status, reason=outcome.reason, killed=streamed, **fields)
        if streamed:
            flow.kill()
        elif _body_pending(flow.request):
            # The body is still coming: answer once it is read (``request`` hook), before any
            # upstream connection exists.
            flow.metadata[_META + ".refuse"] = outcome
        else:
            flow.response = http.Response.make(outcome.status, outcome.reason, {"Content-Type": "text/plain"})

    def request(self, flow: http.HTTPFlow) -> None:
        try:
            refusal = flow.metadata.get(_META + ".refuse")
            if isinstance(refusal, InjectionDecision):
                flow.response = http.Response.make(
                    refusal.status, refusal.reason, {"Content-Type": "text/plain"}
                )
                return
            snapshot = flow.metadata.get(_META)
            name = flow.metadata.get(_META + ".binding")
            if not isinstance(snapshot, VaultSnapshot) or not isinstance(name, str) or flow.request.stream:
                return
            binding = find_binding(snapshot, name)
            if binding is None or not any("body" in s.in_ for s in binding.substitutions):
                return
            new_body = substitute_body(
                binding,
                flow.request.raw_content,
                flow.request.headers.get("content-type"),
                flow.request.headers.get("content-encoding"),
                flow.request.headers.get("transfer-encoding"),
            )
            if new_body is not None:
                flow.request.content = new_body
        except Exception as exc:
            emit("mitm.error", hook="request", error=type(exc).__name__)
            flow.kill()

    def response(self, flow: http.HTTPFlow) -> None:
        """The whole response has been read (buffered) or passed on (streamed). Buffered bodies
        are redacted here; trailers (chunked HTTP/1, HTTP/2) are sent after this hook, streamed
        or not, and are redacted like the headers they are on the wire. A streamed body whose
        coding turned out truncated is aborted rather than ended cleanly."""
        try:
            resp = flow.response
            needles = _needles_of(flow)
            if resp is None:
                return
            body = resp.stream
            if isinstance(body, BodyFilter) and body.failed is not None:
                self._abort(flow, body.failed)
                return
            if needles is None:
                return
            if flow.metadata.get(_REDACT_BUFFERED) and resp.raw_content:
                redacted = redact_bytes(resp.raw_content, needles)
                if redacted != resp.raw_content:
                    resp.raw_content = redacted
                    if "content-length" in resp.headers:
                        resp.headers["content-length"] = str(len(redacted))
            if resp.trailers and (trailers := _redacted_headers(resp.trailers, needles)) is not None:
                resp.trailers = trailers
        except Exception as exc:
            emit("mitm.error", hook="response", error=type(exc).__name__)
            flow.kill()

    @staticmethod
    def _abort(flow: http.HTTPFlow, why: str) -> None:
        emit(RESPONSE_REFUSED_EVENT, status=502, reason=why, client=_peer_ip(flow), host=flow.request.pretty_host)
        if flow.killable:
            flow.kill()

    def websocket_message(self, flow: http.HTTPFlow) -> None:
        """Every WebSocket message, either way, with the flow's redaction strings replaced
        (mitmproxy hands over whole messages: frame boundaries are already joined)."""
        try:
            ws = flow.websocket
            if ws is None or not ws.messages:
                return
            message = ws.messages[-1]
            # mitmproxy keeps every message of a connection on its flow: a long-lived socket
            # would grow the child without bound. Only the message in hand is needed.
            del ws.messages[:-1]
            needles = _needles_of(flow)
            if needles is not None and self.body_redaction and message.content:
                redacted = redact_bytes(message.content, needles)
                if redacted != message.content:
                    message.content = redacted
        except Exception as exc:
            emit("mitm.error", hook="websocket_message", error=type(exc).__name__)
            flow.kill()

    # ---- errors ------------------------------------------------------------------------------

    def error(self, flow: http.HTTPFlow) -> None:
        """Malformed HTTP, upstream failures, killed flows: logged by kind, never by content
        (mitmproxy's message may quote raw bytes; only the text before the first ':' is kept)."""
        body = flow.response.stream if flow.response is not None else None
        if isinstance(body, BodyFilter) and body.failed is not None:
            # egressd.mitm.streampatch aborted the streamed body: say why, as a refusal.
            emit(RESPONSE_REFUSED_EVENT, status=502, reason=body.failed, client=_peer_ip(flow), host=flow.request.pretty_host)
            return
        msg = flow.error.msg if flow.error is not None else ""
        emit(
            "mitm.flow_error",
            client=_peer_ip(flow),
            kind=msg.split(":", 1)[0][:80],
            injected=flow.metadata.get(_META + ".binding") is not None,
        )

    def tls_failed_client(self, data: tls.TlsData) -> None:
        """A client that does not trust the CA, or speaks no TLS the proxy accepts."""
        emit("mitm.tls_failed", client=_ip_of(data.context.client.peername), sni=data.context.client.sni)

    # ---- response side ---------------------------------------------------------------------

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        try:
            self._responseheaders(flow)
        except Exception as exc:
            emit("mitm.error", hook="responseheaders", error=type(exc).__name__)
            flow.kill()

    def _responseheaders(self, flow: http.HTTPFlow) -> None:
        """Header values redacted; the body streamed or buffered, and scanned (docs/behaviour.md
        §10), decided here from the headers before its first byte (:func:`plan_response`)."""
        resp = flow.response
        if resp is None:
            return
        needles = _needles_of(flow)
        if needles is not None:
            if (headers := _redacted_headers(resp.headers, needles)) is not None:
                resp.headers = headers
            if resp.reason:
                resp.reason = redact_str(resp.reason, needles)
        plan = plan_response(
            method=flow.request.method,
            status=resp.status_code,
            get=resp.headers.get_all,
            response_version=resp.http_version,
            request_version=flow.request.http_version,
            redact=needles is not None and self.body_redaction,
            buffer_limit=self.buffer_limit,
        )
        if plan.refuse is not None:
            self._abort(flow, plan.refuse)
            return
        if plan.stream:
            resp.stream = _stream_body(resp, plan, needles)
        elif plan.redact:
            flow.metadata[_REDACT_BUFFERED] = True


def _needles_of(flow: http.HTTPFlow) -> Needles | None:
    """The flow's redaction strings, compiled; None when it has none (no vault)."""
    snapshot = flow.metadata.get(_META)
    if not isinstance(snapshot, VaultSnapshot) or not snapshot.redactions:
        return None
    return compile_needles(snapshot.redactions)


def _redacted_headers(headers: http.Headers, needles: Needles) -> http.Headers | None:
    """Header (or trailer) values with every redaction string replaced, names and order kept;
    None when nothing changed."""
    pairs = list(headers.items(multi=True))
    redacted = [(name, redact_str(value, needles)) for name, value in pairs]
    return _headers(redacted) if redacted != pairs else None


def _stream_body(
    resp: http.Response, plan: ResponsePlan, needles: Needles | None
) -> BodyFilter | bool:
    """mitmproxy's ``stream`` for a body passed on as it arrives: the filter (decode, redact)
    with the framing headers the filtered body needs, or True (bytes as they are)."""
    if not plan.redact or needles is None:
        return True
    if plan.codings:
        del resp.headers["content-encoding"]
    if plan.drop_length:
        del resp.headers["content-length"]
    if plan.chunked:
        resp.headers["transfer-encoding"] = "chunked"
    return BodyFilter(needles, plan.codings)

addons = [EgressInjector()]
