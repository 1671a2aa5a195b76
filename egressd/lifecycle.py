"""What both profiles' composition roots share: the refusal to start, the exit codes, and the one
shutdown sequence (HTTP, background tasks, MITM, DNS, forwarder, kernel)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from egressd.dnsproxy.forwarder import Forwarder
from egressd.dnsproxy.server import DnsProxy
from egressd.kernel.applier import KernelTransactions
from egressd.mitm.service import RunningMitm

Step = Callable[[], Awaitable[None]]


class StartupError(Exception):
    """One-line reason start-up was refused: the daemon never serves without enforcement."""


def run_profile(profile: Coroutine[Any, Any, None]) -> int:
    """Run a profile to its end: 0 after a requested stop, 1 (one line on stderr) for a refused
    start, 130 for Ctrl-C."""
    try:
        asyncio.run(profile)
    except StartupError as exc:
        print(f"egressd: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


@dataclass
class Running:
    """What a profile has started so far. Each start-up step records what it started here, so
    that :meth:`close` stops exactly that, after a requested stop or a refused start alike."""

    tx: KernelTransactions
    http: web.AppRunner | None = None
    background: list[asyncio.Task[None]] = field(default_factory=list)
    # Awaited with the background tasks (the fleet's revocation retries).
    stoppers: list[Step] = field(default_factory=list)
    mitm: RunningMitm | None = None
    mitm_task: asyncio.Task[None] | None = None
    dns: DnsProxy | None = None
    forwarder: Forwarder | None = None

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        self.background.append(asyncio.create_task(coro))

    def supervise(self, mitm: RunningMitm) -> None:
        self.mitm = mitm
        self.mitm_task = asyncio.create_task(mitm.supervisor.run())

    async def close(self, kernel_step: Step | None = None) -> None:
        """Stop everything; ``kernel_step`` (the sidecar's table deletion) runs last before the
        kernel connection closes, also when an earlier step failed."""
        try:
            # The HTTP side first: no new action, and the ones in flight finish (bounded,
            # docs/reference/behaviour.md §14.10) while everything they may touch (MITM, kernel) is still up.
            if self.http is not None:
                await self.http.cleanup()
            for task in self.background:
                task.cancel()
            for stop in self.stoppers:
                await stop()
            if self.mitm is not None:
                # The child is stopped while its supervisor still reads its output; then the
                # supervisor's task, which may be waiting out a restart back-off, is cancelled.
                await self.mitm.close()
            if self.mitm_task is not None:
                self.mitm_task.cancel()
            if self.dns is not None:
                await self.dns.close()
            if self.forwarder is not None:
                self.forwarder.close()
        finally:
            try:
                if kernel_step is not None:
                    await kernel_step()
            finally:
                await self.tx.close()
