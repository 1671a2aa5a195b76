"""Probe-only netlink pieces for issue 28's design note (docs/concepts/ruleset.md, "Design note: shared sets"): a fleet
whose subjects share six table-wide sets keyed by ``source address . destination`` instead of
owning six sets each (fleet_levers.py, variant ``shared``).

The kernel finds a set by name by walking the table's list of sets, so today every
transaction that names a subject's set costs a walk over 6 sets per subject. Chains and
objects (counters) are found through hash tables. Here a subject keeps its chains, rules,
counters and dispatch keys, but its rules look up ``ip saddr . ip daddr`` (``ip6 ...`` for
a v6 subject) in the shared sets, and its policy and leases are elements keyed by its source
address: a subject's change names a constant number of sets, whatever the fleet's size.

Nothing here is used by the daemon; egressd's encoder is reused for everything it already
encodes (chains, counters, map keys), and only the shared sets' elements and the rules that
read them are encoded here.
"""

from __future__ import annotations

import ipaddress
import itertools
import socket
import struct
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from egressd.kernel.netlink import NETLINK_CAP_ACK, SOL_NETLINK
from egressd.kernel.netlink_batch import encode_op
from egressd.kernel.netlink_proto import (
    NETLINK_NETFILTER,
    NFNL_MSG_BATCH_BEGIN,
    NFNL_MSG_BATCH_END,
    NFNL_SUBSYS_NFTABLES,
    NFPROTO_INET,
    NFPROTO_IPV4,
    NFPROTO_IPV6,
    NFT_CMP_EQ,
    NFT_META_NFPROTO,
    NFT_MSG_DELSETELEM,
    NFT_MSG_NEWRULE,
    NFT_MSG_NEWSETELEM,
    NFT_PAYLOAD_NETWORK_HEADER,
    NFT_REG_1,
    NFTA_CMP_DATA,
    NFTA_CMP_OP,
    NFTA_CMP_SREG,
    NFTA_LOOKUP_SET,
    NFTA_LOOKUP_SREG,
    NFTA_META_DREG,
    NFTA_META_KEY,
    NFTA_PAYLOAD_BASE,
    NFTA_PAYLOAD_DREG,
    NFTA_PAYLOAD_LEN,
    NFTA_PAYLOAD_OFFSET,
    NFTA_RULE_CHAIN,
    NFTA_RULE_EXPRESSIONS,
    NFTA_RULE_TABLE,
    NFTA_SET_ELEM_EXPIRATION,
    NFTA_SET_ELEM_KEY,
    NFTA_SET_ELEM_LIST_ELEMENTS,
    NFTA_SET_ELEM_LIST_SET,
    NFTA_SET_ELEM_LIST_TABLE,
    NFTA_SET_ELEM_TIMEOUT,
    NLM_F_ACK,
    NLM_F_APPEND,
    NLM_F_CREATE,
    NLM_F_REQUEST,
    NLMSG_ERROR,
    NetlinkError,
)
from egressd.kernel.ops import NetlinkBatch

NFT_MSG_DESTROYSETELEM = 30  # delete, and no error for an element already gone (kernel 6.3+)
NFTA_SET_ELEM_KEY_END = 10  # the last key of a range in a concatenated interval set (pipapo)
NFT_REG_2 = 2  # a 16-byte register: the second field of a v6 concatenation
NFT_REG32_01 = 9  # the second 4-byte register: the second field of a v4 concatenation
NFTA_DATA_VALUE = 1

KINDS = ("allow", "deny", "dyn")
Net = ipaddress.IPv4Network | ipaddress.IPv6Network
Addr = ipaddress.IPv4Address | ipaddress.IPv6Address


def set_name(kind: str, fam: str, shard: int = 0) -> str:
    return f"sh{shard}_{kind}_{fam}"


def shard_of(nft_id: str, shards: int) -> int:
    """A subject's shard: stable, spread evenly (crc32, not Python's salted hash)."""
    return zlib.crc32(nft_id.encode()) % shards


