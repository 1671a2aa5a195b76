"""§5 network policy: parsing, DNS evaluation, IP sets, always-rules, PATCH/DELETE edits."""

from __future__ import annotations

import json
import os
from ipaddress import IPv4Network, IPv6Network, ip_network
from pathlib import Path
from typing import Any

import pytest

from egressd.policy import (
    DENY_ALL,
    EMPTY_ALWAYS,
    AlwaysRules,
    AlwaysRulesError,
    NetworkPolicy,
    PolicyError,
    Rule,
    TargetKind,
    Verdict,
    check_rule_cap,
    delete_targets,
    domain_matches,
    effective_policy,
    evaluate_domain,
    format_element,
    ip_sets,
    load_always_rules,
    merge_patch,
    normalise_name,
    normalise_networks,
    parse_always_text,
    parse_policy,
    parse_policy_obj,
    parse_rule,
    parse_target,
    policy_mode,
)

P1 = (
    '{"defaultAction":"deny","egress":[{"action":"allow","target":"*.example.com"},'
    '{"action":"deny","target":"api.example.com"},{"action":"allow","target":"*.internal.example.com"},'
    '{"action":"deny","target":"10.0.0.1"},{"action":"allow","target":"10.0.0.0/24"}]}'
)


def pol(default: str, *rules: tuple[str, str]) -> NetworkPolicy:
    return parse_policy_obj(
        {"defaultAction": default, "egress": [{"action": a, "target": t} for a, t in rules]}
    )


def pairs(policy: NetworkPolicy) -> list[tuple[str, str]]:
    return [(r.action.value, r.target) for r in policy.egress]


# --- parsing: documents -------------------------------------------------------------------


@pytest.mark.parametrize("raw", [None, "", "   ", "\n\t", "null", " null ", "{}", b"", b"{}", b"null"])
def test_empty_documents_are_deny_all(raw: str | bytes | None) -> None:
    policy = parse_policy(raw)
    assert policy == DENY_ALL
    assert policy_mode(policy) == "deny_all"


@pytest.mark.parametrize(
    ("raw", "got"), [("[]", "array"), ("42", "number"), ('"x"', "string"), ("true", "boolean")]
)
def test_non_object_documents_are_rejected(raw: str, got: str) -> None:
    with pytest.raises(PolicyError, match=f"must be a JSON object, got {got}"):
        parse_policy(raw)


@pytest.mark.parametrize("raw", ["{not json SECRET", '{"egress": [', "nul", "{'a': 1}"])
def test_invalid_json_is_rejected_without_echo(raw: str) -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy(raw)
    message = str(info.value)
    assert message.startswith("policy is not valid JSON")
    assert raw not in message
    assert "SECRET" not in message
    assert "\n" not in message


def test_invalid_utf8_and_deep_nesting_are_policy_errors() -> None:
    with pytest.raises(PolicyError, match="UTF-8"):
        parse_policy(b'{"egress": "\xff"}')
    with pytest.raises(PolicyError, match="not valid JSON"):
        parse_policy("[" * 200_000)


def test_bytes_and_str_parse_the_same() -> None:
    assert parse_policy(P1.encode()) == parse_policy(P1)


@pytest.mark.parametrize("raw", ['{"egress": null}', '{"defaultAction": "deny", "egress": []}'])
def test_no_rules(raw: str) -> None:
    assert parse_policy(raw) == DENY_ALL


def test_unknown_keys_are_ignored() -> None:
    policy = parse_policy(
        '{"defaultAction":"allow","extra":[1],"egress":[{"action":"deny","target":"x.com","comment":"hi"}]}'
    )
    assert policy.default_action is Verdict.ALLOW
    assert pairs(policy) == [("deny", "x.com")]


def test_missing_actions_default_to_deny() -> None:
    policy = parse_policy('{"egress":[{"target":"x.com"}]}')
    assert policy.default_action is Verdict.DENY
    assert policy.egress == (Rule(Verdict.DENY, "x.com", TargetKind.DOMAIN, None),)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("ALLOW ", Verdict.ALLOW),
        (" Deny", Verdict.DENY),
        ("", Verdict.DENY),
        ("  ", Verdict.DENY),
        (None, Verdict.DENY),
    ],
)
def test_default_action_normalisation(value: str | None, expected: Verdict) -> None:
    assert parse_policy_obj({"defaultAction": value}).default_action is expected


