"""Which transports may carry a credential-vault write (reference parity, issue 15 item 3).

``OPENSANDBOX_EGRESS_CREDENTIAL_VAULT_REQUIRE_TLS``: a vault write (create, replace, patch,
delete) must arrive over TLS, from a loopback peer, or from a peer in
``OPENSANDBOX_EGRESS_CREDENTIAL_VAULT_TRUSTED_PROXY_CIDRS`` that asserts
``X-Forwarded-Proto: https`` (a TLS-terminating proxy in front). Anything else is ``426``
before the body is looked at, so a credential that crossed a plain network is refused
instead of stored. egressd serves plain HTTP only, so "over TLS" always means "through such a
proxy". Pure: the peer address and the header in, a verdict out.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

REFUSAL_STATUS = 426
REFUSAL_TEXT = "credential vault writes require TLS or loopback transport"
FORWARDED_PROTO = "X-Forwarded-Proto"
VAULT_WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def _peer_ip(peer: str | None) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    if not peer:
        return None
    try:
        ip = ipaddress.ip_address(peer.strip().split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


@dataclass(frozen=True, slots=True)
class VaultTransport:
    require_tls: bool = False
    trusted_proxies: tuple[IPNetwork, ...] = ()

    def allows(self, peer: str | None, forwarded_proto: str | None) -> bool:
        """Whether a vault write from ``peer`` (its IP address; None: unknown, e.g. a unix
        socket) with that ``X-Forwarded-Proto`` value may proceed."""
        if not self.require_tls:
            return True
        ip = _peer_ip(peer)
        if ip is None:
            return False
        if ip.is_loopback:
            return True
        if (forwarded_proto or "").strip().lower() != "https":
            return False
        return _trusted(ip, self.trusted_proxies)


def _trusted(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, nets: Sequence[IPNetwork]) -> bool:
    return any(ip.version == net.version and ip in net for net in nets)
