"""What a DNS lease opens (docs/reference/behaviour.md §18): the scopes of the names that taught it, in
the lease book's admissions, narrowings and refreshes, and the kernel steps that hold them."""

from __future__ import annotations

import ipaddress

from egressd.fleetnft.contents import dyn_add, dyn_replace
from egressd.kernel.ops import AddPortElems, AddTimed, DeletePortElems, FlushSet
from egressd.policy import NetworkPolicy, ip_sets, parse_policy
from egressd.policy.scope import Scope
from egressd.sidecarnft.ruleset import SidecarTable, dynpx_set
from egressd.sidecarnft.ruleset import ruleset as sidecar_ruleset
from egressd.subject.leases import Grant, LeaseBook, admissible, narrowed_for, port_elems_cap
from egressd.subject.scopes import QUIC, WHOLE, LeaseScope, lease_scope

NOW = 1000.0
CDN = ipaddress.ip_address("93.184.216.34")
OTHER = ipaddress.ip_address("93.184.216.35")
TCP443 = Scope.of(tcp=[(443, 443)])


def pol(*rules: str, default: str = "deny") -> NetworkPolicy:
    return parse_policy(f'{{"defaultAction":"{default}","egress":[{",".join(rules)}]}}')


API_443 = '{"action":"allow","target":"api.x.io","ports":[443]}'
WWW_80 = '{"action":"allow","target":"www.x.io","protocol":"tcp","ports":[80]}'
API_UDP = '{"action":"allow","target":"api.x.io","protocol":"udp","ports":[443]}'
ANY = '{"action":"allow","target":"any.x.io"}'


def test_a_name_s_lease_scope_follows_its_rules_and_the_name_check() -> None:
    p = pol(API_443, WWW_80, ANY)
    # "ports":[443] is TCP and UDP 443; with the name check, UDP 443 needs an explicit udp rule.
    assert lease_scope(p, "api.x.io", name_check=False) == LeaseScope(
        False, Scope.of(tcp=[(443, 443)], udp=[(443, 443)])
    )
    assert lease_scope(p, "api.x.io", name_check=True) == LeaseScope(False, TCP443)
    assert lease_scope(p, "www.x.io", name_check=True) == LeaseScope(False, Scope.of(tcp=[(80, 80)]))
    # No ports: the address-only set; its rule never opens UDP 443 under the name check.
    assert lease_scope(p, "any.x.io", name_check=True) == WHOLE
    assert not WHOLE.admits("udp", 443, name_check=True) and WHOLE.admits("udp", 443, name_check=False)
    assert WHOLE.admits("icmp", None, name_check=True) and WHOLE.admits("tcp", 22, name_check=True)
    explicit = pol(API_UDP, API_443)
    assert lease_scope(explicit, "api.x.io", name_check=True) == LeaseScope(
        False, Scope.of(tcp=[(443, 443)], udp=[(443, 443)])
    )
    # A whole lease whose UDP 443 an explicit udp rule opened keeps exactly that element.
    whole_quic = pol(
        '{"action":"allow","target":"q.x.io","protocol":"udp","ports":[443]}', ANY.replace("any", "q")
    )
    assert lease_scope(whole_quic, "q.x.io", name_check=True) == LeaseScope(True, QUIC)


def test_a_lease_scope_admits_only_its_ports_and_a_union_stays_normalised() -> None:
    s = LeaseScope(False, Scope.of(tcp=[(443, 443)], udp=[(53, 53)]))
    assert s.admits("tcp", 443, name_check=True) and s.admits("udp", 53, name_check=True)
    assert not s.admits("tcp", 80, name_check=True) and not s.admits("icmp", None, name_check=False)
    assert s.union(WHOLE) == WHOLE  # a whole lease holds no port element but UDP 443
    assert LeaseScope(True, QUIC).union(s) == LeaseScope(True, QUIC)


