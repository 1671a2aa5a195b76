"""Audit (shadow) mode, the pure parts and the DNS proxy against fakes: the policy's ``mode`` key,
rule labels, decision ids, the RFC 8914 EDE option, the would-deny metric with its exemplar,
the kernel counter listing, and the HTTP surfaces that report the mode."""

from __future__ import annotations

import json
import re
import struct
from dataclasses import replace
from typing import Any

import pytest
from dnslib import EDNS0, QTYPE, RCODE, DNSRecord
from structlog.testing import capture_logs

from egressd.actionhandler.inputs import InputError, parse_binding_input
from egressd.dnsproxy.decide import Action, decide
from egressd.dnsproxy.ede import INFO_BLOCKED, INFO_OTHER, attach_ede, ede_option, read_ede
from egressd.dnsproxy.server import DnsProxy
from egressd.fleet.audit import AuditEvidence, counter_samples
from egressd.metrics import EgressMetrics
from egressd.policy import (
    DENY_ALL,
    AlwaysRules,
    PolicyError,
    Verdict,
    delete_targets,
    effective_policy,
    evidence,
    judge_domain,
    merge_patch,
    new_decision_id,
    parse_always_text,
    parse_policy,
    parse_policy_obj,
    policy_mode,
    rule_label,
)
from egressd.policy.audit import safe_token
from egressd.subject.model import Asker, Fence
from tests.unit.dnsproxy.test_dns_proxy import CLIENT, FakeForwarder, FakePolicies, dns_proxy, parse, q, wire

AUDIT_TEXT = (
    '{"defaultAction":"deny","mode":"audit","egress":['
    '{"action":"deny","target":"api.example.com"},'
    '{"action":"allow","target":"*.example.com"}]}'
)
AUDIT = parse_policy(AUDIT_TEXT)
ENFORCE = replace(AUDIT, audit=False)
ALWAYS = AlwaysRules(
    parse_always_text("evil.test\n", "deny.always", Verdict.DENY),
    parse_always_text("good.test\n", "allow.always", Verdict.ALLOW),
)
EVIDENCE = re.compile(r"decision=([0-9a-f]{12}) subject=(\S+) rule=(\S+)")

# --------------------------------------------------------------------------- policy model


@pytest.mark.parametrize(
    ("mode", "audit"),
    [
        (None, False),
        ("enforce", False),
        (" Enforce ", False),
        ("", False),
        ("audit", True),
        (" AUDIT\t", True),
    ],
)
def test_mode_is_trimmed_and_lower_cased(mode: str | None, audit: bool) -> None:
    doc: dict[str, Any] = {"defaultAction": "deny", "egress": [{"action": "allow", "target": "a.test"}]}
    if mode is not None:
        doc["mode"] = mode
    assert parse_policy(json.dumps(doc)).audit is audit


@pytest.mark.parametrize("mode", ["shadow", "auditing", "enforcing", "dry-run", 1, True, [], {}])
def test_any_other_mode_is_a_400_never_silently_audit(mode: object) -> None:
    with pytest.raises(PolicyError) as err:
        parse_policy_obj({"defaultAction": "deny", "mode": mode})
    assert str(err.value).startswith("mode: ")
    assert "\n" not in str(err.value)


def test_binding_input_with_a_bad_mode_is_refused_without_echoing_it() -> None:
    with pytest.raises(InputError) as err:
        parse_binding_input('{"defaultAction":"allow","mode":"sh4dow-secret"}')
    assert str(err.value) == "invalid policy: mode: must be 'enforce' or 'audit'"
    assert parse_binding_input(AUDIT_TEXT).policy.audit


