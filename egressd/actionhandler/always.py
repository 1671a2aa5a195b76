"""Always-rules reload applied to the fleet: every subject with a policy, in ONE transaction.

The reloader (policy/reload.py) reads the files; this applies the result through the kernel
side's contents swap (fleetnft/always.py). Works from kernel truth under the kernel lock: every
subject whose sets hold a policy is re-applied with the new rules, and any transaction after
this one already uses them, so no activation racing the reload can keep the old rules.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from egressd.actionhandler.flows import FlowCuts
from egressd.actionhandler.learning import DnsLearning
from egressd.actionhandler.policies import EffectivePolicies
from egressd.actionhandler.revocation import Revocations, resync_plan
from egressd.actionhandler.shared import Shared
from egressd.addr import IPAddress
from egressd.engine.errors import RulesetRefused, RulesetUncertain
from egressd.engine.plansteps import PlanKernel
from egressd.feed import AlwaysRulesChanged
from egressd.policy import AlwaysRules, NetworkPolicy, effective_policy
from egressd.subject.leases import LeaseBook
from egressd.subject.registry import StaticContents

Applied = list[tuple[str, frozenset[tuple[IPAddress, IPAddress]], NetworkPolicy]]


class AlwaysRulesApply:
    def __init__(
        self,
        shared: Shared,
        kernel: PlanKernel,
        policies: EffectivePolicies,
        revocations: Revocations,
        learning: DnsLearning,
        flows: FlowCuts,
    ) -> None:
        self._shared = shared
        self._kernel = kernel
        self._policies = policies
        self._revocations = revocations
        self._learning = learning
        self._flows = flows

    async def apply(self, always: AlwaysRules) -> None:
        """Swap the always-rules and re-apply every subject with a policy. Raises RulesetRefused
        when the kernel refuses: then nothing changed and the old rules stay."""
        applied: Applied = []
        books: dict[str, LeaseBook] = {}
        written: dict[str, StaticContents] = {}
        shared = self._shared
        async with shared.kernel_lock:
            batch = self._kernel.contents_swap()
            for entry in shared.registry:
                view = shared.registry.kernel(entry.uid)
                if view.rules and view.applied is not None:
                    # A subject being closed (its revert, rebind or removal refused) never
                    # gains from a reload: it gets the narrower of the old and new rules.
                    closing = self._revocations.closing(entry.uid)
                    rules = narrower(self._policies.always, always) if closing else always
                    effective = effective_policy(view.applied, rules)
                    # An audit policy was applied with its audit objects (fleetnft/steps.py), so
                    # ``view.audit`` holds for it; contents_swap refuses the impossible rest.
                    contents = self._kernel.steps.static_contents(effective)
                    narrowed = self._learning.narrowed(entry.uid, effective)
                    # A newly always-denied name loses its leases in the same transaction (the
                    # dyn sets are flushed even when the book knows of none: 14.1).
                    kept = narrowed.kept if narrowed is not None else ()
                    # Likewise the range objects: the always-rules carry no port ranges, so
                    # the shared ranges are the user policy's, applied with their objects.
                    batch.add(
                        entry.nft_id,
                        contents,
                        audit_objects=view.audit,
                        range_objects=view.ranges,
                        kept=kept,
                        unsure=view.unsure,
                    )
                    applied.append((entry.uid, view.keys, effective))
                    written[entry.uid] = contents
                    if narrowed is not None:
                        books[entry.uid] = narrowed.book
            if batch:
                try:
                    await batch.send()
                except Exception as exc:
                    if not isinstance(exc, RulesetRefused) or isinstance(exc, RulesetUncertain):
                        self._record(dict.fromkeys(written))  # either contents: not known
                        self._resync_after_unknown(applied, str(exc))
                    raise
            self._record(written)
            self._policies.always = always
            self._learning.leases.update(books)
            self._shared.feed.publish(AlwaysRulesChanged())  # every subject's effective policy changed
        if self._flows.enabled:
            # A newly always-denied destination must not stay reachable over flows opened
            # before the reload: cut exactly the flows the new rules no longer allow (the
            # cuts of every subject share one read of the conntrack table).
            for uid, keys, effective in applied:
                self._flows.schedule(uid, keys, effective)

    def _record(self, written: Mapping[str, StaticContents | None]) -> None:
        """What the static sets of each subject hold now (None: not known), for its next swap."""
        registry = self._shared.registry
        for uid, contents in written.items():
            registry.set_kernel(uid, replace(registry.kernel(uid), contents=contents))

    def _resync_after_unknown(self, applied: Applied, error: str) -> None:
        """The swap went unanswered: the kernel may enforce the new rules (a new always-allow
        opens more than the registry claims). Each subject it touched is re-synced to its
        policy under the rules still in force, as a revocation; the reloader retries."""
        for uid, _keys, _effective in applied:
            entry = self._shared.registry.get(uid)
            if uid in self._revocations.pending or entry is None:
                continue  # a pending revocation re-applies under the rules in force anyway
            resync = resync_plan(entry)
            if resync is not None:
                reason = f"always-rules reload: {error[:200]} (outcome unknown: re-syncing)"
                self._revocations.mark(uid, resync, reason, None)


def narrower(old: AlwaysRules, new: AlwaysRules) -> AlwaysRules:
    """Every always-deny of either, and only the always-allows both have."""
    deny = new.deny + tuple(r for r in old.deny if r not in new.deny)
    return AlwaysRules(deny=deny, allow=tuple(r for r in new.allow if r in old.allow))
