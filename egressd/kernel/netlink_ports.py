"""The port-scoped objects of docs/reference/behaviour.md §18 as nf_tables attributes, encoded as nft
1.0.6 encodes them (checked against ``nft --debug=netlink`` and the kernel's own listing in
tests/kernel/test_ports_load.py): sets keyed ``ipv4_addr|ipv6_addr . inet_proto . inet_service``
(``flags interval[,timeout]``, the kernel's pipapo set), their elements (a key and a key end,
both inclusive), and the rules that look them up. Pure.

Key layout (each field padded to a 4-byte register, as a concatenation is loaded): the address
(network byte order), the protocol number in the first byte, the port in network byte order.
"""

from __future__ import annotations

import struct

from egressd.kernel.netlink_proto import (
    NFPROTO_IPV4,
    NFPROTO_IPV6,
    NFT_BYTEORDER_HTON,
    NFT_CMP_EQ,
    NFT_CMP_NEQ,
    NFT_CT_DST_IP,
    NFT_CT_DST_IP6,
    NFT_CT_PROTO_DST,
    NFT_DATATYPE_INET_PROTOCOL,
    NFT_DATATYPE_INET_SERVICE,
    NFT_DATATYPE_IP6ADDR,
    NFT_DATATYPE_IPADDR,
    NFT_DATATYPE_TYPE_BITS,
    NFT_META_L4PROTO,
    NFT_META_NFPROTO,
    NFT_PAYLOAD_NETWORK_HEADER,
    NFT_PAYLOAD_TRANSPORT_HEADER,
    NFT_REG32_01,
    NFT_REG32_02,
    NFT_REG32_05,
    NFT_REG_1,
    NFT_REG_2,
    NFTA_BYTEORDER_DREG,
    NFTA_BYTEORDER_LEN,
    NFTA_BYTEORDER_OP,
    NFTA_BYTEORDER_SIZE,
    NFTA_BYTEORDER_SREG,
    NFTA_CMP_DATA,
    NFTA_CMP_OP,
    NFTA_CMP_SREG,
    NFTA_CT_DIRECTION,
    NFTA_CT_DREG,
    NFTA_CT_KEY,
    NFTA_EXPR_DATA,
    NFTA_EXPR_NAME,
    NFTA_LIST_ELEM,
    NFTA_LOOKUP_SET,
    NFTA_LOOKUP_SREG,
    NFTA_META_DREG,
    NFTA_META_KEY,
    NFTA_PAYLOAD_BASE,
    NFTA_PAYLOAD_DREG,
    NFTA_PAYLOAD_LEN,
    NFTA_PAYLOAD_OFFSET,
    NFTA_SET_DESC_CONCAT,
    NFTA_SET_ELEM_EXPIRATION,
    NFTA_SET_ELEM_KEY,
    NFTA_SET_ELEM_KEY_END,
    NFTA_SET_ELEM_TIMEOUT,
    NFTA_SET_FIELD_LEN,
    NFTA_SET_USERDATA,
    _attr,
    _data_value,
    _nest,
    _str,
    _u32,
    _u64,
)
from egressd.kernel.ops import L4_PROTOCOLS, L4Guard, PortElem, PortRule, RangeRule

#: The set's user data nft 1.0.6 attaches to every ``addr . inet_proto . inet_service`` set
#: (libnftnl TLVs: key byte order "invalid" for a concatenation, then the concatenation's
#: sub-key description). The kernel stores it for ``nft list``; it never reads it.
CONCAT_USERDATA = bytes.fromhex("000400000000030800040d0000000100")


def addr_len(fam: str) -> int:
    return 4 if fam == "v4" else 16


def key_type(fam: str) -> int:
    """The concatenation's datatype id: the fields' ids, each shifted by TYPE_BITS."""
    addr = NFT_DATATYPE_IPADDR if fam == "v4" else NFT_DATATYPE_IP6ADDR
    bits = NFT_DATATYPE_TYPE_BITS
    return (addr << 2 * bits) | (NFT_DATATYPE_INET_PROTOCOL << bits) | NFT_DATATYPE_INET_SERVICE


def key_len(fam: str) -> int:
    return addr_len(fam) + 4 + 4


def desc_concat(fam: str) -> bytes:
    """NFTA_SET_DESC_CONCAT: the field lengths (address, protocol, port), unpadded."""
    fields = (addr_len(fam), 1, 2)
    return _nest(
        NFTA_SET_DESC_CONCAT,
        *(_nest(NFTA_LIST_ELEM, _u32(NFTA_SET_FIELD_LEN, n)) for n in fields),
    )


