"""IP-layer view of a policy (§5): IP/CIDR rules as allow/deny x v4/v6 prefix sets.

Rule order is lost here; the kernel ruleset makes deny beat allow.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network

from egressd.policy.model import NetworkPolicy, TargetKind, Verdict

_MAPPED_V4 = IPv6Network("::ffff:0:0/96")


@dataclass(frozen=True, slots=True)
class IpSets:
    allow_v4: tuple[IPv4Network, ...]
    allow_v6: tuple[IPv6Network, ...]
    deny_v4: tuple[IPv4Network, ...]
    deny_v6: tuple[IPv6Network, ...]

    def deny_hit(self, ip: IPv4Address | IPv6Address) -> IPv4Network | IPv6Network | None:
        """The deny prefix holding ``ip`` (deny beats allow at the IP layer), or None."""
        nets = self.deny_v4 if ip.version == 4 else self.deny_v6
        return next((n for n in nets if ip in n), None)

    def allow_hit(self, ip: IPv4Address | IPv6Address) -> IPv4Network | IPv6Network | None:
        """The explicit allow prefix holding ``ip`` (``defaultAction`` is not a prefix), or None."""
        nets = self.allow_v4 if ip.version == 4 else self.allow_v6
        return next((n for n in nets if ip in n), None)

    def explicitly_allows(self, ip: IPv4Address | IPv6Address) -> bool:
        """An explicit IP/CIDR allow rule covers ``ip`` and no deny rule does."""
        return self.deny_hit(ip) is None and self.allow_hit(ip) is not None


def normalise_networks[N: (IPv4Network, IPv6Network)](nets: Iterable[N]) -> tuple[N, ...]:
    """Masked, deduplicated, strict subnets of another entry dropped, sorted by address then prefix.

    Adjacent prefixes are deliberately not merged: each element stays one the user wrote.
    """
    # ipaddress network objects are always masked; sorting puts every supernet before its
    # subnets, and kept entries are pairwise disjoint, so only the last kept entry can cover
    # the next candidate.
    ordered = sorted(set(nets), key=lambda n: (n.network_address, n.prefixlen))
    kept: list[N] = []
    for net in ordered:
        if kept and net.subnet_of(kept[-1]):
            continue
        kept.append(net)
    return tuple(kept)


def _unmap(net: IPv4Network | IPv6Network) -> IPv4Network | IPv6Network:
    """IPv4-mapped IPv6 prefixes (``::ffff:a.b.c.d``, /96 or longer) become IPv4 prefixes."""
    if isinstance(net, IPv6Network) and net.prefixlen >= 96 and net.subnet_of(_MAPPED_V4):
        mapped = net.network_address.ipv4_mapped
        assert mapped is not None
        return IPv4Network((mapped, net.prefixlen - 96))
    return net


def ip_sets(policy: NetworkPolicy) -> IpSets:
    """Split the IP and CIDR rules of ``policy`` into four normalised sets."""
    allow_v4: list[IPv4Network] = []
    allow_v6: list[IPv6Network] = []
    deny_v4: list[IPv4Network] = []
    deny_v6: list[IPv6Network] = []
    for rule in policy.egress:
        if rule.kind is TargetKind.DOMAIN or rule.network is None:
            continue
        net = _unmap(rule.network)
        allow = rule.action is Verdict.ALLOW
        if isinstance(net, IPv4Network):
            (allow_v4 if allow else deny_v4).append(net)
        else:
            (allow_v6 if allow else deny_v6).append(net)
    return IpSets(
        allow_v4=normalise_networks(allow_v4),
        allow_v6=normalise_networks(allow_v6),
        deny_v4=normalise_networks(deny_v4),
        deny_v6=normalise_networks(deny_v6),
    )


def format_element(net: IPv4Network | IPv6Network) -> str:
    """An nft set element: hosts bare (``8.8.8.8``, ``2001:db8::1``), prefixes as ``10.0.0.0/24``."""
    if net.prefixlen == net.max_prefixlen:
        return str(net.network_address)
    return str(net)
