"""Port ranges of DNS leases on the hash path (docs/concepts/ruleset.md, "port-scoped sets"),
fleet profile, with real TCP and UDP packets from a sandbox namespace.

A lease whose ranges are the subject's shared ranges (egressd.subject.ranges: the range part of
the first domain allow rule with ranges) is its address in ``dynr``, opened for exactly the
ranges in ``dynrports``; a lease with other ranges keeps them in the pipapo ``dynp``. A policy
change that changes the shared ranges rewrites every lease in the same transaction: a learned
address loses a port the new ranges leave out (and gains one they add) without a new answer.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator

import pytest

from tests.kernel.test_ports import _ECHO, API_IP, EX_IP, activate, bind, deny_default, probe, reaches_as
from tests.kernel.topology import UPSTREAM_IPS, Daemon, Topology

TCP_PORTS = (22, 8050, 8500, 9000, 7000)
UDP_PORTS = (8500,)


@pytest.fixture(scope="module")
def echo(topo: Topology) -> Iterator[subprocess.Popen[str]]:
    proc = topo.spawn(
        topo.up,
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
        topo.stop(proc)


@pytest.fixture
def checked(topo: Topology) -> Iterator[Daemon]:
    """A daemon with the MITM on, and so the name check (as tests/kernel/test_ports.py's)."""
    env = {
        "OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT": "1",
        "OPENSANDBOX_EGRESS_MITMPROXY_PORT": "18391",
        "OPENSANDBOX_EGRESS_MITMPROXY_UPSTREAM_TRUST_DIR": str(topo.tls_dir / "trust"),
        "EGRESSD_MITM_CONFDIR": str(topo.workdir / "ranges-mitm-conf"),
        "OPENSANDBOX_CREDENTIAL_PROXY_SOCKET": str(topo.workdir / "ranges-mitm-run" / "active.sock"),
    }
    with Daemon(topo, table="egt-ranges-mitm", port=18390, env=env).running() as d:
        yield d


def elements(d: Daemon, kind: str) -> list[str]:
    """The elements of the subject's set ``kind`` as nft prints them (JSON, flattened)."""
    out = d.nft("-j", "list", "set", "inet", d.table, f"subj_s_sb1_{kind}")
    for item in json.loads(out)["nftables"]:
        if "set" in item:
            return [json.dumps(e, sort_keys=True) for e in item["set"].get("elem", [])]
    return []


def holds(d: Daemon, kind: str, ip: str) -> bool:
    return any(ip in e for e in elements(d, kind))


def test_a_name_with_a_range_reaches_exactly_its_ports_through_the_hash_path(
    topo: Topology, daemon: Daemon, echo: subprocess.Popen[str]
) -> None:
    activate(daemon, deny_default({"action": "allow", "target": "api.example.test", "protocol": "tcp",
                                   "ports": [443, "8000-8999"]}))
    assert topo.dig(1, "api.example.test") == ("NOERROR", [API_IP])
    assert holds(daemon, "dynr_v4", API_IP) and not holds(daemon, "dynp_v4", API_IP)
    assert probe(topo, 1, "tcp", API_IP, 8500)
    assert topo.reaches(1, API_IP, 443)
    assert not probe(topo, 1, "tcp", API_IP, 9000)
    assert not probe(topo, 1, "tcp", API_IP, 22)
    assert not probe(topo, 1, "udp", API_IP, 8500)  # udp is not named
    # Without a protocol the rule names both (§18): UDP 8500 opens too, still on the hash path.
    bind(daemon, deny_default({"action": "allow", "target": "api.example.test", "ports": [443, "8000-8999"]}))
    assert topo.dig(1, "api.example.test") == ("NOERROR", [API_IP])
    assert holds(daemon, "dynr_v4", API_IP) and not holds(daemon, "dynp_v4", API_IP)
    assert probe(topo, 1, "udp", API_IP, 8500)
    assert probe(topo, 1, "tcp", API_IP, 8500)
    assert not probe(topo, 1, "tcp", API_IP, 9000)


def test_two_rules_with_different_ranges_each_get_exactly_their_own(
    topo: Topology, daemon: Daemon, echo: subprocess.Popen[str]
) -> None:
    activate(
        daemon,
        deny_default(
            {"action": "allow", "target": "api.example.test", "protocol": "tcp", "ports": ["8000-8999"]},
            {"action": "allow", "target": "example.test", "protocol": "tcp", "ports": ["7000-7001"]},
        ),
    )
    assert topo.dig(1, "api.example.test") == ("NOERROR", [API_IP])
    assert topo.dig(1, "example.test") == ("NOERROR", [EX_IP])
    # The first rule's ranges are the shared ones: its lease on the hash path, the other in pipapo.
    assert holds(daemon, "dynr_v4", API_IP) and not holds(daemon, "dynr_v4", EX_IP)
    assert holds(daemon, "dynp_v4", EX_IP) and not holds(daemon, "dynp_v4", API_IP)
    assert probe(topo, 1, "tcp", API_IP, 8500) and not probe(topo, 1, "tcp", API_IP, 7000)
    assert probe(topo, 1, "tcp", EX_IP, 7000) and not probe(topo, 1, "tcp", EX_IP, 8500)


def test_a_change_of_the_shared_ranges_rewrites_learned_addresses_without_a_new_answer(
    topo: Topology, daemon: Daemon, echo: subprocess.Popen[str]
) -> None:
    def policy(ports: str) -> dict[str, object]:
        return deny_default({"action": "allow", "target": "api.example.test", "protocol": "tcp", "ports": [ports]})

    activate(daemon, policy("8000-8999"))
    assert topo.dig(1, "api.example.test") == ("NOERROR", [API_IP])
    assert probe(topo, 1, "tcp", API_IP, 8500)
    bind(daemon, policy("8000-8099"))  # narrower: no dig since
    assert not probe(topo, 1, "tcp", API_IP, 8500)
    assert probe(topo, 1, "tcp", API_IP, 8050)
    assert holds(daemon, "dynr_v4", API_IP)
    bind(daemon, policy("8000-8999"))  # wider again: the kept lease is refilled with it
    assert probe(topo, 1, "tcp", API_IP, 8500)
    assert not probe(topo, 1, "tcp", API_IP, 9000)
    # A policy whose first ranged rule names other ranges moves the lease to pipapo, exactly.
    bind(
        daemon,
        deny_default(
            {"action": "allow", "target": "example.test", "protocol": "tcp", "ports": ["7000-7001"]},
            {"action": "allow", "target": "api.example.test", "protocol": "tcp", "ports": ["8000-8099"]},
        ),
    )
    assert holds(daemon, "dynp_v4", API_IP) and not holds(daemon, "dynr_v4", API_IP)
    assert probe(topo, 1, "tcp", API_IP, 8050)
    assert not probe(topo, 1, "tcp", API_IP, 8500) and not probe(topo, 1, "tcp", API_IP, 7000)


def test_the_intercepted_path_opens_a_hash_path_lease_on_its_ranges_only(
    topo: Topology, checked: Daemon, echo: subprocess.Popen[str]
) -> None:
    """With the MITM (and the name check) on, a domain rule with ports but no protocol is
    intercepted there: the MITM's input chain judges the conntrack original destination and
    port with the same hash-path rule (``ct original ip daddr @dynr_v4 meta l4proto . ct
    original proto-dst @dynrports_v4``)."""
    activate(checked, deny_default({"action": "allow", "target": "api.example.test", "ports": [443, "8000-8999"]}))
    assert topo.dig(1, "api.example.test") == ("NOERROR", [API_IP])
    assert holds(checked, "dynr_v4", API_IP) and not holds(checked, "dynp_v4", API_IP)
    assert reaches_as(topo, 1, "api.example.test", API_IP, 8080)  # through the MITM, by the original port
    assert reaches_as(topo, 1, "api.example.test", API_IP, 443)
    assert not topo.reaches(1, API_IP, 80)
    bind(checked, deny_default({"action": "allow", "target": "api.example.test", "ports": [443, "8000-8079"]}))
    assert not reaches_as(topo, 1, "api.example.test", API_IP, 8080)  # the shared ranges changed: rewritten
    assert reaches_as(topo, 1, "api.example.test", API_IP, 443)
