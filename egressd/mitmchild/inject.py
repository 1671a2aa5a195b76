"""Credential injection decisions for the transparent MITM (docs/reference/behaviour.md §10, §6).

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
``request`` call :func:`~egressd.mitmchild.substitute.substitute_body` with :func:`find_binding` of the same snapshot (not a
re-fetched one) unless the body was streamed.

One authority (docs/reference/behaviour.md §14.8): before anything else the addon reduces the request to
:func:`~egressd.mitmchild.authority.one_authority`: the HTTP/1 absolute-form authority, the HTTP/2 ``:authority``, the
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

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from egressd.mitmchild.authority import dns_name, normalise_authority
from egressd.mitmchild.injectdata import (
    REASON_AMBIGUOUS,
    REASON_DESTINATION,
    REASON_HOP_BY_HOP,
    REASON_NO_MATCH,
    REASON_NO_SNI,
    REASON_NO_VAULT,
    REASON_PATH,
    REASON_SNI,
    REASON_SUBSTITUTED_PATH,
    REASON_TARGET_OVERRIDE,
    InjectionDecision,
    Request,
    Surface,
    header_reserved,
)
from egressd.mitmchild.redact import MARKER, compile_needles, redact_str
from egressd.mitmchild.substitute import encoded_replacements, substitute, substitute_body
from egressd.policy.evaluate import domain_matches
from egressd.policy.reqpath import decode_layers, structural_problem
from egressd.vault.snapshot import ActiveBinding, VaultSnapshot
from egressd.vault.types import SCHEME_PORTS

__all__ = [
    "CONNECTION_TOKENS",
    "REDACTION_MARKER",
    "TARGET_OVERRIDE_HEADERS",
    "decide",
    "find_binding",
    "path_problem",
    "redact_response_headers",
    "redact_text",
]

#: What every redaction string becomes in a response header value (§10).
REDACTION_MARKER: Final = MARKER.decode()

#: The only ``Connection`` options an injected request may carry. Any other token names a
#: header the next hop would drop (RFC 9110 §7.6.1): ``Connection: content-length`` turns the
#: rest of the body into a smuggled request (body substitutions included) on the upstream
#: connection, ``Connection: host`` leaves the next hop routing on something else, and
#: ``Connection: authorization`` is how a credential would be stripped or replayed.
CONNECTION_TOKENS: Final = frozenset({"close", "keep-alive", "upgrade", "te"})

#: Headers that servers and front ends honour as the request's real host, path or method.
#: A binding names hosts, paths and methods; a credential injected into a request that
#: carries one of these would be used for a target the binding does not name (docs/reference/behaviour.md §14.8).
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

_PASS_NO_VAULT: Final = InjectionDecision("pass", reason=REASON_NO_VAULT)
_PASS_NO_MATCH: Final = InjectionDecision("pass", reason=REASON_NO_MATCH)


def _refuse(reason: str, binding: str | None = None, status: int = 403) -> InjectionDecision:
    return InjectionDecision("refuse", status=status, reason=reason, binding=binding)


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
    name = dns_name(sni)
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

def path_problem(path: str) -> bool:
    """True when ``path`` (query already dropped) could mean another path to the server than
    the one the binding matched: a ``..`` segment (raw or percent-encoded, at any encoding
    depth, ``..;params`` included), a backslash (raw, ``%5c``, or deeper), or a nested
    encoding (an escape that survives one decoding: ``%252f``, ``%2541``). One layer of
    ``%2f`` passes here; :func:`decide` refuses it when decoding changes the matched
    bindings."""
    return structural_problem(decode_layers(path), allow_nested=False)


def _path_refused(
    bindings: Sequence[ActiveBinding], target: _Target, path: str, expected: set[int], *, allow_nested: bool
) -> bool:
    """A structural problem, or the set of matching bindings differs from ``expected`` for
    the path as sent or at any decoding depth (the "decoding changes the binding" rule)."""
    layers = decode_layers(path)
    if layers is None or structural_problem(layers, allow_nested=allow_nested):
        return True
    return any(set(_matches(bindings, target, layer)) != expected for layer in layers)


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
    new_path, n_path = substitute(path, encoded_replacements(subs, "path", "url"))
    if n_path:
        substituted.append("path")
        # Values are URL-encoded, so a value's own "%" makes a nested escape: allowed here,
        # but ".." / backslashes at any depth and a changed binding match are refused.
        if selected.path_refused(new_path, allow_nested=True):
            return _refuse(REASON_SUBSTITUTED_PATH, binding.name)
    new_query, n_query = substitute(query, encoded_replacements(subs, "query", "url")) if has_query else ("", 0)
    if n_query:
        substituted.append("query")
    target_path = None
    if n_path or n_query:
        target_path = new_path + (f"?{new_query}" if has_query else "")

    updates = _header_updates(req.headers, encoded_replacements(subs, "header", "raw"))
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
