"""Ports and protocols in the kernel (docs/reference/behaviour.md §18) for host-uid subjects (§17): the
same per-subject port-scoped sets and rules, reached through the output hook's uid dispatch.
Real processes of a sandbox uid in the module's own "host" namespace (tests/kernel/test_uid_subjects.py)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest

from tests.kernel.test_ports import _ECHO, _PROBE, TCP_PORTS, UDP_PORTS
from tests.kernel.test_uid_subjects import (  # noqa: F401 (fixtures)
    A_IP,
    SYSTEM_PYTHON,
    A,
    as_uid,
    bind,
    dig,
    reaches,
    remove,
    uidd,
    utopo,
)
from tests.kernel.topology import UPSTREAM_IPS, Daemon, Topology

LIT_IP = UPSTREAM_IPS[5]  # 10.204.0.7


@pytest.fixture(scope="module")
def echo(utopo: Topology) -> Iterator[subprocess.Popen[str]]:  # noqa: F811
    proc = utopo.spawn(
        utopo.up,
        "python3",
        "-c",
        _ECHO,
        ",".join(map(str, TCP_PORTS)),
        ",".join(map(str, UDP_PORTS)),
        ",".join(UPSTREAM_IPS),
        ready_line="ready",
    )
    try:
        yield proc
    finally:
        utopo.stop(proc)


def uid_probe(topo: Topology, uid: int, proto: str, ip: str, port: int) -> bool:
    return as_uid(topo, uid, SYSTEM_PYTHON, "-c", _PROBE, proto, ip, str(port)).stdout.strip() == "open"


def test_a_host_uid_subject_is_opened_only_on_its_ports(
    utopo: Topology,  # noqa: F811
    uidd: Daemon,  # noqa: F811
    echo: subprocess.Popen[str],
) -> None:
    pol = {
        "defaultAction": "deny",
        "egress": [
            {"action": "allow", "target": "a.test", "protocol": "tcp", "ports": [8080]},
            {"action": "allow", "target": LIT_IP, "protocol": "udp", "ports": [7000]},
        ],
    }
    bind(uidd, "ua", A, pol)
    try:
        assert dig(utopo, A, "a.test") == ("NOERROR", [A_IP])
        assert reaches(utopo, A, A_IP, port=8080)
        assert not reaches(utopo, A, A_IP, port=80)  # intercepted: refused by the original port
        assert not uid_probe(utopo, A, "tcp", A_IP, 7000)
        assert uid_probe(utopo, A, "udp", LIT_IP, 7000)
        assert not uid_probe(utopo, A, "tcp", LIT_IP, 7000)
        assert not uid_probe(utopo, A, "udp", LIT_IP, 5432)
    finally:
        remove(uidd, "ua")
