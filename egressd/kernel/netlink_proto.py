"""The netlink and nfnetlink framing egressd's nf_tables encoder builds on: the uapi constants
(``linux/netlink.h``, ``linux/netfilter/nfnetlink.h``, ``linux/netfilter/nf_tables.h``), attribute
and message-header encoding and decoding, and :class:`NetlinkError`. Pure: bytes in, bytes out."""

from __future__ import annotations

import errno
import os
import struct

NETLINK_NETFILTER = 12
NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4
NLM_F_EXCL = 0x200
NLM_F_CREATE = 0x400
NLM_F_APPEND = 0x800
NLMSG_ERROR = 0x2
NLMSG_DONE = 0x3
NLM_F_DUMP = 0x300
NLA_TYPE_MASK = 0x3FFF  # without NLA_F_NESTED / NLA_F_NET_BYTEORDER
NLA_F_NESTED = 0x8000

# nla_len is a u16 that counts the 4-byte header: no attribute, nested ones included, may
# be longer. A policy of a few thousand prefixes overflows it in one element list.
NLA_MAX_LEN = 0xFFFF

NFNL_SUBSYS_NFTABLES = 10
NFNL_MSG_BATCH_BEGIN = 0x10
NFNL_MSG_BATCH_END = 0x11
NFPROTO_INET = 1

NFT_MSG_NEWCHAIN = 3
NFT_MSG_DELCHAIN = 5
NFT_MSG_NEWRULE = 6
NFT_MSG_DELRULE = 8
NFT_MSG_NEWSET = 9
NFT_MSG_DELSET = 11
NFT_MSG_NEWSETELEM = 12
NFT_MSG_GETSETELEM = 13
NFT_MSG_DELSETELEM = 14
NFT_MSG_NEWOBJ = 18
NFT_MSG_GETOBJ = 19
NFT_MSG_DELOBJ = 20

NFTA_LIST_ELEM = 1
NFTA_CHAIN_TABLE, NFTA_CHAIN_NAME = 1, 3
NFTA_RULE_TABLE, NFTA_RULE_CHAIN, NFTA_RULE_EXPRESSIONS = 1, 2, 4
NFTA_SET_TABLE, NFTA_SET_NAME, NFTA_SET_FLAGS, NFTA_SET_KEY_TYPE, NFTA_SET_KEY_LEN = 1, 2, 3, 4, 5
NFTA_SET_DESC, NFTA_SET_ID, NFTA_SET_TIMEOUT = 9, 10, 11
NFTA_SET_DESC_SIZE = 1
NFT_SET_INTERVAL, NFT_SET_TIMEOUT = 0x4, 0x10
NFT_DATATYPE_IPADDR, NFT_DATATYPE_IP6ADDR = 7, 8  # nftables' datatype ids: ipv4_addr, ipv6_addr
NFTA_SET_ELEM_DATA = 2
NFTA_VERDICT_CHAIN = 2
NFT_JUMP, NFT_GOTO = -3, -4
NFTA_SET_ELEM_LIST_TABLE, NFTA_SET_ELEM_LIST_SET, NFTA_SET_ELEM_LIST_ELEMENTS = 1, 2, 3
NFTA_SET_ELEM_KEY, NFTA_SET_ELEM_FLAGS, NFTA_SET_ELEM_TIMEOUT, NFTA_SET_ELEM_EXPIRATION = 1, 3, 4, 5
NFTA_SET_ELEM_OBJREF = 9  # after NFTA_SET_ELEM_PAD (8)
NFT_SET_ELEM_INTERVAL_END = 0x1
NFTA_EXPR_NAME, NFTA_EXPR_DATA = 1, 2
NFTA_DATA_VALUE, NFTA_DATA_VERDICT = 1, 2
NFTA_VERDICT_CODE = 1
NFTA_META_DREG, NFTA_META_KEY, NFTA_META_SREG = 1, 2, 3
NFTA_CMP_SREG, NFTA_CMP_OP, NFTA_CMP_DATA = 1, 2, 3
NFTA_PAYLOAD_DREG, NFTA_PAYLOAD_BASE, NFTA_PAYLOAD_OFFSET, NFTA_PAYLOAD_LEN = 1, 2, 3, 4
NFTA_LOOKUP_SET, NFTA_LOOKUP_SREG, NFTA_LOOKUP_FLAGS = 1, 2, 5
NFT_LOOKUP_F_INV = 1
NFTA_IMMEDIATE_DREG, NFTA_IMMEDIATE_DATA = 1, 2
NFTA_CT_DREG, NFTA_CT_KEY, NFTA_CT_DIRECTION = 1, 2, 3
NFTA_BITWISE_SREG, NFTA_BITWISE_DREG, NFTA_BITWISE_LEN, NFTA_BITWISE_MASK, NFTA_BITWISE_XOR = 1, 2, 3, 4, 5
NFTA_LOG_PREFIX = 2
NFTA_OBJREF_IMM_TYPE, NFTA_OBJREF_IMM_NAME = 1, 2
NFTA_OBJ_TABLE, NFTA_OBJ_NAME, NFTA_OBJ_TYPE, NFTA_OBJ_DATA = 1, 2, 3, 4
NFTA_COUNTER_BYTES, NFTA_COUNTER_PACKETS = 1, 2
NFT_OBJECT_COUNTER = 1
NFT_CT_STATE = 0
NF_CT_STATE_NEW = 1 << (2 + 1)  # NF_CT_STATE_BIT(IP_CT_NEW)
LOG_PREFIX_MAX = 127  # NF_LOG_PREFIXLEN - 1: the kernel refuses longer prefixes

