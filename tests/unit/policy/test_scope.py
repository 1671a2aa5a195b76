"""Rule fields ``name``, ``protocol``, ``ports`` and what they open (docs/reference/behaviour.md §18)."""

from __future__ import annotations

import ipaddress
import json
from typing import Any

import pytest

from egressd.policy import (
    NetworkPolicy,
    PolicyError,
    Scope,
    Verdict,
    evaluate_domain,
    ip_sets,
    merge_patch,
    name_denied_by_rule,
    name_scope,
    names_narrow,
    parse_policy,
    parse_policy_obj,
)


def policy(*rules: dict[str, Any], default: str = "deny") -> NetworkPolicy:
    return parse_policy_obj({"defaultAction": default, "egress": list(rules)})


# ---- parsing -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rule", "field"),
    [
        ({"action": "allow", "target": "x.io", "ports": []}, "egress[1].ports"),
        ({"action": "allow", "target": "x.io", "ports": [0]}, "egress[1].ports[0]"),
        ({"action": "allow", "target": "x.io", "ports": [65536]}, "egress[1].ports[0]"),
        ({"action": "allow", "target": "x.io", "ports": ["9-2"]}, "egress[1].ports[0]"),
        ({"action": "allow", "target": "x.io", "ports": ["0-2"]}, "egress[1].ports[0]"),
        ({"action": "allow", "target": "x.io", "ports": ["1-65536"]}, "egress[1].ports[0]"),
        ({"action": "allow", "target": "x.io", "ports": ["a-b"]}, "egress[1].ports[0]"),
        ({"action": "allow", "target": "x.io", "ports": [443, "80 - 81x"]}, "egress[1].ports[1]"),
        ({"action": "allow", "target": "x.io", "ports": [True]}, "egress[1].ports[0]"),
        ({"action": "allow", "target": "x.io", "ports": [443.0]}, "egress[1].ports[0]"),
        ({"action": "allow", "target": "x.io", "ports": 443}, "egress[1].ports"),
        ({"action": "allow", "target": "x.io", "ports": "443"}, "egress[1].ports"),
        ({"action": "allow", "target": "x.io", "protocol": "icmp"}, "egress[1].protocol"),
        ({"action": "allow", "target": "x.io", "protocol": ""}, "egress[1].protocol"),
        ({"action": "allow", "target": "x.io", "protocol": 6}, "egress[1].protocol"),
        ({"action": "allow", "target": "x.io", "name": 7}, "egress[1].name"),
        ({"action": "allow", "target": "x.io", "name": "n" * 257}, "egress[1].name"),
    ],
)
def test_bad_fields_are_refused_naming_the_rule(rule: dict[str, Any], field: str) -> None:
    doc = {"egress": [{"action": "allow", "target": "ok.io"}, rule]}
    with pytest.raises(PolicyError) as err:
        parse_policy(json.dumps(doc))
    assert err.value.field == field
    assert "\n" not in str(err.value)


def test_fields_are_kept_and_read_back() -> None:
    doc = {
        "defaultAction": "deny",
        "egress": [
            {"action": "allow", "target": "api.x.io", "ports": [443], "name": "model API"},
            {"action": "allow", "target": "10.0.0.0/8", "protocol": "TCP", "ports": ["5432-5433", 22]},
            {"action": "deny", "target": "y.io", "protocol": "udp"},
            {"action": "allow", "target": "z.io", "protocol": "https"},
            {"action": "allow", "target": "w.io", "unknown": 1},
        ],
    }
    back = parse_policy(json.dumps(doc)).to_json()
    assert back["egress"] == [
        {"action": "allow", "target": "api.x.io", "name": "model API", "ports": [443]},
        {"action": "allow", "target": "10.0.0.0/8", "protocol": "tcp", "ports": ["5432-5433", 22]},
        {"action": "deny", "target": "y.io", "protocol": "udp"},
        {"action": "allow", "target": "z.io", "protocol": "https"},
        {"action": "allow", "target": "w.io"},
    ]
    # What GET /policy returns parses to the same policy.
    assert parse_policy_obj(back).egress == parse_policy(json.dumps(doc)).egress


