"""Request rules: ``methods`` and ``paths`` (docs/reference/behaviour.md §19), the pure decision."""

from __future__ import annotations

import json
from typing import Any

import pytest

from egressd.policy import (
    NetworkPolicy,
    PolicyError,
    RequestReason,
    Verdict,
    decide_request,
    evaluate_domain,
    judges_requests,
    merge_patch,
    name_scope,
    names_narrow,
    parse_policy,
    parse_policy_obj,
)
from egressd.policy.reqpath import canonical, readings


def policy(*rules: dict[str, Any], default: str = "deny") -> NetworkPolicy:
    return parse_policy_obj({"defaultAction": default, "egress": list(rules)})


VECTOR = policy(
    {"action": "allow", "target": "api.x.io", "methods": ["GET"], "paths": ["/repos/*"]},
    {"action": "allow", "target": "api.x.io", "methods": ["POST"], "paths": ["/repos/o/r/issues"]},
)


@pytest.mark.parametrize(
    ("method", "path", "allowed", "rule"),
    [
        ("GET", "/repos/o/r", True, 0),
        ("POST", "/repos/o/r/issues", True, 1),
        ("POST", "/repos/o/r/pulls", False, None),
        ("DELETE", "/repos/o/r", False, None),
        ("GET", "/user", False, None),
    ],
)
def test_spec_vector(method: str, path: str, allowed: bool, rule: int | None) -> None:
    decision = decide_request(VECTOR, "api.x.io", 443, method, path)
    assert decision.allowed is allowed and decision.rule == rule


# ---- parsing -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rule", "field"),
    [
        ({"target": "10.0.0.1", "methods": ["GET"]}, "egress[0].methods"),
        ({"target": "10.0.0.0/8", "paths": ["/x"]}, "egress[0].paths"),
        ({"target": "x.io", "protocol": "tcp", "methods": ["GET"]}, "egress[0].protocol"),
        ({"target": "x.io", "protocol": "udp", "paths": ["/x"]}, "egress[0].protocol"),
        ({"target": "x.io", "methods": []}, "egress[0].methods"),
        ({"target": "x.io", "methods": "GET"}, "egress[0].methods"),
        ({"target": "x.io", "methods": ["GE T"]}, "egress[0].methods[0]"),
        ({"target": "x.io", "methods": [1]}, "egress[0].methods[0]"),
        ({"target": "x.io", "paths": []}, "egress[0].paths"),
        ({"target": "x.io", "paths": ["x"]}, "egress[0].paths[0]"),
        ({"target": "x.io", "paths": ["/a*b"]}, "egress[0].paths[0]"),
        ({"target": "x.io", "paths": ["/a?b=1"]}, "egress[0].paths[0]"),
        ({"target": "x.io", "paths": ["/a/../b"]}, "egress[0].paths[0]"),
        ({"target": "x.io", "paths": ["/a%2fb"]}, "egress[0].paths[0]"),
        ({"target": "x.io", "paths": ["/a b"]}, "egress[0].paths[0]"),
        ({"target": "x.io", "paths": ["/a\\b"]}, "egress[0].paths[0]"),
    ],
)
def test_bad_request_fields_are_refused_naming_the_field(rule: dict[str, Any], field: str) -> None:
    with pytest.raises(PolicyError) as err:
        parse_policy(json.dumps({"egress": [{"action": "allow", **rule}]}))
    assert err.value.field == field


def test_fields_are_kept_methods_upper_cased() -> None:
    doc = {"egress": [{"action": "deny", "target": "api.x.io", "methods": ["post", "Delete"], "paths": ["/a", "/b/*"]}]}
    back = parse_policy(json.dumps(doc)).to_json()["egress"]
    assert back == [{"action": "deny", "target": "api.x.io", "methods": ["POST", "DELETE"], "paths": ["/a", "/b/*"]}]
    rule = parse_policy(json.dumps(doc)).egress[0]
    assert rule.scope.admits("tcp", 443) and not rule.scope.admits("tcp", 80)  # https when absent
    http = policy({"action": "allow", "target": "x.io", "protocol": "http", "methods": ["GET"]}).egress[0]
    assert http.scope.admits("tcp", 80) and not http.scope.admits("tcp", 443)


