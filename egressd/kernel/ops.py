"""Netlink batch operations as plain data (pure), with an nft-syntax rendering for tests and logs.

A :class:`NetlinkBatch` is applied as one nf_tables transaction: all of it or nothing. These
operations need no libnftables cache, so their cost does not grow with the fleet size.
"""

from __future__ import annotations

import enum
import ipaddress
from dataclasses import dataclass

from egressd.addr import IPAddress

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

ALLOW_MARK = 0x2


class RuleAction(enum.StrEnum):
    """What a per-subject rule does to a matching packet."""

    DROP = "drop"
    ACCEPT = "accept"
    MARK = "mark"  # meta mark set ALLOW_MARK (then continue)


def _verdict_text(outcome: RuleAction, drop_chain: str) -> str:
    if outcome is RuleAction.MARK:
        return f"meta mark set {ALLOW_MARK:#x}"
    if outcome is RuleAction.DROP and drop_chain:
        return f"goto {drop_chain}"
    return outcome.value


#: What a port-scoped element or rule names: the protocols a scope can hold (``other`` never
#: becomes an element: a scope that is not whole never opens other protocols).
L4_PROTOCOLS = {"tcp": 6, "udp": 17}

#: A port-scoped set element: (prefix, protocol, first port, last port), inclusive.
PortElem = tuple[IPNetwork, str, int, int]


class L4Guard(enum.StrEnum):
    """An extra condition on a :class:`MatchRule` (docs/reference/behaviour.md §18: with the name
    check on, a DNS-learned address never opens UDP 443, QUIC, whose name egressd cannot check;
    two rules, ``not udp`` and ``udp, not port 443``, together mark everything else)."""

    NONE = ""
    NOT_UDP = "meta l4proto != udp"
    UDP_NOT_443 = "udp dport != 443"


@dataclass(frozen=True, slots=True)
class MatchRule:
    """``[ct original] ip|ip6 daddr @set [guard] <outcome>`` — the address-only rule shape.

    ``drop_chain``: a DROP hands the packet to that chain instead (``goto``), which counts it
    and drops or rejects it (docs/reference/behaviour.md §15); the packet is still refused, never accepted.
    """

    fam: str  # "v4" | "v6"
    set_name: str
    outcome: RuleAction
    ct_original: bool = False
    drop_chain: str = ""
    guard: L4Guard = L4Guard.NONE

    def render(self) -> str:
        l3 = "ip" if self.fam == "v4" else "ip6"
        prefix = "ct original " if self.ct_original else ""
        guard = f"{self.guard.value} " if self.guard is not L4Guard.NONE else ""
        return f"{prefix}{l3} daddr @{self.set_name} {guard}{_verdict_text(self.outcome, self.drop_chain)}"


@dataclass(frozen=True, slots=True)
class PortRule:
    """``ip|ip6 daddr . meta l4proto . th dport @set <outcome>``: the port-scoped rule shape
    (docs/reference/behaviour.md §18), on a set keyed ``addr . inet_proto . inet_service``.
    ``ct_original``: the intercepted path (input, after the MITM's REDIRECT) judges the
    conntrack original destination and port instead (``ct original ip daddr . meta l4proto .
    ct original proto-dst``, which nft 1.0.6 cannot parse but the kernel takes and lists)."""

    fam: str
    set_name: str
    outcome: RuleAction
    ct_original: bool = False
    drop_chain: str = ""
    # The set is a hash set (AddSet ``exact``): nft loads the protocol without the byteorder
    # step it puts before an interval (pipapo) lookup.
    exact: bool = False

    def render(self) -> str:
        l3 = "ip" if self.fam == "v4" else "ip6"
        if self.ct_original:
            key = f"ct original {l3} daddr . meta l4proto . ct original proto-dst"
        else:
            key = f"{l3} daddr . meta l4proto . th dport"
        return f"{key} @{self.set_name} {_verdict_text(self.outcome, self.drop_chain)}"


@dataclass(frozen=True, slots=True)
class VerdictRule:
    outcome: RuleAction  # DROP or ACCEPT
    drop_chain: str = ""  # as in MatchRule

    def render(self) -> str:
        return _verdict_text(self.outcome, self.drop_chain)


