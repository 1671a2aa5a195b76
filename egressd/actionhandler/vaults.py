"""Each subject's credential vault as the actions and the MITM see it (§6, docs/reference/behaviour.md §14.7, 14.9).

A SET_BINDING input's vault activates with its policy: at once for an active subject, at
data-plane-ready for a denying one. Proxy-route pushes for a sandbox not registered yet wait
in :attr:`Credentials.pending_pushes`. Every change that alters what :meth:`vault_for_ip`
answers for an address tells the MITM child to drop its cached snapshot of it. All of it
runs under the subject's lock (the callers hold it).
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from egressd.actionhandler.inputs import BindingInput, VaultAction
from egressd.actionhandler.policies import EffectivePolicies
from egressd.addr import IPAddress
from egressd.feed import Feed, VaultChanged, port_key
from egressd.policy import NetworkPolicy
from egressd.subject.hostuid import DEFAULT_UID_PORTS, UidPorts
from egressd.subject.model import subject_for_uid
from egressd.subject.registry import Entry, HostBinding, Plan, PlanOutcome, Registry, State
from egressd.vault.offload import off_loop
from egressd.vault.pending import PendingPushes
from egressd.vault.snapshot import VaultSnapshot
from egressd.vault.store import VaultStore
from egressd.vault.types import VaultError, VaultLimits

log = structlog.get_logger("egressd.fleet")


class Credentials:
    def __init__(
        self,
        registry: Registry,
        policies: EffectivePolicies,
        closing: Callable[[str], bool],
        *,
        limits: VaultLimits,
        pending_ttl: float,
        uids: UidPorts = DEFAULT_UID_PORTS,
        feed: Feed | None = None,
    ) -> None:
        self._registry = registry
        self._policies = policies
        self._closing = closing  # a subject whose closing is refused gets no vault (14.6)
        self.limits = limits
        self.stores: dict[str, VaultStore] = {}
        # Binding inputs whose vault activates with their pending policy (data-plane-ready).
        self.pending_inputs: dict[str, BindingInput] = {}
        self.pending_pushes = PendingPushes(pending_ttl)
        # Where vault changes are announced (docs/reference/behaviour.md §14.9): addresses whose vault snapshot the
        # MITM child may hold and must drop now (vault deleted or changed, subject removed, rebound,
        # closing). (A host-uid subject's snapshot is cached under its MITM port's key, not an address.)
        self.feed = feed if feed is not None else Feed()
        self._uids = uids  # host-uid subjects' MITM ports (docs/reference/behaviour.md §17)

    def view_changed(self, uid: str, *also: Entry | None) -> None:
        """What ``vault_for_ip`` answers for ``uid``'s address (``vault_for_mitm_port`` for
        its port) may have changed: the MITM child drops its cached snapshot of it (and of
        ``also``'s, e.g. the old binding)."""
        clients: set[IPAddress | str] = set()
        for e in (self._registry.get(uid), *also):
            if e is None or e.binding is None:
                continue
            if isinstance(e.binding, HostBinding):
                clients.add(port_key(self._uids.mitm_port(e.binding.slot)))
            else:
                clients.add(e.binding.ip)
        if clients:
            self.feed.publish(VaultChanged(tuple(sorted(clients, key=str))))

    def drop(self, uid: str, *, pushes: bool) -> None:
        self.view_changed(uid)
        self.stores.pop(uid, None)
        self.pending_inputs.pop(uid, None)
        if pushes:
            self.pending_pushes.drop(uid)

    def uncovers(self, uid: str, plan: Plan, parsed: BindingInput | None) -> str | None:
        """A policy change that keeps the subject's vault must still cover every binding host,
        exactly as a ``/policy`` write through the proxy route must (14.1): why not, or None."""
        store = self.stores.get(uid)
        if store is None or parsed is None or plan.rebind or parsed.vault is not VaultAction.KEEP:
            return None
        if plan.outcome is not PlanOutcome.OK:
            return None
        try:
            store.check_policy(self._policies.effective(parsed.policy))
        except VaultError as exc:
            return str(exc)
        return None

    async def bound(self, uid: str, parsed: BindingInput) -> None:
        """After a committed SET_BINDING: an active subject's vault changes in place, after
        the policy; a denying one's waits for data-plane-ready. A bare policy string leaves
        the vault alone, including a sealed vault still waiting for data-plane-ready."""
        committed = self._registry.get(uid)
        if committed is not None and committed.state is State.ACTIVE:
            await self.activate(uid, parsed)
        elif committed is not None and parsed.vault is not VaultAction.KEEP:
            self.pending_inputs[uid] = parsed

    def refused(self, uid: str, parsed: BindingInput) -> None:
        """A SET_BINDING the kernel refused (its narrowing is being retried, 14.6): an input that
        takes the vault away needs no kernel for that much, so it holds now."""
        if parsed.vault is VaultAction.REMOVE:
            self.view_changed(uid)
            self.stores.pop(uid, None)
            self.pending_inputs.pop(uid, None)

    async def activated(self, uid: str) -> None:
        """data-plane-ready committed: the binding input's vault activates with its policy."""
        pending = self.pending_inputs.pop(uid, None)
        if pending is not None:
            await self.activate(uid, pending)

    async def activate(self, uid: str, parsed: BindingInput) -> None:
        """Right after the policy was committed."""
        if parsed.vault is VaultAction.KEEP:
            return
        self.view_changed(uid)
        if parsed.vault is VaultAction.REMOVE or parsed.content is None:
            self.stores.pop(uid, None)
            return
        coverage = self.coverage_policy(uid)
        store = self.stores.get(uid)
        work = store.fork() if store is not None else VaultStore(limits=self.limits)
        if coverage is not None and coverage == parsed.validated_against:
            # The usual case: validated (off the loop) against this very policy when the
            # input arrived, so the commit is O(n) and follows the policy in the same step.
            status, _ = work.put_content(parsed.content, coverage, prevalidated=True)
        else:
            # The always-rules changed since: validate again, off the loop (14.7). The old
            # vault goes first, so nothing validated for another policy is injected meanwhile.
            self.stores.pop(uid, None)
            status, _ = await off_loop(work.put_content, parsed.content, coverage)
            if status < 400:
                self.stores[uid] = work
                # A pull during the validation learned "no vault" (a 404 the MITM remembers)
                # under the stamp of the bump above; nothing else bumps after a background
                # activation (the revocation retry), so this widening bumps itself.
                self.view_changed(uid)
                return
        if status < 400:
            self.stores[uid] = work
        else:
            # Validated when the input arrived; only a changed always-rule can refuse it now.
            # Without the vault nothing is injected: closed, and said in the log.
            self.stores.pop(uid, None)
            log.warning("vault.activation_refused", subject=subject_for_uid(uid), code=status)

    def coverage_policy(self, uid: str) -> NetworkPolicy | None:
        """What vault bindings must be covered by: the effective policy if active, else the
        pending one plus always-rules (docs/reference/behaviour.md §6, PROPOSED); None refuses every binding."""
        entry = self._registry.get(uid)
        if entry is None:
            return None
        if entry.state is State.ACTIVE:
            return self._policies.effective_for(entry)
        if entry.pending is not None:
            return self._policies.effective(entry.pending)
        return None

    def vault_for_ip(self, source_ip: IPAddress) -> VaultSnapshot | None:
        """MITM lookup: the active subject's vault snapshot (``.tag`` changes on every mutation)."""
        return self._snapshot(self._registry.resolve(source_ip))

    def vault_for_mitm_port(self, port: int) -> VaultSnapshot | None:
        """MITM lookup of a host-uid subject (docs/reference/behaviour.md §17): its listener port names it."""
        slot = self._uids.slot_of_mitm_port(port)
        return None if slot is None else self._snapshot(self._registry.resolve_slot(slot))

    def _snapshot(self, entry: Entry | None) -> VaultSnapshot | None:
        if entry is None or entry.state is not State.ACTIVE or self._closing(entry.uid):
            return None
        store = self.stores.get(entry.uid)
        return store.snapshot() if store is not None else None
