"""Narrowings the kernel refused (docs/reference/behaviour.md §14.6), retried by egressd itself until they hold.

A plan that takes something away from what the kernel holds (a revert, rebind, removal or an
in-place swap) and fails leaves the kernel more open than the action meant. Such a subject
is *revoking*: /healthz names it, and while the refused plan closes the subject (revert,
rebind, removal) DNS, learning and the vault act as if it were closed already. A background
task runs the plan again, with backoff, until the kernel agrees.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import structlog

from egressd.actionhandler.api import Result
from egressd.actionhandler.shared import Shared
from egressd.actionhandler.steps import StepFailed
from egressd.subject.model import subject_for_uid
from egressd.subject.registry import (
    AddKeys,
    ApplyPolicy,
    DropStaleKeys,
    Entry,
    InstallDenyFirst,
    Plan,
    PlanOutcome,
    Registry,
    RemoveAll,
    State,
    Step,
)

log = structlog.get_logger("egressd.fleet")

REVOKE_RETRY_MIN_S = 0.05
REVOKE_RETRY_MAX_S = 5.0

#: What a committed plan still has to do after its kernel steps (vault, listeners).
After = Callable[[], Coroutine[Any, Any, None]]


@dataclass(slots=True)
class Revocation:
    """A narrowing the kernel refused: the plan to run again, the registry entry its failure
    committed (the retry only runs while that is still what the registry holds), and what
    to do once the kernel agreed."""

    plan: Plan
    expected: Entry | None
    reason: str
    after: After | None = None
    attempts: int = 0

    @property
    def closing(self) -> bool:
        """The refused plan takes the subject's policy away (revert, rebind, removal): DNS,
        learning and the vault act as if it were gone already. A refused in-place swap
        keeps the old policy there, as the registry does (kernel first, registry second)."""
        target = self.plan.on_success
        return target is None or target.state is not State.ACTIVE


def narrows(plan: Plan, registry: Registry) -> bool:
    """Does ``plan`` take away something the kernel holds now? A revert, rebind or re-run
    over existing objects, a removal, or an in-place swap (its new policy may deny what
    the old allowed). A first deny-first install or an activation over deny-first
    content only opens later: their failure leaves the kernel closed."""
    target = plan.on_success if plan.on_success is not None else plan.on_failure
    if target is None:
        return False
    view = registry.kernel(target.uid)
    keyed = bool(view.keys or view.uid_keys)
    for step in plan.steps:
        if isinstance(step, RemoveAll | DropStaleKeys) and (view.objects or keyed):
            return True
        if isinstance(step, InstallDenyFirst) and view.objects and (view.applied is not None or keyed):
            return True
        if isinstance(step, ApplyPolicy) and view.applied is not None:
            return True
    return False


def resync_plan(entry: Entry | None) -> Plan | None:
    """A plan that brings the kernel back to ``entry`` (committed) without changing it."""
    if entry is None or entry.binding is None:
        return None
    steps: tuple[Step, ...]
    if entry.state is State.ACTIVE and entry.policy is not None:
        steps = (ApplyPolicy(entry.policy),)
    else:
        steps = (InstallDenyFirst(entry.binding), DropStaleKeys(entry.binding))
    return Plan(PlanOutcome.OK, steps=steps, on_success=entry, on_failure=entry)


class Revocations:
    def __init__(
        self,
        shared: Shared,
        *,
        execute: Callable[[Entry | None, Plan, After | None], Awaitable[Result]],
        on_closing: Callable[[str], None],
    ) -> None:
        self._shared = shared
        self._execute = execute  # the control plane's plan executor, as for an action
        self._on_closing = on_closing  # the subject's vault view changed (closing: none)
        # Subjects whose kernel still holds more than the registry now says.
        self.pending: dict[str, Revocation] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.backoff = (REVOKE_RETRY_MIN_S, REVOKE_RETRY_MAX_S)

    def closing(self, uid: str) -> bool:
        rev = self.pending.get(uid)
        return rev is not None and rev.closing

    def reasons(self) -> dict[str, str]:
        """uid -> why its revocation is still pending (for /healthz and egressctl)."""
        return {uid: rev.reason for uid, rev in self.pending.items()}

    def failed(
        self, uid: str, plan: Plan, exc: StepFailed, reason: str, after: After | None, *, narrowing: bool
    ) -> None:
        """A step of ``plan`` failed: a narrowing is retried; a widening step (an activation)
        that may have applied leaves the kernel maybe more open than the registry's committed
        state, so the kernel is re-synced down to it, as a revocation (closing, 503, retried).
        Late is fine, early-open never; the caller's retry then widens properly."""
        if narrowing:
            self.mark(uid, plan, reason, after)
        elif exc.uncertain and isinstance(exc.step, ApplyPolicy | AddKeys):
            resync = resync_plan(plan.on_failure)
            if resync is not None:
                self.mark(uid, resync, f"{reason} (outcome unknown: re-syncing)", None)

    def mark(self, uid: str, plan: Plan, reason: str, after: After | None) -> None:
        rev = self.pending.get(uid)
        attempts = rev.attempts if rev is not None else 0
        self.pending[uid] = Revocation(plan, self._shared.registry.get(uid), reason, after, attempts)
        self._on_closing(uid)  # a closing subject gets no vault (vault_for_ip)
        if uid not in self.tasks:
            log.warning("subject.revocation_pending", subject=subject_for_uid(uid), error=reason[:200])
            task = asyncio.get_running_loop().create_task(self.retry(uid))
            self.tasks[uid] = task
            task.add_done_callback(functools.partial(self._task_done, uid))
        self._count()

    def clear(self, uid: str) -> None:
        if self.pending.pop(uid, None) is not None:
            log.info("subject.revocation_done", subject=subject_for_uid(uid))
            self._count()

    async def close(self) -> None:
        """Stop the retries (shutdown keeps the table, still denying)."""
        for task in list(self.tasks.values()):
            task.cancel()
        for task in list(self.tasks.values()):
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def retry(self, uid: str) -> None:
        """Run the refused plan again, with backoff, until the kernel agrees. A newer action
        of the subject that succeeded clears the revocation (it ran its own narrowing)."""
        lo, hi = self.backoff
        delay = lo
        while uid in self.pending:
            await asyncio.sleep(delay)
            delay = min(hi, delay * 2)
            async with self._shared.locks.hold(uid):
                rev = self.pending.get(uid)
                if rev is None:
                    return
                current = self._shared.registry.get(uid)
                if current is not rev.expected:
                    # Only a committed plan changes the entry, and a successful one clears
                    # the revocation; keep retrying on what the registry holds now.
                    rev.expected = current
                rev.attempts += 1
                result = await self._execute(current, rev.plan, rev.after)
                if result.status == 200 and rev.after is not None:
                    await rev.after()

    def _task_done(self, uid: str, _task: asyncio.Task[None]) -> None:
        self.tasks.pop(uid, None)

    def _count(self) -> None:
        if self._shared.metrics:
            self._shared.metrics.revocations_pending.set(float(len(self.pending)))
