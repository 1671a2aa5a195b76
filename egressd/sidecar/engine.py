"""The sidecar's one implicit subject: its policy, its DNS leases and its kernel table.

Every client of the DNS proxy is this subject (the sidecar owns the whole namespace). Policy
changes are persisted first, then the table is rebuilt wholesale in one transaction, then
the new policy is committed in memory: a crash at any point restarts on a policy that is
never behind what the kernel enforced, and a refused transaction leaves the old policy in
force (and on disk) everywhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

import structlog

from egressd.addr import IPAddress
from egressd.engine import learning
from egressd.feed import Feed, PolicyApplied
from egressd.kernel.applier import NftError
from egressd.policy import (
    EMPTY_ALWAYS,
    AlwaysRules,
    NetworkPolicy,
    Verdict,
    effective_policy,
    ip_sets,
)
from egressd.policy.decide import ip_decision
from egressd.sidecar.persist import serialise, write_atomic
from egressd.sidecarnft.ruleset import SidecarTable, delete_table, dyn_add, ruleset
from egressd.subject.leases import LeaseBook, Narrowed, narrowed_for
from egressd.subject.model import Asker, Fence

log = structlog.get_logger("egressd.sidecar")

#: Seconds between a narrowing's flow cut and its second look at the conntrack table.
CUT_RECHECK_S: Final = 1.0

SIDECAR_UID = "sidecar"


class Kernel(Protocol):
    """What the engine needs from the kernel shell (KernelTransactions, or a fake in tests)."""

    async def run_script(self, script: str, *, op: str) -> None: ...


@dataclass(frozen=True, slots=True)
class ChangeResult:
    """A policy change's answer: the HTTP status and, on failure, why."""

    status: int
    reason: str = ""