def test_audit_round_trips_and_the_policy_mode_field_is_unchanged() -> None:
    assert AUDIT.to_json()["mode"] == "audit"
    assert "mode" not in ENFORCE.to_json()  # an enforcing policy reads back exactly as before
    assert parse_policy_obj(AUDIT.to_json()) == AUDIT
    assert policy_mode(AUDIT) == policy_mode(ENFORCE) == "enforcing"
    # Deny-all in audit is not DENY_ALL: everything is a would-deny, nothing is dropped.
    audit_all = parse_policy('{"mode":"audit"}')
    assert audit_all.audit and audit_all != DENY_ALL and policy_mode(audit_all) == "deny_all"
    assert parse_policy('{"mode":"enforce"}') is DENY_ALL


def test_edits_keep_the_mode() -> None:
    assert merge_patch(AUDIT, [{"action": "allow", "target": "x.test"}]).audit
    assert delete_targets(AUDIT, ["api.example.com"])[0].audit
    assert effective_policy(AUDIT, ALWAYS).audit


def test_rule_labels_name_operator_rules_apart_and_never_the_target() -> None:
    eff = effective_policy(AUDIT, ALWAYS)
    assert [rule_label(eff, i) for i in range(len(eff.egress))] == [
        "always-deny[0]",
        "always-allow[0]",
        "egress[0]",
        "egress[1]",
    ]
    assert rule_label(eff, None) == "default"


@pytest.mark.parametrize(
    ("name", "verdict", "rule", "would_deny"),
    [
        ("www.example.com", Verdict.ALLOW, "egress[1]", False),
        ("api.example.com", Verdict.ALLOW, "egress[0]", True),  # user deny: audited
        ("other.test", Verdict.ALLOW, "default", True),  # defaultAction deny: audited
        ("good.test", Verdict.ALLOW, "always-allow[0]", False),
        ("evil.test", Verdict.DENY, "always-deny[0]", False),  # always-deny stays hard
    ],
)
def test_judge_domain_in_audit(name: str, verdict: Verdict, rule: str, would_deny: bool) -> None:
    judged = judge_domain(effective_policy(AUDIT, ALWAYS), name)
    assert (judged.verdict, judged.rule, judged.would_deny) == (verdict, rule, would_deny)
    enforced = judge_domain(effective_policy(ENFORCE, ALWAYS), name)
    assert enforced.would_deny is False
    assert enforced.verdict is (Verdict.DENY if would_deny else verdict)


