"""Credential injection decisions for the transparent MITM (docs/behaviour.md §10, §6).

Pure functions on plain data: no I/O, no logging, no mitmproxy. The addon turns a flow into a
:class:`Request`, calls :func:`decide` with the client's :class:`VaultSnapshot` (the ``_active``
body of §10), and applies the :class:`InjectionDecision`:

* ``pass``: forward untouched (no vault, no binding matches, destination not verified, TLS
  without SNI). Nothing about the request is changed.
* ``refuse``: answer ``status`` with ``reason`` as a ``text/plain`` body **before anything goes
  upstream**, or kill the flow when the request body is streamed (a response cannot be served
  then). ``status`` is 403 from :func:`decide`; :data:`LOOKUP_FAILED` is the 503 the addon uses
  when the ``_active`` lookup fails.
* ``inject``: apply, in this order, ``new_path`` (path and query, when not None),
  ``header_updates`` then ``set_headers`` (:meth:`InjectionDecision.rewrite_headers` does both), and
  ``new_body`` (when not None; the adapter then fixes ``Content-Length`` / drops
  ``Transfer-Encoding`` as for any body rewrite). Response headers of such a flow go through
  :func:`redact_response_headers` with the snapshot's ``redactions``.

Two-phase use (mitmproxy streams bodies above ``stream_large_bodies`` before the ``request``
hook): call :func:`decide` in ``requestheaders`` with ``body=None`` (headers, path and query
are done there, before the upstream connection exists), keep ``outcome.binding``, and in
``request`` call :func:`substitute_body` with :func:`find_binding` of the same snapshot (not a
re-fetched one) unless the body was streamed.

One authority (docs/behaviour.md §14.8): before anything else the addon reduces the request to
:func:`one_authority`: the HTTP/1 absolute-form authority, the HTTP/2 ``:authority``, the
``Host`` header and the SNI must all name the same host (and any explicit port the
connection's), else 400 before the lookup, before the upstream. The addon then forwards that
one authority only (origin-form, no second ``Host`` beside ``:authority``) to the connection's
original destination.

Forged Host / SNI: the binding match runs on that authority, which the sandbox controls, and the SNI is only as good as the upstream certificate check. The caller
therefore passes ``destination_ok``: True only when the connection's original destination IP
is one the subject learned (through the DNS proxy) for the request's host, or one a static
policy rule allows for it. When it is False the request is treated as outside every
binding's scope: :func:`decide` passes it through **without credentials** (never a refusal),
so a sandbox that opens a connection to an address of its choice and sends
``Host: api.example.com`` never receives that binding's credential.

Secrecy: credential values and placeholders never appear in a ``reason`` or in the
``repr()``/``str()`` of :class:`Request` or :class:`InjectionDecision` (request paths, headers and
bodies are hidden too: they may carry placeholders). Reasons are fixed texts plus binding
names.
"""

from __future__ import annotations

import bisect
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal
from urllib.parse import quote, quote_plus, unquote

from egressd.mitmchild.redact import MARKER, compile_needles, redact_str
from egressd.policy.evaluate import domain_matches
from egressd.policy.idn import IdnaError, to_alabels
from egressd.vault.model import RESERVED_HEADERS, SCHEME_PORTS
from egressd.vault.store import ActiveBinding, ActiveSubstitution, VaultSnapshot

__all__ = [
    "AMBIGUOUS_AUTHORITY",
    "CONNECTION_TOKENS",
    "LOOKUP_FAILED",
    "REASON_AMBIGUOUS",
    "REASON_AUTHORITY",
    "REASON_DESTINATION",
    "REASON_HOP_BY_HOP",
    "REASON_LOOKUP_FAILED",
    "REASON_NO_MATCH",
    "REASON_NO_SNI",
    "REASON_NO_VAULT",
    "REASON_PATH",
    "REASON_SNI",
    "REASON_SUBSTITUTED_PATH",
    "REASON_TARGET_OVERRIDE",
    "REDACTION_MARKER",
    "TARGET_OVERRIDE_HEADERS",
    "DecisionKind",
    "InjectionDecision",
    "OneAuthority",
    "Request",
    "RewriteError",
    "decide",
    "find_binding",
    "header_reserved",
    "normalise_authority",
    "one_authority",
    "path_problem",
    "redact_response_headers",
    "redact_text",
    "substitute",
    "substitute_body",
]

