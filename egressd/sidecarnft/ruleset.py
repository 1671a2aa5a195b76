"""Pure generation of the sidecar ruleset (docs/reference/behaviour.md §8.6).

The sidecar runs inside the sandbox's own network namespace and enforces one policy for
everything in it, so its table hooks ``output`` (the app's packets are locally generated)
instead of the fleet's prerouting/forward pair. Every change rebuilds the whole table in one
libnftables transaction (``add table`` + ``delete table`` + the new table): the kernel swaps
the old ruleset for the new one atomically, so there is never a moment without enforcement,
and a missing table cannot make the transaction fail. The table is tiny (one subject), so
the libnftables 1.0.6 cache cost that shapes the fleet builder does not matter here.

Shape::

    sets     allow_v4/v6, deny_v4/v6 (interval), dyn_allow_v4/v6 (timeout 360s),
             [D] doh_block_v4/v6 (interval)
    chain    dns_redirect  nat hook output: mark 0x1 return; udp/tcp dport 53 redirect;
             [M] skgid MITM_GID return, loopback return, tcp dport {80,443} redirect to MITM
    chain    fwd_zone      filter hook output priority raw (both modes): mark 0x1 (the
             forwarder) tracked in conntrack zone 1, original direction only
    chain    [M] mitm_input  filter hook input: MITM port only when redirected
    chain    inbound       filter hook input (mode dns+nft only): TCP from outside that is new
             and not a SYN marked PICKED_UP_MARK (its app side is judged, not "established")
    chain    guard         filter hook output (both modes): a source that is not local (bar
             0.0.0.0 and ::), and port 53 that the redirect did not rewrite (bar the forwarder's mark
             0x1 and the exempt nameservers), goto denied
    chain    egress        filter hook output, policy accept iff defaultAction allow
             (mode dns+nft only): the app's TCP answers on a peer's flow not yet assured refused;
             established (bar flows cut or picked up: REVOKED_FLOW_MARK, PICKED_UP_MARK), mark 0x1, lo,
             redirected DNS, IPv6 ND, 853, DoH,
             deny, dyn, allow, goto denied
    chain    denied        every refusal (docs/reference/behaviour.md §15): counter "dropped", then drop, or with
             EGRESSD_DENY_REJECT a TCP reset / ICMP admin-prohibited

The counter lives in the table, so a rebuild would zero it: the engine reads it first and the
new table declares it with that value (packets refused during the rebuild's own few
milliseconds can be missed; the count never goes backwards).

Nothing here touches the kernel; the shell (:mod:`egressd.sidecar.engine`) runs the text.
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

from egressd.addr import IPAddress, host_network
from egressd.kernel.ops import PortElem, port_elem_text
from egressd.nftsyntax import (
    DYN_TIMEOUT_S,
    FORWARDER_MARK,
    FORWARDER_ZONE_CHAIN,
    ND_TYPES,
    IPNetwork,
    exempt_literal,
    family,
    forwarder_zone,
    l3_of,
    port_set_decl,
    services_set_decl,
    set_decl,
    split_by_family,
    timeout_set_decl,
    unredirected_dns,
)
from egressd.policy import NetworkPolicy, Verdict, ip_sets
from egressd.policy.mitmports import FIXED_PORTS, named_ports
from egressd.policy.portmatch import disjoint, entries
from egressd.policy.scope import Scope
from egressd.subject.leases import Grant, LeaseLike, as_grants, port_elems_cap
from egressd.subject.ranges import on_hash_path, pipapo_elements, shared_ranges, single_elements

Mode = Literal["dns", "dns+nft"]

REDIRECT_CHAIN: Final = "dns_redirect"
FILTER_CHAIN: Final = "egress"
#: Group id the MITM child runs with: its own upstream connections are not intercepted again
#: (mitmproxy cannot mark its sockets). An app running with this gid only skips injection; the
#: filter chain still applies the policy to its packets.
MITM_GID: Final = 18081
MITM_INPUT_CHAIN: Final = "mitm_input"
#: filter input (mode dns+nft): a TCP flow picked up mid-stream from outside is marked.
INBOUND_CHAIN: Final = "inbound"
GUARD_CHAIN: Final = "guard"
#: raw output: the forwarder's flows in a conntrack zone of their own (nftsyntax.forwarder_zone).
FWD_ZONE_CHAIN: Final = "fwd_zone"
#: Every refusal goes here: counted in DROPPED_COUNTER, then dropped or rejected (§15).
DENIED_CHAIN: Final = "denied"
DROPPED_COUNTER: Final = "dropped"
REFUSE: Final = f"goto {DENIED_CHAIN}"
#: Conntrack mark bit a narrowing's cut sets on a flow the new policy refuses (§14.1): the
#: flow's entry stays, so its packets are judged like a new flow's from then on. Deleting
#: the entry instead let the upstream's next packet start a reverse entry (upstream -> app)
#: that made the app's own packets "established" again. One bit, so that a mark another
#: tool of the pod sets on other flows neither hides nor fakes a cut.
REVOKED_FLOW_MARK: Final = 0x40000000
#: Conntrack mark bit the inbound chain sets on a TCP flow that conntrack picked up mid-stream
#: from outside (its first packet was no SYN: an entry that ended, a cut flow's among them, or
#: one from before the table). Its reply direction is the app's packets, which conntrack calls
#: established: with the bit they are judged by the policy (the peer's address) instead, so a
#: cut flow stays cut and an allowed one goes on.
PICKED_UP_MARK: Final = 0x20000000
#: The inbound chain's rule (and the self-test's).
MARK_MIDSTREAM_PICKUP: Final = (
    f"ct state new tcp flags & (fin | syn | rst | ack) != syn ct mark set ct mark | {PICKED_UP_MARK:#x}"
)
#: The egress chain's first rule (and the self-test's): the app's TCP in the reply direction of
#: a flow a peer started with a SYN is refused until the flow is assured (its handshake done),
#: bar the app's own SYN-ACK and RST. A peer's SYN on the 4-tuple of a connection a narrowing
#: cut (its marked entry ended) starts an unmarked entry whose reply direction, the app's old
#: connection still writing, conntrack calls established while it waits for a SYN-ACK.
UNASSURED_REPLY_REFUSED: Final = (
    f"ct direction reply ct status & assured == 0 ct mark & {PICKED_UP_MARK:#x} == 0 "
    f"tcp flags & (syn | rst) == 0 {REFUSE}"
)
#: The egress chain's next rule (and the self-test's): established flows, bar those cut or
#: picked up mid-stream, which the rest of the chain judges like new ones.
ESTABLISHED_UNLESS_MARKED: Final = (
    f"ct state established,related ct mark & {REVOKED_FLOW_MARK | PICKED_UP_MARK:#x} == 0 accept"
)


@dataclass(frozen=True, slots=True)
class SidecarTable:
    """Everything about the ruleset that is fixed for the life of the process."""

    table: str = "opensandbox"
    dns_port: int = 15353
    mode: Mode = "dns+nft"
    block_doh_443: bool = False
    doh_blocklist: tuple[IPNetwork, ...] = ()
    #: Upstream resolver addresses: they join the allow sets (§8.6).
    resolvers: tuple[IPAddress, ...] = ()
    #: Transparent MITM port (None = no interception of the namespace's own 80/443).
    mitm_port: int | None = None
    #: Size of each dyn set: the lease cap (docs/reference/behaviour.md §14.4); 0 = unbounded.
    max_leases: int = 4096
    #: EGRESSD_DENY_REJECT (docs/reference/behaviour.md §15): refuse with a TCP reset / ICMP admin-prohibited.
    deny_reject: bool = False
    #: OPENSANDBOX_EGRESS_MITMPROXY_EXTRA_PORTS: intercepted like 80 and 443 (MITM on).
    mitm_extra_ports: tuple[int, ...] = ()
    #: OPENSANDBOX_EGRESS_NAMESERVER_EXEMPT: the app's DNS to these is not redirected to the
    #: proxy, and (dns+nft) they are reachable on port 53 only, after the deny sets.
    nameserver_exempt: tuple[IPAddress, ...] = ()
    #: Re-adding a timed element does not extend it here (egressd.kernel.renewal).
    renew_by_replace: bool = False
    #: EGRESSD_NAME_CHECK (docs/reference/behaviour.md §18): None follows the MITM. On, a DNS-learned
    #: address's UDP 443 (QUIC) is opened only by an explicit ``protocol: udp`` rule.
    name_check: bool | None = None

    @property
    def checks_names(self) -> bool:
        return self.mitm_port is not None if self.name_check is None else self.name_check


def _interval_set(table: str, name: str, fam: str, elements: Sequence[str]) -> str:
    return f"add set inet {table} {set_decl(name, fam, 'interval', elements)}"


def _timeout_set(table: str, name: str, fam: str, elements: Sequence[str], size: int) -> str:
    # Must stay byte-for-byte the declaration dyn_add re-uses: a re-declaration with other
    # properties is refused by the kernel.
    return f"add set inet {table} {timeout_set_decl(name, fam, size, elements)}"


def dyn_set(fam: str) -> str:
    return f"dyn_allow_{fam}"


def dynp_set(fam: str) -> str:
    """The port-scoped DNS leases (docs/reference/behaviour.md §18): ``addr . proto . port-range``."""
    return f"dyn_allowp_{fam}"


def dynpx_set(fam: str) -> str:
    """The port-scoped DNS leases' single-port elements (``addr . proto . port``): a hash set,
    cheap to add to at any size (docs/concepts/ruleset.md); the ranges stay in :func:`dynp_set`."""
    return f"dyn_allowpx_{fam}"


def dynr_set(fam: str) -> str:
    """The hash path for leases' port ranges (egressd.subject.ranges): the address alone of a
    lease whose ranges are the shared ones, a timeout hash set like :func:`dyn_set`."""
    return f"dyn_allowr_{fam}"


def dynrports_set(fam: str) -> str:
    """The shared ranges (``proto . lo-hi``) an address in :func:`dynr_set` opens, written
    with the policy (every policy change rebuilds the table, leases included)."""
    return f"dyn_allowrports_{fam}"


def _port_set(
    table: str, name: str, fam: str, elements: Sequence[str], size: int, *, timed: bool, exact: bool = False
) -> str:
    decl = port_set_decl(name, fam, size, timed=timed, exact=exact)
    if elements:
        decl = decl[: -len(" }")] + f" elements = {{ {', '.join(elements)} }} }}"
    return f"add set inet {table} {decl}"


def _dynp(cfg: SidecarTable, fam: str, elements: Sequence[str], *, exact: bool = False) -> str:
    # One text per declaration, as for the dyn sets (a re-declaration must match).
    name = dynpx_set(fam) if exact else dynp_set(fam)
    return _port_set(cfg.table, name, fam, elements, port_elems_cap(cfg.max_leases), timed=True, exact=exact)


def _elems_in(ip: IPAddress, ports: Scope, shared: Scope, *, exact: bool) -> tuple[PortElem, ...]:
    """A lease's elements in one of its port sets: single ports (hash), or the ranges that
    are not on the hash path (pipapo)."""
    net = host_network(ip)
    picked = single_elements(ports, shared) if exact else pipapo_elements(ports, shared)
    return tuple((net, proto, lo, hi) for proto, lo, hi in picked)


def port_elements(elems: Sequence[PortElem], seconds: float | None = None) -> list[str]:
    texts = [port_elem_text(e) for e in elems]
    if seconds is None:
        return texts
    s = max(1, min(DYN_TIMEOUT_S, math.ceil(seconds)))
    return [f"{x} timeout {s}s expires {s}s" for x in texts]


def lease_element(ip: IPAddress, seconds: float) -> str:
    """A dyn element; ``expires`` as well as ``timeout`` so a re-add refreshes an existing one."""
    s = max(1, min(DYN_TIMEOUT_S, math.ceil(seconds)))
    return f"{ip} timeout {s}s expires {s}s"


def ruleset(
    cfg: SidecarTable,
    policy: NetworkPolicy,
    leases: Sequence[LeaseLike] = (),
    dropped: int = 0,
) -> str:
    """The whole table for ``policy`` (the effective one: user + always-rules) as one script.

    ``leases`` are DNS-learned addresses with their remaining lifetime in seconds: a rebuild
    keeps them, so a policy change does not break names the app resolved a moment ago.
    ``dropped``: the refusal count of the table being replaced, carried over.
    """
    t = cfg.table
    doh = split_by_family(cfg.doh_blocklist)
    lines = [f"add table inet {t}", f"delete table inet {t}", f"add table inet {t}"]
    lines += _set_declarations(cfg, policy, leases, doh)
    lines += _denied_chain(cfg, dropped)  # the guard refuses packets in either mode
    lines += _redirect_chain(cfg, policy)
    lines += _guard_chain(cfg)
    lines += _fwd_zone_chain(cfg)
    if cfg.mitm_port is not None:
        lines += _mitm_input_chain(cfg, cfg.mitm_port)
    if cfg.mode != "dns":
        lines += _inbound_chain(cfg)
        lines += _filter_chain(cfg, policy, doh)
    return "\n".join(lines) + "\n"


def _rule(t: str, chain: str, body: str) -> str:
    return f"add rule inet {t} {chain} {body}"


def _set_declarations(
    cfg: SidecarTable,
    policy: NetworkPolicy,
    leases: Sequence[LeaseLike],
    doh: dict[str, list[str]],
) -> list[str]:
    t = cfg.table
    sets = ip_sets(policy)
    resolvers = [ipaddress.ip_network(ip) for ip in cfg.resolvers]
    allow = split_by_family([*sets.allow_v4, *sets.allow_v6, *resolvers])
    deny = split_by_family([*sets.deny_v4, *sets.deny_v6])
    # Port-scoped rules and leases (docs/reference/behaviour.md §18), as disjoint elements.
    allowp = disjoint([*entries(sets.allow_scoped, 4), *entries(sets.allow_scoped, 6)])
    denyp = disjoint([*entries(sets.deny_scoped, 4), *entries(sets.deny_scoped, 6)])
    dyn: dict[str, list[str]] = {"v4": [], "v6": []}
    dynp: dict[str, list[str]] = {"v4": [], "v6": []}
    dynpx: dict[str, list[str]] = {"v4": [], "v6": []}
    dynr: dict[str, list[str]] = {"v4": [], "v6": []}
    # The whole table is written here, the shared ranges with it: every lease is placed by
    # the ranges this table holds (the grants' own are the same policy's).
    shared = shared_ranges(policy, name_check=cfg.checks_names)
    for g in as_grants(leases):
        if g.seconds > 0:
            if g.scope.whole:
                dyn[family(g.ip)].append(lease_element(g.ip, g.seconds))
            ports = g.scope.ports
            dynp[family(g.ip)] += port_elements(_elems_in(g.ip, ports, shared, exact=False), g.seconds)
            dynpx[family(g.ip)] += port_elements(_elems_in(g.ip, ports, shared, exact=True), g.seconds)
            if on_hash_path(ports, shared):
                dynr[family(g.ip)].append(lease_element(g.ip, g.seconds))
    services = [f"{p} . {lo}" if lo == hi else f"{p} . {lo}-{hi}" for p, lo, hi in shared.elements()]
    lines = []
    for fam in ("v4", "v6"):
        lines.append(_interval_set(t, f"allow_{fam}", fam, allow[fam]))
        lines.append(_interval_set(t, f"deny_{fam}", fam, deny[fam]))
        lines.append(_timeout_set(t, dyn_set(fam), fam, dyn[fam], cfg.max_leases))
        mine_a = [e for e in allowp if family(e[0]) == fam]
        mine_d = [e for e in denyp if family(e[0]) == fam]
        lines.append(_port_set(t, f"allowp_{fam}", fam, port_elements(mine_a), 0, timed=False))
        lines.append(_port_set(t, f"denyp_{fam}", fam, port_elements(mine_d), 0, timed=False))
        lines.append(_dynp(cfg, fam, dynp[fam]))
        lines.append(_dynp(cfg, fam, dynpx[fam], exact=True))
        if services:
            # Only with shared ranges (every policy change rebuilds the table): without them
            # no lease takes the hash path, and every set fewer is one the kernel's by-name
            # lookups need not walk past.
            lines.append(_timeout_set(t, dynr_set(fam), fam, dynr[fam], cfg.max_leases))
            lines.append(f"add set inet {t} {services_set_decl(dynrports_set(fam), services)}")
    if cfg.block_doh_443 and cfg.doh_blocklist:
        for fam in ("v4", "v6"):
            if doh[fam]:
                lines.append(_interval_set(t, f"doh_block_{fam}", fam, doh[fam]))
    return lines


def _denied_chain(cfg: SidecarTable, dropped: int) -> list[str]:
    t, c = cfg.table, DENIED_CHAIN
    lines = [
        f"add counter inet {t} {DROPPED_COUNTER} {{ packets {max(0, dropped)} bytes 0 }}",
        f"add chain inet {t} {c}",
        _rule(t, c, f'counter name "{DROPPED_COUNTER}"'),
    ]
    if cfg.deny_reject:
        # A locally generated packet: the reset or the ICMP error reaches the app's own
        # socket at once (connect() fails with ECONNREFUSED / EHOSTUNREACH, no timeout).
        lines.append(_rule(t, c, "meta l4proto tcp reject with tcp reset"))
        lines.append(_rule(t, c, "reject with icmpx admin-prohibited"))
    lines.append(_rule(t, c, "drop"))
    return lines


def _redirect_chain(cfg: SidecarTable, policy: NetworkPolicy) -> list[str]:
    # DNS: every udp/tcp 53 packet the namespace sends goes to the local proxy, except the
    # proxy's own upstream queries (SO_MARK 0x1 set by the forwarder).
    t, c = cfg.table, REDIRECT_CHAIN
    lines = [
        f"add chain inet {t} {c} {{ type nat hook output priority -100; policy accept; }}",
        _rule(t, c, f"meta mark {FORWARDER_MARK:#x} return"),
    ]
    lines += _exempt_dns_returns(cfg, c)  # the reference's per-destination RETURN
    lines += [
        _rule(t, c, f"udp dport 53 redirect to :{cfg.dns_port}"),
        _rule(t, c, f"tcp dport 53 redirect to :{cfg.dns_port}"),
    ]
    if cfg.mitm_port is not None:
        # The namespace's own HTTP(S) goes through the MITM (80, 443, the extra ports and the
        # ports the policy's http/https rules name, §18: the table is rebuilt with each
        # policy); the MITM's upstream leg does not (it would loop), and loopback
        # destinations are nobody's upstream.
        fixed = (*FIXED_PORTS, *cfg.mitm_extra_ports)
        named = [str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in named_ports(policy, fixed)]
        ports = "{ " + ", ".join([*(str(p) for p in fixed), *named]) + " }"
        lines += [
            _rule(t, c, f"meta skgid {MITM_GID} return"),
            _rule(t, c, "ip daddr 127.0.0.0/8 return"),
            _rule(t, c, "ip6 daddr ::1 return"),
            _rule(t, c, f"tcp dport {ports} redirect to :{cfg.mitm_port}"),
        ]
    return lines


def _exempt_dns_returns(cfg: SidecarTable, chain: str) -> list[str]:
    """DNS to the exempt nameservers (OPENSANDBOX_EGRESS_NAMESERVER_EXEMPT) goes out as sent."""
    lines = []
    for fam in ("v4", "v6"):
        exempt = exempt_literal(cfg.nameserver_exempt, fam)
        if exempt is not None:
            body = f"{l3_of(fam)} daddr {exempt} meta l4proto {{ tcp, udp }} th dport 53 return"
            lines.append(_rule(cfg.table, chain, body))
    return lines


def _guard_chain(cfg: SidecarTable) -> list[str]:
    """What no policy opens, in both modes: a packet from an address that is not the
    namespace's own (any protocol), and port 53 that the redirect did not rewrite (the
    forwarder and the exempt nameservers aside).

    IPv6 lets any process send from another address (IPV6_FREEBIND needs no capability). A
    "reply" spoofed from resolver:53 to the app's own address sets up a tracked flow; the
    app's query from that port then rides it in the reply direction, never NATed, accepted as
    established. The forwarder's upstream queries leave from the app's address un-redirected
    too, and their tracked flows outlive the sockets it closes (a timeout, more queries than
    its pool, a crash) by 30-120 s: an app that binds such a port rides that flow. Only the
    forwarder and the exempt nameservers send to port 53 as addressed.
    """
    t, c = cfg.table, GUARD_CHAIN
    lines = [
        f"add chain inet {t} {c} {{ type filter hook output priority 0; policy accept; }}",
        # Every protocol (a forged echo request makes the kernel's echo reply, the app's
        # payload, that flow's reply direction), bar the unspecified address (IPv6 duplicate
        # address detection and MLD send from "::"). Only packets of a socket ("meta skuid"
        # has no value without one): EGRESSD_DENY_REJECT's TCP reset comes from the refused
        # destination and has none.
        _rule(t, c, f"ip saddr != 0.0.0.0 meta skuid >= 0 fib saddr type != local {REFUSE}"),
        _rule(t, c, f"ip6 saddr != :: meta skuid >= 0 fib saddr type != local {REFUSE}"),
        _rule(t, c, f"meta mark {FORWARDER_MARK:#x} return"),
    ]
    lines += _exempt_dns_returns(cfg, c)
    lines += [_rule(t, c, body) for body in unredirected_dns(REFUSE)]
    # Rewritten, but not to the proxy: another table's NAT at the same hook got there first
    # (a container runtime's embedded DNS, say), and then ours does not run.
    lines.append(
        _rule(
            t,
            c,
            "meta l4proto { tcp, udp } ct direction original ct original proto-dst 53 "
            f"th dport != {cfg.dns_port} {REFUSE}",
        )
    )
    return lines


def _fwd_zone_chain(cfg: SidecarTable) -> list[str]:
    """Both modes: the forwarder's upstream flows (mark 0x1; the deny webhook's too) in a
    conntrack zone of their own, original direction only. The app's entries ``app:P ->
    resolver:53`` (redirected to the proxy) would otherwise catch the first packet of the
    forwarder's next socket on P and send the query back to the proxy (nftsyntax.forwarder_zone)."""
    t, c = cfg.table, FWD_ZONE_CHAIN
    return [f"add chain inet {t} {c} {FORWARDER_ZONE_CHAIN}", _rule(t, c, forwarder_zone(FORWARDER_MARK))]


