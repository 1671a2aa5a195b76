"""Probe-only netlink pieces for issue 16's "delete sets by handle" lever (fleet_levers.py).

egressd deletes a set by name (``NFTA_SET_NAME``): the kernel walks the table's list of sets
comparing names (``nft_set_lookup``, ``nla_strcmp`` = ``strlen`` + ``memcmp`` per set). With
``NFTA_SET_HANDLE`` it walks the same list comparing a u64 (``nft_set_lookup_byhandle``). The
lever was measured here and rejected (scripts/bench/results/report-fleet-2026-12-03.md, "Issue 16"), so egressd's own
encoder was left as it is; this module re-encodes an egressd batch's ``DELSET`` messages by
handle and sends it on its own socket. Nothing here is used by the daemon.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator, Mapping

from egressd.kernel.netlink import NETLINK_CAP_ACK, SOL_NETLINK
from egressd.kernel.netlink_batch import encode_batch
from egressd.kernel.netlink_proto import (
    NETLINK_NETFILTER,
    NFNL_SUBSYS_NFTABLES,
    NFPROTO_INET,
    NFT_MSG_DELSET,
    NFT_MSG_NEWSET,
    NFTA_SET_NAME,
    NFTA_SET_TABLE,
    NLM_F_DUMP,
    NLM_F_REQUEST,
    NLMSG_DONE,
    NLMSG_ERROR,
    NetlinkError,
)
from egressd.kernel.ops import NetlinkBatch

NFT_MSG_GETSET = 10
NFTA_SET_HANDLE = 16
DELSET_TYPE = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_DELSET
NEWSET_TYPE = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWSET
GETSET_TYPE = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETSET


def attr(kind: int, payload: bytes) -> bytes:
    raw = struct.pack("=HH", 4 + len(payload), kind) + payload
    return raw + b"\0" * (-len(raw) % 4)


def attrs(data: bytes) -> dict[int, bytes]:
    out: dict[int, bytes] = {}
    off = 0
    while off + 4 <= len(data):
        length, kind = struct.unpack_from("=HH", data, off)
        if length < 4:
            break
        out[kind & 0x3FFF] = data[off + 4 : off + length]
        off += (length + 3) & ~3
    return out


def messages(buf: bytes) -> Iterator[tuple[int, int, int, bytes]]:
    """(type, flags, seq, payload after the nlmsghdr) of each netlink message in ``buf``."""
    off = 0
    while off + 16 <= len(buf):
        length, msg_type, flags, seq, _pid = struct.unpack_from("=IHHII", buf, off)
        if length < 16:
            break
        yield msg_type, flags, seq, buf[off + 16 : off + length]
        off += (length + 3) & ~3


def by_handle(data: bytes, handles: Mapping[str, int]) -> bytes:
    """An encoded batch with each DELSET of a set in ``handles`` naming it by handle only
    (table + handle: the kernel takes the handle first when both are given, so the name is
    dropped to leave no doubt). Every other message is passed through unchanged."""
    out: list[bytes] = []
    for msg_type, flags, seq, payload in messages(data):
        if msg_type == DELSET_TYPE:
            a = attrs(payload[4:])
            name = a.get(NFTA_SET_NAME, b"").rstrip(b"\0").decode()
            if name in handles:
                payload = (
                    payload[:4]
                    + attr(NFTA_SET_TABLE, a[NFTA_SET_TABLE])
                    + attr(NFTA_SET_HANDLE, struct.pack(">Q", handles[name]))
                )
        out.append(struct.pack("=IHHII", 16 + len(payload), msg_type, flags, seq, 0) + payload)
    return b"".join(out)


def set_dump_request(table: str, seq: int) -> bytes:
    body = struct.pack("=BB", NFPROTO_INET, 0) + struct.pack(">H", 0)
    body += attr(NFTA_SET_TABLE, table.encode() + b"\0")
    return struct.pack("=IHHII", 16 + len(body), GETSET_TYPE, NLM_F_REQUEST | NLM_F_DUMP, seq, 0) + body


def parse_set_dump(buf: bytes) -> tuple[dict[str, int], bool]:
    """(set name -> handle, whether the dump ended) of one recv() of a GETSET dump."""
    out: dict[str, int] = {}
    for msg_type, _flags, _seq, payload in messages(buf):
        if msg_type == NLMSG_DONE:
            return out, True
        if msg_type == NLMSG_ERROR:
            (code,) = struct.unpack_from("=i", payload)
            if code:
                raise NetlinkError(-code, "set dump")
        elif msg_type == NEWSET_TYPE:
            a = attrs(payload[4:])
            handle = a.get(NFTA_SET_HANDLE, b"")
            if len(handle) == 8:
                out[a.get(NFTA_SET_NAME, b"").rstrip(b"\0").decode()] = struct.unpack(">Q", handle)[0]
    return out, False


class HandleSocket:
    """A NETLINK_NETFILTER socket for the probe: set handles by dump, batches by handle."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self._sock.setsockopt(SOL_NETLINK, NETLINK_CAP_ACK, 1)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
        self._sock.bind((0, 0))
        self._sock.settimeout(30)
        self._seq = 1 << 20

    def set_handles(self, table: str) -> dict[str, int]:
        self._seq += 1
        self._sock.sendall(set_dump_request(table, self._seq))
        out: dict[str, int] = {}
        for _ in range(100_000):  # bounded: a dump ends with DONE long before
            part, done = parse_set_dump(self._sock.recv(1 << 20))
            out.update(part)
            if done:
                return out
        raise NetlinkError(0, "set dump did not end")

    def run(self, batch: NetlinkBatch, handles: Mapping[str, int]) -> None:
        """Apply ``batch`` as one transaction, its set deletions by handle; raise on any error."""
        data, by_seq = encode_batch(batch, self._seq)
        self._seq += len(by_seq) + 2
        self._sock.sendall(by_handle(data, handles))
        pending = set(by_seq)
        while pending:
            for msg_type, _flags, seq, payload in messages(self._sock.recv(1 << 16)):
                if msg_type != NLMSG_ERROR:
                    continue
                (code,) = struct.unpack_from("=i", payload)
                if code:
                    raise NetlinkError(-code, "batch by handle")
                pending.discard(seq)

    def close(self) -> None:
        self._sock.close()
