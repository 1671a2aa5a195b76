"""The hash path for DNS leases' port ranges (docs/concepts/ruleset.md, "port-scoped sets";
egressd.subject.ranges): which ranges a subject shares, which lease takes the hash path, and
the kernel steps of both profiles that hold them (fleet netlink batches, sidecar script)."""

from __future__ import annotations

import ipaddress
from dataclasses import replace

import pytest

from egressd.fleetnft.contents import (
    contents_swap,
    dyn_add,
    dyn_replace,
    needs_range_objects,
    policy_swap,
    static_contents,
)
from egressd.fleetnft.subject import (
    audit_objects,
    flush_subject_sets,
    lazy_objects,
    range_objects,
    removal_batch,
    subject_resync,
    subject_rules,
)
from egressd.fleetnft.table import TableConfig
from egressd.kernel.ops import (
    AddPortElems,
    AddRule,
    AddSet,
    AddTimed,
    DeleteElement,
    DeletePortElems,
    FlushChain,
    FlushSet,
)
from egressd.policy import NetworkPolicy, ip_sets, parse_policy
from egressd.policy.scope import Scope
from egressd.sidecarnft.ruleset import SidecarTable, ruleset
from egressd.sidecarnft.ruleset import dyn_add as sidecar_dyn_add
from egressd.subject.leases import LeaseBook, admissible, narrowed_for
from egressd.subject.ranges import on_hash_path, pipapo_elements, range_part, shared_ranges, single_elements

NOW = 1000.0
CDN = ipaddress.ip_address("93.184.216.34")
OTHER = ipaddress.ip_address("93.184.216.35")
NET = ipaddress.ip_network("93.184.216.34/32")
R8K = Scope.of(tcp=[(8000, 8999)])
#: The shared scope of P_RANGE with the name check on: its single port and its range.
SHARED_P = Scope.of(tcp=[(443, 443), (8000, 8999)])


def pol(*rules: str, default: str = "deny") -> NetworkPolicy:
    return parse_policy(f'{{"defaultAction":"{default}","egress":[{",".join(rules)}]}}')


P_RANGE = '{"action":"allow","target":"*.p.test","protocol":"tcp","ports":[443,"8000-8999"]}'
P_BOTH = '{"action":"allow","target":"*.p.test","ports":[443,"8000-8999"]}'
Q_RANGE = '{"action":"allow","target":"q.test","protocol":"tcp","ports":["7000-7001"]}'


# ---- the pure decision ---------------------------------------------------------------------------


def test_no_domain_rule_with_ranges_shares_nothing() -> None:
    assert shared_ranges(pol(), name_check=True) == Scope.EMPTY
    singles = pol('{"action":"allow","target":"a.test","ports":[443, 80]}', '{"action":"allow","target":"b.test"}')
    assert shared_ranges(singles, name_check=False) == Scope.EMPTY
    # Address rules and deny rules never choose the shared ranges.
    addr = pol('{"action":"allow","target":"10.0.0.0/8","protocol":"tcp","ports":["1-9"]}')
    assert shared_ranges(addr, name_check=False) == Scope.EMPTY
    deny = pol('{"action":"deny","target":"d.test","protocol":"tcp","ports":["1-9"]}')
    assert shared_ranges(deny, name_check=False) == Scope.EMPTY
    assert not on_hash_path(Scope.of(tcp=[(1, 9)]), Scope.EMPTY)


def test_the_first_ranged_domain_allow_rule_gives_the_shared_scope_its_single_ports_too() -> None:
    # A rule of single ports only has no range: the first rule with one gives its whole scope.
    p = pol('{"action":"allow","target":"a.test","ports":[443]}', P_RANGE, Q_RANGE)
    assert shared_ranges(p, name_check=True) == SHARED_P
    # Without a protocol the rule names TCP and UDP: both protocols' ports are shared.
    both = shared_ranges(pol(P_BOTH), name_check=False)
    assert both == Scope.of(tcp=[(443, 443), (8000, 8999)], udp=[(443, 443), (8000, 8999)])
    assert range_part(SHARED_P) == R8K