def _mitm_input_chain(cfg: SidecarTable, port: int) -> list[str]:
    # Only redirected connections may reach the MITM: a direct one (from the app or from
    # outside the namespace) makes it connect to itself in a loop.
    t, c = cfg.table, MITM_INPUT_CHAIN
    return [
        f"add chain inet {t} {c} {{ type filter hook input priority 0; policy accept; }}",
        _rule(t, c, f"tcp dport {port} ct status dnat accept"),
        _rule(t, c, f"tcp dport {port} {REFUSE}"),
    ]


def _inbound_chain(cfg: SidecarTable) -> list[str]:
    """A TCP packet from outside that conntrack does not know and that opens nothing (no SYN)
    is picked up as a new flow in reverse (peer -> app), whose reply direction, the app's
    packets, the egress chain would accept as established: a flow whose entry is gone (a cut
    flow's, ended by a peer's RST the app ignored, or expired) would come back on its own
    4-tuple at the peer's next packet, unjudged and unmarked. Marked here, the app's packets on
    it are judged by the policy. A connection the peer opens is ingress, which the sidecar
    does not police (§8.6)."""
    t, c = cfg.table, INBOUND_CHAIN
    return [
        f"add chain inet {t} {c} {{ type filter hook input priority 0; policy accept; }}",
        _rule(t, c, MARK_MIDSTREAM_PICKUP),
    ]