#: What every redaction string becomes in a response header value (§10).
REDACTION_MARKER: Final = MARKER.decode()

REASON_NO_VAULT: Final = "no credential vault"
REASON_NO_MATCH: Final = "no credential binding matches"
REASON_DESTINATION: Final = "destination not verified for the request host; no credentials injected"
REASON_NO_SNI: Final = "TLS without SNI; no credentials injected"
REASON_AMBIGUOUS: Final = "credential binding ambiguous"
REASON_SNI: Final = "request endpoint identity does not match credential binding"
REASON_PATH: Final = "request path contains ambiguous segments"
REASON_SUBSTITUTED_PATH: Final = "request path contains ambiguous substituted segments"
REASON_LOOKUP_FAILED: Final = "credential vault lookup failed"
REASON_AUTHORITY: Final = "request authority is ambiguous"
REASON_HOP_BY_HOP: Final = "Connection header names a header that must be forwarded"
REASON_TARGET_OVERRIDE: Final = "request carries a header that overrides its target"

#: The only ``Connection`` options an injected request may carry. Any other token names a
#: header the next hop would drop (RFC 9110 §7.6.1): ``Connection: content-length`` turns the
#: rest of the body into a smuggled request (body substitutions included) on the upstream
#: connection, ``Connection: host`` leaves the next hop routing on something else, and
#: ``Connection: authorization`` is how a credential would be stripped or replayed.
CONNECTION_TOKENS: Final = frozenset({"close", "keep-alive", "upgrade", "te"})

#: Headers that servers and front ends honour as the request's real host, path or method.
#: A binding names hosts, paths and methods; a credential injected into a request that
#: carries one of these would be used for a target the binding does not name (docs/behaviour.md §14.8).
TARGET_OVERRIDE_HEADERS: Final = frozenset(
    {
        "forwarded",
        "x-forwarded-host",
        "x-host",
        "x-original-host",
        "x-forwarded-server",
        "x-original-url",
        "x-rewrite-url",
        "x-http-method-override",
        "x-http-method",
        "x-method-override",
    }
)

DecisionKind = Literal["pass", "inject", "refuse"]
Surface = Literal["path", "query", "header", "body"]


# --------------------------------------------------------------------------------------------
# Plain data in and out


@dataclass(frozen=True, slots=True)
class Request:
    """One intercepted request, as the addon sees it in ``requestheaders`` / ``request``.

    ``host`` is the Host header / ``:authority`` (may carry ``:port``); ``port`` the
    connection's (original) destination port; ``path`` the raw request target including the
    query; ``headers`` in wire order, duplicates kept (indices are what
    :attr:`InjectionDecision.header_updates` refers to); ``body`` None when streamed or not read yet;
    ``content_type`` / ``content_encoding`` / ``transfer_encoding`` the request's header
    values (None when absent); ``sni`` the client's ClientHello SNI (None for plaintext HTTP
    or no SNI). The caller has already reduced the request to :func:`one_authority`.
    """

    scheme: str
    host: str
    port: int
    method: str
    path: str = field(repr=False)
    headers: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    body: bytes | None = field(default=None, repr=False)
    # Header values like the others: a sandbox can put a placeholder (or anything) in them.
    content_type: str | None = field(default=None, repr=False)
    content_encoding: str | None = field(default=None, repr=False)
    sni: str | None = None
    transfer_encoding: str | None = None


