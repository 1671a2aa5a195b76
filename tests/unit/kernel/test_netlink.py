"""egressd's nf_tables netlink encoder, checked byte for byte against pyroute2 as an independent oracle."""

from __future__ import annotations

import struct
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from typing import Any

import pytest
from pyroute2.netlink.nfnetlink.nftsocket import (
    NFT_MSG_DELCHAIN,
    NFT_MSG_DELRULE,
    NFT_MSG_DELSET,
    NFT_MSG_DELSETELEM,
    NFT_MSG_NEWRULE,
    NFT_MSG_NEWSETELEM,
    nft_chain_msg,
    nft_rule_msg,
    nft_set_elem_list_msg,
    nft_set_msg,
)

from egressd.fleetnft.contents import policy_swap
from egressd.fleetnft.subject import removal_batch, subject_rules
from egressd.fleetnft.table import TableConfig
from egressd.kernel import netlink, netlink_batch, netlink_dump, netlink_elements, netlink_proto
from egressd.kernel.ops import (
    AddIntervals,
    AddRule,
    AddTimed,
    DeleteChain,
    DeleteElement,
    DeleteSet,
    FlushChain,
    FlushSet,
    MatchRule,
    NetlinkBatch,
    RuleAction,
    VerdictRule,
)
from egressd.policy import parse_policy

T = "opensandbox-fleet"
NESTED = netlink_proto.NLA_F_NESTED

# ---- pyroute2 oracle -------------------------------------------------------------------------


def _ex(name: str, attrs: list[tuple[str, Any]]) -> dict[str, Any]:
    return {"attrs": [("NFTA_EXPR_NAME", name), ("NFTA_EXPR_DATA", {"attrs": attrs})]}


def _oracle_verdict(code: int) -> dict[str, Any]:
    data = {"attrs": [("NFTA_DATA_VERDICT", {"attrs": [("NFTA_VERDICT_CODE", code)]})]}
    return _ex("immediate", [("NFTA_IMMEDIATE_DREG", 0), ("NFTA_IMMEDIATE_DATA", data)])


def _oracle_rule(rule: MatchRule | VerdictRule) -> list[dict[str, Any]]:
    code = {RuleAction.DROP: 0, RuleAction.ACCEPT: 1}
    if isinstance(rule, VerdictRule):
        return [_oracle_verdict(code[rule.outcome])]
    out = []
    if rule.ct_original:
        key = 0x14 if rule.fam == "v4" else 0x16
        out.append(_ex("ct", [("NFTA_CT_DREG", 1), ("NFTA_CT_KEY", key), ("NFTA_CT_DIRECTION", 0)]))
    else:
        out.append(_ex("meta", [("NFTA_META_DREG", 1), ("NFTA_META_KEY", 15)]))
        proto = bytes([2 if rule.fam == "v4" else 10])
        out.append(
            _ex(
                "cmp",
                [
                    ("NFTA_CMP_SREG", 1),
                    ("NFTA_CMP_OP", 0),
                    ("NFTA_CMP_DATA", {"attrs": [("NFTA_DATA_VALUE", proto)]}),
                ],
            )
        )
        off, ln = (16, 4) if rule.fam == "v4" else (24, 16)
        out.append(
            _ex(
                "payload",
                [
                    ("NFTA_PAYLOAD_DREG", 1),
                    ("NFTA_PAYLOAD_BASE", 1),
                    ("NFTA_PAYLOAD_OFFSET", off),
                    ("NFTA_PAYLOAD_LEN", ln),
                ],
            )
        )
    out.append(_ex("lookup", [("NFTA_LOOKUP_SET", rule.set_name), ("NFTA_LOOKUP_SREG", 1)]))
    if rule.outcome is RuleAction.MARK:
        mark = {"attrs": [("NFTA_DATA_VALUE", struct.pack("=I", 2))]}
        out.append(_ex("immediate", [("NFTA_IMMEDIATE_DREG", 1), ("NFTA_IMMEDIATE_DATA", mark)]))
        out.append(_ex("meta", [("NFTA_META_KEY", 3), ("NFTA_META_SREG", 1)]))
    else:
        out.append(_oracle_verdict(code[rule.outcome]))
    return out


