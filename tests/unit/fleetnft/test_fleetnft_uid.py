"""The host-uid half of the fleet ruleset (docs/reference/behaviour.md §17): header, per-subject keys, encoding."""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

import pytest
from pyroute2.netlink.nfnetlink.nftsocket import NFT_MSG_DELSETELEM, NFT_MSG_NEWSETELEM, nft_set_elem_list_msg

from egressd.fleetnft.header import header_script
from egressd.fleetnft.hostuid import (
    UidSubjectNft,
    uid_audit_ops,
    uid_key_deletes,
    uid_subject_create,
    uid_subject_keys,
)
from egressd.fleetnft.subject import subject_create
from egressd.fleetnft.table import TableConfig
from egressd.kernel import netlink_batch, netlink_proto
from egressd.kernel.ops import AddUid, AddUidCounterRef, AddUidJump, AddUidPort, DeleteUid, NetlinkBatch
from egressd.subject.hostuid import UidPorts, UidRange

T = "opensandbox-fleet"
SUBJ = UidSubjectNft("s_u_1", 100001, 3)


def header(cfg: TableConfig) -> list[str]:
    prefix = f"add rule inet {cfg.table} "
    return [line.removeprefix(prefix) for line in header_script(cfg, delete_existing=False).splitlines()]


def chain(lines: list[str], name: str) -> list[str]:
    return [line.removeprefix(f"{name} ") for line in lines if line.startswith(f"{name} ")]


# ---- header ---------------------------------------------------------------------------------


def test_output_hook_polices_only_the_uid_range() -> None:
    lines = header(TableConfig())
    assert f"add chain inet {T} output {{ type filter hook output priority 0; policy accept; }}" in lines
    assert chain(lines, "output") == ["meta skuid 100000-165535 jump uid_out"]
    assert f"add chain inet {T} nat_out {{ type nat hook output priority -100; policy accept; }}" in lines
    assert chain(lines, "nat_out") == ["meta skuid 100000-165535 jump uid_nat"]


def test_uid_out_is_the_forward_path_on_output() -> None:
    assert chain(header(TableConfig()), "uid_out") == [
        # Port 53 that was not redirected rode a forwarder's conntrack entry
        # (tests/kernel/test_uid_dns_collision.py).
        "meta l4proto { tcp, udp } th dport 53 ct state invalid,untracked goto uid_denied",
        "meta l4proto { tcp, udp } th dport 53 ct status & dnat == 0 goto uid_denied",
        # Only the host's own addresses (IPv6 lets a process claim any: tests/kernel/test_spoofing.py).
        "fib saddr type != local goto uid_denied",
        "udp sport { 15353, 16000-16256 } goto uid_denied",
        "tcp sport { 15353, 16000-16256, 18080 } goto uid_denied",
        "fib daddr type local jump uid_local",
        "meta mark set meta mark & 0xfffffffd",
        "tcp dport 853 goto uid_denied",
        "udp dport 853 goto uid_denied",
        "ip daddr @sandboxes_v4 goto uid_denied",
        "ip daddr @sandbox_nets_v4 goto uid_denied",
        "ip6 daddr @sandboxes_v6 goto uid_denied",
        "ip6 daddr @sandbox_nets_v6 goto uid_denied",
        "meta skuid vmap @uid_marking",
        "meta skuid vmap @uid_dispatch",
        # No "ct state established accept" before the subject's chains: every packet is judged.
        "ct state established,related meta skuid @uid_audit accept",
        "meta mark & 0x2 != 0x2 goto uid_denied",
    ]


UNNATED_53 = [
    "meta l4proto { tcp, udp } th dport 53 ct state invalid,untracked goto uid_denied",
    "meta l4proto { tcp, udp } th dport 53 ct status & dnat == 0 goto uid_denied",
]


