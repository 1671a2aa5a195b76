"""Operation handling (BEHAVIOUR.md §3): actions in, kernel transactions and registry commits out.

Every mutation of a subject runs under that subject's lock, and every kernel step runs under
one global lock so the cross-subject bookkeeping (who still uses a gateway or an IP) is read
and changed atomically with the transaction that depends on it. Kernel first, registry second.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import struct
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass, replace
from typing import Any, Protocol

import structlog

from egressd.actionhandler.envelope import HookName, LifecycleHook, RemoveBinding, SetBinding
from egressd.actionhandler.inputs import BindingInput, InputError, VaultAction, parse_binding_input
from egressd.dnsproxy.server import Asker
from egressd.fleetnft.builder import (
    UID_DISPATCH,
    SubjectNft,
    TableConfig,
    UidSubjectNft,
    dispatch_deletes,
    dispatch_map,
    dyn_add,
    dyn_replace,
    flush_subject_sets,
    gateway_release,
    header_script,
    policy_contents,
    policy_swap,
    removal_batch,
    sandbox_nets_refresh,
    subject_create,
    subject_keys,
    subject_resync,
    subject_rules,
    uid_audit_ops,
    uid_key_deletes,
    uid_subject_create,
    uid_subject_keys,
)
from egressd.kernel.applier import NftError, NftUncertain, Transactions
from egressd.kernel.conntrack import flush_flow
from egressd.kernel.conntrack import read_flows as read_conntrack_flows
from egressd.kernel.netlink import element_covering
from egressd.kernel.ops import NetlinkBatch, Op
from egressd.metrics import EgressMetrics
from egressd.mitm.lookup import port_key
from egressd.policy import (
    EMPTY_ALWAYS,
    AlwaysRules,
    IpSets,
    NetworkPolicy,
    Verdict,
    audit_deny_sets,
    effective_policy,
    ip_sets,
    normalise_name,
)
from egressd.policy.decide import hard_denied, ip_decision
from egressd.policy.explain import explain as explain_target
from egressd.subject.hostuid import free_slot, host_uid_problem
from egressd.subject.leases import (
    DEFAULT_MAX_LEASES,
    LeaseBook,
    Narrowed,
    covered_by,
    name_admitted,
    names_admitted,
)
from egressd.subject.model import Fence, IPAddress, nft_id, subject_for_uid, unmap_ip
from egressd.subject.registry import (
    AddKeys,
    AnyBinding,
    ApplyPolicy,
    Binding,
    DropStaleKeys,
    Entry,
    HostBinding,
    InstallDenyFirst,
    KernelView,
    Outcome,
    Plan,
    Registry,
    RemoveAll,
    SetBindingRequest,
    State,
    Step,
    plan_data_plane_ready,
    plan_hook_fence,
    plan_remove,
    plan_set_binding,
)
from egressd.vault.model import DEFAULT_LIMITS, VaultError, VaultLimits
from egressd.vault.offload import off_loop
from egressd.vault.pending import PendingPushes
from egressd.vault.sealed import WRAPPER_MARKER, KeyStore
from egressd.vault.store import VaultSnapshot, VaultStore

log = structlog.get_logger("egressd.fleet")


@dataclass(frozen=True, slots=True)
class Result:
    status: int
    reason: str = ""


OK = Result(200)


class SubjectListener(Protocol):
    """Per-subject extras (vault, pending pushes, DNS leases) follow the subject's lifecycle."""

    async def registered(self, entry: Entry) -> None: ...  # after a successful non-null SET_BINDING

    async def unbound(self, uid: str) -> None: ...  # SET_BINDING(null)

    async def reset(self, uid: str) -> None: ...  # rebind or deny-first reinstall: drop learned state

    async def removed(self, uid: str) -> None: ...  # REMOVE_BINDING (also for absent uids)


class UidPorts(Protocol):
    """The per-subject DNS listeners of host-uid subjects (BEHAVIOUR 17): a slot's port is open
    from before its redirect exists until its subject is removed."""

    async def open(self, slot: int) -> None: ...  # raises OSError when the port cannot be bound

    async def close(self, slot: int) -> None: ...


class StepFailed(Exception):
    def __init__(self, step: Step, reason: str, *, uncertain: bool = False) -> None:
        super().__init__(reason)
        self.step = step
        self.reason = reason
        self.uncertain = uncertain  # the transaction may have applied (NftUncertain)


@dataclass(slots=True)
class _Revocation:
    """A narrowing the kernel refused (BEHAVIOUR 14.6): the plan to run again, the registry
    entry its failure committed (the retry only runs while that is still what the registry
    holds), and what to do once the kernel agreed."""

    plan: Plan
    expected: Entry | None
    reason: str
    after: Callable[[], Coroutine[Any, Any, None]] | None = None
    attempts: int = 0

    @property
    def closing(self) -> bool:
        """The refused plan takes the subject's policy away (revert, rebind, removal): DNS,
        learning and the vault act as if it were gone already. A refused in-place swap
        keeps the old policy there, as the registry does (kernel first, registry second)."""
        target = self.plan.on_success
        return target is None or target.state is not State.ACTIVE


REVOKE_RETRY_MIN_S = 0.05
REVOKE_RETRY_MAX_S = 5.0