def _filter_chain(cfg: SidecarTable, policy: NetworkPolicy, doh: dict[str, list[str]]) -> list[str]:
    """Mode dns+nft: the output filter, which enforces the policy on addresses."""
    t, f = cfg.table, FILTER_CHAIN
    default_allow = policy.default_action is Verdict.ALLOW
    verdict = "accept" if default_allow else "drop"
    lines = [f"add chain inet {t} {f} {{ type filter hook output priority 0; policy {verdict}; }}"]

    def rule(body: str) -> None:
        lines.append(_rule(t, f, body))

    rule(UNASSURED_REPLY_REFUSED)
    rule(ESTABLISHED_UNLESS_MARKED)
    rule(f"meta mark {FORWARDER_MARK:#x} accept")
    if cfg.mitm_port is not None:
        # Redirected to the MITM (its output interface is still the original route's, so
        # "lo" does not match): accepted; the policy applies to the MITM's upstream leg.
        rule(f"tcp dport {cfg.mitm_port} ct status dnat accept")
    rule('oifname "lo" accept')
    # A redirected DNS packet still carries the output interface it was routed to before the
    # nat hook rewrote its destination (the hook state is fixed per traversal), so "lo"
    # does not match it: accept exactly the proxy's loopback address and port.
    rule(f"ip daddr 127.0.0.1 meta l4proto {{ tcp, udp }} th dport {cfg.dns_port} accept")
    rule(f"ip6 daddr ::1 meta l4proto {{ tcp, udp }} th dport {cfg.dns_port} accept")
    # IPv6 needs neighbour discovery to reach even the gateway (IPv4's ARP never enters an
    # inet chain). Link-local only: a hop limit of 255 cannot have been routed.
    rule(f"icmpv6 type {{ {ND_TYPES} }} ip6 hoplimit 255 accept")
    rule(f"tcp dport 853 {REFUSE}")
    rule(f"udp dport 853 {REFUSE}")
    if cfg.block_doh_443:
        if not cfg.doh_blocklist:
            rule(f"tcp dport 443 {REFUSE}")
        else:
            for fam in ("v4", "v6"):
                if doh[fam]:
                    rule(f"{l3_of(fam)} daddr @doh_block_{fam} tcp dport 443 {REFUSE}")
    ranges = not shared_ranges(policy, name_check=cfg.checks_names).is_empty()
    lines += [_rule(t, f, body) for body in _address_verdicts(cfg, ranges=ranges)]
    if not default_allow:
        rule(REFUSE)
    return lines