@pytest.mark.parametrize(
    ("obj", "field"),
    [
        ({"defaultAction": "maybe"}, "defaultAction"),
        ({"defaultAction": 1}, "defaultAction"),
        ({"defaultAction": True}, "defaultAction"),
        ({"egress": {"action": "allow"}}, "egress"),
        ({"egress": "x.com"}, "egress"),
        ({"egress": ["x.com"]}, "egress[0]"),
        ({"egress": [{"action": "foo", "target": "x.com"}]}, "egress[0].action"),
        ({"egress": [{"action": 1, "target": "x.com"}]}, "egress[0].action"),
        ({"egress": [{"action": "allow", "target": ""}]}, "egress[0].target"),
        ({"egress": [{"action": "allow", "target": "   "}]}, "egress[0].target"),
        ({"egress": [{"action": "allow"}]}, "egress[0].target"),
        ({"egress": [{"action": "allow", "target": 5}]}, "egress[0].target"),
        ({"egress": [{"target": "a.com"}, {"target": "a.com"}, {"target": "a.*.com"}]}, "egress[2].target"),
    ],
)
def test_invalid_documents_name_the_field(obj: dict[str, Any], field: str) -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy(json.dumps(obj))
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")


def test_spec_400_vectors() -> None:
    for raw in (
        '{"egress":[{"action":"foo","target":"x.com"}]}',
        '{"egress":[{"action":"allow","target":""}]}',
    ):
        with pytest.raises(PolicyError):
            parse_policy(raw)


def test_policy_error_is_value_error_and_echo_is_bounded() -> None:
    long_target = "a*" + "b" * 500
    with pytest.raises(ValueError) as info:
        parse_rule({"action": "allow", "target": long_target}, "egress[2]")
    message = str(info.value)
    assert message.startswith("egress[2].target: '*' is only allowed as a leading '*.'")
    assert "b" * 81 not in message
    assert len(message) < 200


# --- parsing: targets ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "target", "kind", "network"),
    [
        ("example.com", "example.com", TargetKind.DOMAIN, None),
        (" WWW.Example.COM. ", "www.example.com", TargetKind.DOMAIN, None),
        ("*.Example.com", "*.example.com", TargetKind.DOMAIN, None),
        ("*.com", "*.com", TargetKind.DOMAIN, None),
        ("*.x.com.", "*.x.com", TargetKind.DOMAIN, None),
        ("localhost", "localhost", TargetKind.DOMAIN, None),
        ("_srv._tcp.x.com", "_srv._tcp.x.com", TargetKind.DOMAIN, None),
        ("a" * 63 + ".com", "a" * 63 + ".com", TargetKind.DOMAIN, None),
        ("10.0.0.1", "10.0.0.1", TargetKind.IP, ip_network("10.0.0.1/32")),
        (" 8.8.8.8 ", "8.8.8.8", TargetKind.IP, ip_network("8.8.8.8/32")),
        ("2001:DB8::1", "2001:DB8::1", TargetKind.IP, ip_network("2001:db8::1/128")),
        ("::1", "::1", TargetKind.IP, ip_network("::1/128")),
        ("::ffff:10.0.0.1", "::ffff:10.0.0.1", TargetKind.IP, ip_network("::ffff:10.0.0.1/128")),
        ("10.0.0.0/24", "10.0.0.0/24", TargetKind.CIDR, ip_network("10.0.0.0/24")),
        ("10.0.0.5/24", "10.0.0.5/24", TargetKind.CIDR, ip_network("10.0.0.0/24")),
        ("0.0.0.0/0", "0.0.0.0/0", TargetKind.CIDR, ip_network("0.0.0.0/0")),
        ("2001:db8::5/32", "2001:db8::5/32", TargetKind.CIDR, ip_network("2001:db8::/32")),
        ("10.0.0.1/32", "10.0.0.1/32", TargetKind.CIDR, ip_network("10.0.0.1/32")),
    ],
)
def test_parse_target(text: str, target: str, kind: TargetKind, network: object) -> None:
    assert parse_target(text) == (target, kind, network)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "  ",
        ".",
        "*",
        "*.",
        "a.*.com",
        "*a.com",
        "a*.com",
        "*.*.com",
        "**.com",
        "a.com*",
        "a b.com",
        "a\tb",
        "http://x.com",
        "a/b",
        "x.com/",
        "a..b",
        ".a",
        "a..",
        "a" * 64 + ".com",
        ".".join(["a" * 60] * 5),
        "10.0.0.0/33",
        "10.0.0.0/-1",
        "10.0.0.0/255.0.0.0",
        "10.0.0.0/8/9",
        "2001:db8::/129",
        "fe80::1%eth0",
        "1.2.3.256",
        "10.0.0.01",
    ],
)
def test_invalid_targets(text: str) -> None:
    with pytest.raises(PolicyError) as info:
        parse_target(text, "egress[0].target")
    assert info.value.field == "egress[0].target"
    assert "\n" not in str(info.value)


