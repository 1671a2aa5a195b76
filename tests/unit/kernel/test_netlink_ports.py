"""The port-scoped sets, elements and rules (docs/reference/behaviour.md §18) as netlink attributes: the
values nft 1.0.6 sends for the same text (taken from ``nft --debug=mnl`` on 1.0.6; the kernel's
listing of both is compared in tests/kernel/test_ports_load.py), and their nft rendering."""

from __future__ import annotations

import ipaddress
import struct

from egressd.kernel import netlink_batch
from egressd.kernel.netlink_ports import CONCAT_USERDATA, key_type
from egressd.kernel.netlink_proto import (
    NFT_MSG_DELSETELEM,
    NFT_MSG_NEWRULE,
    NFT_MSG_NEWSET,
    NFT_MSG_NEWSETELEM,
    NFTA_DATA_VALUE,
    NFTA_EXPR_DATA,
    NFTA_EXPR_NAME,
    NFTA_RULE_EXPRESSIONS,
    NFTA_SET_DESC,
    NFTA_SET_ELEM_EXPIRATION,
    NFTA_SET_ELEM_KEY,
    NFTA_SET_ELEM_KEY_END,
    NFTA_SET_ELEM_LIST_ELEMENTS,
    NFTA_SET_ELEM_TIMEOUT,
    NFTA_SET_FLAGS,
    NFTA_SET_KEY_LEN,
    NFTA_SET_KEY_TYPE,
    NFTA_SET_TIMEOUT,
    NFTA_SET_USERDATA,
    _attrs,
    _list,
)
from egressd.kernel.ops import (
    AddPortElems,
    AddRule,
    AddSet,
    DeletePortElems,
    L4Guard,
    MatchRule,
    NetlinkBatch,
    PortRule,
    RuleAction,
)

NET = ipaddress.ip_network


def _u32(b: bytes) -> int:
    return int(struct.unpack(">I", b[:4])[0])


def test_a_port_set_declares_the_concatenation_as_nft_does() -> None:
    [(kind, _flags, body)] = netlink_batch.encode_op(
        "T", AddSet("p", "v6", "timeout", 360, size=8192, ports=True)
    )
    assert kind == NFT_MSG_NEWSET
    a = _attrs(body)
    assert _u32(a[NFTA_SET_FLAGS]) == 0x94  # interval | timeout | concat
    assert _u32(a[NFTA_SET_KEY_TYPE]) == 0x830D == key_type("v6")  # ipv6_addr . inet_proto . inet_service
    assert _u32(a[NFTA_SET_KEY_LEN]) == 24  # 16 + 4 + 4: each field padded to a register
    assert struct.unpack(">Q", a[NFTA_SET_TIMEOUT])[0] == 360_000
    desc = _attrs(a[NFTA_SET_DESC])
    assert _u32(desc[1]) == 8192  # NFTA_SET_DESC_SIZE
    lens = [_u32(_attrs(f)[1]) for f in _list(desc[2])]  # NFTA_SET_DESC_CONCAT field lengths
    assert lens == [16, 1, 2]
    assert a[NFTA_SET_USERDATA] == CONCAT_USERDATA
    plain = _attrs(netlink_batch.encode_op("T", AddSet("q", "v4", "interval", ports=True))[0][2])
    assert _u32(plain[NFTA_SET_FLAGS]) == 0x84 and _u32(plain[NFTA_SET_KEY_TYPE]) == 0x730D
    assert _u32(plain[NFTA_SET_KEY_LEN]) == 12 and NFTA_SET_TIMEOUT not in plain


def test_an_element_is_a_key_and_an_inclusive_key_end() -> None:
    op = AddPortElems("p", "v4", ((NET("10.0.0.0/8"), "udp", 1000, 2000),), (30,))
    [(kind, _flags, body)] = netlink_batch.encode_op("T", op)
    assert kind == NFT_MSG_NEWSETELEM
    [elem] = _list(_attrs(body)[NFTA_SET_ELEM_LIST_ELEMENTS])
    e = _attrs(elem)
    assert struct.unpack(">Q", e[NFTA_SET_ELEM_TIMEOUT])[0] == 30_000
    assert struct.unpack(">Q", e[NFTA_SET_ELEM_EXPIRATION])[0] == 30_000
    key = _attrs(e[NFTA_SET_ELEM_KEY])[NFTA_DATA_VALUE]
    end = _attrs(e[NFTA_SET_ELEM_KEY_END])[NFTA_DATA_VALUE]
    # What nft 1.0.6 sends for "10.0.0.0/8 . udp . 1000-2000" (nft --debug=mnl).
    assert key == bytes.fromhex("0a0000001100000003e80000")
    assert end == bytes.fromhex("0affffff1100000007d00000")
    [(dkind, _f, dbody)] = netlink_batch.encode_op("T", DeletePortElems("p", "v4", op.elems))
    assert dkind == NFT_MSG_DELSETELEM
    [delem] = _list(_attrs(dbody)[NFTA_SET_ELEM_LIST_ELEMENTS])
    assert NFTA_SET_ELEM_TIMEOUT not in _attrs(delem) and _attrs(delem)[NFTA_SET_ELEM_KEY_END]