@dataclass(frozen=True, slots=True)
class AuditRule:
    """``ip|ip6 daddr @set ip|ip6 daddr != @hard ct state new [meta mark & 0x2 != 0x2]
    log prefix "…" counter name "…" meta mark set 0x2``: an audit would-deny, logged and counted
    once per new flow, then marked so it passes the unmarked-drop tail. Only new flows are
    logged and counted (not every packet); later packets of the flow are accepted as
    established before the tail. Destinations in ``hard`` (the deny set, which holds only
    always-deny prefixes while auditing) are left alone: they are dropped, not would-denied.
    ``unmarked_only``: skip packets an allow or dyn rule already marked.
    """

    fam: str
    set_name: str
    hard: str
    log_prefix: str
    counter: str
    unmarked_only: bool = False
    # ``set_name`` is port-scoped (``ip daddr . meta l4proto . th dport @set``): audit mode's
    # would-deny by port (docs/reference/behaviour.md §18).
    ports: bool = False

    def render(self) -> str:
        l3 = "ip" if self.fam == "v4" else "ip6"
        mark = f" meta mark & {ALLOW_MARK:#010x} != {ALLOW_MARK:#010x}" if self.unmarked_only else ""
        key = f"{l3} daddr . meta l4proto . th dport" if self.ports else f"{l3} daddr"
        return (
            f"{key} @{self.set_name} {l3} daddr != @{self.hard} ct state new{mark} "
            f'log prefix "{self.log_prefix}" counter name "{self.counter}" meta mark set {ALLOW_MARK:#x}'
        )


@dataclass(frozen=True, slots=True)
class RangeRule:
    """``ip|ip6 daddr @addrs meta l4proto . th dport @services <outcome>``: a lease address
    (a hash set of addresses) on the port ranges every address of that set shares (an
    ``inet_proto . inet_service`` interval set written with the policy), the hash path for
    leases' port ranges (docs/concepts/ruleset.md). ``ct_original``: on the conntrack
    original destination and port, as :class:`PortRule`."""

    fam: str
    set_name: str
    services: str
    outcome: RuleAction
    ct_original: bool = False
    drop_chain: str = ""

    def render(self) -> str:
        l3 = "ip" if self.fam == "v4" else "ip6"
        if self.ct_original:
            key = f"ct original {l3} daddr @{self.set_name} meta l4proto . ct original proto-dst"
        else:
            key = f"{l3} daddr @{self.set_name} meta l4proto . th dport"
        return f"{key} @{self.services} {_verdict_text(self.outcome, self.drop_chain)}"


Rule = MatchRule | PortRule | VerdictRule | AuditRule | RangeRule


@dataclass(frozen=True, slots=True)
class AddRule:
    chain: str
    rule: Rule


@dataclass(frozen=True, slots=True)
class AddSet:
    """Declare a set (no-op when an identical one exists). ``kind``: interval | timeout | plain."""

    name: str
    fam: str
    kind: str
    timeout_s: int = 0
    size: int = 0  # most elements the kernel accepts (0: no limit); DNS lease cap, 14.4
    # Keyed ``addr . inet_proto . inet_service`` (always an interval set; ``kind`` timeout adds
    # per-element timeouts): the port-scoped sets of docs/reference/behaviour.md §18.
    ports: bool = False
    # With ``ports``: no interval flag, so the kernel picks a hash set, not pipapo. Elements are
    # one address and one port (:func:`is_exact_elem`); an add or delete costs the same at
    # any set size, where pipapo clones its lookup data on every transaction (the leases'
    # single-port elements, docs/concepts/ruleset.md).
    exact: bool = False
    # Keyed ``inet_proto . inet_service`` (an interval set, no address): the port ranges a
    # :class:`RangeRule` opens (``fam`` only names the family of the addresses it goes with).
    services: bool = False


@dataclass(frozen=True, slots=True)
class AddChain:
    name: str


@dataclass(frozen=True, slots=True)
class AddCounter:
    """A named counter object (no-op when it exists): per-subject audit evidence."""

    name: str


