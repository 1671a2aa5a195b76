"""Credential injection (docs/reference/behaviour.md §10): the addon that decides every intercepted request
before anything reaches the upstream, a thin shell around :mod:`egressd.mitmchild.inject` (the
decision) and the client's vault (:mod:`egressd.mitmchild.vaults`: the vault of the flow's
client, and whether the connection's original destination was learned for the request host).

Fail closed: a failed lookup refuses the request before anything reaches the upstream (503
when the body is complete, killed when it is streamed or chunked); an unexpected error in a
hook kills the flow instead of letting mitmproxy carry on with an undecided request.
"""

from __future__ import annotations

import ipaddress
import json
import time
from typing import Any

from mitmproxy import ctx, http

from egressd.addr import unmap_ip
from egressd.mitmchild.authority import normalise_authority, one_authority
from egressd.mitmchild.inject import decide, find_binding
from egressd.mitmchild.injectdata import LOOKUP_FAILED, InjectionDecision, Request
from egressd.mitmchild.intercept import sni_name
from egressd.mitmchild.lookup import LookupFailed
from egressd.mitmchild.names import LOOKUP_FAILED as NAME_LOOKUP_FAILED
from egressd.mitmchild.names import NameAnswer, NameGate, as_name
from egressd.mitmchild.requestgate import RequestGate
from egressd.mitmchild.reqview import LOOKUP_FAILED as REQ_LOOKUP_FAILED
from egressd.mitmchild.reqview import NO_HOST as REQ_NO_HOST
from egressd.mitmchild.reqview import refusal_body, report_doc, request_target
from egressd.mitmchild.respbody import narrow_accept_encoding
from egressd.mitmchild.shared import BINDING_META, META, emit, peer_ip, wire_headers
from egressd.mitmchild.substitute import substitute_body
from egressd.mitmchild.vaults import VaultLookup
from egressd.vault.snapshot import VaultSnapshot


def _original_destination(flow: http.HTTPFlow) -> tuple[str, int] | None:
    addr = flow.server_conn.address
    if not addr:
        return None
    try:
        return str(unmap_ip(ipaddress.ip_address(addr[0]))), int(addr[1])
    except ValueError:
        return None


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


def _unnamed(flow: http.HTTPFlow) -> str | None:
    """The name a request without any authority is for: its connection's SNI (TLS; None when it
    has none or an IP literal), "" on plain HTTP (no name at all)."""
    if flow.client_conn.tls:
        return as_name(sni_name(flow.client_conn.sni))
    return ""


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