def test_domain_length_limit_is_after_normalisation() -> None:
    name = ".".join(["a" * 61] * 4) + ".aaaaa"
    assert len(name) == 253
    assert parse_target(name.upper() + ".")[0] == name
    with pytest.raises(PolicyError, match="253"):
        parse_target(name + "a")


def test_to_json_shape() -> None:
    policy = parse_policy(P1)
    doc = policy.to_json()
    assert doc == json.loads(P1)
    assert json.loads(json.dumps(doc)) == doc
    assert DENY_ALL.to_json() == {"defaultAction": "deny", "egress": []}
    assert parse_policy('{"egress":[{"target":"X.com."}]}').to_json() == {
        "defaultAction": "deny",
        "egress": [{"action": "deny", "target": "x.com"}],
    }
    assert parse_policy(json.dumps(doc)) == policy


@pytest.mark.parametrize(
    ("policy", "mode"),
    [
        (None, "deny_all"),
        (DENY_ALL, "deny_all"),
        (pol("deny"), "deny_all"),
        (pol("allow"), "allow_all"),
        (pol("deny", ("allow", "x.com")), "enforcing"),
        (pol("allow", ("deny", "x.com")), "enforcing"),
        (pol("allow", ("allow", "10.0.0.1")), "enforcing"),
    ],
)
def test_policy_mode(policy: NetworkPolicy | None, mode: str) -> None:
    assert policy_mode(policy) == mode


# --- DNS evaluation -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "verdict", "rule_target"),
    [
        ("api.example.com.", Verdict.ALLOW, "*.example.com"),
        ("WWW.Example.COM", Verdict.ALLOW, "*.example.com"),
        ("example.com", Verdict.DENY, None),
        ("a.internal.example.com", Verdict.ALLOW, "*.example.com"),
        ("unknown.test.", Verdict.DENY, None),
        ("10.0.0.2", Verdict.DENY, None),
    ],
)
def test_p1_dns(name: str, verdict: Verdict, rule_target: str | None) -> None:
    decision = evaluate_domain(parse_policy(P1), name)
    assert decision.verdict is verdict
    assert (decision.rule.target if decision.rule else None) == rule_target


@pytest.mark.parametrize(("name", "verdict"), [("evil.com", Verdict.DENY), ("x.com", Verdict.ALLOW)])
def test_default_allow_with_deny_rule(name: str, verdict: Verdict) -> None:
    policy = parse_policy('{"defaultAction":"allow","egress":[{"action":"deny","target":"evil.com"}]}')
    assert evaluate_domain(policy, name).verdict is verdict


def test_first_match_wins() -> None:
    specific_first = pol("allow", ("deny", "api.example.com"), ("allow", "*.example.com"))
    assert evaluate_domain(specific_first, "api.example.com").verdict is Verdict.DENY
    assert evaluate_domain(specific_first, "www.example.com").verdict is Verdict.ALLOW
    dup = pol("deny", ("allow", "x.com"), ("deny", "x.com"))
    decision = evaluate_domain(dup, "X.COM.")
    assert decision.verdict is Verdict.ALLOW
    assert decision.rule == dup.egress[0]


def test_ip_rules_do_not_affect_dns() -> None:
    policy = pol("allow", ("deny", "10.0.0.1"), ("deny", "10.0.0.0/8"))
    assert evaluate_domain(policy, "10.0.0.1") == evaluate_domain(policy, "anything")
    assert evaluate_domain(policy, "10.0.0.1").rule is None