@dataclass(frozen=True, slots=True)
class DeleteCounter:
    name: str


@dataclass(frozen=True, slots=True)
class AddCounterRef:
    """``map[key] = "counter"`` in a counter map (``type ipv4_addr : counter``): the drop
    counter a source address's refused packets are counted in (docs/reference/behaviour.md §15)."""

    map: str
    key: IPAddress
    counter: str


@dataclass(frozen=True, slots=True)
class AddJump:
    """``map[key] = jump chain`` in a verdict map."""

    map: str
    key: IPAddress
    chain: str


@dataclass(frozen=True, slots=True)
class AddPort:
    """``map[addr] = port`` in a ``type ipv4_addr : inet_service`` map (the MITM worker port a
    source is redirected to, EGRESSD_MITM_WORKERS)."""

    map: str
    key: IPAddress
    to_port: int


@dataclass(frozen=True, slots=True)
class AddElements:
    """Add addresses to a plain (non-interval, no-timeout) set."""

    name: str
    keys: tuple[IPAddress, ...]


@dataclass(frozen=True, slots=True)
class FlushSet:
    name: str


@dataclass(frozen=True, slots=True)
class AddIntervals:
    """Add prefixes to an interval set (normalised: no overlaps, no strict subnets)."""

    name: str
    fam: str
    nets: tuple[IPNetwork, ...]


@dataclass(frozen=True, slots=True)
class AddTimed:
    """Add addresses with per-element timeouts to a timeout set (DNS leases)."""

    name: str
    fam: str
    leases: tuple[tuple[IPAddress, int], ...]  # (address, seconds)


@dataclass(frozen=True, slots=True)
class AddPortElems:
    """Add port-scoped elements to an ``addr . inet_proto . inet_service`` interval set;
    ``seconds`` (one per element, or empty: no timeout) for the port-scoped DNS leases. The
    kernel (pipapo) refuses an element that partly overlaps one it holds: callers add
    disjoint elements, or delete the old ones first in the same transaction."""

    name: str
    fam: str
    elems: tuple[PortElem, ...]
    seconds: tuple[int, ...] = ()
    exact: bool = False  # the set is a hash set (AddSet ``exact``): each element one address, one port


@dataclass(frozen=True, slots=True)
class AddServices:
    """Add ``proto . lo-hi`` elements to an ``inet_proto . inet_service`` interval set
    (AddSet ``services``); disjoint, as an interval set needs."""

    name: str
    elems: tuple[tuple[str, int, int], ...]


@dataclass(frozen=True, slots=True)
class DeletePortElems:
    """Delete port-scoped elements (each must be there: callers add them first when unsure)."""

    name: str
    fam: str
    elems: tuple[PortElem, ...]
    exact: bool = False


@dataclass(frozen=True, slots=True)
class DeleteElement:
    name: str
    key: IPAddress


@dataclass(frozen=True, slots=True)
class FlushChain:
    """Delete every rule of a chain (``flush chain``), keeping the chain and what jumps to it."""

    name: str


@dataclass(frozen=True, slots=True)
class DeleteChain:
    name: str


@dataclass(frozen=True, slots=True)
class DeleteSet:
    name: str


@dataclass(frozen=True, slots=True)
class AddUidJump:
    """``map[uid] = jump chain`` in a verdict map keyed by host uid (``type uid : verdict``),
    or by ``uid . port`` (``type uid . inet_service : verdict``) when ``port`` is given."""

    map: str
    uid: int
    chain: str
    port: int | None = None


@dataclass(frozen=True, slots=True)
class AddUidPort:
    """``map[uid] = port`` in a ``type uid : inet_service`` map (a per-subject redirect port)."""

    map: str
    uid: int
    to_port: int


@dataclass(frozen=True, slots=True)
class AddUidCounterRef:
    """``map[uid] = "counter"`` in a ``type uid : counter`` map: the drop counter a host-uid
    subject's refused packets are counted in (docs/reference/behaviour.md §15 x 17)."""

    map: str
    uid: int
    counter: str


