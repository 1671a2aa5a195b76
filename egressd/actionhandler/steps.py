"""One plan step run: what the engine decides around its kernel transaction, in order.

One method per step kind (subject/registry.py defines them). The kernel side
(:class:`egressd.engine.plansteps.PlanSteps`, the fleet's in fleetnft/steps.py) builds each
step's objects and sends them in one transaction through a :class:`StepTxn`, which records in
the registry what the kernel holds after it, or what it may hold when the answer never came,
so a step failing half-way leaves an exact view for the next one. Around it the engine opens
and closes host-uid DNS ports, narrows the lease books, publishes what changed and schedules
flow cuts. Callers of :meth:`StepRunner.run` hold the kernel lock.
"""

from __future__ import annotations

from dataclasses import replace

import structlog

from egressd.actionhandler import hostuid
from egressd.actionhandler.flows import FlowCuts
from egressd.actionhandler.learning import DnsLearning
from egressd.actionhandler.policies import EffectivePolicies
from egressd.actionhandler.shared import Shared
from egressd.addr import IPAddress
from egressd.engine.errors import RulesetRefused
from egressd.engine.plansteps import InUse, Keys, PlanSteps, Refused, Resync, StepTxn, ips
from egressd.feed import PolicyApplied
from egressd.policy import NetworkPolicy, names_narrow
from egressd.subject.leases import Narrowed
from egressd.subject.registry import (
    AddKeys,
    ApplyPolicy,
    Binding,
    DropStaleKeys,
    Entry,
    HostBinding,
    InstallDenyFirst,
    KernelView,
    RemoveAll,
    StaticContents,
    Step,
)

log = structlog.get_logger("egressd.fleet")

# The 500 reason names the step that failed, not just the action.
STEP_PREFIX: dict[type, str] = {
    InstallDenyFirst: "deny-first install",
    ApplyPolicy: "policy apply",
    AddKeys: "dispatch update",
    DropStaleKeys: "dispatch update",
    RemoveAll: "removal",
}


class StepFailed(Exception):
    def __init__(self, step: Step, reason: str, *, uncertain: bool = False) -> None:
        super().__init__(reason)
        self.step = step
        self.reason = reason
        self.uncertain = uncertain  # the transaction may have applied (RulesetUncertain)