def _oracle_key(value: int, fam: str) -> dict[str, Any]:
    return {"attrs": [("NFTA_DATA_VALUE", value.to_bytes(4 if fam == "v4" else 16, "big"))]}


def _oracle_msg(cls: Any, msg_type: int, attrs: list[tuple[str, Any]], seq: int, flags: int) -> bytes:
    m = cls()
    m["attrs"] = attrs
    m["header"]["type"] = (10 << 8) | msg_type
    m["header"]["flags"] = flags
    m["header"]["sequence_number"] = seq
    m["header"]["pid"] = 0
    m["nfgen_family"] = 1
    m.encode()
    return bytes(m.data)


def _strip_nested(buf: bytes, start: int) -> bytes:
    """Clear NLA_F_NESTED on every attribute header, recursively (pyroute2 does not set it)."""
    out = bytearray(buf)

    def walk(off: int, end: int) -> None:
        while off + 4 <= end:
            length, kind = struct.unpack_from("=HH", out, off)
            if length < 4:
                return
            if kind & NESTED:
                struct.pack_into("=HH", out, off, length, kind & ~NESTED)
                walk(off + 4, off + length)
            off += (length + 3) & ~3

    walk(start, len(out))
    return bytes(out)


def _ours(op: Any, seq: int = 7) -> bytes:
    [(msg_type, extra, body)] = netlink_batch.encode_op(T, op)  # small ops: exactly one message
    raw = netlink_proto._nlmsg(
        (10 << 8) | msg_type, netlink_proto.NLM_F_REQUEST | netlink_proto.NLM_F_ACK | extra, seq, 1, 0, body
    )
    return _strip_nested(raw, 20)


# ---- byte-for-byte agreement -------------------------------------------------------------------

RULES = [
    MatchRule("v4", "subj_s_u_1_deny_v4", RuleAction.DROP),
    MatchRule("v6", "subj_s_u_1_deny_v6", RuleAction.DROP),
    MatchRule("v4", "subj_s_u_1_allow_v4", RuleAction.MARK),
    MatchRule("v6", "subj_s_u_1_dyn_v6", RuleAction.MARK),
    MatchRule("v4", "subj_s_u_1_allow_v4", RuleAction.ACCEPT, ct_original=True),
    MatchRule("v6", "subj_s_u_1_deny_v6", RuleAction.DROP, ct_original=True),
    VerdictRule(RuleAction.DROP),
]


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.render())
def test_rule_bytes_match_pyroute2(rule: MatchRule | VerdictRule) -> None:
    flags = 0x1 | 0x4 | 0x400 | 0x800
    attrs = [
        ("NFTA_RULE_TABLE", T),
        ("NFTA_RULE_CHAIN", "mark_s_u_1"),
        ("NFTA_RULE_EXPRESSIONS", _oracle_rule(rule)),
    ]
    assert _ours(AddRule("mark_s_u_1", rule)) == _oracle_msg(nft_rule_msg, NFT_MSG_NEWRULE, attrs, 7, flags)


def test_interval_elements_match_pyroute2() -> None:
    nets = (IPv4Network("10.0.0.0/24"), IPv4Network("8.8.8.8/32"), IPv4Network("255.255.255.0/24"))
    elems = []
    for key, is_end in netlink_elements.interval_keys(nets, "v4"):
        attrs: list[tuple[str, Any]] = [("NFTA_SET_ELEM_KEY", _oracle_key(key, "v4"))]
        if is_end:
            attrs.append(("NFTA_SET_ELEM_FLAGS", [1]))  # pyroute2's flag quirk: the ops key, not the name
        elems.append({"attrs": attrs})
    attrs2 = [
        ("NFTA_SET_ELEM_LIST_TABLE", T),
        ("NFTA_SET_ELEM_LIST_SET", "s"),
        ("NFTA_SET_ELEM_LIST_ELEMENTS", elems),
    ]
    expected = _oracle_msg(nft_set_elem_list_msg, NFT_MSG_NEWSETELEM, attrs2, 7, 0x1 | 0x4 | 0x400)
    assert _ours(AddIntervals("s", "v4", nets)) == expected