def test_decision_ids_and_evidence_text() -> None:
    ids = {new_decision_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(re.fullmatch(r"[0-9a-f]{12}", i) for i in ids)
    assert (
        evidence("0123456789ab", "s-u-1", "egress[2]") == "decision=0123456789ab subject=s-u-1 rule=egress[2]"
    )
    # A subject name can never forge a field or a line.
    assert safe_token('s-a b"c\nd') == "s-a_b_c_d"
    forged = EVIDENCE.fullmatch(evidence("0123456789ab", "s-x rule=default", "egress[0]"))
    assert forged is not None and forged.group(2, 3) == ("s-x_rule=default", "egress[0]")


# --------------------------------------------------------------------------- DNS decision + EDE


def test_decide_audit_forwards_would_deny_and_keeps_hard_denials() -> None:
    eff = effective_policy(AUDIT, ALWAYS)
    d = decide(q("api.example.com"), eff, known_source=True)
    assert (d.action, d.reason, d.rule, d.would_deny) == (Action.FORWARD, "would_deny", "egress[0]", True)
    d = decide(q("evil.test"), eff, known_source=True)
    assert (d.action, d.rule, d.would_deny) == (Action.NXDOMAIN, "always-deny[0]", False)
    # Deny-first and unknown sources are never audited (there is no policy to audit).
    assert decide(q("api.example.com"), None, known_source=True).action is Action.NXDOMAIN
    assert decide(q("api.example.com"), None, known_source=False).rule == "unknown-source"


def test_ede_option_wire_format_rfc8914() -> None:
    opt = ede_option(INFO_BLOCKED, "decision=0123456789ab")
    assert opt.code == 15
    assert opt.data == b"\x00\x0fdecision=0123456789ab"  # INFO-CODE, then EXTRA-TEXT (no NUL)
    reply = DNSRecord.question("a.test").reply()
    attach_ede(reply, INFO_OTHER, "x")
    attach_ede(reply, INFO_BLOCKED, "y")  # appended to the same OPT record
    parsed = DNSRecord.parse(reply.pack())
    assert len([rr for rr in parsed.ar if rr.rtype == QTYPE.OPT]) == 1
    assert read_ede(parsed) == [(0, "x"), (15, "y")]


def _proxy(policy: object) -> tuple[DnsProxy, FakePolicies, FakeForwarder, EgressMetrics]:
    policies = FakePolicies({CLIENT: Asker("u-1", Fence("r1", "a1"), policy)})  # type: ignore[arg-type]
    fwd, metrics = FakeForwarder(), EgressMetrics()
    return dns_proxy(policies, fwd, metrics), policies, fwd, metrics


async def test_audit_would_deny_is_answered_not_learned_and_one_id_ties_ede_log_and_metric() -> None:
    proxy, policies, fwd, metrics = _proxy(AUDIT)
    with capture_logs() as logs:
        reply = parse(await proxy.answer(wire(q("api.example.com", edns=1232)), CLIENT, tcp=False))
    assert reply.header.rcode == RCODE.NOERROR and [str(rr.rdata) for rr in reply.rr] == ["93.184.216.34"]
    assert len(fwd.calls) == 1
    assert policies.learned == []  # the IP layer's audit rules pass it; leaving audit closes it at once
    [(code, text)] = read_ede(reply)
    assert code == INFO_OTHER
    m = EVIDENCE.fullmatch(text)
    assert m is not None and m.group(2, 3) == ("s-u-1", "egress[0]")
    [line] = [e for e in logs if "would-deny" in e["event"]]
    assert text in line["event"]
    assert line["decision_id"] == m.group(1) and line["audit"] is True and line["layer"] == "dns"
    assert metrics.would_deny.value("s-u-1", "dns", "egress[0]") == 1
    assert metrics.would_deny.exemplar("s-u-1", "dns", "egress[0]") == {"decision_id": m.group(1)}
    assert metrics.policy_denied.value() == 0
    # An allowed name under the same audit policy: learned, no EDE, not counted.
    reply = parse(await proxy.answer(wire(q("www.example.com", edns=1232)), CLIENT, tcp=False))
    assert read_ede(reply) == [] and len(policies.learned) == 1


async def test_enforced_denial_carries_ede_blocked_with_the_logged_id() -> None:
    proxy, _, fwd, metrics = _proxy(ENFORCE)
    with capture_logs() as logs:
        reply = parse(await proxy.answer(wire(q("other.test", edns=1232)), CLIENT, tcp=False))
    assert reply.header.rcode == RCODE.NXDOMAIN and fwd.calls == []
    [(code, text)] = read_ede(reply)
    assert code == INFO_BLOCKED
    m = EVIDENCE.fullmatch(text)
    assert m is not None and m.group(2, 3) == ("s-u-1", "default")
    [line] = [e for e in logs if "[dns] denied query" in e["event"]]
    assert text in line["event"] and line["decision_id"] == m.group(1)
    assert metrics.policy_denied.value() == 1
    assert metrics.policy_denied.exemplar() == {
        "decision_id": m.group(1),
        "rule": "default",
        "subject": "s-u-1",
    }


async def test_clients_without_edns_get_no_opt_record_but_the_decision_is_still_logged() -> None:
    for policy, name in ((AUDIT, "api.example.com"), (ENFORCE, "other.test")):
        proxy, _, _, _ = _proxy(policy)
        with capture_logs() as logs:
            reply = parse(await proxy.answer(wire(q(name)), CLIENT, tcp=False))
        assert [rr for rr in reply.ar if rr.rtype == QTYPE.OPT] == []  # RFC 6891 §7
        assert any("decision_id" in e for e in logs)


async def test_denying_subject_with_audit_pending_is_nxdomain_blocked() -> None:
    proxy, _, fwd, _ = _proxy(None)  # deny-first: no effective policy, whatever is pending
    reply = parse(await proxy.answer(wire(q("api.example.com", edns=1232)), CLIENT, tcp=False))
    assert reply.header.rcode == RCODE.NXDOMAIN and fwd.calls == []
    [(code, text)] = read_ede(reply)
    assert code == INFO_BLOCKED and text.endswith("rule=denying")


async def test_audit_answer_is_truncated_like_any_other_for_small_udp_clients() -> None:
    proxy, _, _, _ = _proxy(AUDIT)
    query = q("api.example.com")
    query.add_ar(EDNS0(udp_len=512))
    reply = parse(await proxy.answer(wire(query), CLIENT, tcp=False))
    assert reply.header.rcode == RCODE.NOERROR


# --------------------------------------------------------------------------- metrics


def test_openmetrics_rendering_carries_the_exemplar_prometheus_text_does_not() -> None:
    metrics = EgressMetrics()
    metrics.would_deny.inc("s-u-1", "dns", "default", exemplar={"decision_id": "0123456789ab"})
    metrics.policy_denied.inc(
        exemplar={"decision_id": "ba9876543210", "rule": "egress[0]", "subject": "s-u-2"}
    )
    text = metrics.render()
    assert 'egressd_policy_would_deny_total{subject="s-u-1",layer="dns",rule="default"} 1\n' in text
    assert "# {" not in text and "# EOF" not in text
    om = metrics.render(openmetrics=True)
    assert om.endswith("# EOF\n")
    assert "# TYPE egressd_policy_would_deny counter" in om
    assert re.search(
        r'^egressd_policy_would_deny_total\{subject="s-u-1",layer="dns",rule="default"\} 1 '
        r'# \{decision_id="0123456789ab"\} 1 \d+\.\d{3}$',
        om,
        re.M,
    )
    assert re.search(
        r'^egress_policy_denied_total 1 # \{decision_id="ba9876543210",rule="egress\[0\]",subject="s-u-2"\} 1 ',
        om,
        re.M,
    )


def test_exemplar_labels_are_cut_to_the_openmetrics_limit() -> None:
    metrics = EgressMetrics()
    metrics.policy_denied.inc(
        exemplar={"decision_id": "0123456789ab", "rule": "default", "subject": "s-" + "u" * 128}
    )
    om = metrics.render(openmetrics=True)
    assert '# {decision_id="0123456789ab",rule="default"} 1' in om


async def test_kernel_counters_become_ip_layer_samples_and_removed_subjects_are_forgotten() -> None:
    listing = {
        "subj_s_u_1_audit_deny": 2,
        "subj_s_u_1_audit_default": 5,
        "subj_s_gone_audit_default": 9,  # a subject no longer registered
        "subj_s_u_2_audit_default": 0,
        "unrelated": 7,
    }
    samples = counter_samples(listing, {"s_u_1": "s-u-1", "s_u_2": "s-u-2"})
    assert samples == {("s-u-1", "ip", "egress-deny"): 2.0, ("s-u-1", "ip", "default"): 5.0}

    class _Entry:
        nft_id, subject = "s_u_1", "s-u-1"

    async def read() -> dict[str, int]:
        return listing

    metrics = EgressMetrics()
    evidence_ = AuditEvidence(metrics, read, lambda: [_Entry()])  # type: ignore[list-item]
    metrics.would_deny.inc("s-u-1", "dns", "default", exemplar={"decision_id": "0123456789ab"})
    await evidence_.refresh()
    text = metrics.render()
    assert 'egressd_policy_would_deny_total{subject="s-u-1",layer="ip",rule="default"} 5' in text
    assert 'egressd_policy_would_deny_total{subject="s-u-1",layer="dns",rule="default"} 1' in text
    await evidence_.removed("u-1")
    assert metrics.would_deny.value("s-u-1", "dns", "default") == 0


# --------------------------------------------------------------------------- HTTP surfaces


async def test_http_reports_audit_mode_and_refuses_a_bad_one(aiohttp_client: Any) -> None:
    from tests.unit.fleet.test_http import hook, make_env, post, set_binding

    env = await make_env(aiohttp_client)
    code, body = await post(env, set_binding(policy='{"defaultAction":"deny","mode":"shadow"}'))
    assert code == 400 and "mode: must be 'enforce' or 'audit'" in body and "shadow" not in body
    assert env.control.registry.get("u-1") is None  # nothing registered, never silently audit
    assert (await post(env, set_binding(policy=AUDIT_TEXT)))[0] == 200
    subjects = (await (await env.client.get("/v1/subjects")).json())["subjects"]
    assert subjects[0]["auditMode"] is False  # denying: the pending audit policy is not in force
    assert (await post(env, hook()))[0] == 200
    subjects = (await (await env.client.get("/v1/subjects")).json())["subjects"]
    assert subjects[0]["auditMode"] is True
    explained = await (await env.client.get("/v1/explain?ip=10.0.0.5&target=api.example.com")).json()
    assert explained["wouldDeny"] is True and explained["ruleLabel"] == "egress[0]" and explained["auditMode"]
    explained = await (await env.client.get("/v1/explain?ip=10.0.0.5&target=4.4.4.4")).json()
    assert explained["wouldDeny"] is True and explained["decision"] == "deny"


async def test_metrics_negotiates_openmetrics(aiohttp_client: Any) -> None:
    from tests.unit.fleet.test_http import make_env

    env = await make_env(aiohttp_client)
    env.metrics.would_deny.inc("s-u-1", "dns", "default", exemplar={"decision_id": "0123456789ab"})
    plain = await env.client.get("/metrics")
    assert plain.content_type == "text/plain" and "# {" not in await plain.text()
    om = await env.client.get("/metrics", headers={"Accept": "application/openmetrics-text;version=1.0.0"})
    assert om.headers["Content-Type"].startswith("application/openmetrics-text; version=1.0.0")
    body = await om.text()
    assert '# {decision_id="0123456789ab"}' in body and body.endswith("# EOF\n")


def test_counter_dump_request_and_reply_parsing() -> None:
    from egressd.kernel import netlink_batch, netlink_dump, netlink_proto

    req = netlink_batch.encode_counter_dump("T", 7)
    length, msg_type, flags, seq, _pid = struct.unpack_from("=IHHII", req)
    assert (length, msg_type, flags, seq) == (len(req), (10 << 8) | 19, 0x1 | 0x300, 7)
    assert b"T\0" in req

    def obj(name: str, packets: int) -> bytes:
        data = netlink_proto._nest(
            netlink_proto.NFTA_OBJ_DATA,
            netlink_proto._u64(netlink_proto.NFTA_COUNTER_BYTES, 60),
            netlink_proto._u64(netlink_proto.NFTA_COUNTER_PACKETS, packets),
        )
        body = (
            netlink_proto._str(netlink_proto.NFTA_OBJ_TABLE, "T")
            + netlink_proto._str(netlink_proto.NFTA_OBJ_NAME, name)
            + data
        )
        return netlink_proto._nlmsg(
            (10 << 8) | netlink_proto.NFT_MSG_NEWOBJ, 0x2, 7, netlink_proto.NFPROTO_INET, 0, body
        )

    done = struct.pack("=IHHII", 20, netlink_proto.NLMSG_DONE, 0x2, 7, 0) + b"\0" * 4
    assert netlink_dump.parse_counter_dump(obj("a", 3) + obj("b", 0)) == ({"a": 3, "b": 0}, False)
    assert netlink_dump.parse_counter_dump(obj("c", 1) + done) == ({"c": 1}, True)
    error = struct.pack("=IHHII", 36, netlink_proto.NLMSG_ERROR, 0, 7, 0) + struct.pack("=i", -2) + b"\0" * 16
    with pytest.raises(netlink_proto.NetlinkError):
        netlink_dump.parse_counter_dump(error)