@pytest.mark.parametrize(
    "cfg",
    [TableConfig(), TableConfig(own_uid=100500), TableConfig(mitm=True, block_doh_443=True)],
    ids=["default", "own_uid_inside", "mitm"],
)
def test_port_53_that_nat_did_not_redirect_is_refused_before_anything_is_accepted(cfg: TableConfig) -> None:
    """NAT is decided on a flow's first packet only. The DNS forwarder (exempt from the redirect)
    sends from the namespace the uid subjects share, and the un-NATed conntrack entries of the
    sockets it closed outlive them: a uid that binds such a port rides one straight to the
    resolver (tests/kernel/test_uid_dns_collision.py). Port 53 of an in-range uid that was not
    NATed is refused right after the exemptions: before the local exemption (a local resolver
    on :53 is redirected too) and before the subject's chains (a policy that opens the
    resolver's address would pass it)."""
    out = chain(header(cfg), "uid_out")
    exemptions = [f"meta skuid {cfg.own_uid} return"] if cfg.own_uid is not None else []
    assert out[: len(exemptions) + 2] == [*exemptions, *UNNATED_53]
    for rule in UNNATED_53:
        assert out.count(rule) == 1
        assert out.index(rule) < out.index("fib daddr type local jump uid_local")
        assert out.index(rule) < out.index("meta skuid vmap @uid_dispatch")
    # The redirect itself is untouched: port 53 of every in-range uid is NATed to a DNS port.
    assert "udp dport 53 redirect to :meta skuid map @uid_dns" in chain(header(cfg), "uid_nat")


def test_uid_refusals_are_counted_by_the_socket_owner_then_refused_like_all() -> None:
    lines = header(TableConfig())
    assert f"add map inet {T} uid_drop_counter {{ type uid : counter; }}" in lines
    assert chain(lines, "uid_denied") == [
        "counter name meta skuid map @uid_drop_counter goto deny_verdict",
        "goto denied",
    ]
    # Declared before the first rule that goes there.
    first = min(i for i, ln in enumerate(lines) if ln.endswith("goto uid_denied"))
    assert lines.index(f"add chain inet {T} uid_denied") < first


def test_own_uid_is_exempt_only_inside_the_range() -> None:
    inside = header(TableConfig(own_uid=100500))
    assert chain(inside, "uid_out")[0] == "meta skuid 100500 return"
    assert chain(inside, "uid_nat")[0] == "meta skuid 100500 return"
    outside = header(TableConfig(own_uid=0))
    assert not any("meta skuid 0 " in line for c in ("uid_out", "uid_nat") for line in chain(outside, c))


def test_the_forwarders_mark_exempts_no_uid_and_zones_only_egressds_sockets() -> None:
    """A sandbox process with CAP_NET_RAW may set SO_MARK 0x1 (Linux 5.17 on): the mark
    alone must neither skip a uid's redirect and policy, nor put its flows in the forwarder's
    conntrack zone (tests/kernel/test_uid_mark_forgery.py)."""
    for cfg in (TableConfig(), TableConfig(own_uid=0), TableConfig(own_uid=100500)):
        lines = header(cfg)
        for c in ("uid_out", "uid_nat"):
            assert not any("meta mark 0x00000001" in line for line in chain(lines, c)), (c, cfg.own_uid)
    assert chain(header(TableConfig(own_uid=0)), "fwd_zone") == ["meta mark 0x1 meta skuid 0 ct original zone set 1"]


def test_dns_redirect_per_uid_and_unknown_uids_to_the_nxdomain_port() -> None:
    assert chain(header(TableConfig()), "uid_nat") == [
        "udp dport 53 redirect to :meta skuid map @uid_dns",
        "tcp dport 53 redirect to :meta skuid map @uid_dns",
        "udp dport 53 redirect to :16256",
        "tcp dport 53 redirect to :16256",
    ]


