"""Big inputs in one netlink batch (docs/reference/behaviour.md §14.5): element lists split below the u16
attribute limit into several messages between ONE BEGIN and ONE END, socket buffers sized
to the batch, and every answer of a many-message batch read and attributed."""

from __future__ import annotations

import errno
import json
import math
import socket
import struct
from ipaddress import IPv4Address, IPv6Address, IPv6Network
from typing import Any

import pytest

from egressd.fleetnft.contents import policy_swap
from egressd.kernel import netlink, netlink_batch, netlink_elements, netlink_proto
from egressd.kernel.ops import AddElements, AddIntervals, AddTimed, FlushSet, NetlinkBatch, Op
from egressd.policy import parse_policy
from tests.bigpolicy import big_policy

T = "opensandbox-fleet"
NESTED = netlink_proto.NLA_F_NESTED
NEWSETELEM = (netlink_proto.NFNL_SUBSYS_NFTABLES << 8) | netlink_proto.NFT_MSG_NEWSETELEM


def _messages(data: bytes) -> list[tuple[int, int, int, bytes]]:
    """(type, flags, seq, attributes) of every message of a batch."""
    out = []
    off = 0
    while off < len(data):
        length, mtype, flags, seq, _pid = struct.unpack_from("=IHHII", data, off)
        assert length >= 20 and off + length <= len(data)
        out.append((mtype, flags, seq, data[off + 20 : off + length]))
        off += (length + 3) & ~3
    assert off == len(data)
    return out


def _attr_lengths(buf: bytes) -> list[int]:
    """nla_len of every attribute, nested ones included (our nests carry NLA_F_NESTED)."""
    out = []
    off = 0
    while off + 4 <= len(buf):
        length, kind = struct.unpack_from("=HH", buf, off)
        assert length >= 4 and off + length <= len(buf), "attribute overruns its parent"
        out.append(length)
        if kind & NESTED:
            out += _attr_lengths(buf[off + 4 : off + length])
        off += (length + 3) & ~3
    return out


def _elements(body: bytes) -> list[tuple[int, bool]]:
    """(key, is interval end) of each element of one NEWSETELEM message, in order."""
    attrs = netlink_proto._attrs(body)
    out = []
    for raw in netlink_proto._list(attrs[netlink_proto.NFTA_SET_ELEM_LIST_ELEMENTS]):
        elem = netlink_proto._attrs(raw)
        key = netlink_proto._attrs(elem[netlink_proto.NFTA_SET_ELEM_KEY])[netlink_proto.NFTA_DATA_VALUE]
        flags = elem.get(netlink_proto.NFTA_SET_ELEM_FLAGS)
        end = bool(flags and struct.unpack(">I", flags)[0] & netlink_proto.NFT_SET_ELEM_INTERVAL_END)
        out.append((int.from_bytes(key, "big"), end))
    return out


def _set_name(body: bytes) -> str:
    return netlink_proto._attrs(body)[netlink_proto.NFTA_SET_ELEM_LIST_SET].rstrip(b"\0").decode()


def _cap_policy_batch() -> NetlinkBatch:
    policy = parse_policy(json.dumps(big_policy(4096, first=["10.204.0.2"], last=["fd00:204::9"])))
    return policy_swap(T, "s_u_1", policy, audit_objects=False)


# ---- the encoder (pure) ------------------------------------------------------------------------