def test_timed_elements_match_pyroute2() -> None:
    leases = ((IPv4Address("93.184.216.34"), 90), (IPv4Address("10.0.0.1"), 360))
    elems = [
        {
            "attrs": [
                ("NFTA_SET_ELEM_KEY", _oracle_key(int(ip), "v4")),
                ("NFTA_SET_ELEM_TIMEOUT", s * 1000),
                ("NFTA_SET_ELEM_EXPIRATION", s * 1000),
            ]
        }
        for ip, s in leases
    ]
    attrs = [
        ("NFTA_SET_ELEM_LIST_TABLE", T),
        ("NFTA_SET_ELEM_LIST_SET", "d"),
        ("NFTA_SET_ELEM_LIST_ELEMENTS", elems),
    ]
    expected = _oracle_msg(nft_set_elem_list_msg, NFT_MSG_NEWSETELEM, attrs, 7, 0x1 | 0x4 | 0x400)
    assert _ours(AddTimed("d", "v4", leases)) == expected


def test_deletes_and_flush_match_pyroute2() -> None:
    flush = [("NFTA_SET_ELEM_LIST_TABLE", T), ("NFTA_SET_ELEM_LIST_SET", "s")]
    assert _ours(FlushSet("s")) == _oracle_msg(nft_set_elem_list_msg, NFT_MSG_DELSETELEM, flush, 7, 0x5)
    key = {"attrs": [("NFTA_SET_ELEM_KEY", _oracle_key(int(IPv6Address("fd00::5")), "v6"))]}
    delete = [*flush, ("NFTA_SET_ELEM_LIST_ELEMENTS", [key])]
    assert _ours(DeleteElement("s", IPv6Address("fd00::5"))) == _oracle_msg(
        nft_set_elem_list_msg, NFT_MSG_DELSETELEM, delete, 7, 0x5
    )
    chain = [("NFTA_CHAIN_TABLE", T), ("NFTA_CHAIN_NAME", "subj_s_u_1")]
    assert _ours(DeleteChain("subj_s_u_1")) == _oracle_msg(nft_chain_msg, NFT_MSG_DELCHAIN, chain, 7, 0x5)
    set_ = [("NFTA_SET_TABLE", T), ("NFTA_SET_NAME", "subj_s_u_1_dyn_v4")]
    assert _ours(DeleteSet("subj_s_u_1_dyn_v4")) == _oracle_msg(nft_set_msg, NFT_MSG_DELSET, set_, 7, 0x5)
    # flush chain = DELRULE with the chain and no handle (what nft sends for "flush chain").
    rules = [("NFTA_RULE_TABLE", T), ("NFTA_RULE_CHAIN", "mark_s_u_1")]
    assert _ours(FlushChain("mark_s_u_1")) == _oracle_msg(nft_rule_msg, NFT_MSG_DELRULE, rules, 7, 0x5)


# ---- interval keys (nft 1.0.6 semantics) -------------------------------------------------------


def test_interval_keys_zero_marker_and_pairs() -> None:
    nets = [IPv4Network("10.0.0.0/24"), IPv4Network("8.8.8.8/32")]
    assert netlink_elements.interval_keys(nets, "v4") == [
        (0, True),
        (int(IPv4Address("8.8.8.8")), False),
        (int(IPv4Address("8.8.8.9")), True),
        (int(IPv4Address("10.0.0.0")), False),
        (int(IPv4Address("10.0.1.0")), True),
    ]


