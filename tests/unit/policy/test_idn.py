"""docs/reference/behaviour.md §14.3: Unicode policy domains and vault hosts are A-labels from parse on.

Queries arrive as A-labels, so a deny written as ``évil.com`` must stop ``xn--vil-9la.com``;
an invalid IDN is a 400; GET /policy shows the A-label form. The fleet action handler and
the sidecar /policy path are covered in test_control.py / test_sidecar_http.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from egressd.mitmchild.authority import normalise_authority
from egressd.policy import PolicyError, Verdict, delete_targets, judge_domain, merge_patch, parse_policy_obj
from egressd.policy.idn import IdnaError, to_alabels
from tests.unit.mitm.test_mitm_inject import bind, go, injected, req, snap

EVIL_A = "xn--vil-9la.com"


def deny(target: str, default: str = "allow") -> dict[str, Any]:
    return {"defaultAction": default, "egress": [{"action": "deny", "target": target}]}


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("évil.com", EVIL_A),
        ("ÉVIL.COM.", EVIL_A),  # UTS-46 case folding, one trailing dot dropped
        ("évil。com", EVIL_A),  # ideographic full stop separates labels (UTS-46)
        ("évil．com", EVIL_A),  # full-width full stop too
        ("  évil.com ", EVIL_A),
        ("*.évil.com", "*." + EVIL_A),  # the wildcard prefix stays
        ("faß.de", "xn--fa-hia.de"),  # non-transitional: ß is kept, not mapped to ss
        ("_dmarc.évil.com", "_dmarc." + EVIL_A),  # ASCII labels untouched in a mixed name
        ("bücher.example", "xn--bcher-kva.example"),
        (EVIL_A, EVIL_A),
        ("Example.COM", "example.com"),  # ASCII as before
    ],
)
def test_unicode_domain_targets_become_a_labels(raw: str, expected: str) -> None:
    policy = parse_policy_obj(deny(raw))
    assert policy.egress[0].target == expected
    assert policy.to_json()["egress"] == [{"action": "deny", "target": expected}]  # GET /policy form


@pytest.mark.parametrize(
    "raw",
    [
        "☃.com",  # a symbol, not a letter: DISALLOWED in IDNA 2008
        "a\u200db.com",  # ZWJ outside its CONTEXTJ context
        "ab--é.com",  # hyphens in positions 3-4 of a U-label
        "-é.com",
        "é-.com",
        ("é" * 64) + ".com",  # the A-label would be over 63 octets
        "*é.com",
        "é.*.com",
        "１２３．４",  # full-width digits map to 123.4: a dotted number, not a domain
        "é.com/8",
    ],
)
def test_invalid_unicode_targets_are_400(raw: str) -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy_obj(deny(raw))
    assert info.value.field == "egress[0].target"
    assert "\n" not in str(info.value) and len(str(info.value)) < 400


def test_unicode_deny_blocks_the_a_label_query() -> None:
    policy = parse_policy_obj(deny("évil.com"))
    assert judge_domain(policy, EVIL_A + ".").verdict is Verdict.DENY
    assert judge_domain(policy, "XN--VIL-9LA.com").verdict is Verdict.DENY
    assert judge_domain(policy, "evil.com").verdict is Verdict.ALLOW  # a different name
    wildcard = parse_policy_obj(deny("*.évil.com"))
    assert judge_domain(wildcard, "cdn." + EVIL_A).verdict is Verdict.DENY
    assert judge_domain(wildcard, EVIL_A).verdict is Verdict.ALLOW  # never the apex


def test_unicode_allow_opens_the_a_label_query() -> None:
    policy = parse_policy_obj({"egress": [{"action": "allow", "target": "bücher.example"}]})
    assert judge_domain(policy, "xn--bcher-kva.example").verdict is Verdict.ALLOW


def test_patch_and_delete_accept_either_form() -> None:
    policy = parse_policy_obj(deny("évil.com"))
    patched = merge_patch(policy, [{"action": "allow", "target": EVIL_A}])
    assert [(r.action.value, r.target) for r in patched.egress] == [("allow", EVIL_A)]
    gone, removed = delete_targets(policy, ["ÉVIL.com"])
    assert removed == 1 and gone.egress == ()
    gone, removed = delete_targets(policy, [EVIL_A])
    assert removed == 1
    same, removed = delete_targets(policy, ["☃.com"])  # no valid name: matches nothing
    assert removed == 0 and same is policy


def test_to_alabels_reports_idna_errors() -> None:
    assert to_alabels("plain.test") == "plain.test"
    with pytest.raises(IdnaError, match="not a valid internationalised domain name"):
        to_alabels("☃.com")


def test_mitm_compares_a_unicode_host_as_a_labels() -> None:
    assert normalise_authority("Bücher.Example.com:443") == ("xn--bcher-kva.example.com", 443)
    assert normalise_authority("☃.example.com") is None  # no valid name: matches no binding
    snapshot = snap(bind(hosts=["bücher.example.com"]))  # stored as its A-labels
    a_label = "xn--bcher-kva.example.com"
    assert snapshot.bindings[0].match.hosts == (a_label,)
    for host, sni in (
        ("bücher.example.com", a_label),
        (a_label, a_label),
        ("BÜCHER.example.com", "bücher.example.com"),
    ):
        assert injected(go(snapshot, req(host=host, sni=sni)))["Authorization"].startswith("Bearer ")


def test_idna_error_does_not_quote_the_label() -> None:
    """idna's own reason quotes the label; a policy 400 must not echo it (a pasted token)."""
    for name in ("sk-PLANTED-label☃.com", "sk-PLANTED-label\u200d.com"):
        with pytest.raises(IdnaError) as caught:
            to_alabels(name)
        assert "sk-PLANTED" not in str(caught.value) and "U+" in str(caught.value)