def test_uid_local_accepts_only_own_redirects_and_guards_egressds_listeners() -> None:
    cfg = TableConfig(dns_port=15353, http_port=18080)
    assert chain(header(cfg), "uid_local") == [
        "udp dport 16000-16256 ct status dnat ct original proto-dst 53 meta skuid . udp dport @uid_dns_own accept",
        "udp dport 16256 ct status dnat ct original proto-dst 53 accept",
        "tcp dport 16000-16256 ct status dnat ct original proto-dst 53 meta skuid . tcp dport @uid_dns_own accept",
        "tcp dport 16256 ct status dnat ct original proto-dst 53 accept",
        "udp dport { 15353, 16000-16256 } goto uid_denied",
        "tcp dport { 15353, 16000-16256, 18080 } goto uid_denied",
        "accept",
    ]


def test_mitm_intercepts_per_uid_port_and_judges_on_the_original_destination() -> None:
    lines = header(TableConfig(mitm=True, mitm_port=18081))
    nat = chain(lines, "uid_nat")
    assert nat[-7:] == [
        "fib daddr type local return",
        "ip daddr @sandboxes_v4 return",
        "ip daddr @sandbox_nets_v4 return",
        "ip6 daddr @sandboxes_v6 return",
        "ip6 daddr @sandbox_nets_v6 return",
        "tcp dport { 80, 443 } redirect to :meta skuid map @uid_mitm",
        # The ports a subject's http/https rules name (§18), per uid.
        "meta skuid . meta l4proto . tcp dport @uid_mitm_ports redirect to :meta skuid map @uid_mitm",
    ]
    local = chain(lines, "uid_local")
    assert "tcp dport 16257-16512 ct status dnat meta skuid . tcp dport vmap @uid_mitm_in" in local
    assert "tcp dport { 15353, 16000-16512, 18080-18081 } goto uid_denied" in local
    assert local[-1] == "accept"
    assert f"add chain inet {T} uid_input {{ type filter hook input priority 0; policy accept; }}" in lines
    assert chain(lines, "uid_input") == [
        "tcp dport 16257-16512 ct status dnat return",
        "tcp dport 16257-16512 goto uid_denied",
    ]
    assert not any("16257" in line for line in chain(lines, "input"))
    assert f"add map inet {T} uid_mitm_in {{ type uid . inet_service : verdict; }}" in lines


@pytest.mark.parametrize("blocklist", [False, True])
def test_doh_blocking_applies_to_uid_subjects(blocklist: bool) -> None:
    import ipaddress

    nets = (ipaddress.ip_network("1.1.1.1/32"),) if blocklist else ()
    lines = header(TableConfig(mitm=True, block_doh_443=True, doh_blocklist=nets))
    out, local = chain(lines, "uid_out"), chain(lines, "uid_local")
    if blocklist:
        assert "ip daddr @doh_block_v4 tcp dport 443 goto uid_denied" in out
        assert (
            "tcp dport 16257-16512 ct status dnat ct original ip daddr @doh_block_v4 ct original proto-dst 443 "
            "goto uid_denied" in local
        )
        assert not any("doh_block_v6" in line for line in out)
    else:
        assert "tcp dport 443 goto uid_denied" in out
        assert "tcp dport 16257-16512 ct status dnat ct original proto-dst 443 goto uid_denied" in local


def test_configured_range_and_ports() -> None:
    cfg = TableConfig(uids=UidPorts(UidRange(2000, 2999), 30000, 4))
    lines = header(cfg)
    assert chain(lines, "output") == ["meta skuid 2000-2999 jump uid_out"]
    assert "udp dport 53 redirect to :30004" in chain(lines, "uid_nat")


# ---- per subject ----------------------------------------------------------------------------


