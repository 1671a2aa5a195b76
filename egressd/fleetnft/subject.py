"""A network subject's part of the fleet ruleset (docs/reference/behaviour.md §8.2, §8.5): its sets,
chains, counters and fixed rules, and the dispatch keys that point its source address at them.
Pure: returns netlink batches (and cache-free libnftables declarations).

A subject's rules are fixed for its lifetime (deny sets drop; allow and dyn sets mark ``0x2``),
except that its first audit policy adds the audit rules once (:func:`audit_objects`) and its
first policy with shared port ranges the range rules once (:func:`range_objects`); its state
lives only in its set contents (:mod:`egressd.fleetnft.contents`). Deny-first is "all its sets
empty": nothing is marked, so the unmarked-drop tail drops everything. ``defaultAction: allow``
is ``0.0.0.0/0`` and ``::/0`` in the allow sets. So activation, policy updates and reverts are
set-content swaps, never rule changes.
"""

from __future__ import annotations

from collections.abc import Iterable

from egressd.addr import IPAddress
from egressd.fleetnft.audit import audit_mark_rules
from egressd.fleetnft.table import (
    AUDIT_COUNTERS,
    AUDIT_PORT_SETS,
    AUDIT_SETS,
    CORE_SETS,
    DENIED_CHAIN,
    DYN_SETS,
    DYNP_SETS,
    DYNPX_SETS,
    DYNR_SETS,
    PORT_STATIC_SETS,
    SHARED_RANGE_SETS,
    Names,
    SubjectNft,
    TableConfig,
    _plain_set_decl,
    _port_map_decl,
    _Script,
    _vmap_decl,
    dispatch_map,
    drop_counter_map,
    gateway_set,
    marking_map,
    mitm_in_map,
    mitm_port_map,
    mitm_src_set,
    sandbox_set,
)
from egressd.kernel.ops import (
    AddChain,
    AddCounter,
    AddCounterRef,
    AddElements,
    AddJump,
    AddPort,
    AddRule,
    AddSet,
    DeleteChain,
    DeleteCounter,
    DeleteElement,
    DeleteSet,
    FlushChain,
    FlushSet,
    L4Guard,
    MatchRule,
    NetlinkBatch,
    Op,
    PortRule,
    RangeRule,
    Rule,
    RuleAction,
    VerdictRule,
)
from egressd.nftsyntax import (
    DYN_TIMEOUT_S,
    family,
    port_set_decl,
    set_decl,
    timeout_set_decl,
)
from egressd.subject.leases import port_elems_cap


def subject_worker_port(cfg: TableConfig, subj: SubjectNft) -> int:
    """The worker port of ``subj``; a worker the table has no port for is refused (ValueError)."""
    if not 0 <= subj.worker < cfg.mitm_workers:
        raise ValueError(f"MITM worker {subj.worker} does not exist ({cfg.mitm_workers} workers)")
    return cfg.mitm_port + subj.worker


def subject_sets(*, audit: bool, ranges: bool) -> tuple[str, ...]:
    """The kinds of set a subject has: the audit sets only once :func:`audit_objects` made
    them, the range sets only once :func:`range_objects` made them."""
    audit_sets = (*AUDIT_SETS, *AUDIT_PORT_SETS) if audit else ()
    range_sets = (*DYNR_SETS, *SHARED_RANGE_SETS) if ranges else ()
    return (*CORE_SETS, *audit_sets, *DYN_SETS, *PORT_STATIC_SETS, *DYNP_SETS, *DYNPX_SETS, *range_sets)


def subject_rules(cfg: TableConfig, nft_id: str, *, audit: bool = False, ranges: bool = False) -> NetlinkBatch:
    """The subject's fixed rules, added once when its chains are first created (the audit
    rules with its audit objects, :func:`audit_objects`; the range rules with its range
    objects, :func:`range_objects`).

    ``subj_<id>``: deny sets drop (address-only, then port-scoped). ``mark_<id>``: allow and dyn
    sets mark 0x2, each address-only then port-scoped (docs/reference/behaviour.md §18; with the name
    check on, the address-only dyn sets mark anything but UDP 443; ``ranges``: the hash path
    ``dynr`` . ``dynrports`` after ``dynpx``), then (``audit``) the audit
    rules, which match nothing while ``wdeny`` and ``audit`` are empty. ``subj_<id>_in``
    (MITM): IN(drop) of §8.2 on the conntrack original destination (and port); the
    intercepted path is never audited, so ``wdeny`` drops there like ``deny``.
    """
    n = Names(nft_id)
    ops: list[Op] = []
    for fam in ("v4", "v6"):
        ops.append(
            AddRule(n.chain, MatchRule(fam, n.set(f"deny_{fam}"), RuleAction.DROP, drop_chain=DENIED_CHAIN))
        )
    for fam in ("v4", "v6"):
        ops.append(
            AddRule(n.chain, PortRule(fam, n.set(f"denyp_{fam}"), RuleAction.DROP, drop_chain=DENIED_CHAIN))
        )
    ops += _mark_rules(n, audit=audit, ranges=ranges, name_check=cfg.checks_names)
    if cfg.mitm:
        ops += _in_rules(n, audit=audit, ranges=ranges)
    return NetlinkBatch(cfg.table, tuple(ops))