def test_the_name_check_cuts_udp_443_from_the_shared_ranges_like_from_a_lease() -> None:
    udp = '{"action":"allow","target":"u.test","ports":["400-500"]}'
    cut = Scope.of(tcp=[(400, 500)], udp=[(400, 442), (444, 500)])
    assert shared_ranges(pol(udp), name_check=True) == cut
    assert shared_ranges(pol(udp), name_check=False) == Scope.of(tcp=[(400, 500)], udp=[(400, 500)])
    # An explicit udp rule keeps its UDP 443.
    explicit = '{"action":"allow","target":"u.test","protocol":"udp","ports":["400-500"]}'
    assert shared_ranges(pol(explicit), name_check=True) == Scope.of(udp=[(400, 500)])
    # And a lease decided by that rule alone takes the hash path (the same cut).
    book = LeaseBook()
    (g,) = admissible(book, pol(udp), [(CDN, 60)], "u.test", NOW, name_check=True)
    assert g.shared == cut and on_hash_path(g.scope.ports, g.shared)


def test_which_set_holds_what() -> None:
    # Exactly the shared scope: the address alone in dynr, nothing in dynpx or dynp.
    ports = Scope.of(tcp=[(443, 443), (8000, 8999)])
    assert on_hash_path(ports, SHARED_P)
    assert pipapo_elements(ports, SHARED_P) == () and single_elements(ports, SHARED_P) == ()
    assert single_elements(ports) == (("tcp", 443, 443),)
    other = Scope.of(tcp=[(7000, 7001)])
    assert not on_hash_path(other, SHARED_P) and pipapo_elements(other, SHARED_P) == (("tcp", 7000, 7001),)
    # More than the shared scope, or only part of it: single ports in dynpx, ranges in pipapo.
    wider = Scope.of(tcp=[(7000, 7001), (8000, 8999)])
    assert not on_hash_path(wider, SHARED_P) and len(pipapo_elements(wider, SHARED_P)) == 2
    assert not on_hash_path(Scope.of(tcp=[(443, 443), (8000, 8099)]), SHARED_P)
    # The shared ranges without its single port: an address in dynr would open 443 too.
    assert not on_hash_path(R8K, SHARED_P) and pipapo_elements(R8K, SHARED_P) == (("tcp", 8000, 8999),)
    # The same ranges with another single port: that port in dynpx, the range in pipapo.
    other_single = Scope.of(tcp=[(80, 80), (8000, 8999)])
    assert not on_hash_path(other_single, SHARED_P)
    assert single_elements(other_single, SHARED_P) == (("tcp", 80, 80),)
    assert pipapo_elements(other_single, SHARED_P) == (("tcp", 8000, 8999),)


def test_a_name_with_only_the_shared_ranges_never_opens_the_shared_single_port() -> None:
    """A second rule with the first one's range and not its single port: its leases stay off
    the hash path (dynrports holds 443 as well), their range in pipapo, 443 nowhere."""
    p = pol(P_RANGE, '{"action":"allow","target":"r.test","protocol":"tcp","ports":["8000-8999"]}')
    (g,) = admissible(LeaseBook(), p, [(OTHER, 60)], "r.test", NOW, name_check=True)
    assert g.shared == SHARED_P and g.scope.ports == R8K and not on_hash_path(g.scope.ports, g.shared)
    other = ipaddress.ip_network("93.184.216.35/32")
    assert dyn_add("T", "s", [g]).ops == (AddPortElems("subj_s_dynp_v4", "v4", ((other, "tcp", 8000, 8999),), (60,)),)


def test_overlapping_rules_cut_by_first_match_give_a_lease_its_own_ranges() -> None:
    # An earlier deny of 8500-8599 cuts the name's range: its lease is not the shared ranges.
    p = pol(
        '{"action":"deny","target":"a.p.test","protocol":"tcp","ports":["8500-8599"]}',
        P_RANGE,
    )
    book = LeaseBook()
    (g,) = admissible(book, p, [(CDN, 60)], "a.p.test", NOW, name_check=True)
    assert g.scope.ports == Scope.of(tcp=[(443, 443), (8000, 8499), (8600, 8999)])
    assert not on_hash_path(g.scope.ports, g.shared)
    (h,) = admissible(book, p, [(OTHER, 60)], "b.p.test", NOW, name_check=True)
    assert on_hash_path(h.scope.ports, h.shared)


# ---- fleet batches ---------------------------------------------------------------------------------