class StepRunner:
    def __init__(
        self,
        shared: Shared,
        policies: EffectivePolicies,
        learning: DnsLearning,
        flows: FlowCuts,
        kernel: PlanSteps,
        ports: hostuid.PortBook,
    ) -> None:
        self._shared = shared
        self._cfg = shared.table
        self._policies = policies
        self._learning = learning
        self._flows = flows
        self.kernel = kernel
        self.ports = ports  # host-uid subjects' DNS listeners

    async def reset_table(self) -> None:
        """The table replaced by the deny-all header in one transaction (start-up): every
        sandbox is an unknown source again, so everything is dropped until the replay."""
        async with self._shared.kernel_lock:
            await self.kernel.reset_table()

    async def run(self, entry: Entry, step: Step) -> list[IPAddress]:
        """Run one step's transactions in order; return the sources whose flows to cut."""
        registry = self._shared.registry
        view = registry.kernel(entry.uid)

        def save(after: KernelView) -> None:
            # Recorded after every transaction, so a step failing half-way leaves an exact view.
            registry.set_kernel(entry.uid, after)

        txn = StepTxn(view, save)
        if view.unsure:
            # The last transaction's answer never came: first make the kernel hold exactly
            # ``view`` (whichever way that transaction went), in this step's transaction.
            txn.resync = self.resync(entry.uid, entry.nft_id, view)
            view = replace(view, rules=view.objects, unsure=False)
        match step:
            case InstallDenyFirst(binding=HostBinding() as host):
                return await self._uid_deny_first(entry, host, view, txn)
            case InstallDenyFirst():
                return await self._deny_first(entry, step, view, txn)
            case ApplyPolicy():
                return await self._apply_policy(entry, step, view, txn)
            case AddKeys(binding=HostBinding() as host):
                return await self._uid_add_keys(entry, host, view, txn)
            case AddKeys():
                assert isinstance(step.binding, Binding)
                return await self.kernel.add_keys(txn, entry, step.binding, view)
            case DropStaleKeys():
                return await self._drop_stale_keys(entry, step, view, txn)
            case RemoveAll():
                return await self._remove_all(entry, view, txn)

    def resync(self, uid: str, nid: str, view: KernelView) -> Resync:
        """Everything ``view`` says the subject has: the set contents of ``view.applied``
        (deny-first when None) with the leases the book holds under it."""
        if not view.objects or view.applied is None:
            return Resync(uid, nid, view, None, ())
        effective = self._policies.effective(view.applied)
        narrowed = self._learning.narrowed(uid, effective)
        return Resync(uid, nid, view, effective, narrowed.kept if narrowed is not None else ())

    async def _uid_deny_first(
        self, entry: Entry, host: HostBinding, view: KernelView, txn: StepTxn
    ) -> list[IPAddress]:
        """A host-uid subject's deny-first: its DNS port listens before any redirect points
        at it. Nothing to cut (its packets are all judged on output), except the flows of a
        network binding it replaces."""
        await self._open_port(host.slot)
        await self.kernel.uid_deny_first(txn, entry, host, view)
        if view.objects:
            self._learning.forget(entry.uid)
        return ips(view.keys)

    async def _uid_add_keys(
        self, entry: Entry, host: HostBinding, view: KernelView, txn: StepTxn
    ) -> list[IPAddress]:
        await self._open_port(host.slot)
        audit = view.applied is not None and self._policies.effective(view.applied).audit
        await self.kernel.uid_add_keys(txn, entry, host, view, audit=audit)
        return []

    async def _open_port(self, slot: int) -> None:
        try:
            await self.ports.open(slot)
        except OSError as exc:
            port = self._cfg.uids.dns_port(slot)
            raise Refused(f"host-uid DNS port {port}: {exc.strerror or exc}") from None

    async def _deny_first(
        self, entry: Entry, step: InstallDenyFirst, view: KernelView, txn: StepTxn
    ) -> list[IPAddress]:
        assert isinstance(step.binding, Binding)
        cut = await self.kernel.deny_first(txn, entry, step.binding, view)
        if view.objects:
            # Revert, rebind or retry: the leases went with the sets' contents.
            self._learning.forget(entry.uid)
        return cut

    async def _apply_policy(
        self, entry: Entry, step: ApplyPolicy, view: KernelView, txn: StepTxn
    ) -> list[IPAddress]:
        if not (view.objects and view.rules):
            raise Refused("subject has no deny-first state in the kernel")
        effective = self._policies.effective(step.policy)
        event = {"egress.default": effective.default_action.value, "rules": len(effective.egress)}
        contents = self.kernel.static_contents(effective)
        narrowed = self._learning.narrowed(entry.uid, effective)
        in_place = view.applied is not None
        # In place: leases no still-allowed name taught leave in the same transaction
        # (14.1). The kernel's dyn sets never hold more than the book (learn records
        # every outcome but a refusal), so when every lease of the book stays they stay.
        kept = narrowed.kept if in_place and narrowed is not None and not narrowed.intact else None
        try:
            await self.kernel.apply_policy(txn, entry, view, step.policy, effective, contents, kept)
        except RulesetRefused as exc:
            log.warning(
                "egress.update_failed",
                **{"opensandbox.event": "egress.update_failed", **event},
                subject=entry.subject,
                error=str(exc)[:200],
            )
            raise
        if narrowed is not None:
            self._learning.leases[entry.uid] = narrowed.book
            self._shared.feed.publish(PolicyApplied())  # names that verified destinations may be gone
        log.info("egress.updated", **{"opensandbox.event": "egress.updated", **event}, subject=entry.subject)
        if in_place and self._flows.enabled and view.keys and self._takes_away(view, effective, contents, narrowed):
            # Flows to destinations the change no longer allows are cut, allowed ones keep
            # running; a change that takes nothing away reads no conntrack table. (A
            # host-uid subject has nothing established past its rules.)
            self._flows.schedule(entry.uid, view.keys, effective)
        return []

    def _takes_away(
        self, view: KernelView, effective: NetworkPolicy, contents: StaticContents, narrowed: Narrowed | None
    ) -> bool:
        """May an in-place change from ``view`` to ``effective`` leave an established flow
        running that the new policy refuses (docs/behaviour.md §14.1)? It may when it revokes
        a lease, refuses an address the static sets accepted, or refuses a name the old policy
        admitted (a flow to one of its addresses may outlive the lease it started under, e.g.
        UDP, never renewed). Anything not known for certain counts as yes."""
        if narrowed is not None and narrowed.revoked:
            return True
        if view.applied is None or view.contents is None or self.kernel.refuses_more(view.contents, contents):
            return True
        return names_narrow(self._policies.effective(view.applied), effective)

    async def _drop_stale_keys(
        self, entry: Entry, step: DropStaleKeys, view: KernelView, txn: StepTxn
    ) -> list[IPAddress]:
        keep = step.keep if isinstance(step.keep, Binding) else None
        kept: Keys = frozenset(
            {(keep.ip, keep.gateway)} if keep is not None and keep.gateway is not None else set()
        )
        kept_uid = hostuid.kept(step.keep)
        stale, stale_uid = view.keys - kept, view.uid_keys - kept_uid
        await self.kernel.drop_keys(txn, entry, view, keep, kept, kept_uid, self._in_use(entry.uid))
        # The slot of the binding the subject ends with stays open (a re-key to another uid
        # drops every key first, then adds the new one on the same slot).
        ending = hostuid.slots(entry, kept_uid)
        await self.ports.close(entry.uid, {slot for _, slot in stale_uid} - ending)
        return [ip for ip in ips(stale) if ip not in ips(kept)]

    async def _remove_all(self, entry: Entry, view: KernelView, txn: StepTxn) -> list[IPAddress]:
        slots = hostuid.slots(entry, view.uid_keys)
        removed = await self.kernel.remove_all(txn, entry, view, self._in_use(entry.uid))
        await self.ports.close(entry.uid, slots)
        if not removed:
            return []
        self._learning.forget(entry.uid)
        self._policies.forget(entry.uid)
        return ips(view.keys)

    def _in_use(self, uid: str) -> InUse:
        """Whether a gateway is still used by a subject other than ``uid``."""
        registry = self._shared.registry
        return lambda gw: registry.gateway_in_use(gw, excluding=uid)
