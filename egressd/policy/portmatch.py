"""Port-scoped IP/CIDR rules (docs/reference/behaviour.md §18) as the kernel holds them: disjoint
``prefix . proto . port-range`` elements, and what they decide for one destination. Pure.

The kernel's port-scoped sets are pipapo interval sets, which refuse an element that partly
overlaps another (``EEXIST``), so overlapping rules (``10.0.0.0/8 tcp 5432-5433`` and
``10.1.0.0/16 tcp 5000-6000``) are cut into disjoint elements that cover exactly their union.
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from collections.abc import Iterable, Sequence

from egressd.addr import IPAddress
from egressd.policy.ipsets import IpSets, Prefix, Scoped

#: A port-scoped rule or element: (prefix, "tcp" | "udp", first port, last port), inclusive.
ScopedEntry = tuple[Prefix, str, int, int]


def disjoint(entries: Iterable[ScopedEntry], limit: int = 0) -> tuple[ScopedEntry, ...]:
    """The same coverage as disjoint elements, per protocol by a sweep over the port axis:
    between two consecutive range boundaries the covering prefixes are constant and are merged
    (``collapse_addresses``); neighbouring stretches with the same prefixes are joined. Sorted
    (protocol, first port, prefix), so equal inputs give equal outputs. ``limit`` (0: none):
    stop once the output is longer (a policy over :data:`MAX_PORT_ELEMENTS` is refused anyway;
    overlapping rules can make the output quadratic in their number)."""
    out: list[ScopedEntry] = []
    by_proto: dict[tuple[str, int], list[ScopedEntry]] = {}
    for e in entries:
        by_proto.setdefault((e[1], e[0].version), []).append(e)
    for (proto, _version), mine in sorted(by_proto.items()):
        if _apart(mine):
            # Neither overlapping nor adjacent on the port axis (the usual policy): the sweep
            # would return these entries as they are, so skip it (it is per-policy parse cost).
            out += mine
        else:
            out += _sweep(mine, proto, limit - len(out) if limit else 0)
        if limit and len(out) > limit:
            break
    return tuple(sorted(out, key=lambda e: (e[0].version, e[1], e[2], int(e[0].network_address))))


def _sweep(mine: list[ScopedEntry], proto: str, limit: int) -> list[ScopedEntry]:
    """:func:`disjoint` for one protocol and family; stops once past ``limit`` (0: none)."""
    events: dict[int, list[tuple[Prefix, int]]] = {}
    for net, _, lo, hi in mine:
        events.setdefault(lo, []).append((net, 1))
        events.setdefault(hi + 1, []).append((net, -1))
    active: Counter[Prefix] = Counter()
    stretches: list[tuple[int, int, tuple[Prefix, ...]]] = []
    count = 0
    points = sorted(events)
    for i, point in enumerate(points):
        for net, delta in events[point]:
            active[net] += delta
            if active[net] == 0:
                del active[net]
        if i + 1 == len(points) or not active:
            continue
        nets = tuple(ipaddress.collapse_addresses(sorted(active)))  # type: ignore[type-var]
        end = points[i + 1] - 1
        if stretches and stretches[-1][1] + 1 == point and stretches[-1][2] == nets:
            stretches[-1] = (stretches[-1][0], end, nets)
        else:
            stretches.append((point, end, nets))
            count += len(nets)
        if limit and count > limit:
            break
    return [(net, proto, lo, hi) for lo, hi, nets in stretches for net in nets]


def _apart(group: list[ScopedEntry]) -> bool:
    """The entries' port ranges are pairwise neither overlapping nor adjacent."""
    ranges = sorted((lo, hi) for _, _, lo, hi in group)
    return all(ranges[i + 1][0] > ranges[i][1] + 1 for i in range(len(ranges) - 1))


def entries(scoped: Iterable[Scoped], version: int) -> list[ScopedEntry]:
    """Port-scoped rules of one address family as ``(prefix, proto, lo, hi)`` entries."""
    return [
        (net, proto, lo, hi)
        for net, scope in scoped
        if net.version == version
        for proto, lo, hi in scope.elements()
    ]


def scoped_hit(entries: Sequence[ScopedEntry], ip: IPAddress, proto: str, port: int | None) -> bool:
    """Does an entry hold ``ip`` on ``proto``/``port``? (No port: a protocol without ports,
    which no entry holds.)"""
    if port is None:
        return False
    return any(p == proto and lo <= port <= hi and ip in net for net, p, lo, hi in entries)


def address_rules_admit(sets: IpSets, ip: IPAddress, proto: str, port: int | None) -> bool | None:
    """What the IP/CIDR rules decide for ``ip``'s ``proto``/``port``: False when a deny rule
    (whole or scoped) holds it (deny beats allow), True when an allow rule does, None when
    none says (a lease or the defaultAction decides)."""
    if sets.deny_hit(ip) is not None or scoped_holds(sets.deny_scoped, ip, proto, port):
        return False
    if sets.allow_hit(ip) is not None or scoped_holds(sets.allow_scoped, ip, proto, port):
        return True
    return None


def scoped_holds(scoped: Iterable[Scoped], ip: IPAddress, proto: str, port: int | None) -> bool:
    """Does a port-scoped rule hold ``ip`` on ``proto``/``port``?"""
    return any(ip.version == net.version and ip in net and scope.admits(proto, port) for net, scope in scoped)


#: Most port-scoped elements the IP/CIDR rules of one policy may need in the kernel (all four
#: port-scoped static sets of a subject together). The kernel empties such a set in time
#: quadratic in its size (docs/concepts/ruleset.md, "port-scoped sets": 8192 elements 1.4 s,
#: 32768 about 12 s, beyond the transaction timeout), and every revert or update of the policy
#: empties them; so a policy over the bound is refused like one over the rule cap.
MAX_PORT_ELEMENTS = 8192


def port_elements_needed(sets: IpSets) -> int:
    """How many port-scoped elements the policy's address rules become (after cutting
    overlaps into disjoint elements, which can multiply them)."""
    if not sets.allow_scoped and not sets.deny_scoped:
        return 0
    total = 0
    for scoped in (sets.allow_scoped, sets.deny_scoped):
        for version in (4, 6):
            total += len(disjoint(entries(scoped, version), limit=MAX_PORT_ELEMENTS + 1 - total))
            if total > MAX_PORT_ELEMENTS:
                return total
    return total
