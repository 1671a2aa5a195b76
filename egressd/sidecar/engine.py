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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import structlog

from egressd.addr import IPAddress
from egressd.engine.errors import RulesetRefused
from egressd.engine.groupcommit import GroupCommit
from egressd.engine.learning import question
from egressd.engine.selftest import Probes
from egressd.engine.subjects import CutOrder, SubjectEngine
from egressd.feed import Feed, PolicyApplied
from egressd.policy import (
    EMPTY_ALWAYS,
    AlwaysRules,
    NetworkPolicy,
    effective_policy,
    ip_sets,
)
from egressd.policy.namecheck import NameVerdict, Wire
from egressd.sidecar.persist import serialise, write_atomic
from egressd.sidecarnft.backend import SIDECAR_UID, Kernel, SidecarBackend
from egressd.sidecarnft.ruleset import SidecarTable
from egressd.subject.leases import LeaseBook, admissible
from egressd.subject.model import Asker, Fence

log = structlog.get_logger("egressd.sidecar")

#: Seconds between a narrowing's flow cut and its second look at the conntrack table.
CUT_RECHECK_S: Final = 1.0


@dataclass(frozen=True, slots=True)
class ChangeResult:
    """A policy change's answer: the HTTP status and, on failure, why."""

    status: int
    reason: str = ""


