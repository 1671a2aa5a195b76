"""The sidecar ruleset generator's output, byte for byte, for a fixed set of inputs.

``golden_sidecar.sha256`` holds, per case of :func:`corpus`, the SHA-256 of the script the
generator produced when the file was last regenerated. Restructuring the generator must leave
every digest unchanged. To see what changed, write the full texts at both commits and diff them
(``.venv/bin/python -m tests.unit.sidecarnft.test_sidecar_golden --full OUT``); a deliberate
change of the ruleset regenerates the digests (the same command without arguments) and the
diff of the full texts is reviewed.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import replace
from ipaddress import ip_address, ip_network
from pathlib import Path

from egressd.policy import DENY_ALL, NetworkPolicy, parse_policy
from egressd.policy.scope import Scope
from egressd.sidecarnft.ruleset import SidecarTable, delete_table, dyn_add, lease_element, ruleset
from egressd.subject.leases import Grant
from egressd.subject.scopes import LeaseScope
from tests.unit.golden import changed_cases, main

GOLDEN = Path(__file__).with_name("golden_sidecar.sha256")

BASE = SidecarTable(table="T")
CONFIGS: dict[str, SidecarTable] = {
    "default": BASE,
    "dns_only": replace(BASE, mode="dns"),
    "dns_only_mitm": replace(BASE, mode="dns", mitm_port=18081),
    "mitm_extra": replace(BASE, mitm_port=18081, mitm_extra_ports=(8080,)),
    "doh_all": replace(BASE, block_doh_443=True),
    "doh_list": replace(
        BASE,
        block_doh_443=True,
        doh_blocklist=(ip_network("1.1.1.0/24"), ip_network("1.1.1.1/32"), ip_network("2606:4700::/32")),
    ),
    "doh_list_v6_off": replace(BASE, doh_blocklist=(ip_network("2606:4700::/32"),)),
    "reject_exempt": replace(
        BASE,
        table="opensandbox",
        dns_port=5353,
        deny_reject=True,
        nameserver_exempt=(ip_address("10.96.0.10"), ip_address("fd00::53")),
        resolvers=(ip_address("10.96.0.10"), ip_address("2001:4860:4860::8888")),
    ),
    "replace_unbounded": replace(BASE, renew_by_replace=True, max_leases=0),
    "name_check": replace(BASE, mitm_port=18081),
}

POLICIES: dict[str, NetworkPolicy] = {
    "deny_all": DENY_ALL,
    "example": parse_policy(
        '{"defaultAction":"deny","egress":[{"action":"allow","target":"*.example.com"},'
        '{"action":"allow","target":"8.8.8.8"},{"action":"deny","target":"10.0.0.1"},'
        '{"action":"allow","target":"10.0.0.0/24"},{"action":"allow","target":"2001:db8::/32"}]}'
    ),
    "allow_but": parse_policy('{"defaultAction":"allow","egress":[{"action":"deny","target":"1.2.3.4"}]}'),
    # Port-scoped rules (docs/reference/behaviour.md §18), overlapping ones cut into disjoint elements.
    "ports": parse_policy(
        '{"defaultAction":"deny","egress":[{"action":"allow","target":"10.0.0.0/8","protocol":"tcp",'
        '"ports":["5432-5433"]},{"action":"allow","target":"10.1.0.0/16","ports":["5000-6000"]},'
        '{"action":"deny","target":"10.1.2.3","protocol":"udp","ports":[53]},'
        '{"action":"allow","target":"2001:db8::/32","protocol":"https"}]}'
    ),
}

LEASES = (
    (ip_address("93.184.216.34"), 300.0),
    (ip_address("2606:2800::1"), 0.2),
    (ip_address("1.1.1.1"), 0.0),
    (ip_address("1.0.0.1"), 1000.0),
    Grant(ip_address("93.184.216.35"), 90, LeaseScope(False, Scope(tcp=((443, 443),)))),
    Grant(
        ip_address("2606:2800::2"),
        90,
        LeaseScope(False, Scope(tcp=((80, 80), (443, 443)))),
        Scope(tcp=((443, 443),)),
    ),
    Grant(ip_address("93.184.216.36"), 60, LeaseScope(True, Scope(udp=((443, 443),)))),
)


def _cases() -> Iterator[tuple[str, str]]:
    for name, cfg in CONFIGS.items():
        for pname, policy in POLICIES.items():
            yield f"{name}/{pname}", ruleset(cfg, policy)
        yield f"{name}/leases_dropped", ruleset(cfg, POLICIES["example"], LEASES, dropped=42)
        yield f"{name}/negative_dropped", ruleset(cfg, DENY_ALL, (), dropped=-3)
        yield f"{name}/dyn_add", dyn_add(cfg, LEASES)
        yield f"{name}/dyn_add_v6", dyn_add(cfg, LEASES[1:2])
        yield f"{name}/dyn_add_empty", dyn_add(cfg, ())
        yield f"{name}/delete_table", delete_table(cfg)
    yield "lease_elements", "\n".join(lease_element(ip, s) for ip, s in LEASES[:4])


def corpus() -> dict[str, str]:
    out: dict[str, str] = {}
    for key, text in _cases():
        assert key not in out, key
        out[key] = text
    return out


def test_the_generated_ruleset_matches_the_golden_digests() -> None:
    changed = changed_cases(GOLDEN, corpus())
    assert not changed, f"{len(changed)} generated cases differ from {GOLDEN.name}: {changed[:20]}"


if __name__ == "__main__":
    main(GOLDEN, corpus, sys.argv[1:])