def set_userdata() -> bytes:
    return _attr(NFTA_SET_USERDATA, CONCAT_USERDATA)


def _key_bytes(addr: int, fam: str, proto: str, port: int) -> bytes:
    return (
        addr.to_bytes(addr_len(fam), "big")
        + bytes([L4_PROTOCOLS[proto]])
        + b"\0\0\0"
        + struct.pack(">H", port)
        + b"\0\0"
    )


#: ``inet_proto . inet_service``: the key of a :class:`RangeRule`'s services set.
SERVICES_KEY_TYPE = (NFT_DATATYPE_INET_PROTOCOL << NFT_DATATYPE_TYPE_BITS) | NFT_DATATYPE_INET_SERVICE
SERVICES_KEY_LEN = 8


def services_desc_concat() -> bytes:
    """NFTA_SET_DESC_CONCAT of ``inet_proto . inet_service``: 1 and 2 bytes, unpadded."""
    return _nest(NFTA_SET_DESC_CONCAT, *(_nest(NFTA_LIST_ELEM, _u32(NFTA_SET_FIELD_LEN, n)) for n in (1, 2)))


def _service_bytes(proto: str, port: int) -> bytes:
    return bytes([L4_PROTOCOLS[proto]]) + b"\0\0\0" + struct.pack(">H", port) + b"\0\0"


def service_keys(elem: tuple[str, int, int]) -> bytes:
    """NFTA_SET_ELEM_KEY and NFTA_SET_ELEM_KEY_END (inclusive) of ``proto . lo-hi``."""
    proto, lo, hi = elem
    if not 0 <= lo <= hi <= 0xFFFF:
        raise ValueError(f"bad port range {lo}-{hi}")
    return _data_value(NFTA_SET_ELEM_KEY, _service_bytes(proto, lo)) + _data_value(
        NFTA_SET_ELEM_KEY_END, _service_bytes(proto, hi)
    )


def elem_keys(elem: PortElem, fam: str, *, exact: bool = False) -> bytes:
    """NFTA_SET_ELEM_KEY and NFTA_SET_ELEM_KEY_END of one element (the end is inclusive);
    ``exact`` (a hash set): the key alone, and the element must be one address and one port."""
    net, proto, lo, hi = elem
    if (net.version == 4) != (fam == "v4"):
        raise ValueError(f"{net} is not an {fam} prefix")
    if not 0 <= lo <= hi <= 0xFFFF:
        raise ValueError(f"bad port range {lo}-{hi}")
    if exact:
        if lo != hi or net.prefixlen != net.max_prefixlen:
            raise ValueError(f"{net} . {proto} . {lo}-{hi} is not one address and one port")
        return _data_value(NFTA_SET_ELEM_KEY, _key_bytes(int(net.network_address), fam, proto, lo))
    start = _key_bytes(int(net.network_address), fam, proto, lo)
    end = _key_bytes(int(net.broadcast_address), fam, proto, hi)
    return _data_value(NFTA_SET_ELEM_KEY, start) + _data_value(NFTA_SET_ELEM_KEY_END, end)


def timed_elem(elem: PortElem, fam: str, seconds: int, *, exact: bool = False) -> bytes:
    """A port-scoped lease element: timeout and expiration first, as nft sends them."""
    ms = seconds * 1000
    keys = elem_keys(elem, fam, exact=exact)
    return _u64(NFTA_SET_ELEM_TIMEOUT, ms) + _u64(NFTA_SET_ELEM_EXPIRATION, ms) + keys


# ---- rules ---------------------------------------------------------------------------------


def _expr(name: str, *attrs: bytes) -> bytes:
    return _nest(NFTA_LIST_ELEM, _str(NFTA_EXPR_NAME, name), _nest(NFTA_EXPR_DATA, *attrs))


def _meta(key: int, dreg: int) -> bytes:
    return _expr("meta", _u32(NFTA_META_DREG, dreg), _u32(NFTA_META_KEY, key))


def _cmp(op: int, data: bytes, sreg: int = NFT_REG_1) -> bytes:
    return _expr("cmp", _u32(NFTA_CMP_SREG, sreg), _u32(NFTA_CMP_OP, op), _data_value(NFTA_CMP_DATA, data))


def _payload(base: int, offset: int, length: int, dreg: int) -> bytes:
    return _expr(
        "payload",
        _u32(NFTA_PAYLOAD_DREG, dreg),
        _u32(NFTA_PAYLOAD_BASE, base),
        _u32(NFTA_PAYLOAD_OFFSET, offset),
        _u32(NFTA_PAYLOAD_LEN, length),
    )


