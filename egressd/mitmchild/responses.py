"""What comes back (docs/reference/behaviour.md §10): the addon that redacts a decrypted response's
headers, trailers and body (streamed through :class:`~egressd.mitmchild.respbody.BodyFilter`
or buffered, decided from its headers before the first body byte) and WebSocket messages
either way, refuses a body it cannot scan, and logs how a flow ended.
"""

from __future__ import annotations

from mitmproxy import ctx, http
from mitmproxy.addonmanager import Loader
from mitmproxy.utils import human

from egressd.mitmchild.redact import Needles, compile_needles, redact_bytes, redact_str
from egressd.mitmchild.respbody import BodyFilter, ResponsePlan, plan_response
from egressd.mitmchild.shared import BINDING_META, META, emit, peer_ip, wire_headers
from egressd.vault.snapshot import VaultSnapshot

#: A response the MITM would not pass on (a body it cannot scan, a decompression bomb): its
#: request was already counted (injected / pass), so this is no request outcome of its own.
RESPONSE_REFUSED_EVENT = "mitm.response_refused"
#: A response body with a known length up to this is buffered (mitmproxy's ``stream_large_bodies``).
DEFAULT_BUFFER_LIMIT = 1 << 20
_REDACT_BUFFERED = META + ".redact"  # a buffered body, redacted whole in the ``response`` hook


class Responses:
    """Response headers, body, trailers and WebSocket messages redacted; flow errors logged."""

    def __init__(self) -> None:
        self.body_redaction = True  # egressd_body_redaction (EGRESSD_MITM_BODY_REDACTION)
        self.buffer_limit = DEFAULT_BUFFER_LIMIT  # mitmproxy's stream_large_bodies

    def load(self, loader: Loader) -> None:
        loader.add_option("egressd_body_redaction", bool, True, "redact response bodies and WebSocket messages")

    def configure(self, updated: set[str]) -> None:
        if "egressd_body_redaction" in updated:
            self.body_redaction = ctx.options.egressd_body_redaction
        if "stream_large_bodies" in updated:
            self.buffer_limit = human.parse_size(ctx.options.stream_large_bodies) or DEFAULT_BUFFER_LIMIT

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
        emit(RESPONSE_REFUSED_EVENT, status=502, reason=why, client=peer_ip(flow), host=flow.request.pretty_host)
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
            # egressd.mitmchild.streampatch aborted the streamed body: say why, as a refusal.
            emit(RESPONSE_REFUSED_EVENT, status=502, reason=body.failed, client=peer_ip(flow), host=flow.request.pretty_host)
            return
        msg = flow.error.msg if flow.error is not None else ""
        emit(
            "mitm.flow_error",
            client=peer_ip(flow),
            kind=msg.split(":", 1)[0][:80],
            injected=flow.metadata.get(BINDING_META) is not None,
        )

    # ---- response side ---------------------------------------------------------------------

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        try:
            self._responseheaders(flow)
        except Exception as exc:
            emit("mitm.error", hook="responseheaders", error=type(exc).__name__)
            flow.kill()

    def _responseheaders(self, flow: http.HTTPFlow) -> None:
        """Header values redacted; the body streamed or buffered, and scanned (docs/reference/behaviour.md
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
    snapshot = flow.metadata.get(META)
    if not isinstance(snapshot, VaultSnapshot) or not snapshot.redactions:
        return None
    return compile_needles(snapshot.redactions)


def _redacted_headers(headers: http.Headers, needles: Needles) -> http.Headers | None:
    """Header (or trailer) values with every redaction string replaced, names and order kept;
    None when nothing changed."""
    pairs = list(headers.items(multi=True))
    redacted = [(name, redact_str(value, needles)) for name, value in pairs]
    return wire_headers(redacted) if redacted != pairs else None


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
