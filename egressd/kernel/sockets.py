"""Live TCP connections of host uids, read from ``/proc/net/tcp{,6}`` (host-uid subjects).

Conntrack does not know which uid opened a flow, the socket table does: for a host-uid
subject (docs/reference/behaviour.md §17) the connection refresh (§9) renews the DNS leases of the remote
addresses its uid's sockets are connected to. The parser is pure; :func:`read_uid_flows`
reads the two files off the event loop.
"""

from __future__ import annotations

import asyncio
import ipaddress
import struct
from collections.abc import Collection, Iterable
from pathlib import Path

from egressd.addr import IPAddress, unmap_ip

PROC_TCP = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))

# /proc/net/tcp "st" values of connections that are alive or being set up or torn down
# (TCP_ESTABLISHED .. TCP_CLOSING of include/net/tcp_states.h, without TIME_WAIT, CLOSE
# and LISTEN): the same set as the conntrack refresh's states.
_ACTIVE_STATES = frozenset({0x01, 0x02, 0x03, 0x04, 0x05, 0x08, 0x09, 0x0B})


def _address(field: str) -> IPAddress | None:
    """``0100007F:1F90`` / 32 hex digits ``:port``: the kernel prints each 32-bit word of the
    address in host byte order."""
    hexaddr = field.partition(":")[0]
    if len(hexaddr) not in (8, 32):
        return None
    try:
        words = [int(hexaddr[i : i + 8], 16) for i in range(0, len(hexaddr), 8)]
    except ValueError:
        return None
    packed = b"".join(struct.pack("=I", w) for w in words)
    return unmap_ip(ipaddress.ip_address(packed))


def parse_uid_flows(lines: Iterable[str], uids: Collection[int]) -> dict[int, set[IPAddress]]:
    """Remote addresses of the live TCP connections of each of ``uids``."""
    out: dict[int, set[IPAddress]] = {}
    for line in lines:
        parts = line.split()
        if len(parts) < 8 or not parts[0].endswith(":"):
            continue  # the header, or a truncated line
        try:
            state, uid = int(parts[3], 16), int(parts[7])
        except ValueError:
            continue
        if state not in _ACTIVE_STATES or uid not in uids:
            continue
        remote = _address(parts[2])
        if remote is not None and not remote.is_unspecified:
            out.setdefault(uid, set()).add(remote)
    return out


def _scan(paths: tuple[Path, ...], uids: frozenset[int]) -> dict[int, set[IPAddress]]:
    out: dict[int, set[IPAddress]] = {}
    for path in paths:
        try:
            with path.open() as f:
                found = parse_uid_flows(f, uids)
        except FileNotFoundError:
            continue  # no IPv6 in this kernel
        for uid, remotes in found.items():
            out.setdefault(uid, set()).update(remotes)
    return out


async def read_uid_flows(
    uids: Collection[int], paths: tuple[Path, ...] = PROC_TCP
) -> dict[int, set[IPAddress]]:
    """:func:`parse_uid_flows` over the live socket tables (streamed, on a worker thread).
    Raises OSError when a table exists but cannot be read."""
    if not uids:
        return {}
    return await asyncio.to_thread(_scan, paths, frozenset(uids))