class Injection:
    """Every intercepted request decided in ``requestheaders`` (headers, path, query), its body
    substituted in ``request``; refused before anything reaches the upstream."""

    def __init__(
        self, vaults: VaultLookup, names: NameGate | None = None, requests: RequestGate | None = None
    ) -> None:
        self.vaults = vaults
        self.names = names
        self.requests = requests
        self.body_redaction = True  # egressd_body_redaction (EGRESSD_MITM_BODY_REDACTION)

    def configure(self, updated: set[str]) -> None:
        if "egressd_body_redaction" in updated:
            self.body_redaction = ctx.options.egressd_body_redaction

    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        try:
            await self._requestheaders(flow)
        except Exception as exc:  # fail closed: never forward an undecided request
            emit("mitm.error", hook="requestheaders", error=type(exc).__name__)
            flow.kill()

    async def _requestheaders(self, flow: http.HTTPFlow) -> None:
        req = flow.request
        client_ip = peer_ip(flow)
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
        asked = host if norm is not None or not authority else authority  # unreadable: as written, refused
        if await self._name_refused(flow, client_ip, asked, dest):
            return
        if await self._request_refused(flow, client_ip, host, port):
            return
        assert self.vaults.client is not None
        try:
            view = await self.vaults.lookup(flow.client_conn, client_ip, host, dst)
        except LookupFailed as exc:
            self._refuse(flow, LOOKUP_FAILED, client=client_ip, why=str(exc))
            return
        if view.snapshot is None:
            return  # no vault: plain pass-through
        flow.metadata[META] = view.snapshot
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
        req.headers = wire_headers(decision.rewrite_headers(request.headers))
        flow.metadata[BINDING_META] = decision.binding
        emit(
            "mitm.injected",
            headers=list(decision.injected_names),
            substituted=list(decision.substituted),
            **fields,
        )

    async def _name_refused(
        self, flow: http.HTTPFlow, client_ip: str | None, host: str | None, dest: tuple[str, int] | None
    ) -> bool:
        """Plain HTTP on an intercepted port (docs/reference/behaviour.md §18): may this request's
        ``Host`` reach the connection's original destination? Refused: 403 (503 when egressd
        could not answer) with a JSON body naming the reason, before any upstream connection;
        the client connection stays.

        A decrypted TLS connection was admitted by its SNI; each of its requests asks again by
        that SNI (answered from memory while the policy stays as it was), so a narrowing that
        takes the name away refuses the next request on a connection already open (§14.1)."""
        names = self.names
        if names is None or not names.enabled:
            return False
        if flow.client_conn.tls:
            wire, asked = "tls", as_name(sni_name(flow.client_conn.sni))
        elif flow.request.scheme == "http":
            wire, asked = "http", as_name(host)
        else:
            return False
        if dest is None:
            answer = NameAnswer(False, NAME_LOOKUP_FAILED)
        else:
            answer = await names.ask(flow.client_conn, client_ip, wire, asked, dest[0], dest[1])
        if answer.admit:
            return False
        reason = answer.reason or NAME_LOOKUP_FAILED
        status = 503 if reason == NAME_LOOKUP_FAILED else 403
        body = json.dumps({"error": "egress_denied", "host": host, "reason": reason})
        outcome = InjectionDecision("refuse", status=status, reason=reason)
        response = http.Response.make(status, body, {"Content-Type": "application/json"})
        fields = {
            "client": client_ip,
            "host": host,
            "dst": dest[0] if dest else None,
            "method": flow.request.method,
        }
        self._answer_refusal(flow, outcome, response, fields)
        return True

    async def _request_refused(
        self, flow: http.HTTPFlow, client_ip: str | None, host: str | None, port: int
    ) -> bool:
        """Request rules (docs/reference/behaviour.md §19): decide this request by the first rule
        matching its name, port, method and path. Refused: 403 with the JSON body of §19 (503 when
        egressd's view could not be had), before anything reaches the upstream and before any
        credential is injected; reported to egressd after the answer. Audit: a would-deny is
        reported and forwarded (an operator always-deny is still refused). A request without a
        name (an IP literal) matches no domain rule: not judged here; one without any authority is
        judged by its TLS SNI, and refused on plain HTTP for a subject with request rules."""
        gate, req = self.requests, flow.request
        name = as_name(host) if host else _unnamed(flow)
        if gate is None or name is None:
            return False
        view = await gate.view(flow.client_conn, client_ip, name or None)
        if view is not None and not view.judged:
            return False
        if view is None:
            status, subject, reason, rule = 503, "-", REQ_LOOKUP_FAILED, None
        elif not name:
            # Plain HTTP naming no host at all, of a subject with request rules: the upstream
            # would pick the host; no rule can be matched, so it is refused.
            status, subject, reason, rule = 403, view.subject, REQ_NO_HOST, None
        else:
            judgement = view.judge(port, req.method, request_target(req.path))
            if not judgement.denied:
                return False
            gate.report(
                flow.client_conn, client_ip, report_doc(host or "", port, req.method, req.path, judgement)
            )
            if judgement.forward:
                emit("mitm.request_would_refuse", client=client_ip, host=host, method=req.method)
                return False
            status, subject, reason, rule = 403, view.subject, judgement.reason, judgement.rule
        body = refusal_body(subject, host, req.method, req.path, reason, rule)
        response = http.Response.make(status, body, {"Content-Type": "application/json"})
        outcome = InjectionDecision("refuse", status=status, reason=reason)
        self._answer_refusal(
            flow, outcome, response, {"client": client_ip, "host": host, "method": req.method}
        )
        return True

    def _one_authority(
        self, flow: http.HTTPFlow, client_ip: str | None, dst: str | None, sni: str | None, port: int
    ) -> str | None:
        """The request's one authority ("" when it names none), now the only one on the wire;
        None when the flow was refused or killed instead."""
        req = flow.request
        # One authority (docs/reference/behaviour.md §14.8), for every flow, vault or not, before the lookup:
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
        response = http.Response.make(outcome.status, outcome.reason, {"Content-Type": "text/plain"})
        self._answer_refusal(flow, outcome, response, fields)

    def _answer_refusal(
        self, flow: http.HTTPFlow, outcome: InjectionDecision, response: http.Response, fields: dict[str, Any]
    ) -> None:
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
            flow.metadata[META + ".refuse"] = response
        else:
            flow.response = response

    def request(self, flow: http.HTTPFlow) -> None:
        try:
            refusal = flow.metadata.get(META + ".refuse")
            if isinstance(refusal, http.Response):
                flow.response = refusal
                return
            snapshot = flow.metadata.get(META)
            name = flow.metadata.get(BINDING_META)
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