@pytest.mark.parametrize(
    ("pattern", "name", "matches"),
    [
        ("x.com", "x.com", True),
        ("x.com", "X.COM.", True),
        ("x.com", "a.x.com", False),
        ("*.x.com", "a.x.com", True),
        ("*.x.com", "a.b.x.com", True),
        ("*.x.com", "A.X.COM.", True),
        ("*.x.com", "x.com", False),
        ("*.x.com", "x.com.", False),
        ("*.x.com", "ax.com", False),
        ("*.x.com", ".x.com", False),
        ("*.x.com", "a.x.com.evil", False),
        ("*.com", "x.com", True),
        ("*.com", "com", False),
        ("a.x.com", "*.x.com", False),
    ],
)
def test_domain_matches(pattern: str, name: str, matches: bool) -> None:
    assert domain_matches(pattern, name) is matches


@pytest.mark.parametrize(
    ("name", "out"), [("A.B.", "a.b"), ("a.b", "a.b"), ("a.b..", "a.b."), ("", ""), (".", "")]
)
def test_normalise_name(name: str, out: str) -> None:
    assert normalise_name(name) == out


# --- IP sets ------------------------------------------------------------------------------


def test_p1_ip_sets() -> None:
    sets = ip_sets(parse_policy(P1))
    assert [format_element(n) for n in sets.allow_v4] == ["10.0.0.0/24"]
    assert [format_element(n) for n in sets.deny_v4] == ["10.0.0.1"]
    assert sets.allow_v6 == () and sets.deny_v6 == ()


@pytest.mark.parametrize(
    ("elements", "expected"),
    [
        ("10.99.0.0/24,10.99.0.9", ["10.99.0.0/24"]),
        ("100.64.0.0/10,127.0.0.1,100.100.2.136", ["100.64.0.0/10", "127.0.0.1"]),
        ("8.8.8.8,8.8.8.8", ["8.8.8.8"]),
        ("2001:db8::/32,2001:db8::1", ["2001:db8::/32"]),
        ("10.0.0.0/25,10.0.0.128/25", ["10.0.0.0/25", "10.0.0.128/25"]),  # adjacent: not merged
        ("10.0.0.0/24,10.0.0.0/24,10.0.0.0/16", ["10.0.0.0/16"]),
        ("10.1.0.0/16,10.0.0.5/8,9.9.9.9", ["9.9.9.9", "10.0.0.0/8"]),
        ("10.0.0.7,10.0.0.3,10.0.0.0/30", ["10.0.0.0/30", "10.0.0.7"]),
        ("0.0.0.0/0,1.2.3.4", ["0.0.0.0/0"]),
    ],
)
def test_set_vectors(elements: str, expected: list[str]) -> None:
    rules = [("allow", e) for e in elements.split(",")]
    sets = ip_sets(pol("deny", *rules))
    got = sets.allow_v4 or sets.allow_v6
    assert [format_element(n) for n in got] == expected
    nets = [ip_network(e, strict=False) for e in elements.split(",")]
    v4 = normalise_networks(n for n in nets if isinstance(n, IPv4Network))
    v6 = normalise_networks(n for n in nets if isinstance(n, IPv6Network))
    assert [format_element(n) for n in v4] + [format_element(n) for n in v6] == expected


def test_ip_sets_split_by_family_and_action() -> None:
    policy = pol(
        "deny",
        ("allow", "1.1.1.1"),
        ("deny", "1.1.1.1"),
        ("allow", "2001:db8::1"),
        ("deny", "2001:db8::/48"),
        ("deny", "2001:DB8::5"),
        ("allow", "example.com"),
        ("allow", "::ffff:10.0.0.1"),
        ("deny", "::ffff:192.168.0.0/112"),
    )
    sets = ip_sets(policy)
    assert sets.allow_v4 == (IPv4Network("1.1.1.1/32"), IPv4Network("10.0.0.1/32"))
    assert sets.deny_v4 == (IPv4Network("1.1.1.1/32"), IPv4Network("192.168.0.0/16"))
    assert sets.allow_v6 == (IPv6Network("2001:db8::1/128"),)
    assert sets.deny_v6 == (IPv6Network("2001:db8::/48"),)
    assert ip_sets(DENY_ALL) == ip_sets(pol("allow", ("allow", "x.com")))


