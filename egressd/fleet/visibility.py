"""The fleet's visibility parts (docs/reference/behaviour.md §15), built and wired in one place for ``run_fleet``.

Kernel counters (audit evidence and refusal counts, one dump per scrape), the recent-denials
ring, the DNS proxy's events hook and, with ``OPENSANDBOX_EGRESS_DENY_WEBHOOK``, the webhook
whose ``sandboxId`` is the asking subject's uid.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import structlog

from egressd.commonconfig import CommonConfig
from egressd.events.denials import RecentDenials
from egressd.events.dns import DnsEvents
from egressd.events.webhook import DenyWebhook, display_url
from egressd.fleet.audit import AuditEvidence
from egressd.fleet.drops import CounterDump, DropCounters
from egressd.metrics import EgressMetrics
from egressd.mitm.names import NameRefusals, NameReport
from egressd.mitm.requests import RequestRefusals
from egressd.subject.registry import Entry

log = structlog.get_logger("egressd.visibility")


@dataclass
class FleetVisibility:
    audit: AuditEvidence
    drops: DropCounters
    events: DnsEvents
    webhook: DenyWebhook | None
    names: NameReport  # the MITM's name-check refusals (docs/reference/behaviour.md §18)
    requests: RequestRefusals  # the MITM's request-rule refusals (docs/reference/behaviour.md §19)

    async def before_scrape(self) -> None:
        # Both read through one CounterDump: started together, they share a single dump.
        await asyncio.gather(self.audit.refresh(), self.drops.refresh())

    def start(self) -> None:
        if self.webhook is not None:
            self.webhook.start()
            log.info("webhook.enabled", webhook=display_url(self.webhook.url), sandbox_id="subject uid")

    async def close(self) -> None:
        if self.webhook is not None:
            await self.webhook.close()


def fleet_visibility(
    cfg: CommonConfig,
    metrics: EgressMetrics,
    read_counters: Callable[[], Awaitable[dict[str, int]]],
    entries: Callable[[], Iterable[Entry]],
) -> FleetVisibility:
    counters = CounterDump(read_counters)
    denials = RecentDenials()
    webhook = DenyWebhook(cfg.deny_webhook, metrics) if cfg.deny_webhook else None
    # In the fleet the sandbox is the subject: sandboxId is its uid (the reference's pool
    # mode leaves it empty).
    events = DnsEvents(webhook=webhook, denials=denials, sandbox_id=lambda uid: uid)
    names = NameReport(NameRefusals(), events.refused_on_wire)
    requests = RequestRefusals(
        names.refusals,
        events.refused_request,
        lambda subject, rule: metrics.would_deny.inc(subject, "request", rule),
    )
    return FleetVisibility(
        audit=AuditEvidence(metrics, counters, entries),
        drops=DropCounters(metrics, counters, entries, denials, names=names),
        events=events,
        webhook=webhook,
        names=names,
        requests=requests,
    )
