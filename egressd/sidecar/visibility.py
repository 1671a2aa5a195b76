"""The sidecar's visibility parts (docs/reference/behaviour.md §15): its one refusal counter and the DNS events.

The table's named counter ``dropped`` counts every refusal; it is exported as
``egressd_subject_dropped_packets_total{subject="s-sidecar"}`` (the label every sidecar
metric gives the namespace's one implicit subject) and carried over each wholesale rebuild
by the engine. The deny webhook reports ``OPENSANDBOX_EGRESS_SANDBOX_ID`` as ``sandboxId``
(empty when unset, like the reference) and sends from sockets marked like the DNS
forwarder's, resolving its host through the forwarder: the sandbox's own policy governs
neither the webhook's lookup nor its connection.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import structlog

from egressd.commonconfig import CommonConfig
from egressd.dnsproxy.forwarder import UPSTREAM_MARK, Forwarder
from egressd.dnsproxy.resolve import ForwarderResolver
from egressd.engine.counters import read_or_keep
from egressd.events.dns import DnsEvents
from egressd.events.webhook import DenyWebhook, display_url
from egressd.metrics import EgressMetrics
from egressd.policy.audit import safe_token
from egressd.sidecar.engine import SIDECAR_UID
from egressd.sidecarnft.ruleset import DROPPED_COUNTER
from egressd.subject.model import subject_for_uid

log = structlog.get_logger("egressd.sidecar")

SUBJECT = safe_token(subject_for_uid(SIDECAR_UID))


class SidecarDrops:
    def __init__(
        self, metrics: EgressMetrics, read_counters: Callable[[], Awaitable[dict[str, int]]]
    ) -> None:
        self._read_counters = read_counters
        self._samples: dict[tuple[str, ...], float] = {}
        metrics.subject_dropped.collect_from(lambda: dict(self._samples))

    async def read(self) -> int:
        """The kernel's count now (raises when the table cannot be read)."""
        return (await self._read_counters()).get(DROPPED_COUNTER, 0)

    async def carried(self) -> int:
        """For a rebuild: the count to declare the new table's counter with (0 when unreadable,
        e.g. no table yet; a refusal count is never a reason to refuse a policy change)."""
        try:
            return await self.read()
        except Exception as exc:
            log.info("drops.not_carried", error=str(exc)[:200])
            return 0

    async def refresh(self) -> None:
        """Before a scrape; a failed read keeps the last sample."""
        dropped = await read_or_keep(self.read, "drops.counters_unreadable")
        if dropped is not None:
            self._samples = {(SUBJECT,): float(dropped)}


def sidecar_events(cfg: CommonConfig, metrics: EgressMetrics, forwarder: Forwarder) -> DnsEvents:
    webhook = None
    if cfg.deny_webhook:
        webhook = DenyWebhook(
            cfg.deny_webhook,
            metrics,
            socket_mark=UPSTREAM_MARK,
            resolver=ForwarderResolver(forwarder),
        )
        log.info("webhook.enabled", webhook=display_url(cfg.deny_webhook), sandbox_id=cfg.sandbox_id or None)
    # "or": unset is "" here (None once the parity settings own the variable): never null.
    sandbox_id = cfg.sandbox_id or ""
    return DnsEvents(webhook=webhook, sandbox_id=lambda uid: sandbox_id)
