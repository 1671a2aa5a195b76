"""The kernel side of one plan step: its netlink transactions, in order, and the kernel view.

One function per step kind (subject/registry.py defines them). Each sends its transaction
through :class:`_Transaction`, which records in the registry what the kernel holds after it,
or what it may hold when the answer never came, so a step failing half-way leaves an exact
view for the next one. Callers of :meth:`StepRunner.run` hold the kernel lock.
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

import structlog

from egressd.actionhandler import hostuid
from egressd.actionhandler.flows import FlowCuts
from egressd.actionhandler.learning import DnsLearning
from egressd.actionhandler.policies import EffectivePolicies
from egressd.actionhandler.shared import Shared
from egressd.addr import IPAddress
from egressd.feed import PolicyApplied
from egressd.fleetnft.contents import (
    Contents,
    contents_swap,
    dyn_replace,
    policy_swap,
    refuses_more,
    sandbox_nets_refresh,
    static_contents,
)
from egressd.fleetnft.header import SANDBOX_IFACES_SET, header_script
from egressd.fleetnft.ifaces import usable_host_veth
from egressd.fleetnft.subject import (
    audit_objects,
    dispatch_deletes,
    flush_subject_sets,
    gateway_release,
    removal_batch,
    subject_create,
    subject_keys,
    subject_resync,
    subject_rules,
)
from egressd.fleetnft.table import SubjectNft
from egressd.kernel.applier import NftError, NftUncertain, Transactions
from egressd.kernel.ops import AddIface, DeleteIface, NetlinkBatch, Op
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
    Step,
)

log = structlog.get_logger("egressd.fleet")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Keys = frozenset[tuple[IPAddress, IPAddress]]

# The 500 reason names the step that failed, not just the action.
STEP_PREFIX: dict[type, str] = {
    InstallDenyFirst: "deny-first install",
    ApplyPolicy: "policy apply",
    AddKeys: "dispatch update",
    DropStaleKeys: "dispatch update",
    RemoveAll: "removal",
}


class Refused(Exception):
    """A step egressd will not send: the kernel could not take it as asked."""


class StepFailed(Exception):
    def __init__(self, step: Step, reason: str, *, uncertain: bool = False) -> None:
        super().__init__(reason)
        self.step = step
        self.reason = reason
        self.uncertain = uncertain  # the transaction may have applied (NftUncertain)


def in_doubt(before: KernelView, after: KernelView) -> KernelView:
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
        audit=before.audit or after.audit,
    )


def ips(keys: Keys) -> list[IPAddress]:
    return sorted({k[0] for k in keys}, key=str)


class SandboxNets:
    """What the kernel holds per subject to recognise sandboxes on the input hook: its
    privateCidr in the ``sandbox_nets`` union (14.2) and its hostVeth in ``sandbox_ifaces`` (20.2)."""

    def __init__(self) -> None:
        self.held: dict[str, Network] = {}
        self.ifaces: dict[str, str] = {}
        self._naming: Counter[str] = Counter()  # interface -> how many subjects name it

    def forget_all(self) -> None:
        """The table was reset: nothing of any subject is held any more."""
        self.held, self.ifaces, self._naming = {}, {}, Counter()

    def refilled(
        self, batch: NetlinkBatch, uid: str, cidr: Network | None, iface: str | None
    ) -> tuple[NetlinkBatch, Callable[[], None]]:
        """``batch`` plus, in the same transaction, the refill of the kernel's union of every
        subject's CIDR when ``uid``'s changes, and its interface's entry when that changes;
        and the commit to call after it."""
        iface = usable_host_veth(iface)
        if self.held.get(uid) == cidr and self.ifaces.get(uid) == iface:
            return batch, lambda: None
        ops = self._iface_ops(uid, iface)
        desired = self.held
        if self.held.get(uid) != cidr:
            desired = {u: n for u, n in self.held.items() if u != uid}
            if cidr is not None:
                desired[uid] = cidr
            ops += sandbox_nets_refresh(desired.values())

        def commit() -> None:
            self.held = desired
            old = self.ifaces.pop(uid, None)
            if old is not None:
                self._naming[old] -= 1
                if self._naming[old] <= 0:
                    del self._naming[old]
            if iface is not None:
                self.ifaces[uid] = iface
                self._naming[iface] += 1

        return batch + NetlinkBatch(batch.table, tuple(ops)), commit

    def _iface_ops(self, uid: str, iface: str | None) -> list[Op]:
        """The new name in (adding is idempotent); the old one out when no other subject names
        it (added first: a delete of a missing element would fail the whole transaction)."""
        old = self.ifaces.get(uid)
        if old == iface:
            return []
        ops: list[Op] = []
        if iface is not None:
            ops.append(AddIface(SANDBOX_IFACES_SET, iface))
        if old is not None and self._naming[old] <= 1:
            ops += [AddIface(SANDBOX_IFACES_SET, old), DeleteIface(SANDBOX_IFACES_SET, old)]
        return ops


@dataclass(slots=True)
class _Transaction:
    """Sends one step's batches; ``prelude`` (a re-sync after an unanswered transaction) goes
    into the first of them, ``doubt`` is what the kernel may hold if one goes unanswered."""

    tx: Transactions
    prelude: NetlinkBatch
    doubt: KernelView
    save: Callable[[KernelView], None]

    async def send(self, batch: NetlinkBatch, op: str, after: KernelView) -> None:
        batch = self.prelude + batch
        if batch:
            try:
                await self.tx.run_batch(batch, op=op)
            except NftUncertain:
                self.save(in_doubt(self.doubt, after))
                raise
            except NftError:
                raise  # refused: nothing of it applied, the view still holds
            except Exception as exc:
                # A timeout (or anything else) out of the kernel shell: the batch may
                # have been committed all the same.
                self.save(in_doubt(self.doubt, after))
                raise NftUncertain(f"kernel transaction failed: {exc!r}"[:300]) from exc
            except BaseException:
                self.save(in_doubt(self.doubt, after))  # cancelled: the kernel thread may still commit it
                raise
        self.save(after)


class StepRunner:
    def __init__(
        self,
        shared: Shared,
        policies: EffectivePolicies,
        learning: DnsLearning,
        flows: FlowCuts,
        nets: SandboxNets,
        ports: hostuid.PortBook,
    ) -> None:
        self._shared = shared
        self._cfg = shared.table
        self._policies = policies
        self._learning = learning
        self._flows = flows
        self.nets = nets
        self.ports = ports  # host-uid subjects' DNS listeners
        self.workers = shared.workers

    async def reset_table(self) -> None:
        """The table replaced by the deny-all header in one transaction (start-up): every
        sandbox is an unknown source again, so everything is dropped until the replay."""
        async with self._shared.kernel_lock:
            await self._shared.tx.reset_table(
                header_script(self._cfg, delete_existing=True),
                header_script(self._cfg, delete_existing=False),
            )
            self.nets.forget_all()

    async def run(self, entry: Entry, step: Step) -> list[IPAddress]:
        """Run one step's transactions in order; return the sources whose flows to cut."""
        registry = self._shared.registry
        view = registry.kernel(entry.uid)

        def save(after: KernelView) -> None:
            # Recorded after every transaction, so a step failing half-way leaves an exact view.
            registry.set_kernel(entry.uid, after)

        txn = _Transaction(self._shared.tx, NetlinkBatch(self._cfg.table), view, save)
        if view.unsure:
            # The last transaction's answer never came: first make the kernel hold exactly
            # ``view`` (whichever way that transaction went), in this step's transaction.
            txn.prelude = self.resync_batch(entry.uid, entry.nft_id, view)
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
                return await self._add_keys(entry, step, view, txn)
            case DropStaleKeys():
                return await self._drop_stale_keys(entry, step, view, txn)
            case RemoveAll():
                return await self._remove_all(entry, view, txn)

    async def _uid_deny_first(
        self, entry: Entry, host: HostBinding, view: KernelView, txn: _Transaction
    ) -> list[IPAddress]:
        """A host-uid subject's deny-first: its DNS port listens before any redirect points
        at it. Nothing to cut (its packets are all judged on output), except the flows of a
        network binding it replaces."""
        await self._open_port(host.slot)
        batch, after = hostuid.deny_first(self._cfg, entry, host, view)
        batch, commit = self.nets.refilled(batch, entry.uid, None, None)
        await txn.send(batch, "deny_first", after)
        commit()
        if view.objects:
            self._learning.forget(entry.uid)
        return ips(view.keys)

    async def _uid_add_keys(
        self, entry: Entry, host: HostBinding, view: KernelView, txn: _Transaction
    ) -> list[IPAddress]:
        await self._open_port(host.slot)
        audit = view.applied is not None and self._policies.effective(view.applied).audit
        batch, commit = self.nets.refilled(
            hostuid.add_keys(self._cfg, entry, host, audit), entry.uid, None, None
        )
        key = (host.host_uid, host.slot)
        await txn.send(batch, "dispatch_update", replace(view, uid_keys=view.uid_keys | {key}))
        commit()
        return []

    async def _open_port(self, slot: int) -> None:
        try:
            await self.ports.open(slot)
        except OSError as exc:
            port = self._cfg.uids.dns_port(slot)
            raise Refused(f"host-uid DNS port {port}: {exc.strerror or exc}") from None

    async def _deny_first(
        self, entry: Entry, step: InstallDenyFirst, view: KernelView, txn: _Transaction
    ) -> list[IPAddress]:
        nid, cfg = entry.nft_id, self._cfg
        assert isinstance(step.binding, Binding)
        subj = _subject_nft(nid, step.binding, self.workers.of(entry.uid))
        try:
            create = subject_create(cfg, subj)
        except ValueError as exc:
            raise Refused(str(exc)) from None
        key = (subj.ip, subj.gateway)
        if not view.objects:
            # A new subject: sets, chains, fixed rules and keys in one transaction.
            create, commit = self.nets.refilled(
                create, entry.uid, step.binding.private_cidr, step.binding.host_veth
            )
            await txn.send(create, "deny_first", KernelView(True, frozenset({key}), rules=True))
            commit()
            # Nothing this subject allows is established yet, yet the header accepts
            # established flows: after a kill -9 and restart (the Fastlet's replay lands
            # here) or an address reused from a sandbox that left while egressd was down,
            # flows a previous process allowed would run on unjudged. Cut them; picked up
            # again they meet this subject's rules (found with scripts/storm.py).
            return [subj.ip]
        # Revert, rebind or retry: empty every set before any (new) key points at the
        # chains, all in one transaction.
        batch = flush_subject_sets(cfg.table, nid, audit=view.audit)
        if not view.rules:
            batch = batch + subject_rules(cfg, nid, audit=view.audit)
        batch, commit = self.nets.refilled(
            batch + subject_keys(cfg, subj), entry.uid, step.binding.private_cidr, step.binding.host_veth
        )
        after = replace(view, rules=True, applied=None, keys=view.keys | {key}, contents=None)
        await txn.send(batch, "deny_first", after)
        commit()
        self._learning.forget(entry.uid)
        return ips(view.keys | {key})

    async def _apply_policy(
        self, entry: Entry, step: ApplyPolicy, view: KernelView, txn: _Transaction
    ) -> list[IPAddress]:
        if not (view.objects and view.rules):
            raise Refused("subject has no deny-first state in the kernel")
        nid, table = entry.nft_id, self._cfg.table
        effective = self._policies.effective(step.policy)
        event = {"egress.default": effective.default_action.value, "rules": len(effective.egress)}
        contents = static_contents(effective)
        batch, audit = self._policy_batch(nid, effective, contents, view)
        narrowed = self._learning.narrowed(entry.uid, effective)
        in_place = view.applied is not None
        if in_place and narrowed is not None and not narrowed.intact:
            # In place: leases no still-allowed name taught leave in the same transaction
            # (14.1). The kernel's dyn sets never hold more than the book (learn records
            # every outcome but a refusal), so when every lease of the book stays they stay.
            batch = batch + dyn_replace(table, nid, narrowed.kept)
        # A host-uid subject's audit mode lets its established flows pass (fleetnft/hostuid.py).
        batch = batch + hostuid.audit_membership(self._cfg, view.uid_keys, effective.audit)
        batch, commit = self.nets.refilled(batch, entry.uid, *_recognised_by(entry, self.nets))
        after = replace(view, applied=step.policy, audit=audit, contents=contents)
        try:
            await txn.send(batch, "static_apply", after)
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
        self, view: KernelView, effective: NetworkPolicy, contents: Contents, narrowed: Narrowed | None
    ) -> bool:
        """May an in-place change from ``view`` to ``effective`` leave an established flow
        running that the new policy refuses (docs/reference/behaviour.md §14.1)? It may when it revokes
        a lease, refuses an address the static sets accepted, or refuses a name the old policy
        admitted (a flow to one of its addresses may outlive the lease it started under, e.g.
        UDP, never renewed). Anything not known for certain counts as yes."""
        if narrowed is not None and narrowed.revoked:
            return True
        if view.applied is None or view.contents is None or refuses_more(view.contents, contents):
            return True
        return names_narrow(self._policies.effective(view.applied), effective)


    def _policy_batch(
        self, nid: str, effective: NetworkPolicy, contents: Contents, view: KernelView
    ) -> tuple[NetlinkBatch, bool]:
        """The static sets' swap to ``effective`` (with the audit objects first when it is the
        subject's first audit policy), and whether the subject has audit objects after it.
        Deny-first content (``applied`` None; every writer of static sets skips such a
        subject, see always.py) is empty, so its first policy is only filled in; after that
        only the sets whose content changes are rewritten, when the view knows what they hold."""
        table = self._cfg.table
        make = effective.audit and not view.audit
        batch = audit_objects(self._cfg, nid) if make else NetlinkBatch(table)
        audit = view.audit or make
        held = view.contents if view.applied is not None else None
        fill = contents_swap(
            table, nid, contents, audit_objects=audit, known_empty=view.applied is None, held=held
        )
        return batch + fill, audit

    async def _add_keys(
        self, entry: Entry, step: AddKeys, view: KernelView, txn: _Transaction
    ) -> list[IPAddress]:
        assert isinstance(step.binding, Binding)
        subj = _subject_nft(entry.nft_id, step.binding, self.workers.of(entry.uid))
        keys, commit = self.nets.refilled(
            subject_keys(self._cfg, subj), entry.uid, step.binding.private_cidr, step.binding.host_veth
        )
        await txn.send(keys, "dispatch_update", replace(view, keys=view.keys | {(subj.ip, subj.gateway)}))
        commit()
        # A new address's established flows were never judged by this subject (see above).
        return [] if subj.ip in ips(view.keys) else [subj.ip]

    async def _drop_stale_keys(
        self, entry: Entry, step: DropStaleKeys, view: KernelView, txn: _Transaction
    ) -> list[IPAddress]:
        keep = step.keep if isinstance(step.keep, Binding) else None
        kept: Keys = frozenset(
            {(keep.ip, keep.gateway)} if keep is not None and keep.gateway is not None else set()
        )
        kept_uid = hostuid.kept(step.keep)
        stale, stale_uid = view.keys - kept, view.uid_keys - kept_uid
        ops = self._key_deletes(entry.uid, stale, keep) + hostuid.key_deletes(self._cfg, stale_uid)
        batch = NetlinkBatch(self._cfg.table, tuple(ops))
        await txn.send(
            batch, "dispatch_update", replace(view, keys=view.keys & kept, uid_keys=view.uid_keys & kept_uid)
        )
        # The slot of the binding the subject ends with stays open (a re-key to another uid
        # drops every key first, then adds the new one on the same slot).
        ending = hostuid.slots(entry, kept_uid)
        await self.ports.close(entry.uid, {slot for _, slot in stale_uid} - ending)
        return [ip for ip in ips(stale) if ip not in ips(kept)]

    async def _remove_all(self, entry: Entry, view: KernelView, txn: _Transaction) -> list[IPAddress]:
        slots = hostuid.slots(entry, view.uid_keys)
        if not view.objects and not view.keys and not view.uid_keys:
            txn.save(KernelView())
            self.workers.release(entry.uid)
            await self.ports.close(entry.uid, slots)
            return []
        ops = self._key_deletes(entry.uid, view.keys, None) + hostuid.key_deletes(self._cfg, view.uid_keys)
        if view.objects:
            ops += removal_batch(self._cfg, entry.nft_id, None, release_gateway=None, audit=view.audit).ops
        removal, commit = self.nets.refilled(NetlinkBatch(self._cfg.table, tuple(ops)), entry.uid, None, None)
        await txn.send(removal, "remove", KernelView())
        commit()
        self.workers.release(entry.uid)
        await self.ports.close(entry.uid, slots)
        self._learning.forget(entry.uid)
        self._policies.forget(entry.uid)
        return ips(view.keys)

    def resync_batch(self, uid: str, nid: str, view: KernelView) -> NetlinkBatch:
        """Everything ``view`` says the subject has, made so in one batch that succeeds on
        either state an unanswered transaction left (see :class:`KernelView`): objects, fixed
        rules exactly once, the set contents of ``view.applied`` (deny-first when None) with
        the leases the book holds, and every key."""
        table = self._cfg.table
        if not view.objects:
            return NetlinkBatch(table)  # neither state has objects (nor keys, which jump to them)
        if view.applied is None:
            contents = flush_subject_sets(table, nid, audit=view.audit)
        else:
            effective = self._policies.effective(view.applied)
            narrowed = self._learning.narrowed(uid, effective)
            contents = policy_swap(table, nid, effective, audit_objects=view.audit) + dyn_replace(
                table, nid, narrowed.kept if narrowed is not None else ()
            )
        worker = self.workers.of(uid) if view.keys else 0
        keys = [SubjectNft(nid, ip, gw, worker) for ip, gw in sorted(view.keys, key=str)]
        audit = view.applied is not None and self._policies.effective(view.applied).audit
        uid_keys = hostuid.resync_keys(self._cfg, nid, view, audit)
        return subject_resync(self._cfg, nid, keys, contents, audit=view.audit) + uid_keys

    def _key_deletes(self, uid: str, stale: Keys, keep: Binding | None) -> list[Op]:
        """Deletions for stale dispatch keys: each map element and gateway exactly once."""
        ops: list[Op] = []
        keep_ip = keep.ip if keep is not None else None
        for ip in ips(stale):
            if ip != keep_ip:
                ops += dispatch_deletes(self._cfg, ip, release_gateway=None)
        for gw in sorted({k[1] for k in stale}, key=str):
            if keep is not None and keep.gateway == gw:
                continue
            if not self._shared.registry.gateway_in_use(gw, excluding=uid):
                ops.append(gateway_release(gw))
        return ops


def _recognised_by(entry: Entry, nets: SandboxNets) -> tuple[Network | None, str | None]:
    """The privateCidr and hostVeth the subject's binding names (none for a host-uid subject)."""
    if isinstance(entry.binding, HostBinding):
        return None, None
    if entry.binding is not None:
        return entry.binding.private_cidr, entry.binding.host_veth
    return nets.held.get(entry.uid), nets.ifaces.get(entry.uid)


def _subject_nft(nid: str, binding: Binding, worker: int) -> SubjectNft:
    if binding.gateway is None:
        raise Refused("attachment.network.gateway is required for the DNS redirect")
    return SubjectNft(nid, binding.ip, binding.gateway, worker)
