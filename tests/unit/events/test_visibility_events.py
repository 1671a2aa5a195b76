"""docs/reference/behaviour.md §15 at the DNS layer: which answers reach the deny webhook and the recent-denials
ring, and the rate-limited ``egress.outbound`` event, through the real DnsProxy."""

from __future__ import annotations

import ipaddress

import pytest
from dnslib import QTYPE, RR, A, DNSRecord
from structlog.testing import capture_logs

from egressd.addr import IPAddress
from egressd.dnsproxy.forwarder import Forwarded
from egressd.dnsproxy.server import DnsProxy
from egressd.events.denials import RecentDenials
from egressd.events.dns import DnsEvents
from egressd.events.outbound import LineBudget, OutboundLog
from egressd.events.webhook import DenyWebhook
from egressd.policy import parse_policy
from egressd.subject.model import Asker, Fence

FENCE = Fence("r1", "a1")
POLICY = parse_policy(
    '{"defaultAction":"deny","egress":['
    '{"action":"deny","target":"api.example.com"},'
    '{"action":"allow","target":"*.example.com"}]}'
)
AUDIT = parse_policy(
    '{"defaultAction":"deny","mode":"audit","egress":[{"action":"allow","target":"a.test"}]}'
)


def ip(text: str) -> IPAddress:
    return ipaddress.ip_address(text)


class Policies:
    def __init__(self, askers: dict[str, Asker]) -> None:
        self.askers = {ip(k): v for k, v in askers.items()}

    def asker(self, source_ip: IPAddress) -> Asker | None:
        return self.askers.get(source_ip)

    async def learn(
        self, uid: str, fence: Fence, leases: list[tuple[IPAddress, int]], name: str | None = None
    ) -> list[IPAddress]:
        return [a for a, _ in leases]


class Forwarder:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    async def forward(self, query: DNSRecord, *, tcp: bool = False) -> Forwarded:
        if self.fail:
            return Forwarded(None, "upstream_error")
        reply = query.reply()
        for addr in ("93.184.216.34", "93.184.216.35"):
            reply.add_answer(RR(query.q.qname, QTYPE.A, rdata=A(addr), ttl=30))
        return Forwarded(DNSRecord.parse(bytes(reply.pack())))


class Webhook(DenyWebhook):
    """The real class, queue only (no worker): what the proxy published."""

    def __init__(self) -> None:
        super().__init__("http://127.0.0.1:1/x", queue_size=100)

    def names(self) -> list[tuple[str, str]]:
        import json

        out = []
        while not self._queue.empty():
            doc = json.loads(self._queue.get_nowait())
            out.append((doc["hostname"], doc["sandboxId"]))
        return out


def proxy(events: DnsEvents, *, fail: bool = False) -> DnsProxy:
    askers = {
        "10.0.0.5": Asker("u-1", FENCE, POLICY),
        "10.0.0.6": Asker("u-2", FENCE, None),  # denying (deny-first)
        "10.0.0.7": Asker("u-3", FENCE, AUDIT),
    }
    policies = Policies(askers)
    return DnsProxy(
        policies.asker, Forwarder(fail), on_resolved=policies.learn, events=events  # type: ignore[arg-type]
    )


def query(name: str, qtype: str = "A") -> bytes:
    return bytes(DNSRecord.question(name, qtype).pack())


async def test_policy_and_deny_first_denials_reach_the_webhook_and_the_ring() -> None:
    hook, ring = Webhook(), RecentDenials()
    p = proxy(DnsEvents(webhook=hook, denials=ring))
    await p.answer(query("API.example.com."), "10.0.0.5", tcp=False)  # denied by egress[0]
    await p.answer(query("other.test"), "10.0.0.5", tcp=False)  # denied by the default
    await p.answer(query("www.example.com"), "10.0.0.5", tcp=False)  # allowed: nothing
    await p.answer(query("anything.test"), "10.0.0.6", tcp=False)  # deny-first
    assert hook.names() == [("api.example.com", "u-1"), ("other.test", "u-1"), ("anything.test", "u-2")]
    assert [(d.name, d.rule) for d in ring.of("u-1")] == [
        ("api.example.com", "egress[0]"),
        ("other.test", "default"),
    ]
    assert [(d.name, d.rule) for d in ring.of("u-2")] == [("anything.test", "denying")]


async def test_unknown_sources_malformed_messages_and_would_denies_are_not_denied_names() -> None:
    hook, ring = Webhook(), RecentDenials()
    p = proxy(DnsEvents(webhook=hook, denials=ring))
    await p.answer(query("x.test"), "10.9.9.9", tcp=False)  # unknown source: NXDOMAIN
    two = DNSRecord.question("x.test")
    two.add_question(DNSRecord.question("y.test").q)
    await p.answer(bytes(two.pack()), "10.0.0.5", tcp=False)  # FORMERR
    await p.answer(query("b.test"), "10.0.0.7", tcp=False)  # audit: would-deny, answered
    assert hook.names() == []
    assert len(ring) == 0


