"""Flow cuts: established flows that a narrowing took away are cut in conntrack.

The kernel refuses new flows the moment a transaction narrows access, but the header
accepts established ones: without a cut they would run on. Cutting is best effort (the
refusal of new flows already holds) and slow (a subprocess), so it runs outside the kernel
lock, and in the background where the answer need not wait for it.

An in-place narrowing's cut (:meth:`FlowCuts.schedule`) reads the conntrack table, which
costs in proportion to the flows of the whole pod, not of the subject. Cuts that wait for
the same pass share one read, and passes start at least :data:`CUT_INTERVAL_S` apart: a
storm of narrowings costs a bounded share of the CPU, not one table read each, and an
isolated narrowing is cut at once as before.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any

import structlog

from egressd.addr import IPAddress
from egressd.engine.subjects import CutOrder, SubjectEngine
from egressd.policy import NetworkPolicy

log = structlog.get_logger("egressd.fleet")

#: Least time between the starts of two passes of scheduled cuts (each reads the whole table).
CUT_INTERVAL_S = 0.05

Keys = frozenset[tuple[IPAddress, IPAddress]]


class FlowCuts:
    def __init__(self, conntrack_flush: Callable[[IPAddress], Any] | None, subjects: SubjectEngine) -> None:
        # Cuts every flow of one source (None: never cut, e.g. unit tests without a kernel).
        self._flush_source = conntrack_flush
        # Judges each subject's flows by its books and cuts them through its backend.
        self._subjects = subjects
        self._background: set[asyncio.Task[None]] = set()
        # Scheduled cuts not yet taken by a pass: uid -> (its sources, the policy to judge by).
        self._due: dict[str, tuple[Keys, NetworkPolicy]] = {}
        self._passes: asyncio.Task[None] | None = None
        self._last_pass = -CUT_INTERVAL_S

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

    def schedule(self, uid: str, keys: Keys, effective: NetworkPolicy) -> None:
        """Cut, soon and in the background, the flows of ``uid``'s sources that ``effective``
        (its new effective policy) no longer allows. A later call for the same subject before
        the pass takes it replaces the policy (the newest one judges) and adds its sources."""
        if self._flush_source is None:
            return
        waiting = self._due.get(uid)
        self._due[uid] = (keys | waiting[0] if waiting is not None else keys, effective)
        if self._passes is None or self._passes.done():
            self._passes = asyncio.get_running_loop().create_task(self._run_passes())
            self._background.add(self._passes)
            self._passes.add_done_callback(self._background.discard)

    async def _run_passes(self) -> None:
        while self._due:
            wait = self._last_pass + CUT_INTERVAL_S - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            due, self._due = self._due, {}
            self._last_pass = time.monotonic()
            try:
                await self._cut(due)
            except Exception as exc:  # best effort: the kernel already refuses new flows
                log.warning("conntrack.cut_failed", error=str(exc)[:200])

    async def cut_disallowed(self, uid: str, keys: Keys, effective: NetworkPolicy) -> None:
        """Cut exactly the flows of ``uid``'s sources that ``effective`` no longer allows;
        allowed ones keep running (an in-place change, an always-rules reload)."""
        await self._cut({uid: (keys, effective)})

    async def _cut(self, due: dict[str, tuple[Keys, NetworkPolicy]]) -> None:
        """One read of the conntrack table for every subject of ``due``, then their cuts: a
        subject's flows are judged by its new effective policy and its live leases; its
        gateways are always reachable."""
        await self._subjects.cut(
            {
                uid: CutOrder(
                    sources={src for src, _ in keys}, effective=effective, reachable={gw for _, gw in keys}
                )
                for uid, (keys, effective) in due.items()
            }
        )
