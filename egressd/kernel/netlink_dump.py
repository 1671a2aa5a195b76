"""Parsing the kernel's dump replies: counter objects and one set's elements, and the element of a
set dump that holds an address. Pure."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from egressd.addr import IPAddress
from egressd.kernel.netlink_proto import (
    NFNL_SUBSYS_NFTABLES,
    NFT_MSG_NEWOBJ,
    NFT_MSG_NEWSETELEM,
    NFT_SET_ELEM_INTERVAL_END,
    NFTA_COUNTER_PACKETS,
    NFTA_DATA_VALUE,
    NFTA_OBJ_DATA,
    NFTA_OBJ_NAME,
    NFTA_SET_ELEM_EXPIRATION,
    NFTA_SET_ELEM_FLAGS,
    NFTA_SET_ELEM_KEY,
    NFTA_SET_ELEM_LIST_ELEMENTS,
    NFTA_SET_ELEM_TIMEOUT,
    NLMSG_DONE,
    NLMSG_ERROR,
    NetlinkError,
    _attrs,
    _list,
)


@dataclass(frozen=True, slots=True)
class SetElement:
    """One element as the kernel reports it: the raw key, whether it closes an interval, and
    (timeout sets) its timeout and the milliseconds left before it expires."""

    key: bytes
    interval_end: bool = False
    timeout_ms: int | None = None
    expires_ms: int | None = None


def parse_setelem_dump(buf: bytes) -> tuple[list[SetElement], bool]:
    """Elements in one recv() of a GETSETELEM dump, and whether it ended (DONE).

    Raises NetlinkError for an error message (ENOENT: no such set)."""
    elements: list[SetElement] = []
    off = 0
    while off + 16 <= len(buf):
        length, msg_type, _flags, _seq, _pid = struct.unpack_from("=IHHII", buf, off)
        if length < 16:
            break
        if msg_type == NLMSG_DONE:
            return elements, True
        if msg_type == NLMSG_ERROR:
            (code,) = struct.unpack_from("=i", buf, off + 16)
            if code != 0:
                raise NetlinkError(-code, "set element dump")
        elif msg_type == (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWSETELEM:
            attrs = _attrs(buf[off + 20 : off + length])
            for raw in _list(attrs.get(NFTA_SET_ELEM_LIST_ELEMENTS, b"")):
                elem = _attrs(raw)
                key = _attrs(elem.get(NFTA_SET_ELEM_KEY, b"")).get(NFTA_DATA_VALUE, b"")
                flags = elem.get(NFTA_SET_ELEM_FLAGS)
                timeout = elem.get(NFTA_SET_ELEM_TIMEOUT)
                expires = elem.get(NFTA_SET_ELEM_EXPIRATION)
                elements.append(
                    SetElement(
                        key,
                        bool(flags and struct.unpack(">I", flags)[0] & NFT_SET_ELEM_INTERVAL_END),
                        struct.unpack(">Q", timeout)[0] if timeout and len(timeout) == 8 else None,
                        struct.unpack(">Q", expires)[0] if expires and len(expires) == 8 else None,
                    )
                )
        off += (length + 3) & ~3
    return elements, False


def element_covering(
    ip: IPAddress, elements: Sequence[SetElement], *, interval: bool
) -> tuple[SetElement, bytes | None] | None:
    """The element of a set dump that holds ``ip``, with the interval's end key (exclusive;
    None: to the top of the address space, as for 0.0.0.0/0, or not an interval set). A
    plain or timeout set matches the equal key."""
    key = ip.packed
    if not interval:
        hit = next((e for e in elements if e.key == key), None)
        return (hit, None) if hit is not None else None
    ordered = sorted(
        (e for e in elements if len(e.key) == len(key)), key=lambda e: (e.key, not e.interval_end)
    )
    start: SetElement | None = None
    for e in ordered:
        if start is not None and start.key <= key < e.key:
            return start, e.key
        start = None if e.interval_end else e
    return (start, None) if start is not None and start.key <= key else None


def parse_counter_dump(buf: bytes) -> tuple[dict[str, int], bool]:
    """Counter objects (name -> packets) in one recv() of a dump, and whether it ended (DONE).

    Raises NetlinkError for an error message."""
    counters: dict[str, int] = {}
    off = 0
    while off + 16 <= len(buf):
        length, msg_type, _flags, _seq, _pid = struct.unpack_from("=IHHII", buf, off)
        if length < 16:
            break
        if msg_type == NLMSG_DONE:
            return counters, True
        if msg_type == NLMSG_ERROR:
            (code,) = struct.unpack_from("=i", buf, off + 16)
            if code != 0:
                raise NetlinkError(-code, "counter dump")
        elif msg_type == (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWOBJ:
            attrs = _attrs(buf[off + 20 : off + length])  # after nlmsghdr (16) + nfgenmsg (4)
            name = attrs.get(NFTA_OBJ_NAME, b"").rstrip(b"\0").decode(errors="replace")
            data = _attrs(attrs.get(NFTA_OBJ_DATA, b""))
            packets = data.get(NFTA_COUNTER_PACKETS)
            if name and packets is not None and len(packets) == 8:
                counters[name] = struct.unpack(">Q", packets)[0]
        off += (length + 3) & ~3
    return counters, False
