"""One authority per request (docs/reference/behaviour.md §14.8): host names as bindings compare them.

Before anything else the addon reduces the request to :func:`one_authority`: the HTTP/1
absolute-form authority, the HTTP/2 ``:authority``, the ``Host`` header and the SNI must all
name the same host (and any explicit port the connection's), else 400 before the lookup,
before the upstream. The addon then forwards that one authority only (origin-form, no second
``Host`` beside ``:authority``) to the connection's original destination. Pure.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from egressd.mitmchild.injectdata import AMBIGUOUS_AUTHORITY, InjectionDecision
from egressd.policy.idn import IdnaError, to_alabels

_NAME_RE: Final = re.compile(r"[a-z0-9_-]+(?:\.[a-z0-9_-]+)*")
_PORT_RE: Final = re.compile(r"[0-9]{1,5}")


def dns_name(text: str) -> str | None:
    """A-labels, lower-cased, one trailing dot dropped; None unless it looks like a DNS name.

    A Unicode Host (or SNI) is compared as its A-labels, like the binding hosts and the names
    the DNS proxy learned (docs/reference/behaviour.md §14.3); one that is not a valid IDN matches nothing.
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
    name = dns_name(text)
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
    """The request's one authority (docs/reference/behaviour.md §14.8), or the 400 :data:`AMBIGUOUS_AUTHORITY`.

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
    if sni and dns_name(sni) != first[0]:
        return OneAuthority(None, AMBIGUOUS_AUTHORITY)
    # The Host header when present (HTTP/1 forwards it; the addon drops the absolute form),
    # else the target: equal names either way.
    return OneAuthority(sources[-1])