def test_two_rules_with_different_ranges_one_hash_path_one_pipapo() -> None:
    p = pol(P_RANGE, Q_RANGE)
    book = LeaseBook()
    on_hash = admissible(book, p, [(CDN, 60)], "a.p.test", NOW, name_check=True)
    in_pipapo = admissible(book, p, [(OTHER, 90)], "q.test", NOW, name_check=True)
    batch = dyn_add("T", "s", [*on_hash, *in_pipapo])
    other = ipaddress.ip_network("93.184.216.35/32")
    # The hash path's lease is one element in one set, as an address-only lease in dyn.
    assert batch.ops == (
        AddPortElems("subj_s_dynp_v4", "v4", ((other, "tcp", 7000, 7001),), (90,)),
        AddTimed("subj_s_dynr_v4", "v4", ((CDN, 60),)),
    )
    assert dyn_add("T", "s", on_hash).ops == (AddTimed("subj_s_dynr_v4", "v4", ((CDN, 60),)),)
    # The shared scope goes with the policy, in both families' sets.
    contents = dict(static_contents(p, name_check=True))
    assert contents["dynrports_v4"] == contents["dynrports_v6"] == (("tcp", 443, 443), ("tcp", 8000, 8999))


def test_a_lease_leaving_the_hash_path_deletes_its_address_there_added_first() -> None:
    p = pol(P_RANGE)
    book = LeaseBook()
    first = admissible(book, p, [(CDN, 60)], "b.p.test", NOW, name_check=True)
    book.record(first, "b.p.test", NOW)
    assert dyn_add("T", "s", first).ops[-1] == AddTimed("subj_s_dynr_v4", "v4", ((CDN, 60),))
    # A refresh: the same scope, its address re-added on the hash path, nothing deleted.
    renew = admissible(book, p, [(CDN, 60)], None, NOW, name_check=True)
    assert [type(op) for op in dyn_add("T", "s", renew).ops] == [AddTimed]
    # A second name with other ranges widens the lease off the hash path: its address is added
    # (so it exists) and deleted from dynr, its single port goes to dynpx, its ranges to pipapo
    # (it held none there: nothing deleted in either).
    q = pol(P_RANGE, Q_RANGE)
    wider = admissible(book, q, [(CDN, 90)], "q.test", NOW, name_check=True)
    ops = dyn_add("T", "s", wider).ops
    assert AddTimed("subj_s_dynr_v4", "v4", ((CDN, 90),)) in ops
    add_at = ops.index(AddTimed("subj_s_dynr_v4", "v4", ((CDN, 90),)))
    assert ops[add_at + 1] == DeleteElement("subj_s_dynr_v4", CDN)
    assert ops[add_at + 2 :] == ()  # not re-added
    pipapo = [op for op in ops if isinstance(op, AddPortElems) and op.name == "subj_s_dynp_v4"]
    assert pipapo and {e[2:] for op in pipapo for e in op.elems} >= {(7000, 7001), (8000, 8999)}
    assert not any(isinstance(op, DeletePortElems) for op in ops)
    assert AddPortElems("subj_s_dynpx_v4", "v4", ((NET, "tcp", 443, 443),), (90,), exact=True) in ops


def test_renew_by_replace_renews_a_hash_path_address_by_add_delete_add() -> None:
    p = pol(P_RANGE)
    book = LeaseBook()
    first = admissible(book, p, [(CDN, 60)], "b.p.test", NOW, name_check=True)
    book.record(first, "b.p.test", NOW)
    again = admissible(book, p, [(CDN, 60)], "b.p.test", NOW, name_check=True)
    ops = [op for op in dyn_add("T", "s", again, replace=True).ops if getattr(op, "name", "") == "subj_s_dynr_v4"]
    assert ops == [
        AddTimed("subj_s_dynr_v4", "v4", ((CDN, 60),)),
        DeleteElement("subj_s_dynr_v4", CDN),
        AddTimed("subj_s_dynr_v4", "v4", ((CDN, 60),)),
    ]


def test_a_change_of_the_shared_ranges_is_a_rewrite_of_every_lease() -> None:
    p = pol(P_RANGE)
    book = LeaseBook()
    book.record(admissible(book, p, [(CDN, 60)], "a.p.test", NOW, name_check=True), "a.p.test", NOW)
    assert book.shared == SHARED_P
    same = narrowed_for(book, p, (), (), NOW, name_check=True)
    assert same.intact
    # 8000-8999 -> 8000-8099: the lease narrows anyway; the kept grant carries the new ranges.
    narrower = pol('{"action":"allow","target":"*.p.test","protocol":"tcp","ports":[443,"8000-8099"]}')
    out = narrowed_for(book, narrower, (), (), NOW, name_check=True)
    assert not out.intact and out.book.shared == Scope.of(tcp=[(443, 443), (8000, 8099)])
    batch = dyn_replace("T", "s", out.kept, ranges=True)
    flushed = [op.name for op in batch.ops if isinstance(op, FlushSet)]
    assert {"subj_s_dynr_v4", "subj_s_dynr_v6", "subj_s_dynp_v4", "subj_s_dynpx_v4"} <= set(flushed)
    assert batch.ops[-1] == AddTimed("subj_s_dynr_v4", "v4", ((CDN, 60),))
    # The shared ranges change while no lease's scope does (a second ranged rule first):
    # still not intact, so the dyn sets are rewritten with the static swap.
    moved = pol(Q_RANGE, P_RANGE)
    out2 = narrowed_for(book, moved, (), (), NOW, name_check=True)
    assert out2.kept[0].scope == book.scope_of(CDN, NOW) and not out2.intact
    batch2 = dyn_replace("T", "s", out2.kept, ranges=True)
    assert not any(isinstance(op, AddTimed) and op.name == "subj_s_dynr_v4" for op in batch2.ops)
    assert any(isinstance(op, AddPortElems) and op.name == "subj_s_dynp_v4" for op in batch2.ops)
    sets = ip_sets(moved)
    assert narrowed_for(out2.book, moved, sets.deny_v4, sets.deny_v6, NOW, name_check=True).intact