def test_a_policy_at_the_cap_is_one_batch_of_split_messages_under_the_limits() -> None:
    batch = _cap_policy_batch()
    intervals = [op for op in batch.ops if isinstance(op, AddIntervals)]
    assert sum(len(op.nets) for op in intervals) == 4096  # every rule is its own element
    data, by_seq = netlink_batch.encode_batch(batch, 100)
    msgs = _messages(data)

    # Exactly one BEGIN first and one END last: the kernel commits all of it or nothing.
    kinds = [m[0] for m in msgs]
    assert kinds[0] == netlink_proto.NFNL_MSG_BATCH_BEGIN and kinds[-1] == netlink_proto.NFNL_MSG_BATCH_END
    assert (
        netlink_proto.NFNL_MSG_BATCH_BEGIN not in kinds[1:]
        and netlink_proto.NFNL_MSG_BATCH_END not in kinds[:-1]
    )
    # Consecutive seqs; every message between them is owned by an op and asks for an ACK.
    assert [m[2] for m in msgs] == list(range(100, 100 + len(msgs)))
    assert sorted(by_seq) == [m[2] for m in msgs[1:-1]]
    assert all(m[1] & netlink_proto.NLM_F_ACK for m in msgs[1:-1])
    assert len(msgs) - 2 > len(batch.ops)  # the element lists were split

    for _mtype, _flags, _seq, body in msgs:
        assert max(_attr_lengths(body), default=0) <= netlink_proto.NLA_MAX_LEN
        assert 20 + len(body) <= netlink_elements.ELEMENT_BYTES_PER_MESSAGE + 512

    for op in intervals:
        own = [m for m in msgs[1:-1] if by_seq[m[2]] is op]
        assert all(m[0] == NEWSETELEM and _set_name(m[3]) == op.name for m in own)
        chunks = [_elements(m[3]) for m in own]
        # Reassembled in order, the messages carry exactly the one-message element list.
        assert [e for c in chunks for e in c] == netlink_elements.interval_keys(op.nets, op.fam)
        # A range's start and end never straddle two messages.
        assert all(not c[0][1] for c in chunks[1:])
        elem_bytes = sum(
            len(netlink_proto._attrs(m[3])[netlink_proto.NFTA_SET_ELEM_LIST_ELEMENTS]) for m in own
        )
        least = math.ceil(elem_bytes / netlink_elements.ELEMENT_BYTES_PER_MESSAGE)
        assert least <= len(own) <= least + 1
    # The flushes stay single messages, in front of their refill.
    flushes = [op for op in batch.ops if isinstance(op, FlushSet)]
    assert all(sum(1 for s in by_seq if by_seq[s] is op) == 1 for op in flushes)


def test_every_element_flavour_splits() -> None:
    leases = tuple((IPv6Address("2001:db8::") + i, 300) for i in range(4096))
    keys = tuple(IPv4Address("10.0.0.0") + i for i in range(20_000))
    ops: list[Op] = [AddTimed("subj_s_u_1_dyn_v6", "v6", leases), AddElements("sandboxes_v4", keys)]
    data, by_seq = netlink_batch.encode_batch(NetlinkBatch(T, tuple(ops)), 1)
    msgs = _messages(data)[1:-1]
    for op, count in ((ops[0], len(leases)), (ops[1], len(keys))):
        own = [m for m in msgs if by_seq[m[2]] is op]
        assert len(own) > 1
        assert sum(len(_elements(m[3])) for m in own) == count
        assert all(max(_attr_lengths(m[3])) <= netlink_proto.NLA_MAX_LEN for m in own)
    got = [k for m in msgs if by_seq[m[2]] is ops[1] for k, _ in _elements(m[3])]
    assert got == [int(k) for k in keys]  # order kept across messages


def test_pack_groups_never_splits_a_group_and_keeps_order() -> None:
    g = [[b"a" * 12, b"b" * 12], [b"c" * 12], [b"d" * 28]]  # nests of 16, 16, 16 and 32 bytes
    assert netlink_elements.pack_groups(g, budget=32) == [[b"a" * 12, b"b" * 12], [b"c" * 12], [b"d" * 28]]
    assert netlink_elements.pack_groups(g, budget=48) == [[b"a" * 12, b"b" * 12, b"c" * 12], [b"d" * 28]]
    assert netlink_elements.pack_groups(g, budget=16) == [[b"a" * 12, b"b" * 12], [b"c" * 12], [b"d" * 28]]
    assert netlink_elements.pack_groups([], budget=16) == []


def test_an_empty_element_list_is_still_one_message() -> None:
    [(mtype, _flags, body)] = netlink_batch.encode_op(T, AddIntervals("s", "v4", ()))
    assert mtype == netlink_proto.NFT_MSG_NEWSETELEM and _elements(body) == []


def test_an_oversized_attribute_is_refused_by_name_not_struct_error() -> None:
    assert (
        len(netlink_proto._attr(1, b"x" * (netlink_proto.NLA_MAX_LEN - 4))) == netlink_proto.NLA_MAX_LEN + 1
    )
    with pytest.raises(ValueError, match="limit 65535"):
        netlink_proto._attr(1, b"x" * (netlink_proto.NLA_MAX_LEN - 3))


def test_buffer_sizes_cover_the_batch() -> None:
    snd, rcv = netlink.buffer_sizes(3_000_000, 5000)
    assert snd > 3_000_000
    assert rcv >= 5000 * netlink.ACK_TRUESIZE
    assert netlink.buffer_sizes(100, 1)[1] == netlink.MIN_RCVBUF


# ---- the socket shell, against a fake kernel ---------------------------------------------------