async def test_the_sidecar_reports_its_configured_sandbox_id() -> None:
    hook = Webhook()
    p = proxy(DnsEvents(webhook=hook, sandbox_id=lambda uid: "sb-from-env"))
    await p.answer(query("other.test"), "10.0.0.5", tcp=False)
    assert hook.names() == [("other.test", "sb-from-env")]


async def test_allowed_answers_log_egress_outbound_with_the_addresses() -> None:
    p = proxy(DnsEvents())
    with capture_logs() as logs:
        await p.answer(query("WWW.example.com."), "10.0.0.5", tcp=False)
        await p.answer(query("api.example.com"), "10.0.0.5", tcp=False)  # denied: no outbound line
    out = [e for e in logs if e["event"] == "egress.outbound"]
    assert out == [
        {
            "event": "egress.outbound",
            "log_level": "info",
            "subject": "s-u-1",
            "opensandbox.event": "egress.outbound",
            "target.host": "www.example.com",
            "target.ips": ["93.184.216.34", "93.184.216.35"],
        }
    ]


async def test_a_failed_forward_logs_egress_outbound_with_the_error() -> None:
    p = proxy(DnsEvents(), fail=True)
    with capture_logs() as logs:
        await p.answer(query("www.example.com"), "10.0.0.5", tcp=False)
    (line,) = [e for e in logs if e["event"] == "egress.outbound"]
    assert line["target.ips"] == [] and line["error"] == "upstream_error"


async def test_audit_would_denies_get_no_outbound_line() -> None:
    p = proxy(DnsEvents())
    with capture_logs() as logs:
        await p.answer(query("b.test"), "10.0.0.7", tcp=False)
    assert not [e for e in logs if e["event"] == "egress.outbound"]


async def test_outbound_lines_are_rate_limited_per_subject() -> None:
    now = [100.0]
    events = DnsEvents(outbound=OutboundLog(per_second=3, clock=lambda: now[0]))
    askers = {"10.0.0.5": Asker("u-1", FENCE, POLICY), "10.0.0.8": Asker("u-4", FENCE, POLICY)}
    policies = Policies(askers)
    p = DnsProxy(policies.asker, Forwarder(), on_resolved=policies.learn, events=events)  # type: ignore[arg-type]
    with capture_logs() as logs:
        for _ in range(5):
            await p.answer(query("www.example.com"), "10.0.0.5", tcp=False)
        await p.answer(query("www.example.com"), "10.0.0.8", tcp=False)  # another subject: its own budget
        now[0] += 1
        await p.answer(query("www.example.com"), "10.0.0.5", tcp=False)  # a new second
    subjects = [e["subject"] for e in logs if e["event"] == "egress.outbound"]
    assert subjects == ["s-u-1"] * 3 + ["s-u-4", "s-u-1"]
    assert sum("rate limit reached" in e["event"] for e in logs) == 1


def test_line_budget() -> None:
    now = [5.0]
    budget = LineBudget(2, "x", clock=lambda: now[0])
    assert [budget.allow("a") for _ in range(3)] == [True, True, False]
    assert budget.allow("b")
    now[0] = 6.2
    assert budget.allow("a")


def test_recent_denials_are_bounded() -> None:
    ring = RecentDenials(per_subject=3, max_subjects=2, clock=lambda: 0.0)
    for i in range(5):
        ring.add("u-1", f"n{i}.test.", "default")
    assert [d.name for d in ring.of("u-1")] == ["n2.test", "n3.test", "n4.test"]
    ring.add("u-2", "x.test", "default")
    ring.add("u-3", "y.test", "default")  # over the subject cap: the longest-tracked goes
    assert ring.of("u-1") == [] and len(ring) == 2
    ring.forget("u-2")
    assert ring.of("u-2") == []
    assert ring.of("u-3")[0].as_json() == {"name": "y.test", "rule": "default", "at": "1970-01-01T00:00:00Z"}


@pytest.mark.parametrize("reason", ["unknown_source", "no_question", "opcode", "would_deny"])
def test_only_policy_and_deny_first_denials_count(reason: str) -> None:
    ring = RecentDenials()
    DnsEvents(denials=ring).denied("u-1", "x.test", reason, "r")
    assert len(ring) == 0
    DnsEvents(denials=ring).denied(None, "x.test", "policy", "r")
    assert len(ring) == 0