def test_a_rule_without_fields_is_whole_and_unchanged() -> None:
    rule = policy({"action": "allow", "target": "x.io"}).egress[0]
    assert rule.scope == Scope.WHOLE and not rule.scoped
    assert rule.to_json() == {"action": "allow", "target": "x.io"}


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"ports": [443]}, Scope.of(tcp=[(443, 443)], udp=[(443, 443)])),
        ({"protocol": "tcp"}, Scope.of(tcp=[(0, 65535)])),
        ({"protocol": "udp", "ports": ["53"]}, Scope.of(udp=[(53, 53)])),
        ({"protocol": "http"}, Scope.of(tcp=[(80, 80)])),
        ({"protocol": "https"}, Scope.of(tcp=[(443, 443)])),
        ({"protocol": "https", "ports": [8443]}, Scope.of(tcp=[(8443, 8443)])),
        ({"ports": [80, "79-81", 443]}, Scope.of(tcp=[(79, 81), (443, 443)], udp=[(79, 81), (443, 443)])),
    ],
)
def test_rule_scope(fields: dict[str, Any], expected: Scope) -> None:
    assert policy({"action": "allow", "target": "x.io", **fields}).egress[0].scope == expected


# ---- scopes --------------------------------------------------------------------------------


def test_scope_algebra() -> None:
    a = Scope.of(tcp=[(80, 80), (443, 443)])
    b = Scope.of(tcp=[(443, 450)], udp=[(53, 53)])
    assert a.union(b) == Scope.of(tcp=[(80, 80), (443, 450)], udp=[(53, 53)])
    assert a.minus(b) == Scope.of(tcp=[(80, 80)])
    assert a.intersect(b) == Scope.of(tcp=[(443, 443)])
    assert Scope.WHOLE.minus(Scope.of(tcp=[(443, 443)])).tcp == ((0, 442), (444, 65535))
    assert Scope.WHOLE.minus(Scope.WHOLE).is_empty()
    assert Scope.of(tcp=[(1, 2)]).union(Scope.of(tcp=[(3, 4)])).tcp == ((1, 4),)
    assert a.admits("tcp", 443) and not a.admits("udp", 443) and not a.admits("icmp", None)
    assert Scope.WHOLE.admits("icmp", None) and not a.admits("tcp", None)
    assert b.elements() == (("tcp", 443, 450), ("udp", 53, 53))
    assert Scope.WHOLE.describe() == "any" and Scope.EMPTY.describe() == "none"
    assert b.describe() == "tcp 443-450 udp 53"


# ---- names ---------------------------------------------------------------------------------


def test_vector_name_with_port() -> None:
    p = policy({"action": "allow", "target": "api.x.io", "ports": [443]})
    scope = name_scope(p, "api.x.io")
    assert scope.admits("tcp", 443) and not scope.admits("tcp", 80) and scope.admits("udp", 443)
    assert evaluate_domain(p, "api.x.io").verdict is Verdict.ALLOW
    assert name_scope(p, "other.x.io").is_empty()


def test_first_match_per_port() -> None:
    p = policy(
        {"action": "deny", "target": "x.io", "ports": [22]},
        {"action": "allow", "target": "x.io"},
    )
    scope = name_scope(p, "x.io")
    assert not scope.admits("tcp", 22) and scope.admits("tcp", 443) and not scope.is_whole()
    decision = evaluate_domain(p, "x.io")
    assert decision.verdict is Verdict.ALLOW and decision.index == 1
    assert not name_denied_by_rule(p, "x.io")


def test_union_of_allow_rules_that_match() -> None:
    p = policy(
        {"action": "allow", "target": "*.x.io", "protocol": "https"},
        {"action": "allow", "target": "a.x.io", "protocol": "tcp", "ports": [8080]},
    )
    assert name_scope(p, "a.x.io") == Scope.of(tcp=[(443, 443), (8080, 8080)])
    assert name_scope(p, "b.x.io") == Scope.of(tcp=[(443, 443)])