def _address_verdicts(cfg: SidecarTable, *, ranges: bool) -> list[str]:
    """Deny beats everything (address-only, then by port); then exempt nameservers (port 53),
    leases, the allow sets, each address-only then by port (docs/reference/behaviour.md §18). With the
    name check on, an address-only lease accepts anything but UDP 443 (QUIC). ``ranges``: the
    policy has shared ranges, so the table has the hash path's sets (and this rule reads them)."""
    key = "daddr . meta l4proto . th dport"
    out = [f"{l3_of(fam)} daddr @deny_{fam} {REFUSE}" for fam in ("v4", "v6")]
    out += [f"{l3_of(fam)} {key} @denyp_{fam} {REFUSE}" for fam in ("v4", "v6")]
    for fam in ("v4", "v6"):
        exempt = exempt_literal(cfg.nameserver_exempt, fam)
        if exempt is not None:
            # Port 53 only: the reference puts exempt nameservers in the allow list whole.
            out.append(f"{l3_of(fam)} daddr {exempt} meta l4proto {{ tcp, udp }} th dport 53 accept")
    guards = ("meta l4proto != udp ", "udp dport != 443 ") if cfg.checks_names else ("",)
    out += [f"{l3_of(fam)} daddr @{dyn_set(fam)} {g}accept" for fam in ("v4", "v6") for g in guards]
    out += [f"{l3_of(fam)} {key} @{dynp_set(fam)} accept" for fam in ("v4", "v6")]
    out += [f"{l3_of(fam)} {key} @{dynpx_set(fam)} accept" for fam in ("v4", "v6")]
    out += [
        f"{l3_of(fam)} daddr @{dynr_set(fam)} meta l4proto . th dport @{dynrports_set(fam)} accept"
        for fam in ("v4", "v6")
        if ranges
    ]
    out += [f"{l3_of(fam)} daddr @allow_{fam} accept" for fam in ("v4", "v6")]
    out += [f"{l3_of(fam)} {key} @allowp_{fam} accept" for fam in ("v4", "v6")]
    return out


