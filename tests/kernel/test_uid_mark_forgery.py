"""A host-uid subject that may set a socket mark cannot pass for egressd's DNS forwarder
(docs/reference/behaviour.md §17).

The forwarder's upstream queries carry SO_MARK 0x1, which the DNS redirect and the filters
exempt. Setting a socket mark needs CAP_NET_ADMIN, or CAP_NET_RAW since Linux 5.17, which a
sandbox process may well have (ping). The forwarder runs in egressd's own process, so its
sockets are egressd's uid: a host-uid subject is told from it by that uid, never by the mark.
Each case here is a process of the subject's uid with CAP_NET_RAW (ambient) that marks its
socket 0x1 and sends where its policy refuses: TCP to an upstream, DNS straight to a resolver
(which must still be redirected to the subject's own DNS port).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.kernel.test_uid_subjects import (
    NO_DNS,
    SYSTEM_PYTHON,
    A,
    bind,
    policy,
    remove,
    uidd,  # noqa: F401  (fixtures)
    utopo,  # noqa: F401
)
from tests.kernel.topology import UPSTREAM_IPS, Daemon, Topology

REFUSED_IP = UPSTREAM_IPS[5]
RESOLVER = UPSTREAM_IPS[0]

MARKED = r"""
import socket, sys
kind, ip, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
if kind == "tcp":
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, 1)
    s.settimeout(2)
    try:
        s.connect((ip, port)); s.sendall(b"GET /probe HTTP/1.0\r\n\r\n")
        print("reached", s.recv(64)[:12], flush=True)
    except OSError as e:
        print("refused", type(e).__name__, flush=True)
else:
    # A query for a name the resolver knows and the policy does not allow.
    q = bytes.fromhex("abcd01000001000000000000") + b"\x03api\x07example\x04test\x00" + b"\x00\x01\x00\x01"
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, 1)
    s.settimeout(2)
    try:
        s.sendto(q, (ip, port)); data = s.recv(512)
        print("reached rcode", data[3] & 0xF, flush=True)
    except OSError as e:
        print("refused", type(e).__name__, flush=True)
"""


def marked_as_uid(topo: Topology, uid: int, *args: str) -> str:
    r = topo.ns(
        topo.pod,
        "setpriv",
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        "--inh-caps=+net_raw",
        "--ambient-caps=+net_raw",
        SYSTEM_PYTHON,
        "-c",
        MARKED,
        *args,
        check=False,
        timeout=15,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


@pytest.fixture
def subject(uidd: Daemon) -> Iterator[None]:  # noqa: F811
    bind(uidd, "um", A, policy("a.test"))
    try:
        yield
    finally:
        remove(uidd, "um")


def test_the_harness_can_mark_as_the_uid(utopo: Topology) -> None:  # noqa: F811
    """Outside egressd's table (no binding yet: an in-range uid that is no subject is refused
    anyway), the mark itself must be settable, else the tests below prove nothing."""
    r = utopo.ns(
        utopo.pod,
        "setpriv",
        f"--reuid={A}",
        f"--regid={A}",
        "--clear-groups",
        "--inh-caps=+net_raw",
        "--ambient-caps=+net_raw",
        SYSTEM_PYTHON,
        "-c",
        "import socket; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, 1); print('ok')",
        check=False,
        timeout=15,
    )
    assert r.stdout.strip() == "ok", r.stderr


@pytest.mark.usefixtures("subject")
def test_a_marked_uid_socket_does_not_pass_for_the_forwarder_over_tcp(utopo: Topology) -> None:  # noqa: F811
    # Dropped (a timeout), not refused by a missing listener: the upstream serves :80 there.
    assert marked_as_uid(utopo, A, "tcp", REFUSED_IP, "80") == "refused TimeoutError"


@pytest.mark.usefixtures("subject")
def test_a_marked_uid_socket_does_not_pass_for_the_forwarder_over_dns(utopo: Topology) -> None:  # noqa: F811
    """Redirected to the subject's DNS port like any of its queries, and answered by its policy
    (NXDOMAIN), never by the resolver (NOERROR), whatever address it was sent to."""
    for server in (RESOLVER, NO_DNS):
        assert marked_as_uid(utopo, A, "udp", server, "53") == "reached rcode 3", server
