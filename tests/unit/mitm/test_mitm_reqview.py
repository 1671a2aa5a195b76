"""Request rules in the MITM child (docs/reference/behaviour.md §19): the view egressd sends for
a name (:func:`egressd.mitm.requests.view_of`), the child's reading of it and its indexed
decision, which must decide exactly as :func:`egressd.policy.requests.decide_request`."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from egressd.mitm.requests import parse_report, view_of
from egressd.mitmchild.reqview import parse_view, refusal_body, report_doc, request_target
from egressd.policy import decide_request, parse_policy_obj
from egressd.policy.model import NetworkPolicy


def policy(*rules: dict[str, Any], default: str = "deny", **extra: Any) -> NetworkPolicy:
    return parse_policy_obj({"defaultAction": default, "egress": list(rules), **extra})


VECTOR = policy(
    {"action": "allow", "target": "a.cdn.test"},
    {"action": "allow", "target": "api.x.io", "methods": ["GET"], "paths": ["/repos/*"]},
    {"action": "allow", "target": "api.x.io", "methods": ["POST"], "paths": ["/repos/o/r/issues"]},
)


def view(pol: NetworkPolicy, name: str) -> Any:
    v = parse_view(json.dumps(view_of("u1", pol, name)).encode())
    assert v is not None
    return v


@pytest.mark.parametrize(
    ("method", "path", "denied", "rule"),
    [
        ("GET", "/repos/o/r", False, 1),
        ("POST", "/repos/o/r/issues", False, 2),
        ("POST", "/repos/o/r/pulls", True, None),
        ("DELETE", "/repos/o/r", True, None),
        ("GET", "/user", True, None),
        ("get", "/repos/o/r", False, 1),
        ("HEAD", "/repos/o/r", True, None),
        ("GET", "/repos/%2e%2e/user", True, None),
        ("OPTIONS", "*", True, None),
    ],
)
def test_the_vector_through_the_view(method: str, path: str, denied: bool, rule: int | None) -> None:
    v = view(VECTOR, "api.x.io")
    assert v.judged and v.subject == "s-u1" and v.indices == (1, 2)
    j = v.judge(443, method, request_target(path))
    assert (j.denied, j.rule, j.forward) == (denied, rule, not denied)


def test_a_name_without_request_rules_is_not_judged() -> None:
    assert not view(VECTOR, "a.cdn.test").judged
    assert view_of("u1", VECTOR, None)["judged"] is True  # plain HTTP: the subject has some
    assert view_of("u1", policy({"action": "allow", "target": "x.io"}), None)["judged"] is False


def test_audit_forwards_would_denies_but_not_an_always_deny() -> None:
    pol = policy(*[r.to_json() for r in VECTOR.egress], mode="audit")
    j = view(pol, "api.x.io").judge(443, "DELETE", "/x")
    assert j.denied and j.forward
    doc = view_of("u1", pol, "api.x.io")
    doc["alwaysDeny"] = 2  # rules 0 and 1 are operator always-deny rules
    doc["rules"][0][1]["action"] = "deny"
    v = parse_view(json.dumps(doc).encode())
    assert v is not None
    j = v.judge(443, "GET", "/repos/o/r")
    assert j.denied and not j.forward and j.rule == 1


@pytest.mark.parametrize(
    "body",
    [b"", b"[]", b"{}", b'{"subject":"s","judged":true,"defaultAction":"maybe","rules":[]}',
     b'{"subject":"s","judged":true,"defaultAction":"deny","rules":[[0,{"action":"allow","target":"x.io","methods":[1]}]]}',
     b'{"subject":"s","judged":"yes","defaultAction":"deny","rules":[]}'],
)  # fmt: skip
def test_a_bad_view_is_none(body: bytes) -> None:
    assert parse_view(body) is None


def test_the_refusal_body_and_report_carry_no_query() -> None:
    body = json.loads(refusal_body("s-u1", "api.x.io", "GET", "/user?token=secret#f", "default_action", None))
    assert body == {
        "error": "egress_denied",
        "subject": "s-u1",
        "host": "api.x.io",
        "method": "GET",
        "path": "/user",
        "reason": "default_action",
        "rule": None,
    }
    j = view(VECTOR, "api.x.io").judge(443, "GET", "/user?token=secret")
    doc = report_doc("api.x.io", 443, "GET", "/user?token=secret", j)
    assert "secret" not in json.dumps(doc)
    report = parse_report(doc)
    assert report is not None and report.path == "/user" and not report.audit
    assert parse_report({**doc, "rule": True}) is None and parse_report({**doc, "port": 0}) is None


METHODS = ["GET", "POST", "DELETE", "HEAD"]
PATHS = ["/", "/a", "/a/", "/a/b", "/ab", "/a/b/c", "/b", "/b/a", "/repos/o/r", "*"]
PATTERNS = ["/*", "/a", "/a*", "/a/*", "/a/b", "/b*", "/repos/*", "/a/b/c"]


def random_policy(rng: random.Random) -> NetworkPolicy:
    rules = []
    for _ in range(rng.randint(1, 12)):
        rule: dict[str, Any] = {"action": rng.choice(["allow", "deny"]), "target": "api.x.io"}
        if rng.random() < 0.8:
            rule["methods"] = rng.sample(METHODS, rng.randint(1, 3))
        if rng.random() < 0.8:
            rule["paths"] = rng.sample(PATTERNS, rng.randint(1, 3))
        if rng.random() < 0.3:
            rule["ports"] = [rng.choice([443, 8443])]
        if "methods" not in rule and "paths" not in rule and rng.random() < 0.5:
            rule["methods"] = ["GET"]
        rules.append(rule)
    return policy(*rules, default=rng.choice(["allow", "deny"]))


def test_the_index_decides_as_decide_request_on_random_policies() -> None:
    rng = random.Random(19)
    paths = [*PATHS, "/a/../b", "/a/%2e%2e/b", "/a%2fb", "//a", "/a;x/b", "/a/./b", "/a?q=1"]
    for _ in range(300):
        pol = random_policy(rng)
        v = view(pol, "api.x.io")
        if not v.judged:
            continue  # no rule with methods/paths: the child does not judge its requests
        for _ in range(20):
            port, method, path = rng.choice([443, 8443]), rng.choice([*METHODS, "get"]), rng.choice(paths)
            want = decide_request(pol, "api.x.io", port, method, path)
            got = v.judge(port, method, request_target(path))
            assert (got.denied, got.rule, got.reason) == (not want.allowed, want.rule, want.reason.value), (
                pol.to_json(), port, method, path,
            )  # fmt: skip