def test_keys_point_the_uid_at_the_subjects_chains_and_ports() -> None:
    assert uid_subject_keys(TableConfig(), SUBJ).describe().splitlines() == [
        f'add element inet {T} uid_drop_counter {{ 100001 : "subj_s_u_1_dropped" }}',
        f"add element inet {T} uid_dispatch {{ 100001 : jump subj_s_u_1 }}",
        f"add element inet {T} uid_marking {{ 100001 : jump mark_s_u_1 }}",
        f"add element inet {T} uid_dns {{ 100001 : 16003 }}",
        f"add element inet {T} uid_dns_own {{ 100001 . 16003 }}",
    ]
    mitm = uid_subject_keys(TableConfig(mitm=True), SUBJ).describe().splitlines()
    assert mitm[-2:] == [
        f"add element inet {T} uid_mitm {{ 100001 : 16260 }}",
        f"add element inet {T} uid_mitm_in {{ 100001 . 16260 : jump subj_s_u_1_in }}",
    ]


def test_deletes_are_the_inverse_of_the_keys_and_leave_no_audit_membership() -> None:
    cfg = TableConfig(mitm=True)
    text = NetlinkBatch(T, tuple(uid_key_deletes(cfg, 100001, 3))).describe().splitlines()
    assert text == [
        f"delete element inet {T} uid_dispatch {{ 100001 }}",
        f"delete element inet {T} uid_marking {{ 100001 }}",
        f"delete element inet {T} uid_dns {{ 100001 }}",
        f"delete element inet {T} uid_dns_own {{ 100001 . 16003 }}",
        f"delete element inet {T} uid_mitm {{ 100001 }}",
        f"delete element inet {T} uid_mitm_in {{ 100001 . 16260 }}",
        f"delete element inet {T} uid_drop_counter {{ 100001 }}",
        f"add element inet {T} uid_audit {{ 100001 }}",
        f"delete element inet {T} uid_audit {{ 100001 }}",
    ]


def test_audit_membership_is_idempotent_both_ways() -> None:
    assert uid_audit_ops(7, audit=True) == [AddUid("uid_audit", 7)]
    assert uid_audit_ops(7, audit=False) == [AddUid("uid_audit", 7), DeleteUid("uid_audit", 7)]


def test_create_has_the_network_subjects_objects_and_rules() -> None:
    import ipaddress

    cfg = TableConfig(mitm=True)
    uid_ops = uid_subject_create(cfg, SUBJ).ops
    net = subject_create(cfg, _net_subject()).ops
    # Same sets, chains, counters and fixed rules; only the keys differ.
    shared = [op for op in net if type(op).__name__ in ("AddSet", "AddChain", "AddCounter", "AddRule")]
    assert list(uid_ops[: len(shared)]) == shared
    assert not any(isinstance(getattr(op, "key", None), ipaddress.IPv4Address) for op in uid_ops)


def _net_subject() -> Any:
    import ipaddress

    from egressd.fleetnft.table import SubjectNft

    return SubjectNft("s_u_1", ipaddress.ip_address("10.0.0.5"), ipaddress.ip_address("10.0.0.1"))


# ---- encoding -------------------------------------------------------------------------------


def _oracle(msg_type: int, set_name: str, elem: list[tuple[str, Any]], flags: int) -> bytes:
    m = nft_set_elem_list_msg()
    m["attrs"] = [
        ("NFTA_SET_ELEM_LIST_TABLE", T),
        ("NFTA_SET_ELEM_LIST_SET", set_name),
        ("NFTA_SET_ELEM_LIST_ELEMENTS", [{"attrs": elem}]),
    ]
    m["header"]["type"] = (10 << 8) | msg_type
    m["header"]["flags"] = flags
    m["header"]["sequence_number"] = 7
    m["header"]["pid"] = 0
    m["nfgen_family"] = 1
    m.encode()
    return bytes(m.data)


def _ours(op: Any) -> bytes:
    [(msg_type, extra, body)] = netlink_batch.encode_op(T, op)
    raw = netlink_proto._nlmsg(
        (10 << 8) | msg_type, netlink_proto.NLM_F_REQUEST | netlink_proto.NLM_F_ACK | extra, 7, 1, 0, body
    )
    out = bytearray(raw)

    def walk(off: int, end: int) -> None:  # pyroute2 does not set NLA_F_NESTED
        while off + 4 <= end:
            length, kind = struct.unpack_from("=HH", out, off)
            if length < 4:
                return
            if kind & netlink_proto.NLA_F_NESTED:
                struct.pack_into("=HH", out, off, length, kind & ~netlink_proto.NLA_F_NESTED)
                walk(off + 4, off + length)
            off += (length + 3) & ~3

    walk(20, len(out))
    return bytes(out)