def _ct(key: int, dreg: int) -> bytes:
    return _expr("ct", _u32(NFTA_CT_DREG, dreg), _u32(NFTA_CT_KEY, key), _attr(NFTA_CT_DIRECTION, b"\0"))


def _registers(fam: str) -> tuple[int, int]:
    """Where nft puts the protocol and the port after the address (register 1): the next
    32-bit registers, addressed as a 128-bit one where it starts one (v6: register 2)."""
    return (NFT_REG32_01, NFT_REG32_02) if fam == "v4" else (NFT_REG_2, NFT_REG32_05)


def port_key_expressions(rule: PortRule) -> list[bytes]:
    """Load ``addr . l4proto . dport`` into registers 1.. and look it up in the rule's set."""
    proto_reg, port_reg = _registers(rule.fam)
    if rule.ct_original:
        addr = [_ct(NFT_CT_DST_IP if rule.fam == "v4" else NFT_CT_DST_IP6, NFT_REG_1)]
        port = _ct(NFT_CT_PROTO_DST, port_reg)
    else:
        nfproto = NFPROTO_IPV4 if rule.fam == "v4" else NFPROTO_IPV6
        offset = 16 if rule.fam == "v4" else 24
        addr = [
            _meta(NFT_META_NFPROTO, NFT_REG_1),
            _cmp(NFT_CMP_EQ, bytes([nfproto])),
            _payload(NFT_PAYLOAD_NETWORK_HEADER, offset, addr_len(rule.fam), NFT_REG_1),
        ]
        port = _payload(NFT_PAYLOAD_TRANSPORT_HEADER, 2, 2, port_reg)
    lookup = _expr("lookup", _str(NFTA_LOOKUP_SET, rule.set_name), _u32(NFTA_LOOKUP_SREG, NFT_REG_1))
    if rule.exact:  # a hash set's lookup: nft 1.0.6 loads the protocol as it is
        return [*addr, _meta(NFT_META_L4PROTO, proto_reg), port, lookup]
    return [*addr, _meta(NFT_META_L4PROTO, proto_reg), _proto_hton(proto_reg), port, lookup]


def range_rule_expressions(rule: RangeRule, daddr_lookup: list[bytes]) -> list[bytes]:
    """After ``daddr_lookup`` (the address in register 1, looked up in the rule's address
    set): load ``l4proto . dport`` into registers 1 and 9 and look it up in its services set,
    as nft 1.0.6 emits ``ip daddr @a meta l4proto . th dport @b``."""
    if rule.ct_original:
        port = _ct(NFT_CT_PROTO_DST, NFT_REG32_01)
    else:
        port = _payload(NFT_PAYLOAD_TRANSPORT_HEADER, 2, 2, NFT_REG32_01)
    lookup = _expr("lookup", _str(NFTA_LOOKUP_SET, rule.services), _u32(NFTA_LOOKUP_SREG, NFT_REG_1))
    return [*daddr_lookup, _meta(NFT_META_L4PROTO, NFT_REG_1), _proto_hton(NFT_REG_1), port, lookup]


def _proto_hton(reg: int) -> bytes:
    """The 1-byte protocol goes through a byteorder step in an interval set's concatenation
    (what nft emits)."""
    return _expr(
        "byteorder",
        _u32(NFTA_BYTEORDER_SREG, reg),
        _u32(NFTA_BYTEORDER_DREG, reg),
        _u32(NFTA_BYTEORDER_OP, NFT_BYTEORDER_HTON),
        _u32(NFTA_BYTEORDER_LEN, 1),
        _u32(NFTA_BYTEORDER_SIZE, 2),
    )


def guard_expressions(guard: L4Guard) -> list[bytes]:
    """``meta l4proto != udp`` or ``udp dport != 443``, after the address lookup."""
    udp = bytes([L4_PROTOCOLS["udp"]])
    l4 = _meta(NFT_META_L4PROTO, NFT_REG_1)
    if guard is L4Guard.NOT_UDP:
        return [l4, _cmp(NFT_CMP_NEQ, udp)]
    if guard is L4Guard.UDP_NOT_443:
        dport = _payload(NFT_PAYLOAD_TRANSPORT_HEADER, 2, 2, NFT_REG_1)
        return [l4, _cmp(NFT_CMP_EQ, udp), dport, _cmp(NFT_CMP_NEQ, struct.pack(">H", 443))]
    return []