def dyn_add(cfg: SidecarTable, leases: Sequence[LeaseLike]) -> str:
    """DNS learning: add (or refresh) addresses in the dyn sets, one transaction.

    Re-declares the sets with the elements inline: that is the cache-free path of
    libnftables 1.0.6 (``add element`` would first dump every interval set of the netns).
    With ``renew_by_replace`` (a kernel that does not extend an element added again) each
    set is declared with the elements (so they exist), they are deleted, and declared again:
    still one transaction. The delete needs the set cache, which in the sidecar's namespace
    is this one small table.
    """
    by_fam: dict[str, list[tuple[IPAddress, str]]] = {"v4": [], "v6": []}
    grants = as_grants(leases)
    for g in grants:
        if g.scope.whole:
            by_fam[family(g.ip)].append((g.ip, lease_element(g.ip, g.seconds)))
    lines: list[str] = []
    for fam, items in by_fam.items():
        if not items:
            continue
        declare = _timeout_set(cfg.table, dyn_set(fam), fam, [el for _, el in items], cfg.max_leases)
        lines.append(declare)
        if cfg.renew_by_replace:
            keys = ", ".join(str(ip) for ip, _ in items)
            lines.append(f"delete element inet {cfg.table} {dyn_set(fam)} {{ {keys} }}")
            lines.append(declare)
    for fam in ("v4", "v6"):
        mine = [g for g in grants if family(g.ip) == fam]
        for exact in (True, False):
            lines += _dynp_add(cfg, fam, mine, exact=exact)
        lines += _dynr_add(cfg, fam, mine)
    return "\n".join(lines) + "\n" if lines else ""


