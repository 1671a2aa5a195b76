"""Fuzzing policies and binding inputs (docs/reference/behaviour.md §5, §11, 14.3) and the /policy edits.

* ``policy``: :func:`parse_policy` and :func:`parse_binding_input` on generated, structurally
  mutated and byte-mutated documents. Oracles: only PolicyError / InputError escape, reasons
  are one line and never quote the binding input; an accepted policy is a fixed point of its
  own wire form (``to_json`` re-parses to the same policy); DNS evaluation agrees with a
  straightforward model of §5 (first matching domain rule, ``*.`` never the apex, else the
  defaultAction).
* ``policy_edit``: :func:`merge_patch` and :func:`delete_targets` against a model of §5's
  PATCH (patch rules first, keyed by lower-cased target, first occurrence kept) and DELETE.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from egressd.actionhandler.inputs import InputError, parse_binding_input
from egressd.policy import (
    NetworkPolicy,
    PolicyError,
    TargetKind,
    Verdict,
    delete_targets,
    evaluate_domain,
    merge_patch,
    parse_policy,
    parse_policy_obj,
)
from tests.unit.fuzz.strategies import (
    domains,
    json_values,
    mutate_bytes,
    mutate_json,
    policies,
    rules,
    targets,
)
from tests.unit.fuzz.support import fuzz, hit

SECRET = "zzpolicycanary41c9"


def _model_verdict(policy: NetworkPolicy, name: str) -> Verdict:
    name = name.lower().removesuffix(".")
    for rule in policy.egress:
        if rule.kind is not TargetKind.DOMAIN:
            continue
        if rule.target == name:
            return rule.action
        if rule.target.startswith("*."):
            suffix = rule.target[2:]
            labels, apex = name.split("."), suffix.split(".")
            if len(labels) > len(apex) and labels[-len(apex) :] == apex and all(labels[: -len(apex)]):
                return rule.action
    return policy.default_action


@st.composite
def policy_texts(draw: st.DrawFn) -> str:
    doc: Any = draw(policies)
    if draw(st.booleans()):
        doc = draw(mutate_json(doc))
    text = json.dumps(doc, ensure_ascii=draw(st.booleans()))
    if draw(st.integers(0, 3)) == 0:
        # surrogatepass: ensure_ascii=False keeps lone surrogates, which plain UTF-8 refuses.
        text = draw(mutate_bytes(text.encode("utf-8", "surrogatepass"))).decode("utf-8", "replace")
    return text


def _check_policy(policy: NetworkPolicy, probes: list[str]) -> None:
    again = parse_policy_obj(json.loads(json.dumps(policy.to_json())))
    assert again == policy, "to_json() does not re-parse to the same policy"
    for name in probes:
        assert evaluate_domain(policy, name).verdict == _model_verdict(policy, name), name


@fuzz("policy", ci=500, campaign=80_000)
@given(text=policy_texts(), probes=st.lists(domains, max_size=3), secret_key=st.booleans())
def test_policy_and_binding_input_parsing(text: str, probes: list[str], secret_key: bool) -> None:
    hit("policy")
    try:
        policy = parse_policy(text)
    except PolicyError as exc:
        assert "\n" not in str(exc)
        policy = None
    if policy is not None:
        # Probe the policy's own domain targets (and one label under each) as well.
        own = [r.target.removeprefix("*.") for r in policy.egress if r.kind is TargetKind.DOMAIN]
        _check_policy(policy, probes + own + [f"x.{t}" for t in own])
    # The same text as a binding input, with the secret planted in an ignored key or a rule.
    planted = text
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        doc = None
    if isinstance(doc, dict):
        if secret_key:
            doc["note"] = SECRET
        else:
            doc.setdefault("egress", [])
            if isinstance(doc["egress"], list):
                doc["egress"].append({"action": "allow", "target": f"bad/{SECRET}"})
        planted = json.dumps(doc)
    try:
        parsed = parse_binding_input(planted, uid="u-1")
    except InputError as exc:
        reason = str(exc)
        assert "\n" not in reason and SECRET not in reason.lower(), reason
    else:
        assert parsed.policy is not None


@fuzz("policy_edit", ci=500, campaign=80_000)
@given(
    base=st.lists(rules, max_size=6),
    default=st.sampled_from(["allow", "deny"]),
    patch=st.one_of(st.lists(st.one_of(rules, json_values), max_size=5), json_values),
    delete=st.one_of(st.lists(st.one_of(targets, json_values), max_size=5), json_values),
)
def test_policy_edits_follow_the_model(base: list[Any], default: str, patch: Any, delete: Any) -> None:
    hit("policy_edit")
    try:
        current = parse_policy_obj({"defaultAction": default, "egress": base})
    except PolicyError:
        return
    try:
        merged = merge_patch(current, patch)
    except PolicyError as exc:
        assert "\n" not in str(exc)
    else:
        assert isinstance(patch, list) and patch
        keys = [(r.target.lower(), r.protocol, r.scope) for r in merged.egress]
        assert len(keys) == len(set(keys)), "PATCH result has duplicate rules"
        expected: list[Any] = []
        seen: set[Any] = set()
        patched = parse_policy_obj({"egress": patch}).egress if patch else ()
        patched_targets = {r.target.lower() for r in patched}
        for rule in (*patched, *(r for r in current.egress if r.target.lower() not in patched_targets)):
            key = (rule.target.lower(), rule.protocol, rule.scope)
            if key not in seen:
                seen.add(key)
                expected.append(rule)
        assert list(merged.egress) == expected
        assert merged.default_action is current.default_action and merged.audit == current.audit
    try:
        after, removed = delete_targets(current, delete)
    except PolicyError as exc:
        assert "\n" not in str(exc)
    else:
        assert isinstance(delete, list) and delete and all(isinstance(t, str) for t in delete)
        assert removed == len(current.egress) - len(after.egress)
        assert [r for r in current.egress if r in after.egress] == list(after.egress)
        if removed == 0:
            assert after is current
        # What is left is still a valid policy (the route re-applies it as is).
        assert parse_policy_obj(json.loads(json.dumps(after.to_json()))).egress == after.egress
