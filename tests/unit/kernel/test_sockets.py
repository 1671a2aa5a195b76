"""Live TCP connections by host uid from /proc/net/tcp{,6} (host-uid lease refresh)."""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from pathlib import Path

from egressd.kernel.sockets import parse_uid_flows, read_uid_flows

HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode"


def v4(ip: str, port: int) -> str:
    (word,) = struct.unpack("=I", socket.inet_aton(ip))
    return f"{word:08X}:{port:04X}"


def v6(ip: str, port: int) -> str:
    raw = ipaddress.IPv6Address(ip).packed
    words = struct.unpack("!4I", raw)
    return "".join(f"{socket.htonl(w):08X}" for w in words) + f":{port:04X}"


def row(n: int, local: str, remote: str, state: int, uid: int) -> str:
    return f"{n:4d}: {local} {remote} {state:02X} 00000000:00000000 00:00000000 00000000 {uid:5d} 0 1234 1"


def test_remote_addresses_of_live_connections_per_uid() -> None:
    lines = [
        HEADER,
        row(0, v4("10.77.0.1", 40000), v4("10.204.0.2", 80), 0x01, 100001),  # established
        row(1, v4("10.77.0.1", 40001), v4("10.204.0.3", 443), 0x02, 100001),  # syn-sent
        row(2, v4("10.77.0.1", 40002), v4("10.204.0.4", 80), 0x06, 100001),  # time-wait: gone
        row(3, v4("0.0.0.0", 8080), v4("0.0.0.0", 0), 0x0A, 100001),  # listen: no peer
        row(4, v4("10.77.0.1", 40003), v4("10.204.0.5", 80), 0x01, 100002),
        row(5, v4("10.77.0.1", 40004), v4("10.204.0.6", 80), 0x01, 0),  # root: not asked
        "garbage line",
    ]
    got = parse_uid_flows(lines, {100001, 100002})
    assert got == {
        100001: {ipaddress.ip_address("10.204.0.2"), ipaddress.ip_address("10.204.0.3")},
        100002: {ipaddress.ip_address("10.204.0.5")},
    }


def test_ipv6_and_mapped_addresses() -> None:
    lines = [
        HEADER,
        row(0, v6("fd00:204::1", 40000), v6("fd00:204::2", 443), 0x01, 100001),
        row(1, v6("::ffff:10.77.0.1", 40001), v6("::ffff:10.204.0.7", 80), 0x01, 100001),
    ]
    assert parse_uid_flows(lines, {100001}) == {
        100001: {ipaddress.ip_address("fd00:204::2"), ipaddress.ip_address("10.204.0.7")}
    }


async def test_read_from_files_and_a_missing_tcp6(tmp_path: Path) -> None:
    tcp = tmp_path / "tcp"
    tcp.write_text("\n".join([HEADER, row(0, v4("10.0.0.1", 1), v4("10.204.0.2", 80), 1, 100001)]) + "\n")
    got = await read_uid_flows({100001}, (tcp, tmp_path / "tcp6"))
    assert got == {100001: {ipaddress.ip_address("10.204.0.2")}}
    assert await read_uid_flows(set(), (tcp,)) == {}


async def test_against_the_live_table() -> None:
    """A real connection of this process's uid is found with its peer."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        with socket.create_connection(srv.getsockname()) as cli:
            peer, _ = srv.accept()
            with peer:
                got = await read_uid_flows({os.getuid()})
                assert ipaddress.ip_address("127.0.0.1") in got.get(os.getuid(), set())
                assert cli.fileno() >= 0