def _exprs(rule: PortRule | MatchRule) -> list[tuple[str, dict[int, bytes]]]:
    [(kind, _flags, body)] = netlink_batch.encode_op("T", AddRule("c", rule))
    assert kind == NFT_MSG_NEWRULE
    out = []
    for e in _list(_attrs(body)[NFTA_RULE_EXPRESSIONS]):
        a = _attrs(e)
        out.append((a[NFTA_EXPR_NAME].rstrip(b"\0").decode(), _attrs(a[NFTA_EXPR_DATA])))
    return out


def test_a_port_rule_loads_address_protocol_and_port_into_consecutive_registers() -> None:
    # nft --debug=netlink: meta nfproto, cmp, payload => reg 1, meta l4proto => reg 9,
    # byteorder reg 9 = hton(reg 9, 2, 1), payload @ transport + 2 => reg 10, lookup reg 1.
    v4 = _exprs(PortRule("v4", "p", RuleAction.MARK))
    assert [n for n, _ in v4] == [
        "meta",
        "cmp",
        "payload",
        "meta",
        "byteorder",
        "payload",
        "lookup",
        "immediate",
        "meta",
    ]
    assert _u32(v4[3][1][1]) == 9 and _u32(v4[3][1][2]) == 16  # dreg 9, key l4proto
    bo = v4[4][1]
    assert [_u32(bo[k]) for k in (1, 2, 3, 4, 5)] == [9, 9, 1, 1, 2]  # sreg, dreg, hton, len, size
    assert _u32(v4[5][1][1]) == 10 and _u32(v4[5][1][2]) == 2  # dreg 10, transport header
    # IPv6: the address fills register 1 (128 bits); the protocol goes to register 2, the port to 13.
    v6 = _exprs(PortRule("v6", "p", RuleAction.DROP, drop_chain="denied"))
    assert _u32(v6[3][1][1]) == 2 and _u32(v6[5][1][1]) == 13
    # The intercepted path: conntrack's original destination and port.
    ct = _exprs(PortRule("v4", "p", RuleAction.ACCEPT, ct_original=True))
    assert [n for n, _ in ct] == ["ct", "meta", "byteorder", "ct", "lookup", "immediate"]
    assert _u32(ct[3][1][2]) == 12 and ct[3][1][3] == b"\0"  # NFT_CT_PROTO_DST, original


def test_the_quic_guards_follow_the_address_lookup() -> None:
    not_udp = _exprs(MatchRule("v4", "d", RuleAction.MARK, guard=L4Guard.NOT_UDP))
    assert [n for n, _ in not_udp][4:] == ["meta", "cmp", "immediate", "meta"]
    udp_not_443 = _exprs(MatchRule("v4", "d", RuleAction.MARK, guard=L4Guard.UDP_NOT_443))
    assert [n for n, _ in udp_not_443][4:] == ["meta", "cmp", "payload", "cmp", "immediate", "meta"]
    assert _attrs(udp_not_443[7][1][3])[NFTA_DATA_VALUE] == b"\x01\xbb"  # port 443, network order


def test_the_port_objects_render_as_nft_lists_them() -> None:
    batch = NetlinkBatch(
        "T",
        (
            AddSet("p", "v4", "timeout", 360, size=8192, ports=True),
            AddRule("c", PortRule("v4", "p", RuleAction.DROP, drop_chain="denied")),
            AddRule("c", PortRule("v6", "p6", RuleAction.ACCEPT, ct_original=True)),
            AddRule("c", MatchRule("v4", "d", RuleAction.MARK, guard=L4Guard.UDP_NOT_443)),
            AddPortElems(
                "p",
                "v4",
                ((NET("10.0.0.0/8"), "tcp", 5432, 5433), (NET("1.2.3.4/32"), "udp", 443, 443)),
                (9, 9),
            ),
            DeletePortElems("p", "v4", ((NET("1.2.3.4/32"), "udp", 443, 443),)),
        ),
    )
    assert batch.describe().splitlines() == [
        "add set inet T p { type ipv4_addr . inet_proto . inet_service; flags interval,timeout; timeout 360s; size 8192; }",
        "add rule inet T c ip daddr . meta l4proto . th dport @p goto denied",
        "add rule inet T c ct original ip6 daddr . meta l4proto . ct original proto-dst @p6 accept",
        "add rule inet T c ip daddr @d udp dport != 443 meta mark set 0x2",
        "add element inet T p { 10.0.0.0/8 . tcp . 5432-5433 timeout 9s expires 9s, 1.2.3.4 . udp . 443 timeout 9s expires 9s }",
        "delete element inet T p { 1.2.3.4 . udp . 443 }",
    ]
    assert batch.weight() == 6 + 3