def _mark_rules(n: Names, *, audit: bool, ranges: bool, name_check: bool) -> list[Op]:
    ops: list[Op] = []
    for kind in ("allow", "dyn"):
        for fam in ("v4", "v6"):
            name = n.set(f"{kind}_{fam}")
            # QUIC has no name egressd can check: a learned address never opens UDP 443 by
            # itself (§18); an explicit udp rule puts the lease's UDP 443 in dynp.
            guards = (L4Guard.NOT_UDP, L4Guard.UDP_NOT_443) if kind == "dyn" and name_check else (L4Guard.NONE,)
            ops += [AddRule(n.mark_chain, MatchRule(fam, name, RuleAction.MARK, guard=g)) for g in guards]
        for fam in ("v4", "v6"):
            ops.append(AddRule(n.mark_chain, PortRule(fam, n.set(f"{kind}p_{fam}"), RuleAction.MARK)))
        if kind == "dyn":
            for fam in ("v4", "v6"):
                ops.append(AddRule(n.mark_chain, PortRule(fam, n.set(f"dynpx_{fam}"), RuleAction.MARK, exact=True)))
            for fam in ("v4", "v6") if ranges else ():
                hashed = RangeRule(fam, n.set(f"dynr_{fam}"), n.set(f"dynrports_{fam}"), RuleAction.MARK)
                ops.append(AddRule(n.mark_chain, hashed))
    if not audit:
        return ops
    return ops + audit_mark_rules(n)


def _in_rules(n: Names, *, audit: bool, ranges: bool) -> list[Op]:
    in_rules = (
        ("deny", RuleAction.DROP),
        ("denyp", RuleAction.DROP),
        *((("wdeny", RuleAction.DROP), ("wdenyp", RuleAction.DROP)) if audit else ()),
        ("dyn", RuleAction.ACCEPT),
        ("dynp", RuleAction.ACCEPT),
        ("dynpx", RuleAction.ACCEPT),
        *((("dynr", RuleAction.ACCEPT),) if ranges else ()),
        ("allow", RuleAction.ACCEPT),
        ("allowp", RuleAction.ACCEPT),
    )
    ops: list[Op] = []
    for kind, outcome in in_rules:
        via = DENIED_CHAIN if outcome is RuleAction.DROP else ""
        for fam in ("v4", "v6"):
            name = n.set(f"{kind}_{fam}")
            if kind == "dynr":
                rule: Rule = RangeRule(fam, name, n.set(f"dynrports_{fam}"), outcome, ct_original=True)
            elif kind.endswith(("p", "px")):
                exact = kind == "dynpx"
                rule = PortRule(fam, name, outcome, ct_original=True, drop_chain=via, exact=exact)
            else:
                rule = MatchRule(fam, name, outcome, ct_original=True, drop_chain=via)
            ops.append(AddRule(n.in_chain, rule))
    ops.append(AddRule(n.in_chain, VerdictRule(RuleAction.DROP, drop_chain=DENIED_CHAIN)))
    return ops


