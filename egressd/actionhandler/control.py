"""Operation handling (docs/reference/actions-protocol.md §3): actions in, the registry's plans executed, commits out.

:class:`ControlPlane` runs the three operations. It parses the input before anything changes,
asks the registry for a plan (subject/registry.py, pure), runs the plan's kernel steps in
order (steps.py) under the subject's lock and the kernel lock, and commits the plan's entry:
kernel first, registry second. What surrounds a plan lives beside it: the vault (vaults.py),
the DNS side (learning.py), refused narrowings (revocation.py), flow cuts (flows.py), the
always-rules reload (always.py) and the operator views (report.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog

from egressd.actionhandler.always import AlwaysRulesApply
from egressd.actionhandler.api import OK, Result, SubjectListener
from egressd.actionhandler.envelope import HookName, LifecycleHook, RemoveBinding, SetBinding
from egressd.actionhandler.flows import FlowCuts
from egressd.actionhandler.hostuid import PortBook, with_host_binding
from egressd.actionhandler.inputs import BadRequest, BindingInput, read_set_binding
from egressd.actionhandler.learning import DnsLearning
from egressd.actionhandler.policies import EffectivePolicies
from egressd.actionhandler.report import Report
from egressd.actionhandler.revocation import After, Revocations, narrows
from egressd.actionhandler.shared import Claims, Shared
from egressd.actionhandler.steps import STEP_PREFIX, StepFailed, StepRunner
from egressd.actionhandler.vaults import Credentials
from egressd.addr import IPAddress
from egressd.engine.errors import RulesetRefused, RulesetUncertain
from egressd.engine.plansteps import PlanKernel, Refused
from egressd.engine.subjects import SubjectEngine
from egressd.feed import Feed
from egressd.metrics import EgressMetrics
from egressd.policy import EMPTY_ALWAYS, AlwaysRules, NetworkPolicy
from egressd.subject.leases import DEFAULT_MAX_LEASES
from egressd.subject.model import subject_for_uid
from egressd.subject.registry import (
    Entry,
    InstallDenyFirst,
    Plan,
    PlanOutcome,
    RemoveAll,
    SetBindingRequest,
    State,
    Step,
    plan_data_plane_ready,
    plan_hook_fence,
    plan_policy_change,
    plan_remove,
    plan_set_binding,
)
from egressd.vault.keys import KeyStore
from egressd.vault.types import DEFAULT_LIMITS, VaultLimits

log = structlog.get_logger("egressd.fleet")


class ControlPlane:
    def __init__(
        self,
        kernel: PlanKernel,
        *,
        always: AlwaysRules = EMPTY_ALWAYS,
        metrics: EgressMetrics | None = None,
        conntrack_flush: Callable[[IPAddress], Any] | None = None,
        keys: KeyStore | None = None,
        pending_ttl: float = 30.0,
        max_leases: int = DEFAULT_MAX_LEASES,
        max_rules: int = 0,
        vault_limits: VaultLimits = DEFAULT_LIMITS,
        feed: Feed | None = None,
    ) -> None:
        # The daemon's one change feed (egressd.feed), passed in at start-up; a test's own by default.
        self.feed = feed if feed is not None else Feed()
        # The kernel side (egressd.engine.plansteps), built by the composition root.
        self.kernel, self.table = kernel, kernel.table
        self.shared = shared = Shared(kernel.table, metrics, self.feed)
        self.registry, self.locks = shared.registry, shared.locks
        self.keys = keys
        self.max_rules = max_rules  # OPENSANDBOX_EGRESS_MAX_RULES on SET_BINDING input (0 = none)
        self.listeners: list[SubjectListener] = []
        self.claims = Claims()
        self.policies = policies = EffectivePolicies(always)
        self.revocations = revocations = Revocations(
            shared,
            execute=lambda entry, plan, after: self._execute(
                entry, plan, failure_prefix="revocation", after=after
            ),
            on_closing=lambda uid: self.credentials.view_changed(uid),
        )
        closing = revocations.closing
        self.credentials = Credentials(
            shared.registry,
            policies,
            closing,
            limits=vault_limits,
            pending_ttl=pending_ttl,
            uids=kernel.table.uids,
            feed=self.feed,
        )
        # The subject engine over the fleet's ruleset backend: leases, narrowing, cuts, checks.
        self.subjects = subjects = SubjectEngine(kernel.backend, self.feed, max_leases=max_leases)
        self.learning = learning = DnsLearning(shared, policies, closing, subjects)
        self.vaults, self.leases = self.credentials.stores, learning.leases
        self.flows = FlowCuts(conntrack_flush, subjects)
        self.uid_ports = PortBook(kernel.table, shared.registry, self.claims)  # host-uid DNS listeners
        self.steps = StepRunner(shared, policies, learning, self.flows, kernel.steps, self.uid_ports)
        self.always_rules = AlwaysRulesApply(shared, kernel, policies, revocations, learning, self.flows)
        self.report = Report(shared, kernel, policies, revocations, self.leases, self.vaults)
        # Kept under their old names: what the tests and scripts reach most.
        self.asker, self.learn = learning.asker, learning.learn
        self.renew_leases = learning.renew_leases
        self.destination_verified = learning.destination_verified
        self.vault_for_ip = self.credentials.vault_for_ip
        self.revoking, self.set_always_rules = revocations.reasons, self.always_rules.apply
        self.enforcement_ready = False

    @property
    def always(self) -> AlwaysRules:
        return self.policies.always

    async def reset_table(self) -> None:
        """Reset the table to the deny-all header (startup; failure is fatal to the caller)."""
        await self.steps.reset_table()
        self.enforcement_ready = True

    async def close(self) -> None:
        """Stop the revocation retries and the DNS group commits, whose waiters are failed
        (shutdown keeps the table, still denying)."""
        await self.revocations.close()
        await self.learning.group.close()

    # ---- actions ---------------------------------------------------------------------------

    async def handle(self, action: SetBinding | LifecycleHook | RemoveBinding) -> Result:
        if isinstance(action, SetBinding):
            return await self.set_binding(action)
        if isinstance(action, LifecycleHook):
            return await self.hook(action)
        return await self.remove(action)

    async def set_binding(self, action: SetBinding) -> Result:
        # The subject's lock is held from the parse on (14.7: the parse, a sealed vault's
        # decryption and validation, runs in the vault worker): actions of one subject keep
        # their arrival order, as when the parse was synchronous; other subjects never wait.
        async with self.locks.hold(action.uid):
            try:
                req, parsed = await read_set_binding(
                    action,
                    keys=self.keys,
                    always=self.policies.always,
                    max_rules=self.max_rules,
                    limits=self.credentials.limits,
                )
            except BadRequest as exc:
                return Result(400, str(exc))
            keyed = with_host_binding(self.table, self.registry, self.claims, action, req)
            if isinstance(keyed, Result):
                return keyed
            return await self._bind(action.uid, keyed, parsed)

    async def _bind(self, uid: str, req: SetBindingRequest, parsed: BindingInput | None) -> Result:
        entry = self.registry.get(uid)
        claim = req.binding or (entry.binding if entry else None)
        conflict = self.registry.check_claims(uid, claim) or self.claims.conflict(uid, claim)
        if conflict is not None:
            return Result(409, conflict)
        # Reserved before the first await: a concurrent SET_BINDING of another uid for the
        # same ip or nft id sees the claim and gets 409 instead of sharing kernel objects.
        with self.claims.reserve(uid, claim):
            plan = plan_set_binding(entry, req)
            uncovered = self.credentials.uncovers(uid, plan, parsed)
            if uncovered is not None:
                return Result(400, f"policy change uncovers a credential binding: {uncovered}")
            if plan.rebind or req.policy is None:
                # A new fence never inherits credentials; null removes policy and vault.
                self.credentials.drop(uid, pushes=req.policy is None)
            if plan.rebind or (req.policy is None and entry is not None):
                for listener in self.listeners:
                    await (listener.reset(uid) if plan.rebind else listener.unbound(uid))

            async def finish() -> None:
                # What a committed SET_BINDING does after its kernel steps; also run by
                # egressd's own retry of a refused narrowing (14.6), so the input's vault
                # action and the pending-push replay are never lost with the 500.
                if parsed is not None:
                    await self.credentials.bound(uid, parsed)
                committed = self.registry.get(uid)
                if req.policy is not None and committed is not None:
                    for listener in self.listeners:
                        await listener.registered(committed)

            result = await self._execute(entry, plan, failure_prefix="deny-first install", after=finish)
        if result.status == 200:
            await finish()
        elif parsed is not None and uid in self.revocations.pending:
            self.credentials.refused(uid, parsed)
        return result

    async def hook(self, action: LifecycleHook) -> Result:
        async with self.locks.hold(action.uid):
            entry = self.registry.get(action.uid)
            if action.hook is HookName.RUNTIME_READY:
                plan = plan_hook_fence(entry, action.fence)
            else:
                view = self.registry.kernel(action.uid)
                plan = plan_data_plane_ready(entry, action.fence, kernel_objects=view.objects and view.rules)
            result = await self._execute(entry, plan, failure_prefix="policy apply")
            if result.status == 200 and plan.outcome is PlanOutcome.OK:
                # The vault of the binding input activates at the same barrier as its policy.
                await self.credentials.activated(action.uid)
            return result

    async def remove(self, action: RemoveBinding) -> Result:
        async with self.locks.hold(action.uid):
            entry = self.registry.get(action.uid)
            plan = plan_remove(entry, action.fence)

            async def forget() -> None:
                self.credentials.drop(action.uid, pushes=True)
                for listener in self.listeners:
                    await listener.removed(action.uid)

            result = await self._execute(entry, plan, failure_prefix="removal", after=forget)
            if result.status == 200 and plan.removed:
                await forget()
            elif plan.removed and entry is not None:
                # The kernel refused: credentials go now, the retry finishes the rest (14.6).
                self.credentials.drop(action.uid, pushes=True)
            return result

    async def apply_user_policy_locked(self, entry: Entry, policy: NetworkPolicy) -> Result:
        """In-place policy change of an active subject (proxy-route /policy); lock held by caller."""
        return await self._execute(entry, plan_policy_change(entry, policy), failure_prefix="policy apply")

    # ---- plan execution --------------------------------------------------------------------

    async def _execute(
        self, entry: Entry | None, plan: Plan, *, failure_prefix: str, after: After | None = None
    ) -> Result:
        if plan.outcome is PlanOutcome.CONFLICT:
            return Result(409, plan.reason)
        if plan.outcome is PlanOutcome.NOOP:
            return OK
        target = plan.on_success if plan.on_success is not None else plan.on_failure
        assert target is not None
        uid = target.uid
        closes = any(isinstance(step, InstallDenyFirst | RemoveAll) for step in plan.steps)
        if self.revocations.closing(uid) and not closes and not self.registry.kernel(uid).unsure:
            # A revert, rebind or removal the kernel refused is still pending: nothing may
            # build on the state it is taking away (a tenant's /policy write, an in-place
            # SET_BINDING, an activation). Retryable, like any kernel failure (14.6). (After
            # an unanswered transaction the next one starts with a re-sync, so it may run.)
            return Result(500, f"revocation pending for {subject_for_uid(uid)}; retry later")
        narrowing = narrows(plan, self.registry)
        try:
            for step in plan.steps:
                await self._step(target, step)
        except StepFailed as exc:
            self._commit(entry, plan.on_failure, uid)
            log.warning(
                "subject.kernel_failed",
                subject=target.subject,
                step=type(exc.step).__name__,
                error=exc.reason,
            )
            reason = f"{STEP_PREFIX.get(type(exc.step), failure_prefix)}: {exc.reason}"
            self.revocations.failed(uid, plan, exc, reason, after, narrowing=narrowing)
            return Result(500, reason)
        self._commit(entry, plan.on_success, uid)
        self.revocations.clear(uid)
        return OK

    async def _step(self, entry: Entry, step: Step) -> None:
        async with self.shared.kernel_lock:
            try:
                cut = await self.steps.run(entry, step)
            except (RulesetRefused, Refused) as exc:
                raise StepFailed(step, str(exc), uncertain=isinstance(exc, RulesetUncertain)) from None
        # Outside the kernel lock: cutting flows is slow (a subprocess) and only narrows access.
        if isinstance(step, RemoveAll):
            # The sandbox is going away and the kernel already refuses its new flows: its old
            # flows are cut in the background instead of delaying the answer. A revert or a
            # rebind waits, so its 200 means "no old flow survives".
            self.flows.background(self.flows.flush_sources(cut))
        else:
            await self.flows.flush_sources(cut)

    def _commit(self, old: Entry | None, new: Entry | None, uid: str) -> None:
        if new is None:
            self.registry.drop(uid)
        else:
            self.registry.put(new)
        if old is not None and (
            new is None or (old.binding, old.state, old.fence) != (new.binding, new.state, new.fence)
        ):
            # Removed, re-keyed, rebound or no longer active: the vault lookup of the old (and
            # new) address answers differently. An in-place policy swap keeps the snapshot.
            self.credentials.view_changed(uid, old)
        old_state = old.state if old else State.ABSENT
        new_state = new.state if new else State.ABSENT
        ref = new or old
        if ref is not None and (old_state != new_state or (old and new and old.fence != new.fence)):
            log.info(
                "subject.transition",
                subject=ref.subject,
                **{"from": old_state.value, "to": new_state.value},
                runtime_instance_id=ref.fence.runtime_instance_id,
                attachment_id=ref.fence.attachment_id,
            )
            if self.shared.metrics:
                self.shared.metrics.transitions.inc(old_state.value, new_state.value)
