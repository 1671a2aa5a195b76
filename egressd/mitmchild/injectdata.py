"""Plain data in and out of the credential injection decision (docs/reference/behaviour.md §10, §6):
the :class:`Request` the addon builds from a flow, the :class:`InjectionDecision` it applies
(see :mod:`egressd.mitmchild.inject` for how), and the fixed reason texts.

Secrecy: credential values and placeholders never appear in a ``reason`` or in the
``repr()``/``str()`` of :class:`Request` or :class:`InjectionDecision` (request paths, headers and
bodies are hidden too: they may carry placeholders). Reasons are fixed texts plus binding
names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

from egressd.vault.types import RESERVED_HEADERS

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

DecisionKind = Literal["pass", "inject", "refuse"]
Surface = Literal["path", "query", "header", "body"]



@dataclass(frozen=True, slots=True)
class Request:
    """One intercepted request, as the addon sees it in ``requestheaders`` / ``request``.

    ``host`` is the Host header / ``:authority`` (may carry ``:port``); ``port`` the
    connection's (original) destination port; ``path`` the raw request target including the
    query; ``headers`` in wire order, duplicates kept (indices are what
    :attr:`InjectionDecision.header_updates` refers to); ``body`` None when streamed or not read yet;
    ``content_type`` / ``content_encoding`` / ``transfer_encoding`` the request's header
    values (None when absent); ``sni`` the client's ClientHello SNI (None for plaintext HTTP
    or no SNI). The caller has already reduced the request to
    :func:`~egressd.mitmchild.authority.one_authority`.
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
    """What to do with a request; :mod:`egressd.mitmchild.inject` says how to apply it.

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

AMBIGUOUS_AUTHORITY: Final = InjectionDecision("refuse", status=400, reason=REASON_AUTHORITY)
"""The 400 of :func:`~egressd.mitmchild.authority.one_authority` (docs/reference/behaviour.md §14.8)."""


def header_reserved(name: str) -> bool:
    """Reserved headers (§6) and HTTP/2 pseudo-headers are never injected or rewritten."""
    return name.lower() in RESERVED_HEADERS or name.startswith(":")
