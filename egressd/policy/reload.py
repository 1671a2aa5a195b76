"""Always-rules hot reload: re-read every interval; apply a changed file, keep the last good one."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import structlog

from egressd.policy import AlwaysRules, AlwaysRulesError, load_always_rules

log = structlog.get_logger("egressd.always")

INTERVAL_S = 60.0


class AlwaysRulesReloader:
    def __init__(
        self,
        directory: Path,
        current: AlwaysRules,
        apply: Callable[[AlwaysRules], Awaitable[None]],
        *,
        interval: float = INTERVAL_S,
    ) -> None:
        self.directory = directory
        self.current = current
        self.apply = apply
        self.interval = interval

    async def check(self) -> bool:
        """One reload attempt; True when new rules were applied."""
        try:
            fresh = await asyncio.to_thread(load_always_rules, self.directory)
        except AlwaysRulesError as exc:
            log.error("always_rules.invalid_kept_last_good", error=str(exc)[:300])
            return False
        if fresh == self.current:
            return False
        try:
            await self.apply(fresh)
        except Exception as exc:
            log.error("always_rules.apply_failed", error=str(exc)[:300])
            return False
        log.info(
            "always_rules.reloaded",
            **{"opensandbox.event": "egress.updated"},
            deny=len(fresh.deny),
            allow=len(fresh.allow),
        )
        self.current = fresh
        return True

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.check()
