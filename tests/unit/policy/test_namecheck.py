"""Names on the wire (docs/reference/behaviour.md §18): the pure decision of
:mod:`egressd.policy.namecheck` — may the SNI / Host a connection asks for reach that address
and port?"""

from __future__ import annotations

import ipaddress
from typing import Any

import pytest

from egressd.policy import AlwaysRules, NetworkPolicy, effective_policy, ip_sets, parse_policy_obj, parse_rule
from egressd.policy.namecheck import NameReason, Wire, address_opens, check_name, denied_by_rule

CDN = ipaddress.ip_address("203.0.113.10")
OTHER = ipaddress.ip_address("198.51.100.7")


def policy(*rules: dict[str, Any], default: str = "deny", mode: str | None = None) -> NetworkPolicy:
    doc: dict[str, Any] = {"defaultAction": default, "egress": list(rules)}
    if mode:
        doc["mode"] = mode
    return parse_policy_obj(doc)


def allow(target: str, **extra: Any) -> dict[str, Any]:
    return {"action": "allow", "target": target, **extra}


def deny(target: str, **extra: Any) -> dict[str, Any]:
    return {"action": "deny", "target": target, **extra}


def check(
    p: NetworkPolicy,
    name: str | None,
    *,
    dst: Any = CDN,
    port: int = 443,
    taught: tuple[str, ...] = (),
    wire: Wire = Wire.TLS,
) -> Any:
    return check_name(p, ip_sets(p), wire=wire, name=name, dst=dst, port=port, taught=frozenset(taught))


# ---- learned-only destinations ---------------------------------------------------------------


def test_the_name_that_taught_the_address_passes() -> None:
    p = policy(allow("a.io"))
    verdict = check(p, "a.io", taught=("a.io",))
    assert verdict.admit and verdict.reason is None


def test_sni_spoofing_of_a_name_the_policy_denies_is_refused_on_a_shared_address() -> None:
    p = policy(allow("a.io"))
    verdict = check(p, "b.io", taught=("a.io",))
    assert not verdict.admit and verdict.reason is NameReason.SNI_NOT_ALLOWED


def test_an_allowed_name_that_did_not_teach_this_address_is_refused() -> None:
    p = policy(allow("a.io"), allow("c.io"))
    verdict = check(p, "c.io", taught=("a.io",))
    assert not verdict.admit and verdict.reason is NameReason.SNI_NOT_LEARNED


def test_host_spoofing_is_refused_with_the_host_reasons() -> None:
    p = policy(allow("a.io"), allow("c.io"))
    assert check(p, "b.io", taught=("a.io",), wire=Wire.HTTP, port=80).reason is NameReason.HOST_NOT_ALLOWED
    assert check(p, "c.io", taught=("a.io",), wire=Wire.HTTP, port=80).reason is NameReason.HOST_NOT_ALLOWED
    assert check(p, "a.io", taught=("a.io",), wire=Wire.HTTP, port=80).admit


def test_no_sni_is_refused_where_only_learning_opened_the_address() -> None:
    p = policy(allow("a.io"))
    assert check(p, None, taught=("a.io",)).reason is NameReason.NO_SNI
    assert check(p, None, taught=("a.io",), wire=Wire.HTTP, port=80).reason is NameReason.HOST_NOT_ALLOWED


def test_names_are_compared_normalised() -> None:
    p = policy(allow("a.io"))
    assert check(p, "A.IO.", taught=("a.io",)).admit


def test_a_wildcard_rule_admits_the_learned_name_and_not_its_apex() -> None:
    p = policy(allow("*.x.io"))
    assert check(p, "api.x.io", taught=("api.x.io",)).admit
    assert check(p, "x.io", taught=("api.x.io",)).reason is NameReason.SNI_NOT_ALLOWED
    assert check(p, "www.x.io", taught=("api.x.io",)).reason is NameReason.SNI_NOT_LEARNED


# ---- address rules ---------------------------------------------------------------------------


def test_an_allow_cidr_admits_any_name_and_no_sni() -> None:
    p = policy(allow("a.io"), allow("203.0.113.0/24"))
    assert check(p, "b.io").admit
    assert check(p, None).admit
    assert check(p, None, wire=Wire.HTTP, port=80).admit
    assert not check(p, None, dst=OTHER).admit


def test_default_allow_admits_unmatched_names_and_no_sni() -> None:
    p = policy(default="allow")
    assert check(p, "anything.io").admit
    assert check(p, None).admit


def test_a_denied_name_is_refused_on_any_address_also_under_default_allow() -> None:
    p = policy(deny("evil.io"), default="allow")
    for dst in (CDN, OTHER):
        verdict = check(p, "evil.io", dst=dst)
        assert not verdict.admit and verdict.reason is NameReason.SNI_NOT_ALLOWED
        assert verdict.rule == "egress[0]"
    assert check(p, "evil.io", wire=Wire.HTTP, port=80).reason is NameReason.HOST_NOT_ALLOWED
    p = policy(deny("evil.io"), allow("203.0.113.0/24"))
    assert not check(p, "evil.io").admit


def test_an_always_deny_name_is_refused_everywhere() -> None:
    user = policy(allow("*.io"), default="allow")
    p = effective_policy(user, AlwaysRules(deny=(parse_rule({"action": "deny", "target": "evil.io"}, "deny.always"),), allow=()))
    verdict = check(p, "evil.io", taught=("evil.io",))
    assert not verdict.admit and verdict.rule == "always-deny[0]"


