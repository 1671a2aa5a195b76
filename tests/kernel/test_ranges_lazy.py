"""The range objects are lazy (docs/concepts/ruleset.md, "port-scoped sets"), fleet profile, with
real packets from a sandbox namespace.

A subject gets ``dynr``/``dynrports`` and the rules that read them only with its first policy
that has shared ranges (egressd.fleetnft.subject.range_objects, in that policy's transaction),
then keeps them for its life; a subject that never had such a policy has none. These tests
walk a subject through the transitions: bound without ranges (no range sets in the kernel),
updated to a range policy (the objects made, a name learned after it opens its ranges at
once), to a policy without ranges (a held lease loses the range ports), and back; and audit
mode before and after the range objects (both kinds of rule in the rebuilt chains).
"""

from __future__ import annotations

import subprocess

from tests.kernel.test_ports import API_IP, activate, bind, deny_default, probe
from tests.kernel.test_ports_ranges import echo, holds
from tests.kernel.topology import Daemon, Topology, envelope

__all__ = ["echo"]  # the module's echo server (TCP 22, 8050, 8500, 9000, 7000; UDP 8500)

RANGE_SETS = ("dynr_v4", "dynr_v6", "dynrports_v4", "dynrports_v6")


def ranged(ports: str = "8000-8999") -> dict[str, object]:
    return deny_default({"action": "allow", "target": "api.example.test", "protocol": "tcp", "ports": [ports]})


def single() -> dict[str, object]:
    """A port-scoped policy without ranges: one port, which a lease holds in the hash set dynpx."""
    return deny_default({"action": "allow", "target": "api.example.test", "protocol": "tcp", "ports": [8050]})


def table_text(d: Daemon) -> str:
    return d.nft("list", "table", "inet", d.table)


def range_sets(d: Daemon) -> list[str]:
    text = table_text(d)
    return [kind for kind in RANGE_SETS if f"set subj_s_sb1_{kind} " in text]


def chain_rules(d: Daemon, chain: str) -> list[str]:
    out = d.nft("list", "chain", "inet", d.table, chain)
    return [ln.strip() for ln in out.splitlines() if "@" in ln or "log prefix" in ln]


def test_range_objects_come_with_the_first_range_policy_and_stay(
    topo: Topology, daemon: Daemon, echo: subprocess.Popen[str]
) -> None:
    activate(daemon, single())
    assert range_sets(daemon) == []  # a subject without shared ranges has none
    assert "dynr" not in table_text(daemon)
    assert topo.dig(1, "api.example.test") == ("NOERROR", [API_IP])
    assert probe(topo, 1, "tcp", API_IP, 8050) and not probe(topo, 1, "tcp", API_IP, 8500)
    # To a range policy: the objects are made in its transaction, and the held lease is
    # rewritten onto the hash path at once (no new answer).
    bind(daemon, ranged())
    assert range_sets(daemon) == list(RANGE_SETS)
    assert holds(daemon, "dynr_v4", API_IP)
    assert probe(topo, 1, "tcp", API_IP, 8500)
    assert not probe(topo, 1, "tcp", API_IP, 9000) and not probe(topo, 1, "tcp", API_IP, 22)
    # A name learned after it: its ranges work at once.
    assert topo.dig(1, "api.example.test") == ("NOERROR", [API_IP])
    assert holds(daemon, "dynr_v4", API_IP) and probe(topo, 1, "tcp", API_IP, 8500)
    marks = [r for r in chain_rules(daemon, "mark_s_sb1") if "dynr" in r]
    assert len(marks) == 2  # one per family, exactly once
    # To a policy without ranges: the objects stay, empty; the held lease loses 8500.
    bind(daemon, single())
    assert range_sets(daemon) == list(RANGE_SETS)
    assert not holds(daemon, "dynr_v4", API_IP)
    assert not probe(topo, 1, "tcp", API_IP, 8500)
    assert probe(topo, 1, "tcp", API_IP, 8050)
    # And back: no re-creation (the rules are there once), the held lease opens its ranges.
    bind(daemon, ranged())
    assert [r for r in chain_rules(daemon, "mark_s_sb1") if "dynr" in r] == marks
    assert probe(topo, 1, "tcp", API_IP, 8500) and not probe(topo, 1, "tcp", API_IP, 9000)
    # A revert to deny-first empties them too (they are flushed because the subject has them).
    revert = envelope("SET_BINDING", "sb1", ip=Topology.sb_ip(1), policy=None, generation=2)
    assert daemon.post(revert) == (200, "{}")
    assert not probe(topo, 1, "tcp", API_IP, 8500) and not probe(topo, 1, "tcp", API_IP, 8050)


def test_audit_mode_first_then_ranges(topo: Topology, daemon: Daemon, echo: subprocess.Popen[str]) -> None:
    audit = {**single(), "mode": "audit"}
    activate(daemon, audit)
    assert range_sets(daemon) == []
    assert topo.dig(1, "api.example.test") == ("NOERROR", [API_IP])
    assert probe(topo, 1, "tcp", API_IP, 9000)  # audit mode: a would-deny passes
    bind(daemon, ranged())  # enforcing, with ranges: the range objects join the audit ones
    assert range_sets(daemon) == list(RANGE_SETS)
    rules = chain_rules(daemon, "mark_s_sb1")
    dynr = [i for i, r in enumerate(rules) if "dynr" in r]
    audits = [i for i, r in enumerate(rules) if "log prefix" in r]
    assert len(dynr) == 2 and len(audits) == 6 and max(dynr) < min(audits)  # audit rules last
    assert probe(topo, 1, "tcp", API_IP, 8500)
    assert not probe(topo, 1, "tcp", API_IP, 9000)  # enforcing again
    bind(daemon, {**ranged(), "mode": "audit"})
    assert probe(topo, 1, "tcp", API_IP, 9000) and probe(topo, 1, "tcp", API_IP, 8500)


def test_ranges_first_then_audit_mode(topo: Topology, daemon: Daemon, echo: subprocess.Popen[str]) -> None:
    activate(daemon, ranged())
    assert range_sets(daemon) == list(RANGE_SETS)
    assert topo.dig(1, "api.example.test") == ("NOERROR", [API_IP])
    assert probe(topo, 1, "tcp", API_IP, 8500) and not probe(topo, 1, "tcp", API_IP, 9000)
    bind(daemon, {**single(), "mode": "audit"})  # the audit objects join the range ones
    rules = chain_rules(daemon, "mark_s_sb1")
    dynr = [i for i, r in enumerate(rules) if "dynr" in r]
    audits = [i for i, r in enumerate(rules) if "log prefix" in r]
    assert len(dynr) == 2 and len(audits) == 6 and max(dynr) < min(audits)
    assert probe(topo, 1, "tcp", API_IP, 9000)  # audit mode passes a would-deny
    bind(daemon, ranged())  # enforcing again: exactly the ranges
    assert probe(topo, 1, "tcp", API_IP, 8500)
    assert not probe(topo, 1, "tcp", API_IP, 9000) and not probe(topo, 1, "tcp", API_IP, 22)
