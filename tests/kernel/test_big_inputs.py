"""docs/reference/behaviour.md §14.5 against the real kernel: a fleet policy AT the rule cap (4096 mixed v4/v6
hosts and CIDRs) is activated, updated in place and reverted, each in exactly one kernel
transaction, with real connections from sandbox namespaces to the first and last allowed
prefixes.

"One transaction" is read from the kernel itself: nf_tables' ruleset generation id grows by
one per committed transaction (aborted ones leave it alone), so a generation step of exactly
one per action means no partial state was ever committed. The daemon's transaction counter
must agree.
"""

from __future__ import annotations

import json
import re
from typing import Any

from egressd.policy import format_element, ip_sets, parse_policy
from tests.bigpolicy import big_policy
from tests.kernel.topology import GATEWAY6, Daemon, Topology, envelope, nft_genid, nft_set_elements

DPR = "sandbox.data-plane-ready"
CAP = 4096  # the default OPENSANDBOX_EGRESS_MAX_RULES: the daemon runs with it

# Reachable allowed destinations: the first two and the last two rules of each policy (a
# host and a CIDR per family); everything between is filler outside the topology.
P1 = big_policy(
    CAP,
    first=["10.204.0.2", "fd00:204::2"],
    last=["fd00:204::8/127", "10.204.0.8/31"],
)
P2 = big_policy(
    CAP,
    first=["10.204.0.3", "fd00:204::3"],
    last=["fd00:204::6/127", "10.204.0.6/31"],
    offset=100_000,
)


def genid(topo: Topology) -> int:
    return nft_genid(topo, topo.pod)


def transactions(d: Daemon, operation: str) -> float:
    code, body = d.get("/metrics")
    assert code == 200
    m = re.search(rf'^egress_nftables_updates_total{{operation="{operation}"}} (\S+)$', body, re.M)
    return float(m.group(1)) if m else 0.0


def assert_sets_hold(d: Daemon, nid: str, policy: dict[str, object] | None) -> None:
    sets = ip_sets(parse_policy(json.dumps(policy))) if policy is not None else None
    for kind in ("allow", "deny"):
        for fam in ("v4", "v6"):
            want = {format_element(n) for n in getattr(sets, f"{kind}_{fam}")} if sets else set()
            assert nft_set_elements(d.topo, d.topo.pod, d.table, f"subj_{nid}_{kind}_{fam}") == want, (
                f"{kind}_{fam}"
            )


def one_transaction(topo: Topology, d: Daemon, operation: str, post: dict[str, object]) -> None:
    """Post one action; it must succeed as exactly one committed kernel transaction."""
    gen, count = genid(topo), transactions(d, operation)
    code, body = d.post(post)
    assert (code, body) == (200, "{}"), body
    assert genid(topo) == gen + 1, "not exactly one kernel transaction"
    assert transactions(d, operation) == count + 1


def test_a_policy_at_the_cap_activates_updates_and_reverts_in_one_transaction_each(
    topo: Topology, daemon: Daemon
) -> None:
    subjects = [  # (uid, sandbox, key address, gateway): one v4-keyed and one v6-keyed subject
        ("sb1", 1, topo.sb_ip(1), None),
        ("sb2", 2, topo.sb_ip6(2), GATEWAY6),
    ]

    def kw(ip: str, gw: str | None) -> dict[str, Any]:
        return {"ip": ip} if gw is None else {"ip": ip, "gateway": gw}

    for uid, _sb, ip, gw in subjects:
        one_transaction(topo, daemon, "deny_first", envelope("SET_BINDING", uid, policy=P1, **kw(ip, gw)))
    assert not topo.reaches(1, "10.204.0.2")  # deny-first: the policy waits for the hook

    # Activation: the whole policy in one transaction, per subject.
    for uid, _sb, _ip, _gw in subjects:
        one_transaction(topo, daemon, "static_apply", envelope("LIFECYCLE_HOOK", uid, hook=DPR))
        assert_sets_hold(daemon, f"s_{uid}", P1)
    assert topo.reaches(1, "10.204.0.2")  # first rule (v4 host)
    assert topo.reaches(1, "10.204.0.9")  # last rule (v4 CIDR)
    assert topo.reaches(2, "fd00:204::2")  # first v6 rule (host)
    assert topo.reaches(2, "fd00:204::9")  # last v6 rule (CIDR)
    assert not topo.reaches(1, "10.204.0.5")  # not allowed by any rule

    # In-place update to another policy at the cap: one transaction each, old prefixes gone.
    for uid, _sb, ip, gw in subjects:
        post = envelope("SET_BINDING", uid, policy=P2, generation=2, **kw(ip, gw))
        one_transaction(topo, daemon, "static_apply", post)
        assert_sets_hold(daemon, f"s_{uid}", P2)
    assert topo.reaches(1, "10.204.0.3") and topo.reaches(1, "10.204.0.7")
    assert topo.reaches(2, "fd00:204::3") and topo.reaches(2, "fd00:204::7")
    assert not topo.reaches(1, "10.204.0.2") and not topo.reaches(1, "10.204.0.9")
    assert not topo.reaches(2, "fd00:204::9")

    # Revert (SET_BINDING null): every set emptied in one transaction.
    for uid, _sb, ip, gw in subjects:
        post = envelope("SET_BINDING", uid, policy=None, generation=3, **kw(ip, gw))
        one_transaction(topo, daemon, "deny_first", post)
        assert_sets_hold(daemon, f"s_{uid}", None)
    assert not topo.reaches(1, "10.204.0.3")
    assert not topo.reaches(2, "fd00:204::3")


def test_one_rule_over_the_cap_is_400_and_touches_nothing(topo: Topology, daemon: Daemon) -> None:
    over = big_policy(CAP + 1, first=["10.204.0.2"], last=["10.204.0.9"])
    gen = genid(topo)
    code, body = daemon.post(envelope("SET_BINDING", "sb3", ip=topo.sb_ip(3), policy=over))
    assert code == 400
    assert (
        body.strip()
        == f"invalid binding input: policy has {CAP + 1} rules, more than OPENSANDBOX_EGRESS_MAX_RULES={CAP}"
    )
    assert genid(topo) == gen
    assert not {n for n in daemon.object_names() if "sb3" in n}
