"""docs/reference/behaviour.md §14.5 x §18 against the real kernel: a fleet policy AT the rule cap whose
every rule names ports and a protocol (4096 mixed v4/v6 hosts and CIDRs, so several thousand
port-scoped elements) is activated, updated in place and reverted, each in exactly one kernel
transaction (the ruleset generation id steps by one), with real connections on an allowed and
a refused port of the first and last rules."""

from __future__ import annotations

from typing import Any

from tests.bigpolicy import big_policy
from tests.kernel.test_big_inputs import one_transaction
from tests.kernel.topology import Daemon, Topology, envelope, nft_set_elements

DPR = "sandbox.data-plane-ready"
CAP = 4096


def scoped(policy: dict[str, Any]) -> dict[str, Any]:
    """Every rule on TCP 80 and 8000-8010 only."""
    rules = [{**r, "protocol": "tcp", "ports": [80, "8000-8010"]} for r in policy["egress"]]
    return {**policy, "egress": rules}


P1 = scoped(big_policy(CAP, first=["10.204.0.2"], last=["10.204.0.8/31"]))
P2 = scoped(big_policy(CAP, first=["10.204.0.3"], last=["10.204.0.6/31"], offset=100_000))


def test_a_policy_of_port_scoped_rules_at_the_cap_is_one_transaction_per_change(
    topo: Topology, daemon: Daemon
) -> None:
    one_transaction(topo, daemon, "deny_first", envelope("SET_BINDING", "sb1", ip=topo.sb_ip(1), policy=P1))
    one_transaction(topo, daemon, "static_apply", envelope("LIFECYCLE_HOOK", "sb1", hook=DPR))
    held = nft_set_elements(topo, topo.pod, daemon.table, "subj_s_sb1_allowp_v4")
    assert '{"concat": ["10.204.0.2", "tcp", 80]}' in held
    assert '{"concat": ["10.204.0.2", "tcp", {"range": [8000, 8010]}]}' in held
    assert len(held) > CAP // 4  # a v4 host or /24 in every fourth rule, two ranges each
    assert topo.reaches(1, "10.204.0.2") and topo.reaches(1, "10.204.0.9")
    assert not topo.reaches(1, "10.204.0.2", port=8080)  # only the rules' ports
    assert not topo.reaches(1, "10.204.0.5")
    post = envelope("SET_BINDING", "sb1", ip=topo.sb_ip(1), policy=P2, generation=2)
    one_transaction(topo, daemon, "static_apply", post)
    assert topo.reaches(1, "10.204.0.3") and topo.reaches(1, "10.204.0.7")
    assert not topo.reaches(1, "10.204.0.2") and not topo.reaches(1, "10.204.0.3", port=8080)
    post = envelope("SET_BINDING", "sb1", ip=topo.sb_ip(1), policy=None, generation=3)
    one_transaction(topo, daemon, "deny_first", post)
    assert nft_set_elements(topo, topo.pod, daemon.table, "subj_s_sb1_allowp_v4") == set()
    assert not topo.reaches(1, "10.204.0.3")