@dataclass(frozen=True, slots=True)
class AddUid:
    """Add ``uid`` (or ``uid . port``) to a ``type uid`` (``type uid . inet_service``) set."""

    name: str
    uid: int
    port: int | None = None


@dataclass(frozen=True, slots=True)
class DeleteUid:
    """Delete the element keyed ``uid`` (or ``uid . port``) from a uid-keyed set or map."""

    name: str
    uid: int
    port: int | None = None


UidOp = AddUidJump | AddUidPort | AddUidCounterRef | AddUid | DeleteUid


@dataclass(frozen=True, slots=True)
class AddIface:
    """Add an interface name to a ``type ifname`` set (a sandbox-facing interface, §20.2);
    a no-op when it is there."""

    name: str
    iface: str


@dataclass(frozen=True, slots=True)
class DeleteIface:
    """Delete an interface name from a ``type ifname`` set (fails when it is not there)."""

    name: str
    iface: str


IfaceOp = AddIface | DeleteIface

Op = (
    AddSet
    | AddChain
    | AddCounter
    | DeleteCounter
    | AddCounterRef
    | AddJump
    | AddPort
    | AddElements
    | AddRule
    | FlushSet
    | AddIntervals
    | AddTimed
    | DeleteElement
    | AddPortElems
    | AddServices
    | DeletePortElems
    | FlushChain
    | DeleteChain
    | DeleteSet
    | UidOp
    | IfaceOp
)

#: The operations on a set's or a map's contents; the others create or delete kernel objects.
ElementOp = (
    AddJump
    | AddPort
    | AddCounterRef
    | AddElements
    | FlushSet
    | AddIntervals
    | AddTimed
    | DeleteElement
    | AddPortElems
    | AddServices
    | DeletePortElems
)


def _uid_key_text(uid: int, port: int | None) -> str:
    return str(uid) if port is None else f"{uid} . {port}"


def describe_uid_op(t: str, op: UidOp) -> str:
    if isinstance(op, AddUidJump):
        return f"add element {t} {op.map} {{ {_uid_key_text(op.uid, op.port)} : jump {op.chain} }}"
    if isinstance(op, AddUidPort):
        return f"add element {t} {op.map} {{ {op.uid} : {op.to_port} }}"
    if isinstance(op, AddUidCounterRef):
        return f'add element {t} {op.map} {{ {op.uid} : "{op.counter}" }}'
    if isinstance(op, AddUid):
        return f"add element {t} {op.name} {{ {_uid_key_text(op.uid, op.port)} }}"
    return f"delete element {t} {op.name} {{ {_uid_key_text(op.uid, op.port)} }}"


def describe_iface_op(t: str, op: IfaceOp) -> str:
    verb = "add" if isinstance(op, AddIface) else "delete"
    return f'{verb} element {t} {op.name} {{ "{op.iface}" }}'


def is_exact_elem(elem: PortElem) -> bool:
    """One address and one port: an element a hash (``exact``) port set can hold."""
    net, _, lo, hi = elem
    return lo == hi and net.prefixlen == net.max_prefixlen


def port_elem_text(elem: PortElem) -> str:
    """``prefix . proto . port[-port]`` as nft lists it."""
    net, proto, lo, hi = elem
    ports = str(lo) if lo == hi else f"{lo}-{hi}"
    return f"{_fmt_net(net)} . {proto} . {ports}"


def _fmt_net(net: IPNetwork) -> str:
    return str(net.network_address) if net.prefixlen == net.max_prefixlen else str(net)


