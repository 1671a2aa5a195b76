"""Flow cuts: established flows that a narrowing took away are cut in conntrack.

The kernel refuses new flows the moment a transaction narrows access, but the header
accepts established ones: without a cut they would run on. Cutting is best effort (the
refusal of new flows already holds) and slow (a subprocess), so it runs outside the kernel
lock, and in the background where the answer need not wait for it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any

import structlog

from egressd.kernel.conntrack import flush_flow
from egressd.kernel.conntrack import read_flows as read_conntrack_flows
from egressd.policy import NetworkPolicy, Verdict, audit_deny_sets, ip_sets
from egressd.policy.decide import hard_denied, ip_decision
from egressd.subject.leases import LeaseBook
from egressd.subject.model import IPAddress

log = structlog.get_logger("egressd.fleet")


class FlowCuts:
    def __init__(
        self, conntrack_flush: Callable[[IPAddress], Any] | None, leases: dict[str, LeaseBook]
    ) -> None:
        # Cuts every flow of one source (None: never cut, e.g. unit tests without a kernel).
        self._flush_source = conntrack_flush
        self._leases = leases
        self._background: set[asyncio.Task[None]] = set()

    @property
    def enabled(self) -> bool:
        return self._flush_source is not None

    def background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def flush_sources(self, ips: list[IPAddress]) -> None:
        """Cut established flows of sources whose access just narrowed (best effort)."""
        if self._flush_source is None:
            return
        for ip in ips:
            try:
                await self._flush_source(ip)
            except Exception as exc:  # the kernel already refuses new flows; log and go on
                log.warning("conntrack.flush_failed", source_ip=str(ip), error=str(exc)[:200])

    async def cut_disallowed(
        self, uid: str, keys: frozenset[tuple[IPAddress, IPAddress]], effective: NetworkPolicy
    ) -> None:
        """Cut exactly the flows of ``uid``'s sources that ``effective`` no longer allows;
        allowed ones keep running (an in-place change, an always-rules reload)."""
        sources = sorted({k[0] for k in keys}, key=str)
        flows = await read_conntrack_flows(sources)
        if flows is None:
            return
        now = time.monotonic()
        book = self._leases.get(uid)
        leases = book.live(now) if book is not None else {}
        gateways = {gw for _, gw in keys}
        sets = ip_sets(effective)
        split = audit_deny_sets(effective) if effective.audit else None
        for src in sources:
            for dst in sorted(flows.get(src, ()), key=str):
                if dst in gateways or ip_decision(effective, leases, dst, now, sets)[0] is not Verdict.DENY:
                    continue
                if split is not None and not hard_denied(effective, dst, split):
                    continue  # audit mode: a would-deny flow passes, so it is not cut either
                try:
                    await flush_flow(src, dst)
                except Exception as exc:
                    log.warning("conntrack.cut_failed", source_ip=str(src), error=str(exc)[:200])