def test_two_names_on_one_address_widen_its_lease_and_replace_its_elements() -> None:
    p = pol(API_443, WWW_80)
    book = LeaseBook()
    first = admissible(book, p, [(CDN, 60)], "api.x.io", NOW, name_check=True)
    assert first == [Grant(CDN, 60, LeaseScope(False, TCP443))]
    book.record(first, "api.x.io", NOW)
    second = admissible(book, p, [(CDN, 90)], "www.x.io", NOW, name_check=True)
    both = Scope.of(tcp=[(80, 80), (443, 443)])
    assert second == [Grant(CDN, 90, LeaseScope(False, both), held=TCP443)]
    # The kernel step: the held element is added (so it exists), deleted, the new ones added.
    batch = dyn_add("T", "s", second)
    net = ipaddress.ip_network("93.184.216.34/32")
    old = ((net, "tcp", 443, 443),)
    assert batch.ops == (
        AddPortElems("subj_s_dynpx_v4", "v4", old, (90,), exact=True),
        DeletePortElems("subj_s_dynpx_v4", "v4", old, exact=True),
        AddPortElems("subj_s_dynpx_v4", "v4", ((net, "tcp", 80, 80), (net, "tcp", 443, 443)), (90, 90), exact=True),
    )
    book.record(second, "www.x.io", NOW)
    assert book.scope_of(CDN, NOW) == LeaseScope(False, both)
    # A refresh renews the lease's scope, never more, and no element changes.
    renew = admissible(book, p, [(CDN, 360)], None, NOW, name_check=True)
    assert renew == [Grant(CDN, 360, LeaseScope(False, both), held=both)]
    assert [type(op) for op in dyn_add("T", "s", renew).ops] == [AddPortElems]


def test_a_narrowing_rescopes_each_lease_by_the_names_still_allowed() -> None:
    p = pol(API_443, WWW_80)
    book = LeaseBook()
    for name in ("api.x.io", "www.x.io"):
        book.record(admissible(book, p, [(CDN, 60)], name, NOW, name_check=True), name, NOW)
    book.record(admissible(book, p, [(OTHER, 60)], "www.x.io", NOW, name_check=True), "www.x.io", NOW)
    narrower = pol(API_443)  # www.x.io is gone: CDN keeps 443 only, OTHER leaves
    sets = ip_sets(narrower)
    out = narrowed_for(book, narrower, sets.deny_v4, sets.deny_v6, NOW, name_check=True)
    assert out.revoked == (OTHER,) and not out.intact
    assert out.kept == (Grant(CDN, 60, LeaseScope(False, TCP443)),)
    # The same policy keeps everything as it is: no rewrite of the dyn sets.
    same = narrowed_for(book, p, (), (), NOW, name_check=True)
    assert same.intact
    # A port taken away from a name: still a narrowing (the lease's elements shrink).
    only80 = pol('{"action":"allow","target":"api.x.io","protocol":"tcp","ports":[8443]}', WWW_80)
    shrunk = narrowed_for(book, only80, (), (), NOW, name_check=True)
    assert not shrunk.intact and shrunk.kept[0].scope.ports == Scope.of(tcp=[(80, 80), (8443, 8443)])
    # Its kernel step empties both dyn sets of both kinds and refills them from the new scopes.
    batch = dyn_replace("T", "s", out.kept, ranges=False)
    kinds = ("dyn_v4", "dyn_v6", "dynp_v4", "dynp_v6", "dynpx_v4", "dynpx_v6")
    assert batch.ops[:6] == tuple(FlushSet(f"subj_s_{k}") for k in kinds)
    assert not any(isinstance(op, DeletePortElems | AddTimed) for op in batch.ops)