def test_a_port_an_earlier_rule_decided_stays_decided() -> None:
    p = policy(
        {"action": "deny", "target": "x.io", "ports": [443]},
        {"action": "allow", "target": "x.io", "ports": [443]},
    )
    assert name_scope(p, "x.io").is_empty()
    decision = evaluate_domain(p, "x.io")
    assert decision.verdict is Verdict.DENY and decision.index == 0
    assert name_denied_by_rule(p, "x.io")


def test_default_allow_opens_what_no_rule_decided() -> None:
    p = policy({"action": "deny", "target": "x.io", "ports": [80]}, default="allow")
    scope = name_scope(p, "x.io")
    assert not scope.admits("tcp", 80) and scope.admits("tcp", 443) and scope.admits("icmp", None)
    assert evaluate_domain(p, "x.io") == evaluate_domain(p, "x.io")
    assert evaluate_domain(p, "x.io").verdict is Verdict.ALLOW


def test_a_name_denied_by_rule_under_default_allow() -> None:
    p = policy({"action": "deny", "target": "bad.io"}, default="allow")
    assert name_denied_by_rule(p, "bad.io") and not name_denied_by_rule(p, "good.io")
    assert name_scope(p, "bad.io").is_empty() and name_scope(p, "good.io").is_whole()
    assert not name_denied_by_rule(policy(), "any.io")  # the default, not a rule


def test_unscoped_policies_decide_as_before() -> None:
    p = policy(
        {"action": "deny", "target": "a.x.io"},
        {"action": "allow", "target": "*.x.io"},
    )
    assert evaluate_domain(p, "a.x.io").index == 0 and evaluate_domain(p, "a.x.io").verdict is Verdict.DENY
    assert evaluate_domain(p, "b.x.io").index == 1
    assert name_scope(p, "b.x.io").is_whole()


# ---- addresses -----------------------------------------------------------------------------


def test_vector_cidr_with_protocol_and_ports() -> None:
    sets = ip_sets(policy({"action": "allow", "target": "10.0.0.0/8", "protocol": "tcp", "ports": ["5432-5433"]}))
    assert sets.allow_v4 == () and len(sets.allow_scoped) == 1
    scope = sets.ip_scope(ipaddress.ip_address("10.1.2.3"))
    assert scope.admits("tcp", 5432) and not scope.admits("udp", 5432) and not scope.admits("tcp", 22)
    assert sets.ip_scope(ipaddress.ip_address("11.1.2.3")).is_empty()
    assert not sets.explicitly_allows(ipaddress.ip_address("10.1.2.3"))


def test_address_rules_deny_beats_allow() -> None:
    sets = ip_sets(
        policy(
            {"action": "allow", "target": "10.0.0.0/8"},
            {"action": "deny", "target": "10.1.0.0/16", "ports": [22]},
            {"action": "deny", "target": "10.2.0.0/16"},
        )
    )
    assert sets.ip_scope(ipaddress.ip_address("10.0.0.1")).is_whole()
    within = sets.ip_scope(ipaddress.ip_address("10.1.0.1"))
    assert not within.admits("tcp", 22) and within.admits("tcp", 443)
    assert sets.ip_scope(ipaddress.ip_address("10.2.0.1")).is_empty()


# ---- edits and narrowing -------------------------------------------------------------------


def test_patch_keeps_rules_that_differ_in_ports() -> None:
    current = policy({"action": "allow", "target": "x.io"}, {"action": "allow", "target": "y.io"})
    merged = merge_patch(
        current,
        [
            {"action": "allow", "target": "x.io", "ports": [443]},
            {"action": "deny", "target": "x.io"},
            {"action": "deny", "target": "x.io", "ports": [443]},
        ],
    )
    assert [r.to_json() for r in merged.egress] == [
        {"action": "allow", "target": "x.io", "ports": [443]},
        {"action": "deny", "target": "x.io"},
        {"action": "allow", "target": "y.io"},
    ]


def test_removing_a_port_is_a_narrowing() -> None:
    old = policy({"action": "allow", "target": "x.io", "ports": [80, 443]})
    new = policy({"action": "allow", "target": "x.io", "ports": [443]})
    assert names_narrow(old, new)
    assert not names_narrow(new, new)