@pytest.mark.parametrize(
    ("net", "text"),
    [
        (IPv4Network("8.8.8.8/32"), "8.8.8.8"),
        (IPv4Network("10.0.0.0/24"), "10.0.0.0/24"),
        (IPv6Network("2001:db8::1/128"), "2001:db8::1"),
        (IPv6Network("2001:db8::/32"), "2001:db8::/32"),
        (IPv4Network("0.0.0.0/0"), "0.0.0.0/0"),
    ],
)
def test_format_element(net: IPv4Network | IPv6Network, text: str) -> None:
    assert format_element(net) == text


# --- always-rules -------------------------------------------------------------------------


def test_parse_always_text() -> None:
    text = "# operator denies\n\n  Evil.COM.  \n\t# indented comment\n10.0.0.0/8\r\n2001:db8::1\n*.bad.net\n"
    rules = parse_always_text(text, "deny.always", Verdict.DENY)
    assert [(r.action, r.target, r.kind) for r in rules] == [
        (Verdict.DENY, "evil.com", TargetKind.DOMAIN),
        (Verdict.DENY, "10.0.0.0/8", TargetKind.CIDR),
        (Verdict.DENY, "2001:db8::1", TargetKind.IP),
        (Verdict.DENY, "*.bad.net", TargetKind.DOMAIN),
    ]
    assert parse_always_text("", "allow.always", Verdict.ALLOW) == ()
    assert parse_always_text("# only\n\n", "allow.always", Verdict.ALLOW) == ()


@pytest.mark.parametrize(
    ("text", "line"),
    [("ok.com\n\na.*.com\n", 3), ("# c\nhttp://x.com", 2), ("a b\n", 1), ("x.com\r\ny.com\r\n*\r\n", 3)],
)
def test_always_invalid_line_names_file_and_line(text: str, line: int) -> None:
    with pytest.raises(AlwaysRulesError, match=rf"^deny\.always:{line}: ") as info:
        parse_always_text(text, "deny.always", Verdict.DENY)
    assert "\n" not in str(info.value)


def test_load_always_rules(tmp_path: Path) -> None:
    assert load_always_rules(tmp_path) == EMPTY_ALWAYS
    assert load_always_rules(tmp_path / "missing") == EMPTY_ALWAYS
    (tmp_path / "deny.always").write_text("# d\nevil.com\n")
    assert load_always_rules(tmp_path) == AlwaysRules(
        deny=(Rule(Verdict.DENY, "evil.com", TargetKind.DOMAIN, None),), allow=()
    )
    (tmp_path / "allow.always").write_text("good.com\n8.8.8.8\n")
    loaded = load_always_rules(tmp_path)
    assert [r.target for r in loaded.allow] == ["good.com", "8.8.8.8"]
    assert all(r.action is Verdict.ALLOW for r in loaded.allow)


def test_load_always_invalid_line(tmp_path: Path) -> None:
    (tmp_path / "allow.always").write_text("good.com\n\n*bad.com\n")
    with pytest.raises(AlwaysRulesError, match=r"allow\.always:3: "):
        load_always_rules(tmp_path)


def test_load_always_directory_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "deny.always").mkdir()
    with pytest.raises(AlwaysRulesError, match=r"deny\.always"):
        load_always_rules(tmp_path)