def test_a_change_of_the_shared_single_ports_alone_is_a_rewrite_too() -> None:
    """dynrports holds the shared scope's single ports as well: a policy that moves only them
    (443 -> 8443, same range) rewrites every lease, none keeps its address in dynr under
    ranges that now open 8443."""
    book = LeaseBook()
    book.record(admissible(book, pol(P_RANGE), [(CDN, 60)], "a.p.test", NOW, name_check=True), "a.p.test", NOW)
    moved = pol('{"action":"allow","target":"*.p.test","protocol":"tcp","ports":[8443,"8000-8999"]}')
    out = narrowed_for(book, moved, (), (), NOW, name_check=True)
    assert not out.intact and out.book.shared == Scope.of(tcp=[(8000, 8999)]).union(Scope.of(tcp=[(8443, 8443)]))
    (kept,) = out.kept
    assert kept.shared == out.book.shared and on_hash_path(kept.scope.ports, kept.shared)
    flushed = [op.name for op in dyn_replace("T", "s", out.kept, ranges=True).ops if isinstance(op, FlushSet)]
    assert "subj_s_dynr_v4" in flushed


# ---- sidecar --------------------------------------------------------------------------------------


def test_the_sidecar_renders_the_same_layout() -> None:
    cfg = SidecarTable(table="t", mitm_port=None, name_check=True)
    p = pol(P_RANGE, Q_RANGE)
    book = LeaseBook()
    grants = [
        *admissible(book, p, [(CDN, 60)], "a.p.test", NOW, name_check=True),
        *admissible(book, p, [(OTHER, 90)], "q.test", NOW, name_check=True),
    ]
    text = ruleset(cfg, p, grants)
    assert "add set inet t dyn_allowrports_v4 { type inet_proto . inet_service; flags interval; " \
        "elements = { tcp . 443, tcp . 8000-8999 }; }" in text
    assert "add set inet t dyn_allowr_v4 { type ipv4_addr; flags timeout; timeout 360s; size 4096; " \
        "elements = { 93.184.216.34 timeout 60s expires 60s } }" in text
    assert "93.184.216.35 . tcp . 7000-7001" in text and "93.184.216.34 . tcp . 8000-8999" not in text
    assert "93.184.216.34 . tcp . 443" not in text
    assert "ip daddr @dyn_allowr_v4 meta l4proto . th dport @dyn_allowrports_v4 accept" in text
    assert "ip6 daddr @dyn_allowr_v6 meta l4proto . th dport @dyn_allowrports_v6 accept" in text
    # The learn path: the address into dyn_allowr, the other lease's range into pipapo.
    script = sidecar_dyn_add(cfg, grants)
    assert "dyn_allowr_v4 { type ipv4_addr; flags timeout; timeout 360s; size 4096; elements = { 93.184.216.34" in script
    assert "93.184.216.35 . tcp . 7000-7001" in script
    assert "93.184.216.34 . tcp . 8000-8999" not in script and "93.184.216.34 . tcp . 443" not in script
    # No ranged rule: no hash path at all, neither sets nor rules (the table is rebuilt with
    # every policy, so a later ranged policy brings them; the learn path names none either).
    single = pol('{"action":"allow","target":"a.test","ports":[443]}')
    empty = ruleset(cfg, single, admissible(LeaseBook(), single, [(CDN, 60)], "a.test", NOW, name_check=True))
    assert "dyn_allowr" not in empty
    assert "dyn_allowr" not in sidecar_dyn_add(cfg, admissible(LeaseBook(), single, [(CDN, 60)], "a.test", NOW, name_check=True))
    assert "dyn_allowr" not in ruleset(replace(cfg, mitm_port=8443), single)