def sets_script(table: str, *, dyn_size: int, shards: int = 1) -> str:
    """Six shared sets per shard (nft text: cache-free declarations)."""
    out = []
    for shard in range(shards):
        for fam, l3 in (("v4", "ip"), ("v6", "ip6")):
            key = f"typeof {l3} saddr . {l3} daddr"
            for kind in ("allow", "deny"):
                out.append(f"add set inet {table} {set_name(kind, fam, shard)} {{ {key}; flags interval; }}")
            out.append(
                f"add set inet {table} {set_name('dyn', fam, shard)} {{ {key}; flags timeout; timeout 360s; size {dyn_size}; }}"
            )
    return "\n".join(out) + "\n"


# ---- encoding --------------------------------------------------------------------------------


def _attr(kind: int, payload: bytes) -> bytes:
    raw = struct.pack("=HH", 4 + len(payload), kind) + payload
    return raw + b"\0" * (-len(raw) % 4)


def _nest(kind: int, *children: bytes) -> bytes:
    return _attr(kind | 0x8000, b"".join(children))


def _u32(kind: int, value: int) -> bytes:
    return _attr(kind, struct.pack(">I", value))


def _str(kind: int, value: str) -> bytes:
    return _attr(kind, value.encode() + b"\0")


def _expr(name: str, *attrs: bytes) -> bytes:
    return _nest(1, _str(1, name), _nest(2, *attrs))  # NFTA_LIST_ELEM { NAME, DATA }


def concat_lookup(fam: str, name: str) -> list[bytes]:
    """``ip saddr . ip daddr @name`` (``ip6`` for v6), as nft 1.0.6 encodes it in an inet table."""
    proto, (s_off, d_off, length), second = (
        (NFPROTO_IPV4, (12, 16, 4), NFT_REG32_01) if fam == "v4" else (NFPROTO_IPV6, (8, 24, 16), NFT_REG_2)
    )

    def load(offset: int, dreg: int) -> bytes:
        return _expr(
            "payload",
            _u32(NFTA_PAYLOAD_DREG, dreg),
            _u32(NFTA_PAYLOAD_BASE, NFT_PAYLOAD_NETWORK_HEADER),
            _u32(NFTA_PAYLOAD_OFFSET, offset),
            _u32(NFTA_PAYLOAD_LEN, length),
        )

    return [
        _expr("meta", _u32(NFTA_META_DREG, NFT_REG_1), _u32(NFTA_META_KEY, NFT_META_NFPROTO)),
        _expr(
            "cmp",
            _u32(NFTA_CMP_SREG, NFT_REG_1),
            _u32(NFTA_CMP_OP, NFT_CMP_EQ),
            _nest(NFTA_CMP_DATA, _attr(NFTA_DATA_VALUE, bytes([proto]))),
        ),
        load(s_off, NFT_REG_1),
        load(d_off, second),
        _expr("lookup", _str(NFTA_LOOKUP_SET, name), _u32(NFTA_LOOKUP_SREG, NFT_REG_1)),
    ]


@dataclass(frozen=True, slots=True)
class Msg:
    msg_type: int
    flags: int
    body: bytes


def rule(table: str, chain: str, exprs: Sequence[bytes]) -> Msg:
    body = _str(NFTA_RULE_TABLE, table) + _str(NFTA_RULE_CHAIN, chain) + _nest(NFTA_RULE_EXPRESSIONS, *exprs)
    return Msg(NFT_MSG_NEWRULE, NLM_F_CREATE | NLM_F_APPEND, body)


def _key(kind: int, src: Addr, dst: int) -> bytes:
    size = 4 if src.version == 4 else 16
    return _nest(kind, _attr(NFTA_DATA_VALUE, src.packed + dst.to_bytes(size, "big")))


def _elements(table: str, name: str, elems: Iterable[bytes]) -> bytes:
    nests = [_nest(i, e) for i, e in enumerate(elems, 1)]
    return (
        _str(NFTA_SET_ELEM_LIST_TABLE, table)
        + _str(NFTA_SET_ELEM_LIST_SET, name)
        + _nest(NFTA_SET_ELEM_LIST_ELEMENTS, *nests)
    )


