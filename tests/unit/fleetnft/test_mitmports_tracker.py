"""The fleet's per-subject named-port elements (egressd/fleetnft/mitmports.py): exact deletes
and adds while the kernel's state is known, a full refill after a change whose outcome is not,
with the doubtful subject's old and new ports together (more interception, never less)."""

from __future__ import annotations

import ipaddress

from egressd.fleetnft.mitmports import NONE, Interception, NamedPorts, address_key, uid_key
from egressd.kernel.ops import AddPortElems, DeletePortElems, FlushSet, NetlinkBatch

SETS = ("mitm_ports_v4", "mitm_ports_v6", "uid_mitm_ports")
A = address_key(ipaddress.ip_address("10.0.0.5"))
A6 = address_key(ipaddress.ip_address("fd00::5"))
B = address_key(ipaddress.ip_address("10.0.0.6"))
U = ("uid_mitm_ports", uid_key(100001))


def ops(batch: NetlinkBatch) -> list[object]:
    return list(batch.ops)


def test_a_change_deletes_exactly_what_is_held_then_adds() -> None:
    named = NamedPorts(SETS)
    batch, commit = named.changed(NetlinkBatch("T"), "a", Interception(frozenset({A, A6}), ((8443, 8443),)))
    assert ops(batch) == [
        AddPortElems("mitm_ports_v4", "v4", ((A[1], "tcp", 8443, 8443),)),
        AddPortElems("mitm_ports_v6", "v6", ((A6[1], "tcp", 8443, 8443),)),
    ]
    commit()
    assert named.doubt == {}
    batch, commit = named.changed(NetlinkBatch("T"), "a", Interception(frozenset({A}), ((8000, 8999),)))
    assert ops(batch) == [
        DeletePortElems("mitm_ports_v4", "v4", ((A[1], "tcp", 8443, 8443),)),
        DeletePortElems("mitm_ports_v6", "v6", ((A6[1], "tcp", 8443, 8443),)),
        AddPortElems("mitm_ports_v4", "v4", ((A[1], "tcp", 8000, 8999),)),
    ]
    commit()
    # Unchanged: nothing sent; the keys are kept for a later re-key.
    batch, commit = named.changed(NetlinkBatch("T"), "a", Interception(frozenset({A}), ((8000, 8999),)))
    assert ops(batch) == []
    commit()
    assert named.wanted("a").keys == frozenset({A})


def test_the_uid_key_is_big_endian_like_nfts_interval_lookup() -> None:
    assert uid_key(100001).network_address.packed == (100001).to_bytes(4, "big")
    named = NamedPorts(SETS)
    batch, _ = named.changed(NetlinkBatch("T"), "u", Interception(frozenset({U}), ((8443, 8443),)))
    assert ops(batch) == [AddPortElems("uid_mitm_ports", "v4", ((U[1], "tcp", 8443, 8443),))]


def test_an_unconfirmed_change_makes_the_next_one_refill_with_both_candidates() -> None:
    named = NamedPorts(SETS)
    _, commit = named.changed(NetlinkBatch("T"), "a", Interception(frozenset({A}), ((8443, 8443),)))
    commit()
    _, commit = named.changed(NetlinkBatch("T"), "b", Interception(frozenset({B}), ((9000, 9000),)))
    commit()
    # "a" narrows to 8080, and the answer never comes (no commit): either state may be held.
    named.changed(NetlinkBatch("T"), "a", Interception(frozenset({A}), ((8080, 8080),)))
    assert named.doubt["a"].ranges == ((8080, 8080), (8443, 8443))
    batch, commit = named.changed(NetlinkBatch("T"), "b", NONE)
    assert ops(batch) == [
        FlushSet("mitm_ports_v4"),
        FlushSet("mitm_ports_v6"),
        FlushSet("uid_mitm_ports"),
        AddPortElems("mitm_ports_v4", "v4", ((A[1], "tcp", 8080, 8080), (A[1], "tcp", 8443, 8443))),
    ]
    commit()
    # What the refill wrote is what is held now: the next change of "a" deletes exactly that.
    assert named.doubt == {} and named.held["a"].ranges == ((8080, 8080), (8443, 8443)) and "b" not in named.held
    batch, _ = named.changed(NetlinkBatch("T"), "a", Interception(frozenset({A}), ((8080, 8080),)))
    assert ops(batch) == [
        DeletePortElems("mitm_ports_v4", "v4", ((A[1], "tcp", 8080, 8080), (A[1], "tcp", 8443, 8443))),
        AddPortElems("mitm_ports_v4", "v4", ((A[1], "tcp", 8080, 8080),)),
    ]


def test_a_refused_change_leaves_the_held_state_and_refills_next_time() -> None:
    named = NamedPorts(SETS)
    _, commit = named.changed(NetlinkBatch("T"), "a", Interception(frozenset({A}), ((8443, 8443),)))
    commit()
    named.changed(NetlinkBatch("T"), "a", NONE)  # refused: no commit
    assert named.held["a"].ranges == ((8443, 8443),)
    batch, commit = named.changed(NetlinkBatch("T"), "a", NONE)
    assert ops(batch)[:3] == [FlushSet(s) for s in SETS] and len(ops(batch)) == 3
    commit()
    assert named.held == {} and named.doubt == {}


def test_without_the_mitm_nothing_is_tracked_or_sent() -> None:
    named = NamedPorts(())
    batch, commit = named.changed(NetlinkBatch("T"), "a", Interception(frozenset({A}), ((8443, 8443),)))
    commit()
    assert ops(batch) == [] and named.held == {}
    named.forget_all()