@dataclass(frozen=True, slots=True)
class NetlinkBatch:
    table: str
    ops: tuple[Op, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.ops)

    def weight(self) -> int:
        """Messages plus elements: what the batch costs to encode and the kernel to apply."""
        n = len(self.ops)
        for op in self.ops:
            if isinstance(op, AddIntervals):
                n += len(op.nets)
            elif isinstance(op, AddTimed):
                n += len(op.leases)
            elif isinstance(op, AddElements):
                n += len(op.keys)
            elif isinstance(op, AddPortElems | DeletePortElems | AddServices):
                n += len(op.elems)
        return n

    def __add__(self, other: NetlinkBatch) -> NetlinkBatch:
        assert other.table == self.table
        return NetlinkBatch(self.table, self.ops + other.ops)

    def describe(self) -> str:
        """The batch in nft syntax (what ``nft -f`` would be given for the same change)."""
        t = f"inet {self.table}"
        out = [
            describe_uid_op(t, op)
            if isinstance(op, AddUidJump | AddUidPort | AddUidCounterRef | AddUid | DeleteUid)
            else describe_iface_op(t, op)
            if isinstance(op, AddIface | DeleteIface)
            else _describe_elements(t, op)
            if isinstance(op, ElementOp)
            else _describe_object(t, op)
            for op in self.ops
        ]
        return "\n".join(out) + ("\n" if out else "")


def _describe_object(t: str, op: Op) -> str:
    if isinstance(op, AddSet) and op.services:
        return f"add set {t} {op.name} {{ type inet_proto . inet_service; flags interval; }}"
    if isinstance(op, AddSet):
        typ = "ipv4_addr" if op.fam == "v4" else "ipv6_addr"
        flags = {
            "interval": " flags interval;",
            "timeout": f" flags timeout; timeout {op.timeout_s}s;",
        }
        if op.ports:
            typ += " . inet_proto . inet_service"
            if not op.exact:
                flags = {
                    "interval": " flags interval;",
                    "timeout": f" flags interval,timeout; timeout {op.timeout_s}s;",
                }
        size = f" size {op.size};" if op.size else ""
        return f"add set {t} {op.name} {{ type {typ};{flags.get(op.kind, '')}{size} }}"
    if isinstance(op, AddChain):
        return f"add chain {t} {op.name}"
    if isinstance(op, AddCounter):
        return f"add counter {t} {op.name}"
    if isinstance(op, DeleteCounter):
        return f"delete counter {t} {op.name}"
    if isinstance(op, AddRule):
        return f"add rule {t} {op.chain} {op.rule.render()}"
    if isinstance(op, FlushChain):
        return f"flush chain {t} {op.name}"
    if isinstance(op, DeleteChain):
        return f"delete chain {t} {op.name}"
    assert isinstance(op, DeleteSet)
    return f"delete set {t} {op.name}"


def _describe_elements(t: str, op: ElementOp) -> str:
    if isinstance(op, AddJump):
        return f"add element {t} {op.map} {{ {op.key} : jump {op.chain} }}"
    if isinstance(op, AddCounterRef):
        return f'add element {t} {op.map} {{ {op.key} : "{op.counter}" }}'
    if isinstance(op, AddPort):
        return f"add element {t} {op.map} {{ {op.key} : {op.to_port} }}"
    if isinstance(op, AddElements):
        return f"add element {t} {op.name} {{ {', '.join(str(k) for k in op.keys)} }}"
    if isinstance(op, FlushSet):
        return f"flush set {t} {op.name}"
    if isinstance(op, AddIntervals):
        return f"add element {t} {op.name} {{ {', '.join(_fmt_net(n) for n in op.nets)} }}"
    if isinstance(op, AddTimed):
        elems = ", ".join(f"{ip} timeout {s}s expires {s}s" for ip, s in op.leases)
        return f"add element {t} {op.name} {{ {elems} }}"
    if isinstance(op, AddPortElems):
        texts = [port_elem_text(e) for e in op.elems]
        if op.seconds:
            texts = [f"{x} timeout {s}s expires {s}s" for x, s in zip(texts, op.seconds, strict=True)]
        return f"add element {t} {op.name} {{ {', '.join(texts)} }}"
    if isinstance(op, DeletePortElems):
        return f"delete element {t} {op.name} {{ {', '.join(port_elem_text(e) for e in op.elems)} }}"
    if isinstance(op, AddServices):
        texts = [f"{proto} . {lo}" if lo == hi else f"{proto} . {lo}-{hi}" for proto, lo, hi in op.elems]
        return f"add element {t} {op.name} {{ {', '.join(texts)} }}"
    return f"delete element {t} {op.name} {{ {op.key} }}"
