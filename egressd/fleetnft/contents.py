"""What the fleet ruleset's sets hold (docs/reference/behaviour.md §5, §7, §8.3, §9, §14.1): a policy's
static set contents and their atomic swaps, the DNS leases of the dyn sets, and the table-wide
``sandbox_nets`` sets. Pure: returns netlink batches; the rules that read the sets never change.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from egressd.addr import IPAddress, host_network
from egressd.fleetnft.table import (
    AUDIT_PORT_SETS,
    AUDIT_SETS,
    DYNR_SETS,
    PORT_STATIC_SETS,
    SHARED_RANGE_SETS,
    STATIC_SETS,
    Names,
    sandbox_nets_set,
)
from egressd.kernel.ops import (
    AddIntervals,
    AddPortElems,
    AddServices,
    AddTimed,
    DeleteElement,
    DeletePortElems,
    FlushSet,
    NetlinkBatch,
    Op,
    PortElem,
)
from egressd.nftsyntax import IPNetwork, family
from egressd.policy import (
    IpSets,
    NetworkPolicy,
    Verdict,
    audit_deny_sets,
    ip_sets,
)
from egressd.policy.ipsets import PrefixIndex
from egressd.policy.portmatch import disjoint, entries
from egressd.policy.scope import Scope
from egressd.subject.leases import Grant, LeaseLike, as_grants
from egressd.subject.ranges import Placement, placement, shared_ranges


def sandbox_nets_refresh(nets: Iterable[IPNetwork]) -> list[Op]:
    """Empty and refill ``sandbox_nets_v4/v6`` with the union of ``nets`` (merged: an interval
    set refuses overlapping elements), for the caller's transaction."""
    ops: list[Op] = []
    for fam, version in (("v4", 4), ("v6", 6)):
        mine = [n for n in nets if n.version == version]
        merged = tuple(ipaddress.collapse_addresses(mine))  # type: ignore[type-var]
        ops.append(FlushSet(sandbox_nets_set(fam)))
        if merged:
            ops.append(AddIntervals(sandbox_nets_set(fam), fam, merged))
    return ops


_ALL_V4 = ipaddress.IPv4Network("0.0.0.0/0")
_ALL_V6 = ipaddress.IPv6Network("::/0")


def port_contents(sets: IpSets, *, audit: bool = False) -> dict[str, tuple[PortElem, ...]]:
    """The port-scoped static sets (docs/reference/behaviour.md §18): IP/CIDR rules with ports or a
    protocol, as disjoint elements (the kernel's pipapo sets refuse partial overlaps). In
    audit mode the deny rules with ports move to ``wdenyp`` (logged, counted and passed, like
    ``wdeny``): only the user's rules carry ports, the operator's always-deny never does."""
    deny4, deny6 = disjoint(entries(sets.deny_scoped, 4)), disjoint(entries(sets.deny_scoped, 6))
    return {
        "allowp_v4": disjoint(entries(sets.allow_scoped, 4)),
        "allowp_v6": disjoint(entries(sets.allow_scoped, 6)),
        "denyp_v4": () if audit else deny4,
        "denyp_v6": () if audit else deny6,
        "wdenyp_v4": deny4 if audit else (),
        "wdenyp_v6": deny6 if audit else (),
    }


def policy_contents(effective: NetworkPolicy) -> dict[str, tuple[IPNetwork, ...]]:
    """Contents of the address-only static sets for an effective policy (§5 IP layer), audit
    mode included (the port-scoped ones: :func:`port_contents`)."""
    sets: IpSets = ip_sets(effective)
    allow_v4: tuple[IPNetwork, ...] = sets.allow_v4
    allow_v6: tuple[IPNetwork, ...] = sets.allow_v6
    if effective.default_action is Verdict.ALLOW:
        # Everything is allowed unless denied: the whole address space, one prefix per family.
        allow_v4, allow_v6 = (_ALL_V4,), (_ALL_V6,)
    out: dict[str, tuple[IPNetwork, ...]] = {"allow_v4": allow_v4, "allow_v6": allow_v6}
    if not effective.audit:
        return out | {"deny_v4": sets.deny_v4, "deny_v6": sets.deny_v6} | dict.fromkeys(STATIC_SETS[4:], ())
    split = audit_deny_sets(effective)
    return out | {
        "deny_v4": split.hard_v4,
        "deny_v6": split.hard_v6,
        "wdeny_v4": split.soft_v4,
        "wdeny_v6": split.soft_v6,
        "audit_v4": (_ALL_V4,),
        "audit_v6": (_ALL_V6,),
    }


#: ``proto . lo-hi`` without an address: the shared ranges' elements (``dynrports``).
ServiceElem = tuple[str, int, int]