def test_interval_keys_edges() -> None:
    assert netlink_elements.interval_keys([IPv4Network("0.0.0.0/8")], "v4") == [(0, False), (1 << 24, True)]
    assert netlink_elements.interval_keys([IPv4Network("0.0.0.0/0")], "v4") == [(0, False)]
    top = netlink_elements.interval_keys([IPv4Network("255.255.255.0/24")], "v4")
    assert top == [(0, True), (int(IPv4Address("255.255.255.0")), False)]
    assert netlink_elements.interval_keys([IPv6Network("::/0")], "v6") == [(0, False)]
    assert netlink_elements.interval_keys([], "v4") == []


def test_v6_keys_are_16_bytes_big_endian() -> None:
    raw = netlink_elements._key(IPv6Address("2001:db8::1"), "v6")
    assert raw.endswith(IPv6Address("2001:db8::1").packed)


# ---- framing -----------------------------------------------------------------------------------


def test_batch_framing_and_seq_map() -> None:
    cfg = TableConfig(table=T)
    batch = subject_rules(cfg, "s_u_1") + policy_swap(
        T, "s_u_1", parse_policy('{"defaultAction":"allow"}'), audit_objects=False
    )
    data, by_seq = netlink_batch.encode_batch(batch, 100)
    msgs = []
    off = 0
    while off < len(data):
        length, mtype, flags, seq, _ = struct.unpack_from("=IHHII", data, off)
        msgs.append((mtype, flags, seq))
        off += length
    assert off == len(data)
    assert msgs[0] == (netlink_proto.NFNL_MSG_BATCH_BEGIN, netlink_proto.NLM_F_REQUEST, 100)
    assert msgs[-1][0] == netlink_proto.NFNL_MSG_BATCH_END
    assert sorted(by_seq) == list(range(101, 101 + len(batch.ops)))
    assert all(f & netlink_proto.NLM_F_ACK for _, f, _ in msgs[1:-1])
    assert by_seq[101] == batch.ops[0]


def test_removal_batch_encodes_every_op() -> None:
    batch = removal_batch(
        TableConfig(table=T, mitm=True), "s_u_1", IPv4Address("10.0.0.5"), release_gateway=None, audit=True, ranges=True
    )
    data, by_seq = netlink_batch.encode_batch(batch, 1)
    assert len(by_seq) == len(batch.ops) > 0
    assert isinstance(NetlinkBatch(T, batch.ops), NetlinkBatch)
    assert len(data) % 4 == 0


def test_subject_create_is_one_batch_sets_chains_rules_keys() -> None:
    from egressd.fleetnft.subject import subject_create
    from egressd.fleetnft.table import SubjectNft

    subj = SubjectNft("s_u_1", IPv4Address("10.0.0.5"), IPv4Address("10.0.0.1"))
    text = subject_create(TableConfig(table=T), subj).describe().splitlines()
    concat = "inet_proto . inet_service"
    # No audit sets and no range sets: they come with the subject's first audit policy and its
    # first policy with shared port ranges (range_objects below).
    assert text[:14] == [
        *(
            f"add set inet {T} subj_s_u_1_{kind}_{fam} {{ type ipv{fam[1]}_addr; flags interval; }}"
            for kind in ("allow", "deny")
            for fam in ("v4", "v6")
        ),
        f"add set inet {T} subj_s_u_1_dyn_v4 {{ type ipv4_addr; flags timeout; timeout 360s; size 4096; }}",
        f"add set inet {T} subj_s_u_1_dyn_v6 {{ type ipv6_addr; flags timeout; timeout 360s; size 4096; }}",
        # Port-scoped (docs/reference/behaviour.md §18): rules with ports, and leases of names with ports.
        *(
            f"add set inet {T} subj_s_u_1_{kind}_{fam} {{ type ipv{fam[1]}_addr . {concat}; flags interval; }}"
            for kind in ("allowp", "denyp")
            for fam in ("v4", "v6")
        ),
        *(
            f"add set inet {T} subj_s_u_1_dynp_{fam} {{ type ipv{fam[1]}_addr . {concat}; "
            "flags interval,timeout; timeout 360s; size 8192; }"
            for fam in ("v4", "v6")
        ),
        # Their single ports: a hash set (no interval flag), cheap to add to at any size.
        *(
            f"add set inet {T} subj_s_u_1_dynpx_{fam} {{ type ipv{fam[1]}_addr . {concat}; "
            "flags timeout; timeout 360s; size 8192; }"
            for fam in ("v4", "v6")
        ),
    ]
    assert text[14:18] == [
        f"add chain inet {T} subj_s_u_1",
        f"add chain inet {T} mark_s_u_1",
        f"add counter inet {T} subj_s_u_1_audit_deny",
        f"add counter inet {T} subj_s_u_1_audit_default",
    ]
    assert text[-4:] == [
        f"add element inet {T} dispatch_v4 {{ 10.0.0.5 : jump subj_s_u_1 }}",
        f"add element inet {T} sandboxes_v4 {{ 10.0.0.5 }}",
        f"add element inet {T} marking_v4 {{ 10.0.0.5 : jump mark_s_u_1 }}",
        f"add element inet {T} dns_gw_v4 {{ 10.0.0.1 }}",
    ]
    _data, by_seq = netlink_batch.encode_batch(subject_create(TableConfig(table=T), subj), 1)
    assert len(by_seq) == len(text)