@dataclass(frozen=True, slots=True)
class InjectionDecision:
    """What to do with a request; see the module docstring for how to apply it.

    ``reason`` is a fixed text (for a refusal: the response body); ``binding`` names the
    selected binding for ``inject`` and for refusals made after one binding was selected
    (SNI, path), None otherwise. ``set_headers``
    are ``(name, value)`` pairs to set after deleting every same-name header
    (case-insensitively). ``header_updates`` are ``(index into Request.headers, new value)``
    from ``header`` substitutions (indices, not names, so duplicate headers stay exact).
    ``new_path`` is the full new request target (path and query) or None when unchanged;
    ``new_body`` the new body or None when unchanged. ``substituted`` lists the surfaces
    (``path``, ``query``, ``header``, ``body``) where a placeholder was replaced, for logs.
    """

    kind: DecisionKind
    status: int = 0
    reason: str = ""
    binding: str | None = None
    set_headers: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    header_updates: tuple[tuple[int, str], ...] = field(default=(), repr=False)
    new_path: str | None = field(default=None, repr=False)
    new_body: bytes | None = field(default=None, repr=False)
    substituted: tuple[Surface, ...] = ()

    def __repr__(self) -> str:
        path = "None" if self.new_path is None else "<redacted>"
        body = "None" if self.new_body is None else f"<{len(self.new_body)} bytes>"
        return (
            f"InjectionDecision(kind={self.kind!r}, status={self.status}, reason={self.reason!r}, "
            f"binding={self.binding!r}, set_headers={list(self.injected_names)!r}, "
            f"header_updates=<{len(self.header_updates)}>, new_path={path}, new_body={body}, "
            f"substituted={self.substituted!r})"
        )

    __str__ = __repr__

    @property
    def injected_names(self) -> tuple[str, ...]:
        """The names of the injected headers (safe to log)."""
        return tuple(name for name, _ in self.set_headers)

    def rewrite_headers(self, headers: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
        """``headers`` (the :attr:`Request.headers` the outcome was decided on) with the header
        substitutions applied, same-name headers of ``set_headers`` removed case-insensitively
        and ``set_headers`` appended."""
        out = list(headers)
        # The exact rewrite list (docs/security.md): values of non-reserved headers at the
        # indices decided on, and the binding's non-reserved headers. Anything else is a bug
        # and the addon kills the flow rather than forward it.
        for name, _ in self.set_headers:
            if header_reserved(name):
                raise RewriteError("reserved header in set_headers")
        for index, value in self.header_updates:
            if not 0 <= index < len(out) or header_reserved(out[index][0]):
                raise RewriteError("header update outside the rewrite list")
            out[index] = (out[index][0], value)
        if self.set_headers:
            drop = {name.lower() for name, _ in self.set_headers}
            out = [(n, v) for n, v in out if n.lower() not in drop]
            out.extend(self.set_headers)
        return out


class RewriteError(ValueError):
    """An outcome asks for a rewrite outside the exact list (never expected; fail closed)."""


LOOKUP_FAILED: Final = InjectionDecision("refuse", status=503, reason=REASON_LOOKUP_FAILED)
"""The outcome for every intercepted flow of a client whose ``_active`` lookup failed (§10)."""

_PASS_NO_VAULT: Final = InjectionDecision("pass", reason=REASON_NO_VAULT)
_PASS_NO_MATCH: Final = InjectionDecision("pass", reason=REASON_NO_MATCH)


def _refuse(reason: str, binding: str | None = None, status: int = 403) -> InjectionDecision:
    return InjectionDecision("refuse", status=status, reason=reason, binding=binding)


AMBIGUOUS_AUTHORITY: Final = InjectionDecision("refuse", status=400, reason=REASON_AUTHORITY)
"""The 400 of :func:`one_authority` (docs/behaviour.md §14.8)."""


# --------------------------------------------------------------------------------------------
# Names

_NAME_RE: Final = re.compile(r"[a-z0-9_-]+(?:\.[a-z0-9_-]+)*")
_PORT_RE: Final = re.compile(r"[0-9]{1,5}")


def _dns_name(text: str) -> str | None:
    """A-labels, lower-cased, one trailing dot dropped; None unless it looks like a DNS name.

    A Unicode Host (or SNI) is compared as its A-labels, like the binding hosts and the names
    the DNS proxy learned (docs/behaviour.md §14.3); one that is not a valid IDN matches nothing.
    """
    try:
        name = to_alabels(text.strip()).lower()
    except IdnaError:
        return None
    if name.endswith("."):
        name = name[:-1]
    return name if _NAME_RE.fullmatch(name) else None


def normalise_authority(authority: str) -> tuple[str, int | None] | None:
    """``API.Example.COM.:443`` -> ``("api.example.com", 443)``; no port -> None port.

    None when the authority is not a DNS name (IP literals in brackets, junk, a bad port):
    such a request matches no binding.
    """
    text = authority.strip()
    if text.startswith("["):
        return None
    port: int | None = None
    head, sep, tail = text.rpartition(":")
    if sep:
        if tail:
            if not _PORT_RE.fullmatch(tail) or int(tail) > 65535:
                return None
            port = int(tail)
        text = head
    name = _dns_name(text)
    return None if name is None else (name, port)


def _authority_key(text: str) -> tuple[str, int | None] | None:
    """``(host, explicit port or None)`` for comparing authorities: DNS names as
    :func:`normalise_authority` has them, IP literals lower-cased (brackets kept); None when
    ``text`` cannot be split into a host and a valid port at all."""
    norm = normalise_authority(text)
    if norm is not None:
        return norm
    text = text.strip().lower()
    if text.startswith("["):
        close = text.find("]")
        if close < 0:
            return None
        host, rest = text[: close + 1], text[close + 1 :]
        if not rest:
            return host, None
        if not rest.startswith(":"):
            return None
        tail = rest[1:]
    else:
        host, sep, tail = text.rpartition(":")
        if not sep:
            return (text, None) if text else None
    if not host or not _PORT_RE.fullmatch(tail) or int(tail) > 65535:
        return None
    return host, int(tail)


@dataclass(frozen=True, slots=True)
class OneAuthority:
    """The result of :func:`one_authority`: ``value`` the authority to decide and forward on
    (a Host / ``:authority`` text, None when the request names none), or ``refusal``."""

    value: str | None
    refusal: InjectionDecision | None = None


def one_authority(
    target: str, host_headers: Sequence[str], sni: str | None, port: int, path: str = "/"
) -> OneAuthority:
    """The request's one authority (docs/behaviour.md §14.8), or the 400 :data:`AMBIGUOUS_AUTHORITY`.

    ``target`` is the HTTP/1 absolute-form authority or the HTTP/2 ``:authority`` ("" when
    absent: origin-form); ``host_headers`` every ``Host`` header value in wire order; ``sni``
    the ClientHello SNI (None when absent or plaintext); ``port`` the connection's original
    destination port, which is where the request goes whatever it says.

    Refused: more than one ``Host`` header (RFC 9112 §3.2 says 400); a target and a ``Host``
    that name different hosts or ports (case, one trailing dot, IDN form and an explicit
    default port do not count as different); an explicit port other than ``port`` (the
    request would be forwarded to an authority it does not name); an SNI that differs from
    the authority's host when both are present; a ``path`` (request target without the
    authority) that is neither origin-form nor ``*``: an HTTP/2 ``:path`` of
    ``https://other/x`` becomes an absolute-form request line naming another authority when
    mitmproxy speaks HTTP/1 upstream. Servers and front ends disagree about which
    of these wins (RFC 9112 §3.2.2 says the request-target, many CDNs route on the SNI), so
    a request whose names disagree is never decided on one of them and forwarded on another.
    """
    if len(host_headers) > 1 or not (path.startswith("/") or path == "*"):
        return OneAuthority(None, AMBIGUOUS_AUTHORITY)
    sources = ([target] if target else []) + list(host_headers)
    if not sources:
        return OneAuthority(None)
    keys = [_authority_key(text) for text in sources]
    first = keys[0]
    if first is None:
        # Not even host[:port]: matches no binding; refuse only when something else disagrees.
        if len(sources) > 1 or sni:
            return OneAuthority(None, AMBIGUOUS_AUTHORITY)
        return OneAuthority(sources[-1])
    if any(key is None or key[0] != first[0] for key in keys):
        return OneAuthority(None, AMBIGUOUS_AUTHORITY)
    # Every explicit port must be the connection's: then all sources name the same port too.
    if any(key is not None and key[1] is not None and key[1] != port for key in keys):
        return OneAuthority(None, AMBIGUOUS_AUTHORITY)
    if sni and _dns_name(sni) != first[0]:
        return OneAuthority(None, AMBIGUOUS_AUTHORITY)
    # The Host header when present (HTTP/1 forwards it; the addon drops the absolute form),
    # else the target: equal names either way.
    return OneAuthority(sources[-1])


def header_reserved(name: str) -> bool:
    """Reserved headers (§6) and HTTP/2 pseudo-headers are never injected or rewritten."""
    return name.lower() in RESERVED_HEADERS or name.startswith(":")


# --------------------------------------------------------------------------------------------
# Binding match


@dataclass(frozen=True, slots=True)
class _Target:
    scheme: str
    method: str
    host: str


def _target(req: Request) -> _Target | None:
    """The match key, or None when the request can match no binding at all: unknown scheme,
    a port other than the scheme's canonical one (connection or explicit Host port), or a
    host that is not a DNS name."""
    scheme = req.scheme.strip().lower()
    canonical = SCHEME_PORTS.get(scheme)
    if canonical is None or req.port != canonical:
        return None
    authority = normalise_authority(req.host)
    if authority is None:
        return None
    host, port = authority
    if port is not None and port != canonical:
        return None
    return _Target(scheme, req.method.strip().upper(), host)


def _host_precedence(host: str, pattern: str) -> int:
    """2 exact, 1 wildcard (``*.x.com``: at least one extra label, never the apex), 0 none."""
    if pattern.startswith("*."):
        return 1 if domain_matches(pattern, host) else 0
    return 2 if host == pattern else 0


def _path_matches(path: str, pattern: str) -> bool:
    if pattern.endswith("*"):
        return path.startswith(pattern[:-1])
    return path == pattern


def _precedence(binding: ActiveBinding, target: _Target, path: str) -> int:
    match = binding.match
    if target.scheme not in match.schemes or target.method not in match.methods:
        return 0
    if not any(_path_matches(path, p) for p in match.paths):
        return 0
    return max((_host_precedence(target.host, h) for h in match.hosts), default=0)


def _matches(bindings: Sequence[ActiveBinding], target: _Target, path: str) -> dict[int, int]:
    """``{binding index: precedence}`` of every binding matching ``path`` (query dropped)."""
    out: dict[int, int] = {}
    for i, binding in enumerate(bindings):
        precedence = _precedence(binding, target, path)
        if precedence:
            out[i] = precedence
    return out


def find_binding(snapshot: VaultSnapshot, name: str | None) -> ActiveBinding | None:
    """The snapshot's binding called ``name`` (for the body phase), or None."""
    for binding in snapshot.bindings:
        if binding.name == name:
            return binding
    return None


def _sni_in_scope(sni: str, binding: ActiveBinding) -> bool:
    name = _dns_name(sni)
    if name is None:
        return False
    return any(_host_precedence(name, pattern) for pattern in binding.match.hosts)


def _hop_by_hop_problem(headers: Sequence[tuple[str, str]]) -> bool:
    """A ``Connection`` option outside :data:`CONNECTION_TOKENS` (any ``Connection`` header,
    any case, comma lists and duplicates included)."""
    for name, value in headers:
        if name.strip().lower() not in ("connection", "proxy-connection"):
            continue
        for token in value.split(","):
            token = token.strip().lower()
            if token and token not in CONNECTION_TOKENS:
                return True
    return False


# --------------------------------------------------------------------------------------------
# Path tricks

_MAX_DECODE_LAYERS: Final = 8


def _has_dot_dot_segment(path: str) -> bool:
    """A ``..`` segment, also with ``;params`` (``..;`` is ``..`` to some servers)."""
    return any(segment.split(";", 1)[0] == ".." for segment in path.split("/"))


def _decode_layers(path: str) -> list[str] | None:
    """``[path, decoded once, decoded twice, ...]`` until percent-decoding changes nothing;
    None if it still changes after :data:`_MAX_DECODE_LAYERS` rounds."""
    layers = [path]
    for _ in range(_MAX_DECODE_LAYERS):
        decoded = unquote(layers[-1], errors="surrogateescape")
        if decoded == layers[-1]:
            return layers
        layers.append(decoded)
    return None


def _structural_problem(layers: list[str] | None, *, allow_nested: bool) -> bool:
    if layers is None:
        return True
    if any("\\" in layer or _has_dot_dot_segment(layer) for layer in layers):
        return True
    return not allow_nested and len(layers) > 2


def path_problem(path: str) -> bool:
    """True when ``path`` (query already dropped) could mean another path to the server than
    the one the binding matched: a ``..`` segment (raw or percent-encoded, at any encoding
    depth, ``..;params`` included), a backslash (raw, ``%5c``, or deeper), or a nested
    encoding (an escape that survives one decoding: ``%252f``, ``%2541``). One layer of
    ``%2f`` passes here; :func:`decide` refuses it when decoding changes the matched
    bindings."""
    return _structural_problem(_decode_layers(path), allow_nested=False)


def _path_refused(
    bindings: Sequence[ActiveBinding], target: _Target, path: str, expected: set[int], *, allow_nested: bool
) -> bool:
    """A structural problem, or the set of matching bindings differs from ``expected`` for
    the path as sent or at any decoding depth (the "decoding changes the binding" rule)."""
    layers = _decode_layers(path)
    if layers is None or _structural_problem(layers, allow_nested=allow_nested):
        return True
    return any(set(_matches(bindings, target, layer)) != expected for layer in layers)


# --------------------------------------------------------------------------------------------
# Substitutions


def substitute(text: str, replacements: Iterable[tuple[str, str]]) -> tuple[str, int]:
    """Replace literal, case-sensitive placeholders: longest placeholder first (ties by
    placeholder text), each occurrence claimed on the **original** text, so a replacement is
    never rescanned for other placeholders. Returns the text and the number of replacements.
    """
    ordered = sorted({p: v for p, v in replacements if p}.items(), key=lambda r: (-len(r[0]), r[0]))
    if not text or not ordered:
        return text, 0
    starts: list[int] = []
    ends: list[int] = []
    chosen: list[tuple[int, int, str]] = []
    for placeholder, value in ordered:
        i = text.find(placeholder)
        while i >= 0:
            j = i + len(placeholder)
            k = bisect.bisect_right(starts, i)
            free = (k == 0 or ends[k - 1] <= i) and (k == len(starts) or starts[k] >= j)
            if free:
                starts.insert(k, i)
                ends.insert(k, j)
                chosen.append((i, j, value))
                i = text.find(placeholder, j)
            else:
                i = text.find(placeholder, i + 1)
    if not chosen:
        return text, 0
    chosen.sort()
    parts: list[str] = []
    pos = 0
    for i, j, value in chosen:
        parts.append(text[pos:i])
        parts.append(value)
        pos = j
    parts.append(text[pos:])
    return "".join(parts), len(chosen)


def _replacements(
    substitutions: Iterable[ActiveSubstitution],
    surface: Surface,
    encode: Literal["url", "json", "form", "raw"],
) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for s in substitutions:
        if surface not in s.in_ or not s.placeholder:
            continue
        match encode:
            case "url":
                value = quote(s.value, safe="")
            case "json":
                value = json.dumps(s.value)[1:-1]
            case "form":
                value = quote_plus(s.value, safe="")
            case "raw":
                value = s.value
        out.append((s.placeholder, value))
    return out


_UTF8_CHARSETS: Final = frozenset({"utf-8", "utf8", "us-ascii", "ascii"})


def _identity_encoding(content_encoding: str | None) -> bool:
    if content_encoding is None:
        return True
    codings = [c.strip().lower() for c in content_encoding.split(",") if c.strip()]
    return all(c == "identity" for c in codings)


def _body_encoding(content_type: str | None) -> Literal["json", "form", "raw", "skip"]:
    """How a body substitution value is encoded for this content type; ``skip`` for
    multipart and for an explicit charset other than UTF-8/ASCII."""
    if content_type is None:
        return "raw"
    if "," in content_type:
        # Two Content-Type headers reach us joined ("text/plain, application/json"): the
        # server may parse the body as either, so no encoding is safe for both.
        return "skip"
    media, _, params = content_type.partition(";")
    media = media.strip().lower()
    if media.startswith("multipart/"):
        return "skip"
    for param in params.split(";"):
        key, _, value = param.partition("=")
        if key.strip().lower() == "charset" and value.strip().strip('"').lower() not in _UTF8_CHARSETS:
            return "skip"
    if media == "application/json" or media.endswith("+json"):
        return "json"
    if media == "application/x-www-form-urlencoded":
        return "form"
    return "raw"


def substitute_body(
    binding: ActiveBinding,
    body: bytes | None,
    content_type: str | None,
    content_encoding: str | None,
    transfer_encoding: str | None = None,
) -> bytes | None:
    """The body with the binding's ``body`` substitutions applied, or None when nothing
    changed or the body is skipped: streamed (None), an ambiguous content type (a comma: two
    ``Content-Type`` headers joined), compressed (a content-encoding other than
    identity, or a transfer-encoding other than plain ``chunked``: the bytes the proxy holds
    are then not the bytes the server decodes), multipart, a non-UTF-8 charset, or bytes that
    are not UTF-8.

    JSON bodies (``application/json``, ``*+json``) get values JSON-escaped for a string
    context (``json.dumps(v)[1:-1]``), ``application/x-www-form-urlencoded`` bodies form-encoded,
    other bodies the raw value."""
    if body is None or not body or not _identity_encoding(content_encoding):
        return None
    if transfer_encoding is not None and transfer_encoding.strip().lower() != "chunked":
        return None
    encoding = _body_encoding(content_type)
    if encoding == "skip":
        return None
    replacements = _replacements(binding.substitutions, "body", encoding)
    if not replacements:
        return None
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return None
    new_text, count = substitute(text, replacements)
    return new_text.encode("utf-8") if count else None


# --------------------------------------------------------------------------------------------
# The decision


def decide(snapshot: VaultSnapshot | None, req: Request, *, destination_ok: bool) -> InjectionDecision:
    """Match ``req`` against ``snapshot`` and say whether to pass, refuse or inject (§10).

    Order: no vault -> pass; no binding matches (scheme, canonical port, method, path without
    query, host: exact precedence 2 over wildcard 1) -> pass; ``destination_ok`` False ->
    pass; https without SNI -> pass; several bindings at the top precedence -> 403; SNI
    outside the binding's hosts -> 403; path tricks (:func:`path_problem`, or percent-decoding
    changes the matched bindings) -> 403; a ``Connection`` option outside
    :data:`CONNECTION_TOKENS` -> 400; a :data:`TARGET_OVERRIDE_HEADERS` header -> 403; then
    path/query/header/body substitutions (a substituted path is checked again -> 403) and
    header injection. ``req.host`` is the :func:`one_authority` value (the caller refuses
    before calling when there is none that is unambiguous).
    """
    if snapshot is None:
        return _PASS_NO_VAULT
    target = _target(req)
    if target is None:
        return _PASS_NO_MATCH
    path = req.path.partition("?")[0]
    bindings = snapshot.bindings
    matched = _matches(bindings, target, path)
    if not matched:
        return _PASS_NO_MATCH
    if not destination_ok:
        return InjectionDecision("pass", reason=REASON_DESTINATION)
    if target.scheme == "https" and not req.sni:
        return InjectionDecision("pass", reason=REASON_NO_SNI)
    top = max(matched.values())
    chosen = [bindings[i] for i, p in matched.items() if p == top]
    if len(chosen) > 1:
        return _refuse(REASON_AMBIGUOUS)
    selected = _Selected(chosen[0], bindings, target, set(matched))
    refusal = _refusal(req, selected, path)
    if refusal is not None:
        return refusal
    return _injection(req, selected)


@dataclass(frozen=True, slots=True)
class _Selected:
    """The one binding a request matched at the top precedence, and what it was matched on:
    a path (decoded, or substituted) must match exactly the same bindings."""

    binding: ActiveBinding
    bindings: Sequence[ActiveBinding]
    target: _Target
    matched: set[int]

    def path_refused(self, path: str, *, allow_nested: bool) -> bool:
        return _path_refused(self.bindings, self.target, path, self.matched, allow_nested=allow_nested)


def _refusal(req: Request, selected: _Selected, path: str) -> InjectionDecision | None:
    """Why the request must not carry the selected binding's credentials, if it must not."""
    name = selected.binding.name
    if req.sni and not _sni_in_scope(req.sni, selected.binding):
        return _refuse(REASON_SNI, name)
    if selected.path_refused(path, allow_nested=False):
        return _refuse(REASON_PATH, name)
    if _hop_by_hop_problem(req.headers):
        return _refuse(REASON_HOP_BY_HOP, name, status=400)
    if any(header.strip().lower() in TARGET_OVERRIDE_HEADERS for header, _ in req.headers):
        return _refuse(REASON_TARGET_OVERRIDE, name)
    return None


def _injection(req: Request, selected: _Selected) -> InjectionDecision:
    """The substitutions on every surface, then the binding's headers."""
    binding = selected.binding
    substituted: list[Surface] = []
    subs = binding.substitutions
    path, has_query, query = req.path.partition("?")
    new_path, n_path = substitute(path, _replacements(subs, "path", "url"))
    if n_path:
        substituted.append("path")
        # Values are URL-encoded, so a value's own "%" makes a nested escape: allowed here,
        # but ".." / backslashes at any depth and a changed binding match are refused.
        if selected.path_refused(new_path, allow_nested=True):
            return _refuse(REASON_SUBSTITUTED_PATH, binding.name)
    new_query, n_query = substitute(query, _replacements(subs, "query", "url")) if has_query else ("", 0)
    if n_query:
        substituted.append("query")
    target_path = None
    if n_path or n_query:
        target_path = new_path + (f"?{new_query}" if has_query else "")

    updates = _header_updates(req.headers, _replacements(subs, "header", "raw"))
    if updates:
        substituted.append("header")

    new_body = substitute_body(
        binding, req.body, req.content_type, req.content_encoding, req.transfer_encoding
    )
    if new_body is not None:
        substituted.append("body")

    set_headers = tuple((h.name, h.value) for h in binding.headers if not header_reserved(h.name))
    return InjectionDecision(
        "inject",
        binding=binding.name,
        set_headers=set_headers,
        header_updates=tuple(updates),
        new_path=target_path,
        new_body=new_body,
        substituted=tuple(substituted),
    )


def _header_updates(
    headers: Sequence[tuple[str, str]], replacements: Sequence[tuple[str, str]]
) -> list[tuple[int, str]]:
    """(index, new value) of every non-reserved header a ``header`` substitution changed."""
    updates: list[tuple[int, str]] = []
    if not replacements:
        return updates
    for index, (name, value) in enumerate(headers):
        if header_reserved(name):
            continue
        new_value, n = substitute(value, replacements)
        if n:
            updates.append((index, new_value))
    return updates


# --------------------------------------------------------------------------------------------
# Response redaction


def redact_text(text: str, redactions: Iterable[str]) -> str:
    """Every occurrence of every redaction string -> ``[REDACTED]``, overlapping ones merged
    into one marker (:mod:`egressd.mitmchild.redact`, the one implementation for headers, bodies and
    WebSocket messages)."""
    return redact_str(text, compile_needles(redactions))


def redact_response_headers(
    headers: Sequence[tuple[str, str]], redactions: Sequence[str]
) -> list[tuple[str, str]]:
    """Response headers with every redaction string in a value replaced by ``[REDACTED]``
    (names untouched, order kept). Bodies go through the same redactor (:mod:`egressd.mitmchild.respbody`)."""
    if not redactions:
        return list(headers)
    return [(name, redact_text(value, redactions)) for name, value in headers]