def lazy_objects(
    cfg: TableConfig, nft_id: str, *, audit: bool, ranges: bool, make_audit: bool, make_ranges: bool
) -> NetlinkBatch:
    """The objects a subject gains with its first policy that needs them, for the caller's
    transaction (nothing when neither ``make_*``): audit mode's ``wdeny``, ``wdenyp`` and
    ``audit`` sets (``make_audit``) and the hash path's ``dynr`` and ``dynrports`` sets
    (``make_ranges``), all empty, and ``mark_<id>`` (and ``subj_<id>_in``) rebuilt with the
    rules of every object it then has (``audit`` / ``ranges``: it had them already). The
    chains are emptied and refilled in the same atomic batch, so no packet ever meets a chain
    without its allow/deny rules; the sets are declared (a no-op when present) before any rule
    names them. Both kinds are lazy because the kernel finds a set by name by walking the
    table's sets: every set a subject does not need slows every transaction of the fleet."""
    if not make_audit and not make_ranges:
        return NetlinkBatch(cfg.table)
    n = Names(nft_id)
    ops: list[Op] = []
    if make_audit:
        ops += [AddSet(n.set(kind), kind[-2:], "interval") for kind in AUDIT_SETS]
        ops += [AddSet(n.set(kind), kind[-2:], "interval", ports=True) for kind in AUDIT_PORT_SETS]
    if make_ranges:
        ops += _range_sets(cfg, n)
    audit, ranges = audit or make_audit, ranges or make_ranges
    ops.append(FlushChain(n.mark_chain))
    ops += _mark_rules(n, audit=audit, ranges=ranges, name_check=cfg.checks_names)
    if cfg.mitm:
        ops.append(FlushChain(n.in_chain))
        ops += _in_rules(n, audit=audit, ranges=ranges)
    return NetlinkBatch(cfg.table, tuple(ops))


def audit_objects(cfg: TableConfig, nft_id: str, *, ranges: bool = False) -> NetlinkBatch:
    """Audit mode's objects for a subject that has none yet (``ranges``: it has its range
    objects), see :func:`lazy_objects`."""
    return lazy_objects(cfg, nft_id, audit=False, ranges=ranges, make_audit=True, make_ranges=False)


def range_objects(cfg: TableConfig, nft_id: str, *, audit: bool = False) -> NetlinkBatch:
    """The hash path's objects (egressd.subject.ranges) for a subject that has none yet
    (``audit``: it has its audit objects), see :func:`lazy_objects`."""
    return lazy_objects(cfg, nft_id, audit=audit, ranges=False, make_audit=False, make_ranges=True)


def _range_sets(cfg: TableConfig, n: Names) -> list[Op]:
    ops: list[Op] = [
        AddSet(n.set(kind), kind[-2:], "timeout", DYN_TIMEOUT_S, size=cfg.max_leases) for kind in DYNR_SETS
    ]
    ops += [AddSet(n.set(kind), kind[-2:], "interval", services=True) for kind in SHARED_RANGE_SETS]
    return ops


def rules_per_subject(cfg: TableConfig, *, audit: bool = False, ranges: bool = False) -> int:
    """How many rules one installed subject adds to the table: its fixed rules (with the audit
    and range rules once it has them), counted from :func:`subject_rules` itself so the metric
    can never drift from what is installed."""
    return len(subject_rules(cfg, "0", audit=audit, ranges=ranges).ops)


def subject_keys(cfg: TableConfig, subj: SubjectNft) -> NetlinkBatch:
    """Point the subject's source IP (and gateway) at its chains (idempotent)."""
    n = Names(subj.nft_id)
    fam = family(subj.ip)
    ops: list[Op] = [
        # First: the counter exists before the dispatch jump can send a packet to a drop.
        AddCounterRef(drop_counter_map(fam), subj.ip, n.dropped_counter),
        AddJump(dispatch_map(fam), subj.ip, n.chain),
        AddElements(sandbox_set(fam), (subj.ip,)),
        AddJump(marking_map(fam), subj.ip, n.mark_chain),
        AddElements(gateway_set(family(subj.gateway)), (subj.gateway,)),
    ]
    if cfg.mitm:
        ops += [
            AddPort(mitm_port_map(fam), subj.ip, subject_worker_port(cfg, subj)),
            AddJump(mitm_in_map(fam), subj.ip, n.in_chain),
            AddElements(mitm_src_set(fam), (subj.ip,)),
        ]
    return NetlinkBatch(cfg.table, tuple(ops))


def subject_create(cfg: TableConfig, subj: SubjectNft) -> NetlinkBatch:
    """A new subject in ONE atomic batch: sets, chains, fixed rules, then its dispatch keys.

    All of it or nothing lands, so a subject never exists half made; nothing in it goes
    through libnftables (no cache fill), and the table is validated once.
    """
    if cfg.mitm and subj.gateway.version != subj.ip.version:
        raise ValueError("gateway and sandbox ip are of different address families")
    return subject_objects(cfg, subj.nft_id) + subject_rules(cfg, subj.nft_id) + subject_keys(cfg, subj)