def test_an_ip_deny_closes_what_default_allow_opened() -> None:
    p = policy(deny("203.0.113.10"), default="allow")
    assert not address_opens(p, ip_sets(p), CDN, 443)
    assert check(p, "x.io").reason is NameReason.SNI_NOT_LEARNED


# ---- ports (§18 rule fields) -----------------------------------------------------------------


def test_a_name_allowed_on_another_port_only_is_port_not_allowed() -> None:
    p = policy(allow("api.x.io", ports=[443]))
    assert check(p, "api.x.io", port=443, taught=("api.x.io",)).admit
    verdict = check(p, "api.x.io", port=80, taught=("api.x.io",), wire=Wire.HTTP)
    assert not verdict.admit and verdict.reason is NameReason.PORT_NOT_ALLOWED


def test_a_deny_rule_with_ports_refuses_only_there() -> None:
    p = policy(deny("x.io", ports=[80]), default="allow")
    assert denied_by_rule(p, "x.io", 80) == 0
    assert denied_by_rule(p, "x.io", 443) is None
    assert check(p, "x.io", port=80, wire=Wire.HTTP).reason is NameReason.HOST_NOT_ALLOWED
    assert check(p, "x.io", port=443).admit


def test_an_address_rule_for_other_ports_does_not_open_443() -> None:
    p = policy(allow("203.0.113.0/24", protocol="tcp", ports=["5432-5433"]))
    assert not address_opens(p, ip_sets(p), CDN, 443)
    assert address_opens(p, ip_sets(p), CDN, 5432)
    assert check(p, None).reason is NameReason.NO_SNI


# ---- audit mode --------------------------------------------------------------------------------


def test_audit_mode_admits_with_a_would_deny() -> None:
    p = policy(allow("a.io"), mode="audit")
    verdict = check(p, "b.io", taught=("a.io",))
    assert verdict.admit and verdict.would_deny and verdict.reason is NameReason.SNI_NOT_ALLOWED


def test_audit_mode_keeps_always_deny_hard() -> None:
    p = effective_policy(policy(default="allow", mode="audit"), AlwaysRules(deny=(parse_rule({"action": "deny", "target": "evil.io"}, "deny.always"),), allow=()))
    verdict = check(p, "evil.io")
    assert not verdict.admit and not verdict.would_deny


@pytest.mark.parametrize("reason", list(NameReason))
def test_reasons_are_the_specified_words(reason: NameReason) -> None:
    assert reason.value in {"sni_not_allowed", "sni_not_learned", "no_sni", "host_not_allowed", "port_not_allowed"}


# ---- no name on the wire (Wire.TCP: neither TLS nor HTTP, or a silent client) ------------------


def tcp(p: NetworkPolicy, *, port: int = 2222, taught: tuple[str, ...] = (), dst: Any = CDN) -> Any:
    return check(p, None, dst=dst, port=port, taught=taught, wire=Wire.TCP)


def test_nameless_bytes_pass_where_a_tcp_rule_taught_the_address() -> None:
    p = policy(allow("git.io", protocol="tcp", ports=[2222]), allow("a.io", protocol="https", ports=[2222]))
    assert tcp(p, taught=("git.io",)).admit
    assert tcp(p, taught=("git.io",)).rule == "lease"
    # The https rule's lease speaks for names only: nameless bytes are refused there.
    refused = tcp(p, taught=("a.io",))
    assert not refused.admit and refused.reason is NameReason.NO_SNI
    assert not tcp(p, taught=()).admit  # taught by nobody
    assert not tcp(p, taught=("git.io",), port=2223).admit  # the tcp rule's port only


def test_nameless_bytes_pass_where_an_any_protocol_rule_with_ports_taught_the_address() -> None:
    p = policy(allow("db.io", ports=[5432]))
    assert tcp(p, port=5432, taught=("db.io",)).admit
    assert not tcp(p, port=5433, taught=("db.io",)).admit


def test_nameless_bytes_are_refused_on_a_request_rule_lease() -> None:
    # methods/paths without a protocol mean https: a lease of such a rule admits no bytes unjudged.
    p = policy(allow("api.io", methods=["GET"], ports=[8443]))
    assert not tcp(p, port=8443, taught=("api.io",)).admit


def test_nameless_bytes_pass_where_an_address_rule_or_default_allow_opens() -> None:
    assert tcp(policy(allow(str(CDN)))).admit
    assert tcp(policy(allow(str(CDN), protocol="tcp", ports=[2222]))).admit
    assert not tcp(policy(allow(str(CDN), protocol="tcp", ports=[22]))).admit
    assert tcp(policy(default="allow")).admit
    assert not tcp(policy(deny(str(CDN)), default="allow")).admit


def test_a_deny_rule_first_decides_the_teaching_name() -> None:
    p = policy(deny("git.io", protocol="tcp", ports=[2222]), allow("*.io", protocol="tcp"))
    assert not tcp(p, taught=("git.io",)).admit
    assert tcp(p, taught=("git.io", "other.io")).admit  # another name taught it for tcp


def test_nameless_refusals_are_would_denies_in_audit_mode() -> None:
    verdict = tcp(policy(allow("a.io", protocol="https", ports=[2222]), mode="audit"), taught=("a.io",))
    assert verdict.admit and verdict.would_deny and verdict.reason is NameReason.NO_SNI
