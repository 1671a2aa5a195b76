"""``egressctl suggest``'s pure part (docs/reference/behaviour.md §19): a policy that would have
admitted a scripted session's denials, and nothing it need not."""

from __future__ import annotations

import json

from egressd.policy import decide_request, name_scope, parse_policy, parse_policy_obj
from egressd.policy.suggest import Denied, suggest

CURRENT = parse_policy_obj(
    {
        "defaultAction": "deny",
        "egress": [
            {"action": "allow", "target": "api.x.io", "methods": ["GET"], "paths": ["/repos/*"]},
            {"action": "allow", "target": "pypi.org"},
        ],
    }
)

# An agent that hits five different denials.
SESSION = [
    Denied("registry.npmjs.org"),  # a DNS name
    Denied("api.x.io", 443, "tcp", "POST", "/repos/o/r/issues"),  # a request
    Denied("api.x.io", 443, "tcp", "DELETE", "/repos/o/r?token=abc"),  # a request with a query
    Denied("git.x.io", 22, "tcp"),  # a port
    Denied("stats.x.io", 443, "udp"),  # QUIC
    Denied("evil.io", 443, "tcp", hard=True),  # the operator's always-deny: not the tenant's to lift
    Denied("1.2.3.4", 443, "tcp"),  # no name
]


def test_a_scripted_session() -> None:
    out = suggest(CURRENT, SESSION)
    # Usable as a SET_BINDING input as it is.
    suggested = parse_policy(json.dumps(out))
    assert out["defaultAction"] == "deny" and out["egress"][-2:] == [r.to_json() for r in CURRENT.egress]
    assert "token=abc" not in json.dumps(out)
    # Every denial (but the hard one and the nameless one) would have been admitted ...
    assert not name_scope(suggested, "registry.npmjs.org").is_empty()
    assert decide_request(suggested, "api.x.io", 443, "POST", "/repos/o/r/issues").allowed
    assert decide_request(suggested, "api.x.io", 443, "DELETE", "/repos/o/r").allowed
    assert name_scope(suggested, "git.x.io").admits("tcp", 22)
    assert name_scope(suggested, "stats.x.io").admits("udp", 443)
    assert name_scope(suggested, "evil.io").is_empty()
    # ... and not much more: other methods, paths and ports stay closed.
    assert not decide_request(suggested, "api.x.io", 443, "POST", "/repos/o/r/pulls").allowed
    assert not decide_request(suggested, "api.x.io", 443, "DELETE", "/user").allowed
    assert not name_scope(suggested, "git.x.io").admits("tcp", 443)
    assert not name_scope(suggested, "registry.npmjs.org").admits("tcp", 80)


def test_nothing_denied_changes_nothing() -> None:
    assert suggest(CURRENT, []) == CURRENT.to_json()


def test_audit_mode_is_kept() -> None:
    audit = parse_policy_obj({"defaultAction": "deny", "mode": "audit", "egress": []})
    assert suggest(audit, [Denied("a.io")])["mode"] == "audit"


def test_plain_http_and_other_ports() -> None:
    out = suggest(CURRENT, [Denied("a.io", 80, "tcp", "GET", "/"), Denied("a.io", 8443, "tcp", "PUT", "/x")])
    assert out["egress"][:2] == [
        {"action": "allow", "target": "a.io", "name": "suggested from denials", "protocol": "http",
         "methods": ["GET"], "paths": ["/"]},
        {"action": "allow", "target": "a.io", "name": "suggested from denials", "protocol": "https",
         "ports": [8443], "methods": ["PUT"], "paths": ["/x"]},
    ]  # fmt: skip