def test_the_port_element_budget_trims_an_answer_like_the_lease_cap() -> None:
    wide = pol('{"action":"allow","target":"w.x.io","protocol":"tcp","ports":[1,3,5]}')
    book = LeaseBook(cap=1)  # room for 2 port elements
    assert admissible(book, wide, [(CDN, 60)], "w.x.io", NOW, name_check=True) == []
    narrow = pol('{"action":"allow","target":"w.x.io","protocol":"tcp","ports":[1,3]}')
    got = admissible(book, narrow, [(CDN, 60)], "w.x.io", NOW, name_check=True)
    assert [g.ip for g in got] == [CDN]
    book.record(got, "w.x.io", NOW)
    assert admissible(book, narrow, [(OTHER, 60)], "w.x.io", NOW, name_check=True) == []  # over the cap


def test_a_narrowing_keeps_leases_only_while_their_port_elements_fit_the_budget() -> None:
    """A lease taught by a name allowed on every port (no port element) and by one allowed on
    three ports gets those three elements back when the whole name goes: the narrowing keeps
    leases in the book's order while their elements fit (cap 2: 4 elements, the size of the
    kernel's port-scoped dyn sets) and revokes the rest, so the refill always fits the kernel's
    sets (else ENFILE would fail the swap and leave the wider policy in force)."""
    every = '{"action":"allow","target":"w.x.io"}'
    three = '{"action":"allow","target":"p.x.io","protocol":"tcp","ports":[1,3,5]}'
    wide = pol(every, three)
    book = LeaseBook(cap=2)
    for ip in (CDN, OTHER):
        for name in ("w.x.io", "p.x.io"):
            got = admissible(book, wide, [(ip, 60)], name, NOW, name_check=True)
            assert got == [Grant(ip, 60, WHOLE)], got  # whole: no port element to budget
            book.record(got, name, NOW)
    assert book._elems == 0
    narrower = pol(three)
    out = narrowed_for(book, narrower, (), (), NOW, name_check=True)
    ports = Scope.of(tcp=[(1, 1), (3, 3), (5, 5)])
    assert out.kept == (Grant(CDN, 60, LeaseScope(False, ports)),)
    assert out.revoked == (OTHER,) and not out.intact
    # The book is exactly what the kernel gets: OTHER is gone, its names with it.
    assert list(out.book) == [CDN] and out.book._elems == 3 <= out.book.elem_cap
    assert out.book.scope_of(OTHER, NOW) == LeaseScope(False, Scope.EMPTY)
    assert not out.book.verified(OTHER, "p.x.io", NOW) and out.book.verified(CDN, "p.x.io", NOW)
    # ... and learning does not bring it back past the budget; the kept lease renews.
    assert admissible(out.book, narrower, [(OTHER, 60)], "p.x.io", NOW, name_check=True) == []
    renewed = admissible(out.book, narrower, [(CDN, 60)], "p.x.io", NOW, name_check=True)
    assert [g.ip for g in renewed] == [CDN]
    # The refill fits the sets: the fleet's batch and the sidecar's rebuild alike.
    size = port_elems_cap(2)
    added = [op for op in dyn_replace("T", "s", out.kept, ranges=False).ops if isinstance(op, AddPortElems)]
    assert added and all(len(op.elems) <= size for op in added)
    script = sidecar_ruleset(SidecarTable(max_leases=2), narrower, out.kept)
    (dynpx,) = [ln for ln in script.splitlines() if f"set inet opensandbox {dynpx_set('v4')} " in ln]
    assert f"size {size};" in dynpx and dynpx.count(" . tcp . ") == 3, dynpx
    # A narrowing that changes nothing keeps everything, within the budget.
    again = narrowed_for(out.book, narrower, (), (), NOW, name_check=True)
    assert again.intact and again.kept == out.kept and not again.revoked


def test_a_name_whose_scope_is_empty_is_never_learned() -> None:
    p = pol('{"action":"deny","target":"api.x.io","ports":[443]}', API_443)
    assert admissible(LeaseBook(), p, [(CDN, 60)], "api.x.io", NOW, name_check=True) == []