# ---- fleet: the range objects are lazy (egressd.fleetnft.subject.range_objects) ------------------


def test_without_range_objects_no_step_names_a_range_set() -> None:
    """A flush of (or an add to) a set that does not exist fails the whole transaction: a
    subject whose policies never had shared ranges has none, and nothing names them."""
    single = pol('{"action":"allow","target":"a.test","ports":[443]}')
    book = LeaseBook()
    grants = admissible(book, single, [(CDN, 60)], "a.test", NOW, name_check=True)
    book.record(grants, "a.test", NOW)
    assert not needs_range_objects(static_contents(single, name_check=True))
    swap = policy_swap("T", "s", single, audit_objects=False, name_check=True)
    out = narrowed_for(book, single, (), (), NOW, name_check=True)
    for batch in (
        swap,
        dyn_add("T", "s", grants),
        dyn_replace("T", "s", out.kept, ranges=False),
        dyn_replace("T", "s", (), ranges=False),
        contents_swap("T", "s", static_contents(single, name_check=True), audit_objects=False, range_objects=False),
        flush_subject_sets("T", "s", audit=True, ranges=False),
        removal_batch(TableConfig(table="T"), "s", None, release_gateway=None, audit=False, ranges=False),
        subject_resync(TableConfig(table="T", mitm=True), "s", (), swap, audit=True, ranges=False),
        subject_rules(TableConfig(table="T", mitm=True), "s", audit=True),
        audit_objects(TableConfig(table="T", mitm=True), "s"),
    ):
        assert "dynr" not in batch.describe(), batch.describe()
    # With them, the same steps empty them.
    assert "flush set inet T subj_s_dynr_v4" in dyn_replace("T", "s", out.kept, ranges=True).describe()
    assert "flush set inet T subj_s_dynrports_v4" in flush_subject_sets("T", "s", audit=False, ranges=True).describe()


def test_a_ranged_policy_needs_the_range_objects() -> None:
    p = pol(P_RANGE)
    contents = static_contents(p, name_check=True)
    assert needs_range_objects(contents)
    with pytest.raises(ValueError, match="range objects"):
        contents_swap("T", "s", contents, audit_objects=False, range_objects=False)
    with pytest.raises(ValueError, match="range objects"):
        policy_swap("T", "s", p, audit_objects=False, name_check=True)
    book = LeaseBook()
    grants = admissible(book, p, [(CDN, 60)], "a.p.test", NOW, name_check=True)
    with pytest.raises(ValueError, match="range objects"):
        dyn_replace("T", "s", grants, ranges=False)
    text = contents_swap("T", "s", contents, audit_objects=False, range_objects=True).describe()
    assert "add element inet T subj_s_dynrports_v4 { tcp . 443, tcp . 8000-8999 }" in text


def test_range_objects_rebuild_the_chains_with_every_rule_once_in_order() -> None:
    for mitm in (False, True):
        cfg = TableConfig(table="T", mitm=mitm)
        chains = ["mark_s"] + (["subj_s_in"] if mitm else [])
        for audit in (False, True):
            batch = range_objects(cfg, "s", audit=audit)
            declared = [op.name for op in batch.ops if isinstance(op, AddSet)]
            assert declared == ["subj_s_dynr_v4", "subj_s_dynr_v6", "subj_s_dynrports_v4", "subj_s_dynrports_v6"]
            full = subject_rules(cfg, "s", audit=audit, ranges=True)
            for chain in chains:
                mine = [op for op in batch.ops if getattr(op, "chain", None) == chain or op == FlushChain(chain)]
                assert mine[0] == FlushChain(chain)
                assert mine[1:] == [op for op in full.ops if isinstance(op, AddRule) and op.chain == chain]
            assert not [op for op in batch.ops if getattr(op, "chain", None) == "subj_s"]
            # The audit objects after the range objects end in the same chains as the reverse.
            after = audit_objects(cfg, "s", ranges=True)
            both = lazy_objects(cfg, "s", audit=False, ranges=False, make_audit=True, make_ranges=True)
            rules = [op for op in after.ops if isinstance(op, AddRule)]
            assert rules == [op for op in both.ops if isinstance(op, AddRule)]
            assert rules == [op for op in subject_rules(cfg, "s", audit=True, ranges=True).ops if isinstance(op, AddRule) and op.chain in chains]
        assert lazy_objects(cfg, "s", audit=True, ranges=True, make_audit=False, make_ranges=False).ops == ()