def subject_chains(cfg: TableConfig, nft_id: str) -> list[str]:
    n = Names(nft_id)
    return [n.chain, n.mark_chain] + ([n.in_chain] if cfg.mitm else [])


def subject_objects(cfg: TableConfig, nft_id: str, *, audit: bool = False, ranges: bool = False) -> NetlinkBatch:
    """Declare the subject's sets, chains and counters (each a no-op when it exists); the
    audit sets only with ``audit``, the range sets only with ``ranges``."""
    n = Names(nft_id)
    kinds = CORE_SETS + (AUDIT_SETS if audit else ())
    ops: list[Op] = [AddSet(n.set(kind), kind[-2:], "interval") for kind in kinds]
    ops += [
        AddSet(n.set(f"dyn_{fam}"), fam, "timeout", DYN_TIMEOUT_S, size=cfg.max_leases)
        for fam in ("v4", "v6")
    ]
    port_kinds = PORT_STATIC_SETS + (AUDIT_PORT_SETS if audit else ())
    ops += [AddSet(n.set(kind), kind[-2:], "interval", ports=True) for kind in port_kinds]
    ops += [
        AddSet(n.set(kind), kind[-2:], "timeout", DYN_TIMEOUT_S, size=port_elems_cap(cfg.max_leases), ports=True)
        for kind in DYNP_SETS
    ]
    ops += [
        AddSet(
            n.set(kind),
            kind[-2:],
            "timeout",
            DYN_TIMEOUT_S,
            size=port_elems_cap(cfg.max_leases),
            ports=True,
            exact=True,
        )
        for kind in DYNPX_SETS
    ]
    if ranges:
        ops += _range_sets(cfg, n)
    ops += [AddChain(c) for c in subject_chains(cfg, nft_id)]
    ops += [AddCounter(n.counter(kind)) for kind in AUDIT_COUNTERS]
    ops.append(AddCounter(n.dropped_counter))
    return NetlinkBatch(cfg.table, tuple(ops))


def subject_resync(
    cfg: TableConfig,
    nft_id: str,
    keys: Iterable[SubjectNft],
    contents: NetlinkBatch,
    *,
    audit: bool,
    ranges: bool,
) -> NetlinkBatch:
    """Make the kernel hold exactly one state of a subject whichever of two states it holds
    now (after a transaction whose answer never came): every object declared (no-op when
    present), its chains emptied and given their fixed rules once, ``contents`` (flushes and
    refills of all its sets), and every one of ``keys``. Each part succeeds on both states,
    so the caller's own operations can follow in the same transaction. ``audit`` / ``ranges``:
    either state may have the audit / range objects; both then end with them."""
    ops: list[Op] = [FlushChain(c) for c in subject_chains(cfg, nft_id)]
    out = subject_objects(cfg, nft_id, audit=audit, ranges=ranges) + NetlinkBatch(cfg.table, tuple(ops))
    out = out + subject_rules(cfg, nft_id, audit=audit, ranges=ranges)
    out = out + contents
    for subj in keys:
        out = out + subject_keys(cfg, subj)
    return out


def subject_objects_script(cfg: TableConfig, subj: SubjectNft) -> str:
    """Declare the subject's sets and chains (no-op when they exist) and point its keys at them.

    Contains no rules and no flushes, so libnftables runs it without a cache fill. Callers
    empty the sets first when the subject already had content (revert, rebind).
    """
    if cfg.mitm and subj.gateway.version != subj.ip.version:
        raise ValueError("gateway and sandbox ip are of different address families")
    s = _Script(cfg.table)
    n = Names(subj.nft_id)
    for kind in CORE_SETS:
        s.obj("add", "set", set_decl(n.set(kind), kind[-2:], "interval"))
    for fam in ("v4", "v6"):
        s.obj("add", "set", timeout_set_decl(n.set(f"dyn_{fam}"), fam, cfg.max_leases))
    for kind in PORT_STATIC_SETS:
        s.obj("add", "set", port_set_decl(n.set(kind), kind[-2:], 0))
    for kind in DYNP_SETS:
        s.obj("add", "set", port_set_decl(n.set(kind), kind[-2:], port_elems_cap(cfg.max_leases), timed=True))
    for kind in DYNPX_SETS:
        decl = port_set_decl(n.set(kind), kind[-2:], port_elems_cap(cfg.max_leases), timed=True, exact=True)
        s.obj("add", "set", decl)
    s.obj("add", "chain", n.chain)
    s.obj("add", "chain", n.mark_chain)
    if cfg.mitm:
        s.obj("add", "chain", n.in_chain)
    for kind in AUDIT_COUNTERS:
        s.obj("add", "counter", n.counter(kind))
    _dispatch_entries(s, cfg, subj)
    return s.text()


