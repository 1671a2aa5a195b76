"""Selective interception (docs/reference/behaviour.md §16): which redirected connections the MITM opens up.

Pure functions on plain data, called by the addon before any byte of a connection is
decrypted or parsed:

* TLS: :func:`tls_early` decides what needs no vault (an ignored host, no SNI, a port no
  binding can use), then :func:`tls_by_vault` decides with the subject's vault snapshot (the
  same ``_active`` answer injection uses): decrypt only when the ClientHello SNI is a host of
  one of its https bindings, by the injection's host rules (exact, or ``*.suffix`` below the
  apex). Everything else is passed through as an opaque TCP stream to the connection's
  original destination: the sandbox sees the upstream's own certificate.
* Plain HTTP: :func:`http_early` (the http port only), then :func:`http_by_vault`: parsed only for a subject with an http binding (and on
  the http port), else relayed untouched. The request's Host is not known when this is
  decided, so it is per subject, as §16 words it.

A failed vault lookup is not decided here: the addon then decrypts (or parses), and the
request path refuses every request of that client until a lookup answers again (§10). The
reasoning is in docs/reference/behaviour.md §16.

``ignore_hosts`` (``OPENSANDBOX_EGRESS_MITMPROXY_IGNORE_HOSTS``) are mitmproxy's
``ignore_hosts`` regular expressions; mitmproxy itself tries them on ``address:port``, the
``Host`` header and ``SNI:port`` before a connection's layers are chosen. :func:`ignored`
adds the bare name, as the reference addon does, so that ``^api\\.example\\.com$`` works too.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

from egressd.mitmchild.authority import normalise_authority
from egressd.policy.evaluate import domain_matches
from egressd.vault.snapshot import VaultSnapshot
from egressd.vault.types import SCHEME_PORTS

__all__ = [
    "REASON_BOUND",
    "REASON_HTTP_BOUND",
    "REASON_IGNORED",
    "REASON_LOOKUP_FAILED",
    "REASON_NAME_CHECK",
    "REASON_NO_BINDING",
    "REASON_NO_HTTP_BINDING",
    "REASON_NO_SNI",
    "REASON_NO_VAULT",
    "REASON_PORT",
    "REASON_REQUESTS_LATER",
    "REASON_REQUESTS_UNSEEN",
    "REASON_REQUEST_RULES",
    "Verdict",
    "http_by_vault",
    "http_early",
    "ignored",
    "sni_name",
    "tls_by_vault",
    "tls_early",
]


REASON_BOUND: Final = "SNI is a host of an https binding"
REASON_HTTP_BOUND: Final = "the subject has an http binding"
REASON_IGNORED: Final = "host matches OPENSANDBOX_EGRESS_MITMPROXY_IGNORE_HOSTS"
REASON_NO_SNI: Final = "TLS without a usable SNI"
REASON_NO_VAULT: Final = "no credential vault"
REASON_NO_BINDING: Final = "no https binding names the SNI"
REASON_NO_HTTP_BINDING: Final = "no http binding"
REASON_PORT: Final = "not the scheme's port: no binding can match"
REASON_LOOKUP_FAILED: Final = "vault lookup failed: opened so that its requests are refused"
REASON_NAME_CHECK: Final = "plain HTTP on a name-checked port: every request's Host is checked"

REASON_REQUEST_RULES: Final = "a rule with methods/paths matches the name: its requests are judged"

REASON_REQUESTS_LATER: Final = "a relayed connection's name is judged since a policy change: reset"

REASON_REQUESTS_UNSEEN: Final = "an ignored host that request rules judge: refused, never relayed unjudged"

Decision = Literal["decrypt", "parse", "passthrough", "refuse"]


@dataclass(frozen=True, slots=True)
class Verdict:
    """``decision`` and a fixed ``reason`` (no host or value in it); ``binding`` names the
    binding whose host matched, for the log."""

    decision: Decision
    reason: str
    binding: str | None = None

    @property
    def opens(self) -> bool:
        """True when the connection is decrypted or parsed; False when it is relayed (or refused)."""
        return self.decision in ("decrypt", "parse")


def _pass(reason: str) -> Verdict:
    return Verdict("passthrough", reason)


def sni_name(sni: str | None) -> str | None:
    """The SNI as injection compares hosts (A-labels, lower case, no trailing dot); None when
    absent or not a DNS name (an SNI carrying a port or an IP literal matches no binding)."""
    if not sni:
        return None
    norm = normalise_authority(sni)
    if norm is None or norm[1] is not None:
        return None
    return norm[0]


def ignored(patterns: Sequence[re.Pattern[str]], host: str | None, port: int | None) -> bool:
    """Whether ``host`` (bare, and as ``host:port``) matches one of ``patterns``."""
    if not patterns or not host:
        return False
    candidates = [host] if port is None else [host, f"{host}:{port}"]
    return any(rex.search(c) for rex in patterns for c in candidates)


def tls_early(sni: str | None, port: int | None, ignore: Sequence[re.Pattern[str]]) -> Verdict | None:
    """The TLS verdict that needs no vault lookup, or None when the vault decides.

    An ignored host is passed through even when a binding names it: the operator said so,
    and a binding host matching the list is refused at the vault write already (§6).
    """
    if sni and ignored(ignore, sni, port):
        return _pass(REASON_IGNORED)
    if sni_name(sni) is None:
        return _pass(REASON_NO_SNI)  # nothing to match; §10 passes it without credentials anyway
    if port != SCHEME_PORTS["https"]:
        return _pass(REASON_PORT)  # injection needs the scheme's port (§10), so nothing to open
    return None


def _host_matches(name: str, pattern: str) -> bool:
    # Injection's rule (inject._host_precedence): exact, or a wildcard never matching its apex.
    return domain_matches(pattern, name) if pattern.startswith("*.") else name == pattern


def tls_by_vault(snapshot: VaultSnapshot | None, sni: str | None) -> Verdict:
    """Decrypt when ``sni`` is a host of one of the snapshot's https bindings."""
    if snapshot is None:
        return _pass(REASON_NO_VAULT)
    name = sni_name(sni)
    if name is None:
        return _pass(REASON_NO_SNI)
    for binding in snapshot.bindings:
        if "https" in binding.match.schemes and any(_host_matches(name, h) for h in binding.match.hosts):
            return Verdict("decrypt", REASON_BOUND, binding.name)
    return _pass(REASON_NO_BINDING)


def http_early(port: int | None) -> Verdict | None:
    """The plain-HTTP verdict that needs no vault lookup, or None when the vault decides."""
    return None if port == SCHEME_PORTS["http"] else _pass(REASON_PORT)


def http_by_vault(snapshot: VaultSnapshot | None) -> Verdict:
    """Parse plain HTTP only for a subject with an http binding (the port is :func:`http_early`'s)."""
    if snapshot is None:
        return _pass(REASON_NO_VAULT)
    for binding in snapshot.bindings:
        if "http" in binding.match.schemes:
            return Verdict("parse", REASON_HTTP_BOUND, binding.name)
    return _pass(REASON_NO_HTTP_BINDING)
