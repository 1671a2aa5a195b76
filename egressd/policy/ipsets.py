"""IP-layer view of a policy (§5): IP/CIDR rules as allow/deny x v4/v6 prefix sets.

Rule order is lost here; the kernel ruleset makes deny beat allow.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network

from egressd.policy.model import NetworkPolicy, TargetKind, Verdict
from egressd.policy.scope import Scope

_MAPPED_V4 = IPv6Network("::ffff:0:0/96")

Prefix = IPv4Network | IPv6Network


class PrefixIndex:
    """Which of a set of prefixes holds an address, by binary search over their ranges: the
    one membership test of the IP layer (the MITM's check per request, flow cuts, explain,
    and a narrowing of 4096 leases against 4096 deny rules, which stays linear-logarithmic).

    Two prefixes are either disjoint or nested; a nested one adds nothing, so each range is
    exactly one prefix, the widest (normalised sets have no nesting at all).
    """

    __slots__ = ("_ranges",)

    def __init__(self, nets: Iterable[Prefix]) -> None:
        self._ranges: dict[int, tuple[list[int], list[int], list[Prefix]]] = {
            4: ([], [], []),
            6: ([], [], []),
        }
        for net in sorted(nets, key=lambda n: (n.version, int(n.network_address), -n.num_addresses)):
            starts, ends, owners = self._ranges[net.version]
            first, last = int(net.network_address), int(net.broadcast_address)
            if ends and first <= ends[-1]:
                continue  # inside the previous prefix
            starts.append(first)
            ends.append(last)
            owners.append(net)

    def hit(self, ip: IPv4Address | IPv6Address) -> Prefix | None:
        starts, ends, owners = self._ranges[ip.version]
        i = bisect.bisect_right(starts, int(ip)) - 1
        return owners[i] if i >= 0 and int(ip) <= ends[i] else None


def covered_by(v4: Sequence[Prefix], v6: Sequence[Prefix]) -> Callable[[IPv4Address | IPv6Address], bool]:
    """Membership in a set of prefixes (the deny sets a narrowing keeps leases out of)."""
    index = PrefixIndex((*v4, *v6))
    return lambda ip: index.hit(ip) is not None


#: An IP/CIDR rule that names ports or a protocol (§18): its prefix and what it opens or denies.
Scoped = tuple[Prefix, Scope]


@dataclass(frozen=True, slots=True)
class IpSets:
    """The IP/CIDR rules of a policy: ``allow_*``/``deny_*`` hold the rules that cover every
    protocol and port of their prefix (the address-only kernel sets), ``*_scoped`` the rules
    that name ports or a protocol, in policy order (§18)."""

    allow_v4: tuple[IPv4Network, ...]
    allow_v6: tuple[IPv6Network, ...]
    deny_v4: tuple[IPv4Network, ...]
    deny_v6: tuple[IPv6Network, ...]
    allow_scoped: tuple[Scoped, ...] = ()
    deny_scoped: tuple[Scoped, ...] = ()
    # Built on the first question, not with the sets: the ruleset builder only needs the
    # tuples, while the MITM and flow cuts ask per request and per flow.
    _allow: PrefixIndex | None = field(default=None, init=False, repr=False, compare=False)
    _deny: PrefixIndex | None = field(default=None, init=False, repr=False, compare=False)

    def deny_hit(self, ip: IPv4Address | IPv6Address) -> IPv4Network | IPv6Network | None:
        """The deny prefix holding ``ip`` (deny beats allow at the IP layer), or None."""
        if self._deny is None:
            object.__setattr__(self, "_deny", PrefixIndex((*self.deny_v4, *self.deny_v6)))
        assert self._deny is not None
        return self._deny.hit(ip)

    def allow_hit(self, ip: IPv4Address | IPv6Address) -> IPv4Network | IPv6Network | None:
        """The explicit allow prefix holding ``ip`` (``defaultAction`` is not a prefix), or None."""
        if self._allow is None:
            object.__setattr__(self, "_allow", PrefixIndex((*self.allow_v4, *self.allow_v6)))
        assert self._allow is not None
        return self._allow.hit(ip)

    def explicitly_allows(self, ip: IPv4Address | IPv6Address) -> bool:
        """An explicit IP/CIDR allow rule covers every port of ``ip`` and no deny rule does."""
        return self.deny_hit(ip) is None and self.allow_hit(ip) is not None

    def ip_scope(self, ip: IPv4Address | IPv6Address) -> Scope:
        """What the address rules open for ``ip`` (deny beats allow, as in the kernel): nothing
        under a whole deny; otherwise every port of a whole allow, or the union of the scoped
        allows holding it, minus the scoped denies holding it. ``defaultAction`` is not here."""
        if self.deny_hit(ip) is not None:
            return Scope.EMPTY
        if self.allow_hit(ip) is not None:
            opened = Scope.WHOLE
        else:
            opened = Scope.EMPTY
            for net, scope in self.allow_scoped:
                if ip.version == net.version and ip in net:
                    opened = opened.union(scope)
        if opened.is_empty():
            return opened
        for net, scope in self.deny_scoped:
            if ip.version == net.version and ip in net:
                opened = opened.minus(scope)
        return opened


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
    allow_scoped: list[Scoped] = []
    deny_scoped: list[Scoped] = []
    for rule in policy.egress:
        if rule.kind is TargetKind.DOMAIN or rule.network is None:
            continue
        net = _unmap(rule.network)
        allow = rule.action is Verdict.ALLOW
        if rule.scoped:
            (allow_scoped if allow else deny_scoped).append((net, rule.scope))
            continue
        if isinstance(net, IPv4Network):
            (allow_v4 if allow else deny_v4).append(net)
        else:
            (allow_v6 if allow else deny_v6).append(net)
    return IpSets(
        allow_v4=normalise_networks(allow_v4),
        allow_v6=normalise_networks(allow_v6),
        deny_v4=normalise_networks(deny_v4),
        deny_v6=normalise_networks(deny_v6),
        allow_scoped=tuple(allow_scoped),
        deny_scoped=tuple(deny_scoped),
    )


def format_element(net: IPv4Network | IPv6Network) -> str:
    """An nft set element: hosts bare (``8.8.8.8``, ``2001:db8::1``), prefixes as ``10.0.0.0/24``."""
    if net.prefixlen == net.max_prefixlen:
        return str(net.network_address)
    return str(net)
