"""The connection refresh of host-uid subjects (docs/reference/behaviour.md §17 x §9): their flows are found by
the uid that owns the socket (/proc/net/tcp), not by source address in conntrack."""

from __future__ import annotations

import ipaddress
import socket
import struct
import time
from pathlib import Path

from egressd.addr import IPAddress
from egressd.kernel.refresh import LeaseRefresher
from egressd.subject.leases import LeaseBook


def v4(ip: str, port: int) -> str:
    (word,) = struct.unpack("=I", socket.inet_aton(ip))
    return f"{word:08X}:{port:04X}"


def row(remote: str, uid: int, state: int = 1) -> str:
    return f"   0: {v4('10.77.0.1', 40000)} {v4(remote, 443)} {state:02X} 0:0 00:0 0 {uid} 0 1 1"


async def test_leases_of_a_uid_with_a_live_connection_are_renewed(tmp_path: Path) -> None:
    tcp = tmp_path / "tcp"
    tcp.write_text("header\n" + row("93.184.216.34", 100001) + "\n" + row("151.101.1.69", 100002) + "\n")
    conntrack = tmp_path / "nf_conntrack"
    conntrack.write_text("")  # the host's own flows: nothing of the uid subjects is keyed there
    books: dict[str, LeaseBook] = {"u-1": LeaseBook(), "u-2": LeaseBook()}
    now = time.monotonic()
    for book, addr in ((books["u-1"], "93.184.216.34"), (books["u-2"], "10.9.9.9")):
        book.record([(ipaddress.ip_address(addr), 60)], "example.com", now)
    renewed: list[tuple[str, list[IPAddress]]] = []

    async def renew(uid: str, ips: list[IPAddress], seconds: int) -> None:
        renewed.append((uid, ips))

    refresher = LeaseRefresher(
        lambda ip: None,
        books,
        renew,
        path=conntrack,
        host_uids=lambda: {100001: "u-1", 100002: "u-2"},
        socket_tables=(tcp,),
    )
    await refresher.tick()
    # u-1's connection is to a leased address: renewed. u-2's is to an address it holds no
    # lease for: nothing to renew, and its own lease has no live connection.
    assert renewed == [("u-1", [ipaddress.ip_address("93.184.216.34")])]


async def test_unreadable_socket_table_skips_the_uid_part(tmp_path: Path) -> None:
    conntrack = tmp_path / "nf_conntrack"
    conntrack.write_text("")

    async def renew(uid: str, ips: list[IPAddress], seconds: int) -> None:
        raise AssertionError("nothing to renew")

    missing_dir = tmp_path / "gone"
    missing_dir.mkdir()
    refresher = LeaseRefresher(
        lambda ip: None, {}, renew, path=conntrack, host_uids=lambda: {1: "u"}, socket_tables=(missing_dir,)
    )
    await refresher.tick()  # a directory cannot be read as a table: logged, not raised