def flush_subject_sets(table: str, nft_id: str, *, audit: bool, ranges: bool) -> NetlinkBatch:
    """Deny-first content: every set of the subject empty (leases included, so a rebind never
    keeps them); ``audit``: it has the audit sets, which must be emptied too (``audit`` holds
    0.0.0.0/0 while auditing); ``ranges``: it has the range sets (emptied too; without them a
    flush of one would fail the whole transaction)."""
    n = Names(nft_id)
    kinds = subject_sets(audit=audit, ranges=ranges)
    return NetlinkBatch(table, tuple(FlushSet(n.set(kind)) for kind in kinds))


def dispatch_entries(cfg: TableConfig, subj: SubjectNft) -> str:
    """Re-declarations that point the subject's source IP (and gateway) at its chains."""
    s = _Script(cfg.table)
    _dispatch_entries(s, cfg, subj)
    return s.text()


def _dispatch_entries(s: _Script, cfg: TableConfig, subj: SubjectNft) -> None:
    n = Names(subj.nft_id)
    fam = family(subj.ip)
    ip = str(subj.ip)
    s.obj("add", "map", _vmap_decl(dispatch_map(fam), fam, [f"{ip} : jump {n.chain}"]))
    s.obj("add", "set", _plain_set_decl(sandbox_set(fam), fam, [ip]))
    s.obj("add", "map", _vmap_decl(marking_map(fam), fam, [f"{ip} : jump {n.mark_chain}"]))
    gfam = family(subj.gateway)
    s.obj("add", "set", _plain_set_decl(gateway_set(gfam), gfam, [str(subj.gateway)]))
    if cfg.mitm:
        port = subject_worker_port(cfg, subj)
        s.obj("add", "map", _port_map_decl(mitm_port_map(fam), fam, [f"{ip} : {port}"]))
        s.obj("add", "map", _vmap_decl(mitm_in_map(fam), fam, [f"{ip} : jump {n.in_chain}"]))
        s.obj("add", "set", _plain_set_decl(mitm_src_set(fam), fam, [ip]))


def gateway_release(gateway: IPAddress) -> DeleteElement:
    return DeleteElement(gateway_set(family(gateway)), gateway)


def dispatch_deletes(cfg: TableConfig, ip: IPAddress, *, release_gateway: IPAddress | None) -> list[Op]:
    """Remove a source IP from every dispatch map (and, when unused, its gateway)."""
    fam = family(ip)
    maps = [marking_map(fam), dispatch_map(fam), sandbox_set(fam)]
    if cfg.mitm:
        # The source leaves mitm_src before its port: never intercepted without a worker port
        # (and within one transaction either order is atomic anyway).
        maps += [mitm_src_set(fam), mitm_in_map(fam), mitm_port_map(fam)]
    maps.append(drop_counter_map(fam))  # last: the counter outlives every way a packet reaches a drop
    ops: list[Op] = [DeleteElement(m, ip) for m in maps]
    if release_gateway is not None:
        ops.append(gateway_release(release_gateway))
    return ops


def removal_batch(
    cfg: TableConfig,
    nft_id: str,
    ip: IPAddress | None,
    *,
    release_gateway: IPAddress | None,
    audit: bool,
    ranges: bool,
) -> NetlinkBatch:
    """§8.5 without the rebuild: one atomic batch dropping exactly this subject's objects.

    Map entries go first (they reference the chains), then chains (their rules reference
    the sets and counters), then sets and counters. Other subjects' objects and leases are untouched.
    """
    n = Names(nft_id)
    ops: list[Op] = []
    if ip is not None:
        ops += dispatch_deletes(cfg, ip, release_gateway=release_gateway)
    ops += [DeleteChain(c) for c in subject_chains(cfg, nft_id)]
    ops += [DeleteSet(n.set(kind)) for kind in subject_sets(audit=audit, ranges=ranges)]
    ops += [DeleteCounter(n.counter(kind)) for kind in AUDIT_COUNTERS]
    ops.append(DeleteCounter(n.dropped_counter))
    return NetlinkBatch(cfg.table, tuple(ops))