# ---- names ---------------------------------------------------------------------------------


def test_a_request_deny_does_not_deny_the_name() -> None:
    p = policy({"action": "deny", "target": "api.x.io", "methods": ["POST"]}, default="allow")
    assert evaluate_domain(p, "api.x.io").verdict is Verdict.ALLOW
    assert name_scope(p, "api.x.io").is_whole()
    assert judges_requests(p, "api.x.io") and not judges_requests(p, "other.io")


def test_a_request_allow_opens_its_name_on_its_port() -> None:
    scope = name_scope(VECTOR, "api.x.io")
    assert scope.admits("tcp", 443) and not scope.admits("tcp", 80) and not scope.admits("udp", 443)
    assert evaluate_domain(VECTOR, "api.x.io").verdict is Verdict.ALLOW


def test_changing_methods_is_a_narrowing_and_patch_keeps_both() -> None:
    wide = policy({"action": "allow", "target": "api.x.io", "methods": ["GET", "POST"]})
    narrow = policy({"action": "allow", "target": "api.x.io", "methods": ["GET"]})
    assert names_narrow(wide, narrow)
    merged = merge_patch(narrow, [{"action": "allow", "target": "api.x.io", "methods": ["GET"]},
                                  {"action": "allow", "target": "api.x.io", "methods": ["PUT"]}])  # fmt: skip
    assert [r.methods for r in merged.egress] == [("GET",), ("PUT",)]


# ---- decisions -----------------------------------------------------------------------------


def test_first_match_in_policy_order_then_default() -> None:
    p = policy(
        {"action": "deny", "target": "api.x.io", "methods": ["DELETE"]},
        {"action": "allow", "target": "*.x.io"},
        default="deny",
    )
    assert decide_request(p, "api.x.io", 443, "DELETE", "/a").rule == 0
    allowed = decide_request(p, "api.x.io", 443, "GET", "/a")
    assert allowed.allowed and allowed.rule == 1 and allowed.reason is RequestReason.RULE
    assert decide_request(p, "other.io", 443, "GET", "/").reason is RequestReason.DEFAULT


def test_port_must_match() -> None:
    p = policy({"action": "allow", "target": "api.x.io", "methods": ["GET"]})
    assert decide_request(p, "api.x.io", 443, "GET", "/").allowed
    assert not decide_request(p, "api.x.io", 8443, "GET", "/").allowed


@pytest.mark.parametrize(
    "method", ["post", "Post", "pOST"],
)
def test_method_case_is_judged_upper(method: str) -> None:
    p = policy({"action": "deny", "target": "api.x.io", "methods": ["POST"]}, default="allow")
    assert not decide_request(p, "api.x.io", 443, method, "/x").allowed


def test_head_is_not_get() -> None:
    p = policy({"action": "allow", "target": "api.x.io", "methods": ["GET"]})
    assert not decide_request(p, "api.x.io", 443, "HEAD", "/").allowed
    assert not decide_request(p, "api.x.io", 443, "OPTIONS", "*").allowed


DENY_ADMIN = policy({"action": "deny", "target": "api.x.io", "paths": ["/admin", "/admin/*"]}, default="allow")
ONLY_REPOS = policy({"action": "allow", "target": "api.x.io", "paths": ["/repos/*"]})


@pytest.mark.parametrize(
    "path",
    [
        "/admin",
        "/admin/",
        "/admin?x=1",
        "//admin",
        "/./admin",
        "/admin;x=1",
        "/%61dmin",
        "/adm%69n/",
        "/x/../admin",
        "/x/%2e%2e/admin",
        "/x/%252e%252e/admin",
        "/x%2f..%2fadmin",
        "/x\\..\\admin",
        "/admin/.",
        "///admin//users",
    ],
)
def test_path_tricks_never_pass_a_deny(path: str) -> None:
    assert not decide_request(DENY_ADMIN, "api.x.io", 443, "GET", path).allowed


@pytest.mark.parametrize(
    "path",
    ["/repos/../user", "/repos/%2e%2e/user", "/repos%2f..%2fuser", "/repos/x/..;/..;/user", "/repos/%252e%252e/user"],
)
def test_path_tricks_never_leave_an_allowed_prefix(path: str) -> None:
    assert not decide_request(ONLY_REPOS, "api.x.io", 443, "GET", path).allowed


