"""What the MITM does with a response body of a decrypted connection (docs/reference/behaviour.md §10).
Pure: decided from the response headers alone, before the first body byte.

Streamed or buffered (:func:`plan_response`):

* A body of unknown length (chunked, HTTP/1 delimited by the connection's end, HTTP/2 without
  ``content-length``), a ``text/event-stream``, and a body longer than the buffer limit are
  **streamed**: each chunk is passed on as it arrives (server-sent events reach the client as the
  upstream produces them).
* A body with a known length up to the buffer limit is buffered whole, as mitmproxy does by
  default (the client keeps its ``Content-Length``).

Redaction (when the flow carries a vault): every body is scanned, streamed ones chunk by chunk
through :class:`BodyFilter` (the same redactor as buffered ones). A body in a content coding is
decoded to be scanned and forwarded **decoded**: ``Content-Encoding`` and ``Content-Length``
are removed (re-compressing would cost the MITM CPU for bytes that stay on the pod's own links).
A streamed body whose length may change loses its ``Content-Length``; an HTTP/1.1 exchange
gets ``Transfer-Encoding: chunked`` instead, an HTTP/1.0 client a body delimited by the end of
the connection, HTTP/2 needs neither. A coding that cannot be decoded refuses the response.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Final

from egressd.mitmchild.bodycodec import DEFAULT_LIMIT, SUPPORTED, DecodeError, Decoder, parse_codings
from egressd.mitmchild.redact import Needles, StreamRedactor

REASON_UNSUPPORTED_CODING: Final = "response content-encoding cannot be scanned for credentials"

Getter = Callable[[str], list[str]]  # every value of a header (case-insensitive name)


@dataclass(frozen=True, slots=True)
class ResponsePlan:
    """How one response body goes to the client."""

    stream: bool = False  # passed on chunk by chunk as it arrives
    redact: bool = False  # through the redactor (streamed: BodyFilter; buffered: the response hook)
    codings: tuple[str, ...] = ()  # content codings decoded before the scan (and not re-applied)
    drop_length: bool = False  # remove Content-Length (the scanned body may differ in length)
    chunked: bool = False  # add Transfer-Encoding: chunked (HTTP/1.1 both ways)
    refuse: str | None = None  # the body cannot be scanned: refuse the response


NO_BODY: Final = ResponsePlan()


def _length(get: Getter) -> int | None:
    """The ``Content-Length`` when the body is framed by it (one valid value, no
    ``Transfer-Encoding``), else None (unknown until the end)."""
    if get("transfer-encoding"):
        return None
    values = {v.strip() for v in get("content-length")}
    if len(values) != 1:
        return None
    value = values.pop()
    return int(value) if value.isdigit() else None


def has_body(method: str, status: int) -> bool:
    """RFC 9110: HEAD, 1xx, 204 and 304 responses carry no body."""
    return method.upper() != "HEAD" and status >= 200 and status not in (204, 304)


def plan_response(
    *,
    method: str,
    status: int,
    get: Getter,
    response_version: str,
    request_version: str,
    redact: bool,
    buffer_limit: int,
) -> ResponsePlan:
    """The plan for one response, from its headers (``get``) and both sides' HTTP versions."""
    if not has_body(method, status):
        return NO_BODY
    length = _length(get)
    event_stream = any(v.split(";", 1)[0].strip().lower() == "text/event-stream" for v in get("content-type"))
    stream = length is None or event_stream or length > buffer_limit
    if not redact:
        return ResponsePlan(stream=stream)
    codings = parse_codings(get("content-encoding"))
    if codings is None:
        return ResponsePlan(refuse=REASON_UNSUPPORTED_CODING)
    stream = stream or bool(codings)
    if not stream:
        return ResponsePlan(redact=True)  # buffered: the whole body is redacted at once
    had_length = length is not None or bool(get("content-length"))
    chunked = (
        had_length
        and not get("transfer-encoding")
        and response_version == "HTTP/1.1"
        and request_version == "HTTP/1.1"
    )
    return ResponsePlan(stream=True, redact=True, codings=codings, drop_length=had_length, chunked=chunked)


def narrow_accept_encoding(values: Iterable[str]) -> str | None:
    """A request's ``Accept-Encoding`` with the codings the MITM cannot decode left out (so an
    upstream does not answer in one and get the response refused); None when nothing changes.
    ``*`` goes too, and a list left empty becomes ``identity`` (no header at all would mean
    "any coding", RFC 9110 §12.5.3)."""
    items = [item.strip() for value in values for item in value.split(",") if item.strip()]
    keep = [
        item
        for item in items
        if (name := item.split(";", 1)[0].strip().lower()) in SUPPORTED or name in ("identity", "x-gzip")
    ]
    if keep == items:
        return None
    return ", ".join(keep) or "identity"


class BodyFilter:
    """mitmproxy's per-chunk stream callable for one response body: decode (when the plan says
    so), then redact. Called with every chunk as it arrives and with ``b""`` once at the end.

    Never returns an empty chunk (on HTTP/1 chunked an empty chunk would end the body). When the
    body cannot be passed on (corrupt or truncated coding, a chunk that decodes to more than
    the limit), ``failed`` says why and nothing more is released; the addon then aborts the
    response instead of ending it cleanly."""

    def __init__(self, needles: Needles, codings: tuple[str, ...] = (), limit: int = DEFAULT_LIMIT) -> None:
        self._decoder = Decoder(codings, limit) if codings else None
        self._redactor = StreamRedactor(needles)
        self.failed: str | None = None
        self.ended = False

    def __call__(self, chunk: bytes) -> list[bytes]:
        if self.failed is not None or self.ended:
            return []
        try:
            if chunk:
                return self._pass(self._decoder.feed(chunk) if self._decoder else (chunk,))
            self.ended = True
            if self._decoder is not None:
                self._decoder.finish()
            return [x for x in (self._redactor.finish(),) if x]
        except DecodeError as exc:
            self.failed = str(exc)
            return []

    def _pass(self, pieces: Iterable[bytes]) -> list[bytes]:
        out: list[bytes] = []
        for piece in pieces:
            if released := self._redactor.feed(piece):
                out.append(released)
        return out

    @property
    def held(self) -> int:
        """Bytes of the body held back for the carry-over window right now."""
        return self._redactor.held
