"""nft script text shared by the fleet (:mod:`egressd.fleetnft`) and the sidecar
(:mod:`egressd.sidecarnft`) rulesets. Pure: strings in, strings out.

Both tables declare the same kinds of address sets (interval sets of prefixes, timeout sets of
DNS leases), split prefixes by family the same way, write the exempt nameservers and the
intercepted ports as the same anonymous sets, and let the same IPv6 neighbour discovery through;
one definition keeps the two tables' text the same where it is meant to be.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from typing import Final

from egressd.addr import IPAddress
from egressd.policy import format_element, normalise_networks

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

#: The DNS forwarder's socket mark (SO_MARK) on its upstream queries: both tables exempt its
#: packets from the DNS redirect and the filters, and track its flows in FORWARDER_ZONE.
FORWARDER_MARK: Final = 0x1
#: How long a DNS-learned address stays in a dyn set at most (the sets' timeout), in seconds.
DYN_TIMEOUT_S: Final = 360
#: The ICMPv6 neighbour discovery a sandbox needs with its gateway (IPv4's ARP never enters an
#: inet chain).
ND_TYPES: Final = "nd-router-solicit, nd-neighbor-solicit, nd-neighbor-advert"


def family(ip: IPAddress | IPNetwork) -> str:
    return "v4" if ip.version == 4 else "v6"


def l3_of(fam: str) -> str:
    return "ip" if fam == "v4" else "ip6"


def addr_type(fam: str) -> str:
    return "ipv4_addr" if fam == "v4" else "ipv6_addr"


def split_by_family(nets: Iterable[IPNetwork]) -> dict[str, list[str]]:
    """Set elements per family, normalised: overlapping interval elements make nft refuse the
    set (and the whole script with it)."""
    v4 = [n for n in nets if isinstance(n, ipaddress.IPv4Network)]
    v6 = [n for n in nets if isinstance(n, ipaddress.IPv6Network)]
    return {
        "v4": [format_element(n) for n in normalise_networks(v4)],
        "v6": [format_element(n) for n in normalise_networks(v6)],
    }


def exempt_literal(nameservers: Iterable[IPAddress], fam: str) -> str | None:
    """The exempt nameservers (OPENSANDBOX_EGRESS_NAMESERVER_EXEMPT) of one family as an
    anonymous nft set, or None."""
    version = 4 if fam == "v4" else 6
    ips = [str(ip) for ip in nameservers if ip.version == version]
    return "{ " + ", ".join(ips) + " }" if ips else None


def unredirected_dns(refuse: str) -> list[str]:
    """Rules refusing tcp/udp port 53 that the DNS redirect did not rewrite, for a chain that
    has already let the forwarder (and, in the sidecar, the exempt nameservers) through.

    NAT is decided on a flow's first packet only, so such a packet rides a tracked flow that
    was never redirected: one the forwarder left behind (same address, a source port it has
    closed), or one a spoofed packet set up in the other direction. Either way it would reach
    the resolver past the DNS policy. Whatever the direction; a packet conntrack does not track
    (invalid, untracked) has no NAT either, and ``ct status`` cannot say so for it."""
    dns = "meta l4proto { tcp, udp } th dport 53"
    return [f"{dns} ct state invalid,untracked {refuse}", f"{dns} ct status & dnat == 0 {refuse}"]


#: The conntrack zone of the DNS forwarder's flows, in their original direction (:func:`forwarder_zone`).
FORWARDER_ZONE: Final = 1
#: The base chain :func:`forwarder_zone` goes in: before conntrack looks a locally generated
#: packet up (``priority raw``, -300; conntrack is -200).
FORWARDER_ZONE_CHAIN: Final = "{ type filter hook output priority raw; policy accept; }"


def forwarder_zone(mark: int, uid: int | None = None) -> str:
    """The rule that tracks the DNS forwarder's flows (socket mark ``mark``) in a conntrack zone
    of their own, in the original direction only, for a :data:`FORWARDER_ZONE_CHAIN` chain.

    The forwarder sends from the same namespace and address as the subjects it serves (the
    sidecar's app, host-uid subjects). Conntrack entries reserve no port: a subject that sends
    to ``resolver:53`` from every ephemeral port leaves an entry, redirected to its own DNS
    port, on each; the forwarder's next new socket gets one of those ports, and its first
    packet, matching that entry, would be NATed to that subject's DNS proxy and answered under
    its policy. In a zone of their own the forwarder's packets never match the subjects'
    entries, nor theirs the forwarder's; the replies, looked up in the default zone in the
    reply direction, still find the forwarder's.

    ``uid``: the forwarder's socket owner (egressd's uid), where the subjects are told from it
    by uid (the fleet's host-uid subjects): a subject that may set the mark (CAP_NET_RAW)
    cannot put its own redirected flows in the forwarder's zone to catch its sockets there."""
    owner = f"meta skuid {uid} " if uid is not None else ""
    return f"meta mark {mark:#x} {owner}ct original zone set {FORWARDER_ZONE}"


def intercepted_ports(extra_ports: Iterable[int]) -> str:
    """The TCP destination ports the MITM intercepts (80, 443 and
    OPENSANDBOX_EGRESS_MITMPROXY_EXTRA_PORTS) as an nft set literal."""
    return "{ " + ", ".join(str(p) for p in (80, 443, *extra_ports)) + " }"


def set_decl(name: str, fam: str, flags: str, elements: Sequence[str] = (), extra: str = "") -> str:
    """``<name> { type <addr>; flags <flags>;<extra> [elements = { ... }] }``."""
    body = f"type {addr_type(fam)}; flags {flags};{extra}"
    if elements:
        body += f" elements = {{ {', '.join(elements)} }}"
    return f"{name} {{ {body} }}"


def port_set_decl(name: str, fam: str, size: int, *, timed: bool = False, exact: bool = False) -> str:
    """A port-scoped set (docs/reference/behaviour.md §18): ``addr . inet_proto . inet_service``,
    an interval set; ``timed``: per-element timeouts (the DNS leases), timeout
    :data:`DYN_TIMEOUT_S`; at most ``size`` elements (0 = unbounded). One text per set, as for
    :func:`timeout_set_decl`. ``exact``: no interval flag (a hash set; elements are one
    address and one port: the leases' single ports)."""
    flags = ",".join(f for f in ("" if exact else "interval", "timeout" if timed else "") if f)
    extra = (f" timeout {DYN_TIMEOUT_S}s;" if timed else "") + (f" size {size};" if size else "")
    flags = f" flags {flags};" if flags else ""
    return f"{name} {{ type {addr_type(fam)} . inet_proto . inet_service;{flags}{extra} }}"


def services_set_decl(name: str, elements: Sequence[str] = ()) -> str:
    """The shared ranges of a subject's leases (egressd.subject.ranges): ``inet_proto .
    inet_service`` intervals, read together with an address set (``ip daddr @a meta l4proto .
    th dport @b``). ``elements``: ``tcp . 8000-8999`` texts."""
    elems = f" elements = {{ {', '.join(elements)} }};" if elements else ""
    return f"{name} {{ type inet_proto . inet_service; flags interval;{elems} }}"


def timeout_set_decl(name: str, fam: str, size: int, elements: Sequence[str] = ()) -> str:
    """A dyn set: timeout :data:`DYN_TIMEOUT_S`, at most ``size`` elements (0 = unbounded).
    Every declaration of one set must be this text: a re-declaration with other properties is
    refused by the kernel."""
    extra = f" timeout {DYN_TIMEOUT_S}s;" + (f" size {size};" if size else "")
    return set_decl(name, fam, "timeout", elements, extra)