def _dynr_add(cfg: SidecarTable, fam: str, grants: Sequence[Grant]) -> list[str]:
    """The hash path's addresses (egressd.subject.ranges): a lease whose ranges are its
    grant's shared ones (the table's, written with the same policy). One whose held ranges
    were there and whose new ones are not is declared (so it exists: a delete of an expired
    element would fail the transaction) and deleted; ``renew_by_replace`` likewise."""
    gone: list[tuple[IPAddress, int]] = []
    add: list[tuple[IPAddress, int]] = []
    for g in grants:
        if g.scope.ports.is_empty():
            continue  # as in _dynp_add
        new = on_hash_path(g.scope.ports, g.shared)
        changed = g.held != g.scope.ports
        old = on_hash_path(g.held, g.shared) if changed else new
        if old and (changed or cfg.renew_by_replace):
            gone.append((g.ip, g.seconds))
        if new:
            add.append((g.ip, g.seconds))
    lines: list[str] = []
    name = dynr_set(fam)
    if gone:
        lines.append(_timeout_set(cfg.table, name, fam, [lease_element(ip, s) for ip, s in gone], cfg.max_leases))
        keys = ", ".join(str(ip) for ip, _ in gone)
        lines.append(f"delete element inet {cfg.table} {name} {{ {keys} }}")
    if add:
        lines.append(_timeout_set(cfg.table, name, fam, [lease_element(ip, s) for ip, s in add], cfg.max_leases))
    return lines


