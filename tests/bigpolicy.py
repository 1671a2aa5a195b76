"""Policies at the rule cap (docs/reference/behaviour.md §14.5) for unit and kernel tests.

Every filler rule is its own kernel set element: hosts and prefixes are pairwise disjoint
(normalisation keeps them all), v4/v6 hosts and CIDRs are interleaved, every seventh rule is
a deny. No filler address is inside the test topology's networks, so the only reachable
allowed destinations are the ``first`` and ``last`` rules the caller names.
"""

from __future__ import annotations

from ipaddress import IPv4Address, IPv6Address
from typing import Any

V4_HOSTS = IPv4Address("172.16.0.0")
V4_NETS = IPv4Address("11.0.0.0")
V6_HOSTS = IPv6Address("2001:db8:1::")
V6_NETS = IPv6Address("2001:db8:2::")


def filler_rules(n: int, offset: int = 0) -> list[dict[str, str]]:
    """``n`` disjoint rules cycling v4 host, v4 /24, v6 host, v6 /64; ``offset`` shifts every
    address so two fillers with different offsets share no element."""
    out = []
    for i in range(n):
        j = i + offset
        kind = i % 4
        if kind == 0:
            target = str(V4_HOSTS + j)
        elif kind == 1:
            target = f"{V4_NETS + j * 256}/24"
        elif kind == 2:
            target = str(V6_HOSTS + j)
        else:
            target = f"{V6_NETS + (j << 64)}/64"
        # Every seventh a deny: 7 and 4 are coprime, so each kind has denies too.
        out.append({"action": "deny" if i % 7 == 6 else "allow", "target": target})
    return out


def big_policy(n: int, *, first: list[str], last: list[str], offset: int = 0) -> dict[str, Any]:
    """``n`` rules: allow each of ``first``, filler, allow each of ``last``."""
    rules = [
        *({"action": "allow", "target": t} for t in first),
        *filler_rules(n - len(first) - len(last), offset),
        *({"action": "allow", "target": t} for t in last),
    ]
    assert len(rules) == n
    return {"defaultAction": "deny", "egress": rules}