class SidecarEngine:
    def __init__(
        self,
        table: SidecarTable,
        kernel: Kernel,
        policy: NetworkPolicy,
        *,
        always: AlwaysRules = EMPTY_ALWAYS,
        persist_path: Path | None = None,
        writer: Callable[[Path, str], None] = write_atomic,
        clock: Callable[[], float] = time.monotonic,
        cut_flows: Callable[[Callable[[IPAddress], bool]], Coroutine[Any, Any, int]] | None = None,
        carry_dropped: Callable[[], Awaitable[int]] | None = None,
        feed: Feed | None = None,
    ) -> None:
        # The daemon's one change feed (egressd.feed), passed in at start-up; a test's own by default.
        self.feed = feed if feed is not None else Feed()
        self.table = table
        self.kernel = kernel
        self.user = policy
        self.always = always
        self.effective = effective_policy(policy, always)
        self._sets = ip_sets(self.effective)  # its IP layer, for per-request/per-flow checks
        self.persist_path = persist_path
        self._writer = writer
        self._clock = clock
        # Serialises rebuilds, lease adds and the commits that go with them.
        self._kernel_lock = asyncio.Lock()
        # DNS leases with the names whose answers carried them (subject/leases.py, shared with
        # the fleet). A rebuild re-adds those a name of which the new policy still allows
        # (remaining lifetime), so a policy change neither forgets what the app resolved a
        # moment ago nor keeps open what it now denies.
        self.leases = LeaseBook(table.max_leases)
        # Bumped on every policy change; carried in the DNS fence.
        self.generation = 0
        self.enforcement_ready = False
        # After a change, established flows to destinations it no longer allows are cut in
        # the background (None: never, e.g. in unit tests without a kernel).
        self._cut_flows = cut_flows
        self._background: set[asyncio.Task[int]] = set()
        self.rules_installed = 0  # for egress_nftables_rules_count
        # The refusal count of the table a rebuild replaces (docs/reference/behaviour.md §15), read under the
        # kernel lock just before the rebuild; None: start from 0 (unit tests).
        self._carry_dropped = carry_dropped

    async def _dropped(self) -> int:
        return await self._carry_dropped() if self._carry_dropped is not None else 0

    def effective_for(self, policy: NetworkPolicy) -> NetworkPolicy:
        """``policy`` with the current always-rules merged in (what DNS and nft would enforce)."""
        return effective_policy(policy, self.always)

    @property
    def fence(self) -> Fence:
        return Fence(SIDECAR_UID, str(self.generation))

    # ---- DNS proxy side (its asker and on_resolved callbacks) --------------------------------

    def asker(self, source_ip: IPAddress) -> Asker:
        return Asker(SIDECAR_UID, self.fence, self.effective)

    def destination_verified(self, client_ip: IPAddress, host: str, dst: IPAddress) -> bool:
        """May the MITM send ``host``'s credentials to ``dst``? The rule both profiles share
        (:func:`egressd.engine.learning.verified`), for the one subject."""
        return learning.verified(self.leases, self._sets, host, dst, self._clock())

    def destination_verified_until(self, client_ip: IPAddress, host: str, dst: IPAddress) -> float:
        """The same with its deadline (monotonic; 0.0: not verified), for the MITM's memory
        (docs/reference/behaviour.md §10, "answered from memory")."""
        return learning.verified_until(self.leases, self._sets, host, dst, self._clock())

    async def learn(
        self, uid: str, fence: Fence, leases: list[tuple[IPAddress, int]], name: str | None = None
    ) -> list[IPAddress]:
        """``name``: the question the answer was for (None: a refresh of live addresses).
        Returns the addresses the kernel holds (the reply carries only those). Shielded like
        the fleet's: the book records whatever the kernel took, even if the caller left."""
        if self.table.mode == "dns":
            return [ip for ip, _ in leases]  # no filter chain: nothing consults the dyn sets
        return await asyncio.shield(self._learn(fence, leases, name))

    async def _learn(
        self, fence: Fence, leases: list[tuple[IPAddress, int]], name: str | None
    ) -> list[IPAddress]:
        async with self._kernel_lock:
            if not self.enforcement_ready:
                return []
            # Decided again under the policy in force now: an answer that raced a change adds
            # nothing the change denies.
            return await learning.learn(self.leases, self.effective, leases, name, self._clock(), self._add)

    async def _add(self, admitted: list[tuple[IPAddress, int]]) -> None:
        await self.kernel.run_script(dyn_add(self.table, admitted), op="dynamic_add")

    # ---- kernel ------------------------------------------------------------------------------

    def _narrowed(self, effective: NetworkPolicy) -> Narrowed:
        """The leases that survive ``effective``: a name that taught them is still allowed
        and no deny rule covers the address (docs/reference/behaviour.md §14.1, same rule as the fleet)."""
        sets = ip_sets(effective)
        return narrowed_for(self.leases, effective, sets.deny_v4, sets.deny_v6, self._clock())

    def allows_ip(self, ip: IPAddress) -> bool:
        """Whether the installed ruleset accepts a new connection to ``ip`` (mode dns+nft)."""
        now = self._clock()
        verdict, where, _ = ip_decision(self.effective, self.leases.live(now), ip, now, self._sets)
        if verdict is Verdict.ALLOW:
            return True
        # Resolver addresses join the allow sets, but a deny rule still beats them.
        return where != "deny" and ip in self.table.resolvers

    async def install(self) -> None:
        """Start-up: build the table for the current policy (NftError is fatal to the caller)."""
        async with self._kernel_lock:
            script = ruleset(self.table, self.effective, dropped=await self._dropped())
            await self.kernel.run_script(script, op="static_apply")
            self.rules_installed = _rule_count(script)
            self.enforcement_ready = True
        log.info(
            "egress.loaded",
            **{"opensandbox.event": "egress.loaded", "egress.default": self.user.default_action.value},
            rules=len(self.user.egress),
            table=self.table.table,
            mode=self.table.mode,
        )

    async def shutdown(self) -> None:
        """Remove the table (docs/reference/behaviour.md §13: shutdown deletes the sidecar table)."""
        async with self._kernel_lock:
            self.enforcement_ready = False
            await self.kernel.run_script(delete_table(self.table), op="reset")

    # ---- changes -----------------------------------------------------------------------------

    def _persist(self, policy: NetworkPolicy) -> None:
        if self.persist_path is not None:
            self._writer(self.persist_path, serialise(policy))

    async def set_policy(self, policy: NetworkPolicy) -> ChangeResult:
        """Persist, rebuild, commit. 500 (with everything unchanged) when a step fails."""
        return await self._change(policy, self.always, persist=True)

    async def set_always_rules(self, always: AlwaysRules) -> None:
        """Always-rules reload: rebuild with the new rules; raises when the kernel refuses."""
        result = await self._change(self.user, always, persist=False)
        if result.status != 200:
            raise RuntimeError(result.reason)

    async def _change(self, policy: NetworkPolicy, always: AlwaysRules, *, persist: bool) -> ChangeResult:
        effective = effective_policy(policy, always)
        event = {"egress.default": policy.default_action.value, "rules": len(policy.egress)}
        async with self._kernel_lock:
            if persist:
                try:
                    await asyncio.to_thread(self._persist, policy)
                except OSError as exc:
                    log.warning(
                        "egress.update_failed",
                        **{"opensandbox.event": "egress.update_failed", **event},
                        error=f"persist: {exc.strerror or exc}",
                    )
                    return ChangeResult(500, f"cannot persist policy: {exc.strerror or type(exc).__name__}")
            narrowed = self._narrowed(effective)
            try:
                script = ruleset(self.table, effective, narrowed.kept, await self._dropped())
                await self.kernel.run_script(script, op="static_apply")
            except NftError as exc:
                if persist:
                    # Put the file back in line with what the kernel still enforces.
                    with contextlib.suppress(OSError):
                        await asyncio.to_thread(self._persist, self.user)
                log.warning(
                    "egress.update_failed",
                    **{"opensandbox.event": "egress.update_failed", **event},
                    error=str(exc)[:200],
                )
                return ChangeResult(500, f"policy apply: {exc}")
            self.user = policy
            self.always = always
            self.effective = effective
            self._sets = ip_sets(effective)
            self.generation += 1
            self.rules_installed = _rule_count(script)
            self.leases = narrowed.book
            self.feed.publish(PolicyApplied())  # the policy and its lease book changed together
            if self._cut_flows is not None and self.table.mode == "dns+nft":
                task = asyncio.get_running_loop().create_task(self._cut_and_recheck(self._cut_flows))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
        log.info("egress.updated", **{"opensandbox.event": "egress.updated", **event})
        return ChangeResult(200)

    async def _cut_and_recheck(
        self, cut_flows: Callable[[Callable[[IPAddress], bool]], Awaitable[int]]
    ) -> int:
        """Cut the flows the new policy refuses, then look again once (docs/reference/behaviour.md §14.1).

        The cut is best effort: a failed conntrack read, address listing or delete leaves a
        refused flow running on its established state. The second look, a moment later and by
        the policy in force then, cuts what the first missed and says so, so that a miss is
        neither permanent nor silent."""
        cut = 0
        for attempt in (1, 2):
            if attempt == 2:
                await asyncio.sleep(CUT_RECHECK_S)
            try:
                found = await cut_flows(self.allows_ip)
            except Exception as exc:
                log.warning("conntrack.cut_failed", attempt=attempt, error=str(exc)[:200])
                continue
            if attempt == 2 and found:
                log.warning("conntrack.cut_late", destinations=found)
            cut += found
        return cut


def _rule_count(script: str) -> int:
    return sum(1 for line in script.splitlines() if line.startswith("add rule "))