def ranges(
    table: str, src: Addr, kind: str, nets: Sequence[Net], *, delete: bool = False, shard: int = 0
) -> list[Msg]:
    """Add (or delete) ``src . net`` ranges in a shared interval set; one message per 200."""
    fam = "v4" if src.version == 4 else "v6"
    mine = [n for n in nets if n.version == src.version]
    out = []
    for lo in range(0, len(mine), 200):
        elems = [
            _key(NFTA_SET_ELEM_KEY, src, int(n.network_address))
            + _key(NFTA_SET_ELEM_KEY_END, src, int(n.broadcast_address))
            for n in mine[lo : lo + 200]
        ]
        msg_type = NFT_MSG_DELSETELEM if delete else NFT_MSG_NEWSETELEM
        out.append(
            Msg(msg_type, 0 if delete else NLM_F_CREATE, _elements(table, set_name(kind, fam, shard), elems))
        )
    return out


def leases(
    table: str, src: Addr, addrs: Sequence[tuple[Addr, int]], *, destroy: bool = False, shard: int = 0
) -> list[Msg]:
    """Add ``src . addr`` leases to the shared dyn set, or destroy them (gone already is fine)."""
    fam = "v4" if src.version == 4 else "v6"
    mine = [(a, s) for a, s in addrs if a.version == src.version]
    if not mine:
        return []
    if destroy:
        elems = [_key(NFTA_SET_ELEM_KEY, src, int(a)) for a, _ in mine]
        return [Msg(NFT_MSG_DESTROYSETELEM, 0, _elements(table, set_name("dyn", fam, shard), elems))]
    elems = [
        _key(NFTA_SET_ELEM_KEY, src, int(a))
        + _attr(NFTA_SET_ELEM_TIMEOUT, struct.pack(">Q", s * 1000))
        + _attr(NFTA_SET_ELEM_EXPIRATION, struct.pack(">Q", s * 1000))
        for a, s in mine
    ]
    return [Msg(NFT_MSG_NEWSETELEM, NLM_F_CREATE, _elements(table, set_name("dyn", fam, shard), elems))]


@dataclass(slots=True)
class Raw:
    """One transaction of egressd ops and probe messages, in this order each."""

    table: str
    ops: NetlinkBatch | None = None
    msgs: list[Msg] = field(default_factory=list)
    after: list[Msg] = field(default_factory=list)  # probe messages after the ops

    def all_messages(self) -> list[Msg]:
        out = list(self.msgs)
        for op in self.ops.ops if self.ops is not None else ():
            out += [Msg(t, f, b) for t, f, b in encode_op(self.table, op)]
        return out + self.after


class RawSocket:
    """A NETLINK_NETFILTER socket that applies :class:`Raw` transactions (raises on any error)."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self._sock.setsockopt(SOL_NETLINK, NETLINK_CAP_ACK, 1)
        for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
            self._sock.setsockopt(socket.SOL_SOCKET, opt, 1 << 23)
        self._sock.bind((0, 0))
        self._sock.settimeout(120)
        self._seq = itertools.count(1 << 24)

    def run(self, txn: Raw) -> None:
        def nlmsg(msg_type: int, flags: int, seq: int, family: int, res_id: int, body: bytes) -> bytes:
            payload = struct.pack("=BB", family, 0) + struct.pack(">H", res_id) + body
            return struct.pack("=IHHII", 16 + len(payload), msg_type, flags, seq, 0) + payload

        parts = [nlmsg(NFNL_MSG_BATCH_BEGIN, NLM_F_REQUEST, next(self._seq), 0, NFNL_SUBSYS_NFTABLES, b"")]
        pending = set()
        for m in txn.all_messages():
            seq = next(self._seq)
            pending.add(seq)
            msg_type = (NFNL_SUBSYS_NFTABLES << 8) | m.msg_type
            parts.append(nlmsg(msg_type, NLM_F_REQUEST | NLM_F_ACK | m.flags, seq, NFPROTO_INET, 0, m.body))
        parts.append(nlmsg(NFNL_MSG_BATCH_END, NLM_F_REQUEST, next(self._seq), 0, NFNL_SUBSYS_NFTABLES, b""))
        self._sock.sendall(b"".join(parts))
        while pending:
            buf = self._sock.recv(1 << 20)
            off = 0
            while off + 16 <= len(buf):
                length, msg_type, _flags, seq, _pid = struct.unpack_from("=IHHII", buf, off)
                if msg_type == NLMSG_ERROR:
                    (code,) = struct.unpack_from("=i", buf, off + 16)
                    if code:
                        raise NetlinkError(-code, f"shared-set probe message {seq}")
                    pending.discard(seq)
                off += max(16, (length + 3) & ~3)

    def close(self) -> None:
        self._sock.close()