def test_range_objects_declare_the_hash_path_sets() -> None:
    from egressd.fleetnft.subject import range_objects

    batch = range_objects(TableConfig(table=T), "s_u_1")
    text = batch.describe().splitlines()
    assert text[:4] == [
        # The hash path for the leases' shared ranges: the address alone, sized like dyn ...
        *(
            f"add set inet {T} subj_s_u_1_dynr_{fam} {{ type ipv{fam[1]}_addr; flags timeout; timeout 360s; size 4096; }}"
            for fam in ("v4", "v6")
        ),
        # ... and the ranges, written with the policy.
        *(
            f"add set inet {T} subj_s_u_1_dynrports_{fam} {{ type inet_proto . inet_service; flags interval; }}"
            for fam in ("v4", "v6")
        ),
    ]
    assert text[4] == f"flush chain inet {T} mark_s_u_1"
    _data, by_seq = netlink_batch.encode_batch(batch, 1)
    assert len(by_seq) == len(text)


# ---- set element dumps (explain reads what the kernel holds) --------------------------------------


def _elements_for(nets: list[Any], fam: str) -> list[netlink_dump.SetElement]:
    width = 4 if fam == "v4" else 16
    return [
        netlink_dump.SetElement(k.to_bytes(width, "big"), end)
        for k, end in netlink_elements.interval_keys(nets, fam)
    ]


def test_element_covering_interval_sets() -> None:
    elements = _elements_for([IPv4Network("10.0.0.0/24"), IPv4Network("8.8.8.8/32")], "v4")
    hit = netlink_dump.element_covering(IPv4Address("10.0.0.77"), elements, interval=True)
    assert hit is not None and hit[0].key == IPv4Address("10.0.0.0").packed
    assert hit[1] == IPv4Address("10.0.1.0").packed
    host = netlink_dump.element_covering(IPv4Address("8.8.8.8"), elements, interval=True)
    assert host is not None and host[0].key == IPv4Address("8.8.8.8").packed
    for miss in ("8.8.8.9", "10.0.1.0", "9.9.9.9", "0.0.0.0"):
        assert netlink_dump.element_covering(IPv4Address(miss), elements, interval=True) is None
    everything = _elements_for([IPv4Network("0.0.0.0/0")], "v4")
    assert netlink_dump.element_covering(IPv4Address("203.0.113.9"), everything, interval=True) == (
        everything[0],
        None,
    )
    top = _elements_for([IPv4Network("255.255.255.0/24")], "v4")
    assert netlink_dump.element_covering(IPv4Address("255.255.255.255"), top, interval=True) is not None
    v6 = _elements_for([IPv6Network("2001:db8::/32")], "v6")
    assert netlink_dump.element_covering(IPv6Address("2001:db8::1"), v6, interval=True) is not None
    assert netlink_dump.element_covering(IPv4Address("32.1.13.184"), v6, interval=True) is None, (
        "family kept apart"
    )