def _dynp_add(cfg: SidecarTable, fam: str, grants: Sequence[Grant], *, exact: bool) -> list[str]:
    """A lease's port elements (§18) in one of its two sets (``exact``: the single ports'
    hash set, else the ranges' pipapo set): those it held first declared (so each exists)
    and deleted when its scope changed (the kernel refuses a partly overlapping element),
    then the new ones; ``renew_by_replace`` likewise for unchanged ones."""
    gone: list[str] = []
    gone_keys: list[str] = []
    new: list[str] = []
    for g in grants:
        if g.scope.ports.is_empty():
            continue
        elems = _elems_in(g.ip, g.scope.ports, g.shared, exact=exact)
        held = _elems_in(g.ip, g.held, g.shared, exact=exact)
        old = held if g.held != g.scope.ports else (elems if cfg.renew_by_replace else ())
        gone += port_elements(old, g.seconds)
        gone_keys += port_elements(old)
        new += port_elements(elems, g.seconds)
    lines: list[str] = []
    name = dynpx_set(fam) if exact else dynp_set(fam)
    if gone:
        lines.append(_dynp(cfg, fam, gone, exact=exact))
        lines.append(f"delete element inet {cfg.table} {name} {{ {', '.join(gone_keys)} }}")
    if new:
        lines.append(_dynp(cfg, fam, new, exact=exact))
    return lines


def delete_table(cfg: SidecarTable) -> str:
    """Shutdown: remove the table (``add`` first, so a missing table is not an error)."""
    return f"add table inet {cfg.table}\ndelete table inet {cfg.table}\n"
