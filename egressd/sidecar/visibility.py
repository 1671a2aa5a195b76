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

from collections.abc import Awaitable, Callable, Mapping

import structlog

from egressd.commonconfig import CommonConfig
from egressd.dnsproxy.forwarder import Forwarder
from egressd.dnsproxy.resolve import ForwarderResolver
from egressd.engine.backend import Refusals
from egressd.engine.refusals import RefusalSamples
from egressd.events.dns import DnsEvents
from egressd.events.webhook import DenyWebhook, display_url
from egressd.metrics import EgressMetrics
from egressd.mitm.names import NameRefusals
from egressd.nftsyntax import FORWARDER_MARK
from egressd.policy.audit import safe_token
from egressd.sidecarnft.backend import SIDECAR_NFT_ID, SIDECAR_UID, sidecar_refusals
from egressd.subject.model import subject_for_uid

log = structlog.get_logger("egressd.sidecar")

SUBJECT = safe_token(subject_for_uid(SIDECAR_UID))


class SidecarDrops:
    """The one subject's refusal count: the engine's samples over the sidecar backend's counter."""

    def __init__(
        self,
        metrics: EgressMetrics,
        read_counters: Callable[[], Awaitable[dict[str, int]]],
        refusals: Callable[[Mapping[str, int]], Refusals] = sidecar_refusals,
    ) -> None:
        # Plus the MITM's name-check refusals (docs/reference/behaviour.md §18), in the same count.
        self.names = NameRefusals()
        self._samples = RefusalSamples(
            metrics,
            read_counters,
            refusals,
            lambda: {SIDECAR_NFT_ID: SUBJECT},
            extra=lambda: {SIDECAR_NFT_ID: self.names.of(SIDECAR_UID)},
        )

    async def read(self) -> int:
        """The count now, kernel and name check (raises when the table cannot be read)."""
        return (await self._samples.read()).by_subject.get(SIDECAR_NFT_ID, 0)

    async def kernel_count(self) -> int:
        """The kernel's count alone (what a rebuilt table's counter carries over)."""
        return (await self._samples.read_kernel()).by_subject.get(SIDECAR_NFT_ID, 0)

    async def carried(self) -> int:
        """For a rebuild: the count to declare the new table's counter with (0 when unreadable,
        e.g. no table yet; a refusal count is never a reason to refuse a policy change)."""
        try:
            return await self.kernel_count()
        except Exception as exc:
            log.info("drops.not_carried", error=str(exc)[:200])
            return 0

    async def refresh(self) -> None:
        """Before a scrape; a failed read keeps the last sample."""
        await self._samples.refresh()


def sidecar_events(cfg: CommonConfig, metrics: EgressMetrics, forwarder: Forwarder) -> DnsEvents:
    webhook = None
    if cfg.deny_webhook:
        webhook = DenyWebhook(
            cfg.deny_webhook,
            metrics,
            socket_mark=FORWARDER_MARK,
            resolver=ForwarderResolver(forwarder),
        )
        log.info("webhook.enabled", webhook=display_url(cfg.deny_webhook), sandbox_id=cfg.sandbox_id or None)
    # "or": unset is "" here (None once the parity settings own the variable): never null.
    sandbox_id = cfg.sandbox_id or ""
    return DnsEvents(webhook=webhook, sandbox_id=lambda uid: sandbox_id)
