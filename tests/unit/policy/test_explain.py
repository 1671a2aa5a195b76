"""`egressctl explain` decisions: pure function and the daemon endpoint through the real CLI."""

from __future__ import annotations

import json
from ipaddress import ip_address
from typing import Any

import pytest

from egressd.policy import parse_policy
from egressd.policy.explain import explain

POLICY = parse_policy(
    json.dumps(
        {
            "defaultAction": "deny",
            "egress": [
                {"action": "deny", "target": "bad.example.com"},
                {"action": "allow", "target": "*.example.com"},
                {"action": "allow", "target": "10.1.0.0/16"},
                {"action": "deny", "target": "10.1.2.3"},
            ],
        }
    )
)


@pytest.mark.parametrize(
    ("target", "decision", "layer", "extra"),
    [
        ("api.example.com", "allow", "dns", {"rule": {"action": "allow", "target": "*.example.com"}}),
        ("bad.example.com", "deny", "dns", {"rule": {"action": "deny", "target": "bad.example.com"}}),
        ("example.com", "deny", "dns", {"rule": None}),
        ("10.1.9.9", "allow", "ip", {"set": "allow"}),
        ("10.1.2.3", "deny", "ip", {"set": "deny"}),
        ("93.184.216.34", "allow", "ip", {"set": "dyn"}),
        ("8.8.8.8", "deny", "ip", {}),
    ],
)
def test_explain_active(target: str, decision: str, layer: str, extra: dict[str, Any]) -> None:
    out = explain(
        state="active", effective=POLICY, leases={ip_address("93.184.216.34"): 100.0}, target=target, now=10.0
    )
    assert (out["decision"], out["layer"]) == (decision, layer)
    for k, v in extra.items():
        assert out[k] == v


def test_explain_absent_denying_expired_and_default_allow() -> None:
    assert explain(state=None, effective=None, leases={}, target="x.com", now=0)["decision"] == "deny"
    assert explain(state="denying", effective=None, leases={}, target="x.com", now=0)["layer"] == "dispatch"
    expired = explain(
        state="active", effective=POLICY, leases={ip_address("1.2.3.4"): 5.0}, target="1.2.3.4", now=6
    )
    assert expired["decision"] == "deny"
    allow_all = parse_policy('{"defaultAction":"allow"}')
    assert (
        explain(state="active", effective=allow_all, leases={}, target="1.2.3.4", now=0)["decision"]
        == "allow"
    )
    assert explain(state="active", effective=POLICY, leases={}, target="a..b", now=0)["decision"] == "invalid"


# ---- ports and the name check (docs/reference/behaviour.md §18) ------------------------------

NAMES = parse_policy(
    json.dumps(
        {
            "defaultAction": "deny",
            "egress": [
                {"action": "deny", "target": "evil.example.com"},
                {"action": "allow", "target": "api.x.io", "ports": [443]},
                {"action": "allow", "target": "*.example.com"},
                {"action": "allow", "target": "10.9.0.0/16"},
            ],
        }
    )
)
LEASED = ip_address("93.184.216.34")


def _explain(target: str, port: int | None, check: bool = True) -> dict[str, Any]:
    return explain(
        state="active",
        effective=NAMES,
        leases={LEASED: 100.0},
        target=target,
        now=0.0,
        port=port,
        name_check=check,
        taught=lambda ip: {"api.example.com"} if ip == LEASED else set(),
    )


def test_explain_answers_for_the_port() -> None:
    assert _explain("api.x.io", 443)["decision"] == "allow"
    out = _explain("api.x.io", 80)
    assert out["decision"] == "deny" and out["port"] == 80 and "tcp 443" in out["reason"]
    assert _explain("api.x.io", None)["port"] is None


def test_explain_says_what_the_name_check_admits() -> None:
    assert "refused on any address" in _explain("evil.example.com", 443)["nameCheck"]["outcome"]
    assert "learned" in _explain("www.example.com", 443)["nameCheck"]["outcome"]
    leased = _explain(str(LEASED), 443)["nameCheck"]
    assert leased["names"] == ["api.example.com"]
    assert "address rule opens it" in _explain("10.9.1.1", 443)["nameCheck"]["outcome"]
    assert "not checked on port 22" in _explain("www.example.com", 22)["nameCheck"]["outcome"]
    off = _explain("www.example.com", 443, check=False)["nameCheck"]
    assert off["enabled"] is False and off["outcome"].startswith("off")