def test_element_covering_plain_sets() -> None:
    lease = netlink_dump.SetElement(IPv4Address("93.184.216.34").packed, timeout_ms=90_000, expires_ms=61_500)
    assert netlink_dump.element_covering(IPv4Address("93.184.216.34"), [lease], interval=False) == (
        lease,
        None,
    )
    assert netlink_dump.element_covering(IPv4Address("93.184.216.35"), [lease], interval=False) is None


def test_parse_setelem_dump() -> None:
    def elem(
        key: bytes, *, end: bool = False, timeout: int | None = None, expires: int | None = None
    ) -> bytes:
        attrs = netlink_proto._nest(
            netlink_proto.NFTA_SET_ELEM_KEY, netlink_proto._attr(netlink_proto.NFTA_DATA_VALUE, key)
        )
        if end:
            attrs += netlink_proto._attr(
                netlink_proto.NFTA_SET_ELEM_FLAGS, struct.pack(">I", netlink_proto.NFT_SET_ELEM_INTERVAL_END)
            )
        if timeout is not None:
            attrs += netlink_proto._attr(netlink_proto.NFTA_SET_ELEM_TIMEOUT, struct.pack(">Q", timeout))
        if expires is not None:
            attrs += netlink_proto._attr(netlink_proto.NFTA_SET_ELEM_EXPIRATION, struct.pack(">Q", expires))
        return netlink_proto._nest(netlink_proto.NFTA_LIST_ELEM, attrs)

    body = (
        struct.pack("=BBH", netlink_proto.NFPROTO_INET, 0, 0)
        + netlink_proto._str(netlink_proto.NFTA_SET_ELEM_LIST_TABLE, "T")
        + netlink_proto._str(netlink_proto.NFTA_SET_ELEM_LIST_SET, "s")
        + netlink_proto._nest(
            netlink_proto.NFTA_SET_ELEM_LIST_ELEMENTS,
            elem(b"\x0a\x00\x00\x00"),
            elem(b"\x0a\x00\x01\x00", end=True),
            elem(b"\x5d\xb8\xd8\x22", timeout=90_000, expires=12_345),
        )
    )
    msg_type = (netlink_proto.NFNL_SUBSYS_NFTABLES << 8) | netlink_proto.NFT_MSG_NEWSETELEM
    first = struct.pack("=IHHII", 16 + len(body), msg_type, 0, 1, 0) + body
    done = struct.pack("=IHHII", 20, netlink_proto.NLMSG_DONE, 0, 1, 0) + b"\0\0\0\0"
    elements, finished = netlink_dump.parse_setelem_dump(first + done)
    assert finished
    assert [(e.key, e.interval_end, e.timeout_ms, e.expires_ms) for e in elements] == [
        (b"\x0a\x00\x00\x00", False, None, None),
        (b"\x0a\x00\x01\x00", True, None, None),
        (b"\x5d\xb8\xd8\x22", False, 90_000, 12_345),
    ]
    error = struct.pack("=IHHII", 36, netlink_proto.NLMSG_ERROR, 0, 1, 0) + struct.pack("=i", -2) + bytes(16)
    with pytest.raises(netlink_proto.NetlinkError):
        netlink_dump.parse_setelem_dump(error)


def test_a_refused_element_op_is_reported_without_its_addresses() -> None:
    from egressd.kernel.ops import AddIntervals, AddTimed

    text = netlink._failed_op_text("T", AddIntervals("subj_x_allow_v4", "v4", (IPv4Network("10.9.0.0/24"),)))
    assert text == "add element inet T subj_x_allow_v4 { <1 prefixes> }"
    text = netlink._failed_op_text(
        "T", AddTimed("subj_x_dyn_v4", "v4", ((IPv4Address("93.184.216.34"), 90),))
    )
    assert "93.184.216.34" not in text and "<1 leases>" in text