def _value(raw: bytes) -> dict[str, Any]:
    return {"attrs": [("NFTA_DATA_VALUE", raw)]}


UID = struct.pack("=I", 100001)  # meta skuid: a host-endian u32
UID_PORT = UID + struct.pack(">H", 16003) + b"\0\0"  # uid . inet_service, padded to 8 bytes
NEW = 0x1 | 0x4 | 0x400


def test_uid_element_bytes_match_pyroute2() -> None:
    assert _ours(AddUid("uid_audit", 100001)) == _oracle(
        NFT_MSG_NEWSETELEM, "uid_audit", [("NFTA_SET_ELEM_KEY", _value(UID))], NEW
    )
    assert _ours(AddUid("uid_dns_own", 100001, 16003)) == _oracle(
        NFT_MSG_NEWSETELEM, "uid_dns_own", [("NFTA_SET_ELEM_KEY", _value(UID_PORT))], NEW
    )
    assert _ours(DeleteUid("uid_dns_own", 100001, 16003)) == _oracle(
        NFT_MSG_DELSETELEM, "uid_dns_own", [("NFTA_SET_ELEM_KEY", _value(UID_PORT))], 0x5
    )
    port = [("NFTA_SET_ELEM_KEY", _value(UID)), ("NFTA_SET_ELEM_DATA", _value(struct.pack(">H", 16003)))]
    assert _ours(AddUidPort("uid_dns", 100001, 16003)) == _oracle(NFT_MSG_NEWSETELEM, "uid_dns", port, NEW)


@pytest.mark.parametrize(("port", "key"), [(None, UID), (16003, UID_PORT)])
def test_uid_jump_bytes_match_pyroute2(port: int | None, key: bytes) -> None:
    verdict = {
        "attrs": [("NFTA_DATA_VERDICT", {"attrs": [("NFTA_VERDICT_CODE", -3), ("NFTA_VERDICT_CHAIN", "c")]})]
    }
    elem = [("NFTA_SET_ELEM_KEY", _value(key)), ("NFTA_SET_ELEM_DATA", verdict)]
    assert _ours(AddUidJump("m", 100001, "c", port=port)) == _oracle(NFT_MSG_NEWSETELEM, "m", elem, NEW)


def test_uid_counter_ref_bytes_match_pyroute2() -> None:
    elem = [("NFTA_SET_ELEM_KEY", _value(UID)), ("NFTA_SET_ELEM_OBJREF", "subj_s_u_1_dropped")]
    assert _ours(AddUidCounterRef("uid_drop_counter", 100001, "subj_s_u_1_dropped")) == _oracle(
        NFT_MSG_NEWSETELEM, "uid_drop_counter", elem, NEW
    )


def test_a_sandbox_uid_never_answers_from_one_of_egressds_listener_ports() -> None:
    """Port squatting (review of issue 16): a sandbox uid that binds a restarting worker's port, or
    another subject's DNS/MITM port, would receive that subject's redirected flows. Its replies
    from any of egressd's listener ports are refused before anything else in uid_out."""
    cfg = dataclasses.replace(TableConfig(), mitm=True, mitm_workers=3)
    out = chain(header(cfg), "uid_out")
    after = out.index("fib saddr type != local goto uid_denied") + 1
    assert out[after : after + 2] == [
        "udp sport { 15353, 16000-16256 } goto uid_denied",
        "tcp sport { 15353, 16000-16512, 18080-18083 } goto uid_denied",
    ]
    lo, hi = cfg.uids.mitm_ports
    assert (lo, hi) == (16257, 16512)  # the per-subject MITM block is inside the refused range