NFT_REG_VERDICT, NFT_REG_1 = 0, 1
NFT_META_MARK, NFT_META_NFPROTO = 3, 15
NFT_CT_DST_IP, NFT_CT_DST_IP6 = 0x14, 0x16
NFT_PAYLOAD_NETWORK_HEADER = 1
NFT_CMP_EQ, NFT_CMP_NEQ = 0, 1
NF_DROP, NF_ACCEPT = 0, 1
NFPROTO_IPV4, NFPROTO_IPV6 = 2, 10


class NetlinkError(RuntimeError):
    """The kernel refused the batch (nothing of it was applied)."""

    def __init__(self, code: int, op: str) -> None:
        self.code = code
        self.op = op
        super().__init__(f"{os.strerror(code)} ({errno.errorcode.get(code, code)}) at: {op}")


# ---- attribute encoding (pure) -------------------------------------------------------------


def _attr(kind: int, payload: bytes) -> bytes:
    length = 4 + len(payload)
    if length > NLA_MAX_LEN:
        # struct.pack would raise a bare struct.error; name the limit instead.
        raise ValueError(f"netlink attribute {kind & NLA_TYPE_MASK} is {length} bytes (limit {NLA_MAX_LEN})")
    return struct.pack("=HH", length, kind) + payload + b"\0" * (-length % 4)


def _nest(kind: int, *children: bytes) -> bytes:
    return _attr(kind | NLA_F_NESTED, b"".join(children))


def _u32(kind: int, value: int) -> bytes:
    return _attr(kind, struct.pack(">I", value))


def _u64(kind: int, value: int) -> bytes:
    return _attr(kind, struct.pack(">Q", value))


def _str(kind: int, value: str) -> bytes:
    return _attr(kind, value.encode() + b"\0")


def _data_value(kind: int, value: bytes) -> bytes:
    return _nest(kind, _attr(NFTA_DATA_VALUE, value))


def _nlmsg(msg_type: int, flags: int, seq: int, family: int, res_id: int, body: bytes) -> bytes:
    payload = struct.pack("=BB", family, 0) + struct.pack(">H", res_id) + body
    return struct.pack("=IHHII", 16 + len(payload), msg_type, flags, seq, 0) + payload


# ---- attribute decoding (pure) -------------------------------------------------------------


def _list(data: bytes) -> list[bytes]:
    """The children of a nested list attribute, in order (``_attrs`` would keep only the last)."""
    out: list[bytes] = []
    off = 0
    while off + 4 <= len(data):
        length, _kind = struct.unpack_from("=HH", data, off)
        if length < 4:
            break
        out.append(data[off + 4 : off + length])
        off += (length + 3) & ~3
    return out


def _attrs(data: bytes) -> dict[int, bytes]:
    out: dict[int, bytes] = {}
    off = 0
    while off + 4 <= len(data):
        length, kind = struct.unpack_from("=HH", data, off)
        if length < 4:
            break
        out[kind & NLA_TYPE_MASK] = data[off + 4 : off + length]
        off += (length + 3) & ~3
    return out

# ---- port-scoped sets and rules (docs/reference/behaviour.md §18) ------------------------------
NFT_SET_CONCAT = 0x80
NFTA_SET_USERDATA = 13
NFTA_SET_DESC_CONCAT = 2
NFTA_SET_FIELD_LEN = 1
NFTA_SET_ELEM_KEY_END = 10
# nftables' datatype ids, and how a concatenation's type is numbered (each field shifted by
# TYPE_BITS, in key order): ``ipv4_addr . inet_proto . inet_service``.
NFT_DATATYPE_INET_PROTOCOL, NFT_DATATYPE_INET_SERVICE = 12, 13
NFT_DATATYPE_TYPE_BITS = 6
NFT_META_L4PROTO = 16
NFT_CT_PROTO_DST = 12
NFT_PAYLOAD_TRANSPORT_HEADER = 2
NFTA_BYTEORDER_SREG, NFTA_BYTEORDER_DREG, NFTA_BYTEORDER_OP = 1, 2, 3
NFTA_BYTEORDER_LEN, NFTA_BYTEORDER_SIZE = 4, 5
NFT_BYTEORDER_HTON = 1
NFT_REG_2 = 2
NFT_REG32_01, NFT_REG32_02, NFT_REG32_05 = 9, 10, 13