@pytest.mark.parametrize("path", ["/repos/o/r", "/repos/o/r?per_page=1", "/repos/o%20x/r", "/repos/"])
def test_plain_paths_pass(path: str) -> None:
    assert decide_request(ONLY_REPOS, "api.x.io", 443, "GET", path).allowed


@pytest.mark.parametrize(
    "target",
    [
        "/repos/#/../../user",  # "/user" to a server that keeps "#" and removes dot segments
        "/repos/x#y",
        "/repos/x?q=#/../user",
        "/repos/x /user",  # HTTP/2 ":path" with a space: "/repos/x" or more, depending on the server
        "/repos/x\t/user",
        "/repos/x\x0b/user",
        "/repos/x\x7f",
        "/repos/x?a b",
        "/repos/o/r%00",  # "/repos/o/r" then NUL: the end of the path to a C server
    ],
)
def test_targets_servers_read_differently_are_refused(target: str) -> None:
    decision = decide_request(ONLY_REPOS, "api.x.io", 443, "GET", target)
    assert not decision.allowed and decision.reason is RequestReason.PATH_TRICK and decision.rule is None
    assert not decide_request(DENY_ADMIN, "api.x.io", 443, "GET", target).allowed


@pytest.mark.parametrize("method", ["GET /user", "GET\t/user", "GET\x0b", "DELETE /x", "", "G\u00c9T"])
def test_methods_that_are_no_token_are_refused(method: str) -> None:
    # HTTP/2 ":method" "GET /user" with ":path" "/repos/x" is the HTTP/1 line "GET /user /repos/x".
    deny_delete = policy({"action": "deny", "target": "api.x.io", "methods": ["DELETE"]}, default="allow")
    for pol in (ONLY_REPOS, DENY_ADMIN, deny_delete):
        decision = decide_request(pol, "api.x.io", 443, method, "/repos/x")
        assert not decision.allowed and decision.reason is RequestReason.METHOD_TRICK, (pol, method)


def test_encoded_slash_must_pass_both_readings() -> None:
    # "/repos%2fo" is "/repos%2fo" to one server and "/repos/o" to another: both must pass.
    assert not decide_request(ONLY_REPOS, "api.x.io", 443, "GET", "/repos%2fo").allowed


def test_readings() -> None:
    assert canonical("//a//b/./c;p/") == "/a/b/c/"
    assert readings("/a") == ("/a",)
    assert readings("/%2e%2e/x") is None and readings("/%252e") is None


def test_request_rules_this_daemon_cannot_enforce_are_refused() -> None:
    """§19 in the daemon: without the MITM, or on a port the MITM never sees (53, 853), a rule
    with methods/paths would let its requests pass unjudged: every policy entry point refuses
    it. Any other port such a rule names is intercepted for its subject (§18)."""
    from egressd.policy.edit import rule_cap_problem
    from egressd.policy.requests import intercepted_ports, set_intercepted_ports, unenforceable_problem

    on_8443 = policy({"action": "allow", "target": "a.io", "methods": ["GET"], "ports": [8443]})
    plain = policy({"action": "allow", "target": "a.io"})
    assert unenforceable_problem(on_8443, intercepted_ports(False, ())) is not None
    assert unenforceable_problem(plain, intercepted_ports(False, ())) is None
    assert unenforceable_problem(on_8443, intercepted_ports(True, ())) is None
    assert unenforceable_problem(on_8443, intercepted_ports(True, (8443,))) is None
    on_dot = policy({"action": "allow", "target": "a.io", "methods": ["GET"], "ports": ["800-900"]})
    assert "853" in (unenforceable_problem(on_dot, intercepted_ports(True, ())) or "")
    assert unenforceable_problem(VECTOR, intercepted_ports(True, ())) is None
    try:
        set_intercepted_ports(intercepted_ports(False, ()))
        assert "MITM" in (rule_cap_problem(VECTOR, 0) or "")
    finally:
        set_intercepted_ports(None)
    assert rule_cap_problem(VECTOR, 0) is None