class FakeKernel:
    """Stands in for the NETLINK_NETFILTER socket: answers every message of a sent batch as
    the kernel does (one ACK or error each, queued before sendall returns)."""

    def __init__(self, *, force_allowed: bool = True, errors: dict[int, int] | None = None) -> None:
        self.force_allowed = force_allowed
        self.errors = errors or {}  # message index (0 = first op message) -> errno
        self.opts: dict[int, int] = {}
        self.sent: list[bytes] = []
        self.answers: list[bytes | OSError] = []
        self.recvs = 0

    def setsockopt(self, level: int, opt: int, value: int) -> None:
        if opt in (netlink.SO_SNDBUFFORCE, netlink.SO_RCVBUFFORCE) and not self.force_allowed:
            raise PermissionError(errno.EPERM, "Operation not permitted")
        plain = {netlink.SO_SNDBUFFORCE: socket.SO_SNDBUF, netlink.SO_RCVBUFFORCE: socket.SO_RCVBUF}
        self.opts[opt] = value
        self.opts[plain.get(opt, opt)] = value

    def getsockopt(self, level: int, opt: int) -> int:
        return 2 * self.opts.get(opt, 106_496)

    def bind(self, _addr: object) -> None:
        pass

    def settimeout(self, _t: float) -> None:
        pass

    def sendall(self, data: bytes) -> None:
        self.sent.append(data)
        for i, (_t, _f, seq, _b) in enumerate(_messages(data)[1:-1]):
            code = -self.errors.get(i, 0)
            self.answers.append(
                struct.pack("=IHHII", 36, netlink_proto.NLMSG_ERROR, 0, seq, 0)
                + struct.pack("=i", code)
                + bytes(16)
            )

    def recv(self, _n: int) -> bytes:
        self.recvs += 1
        if not self.answers:
            raise TimeoutError
        answer = self.answers.pop(0)
        if isinstance(answer, OSError):
            raise answer
        return answer

    def close(self) -> None:
        pass


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Any:
    def install(**kw: Any) -> FakeKernel:
        k = FakeKernel(**kw)
        monkeypatch.setattr("egressd.kernel.netlink.socket.socket", lambda *_a: k)
        return k

    return install


def test_a_batch_at_the_cap_reads_every_answer_and_sizes_both_buffers(fake: Any) -> None:
    k = fake()
    sock = netlink.NfTablesSocket()
    batch = _cap_policy_batch()
    sock.run(batch)
    [data] = k.sent
    msgs = _messages(data)
    assert k.recvs == len(msgs) - 2 and not k.answers  # every ACK consumed, none left behind
    assert k.opts[netlink.SO_SNDBUFFORCE] >= len(data)
    assert k.opts[netlink.SO_RCVBUFFORCE] >= (len(msgs) - 2) * netlink.ACK_TRUESIZE
    assert k.opts[netlink.NETLINK_CAP_ACK] == 1
    # The next batch starts after the last seq of this one: no answer can be mistaken.
    sock.run(NetlinkBatch(T, (FlushSet("x"),)))
    assert _messages(k.sent[1])[0][2] == msgs[-1][2] + 1


def test_a_refused_later_chunk_names_its_op_and_drains_the_rest(fake: Any) -> None:
    batch = _cap_policy_batch()
    _data, by_seq = netlink_batch.encode_batch(batch, 1)
    seqs = sorted(by_seq)
    # The second message of the biggest element op.
    op = max((o for o in batch.ops if isinstance(o, AddIntervals)), key=lambda o: len(o.nets))
    index = [s for s in seqs if by_seq[s] is op][1] - seqs[0]
    k = fake(errors={index: errno.EEXIST})
    sock = netlink.NfTablesSocket()
    with pytest.raises(netlink_proto.NetlinkError) as info:
        sock.run(batch)
    assert info.value.code == errno.EEXIST
    assert info.value.op == f"add element inet {T} {op.name} {{ <{len(op.nets)} prefixes> }}"
    assert not k.answers  # the answers after the error were read too


def test_without_force_privilege_the_plain_options_are_used(fake: Any) -> None:
    k = fake(force_allowed=False)
    sock = netlink.NfTablesSocket()
    nets = tuple(IPv6Network((0x20010DB8 << 96 | i << 64, 64)) for i in range(3000))
    sock.run(NetlinkBatch(T, (AddIntervals("s", "v6", nets),)))
    assert k.opts[socket.SO_SNDBUF] >= len(k.sent[0])
    assert netlink.SO_SNDBUFFORCE not in k.opts


def test_lost_answers_are_reported_as_lost(fake: Any) -> None:
    k = fake()
    sock = netlink.NfTablesSocket()
    k.sendall = lambda data: k.answers.append(OSError(errno.ENOBUFS, "No buffer space available"))
    with pytest.raises(netlink_proto.NetlinkError) as info:
        sock.run(NetlinkBatch(T, (FlushSet("x"),)))
    assert info.value.code == errno.ENOBUFS and "lost" in str(info.value)