#: What a subject's static sets hold: (set kind, its prefixes) in :data:`STATIC_SETS` order,
#: then (set kind, its port elements) in :data:`PORT_STATIC_SETS` order, then the shared
#: ranges (:data:`SHARED_RANGE_SETS`).
Contents = tuple[tuple[str, tuple[IPNetwork, ...] | tuple[PortElem, ...] | tuple[ServiceElem, ...]], ...]


def static_contents(effective: NetworkPolicy, *, name_check: bool = False) -> Contents:
    """:func:`policy_contents`, :func:`port_contents` and the leases' shared ranges
    (egressd.subject.ranges; ``name_check``: the name check is on) in the form a kernel view
    records (docs/concepts/architecture.md, KernelView)."""
    ports = port_contents(ip_sets(effective), audit=effective.audit)
    kinds = (*PORT_STATIC_SETS, *AUDIT_PORT_SETS)
    shared = shared_ranges(effective, name_check=name_check).elements()
    return (
        *policy_contents(effective).items(),
        *((k, ports[k]) for k in kinds),
        *((k, shared) for k in SHARED_RANGE_SETS),
    )


_Value = tuple[IPNetwork, ...] | tuple[PortElem, ...] | tuple[ServiceElem, ...]


def _nets(value: _Value) -> tuple[IPNetwork, ...]:
    return tuple(v for v in value if not isinstance(v, tuple))


def _elems(value: _Value) -> tuple[PortElem, ...]:
    return tuple(v for v in value if isinstance(v, tuple) and len(v) == 4)


def _services(value: _Value) -> tuple[ServiceElem, ...]:
    return tuple(v for v in value if isinstance(v, tuple) and len(v) == 3)


def policy_swap(
    table: str,
    nft_id: str,
    effective: NetworkPolicy,
    *,
    audit_objects: bool,
    range_objects: bool = False,
    known_empty: bool = False,
    held: Contents | None = None,
    name_check: bool = False,
) -> NetlinkBatch:
    """§8.3 as one atomic batch: each static set flushed and refilled; dyn sets untouched.

    ``audit_objects``: the subject has the audit sets (an audit policy needs them: raises
    ValueError without). ``range_objects``: the subject has the range sets ``dynr`` and
    ``dynrports`` (a policy with shared ranges needs them: raises ValueError without; see
    :func:`needs_range_objects`). ``known_empty``: every static set is empty (deny-first content, the
    registry's ``applied`` None), so the flushes are left out: each is one more set-name
    lookup, a walk of the table's list of sets in the kernel. ``held``: what the static sets
    hold now, known for certain (the kernel view's ``contents``); a set whose content does not
    change is then left alone, neither flushed nor refilled."""
    if effective.audit and not audit_objects:
        raise ValueError("an audit policy needs the subject's audit objects")
    return contents_swap(
        table,
        nft_id,
        static_contents(effective, name_check=name_check),
        audit_objects=audit_objects,
        range_objects=range_objects,
        known_empty=known_empty,
        held=held,
    )


def contents_swap(
    table: str,
    nft_id: str,
    contents: Contents,
    *,
    audit_objects: bool,
    range_objects: bool,
    known_empty: bool = False,
    held: Contents | None = None,
) -> NetlinkBatch:
    """:func:`policy_swap` of :func:`static_contents` already computed."""
    n = Names(nft_id)
    before = dict(held) if held is not None else {}
    ops: list[Op] = []
    for kind, nets in contents:
        if _absent(kind, nets, audit_objects=audit_objects, range_objects=range_objects):
            continue
        if before.get(kind) == nets:
            continue  # held and unchanged
        if not known_empty:
            ops.append(FlushSet(n.set(kind)))
        if kind in SHARED_RANGE_SETS:
            if nets:
                ops.append(AddServices(n.set(kind), _services(nets)))
        elif kind in PORT_STATIC_SETS or kind in AUDIT_PORT_SETS:
            if nets:
                ops.append(AddPortElems(n.set(kind), kind[-2:], _elems(nets)))
        elif nets:
            ops.append(AddIntervals(n.set(kind), kind[-2:], _nets(nets)))
    return NetlinkBatch(table, tuple(ops))


def _absent(kind: str, nets: _Value, *, audit_objects: bool, range_objects: bool) -> bool:
    """Is ``kind`` one of the lazy sets the subject does not have? Such a set must be empty
    under the policy (ValueError otherwise: the policy that needs it would have made it), and
    is left alone: a flush of a set that does not exist fails the whole transaction."""
    if kind in (*AUDIT_SETS, *AUDIT_PORT_SETS) and not audit_objects:
        if nets:
            raise ValueError("an audit policy needs the subject's audit objects")
        return True
    if kind in SHARED_RANGE_SETS and not range_objects:
        if nets:
            raise ValueError("a policy with shared port ranges needs the subject's range objects")
        return True
    return False


