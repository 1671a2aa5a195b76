"""``GET``/``POST /_requests`` on the private socket (docs/reference/behaviour.md §19): the view of a
subject's policy for a name, and the report of a refused request (count, ring, webhook payload)."""

from __future__ import annotations

import ipaddress
import json
from typing import Any

from egressd.events.denials import RecentDenials
from egressd.events.dns import DnsEvents
from egressd.events.suggestion import suggestion
from egressd.events.webhook import payload
from egressd.mitm.active import active_app
from egressd.mitm.names import NameRefusals, NameService
from egressd.mitm.protocol import REQUESTS_PATH
from egressd.mitm.requests import RequestRefusals
from egressd.policy import parse_policy_obj

POLICY = parse_policy_obj(
    {
        "defaultAction": "deny",
        "egress": [
            {"action": "allow", "target": "a.io"},
            {"action": "allow", "target": "api.x.io", "methods": ["GET"], "paths": ["/repos/*"]},
        ],
    }
)


def service(denied: list[tuple[Any, ...]], refusals: NameRefusals) -> NameService:
    def policy_of(client: Any, listen: int | None) -> Any:
        return ("u1", POLICY) if client == ipaddress.ip_address("10.0.0.2") else None

    report = RequestRefusals(refusals, lambda *a: denied.append(a))
    return NameService(lambda q: (None, None), policy_of=policy_of, request_report=report)


async def test_the_view_and_the_report(aiohttp_client: Any) -> None:
    denied: list[tuple[Any, ...]] = []
    refusals = NameRefusals()
    # Served whether or not the name check is on.
    client = await aiohttp_client(active_app(lambda ip: None, names=service(denied, refusals), name_check=False))
    resp = await client.get(REQUESTS_PATH, params={"clientIp": "10.0.0.2", "name": "api.x.io"})
    doc = json.loads(await resp.read())
    assert resp.status == 200 and doc["judged"] is True and doc["subject"] == "s-u1"
    assert [i for i, _ in doc["rules"]] == [1]
    resp = await client.get(REQUESTS_PATH, params={"clientIp": "10.0.0.2", "name": "a.io"})
    assert json.loads(await resp.read())["judged"] is False
    assert (await client.get(REQUESTS_PATH, params={"clientIp": "10.0.0.9", "name": "a.io"})).status == 404
    assert (await client.get(REQUESTS_PATH, params={"clientIp": "nope"})).status == 400
    report = {"host": "api.x.io", "port": 443, "method": "GET", "path": "/user?q=1", "reason": "default_action",
              "rule": None, "audit": False}  # fmt: skip
    resp = await client.post(REQUESTS_PATH, params={"clientIp": "10.0.0.2"}, data=json.dumps(report))
    assert resp.status == 204
    assert denied == [("u1", "api.x.io", 443, "GET", "/user")] and refusals.of("u1") == 1
    resp = await client.post(REQUESTS_PATH, params={"clientIp": "10.0.0.2"}, data=json.dumps({**report, "audit": True}))
    assert resp.status == 204 and refusals.of("u1") == 1  # audit: logged, not a refusal
    assert (await client.post(REQUESTS_PATH, params={"clientIp": "10.0.0.2"}, data=b"[]")).status == 400


def test_the_ring_and_the_webhook_carry_method_and_path() -> None:
    ring = RecentDenials(per_subject=4)
    events = DnsEvents(denials=ring)
    events.refused_request("u1", "api.x.io", 443, "DELETE", "/repos/o/r?x=1")
    events.refused_on_wire("u1", "b.cdn.test", "default", 443)
    events.denied("u1", "c.cdn.test", "policy", "default")
    for i in range(10):
        events.refused_request("u2", "api.x.io", 443, "GET", f"/p{i}")
    assert [d.as_json().get("path") for d in ring.of("u1")] == ["/repos/o/r", None, None]
    assert ring.of("u1")[1].port == 443 and len(ring.of("u2")) == 4  # bounded
    doc = json.loads(payload("api.x.io", 0.0, "u1", "DELETE", "/repos/o/r"))
    assert set(doc) == {"hostname", "timestamp", "source", "sandboxId", "method", "path"}
    assert set(json.loads(payload("api.x.io", 0.0, "u1"))) == {"hostname", "timestamp", "source", "sandboxId"}
    suggested = suggestion(POLICY, ring.of("u1"))
    assert suggested["egress"][-2:] == POLICY.to_json()["egress"]
    added = suggested["egress"][:-2]
    assert {"action": "allow", "target": "api.x.io", "name": "suggested from denials", "protocol": "https",
            "methods": ["DELETE"], "paths": ["/repos/o/r"]} in added  # fmt: skip
    assert {r["target"] for r in added} == {"api.x.io", "b.cdn.test", "c.cdn.test"}
    parse_policy_obj(suggested)  # a valid SET_BINDING policy as it is


def test_an_audited_request_is_counted_as_a_would_deny_not_a_refusal() -> None:
    from egressd.mitm.requests import RequestReport

    refusals = NameRefusals()
    denied: list[tuple[Any, ...]] = []
    would: list[tuple[str, str]] = []
    report = RequestRefusals(refusals, lambda *a: denied.append(a), lambda s, r: would.append((s, r)))
    report("u1", RequestReport("api.x.io", 443, "POST", "/repos", "rule", 3, True))
    report("u1", RequestReport("api.x.io", 443, "GET", "/user", "default_action", None, True))
    assert would == [("s-u1", "egress[3]"), ("s-u1", "default")]
    assert refusals.of("u1") == 0 and denied == []
