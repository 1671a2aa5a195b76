"""Which TCP ports of a subject pass through the MITM (docs/reference/behaviour.md §18): 80, 443
and the extra ports for everyone, and the ports its http/https rules name. Pure."""

from __future__ import annotations

from typing import Any

from egressd.policy import NetworkPolicy, parse_policy_obj
from egressd.policy.explain import explain
from egressd.policy.mitmports import FIXED_PORTS, intercepts, named_ports, never_intercepted
from egressd.policy.scope import Scope


def policy(*rules: dict[str, Any], default: str = "deny") -> NetworkPolicy:
    return parse_policy_obj({"defaultAction": default, "egress": list(rules)})


def test_http_and_https_rules_name_their_ports_allow_and_deny_alike() -> None:
    pol = policy(
        {"action": "allow", "target": "a.io", "protocol": "https", "ports": [8443, "9000-9010"]},
        {"action": "deny", "target": "b.io", "protocol": "http", "ports": [8081]},
        {"action": "allow", "target": "c.io", "protocol": "tcp", "ports": [5432]},  # not HTTP: address level
        {"action": "allow", "target": "d.io", "protocol": "udp", "ports": [7000]},
        {"action": "allow", "target": "e.io"},  # every port, no protocol: nothing named
        {"action": "allow", "target": "10.0.0.0/8", "protocol": "https", "ports": [6443]},
    )
    assert named_ports(pol) == ((6443, 6443), (8081, 8081), (8443, 8443), (9000, 9010))
    assert named_ports(pol, (80, 443, 8081)) == ((6443, 6443), (8443, 8443), (9000, 9010))
    assert intercepts(pol, FIXED_PORTS, 9005) and intercepts(pol, FIXED_PORTS, 80)
    assert not intercepts(pol, FIXED_PORTS, 5432) and not intercepts(None, FIXED_PORTS, 8443)


def test_the_default_ports_and_request_rules_without_a_protocol() -> None:
    # http/https without ports mean 80/443 (already intercepted); methods/paths without a
    # protocol mean https (443).
    pol = policy(
        {"action": "allow", "target": "a.io", "protocol": "https"},
        {"action": "allow", "target": "b.io", "methods": ["GET"]},
        {"action": "allow", "target": "c.io", "methods": ["GET"], "ports": [8443]},
    )
    assert named_ports(pol) == ((8443, 8443),)


def test_dns_ports_are_never_intercepted_and_fixed_ports_never_named_twice() -> None:
    pol = policy({"action": "allow", "target": "a.io", "protocol": "https", "ports": ["1-65535"]})
    assert named_ports(pol) == ((1, 52), (54, 79), (81, 442), (444, 852), (854, 65535))
    assert never_intercepted(Scope.of(tcp=[(800, 900)])) and never_intercepted(Scope.of(tcp=[(53, 53)]))
    assert not never_intercepted(Scope.of(tcp=[(854, 900)], udp=[(53, 53)]))


def test_explain_says_whether_a_port_is_name_checked() -> None:
    pol = policy({"action": "allow", "target": "a.io", "protocol": "https", "ports": [8443]})
    common: dict[str, Any] = {"state": "active", "effective": pol, "leases": {}, "now": 0.0, "name_check": True}
    assert "not checked" not in explain(target="a.io", port=8443, **common)["nameCheck"]["outcome"]
    assert "not checked on port 8444" in explain(target="a.io", port=8444, **common)["nameCheck"]["outcome"]


def test_a_domain_rule_with_ports_and_no_protocol_names_its_tcp_ports() -> None:
    # No protocol: any protocol, HTTPS on those ports included, so its name is checked there.
    pol = policy(
        {"action": "allow", "target": "a.io", "ports": [8443, "9000-9001"]},
        {"action": "allow", "target": "b.io", "protocol": "tcp", "ports": [2222]},  # raw TCP: not
        {"action": "allow", "target": "10.1.2.3", "ports": [7443]},  # an address opens every name
        {"action": "deny", "target": "c.io", "ports": [6000]},
    )
    assert named_ports(pol) == ((6000, 6000), (8443, 8443), (9000, 9001))
    assert intercepts(pol, FIXED_PORTS, 9001) and not intercepts(pol, FIXED_PORTS, 2222)
    assert not intercepts(pol, FIXED_PORTS, 7443)
    # The DNS ports are never intercepted, whoever names them.
    assert named_ports(policy({"action": "allow", "target": "d.io", "ports": ["50-900"]})) == (
        (50, 52),
        (54, 79),
        (81, 442),
        (444, 852),
        (854, 900),
    )