def needs_range_objects(contents: Contents) -> bool:
    """Does a subject with ``contents`` need its range objects (``dynr``, ``dynrports`` and the
    rules that read them, :func:`egressd.fleetnft.subject.range_objects`)? Yes when its policy
    has shared ranges (egressd.subject.ranges): only then can a lease take the hash path."""
    return any(nets for kind, nets in contents if kind in SHARED_RANGE_SETS)


def refuses_more(held: Contents, new: Contents) -> bool:
    """Would the kernel refuse, with ``new`` in the static sets, a destination it accepts with
    ``held`` (DNS leases aside)? A destination is accepted when no deny prefix holds it and an
    allow, wdeny or audit prefix does (or a lease: the lease book answers for those). So
    ``new`` refuses nothing more when its deny sets lie within the held ones and its marking
    sets cover the held ones. Conservative: True whenever that cannot be shown prefix by
    prefix (e.g. a held /24 covered only by two new /25s)."""
    old = {k: _nets(v) for k, v in held}
    now = {k: _nets(v) for k, v in new}
    marks = ("allow", "wdeny", "audit")
    for fam in ("v4", "v6"):
        if not _within(now.get(f"deny_{fam}", ()), old.get(f"deny_{fam}", ())):
            return True
        marked = [net for kind in marks for net in now.get(f"{kind}_{fam}", ())]
        if not _within([net for kind in marks for net in old.get(f"{kind}_{fam}", ())], marked):
            return True
    # Port-scoped sets (§18): any new deny element, or any held allow element that is gone,
    # may refuse something (conservative: element by element, no coverage reasoning).
    old_p = {k: set(_elems(v)) for k, v in held if k in PORT_STATIC_SETS}
    now_p = {k: set(_elems(v)) for k, v in new if k in PORT_STATIC_SETS}
    for fam in ("v4", "v6"):
        if not now_p.get(f"denyp_{fam}", set()) <= old_p.get(f"denyp_{fam}", set()):
            return True
        if not old_p.get(f"allowp_{fam}", set()) <= now_p.get(f"allowp_{fam}", set()):
            return True
    return False


def _within(nets: Sequence[IPNetwork], cover: Sequence[IPNetwork]) -> bool:
    """Every prefix of ``nets`` inside one prefix of ``cover``."""
    if not nets:
        return True
    index = PrefixIndex(cover)
    for net in nets:
        hit = index.hit(net.network_address)
        if hit is None or int(net.broadcast_address) > int(hit.broadcast_address):
            return False
    return True


def dyn_replace(table: str, nft_id: str, kept: Sequence[LeaseLike], *, ranges: bool) -> NetlinkBatch:
    """A narrowing change's dyn-set part (docs/reference/behaviour.md §14.1): the dyn sets (address-only and
    port-scoped) emptied and refilled with the leases that survive, each with its scope under
    the new policy (§18), in the caller's transaction. A flush, not per-element deletes: an
    element the kernel already expired would make a delete fail (ENOENT) and abort the whole
    swap. ``ranges``: the subject has its range objects (``dynr`` is flushed too); without
    them no lease may take the hash path (ValueError: its policy would have made them)."""
    n = Names(nft_id)
    kinds = ("dyn_v4", "dyn_v6", "dynp_v4", "dynp_v6", "dynpx_v4", "dynpx_v6", *(DYNR_SETS if ranges else ()))
    flush = NetlinkBatch(table, tuple(FlushSet(n.set(kind)) for kind in kinds))
    # The flush emptied what they held; each keeps the shared ranges it was narrowed under.
    fresh = [Grant(g.ip, g.seconds, g.scope, shared=g.shared) for g in as_grants(kept)]
    if not ranges and any(not g.shared.is_empty() for g in fresh):
        raise ValueError("a lease on the hash path needs the subject's range objects")
    return flush + dyn_add(table, nft_id, fresh)


def lease_elems(ip: IPAddress, scope: Scope) -> tuple[PortElem, ...]:
    """A lease's port-scoped elements: its address on each range of ``scope``."""
    return _at(ip, scope.elements())


def _at(ip: IPAddress, elems: tuple[ServiceElem, ...]) -> tuple[PortElem, ...]:
    if not elems:
        return ()
    net = host_network(ip)
    return tuple((net, proto, lo, hi) for proto, lo, hi in elems)