def test_load_always_invalid_utf8_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "allow.always").write_bytes(b"good.com\n\xff\xfe\n")
    with pytest.raises(AlwaysRulesError, match=r"allow\.always.*UTF-8"):
        load_always_rules(tmp_path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root can read mode-000 files")
def test_load_always_unreadable_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "deny.always"
    path.write_text("evil.com\n")
    path.chmod(0)
    try:
        with pytest.raises(AlwaysRulesError, match=r"deny\.always"):
            load_always_rules(tmp_path)
    finally:
        path.chmod(0o600)


@pytest.mark.parametrize(
    ("deny_file", "allow_file", "user", "name", "verdict"),
    [
        ("evil.com", "", pol("deny", ("allow", "evil.com")), "evil.com", Verdict.DENY),
        ("", "good.com", pol("deny", ("deny", "good.com")), "good.com", Verdict.ALLOW),
        ("x.com", "x.com", DENY_ALL, "x.com", Verdict.DENY),
        ("x.com", "x.com", pol("allow"), "x.com", Verdict.DENY),
        ("", "", pol("allow"), "other.com", Verdict.ALLOW),
        ("evil.com", "", pol("allow"), "other.com", Verdict.ALLOW),
        ("", "good.com", DENY_ALL, "other.com", Verdict.DENY),
    ],
)
def test_effective_policy_vectors(
    deny_file: str, allow_file: str, user: NetworkPolicy, name: str, verdict: Verdict
) -> None:
    always = AlwaysRules(
        deny=parse_always_text(deny_file, "deny.always", Verdict.DENY),
        allow=parse_always_text(allow_file, "allow.always", Verdict.ALLOW),
    )
    effective = effective_policy(user, always)
    assert effective.default_action is user.default_action
    assert evaluate_domain(effective, name).verdict is verdict


def test_effective_policy_order_and_ip_sets() -> None:
    always = AlwaysRules(
        deny=parse_always_text("d.com\n10.0.0.1", "deny.always", Verdict.DENY),
        allow=parse_always_text("a.com", "allow.always", Verdict.ALLOW),
    )
    user = pol("allow", ("allow", "u.com"), ("allow", "10.0.0.0/24"))
    effective = effective_policy(user, always)
    assert pairs(effective) == [("deny", "d.com"), ("deny", "10.0.0.1"), ("allow", "a.com"), *pairs(user)]
    assert ip_sets(effective).deny_v4 == (IPv4Network("10.0.0.1/32"),)
    assert effective_policy(user, EMPTY_ALWAYS) == user
    assert policy_mode(user) == "enforcing"


# --- PATCH / DELETE -----------------------------------------------------------------------


def test_patch_vectors() -> None:
    body = json.loads('[{"action":"allow","target":"example.com"},{"action":"deny","target":"example.com"}]')
    assert pairs(merge_patch(DENY_ALL, body)) == [("allow", "example.com")]
    existing = pol("deny", ("allow", "a.com"), ("allow", "b.com"))
    merged = merge_patch(existing, [{"action": "deny", "target": "A.com"}])
    assert pairs(merged) == [("deny", "a.com"), ("allow", "b.com")]
    assert merged.default_action is Verdict.DENY


def test_patch_keeps_default_and_appends_existing_after_patch() -> None:
    existing = pol("allow", ("deny", "x.com"), ("deny", "2001:DB8::1"))
    merged = merge_patch(existing, [{"action": "allow", "target": "2001:db8::1"}, {"target": "y.com"}])
    assert pairs(merged) == [("allow", "2001:db8::1"), ("deny", "y.com"), ("deny", "x.com")]
    assert merged.default_action is Verdict.ALLOW


@pytest.mark.parametrize(
    "body",
    [
        None,
        [],
        {},
        {"action": "allow", "target": "x.com"},
        "x.com",
        [{"action": "foo", "target": "x.com"}],
        ["x.com"],
    ],
)
def test_patch_rejects(body: object) -> None:
    with pytest.raises(PolicyError):
        merge_patch(DENY_ALL, body)


def test_delete_vectors() -> None:
    existing = pol("deny", ("allow", "a.com"), ("allow", "b.com"))
    after, removed = delete_targets(existing, ["B.COM", " "])
    assert pairs(after) == [("allow", "a.com")]
    assert removed == 1
    same, none_removed = delete_targets(existing, ["c.com", ""])
    assert same == existing
    assert none_removed == 0


def test_delete_removes_every_matching_rule() -> None:
    existing = pol("allow", ("allow", "2001:db8::1"), ("deny", "2001:DB8::1"), ("deny", "x.com"))
    after, removed = delete_targets(existing, [" 2001:db8::1 "])
    assert removed == 2
    assert pairs(after) == [("deny", "x.com")]
    assert after.default_action is Verdict.ALLOW


@pytest.mark.parametrize("body", [None, [], {}, "x.com", [1], ["x.com", None], [{"target": "x.com"}]])
def test_delete_rejects(body: object) -> None:
    with pytest.raises(PolicyError):
        delete_targets(DENY_ALL, body)


@pytest.mark.parametrize(
    ("count", "cap", "ok"),
    [(0, 0, True), (5, 0, True), (3, 3, True), (4, 3, False), (0, 1, True), (4096, 4096, True)],
)
def test_check_rule_cap(count: int, cap: int, ok: bool) -> None:
    policy = pol("deny", *[("allow", f"h{i}.com") for i in range(count)])
    assert check_rule_cap(policy, cap) is ok


def test_check_rule_cap_rejects_negative() -> None:
    with pytest.raises(ValueError):
        check_rule_cap(DENY_ALL, -1)