class SidecarEngine:
    """The subject engine (:class:`~egressd.engine.subjects.SubjectEngine`) with one implicit
    subject, ``SIDECAR_UID``, over the whole-table backend; its guards are readiness and the
    policy generation (the DNS fence), its narrowing is a persisted whole-table rebuild."""

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
        cut_flows: bool = False,
        carry_dropped: Callable[[], Awaitable[int]] | None = None,
        feed: Feed | None = None,
        probes: Callable[[str], Probes[Any]] | None = None,
    ) -> None:
        # The daemon's one change feed (egressd.feed), passed in at start-up; a test's own by default.
        self.feed = feed if feed is not None else Feed()
        self.backend = SidecarBackend(table, kernel, probes=probes)
        # DNS leases with the names whose answers carried them, under SIDECAR_UID. A rebuild
        # re-adds those a name of which the new policy still allows (remaining lifetime), so a
        # policy change neither forgets what the app resolved a moment ago nor keeps open what
        # it now denies.
        self.subjects = SubjectEngine(self.backend, self.feed, max_leases=table.max_leases, clock=clock)
        self.user = policy
        self.always = always
        self.effective = effective_policy(policy, always)
        # A policy rebuild failed since the last one that succeeded (the kernel may hold either).
        self._rebuild_failed = False
        self._sets = ip_sets(self.effective)  # its IP layer, for per-request/per-flow checks
        self.persist_path = persist_path
        self._writer = writer
        # Serialises rebuilds, lease adds and the commits that go with them.
        self._kernel_lock = asyncio.Lock()
        # Concurrent answers go to the kernel together, taken under the kernel lock: one
        # transaction for all that waited (the fleet's group commit, for the one subject).
        self._group: GroupCommit[str, tuple[list[tuple[IPAddress, int]], str | None], list[IPAddress]] = (
            GroupCommit(self._commit, guard=lambda _uid: self._kernel_lock, weight=lambda ask: len(ask[0]))
        )
        # Bumped on every policy change; carried in the DNS fence.
        self.generation = 0
        self.enforcement_ready = False
        # After a change, established flows to destinations it no longer allows are cut in
        # the background (False: never, e.g. in unit tests without a kernel).
        self.cut_flows = cut_flows
        self._background: set[asyncio.Task[int]] = set()
        self.rules_installed = 0  # for egress_nftables_rules_count
        # The refusal count of the table a rebuild replaces (docs/reference/behaviour.md §15), read under the
        # kernel lock just before the rebuild; None: start from 0 (unit tests).
        self._carry_dropped = carry_dropped

    @property
    def table(self) -> SidecarTable:
        return self.backend.table

    @table.setter
    def table(self, table: SidecarTable) -> None:
        """Start-up sets the table once the self-test knows how this kernel renews leases."""
        self.backend.table = table
        self.subjects.max_leases = table.max_leases

    @property
    def kernel(self) -> Kernel:
        return self.backend.kernel

    @property
    def leases(self) -> LeaseBook:
        """The one subject's lease book (empty before anything was learned)."""
        return self.subjects.books.get(SIDECAR_UID) or LeaseBook(self.table.max_leases)

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
        """May the MITM send ``host``'s credentials to ``dst``? The engine's rule, for the one subject."""
        return self.subjects.verified(SIDECAR_UID, self._sets, host, dst)

    def destination_verified_until(self, client_ip: IPAddress, host: str, dst: IPAddress) -> float:
        """The same with its deadline (monotonic; 0.0: not verified), for the MITM's memory
        (docs/reference/behaviour.md §10, "answered from memory")."""
        return self.subjects.verified_until(SIDECAR_UID, self._sets, host, dst)

    def check_name(
        self, wire: Wire, name: str | None, dst: IPAddress, port: int
    ) -> tuple[str | None, NameVerdict | None]:
        """May the sidecar's subject ask for ``name`` on a connection to ``dst``:``port``
        (docs/reference/behaviour.md §18)? (None, None) before enforcement is installed (refused)."""
        if not self.enforcement_ready:
            return None, None
        verdict = self.subjects.check_name(
            SIDECAR_UID, self.effective, self._sets, wire=wire, name=name, dst=dst, port=port
        )
        return SIDECAR_UID, verdict

    def request_policy(self) -> tuple[str, NetworkPolicy] | None:
        """The subject and its effective policy for the MITM's request rules
        (docs/reference/behaviour.md §19); None before enforcement is installed (refused)."""
        if not self.enforcement_ready:
            return None
        return SIDECAR_UID, self.effective

    async def learn(
        self, uid: str, fence: Fence, leases: list[tuple[IPAddress, int]], name: str | None = None
    ) -> list[IPAddress]:
        """``name``: the question the answer was for (None: a refresh of live addresses).
        Returns the addresses the kernel holds (the reply carries only those). Group-committed
        like the fleet's: answers that wait for the kernel lock go in one transaction, each
        caller released when it ended; the book records whatever the kernel took, even if the
        caller left."""
        if self.table.mode == "dns":
            # No filter chain: nothing consults the dyn sets. The book still learns what fits:
            # the MITM's name check (docs/reference/behaviour.md §18) asks who taught an address.
            self._book_only(leases, name)
            return [ip for ip, _ in leases]
        return await self._group.submit(SIDECAR_UID, (leases, name))

    def _book_only(self, leases: list[tuple[IPAddress, int]], name: str | None) -> None:
        if name is None or not self.enforcement_ready:
            return
        book = self.subjects.books.setdefault(SIDECAR_UID, LeaseBook(self.table.max_leases))
        now = self.subjects.clock()
        book.record(admissible(book, self.effective, leases, question(name), now), question(name), now)

    async def _commit(
        self, _uid: str, asks: list[tuple[list[tuple[IPAddress, int]], str | None]]
    ) -> list[list[IPAddress]]:
        """One batch of answers, under the kernel lock (the group's guard)."""
        if not self.enforcement_ready:
            return [[] for _ in asks]
        # Decided again under the policy in force now: an answer that raced a change adds
        # nothing the change denies.
        # A rebuild that failed may have left the kernel with the other policy's shared ranges:
        # no lease takes the range hash path until a rebuild succeeds (admissible_many).
        return await self.subjects.learn_many(
            SIDECAR_UID, self.effective, asks, hash_ranges=not self._rebuild_failed
        )

    # ---- kernel ------------------------------------------------------------------------------

    def _cut_order(self) -> CutOrder:
        # Resolver addresses join the allow sets, but a deny rule still beats them.
        return CutOrder(sources=(), effective=self.effective, unless_denied=self.table.resolvers)

    def allows_ip(self, ip: IPAddress) -> bool:
        """Whether the installed ruleset accepts a new connection to ``ip`` (mode dns+nft)."""
        return self.subjects.judge(SIDECAR_UID, self._cut_order(), self._sets)(ip)

    async def install(self) -> None:
        """Start-up: build the table for the current policy (NftError is fatal to the caller)."""
        async with self._kernel_lock:
            self.rules_installed = await self.backend.rebuild(self.effective, dropped=await self._dropped())
            self.enforcement_ready = True
        if self.cut_flows:
            await self._forget_dns_flows()
        log.info(
            "egress.loaded",
            **{"opensandbox.event": "egress.loaded", "egress.default": self.user.default_action.value},
            rules=len(self.user.egress),
            table=self.table.table,
            mode=self.table.mode,
        )

    async def _forget_dns_flows(self) -> None:
        """Start-up: forget the namespace's tracked port-53 flows, so that the next packet of
        each is judged by the redirect just installed. A flow from before it (the app's, or a
        previous forwarder's closed socket, whose source port the app may bind) is otherwise
        never redirected; the DNS guard refuses it, and a client that keeps its socket would
        get no answers until the entry expires. Best effort: the guard holds either way."""
        try:
            await self.backend.forget_dns_flows()
        except Exception as exc:
            log.warning("conntrack.dns_forget_failed", error=str(exc)[:200])

    async def shutdown(self) -> None:
        """Remove the table (docs/reference/behaviour.md §13: shutdown deletes the sidecar table).
        Answers still waiting to be learned are failed first (their queries get no answer)."""
        await self._group.close()
        async with self._kernel_lock:
            self.enforcement_ready = False
            await self.backend.remove()

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
            narrowed = self.subjects.narrowed(SIDECAR_UID, effective)
            self._rebuild_failed = True  # until this rebuild is known to be the kernel's
            try:
                rules = await self.backend.rebuild(
                    effective, narrowed.kept if narrowed is not None else (), await self._dropped()
                )
            except RulesetRefused as exc:
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
            self._rebuild_failed = False
            self.user = policy
            self.always = always
            self.effective = effective
            self._sets = ip_sets(effective)
            self.generation += 1
            self.rules_installed = rules
            self.subjects.commit(SIDECAR_UID, narrowed)
            self.feed.publish(PolicyApplied())  # the policy and its lease book changed together
            if self.cut_flows and self.table.mode == "dns+nft":
                task = asyncio.get_running_loop().create_task(self._cut_and_recheck())
                self._background.add(task)
                task.add_done_callback(self._background.discard)
        log.info("egress.updated", **{"opensandbox.event": "egress.updated", **event})
        return ChangeResult(200)

    async def _cut_and_recheck(self) -> int:
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
                found = await self.subjects.cut({SIDECAR_UID: self._cut_order()})
            except Exception as exc:
                log.warning("conntrack.cut_failed", attempt=attempt, error=str(exc)[:200])
                continue
            if found:
                log.info("conntrack.cut", destinations=found)
            if attempt == 2 and found:
                log.warning("conntrack.cut_late", destinations=found)
            cut += found
        return cut