def dyn_add(table: str, nft_id: str, leases: Sequence[LeaseLike], *, replace: bool = False) -> NetlinkBatch:
    """DNS learning (§7) and renewal (§9): addresses with per-element timeouts, a whole lease
    in the address-only dyn set, its port elements (§18) in the port-scoped ones: single
    ports in the hash set ``dynpx``; ranges as the address alone in the hash set ``dynr`` when
    they are the grant's shared ranges (egressd.subject.ranges), else in the pipapo ``dynp``.
    Where a grant's held elements are follows from the same shared ranges: they change only
    with the policy, whose change rewrites every lease (:func:`dyn_replace`).

    ``replace`` False: one add, which also sets a new expiry on an existing element where the
    kernel supports that. True (the self-test found it does not, egressd.kernel.renewal):
    add (so each element exists), delete, add again, in the caller's one transaction. A lease
    whose port elements change first has its held ones added (so each exists) and deleted:
    the kernel refuses an element that partly overlaps one it holds."""
    n = Names(nft_id)
    ops: list[Op] = []
    grants = as_grants(leases)
    for fam in ("v4", "v6"):
        mine = [g for g in grants if family(g.ip) == fam]
        if not mine:
            continue
        whole = tuple((g.ip, g.seconds) for g in mine if g.scope.whole)
        if whole:
            name = n.set(f"dyn_{fam}")
            ops.append(AddTimed(name, fam, whole))
            if replace:
                ops += [DeleteElement(name, ip) for ip, _ in whole]
                ops.append(AddTimed(name, fam, whole))
        # A whole lease without UDP 443 has no port element: what it held expires by itself.
        placed = [_placed(g) for g in mine if not g.scope.ports.is_empty()]
        if not placed:
            continue
        ops += _port_set_ops(n.set(f"dynpx_{fam}"), fam, placed, replace=replace, exact=True)
        ops += _port_set_ops(n.set(f"dynp_{fam}"), fam, placed, replace=replace, exact=False)
        ops += _range_addr_ops(n.set(f"dynr_{fam}"), fam, placed, replace=replace)
    return NetlinkBatch(table, tuple(ops))


@dataclass(frozen=True, slots=True)
class _Placed:
    """One port-scoped grant, where its new elements go and where its held ones are."""

    grant: Grant
    new: Placement
    old: Placement
    changed: bool  # its port elements change (the held ones are replaced)


def _placed(g: Grant) -> _Placed:
    new = placement(g.scope.ports, g.shared)
    changed = g.held != g.scope.ports
    return _Placed(g, new, placement(g.held, g.shared) if changed else new, changed)


def _range_addr_ops(name: str, fam: str, placed: Sequence[_Placed], *, replace: bool) -> list[Op]:
    """The hash path's ops: the address of each grant whose ranges are its shared ranges.
    An address whose held ranges were there and whose new ones are not is added (so it
    exists: an expired element would make the delete fail with ENOENT and abort the
    transaction) and deleted; ``replace`` renews by add, delete, add like the dyn set."""
    gone: list[tuple[IPAddress, int]] = []
    add: list[tuple[IPAddress, int]] = []
    for p in placed:
        g = p.grant
        if p.old.hashed and (p.changed or replace):
            gone.append((g.ip, g.seconds))
        if p.new.hashed:
            add.append((g.ip, g.seconds))
    ops: list[Op] = []
    if gone:
        ops.append(AddTimed(name, fam, tuple(gone)))
        ops += [DeleteElement(name, ip) for ip, _ in gone]
    if add:
        ops.append(AddTimed(name, fam, tuple(add)))
    return ops


def _port_set_ops(name: str, fam: str, placed: Sequence[_Placed], *, replace: bool, exact: bool) -> list[Op]:
    """The port elements of one set: single ports in the hash set (``exact``), the ranges
    not on the hash path in the pipapo set."""
    gone: list[PortElem] = []
    gone_s: list[int] = []
    add: list[PortElem] = []
    add_s: list[int] = []
    for p in placed:
        g = p.grant
        new = _at(g.ip, p.new.single if exact else p.new.pipapo)
        if p.changed:
            old = _at(g.ip, p.old.single if exact else p.old.pipapo)
            gone += old
            gone_s += [g.seconds] * len(old)
        elif replace:
            gone += new
            gone_s += [g.seconds] * len(new)
        add += new
        add_s += [g.seconds] * len(new)
    ops: list[Op] = []
    if gone:
        ops += [
            AddPortElems(name, fam, tuple(gone), tuple(gone_s), exact=exact),
            DeletePortElems(name, fam, tuple(gone), exact=exact),
        ]
    if add:
        ops.append(AddPortElems(name, fam, tuple(add), tuple(add_s), exact=exact))
    return ops