class _SubjectLocks:
    """One asyncio lock per uid, freed when nobody holds or waits for it."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def hold(self, uid: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(uid, (asyncio.Lock(), 0))
        self._locks[uid] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[uid]
            if users <= 1:
                del self._locks[uid]
            else:
                self._locks[uid] = (lock, users - 1)


class ControlPlane:
    def __init__(
        self,
        table: TableConfig,
        tx: Transactions,
        *,
        always: AlwaysRules = EMPTY_ALWAYS,
        metrics: EgressMetrics | None = None,
        conntrack_flush: Callable[[IPAddress], Any] | None = None,
        keys: KeyStore | None = None,
        pending_ttl: float = 30.0,
        max_leases: int = DEFAULT_MAX_LEASES,
        max_rules: int = 0,
        vault_limits: VaultLimits = DEFAULT_LIMITS,
    ) -> None:
        self.table = table
        self.max_rules = max_rules  # OPENSANDBOX_EGRESS_MAX_RULES on SET_BINDING input (0 = none)
        self.vault_limits = vault_limits
        self.tx = tx
        self.always = always
        self.metrics = metrics
        self.registry = Registry()
        self.listeners: list[SubjectListener] = []
        self._locks = _SubjectLocks()
        self._kernel_lock = asyncio.Lock()
        self._conntrack_flush = conntrack_flush
        self._background: set[asyncio.Task[None]] = set()
        self.keys = keys
        self.vaults: dict[str, VaultStore] = {}
        # Set by the MITM (BEHAVIOUR 14.9): addresses whose vault snapshot the MITM child may
        # hold and must drop now (vault deleted or changed, subject removed, rebound, closing).
        # (A host-uid subject's snapshot is cached under its MITM port's key, not an address.)
        self.forget_snapshots: Callable[[list[IPAddress | str]], None] | None = None
        self._pending_vault: dict[str, BindingInput] = {}
        self.pending_pushes = PendingPushes(pending_ttl)
        self._claims_ip: dict[IPAddress, str] = {}
        self._claims_nft: dict[str, str] = {}
        # Host-uid subjects (BEHAVIOUR 17): claims in flight, and the DNS port listeners.
        self._claims_host_uid: dict[int, str] = {}
        self._claims_slot: dict[int, str] = {}
        self.uid_ports: UidPorts | None = None
        self._effective: dict[str, tuple[NetworkPolicy, AlwaysRules, NetworkPolicy]] = {}
        self._ip_sets: dict[str, tuple[NetworkPolicy, IpSets]] = {}
        # Each subject's DNS leases, with the names that taught them (subject/leases.py): the
        # refresh mirror, the lease cap, narrowing on policy changes and the MITM's check.
        self.max_leases = max_leases
        self.leases: dict[str, LeaseBook] = {}
        # Subjects whose kernel still holds more than the registry now says (14.6).
        self._revoking: dict[str, _Revocation] = {}
        self._revoke_tasks: dict[str, asyncio.Task[None]] = {}
        # privateCidr per subject as the kernel's sandbox_nets sets hold them (14.2).
        self._nets: dict[str, ipaddress.IPv4Network | ipaddress.IPv6Network] = {}
        self.revoke_retry = (REVOKE_RETRY_MIN_S, REVOKE_RETRY_MAX_S)
        self.enforcement_ready = False

    # ---- start-up -------------------------------------------------------------------------

    async def reset_table(self) -> None:
        """Reset the table to the deny-all header (startup; failure is fatal to the caller)."""
        async with self._kernel_lock:
            await self.tx.reset_table(
                header_script(self.table, delete_existing=True),
                header_script(self.table, delete_existing=False),
            )
            self._nets = {}
        self.enforcement_ready = True

    # ---- effective policy ------------------------------------------------------------------

    def effective(self, user: NetworkPolicy) -> NetworkPolicy:
        return effective_policy(user, self.always)

    def effective_for(self, entry: Entry) -> NetworkPolicy | None:
        """The entry's effective policy (user + always-rules), cached; None unless active."""
        if entry.state is not State.ACTIVE or entry.policy is None:
            return None
        cached = self._effective.get(entry.uid)
        if cached is not None and cached[0] is entry.policy and cached[1] is self.always:
            return cached[2]
        eff = self.effective(entry.policy)
        self._effective[entry.uid] = (entry.policy, self.always, eff)
        return eff

    async def set_always_rules(self, always: AlwaysRules) -> None:
        """Swap always-rules and re-apply every subject with a policy in ONE transaction.

        Works from kernel truth under the kernel lock: every subject whose sets hold a policy
        is re-applied with the new rules, and any transaction after this one already uses
        them, so no activation racing this reload can keep the old rules. Raises NftError
        when the kernel refuses: then nothing changed and the old rules stay.
        """
        applied: list[tuple[str, frozenset[tuple[IPAddress, IPAddress]], NetworkPolicy]] = []
        books: dict[str, LeaseBook] = {}
        async with self._kernel_lock:
            table = self.table.table
            batch = NetlinkBatch(table)
            for entry in self.registry:
                view = self.registry.kernel(entry.uid)
                if view.rules and view.applied is not None:
                    # A subject being closed (its revert, rebind or removal refused) never
                    # gains from a reload: it gets the narrower of the old and new rules.
                    rules = _narrower(self.always, always) if self._closing(entry.uid) else always
                    effective = effective_policy(view.applied, rules)
                    batch = batch + policy_swap(table, entry.nft_id, effective)
                    applied.append((entry.uid, view.keys, effective))
                    narrowed = self._narrowed(entry.uid, effective)
                    # A newly always-denied name loses its leases in the same transaction (the
                    # dyn sets are flushed even when the book knows of none: 14.1).
                    kept = narrowed.kept if narrowed is not None else ()
                    batch = batch + dyn_replace(table, entry.nft_id, kept)
                    if narrowed is not None:
                        books[entry.uid] = narrowed.book
            if batch:
                try:
                    await self.tx.run_batch(batch, op="static_apply")
                except Exception as exc:
                    if not isinstance(exc, NftError) or isinstance(exc, NftUncertain):
                        self._resync_after_unknown_reload(applied, str(exc))
                    raise
            self.always = always
            self.leases.update(books)
        if self._conntrack_flush is not None:
            # A newly always-denied destination must not stay reachable over flows opened
            # before the reload: cut exactly the flows the new rules no longer allow.
            for uid, keys, effective in applied:
                self._background_task(self._cut_disallowed(uid, keys, effective))

    def _resync_after_unknown_reload(
        self, applied: list[tuple[str, frozenset[tuple[IPAddress, IPAddress]], NetworkPolicy]], error: str
    ) -> None:
        """An always-rules swap went unanswered: the kernel may enforce the new rules (a new
        always-allow opens more than the registry claims). Each subject it touched is re-synced
        to its policy under the rules still in force, as a revocation; the reloader retries."""
        for uid, _keys, _effective in applied:
            entry = self.registry.get(uid)
            if uid in self._revoking or entry is None:
                continue  # a pending revocation re-applies under the rules in force anyway
            resync = _resync_plan(entry)
            if resync is not None:
                reason = f"always-rules reload: {error[:200]} (outcome unknown: re-syncing)"
                self._mark_revoking(uid, resync, reason, None)

    # ---- DNS proxy side ----------------------------------------------------------------------

    def asker(self, source_ip: IPAddress) -> Asker | None:
        """Hot path for every DNS query: a map lookup and a cached effective policy."""
        return self._asker_of(self.registry.resolve(source_ip))

    def asker_for_slot(self, slot: int) -> Asker | None:
        """The asker behind a host-uid subject's DNS port (BEHAVIOUR 17): the port names it."""
        return self._asker_of(self.registry.resolve_slot(slot))

    def _asker_of(self, entry: Entry | None) -> Asker | None:
        if entry is None:
            return None
        if self._closing(entry.uid):
            return Asker(entry.uid, entry.fence, None)  # being closed: answered as denying
        return Asker(entry.uid, entry.fence, self.effective_for(entry))

    def host_uid_subjects(self) -> dict[int, str]:
        """Host uid -> sandbox uid of every host-uid subject (the connection refresh's view)."""
        return {e.binding.host_uid: e.uid for e in self.registry if isinstance(e.binding, HostBinding)}

    def uid_for(self, source_ip: IPAddress) -> str | None:
        entry = self.registry.resolve(source_ip)
        return entry.uid if entry is not None else None

    async def renew_leases(self, uid: str, ips: list[IPAddress], seconds: int) -> None:
        """Connection refresh: re-add still-used DNS leases (one transaction per subject)."""
        entry = self.registry.get(uid)
        if entry is not None:
            await self.learn(uid, entry.fence, [(ip, seconds) for ip in ips])

    async def learn(
        self, uid: str, fence: Fence, leases: list[tuple[IPAddress, int]], name: str | None = None
    ) -> list[IPAddress]:
        """Put DNS-learned addresses into the subject's dyn sets before the answer is sent;
        return those the kernel now holds (the reply carries only these, BEHAVIOUR 14.4).

        Under the subject's lock and decided again there, against the policy in force now
        (BEHAVIOUR 14.1): an answer that arrives after a revert, rebind, removal or a change
        that denies its name must never reopen it. ``name`` None is the connection refresh:
        it renews only addresses that a still-allowed name taught.

        Shielded: a caller that stops waiting (the DNS proxy's bound) does not stop a kernel
        step that may already be under way, so the book always records what the kernel took.
        """
        return await asyncio.shield(self._learn(uid, fence, leases, name))

    async def _learn(
        self, uid: str, fence: Fence, leases: list[tuple[IPAddress, int]], name: str | None
    ) -> list[IPAddress]:
        async with self._locks.hold(uid):
            entry = self.registry.get(uid)
            if entry is None or entry.fence != fence or entry.state is not State.ACTIVE:
                return []
            if self._closing(uid) or not self.registry.kernel(uid).rules:
                return []
            async with self._kernel_lock:
                effective = self.effective_for(entry)  # always-rules change under this lock
                if effective is None:
                    return []
                now = time.monotonic()
                book = self.leases.setdefault(uid, LeaseBook(self.max_leases))
                if name is not None:
                    name = normalise_name(name.strip())
                    if not name_admitted(effective, name):
                        return []
                    candidates = leases
                else:
                    renew = set(book.renewable((ip for ip, _ in leases), names_admitted(effective), now))
                    candidates = [(ip, sec) for ip, sec in leases if ip in renew]
                admitted = book.admit(candidates, now)
                if not admitted:
                    return []
                batch = dyn_add(self.table.table, entry.nft_id, admitted, replace=self.table.renew_by_replace)
                # The inline path is an optional fast path of the kernel shell (see applier).
                run = getattr(self.tx, "run_batch_inline", None) or self.tx.run_batch
                try:
                    await run(batch, op="dynamic_add")
                except BaseException as exc:
                    if not isinstance(exc, NftError) or isinstance(exc, NftUncertain):
                        # Unanswered, timed out or cancelled by the DNS proxy's bound (the
                        # kernel thread may still commit it): the kernel may hold the leases.
                        # The book must never be narrower than the kernel, or a later
                        # narrowing would not revoke them (it rewrites the dyn sets from it).
                        book.record(admitted, name, now)
                    raise
                book.record(admitted, name, now)
            return [ip for ip, _ in admitted]

    def _narrowed(self, uid: str, effective: NetworkPolicy) -> Narrowed | None:
        """The subject's leases under a new effective policy (None: it has none)."""
        book = self.leases.get(uid)
        if book is None or not len(book):
            return None
        contents = policy_contents(effective)  # the deny sets the kernel will hold
        denied = covered_by(contents["deny_v4"], contents["deny_v6"])
        return book.narrowed(names_admitted(effective), denied, time.monotonic())

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
        async with self._locks.hold(action.uid):
            return await self._set_binding_locked(action)

    async def _set_binding_locked(self, action: SetBinding) -> Result:
        policy: NetworkPolicy | None = None
        parsed: BindingInput | None = None
        if action.input is not None:
            if self.keys is not None:
                # A due key-directory rescan runs in a thread, not on the loop that serves DNS;
                # the lookup inside parse_binding_input then finds it done (§11, ≤ 1 scan/s).
                await self.keys.refresh_async()
            parse = functools.partial(
                parse_binding_input,
                action.input,
                uid=action.uid,
                keys=self.keys,
                always=self.always,
                max_rules=self.max_rules,
                limits=self.vault_limits,
            )
            try:
                # A sealed vault (decryption, up to 1 MiB of validation) off the loop (14.7);
                # a bare policy stays here, so a busy vault worker never delays it.
                parsed = await off_loop(parse) if WRAPPER_MARKER in action.input else parse()
            except InputError as exc:
                return Result(400, f"invalid binding input: {exc}")
            policy = parsed.policy
        binding: AnyBinding | None = None
        entry = self.registry.get(action.uid)
        if action.attachment is not None:
            problem = _dispatch_key_problem(action.attachment.ip, action.attachment.gateway)
            if problem is not None:
                return Result(400, f"invalid action envelope: {problem}")
            binding = Binding(action.attachment.ip, action.attachment.gateway, action.attachment.private_cidr)
        elif action.process is not None:
            host = self._host_binding(action.uid, action.process.uid, entry)
            if isinstance(host, Result):
                return host
            binding = host
        req = SetBindingRequest(action.uid, action.fence, action.spec_generation, binding, policy)
        claim = binding or (entry.binding if entry else None)
        conflict = self.registry.check_claims(action.uid, claim) or self._in_flight_conflict(
            action.uid, claim
        )
        if conflict is not None:
            return Result(409, conflict)
        # Reserved before the first await: a concurrent SET_BINDING of another uid for the
        # same ip or nft id sees the claim and gets 409 instead of sharing kernel objects.
        with self._reserve(action.uid, claim):
            plan = plan_set_binding(entry, req)
            uncovered = self._uncovers_vault(action.uid, plan, parsed)
            if uncovered is not None:
                return Result(400, f"policy change uncovers a credential binding: {uncovered}")
            if plan.rebind or policy is None:
                # A new fence never inherits credentials; null removes policy and vault.
                self._drop_vault_state(action.uid, pushes=policy is None)
            if plan.rebind or (policy is None and entry is not None):
                for listener in self.listeners:
                    await (listener.reset(action.uid) if plan.rebind else listener.unbound(action.uid))

            async def finish() -> None:
                # What a committed SET_BINDING does after its kernel steps; also run by
                # egressd's own retry of a refused narrowing (14.6), so the input's vault
                # action and the pending-push replay are never lost with the 500.
                await self._after_set_binding(action.uid, parsed, policy)

            result = await self._execute(entry, plan, failure_prefix="deny-first install", after=finish)
        if result.status == 200:
            await finish()
        elif parsed is not None and parsed.vault is VaultAction.REMOVE and action.uid in self._revoking:
            # The input takes the vault away: that much needs no kernel, so it holds now.
            self.vaults.pop(action.uid, None)
            self._pending_vault.pop(action.uid, None)
        return result

    async def _after_set_binding(
        self, uid: str, parsed: BindingInput | None, policy: NetworkPolicy | None
    ) -> None:
        if parsed is not None:
            committed = self.registry.get(uid)
            if committed is not None and committed.state is State.ACTIVE:
                await self._apply_vault(uid, parsed)  # in place, after the policy
            elif committed is not None and parsed.vault is not VaultAction.KEEP:
                # Activates with the policy. A bare policy string leaves the vault alone,
                # including a sealed vault still waiting for data-plane-ready.
                self._pending_vault[uid] = parsed
        if policy is not None:
            committed = self.registry.get(uid)
            if committed is not None:
                for listener in self.listeners:
                    await listener.registered(committed)

    def _uncovers_vault(self, uid: str, plan: Plan, parsed: BindingInput | None) -> str | None:
        """A policy change that keeps the subject's vault must still cover every binding host,
        exactly as a ``/policy`` write through the proxy route must (14.1): why not, or None."""
        store = self.vaults.get(uid)
        if store is None or parsed is None or plan.rebind or parsed.vault is not VaultAction.KEEP:
            return None
        if plan.outcome is not Outcome.OK:
            return None
        try:
            store.check_policy(self.effective(parsed.policy))
        except VaultError as exc:
            return str(exc)
        return None

    def _in_flight_conflict(self, uid: str, binding: AnyBinding | None) -> str | None:
        other = self._claims_nft.get(nft_id(subject_for_uid(uid)))
        if other is not None and other != uid:
            return f"subject id collides with sandbox {other!r} being bound"
        if isinstance(binding, HostBinding):
            other = self._claims_host_uid.get(binding.host_uid)
            if other is not None and other != uid:
                return f"host uid {binding.host_uid} is being bound to another sandbox"
        elif binding is not None:
            other = self._claims_ip.get(binding.ip)
            if other is not None and other != uid:
                return f"ip {binding.ip} is being bound to another sandbox"
        return None

    @contextlib.contextmanager
    def _reserve(self, uid: str, binding: AnyBinding | None) -> Iterator[None]:
        nid = nft_id(subject_for_uid(uid))
        self._claims_nft[nid] = uid
        claims: list[tuple[dict[Any, str], object]] = []
        if isinstance(binding, HostBinding):
            claims = [(self._claims_host_uid, binding.host_uid), (self._claims_slot, binding.slot)]
        elif binding is not None:
            claims = [(self._claims_ip, binding.ip)]
        for book, key in claims:
            book[key] = uid
        try:
            yield
        finally:
            if self._claims_nft.get(nid) == uid:
                del self._claims_nft[nid]
            for book, key in claims:
                if book.get(key) == uid:
                    del book[key]

    def _host_binding(self, uid: str, host_uid: int, entry: Entry | None) -> HostBinding | Result:
        """A host-uid sandbox's binding: its uid, checked again here (the range and egressd's
        own uid are this daemon's, whoever parsed the envelope), and its slot: the one it
        already has (a retry, rebind or re-key keeps its ports), else the lowest free one."""
        problem = host_uid_problem(host_uid, self.table.uids.uid_range, self.table.own_uid)
        if problem is not None:
            return Result(400, f"invalid action envelope: attachment.process.uid is invalid: {problem}")
        if entry is not None and isinstance(entry.binding, HostBinding):
            return HostBinding(host_uid, entry.binding.slot)
        held = sorted(slot for _, slot in self.registry.kernel(uid).uid_keys)
        if held:
            return HostBinding(host_uid, held[0])  # a failed install's slot, still in the kernel
        used = self.registry.slots_in_use() | {s for s, u in self._claims_slot.items() if u != uid}
        slot = free_slot(used, self.table.uids.max_subjects)
        if slot is None:
            return Result(
                409, f"no free host-uid slot (EGRESSD_UID_MAX_SUBJECTS={self.table.uids.max_subjects})"
            )
        return HostBinding(host_uid, slot)

    async def hook(self, action: LifecycleHook) -> Result:
        async with self._locks.hold(action.uid):
            entry = self.registry.get(action.uid)
            if action.hook is HookName.RUNTIME_READY:
                plan = plan_hook_fence(entry, action.fence)
            else:
                view = self.registry.kernel(action.uid)
                plan = plan_data_plane_ready(entry, action.fence, kernel_objects=view.objects and view.rules)
            result = await self._execute(entry, plan, failure_prefix="policy apply")
            if result.status == 200 and plan.outcome is Outcome.OK:
                # The vault of the binding input activates at the same barrier as its policy.
                pending = self._pending_vault.pop(action.uid, None)
                if pending is not None:
                    await self._apply_vault(action.uid, pending)
            return result

    async def remove(self, action: RemoveBinding) -> Result:
        async with self._locks.hold(action.uid):
            entry = self.registry.get(action.uid)
            plan = plan_remove(entry, action.fence)

            async def forget() -> None:
                self._drop_vault_state(action.uid, pushes=True)
                for listener in self.listeners:
                    await listener.removed(action.uid)

            result = await self._execute(entry, plan, failure_prefix="removal", after=forget)
            if result.status == 200 and plan.removed:
                await forget()
            elif plan.removed and entry is not None:
                # The kernel refused: credentials go now, the retry finishes the rest (14.6).
                self._drop_vault_state(action.uid, pushes=True)
            return result

    # ---- credential vault ------------------------------------------------------------------

    def subject_lock(self, uid: str) -> contextlib.AbstractAsyncContextManager[None]:
        """The per-subject lock every mutation of that subject (vault included) runs under."""
        return self._locks.hold(uid)

    def vault_view_changed(self, uid: str, *also: Entry | None) -> None:
        """What ``vault_for_ip`` answers for ``uid``'s address may have changed: the MITM child
        drops its cached snapshot of it (and of ``also``'s addresses, e.g. the old binding)."""
        if self.forget_snapshots is None:
            return
        clients: set[IPAddress | str] = set()
        for e in (self.registry.get(uid), *also):
            if e is None or e.binding is None:
                continue
            if isinstance(e.binding, HostBinding):
                clients.add(port_key(self.table.uids.mitm_port(e.binding.slot)))
            else:
                clients.add(e.binding.ip)
        if clients:
            self.forget_snapshots(sorted(clients, key=str))

    def _drop_vault_state(self, uid: str, *, pushes: bool) -> None:
        self.vault_view_changed(uid)
        self.vaults.pop(uid, None)
        self._pending_vault.pop(uid, None)
        if pushes:
            self.pending_pushes.drop(uid)

    async def _apply_vault(self, uid: str, parsed: BindingInput) -> None:
        """Under the subject lock (callers hold it), right after the policy was committed."""
        if parsed.vault is VaultAction.KEEP:
            return
        self.vault_view_changed(uid)
        if parsed.vault is VaultAction.REMOVE or parsed.content is None:
            self.vaults.pop(uid, None)
            return
        coverage = self.coverage_policy(uid)
        store = self.vaults.get(uid)
        work = store.fork() if store is not None else VaultStore(limits=self.vault_limits)
        if coverage is not None and coverage == parsed.validated_against:
            # The usual case: validated (off the loop) against this very policy when the
            # input arrived, so the commit is O(n) and follows the policy in the same step.
            status, _ = work.put_content(parsed.content, coverage, prevalidated=True)
        else:
            # The always-rules changed since: validate again, off the loop (14.7). The old
            # vault goes first, so nothing validated for another policy is injected meanwhile.
            self.vaults.pop(uid, None)
            status, _ = await off_loop(work.put_content, parsed.content, coverage)
        if status < 400:
            self.vaults[uid] = work
        else:
            # Validated when the input arrived; only a changed always-rule can refuse it now.
            # Without the vault nothing is injected: closed, and said in the log.
            self.vaults.pop(uid, None)
            log.warning("vault.activation_refused", subject=f"s-{uid}", code=status)

    def coverage_policy(self, uid: str) -> NetworkPolicy | None:
        """What vault bindings must be covered by: the effective policy if active, else the
        pending one plus always-rules (BEHAVIOUR §6, PROPOSED); None refuses every binding."""
        entry = self.registry.get(uid)
        if entry is None:
            return None
        if entry.state is State.ACTIVE:
            return self.effective_for(entry)
        if entry.pending is not None:
            return self.effective(entry.pending)
        return None

    def vault_for_ip(self, source_ip: IPAddress) -> VaultSnapshot | None:
        """MITM lookup: the active subject's vault snapshot (``.tag`` changes on every mutation)."""
        entry = self.registry.resolve(source_ip)
        return None if entry is None else self.vault_for_ip_entry(entry)

    def destination_verified(self, source_ip: IPAddress, host: str, dst: IPAddress) -> bool:
        """May the MITM send ``host``'s credentials to ``dst`` for this sandbox?

        Only if the active subject's DNS proxy answered ``host`` with ``dst`` (lease still
        running), or an explicit IP/CIDR allow rule (not ``defaultAction: allow``) covers ``dst``
        and no deny rule does. A sandbox that forges Host/SNI towards an address of its choice
        therefore never receives a credential.
        """
        entry = self.registry.resolve(source_ip)
        return entry is not None and self._destination_verified(entry, host, dst)

    def _destination_verified(self, entry: Entry, host: str, dst: IPAddress) -> bool:
        if entry.state is not State.ACTIVE or self._closing(entry.uid):
            return False
        dst = unmap_ip(dst)
        book = self.leases.get(entry.uid)
        if book is not None and book.verified(dst, normalise_name(host.strip()), time.monotonic()):
            return True
        effective = self.effective_for(entry)
        return effective is not None and self._ip_sets_of(entry.uid, effective).explicitly_allows(dst)

    def _entry_of_mitm_port(self, port: int) -> Entry | None:
        slot = self.table.uids.slot_of_mitm_port(port)
        return None if slot is None else self.registry.resolve_slot(slot)

    def vault_for_mitm_port(self, port: int) -> VaultSnapshot | None:
        """MITM lookup of a host-uid subject (BEHAVIOUR 17): the listener port names it."""
        entry = self._entry_of_mitm_port(port)
        return None if entry is None else self.vault_for_ip_entry(entry)

    def destination_verified_port(self, port: int, host: str, dst: IPAddress) -> bool:
        entry = self._entry_of_mitm_port(port)
        return entry is not None and self._destination_verified(entry, host, dst)

    def vault_for_ip_entry(self, entry: Entry) -> VaultSnapshot | None:
        """The vault snapshot of an active subject that is not being closed, else None."""
        if entry.state is not State.ACTIVE or self._closing(entry.uid):
            return None
        store = self.vaults.get(entry.uid)
        return store.snapshot() if store is not None else None

    def _ip_sets_of(self, uid: str, effective: NetworkPolicy) -> IpSets:
        """``ip_sets(effective)``, kept while the effective policy object is unchanged (the MITM
        asks for every request that is not towards a DNS-learned address)."""
        cached = self._ip_sets.get(uid)
        if cached is not None and cached[0] is effective:
            return cached[1]
        sets = ip_sets(effective)
        self._ip_sets[uid] = (effective, sets)
        return sets

    def _forget_learned(self, uid: str) -> None:
        self.leases.pop(uid, None)

    async def apply_user_policy_locked(self, entry: Entry, policy: NetworkPolicy) -> Result:
        """In-place policy change of an active subject (proxy-route /policy); lock held by caller."""
        plan = Plan(
            Outcome.OK,
            steps=(ApplyPolicy(policy),),
            on_success=replace(entry, policy=policy),
            on_failure=entry,
        )
        return await self._execute(entry, plan, failure_prefix="policy apply")

    # ---- plan execution --------------------------------------------------------------------

    async def _execute(
        self,
        entry: Entry | None,
        plan: Plan,
        *,
        failure_prefix: str,
        after: Callable[[], Coroutine[Any, Any, None]] | None = None,
    ) -> Result:
        if plan.outcome is Outcome.CONFLICT:
            return Result(409, plan.reason)
        if plan.outcome is Outcome.NOOP:
            return OK
        target = plan.on_success if plan.on_success is not None else plan.on_failure
        assert target is not None
        uid = target.uid
        closes = any(isinstance(step, InstallDenyFirst | RemoveAll) for step in plan.steps)
        if self._closing(uid) and not closes and not self.registry.kernel(uid).unsure:
            # A revert, rebind or removal the kernel refused is still pending: nothing may
            # build on the state it is taking away (a tenant's /policy write, an in-place
            # SET_BINDING, an activation). Retryable, like any kernel failure (14.6). (After
            # an unanswered transaction the next one starts with a re-sync, so it may run.)
            return Result(500, f"revocation pending for {subject_for_uid(uid)}; retry later")
        narrowing = self._narrows(plan)
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
            reason = f"{_STEP_PREFIX.get(type(exc.step), failure_prefix)}: {exc.reason}"
            if narrowing:
                self._mark_revoking(uid, plan, reason, after)
            elif exc.uncertain and isinstance(exc.step, ApplyPolicy | AddKeys):
                # A widening step (an activation) that may have applied: the kernel may now be
                # more open than the registry's committed state. Late is fine, early-open
                # never: re-sync the kernel down to what the registry claims, as a revocation
                # (closing, 503, retried); the caller's retry then widens properly.
                resync = _resync_plan(plan.on_failure)
                if resync is not None:
                    self._mark_revoking(uid, resync, f"{reason} (outcome unknown: re-syncing)", None)
            return Result(500, reason)
        self._commit(entry, plan.on_success, uid)
        self._clear_revoking(uid)
        return OK

    # ---- revocations the kernel refused (BEHAVIOUR 14.6) -----------------------------------

    def _narrows(self, plan: Plan) -> bool:
        """Does ``plan`` take away something the kernel holds now? A revert, rebind or re-run
        over existing objects, a removal, or an in-place swap (its new policy may deny what
        the old allowed). A first deny-first install or an activation over deny-first
        content only opens later: their failure leaves the kernel closed."""
        target = plan.on_success if plan.on_success is not None else plan.on_failure
        if target is None:
            return False
        view = self.registry.kernel(target.uid)
        for step in plan.steps:
            if isinstance(step, RemoveAll | DropStaleKeys) and (view.objects or view.keys or view.uid_keys):
                return True
            if (
                isinstance(step, InstallDenyFirst)
                and view.objects
                and (view.applied is not None or view.keys or view.uid_keys)
            ):
                return True
            if isinstance(step, ApplyPolicy) and view.applied is not None:
                return True
        return False

    def _closing(self, uid: str) -> bool:
        rev = self._revoking.get(uid)
        return rev is not None and rev.closing

    def revoking(self) -> dict[str, str]:
        """uid -> why its revocation is still pending (for /healthz and egressctl)."""
        return {uid: rev.reason for uid, rev in self._revoking.items()}

    def _mark_revoking(
        self, uid: str, plan: Plan, reason: str, after: Callable[[], Coroutine[Any, Any, None]] | None
    ) -> None:
        rev = self._revoking.get(uid)
        attempts = rev.attempts if rev is not None else 0
        self._revoking[uid] = _Revocation(plan, self.registry.get(uid), reason, after, attempts)
        self.vault_view_changed(uid)  # a closing subject gets no vault (vault_for_ip)
        if uid not in self._revoke_tasks:
            log.warning("subject.revocation_pending", subject=subject_for_uid(uid), error=reason[:200])
            task = asyncio.get_running_loop().create_task(self._retry_revocation(uid))
            self._revoke_tasks[uid] = task
            task.add_done_callback(functools.partial(self._revoke_task_done, uid))
        self._count_revocations()

    def _revoke_task_done(self, uid: str, _task: asyncio.Task[None]) -> None:
        self._revoke_tasks.pop(uid, None)

    async def close(self) -> None:
        """Stop the revocation retries (shutdown keeps the table, still denying)."""
        for task in list(self._revoke_tasks.values()):
            task.cancel()
        for task in list(self._revoke_tasks.values()):
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _clear_revoking(self, uid: str) -> None:
        if self._revoking.pop(uid, None) is not None:
            log.info("subject.revocation_done", subject=subject_for_uid(uid))
            self._count_revocations()

    def _count_revocations(self) -> None:
        if self.metrics:
            self.metrics.revocations_pending.set(float(len(self._revoking)))

    async def _retry_revocation(self, uid: str) -> None:
        """Run the refused plan again, with backoff, until the kernel agrees. A newer action
        of the subject that succeeded clears the revocation (it ran its own narrowing)."""
        lo, hi = self.revoke_retry
        delay = lo
        while uid in self._revoking:
            await asyncio.sleep(delay)
            delay = min(hi, delay * 2)
            async with self._locks.hold(uid):
                rev = self._revoking.get(uid)
                if rev is None:
                    return
                current = self.registry.get(uid)
                if current is not rev.expected:
                    # Only a committed plan changes the entry, and a successful one clears
                    # the revocation; keep retrying on what the registry holds now.
                    rev.expected = current
                rev.attempts += 1
                result = await self._execute(current, rev.plan, failure_prefix="revocation", after=rev.after)
                if result.status == 200 and rev.after is not None:
                    await rev.after()

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
            self.vault_view_changed(uid, old)
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
            if self.metrics:
                self.metrics.transitions.inc(old_state.value, new_state.value)

    async def _step(self, entry: Entry, step: Step) -> None:
        uid = entry.uid

        def save(view: KernelView) -> None:
            # Recorded after every transaction, so a step failing half-way leaves an exact view.
            self.registry.set_kernel(uid, view)

        async with self._kernel_lock:
            try:
                cut = await self._run_step(entry, step, self.registry.kernel(uid), save)
            except (NftError, _Refused) as exc:
                raise StepFailed(step, str(exc), uncertain=isinstance(exc, NftUncertain)) from None
        # Outside the kernel lock: cutting flows is slow (a subprocess) and only narrows access.
        if isinstance(step, RemoveAll):
            # The sandbox is going away and the kernel already refuses its new flows: its old
            # flows are cut in the background instead of delaying the answer. A revert or a
            # rebind waits, so its 200 means "no old flow survives".
            self._background_task(self._flush_conntrack(cut))
        else:
            await self._flush_conntrack(cut)

    async def _run_step(
        self, entry: Entry, step: Step, view: KernelView, save: Callable[[KernelView], None]
    ) -> list[IPAddress]:
        """Run one step's transactions in order; return the sources whose flows to cut."""
        nid = entry.nft_id
        table = self.table.table
        prelude = NetlinkBatch(table)
        doubt = view  # what the kernel may hold if this step's transaction goes unanswered
        if view.unsure:
            # The last transaction's answer never came: first make the kernel hold exactly
            # ``view`` (whichever way that transaction went), in this step's transaction.
            prelude = self._resync_batch(entry.uid, nid, view)
            view = replace(view, rules=view.objects, unsure=False)

        async def send(batch: NetlinkBatch, op: str, after: KernelView) -> None:
            batch = prelude + batch
            if batch:
                try:
                    await self.tx.run_batch(batch, op=op)
                except NftUncertain:
                    save(_in_doubt(doubt, after))
                    raise
                except NftError:
                    raise  # refused: nothing of it applied, ``view`` still holds
                except Exception as exc:
                    # A timeout (or anything else) out of the kernel shell: the batch may
                    # have been committed all the same.
                    save(_in_doubt(doubt, after))
                    raise NftUncertain(f"kernel transaction failed: {exc!r}"[:300]) from exc
                except BaseException:
                    save(_in_doubt(doubt, after))  # cancelled: the kernel thread may still commit it
                    raise
            save(after)

        if isinstance(step, InstallDenyFirst) and isinstance(step.binding, HostBinding):
            return await self._uid_deny_first(entry, step.binding, view, send)
        if isinstance(step, AddKeys) and isinstance(step.binding, HostBinding):
            return await self._uid_add_keys(entry, step.binding, view, send)
        if isinstance(step, InstallDenyFirst):
            assert isinstance(step.binding, Binding)
            subj = self._subject_nft(nid, step.binding)
            try:
                create = subject_create(self.table, subj)
            except ValueError as exc:
                raise _Refused(str(exc)) from None
            if not view.objects:
                # A new subject: sets, chains, fixed rules and keys in one transaction.
                create, commit = self._nets_in(create, entry.uid, step.binding.private_cidr)
                await send(
                    create, "deny_first", KernelView(True, frozenset({(subj.ip, subj.gateway)}), rules=True)
                )
                commit()
                # Nothing this subject allows is established yet, yet the header accepts
                # established flows: after a kill -9 and restart (the Fastlet's replay lands
                # here) or an address reused from a sandbox that left while egressd was down,
                # flows a previous process allowed would run on unjudged. Cut them; picked up
                # again they meet this subject's rules (found with scripts/storm.py).
                return [subj.ip]
            # Revert, rebind or retry: empty every set before any (new) key points at the
            # chains, all in one transaction.
            batch = flush_subject_sets(table, nid)
            if not view.rules:
                batch = batch + subject_rules(self.table, nid)
            batch, commit = self._nets_in(
                batch + subject_keys(self.table, subj), entry.uid, step.binding.private_cidr
            )
            await send(
                batch,
                "deny_first",
                replace(view, rules=True, applied=None, keys=view.keys | {(subj.ip, subj.gateway)}),
            )
            commit()
            self._forget_learned(entry.uid)
            return _ips(view.keys | {(subj.ip, subj.gateway)})
        if isinstance(step, ApplyPolicy):
            if not (view.objects and view.rules):
                raise _Refused("subject has no deny-first state in the kernel")
            effective = self.effective(step.policy)
            event = {"egress.default": effective.default_action.value, "rules": len(effective.egress)}
            batch = policy_swap(table, nid, effective)
            narrowed = self._narrowed(entry.uid, effective)
            if view.applied is not None:
                # In place: leases no still-allowed name taught leave in the same transaction
                # (14.1); the flush runs even when the book knows of none, so an element a
                # failed-looking learn left in the kernel does not outlive the change.
                batch = batch + dyn_replace(table, nid, narrowed.kept if narrowed is not None else ())
            for host_uid, _slot in sorted(view.uid_keys):
                # A host-uid subject's audit mode lets its established flows pass (see builder).
                batch = batch + NetlinkBatch(table, tuple(uid_audit_ops(host_uid, audit=effective.audit)))
            if isinstance(entry.binding, HostBinding):
                cidr = None
            else:
                cidr = entry.binding.private_cidr if entry.binding is not None else self._nets.get(entry.uid)
            batch, commit = self._nets_in(batch, entry.uid, cidr)
            try:
                await send(batch, "static_apply", replace(view, applied=step.policy))
            except NftError as exc:
                log.warning(
                    "egress.update_failed",
                    **{"opensandbox.event": "egress.update_failed", **event},
                    subject=entry.subject,
                    error=str(exc)[:200],
                )
                raise
            commit()
            if narrowed is not None:
                self.leases[entry.uid] = narrowed.book
            log.info(
                "egress.updated", **{"opensandbox.event": "egress.updated", **event}, subject=entry.subject
            )
            if view.applied is not None and self._conntrack_flush is not None and view.keys:
                # An in-place change: flows to destinations it no longer allows are cut,
                # allowed ones keep running. (A host-uid subject's packets are all judged
                # on output: nothing of it is established past its rules.)
                self._background_task(self._cut_disallowed(entry.uid, view.keys, effective))
            return []
        if isinstance(step, AddKeys):
            assert isinstance(step.binding, Binding)
            subj = self._subject_nft(nid, step.binding)
            keys, commit = self._nets_in(subject_keys(self.table, subj), entry.uid, step.binding.private_cidr)
            await send(keys, "dispatch_update", replace(view, keys=view.keys | {(subj.ip, subj.gateway)}))
            commit()
            # A new address's established flows were never judged by this subject (see above).
            return [] if subj.ip in _ips(view.keys) else [subj.ip]
        if isinstance(step, DropStaleKeys):
            keep = step.keep
            keep_net = keep if isinstance(keep, Binding) else None
            kept: frozenset[tuple[IPAddress, IPAddress]] = frozenset(
                {(keep_net.ip, keep_net.gateway)}
                if keep_net is not None and keep_net.gateway is not None
                else set()
            )
            kept_uid = frozenset({(keep.host_uid, keep.slot)} if isinstance(keep, HostBinding) else set())
            stale = view.keys - kept
            stale_uid = view.uid_keys - kept_uid
            ops = self._key_deletes(entry.uid, stale, keep_net)
            for host_uid, slot in sorted(stale_uid):
                ops += uid_key_deletes(self.table, host_uid, slot)
            await send(
                NetlinkBatch(table, tuple(ops)),
                "dispatch_update",
                replace(view, keys=view.keys & kept, uid_keys=view.uid_keys & kept_uid),
            )
            # The slot of the binding the subject ends with stays open (a re-key to another uid
            # drops every key first, then adds the new one on the same slot).
            ending = {entry.binding.slot} if isinstance(entry.binding, HostBinding) else set()
            await self._close_uid_ports(
                entry.uid, {s for _, s in stale_uid} - {s for _, s in kept_uid} - ending
            )
            return [ip for ip in _ips(stale) if ip not in _ips(kept)]
        assert isinstance(step, RemoveAll)
        slots = {s for _, s in view.uid_keys}
        if isinstance(entry.binding, HostBinding):
            slots.add(entry.binding.slot)
        if not view.objects and not view.keys and not view.uid_keys:
            save(KernelView())
            await self._close_uid_ports(entry.uid, slots)
            return []
        ops = self._key_deletes(entry.uid, view.keys, None)
        for host_uid, slot in sorted(view.uid_keys):
            ops += uid_key_deletes(self.table, host_uid, slot)
        if view.objects:
            ops += removal_batch(self.table, nid, None, release_gateway=None).ops
        removal, commit = self._nets_in(NetlinkBatch(table, tuple(ops)), entry.uid, None)
        await send(removal, "remove", KernelView())
        commit()
        await self._close_uid_ports(entry.uid, slots)
        self._forget_learned(entry.uid)
        self._effective.pop(entry.uid, None)
        self._ip_sets.pop(entry.uid, None)
        return _ips(view.keys)

    # ---- host-uid subjects (BEHAVIOUR 17) ------------------------------------------------

    async def _uid_deny_first(
        self,
        entry: Entry,
        host: HostBinding,
        view: KernelView,
        send: Callable[..., Coroutine[Any, Any, None]],
    ) -> list[IPAddress]:
        """Deny-first for a host-uid subject: its DNS port listens before any redirect points
        at it, then the same objects, rules and empty sets as a network subject's, keyed by
        its uid, in one transaction. Nothing to cut: its packets are all judged on output."""
        nid, table = entry.nft_id, self.table.table
        subj = UidSubjectNft(nid, host.host_uid, host.slot)
        await self._open_uid_port(host.slot)
        key = (host.host_uid, host.slot)
        if not view.objects:
            create, commit = self._nets_in(uid_subject_create(self.table, subj), entry.uid, None)
            await send(create, "deny_first", KernelView(True, rules=True, uid_keys=frozenset({key})))
            commit()
            return []
        batch = flush_subject_sets(table, nid)
        if not view.rules:
            batch = batch + subject_rules(self.table, nid)
        batch = batch + uid_subject_keys(self.table, subj)
        for host_uid, _slot in sorted(view.uid_keys | {key}):
            batch = batch + NetlinkBatch(table, tuple(uid_audit_ops(host_uid, audit=False)))
        batch, commit = self._nets_in(batch, entry.uid, None)
        await send(
            batch, "deny_first", replace(view, rules=True, applied=None, uid_keys=view.uid_keys | {key})
        )
        commit()
        self._forget_learned(entry.uid)
        return _ips(view.keys)  # a network binding this one replaces: its flows are cut

    async def _uid_add_keys(
        self,
        entry: Entry,
        host: HostBinding,
        view: KernelView,
        send: Callable[..., Coroutine[Any, Any, None]],
    ) -> list[IPAddress]:
        """Re-key of an active subject to a host uid: its chains keep their content."""
        table = self.table.table
        await self._open_uid_port(host.slot)
        audit = view.applied is not None and self.effective(view.applied).audit
        batch = uid_subject_keys(self.table, UidSubjectNft(entry.nft_id, host.host_uid, host.slot))
        batch = batch + NetlinkBatch(table, tuple(uid_audit_ops(host.host_uid, audit=audit)))
        batch, commit = self._nets_in(batch, entry.uid, None)
        key = (host.host_uid, host.slot)
        await send(batch, "dispatch_update", replace(view, uid_keys=view.uid_keys | {key}))
        commit()
        return []

    async def _open_uid_port(self, slot: int) -> None:
        if self.uid_ports is None:
            return
        try:
            await self.uid_ports.open(slot)
        except OSError as exc:
            port = self.table.uids.dns_port(slot)
            raise _Refused(f"host-uid DNS port {port}: {exc.strerror or exc}") from None

    async def _close_uid_ports(self, uid: str, slots: set[int]) -> None:
        """Stop listening on ``uid``'s former ports, unless another subject holds one now."""
        if self.uid_ports is None:
            return
        others = self.registry.slots_in_use(excluding=uid) | {
            s for s, u in self._claims_slot.items() if u != uid
        }
        for slot in sorted(slots - others):
            await self.uid_ports.close(slot)

    def _resync_batch(self, uid: str, nid: str, view: KernelView) -> NetlinkBatch:
        """Everything ``view`` says the subject has, made so in one batch that succeeds on
        either state an unanswered transaction left (see :class:`KernelView`): objects, fixed
        rules exactly once, the set contents of ``view.applied`` (deny-first when None) with
        the leases the book holds, and every key."""
        table = self.table.table
        if not view.objects:
            return NetlinkBatch(table)  # neither state has objects (nor keys, which jump to them)
        if view.applied is None:
            contents = flush_subject_sets(table, nid)
        else:
            effective = self.effective(view.applied)
            narrowed = self._narrowed(uid, effective)
            contents = policy_swap(table, nid, effective) + dyn_replace(
                table, nid, narrowed.kept if narrowed is not None else ()
            )
        keys = [SubjectNft(nid, ip, gw) for ip, gw in sorted(view.keys, key=str)]
        out = subject_resync(self.table, nid, keys, contents)
        audit = view.applied is not None and self.effective(view.applied).audit
        for host_uid, slot in sorted(view.uid_keys):
            out = out + uid_subject_keys(self.table, UidSubjectNft(nid, host_uid, slot))
            out = out + NetlinkBatch(table, tuple(uid_audit_ops(host_uid, audit=audit)))
        return out

    def _nets_in(
        self, batch: NetlinkBatch, uid: str, cidr: ipaddress.IPv4Network | ipaddress.IPv6Network | None
    ) -> tuple[NetlinkBatch, Callable[[], None]]:
        """``batch`` plus, when ``uid``'s privateCidr changes, the refill of the kernel's
        union of every subject's CIDR (same transaction); and the commit to call after it."""
        if self._nets.get(uid) == cidr:
            return batch, lambda: None
        desired = {u: n for u, n in self._nets.items() if u != uid}
        if cidr is not None:
            desired[uid] = cidr
        refill = NetlinkBatch(batch.table, tuple(sandbox_nets_refresh(desired.values())))

        def commit() -> None:
            self._nets = desired

        return batch + refill, commit

    def _background_task(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _cut_disallowed(
        self, uid: str, keys: frozenset[tuple[IPAddress, IPAddress]], effective: NetworkPolicy
    ) -> None:
        flows = await read_conntrack_flows(_ips(keys))
        if flows is None:
            return
        now = time.monotonic()
        book = self.leases.get(uid)
        leases = book.live(now) if book is not None else {}
        gateways = {gw for _, gw in keys}
        sets = ip_sets(effective)
        split = audit_deny_sets(effective) if effective.audit else None
        for src in _ips(keys):
            for dst in sorted(flows.get(src, ()), key=str):
                if dst in gateways or ip_decision(effective, leases, dst, now, sets)[0] is not Verdict.DENY:
                    continue
                if split is not None and not hard_denied(effective, dst, split):
                    continue  # audit mode: a would-deny flow passes, so it is not cut either
                try:
                    await flush_flow(src, dst)
                except Exception as exc:
                    log.warning("conntrack.cut_failed", source_ip=str(src), error=str(exc)[:200])

    def _key_deletes(
        self, uid: str, stale: frozenset[tuple[IPAddress, IPAddress]], keep: Binding | None
    ) -> list[Op]:
        """Deletions for stale dispatch keys: each map element and gateway exactly once."""
        ops: list[Op] = []
        keep_ip = keep.ip if keep is not None else None
        for ip in _ips(stale):
            if ip != keep_ip:
                ops += dispatch_deletes(self.table, ip, release_gateway=None)
        for gw in sorted({k[1] for k in stale}, key=str):
            if self._gateway_releasable(uid=uid, gw=gw, keep=keep):
                ops.append(gateway_release(gw))
        return ops

    def _gateway_releasable(self, *, uid: str, gw: IPAddress, keep: Binding | None) -> bool:
        if keep is not None and keep.gateway == gw:
            return False
        return not self.registry.gateway_in_use(gw, excluding=uid)

    def _subject_nft(self, nid: str, binding: Binding) -> SubjectNft:
        if binding.gateway is None:
            raise _Refused("attachment.network.gateway is required for the DNS redirect")
        return SubjectNft(nid, binding.ip, binding.gateway)

    async def _flush_conntrack(self, ips: list[IPAddress]) -> None:
        """Cut established flows of sources whose access just narrowed (best effort)."""
        if self._conntrack_flush is None:
            return
        for ip in ips:
            try:
                await self._conntrack_flush(ip)
            except Exception as exc:  # the kernel already refuses new flows; log and go on
                log.warning("conntrack.flush_failed", source_ip=str(ip), error=str(exc)[:200])

    # ---- read side -------------------------------------------------------------------------

    def _entry_of(self, source: IPAddress | int) -> Entry | None:
        """The subject behind a source address, or behind a host uid (an ``int``, BEHAVIOUR 17)."""
        if isinstance(source, int):
            return self.registry.resolve_host_uid(source)
        return self.registry.resolve(unmap_ip(source))

    def explain(self, source_ip: IPAddress | int, target: str) -> dict[str, Any]:
        """``source_ip`` is a sandbox address, or an ``int``: a host uid."""
        entry = self._entry_of(source_ip)
        now = time.monotonic()
        book = self.leases.get(entry.uid) if entry else None
        out = explain_target(
            state=entry.state.value if entry else None,
            effective=self.effective_for(entry) if entry else None,
            leases=book.live(now) if book is not None else {},
            target=target,
            now=now,
        )
        if isinstance(source_ip, int):
            out["hostUid"] = source_ip
        else:
            out["sourceIp"] = str(source_ip)
        if entry is not None:
            out["subject"] = entry.subject
        return out

    async def kernel_membership(self, source_ip: IPAddress | int, target: IPAddress) -> dict[str, Any]:
        """What the kernel itself holds for ``target`` in the source's subject (explain):
        whether the source (an address, or a host uid) is in the dispatch map, and which of
        the subject's sets cover the address (with the remaining lifetime of a DNS lease). Read
        from the kernel by one netlink dump per set, never from egressd's own bookkeeping."""
        target = unmap_ip(target)
        dump = getattr(self.tx, "list_set_elements", None)
        entry = self._entry_of(source_ip)
        if dump is None:
            return {"available": False}
        fam = "v4" if target.version == 4 else "v6"
        table = self.table.table
        try:
            if isinstance(source_ip, int):
                key = struct.pack("=I", source_ip)  # meta skuid's host-endian u32
                dispatched = any(e.key == key for e in await dump(table, UID_DISPATCH))
            else:
                source_ip = unmap_ip(source_ip)
                src_map = dispatch_map("v4" if source_ip.version == 4 else "v6")
                dispatched = (
                    element_covering(source_ip, await dump(table, src_map), interval=False) is not None
                )
            out: dict[str, Any] = {"available": True, "dispatched": dispatched, "sets": []}
            if entry is None or not self.registry.kernel(entry.uid).objects:
                return out
            for kind, interval in (("deny", True), ("allow", True), ("dyn", False)):
                name = f"subj_{entry.nft_id}_{kind}_{fam}"
                hit = element_covering(target, await dump(table, name), interval=interval)
                if hit is None:
                    continue
                element, end = hit
                item: dict[str, Any] = {
                    "set": name,
                    "element": _element_text(element.key, end, interval=interval),
                }
                if element.expires_ms is not None:
                    item["expiresInS"] = round(element.expires_ms / 1000)
                out["sets"].append(item)
        except NftError as exc:
            return {"available": False, "error": str(exc)[:200]}
        return out

    def rules_count(self) -> dict[tuple[str, ...], float]:
        """Rules in the table: the header's plus each installed subject's fixed rules."""
        per_subject = 10 + (9 if self.table.mitm else 0)  # incl. the 4 audit rules (+2 MITM)
        installed = sum(1 for e in self.registry if self.registry.kernel(e.uid).rules)
        return {(): float(per_subject * installed)}

    def state_counts(self) -> dict[tuple[str, ...], float]:
        counts = self.registry.counts()
        return {(s.value,): float(n) for s, n in counts.items()}

    def describe(self) -> list[dict[str, Any]]:
        out = []
        now = time.monotonic()
        for e in sorted(self.registry, key=lambda e: e.uid):
            pol = e.policy if e.state is State.ACTIVE else None
            out.append(
                {
                    "subject": e.subject,
                    "uid": e.uid,
                    "state": e.state.value,
                    # The kernel refused a narrowing and egressd is retrying it (14.6).
                    "revoking": e.uid in self._revoking,
                    **_binding_fields(e.binding, self.table),
                    "specGeneration": e.spec_generation,
                    "pending": e.pending is not None,
                    "kernelInstalled": self.registry.kernel(e.uid).objects,
                    "policy": _policy_summary(pol),
                    # Audit (shadow) mode of the ACTIVE policy only: deny-first never audits.
                    "auditMode": bool(pol is not None and pol.audit),
                    "vaultRevision": self.vaults[e.uid].revision if e.uid in self.vaults else None,
                    "leases": len(self.leases[e.uid].live(now)) if e.uid in self.leases else 0,
                }
            )
        return out


def _binding_fields(binding: AnyBinding | None, table: TableConfig) -> dict[str, Any]:
    """The dispatch key of ``egressctl subjects``: an address and gateway, or a host uid and
    its two ports (BEHAVIOUR 17)."""
    if isinstance(binding, HostBinding):
        return {
            "sourceIp": None,
            "gateway": None,
            "hostUid": binding.host_uid,
            "dnsPort": table.uids.dns_port(binding.slot),
            "mitmPort": table.uids.mitm_port(binding.slot) if table.mitm else None,
        }
    return {
        "sourceIp": str(binding.ip) if binding else None,
        "gateway": str(binding.gateway) if binding and binding.gateway else None,
    }


def _narrower(old: AlwaysRules, new: AlwaysRules) -> AlwaysRules:
    """Every always-deny of either, and only the always-allows both have."""
    deny = new.deny + tuple(r for r in old.deny if r not in new.deny)
    return AlwaysRules(deny=deny, allow=tuple(r for r in new.allow if r in old.allow))


def _element_text(start: bytes, end: bytes | None, *, interval: bool) -> str:
    """A set element as nft would print it: an address, or an interval [start, end) as CIDR(s)
    (``end`` None in an interval set: up to the top of the address space)."""
    first = ipaddress.ip_address(start)
    if not interval:
        return str(first)
    top = (1 << (8 * len(start))) - 1
    last = ipaddress.ip_address(int.from_bytes(end, "big") - 1 if end is not None else top)
    nets = ipaddress.summarize_address_range(first, last)
    return ", ".join(str(n.network_address) if n.num_addresses == 1 else str(n) for n in nets)


def _policy_summary(policy: NetworkPolicy | None) -> dict[str, Any] | None:
    if policy is None:
        return None
    return {"defaultAction": policy.default_action.value, "rules": len(policy.egress)}


def _dispatch_key_problem(ip: IPAddress, gateway: IPAddress | None) -> str | None:
    """A source IP that cannot identify one sandbox would dispatch someone else's traffic."""
    if ip.is_unspecified or ip.is_loopback or ip.is_multicast or ip.is_link_local:
        return f"attachment.network.ip {ip} cannot identify a sandbox"
    if gateway is not None and gateway == ip:
        return "attachment.network.gateway equals the sandbox ip"
    return None


def _resync_plan(entry: Entry | None) -> Plan | None:
    """A plan that brings the kernel back to ``entry`` (committed) without changing it."""
    if entry is None or entry.binding is None:
        return None
    steps: tuple[Step, ...]
    if entry.state is State.ACTIVE and entry.policy is not None:
        steps = (ApplyPolicy(entry.policy),)
    else:
        steps = (InstallDenyFirst(entry.binding), DropStaleKeys(entry.binding))
    return Plan(Outcome.OK, steps=steps, on_success=entry, on_failure=entry)


# The 500 reason names the step that failed, not just the action.
_STEP_PREFIX: dict[type, str] = {
    InstallDenyFirst: "deny-first install",
    ApplyPolicy: "policy apply",
    AddKeys: "dispatch update",
    DropStaleKeys: "dispatch update",
    RemoveAll: "removal",
}


def _in_doubt(before: KernelView, after: KernelView) -> KernelView:
    """What the kernel may hold when a transaction from ``before`` to ``after`` went
    unanswered: anything either state has (so a deletion finds it), rules only if both
    have them. The set contents to re-sync to are the registry's claim (``before``), except
    after a closing step (deny-first, removal): then deny-first, so nothing that re-applies
    the recorded policy (an always-rules reload) reopens what may already be closed."""
    return KernelView(
        objects=before.objects or after.objects,
        keys=before.keys | after.keys,
        rules=before.rules and after.rules,
        applied=None if after.applied is None else before.applied,
        unsure=True,
        uid_keys=before.uid_keys | after.uid_keys,
    )


def _ips(keys: frozenset[tuple[IPAddress, IPAddress]]) -> list[IPAddress]:
    return sorted({k[0] for k in keys}, key=str)


class _Refused(Exception):
    pass
