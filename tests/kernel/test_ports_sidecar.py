"""Ports and protocols in the kernel (docs/reference/behaviour.md §18), sidecar profile: the same
semantics as the fleet's (tests/kernel/test_ports.py) with the sidecar's own ruleset, real TCP
and UDP packets from the app in the sandbox namespace."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator

import pytest

from tests.kernel.sidecar import Sidecar
from tests.kernel.test_ports import _ECHO, _HOLD, TCP_PORTS, UDP_PORTS, probe
from tests.kernel.topology import UP_NET, UPSTREAM_IPS, Topology, cleanup_stale

EX_IP = f"{UP_NET}.5"  # example.test
CDN_IP = f"{UP_NET}.6"  # api.example.test and h2.example.test
LIT_IP = f"{UP_NET}.7"


@pytest.fixture(scope="module")
def ptopo() -> Iterator[Topology]:
    cleanup_stale()
    t = Topology(prefix=f"egp{os.getpid()}", sandboxes=1).up_()
    try:
        t.spawn(
            t.up,
            "python3",
            "-c",
            _ECHO,
            ",".join(map(str, TCP_PORTS)),
            ",".join(map(str, UDP_PORTS)),
            ",".join(UPSTREAM_IPS),
            ready_line="ready",
        )
        yield t
    finally:
        t.down()


@pytest.fixture
def sidecar(ptopo: Topology) -> Iterator[Sidecar]:
    sc = Sidecar(ptopo, sb=1)
    try:
        yield sc
    finally:
        sc.cleanup()


def policy(h2_ports: list[object]) -> dict[str, object]:
    return {
        "defaultAction": "deny",
        "egress": [
            {"action": "allow", "target": "h2.example.test", "protocol": "tcp", "ports": h2_ports},
            {"action": "allow", "target": LIT_IP, "protocol": "tcp", "ports": ["5432-5433"]},
            {"action": "deny", "target": EX_IP, "protocol": "udp", "ports": [7000]},
            {"action": "allow", "target": "example.test"},
        ],
    }


def test_rules_and_leases_with_ports_open_only_there(sidecar: Sidecar, ptopo: Topology) -> None:
    sidecar.env["OPENSANDBOX_EGRESS_RULES"] = json.dumps(policy([7000]))
    sidecar.start()
    # An address rule with protocol and ports.
    assert probe(ptopo, 1, "tcp", LIT_IP, 5432) and probe(ptopo, 1, "tcp", LIT_IP, 5433)
    assert not probe(ptopo, 1, "udp", LIT_IP, 5432)
    assert not probe(ptopo, 1, "tcp", LIT_IP, 22)
    # A name with ports: its lease opens its address there only.
    assert not probe(ptopo, 1, "tcp", CDN_IP, 7000)
    assert sidecar.dig("h2.example.test") == ("NOERROR", [CDN_IP])
    assert probe(ptopo, 1, "tcp", CDN_IP, 7000)
    assert not probe(ptopo, 1, "tcp", CDN_IP, 7001)
    assert not probe(ptopo, 1, "udp", CDN_IP, 7000)
    assert not sidecar.reaches(CDN_IP, 80)
    # A name without ports: every port, but a deny by port still beats its lease.
    assert sidecar.dig("example.test") == ("NOERROR", [EX_IP])
    assert probe(ptopo, 1, "tcp", EX_IP, 7000) and probe(ptopo, 1, "udp", EX_IP, 5432)
    assert not probe(ptopo, 1, "udp", EX_IP, 7000)


def test_a_narrowing_by_port_rescopes_the_lease_and_cuts_only_that_flow(
    sidecar: Sidecar, ptopo: Topology
) -> None:
    sidecar.env["OPENSANDBOX_EGRESS_RULES"] = json.dumps(policy([7000, 7001]))
    sidecar.start()
    assert sidecar.dig("h2.example.test") == ("NOERROR", [CDN_IP])
    holder = ptopo.spawn(ptopo.sb(1), "python3", "-c", _HOLD, CDN_IP, "7000,7001", "8", ready_line="up")
    time.sleep(0.6)
    sidecar.set_policy(policy([7001]))  # the lease stays, with the name's new scope
    out, _ = holder.communicate(timeout=30)
    seen: dict[str, list[str]] = {"7000": [], "7001": []}
    for line in out.splitlines():
        port, verdict = line.split()
        seen[port].append(verdict)
    assert seen["7000"][-1] == "dead", "a flow on a port the policy took away survived: " + out
    assert seen["7001"] and "dead" not in seen["7001"], "a flow on a still-allowed port was cut: " + out
    assert not probe(ptopo, 1, "tcp", CDN_IP, 7000)
    assert probe(ptopo, 1, "tcp", CDN_IP, 7001)


def test_quic_to_a_learned_address_needs_an_explicit_udp_rule_under_the_name_check(
    sidecar: Sidecar, ptopo: Topology
) -> None:
    sidecar.with_mitm()
    sidecar.env["OPENSANDBOX_EGRESS_RULES"] = json.dumps(
        {
            "defaultAction": "deny",
            "egress": [
                {"action": "allow", "target": "h2.example.test", "protocol": "udp", "ports": [443]},
                {"action": "allow", "target": "api.example.test", "ports": [443, 7000]},
                {"action": "allow", "target": "example.test"},
            ],
        }
    )
    sidecar.start()
    assert sidecar.dig("example.test") == ("NOERROR", [EX_IP])
    assert probe(ptopo, 1, "udp", EX_IP, 7000)
    assert not probe(ptopo, 1, "udp", EX_IP, 443)  # learned only: no QUIC
    assert sidecar.dig("api.example.test") == ("NOERROR", [CDN_IP])
    assert probe(ptopo, 1, "tcp", CDN_IP, 7000) and probe(ptopo, 1, "udp", CDN_IP, 7000)
    assert not probe(ptopo, 1, "udp", CDN_IP, 443)  # "ports": [443] without protocol: not explicit
    assert sidecar.dig("h2.example.test") == ("NOERROR", [CDN_IP])
    assert probe(ptopo, 1, "udp", CDN_IP, 443)  # an explicit protocol: udp rule opens it


def _sidecar_set(ptopo: Topology, name: str) -> str:
    return ptopo.ns(ptopo.sb(1), "nft", "-j", "list", "set", "inet", "opensandbox", name, check=False).stdout


def test_port_ranges_take_the_hash_path_and_follow_a_change_of_the_shared_ranges(
    sidecar: Sidecar, ptopo: Topology
) -> None:
    """The first ranged domain rule's ranges are shared (docs/concepts/ruleset.md): its lease is
    the address in ``dyn_allowr``; another name's ranges stay in pipapo. A policy change of the
    shared ranges rewrites the learned address (no new answer) both ways."""

    def ranged(h2: str) -> dict[str, object]:
        return {
            "defaultAction": "deny",
            "egress": [
                {"action": "allow", "target": "h2.example.test", "protocol": "tcp", "ports": [h2]},
                {"action": "allow", "target": "example.test", "protocol": "tcp", "ports": ["7000-7001"]},
            ],
        }

    sidecar.env["OPENSANDBOX_EGRESS_RULES"] = json.dumps(ranged("5000-5999"))
    sidecar.start()
    assert sidecar.dig("h2.example.test") == ("NOERROR", [CDN_IP])
    assert sidecar.dig("example.test") == ("NOERROR", [EX_IP])
    assert CDN_IP in _sidecar_set(ptopo, "dyn_allowr_v4") and EX_IP not in _sidecar_set(ptopo, "dyn_allowr_v4")
    assert EX_IP in _sidecar_set(ptopo, "dyn_allowp_v4") and CDN_IP not in _sidecar_set(ptopo, "dyn_allowp_v4")
    assert probe(ptopo, 1, "tcp", CDN_IP, 5432) and probe(ptopo, 1, "tcp", CDN_IP, 5433)
    assert not probe(ptopo, 1, "tcp", CDN_IP, 7000) and not probe(ptopo, 1, "tcp", CDN_IP, 22)
    assert not probe(ptopo, 1, "udp", CDN_IP, 5432)
    assert probe(ptopo, 1, "tcp", EX_IP, 7000) and not probe(ptopo, 1, "tcp", EX_IP, 5432)
    sidecar.set_policy(ranged("5000-5432"))  # narrower shared ranges, no dig since
    assert probe(ptopo, 1, "tcp", CDN_IP, 5432) and not probe(ptopo, 1, "tcp", CDN_IP, 5433)
    sidecar.set_policy(ranged("5000-5999"))  # wider again
    assert probe(ptopo, 1, "tcp", CDN_IP, 5433)
    assert probe(ptopo, 1, "tcp", EX_IP, 7000) and not probe(ptopo, 1, "tcp", EX_IP, 5433)


def test_a_narrowing_past_the_port_element_budget_revokes_what_does_not_fit(
    sidecar: Sidecar, ptopo: Topology
) -> None:
    """The fleet's test of the same name in the sidecar: two leases learned whole, narrowed to
    three single ports each, six port elements for sets sized for four. The kernel would refuse
    the rebuild (ENFILE) and the wider policy stay; instead the first lease keeps its three
    ports and the other is revoked."""

    def wide_or_not(*, whole: bool) -> dict[str, object]:
        rules: list[dict[str, object]] = []
        for name in ("example.test", "api.example.test"):
            if whole:
                rules.append({"action": "allow", "target": name})
            rules.append({"action": "allow", "target": name, "protocol": "tcp", "ports": [22, 5432, 7000]})
        return {"defaultAction": "deny", "egress": rules}

    sidecar.env["EGRESSD_MAX_LEASES_PER_SUBJECT"] = "2"
    sidecar.env["OPENSANDBOX_EGRESS_RULES"] = json.dumps(wide_or_not(whole=True))
    sidecar.start()
    assert sidecar.dig("example.test") == ("NOERROR", [EX_IP])
    assert sidecar.dig("api.example.test") == ("NOERROR", [CDN_IP])
    assert probe(ptopo, 1, "tcp", EX_IP, 5433) and probe(ptopo, 1, "tcp", CDN_IP, 5433)
    holders = {
        ip: ptopo.spawn(ptopo.sb(1), "python3", "-c", _HOLD, ip, "22", "8", ready_line="up")
        for ip in (EX_IP, CDN_IP)
    }
    time.sleep(0.6)
    code, text = sidecar.api("POST", "/policy", wide_or_not(whole=False))
    wide = probe(ptopo, 1, "tcp", EX_IP, 5433) or probe(ptopo, 1, "tcp", CDN_IP, 5433)
    verdicts = {ip: holder.communicate(timeout=30)[0].split() for ip, holder in holders.items()}
    assert code == 200, f"narrowing refused ({code} {text}); old wide policy still in force: {wide}"
    assert not wide, "the whole rule's ports stayed open after the narrowing"
    assert probe(ptopo, 1, "tcp", EX_IP, 22) and probe(ptopo, 1, "tcp", EX_IP, 7000)
    assert not any(probe(ptopo, 1, "tcp", CDN_IP, p) for p in (22, 5432, 7000)), (
        "a lease over the budget stayed"
    )
    assert verdicts[CDN_IP][-1] == "dead", f"the revoked lease's flow survived: {verdicts}"
    assert verdicts[EX_IP][1::2] and "dead" not in verdicts[EX_IP], (
        f"the kept lease's flow was cut: {verdicts}"
    )
